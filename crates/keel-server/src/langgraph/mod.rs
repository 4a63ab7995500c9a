//! LangGraph Server's API (the Agent Server API that `langgraph-sdk` and
//! `@langchain/langgraph-sdk` speak) as a view of Keel, under `/langgraph`.
//!
//! Like `ag_ui`, nothing here executes anything: an assistant is an agent, a thread a conversation,
//! a run a Keel run; a request goes through the engine calls the native routes use, and a stream
//! maps the run's stored-then-live events. This module holds the pure mapping (objects, stream
//! parts, interrupts in the shape of LangChain's human-in-the-loop middleware, resumes to Keel
//! decisions, the option checks); `routes` the handlers. docs/langgraph.md is its contract.

pub mod routes;

use std::collections::{BTreeMap, HashMap, HashSet};

use keel_core::engine::{CallDecision, Decision};
use keel_core::{Event, EventKind, Interrupt, InterruptKind, Run, RunStatus, Timestamp};
use serde_json::{json, Map, Value};

use crate::ag_ui::Snapshot;

/// The binding namespaces ([`keel_core::store::BindingStore`]): a thread id a client chose, per
/// user, bound to its conversation; a thread's metadata (JSON), per user, by conversation id; a
/// thread deleted through this API (its conversation stays in Keel's store).
pub const THREADS: &str = "langgraph.thread";
pub const THREAD_METADATA: &str = "langgraph.thread_metadata";
pub const DELETED: &str = "langgraph.deleted";

/// A timestamp as LangGraph writes them (RFC 3339, UTC).
pub fn time(ts: &Timestamp) -> String {
    ts.to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
}

/// The assistant of an agent: `assistant_id` and `graph_id` are the agent's id.
pub fn assistant(agent: &keel_core::agent::Agent, created: &str) -> Value {
    json!({
        "assistant_id": agent.id,
        "graph_id": agent.id,
        "name": agent.name,
        "description": if agent.description.is_empty() { Value::Null } else { json!(agent.description) },
        "config": {},
        "context": {},
        "metadata": {"created_by": "keel"},
        "version": 1,
        "created_at": created,
        "updated_at": created,
    })
}

/// A LangGraph run status for a Keel run status. A run queued, or waiting its turn behind another
/// (`multitask_strategy` `enqueue`), is `pending`, as LangGraph's are. A run waiting for a human is
/// `interrupted`, as LangGraph's is after `interrupt()`; a cancelled one is `interrupted` too
/// (LangGraph's cancel), with `cancel_reason` telling them apart. A rolled-back run is not shown
/// (404, as LangGraph deletes it); were it, it would read as the cancel it was.
pub fn run_status(status: RunStatus) -> &'static str {
    match status {
        RunStatus::Queued | RunStatus::Waiting => "pending",
        RunStatus::Running => "running",
        RunStatus::Interrupted | RunStatus::Cancelled | RunStatus::RolledBack => "interrupted",
        RunStatus::Completed => "success",
        RunStatus::Failed => "error",
    }
}

pub fn run_object(run: &Run, thread_id: &str, default_agent: &str) -> Value {
    let mut out = json!({
        "run_id": run.id,
        "thread_id": thread_id,
        "assistant_id": run.agent_id.as_deref().unwrap_or(default_agent),
        "created_at": time(&run.created_at),
        "updated_at": time(&run.updated_at),
        "status": run_status(run.status),
        "metadata": {},
        "multitask_strategy": "reject",
        "kwargs": {},
    });
    if run.status == RunStatus::Cancelled {
        out["cancel_reason"] = json!(run.reason.clone().unwrap_or_else(|| "cancelled".into()));
    }
    out
}

/// The thread's status from its latest run: `busy` while one runs (or waits its turn), `interrupted`
/// while one waits for a human, `error` after a failed one, else `idle`.
pub fn thread_status(latest: Option<&Run>) -> &'static str {
    match latest.map(|r| r.status) {
        Some(RunStatus::Queued | RunStatus::Running | RunStatus::Waiting) => "busy",
        Some(RunStatus::Interrupted) => "interrupted",
        Some(RunStatus::Failed) => "error",
        _ => "idle",
    }
}

