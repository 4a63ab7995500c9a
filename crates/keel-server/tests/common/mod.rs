//! `TestApp`: the real server on `127.0.0.1:0` over a temporary SQLite database, the demo model and
//! the OpsPilot tools, with a reqwest client and helpers that return typed JSON.

#![allow(dead_code)]

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Once};
use std::time::{Duration, Instant};

use futures::StreamExt;
use keel_client::sse::{SseFrame, SseParser};
use keel_core::agent::Agents;
use keel_core::bus::LocalBus;
use keel_core::clock::SystemClock;
use keel_core::engine::{Engine, EngineConfig, EngineParts};
use keel_core::model::Model;
use keel_core::store::Store;
use keel_core::tool::Tool;
use keel_core::{Event, UserRole};
use keel_models::DemoModel;
use keel_opspilot::{Fleet, FleetSeed};
use keel_server::auth::{issue_api_key, AuthMode};
use keel_server::{AppState, ServerConfig, ServerMetrics};
use keel_store::{PostgresStore, SqliteStore};
use reqwest::header::{HeaderMap, HeaderValue, ACCEPT, AUTHORIZATION, CONTENT_TYPE};
use reqwest::StatusCode;
use serde_json::{json, Value};
use tempfile::TempDir;
use tokio::sync::oneshot;

/// How long any one wait in a test may take before it fails.
pub const DEADLINE: Duration = Duration::from_secs(20);

pub const RESTART_PROMPT: &str = "Restart the abnormal instance of payment-api";
pub const ERRORS_PROMPT: &str = "Look at the recent errors of payment-api";

#[derive(Clone)]
pub struct Options {
    pub heartbeat: Duration,
    pub interrupt_ttl: Duration,
    /// The demo model's pause before each word.
    pub demo_delay: Duration,
    pub demo_mode: bool,
    pub body_limit: usize,
    /// The server's settings; `heartbeat`, `demo_mode` and `body_limit` above win over these.
    pub server: ServerConfig,
    /// Instead of the demo model.
    pub model: Option<Arc<dyn Model>>,
    /// Extra tools beside OpsPilot's.
    pub extra_tools: Vec<Arc<dyn Tool>>,
    pub ws_send_timeout: Duration,
    pub ws_buffer: usize,
    /// `SO_SNDBUF` of the server's sockets (accepted sockets inherit the listener's): a small one
    /// lets a test fill the path to a client that stopped reading with little data.
    pub send_buffer: Option<u32>,
    /// Instead of a SQLite database in the temporary directory: this Postgres store (a schema of
    /// its own).
    pub postgres: Option<PostgresStore>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            heartbeat: Duration::from_secs(15),
            interrupt_ttl: Duration::from_secs(15 * 60),
            demo_delay: Duration::from_millis(1),
            demo_mode: false,
            body_limit: 1024 * 1024,
            server: ServerConfig { auth: AuthMode::Keys, ..ServerConfig::default() },
            model: None,
            extra_tools: Vec::new(),
            ws_send_timeout: Duration::from_secs(5),
            ws_buffer: 64,
            send_buffer: None,
            postgres: None,
        }
    }
}

pub struct TestApp {
    pub addr: SocketAddr,
    pub base: String,
    pub client: reqwest::Client,
    pub engine: Arc<Engine>,
    pub store: Arc<dyn Store>,
    /// OpsPilot's fleet (the default agent's).
    pub fleet: Arc<dyn Fleet>,
    /// API keys by user: `demo`, `alice`, `bob` and `mallory` are operators, `vera` a viewer. `client` sends
    /// demo's with every request unless the request names another.
    pub keys: HashMap<String, String>,
    /// The registry `GET /metrics` serves (the engine records into it).
    pub metrics: ServerMetrics,
    pub state: AppState,
    stop: Option<oneshot::Sender<()>>,
    _dir: TempDir,
}

fn init_tracing() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let filter = tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
        let _ = tracing_subscriber::fmt().with_env_filter(filter).with_test_writer().try_init();
    });
}

impl TestApp {
    pub async fn spawn() -> Self {
        Self::with(Options::default()).await
    }

