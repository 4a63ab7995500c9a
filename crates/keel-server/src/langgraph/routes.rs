//! The `/langgraph` routes: LangGraph Server's assistants, threads and runs over Keel's engine.
//!
//! Every handler goes through the calls the native routes use (`send_message`, `resume`, `cancel`,
//! the run's stored-then-live events); ids are Keel's (`conv_…` threads, `run_…` runs, `int_…`
//! interrupts), and a thread id a client chose is bound to its conversation per user.

use std::convert::Infallible;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::StreamExt;
use keel_core::engine::{EngineError, MultitaskStrategy, ResumeRequest, SendMessage};
use keel_core::store::StoreError;
use keel_core::stream::{Known, Until};
use keel_core::{Conversation, ConversationId, Event, EventKind, Interrupt, InterruptId, RunId, RunStatus};
use serde_json::{json, Map, Value};
use tokio::sync::mpsc;
use tokio::sync::mpsc::error::SendTimeoutError;
use tokio_stream::wrappers::ReceiverStream;

use super::{Lookup, Modes, StreamMapper, DELETED, THREADS, THREAD_METADATA};
use crate::ag_ui::Snapshot;
use crate::error::{ApiError, ApiResult};
use crate::extract::{ApiJson, Caller, OptionalJson, Params};
use crate::limits::StreamPermit;
use crate::sse;
use crate::state::AppState;

/// The route templates, for the request log (which names a template, never a path).
pub const TEMPLATES: &[&str] = &[
    "/langgraph/assistants/search",
    "/langgraph/assistants/{id}",
    "/langgraph/assistants/{id}/graph",
    "/langgraph/assistants/{id}/schemas",
    "/langgraph/threads",
    "/langgraph/threads/search",
    "/langgraph/threads/{id}",
    "/langgraph/threads/{id}/state",
    "/langgraph/threads/{id}/state/checkpoint",
    "/langgraph/threads/{id}/state/{id}",
    "/langgraph/threads/{id}/history",
    "/langgraph/threads/{id}/runs",
    "/langgraph/threads/{id}/runs/stream",
    "/langgraph/threads/{id}/runs/wait",
    "/langgraph/threads/{id}/runs/{id}",
    "/langgraph/threads/{id}/runs/{id}/cancel",
    "/langgraph/threads/{id}/runs/{id}/join",
    "/langgraph/threads/{id}/runs/{id}/stream",
];

/// The routes, relative to `/langgraph` (the caller nests them and adds authentication).
pub fn router() -> Router<AppState> {
    Router::new()
        .route("/assistants/search", post(search_assistants))
        .route("/assistants/{assistant}", get(get_assistant))
        .route("/assistants/{assistant}/graph", get(assistant_graph))
        .route("/assistants/{assistant}/schemas", get(assistant_schemas))
        .route("/threads", post(create_thread))
        .route("/threads/search", post(search_threads))
        .route("/threads/{thread}", get(get_thread).delete(delete_thread))
        .route("/threads/{thread}/state", get(thread_state))
        .route("/threads/{thread}/state/checkpoint", post(thread_state_checkpoint))
        .route("/threads/{thread}/state/{checkpoint}", get(thread_state_at))
        .route("/threads/{thread}/history", post(thread_history).get(thread_history_get))
        .route("/threads/{thread}/runs", post(create_run).get(list_runs))
        .route("/threads/{thread}/runs/stream", post(stream_run))
        .route("/threads/{thread}/runs/wait", post(wait_run))
        .route("/threads/{thread}/runs/{run}", get(get_run).delete(delete_run))
        .route("/threads/{thread}/runs/{run}/cancel", post(cancel_run))
        .route("/threads/{thread}/runs/{run}/join", get(join_run))
        .route("/threads/{thread}/runs/{run}/stream", get(join_stream))
}

fn refuse(message: impl Into<String>) -> ApiError {
    ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "UNSUPPORTED_OPTION", message)
}

fn check(body: &Map<String, Value>, supported: &[&str], default_only: &[&str]) -> ApiResult<()> {
    super::check_options(body, supported, default_only).map_err(refuse)
}

fn check_params(params: &Params, supported: &[&str]) -> ApiResult<()> {
    let mut unknown: Vec<&str> = params.0.keys().map(String::as_str).filter(|k| !supported.contains(k)).collect();
    unknown.sort_unstable();
    if unknown.is_empty() {
        Ok(())
    } else {
        Err(refuse(format!("unsupported query parameters: {}", unknown.join(", "))))
    }
}

/// The most runs of a thread `runs.list` looks at (the newest): its pages stay within them.
const RUNS_LISTED: u32 = 1000;

const ASSISTANT_SORT_KEYS: &[&str] = &["assistant_id", "graph_id", "name", "created_at", "updated_at"];

/// The fields a `select` names (a list of strings, or one string of names separated by commas);
/// `None` for all of them.
fn selected(select: Option<&Value>) -> ApiResult<Option<Vec<String>>> {
    match select {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(a)) if a.is_empty() => Ok(None),
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| v.as_str().map(str::to_owned).ok_or_else(|| ApiError::validation("select: must list field names")))
            .collect::<ApiResult<Vec<_>>>()
            .map(Some),
        Some(Value::String(s)) => {
            Ok(Some(s.split(',').map(|f| f.trim().to_owned()).filter(|f| !f.is_empty()).collect()))
        }
        Some(_) => Err(ApiError::validation("select: must list field names")),
    }
}

/// `object` with only the `select`ed fields (all of them without a `select`).
fn only_fields(object: Value, select: &Option<Vec<String>>) -> Value {
    match (object, select) {
        (Value::Object(mut map), Some(fields)) => {
            map.retain(|k, _| fields.iter().any(|f| f == k));
            Value::Object(map)
        }
        (object, _) => object,
    }
}

fn page(body: &Map<String, Value>) -> ApiResult<(usize, usize)> {
    let number = |key: &str, default: usize| match body.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => v
            .as_u64()
            .map(|n| n as usize)
            .ok_or_else(|| ApiError::validation(format!("{key}: must be a non-negative integer"))),
    };
    Ok((number("limit", 10)?.min(1000), number("offset", 0)?))
}

// ------------------------------------------------------------------ assistants

fn agent_or_404(state: &AppState, id: &str) -> ApiResult<std::sync::Arc<keel_core::agent::Agent>> {
    state.engine.agents().get(id).ok_or_else(ApiError::not_found)
}

/// When this process first served an assistant stands in for when it was made: agents are
/// configuration, not stored.
fn created(state: &AppState) -> String {
    static FIRST: std::sync::OnceLock<keel_core::Timestamp> = std::sync::OnceLock::new();
    super::time(FIRST.get_or_init(|| state.engine.now()))
}

async fn search_assistants(
    State(state): State<AppState>,
    OptionalJson(body): OptionalJson<Map<String, Value>>,
) -> ApiResult<Response> {
    check(&body, &["limit", "offset", "graph_id", "name", "sort_by", "sort_order", "select"], &["metadata"])?;
    let (limit, offset) = page(&body)?;
    let graph = body.get("graph_id").and_then(Value::as_str);
    let name = body.get("name").and_then(Value::as_str).map(str::to_lowercase);
    let created = created(&state);
    let sort_by = match body.get("sort_by") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if ASSISTANT_SORT_KEYS.contains(&s.as_str()) => Some(s.as_str()),
        Some(_) => {
            return Err(ApiError::validation(format!("sort_by: must be one of {}", ASSISTANT_SORT_KEYS.join(", "))))
        }
    };
    let descending = match body.get("sort_order") {
        None | Some(Value::Null) => false,
        Some(Value::String(s)) if s == "asc" => false,
        Some(Value::String(s)) if s == "desc" => true,
        Some(_) => return Err(ApiError::validation("sort_order: must be asc or desc")),
    };
    let select = selected(body.get("select"))?;
    let mut list: Vec<Value> = state
        .engine
        .agents()
        .all()
        .iter()
        .filter(|a| graph.is_none_or(|g| a.id == g))
        .filter(|a| name.as_deref().is_none_or(|n| a.name.to_lowercase().contains(n)))
        .map(|a| super::assistant(a, &created))
        .collect();
    if let Some(key) = sort_by {
        // Every value sorted on is a string; the sort is stable, so ties keep the configured order.
        list.sort_by(|a, b| a[key].as_str().cmp(&b[key].as_str()));
    }
    if descending {
        list.reverse();
    }
    let list: Vec<Value> = list.into_iter().skip(offset).take(limit).map(|a| only_fields(a, &select)).collect();
    Ok(Json(list).into_response())
}