/// The conversation as LangChain messages (what `values.messages` holds), from the AG-UI snapshot
/// of it: user text as `human`, assistant text and tool calls as `ai`, each result as `tool` with
/// the call's one-line summary (never the full result).
pub fn messages(snapshot: &Snapshot) -> Vec<Value> {
    snapshot.messages.iter().map(message).collect()
}

fn message(m: &Value) -> Value {
    let id = m.get("id").cloned().unwrap_or(Value::Null);
    let content = m.get("content").cloned().unwrap_or_else(|| json!(""));
    match m.get("role").and_then(Value::as_str) {
        Some("user") => json!({
            "type": "human", "id": id, "content": content, "name": null,
            "additional_kwargs": {}, "response_metadata": {}, "example": false,
        }),
        Some("tool") => json!({
            "type": "tool", "id": id, "content": content, "name": null, "status": "success",
            "tool_call_id": m.get("toolCallId").cloned().unwrap_or(Value::Null),
            "additional_kwargs": {}, "response_metadata": {},
        }),
        _ => {
            let tool_calls: Vec<Value> = m
                .get("toolCalls")
                .and_then(Value::as_array)
                .map(|calls| {
                    calls
                        .iter()
                        .map(|c| {
                            let args = c["function"]["arguments"]
                                .as_str()
                                .and_then(|s| serde_json::from_str::<Value>(s).ok())
                                .unwrap_or_else(|| json!({}));
                            json!({"name": c["function"]["name"], "args": args, "id": c["id"], "type": "tool_call"})
                        })
                        .collect()
                })
                .unwrap_or_default();
            json!({
                "type": "ai", "id": id, "content": content, "name": null, "tool_calls": tool_calls,
                "invalid_tool_calls": [], "usage_metadata": null, "example": false,
                "additional_kwargs": {}, "response_metadata": {},
            })
        }
    }
}

/// The thread's values: its messages and its confirmed facts.
pub fn values(snapshot: &Snapshot) -> Value {
    json!({"messages": messages(snapshot), "facts": snapshot.state.get("facts").cloned().unwrap_or(json!({}))})
}

/// An interrupt as LangGraph shows it (`{value, id}`), its value in the shape of LangChain's
/// human-in-the-loop middleware: `action_requests` (`name`, `args`, `description`) and
/// `review_configs` (`action_name`, `allowed_decisions`, `args_schema`), one of each per call
/// waiting, in order; Keel's own view of it under `keel`. `schema_of` gives a tool's argument
/// schema.
pub fn interrupt(i: &Interrupt, schema_of: &dyn Fn(&str) -> Option<Value>) -> Value {
    let payload = i.payload.inner();
    let actions = payload.get("actions").and_then(Value::as_array).cloned().unwrap_or_default();
    let allowed: Vec<Value> = payload.get("decisions").and_then(Value::as_array).cloned().unwrap_or_default();
    let mut requests = Vec::new();
    let mut configs = Vec::new();
    for a in &actions {
        let name = a.get("tool").and_then(Value::as_str).unwrap_or_default();
        requests.push(json!({
            "name": name,
            "args": a.get("args").cloned().unwrap_or(json!({})),
            "description": a.get("description").or_else(|| a.get("title")).cloned().unwrap_or(Value::Null),
        }));
        let mut config = json!({"action_name": name, "allowed_decisions": allowed});
        if let Some(schema) = a.get("argsSchema").filter(|s| !s.is_null()).cloned().or_else(|| schema_of(name)) {
            config["args_schema"] = schema;
        }
        configs.push(config);
    }
    json!({
        "id": i.id,
        "value": {
            "action_requests": requests,
            "review_configs": configs,
            "keel": {
                "interruptId": i.id,
                "kind": i.kind,
                "title": payload.get("title").cloned().unwrap_or(Value::Null),
                "risk": payload.get("risk").cloned().unwrap_or(Value::Null),
                "callIds": i.call_ids,
                "expiresAt": time(&i.expires_at),
            },
        },
    })
}