    pub async fn with(options: Options) -> Self {
        init_tracing();
        let dir = tempfile::tempdir().expect("temp dir");
        let model = options.model.clone().unwrap_or_else(|| Arc::new(DemoModel::new(options.demo_delay)));
        let (store, (agent, fleet)): (Arc<dyn Store>, _) = match &options.postgres {
            Some(pg) => (
                Arc::new(pg.clone()),
                keel_opspilot::on_postgres(pg, model, FleetSeed::default()).await.expect("the demo fleet"),
            ),
            None => {
                let sqlite = SqliteStore::open(&dir.path().join("keel.db")).await.expect("open the store");
                let opened =
                    keel_opspilot::on_sqlite(&sqlite, model, FleetSeed::default()).await.expect("the demo fleet");
                (Arc::new(sqlite), opened)
            }
        };
        let mut keys = HashMap::new();
        for (user, role) in [
            ("demo", UserRole::Operator),
            ("alice", UserRole::Operator),
            ("bob", UserRole::Operator),
            ("mallory", UserRole::Operator),
            ("vera", UserRole::Viewer),
        ] {
            let issued = issue_api_key(store.as_ref(), user, role, chrono::Utc::now()).await.expect("an api key");
            keys.insert(user.to_owned(), issued.secret);
        }
        let mut agent = agent;
        for tool in &options.extra_tools {
            agent.tools.register(tool.clone()).expect("a valid extra tool");
        }
        let metrics = ServerMetrics::new();
        let engine = Arc::new(Engine::new(
            EngineParts {
                store: store.clone(),
                agents: Agents::single(agent),
                bus: Arc::new(LocalBus::default()),
                clock: Arc::new(SystemClock),
            },
            EngineConfig {
                steal_leases_on_start: true,
                interrupt_ttl: options.interrupt_ttl,
                sweep_interval: Duration::from_millis(50),
                poll_interval: Some(Duration::from_millis(200)),
                metrics: metrics.recorder(),
                ..EngineConfig::default()
            },
        ));
        engine.start().await.expect("start the engine");
        let config = ServerConfig {
            heartbeat: options.heartbeat,
            body_limit: options.body_limit,
            ws_send_timeout: options.ws_send_timeout,
            ws_buffer: options.ws_buffer,
            ..options.server
        };
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        if let Some(size) = options.send_buffer {
            socket.set_send_buffer_size(size).expect("SO_SNDBUF");
        }
        socket.bind("127.0.0.1:0".parse().expect("address")).expect("bind");
        let listener = socket.listen(1024).expect("listen");
        let addr = listener.local_addr().expect("local addr");
        let (stop, stopped) = oneshot::channel::<()>();
        let state = AppState::new(engine.clone(), config).with_metrics(metrics.clone());
        let routes = keel_opspilot::routes::routes(fleet.clone(), FleetSeed::default(), options.demo_mode);
        tokio::spawn(keel_server::serve(listener, state.clone(), routes, async move {
            let _ = stopped.await;
        }));
        Self {
            addr,
            base: format!("http://{addr}"),
            client: client_as(&keys["demo"]),
            engine,
            store,
            fleet,
            keys,
            metrics,
            state,
            stop: Some(stop),
            _dir: dir,
        }
    }

    /// The SQLite database file (its `-wal` beside it).
    pub fn db_path(&self) -> std::path::PathBuf {
        self._dir.path().join("keel.db")
    }

