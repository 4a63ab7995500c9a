//! `OpenAiCompatible`: a streaming client for the Chat Completions API, as OpenAI, Azure OpenAI,
//! vLLM, Ollama, llama.cpp's server and most gateways speak it.
//!
//! One model call is one `POST {base_url}/chat/completions` with `stream: true`. Text deltas are
//! passed on as they arrive; tool-call fragments are put together by their `index` and handed over,
//! whole, when the choice finishes. Arguments that are not JSON become
//! `{"__invalid_json": "<raw text>"}`, which the engine's schema check rejects (for schemas with
//! `additionalProperties: false`) and reports to the model, instead of crashing the run.
//!
//! Failures before anything was passed on (connection errors, timeouts, 429, 5xx, a stream that
//! broke early) are retried with exponential backoff and jitter, honouring `Retry-After`, and end
//! in [`ModelError::Transient`]. Failures after text was passed on end in [`ModelError::Fatal`]:
//! another try would repeat text the engine already stored. Other 4xx answers are `Fatal` with the
//! server's message. The API key is never logged and never part of an error.
//!
//! Everything happens inside the returned stream and nothing is spawned: dropping the stream drops
//! the HTTP response, which closes the connection.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use keel_core::mask::truncate;
use keel_core::model::{Model, ModelChunk, ModelError, ModelMessage, ModelRequest, ModelStream, ModelToolCall};
use keel_core::tool::ToolSpec;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue, ACCEPT, AUTHORIZATION, CONTENT_TYPE, RETRY_AFTER};
use reqwest::{StatusCode, Url};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::time::Instant;

use crate::sse::SseParser;

/// The key of the object that stands in for tool-call arguments that are not valid JSON.
pub const INVALID_JSON_KEY: &str = "__invalid_json";

/// How much of invalid arguments, and of a server's error message, is kept.
const MAX_RAW_CHARS: usize = 2000;
const MAX_ERROR_CHARS: usize = 500;
/// How long to wait for the usage chunk and `[DONE]` once the answer finished (at most the idle
/// timeout): a server that keeps the connection open after that shouldn't hold up the run.
const AFTER_FINISH_WAIT: Duration = Duration::from_secs(2);
/// How much of an error response's body is read.
const MAX_ERROR_BODY: usize = 64 * 1024;

/// An API key. Its `Debug` prints `***` and it has no `Display`, so it can't end up in a log line or
/// an error by accident; [`ApiKey::expose`] is the one way to read it.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(String);

impl ApiKey {
    pub fn new(key: impl Into<String>) -> Self {
        Self(key.into())
    }

    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

impl From<String> for ApiKey {
    fn from(key: String) -> Self {
        Self(key)
    }
}

impl From<&str> for ApiKey {
    fn from(key: &str) -> Self {
        Self(key.to_owned())
    }
}

/// The settings of an [`OpenAiCompatible`] model. [`OpenAiConfig::new`] fills in the defaults.
#[derive(Clone, PartialEq)]
pub struct OpenAiConfig {
    /// The API root, e.g. `https://api.openai.com/v1` or `http://127.0.0.1:11434/v1`;
    /// `/chat/completions` is appended to its path (unless it already ends so), and a query string
    /// (Azure's `?api-version=…`) is kept.
    pub base_url: String,
    /// Sent as `Authorization: Bearer KEY` (or in [`OpenAiConfig::api_key_header`]); no header at
    /// all without a key. An empty key counts as none.
    pub api_key: Option<ApiKey>,
    /// Another header to carry the key as it is, e.g. `api-key` for Azure OpenAI; `None` means
    /// `Authorization: Bearer`.
    pub api_key_header: Option<String>,
    /// The `model` field: a model name, an Azure deployment name, an Ollama tag.
    pub model: String,
    pub temperature: Option<f32>,
    pub max_tokens: Option<u32>,
    /// Sent with every request (e.g. `OpenAI-Organization`). Their values are treated as secrets:
    /// never logged, `***` in `Debug`.
    pub extra_headers: Vec<(String, String)>,
    /// Time to open the TCP connection (and TLS, where the build has it).
    pub connect_timeout: Duration,
    /// Time from sending the request to the first text, tool-call or reasoning delta (headers
    /// included).
    pub first_token_timeout: Duration,
    /// Longest silence between two reads once the answer has started.
    pub idle_timeout: Duration,
    /// Further attempts after a retryable failure before anything was streamed.
    pub max_retries: u32,
    /// The first backoff; it doubles with every retry, with jitter.
    pub retry_base_delay: Duration,
    /// Caps the backoff and a server's `Retry-After`.
    pub max_retry_delay: Duration,
    /// Ask for token usage (`stream_options.include_usage`); turn off for servers that reject it.
    pub include_usage: bool,
}

impl OpenAiConfig {
    /// Defaults: no key, connect 10 s, first token 60 s, idle 30 s, 2 retries from 500 ms, waits
    /// capped at 30 s, usage asked for.
    pub fn new(base_url: impl Into<String>, model: impl Into<String>) -> Self {
        Self {
            base_url: base_url.into(),
            api_key: None,
            api_key_header: None,
            model: model.into(),
            temperature: None,
            max_tokens: None,
            extra_headers: Vec::new(),
            connect_timeout: Duration::from_secs(10),
            first_token_timeout: Duration::from_secs(60),
            idle_timeout: Duration::from_secs(30),
            max_retries: 2,
            retry_base_delay: Duration::from_millis(500),
            max_retry_delay: Duration::from_secs(30),
            include_usage: true,
        }
    }
}

impl fmt::Debug for OpenAiConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let headers: Vec<(&str, &str)> = self.extra_headers.iter().map(|(k, _)| (k.as_str(), "***")).collect();
        f.debug_struct("OpenAiConfig")
            .field("base_url", &redact_url_text(&self.base_url))
            .field("api_key", &self.api_key)
            .field("api_key_header", &self.api_key_header)
            .field("model", &self.model)
            .field("temperature", &self.temperature)
            .field("max_tokens", &self.max_tokens)
            .field("extra_headers", &headers)
            .field("connect_timeout", &self.connect_timeout)
            .field("first_token_timeout", &self.first_token_timeout)
            .field("idle_timeout", &self.idle_timeout)
            .field("max_retries", &self.max_retries)
            .field("retry_base_delay", &self.retry_base_delay)
            .field("max_retry_delay", &self.max_retry_delay)
            .field("include_usage", &self.include_usage)
            .finish()
    }
}

