//! A typed client for Keel's HTTP API (v1).
//!
//! ```no_run
//! # async fn demo() -> Result<(), keel_client::ClientError> {
//! use futures::StreamExt;
//! use keel_client::KeelClient;
//!
//! let keel = KeelClient::new("http://127.0.0.1:8080").with_api_key("keel_…")?;
//! let conv = keel.create_conversation("troubleshoot payment-api").await?;
//! let sent = keel.send_message(&conv.id, "Restart the abnormal instance of payment-api").await?;
//! let mut events = keel.events(&sent.run_id, 0);
//! while let Some(event) = events.next().await {
//!     let event = event?;
//!     println!("{} {}", event.sequence, event.type_name());
//!     if event.is_pausing() {
//!         break; // an interrupt: ask the human, then `resume`
//!     }
//! }
//! # Ok(())
//! # }
//! ```
//!
//! - Requests and responses are the server's own types, from [`keel_core::wire`] (re-exported
//!   here): the two sides can't disagree on a field.
//! - [`KeelClient::events`] is the "reconnect with `Last-Event-ID`" client of docs/events.md: it follows a run's
//!   event stream to its terminal event across dropped connections and server restarts, backing
//!   off, delivering every event once, in order. The SSE parser it uses is [`sse::SseParser`].
//! - [`KeelClient::resume`] (and [`KeelClient::resume_with_note`], a decision with the decider's
//!   note) makes its own idempotency key and retries with it, so a lost answer never applies a
//!   decision twice; reads are retried on transport failures; other writes are not.
//! - [`KeelClient::list_agents`] lists the server's agents; [`KeelClient::create_conversation_with_agent`]
//!   starts a conversation with one of them.
//! - [`KeelClient::with_api_key`] sends `Authorization: Bearer <key>`; the key never shows in
//!   `Debug` output.
//!
//! `examples/approve.rs` is a whole approval flow; `keel chat` (in `crates/keel/src/client/`) is a
//! terminal client built on this crate.
#![forbid(unsafe_code)]

pub mod resume;
pub mod sse;

use futures::Stream;
use keel_core::engine::{ConversationView, ResumeAccepted};
use keel_core::{ConversationId, Event, InterruptId, RunId, RunStatus, Timestamp};
use reqwest::header::{HeaderMap, HeaderValue, AUTHORIZATION};
use reqwest::{Method, RequestBuilder, Response, StatusCode};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::time::Duration;

pub use keel_core::agent::{AgentInfo, ToolInfo};
pub use keel_core::wire::{
    CreateConversation, MessageAccepted, PostMessage, ResumeBody, RunBody, RunList, RunSummary, ToolCallBody, TurnBody,
};

pub use resume::{ReconnectPolicy, Resumer, Step};
pub use sse::{SseFrame, SseParser};

/// Everything a client call can fail with.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The server answered with a non-2xx status and (usually) `{"error": {"code", "message"}}`.
    /// When the body is not that shape, `code` is `HTTP_<status>` and `message` the start of the
    /// body.
    #[error("HTTP {status} {code}: {message}")]
    Api { status: StatusCode, code: String, message: String },
    /// The request could not be sent, or the response body could not be read.
    #[error("HTTP transport error: {0}")]
    Http(#[from] reqwest::Error),
    /// A response (or an SSE event's `data`) is not the JSON expected.
    #[error("unexpected JSON ({context}): {source}")]
    Decode {
        context: String,
        #[source]
        source: serde_json::Error,
    },
    /// The server broke the protocol (wrong content type, an event of another run, a huge line).
    #[error("protocol error: {0}")]
    Protocol(String),
    /// An event stream skipped sequences.
    #[error("event stream gap: expected sequence {expected}, got {got}")]
    SequenceGap { expected: i64, got: i64 },
    /// An event stream ended before the run's terminal event.
    #[error("the event stream ended before the run's terminal event")]
    StreamEnded,
    /// No bytes on an event stream (not even a heartbeat) for this long.
    #[error("no data on the event stream for {0:?}")]
    IdleTimeout(Duration),
    /// An event stream kept failing: `attempts` reconnects in a row brought no new event.
    #[error("gave up on the event stream after {attempts} reconnects (last sequence {last_sequence}): {last}")]
    ReconnectsExhausted {
        attempts: u32,
        last_sequence: i64,
        #[source]
        last: Box<ClientError>,
    },
}

