//! The masking gate, end to end: secrets planted in every field of every write route (REST, AG-UI,
//! WebSocket, the resume's note and edited arguments, a tool's result) reach no response body, no
//! event, no log line and no byte of the database — the SQLite files under the data directory, or
//! a `pg_dump` of a Postgres schema. And a secret sent in a wrongly typed field never comes back in
//! the error. Its own test binary, so that it can capture every log line at TRACE.

#[path = "common/mod.rs"]
mod common;

use std::io::Write;
use std::sync::{Arc, Mutex, Once};

use async_trait::async_trait;
use futures::{SinkExt, StreamExt};
use keel_core::model::{Model, ModelChunk, ModelError, ModelMessage, ModelRequest, ModelStream, ModelToolCall};
use keel_core::tool::{Tool, ToolContext, ToolError, ToolOutput, ToolSpec};
use keel_store::PostgresStore;
use reqwest::header::{ACCEPT, AUTHORIZATION};
use reqwest::StatusCode;
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::Message;

use crate::common::{Options, TestApp, DEADLINE, RESTART_PROMPT};

/// The shapes the masker must catch: an OpenAI-style key, an AWS access key id, a `password=`
/// pair, a bearer token; Keel's own keys are added per test (a real key of another user).
const OPENAI: &str = "sk-proj-Zx9Qw8Er7Ty6Ui5Op4As3Df2";
const AWS: &str = "AKIAZ7QW3ER5TY8UI0PL";
const PASSWORD: &str = "Hunter2Secret";
const BEARER: &str = "tok3nValue9xyz";

/// Every log line of the process, at every level.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn logs() -> Captured {
    static LOGS: std::sync::OnceLock<Captured> = std::sync::OnceLock::new();
    static INIT: Once = Once::new();
    let logs = LOGS.get_or_init(Captured::default).clone();
    INIT.call_once(|| {
        let writer = logs.clone();
        // Every level of every crate, but what the binary always quietens.
        let mut filter = tracing_subscriber::EnvFilter::new("trace");
        for directive in keel_server::QUIET_LOG_TARGETS {
            filter = filter.add_directive(directive.parse().unwrap());
        }
        tracing_subscriber::fmt().with_env_filter(filter).with_writer(move || writer.clone()).with_ansi(false).init();
    });
    logs
}

/// A tool whose result carries every secret shape (the text is set once the keys exist).
struct LeakyTool(ToolSpec, Arc<Mutex<String>>);

#[async_trait]
impl Tool for LeakyTool {
    fn spec(&self) -> &ToolSpec {
        &self.0
    }
    async fn execute(&self, _ctx: &ToolContext, _args: &Value) -> Result<ToolOutput, ToolError> {
        let planted = self.1.lock().unwrap().clone();
        Ok(ToolOutput {
            result: json!({"note": planted, "password": PASSWORD, "aws": AWS}),
            summary: format!("read {planted}"),
            facts: vec![("service".into(), planted.clone()), ("db_password".into(), PASSWORD.into())],
        })
    }
}

/// The demo model, but a turn that asks to read the settings calls `read_settings` first.
struct SettingsThenDemo(keel_models::DemoModel);

#[async_trait]
impl Model for SettingsThenDemo {
    fn name(&self) -> &str {
        "settings-then-demo"
    }
    async fn stream(&self, request: ModelRequest) -> Result<ModelStream, ModelError> {
        let last_user = request.messages.iter().rposition(|m| matches!(m, ModelMessage::User { .. }));
        let asks = last_user.is_some_and(|i| {
            matches!(&request.messages[i], ModelMessage::User { content } if content.starts_with("Read the settings"))
        });
        let answered =
            last_user.is_some_and(|i| request.messages[i..].iter().any(|m| matches!(m, ModelMessage::Tool { .. })));
        if asks && !answered {
            let call = ModelToolCall { id: "call_settings".into(), name: "read_settings".into(), arguments: json!({}) };
            return Ok(Box::pin(futures::stream::iter([Ok(ModelChunk::ToolCall(call))])));
        }
        if asks {
            return Ok(Box::pin(futures::stream::iter([Ok(ModelChunk::Text("The settings are read.".into()))])));
        }
        self.0.stream(request).await
    }
}

