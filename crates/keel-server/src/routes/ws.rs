//! `GET /v1/ws`: one WebSocket for many runs — subscribe to runs' events, send messages, resume,
//! answer client-side tool calls, cancel — through the same engine calls as the REST routes.
//!
//! Client messages are JSON text frames with a `type` and an optional `requestId`; the server sends
//! the runs' native events (the JSON of the SSE `data:` lines) and one `reply` per request, with its
//! `requestId`. Everything the server sends goes through one bounded queue per connection, drained
//! by one writer that waits at most `ws_send_timeout` for the socket to take a frame: a client that
//! can't keep up is cut off (its queue never grows past `ws_buffer`), resubscribes with `after` and
//! gets what it missed from the store. docs/api.md, "WebSocket", is the contract.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::{CloseFrame, Message, Utf8Bytes, WebSocket, WebSocketUpgrade};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use futures::{SinkExt, StreamExt};
use keel_core::engine::{Decision, EngineError, ResumeRequest, SendMessage, ToolResultRequest};
use keel_core::stream::{Known, Until};
use keel_core::{ConversationId, InterruptId, RunId};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use crate::error::ApiError;
use crate::extract::Caller;
use crate::state::{AppState, WsStats};
use crate::views::{ErrorBody, RunBody, TicketBody};

#[utoipa::path(
    get,
    path = "/v1/ws",
    operation_id = "openWebSocket",
    tag = "streams",
    description = "A WebSocket upgrade; the messages are in docs/api.md, \"WebSocket\".",
    security(("bearer" = []), ("ticket" = [])),
    params(("ticket" = Option<String>, Query, description = "A WebSocket ticket instead of an API key")),
    responses(
        (status = 101, description = "Switching protocols: the WebSocket is open"),
        (status = 426, description = "`UPGRADE_REQUIRED`: not a WebSocket upgrade request", body = ErrorBody),
    )
)]
pub async fn ws(
    State(state): State<AppState>,
    caller: Caller,
    upgrade: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Result<Response, ApiError> {
    let upgrade = upgrade.map_err(|_| {
        ApiError::new(StatusCode::UPGRADE_REQUIRED, "UPGRADE_REQUIRED", "expected a WebSocket upgrade request")
    })?;
    // One of the caller's stream slots, and one open connection on /metrics, while the socket is open.
    let permit = state.limits.streams.acquire(&caller.0)?;
    let open = state.metrics.connection_opened(crate::metrics::WEBSOCKET);
    Ok(upgrade.max_message_size(state.config.body_limit).on_upgrade(move |socket| async move {
        connection(state, caller, socket).await;
        drop((permit, open));
    }))
}

/// `POST /v1/ws/ticket`: a short-lived, single-use ticket for `GET /v1/ws?ticket=…`, for a browser,
/// whose WebSocket can't send an `Authorization` header.
#[utoipa::path(
    post,
    path = "/v1/ws/ticket",
    operation_id = "createWebSocketTicket",
    tag = "streams",
    responses((status = 201, description = "A ticket for `GET /v1/ws?ticket=…`", body = TicketBody))
)]
pub async fn ticket(State(state): State<AppState>, caller: Caller) -> Result<Response, ApiError> {
    crate::auth::ticket_created(&state, &caller, keel_core::TicketScope::WebSocket, None, "/v1/ws").await
}

/// A client message, after its `type` and `requestId` were read.
#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", rename_all_fields = "camelCase", deny_unknown_fields)]
enum Request {
    Subscribe {
        run_id: String,
        #[serde(default)]
        after: Option<i64>,
        #[serde(default)]
        request_id: Option<Value>,
    },
    Unsubscribe {
        run_id: String,
        #[serde(default)]
        request_id: Option<Value>,
    },
    /// A new conversation, with the agent named (the default agent when absent).
    CreateConversation {
        #[serde(default)]
        title: Option<String>,
        #[serde(default)]
        agent_id: Option<String>,
        #[serde(default)]
        request_id: Option<Value>,
    },
    Send {
        conversation_id: String,
        content: String,
        #[serde(default)]
        cancel_on_disconnect: bool,
        #[serde(default)]
        request_id: Option<Value>,
    },
    Resume {
        run_id: String,
        interrupt_id: String,
        decision: Value,
        idempotency_key: String,
        #[serde(default)]
        note: Option<String>,
        #[serde(default)]
        request_id: Option<Value>,
    },
    /// A client-side call's result or error, as `POST /v1/runs/{id}/tool-results`.
    ToolResult {
        run_id: String,
        call_id: String,
        #[serde(default)]
        result: Option<Value>,
        #[serde(default)]
        error: Option<String>,
        idempotency_key: String,
        #[serde(default)]
        request_id: Option<Value>,
    },
    Cancel {
        run_id: String,
        #[serde(default)]
        request_id: Option<Value>,
    },
}