impl ClientError {
    /// The HTTP status of an API error.
    pub fn status(&self) -> Option<StatusCode> {
        match self {
            ClientError::Api { status, .. } => Some(*status),
            ClientError::Http(e) => e.status(),
            _ => None,
        }
    }

    /// The server's error code of an API error (`RUN_ACTIVE`, `INTERRUPT_EXPIRED`, …).
    pub fn code(&self) -> Option<&str> {
        match self {
            ClientError::Api { code, .. } => Some(code),
            _ => None,
        }
    }

    /// Worth retrying: transport failures, timeouts, 408, 429 and 5xx.
    pub fn is_retryable(&self) -> bool {
        match self {
            ClientError::Api { status, .. } => {
                status.is_server_error()
                    || *status == StatusCode::TOO_MANY_REQUESTS
                    || *status == StatusCode::REQUEST_TIMEOUT
            }
            ClientError::Http(_)
            | ClientError::StreamEnded
            | ClientError::IdleTimeout(_)
            | ClientError::SequenceGap { .. } => true,
            ClientError::Decode { .. } | ClientError::Protocol(_) | ClientError::ReconnectsExhausted { .. } => false,
        }
    }
}

/// `POST /v1/conversations` → 201.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Conversation {
    pub id: ConversationId,
    #[serde(default)]
    pub title: Option<String>,
    /// The agent it talks to (`None` from a server older than agents).
    #[serde(default)]
    pub agent_id: Option<String>,
    pub created_at: Timestamp,
}

/// `GET /v1/agents` → 200: the agents the server runs, one of them the default.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AgentList {
    pub agents: Vec<AgentInfo>,
}

impl AgentList {
    /// The agent conversations that name none talk to.
    pub fn default_agent(&self) -> Option<&AgentInfo> {
        self.agents.iter().find(|a| a.default)
    }
}

/// `POST /v1/conversations/{id}/messages` → 202 `{messageId, runId}`.
pub type SentMessage = MessageAccepted;

/// `GET /v1/runs` parameters: at most `limit` runs (the server's default is 20, its cap 100), only
/// those with `status`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ListRuns {
    pub status: Option<RunStatus>,
    pub limit: Option<u32>,
}

/// A client of one Keel server. Cheap to clone (the connection pool is shared). Its `Debug` output
/// never shows the API key.
#[derive(Debug, Clone)]
pub struct KeelClient {
    http: reqwest::Client,
    base: String,
    /// `Authorization`, sent with every request (the key marked sensitive).
    identity: HeaderMap,
    reconnect: ReconnectPolicy,
}

impl KeelClient {
    /// A client of the server at `base_url` (e.g. `http://127.0.0.1:8080`; a trailing `/` is
    /// ignored, a path prefix is kept).
    pub fn new(base_url: impl Into<String>) -> Self {
        Self::with_http(base_url, reqwest::Client::new())
    }

    /// Like [`KeelClient::new`], with a configured `reqwest` client (timeouts, proxies …). Avoid a
    /// total request timeout if you use [`KeelClient::events`]: event streams are long-lived.
    pub fn with_http(base_url: impl Into<String>, http: reqwest::Client) -> Self {
        let mut base = base_url.into();
        while base.ends_with('/') {
            base.pop();
        }
        Self { http, base, identity: HeaderMap::new(), reconnect: ReconnectPolicy::default() }
    }