/// A resume (`command.resume`, one interrupt's value) as a Keel decision and its note:
/// `"approve"`/`"reject"` (and Keel's other bare decisions) for every call, or
/// `{decisions: [...]}`, one per action in order, each `{type: "approve"}`, `{type: "edit",
/// edited_action: {name, args}}`, `{type: "reject", message?}`, `{type: "respond", message}` (a
/// rejection whose message goes to the model as the note) or Keel's `retry` / `mark_done` /
/// `mark_failed`. The error names the rule, never the value.
pub fn decision(resume: &Value, interrupt: &Interrupt) -> Result<(Decision, Option<String>), String> {
    if let Value::String(_) = resume {
        return Decision::parse(resume).map(|d| (d, None)).map_err(|e| format!("command.resume: {e}"));
    }
    let Some(obj) = resume.as_object() else {
        return Err("command.resume: expected \"approve\", \"reject\" or {\"decisions\": [...]}".into());
    };
    if let Some(unknown) = obj.keys().find(|k| k.as_str() != "decisions") {
        return Err(format!("command.resume.{unknown}: not supported (expected only `decisions`)"));
    }
    let Some(list) = obj.get("decisions").and_then(Value::as_array) else {
        return Err("command.resume.decisions: must be a list".into());
    };
    if interrupt.kind == InterruptKind::ToolCall {
        return Err("command.resume: this interrupt waits for a client-side tool's result; send it to POST /v1/runs/{id}/tool-results".into());
    }
    let actions = interrupt.payload.inner().get("actions").and_then(Value::as_array).cloned().unwrap_or_default();
    if list.len() != actions.len() {
        return Err(format!(
            "command.resume.decisions: one decision per action request, in order ({} expected, {} given)",
            actions.len(),
            list.len()
        ));
    }
    let mut calls = BTreeMap::new();
    let mut notes = Vec::new();
    for (n, (d, action)) in list.iter().zip(&actions).enumerate() {
        let at = format!("command.resume.decisions[{n}]");
        let Some(d) = d.as_object() else { return Err(format!("{at}: must be an object with `type`")) };
        let kind = d.get("type").and_then(Value::as_str).unwrap_or_default();
        let allowed: &[&str] = match kind {
            "edit" => &["type", "edited_action"],
            "reject" | "respond" => &["type", "message"],
            _ => &["type"],
        };
        if let Some(unknown) = d.keys().find(|k| !allowed.contains(&k.as_str())) {
            return Err(format!("{at}.{unknown}: not supported for type {kind:?}"));
        }
        let call_id = action.get("callId").and_then(Value::as_str).unwrap_or_default().to_owned();
        let tool = action.get("tool").and_then(Value::as_str).unwrap_or_default();
        let decided = match kind {
            "approve" => CallDecision::Approve,
            "reject" => CallDecision::Reject,
            "respond" => {
                if !d.get("message").is_some_and(Value::is_string) {
                    return Err(format!("{at}.message: required for `respond` (a string)"));
                }
                CallDecision::Reject
            }
            "edit" => {
                let edited = d.get("edited_action").and_then(Value::as_object);
                let Some(edited) = edited else { return Err(format!("{at}.edited_action: required ({{name, args}})")) };
                if let Some(name) = edited.get("name").and_then(Value::as_str) {
                    if name != tool {
                        return Err(format!("{at}.edited_action.name: must be the action's ({tool})"));
                    }
                }
                let Some(args) = edited.get("args").filter(|a| a.is_object()) else {
                    return Err(format!("{at}.edited_action.args: required (an object)"));
                };
                CallDecision::Edit(args.clone())
            }
            "retry" => CallDecision::Retry,
            "mark_done" => CallDecision::MarkDone,
            "mark_failed" => CallDecision::MarkFailed,
            _ => {
                return Err(format!(
                    "{at}.type: expected approve, edit, reject, respond, retry, mark_done or mark_failed"
                ))
            }
        };
        if let Some(message) = d.get("message") {
            let Some(message) = message.as_str() else { return Err(format!("{at}.message: must be a string")) };
            if !message.is_empty() {
                notes.push(message.to_owned());
            }
        }
        calls.insert(call_id, decided);
    }
    let note = if notes.is_empty() { None } else { Some(notes.join("\n")) };
    Ok((Decision::Calls(calls), note))
}

/// The stream modes a run may be streamed in. `events`, `debug`, `tasks` and `checkpoints` do not
/// map onto Keel's events and are refused.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Modes {
    pub values: bool,
    pub updates: bool,
    pub messages_tuple: bool,
    pub messages: bool,
    pub custom: bool,
}