/// Why a connection stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Closing {
    Open,
    /// The client did not take a frame within the send timeout.
    TooSlow,
    /// The socket failed or the client closed it.
    Gone,
}

/// What the connection's tasks share: the queue to the writer and the flag that stops them all.
#[derive(Clone)]
struct Outbox {
    tx: mpsc::Sender<Message>,
    capacity: usize,
    timeout: Duration,
    closing: Arc<watch::Sender<Closing>>,
    stats: Arc<WsStats>,
}

impl Outbox {
    /// Queues a frame; waits at most the send timeout for room, else cuts the connection off.
    async fn push(&self, message: Message) -> bool {
        match self.tx.send_timeout(message, self.timeout).await {
            Ok(()) => {
                let queued = self.capacity.saturating_sub(self.tx.capacity());
                self.stats.max_queued.fetch_max(queued, Ordering::Relaxed);
                true
            }
            Err(mpsc::error::SendTimeoutError::Timeout(_)) => {
                self.close(Closing::TooSlow);
                false
            }
            Err(mpsc::error::SendTimeoutError::Closed(_)) => false,
        }
    }

    async fn json(&self, value: &Value) -> bool {
        self.push(Message::Text(Utf8Bytes::from(value.to_string()))).await
    }

    async fn reply(&self, request_id: &Option<Value>, outcome: Result<Value, ApiError>) -> bool {
        let mut reply = json!({"type": "reply"});
        if let Some(id) = request_id {
            // Echoed so the client can match the reply, masked like anything else it sent.
            reply["requestId"] = keel_core::mask::mask_value(id);
        }
        match outcome {
            Ok(result) => reply["result"] = result,
            Err(e) => {
                let mut error = json!({"code": e.code, "message": e.message});
                // the same object an HTTP answer carries (`firstHeldSequence` of EVENTS_PRUNED)
                if let (Some(fields), Some(object)) = (e.fields, error.as_object_mut()) {
                    object.extend(fields);
                }
                reply["error"] = error;
            }
        }
        self.json(&reply).await
    }

    fn close(&self, why: Closing) {
        self.closing.send_if_modified(|now| {
            let first = *now == Closing::Open;
            if first {
                *now = why;
            }
            first
        });
    }
}

async fn connection(state: AppState, caller: Caller, socket: WebSocket) {
    let stats = state.ws.clone();
    stats.open.fetch_add(1, Ordering::Relaxed);
    let capacity = state.config.ws_buffer.max(1);
    let (tx, rx) = mpsc::channel::<Message>(capacity);
    let (closing, mut closed) = watch::channel(Closing::Open);
    let outbox = Outbox {
        tx,
        capacity,
        timeout: state.config.ws_send_timeout,
        closing: Arc::new(closing),
        stats: stats.clone(),
    };
    let (sink, mut stream) = socket.split();
    let writer = tokio::spawn(write(sink, rx, outbox.clone(), state.config.heartbeat));
    let mut subscriptions: HashMap<RunId, JoinHandle<()>> = HashMap::new();
    let shutdown = state.shutdown.wait();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            biased;
            () = stopped(&mut closed) => break,
            () = &mut shutdown => {
                let frame = CloseFrame { code: 1001, reason: Utf8Bytes::from_static("the server is stopping") };
                outbox.push(Message::Close(Some(frame))).await;
                break;
            }
            incoming = stream.next() => match incoming {
                Some(Ok(Message::Text(text))) => {
                    handle(&state, &caller, &outbox, &mut subscriptions, text.as_str()).await;
                }
                Some(Ok(Message::Binary(_))) => {
                    let e = ApiError::validation("binary messages are not understood; send JSON text");
                    outbox.reply(&None, Err(e)).await;
                }
                Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
                Some(Ok(Message::Close(_))) | Some(Err(_)) | None => {
                    outbox.close(Closing::Gone);
                    break;
                }
            },
        }
    }
    let why = *outbox.closing.borrow();
    if why == Closing::TooSlow {
        stats.cut_off.fetch_add(1, Ordering::Relaxed);
        state.metrics.subscriber_dropped(crate::metrics::WEBSOCKET);
        tracing::info!(user = %caller.0, "WebSocket client too slow to drain its queue; cut off (it may resubscribe)");
    }
    for (run_id, task) in subscriptions {
        let finished = task.is_finished();
        task.abort();
        if !finished {
            if let Err(e) = state.engine.client_detached(&run_id).await {
                tracing::warn!(run_id = %run_id, error = %e, "handling a detached client failed");
            }
        }
    }
    if why == Closing::Open {
        // The server is stopping: let the writer send the close frame.
        drop(outbox);
        let _ = tokio::time::timeout(Duration::from_secs(1), writer).await;
    } else {
        writer.abort();
    }
    stats.open.fetch_sub(1, Ordering::Relaxed);
}