    /// Authenticates with an API key: sends `Authorization: Bearer <key>` with every request,
    /// event-stream reconnects included. A key that can't be a header value (a control character,
    /// a newline) is [`ClientError::Protocol`], before anything is sent.
    pub fn with_api_key(mut self, key: &str) -> Result<Self, ClientError> {
        let mut value = HeaderValue::from_str(&format!("Bearer {}", key.trim()))
            .map_err(|_| ClientError::Protocol("the API key is not a valid header value".into()))?;
        value.set_sensitive(true);
        self.identity.insert(AUTHORIZATION, value);
        Ok(self)
    }

    /// How [`KeelClient::events`] streams reconnect, and how often [`KeelClient::resume`] retries.
    pub fn reconnect_policy(mut self, policy: ReconnectPolicy) -> Self {
        self.reconnect = policy;
        self
    }

    /// The base URL, without a trailing `/`.
    pub fn base_url(&self) -> &str {
        &self.base
    }

    /// `POST /v1/conversations {"title"}`: a conversation with the server's default agent.
    pub async fn create_conversation(&self, title: &str) -> Result<Conversation, ClientError> {
        let body = CreateConversation { title: Some(title.to_owned()), agent_id: None };
        send_json(self.request(Method::POST, "/v1/conversations").json(&body), "create_conversation").await
    }

    /// `POST /v1/conversations {"title", "agentId"}`: a conversation with the agent `agent_id` (one
    /// of [`KeelClient::list_agents`]). An id the server does not run is a 422 `UNKNOWN_AGENT`.
    pub async fn create_conversation_with_agent(
        &self,
        title: &str,
        agent_id: &str,
    ) -> Result<Conversation, ClientError> {
        let body = CreateConversation { title: Some(title.to_owned()), agent_id: Some(agent_id.to_owned()) };
        send_json(self.request(Method::POST, "/v1/conversations").json(&body), "create_conversation").await
    }

    /// `GET /v1/agents`: every agent of the server, with its description, suggestions and tools.
    pub async fn list_agents(&self) -> Result<AgentList, ClientError> {
        self.get_json(self.request(Method::GET, "/v1/agents"), "list_agents").await
    }

    /// `GET /v1/conversations/{id}`: the conversation with recent messages, facts, active run.
    pub async fn get_conversation(&self, conversation_id: &ConversationId) -> Result<ConversationView, ClientError> {
        let req = self.request(Method::GET, &format!("/v1/conversations/{conversation_id}"));
        self.get_json(req, "get_conversation").await
    }

    /// `POST /v1/conversations/{id}/messages {"content"}` → `{messageId, runId}` (the run is
    /// queued; follow it with [`KeelClient::events`]).
    pub async fn send_message(
        &self,
        conversation_id: &ConversationId,
        content: &str,
    ) -> Result<SentMessage, ClientError> {
        let body = PostMessage { content: content.to_owned(), cancel_on_disconnect: false, multitask_strategy: None };
        let req = self.request(Method::POST, &format!("/v1/conversations/{conversation_id}/messages")).json(&body);
        send_json(req, "send_message").await
    }

    /// `GET /v1/runs`: the caller's runs, newest first.
    pub async fn list_runs(&self, params: ListRuns) -> Result<RunList, ClientError> {
        let mut query: Vec<(&str, String)> = Vec::new();
        if let Some(status) = params.status {
            query.push(("status", status.as_str().to_owned()));
        }
        if let Some(limit) = params.limit {
            query.push(("limit", limit.to_string()));
        }
        self.get_json(self.request(Method::GET, "/v1/runs").query(&query), "list_runs").await
    }

    /// `GET /v1/runs/{id}`: status, checkpoint step, pending interrupt, last sequence, tool calls,
    /// and every interrupt with who decided it and when.
    pub async fn get_run(&self, run_id: &RunId) -> Result<RunBody, ClientError> {
        self.get_json(self.request(Method::GET, &format!("/v1/runs/{run_id}")), "get_run").await
    }