/// Everything a client received, to be searched at the end: (what it answered, the body). The
/// label is the test's own (it may name the secret it sent); only the body is searched.
#[derive(Default)]
struct Seen(Vec<(String, String)>);

impl Seen {
    fn add(&mut self, what: &str, text: impl Into<String>) {
        self.0.push((what.to_owned(), text.into()));
    }
}

struct Gate {
    app: TestApp,
    /// The secrets' tell-tale parts: none of these may appear anywhere.
    secrets: Vec<String>,
    /// One text with every shape in it, as a user would paste it.
    planted: String,
    seen: Seen,
}

impl Gate {
    async fn new(postgres: Option<PostgresStore>) -> Self {
        let text = Arc::new(Mutex::new(String::new()));
        let tool = LeakyTool(
            ToolSpec::new(
                "read_settings",
                "Reads the settings.",
                json!({"type": "object", "properties": {}, "additionalProperties": false}),
                false,
            ),
            text.clone(),
        );
        let model = Arc::new(SettingsThenDemo(keel_models::DemoModel::new(std::time::Duration::from_millis(1))));
        let app = TestApp::with(Options {
            postgres,
            model: Some(model),
            extra_tools: vec![Arc::new(tool)],
            ..Options::default()
        })
        .await;
        // One of Keel's own keys: a real one, of another user.
        let keel_key = app.keys["bob"].clone();
        let planted =
            format!("key {OPENAI} aws {AWS} password={PASSWORD} Authorization: Bearer {BEARER} keel {keel_key} end");
        *text.lock().unwrap() = planted.clone();
        let secrets = vec![
            OPENAI.to_owned(),
            AWS.to_owned(),
            PASSWORD.to_owned(),
            BEARER.to_owned(),
            keel_key["keel_".len()..].to_owned(),
        ];
        Self { app, secrets, planted, seen: Seen::default() }
    }

    fn assert_clean(&self, what: &str, text: &str) {
        for secret in &self.secrets {
            assert!(!text.contains(secret.as_str()), "{secret:?} leaked into {what}:\n{text}");
        }
    }

    fn assert_bytes_clean(&self, what: &str, bytes: &[u8]) {
        for secret in &self.secrets {
            assert!(!bytes.windows(secret.len()).any(|w| w == secret.as_bytes()), "{secret:?} is in {what}");
        }
    }