async fn get_assistant(State(state): State<AppState>, Path(id): Path<String>) -> ApiResult<Response> {
    let agent = agent_or_404(&state, &id)?;
    Ok(Json(super::assistant(&agent, &created(&state))).into_response())
}

/// The agent loop's nodes and edges, as LangGraph draws a graph.
async fn assistant_graph(State(state): State<AppState>, Path(id): Path<String>) -> ApiResult<Response> {
    agent_or_404(&state, &id)?;
    use keel_core::engine::nodes::*;
    let mut nodes = vec![json!({"id": "__start__", "type": "schema", "data": "__start__"})];
    for n in [CONTEXT, MODEL, TOOLS, APPROVAL, FINALIZE] {
        nodes.push(json!({"id": n, "type": "runnable", "data": {"id": ["keel", n], "name": n}}));
    }
    nodes.push(json!({"id": "__end__", "type": "schema", "data": "__end__"}));
    let edge = |s: &str, t: &str, conditional: bool| json!({"source": s, "target": t, "conditional": conditional});
    let edges = vec![
        edge("__start__", CONTEXT, false),
        edge(CONTEXT, MODEL, false),
        edge(MODEL, TOOLS, true),
        edge(MODEL, FINALIZE, true),
        edge(TOOLS, APPROVAL, true),
        edge(APPROVAL, TOOLS, false),
        edge(TOOLS, CONTEXT, true),
        edge(FINALIZE, "__end__", false),
    ];
    Ok(Json(json!({"nodes": nodes, "edges": edges})).into_response())
}

async fn assistant_schemas(State(state): State<AppState>, Path(id): Path<String>) -> ApiResult<Response> {
    let agent = agent_or_404(&state, &id)?;
    let message = json!({"type": "object", "properties": {
        "type": {"type": "string"}, "role": {"type": "string"}, "content": {"type": "string"}}});
    let input = json!({"type": "object", "title": "Input", "required": ["messages"],
        "properties": {"messages": {"type": "array", "items": message}}});
    let state_schema = json!({"type": "object", "title": "State", "properties": {
        "messages": {"type": "array", "items": message},
        "facts": {"type": "object", "additionalProperties": {"type": "string"}}}});
    Ok(Json(json!({
        "graph_id": agent.id,
        "input_schema": input,
        "output_schema": state_schema,
        "state_schema": state_schema,
        "config_schema": null,
        "context_schema": null,
    }))
    .into_response())
}

// ------------------------------------------------------------------ threads