    /// The directory the SQLite database lives in.
    pub fn data_dir(&self) -> &std::path::Path {
        self._dir.path()
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    pub async fn get(&self, path: &str) -> (StatusCode, Value) {
        to_json(self.client.get(self.url(path)).send().await.expect("GET")).await
    }

    /// `Authorization: Bearer` with `user`'s key.
    pub fn bearer(&self, user: &str) -> String {
        format!("Bearer {}", self.keys.get(user).unwrap_or_else(|| panic!("no key for {user}")))
    }

    /// A client that sends `user`'s key with every request.
    pub fn client_for(&self, user: &str) -> reqwest::Client {
        client_as(&self.keys[user])
    }

    pub async fn get_as(&self, user: &str, path: &str) -> (StatusCode, Value) {
        to_json(self.client.get(self.url(path)).header(AUTHORIZATION, self.bearer(user)).send().await.expect("GET"))
            .await
    }

    pub async fn post_as(&self, user: &str, path: &str, body: &Value) -> (StatusCode, Value) {
        let request = self.client.post(self.url(path)).header(AUTHORIZATION, self.bearer(user)).json(body);
        to_json(request.send().await.expect("POST")).await
    }

    pub async fn post(&self, path: &str, body: &Value) -> (StatusCode, Value) {
        to_json(self.client.post(self.url(path)).json(body).send().await.expect("POST")).await
    }

    /// The request that opens `GET /v1/ws`, with `user`'s key (demo's when `None`).
    pub fn ws_request(&self, user: Option<&str>) -> tokio_tungstenite::tungstenite::handshake::client::Request {
        use tokio_tungstenite::tungstenite::client::IntoClientRequest;
        let mut request = format!("ws://{}/v1/ws", self.addr).into_client_request().expect("ws request");
        let bearer = self.bearer(user.unwrap_or("demo"));
        request.headers_mut().insert("authorization", bearer.parse().expect("header"));
        request
    }

    pub async fn create_conversation(&self) -> String {
        let (status, body) = self.post("/v1/conversations", &json!({"title": "troubleshoot payment-api"})).await;
        assert_eq!(status, StatusCode::CREATED, "{body}");
        body["id"].as_str().expect("conversation id").to_owned()
    }

    /// `POST …/messages` without negotiation: `202 {messageId, runId}`; returns the run id.
    pub async fn send(&self, conversation: &str, content: &str) -> String {
        let (status, body) =
            self.post(&format!("/v1/conversations/{conversation}/messages"), &json!({"content": content})).await;
        assert_eq!(status, StatusCode::ACCEPTED, "{body}");
        assert!(body["messageId"].as_str().unwrap().starts_with("msg_"), "{body}");
        body["runId"].as_str().expect("run id").to_owned()
    }

    /// `POST …/messages?wait=true`: the turn once the run pauses or ends.
    pub async fn send_and_wait(&self, conversation: &str, content: &str) -> Value {
        let (status, body) = self
            .post(&format!("/v1/conversations/{conversation}/messages?wait=true"), &json!({"content": content}))
            .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        body
    }

    /// `POST …/messages` with `Accept: text/event-stream`.
    pub async fn send_streaming(&self, conversation: &str, body: &Value) -> SseReader {
        let response = self
            .client
            .post(self.url(&format!("/v1/conversations/{conversation}/messages")))
            .header(ACCEPT, "text/event-stream")
            .json(body)
            .send()
            .await
            .expect("POST");
        SseReader::new(response)
    }

    /// `GET /v1/runs/{id}/events` as SSE, with `Last-Event-ID` when given.
    pub async fn events_stream(&self, run: &str, last_event_id: Option<i64>) -> SseReader {
        let mut request = self.client.get(self.url(&format!("/v1/runs/{run}/events")));
        if let Some(id) = last_event_id {
            request = request.header("last-event-id", id.to_string());
        }
        SseReader::new(request.send().await.expect("GET events"))
    }

    /// The stored events after `after`, as JSON.
    pub async fn events_json(&self, run: &str, after: i64) -> Vec<Event> {
        let response = self
            .client
            .get(self.url(&format!("/v1/runs/{run}/events?after={after}")))
            .header(ACCEPT, "application/json")
            .send()
            .await
            .expect("GET events");
        let (status, body) = to_json(response).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        serde_json::from_value(body["events"].clone()).expect("events")
    }

    pub async fn resume(&self, run: &str, interrupt: &str, decision: Value, key: &str) -> (StatusCode, Value) {
        self.post(
            &format!("/v1/runs/{run}/resume"),
            &json!({"interruptId": interrupt, "decision": decision, "idempotencyKey": key}),
        )
        .await
    }

    pub async fn run(&self, run: &str) -> Value {
        let (status, body) = self.get(&format!("/v1/runs/{run}")).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        body
    }

    /// Polls the run until `done(run)` holds; fails after [`DEADLINE`].
    pub async fn wait_for_run(&self, run: &str, what: &str, done: impl Fn(&Value) -> bool) -> Value {
        let view = eventually(what, || async {
            let view = self.run(run).await;
            done(&view).then_some(view)
        })
        .await;
        view
    }

    pub async fn wait_for_status(&self, run: &str, status: &str) -> Value {
        self.wait_for_run(run, &format!("run {run} {status}"), |v| v["status"] == status).await
    }

    pub async fn instance(&self, id: &str) -> Value {
        let (status, body) = self.get("/v1/demo/instances").await;
        assert_eq!(status, StatusCode::OK, "{body}");
        body.as_array().expect("array").iter().find(|i| i["id"] == id).cloned().expect("instance")
    }

    /// A conversation whose run waits for approval to restart pay-prod-2: (conversation, run, interrupt).
    pub async fn interrupted_run(&self) -> (String, String, String) {
        let conversation = self.create_conversation().await;
        let turn = self.send_and_wait(&conversation, RESTART_PROMPT).await;
        assert_eq!(turn["run"]["status"], "interrupted", "{turn}");
        let run = turn["run"]["id"].as_str().unwrap().to_owned();
        let interrupt = turn["interrupt"]["id"].as_str().unwrap().to_owned();
        (conversation, run, interrupt)
    }
}

impl Drop for TestApp {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

fn client_as(key: &str) -> reqwest::Client {
    let mut headers = HeaderMap::new();
    headers.insert(AUTHORIZATION, HeaderValue::from_str(&format!("Bearer {key}")).expect("a header value"));
    reqwest::Client::builder().default_headers(headers).build().expect("a client")
}

pub async fn to_json(response: reqwest::Response) -> (StatusCode, Value) {
    let status = response.status();
    let text = response.text().await.expect("body");
    let body = if text.is_empty() { Value::Null } else { serde_json::from_str(&text).unwrap_or(Value::String(text)) };
    (status, body)
}

/// Retries `check` until it gives a value; fails after [`DEADLINE`].
pub async fn eventually<T, F, Fut>(what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(start.elapsed() < DEADLINE, "timed out waiting for {what}");
        // A poll interval, not a wait for something: the condition is what ends the loop.
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// An SSE response read frame by frame, with the raw bytes kept for framing checks.
pub struct SseReader {
    pub status: StatusCode,
    pub headers: HeaderMap,
    body: Option<futures::stream::BoxStream<'static, reqwest::Result<bytes::Bytes>>>,
    parser: SseParser,
    pending: VecDeque<SseFrame>,
    pub raw: Vec<u8>,
}

impl SseReader {
    pub fn new(response: reqwest::Response) -> Self {
        let status = response.status();
        let headers = response.headers().clone();
        Self {
            status,
            headers,
            body: Some(response.bytes_stream().boxed()),
            parser: SseParser::new(),
            pending: VecDeque::new(),
            raw: Vec::new(),
        }
    }

    pub fn assert_sse(&self) {
        assert_eq!(self.status, StatusCode::OK);
        assert_eq!(self.headers.get(CONTENT_TYPE), Some(&HeaderValue::from_static("text/event-stream; charset=utf-8")));
        assert_eq!(self.headers.get("cache-control"), Some(&HeaderValue::from_static("no-cache, no-transform")));
        assert_eq!(self.headers.get("x-accel-buffering"), Some(&HeaderValue::from_static("no")));
    }

    /// The next frame; `None` once the response ended.
    pub async fn next_frame(&mut self) -> Option<SseFrame> {
        loop {
            if let Some(frame) = self.pending.pop_front() {
                return Some(frame);
            }
            let body = self.body.as_mut()?;
            match tokio::time::timeout(DEADLINE, body.next()).await.expect("an SSE frame in time") {
                Some(Ok(chunk)) => {
                    self.raw.extend_from_slice(&chunk);
                    self.pending.extend(self.parser.push(&chunk));
                }
                Some(Err(e)) => panic!("SSE body failed: {e}"),
                None => {
                    assert!(!self.parser.finish(), "the stream ended inside a frame");
                    self.body = None;
                }
            }
        }
    }

    /// The next event, skipping comments and `retry`; `None` once the response ended.
    pub async fn next_event(&mut self) -> Option<Event> {
        loop {
            match self.next_frame().await? {
                SseFrame::Event { id, event, data } => {
                    let parsed: Event = serde_json::from_str(&data).expect("event JSON");
                    assert_eq!(id.as_deref(), Some(parsed.sequence.to_string().as_str()), "id is the sequence");
                    assert_eq!(event.as_deref(), Some(parsed.type_name()), "event is the type");
                    return Some(parsed);
                }
                SseFrame::Retry(_) | SseFrame::Comment(_) => continue,
            }
        }
    }

    /// Every remaining event, until the response ends.
    pub async fn collect(&mut self) -> Vec<Event> {
        let mut out = Vec::new();
        while let Some(e) = self.next_event().await {
            out.push(e);
        }
        out
    }

    /// Stops reading: the connection closes as a client that went away would.
    pub fn disconnect(self) {}
}

/// Sequences are `first, first+1, …` with no gap and no repeat.
pub fn assert_contiguous(events: &[Event], first: i64) {
    for (i, e) in events.iter().enumerate() {
        assert_eq!(e.sequence, first + i as i64, "event {i} ({}) out of sequence", e.type_name());
    }
}

pub fn types(events: &[Event]) -> Vec<&'static str> {
    events.iter().map(Event::type_name).collect()
}
