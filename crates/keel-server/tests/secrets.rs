//! Secrets planted in a user message and in a tool result reach no event, no log line, no stored
//! byte and no model prompt. Its own test binary, so that it can capture every log line at TRACE.

#[path = "common/mod.rs"]
mod common;

use std::io::Write;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use keel_core::model::{Model, ModelChunk, ModelError, ModelRequest, ModelStream, ModelToolCall};
use keel_core::tool::{Tool, ToolContext, ToolError, ToolOutput, ToolSpec};
use reqwest::StatusCode;
use serde_json::{json, Value};

use crate::common::{Options, TestApp};

const KEEL_KEY: &str = "keel_5ec12e75ec12e75ec12e75ec12e75ec12e75ec12e75ec12e75ec12e75ec1";
const SECRETS: &[&str] =
    &["hunter2", "sk-live-0123456789abcdef", "admin:s3cr3t", "5ec12e75ec12e75ec12e7", "tool-pw-42"];

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

/// Calls the secret tool, then answers; keeps every request it was sent.
struct RecordingModel {
    requests: Mutex<Vec<ModelRequest>>,
}

#[async_trait]
impl Model for RecordingModel {
    fn name(&self) -> &str {
        "recording"
    }
    async fn stream(&self, request: ModelRequest) -> Result<ModelStream, ModelError> {
        let first = {
            let mut requests = self.requests.lock().unwrap();
            requests.push(request);
            requests.len() == 1
        };
        let chunks = if first {
            vec![
                Ok(ModelChunk::Text("Reading the settings.".into())),
                Ok(ModelChunk::ToolCall(ModelToolCall {
                    id: "call_1".into(),
                    name: "read_db_config".into(),
                    arguments: json!({}),
                })),
            ]
        } else {
            vec![Ok(ModelChunk::Text("The database is on host db.".into()))]
        };
        Ok(Box::pin(futures::stream::iter(chunks)))
    }
}

struct ReadDbConfig(ToolSpec);

#[async_trait]
impl Tool for ReadDbConfig {
    fn spec(&self) -> &ToolSpec {
        &self.0
    }
    async fn execute(&self, _ctx: &ToolContext, _args: &Value) -> Result<ToolOutput, ToolError> {
        Ok(ToolOutput {
            result: json!({
                "host": "db",
                "password": "tool-pw-42",
                "dsn": "postgres://admin:s3cr3t@db/pay",
                "note": format!("rotate {KEEL_KEY} and sk-live-0123456789abcdef"),
            }),
            summary: "read postgres://admin:s3cr3t@db/pay (password=tool-pw-42)".into(),
            facts: vec![("db_dsn".into(), "postgres://admin:s3cr3t@db/pay".into())],
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn planted_secrets_reach_no_event_log_row_or_prompt() {
    let logs = Captured::default();
    let writer = logs.clone();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new("trace"))
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .init();

    let model = Arc::new(RecordingModel { requests: Mutex::new(Vec::new()) });
    let tool = ReadDbConfig(ToolSpec::new(
        "read_db_config",
        "Reads the settings of the payments database.",
        json!({"type": "object", "properties": {}, "additionalProperties": false}),
        false,
    ));
    let app =
        TestApp::with(Options { model: Some(model.clone()), extra_tools: vec![Arc::new(tool)], ..Options::default() })
            .await;
    let conversation = app.create_conversation().await;
    let said = "Check the db at postgres://admin:hunter2@db/pay with key sk-live-0123456789abcdef please";
    let turn = app.send_and_wait(&conversation, said).await;
    assert_eq!(turn["run"]["status"], "completed", "{turn}");
    let run = turn["run"]["id"].as_str().unwrap().to_owned();
    assert_eq!(turn["message"]["content"], "The database is on host db.");
    // A ticket in a URL is a credential too: it must not reach the request log.
    let (status, ticket) = app.post(&format!("/v1/runs/{run}/stream-ticket"), &json!({})).await;
    assert_eq!(status, StatusCode::CREATED);
    let ticket = ticket["ticket"].as_str().unwrap().to_owned();
    let replay = reqwest::Client::new()
        .get(app.url(&format!("/v1/runs/{run}/events?ticket={ticket}")))
        .header("accept", "application/json")
        .send()
        .await
        .unwrap();
    assert_eq!(replay.status(), StatusCode::OK);
    let replay: Value = replay.json().await.unwrap();

    let mut secrets: Vec<String> = SECRETS.iter().map(|s| (*s).to_owned()).collect();
    secrets.push(ticket[4..].to_owned());
    secrets.push(app.keys["demo"][5..].to_owned());
    let leaks = |what: &str, text: &str| {
        for secret in &secrets {
            assert!(!text.contains(secret.as_str()), "{secret:?} leaked into {what}");
        }
    };

    // The user's words were stored masked; the model saw them masked.
    let (_, view) = app.get(&format!("/v1/conversations/{conversation}")).await;
    let stored = view["messages"][0]["content"].as_str().unwrap();
    assert_eq!(stored, "Check the db at postgres://***@db/pay with key *** please");
    leaks("the conversation", &view.to_string());
    leaks("the run", &app.run(&run).await.to_string());
    leaks("the events", &replay.to_string());
    let requests = model.requests.lock().unwrap().clone();
    assert_eq!(requests.len(), 2, "the tool's result went back to the model");
    for (i, request) in requests.iter().enumerate() {
        leaks(&format!("model request {i}"), &format!("{request:?}"));
    }
    assert!(format!("{:?}", requests[1]).contains("postgres://***@db/pay"), "the model saw the masked result");

    // Every byte the database holds (the file and its write-ahead log).
    for suffix in ["", "-wal"] {
        let path = format!("{}{suffix}", app.db_path().display());
        if let Ok(bytes) = std::fs::read(&path) {
            for secret in &secrets {
                assert!(!bytes.windows(secret.len()).any(|w| w == secret.as_bytes()), "{secret:?} is in {path}");
            }
        }
    }
    let text = String::from_utf8_lossy(&logs.0.lock().unwrap()).into_owned();
    assert!(text.contains("request"), "the log was captured");
    leaks("the log", &text);
}