/// The conversation of a thread id: a Keel conversation id, or an id the client chose (bound to
/// one per user). A thread deleted through this API is gone.
async fn find_thread(state: &AppState, caller: &Caller, thread: &str) -> ApiResult<Option<Conversation>> {
    let engine = &state.engine;
    let store = engine.store();
    let id = if let Ok(id) = ConversationId::parse(thread) {
        id
    } else if let Some(bound) = store.binding(THREADS, &caller.0, thread).await? {
        ConversationId::parse(&bound).map_err(|e| ApiError::internal(&e))?
    } else {
        return Ok(None);
    };
    if store.binding(DELETED, &caller.0, id.as_str()).await?.is_some() {
        return Ok(None);
    }
    match engine.conversation(&caller.0, &id).await {
        Ok(c) => Ok(Some(c)),
        Err(EngineError::NotFound(_)) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

async fn thread_or_404(state: &AppState, caller: &Caller, thread: &str) -> ApiResult<Conversation> {
    find_thread(state, caller, thread).await?.ok_or_else(|| EngineError::NotFound("conversation").into())
}

/// How many of a thread's newest runs [`latest_run`] looks through for one that is [`in_thread`].
const LATEST_LOOKED_AT: u32 = 20;

/// Whether the `runs` endpoints show the run: a rolled-back run is gone from them (as LangGraph
/// deletes it), and so is one deleted here (`runs.delete`, hidden); Keel's own API keeps both.
fn shown(run: &keel_core::Run) -> bool {
    in_thread(run) && run.hidden_at.is_none()
}

/// Whether the run is part of the thread's state and history. A rolled-back run is not (its
/// messages are gone); a deleted one still is: as in LangGraph, deleting a run removes the run's
/// record, not the thread's checkpoints.
fn in_thread(run: &keel_core::Run) -> bool {
    run.status != RunStatus::RolledBack
}

/// The conversation's active run, else its newest one that is [`in_thread`].
async fn latest_run(state: &AppState, id: &ConversationId) -> ApiResult<Option<keel_core::Run>> {
    let store = state.engine.store();
    if let Some(run) = store.active_run(id).await? {
        return Ok(Some(run));
    }
    let newest = store.newest_conversation_runs(id, LATEST_LOOKED_AT).await?;
    Ok(newest.into_iter().find(in_thread))
}

async fn snapshot(state: &AppState, id: &ConversationId) -> ApiResult<Snapshot> {
    let store = state.engine.store();
    let messages = store.list_messages(id).await?;
    let calls = store.list_conversation_tool_calls(id).await?;
    let facts = store.list_facts(id).await?;
    Ok(Snapshot::build(&messages, &calls, &facts))
}

fn interrupt_value(state: &AppState, conversation: &Conversation, i: &Interrupt) -> Value {
    let agent = state.engine.agent_of(conversation);
    let schema_of = move |tool: &str| -> Option<Value> {
        agent.as_ref().and_then(|a| a.tools.get(tool)).map(|t| t.spec().parameters.clone())
    };
    super::interrupt(i, &schema_of)
}

async fn metadata(state: &AppState, caller: &Caller, conversation: &Conversation) -> ApiResult<Value> {
    let stored = state.engine.store().binding(THREAD_METADATA, &caller.0, conversation.id.as_str()).await?;
    let mut meta = stored.and_then(|s| serde_json::from_str::<Value>(&s).ok()).unwrap_or_else(|| json!({}));
    let agent = state.engine.agent_of(conversation).map(|a| a.id.clone());
    if let (Some(obj), Some(agent)) = (meta.as_object_mut(), agent) {
        obj.entry("graph_id").or_insert(json!(agent));
        obj.entry("assistant_id").or_insert(json!(agent));
    }
    Ok(meta)
}

async fn thread_object(state: &AppState, caller: &Caller, thread_id: &str, c: &Conversation) -> ApiResult<Value> {
    let latest = latest_run(state, &c.id).await?;
    let snapshot = snapshot(state, &c.id).await?;
    let mut interrupts = Map::new();
    if let Some(run) = latest.as_ref().filter(|r| r.status == RunStatus::Interrupted) {
        if let Some(i) = state.engine.store().pending_interrupt(&run.id).await? {
            interrupts.insert(i.id.to_string(), json!([interrupt_value(state, c, &i)]));
        }
    }
    Ok(json!({
        "thread_id": thread_id,
        "created_at": super::time(&c.created_at),
        "updated_at": super::time(&latest.as_ref().map_or(c.created_at, |r| r.updated_at)),
        "metadata": metadata(state, caller, c).await?,
        "status": super::thread_status(latest.as_ref()),
        "values": super::values(&snapshot),
        "interrupts": interrupts,
        "config": {},
    }))
}

/// `POST /threads`: `thread_id` (a client's id, bound to a new conversation), `metadata` (kept with
/// it; `graph_id` names the agent), `if_exists` (`raise`, the default, or `do_nothing`).
async fn create_thread(
    State(state): State<AppState>,
    caller: Caller,
    OptionalJson(body): OptionalJson<Map<String, Value>>,
) -> ApiResult<Response> {
    check(&body, &["thread_id", "metadata", "if_exists"], &["supersteps", "ttl", "graph_id"])?;
    let metadata = match body.get("metadata") {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(m)) => m.clone(),
        Some(_) => return Err(ApiError::validation("metadata: must be an object")),
    };
    let if_exists = body.get("if_exists").and_then(Value::as_str).unwrap_or("raise");
    if !["raise", "do_nothing"].contains(&if_exists) {
        return Err(ApiError::validation("if_exists: must be raise or do_nothing"));
    }
    let agent = metadata.get("graph_id").or_else(|| metadata.get("assistant_id")).and_then(Value::as_str);
    if let Some(agent) = agent {
        agent_or_404(&state, agent).map_err(|_| ApiError::validation("metadata.graph_id: no such assistant"))?;
    }
    let wanted = body.get("thread_id").and_then(Value::as_str).filter(|s| !s.is_empty());
    if let Some(wanted) = wanted {
        if let Some(existing) = find_thread(&state, &caller, wanted).await? {
            if if_exists == "do_nothing" {
                return Ok(Json(thread_object(&state, &caller, wanted, &existing).await?).into_response());
            }
            return Err(ApiError::new(StatusCode::CONFLICT, "THREAD_EXISTS", "thread_id: the thread exists"));
        }
        if ConversationId::parse(wanted).is_ok() {
            return Err(ApiError::validation("thread_id: conv_… ids are Keel's to give"));
        }
    }
    let conversation = create_conversation(&state, &caller, wanted, agent, &metadata).await?;
    let thread_id = wanted.map_or_else(|| conversation.id.to_string(), str::to_owned);
    Ok(Json(thread_object(&state, &caller, &thread_id, &conversation).await?).into_response())
}

async fn create_conversation(
    state: &AppState,
    caller: &Caller,
    thread_id: Option<&str>,
    agent: Option<&str>,
    metadata: &Map<String, Value>,
) -> ApiResult<Conversation> {
    let engine = &state.engine;
    let store = engine.store();
    let created = engine.create_conversation(&caller.0, "", agent).await?;
    let id = match thread_id {
        // Two creates of one thread id race: the first binding wins; the other conversation stays
        // empty.
        Some(t) => store.bind(THREADS, &caller.0, t, created.id.as_str(), engine.now()).await?,
        None => created.id.to_string(),
    };
    let id = ConversationId::parse(&id).map_err(|e| ApiError::internal(&e))?;
    if !metadata.is_empty() {
        let text = Value::Object(metadata.clone()).to_string();
        store.bind(THREAD_METADATA, &caller.0, id.as_str(), &text, engine.now()).await?;
    }
    Ok(engine.conversation(&caller.0, &id).await?)
}

async fn get_thread(State(state): State<AppState>, caller: Caller, Path(thread): Path<String>) -> ApiResult<Response> {
    let c = thread_or_404(&state, &caller, &thread).await?;
    Ok(Json(thread_object(&state, &caller, &thread, &c).await?).into_response())
}

/// A thread deleted here is gone from this API (its runs not over — the active one, the ones waiting
/// their turn — are cancelled); Keel keeps the conversation and its history.
async fn delete_thread(
    State(state): State<AppState>,
    caller: Caller,
    Path(thread): Path<String>,
) -> ApiResult<Response> {
    let c = thread_or_404(&state, &caller, &thread).await?;
    // the waiting ones first, so that none starts when the active one ends
    for run in state.engine.store().waiting_runs(&c.id, RUNS_LISTED).await? {
        state.engine.cancel(&caller.0, &run.id).await?;
    }
    if let Some(run) = state.engine.store().active_run(&c.id).await? {
        state.engine.cancel(&caller.0, &run.id).await?;
    }
    state.engine.store().bind(DELETED, &caller.0, c.id.as_str(), "deleted", state.engine.now()).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn search_threads(
    State(state): State<AppState>,
    caller: Caller,
    OptionalJson(body): OptionalJson<Map<String, Value>>,
) -> ApiResult<Response> {
    check(
        &body,
        &["limit", "offset", "metadata", "status", "ids"],
        &["values", "sort_by", "sort_order", "select", "extract"],
    )?;
    let (limit, offset) = page(&body)?;
    let want_meta = body.get("metadata").and_then(Value::as_object).cloned().unwrap_or_default();
    let want_status = body.get("status").and_then(Value::as_str);
    let ids: Option<Vec<String>> = body
        .get("ids")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).map(str::to_owned).collect());
    let mut out = Vec::new();
    let mut skipped = 0;
    for c in state.engine.list_conversations(&caller.0).await? {
        if out.len() >= limit {
            break;
        }
        if state.engine.store().binding(DELETED, &caller.0, c.id.as_str()).await?.is_some() {
            continue;
        }
        if ids.as_ref().is_some_and(|ids| !ids.iter().any(|i| i == c.id.as_str())) {
            continue;
        }
        let thread = thread_object(&state, &caller, c.id.as_str(), &c).await?;
        if want_status.is_some_and(|s| thread["status"] != s) {
            continue;
        }
        if want_meta.iter().any(|(k, v)| thread["metadata"].get(k) != Some(v)) {
            continue;
        }
        if skipped < offset {
            skipped += 1;
            continue;
        }
        out.push(thread);
    }
    Ok(Json(out).into_response())
}

/// A state's checkpoint id: the run whose end (or, for one not over, whose latest event) it is
/// the state after, and that event's sequence — stable once the run is over.
fn checkpoint_id(run: &keel_core::Run) -> String {
    format!("{}:{}", run.id, run.last_sequence())
}

fn checkpoint(thread_id: &str, run: Option<&keel_core::Run>) -> Value {
    json!({
        "thread_id": thread_id,
        "checkpoint_ns": "",
        "checkpoint_id": run.map(checkpoint_id),
        "checkpoint_map": null,
    })
}

/// What a run not over waits on: `next` (the node), `tasks` (with the interrupt), `interrupts`.
async fn pending(state: &AppState, c: &Conversation, run: &keel_core::Run) -> ApiResult<(Value, Value, Value)> {
    let mut interrupts = Vec::new();
    let mut tasks = Vec::new();
    let mut next = Vec::new();
    match run.status {
        RunStatus::Interrupted => {
            if let Some(i) = state.engine.store().pending_interrupt(&run.id).await? {
                let value = interrupt_value(state, c, &i);
                next.push(keel_core::engine::nodes::APPROVAL);
                tasks.push(json!({
                    "id": i.id, "name": keel_core::engine::nodes::APPROVAL, "path": [], "error": null,
                    "interrupts": [value], "checkpoint": null, "state": null, "result": null,
                }));
                interrupts.push(value);
            }
        }
        RunStatus::Queued | RunStatus::Running | RunStatus::Waiting => next.push(keel_core::engine::nodes::MODEL),
        _ => {}
    }
    Ok((json!(next), json!(tasks), json!(interrupts)))
}

/// The thread's state: `values`, `next` (the node a paused run waits in), `tasks` (with the
/// interrupt), `interrupts` with their ids, a checkpoint naming the newest run and its last event.
async fn state_object(state: &AppState, caller: &Caller, thread_id: &str, c: &Conversation) -> ApiResult<Value> {
    let latest = latest_run(state, &c.id).await?;
    let snapshot = snapshot(state, &c.id).await?;
    let (next, tasks, interrupts) = match &latest {
        Some(run) => pending(state, c, run).await?,
        None => (json!([]), json!([]), json!([])),
    };
    Ok(json!({
        "values": super::values(&snapshot),
        "next": next,
        "tasks": tasks,
        "checkpoint": checkpoint(thread_id, latest.as_ref()),
        "metadata": metadata(state, caller, c).await?,
        "created_at": latest.as_ref().map(|r| super::time(&r.updated_at)),
        "parent_checkpoint": null,
        "interrupts": interrupts,
    }))
}