/// Token counts, as the server reports them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
}

#[derive(Debug, Default)]
struct UsageBook {
    last: Option<Usage>,
    total: Usage,
}

/// A model behind an OpenAI-compatible Chat Completions endpoint.
#[derive(Clone)]
pub struct OpenAiCompatible {
    inner: Arc<Inner>,
}

struct Inner {
    config: OpenAiConfig,
    client: reqwest::Client,
    url: Url,
    /// The URL without credentials or query, for messages.
    shown_url: String,
    headers: HeaderMap,
    usage: Mutex<UsageBook>,
}

impl fmt::Debug for OpenAiCompatible {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpenAiCompatible")
            .field("url", &self.inner.shown_url)
            .field("config", &self.inner.config)
            .finish()
    }
}

impl OpenAiCompatible {
    /// Checks the settings (URL, header names and values) and builds the HTTP client. Sends nothing.
    pub fn new(mut config: OpenAiConfig) -> Result<Self, ModelError> {
        let bad = |what: String| ModelError::Fatal(format!("invalid model settings: {what}"));
        if config.api_key.as_ref().is_some_and(|k| k.expose().trim().is_empty()) {
            config.api_key = None;
        }
        if config.model.trim().is_empty() {
            return Err(bad("the model name is empty".into()));
        }
        if config.temperature.is_some_and(|t| !t.is_finite() || t < 0.0) {
            return Err(bad("the temperature must be a number of at least 0".into()));
        }
        if config.max_tokens == Some(0) {
            return Err(bad("max_tokens must be at least 1".into()));
        }
        let mut url = Url::parse(config.base_url.trim())
            .map_err(|e| bad(format!("base URL {:?}: {e}", redact_url_text(&config.base_url))))?;
        if url.scheme() != "http" && url.scheme() != "https" {
            return Err(bad(format!(
                "base URL {:?}: only http and https are supported",
                redact_url_text(&config.base_url)
            )));
        }
        let path = url.path().trim_end_matches('/').to_owned();
        if !path.ends_with("/chat/completions") {
            url.set_path(&format!("{path}/chat/completions"));
        }
        let shown_url = redact_url(&url);

        let mut headers = HeaderMap::new();
        for (name, value) in &config.extra_headers {
            let header =
                HeaderName::from_bytes(name.trim().as_bytes()).map_err(|_| bad(format!("header name {name:?}")))?;
            let mut value = HeaderValue::from_str(value).map_err(|_| bad(format!("the value of header {name:?}")))?;
            value.set_sensitive(true);
            headers.append(header, value);
        }
        if let Some(key) = &config.api_key {
            let (name, value) = match &config.api_key_header {
                None => (AUTHORIZATION, format!("Bearer {}", key.expose().trim())),
                Some(h) => (
                    HeaderName::from_bytes(h.trim().as_bytes())
                        .map_err(|_| bad(format!("API key header name {h:?}")))?,
                    key.expose().trim().to_owned(),
                ),
            };
            let mut value = HeaderValue::from_str(&value)
                .map_err(|_| bad("the API key is not a valid header value (a newline or control character?)".into()))?;
            value.set_sensitive(true);
            headers.insert(name, value);
        }
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        headers.insert(ACCEPT, HeaderValue::from_static("text/event-stream"));

        let client = reqwest::Client::builder()
            .connect_timeout(config.connect_timeout)
            .tcp_nodelay(true)
            .user_agent(concat!("keel/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| bad(format!("HTTP client: {e}")))?;
        Ok(Self {
            inner: Arc::new(Inner { config, client, url, shown_url, headers, usage: Mutex::new(UsageBook::default()) }),
        })
    }

    pub fn config(&self) -> &OpenAiConfig {
        &self.inner.config
    }

    /// The usage the server reported for the last call that reported any.
    pub fn last_usage(&self) -> Option<Usage> {
        self.inner.usage.lock().map(|b| b.last).unwrap_or(None)
    }

    /// The usage of all calls so far, summed.
    pub fn total_usage(&self) -> Usage {
        self.inner.usage.lock().map(|b| b.total).unwrap_or_default()
    }
}

#[async_trait]
impl Model for OpenAiCompatible {
    fn name(&self) -> &str {
        "openai"
    }

    async fn stream(&self, request: ModelRequest) -> Result<ModelStream, ModelError> {
        let body = request_body(&self.inner.config, &request);
        let body = serde_json::to_vec(&body).map_err(|e| ModelError::Fatal(format!("encoding the request: {e}")))?;
        tracing::debug!(
            url = %self.inner.shown_url,
            model = %self.inner.config.model,
            messages = request.messages.len(),
            tools = request.tools.len(),
            "calling the model"
        );
        Ok(run(self.inner.clone(), body))
    }
}

/// The Chat Completions request for `request`.
fn request_body(config: &OpenAiConfig, request: &ModelRequest) -> Value {
    let messages: Vec<Value> = request.messages.iter().map(wire_message).collect();
    let mut body = json!({"model": config.model, "messages": messages, "stream": true});
    if config.include_usage {
        body["stream_options"] = json!({"include_usage": true});
    }
    if !request.tools.is_empty() {
        body["tools"] = Value::Array(request.tools.iter().map(wire_tool).collect());
    }
    if let Some(t) = config.temperature {
        body["temperature"] = json!(t);
    }
    if let Some(n) = config.max_tokens {
        body["max_tokens"] = json!(n);
    }
    body
}

fn wire_message(m: &ModelMessage) -> Value {
    match m {
        ModelMessage::System { content } => json!({"role": "system", "content": content}),
        ModelMessage::User { content } => json!({"role": "user", "content": content}),
        ModelMessage::Assistant { content, tool_calls } if tool_calls.is_empty() => {
            json!({"role": "assistant", "content": content})
        }
        ModelMessage::Assistant { content, tool_calls } => {
            let calls: Vec<Value> = tool_calls
                .iter()
                .map(|c| {
                    json!({"id": c.id, "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments.to_string()}})
                })
                .collect();
            let content = if content.is_empty() { Value::Null } else { json!(content) };
            json!({"role": "assistant", "content": content, "tool_calls": calls})
        }
        ModelMessage::Tool { call_id, name: _, content } => {
            json!({"role": "tool", "tool_call_id": call_id, "content": content})
        }
    }
}

fn wire_tool(t: &ToolSpec) -> Value {
    let empty = t.parameters.is_null() || t.parameters.as_object().is_some_and(|o| o.is_empty());
    let parameters = if empty { json!({"type": "object", "properties": {}}) } else { t.parameters.clone() };
    json!({"type": "function", "function": {"name": t.name, "description": t.description, "parameters": parameters}})
}

// ------------------------------------------------------------------------------------ the stream

fn run(inner: Arc<Inner>, body: Vec<u8>) -> ModelStream {
    Box::pin(async_stream::stream! {
        let mut retries = 0u32;
        loop {
            let mut emitted = false;
            let failure = match Attempt::start(&inner, &body).await {
                Err(f) => f,
                Ok(mut attempt) => loop {
                    match attempt.next().await {
                        Ok(Some(chunk)) => {
                            emitted = true;
                            yield Ok(chunk);
                        }
                        Ok(None) => return,
                        Err(f) => break f,
                    }
                },
            };
            let message = inner.scrub(failure.to_string());
            if emitted {
                tracing::warn!(error = %message, "the model stream failed after it had started answering");
                yield Err(ModelError::Fatal(format!(
                    "{message} (after the model had started answering; not retried, so no text is repeated)"
                )));
                return;
            }
            if !failure.retryable() {
                tracing::warn!(error = %message, "the model call failed");
                yield Err(ModelError::Fatal(message));
                return;
            }
            if retries >= inner.config.max_retries {
                tracing::warn!(error = %message, attempts = retries + 1, "the model call failed; giving up");
                let attempts = if retries == 0 { "1 attempt".to_owned() } else { format!("{} attempts", retries + 1) };
                yield Err(ModelError::Transient(format!("{message} (gave up after {attempts})")));
                return;
            }
            retries += 1;
            let delay = match failure.retry_after() {
                Some(d) => d.min(inner.config.max_retry_delay),
                None => backoff(inner.config.retry_base_delay, inner.config.max_retry_delay, retries),
            };
            tracing::warn!(error = %message, retry = retries, delay_ms = delay.as_millis() as u64, "the model call failed; retrying");
            tokio::time::sleep(delay).await;
        }
    })
}

/// `base · 2^(retry-1)`, capped, with "equal jitter": half fixed, half random.
fn backoff(base: Duration, cap: Duration, retry: u32) -> Duration {
    let full = base.saturating_mul(1u32 << (retry.saturating_sub(1)).min(20)).min(cap);
    full / 2 + full.mul_f64(random_fraction() / 2.0)
}

/// A number in [0, 1), random enough for jitter, without a dependency.
fn random_fraction() -> f64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0));
    (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}

/// Why one attempt failed.
#[derive(Debug)]
enum Failure {
    Connect(String),
    ConnectTimeout(Duration),
    FirstTokenTimeout(Duration),
    IdleTimeout(Duration),
    Status {
        status: StatusCode,
        retry_after: Option<Duration>,
        message: String,
    },
    /// The body could not be read on.
    Broken(String),
    /// The body ended before the answer did.
    Truncated,
    /// An `error` object inside the stream.
    InStream(String),
    Malformed(String),
    NoTls,
    NotEventStream(String),
}

impl Failure {
    fn retryable(&self) -> bool {
        match self {
            Failure::Connect(_)
            | Failure::ConnectTimeout(_)
            | Failure::FirstTokenTimeout(_)
            | Failure::IdleTimeout(_)
            | Failure::Broken(_)
            | Failure::Truncated
            | Failure::InStream(_) => true,
            Failure::Status { status, .. } => *status == StatusCode::TOO_MANY_REQUESTS || status.is_server_error(),
            Failure::Malformed(_) | Failure::NoTls | Failure::NotEventStream(_) => false,
        }
    }

    fn retry_after(&self) -> Option<Duration> {
        match self {
            Failure::Status { retry_after, .. } => *retry_after,
            _ => None,
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Connect(e) => write!(f, "could not reach the model server: {e}"),
            Failure::ConnectTimeout(d) => write!(f, "could not connect to the model server within {d:?}"),
            Failure::FirstTokenTimeout(d) => write!(f, "the model started no answer within {d:?}"),
            Failure::IdleTimeout(d) => write!(f, "the model stream stalled: nothing for {d:?}"),
            Failure::Status { status, message, .. } if message.is_empty() => write!(f, "the model server answered {status}"),
            Failure::Status { status, message, .. } => write!(f, "the model server answered {status}: {message}"),
            Failure::Broken(e) => write!(f, "the model stream broke off: {e}"),
            Failure::Truncated => f.write_str("the model stream ended before the answer was complete"),
            Failure::InStream(e) => write!(f, "the model server reported an error mid-stream: {e}"),
            Failure::Malformed(e) => write!(f, "the model server sent a malformed stream: {e}"),
            Failure::NoTls => f.write_str(
                "the base URL is https, but this build of Keel has no TLS support: use an http:// endpoint \
                 (e.g. a local server or a TLS-terminating proxy) or build keel-models with reqwest's rustls-tls feature",
            ),
            Failure::NotEventStream(e) => write!(f, "the model server did not answer with an event stream: {e}"),
        }
    }
}

/// One HTTP request and the reading of its stream.
struct Attempt {
    inner: Arc<Inner>,
    response: reqwest::Response,
    parser: SseParser,
    events: Vec<String>,
    calls: BTreeMap<usize, PartialCall>,
    pending: VecDeque<ModelChunk>,
    deadline: Instant,
    /// A text, tool-call or reasoning delta arrived: the first-token timeout gave way to the idle
    /// timeout.
    started: bool,
    /// The choice finished (its tool calls are queued); only usage and `[DONE]` may follow.
    finished: bool,
    /// Nothing more to read.
    done: bool,
}

#[derive(Debug, Default)]
struct PartialCall {
    id: String,
    name: String,
    arguments: String,
}

impl Attempt {
    async fn start(inner: &Arc<Inner>, body: &[u8]) -> Result<Self, Failure> {
        let deadline = Instant::now() + inner.config.first_token_timeout;
        let send = inner.client.post(inner.url.clone()).headers(inner.headers.clone()).body(body.to_vec()).send();
        let response = match tokio::time::timeout_at(deadline, send).await {
            Err(_) => return Err(Failure::FirstTokenTimeout(inner.config.first_token_timeout)),
            Ok(Err(e)) => return Err(send_failure(inner, e)),
            Ok(Ok(r)) => r,
        };
        let status = response.status();
        if !status.is_success() {
            let retry_after = retry_after(response.headers());
            let message = match tokio::time::timeout_at(deadline, read_limited(response)).await {
                Ok(text) => error_message(&text),
                Err(_) => String::new(),
            };
            return Err(Failure::Status { status, retry_after, message });
        }
        let json = response
            .headers()
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|ct| ct.trim_start().to_ascii_lowercase().starts_with("application/json"));
        if json {
            let text = tokio::time::timeout_at(deadline, read_limited(response)).await.unwrap_or_default();
            return Err(Failure::NotEventStream(error_message(&text)));
        }
        Ok(Self {
            inner: inner.clone(),
            response,
            parser: SseParser::default(),
            events: Vec::new(),
            calls: BTreeMap::new(),
            pending: VecDeque::new(),
            deadline,
            started: false,
            finished: false,
            done: false,
        })
    }

    /// The next chunk to pass on; `None` at the end of the answer.
    async fn next(&mut self) -> Result<Option<ModelChunk>, Failure> {
        loop {
            if let Some(chunk) = self.pending.pop_front() {
                return Ok(Some(chunk));
            }
            if self.done {
                return Ok(None);
            }
            let read = tokio::time::timeout_at(self.deadline, self.response.chunk()).await;
            let (idle, first) = (self.inner.config.idle_timeout, self.inner.config.first_token_timeout);
            match read {
                Err(_) if self.finished => {
                    tracing::debug!("the model stream went quiet after the answer; ending it");
                    self.done = true;
                }
                Err(_) if self.started => return Err(Failure::IdleTimeout(idle)),
                Err(_) => return Err(Failure::FirstTokenTimeout(first)),
                Ok(Err(e)) if self.finished => {
                    tracing::debug!(error = %describe(e), "the model stream broke off after the answer");
                    self.done = true;
                }
                Ok(Err(e)) => return Err(Failure::Broken(describe(e))),
                Ok(Ok(Some(bytes))) => {
                    self.parser.feed(&bytes, &mut self.events).map_err(|e| Failure::Malformed(e.to_string()))?;
                    self.handle_events()?;
                    if self.finished {
                        self.deadline = Instant::now() + idle.min(AFTER_FINISH_WAIT);
                    } else if self.started {
                        self.deadline = Instant::now() + idle;
                    }
                }
                Ok(Ok(None)) => {
                    self.parser.finish(&mut self.events).map_err(|e| Failure::Malformed(e.to_string()))?;
                    self.handle_events()?;
                    if !self.finished {
                        return Err(Failure::Truncated);
                    }
                    self.done = true;
                }
            }
        }
    }

    fn handle_events(&mut self) -> Result<(), Failure> {
        for data in std::mem::take(&mut self.events) {
            if self.done {
                break;
            }
            self.handle_event(&data)?;
        }
        Ok(())
    }

    fn handle_event(&mut self, data: &str) -> Result<(), Failure> {
        if data.trim() == "[DONE]" {
            self.finish();
            self.done = true;
            return Ok(());
        }
        let chunk: WireChunk = serde_json::from_str(data)
            .map_err(|e| Failure::Malformed(format!("{e} in {:?}", truncate(data, MAX_ERROR_CHARS))))?;
        if let Some(error) = chunk.error {
            if self.finished {
                return Ok(());
            }
            return Err(Failure::InStream(
                error_text(&error).unwrap_or_else(|| truncate(&error.to_string(), MAX_ERROR_CHARS)),
            ));
        }
        if let Some(u) = chunk.usage {
            let usage = Usage {
                prompt_tokens: u.prompt_tokens.unwrap_or(0),
                completion_tokens: u.completion_tokens.unwrap_or(0),
            };
            tracing::debug!(
                model = %self.inner.config.model,
                prompt_tokens = usage.prompt_tokens,
                completion_tokens = usage.completion_tokens,
                "model usage"
            );
            if let Ok(mut book) = self.inner.usage.lock() {
                book.last = Some(usage);
                book.total.prompt_tokens += usage.prompt_tokens;
                book.total.completion_tokens += usage.completion_tokens;
            }
        }
        for choice in chunk.choices.unwrap_or_default() {
            if choice.index.unwrap_or(0) != 0 || self.finished {
                continue;
            }
            if let Some(delta) = choice.delta {
                for text in [delta.content, delta.refusal].into_iter().flatten().filter(|t| !t.is_empty()) {
                    self.started = true;
                    self.pending.push_back(ModelChunk::Text(text));
                }
                if delta.reasoning_content.is_some_and(|r| !r.is_empty()) {
                    self.started = true;
                }
                for tc in delta.tool_calls.unwrap_or_default() {
                    self.started = true;
                    self.add_fragment(tc);
                }
            }
            if let Some(reason) = choice.finish_reason {
                tracing::debug!(finish_reason = %reason, "the model finished");
                self.finish();
            }
        }
        Ok(())
    }

    fn add_fragment(&mut self, tc: WireToolDelta) {
        let key = match tc.index {
            Some(i) => i,
            // Servers that leave out `index`: a new id starts a new call, the rest continue the last.
            None => {
                let by_id = tc.id.as_ref().and_then(|id| self.calls.iter().find(|(_, c)| &c.id == id).map(|(k, _)| *k));
                let last = self.calls.keys().next_back().copied();
                match (by_id, &tc.id, last) {
                    (Some(k), _, _) => k,
                    (None, Some(_), Some(l)) => l + 1,
                    (None, _, l) => l.unwrap_or(0),
                }
            }
        };
        let call = self.calls.entry(key).or_default();
        if let Some(id) = tc.id.filter(|id| !id.is_empty()) {
            if call.id.is_empty() {
                call.id = id;
            }
        }
        if let Some(f) = tc.function {
            if let Some(name) = f.name.filter(|n| !n.is_empty()) {
                if call.name.is_empty() {
                    call.name = name;
                }
            }
            if let Some(args) = f.arguments {
                call.arguments.push_str(&args);
            }
        }
    }

    /// The choice is over: its tool calls are complete.
    fn finish(&mut self) {
        if self.finished {
            return;
        }
        self.finished = true;
        for (index, call) in std::mem::take(&mut self.calls) {
            self.pending.push_back(ModelChunk::ToolCall(complete_call(index, call)));
        }
    }
}

fn complete_call(index: usize, call: PartialCall) -> ModelToolCall {
    let raw = call.arguments.trim();
    let arguments = if raw.is_empty() {
        json!({})
    } else {
        match serde_json::from_str::<Value>(raw) {
            // Some models encode the object twice.
            Ok(Value::String(s)) => match serde_json::from_str::<Value>(&s) {
                Ok(v @ Value::Object(_)) => v,
                _ => Value::String(s),
            },
            Ok(v) => v,
            Err(e) => {
                tracing::warn!(tool = %call.name, error = %e, "the model's tool-call arguments are not valid JSON");
                json!({ INVALID_JSON_KEY: truncate(raw, MAX_RAW_CHARS) })
            }
        }
    };
    let id = if call.id.is_empty() { format!("call_{index}_{:x}", (random_fraction() * 1e15) as u64) } else { call.id };
    ModelToolCall { id, name: call.name, arguments }
}

impl Inner {
    /// Takes the API key out of `text`, should a server have echoed it.
    fn scrub(&self, text: String) -> String {
        match &self.config.api_key {
            Some(key) if !key.expose().trim().is_empty() => text.replace(key.expose().trim(), "***"),
            _ => text,
        }
    }
}

fn send_failure(inner: &Inner, e: reqwest::Error) -> Failure {
    let timeout = e.is_timeout();
    let text = describe(e);
    if inner.url.scheme() == "https" && text.contains("scheme is not http") {
        return Failure::NoTls;
    }
    if timeout {
        return Failure::ConnectTimeout(inner.config.connect_timeout);
    }
    Failure::Connect(format!("{}: {text}", inner.shown_url))
}

/// An error and its causes on one line, without the URL (which may hold credentials).
fn describe(e: reqwest::Error) -> String {
    let e = e.without_url();
    let mut parts = vec![e.to_string()];
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        let text = s.to_string();
        if parts.last() != Some(&text) {
            parts.push(text);
        }
        source = s.source();
    }
    parts.join(": ")
}

