//! MCP tools against a real MCP server: `e2e/mcp/recording_server.py` (the Python SDK), which
//! records every call, answer and cancellation to a file. It needs `KEEL_TEST_MCP_PYTHON`, a
//! Python with the SDK installed (`e2e/mcp/install.sh` prints it; CI sets it); without it these
//! tests say so and pass.

mod support;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use keel_core::tool::{Policy, Tool, ToolError};
use keel_core::UserRole;
use keel_tools::ToolConfig;
use serde_json::{json, Value};

const DEADLINE: Duration = Duration::from_secs(30);

fn python() -> Option<String> {
    let python = std::env::var("KEEL_TEST_MCP_PYTHON").ok();
    if python.is_none() {
        eprintln!("skipped: KEEL_TEST_MCP_PYTHON is not set (run e2e/mcp/install.sh; CI sets it)");
    }
    python
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../e2e/mcp/recording_server.py")
}

/// The server's record of what happened to it.
struct Record(PathBuf);

impl Record {
    fn events(&self) -> Vec<Value> {
        std::fs::read_to_string(&self.0)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).expect("a JSON line"))
            .collect()
    }

    fn of(&self, event: &str) -> Vec<Value> {
        self.events().into_iter().filter(|e| e["event"] == event).collect()
    }

    async fn wait_for(&self, event: &str, n: usize) -> Vec<Value> {
        let start = Instant::now();
        loop {
            let found = self.of(event);
            if found.len() >= n {
                return found;
            }
            assert!(start.elapsed() < DEADLINE, "timed out waiting for {n} {event:?} in {:?}", self.events());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// The table of the recording server, with `extra` lines; its record goes to `dir`.
fn table(python: &str, extra: &str) -> String {
    format!(
        "kind = \"mcp\"\nname = \"rec\"\ncommand = {python:?}\nargs = [{:?}]\nenv = {{ MCP_RECORD = \"${{REC}}\" }}\n{extra}\n",
        script().display().to_string()
    )
}

async fn start(python: &str, dir: &Path, extra: &str) -> (Vec<Arc<dyn Tool>>, Record) {
    let record = dir.join("record.jsonl");
    let config: ToolConfig = toml::from_str(&table(python, extra)).unwrap();
    let path = record.display().to_string();
    let tools = keel_tools::build_all(&config, &move |name| (name == "REC").then(|| path.clone()))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    (tools, Record(record))
}

fn named<'a>(tools: &'a [Arc<dyn Tool>], name: &str) -> &'a Arc<dyn Tool> {
    tools.iter().find(|t| t.spec().name == name).unwrap_or_else(|| panic!("no tool {name}"))
}

#[tokio::test]
async fn the_servers_tools_are_offered_with_policies_from_annotations_and_patterns() {
    let Some(python) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (tools, _) = start(&python, dir.path(), "").await;
    let mut names: Vec<&str> = tools.iter().map(|t| t.spec().name.as_str()).collect();
    names.sort();
    assert_eq!(names, ["rec__fail", "rec__grow", "rec__put", "rec__read", "rec__write"]);

    // readOnlyHint: no side effect, allowed, retried. destructiveHint (and no hint): ask, not
    // retried. idempotentHint: ask, retried.
    let read = named(&tools, "rec__read").spec();
    assert!(!read.side_effect && read.idempotent);
    assert!(UserRole::ALL.iter().all(|r| read.policy_for(Some(*r)) == Policy::Allow));
    let write = named(&tools, "rec__write").spec();
    assert!(write.side_effect && !write.idempotent);
    assert_eq!(write.policy_for(Some(UserRole::Operator)), Policy::Ask);
    assert_eq!(write.policy_for(Some(UserRole::Viewer)), Policy::Deny);
    let put = named(&tools, "rec__put").spec();
    assert!(put.side_effect && put.idempotent);
    assert_eq!(put.policy_for(Some(UserRole::Admin)), Policy::Ask);
    assert_eq!(read.parameters["properties"]["item"]["type"], "string");
    assert_eq!(read.description, "Reads an item.");
    assert_eq!(read.timeout, keel_core::tool::DEFAULT_TOOL_TIMEOUT);

    // deny hides, then ask, then allow: the most careful list that names a tool wins.
    let dir = tempfile::tempdir().unwrap();
    let (tools, _) = start(
        &python,
        dir.path(),
        "allow = [\"*\"]\nask = [\"re*\"]\ndeny = [\"fail\", \"nothing_*\"]\ntimeout = \"5s\"",
    )
    .await;
    let mut names: Vec<&str> = tools.iter().map(|t| t.spec().name.as_str()).collect();
    names.sort();
    assert_eq!(names, ["rec__grow", "rec__put", "rec__read", "rec__write"]);
    let policy = |name: &str| named(&tools, name).spec().policy_for(Some(UserRole::Viewer));
    assert_eq!(policy("rec__read"), Policy::Ask);
    assert_eq!(policy("rec__write"), Policy::Allow);
    assert_eq!(named(&tools, "rec__put").spec().timeout, Duration::from_secs(5));
}