async fn thread_state(
    State(state): State<AppState>,
    caller: Caller,
    Path(thread): Path<String>,
    params: Params,
) -> ApiResult<Response> {
    check_params(&params, &["subgraphs"])?;
    let c = thread_or_404(&state, &caller, &thread).await?;
    Ok(Json(state_object(&state, &caller, &thread, &c).await?).into_response())
}

/// The most states one history answers (`limit`; 10 unless asked).
const HISTORY_LIMIT: usize = 100;
/// The most messages a state of the history shows: the newest at that point (one bounded read
/// per state, whatever the thread's length).
const HISTORY_MESSAGES: u32 = 200;

/// What a history asks for: how many states, from which (`before`: the ones older than that
/// checkpoint; `checkpoint`: that one only), whose metadata has these values.
#[derive(Default)]
struct HistoryQuery {
    limit: usize,
    before: Option<RunId>,
    checkpoint: Option<RunId>,
    metadata: Map<String, Value>,
}

/// The run a checkpoint names: a checkpoint object (`{thread_id, checkpoint_ns: "", checkpoint_id}`)
/// or, where the SDK allows it, its id alone. `None` for none (`null`, or no `checkpoint_id`).
fn checkpoint_run(field: &str, value: Option<&Value>, id_alone: bool) -> ApiResult<Option<RunId>> {
    let id = match value {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::String(id)) if id_alone => id.as_str(),
        Some(Value::Object(o)) => {
            match o.get("checkpoint_ns") {
                None | Some(Value::Null) => {}
                Some(Value::String(ns)) if ns.is_empty() => {}
                Some(_) => {
                    return Err(ApiError::validation(format!(
                        "{field}.checkpoint_ns: must be \"\" (Keel's threads have no subgraphs)"
                    )))
                }
            }
            match o.get("checkpoint_id") {
                None | Some(Value::Null) => return Ok(None),
                Some(Value::String(id)) => id.as_str(),
                Some(_) => return Err(ApiError::validation(format!("{field}.checkpoint_id: must be a string"))),
            }
        }
        Some(_) => {
            return Err(ApiError::validation(format!(
                "{field}: must be a checkpoint ({{thread_id, checkpoint_ns, checkpoint_id}}){}",
                if id_alone { " or a checkpoint id" } else { "" }
            )))
        }
    };
    let run = id.split_once(':').map_or(id, |(run, _)| run);
    RunId::parse(run)
        .map(Some)
        .map_err(|_| ApiError::validation(format!("{field}: not a checkpoint id of Keel's (`<run id>:<sequence>`)")))
}

fn history_limit(value: Option<&Value>) -> ApiResult<usize> {
    match value {
        None | Some(Value::Null) => Ok(10),
        Some(v) => v
            .as_u64()
            .filter(|n| (1..=HISTORY_LIMIT as u64).contains(n))
            .map(|n| n as usize)
            .ok_or_else(|| ApiError::validation(format!("limit: must be an integer from 1 to {HISTORY_LIMIT}"))),
    }
}

/// The thread's states, newest first: one per run boundary — the state after each run, the first
/// the current one (after the newest run, or where it is now if it is not over). A state's
/// `values` are the conversation's messages up to that run's last one (the newest
/// [`HISTORY_MESSAGES`]) and the facts as they are now (Keel keeps no history of facts). Runs
/// rolled back, waiting their turn or that never ran have no state; a run deleted with
/// `runs.delete` keeps its state (its record is gone, the thread's checkpoints stay).
async fn history(
    state: &AppState,
    caller: &Caller,
    thread_id: &str,
    c: &Conversation,
    query: &HistoryQuery,
) -> ApiResult<Vec<Value>> {
    let store = state.engine.store();
    let runs: Vec<keel_core::Run> = store
        .newest_conversation_runs(&c.id, RUNS_LISTED)
        .await?
        .into_iter()
        .filter(|r| in_thread(r) && r.status != RunStatus::Waiting)
        .collect();
    let from = match (&query.checkpoint, &query.before) {
        (Some(id), _) | (None, Some(id)) => match runs.iter().position(|r| &r.id == id) {
            Some(i) if query.checkpoint.is_some() => i,
            Some(i) => i + 1,
            None => return Ok(Vec::new()),
        },
        (None, None) => 0,
    };
    let limit = if query.checkpoint.is_some() { 1 } else { query.limit };
    let thread_meta = metadata(state, caller, c).await?;
    let facts = store.list_facts(&c.id).await?;
    let mut states: Vec<Value> = Vec::new();
    // The state waiting for its parent: the next older run that has a state.
    let mut child: Option<usize> = None;
    for run in &runs[from..] {
        if states.len() >= limit && child.is_none() {
            break;
        }
        let mut meta = thread_meta.clone();
        if let Some(m) = meta.as_object_mut() {
            m.insert("run_id".into(), json!(run.id));
            m.insert("step".into(), json!(run.last_sequence()));
            m.insert("source".into(), json!("loop"));
        }
        let wanted = query.metadata.iter().all(|(k, v)| meta.get(k) == Some(v));
        if !wanted && child.is_none() {
            continue;
        }
        let window = store.messages_through_run(&c.id, &run.id, HISTORY_MESSAGES).await?;
        if window.messages.is_empty() {
            continue; // a run that never ran (cancelled while it waited its turn)
        }
        if let Some(i) = child.take() {
            states[i]["parent_checkpoint"] = checkpoint(thread_id, Some(run));
        }
        if !wanted || states.len() >= limit {
            continue;
        }
        let mut messages = window.messages;
        messages.reverse();
        let mut calls = window.tool_calls;
        if !run.status.is_terminal() {
            // the calls it is running or asking about, not answered yet
            for call in store.list_tool_calls(&run.id).await? {
                if call.result.is_none() && !calls.iter().any(|k| k.id == call.id) {
                    calls.push(call);
                }
            }
        }
        let snapshot = Snapshot::build(&messages, &calls, &facts);
        let (next, tasks, interrupts) = pending(state, c, run).await?;
        states.push(json!({
            "values": super::values(&snapshot),
            "next": next,
            "tasks": tasks,
            "checkpoint": checkpoint(thread_id, Some(run)),
            "metadata": meta,
            "created_at": super::time(&run.updated_at),
            "parent_checkpoint": null,
            "interrupts": interrupts,
        }));
        child = Some(states.len() - 1);
    }
    Ok(states)
}

/// `POST /threads/{id}/history`: `limit`, `before`, `checkpoint`, `metadata` (see [`history`]).
async fn thread_history(
    State(state): State<AppState>,
    caller: Caller,
    Path(thread): Path<String>,
    OptionalJson(body): OptionalJson<Map<String, Value>>,
) -> ApiResult<Response> {
    check(&body, &["limit", "before", "checkpoint", "metadata"], &["select"])?;
    let metadata = match body.get("metadata") {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(m)) => m.clone(),
        Some(_) => return Err(ApiError::validation("metadata: must be an object")),
    };
    let query = HistoryQuery {
        limit: history_limit(body.get("limit"))?,
        before: checkpoint_run("before", body.get("before"), true)?,
        checkpoint: checkpoint_run("checkpoint", body.get("checkpoint"), false)?,
        metadata,
    };
    let c = thread_or_404(&state, &caller, &thread).await?;
    Ok(Json(history(&state, &caller, &thread, &c, &query).await?).into_response())
}