    /// `POST /v1/runs/{id}/resume` with an idempotency key of its own: a new key per call, kept
    /// across this call's retries. A transport failure, a 5xx, a 429 or a 409
    /// `IDEMPOTENCY_KEY_IN_FLIGHT` is retried with the same key and body (backing off as
    /// [`ReconnectPolicy`] says, at most `max_attempts` times), so the decision is applied once
    /// even when an answer is lost: the server answers a retry with the first answer. `decision` is
    /// `"approve"`, `"reject"`, `{"edit": …}`, `{"calls": …}`, `{"select": …}` or `{"provide": …}`
    /// (see [`decision`]).
    pub async fn resume(
        &self,
        run_id: &RunId,
        interrupt_id: &InterruptId,
        decision: Value,
    ) -> Result<ResumeAccepted, ClientError> {
        self.resume_with_note(run_id, interrupt_id, decision, None).await
    }

    /// [`KeelClient::resume`] with a `note`: why, in the decider's words (at most 2,000
    /// characters). The server stores it, masked, with the decision; the `resumed` event and the
    /// run's interrupts show it. `None` sends no note.
    pub async fn resume_with_note(
        &self,
        run_id: &RunId,
        interrupt_id: &InterruptId,
        decision: Value,
        note: Option<&str>,
    ) -> Result<ResumeAccepted, ClientError> {
        let key = format!("keel-client-{interrupt_id}-{}", uuid::Uuid::now_v7().simple());
        let body = ResumeBody {
            interrupt_id: interrupt_id.to_string(),
            decision: Some(decision),
            idempotency_key: Some(key),
            note: note.map(str::to_owned),
        };
        let mut failures = 0;
        loop {
            match self.send_resume(run_id, &body).await {
                Err(err) if failures < self.reconnect.max_attempts && retry_resume(&err) => {
                    failures += 1;
                    tokio::time::sleep(self.reconnect.backoff(failures, None)).await;
                }
                other => return other,
            }
        }
    }

    /// `POST /v1/runs/{id}/resume {"interruptId", "decision", "idempotencyKey"}` with the caller's
    /// key, once. The same key with the same body returns the first answer again.
    pub async fn resume_with_key(
        &self,
        run_id: &RunId,
        interrupt_id: &InterruptId,
        decision: Value,
        idempotency_key: &str,
    ) -> Result<ResumeAccepted, ClientError> {
        let body = ResumeBody {
            interrupt_id: interrupt_id.to_string(),
            decision: Some(decision),
            idempotency_key: Some(idempotency_key.to_owned()),
            note: None,
        };
        self.send_resume(run_id, &body).await
    }

    /// `POST /v1/runs/{id}/resume` with this body, once: the caller's idempotency key (or none, if
    /// it sends one another way), decision and note.
    pub async fn send_resume(&self, run_id: &RunId, body: &ResumeBody) -> Result<ResumeAccepted, ClientError> {
        let req = self.request(Method::POST, &format!("/v1/runs/{run_id}/resume")).json(body);
        send_json(req, "resume").await
    }

    /// `POST /v1/runs/{id}/cancel`: a durable cancel. Returns the run as it is now.
    pub async fn cancel(&self, run_id: &RunId) -> Result<RunBody, ClientError> {
        send_json(self.request(Method::POST, &format!("/v1/runs/{run_id}/cancel")), "cancel").await
    }