    async fn post(&mut self, path: &str, body: &Value) -> (StatusCode, Value) {
        let response = self.app.client.post(self.app.url(path)).json(body).send().await.expect("POST");
        let status = response.status();
        let text = response.text().await.expect("body");
        self.seen.add(&format!("POST {path} → {status}"), text.clone());
        (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
    }

    async fn get(&mut self, path: &str) -> (StatusCode, Value) {
        let response = self.app.client.get(self.app.url(path)).send().await.expect("GET");
        let status = response.status();
        let text = response.text().await.expect("body");
        self.seen.add(&format!("GET {path} → {status}"), text.clone());
        (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
    }

    /// A streamed response, whole.
    async fn post_stream(&mut self, path: &str, body: &Value) -> String {
        let response = self
            .app
            .client
            .post(self.app.url(path))
            .header(ACCEPT, "text/event-stream")
            .json(body)
            .send()
            .await
            .expect("POST");
        let status = response.status();
        let text = tokio::time::timeout(DEADLINE, response.text()).await.expect("the stream ends").expect("body");
        self.seen.add(&format!("POST {path} (stream) → {status}"), text.clone());
        text
    }

    /// Plants the secrets through every write route, driving runs to their ends.
    async fn plant_everywhere(&mut self) {
        let planted = self.planted.clone();

        // REST: a conversation titled with secrets, a message full of them.
        let (status, conversation) = self.post("/v1/conversations", &json!({"title": planted})).await;
        assert_eq!(status, StatusCode::CREATED, "{conversation}");
        let conv = conversation["id"].as_str().unwrap().to_owned();
        assert!(conversation["title"].as_str().unwrap().contains("***"), "{conversation}");
        let (status, turn) = self
            .post(
                &format!("/v1/conversations/{conv}/messages?wait=true"),
                &json!({"content": format!("Read the settings please: {planted}")}),
            )
            .await;
        assert_eq!(status, StatusCode::OK, "{turn}");
        assert_eq!(turn["run"]["status"], "completed", "{turn}");

        // REST: a restart waiting for approval, resumed with a note and edited arguments full of
        // secrets (and first with a secret idempotency key, which is refused).
        let (status, conversation) = self.post("/v1/conversations", &json!({})).await;
        assert_eq!(status, StatusCode::CREATED);
        let conv2 = conversation["id"].as_str().unwrap().to_owned();
        let (_, turn) = self
            .post(&format!("/v1/conversations/{conv2}/messages?wait=true"), &json!({"content": RESTART_PROMPT}))
            .await;
        assert_eq!(turn["run"]["status"], "interrupted", "{turn}");
        let run = turn["run"]["id"].as_str().unwrap().to_owned();
        let interrupt = turn["interrupt"]["id"].as_str().unwrap().to_owned();
        let call = turn["interrupt"]["payload"]["actions"][0]["callId"].as_str().unwrap().to_owned();
        let (status, refused) = self
            .post(
                &format!("/v1/runs/{run}/resume"),
                &json!({"interruptId": interrupt, "decision": "approve", "idempotencyKey": OPENAI}),
            )
            .await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{refused}");
        let (status, resumed) = self
            .post(
                &format!("/v1/runs/{run}/resume?wait=true"),
                &json!({
                    "interruptId": interrupt,
                    "decision": {"edit": {call: {"instanceId": AWS}}},
                    "idempotencyKey": "edit-1",
                    "note": planted,
                }),
            )
            .await;
        assert_eq!(status, StatusCode::OK, "{resumed}");
        let (_, view) = self.get(&format!("/v1/runs/{run}")).await;
        let note = &view["interrupts"][0]["note"];
        assert!(note.as_str().is_some_and(|n| n.contains("***")), "the note is kept, masked: {view}");

        // A bad key in the header, and a secret in a URL path and a query.
        let response = reqwest::Client::new()
            .get(self.app.url("/v1/conversations"))
            .header(AUTHORIZATION, format!("Bearer {BEARER}"))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
        self.seen.add("GET with a bad key", response.text().await.unwrap());
        let (status, _) = self.get(&format!("/v1/runs/{OPENAI}")).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        let (status, _) = self.get(&format!("/v1/runs/run_{AWS}")).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        let (status, _) = self.get(&format!("/v1/runs?status={AWS}")).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);

        // AG-UI: a thread whose first message (its title) holds every secret; ids that look like
        // secrets are refused.
        let input = |thread: &str, run: &str, message_id: &str| {
            json!({
                "threadId": thread, "runId": run,
                "messages": [{"id": message_id, "role": "user", "content": format!("{RESTART_PROMPT}. {planted}")}],
                "state": {"token": planted}, "tools": [], "context": [{"value": planted}],
                "forwardedProps": {"password": PASSWORD},
            })
        };
        let stream = self.post_stream("/v1/ag-ui", &input("thread-1", "agui-run-1", "m-1")).await;
        assert!(stream.contains("RUN_FINISHED") || stream.contains("RUN_ERROR"), "{stream}");
        for (thread, run, message) in [(OPENAI, "r-2", "m-2"), ("thread-3", AWS, "m-3"), ("thread-4", "r-4", OPENAI)] {
            let (status, body) = self.post("/v1/ag-ui", &input(thread, run, message)).await;
            assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
        }
        // The AG-UI run waits to restart pay-prod-2: cancel it, so the WebSocket's run asks too.
        let (_, waiting) = self.get("/v1/runs?status=interrupted").await;
        for run in waiting["runs"].as_array().unwrap().clone() {
            let (status, body) =
                self.post(&format!("/v1/runs/{}/cancel", run["id"].as_str().unwrap()), &json!({})).await;
            assert_eq!(status, StatusCode::OK, "{body}");
        }

        // WebSocket: a message and a resume with a note, and a request id that is a secret.
        let (mut socket, _) = tokio_tungstenite::connect_async(self.app.ws_request(None)).await.expect("upgrade");
        let (_, conversation) = self.post("/v1/conversations", &json!({"title": "ws"})).await;
        let conv3 = conversation["id"].as_str().unwrap().to_owned();
        let frames = [
            json!({"type": "send", "conversationId": conv3, "content": format!("{RESTART_PROMPT}. {planted}"), "requestId": OPENAI}),
        ];
        for frame in frames {
            socket.send(Message::text(frame.to_string())).await.unwrap();
        }
        let ws_run = loop {
            let text = next_text(&mut socket).await;
            self.seen.add("ws frame", text.clone());
            let message: Value = serde_json::from_str(&text).unwrap();
            if message["type"] == "reply" {
                break message["result"]["runId"].as_str().expect("the run started").to_owned();
            }
        };
        let waiting = self.app.wait_for_status(&ws_run, "interrupted").await;
        let ws_interrupt = waiting["pendingInterrupt"]["id"].as_str().unwrap().to_owned();
        let resume = json!({"type": "resume", "runId": ws_run, "interruptId": ws_interrupt, "decision": "reject",
            "idempotencyKey": "ws-reject", "note": planted, "requestId": "r1"});
        socket.send(Message::text(resume.to_string())).await.unwrap();
        loop {
            let text = next_text(&mut socket).await;
            self.seen.add("ws frame", text.clone());
            let message: Value = serde_json::from_str(&text).unwrap();
            if message["type"] == "reply" {
                assert!(message.get("result").is_some(), "{message}");
                break;
            }
        }
        self.app.wait_for_status(&ws_run, "completed").await;
        socket.close(None).await.ok();

        // What a refreshed page and `keel runs show` read.
        for conv in [&conv, &conv2, &conv3] {
            self.get(&format!("/v1/conversations/{conv}")).await;
        }
        self.get("/v1/conversations").await;
        let (_, runs) = self.get("/v1/runs?limit=100").await;
        for run in runs["runs"].as_array().unwrap().clone() {
            let id = run["id"].as_str().unwrap();
            self.get(&format!("/v1/runs/{id}")).await;
            let response = self
                .app
                .client
                .get(self.app.url(&format!("/v1/runs/{id}/events")))
                .header(ACCEPT, "application/json")
                .send()
                .await
                .unwrap();
            self.seen.add("events", response.text().await.unwrap());
        }
    }

    fn assert_nothing_leaked(&self) {
        for (what, text) in &self.seen.0 {
            self.assert_clean(&format!("the answer to {}", mask_label(what)), text);
        }
        let text = String::from_utf8_lossy(&logs().0.lock().unwrap()).into_owned();
        assert!(text.contains("request"), "the log was captured");
        self.assert_clean("the log", &text);
    }
}

/// The label of a request, without the secret it may carry in its URL (the label is printed).
fn mask_label(what: &str) -> String {
    keel_core::mask::mask_text(what)
}

async fn next_text(
    socket: &mut tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>,
) -> String {
    loop {
        match tokio::time::timeout(DEADLINE, socket.next()).await.expect("a frame in time") {
            Some(Ok(Message::Text(text))) => return text.as_str().to_owned(),
            Some(Ok(_)) => continue,
            other => panic!("the connection stays open: {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn planted_secrets_reach_nothing_on_sqlite() {
    let _logs = logs();
    let mut gate = Gate::new(None).await;
    gate.plant_everywhere().await;
    gate.assert_nothing_leaked();
    // Every byte of every file under the data directory: the database, its WAL and shared memory.
    let mut files = 0;
    for entry in std::fs::read_dir(gate.app.data_dir()).unwrap() {
        let path = entry.unwrap().path();
        let bytes = std::fs::read(&path).unwrap();
        gate.assert_bytes_clean(&path.display().to_string(), &bytes);
        files += 1;
    }
    assert!(files >= 2, "the database and its WAL were read");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn planted_secrets_reach_nothing_on_postgres() {
    let _logs = logs();
    let Ok(url) = std::env::var("KEEL_TEST_POSTGRES_URL") else {
        eprintln!("secret_gate: the Postgres case is SKIPPED because KEEL_TEST_POSTGRES_URL is unset");
        return;
    };
    let schema = format!("keel_gate_{}", keel_core::RunId::new().as_str().trim_start_matches("run_"));
    let store = PostgresStore::connect_with_schema(&url, &schema)
        .await
        .unwrap_or_else(|e| panic!("KEEL_TEST_POSTGRES_URL is set, but the database cannot be used: {e}"));
    let mut gate = Gate::new(Some(store.clone())).await;
    gate.plant_everywhere().await;
    gate.assert_nothing_leaked();
    let dump = std::process::Command::new("pg_dump")
        .args(["--data-only", "--schema", &schema, &url])
        .output()
        .expect("pg_dump runs (postgresql-client)");
    assert!(dump.status.success(), "pg_dump: {}", String::from_utf8_lossy(&dump.stderr));
    assert!(dump.stdout.len() > 1000, "the dump holds the data");
    gate.assert_bytes_clean("pg_dump", &dump.stdout);
    store.drop_schema().await.expect("drop the schema");
}

/// Each JSON body's fields, each sent with a secret where it does not belong: a string where a
/// boolean, number, array or object goes, an object holding it where a string goes, an unknown
/// variant, a key of a map of call ids.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrongly_typed_fields_are_refused_without_their_value() {
    let _logs = logs();
    let mut gate = Gate::new(None).await;
    let s = OPENAI;
    let (_, conversation) = gate.post("/v1/conversations", &json!({})).await;
    let conv = conversation["id"].as_str().unwrap().to_owned();
    let (_, turn) =
        gate.post(&format!("/v1/conversations/{conv}/messages?wait=true"), &json!({"content": RESTART_PROMPT})).await;
    let run = turn["run"]["id"].as_str().unwrap().to_owned();
    let interrupt = turn["interrupt"]["id"].as_str().unwrap().to_owned();

    let bodies: Vec<(String, Value)> = vec![
        ("/v1/conversations".into(), json!({"title": {"t": s}})),
        ("/v1/conversations".into(), json!({"title": [s]})),
        (format!("/v1/conversations/{conv}/messages"), json!({"content": {"c": s}})),
        (format!("/v1/conversations/{conv}/messages"), json!({"content": "hi", "cancelOnDisconnect": s})),
        (format!("/v1/conversations/{conv}/messages"), json!({"content": [s, s]})),
        (format!("/v1/runs/{run}/resume"), json!({"interruptId": s, "decision": "approve", "idempotencyKey": "k"})),
        (
            format!("/v1/runs/{run}/resume"),
            json!({"interruptId": {"i": s}, "decision": "approve", "idempotencyKey": "k"}),
        ),
        (format!("/v1/runs/{run}/resume"), json!({"interruptId": interrupt, "decision": s, "idempotencyKey": "k"})),
        (
            format!("/v1/runs/{run}/resume"),
            json!({"interruptId": interrupt, "decision": "approve", "idempotencyKey": [s]}),
        ),
        (
            format!("/v1/runs/{run}/resume"),
            json!({"interruptId": interrupt, "decision": "approve", "idempotencyKey": s}),
        ),
        (
            format!("/v1/runs/{run}/resume"),
            json!({"interruptId": interrupt, "decision": "approve", "idempotencyKey": "k", "note": {"n": s}}),
        ),
        (
            format!("/v1/runs/{run}/resume"),
            json!({"interruptId": interrupt, "decision": {"edit": {s: {}}}, "idempotencyKey": "k2"}),
        ),
        (
            format!("/v1/runs/{run}/resume"),
            json!({"interruptId": interrupt, "decision": {"calls": {s: "approve"}}, "idempotencyKey": "k3"}),
        ),
        (
            format!("/v1/runs/{run}/resume"),
            json!({"interruptId": interrupt, "decision": {"calls": {"call_x": s}}, "idempotencyKey": "k4"}),
        ),
        (
            format!("/v1/runs/{run}/resume"),
            json!({"interruptId": interrupt, "decision": {s: 1}, "idempotencyKey": "k5"}),
        ),
        ("/v1/ag-ui".into(), json!({"threadId": {"t": s}, "runId": "r", "messages": []})),
        ("/v1/ag-ui".into(), json!({"threadId": "t", "runId": [s], "messages": []})),
        ("/v1/ag-ui".into(), json!({"threadId": "t", "runId": "r", "messages": s})),
        (
            "/v1/ag-ui".into(),
            json!({"threadId": "t", "runId": "r", "messages": [{"id": {"x": s}, "role": "user", "content": "x"}]}),
        ),
        (
            "/v1/ag-ui".into(),
            json!({"threadId": "t", "runId": "r", "messages": [{"id": "m", "role": {"r": s}, "content": "x"}]}),
        ),
        (
            "/v1/ag-ui".into(),
            json!({"threadId": "t", "runId": "r", "messages": [{"id": "m", "role": "user", "content": 5}], "resume": s}),
        ),
        (
            "/v1/ag-ui".into(),
            json!({"threadId": "t", "runId": "r", "messages": [], "resume": [{"interruptId": s, "status": "resolved"}]}),
        ),
        (
            "/v1/ag-ui".into(),
            json!({"threadId": "t", "runId": "r", "messages": [], "resume": [{"interruptId": "int_x", "status": s}]}),
        ),
        ("/v1/ag-ui".into(), json!({"threadId": "t", "runId": "r", "messages": [], "tools": s, "context": s})),
        (
            "/v1/ag-ui".into(),
            json!({"threadId": "t", "runId": "r", "messages": [{"id": "m", "role": "user", "content": [{"type": s}]}]}),
        ),
    ];
    for (path, body) in &bodies {
        let (status, answer) = gate.post(path, body).await;
        assert!(status.is_client_error(), "{path} {body} → {status} {answer}");
        assert!(answer["error"]["code"].is_string(), "{answer}");
    }
    for query in ["wait=", "after="] {
        let (status, _) =
            gate.post(&format!("/v1/conversations/{conv}/messages?{query}{s}"), &json!({"content": "x"})).await;
        assert!(status.is_client_error());
    }
    for query in [format!("after={s}"), format!("limit={s}")] {
        let (status, _) = gate.get(&format!("/v1/runs/{run}/events?{query}")).await;
        assert!(status.is_client_error());
    }

    // WebSocket frames: each field wrongly typed.
    let (mut socket, _) = tokio_tungstenite::connect_async(gate.app.ws_request(None)).await.expect("upgrade");
    let frames = vec![
        json!({"type": s}),
        json!({"type": "subscribe", "runId": run, "after": s}),
        json!({"type": "subscribe", "runId": {"r": s}}),
        json!({"type": "send", "conversationId": conv, "content": {"c": s}}),
        json!({"type": "send", "conversationId": conv, "content": "x", "cancelOnDisconnect": s}),
        json!({"type": "send", "conversationId": s, "content": "x"}),
        json!({"type": "resume", "runId": run, "interruptId": s, "decision": "approve", "idempotencyKey": "k"}),
        json!({"type": "resume", "runId": run, "interruptId": interrupt, "decision": "approve", "idempotencyKey": {"k": s}}),
        json!({"type": "resume", "runId": run, "interruptId": interrupt, "decision": {"edit": {s: {}}}, "idempotencyKey": "k9"}),
        json!({"type": "cancel", "runId": [s]}),
        json!({"type": "cancel", "runId": run, s: 1}),
    ];
    let count = frames.len();
    for frame in frames {
        socket.send(Message::text(frame.to_string())).await.unwrap();
    }
    socket.send(Message::text(format!("{{\"type\": {s}}}"))).await.unwrap();
    for _ in 0..=count {
        let text = next_text(&mut socket).await;
        gate.seen.add("ws error", text.clone());
        let reply: Value = serde_json::from_str(&text).unwrap();
        assert!(reply["error"]["code"].is_string(), "{reply}");
    }
    gate.assert_nothing_leaked();
}