/// `GET /threads/{id}/history`: `limit`, `before` (a checkpoint id).
async fn thread_history_get(
    State(state): State<AppState>,
    caller: Caller,
    Path(thread): Path<String>,
    params: Params,
) -> ApiResult<Response> {
    check_params(&params, &["limit", "before"])?;
    let limit = match params.0.get("limit") {
        None => None,
        Some(l) => Some(
            l.parse::<u64>()
                .map(Value::from)
                .map_err(|_| ApiError::validation(format!("limit: must be an integer from 1 to {HISTORY_LIMIT}")))?,
        ),
    };
    let query = HistoryQuery {
        limit: history_limit(limit.as_ref())?,
        before: checkpoint_run("before", params.0.get("before").map(|b| json!(b)).as_ref(), true)?,
        ..HistoryQuery::default()
    };
    let c = thread_or_404(&state, &caller, &thread).await?;
    Ok(Json(history(&state, &caller, &thread, &c, &query).await?).into_response())
}

/// One state of the history (`threads.get_state` with a checkpoint): 404 when the thread has none
/// by that id.
async fn state_at(state: &AppState, caller: &Caller, thread: &str, run: Option<RunId>) -> ApiResult<Response> {
    let c = thread_or_404(state, caller, thread).await?;
    let Some(run) = run else {
        return Ok(Json(state_object(state, caller, thread, &c).await?).into_response());
    };
    let query = HistoryQuery { limit: 1, checkpoint: Some(run), ..HistoryQuery::default() };
    let found = history(state, caller, thread, &c, &query).await?.into_iter().next();
    found.map(|s| Json(s).into_response()).ok_or_else(|| EngineError::NotFound("checkpoint").into())
}

/// `GET /threads/{id}/state/{checkpoint_id}` (`threads.get_state(checkpoint_id=…)`).
async fn thread_state_at(
    State(state): State<AppState>,
    caller: Caller,
    Path((thread, checkpoint)): Path<(String, String)>,
    params: Params,
) -> ApiResult<Response> {
    check_params(&params, &["subgraphs"])?;
    let run = checkpoint_run("checkpoint_id", Some(&json!(checkpoint)), true)?;
    state_at(&state, &caller, &thread, run).await
}

/// `POST /threads/{id}/state/checkpoint` (`threads.get_state(checkpoint=…)`).
async fn thread_state_checkpoint(
    State(state): State<AppState>,
    caller: Caller,
    Path(thread): Path<String>,
    OptionalJson(body): OptionalJson<Map<String, Value>>,
) -> ApiResult<Response> {
    check(&body, &["checkpoint", "subgraphs"], &["select"])?;
    let run = checkpoint_run("checkpoint", body.get("checkpoint"), false)?;
    state_at(&state, &caller, &thread, run).await
}

// ------------------------------------------------------------------ runs

/// The options a run request may carry: the ones Keel reads, and the ones it accepts only at their
/// default (anything else is a 422 that names them).
const RUN_OPTIONS: &[&str] = &[
    "assistant_id",
    "input",
    "command",
    "stream_mode",
    "stream_resumable",
    "multitask_strategy",
    "if_not_exists",
    "on_disconnect",
    // Keel commits every step before it is shown: every durability is Keel's `sync`.
    "durability",
    "checkpoint_during",
];
const RUN_DEFAULT_ONLY: &[&str] = &[
    "stream_subgraphs",
    "metadata",
    "config",
    "context",
    "interrupt_before",
    "interrupt_after",
    "webhook",
    "checkpoint",
    "checkpoint_id",
    "feedback_keys",
    "after_seconds",
    "on_completion",
    "langsmith_tracer",
    "strict_resume",
];

/// A run request, read.
struct RunRequest {
    assistant: String,
    modes: Modes,
    strategy: String,
    multitask: MultitaskStrategy,
    cancel_on_disconnect: bool,
}

/// What a run request started or continued.
struct Started {
    conversation: Conversation,
    run_id: RunId,
    /// The stream of this request starts after this sequence.
    after: i64,
}

fn read_run_request(body: &Map<String, Value>) -> ApiResult<RunRequest> {
    check(body, RUN_OPTIONS, RUN_DEFAULT_ONLY)?;
    let assistant = body
        .get("assistant_id")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::validation("assistant_id: required (an agent's id)"))?
        .to_owned();
    let modes = Modes::parse(body.get("stream_mode")).map_err(refuse)?;
    let multitask = match body.get("multitask_strategy") {
        None | Some(Value::Null) => MultitaskStrategy::Reject,
        Some(v) => v.as_str().and_then(MultitaskStrategy::parse).ok_or_else(|| {
            ApiError::validation(format!("multitask_strategy: must be one of {}", MultitaskStrategy::NAMES.join(", ")))
        })?,
    };
    let strategy = multitask.as_str().to_owned();
    let cancel_on_disconnect = match body.get("on_disconnect").and_then(Value::as_str) {
        None | Some("continue") => false,
        Some("cancel") => true,
        Some(_) => return Err(ApiError::validation("on_disconnect: must be cancel or continue")),
    };
    if let Some(d) = body.get("durability").and_then(Value::as_str) {
        if !["sync", "async", "exit"].contains(&d) {
            return Err(ApiError::validation("durability: must be sync, async or exit"));
        }
    }
    Ok(RunRequest { assistant, modes, strategy, multitask, cancel_on_disconnect })
}

/// The text of the newest human message of `input.messages`.
fn input_text(input: &Value) -> ApiResult<String> {
    let Some(obj) = input.as_object() else { return Err(ApiError::validation("input: must be an object")) };
    if let Some(unknown) = obj.keys().find(|k| k.as_str() != "messages") {
        return Err(refuse(format!("input.{unknown}: not supported (Keel's state is its messages and facts)")));
    }
    let messages = obj
        .get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| ApiError::validation("input.messages: required (a list)"))?;
    let human = messages.iter().rev().find(|m| {
        let role = m.get("role").or_else(|| m.get("type")).and_then(Value::as_str);
        matches!(role, Some("user" | "human"))
    });
    let Some(human) = human else { return Err(ApiError::validation("input.messages: no human message")) };
    match human.get("content") {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for p in parts {
                match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => text.push_str(t),
                    _ => return Err(refuse("input.messages: only text content parts are supported")),
                }
            }
            Ok(text)
        }
        _ => Err(ApiError::validation("input.messages: a message's content must be a string or text parts")),
    }
}

/// Starts a run for `input`, or resumes the thread's interrupt for `command`.
async fn start(
    state: &AppState,
    caller: &Caller,
    thread: &str,
    body: &Map<String, Value>,
    req: &RunRequest,
    headers: &HeaderMap,
) -> ApiResult<Started> {
    let engine = &state.engine;
    if engine.agents().get(&req.assistant).is_none() {
        return Err(ApiError::new(StatusCode::NOT_FOUND, "ASSISTANT_NOT_FOUND", "assistant_id: no such assistant"));
    }
    let conversation = match find_thread(state, caller, thread).await? {
        Some(c) => c,
        None => match body.get("if_not_exists").and_then(Value::as_str) {
            Some("create") if ConversationId::parse(thread).is_err() => {
                create_conversation(state, caller, Some(thread), Some(&req.assistant), &Map::new()).await?
            }
            None | Some("reject") | Some("create") => return Err(EngineError::NotFound("conversation").into()),
            Some(_) => return Err(ApiError::validation("if_not_exists: must be create or reject")),
        },
    };
    if engine.agent_of(&conversation).map(|a| a.id.clone()).as_deref() != Some(req.assistant.as_str()) {
        return Err(ApiError::validation("assistant_id: the thread's conversation talks to another assistant"));
    }
    let input = body.get("input").filter(|v| !v.is_null());
    let command = body.get("command").filter(|v| !v.is_null());
    match (input, command) {
        (Some(_), Some(_)) => Err(ApiError::validation("input and command: send one")),
        (None, None) => Err(ApiError::validation("input or command: one is required")),
        (None, Some(command)) => resume(state, caller, conversation, command, headers).await,
        (Some(input), None) => {
            let content = input_text(input)?;
            let message = SendMessage { content, cancel_on_disconnect: req.cancel_on_disconnect };
            let started = engine.send_message_with(&caller.0, &conversation.id, message, req.multitask).await?;
            Ok(Started { conversation, run_id: started.run.id, after: 0 })
        }
    }
}