/// Reads at most [`MAX_ERROR_BODY`] bytes of a response as text.
async fn read_limited(mut response: reqwest::Response) -> String {
    let mut buf = Vec::new();
    while let Ok(Some(chunk)) = response.chunk().await {
        buf.extend_from_slice(&chunk);
        if buf.len() >= MAX_ERROR_BODY {
            buf.truncate(MAX_ERROR_BODY);
            break;
        }
    }
    String::from_utf8_lossy(&buf).into_owned()
}

/// The message of an error body: OpenAI's `{"error": {"message": …}}`, a few other shapes, or the
/// text itself; truncated.
fn error_message(body: &str) -> String {
    let body = body.trim();
    match serde_json::from_str::<Value>(body) {
        Ok(v) => error_text(&v).unwrap_or_else(|| truncate(body, MAX_ERROR_CHARS)),
        Err(_) => truncate(body, MAX_ERROR_CHARS),
    }
}

fn error_text(v: &Value) -> Option<String> {
    let text = v
        .pointer("/error/message")
        .or_else(|| v.get("message"))
        .or_else(|| v.get("error").filter(|e| e.is_string()))
        .or_else(|| v.get("detail"))
        .and_then(Value::as_str)?;
    Some(truncate(text, MAX_ERROR_CHARS))
}