/// Resolves once the connection is closing (the guard `wait_for` returns is not kept across awaits).
async fn stopped(closed: &mut watch::Receiver<Closing>) {
    let _ = closed.wait_for(|c| *c != Closing::Open).await;
}

/// Drains the queue into the socket, a frame at a time, each within the send timeout; pings every
/// heartbeat so idle connections stay open through proxies.
async fn write(
    mut sink: futures::stream::SplitSink<WebSocket, Message>,
    mut rx: mpsc::Receiver<Message>,
    outbox: Outbox,
    heartbeat: Duration,
) {
    let timeout = outbox.timeout;
    let heartbeat = heartbeat.max(Duration::from_millis(1));
    let mut ping = tokio::time::interval_at(tokio::time::Instant::now() + heartbeat, heartbeat);
    ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let message = tokio::select! {
            next = rx.recv() => match next {
                Some(m) => m,
                None => break,
            },
            _ = ping.tick() => Message::Ping(Default::default()),
        };
        let closing = matches!(message, Message::Close(_));
        match tokio::time::timeout(timeout, sink.send(message)).await {
            Ok(Ok(())) if !closing => {}
            Ok(Ok(())) => break,
            Ok(Err(_)) => {
                outbox.close(Closing::Gone);
                break;
            }
            Err(_elapsed) => {
                outbox.close(Closing::TooSlow);
                break;
            }
        }
    }
}