/// Cancels the run (at its next checkpoint; what it did so far stays) and waits until it has ended.
async fn cancel_and_wait(state: &AppState, caller: &Caller, run_id: &RunId) -> ApiResult<()> {
    let engine = &state.engine;
    engine.cancel(&caller.0, run_id).await?;
    let run = engine.run(&caller.0, run_id).await?;
    if !run.status.is_terminal() {
        let events = engine.events(run_id, run.last_sequence(), Until::Terminal, Known::Active);
        tokio::pin!(events);
        let ended = tokio::time::timeout(Duration::from_secs(60), async {
            while let Some(e) = events.next().await {
                e?;
            }
            Ok::<_, keel_core::store::StoreError>(())
        });
        match ended.await {
            Ok(r) => r?,
            Err(_) => {
                return Err(ApiError::new(
                    StatusCode::CONFLICT,
                    "RUN_ACTIVE",
                    "the active run did not stop within 60 s",
                ))
            }
        }
    }
    Ok(())
}

/// `command: {resume}` onto Keel's resume: the value for the thread's pending interrupt, or a map
/// keyed by interrupt id. The idempotency key is the request's `Idempotency-Key`, or one made from
/// the run and the interrupt, so the same resume sent again continues nothing twice.
async fn resume(
    state: &AppState,
    caller: &Caller,
    conversation: Conversation,
    command: &Value,
    headers: &HeaderMap,
) -> ApiResult<Started> {
    let engine = &state.engine;
    let store = engine.store();
    let Some(command) = command.as_object() else { return Err(ApiError::validation("command: must be an object")) };
    if let Some(other) = command.keys().find(|k| k.as_str() != "resume") {
        return Err(refuse(format!("command.{other}: not supported (only resume)")));
    }
    let value = command
        .get("resume")
        .filter(|v| !v.is_null())
        .ok_or_else(|| ApiError::validation("command.resume: required"))?;
    let keyed = value.as_object().filter(|o| !o.is_empty() && o.keys().all(|k| InterruptId::parse(k).is_ok()));
    let (interrupt, value) = if let Some(map) = keyed {
        if map.len() > 1 {
            return Err(ApiError::validation("command.resume: one interrupt at a time (Keel's runs wait on one)"));
        }
        let (id, value) = map.iter().next().expect("one entry");
        let id = InterruptId::parse(id).map_err(|_| ApiError::validation("command.resume: an interrupt id"))?;
        let i = store.get_interrupt(&id).await?.ok_or(EngineError::NotFound("interrupt"))?;
        (i, value)
    } else {
        let run = latest_run(state, &conversation.id).await?.ok_or(EngineError::RunNotInterrupted)?;
        let i = store.list_interrupts(&run.id).await?.pop().ok_or(EngineError::RunNotInterrupted)?;
        (i, value)
    };
    let run = engine.run(&caller.0, &interrupt.run_id).await?;
    if run.conversation_id != conversation.id {
        return Err(EngineError::NotFound("interrupt").into());
    }
    let (decision, note) = super::decision(value, &interrupt).map_err(ApiError::validation)?;
    let idempotency_key = match headers.get("idempotency-key") {
        Some(v) => v.to_str().map_err(|_| ApiError::validation("Idempotency-Key: must be visible ASCII"))?.to_owned(),
        None => format!("langgraph:{}:{}", run.id, interrupt.id),
    };
    let request = ResumeRequest { interrupt_id: interrupt.id.clone(), decision, idempotency_key, note };
    let accepted = engine.resume(&caller.0, &run.id, request).await?;
    Ok(Started { conversation, run_id: run.id, after: (accepted.resumed_sequence - 1).max(0) })
}

fn with_location(mut response: Response, thread: &str, run: &RunId) -> Response {
    if let Ok(v) = HeaderValue::from_str(&format!("/threads/{thread}/runs/{run}")) {
        response.headers_mut().insert("content-location", v);
    }
    response
}

/// `POST /threads/{id}/runs`: a background run; answers with the run.
async fn create_run(
    State(state): State<AppState>,
    caller: Caller,
    Path(thread): Path<String>,
    headers: HeaderMap,
    ApiJson(body): ApiJson<Map<String, Value>>,
) -> ApiResult<Response> {
    let req = read_run_request(&body)?;
    let started = start(&state, &caller, &thread, &body, &req, &headers).await?;
    let run = state.engine.run(&caller.0, &started.run_id).await?;
    let mut out = super::run_object(&run, &thread, state.engine.agents().default_id());
    out["multitask_strategy"] = json!(req.strategy);
    Ok(with_location(Json(out).into_response(), &thread, &run.id))
}

/// `POST /threads/{id}/runs/stream`: the run's parts until it pauses or ends.
async fn stream_run(
    State(state): State<AppState>,
    caller: Caller,
    Path(thread): Path<String>,
    headers: HeaderMap,
    ApiJson(body): ApiJson<Map<String, Value>>,
) -> ApiResult<Response> {
    let req = read_run_request(&body)?;
    // The stream's slot is taken first, so a refused stream starts nothing.
    let permit = state.limits.streams.acquire(&caller.0)?;
    let started = start(&state, &caller, &thread, &body, &req, &headers).await?;
    let response =
        stream(&state, permit, &thread, &req.assistant, started.run_id.clone(), (started.after, 0), req.modes);
    Ok(with_location(response, &thread, &started.run_id))
}

/// `POST /threads/{id}/runs/wait`: the thread's values once the run pauses or ends.
async fn wait_run(
    State(state): State<AppState>,
    caller: Caller,
    Path(thread): Path<String>,
    headers: HeaderMap,
    ApiJson(body): ApiJson<Map<String, Value>>,
) -> ApiResult<Response> {
    let req = read_run_request(&body)?;
    let started = start(&state, &caller, &thread, &body, &req, &headers).await?;
    let values = settle(&state, &caller, &started.conversation, &started.run_id, started.after).await?;
    Ok(with_location(Json(values).into_response(), &thread, &started.run_id))
}

/// Waits until the run pauses or ends after `after`, then gives the thread's values (with
/// `__interrupt__` when it waits for a human, `__error__` when it failed).
async fn settle(state: &AppState, caller: &Caller, c: &Conversation, run_id: &RunId, after: i64) -> ApiResult<Value> {
    let engine = &state.engine;
    tokio::select! {
        settled = engine.wait_settled(run_id, after) => { settled?; }
        () = state.shutdown.wait() => return Err(EngineError::ShuttingDown.into()),
    }
    final_values(state, caller, c, run_id).await
}

async fn final_values(state: &AppState, caller: &Caller, c: &Conversation, run_id: &RunId) -> ApiResult<Value> {
    let run = state.engine.run(&caller.0, run_id).await?;
    let mut values = super::values(&snapshot(state, &c.id).await?);
    match run.status {
        RunStatus::Interrupted => {
            if let Some(i) = state.engine.store().pending_interrupt(run_id).await? {
                values["__interrupt__"] = json!([interrupt_value(state, c, &i)]);
            }
        }
        RunStatus::Failed => {
            values["__error__"] =
                json!({"error": run.reason.clone().unwrap_or_else(|| "error".into()), "message": "the run failed"});
        }
        _ => {}
    }
    Ok(values)
}

async fn run_in_thread(
    state: &AppState,
    caller: &Caller,
    thread: &str,
    run: &str,
) -> ApiResult<(Conversation, keel_core::Run)> {
    let c = thread_or_404(state, caller, thread).await?;
    let run_id = RunId::parse(run).map_err(|_| EngineError::NotFound("run"))?;
    let run = state.engine.run(&caller.0, &run_id).await?;
    // a rolled-back or deleted run is gone from the thread (Keel's audit keeps it)
    if run.conversation_id != c.id || !shown(&run) {
        return Err(EngineError::NotFound("run").into());
    }
    Ok((c, run))
}