    /// The run's events with sequence > `after` (0: from the start), from
    /// `GET /v1/runs/{id}/events` with `Last-Event-ID`, until its terminal event (`done`, `error`,
    /// `cancelled`), after which the stream ends.
    ///
    /// If the connection drops (or goes silent for [`ReconnectPolicy::idle_timeout`]) first, it
    /// reconnects with `Last-Event-ID: <last delivered sequence>`, backing off, and skips any
    /// event it already delivered: each event comes once, in sequence order. It gives up with
    /// [`ClientError::ReconnectsExhausted`] after [`ReconnectPolicy::max_attempts`] reconnects in a
    /// row without a new event. A 4xx other than 408/429 (unknown run, cursor past the end), an
    /// undecodable event or a protocol violation ends the stream with that error at once. The
    /// stream does not end at an `interrupt`: the run is paused, and the server keeps the stream
    /// open (with heartbeats) until it resumes.
    pub fn events(
        &self,
        run_id: &RunId,
        after: i64,
    ) -> impl Stream<Item = Result<Event, ClientError>> + Send + Unpin + 'static {
        resume::EventStream::new(
            self.http.clone(),
            self.url(&format!("/v1/runs/{run_id}/events")),
            self.identity.clone(),
            run_id.clone(),
            self.reconnect.clone(),
            after,
        )
        .into_stream()
    }

    /// A read: safe to send again, so a transport failure (a pooled connection the server or a proxy
    /// closed, a server restarting) is retried with backoff, at most `max_attempts` times.
    async fn get_json<T: DeserializeOwned>(&self, req: RequestBuilder, what: &str) -> Result<T, ClientError> {
        let mut failures = 0;
        loop {
            let Some(attempt) = req.try_clone() else { return send_json(req, what).await };
            match send_json(attempt, what).await {
                Err(ClientError::Http(_)) if failures < self.reconnect.max_attempts => {
                    failures += 1;
                    tokio::time::sleep(self.reconnect.backoff(failures, None)).await;
                }
                other => return other,
            }
        }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    fn request(&self, method: Method, path: &str) -> RequestBuilder {
        self.http
            .request(method, self.url(path))
            .header(reqwest::header::ACCEPT, "application/json")
            .headers(self.identity.clone())
    }
}

/// Worth sending the same resume again: it may not have arrived, or the first is still in flight.
fn retry_resume(err: &ClientError) -> bool {
    matches!(err, ClientError::Http(_)) || err.is_retryable() || err.code() == Some("IDEMPOTENCY_KEY_IN_FLIGHT")
}

/// The `decision` values of a resume.
pub mod decision {
    use serde_json::{json, Map, Value};

    /// Approve every call of the interrupt.
    pub fn approve() -> Value {
        json!("approve")
    }

    /// Reject every call of the interrupt: no side effect.
    pub fn reject() -> Value {
        json!("reject")
    }

    /// Approve, with these calls' arguments replaced (`(callId, args)` pairs).
    pub fn edit<'a>(calls: impl IntoIterator<Item = (&'a str, Value)>) -> Value {
        let edits: Map<String, Value> = calls.into_iter().map(|(id, args)| (id.to_owned(), args)).collect();
        json!({ "edit": edits })
    }
}

async fn send_json<T: DeserializeOwned>(req: RequestBuilder, what: &str) -> Result<T, ClientError> {
    let resp = req.send().await?;
    if !resp.status().is_success() {
        return Err(api_error(resp).await);
    }
    let body = resp.bytes().await?;
    let body: &[u8] = if body.iter().all(u8::is_ascii_whitespace) { b"null" } else { &body };
    serde_json::from_slice(body).map_err(|source| ClientError::Decode { context: what.to_owned(), source })
}

/// The [`ClientError::Api`] for a non-2xx response.
pub(crate) async fn api_error(resp: Response) -> ClientError {
    #[derive(Deserialize)]
    struct Envelope {
        error: Detail,
    }
    #[derive(Deserialize)]
    struct Detail {
        code: String,
        #[serde(default)]
        message: String,
    }

    let status = resp.status();
    let body = resp.bytes().await.unwrap_or_default();
    match serde_json::from_slice::<Envelope>(&body) {
        Ok(Envelope { error }) => ClientError::Api { status, code: error.code, message: error.message },
        Err(_) => {
            let text = String::from_utf8_lossy(&body);
            let message: String = text.trim().chars().take(500).collect();
            ClientError::Api { status, code: format!("HTTP_{}", status.as_u16()), message }
        }
    }
}