impl Modes {
    /// `stream_mode`: a string or a list of them; absent is `values` (LangGraph's default).
    pub fn parse(value: Option<&Value>) -> Result<Self, String> {
        let names: Vec<&str> = match value {
            None | Some(Value::Null) => vec!["values"],
            Some(Value::String(s)) => vec![s.as_str()],
            Some(Value::Array(list)) => {
                let mut out = Vec::new();
                for v in list {
                    out.push(v.as_str().ok_or("stream_mode: must be a string or a list of strings")?);
                }
                out
            }
            Some(_) => return Err("stream_mode: must be a string or a list of strings".into()),
        };
        let mut modes = Modes::default();
        for name in names {
            match name {
                "values" => modes.values = true,
                "updates" => modes.updates = true,
                "messages-tuple" => modes.messages_tuple = true,
                "messages" => modes.messages = true,
                "custom" => modes.custom = true,
                "events" | "debug" | "tasks" | "checkpoints" => {
                    return Err(format!("stream_mode {name:?}: not supported by Keel (supported: values, updates, messages-tuple, messages, custom)"))
                }
                other => return Err(format!("stream_mode {other:?}: unknown")),
            }
        }
        Ok(modes)
    }

    /// Every mode (a background run's join streams the union, as LangGraph's do).
    pub fn all() -> Self {
        Modes { values: true, updates: true, messages_tuple: true, messages: false, custom: true }
    }
}

/// What the stream mapper needs that only the store knows, read by the caller after the event.
pub struct Lookup<'a> {
    /// The conversation now (for `values`, `updates` and the messages a node produced).
    pub snapshot: Option<&'a Snapshot>,
    /// The interrupt an `interrupt` event announces, as [`interrupt`] shows it.
    pub interrupt: Option<Value>,
}

/// Whether mapping `event` needs the conversation's snapshot.
pub fn needs_snapshot(event: &Event, modes: Modes) -> bool {
    let state = modes.values || modes.updates || modes.messages_tuple || modes.messages;
    state
        && matches!(
            event.kind,
            EventKind::RunStarted { .. }
                | EventKind::NodeFinished { .. }
                | EventKind::Interrupt { .. }
                | EventKind::Done { .. }
        )
}

/// Maps a run's Keel events onto LangGraph stream parts (`(event, data)`), for the modes asked.
/// A stream starts with `metadata` ([`StreamMapper::metadata`]) and ends with `end` once the run
/// pauses or ends.
///
/// What a node produced is known from the events themselves (the text messages streamed, the calls
/// started and finished since the previous node ended), so a stream joined in the middle, after
/// the mapper read the earlier events without output ([`StreamMapper::restart`]), says exactly
/// what a stream from the start would have said from there on.
pub struct StreamMapper {
    modes: Modes,
    run_id: String,
    thread_id: String,
    assistant_id: String,
    /// The ids (LangChain's) of the messages produced since the last node ended, in order.
    pending: Vec<String>,
    /// The ids of the messages shown as a node's output (a call shown when it waited for approval
    /// is not shown again when it runs).
    shown: HashSet<String>,
    /// Text streamed so far, per message.
    partial: HashMap<String, String>,
    step: u64,
    finished: bool,
}

impl StreamMapper {
    pub fn new(modes: Modes, run_id: &str, thread_id: &str, assistant_id: &str) -> Self {
        Self {
            modes,
            run_id: run_id.to_owned(),
            thread_id: thread_id.to_owned(),
            assistant_id: assistant_id.to_owned(),
            pending: Vec::new(),
            shown: HashSet::new(),
            partial: HashMap::new(),
            step: 0,
            finished: false,
        }
    }

    pub fn modes(&self) -> Modes {
        self.modes
    }

    /// After the earlier events were read without output: the stream goes on (a pause among them
    /// was a past one).
    pub fn restart(&mut self) {
        self.finished = false;
    }

    pub fn metadata(&self) -> (&'static str, Value) {
        ("metadata", json!({"run_id": self.run_id, "thread_id": self.thread_id, "attempt": 1}))
    }

    pub fn is_finished(&self) -> bool {
        self.finished
    }

    fn chunk_metadata(&self, node: &str) -> Value {
        json!({
            "run_id": self.run_id,
            "thread_id": self.thread_id,
            "assistant_id": self.assistant_id,
            "graph_id": self.assistant_id,
            "langgraph_node": node,
            "langgraph_step": self.step,
            "langgraph_checkpoint_ns": "",
        })
    }