async fn list_runs(
    State(state): State<AppState>,
    caller: Caller,
    Path(thread): Path<String>,
    params: Params,
) -> ApiResult<Response> {
    check_params(&params, &["limit", "offset", "status", "select"])?;
    let c = thread_or_404(&state, &caller, &thread).await?;
    let limit = params.0.get("limit").and_then(|l| l.parse::<usize>().ok()).unwrap_or(10);
    let offset = params.0.get("offset").and_then(|l| l.parse::<usize>().ok()).unwrap_or(0);
    let status = params.0.get("status").cloned();
    let select = selected(params.0.get("select").map(|s| Value::String(s.clone())).as_ref())?;
    let default = state.engine.agents().default_id().to_owned();
    let runs: Vec<Value> = state
        .engine
        .store()
        .newest_conversation_runs(&c.id, RUNS_LISTED)
        .await?
        .into_iter()
        .filter(shown)
        .map(|r| super::run_object(&r, &thread, &default))
        .filter(|r| status.as_deref().is_none_or(|s| r["status"] == s))
        .skip(offset)
        .take(limit)
        .map(|r| only_fields(r, &select))
        .collect();
    Ok(Json(runs).into_response())
}

async fn get_run(
    State(state): State<AppState>,
    caller: Caller,
    Path((thread, run)): Path<(String, String)>,
) -> ApiResult<Response> {
    let (_, run) = run_in_thread(&state, &caller, &thread, &run).await?;
    Ok(Json(super::run_object(&run, &thread, state.engine.agents().default_id())).into_response())
}

/// `runs.delete`: a run that is over is gone from this API (404 from then on, left out of the
/// thread's runs), as LangGraph deletes its record. Keel keeps it — the run, its events, tool calls
/// and interrupts, its messages in the thread — only hidden (`GET /v1/runs/{id}` shows it). A run
/// not over is 409 `RUN_ACTIVE`: cancel it first.
async fn delete_run(
    State(state): State<AppState>,
    caller: Caller,
    Path((thread, run)): Path<(String, String)>,
) -> ApiResult<Response> {
    let (_, run) = run_in_thread(&state, &caller, &thread, &run).await?;
    let active = || {
        ApiError::new(
            StatusCode::CONFLICT,
            "RUN_ACTIVE",
            "the run is not over: cancel it (runs.cancel), then delete it",
        )
    };
    if !run.status.is_terminal() {
        return Err(active());
    }
    match state.engine.store().hide_run(&run.id, state.engine.now()).await {
        Ok(true) => Ok(StatusCode::NO_CONTENT.into_response()),
        // another request deleted it first
        Ok(false) => Err(EngineError::NotFound("run").into()),
        Err(StoreError::Conflict(_)) => Err(active()),
        Err(e) => Err(e.into()),
    }
}

/// `?action=interrupt` (the default; what the run did stays) and `?wait=true` (answer once it
/// ended). `?action=rollback`: the run is cancelled, and once it has ended (whatever `wait` says:
/// its messages and events can only go once nothing writes them) rolled back — its messages and
/// events removed, its tool calls and interrupts kept in Keel's audit — and gone from this API:
/// 204, and 404 for it from then on.
async fn cancel_run(
    State(state): State<AppState>,
    caller: Caller,
    Path((thread, run)): Path<(String, String)>,
    params: Params,
) -> ApiResult<Response> {
    check_params(&params, &["wait", "action"])?;
    let rollback = match params.0.get("action").map(String::as_str) {
        None | Some("interrupt") => false,
        Some("rollback") => true,
        Some(_) => return Err(ApiError::validation("action: must be interrupt or rollback")),
    };
    let wait = params.flag("wait")?;
    let (_, run) = run_in_thread(&state, &caller, &thread, &run).await?;
    if rollback {
        state.engine.roll_back(&caller.0, &run.id).await?;
        return Ok(StatusCode::NO_CONTENT.into_response());
    }
    if wait {
        cancel_and_wait(&state, &caller, &run.id).await?;
    } else {
        state.engine.cancel(&caller.0, &run.id).await?;
    }
    let run = state.engine.run(&caller.0, &run.id).await?;
    Ok(Json(super::run_object(&run, &thread, state.engine.agents().default_id())).into_response())
}

/// `GET …/join`: the thread's values once the run pauses or ends.
async fn join_run(
    State(state): State<AppState>,
    caller: Caller,
    Path((thread, run)): Path<(String, String)>,
    params: Params,
) -> ApiResult<Response> {
    check_params(&params, &["cancel_on_disconnect"])?;
    if params.flag("cancel_on_disconnect")? {
        return Err(refuse("cancel_on_disconnect: not supported on a join (set on_disconnect when the run starts)"));
    }
    let (c, run) = run_in_thread(&state, &caller, &thread, &run).await?;
    // A run that runs now (or waits its turn) settles at its next pause or end: read from its last
    // event before the resume that woke it (the events after `after` include the pause or end to
    // wait for).
    if matches!(run.status, RunStatus::Queued | RunStatus::Running | RunStatus::Waiting) {
        let after = last_resume(&state, &run).await?;
        tokio::select! {
            settled = state.engine.wait_settled(&run.id, after) => { settled?; }
            () = state.shutdown.wait() => return Err(EngineError::ShuttingDown.into()),
        }
    }
    Ok(Json(final_values(&state, &caller, &c, &run.id).await?).into_response())
}

/// The sequence just before the run's newest `resumed` event (0 when it was never resumed): the
/// stream of its current stretch starts there.
async fn last_resume(state: &AppState, run: &keel_core::Run) -> ApiResult<i64> {
    let interrupts = state.engine.store().list_interrupts(&run.id).await?;
    if interrupts.is_empty() {
        return Ok(0);
    }
    let mut after = 0;
    let mut last = 0;
    loop {
        let page = state.engine.store().list_events(&run.id, after, 1000).await?;
        let Some(end) = page.last().map(|e| e.sequence) else { break };
        for e in &page {
            if matches!(e.kind, EventKind::Resumed { .. }) {
                last = e.sequence - 1;
            }
        }
        after = end;
    }
    Ok(last)
}

/// `GET …/stream`: joins a run's stream. With `Last-Event-ID` the parts after that event (the ids
/// are Keel's event sequences, stored: no gap, no duplicate); without, the run's current stretch
/// from its start (or from the resume that woke it) until it pauses or ends.
async fn join_stream(
    State(state): State<AppState>,
    caller: Caller,
    Path((thread, run)): Path<(String, String)>,
    query: Result<axum::extract::Query<Vec<(String, String)>>, axum::extract::rejection::QueryRejection>,
    headers: HeaderMap,
) -> ApiResult<Response> {
    // `stream_mode` comes once per mode: the query is read as a list, not a map.
    let axum::extract::Query(query) =
        query.map_err(|_| ApiError::bad_request("INVALID_QUERY", "the query string could not be decoded"))?;
    let mut modes = Vec::new();
    for (key, value) in &query {
        match key.as_str() {
            "stream_mode" if !value.is_empty() => modes.push(json!(value)),
            "stream_mode" => {}
            "cancel_on_disconnect" if matches!(value.as_str(), "" | "false" | "False" | "0") => {}
            "cancel_on_disconnect" => {
                return Err(refuse(
                    "cancel_on_disconnect: not supported on a join (set on_disconnect when the run starts)",
                ))
            }
            other => return Err(refuse(format!("unsupported query parameters: {other}"))),
        }
    }
    let modes =
        if modes.is_empty() { Modes::all() } else { Modes::parse(Some(&Value::Array(modes))).map_err(refuse)? };
    let permit = state.limits.streams.acquire(&caller.0)?;
    let (c, run) = run_in_thread(&state, &caller, &thread, &run).await?;
    let from = match headers.get("last-event-id") {
        Some(raw) => {
            let invalid =
                || ApiError::bad_request("INVALID_CURSOR", "Last-Event-ID: an id this stream gave (`S` or `S:k`)");
            let (after, skip) = raw.to_str().ok().and_then(super::parse_event_id).ok_or_else(invalid)?;
            if after + i64::from(skip > 0) > run.last_sequence() {
                return Err(ApiError::bad_request("CURSOR_OUT_OF_RANGE", "Last-Event-ID is past the run's last event"));
            }
            (after, skip)
        }
        None => (last_resume(&state, &run).await?, 0),
    };
    let assistant = state.engine.agent_of(&c).map(|a| a.id.clone()).unwrap_or_default();
    Ok(stream(&state, permit, &thread, &assistant, run.id, from, modes))
}