async fn handle(
    state: &AppState,
    caller: &Caller,
    outbox: &Outbox,
    subscriptions: &mut HashMap<RunId, JoinHandle<()>>,
    text: &str,
) {
    let value: Value = match serde_json::from_str(text) {
        Ok(v) => v,
        Err(e) => {
            let e = ApiError::bad_request(
                "MALFORMED_JSON",
                format!("the message is not valid JSON: {}", crate::json_error::syntax(&e)),
            );
            outbox.reply(&None, Err(e)).await;
            return;
        }
    };
    let request_id = value.get("requestId").cloned();
    let request: Request = match crate::json_error::from_value(value) {
        Ok(r) => r,
        Err(e) => {
            outbox.reply(&request_id, Err(ApiError::validation(e))).await;
            return;
        }
    };
    let engine = &state.engine;
    let run_not_found = || ApiError::from(EngineError::NotFound("run"));
    let parse_run = |raw: &str| RunId::parse(raw).map_err(|_| run_not_found());
    match request {
        Request::Subscribe { run_id, after, request_id } => {
            let outcome = async {
                let run_id = parse_run(&run_id)?;
                let after = after.unwrap_or(0);
                if after < 0 {
                    return Err(ApiError::bad_request("INVALID_CURSOR", "after: must be a non-negative integer"));
                }
                let run = engine.run(&caller.0, &run_id).await?;
                if after > run.last_sequence() {
                    return Err(ApiError::bad_request(
                        "CURSOR_OUT_OF_RANGE",
                        format!("the run's last event is {}; the cursor is past it", run.last_sequence()),
                    ));
                }
                crate::retention::check_held(engine, &run, after).await?;
                Ok((run_id, after, run.last_sequence()))
            }
            .await;
            match outcome {
                Ok((run_id, after, last)) => {
                    // Subscriptions that reached their run's end are done; a long-lived connection
                    // keeps only the live ones.
                    subscriptions.retain(|_, task| !task.is_finished());
                    if let Some(old) = subscriptions.remove(&run_id) {
                        old.abort();
                    }
                    let result = json!({"runId": run_id, "after": after, "lastSequence": last});
                    // The reply is queued before the subscription's first event.
                    if outbox.reply(&request_id, Ok(result)).await {
                        let task = tokio::spawn(subscription(
                            state.clone(),
                            outbox.clone(),
                            run_id.clone(),
                            after,
                            request_id,
                        ));
                        subscriptions.insert(run_id, task);
                    }
                }
                Err(e) => {
                    outbox.reply(&request_id, Err(e)).await;
                }
            }
        }
        Request::Unsubscribe { run_id, request_id } => {
            let outcome = parse_run(&run_id).map(|run_id| {
                let was = subscriptions.remove(&run_id).map(|task| task.abort()).is_some();
                json!({"runId": run_id, "subscribed": was})
            });
            outbox.reply(&request_id, outcome).await;
        }
        Request::CreateConversation { title, agent_id, request_id } => {
            let outcome = async {
                let created =
                    engine.create_conversation(&caller.0, title.as_deref().unwrap_or(""), agent_id.as_deref()).await?;
                serde_json::to_value(created).map_err(|e| ApiError::internal(&e))
            }
            .await;
            outbox.reply(&request_id, outcome).await;
        }
        Request::Send { conversation_id, content, cancel_on_disconnect, request_id } => {
            let outcome = async {
                let id = ConversationId::parse(&conversation_id)
                    .map_err(|_| ApiError::from(EngineError::NotFound("conversation")))?;
                let started =
                    engine.send_message(&caller.0, &id, SendMessage { content, cancel_on_disconnect }).await?;
                Ok(json!({"messageId": started.message.id, "runId": started.run.id}))
            }
            .await;
            outbox.reply(&request_id, outcome).await;
        }
        Request::Resume { run_id, interrupt_id, decision, idempotency_key, note, request_id } => {
            let outcome = async {
                let run_id = parse_run(&run_id)?;
                let interrupt_id = InterruptId::parse(&interrupt_id)
                    .map_err(|_| ApiError::validation("interruptId: must be an interrupt id (int_…)"))?;
                if decision.is_null() {
                    return Err(ApiError::validation("decision: required"));
                }
                let decision =
                    Decision::parse(&decision).map_err(|e| ApiError::from(EngineError::InvalidDecision(e)))?;
                let request = ResumeRequest { interrupt_id, decision, idempotency_key, note };
                let accepted = engine.resume(&caller.0, &run_id, request).await?;
                serde_json::to_value(accepted).map_err(|e| ApiError::internal(&e))
            }
            .await;
            outbox.reply(&request_id, outcome).await;
        }
        Request::ToolResult { run_id, call_id, result, error, idempotency_key, request_id } => {
            let outcome = async {
                let run_id = parse_run(&run_id)?;
                let outcome = super::runs::client_outcome(result, error)?;
                let request = ToolResultRequest { call_id, outcome, idempotency_key };
                let accepted = engine.submit_tool_result(&caller.0, &run_id, request).await?;
                serde_json::to_value(accepted).map_err(|e| ApiError::internal(&e))
            }
            .await;
            outbox.reply(&request_id, outcome).await;
        }
        Request::Cancel { run_id, request_id } => {
            let outcome = async {
                let run_id = parse_run(&run_id)?;
                engine.cancel(&caller.0, &run_id).await?;
                let view = engine.run_view(&caller.0, &run_id).await?;
                serde_json::to_value(RunBody::from(view)).map_err(|e| ApiError::internal(&e))
            }
            .await;
            outbox.reply(&request_id, outcome).await;
        }
    }
}

/// Forwards one run's events after `after`, stored then live, until its terminal event.
async fn subscription(state: AppState, outbox: Outbox, run_id: RunId, after: i64, request_id: Option<Value>) {
    let events = state.engine.events(&run_id, after, Until::Terminal, Known::Unknown);
    tokio::pin!(events);
    while let Some(next) = events.next().await {
        match next {
            Ok(event) => match serde_json::to_value(&event) {
                Ok(value) => {
                    if !outbox.json(&value).await {
                        return;
                    }
                    // Queued for the socket's writer: as "delivered" as an SSE frame handed to hyper.
                    state.metrics.event_delivered(crate::metrics::WEBSOCKET);
                }
                Err(e) => {
                    tracing::error!(run_id = %run_id, error = %e, "encoding an event failed");
                    return;
                }
            },
            Err(e) => {
                tracing::error!(run_id = %run_id, error = %e, "reading the run's events for a WebSocket failed");
                outbox.reply(&request_id, Err(ApiError::from(e))).await;
                return;
            }
        }
    }
}