    /// An `error` part (the stream cannot go on) and `end`.
    pub fn fail(&mut self, code: &str, message: &str) -> Vec<(&'static str, Value)> {
        self.finished = true;
        vec![("error", json!({"error": code, "message": message})), ("end", Value::Null)]
    }

    fn produce(&mut self, id: String) {
        if !self.pending.contains(&id) {
            self.pending.push(id);
        }
    }

    /// The messages produced since the last node ended, as the snapshot has them, in its order.
    fn take_produced(&mut self, snapshot: Option<&Snapshot>) -> Vec<Value> {
        let mut pending = std::mem::take(&mut self.pending);
        pending.retain(|id| self.shown.insert(id.clone()));
        let Some(snapshot) = snapshot else { return Vec::new() };
        messages(snapshot)
            .into_iter()
            .filter(|m| m.get("id").and_then(Value::as_str).is_some_and(|id| pending.iter().any(|p| p == id)))
            .collect()
    }

    /// Parts for the messages a node produced: an update under the node's name, whole messages
    /// for `messages-tuple` (text streamed token by token was shown already), `messages/complete`.
    fn node_output(&self, node: &str, produced: &[Value], out: &mut Vec<(&'static str, Value)>) {
        if self.modes.updates && !produced.is_empty() {
            out.push(("updates", json!({ node: {"messages": produced} })));
        }
        for m in produced {
            let id = m.get("id").and_then(Value::as_str).unwrap_or_default();
            let streamed = self.partial.contains_key(id);
            if self.modes.messages_tuple && !streamed {
                out.push(("messages", json!([m, self.chunk_metadata(node)])));
            }
            if self.modes.messages {
                out.push(("messages/complete", json!([m])));
            }
        }
    }

    pub fn map(&mut self, event: &Event, lookup: Lookup<'_>) -> Vec<(&'static str, Value)> {
        let mut out = Vec::new();
        let state = lookup.snapshot.map(values);
        match &event.kind {
            EventKind::RunStarted { .. } => {
                if let (true, Some(state)) = (self.modes.values, state) {
                    out.push(("values", state));
                }
            }
            EventKind::NodeStarted { .. } => self.step += 1,
            EventKind::TextDelta { message_id, delta } => {
                let id = message_id.to_string();
                self.produce(id.clone());
                let first = !self.partial.contains_key(&id);
                let text = self.partial.entry(id.clone()).or_default();
                text.push_str(delta);
                let text = text.clone();
                if self.modes.messages_tuple && !delta.is_empty() {
                    let chunk = json!({
                        "type": "AIMessageChunk", "id": id, "content": delta, "name": null,
                        "tool_calls": [], "tool_call_chunks": [], "invalid_tool_calls": [],
                        "additional_kwargs": {}, "response_metadata": {}, "example": false,
                    });
                    out.push(("messages", json!([chunk, self.chunk_metadata("model")])));
                }
                if self.modes.messages {
                    if first {
                        out.push((
                            "messages/metadata",
                            json!({ id.clone(): {"metadata": self.chunk_metadata("model")} }),
                        ));
                    }
                    out.push((
                        "messages/partial",
                        json!([{"type": "ai", "id": id, "content": text, "tool_calls": [], "invalid_tool_calls": [],
                                "additional_kwargs": {}, "response_metadata": {}, "name": null, "example": false}]),
                    ));
                }
            }
            EventKind::TextDiscarded { message_id, .. } => {
                let id = message_id.to_string();
                self.pending.retain(|p| p != &id);
            }
            EventKind::ToolStarted { call_id, .. } => self.produce(call_id.to_string()),
            EventKind::ToolFinished { call_id, .. } => {
                self.produce(call_id.to_string());
                self.produce(crate::ag_ui::result_message_id(call_id.as_str()));
            }
            EventKind::NodeFinished { node, .. } => {
                let produced = self.take_produced(lookup.snapshot);
                self.node_output(node, &produced, &mut out);
                if let (true, Some(state), false) = (self.modes.values, state, produced.is_empty()) {
                    out.push(("values", state));
                }
            }
            EventKind::Interrupt { payload, .. } => {
                // The calls waiting for a decision were not started: they are the model's output.
                let waiting: Vec<String> = payload
                    .inner()
                    .get("actions")
                    .and_then(Value::as_array)
                    .map(|a| {
                        a.iter().filter_map(|a| a.get("callId").and_then(Value::as_str)).map(str::to_owned).collect()
                    })
                    .unwrap_or_default();
                for id in waiting {
                    self.produce(id);
                }
                let produced = self.take_produced(lookup.snapshot);
                self.node_output("model", &produced, &mut out);
                let interrupts = lookup.interrupt.map(|i| json!([i])).unwrap_or(json!([]));
                if self.modes.updates {
                    out.push(("updates", json!({"__interrupt__": interrupts})));
                }
                if let (true, Some(mut state)) = (self.modes.values, state) {
                    state["__interrupt__"] = interrupts;
                    out.push(("values", state));
                }
                out.push(("end", Value::Null));
                self.finished = true;
            }
            EventKind::Done { .. } => {
                let produced = self.take_produced(lookup.snapshot);
                self.node_output("finalize", &produced, &mut out);
                if let (true, Some(state)) = (self.modes.values, state) {
                    out.push(("values", state));
                }
                out.push(("end", Value::Null));
                self.finished = true;
            }
            EventKind::Cancelled { .. } => {
                out.push(("end", Value::Null));
                self.finished = true;
            }
            EventKind::Error { code, message } => {
                out.push(("error", json!({"error": code, "message": message})));
                out.push(("end", Value::Null));
                self.finished = true;
            }
            _ => {}
        }
        out
    }
}

/// `event: <name>`, optional `id: <id>`, `data: <one line of JSON>`, blank line.
pub fn frame(name: &str, data: &Value, id: Option<&str>) -> String {
    let mut out = String::new();
    if let Some(id) = id {
        out.push_str(&format!("id: {id}\n"));
    }
    out.push_str(&format!("event: {name}\ndata: {data}\n\n"));
    out
}

/// The ids of the parts one Keel event maps to: the last part (`end` aside, which has none) is the
/// event's sequence, `S` ("event S is delivered"); an earlier part `k` (1-based) is `S:k` ("event
/// S's first k parts are delivered"). A client cut anywhere reconnects with the id it saw last and
/// gets exactly what follows.
pub fn part_ids(sequence: i64, parts: &[(&'static str, Value)]) -> Vec<Option<String>> {
    let last = parts.iter().rposition(|(name, _)| *name != "end");
    parts
        .iter()
        .enumerate()
        .map(|(n, (name, _))| match (*name, Some(n) == last) {
            ("end", _) => None,
            (_, true) => Some(sequence.to_string()),
            _ => Some(format!("{sequence}:{}", n + 1)),
        })
        .collect()
}

/// A `Last-Event-ID` as [`part_ids`] writes them: the events after which the stream goes on, and
/// how many parts of the next event to skip.
pub fn parse_event_id(raw: &str) -> Option<(i64, usize)> {
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    match raw.split_once(':') {
        None if digits(raw) => Some((raw.parse().ok()?, 0)),
        Some((seq, k)) if digits(seq) && digits(k) => {
            let seq: i64 = seq.parse().ok()?;
            let k: usize = k.parse().ok()?;
            (seq >= 1 && k >= 1).then_some((seq - 1, k))
        }
        _ => None,
    }
}

/// Checks a request body's options: every key must be one Keel knows, and an option Keel does not
/// support may only carry its default (absent, `null`, `false`, empty). The error names them all.
pub fn check_options(body: &Map<String, Value>, supported: &[&str], default_only: &[&str]) -> Result<(), String> {
    let mut refused = Vec::new();
    for (key, value) in body {
        if supported.contains(&key.as_str()) {
            continue;
        }
        if default_only.contains(&key.as_str()) {
            let default = match value {
                Value::Null | Value::Bool(false) => true,
                Value::Array(a) => a.is_empty(),
                Value::Object(o) => o.is_empty(),
                Value::String(s) => s.is_empty(),
                Value::Number(_) => value.as_f64() == Some(0.0),
                Value::Bool(true) => false,
            };
            if !default {
                refused.push(format!("{key} (not supported by Keel)"));
            }
            continue;
        }
        refused.push(format!("{key} (unknown)"));
    }
    if refused.is_empty() {
        Ok(())
    } else {
        Err(format!("unsupported options: {}", refused.join(", ")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_core::{InterruptId, InterruptStatus, RunId};

    fn confirm(actions: Value) -> Interrupt {
        Interrupt {
            id: InterruptId::parse("int_1").unwrap(),
            run_id: RunId::parse("run_1").unwrap(),
            kind: InterruptKind::ConfirmAction,
            status: InterruptStatus::Pending,
            payload: json!({"title": "Do it?", "decisions": ["approve", "reject", "edit"], "actions": actions}).into(),
            call_ids: vec![],
            created_at: chrono::DateTime::from_timestamp(0, 0).unwrap(),
            expires_at: chrono::DateTime::from_timestamp(900, 0).unwrap(),
            decision: None,
            note: None,
            resolved_by: None,
            resolved_at: None,
        }
    }

    #[test]
    fn interrupts_take_the_middleware_shape() {
        let i = confirm(json!([{"callId": "call_1", "tool": "scale", "args": {"n": 2}, "description": "Scale to 2"}]));
        let v = interrupt(&i, &|_| Some(json!({"type": "object"})));
        assert_eq!(v["id"], "int_1");
        assert_eq!(
            v["value"]["action_requests"][0],
            json!({"name": "scale", "args": {"n": 2}, "description": "Scale to 2"})
        );
        assert_eq!(v["value"]["review_configs"][0]["allowed_decisions"], json!(["approve", "reject", "edit"]));
        assert_eq!(v["value"]["review_configs"][0]["args_schema"], json!({"type": "object"}));
    }

    #[test]
    fn resumes_become_decisions() {
        let i = confirm(json!([
            {"callId": "call_1", "tool": "a", "args": {}},
            {"callId": "call_2", "tool": "b", "args": {}},
        ]));
        assert_eq!(decision(&json!("approve"), &i).unwrap(), (Decision::Approve, None));
        let (d, note) = decision(
            &json!({"decisions": [{"type": "edit", "edited_action": {"name": "a", "args": {"x": 1}}},
                                  {"type": "reject", "message": "no"}]}),
            &i,
        )
        .unwrap();
        assert_eq!(
            d,
            Decision::Calls(BTreeMap::from([
                ("call_1".into(), CallDecision::Edit(json!({"x": 1}))),
                ("call_2".into(), CallDecision::Reject)
            ]))
        );
        assert_eq!(note.as_deref(), Some("no"));
        assert!(decision(&json!({"decisions": [{"type": "approve"}]}), &i).unwrap_err().contains("2 expected"));
        assert!(decision(&json!({"decisions": [{"type": "approve", "x": 1}, {"type": "approve"}]}), &i)
            .unwrap_err()
            .contains("decisions[0].x"));
        assert!(decision(
            &json!({"decisions": [{"type": "edit", "edited_action": {"name": "b", "args": {}}}, {"type": "approve"}]}),
            &i
        )
        .unwrap_err()
        .contains("must be the action's"));
        assert!(decision(&json!({"other": 1}), &i).unwrap_err().contains("command.resume.other"));
    }

    #[test]
    fn options_are_checked_by_name() {
        let body = json!({"input": {}, "stream_subgraphs": false, "webhook": "http://x", "nope": 1});
        let err = check_options(body.as_object().unwrap(), &["input"], &["stream_subgraphs", "webhook"]).unwrap_err();
        assert_eq!(err, "unsupported options: nope (unknown), webhook (not supported by Keel)");
        assert!(Modes::parse(Some(&json!(["updates", "messages-tuple"]))).is_ok());
        assert!(Modes::parse(Some(&json!("events"))).unwrap_err().contains("events"));
    }

    #[test]
    fn frames_have_ids_when_given() {
        assert_eq!(frame("end", &Value::Null, None), "event: end\ndata: null\n\n");
        assert_eq!(frame("values", &json!({}), Some("3")), "id: 3\nevent: values\ndata: {}\n\n");
        let parts = [("values", json!({})), ("updates", json!({})), ("end", Value::Null)];
        assert_eq!(part_ids(7, &parts), vec![Some("7:1".to_owned()), Some("7".to_owned()), None]);
        assert_eq!(parse_event_id("7"), Some((7, 0)));
        assert_eq!(parse_event_id("7:1"), Some((6, 1)));
        assert_eq!(parse_event_id("0"), Some((0, 0)));
        for bad in ["", "x", "7:", ":1", "0:1", "7:0", "-1", "7:1:2"] {
            assert_eq!(parse_event_id(bad), None, "{bad}");
        }
    }
}