/// `retry-after-ms` (OpenAI) or `Retry-After` in seconds; HTTP dates are not honoured.
fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let number = |name: &str| {
        headers.get(name)?.to_str().ok()?.trim().parse::<f64>().ok().filter(|n| n.is_finite() && *n >= 0.0)
    };
    number("retry-after-ms")
        .map(|ms| ms / 1000.0)
        .or_else(|| number(RETRY_AFTER.as_str()))
        .map(|s| Duration::from_secs_f64(s.min(86_400.0)))
}

fn redact_url(url: &Url) -> String {
    let mut u = url.clone();
    let _ = u.set_username("");
    let _ = u.set_password(None);
    u.set_query(None);
    u.to_string()
}

fn redact_url_text(text: &str) -> String {
    match Url::parse(text.trim()) {
        Ok(u) => redact_url(&u),
        Err(_) => "<invalid URL>".to_owned(),
    }
}

// ------------------------------------------------------------------------------- wire types

#[derive(Debug, Deserialize)]
struct WireChunk {
    #[serde(default)]
    choices: Option<Vec<WireChoice>>,
    #[serde(default)]
    usage: Option<WireUsage>,
    #[serde(default)]
    error: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct WireChoice {
    #[serde(default)]
    index: Option<u32>,
    #[serde(default)]
    delta: Option<WireDelta>,
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(Debug, Deserialize)]
struct WireDelta {
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    refusal: Option<String>,
    #[serde(default)]
    tool_calls: Option<Vec<WireToolDelta>>,
    /// What reasoning models (DeepSeek-R1 on vLLM or Ollama, …) think before they answer: not
    /// passed on, but proof the model is working.
    #[serde(default, alias = "reasoning")]
    reasoning_content: Option<String>,
}

#[derive(Debug, Deserialize)]
struct WireToolDelta {
    #[serde(default)]
    index: Option<usize>,
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    function: Option<WireFunctionDelta>,
}

#[derive(Debug, Deserialize)]
struct WireFunctionDelta {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    arguments: Option<String>,
}

#[derive(Debug, Deserialize)]
struct WireUsage {
    #[serde(default)]
    prompt_tokens: Option<u64>,
    #[serde(default)]
    completion_tokens: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_with_jitter_and_is_capped() {
        let base = Duration::from_millis(100);
        let cap = Duration::from_secs(1);
        for retry in 1..=6 {
            let full = (base * (1 << (retry - 1))).min(cap);
            let d = backoff(base, cap, retry);
            assert!(d >= full / 2 && d <= full, "retry {retry}: {d:?}");
        }
        assert!(backoff(base, cap, 40) <= cap);
    }