// ------------------------------------------------------------------ the stream

fn stream(
    state: &AppState,
    permit: StreamPermit,
    thread: &str,
    assistant: &str,
    run_id: RunId,
    (after, skip): (i64, usize),
    modes: Modes,
) -> Response {
    let (tx, rx) = mpsc::channel::<Bytes>(state.config.sse_buffer.max(1));
    let mapper = StreamMapper::new(modes, run_id.as_str(), thread, assistant);
    let state = state.clone();
    let open = state.metrics.connection_opened(crate::metrics::SSE);
    tokio::spawn(async move {
        feed(state, tx, mapper, run_id, after, skip).await;
        drop(permit);
    });
    let body = ReceiverStream::new(rx).map(move |frame| {
        let _open = &open;
        Ok::<_, Infallible>(frame)
    });
    sse::sse_response(Body::from_stream(body))
}

enum End {
    Finished,
    Detached,
    TooSlow,
}

async fn feed(
    state: AppState,
    tx: mpsc::Sender<Bytes>,
    mut mapper: StreamMapper,
    run_id: RunId,
    after: i64,
    mut skip: usize,
) {
    let engine = state.engine.clone();
    let timeout = state.config.sse_send_timeout;
    let send = |text: String| {
        let tx = tx.clone();
        async move {
            match tx.send_timeout(Bytes::from(text), timeout).await {
                Ok(()) => None,
                Err(SendTimeoutError::Closed(_)) => Some(End::Detached),
                Err(SendTimeoutError::Timeout(_)) => Some(End::TooSlow),
            }
        }
    };
    let end = async {
        let (name, data) = mapper.metadata();
        if let Some(end) = send(super::frame(name, &data, None)).await {
            return end;
        }
        // The events up to `after` were shown (or are the past of a resume): the mapper reads
        // them without a word, so that what it says next is what it would have said then.
        if let Err(e) = catch_up(&state, &mut mapper, &run_id, after).await {
            tracing::error!(run_id = %run_id, error = ?e, "reading the run's events for LangGraph failed");
            return write(&send, mapper.fail("INTERNAL", "internal error"), None, 0).await.unwrap_or(End::Finished);
        }
        // A run that waits for a human, or is over, with nothing after `after`: the stream is over
        // (a client that lost the `end` part gets it, instead of waiting for the next stretch).
        let store = engine.store();
        let conversation = match store.get_run(&run_id).await {
            Ok(Some(run))
                if !matches!(run.status, RunStatus::Queued | RunStatus::Running | RunStatus::Waiting)
                    && run.last_sequence() <= after =>
            {
                return send(super::frame("end", &Value::Null, None)).await.unwrap_or(End::Finished);
            }
            Ok(Some(run)) => store.get_conversation(&run.conversation_id).await,
            Ok(None) => Ok(None),
            Err(e) => Err(e),
        };
        let conversation = match conversation {
            Ok(Some(c)) => c,
            Ok(None) | Err(_) => {
                tracing::error!(run_id = %run_id, "reading the run's conversation for LangGraph failed");
                return write(&send, mapper.fail("INTERNAL", "internal error"), None, 0).await.unwrap_or(End::Finished);
            }
        };
        let events = engine.events(&run_id, after, Until::PauseOrTerminal, Known::Unknown);
        tokio::pin!(events);
        let shutdown = state.shutdown.wait();
        tokio::pin!(shutdown);
        let heartbeat = state.config.heartbeat.max(Duration::from_millis(1));
        let mut keep_alive = tokio::time::interval_at(tokio::time::Instant::now() + heartbeat, heartbeat);
        keep_alive.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let (parts, id) = tokio::select! {
                biased;
                () = tx.closed() => return End::Detached,
                () = &mut shutdown => (mapper.fail("SHUTTING_DOWN", "the server is stopping; the run goes on: join it again"), None),
                next = events.next() => match next {
                    None => (mapper.fail("INTERNAL", "the run's events ended early"), None),
                    Some(Err(e)) => {
                        tracing::error!(run_id = %run_id, error = ?e, "reading the run's events for LangGraph failed");
                        (mapper.fail("INTERNAL", "internal error"), None)
                    }
                    Some(Ok(event)) => match map(&state, &mut mapper, &conversation, &event).await {
                        Ok(parts) => (parts, Some(event.sequence)),
                        Err(e) => {
                            tracing::error!(run_id = %run_id, error = ?e, "reading a snapshot for LangGraph failed");
                            (mapper.fail("INTERNAL", "internal error"), None)
                        }
                    },
                },
                _ = keep_alive.tick() => {
                    if let Some(end) = send(String::from_utf8_lossy(sse::KEEP_ALIVE).into_owned()).await {
                        return end;
                    }
                    continue;
                }
            };
            if !parts.is_empty() {
                keep_alive.reset();
            }
            // A client cut inside the first event's parts saw `skip` of them.
            let skip = if id == Some(after + 1) { std::mem::take(&mut skip) } else { 0 };
            if let Some(end) = write(&send, parts, id, skip).await {
                return end;
            }
            if mapper.is_finished() {
                return End::Finished;
            }
        }
    }
    .await;
    drop(tx);
    match end {
        End::Detached => {
            if let Err(e) = engine.client_detached(&run_id).await {
                tracing::warn!(run_id = %run_id, error = %e, "handling a detached client failed");
            }
        }
        End::TooSlow => tracing::info!(run_id = %run_id, "LangGraph client too slow to drain its buffer; cut off"),
        End::Finished => {}
    }
}

/// Writes the parts of one Keel event (`sequence`: with their ids, [`super::part_ids`]), but the
/// first `skip`, in one write.
async fn write<F, Fut>(send: &F, parts: Vec<(&'static str, Value)>, sequence: Option<i64>, skip: usize) -> Option<End>
where
    F: Fn(String) -> Fut,
    Fut: std::future::Future<Output = Option<End>>,
{
    let ids = match sequence {
        Some(s) => super::part_ids(s, &parts),
        None => vec![None; parts.len()],
    };
    let mut text = String::new();
    for ((name, data), id) in parts.iter().zip(&ids).skip(skip) {
        text.push_str(&super::frame(name, data, id.as_deref()));
    }
    if text.is_empty() {
        return None;
    }
    send(text).await
}

async fn catch_up(state: &AppState, mapper: &mut StreamMapper, run_id: &RunId, upto: i64) -> ApiResult<()> {
    let mut after = 0;
    while after < upto {
        let page = state.engine.store().list_events(run_id, after, 1000).await?;
        let Some(last) = page.last().map(|e| e.sequence) else { break };
        for e in page.iter().filter(|e| e.sequence <= upto) {
            mapper.map(e, Lookup { snapshot: None, interrupt: None });
        }
        after = last;
    }
    mapper.restart();
    Ok(())
}

async fn map(
    state: &AppState,
    mapper: &mut StreamMapper,
    conversation: &Conversation,
    event: &Event,
) -> ApiResult<Vec<(&'static str, Value)>> {
    let store = state.engine.store();
    let snapshot = if super::needs_snapshot(event, mapper.modes()) {
        Some(snapshot(state, &conversation.id).await?)
    } else {
        None
    };
    let interrupt = match &event.kind {
        EventKind::Interrupt { interrupt_id, .. } => {
            store.get_interrupt(interrupt_id).await?.map(|i| interrupt_value(state, conversation, &i))
        }
        _ => None,
    };
    Ok(mapper.map(event, Lookup { snapshot: snapshot.as_ref(), interrupt }))
}