#[tokio::test]
async fn a_changed_tool_list_is_listed_again_and_its_new_tools_work() {
    let Some(python) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let record = Record(dir.path().join("record.jsonl"));
    let config: ToolConfig = toml::from_str(&table(&python, "deny = [\"secret_*\"]")).unwrap();
    let path = record.0.display().to_string();
    let (sender, mut changes) = tokio::sync::mpsc::unbounded_channel::<Vec<Arc<dyn Tool>>>();
    let tools = keel_tools::build_all_watched(
        &config,
        &move |name| (name == "REC").then(|| path.clone()),
        Box::new(move |tools| {
            let _ = sender.send(tools);
        }),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(tools.iter().all(|t| t.spec().name != "rec__extra"));

    // The server adds a tool and sends notifications/tools/list_changed: the tools are listed
    // again, with the new one, selected and given its policy like the first ones.
    let out = named(&tools, "rec__grow").execute(&support::ctx(), &json!({"item": "extra"})).await.unwrap();
    assert_eq!(out.result, json!({"result": "grow extra ok"}));
    let changed = tokio::time::timeout(DEADLINE, changes.recv()).await.expect("a new list").expect("open");
    let mut names: Vec<&str> = changed.iter().map(|t| t.spec().name.as_str()).collect();
    names.sort();
    assert_eq!(names, ["rec__extra", "rec__fail", "rec__grow", "rec__put", "rec__read", "rec__write"]);
    let extra = named(&changed, "rec__extra");
    assert!(!extra.spec().side_effect, "readOnlyHint: no side effect");
    assert_eq!(extra.spec().policy_for(Some(UserRole::Viewer)), Policy::Allow);
    let out = extra.execute(&support::ctx(), &json!({})).await.unwrap();
    assert_eq!(out.result, json!({"result": "extra ok"}));
    assert_eq!(record.of("call").iter().filter(|c| c["tool"] == "extra").count(), 1);

    // A tool the table denies stays out of the new list too.
    named(&tools, "rec__grow").execute(&support::ctx(), &json!({"item": "secret_x"})).await.unwrap();
    let changed = tokio::time::timeout(DEADLINE, changes.recv()).await.expect("a new list").expect("open");
    assert!(changed.iter().any(|t| t.spec().name == "rec__extra"));
    assert!(changed.iter().all(|t| t.spec().name != "rec__secret_x"));
}

#[tokio::test]
async fn a_call_carries_its_key_and_its_result_or_error_comes_back() {
    let Some(python) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (tools, record) = start(&python, dir.path(), "").await;
    let ctx = support::ctx();
    let out = named(&tools, "rec__read").execute(&ctx, &json!({"item": "x"})).await.unwrap();
    // Structured content when the server gives it.
    assert_eq!(out.result, json!({"result": "read x ok"}));
    assert_eq!(out.summary, "rec: read → ok");
    let calls = record.of("call");
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0]["key"], ctx.idempotency_key.as_str());
    assert_eq!(calls[0]["args"]["item"], "x");

    // isError: a failed call, with the server's text.
    match named(&tools, "rec__fail").execute(&support::ctx(), &json!({"message": "the disk is full"})).await {
        Err(ToolError::Failed(message)) => assert!(message.contains("the disk is full"), "{message}"),
        other => panic!("{other:?}"),
    }
    // A JSON-RPC error (arguments the server refuses): the model is told.
    match named(&tools, "rec__read").execute(&support::ctx(), &json!({"item": 5})).await {
        Err(ToolError::Invalid(_)) | Err(ToolError::Failed(_)) => {}
        other => panic!("{other:?}"),
    }
    // A result larger than max_response_bytes.
    let dir = tempfile::tempdir().unwrap();
    let (tools, _) = start(&python, dir.path(), "max_response_bytes = 10").await;
    match named(&tools, "rec__read").execute(&support::ctx(), &json!({"item": "x"})).await {
        Err(ToolError::TooLarge { limit: 10 }) => {}
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_server_killed_mid_call_fails_that_call_clearly_and_is_started_again() {
    let Some(python) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (tools, record) = start(&python, dir.path(), "").await;
    let write = named(&tools, "rec__write").clone();
    let in_flight =
        tokio::spawn(async move { write.execute(&support::ctx(), &json!({"item": "a", "delay_ms": 60_000})).await });
    let call = record.wait_for("call", 1).await.remove(0);
    let pid = call["pid"].as_u64().unwrap().to_string();
    assert!(std::process::Command::new("kill").args(["-KILL", &pid]).status().unwrap().success());

    // The call in flight: it may have been applied, and the message says what happened.
    let error = tokio::time::timeout(DEADLINE, in_flight).await.expect("no hang").unwrap().unwrap_err();
    match &error {
        ToolError::OutcomeUnknown(m) => assert!(m.contains("stopped before it answered write"), "{m}"),
        other => panic!("{other:?}"),
    }

    // Until the server is back, a call fails at once as unreachable (nothing was sent); then it works.
    let read = named(&tools, "rec__read");
    let start = Instant::now();
    loop {
        let asked = Instant::now();
        match read.execute(&support::ctx(), &json!({"item": "b"})).await {
            Ok(out) => {
                assert_eq!(out.result["result"], "read b ok");
                break;
            }
            Err(ToolError::Unreachable(m)) => {
                assert!(m.contains("the MCP server rec"), "{m}");
                assert!(asked.elapsed() < Duration::from_secs(1), "a call to a stopped server waits");
            }
            Err(other) => panic!("{other:?}"),
        }
        assert!(start.elapsed() < DEADLINE, "the server was not started again");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let started = record.of("started");
    assert_eq!(started.len(), 2, "{started:?}");
    assert_ne!(started[0]["pid"], started[1]["pid"]);
    assert!(record.of("done").iter().all(|d| d["tool"] != "write"), "the killed call never finished");
}

#[tokio::test]
async fn a_call_past_its_timeout_is_cancelled_on_the_server() {
    let Some(python) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (tools, record) = start(&python, dir.path(), "timeout = \"500ms\"").await;
    let ctx = support::ctx();
    match named(&tools, "rec__write").execute(&ctx, &json!({"item": "slow", "delay_ms": 20_000})).await {
        Err(ToolError::Timeout(m)) => assert!(m.contains("within 500ms"), "{m}"),
        other => panic!("{other:?}"),
    }
    let cancelled = record.wait_for("cancelled", 1).await;
    assert_eq!(cancelled[0]["key"], ctx.idempotency_key.as_str());
    // The server goes on serving.
    let out = named(&tools, "rec__read").execute(&support::ctx(), &json!({"item": "c"})).await.unwrap();
    assert_eq!(out.result["result"], "read c ok");
}

#[tokio::test]
async fn a_server_that_does_not_start_is_an_error_naming_the_field() {
    let build = |text: &str| {
        let config: ToolConfig = toml::from_str(text).unwrap();
        async move { keel_tools::build_all(&config, &|_| None).await.map(|t| t.len()) }
    };
    let e = build("kind = \"mcp\"\nname = \"x\"\ncommand = \"/nonexistent/mcp-server\"").await.unwrap_err();
    assert_eq!(e.field, "command");
    assert!(e.message.contains("could not run /nonexistent/mcp-server"), "{e}");

    let e = build("kind = \"mcp\"\nname = \"x\"\ncommand = \"true\"").await.unwrap_err();
    assert_eq!(e.field, "command");
    assert!(e.message.contains("the MCP server x (true)"), "{e}");

    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let e = build(&format!("kind = \"mcp\"\nname = \"x\"\nurl = \"http://{closed}/mcp\"")).await.unwrap_err();
    assert_eq!(e.field, "url");
    assert!(e.message.contains("the MCP server x (at 127.0.0.1)"), "{e}");
}

/// server-everything over Streamable HTTP on `port`; killed when dropped.
struct EverythingHttp(std::process::Child);

impl EverythingHttp {
    fn start(script: &str, port: u16) -> Self {
        use std::io::BufRead;
        let mut child = std::process::Command::new("node")
            .args([script, "streamableHttp"])
            .env("PORT", port.to_string())
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("node runs server-everything");
        let mut stderr = std::io::BufReader::new(child.stderr.take().unwrap());
        let mut line = String::new();
        loop {
            line.clear();
            assert!(stderr.read_line(&mut line).unwrap() > 0, "server-everything exited before it listened");
            if line.contains(&format!("listening on port {port}")) {
                break;
            }
        }
        std::thread::spawn(move || std::io::copy(&mut stderr, &mut std::io::sink()));
        Self(child)
    }
}

impl Drop for EverythingHttp {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A server over HTTP that goes away: calls fail clearly and at once; once it is back, a new
/// session is opened and calls work again.
#[tokio::test]
async fn a_server_over_http_that_goes_away_is_connected_again() {
    let Ok(script) = std::env::var("KEEL_TEST_MCP_EVERYTHING") else {
        eprintln!("skipped: KEEL_TEST_MCP_EVERYTHING is not set (run e2e/mcp/install.sh; CI sets it)");
        return;
    };
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let server = EverythingHttp::start(&script, port);
    let config: ToolConfig = toml::from_str(&format!(
        "kind = \"mcp\"\nname = \"ev\"\nurl = \"http://127.0.0.1:{port}/mcp\"\ntimeout = \"5s\""
    ))
    .unwrap();
    let tools = keel_tools::build_all(&config, &|_| None).await.unwrap();
    let sum = named(&tools, "ev__get-sum");
    let out = sum.execute(&support::ctx(), &json!({"a": 1, "b": 2})).await.unwrap();
    assert!(out.result.as_str().unwrap().contains('3'), "{:?}", out.result);

    drop(server);
    let asked = Instant::now();
    let error = sum.execute(&support::ctx(), &json!({"a": 1, "b": 2})).await.unwrap_err();
    assert!(asked.elapsed() < Duration::from_secs(6), "{error:?}");
    assert!(error.to_string().contains("the MCP server ev"), "{error:?}");

    let _server = EverythingHttp::start(&script, port);
    let start = Instant::now();
    loop {
        match sum.execute(&support::ctx(), &json!({"a": 2, "b": 2})).await {
            Ok(out) => {
                assert!(out.result.as_str().unwrap().contains('4'), "{:?}", out.result);
                break;
            }
            Err(e) => assert!(start.elapsed() < DEADLINE, "not connected again: {e:?}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