    #[test]
    fn retry_after_headers() {
        let mut h = HeaderMap::new();
        assert_eq!(retry_after(&h), None);
        h.insert(RETRY_AFTER, HeaderValue::from_static("2"));
        assert_eq!(retry_after(&h), Some(Duration::from_secs(2)));
        h.insert("retry-after-ms", HeaderValue::from_static("150"));
        assert_eq!(retry_after(&h), Some(Duration::from_millis(150)));
        h.remove("retry-after-ms");
        h.insert(RETRY_AFTER, HeaderValue::from_static("Wed, 21 Oct 2015 07:28:00 GMT"));
        assert_eq!(retry_after(&h), None);
    }

    #[test]
    fn error_bodies() {
        assert_eq!(
            error_message(r#"{"error": {"message": "bad tools", "type": "invalid_request_error"}}"#),
            "bad tools"
        );
        assert_eq!(error_message(r#"{"error": "model not found"}"#), "model not found");
        assert_eq!(error_message("plain text"), "plain text");
        assert_eq!(error_message(&"x".repeat(2000)).chars().count(), MAX_ERROR_CHARS);
    }

    #[test]
    fn arguments() {
        let call =
            |args: &str| complete_call(0, PartialCall { id: "c".into(), name: "t".into(), arguments: args.into() });
        assert_eq!(call(r#"{"a": 1}"#).arguments, json!({"a": 1}));
        assert_eq!(call("  ").arguments, json!({}));
        assert_eq!(call(r#""{\"a\": 1}""#).arguments, json!({"a": 1}));
        assert_eq!(call(r#"{"a": 1"#).arguments, json!({INVALID_JSON_KEY: r#"{"a": 1"#}));
        assert!(complete_call(3, PartialCall::default()).id.starts_with("call_3_"));
    }

    #[test]
    fn invalid_arguments_fail_a_strict_schema() {
        let schema = json!({"type": "object", "properties": {"x": {"type": "string"}}, "additionalProperties": false});
        let args = json!({INVALID_JSON_KEY: "{\"x\": "});
        let schema = keel_core::tool::JsonSchema::compile(&schema).unwrap();
        assert!(schema.validate(&args).unwrap_err().rule.contains("does not allow"));
    }

    #[test]
    fn urls() {
        let m = OpenAiCompatible::new(OpenAiConfig::new("http://127.0.0.1:11434/v1/", "llama3.1")).unwrap();
        assert_eq!(m.inner.url.as_str(), "http://127.0.0.1:11434/v1/chat/completions");
        let m = OpenAiCompatible::new(OpenAiConfig::new(
            "https://user:pw@res.openai.azure.com/openai/deployments/gpt4o?api-version=2024-10-21",
            "gpt4o",
        ))
        .unwrap();
        assert_eq!(
            m.inner.url.as_str(),
            "https://user:pw@res.openai.azure.com/openai/deployments/gpt4o/chat/completions?api-version=2024-10-21"
        );
        assert_eq!(m.inner.shown_url, "https://res.openai.azure.com/openai/deployments/gpt4o/chat/completions");
        let m = OpenAiCompatible::new(OpenAiConfig::new("http://h/v1/chat/completions", "m")).unwrap();
        assert_eq!(m.inner.url.as_str(), "http://h/v1/chat/completions");
        assert!(OpenAiCompatible::new(OpenAiConfig::new("ftp://h/v1", "m")).is_err());
        assert!(OpenAiCompatible::new(OpenAiConfig::new("not a url", "m")).is_err());
        assert!(OpenAiCompatible::new(OpenAiConfig::new("http://h/v1", " ")).is_err());
    }

    #[test]
    fn settings_errors_and_debug_hide_secrets() {
        let mut c = OpenAiConfig::new("http://h/v1", "m");
        c.api_key = Some("sk-secret\nline".into());
        let e = OpenAiCompatible::new(c.clone()).unwrap_err();
        assert!(!format!("{e} {e:?}").contains("sk-secret"));
        c.api_key = Some("sk-secret".into());
        c.extra_headers = vec![("X-Proxy-Token".into(), "tok-secret".into())];
        let m = OpenAiCompatible::new(c).unwrap();
        let shown = format!("{m:?}");
        assert!(!shown.contains("sk-secret") && !shown.contains("tok-secret"), "{shown}");
        assert!(shown.contains("X-Proxy-Token"));
        let mut c = OpenAiConfig::new("http://h/v1", "m");
        c.api_key = Some("   ".into());
        assert!(OpenAiCompatible::new(c).unwrap().config().api_key.is_none());
    }
}
