//! MCP tools end to end: `keel serve` with an agent whose tools come from an MCP server declared in
//! its keel.toml, driven by the mock model of `support/serve.rs`.
//!
//! Two real servers: the reference server `@modelcontextprotocol/server-everything` (npm), over
//! stdio and over Streamable HTTP; and `e2e/mcp/recording_server.py` (the Python SDK), which records
//! every call to a file. `e2e/mcp/install.sh` installs both and prints the variables these tests
//! read, `KEEL_TEST_MCP_EVERYTHING` and `KEEL_TEST_MCP_PYTHON`; CI sets them. A test whose variable
//! is unset says so and passes.

mod support;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::eventually;
use support::serve::{Api, MockModel, Serve};

fn var(name: &str) -> Option<String> {
    let value = std::env::var(name).ok();
    if value.is_none() {
        eprintln!("skipped: {name} is not set (run e2e/mcp/install.sh; CI sets it)");
    }
    value
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// An agent `ops` with the mock model and one MCP table (`tool`, TOML lines).
fn keel_toml(model: &str, tool: &str) -> String {
    format!(
        r#"
[[agents]]
id = "ops"
system_prompt = "You use the tools of MCP servers."

[agents.model]
kind = "openai"
base_url = "{model}"
name = "mock"

[[agents.tools]]
kind = "mcp"
{tool}
"#
    )
}

/// `toml` as a TOML string, quoted.
fn quoted(text: &str) -> String {
    toml::Value::String(text.to_owned()).to_string()
}

// ------------------------------------------------------------------------------ server-everything

/// server-everything over Streamable HTTP on a free port; stopped when dropped.
struct EverythingHttp {
    child: Child,
    url: String,
}

impl EverythingHttp {
    fn start(script: &str) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let mut child = Command::new("node")
            .args([script, "streamableHttp"])
            .env("PORT", port.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("node runs server-everything");
        // It says so on stderr once it listens.
        let mut stderr = BufReader::new(child.stderr.take().unwrap());
        let mut line = String::new();
        loop {
            line.clear();
            assert!(stderr.read_line(&mut line).unwrap() > 0, "server-everything exited before it listened");
            if line.contains(&format!("listening on port {port}")) {
                break;
            }
        }
        std::thread::spawn(move || std::io::copy(&mut stderr, &mut std::io::sink()));
        Self { child, url: format!("http://127.0.0.1:{port}/mcp") }
    }
}

impl Drop for EverythingHttp {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The flow of the issue against server-everything, whichever the transport: its tools are listed
/// on the agent (`deny` hides some), a read-only one runs without asking, one configured `ask` asks,
/// is approved through the resume API and is called exactly once; the server sees none of Keel's
/// environment.
fn everything_flow(transport: &str) {
    let dir = tempfile::tempdir().unwrap();
    let model = MockModel::start();
    let tool = format!("name = \"everything\"\n{transport}\nask = [\"echo\"]\ndeny = [\"trigger-*\", \"simulate-*\"]");
    // A variable of Keel's own that the server must not see, and the token of the HTTP header.
    let env = [("MCP_TEST_SECRET", "keel-test-secret-value"), ("MCP_TEST_TOKEN", "keel-test-token")];
    let server = Serve::start_with_env(dir.path(), &keel_toml(&model.url, &tool), &env);
    let api = Api::new(&server);
    runtime().block_on(async {
        let agents = api.get("/v1/agents").await;
        let ops = agents["agents"].as_array().unwrap().iter().find(|a| a["id"] == "ops").unwrap().clone();
        let tools: Vec<&Value> = ops["tools"].as_array().unwrap().iter().collect();
        let tool = |name: &str| tools.iter().find(|t| t["name"] == name).copied();
        let sum = tool("everything__get-sum").unwrap_or_else(|| panic!("{ops}"));
        assert_eq!(sum["sideEffect"], false);
        assert_eq!(sum["policies"]["operator"], "allow");
        assert!(sum["description"].as_str().unwrap().contains("sum"), "{sum}");
        let echo = tool("everything__echo").unwrap();
        assert_eq!(echo["policies"]["operator"], "ask");
        assert!(tool("everything__get-env").is_some());
        assert!(tools.iter().all(|t| !t["name"].as_str().unwrap().starts_with("everything__trigger-")), "{ops}");

        // Read-only: runs at once.
        let conv = api.conversation(Some("ops")).await;
        let turn = api.say(&conv, r#"call everything__get-sum {"a": 2, "b": 3}"#).await;
        assert_eq!(turn["run"]["status"], "completed", "{turn}");
        assert!(turn["interrupt"].is_null(), "{turn}");
        assert!(turn["message"]["content"].as_str().unwrap().contains('5'), "{turn}");

        // The server runs with its own environment, not Keel's (which holds model keys).
        let conv = api.conversation(Some("ops")).await;
        let turn = api.say(&conv, r#"call everything__get-env {}"#).await;
        assert_eq!(turn["run"]["status"], "completed", "{turn}");
        let said = turn["message"]["content"].as_str().unwrap();
        assert!(said.contains("PATH"), "{said}");
        assert!(!said.contains("keel-test-secret-value"), "{said}");

        // Configured ask: a card, an approval, one call.
        let conv = api.conversation(Some("ops")).await;
        let turn = api.say(&conv, r#"call everything__echo {"message": "hello mcp"}"#).await;
        assert_eq!(turn["run"]["status"], "interrupted", "{turn}");
        let interrupt = &turn["interrupt"];
        assert_eq!(interrupt["kind"], "confirm_action", "{interrupt}");
        assert_eq!(interrupt["payload"]["actions"][0]["tool"], "everything__echo");
        let run = turn["run"]["id"].as_str().unwrap();
        let (status, body) =
            api.resume(run, interrupt["id"].as_str().unwrap(), json!("approve"), None, "approve-echo").await;
        assert_eq!(status, 200, "{body}");
        let view = api.settled(run).await;
        assert_eq!(view["status"], "completed", "{view}");
        let calls = view["toolCalls"].as_array().unwrap();
        assert_eq!(calls.len(), 1, "{view}");
        assert_eq!(calls[0]["state"], "succeeded");
        assert_eq!(calls[0]["attempts"], 1);
        let events = api.events(run).await;
        assert_eq!(events.iter().filter(|e| e["type"] == "tool_started").count(), 1);
        assert_eq!(events.iter().filter(|e| e["type"] == "tool_finished").count(), 1);
        let answer = api.get(&format!("/v1/conversations/{conv}")).await;
        let last = answer["messages"].as_array().unwrap().last().unwrap().clone();
        assert!(last["content"].as_str().unwrap().contains("Echo: hello mcp"), "{last}");
    });
}

#[test]
fn server_everything_over_stdio_is_listed_runs_read_only_tools_and_asks_for_the_others() {
    let Some(script) = var("KEEL_TEST_MCP_EVERYTHING") else { return };
    everything_flow(&format!("command = \"node\"\nargs = [{}, \"stdio\"]", quoted(&script)));
}

#[test]
fn server_everything_over_streamable_http_is_listed_runs_read_only_tools_and_asks_for_the_others() {
    let Some(script) = var("KEEL_TEST_MCP_EVERYTHING") else { return };
    let server = EverythingHttp::start(&script);
    everything_flow(&format!(
        "url = {}\nheaders = {{ Authorization = \"Bearer ${{MCP_TEST_TOKEN}}\" }}",
        quoted(&server.url)
    ));
}

// ------------------------------------------------------------------------------ the recording server

fn record(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}

fn calls(path: &Path, tool: &str) -> Vec<Value> {
    record(path).into_iter().filter(|e| e["event"] == "call" && e["tool"] == tool).collect()
}

/// The agent `ops` with the recording server as `rec`, every tool allowed; its record goes to
/// `recorded`.
fn recording_toml(model: &str, python: &str, recorded: &Path) -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../e2e/mcp/recording_server.py");
    let tool = format!(
        "name = \"rec\"\ncommand = {}\nargs = [{}]\nenv = {{ MCP_RECORD = {} }}\nallow = [\"*\"]",
        quoted(python),
        quoted(&script.display().to_string()),
        quoted(&recorded.display().to_string())
    );
    keel_toml(model, &tool)
}

/// A run cancelled while its MCP call runs: the call is stopped (the server is sent
/// `notifications/cancelled` and records it), recorded as failed with the code `cancelled`, and
/// the run ends `cancelled` at once rather than when the call would have answered.
#[test]
fn a_cancelled_run_cancels_its_mcp_call_on_the_server() {
    let Some(python) = var("KEEL_TEST_MCP_PYTHON") else { return };
    let dir = tempfile::tempdir().unwrap();
    let recorded = dir.path().join("record.jsonl");
    let model = MockModel::start();
    let server = Serve::start(dir.path(), &recording_toml(&model.url, &python, &recorded));
    let api = Api::new(&server);
    runtime().block_on(async {
        let conv = api.conversation(Some("ops")).await;
        let run = api.start(&conv, r#"call rec__write {"item": "c", "delay_ms": 60000}"#).await;
        eventually("the server to hold the call", || async { (calls(&recorded, "write").len() == 1).then_some(()) })
            .await;
        let asked = Instant::now();
        let (status, body) = api.post(&format!("/v1/runs/{run}/cancel"), json!({})).await;
        assert_eq!(status, 200, "{body}");
        let view = api.settled(&run).await;
        assert_eq!(view["status"], "cancelled", "{view}");
        assert!(asked.elapsed() < Duration::from_secs(20), "the run waited for the call");
        let call = &view["toolCalls"][0];
        assert_eq!(call["state"], "failed", "{view}");
        assert_eq!(call["errorCode"], "cancelled", "{view}");
        let cancelled = eventually("the server to record the cancellation", || async {
            let found: Vec<Value> = record(&recorded).into_iter().filter(|e| e["event"] == "cancelled").collect();
            (!found.is_empty()).then_some(found)
        })
        .await;
        assert_eq!(cancelled[0]["key"], call["id"]);
        assert!(record(&recorded).iter().all(|e| e["event"] != "done"), "the call never finished");
    });
}

/// The MCP server adds a tool while Keel serves and sends `notifications/tools/list_changed`: the
/// agent's tools are listed again (`GET /v1/agents` shows the new one, with the table's policy) and
/// the next run calls it.
#[test]
fn a_tool_the_mcp_server_adds_while_keel_serves_is_offered_and_called() {
    let Some(python) = var("KEEL_TEST_MCP_PYTHON") else { return };
    let dir = tempfile::tempdir().unwrap();
    let recorded = dir.path().join("record.jsonl");
    let model = MockModel::start();
    let server = Serve::start(dir.path(), &recording_toml(&model.url, &python, &recorded));
    let api = Api::new(&server);
    runtime().block_on(async {
        let offered = |agents: &Value| -> Vec<String> {
            agents["agents"][0]["tools"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t["name"].as_str().unwrap().to_owned())
                .collect()
        };
        assert!(!offered(&api.get("/v1/agents").await).contains(&"rec__extra".to_owned()));
        let conv = api.conversation(Some("ops")).await;
        let run = api.start(&conv, r#"call rec__grow {"item": "extra"}"#).await;
        assert_eq!(api.settled(&run).await["status"], "completed");
        let tools = eventually("the agent to offer the new tool", || async {
            let agents = api.get("/v1/agents").await;
            offered(&agents).contains(&"rec__extra".to_owned()).then_some(agents)
        })
        .await;
        let extra = tools["agents"][0]["tools"].as_array().unwrap().iter().find(|t| t["name"] == "rec__extra").unwrap();
        assert_eq!(extra["sideEffect"], false, "{extra}");
        assert_eq!(extra["policies"]["viewer"], "allow", "{extra}");

        let run = api.start(&conv, r#"call rec__extra {"note": "hi"}"#).await;
        let view = api.settled(&run).await;
        assert_eq!(view["status"], "completed", "{view}");
        assert_eq!(view["toolCalls"][0]["state"], "succeeded", "{view}");
        assert_eq!(calls(&recorded, "extra").len(), 1);
    });
}

/// A crash of Keel while the MCP server holds the calls: after the restart, the call of the
/// `idempotentHint` tool is sent again with the same key (in `_meta`) and completes; the other is
/// not sent again, and a human is asked (`outcome_unknown`).
#[test]
fn a_crash_of_keel_mid_call_retries_idempotent_mcp_tools_and_asks_about_the_others() {
    let Some(python) = var("KEEL_TEST_MCP_PYTHON") else { return };
    let dir = tempfile::tempdir().unwrap();
    let recorded: PathBuf = dir.path().join("record.jsonl");
    let model = MockModel::start();
    let server = Serve::start(dir.path(), &recording_toml(&model.url, &python, &recorded));
    let api = Api::new(&server);
    let rt = runtime();
    let (put_run, write_run) = rt.block_on(async {
        let conv = api.conversation(Some("ops")).await;
        let put_run = api.start(&conv, r#"call rec__put {"item": "p", "delay_ms": 60000}"#).await;
        let conv = api.conversation(Some("ops")).await;
        let write_run = api.start(&conv, r#"call rec__write {"item": "w", "delay_ms": 60000}"#).await;
        eventually("the server to hold both calls", || async {
            (calls(&recorded, "put").len() == 1 && calls(&recorded, "write").len() == 1).then_some(())
        })
        .await;
        (put_run, write_run)
    });
    let dir_path = server.kill();
    let server = Serve::again(&dir_path);
    let api = Api::new(&server);
    rt.block_on(async {
        let view = api.settled(&put_run).await;
        assert_eq!(view["status"], "completed", "{view}");
        let call = &view["toolCalls"][0];
        assert_eq!(call["state"], "succeeded");
        assert_eq!(call["attempts"], 2);
        let sent = calls(&recorded, "put");
        assert_eq!(sent.len(), 2, "{sent:?}");
        assert_eq!(sent[0]["key"], call["id"]);
        assert_eq!(sent[1]["key"], call["id"]);
        assert_ne!(sent[0]["pid"], sent[1]["pid"], "a new server for the new Keel");

        let view = api.settled(&write_run).await;
        assert_eq!(view["status"], "interrupted", "{view}");
        assert_eq!(view["pendingInterrupt"]["kind"], "outcome_unknown", "{view}");
        assert_eq!(view["toolCalls"][0]["state"], "unknown");
        assert_eq!(calls(&recorded, "write").len(), 1, "not sent again on Keel's own initiative");
    });
}

/// `keel serve` with the keel.toml of `dir`, which must fail: its stderr.
fn serve_fails(dir: &Path) -> String {
    let out = support::keel()
        .args(["serve", "--listen", "127.0.0.1:0", "--config"])
        .arg(dir.join("keel.toml"))
        .arg("--data-dir")
        .arg(dir.join("data"))
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success());
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A server that cannot be started stops `keel serve` with one line naming the agent and the tool.
#[test]
fn an_mcp_server_that_does_not_start_stops_serve_with_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let model = MockModel::start();
    let file = |tool: &str| std::fs::write(dir.path().join("keel.toml"), keel_toml(&model.url, tool)).unwrap();
    file("name = \"files\"\ncommand = \"/nonexistent/mcp-files\"");
    let started = Instant::now();
    let stderr = serve_fails(dir.path());
    assert!(started.elapsed() < Duration::from_secs(30));
    let line = stderr.lines().find(|l| l.contains("files")).unwrap_or_else(|| panic!("{stderr}"));
    assert!(
        line.contains(
            r#"agent "ops": tool "files": command: the MCP server files (/nonexistent/mcp-files): could not run"#
        ),
        "{line}"
    );

    // An unset variable is found when the file is read, before anything is started.
    file("name = \"files\"\ncommand = \"x\"\nenv = { TOKEN = \"${FILES_TOKEN_UNSET}\" }");
    let stderr = serve_fails(dir.path());
    assert!(
        stderr.contains(
            r#"agent "ops": tools[0] ("files"): env.TOKEN: the environment variable FILES_TOKEN_UNSET is not set"#
        ),
        "{stderr}"
    );
}
