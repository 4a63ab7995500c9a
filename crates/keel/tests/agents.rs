//! Agents of one's own, end to end: agents defined only in `keel.toml`, served by the real
//! `keel serve` as a child process, whose model is an OpenAI-compatible mock server (scripted by
//! the last message, recording every request) and whose tools are HTTP endpoints of
//! `support/tool_service.py`, a separate process that records every `Idempotency-Key` it gets and
//! applies a restart once per key.
//!
//! The mock model: a user message `call TOOL {json}` makes it call TOOL with those arguments (the
//! call id always `call_0`, as some models number their calls), `calls [[TOOL, {json}], …]` makes
//! it call several at once; after a tool result it answers
//! `tool said: <the result>` (a result holding `hang-once` is held the first time, for a crash
//! test); anything else gets `hello`.

mod support;

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use serde_json::{json, Value};
use support::serve::{Api, MockModel, Serve};
use support::{eventually, keel};

// ------------------------------------------------------------------------------ the tool service

/// `tool_service.py` on a free port; stopped when dropped.
struct ToolService {
    child: Child,
    url: String,
    http: reqwest::Client,
}

impl ToolService {
    fn start() -> Self {
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/support/tool_service.py");
        let mut child = Command::new("python3")
            .arg(script)
            .arg("0")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("python3 runs tool_service.py");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let port = line.trim().strip_prefix("listening ").unwrap_or_else(|| panic!("tool_service.py said {line:?}"));
        Self { child, url: format!("http://127.0.0.1:{port}"), http: reqwest::Client::new() }
    }

    async fn get(&self, path: &str) -> Value {
        self.http.get(format!("{}{path}", self.url)).send().await.unwrap().json().await.unwrap()
    }

    /// Every request it got (not the `/_` ones), oldest first.
    async fn requests(&self) -> Vec<Value> {
        self.get("/_requests").await.as_array().unwrap().clone()
    }

    /// How many times each instance's restart was applied.
    async fn effects(&self) -> Value {
        self.get("/_effects").await
    }

    async fn control(&self, control: Value) {
        let status = self.http.post(format!("{}/_control", self.url)).json(&control).send().await.unwrap().status();
        assert_eq!(status, 200);
    }

    async fn reset(&self) {
        let status = self.http.post(format!("{}/_reset", self.url)).send().await.unwrap().status();
        assert_eq!(status, 200);
    }
}

impl Drop for ToolService {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ------------------------------------------------------------------------------ keel.toml

fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

/// The agent `ops`: `restart` (asks first, idempotent, with a pattern and a oneOf in its schema,
/// and card templates), `restart_now` (allowed, idempotent), `restart_once` (allowed, not
/// idempotent), `lookup` (a GET: allowed, short timeout, small answers) and `lookup_down` (a
/// service that is not there); and the agent `helper`, with a prompt and one tool of its own.
fn keel_toml(model: &str, service: &str) -> String {
    let closed = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    format!(
        r#"
[[agents]]
id = "ops"
name = "Ops"
description = "Restarts instances, with approval."
system_prompt = "OPS-PROMPT: you restart instances."
default = true
[agents.model]
kind = "openai"
base_url = "{model}"
name = "mock"
max_retries = 0
[agents.context]
tool_result_max_bytes = 4096

[[agents.tools]]
kind = "http"
name = "restart"
description = "Restart an instance"
method = "POST"
url = "{service}/restart/{{instanceId}}"
timeout = "10s"
idempotent = true
policy = {{ viewer = "deny", operator = "ask", admin = "ask" }}
[agents.tools.confirm]
title = "Restart {{instanceId}}?"
risk = "{{instanceId}} drops what it is serving."
[agents.tools.args_schema]
type = "object"
required = ["instanceId"]
additionalProperties = false
[agents.tools.args_schema.properties.instanceId]
type = "string"
pattern = "^[a-z]+-[0-9]+$"
[agents.tools.args_schema.properties.window]
oneOf = [{{ type = "integer", minimum = 1 }}, {{ type = "string", pattern = "^[0-9]+m$" }}]

[[agents.tools]]
kind = "http"
name = "restart_now"
description = "Restart an instance at once"
method = "POST"
url = "{service}/restart/{{instanceId}}"
timeout = "20s"
idempotent = true
policy = "allow"
args_schema = {{ type = "object", properties = {{ instanceId = {{ type = "string" }} }}, required = ["instanceId"] }}

[[agents.tools]]
kind = "http"
name = "restart_once"
description = "Restart an instance; never sent twice"
method = "POST"
url = "{service}/restart/{{instanceId}}"
timeout = "20s"
idempotent = false
policy = "allow"
args_schema = {{ type = "object", properties = {{ instanceId = {{ type = "string" }} }}, required = ["instanceId"] }}

[[agents.tools]]
kind = "http"
name = "lookup"
description = "Read an instance"
method = "GET"
url = "{service}/instances/{{id}}"
timeout = "500ms"
max_response_bytes = 65536
args_schema = {{ type = "object", properties = {{ id = {{ type = "string" }} }}, required = ["id"] }}

[[agents.tools]]
kind = "http"
name = "lookup_big"
description = "Read an instance, however large the answer"
method = "GET"
url = "{service}/instances/{{id}}"
max_response_bytes = 8388608
args_schema = {{ type = "object", properties = {{ id = {{ type = "string" }} }}, required = ["id"] }}

[[agents.tools]]
kind = "http"
name = "lookup_down"
description = "Read an instance from a service that is not there"
method = "GET"
url = "http://127.0.0.1:{closed}/instances/{{id}}"
timeout = "500ms"
args_schema = {{ type = "object", properties = {{ id = {{ type = "string" }} }}, required = ["id"] }}

[[agents]]
id = "helper"
name = "Helper"
system_prompt = "HELPER-PROMPT: you look things up."
[agents.model]
kind = "openai"
base_url = "{model}"
name = "mock"
max_retries = 0

[[agents.tools]]
kind = "http"
name = "weather"
description = "Read the weather of an instance"
method = "GET"
url = "{service}/instances/{{id}}"
args_schema = {{ type = "object", properties = {{ id = {{ type = "string" }} }}, required = ["id"] }}
"#
    )
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// The tool service's requests for one run.
fn of_run<'a>(requests: &'a [Value], run: &str) -> Vec<&'a Value> {
    requests.iter().filter(|r| r["keelRunId"] == run).collect()
}

// ------------------------------------------------------------------------------ the tests

/// Ask → card → approve → one request (with the call's key and the run's id) → result → answer;
/// reject sends nothing; edited arguments are checked again (a `pattern` and a `oneOf` violation
/// refused with their JSON path) and run as edited. Every call id the model sent was `call_0`: each
/// run's key is its own.
#[test]
fn approve_reject_and_edit_an_http_tool_of_an_agent_from_keel_toml() {
    let dir = tempdir();
    let (model, service) = (MockModel::start(), ToolService::start());
    let server = Serve::start(dir.path(), &keel_toml(&model.url, &service.url));
    let api = Api::new(&server);
    runtime().block_on(async {
        // Ask: the run pauses on a card made from the tool's templates; nothing was sent.
        let conv = api.conversation(None).await;
        let turn = api.say(&conv, r#"call restart {"instanceId": "web-1"}"#).await;
        assert_eq!(turn["run"]["status"], "interrupted", "{turn}");
        let interrupt = &turn["interrupt"];
        assert_eq!(interrupt["kind"], "confirm_action");
        assert_eq!(interrupt["payload"]["title"], "Restart web-1?");
        assert_eq!(interrupt["payload"]["risk"], "web-1 drops what it is serving.");
        assert!(service.requests().await.is_empty());
        let run = turn["run"]["id"].as_str().unwrap().to_owned();

        // Approve (twice: a double click): one request, with the call's key and the run's id.
        let int_id = interrupt["id"].as_str().unwrap();
        let (status, resumed) = api.resume(&run, int_id, json!("approve"), Some("looked fine"), "approve-1").await;
        assert_eq!(status, 200, "{resumed}");
        let (again, _) = api.resume(&run, int_id, json!("approve"), Some("looked fine"), "approve-1").await;
        assert_eq!(again, 200);
        let view = api.settled(&run).await;
        assert_eq!(view["status"], "completed", "{view}");
        let requests = service.requests().await;
        assert_eq!(requests.len(), 1, "{requests:?}");
        let call = &view["toolCalls"][0];
        assert_eq!(call["state"], "succeeded");
        assert_ne!(call["id"], "call_0", "the call id is Keel's own");
        assert_eq!(requests[0]["method"], "POST");
        assert_eq!(requests[0]["path"], "/restart/web-1");
        assert_eq!(requests[0]["idempotencyKey"], call["id"]);
        assert_eq!(requests[0]["keelRunId"], run.as_str());
        assert_eq!(requests[0]["keelAttempt"], "1");
        assert_eq!(service.effects().await, json!({"web-1": 1}));
        // The answer is the model's, after the service's result; the decision is on record.
        let answer = resumed["message"]["content"].as_str().unwrap_or_default().to_owned();
        let answer = if answer.is_empty() {
            api.get(&format!("/v1/conversations/{conv}")).await["messages"].as_array().unwrap().last().unwrap()
                ["content"]
                .as_str()
                .unwrap()
                .to_owned()
        } else {
            answer
        };
        assert!(answer.starts_with("tool said: ") && answer.contains("\"restarted\":true"), "{answer}");
        let decided = &view["interrupts"][0];
        assert_eq!(decided["decision"], "approve");
        assert_eq!(decided["note"], "looked fine");
        assert_eq!(decided["resolvedBy"], "demo");
        let finished = api.tool_finished(&run).await;
        assert_eq!(finished.len(), 1);
        assert_eq!(finished[0]["summary"], "POST /restart/{instanceId} → 200");

        // Reject: no request; the model is told.
        let turn = api.say(&conv, r#"call restart {"instanceId": "web-2"}"#).await;
        let run2 = turn["run"]["id"].as_str().unwrap().to_owned();
        let (status, _) =
            api.resume(&run2, turn["interrupt"]["id"].as_str().unwrap(), json!("reject"), None, "reject-1").await;
        assert_eq!(status, 200);
        let view = api.settled(&run2).await;
        assert_eq!(view["status"], "completed", "{view}");
        assert_eq!(view["toolCalls"][0]["state"], "denied");
        assert_eq!(service.requests().await.len(), 1, "a rejected call sends nothing");
        let told = model.requests().last().unwrap()["messages"].as_array().unwrap().last().unwrap().clone();
        assert_eq!(told["role"], "tool");
        assert!(told["content"].as_str().unwrap().contains("rejected"), "{told}");

        // Edit: checked against the schema again, and refused with the JSON path and the rule.
        let turn = api.say(&conv, r#"call restart {"instanceId": "web-3"}"#).await;
        let run3 = turn["run"]["id"].as_str().unwrap().to_owned();
        let int3 = turn["interrupt"]["id"].as_str().unwrap().to_owned();
        let call3 = api.run(&run3).await["toolCalls"][0]["id"].as_str().unwrap().to_owned();
        for (i, (args, path, rule)) in [
            (json!({"instanceId": "WEB 3"}), "$.instanceId", "must match the pattern ^[a-z]+-[0-9]+$"),
            (json!({"instanceId": "web-3", "window": "soon"}), "$.window", "must match one of the schemas of oneOf"),
            (json!({"instanceId": "web-3", "force": true}), "$", "has a property the schema does not allow"),
        ]
        .into_iter()
        .enumerate()
        {
            let (status, body) =
                api.resume(&run3, &int3, json!({"edit": {&call3: args}}), None, &format!("edit-bad-{i}")).await;
            assert_eq!(status, 422, "{body}");
            assert_eq!(body["error"]["code"], "INVALID_ARGS");
            let message = body["error"]["message"].as_str().unwrap();
            assert!(message.contains(&format!("{path}: {rule}")), "{message}");
            assert!(!message.contains("WEB 3") && !message.contains("soon"), "never the value: {message}");
        }
        assert_eq!(api.run(&run3).await["status"], "interrupted", "a refused edit decides nothing");
        let (status, body) = api
            .resume(&run3, &int3, json!({"edit": {&call3: {"instanceId": "web-4", "window": "5m"}}}), None, "edit-ok")
            .await;
        assert_eq!(status, 200, "{body}");
        let view = api.settled(&run3).await;
        assert_eq!(view["status"], "completed", "{view}");
        let requests = service.requests().await;
        assert_eq!(requests.len(), 2, "{requests:?}");
        assert_eq!(requests[1]["path"], "/restart/web-4");
        assert_eq!(requests[1]["body"], json!({"window": "5m"}));
        assert_eq!(requests[1]["idempotencyKey"], call3.as_str());
        assert_ne!(requests[0]["idempotencyKey"], requests[1]["idempotencyKey"]);
    });
}

/// SIGKILL of Keel while the service holds four requests (it applied each effect and delays its
/// answer). After the restart: the idempotent tool's call is sent again with the same key and the
/// effect stays applied once; each of the three calls of the tool that is not idempotent waits on
/// an `outcome_unknown` interrupt, and each of its decisions — retry (same key, no second effect),
/// mark_done, mark_failed — works and is recorded with who decided and the note.
#[test]
fn a_crash_while_the_service_holds_the_request_retries_idempotent_calls_and_asks_about_the_others() {
    let dir = tempdir();
    let (model, service) = (MockModel::start(), ToolService::start());
    let server = Serve::start(dir.path(), &keel_toml(&model.url, &service.url));
    let api = Api::new(&server);
    let rt = runtime();
    let runs: Vec<(String, String)> = rt.block_on(async {
        service.control(json!({"mode": "ok", "delay_ms": 60_000, "times": 4, "path": "/restart/"})).await;
        let mut runs = Vec::new();
        for (tool, instance) in
            [("restart_now", "a-1"), ("restart_once", "b-1"), ("restart_once", "b-2"), ("restart_once", "b-3")]
        {
            let conv = api.conversation(Some("ops")).await;
            let run = api.start(&conv, &format!(r#"call {tool} {{"instanceId": "{instance}"}}"#)).await;
            runs.push((run, instance.to_owned()));
        }
        eventually("the service to hold all four requests", || async {
            (service.requests().await.len() == 4).then_some(())
        })
        .await;
        runs
    });
    let dir_path = server.kill();
    let server = Serve::again(&dir_path);
    let api = Api::new(&server);
    rt.block_on(async {
        // Every effect was applied before the crash, once.
        assert_eq!(service.effects().await, json!({"a-1": 1, "b-1": 1, "b-2": 1, "b-3": 1}));

        // The idempotent call: sent again with the same key; the service answered its first
        // answer again, so the effect happened once.
        let (run, _) = &runs[0];
        let view = api.settled(run).await;
        assert_eq!(view["status"], "completed", "{view}");
        let call = &view["toolCalls"][0];
        assert_eq!(call["state"], "succeeded");
        assert_eq!(call["attempts"], 2);
        let requests = service.requests().await;
        let sent = of_run(&requests, run);
        assert_eq!(sent.len(), 2, "{sent:?}");
        assert_eq!(sent[0]["idempotencyKey"], call["id"]);
        assert_eq!(sent[1]["idempotencyKey"], call["id"]);
        assert_eq!((sent[0]["keelAttempt"].as_str(), sent[1]["keelAttempt"].as_str()), (Some("1"), Some("2")));
        assert_eq!(service.effects().await["a-1"], 1);

        // The others: nothing sent again on Keel's own initiative; a human is asked.
        let mut interrupts = Vec::new();
        for (run, _) in &runs[1..] {
            let view = api.settled(run).await;
            assert_eq!(view["status"], "interrupted", "{view}");
            let pending = view["pendingInterrupt"].clone();
            assert_eq!(pending["kind"], "outcome_unknown", "{pending}");
            assert_eq!(pending["payload"]["decisions"], json!(["retry", "mark_done", "mark_failed"]));
            assert_eq!(pending["payload"]["actions"][0]["outcome"], "unknown");
            assert_eq!(pending["payload"]["actions"][0]["attempts"], 1);
            assert_eq!(view["toolCalls"][0]["state"], "unknown");
            interrupts.push(pending["id"].as_str().unwrap().to_owned());
        }
        assert_eq!(service.requests().await.len(), 5, "only the idempotent call was sent again");

        // Retry: the same key again; the service recognises it and applies nothing more.
        let (run, _) = &runs[1];
        let (status, body) = api.resume(run, &interrupts[0], json!("retry"), Some("send it again"), "d-1").await;
        assert_eq!(status, 200, "{body}");
        let view = api.settled(run).await;
        assert_eq!(view["status"], "completed", "{view}");
        assert_eq!(view["toolCalls"][0]["state"], "succeeded");
        let requests = service.requests().await;
        let sent = of_run(&requests, run);
        assert_eq!(sent.len(), 2);
        assert_eq!(sent[0]["idempotencyKey"], sent[1]["idempotencyKey"]);
        assert_eq!(sent[1]["keelAttempt"], "2");
        assert_eq!(service.effects().await["b-1"], 1);

        // Mark done: nothing sent; the call succeeded because a human said so.
        let (run, _) = &runs[2];
        let (status, body) = api.resume(run, &interrupts[1], json!("mark_done"), Some("it restarted"), "d-2").await;
        assert_eq!(status, 200, "{body}");
        let view = api.settled(run).await;
        assert_eq!(view["status"], "completed", "{view}");
        assert_eq!(view["toolCalls"][0]["state"], "succeeded");

        // Mark failed: nothing sent; the call failed, and the model is told.
        let (run, _) = &runs[3];
        let (status, body) = api.resume(run, &interrupts[2], json!("mark_failed"), Some("it did not"), "d-3").await;
        assert_eq!(status, 200, "{body}");
        let view = api.settled(run).await;
        assert_eq!(view["status"], "completed", "{view}");
        assert_eq!(view["toolCalls"][0]["state"], "failed");
        let finished = api.tool_finished(run).await;
        assert_eq!(finished.last().unwrap()["errorCode"], "marked_failed");
        assert_eq!(service.requests().await.len(), 6, "mark_done and mark_failed send nothing");

        // Each decision is on record, with who decided and the note.
        for ((run, _), (decision, note)) in runs[1..].iter().zip([
            ("retry", "send it again"),
            ("mark_done", "it restarted"),
            ("mark_failed", "it did not"),
        ]) {
            let view = api.run(run).await;
            let decided = &view["interrupts"][0];
            assert_eq!(decided["kind"], "outcome_unknown");
            assert_eq!(decided["status"], "resolved");
            assert_eq!(decided["decision"], decision, "{decided}");
            assert_eq!(decided["note"], note);
            assert_eq!(decided["resolvedBy"], "demo");
            let resumed = api.events(run).await.into_iter().find(|e| e["type"] == "resumed").unwrap();
            assert_eq!(resumed["note"], note, "{resumed}");
        }
    });
}

/// The service down, slow, failing with 500, answering too much or not JSON: each is its own tool
/// error, the event names it, the model is told, and the run goes on to its answer. Calls that
/// got no answer (or a 500) from a GET are retried with the same key, a bounded number of times.
#[test]
fn a_failing_service_is_an_error_the_run_goes_on_with() {
    let dir = tempdir();
    let (model, service) = (MockModel::start(), ToolService::start());
    let server = Serve::start(dir.path(), &keel_toml(&model.url, &service.url));
    let api = Api::new(&server);
    runtime().block_on(async {
        let conv = api.conversation(None).await;
        let cases = [
            ("lookup", json!({"mode": "500"}), "http_500", 3),
            ("lookup", json!({"mode": "hang_then_ok", "delay_ms": 3000}), "timeout", 3),
            ("lookup", json!({"mode": "oversize"}), "too_large", 1),
            ("lookup", json!({"mode": "nonjson"}), "bad_response", 1),
            ("lookup_down", json!({}), "unreachable", 0),
        ];
        for (tool, control, code, sent) in cases {
            service.reset().await;
            service.control(control.clone()).await;
            let turn = api.say(&conv, &format!(r#"call {tool} {{"id": "web-1"}}"#)).await;
            assert_eq!(turn["run"]["status"], "completed", "{control}: {turn}");
            let run = turn["run"]["id"].as_str().unwrap();
            let finished = api.tool_finished(run).await;
            assert_eq!(finished.len(), 1, "{control}");
            assert_eq!(finished[0]["status"], "error", "{control}");
            assert_eq!(finished[0]["errorCode"], code, "{control}");
            let view = api.run(run).await;
            assert_eq!(view["toolCalls"][0]["state"], "failed", "{control}");
            // The model was told which error it was, and answered.
            let told = model.requests().last().unwrap()["messages"].as_array().unwrap().last().unwrap().clone();
            let result: Value = serde_json::from_str(told["content"].as_str().unwrap()).unwrap();
            assert_eq!(result["code"], code, "{control}");
            assert!(turn["message"]["content"].as_str().unwrap().starts_with("tool said: "), "{turn}");
            let requests = service.requests().await;
            assert_eq!(requests.len(), sent, "{control}: {requests:?}");
            assert!(requests.iter().all(|r| r["idempotencyKey"] == view["toolCalls"][0]["id"]), "{requests:?}");
        }
        // An answer the tool accepts but the agent's budget (4 KiB) does not: the model, the store
        // and the events get a marker with the total size and the start, never the 5 MiB.
        service.reset().await;
        service.control(json!({"mode": "oversize"})).await;
        let turn = api.say(&conv, r#"call lookup_big {"id": "web-1"}"#).await;
        assert_eq!(turn["run"]["status"], "completed", "{turn}");
        let run = turn["run"]["id"].as_str().unwrap();
        assert_eq!(api.tool_finished(run).await[0]["status"], "success");
        let told = model.requests().last().unwrap()["messages"].as_array().unwrap().last().unwrap().clone();
        let content = told["content"].as_str().unwrap();
        assert!(content.len() < 4096 + 512, "{} bytes reached the model", content.len());
        let marker: Value = serde_json::from_str(content).unwrap();
        assert_eq!(marker["truncated"], true, "{marker}");
        assert!(marker["totalBytes"].as_u64().unwrap() > 5 * 1024 * 1024, "{marker}");
        assert!(marker["preview"].as_str().unwrap().starts_with("{\"padding\""), "{marker}");
        let events = Value::from(api.events(run).await).to_string();
        assert!(events.len() < 64 * 1024, "the events hold {} bytes", events.len());

        // And a good answer after all that.
        service.reset().await;
        let turn = api.say(&conv, r#"call lookup {"id": "web-1"}"#).await;
        let finished = api.tool_finished(turn["run"]["id"].as_str().unwrap()).await;
        assert_eq!(finished[0]["status"], "success");
        assert!(turn["message"]["content"].as_str().unwrap().contains("\"status\":\"unhealthy\""), "{turn}");
    });
}

/// Two agents in one server: each conversation keeps its agent, and its runs see that agent's
/// prompt and tools only — a call of the other agent's tool is refused without a request.
#[test]
fn two_agents_never_see_each_others_tools_or_prompt() {
    let dir = tempdir();
    let (model, service) = (MockModel::start(), ToolService::start());
    let server = Serve::start(dir.path(), &keel_toml(&model.url, &service.url));
    let api = Api::new(&server);
    runtime().block_on(async {
        let agents = api.get("/v1/agents").await;
        let ids: Vec<&str> = agents["agents"].as_array().unwrap().iter().map(|a| a["id"].as_str().unwrap()).collect();
        assert_eq!(ids, ["ops", "helper"]);
        assert_eq!(agents["agents"][0]["default"], true);
        assert_eq!(agents["agents"][1]["tools"][0]["name"], "weather");
        assert_eq!(
            agents["agents"][0]["tools"][0]["policies"],
            json!({"viewer": "deny", "operator": "ask", "admin": "ask"})
        );

        let (status, body) = api.post("/v1/conversations", json!({"agentId": "nobody"})).await;
        assert_eq!(status, 422, "{body}");
        assert_eq!(body["error"]["code"], "UNKNOWN_AGENT");

        let ops = api.conversation(None).await;
        let helper = api.conversation(Some("helper")).await;
        assert_eq!(api.get(&format!("/v1/conversations/{ops}")).await["agentId"], "ops");
        assert_eq!(api.get(&format!("/v1/conversations/{helper}")).await["agentId"], "helper");

        let tools_and_prompt = |request: &Value| {
            let tools: Vec<String> = request["tools"]
                .as_array()
                .map(|t| t.iter().map(|t| t["function"]["name"].as_str().unwrap().to_owned()).collect())
                .unwrap_or_default();
            let prompt = request["messages"][0]["content"].as_str().unwrap_or_default().to_owned();
            (tools, prompt)
        };
        api.say(&helper, "hi").await;
        let (tools, prompt) = tools_and_prompt(model.requests().last().unwrap());
        assert_eq!(tools, ["weather"]);
        assert!(prompt.contains("HELPER-PROMPT") && !prompt.contains("OPS-PROMPT"), "{prompt}");
        api.say(&ops, "hi").await;
        let (tools, prompt) = tools_and_prompt(model.requests().last().unwrap());
        assert_eq!(tools, ["restart", "restart_now", "restart_once", "lookup", "lookup_big", "lookup_down"]);
        assert!(prompt.contains("OPS-PROMPT") && !prompt.contains("HELPER-PROMPT"), "{prompt}");
        // Every request of the helper's conversation, before and after the ops turn, is the helper's.
        let turn = api.say(&helper, r#"call restart_now {"instanceId": "web-9"}"#).await;
        assert_eq!(turn["run"]["status"], "completed", "{turn}");
        let finished = api.tool_finished(turn["run"]["id"].as_str().unwrap()).await;
        assert_eq!(finished[0]["status"], "error");
        assert!(service.requests().await.is_empty(), "the helper has no restart_now");
        for request in model.requests() {
            let (tools, prompt) = tools_and_prompt(&request);
            if prompt.contains("HELPER-PROMPT") {
                assert_eq!(tools, ["weather"], "{request}");
                let text = request.to_string();
                assert!(!text.contains("OPS-PROMPT"), "{text}");
            }
        }
    });
}

/// Each mistake in an agent's tools stops `keel serve` before it listens: exit code 1 and one
/// line that names the file, the agent, the tool and the field.
#[test]
fn a_bad_tool_in_keel_toml_stops_serve_with_one_line() {
    const AGENT: &str = "[[agents]]\nid = \"ops\"\nsystem_prompt = \"You help.\"\n";
    const TOOL: &str = "[[agents.tools]]\nname = \"restart\"\ndescription = \"Restart it\"\nmethod = \"POST\"\n";
    const UNSET: &str = "KEEL_TEST_UNSET_TOOL_TOKEN";
    let tool = |rest: &str| format!("{AGENT}{TOOL}{rest}");
    let cases = [
        (
            tool("kind = \"grpc\"\nurl = \"http://127.0.0.1:9/r\"\nargs_schema = { type = \"object\" }\n"),
            "agent \"ops\": tools[0] (\"restart\"): kind: unknown tool kind \"grpc\"; supported kinds: http, mcp, client",
        ),
        (
            tool("kind = \"client\"\nargs_schema = { type = \"object\" }\n"),
            "agent \"ops\": tools[0] (\"restart\"): method: not a field of a client tool (kind = \"client\")",
        ),
        (
            tool("kind = \"http\"\nargs_schema = { type = \"object\" }\n"),
            "agent \"ops\": tools[0] (\"restart\"): url: missing; a tool of kind http needs description, method, url and args_schema",
        ),
        (
            tool(
                "kind = \"http\"\nurl = \"http://127.0.0.1:9/r\"\n\
                 args_schema = { type = \"object\", properties = { id = { type = \"strin\" } } }\n",
            ),
            "agent \"ops\": tools[0] (\"restart\"): args_schema: not a valid JSON Schema: at /properties/id/type: \
             \"strin\" is not valid under any of the schemas listed in the 'anyOf' keyword",
        ),
        (
            tool(
                "kind = \"http\"\nurl = \"http://127.0.0.1:9/r\"\nargs_schema = { type = \"object\" }\n\
                 policy = { superuser = \"ask\" }\n",
            ),
            "agent \"ops\": tools[0] (\"restart\"): policy.superuser: unknown role; the roles are viewer, operator, admin",
        ),
        (
            tool(&format!(
                "kind = \"http\"\nurl = \"http://127.0.0.1:9/r\"\nargs_schema = {{ type = \"object\" }}\n\
                 headers = {{ Authorization = \"Bearer ${{{UNSET}}}\" }}\n"
            )),
            "agent \"ops\": tools[0] (\"restart\"): headers.Authorization: the environment variable \
             KEEL_TEST_UNSET_TOOL_TOKEN is not set",
        ),
        (format!("{AGENT}{AGENT}"), "agents: two agents have the id \"ops\""),
    ];
    for (file, line) in cases {
        let dir = tempdir();
        std::fs::write(dir.path().join("keel.toml"), &file).unwrap();
        let output = keel()
            .current_dir(dir.path())
            .args(["serve", "--listen", "127.0.0.1:0"])
            .env_remove(UNSET)
            .output()
            .unwrap();
        assert_eq!(output.status.code(), Some(1), "{file}");
        assert_eq!(String::from_utf8_lossy(&output.stderr), format!("keel: keel.toml: {line}\n"), "{file}");
        assert!(output.stdout.is_empty(), "it never listened: {file}");
    }
}

/// The complete keel.toml of docs/agents.md starts `keel serve` as written (given the environment
/// variables it names), and serves its agent and tools.
#[test]
fn the_keel_toml_of_docs_agents_md_starts_a_server() {
    let doc = std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../docs/agents.md")).unwrap();
    let marker = "<!-- agents.md: keel.toml -->\n```toml\n";
    let start = doc.find(marker).expect("docs/agents.md marks its keel.toml") + marker.len();
    let toml = &doc[start..start + doc[start..].find("```").unwrap()];
    let dir = tempdir();
    std::fs::write(dir.path().join("keel.toml"), toml).unwrap();
    let mut child = keel()
        .current_dir(dir.path())
        .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir.path().join("data"))
        .env("OPS_MODEL_KEY", "sk-docs-example")
        .env("OPS_API_TOKEN", "docs-example-token")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut banner = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut banner).unwrap();
    let url = banner.trim().strip_prefix("Keel listening on ").map(|u| u.trim_end_matches('/').to_owned());
    let agents: Option<Value> = url.as_ref().map(|url| {
        runtime().block_on(async { reqwest::get(format!("{url}/v1/agents")).await.unwrap().json().await.unwrap() })
    });
    let _ = child.kill();
    let _ = child.wait();
    let agents = agents.unwrap_or_else(|| panic!("unexpected banner {banner:?}"));
    let ops = &agents["agents"][0];
    assert_eq!(ops["id"], "ops");
    assert_eq!(ops["name"], "Ops assistant");
    let tools: Vec<&str> = ops["tools"].as_array().unwrap().iter().map(|t| t["name"].as_str().unwrap()).collect();
    assert_eq!(tools, ["get_service", "restart_service"]);
    assert_eq!(ops["tools"][0]["policies"], json!({"viewer": "allow", "operator": "allow", "admin": "allow"}));
    assert_eq!(ops["tools"][1]["policies"], json!({"viewer": "deny", "operator": "ask", "admin": "ask"}));
    assert_eq!(ops["tools"][1]["idempotent"], true);
}

/// `keel serve` without agents runs one plain `assistant` with no tools, and seeds nothing: no
/// demo tables, no demo routes — even over a database `keel demo` used before, whose fleet stays
/// the demo's own.
#[test]
fn serve_without_agents_runs_a_plain_assistant_and_seeds_nothing() {
    let dir = tempdir();
    let tables = |dir: &Path| -> Vec<String> {
        let db = keel_store::rusqlite::Connection::open(dir.join("data/keel.db")).unwrap();
        let mut statement = db.prepare("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name").unwrap();
        let names = statement.query_map([], |row| row.get::<_, String>(0)).unwrap();
        names.map(Result::unwrap).collect()
    };
    let check = |server: &Serve| {
        runtime().block_on(async {
            let api = Api::new(server);
            let agents = api.get("/v1/agents").await;
            assert_eq!(agents["agents"].as_array().unwrap().len(), 1, "{agents}");
            assert_eq!(agents["agents"][0]["id"], "assistant");
            assert_eq!(agents["agents"][0]["tools"], json!([]));
            let demo = api.http.get(format!("{}/v1/demo/instances", api.base)).send().await.unwrap();
            assert_eq!(demo.status(), 404, "no demo routes");
            let conv = api.conversation(None).await;
            let turn = api.say(&conv, "hello").await;
            assert_eq!(turn["run"]["status"], "completed", "{turn}");
        })
    };
    let server = Serve::start(dir.path(), "");
    check(&server);
    drop(server);
    let keel_tables = tables(dir.path());
    assert!(keel_tables.iter().all(|t| !t.starts_with("opspilot")), "{keel_tables:?}");
    assert!(keel_tables.contains(&"runs".to_owned()), "{keel_tables:?}");

    // The demo over the same database adds its own tables; `keel serve` still serves no demo.
    let mut demo = keel()
        .args(["demo", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir.path().join("data"))
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut banner = String::new();
    BufReader::new(demo.stdout.take().unwrap()).read_line(&mut banner).unwrap();
    assert!(banner.starts_with("Keel demo running at "), "{banner:?}");
    demo.kill().unwrap();
    demo.wait().unwrap();
    assert!(tables(dir.path()).contains(&"opspilot_instances".to_owned()));
    let server = Serve::again(dir.path());
    check(&server);
}

// ------------------------------------------------------------------------------ client-side tools

/// The agent `front`: `ask_user` (a question only the user can answer, with a result schema),
/// `pick_file` (asks for approval first) and `ask_quick` (the client has one second to answer).
fn client_toml(model: &str) -> String {
    format!(
        r#"
[[agents]]
id = "front"
name = "Front"
system_prompt = "You ask the user when you must."
[agents.model]
kind = "openai"
base_url = "{model}"
name = "mock"
max_retries = 0

[[agents.tools]]
kind = "client"
name = "ask_user"
description = "Ask the user a question and get their answer"
args_schema = {{ type = "object", properties = {{ question = {{ type = "string" }} }}, required = ["question"] }}
result_schema = {{ type = "object", properties = {{ answer = {{ type = "string", maxLength = 50 }} }}, required = ["answer"], additionalProperties = false }}

[[agents.tools]]
kind = "client"
name = "pick_file"
description = "Let the user pick a local file and read it"
policy = "ask"
args_schema = {{ type = "object", properties = {{ pattern = {{ type = "string" }} }} }}
[agents.tools.confirm]
title = "Read a local file ({{pattern}})?"

[[agents.tools]]
kind = "client"
name = "ask_quick"
description = "Ask, but only for a second"
timeout = "1s"
args_schema = {{ type = "object" }}
"#
    )
}

impl Api {
    async fn tool_result(&self, run: &str, body: Value) -> (u16, Value) {
        self.post(&format!("/v1/runs/{run}/tool-results"), body).await
    }
}

/// A client-side tool over the REST API: the call pauses the run on a `tool_call` interrupt with
/// the call's id, name and arguments; a wrong call id, a body without a result, a result that
/// breaks the schema are refused (422) and decide nothing; the answer continues the run once — the
/// same request again gets the first answer, another answer 409, concurrent answers one winner —
/// and the model sees exactly one result; an error from the client is the call's error; an `ask`
/// tool shows its card first; cancel and expiry end the call as unanswered.
#[test]
fn a_client_tool_waits_for_the_clients_answer_and_continues_once() {
    let dir = tempdir();
    let model = MockModel::start();
    let server = Serve::start(dir.path(), &client_toml(&model.url));
    let api = Api::new(&server);
    runtime().block_on(async {
        let conv = api.conversation(Some("front")).await;
        let turn = api.say(&conv, r#"call ask_user {"question": "Which region?"}"#).await;
        assert_eq!(turn["run"]["status"], "interrupted", "{turn}");
        let run = turn["run"]["id"].as_str().unwrap().to_owned();
        let interrupt = &turn["interrupt"];
        assert_eq!(interrupt["kind"], "tool_call", "{interrupt}");
        let payload = &interrupt["payload"];
        let call = payload["callId"].as_str().unwrap().to_owned();
        assert_eq!(payload["tool"], "ask_user");
        assert_eq!(payload["args"], json!({"question": "Which region?"}));
        assert_eq!(payload["actions"][0]["resultSchema"]["required"], json!(["answer"]));
        assert_eq!(api.run(&run).await["toolCalls"][0]["state"], "suspended");

        // Refused, and nothing decided: an unknown call, a malformed one, no result, a bad result.
        for (body, code, said) in [
            (json!({"callId": "call_00000000000000000000000000", "result": {"answer": "eu"}, "idempotencyKey": "a"}),
             "UNKNOWN_CALL", "callId"),
            (json!({"callId": "nope", "result": {"answer": "eu"}, "idempotencyKey": "a"}), "UNKNOWN_CALL", "callId"),
            (json!({"callId": &call, "idempotencyKey": "a"}), "VALIDATION_FAILED", "exactly one"),
            (json!({"callId": &call, "result": {"answer": "eu"}, "error": "x", "idempotencyKey": "a"}),
             "VALIDATION_FAILED", "exactly one"),
            (json!({"callId": &call, "result": {"answer": "eu"}}), "VALIDATION_FAILED", "idempotencyKey"),
            (json!({"callId": &call, "result": {"answer": 7}, "idempotencyKey": "a"}), "INVALID_RESULT", "$.answer"),
            (json!({"callId": &call, "result": {"answer": "eu", "extra": "s3cr3t-value"}, "idempotencyKey": "a"}),
             "INVALID_RESULT", "$"),
        ] {
            let (status, answer) = api.tool_result(&run, body.clone()).await;
            assert_eq!(status, 422, "{body}: {answer}");
            assert_eq!(answer["error"]["code"], code, "{body}: {answer}");
            let message = answer["error"]["message"].as_str().unwrap();
            assert!(message.contains(said), "{message}");
            assert!(!message.contains("s3cr3t-value"), "never the value: {message}");
        }
        assert_eq!(api.run(&run).await["status"], "interrupted");
        let (status, body) = api
            .post(
                &format!("/v1/runs/{run}/resume"),
                json!({"interruptId": interrupt["id"], "decision": "approve", "idempotencyKey": "r"}),
            )
            .await;
        assert_eq!((status, body["error"]["code"].as_str()), (422, Some("INVALID_DECISION")), "{body}");

        // The answer, twice with its key (the first answer again), then with another key (409).
        let answer = json!({"callId": &call, "result": {"answer": "eu-west"}, "idempotencyKey": "answer-1"});
        let (status, first) = api.tool_result(&run, answer.clone()).await;
        assert_eq!(status, 200, "{first}");
        assert_eq!(first["callId"], call.as_str());
        assert_eq!(first["outcome"], "success");
        let (status, again) = api.tool_result(&run, answer).await;
        assert_eq!((status, &again), (200, &first));
        let (status, late) = api
            .tool_result(&run, json!({"callId": &call, "result": {"answer": "us"}, "idempotencyKey": "answer-2"}))
            .await;
        assert_eq!((status, late["error"]["code"].as_str()), (409, Some("TOOL_CALL_ALREADY_ANSWERED")), "{late}");
        let view = api.settled(&run).await;
        assert_eq!(view["status"], "completed", "{view}");
        assert_eq!(view["toolCalls"][0]["state"], "succeeded");
        assert_eq!(tool_messages(&model.requests(), "eu-west"), 1, "the model saw the result once");
        let told = model.requests().last().unwrap()["messages"].as_array().unwrap().last().unwrap().clone();
        assert_eq!(told["content"], r#"{"answer":"eu-west"}"#);
        let events = api.events(&run).await;
        let finished: Vec<_> = events.iter().filter(|e| e["type"] == "tool_finished").collect();
        assert_eq!(finished.len(), 1);
        assert_eq!(finished[0]["status"], "success");
        assert_eq!(events.iter().filter(|e| e["type"] == "resumed").count(), 1);
        // The model repeats it (`text_delta`); Keel's own events never carry it.
        let own: Vec<_> = events.iter().filter(|e| e["type"] != "text_delta").cloned().collect();
        assert!(!Value::from(own).to_string().contains("eu-west"), "the result is never in events");

        // Concurrent answers with distinct keys (two tabs): one wins, the run continues once.
        let turn = api.say(&conv, r#"call ask_user {"question": "Again?"}"#).await;
        let run = turn["run"]["id"].as_str().unwrap().to_owned();
        let call = turn["interrupt"]["payload"]["callId"].as_str().unwrap().to_owned();
        let answers = futures::future::join_all((0..6).map(|i| {
            api.tool_result(&run, json!({"callId": &call, "result": {"answer": format!("tab {i}")}, "idempotencyKey": format!("tab-{i}")}))
        }))
        .await;
        let won = answers.iter().filter(|(s, _)| *s == 200).count();
        let lost = answers.iter().filter(|(s, b)| *s == 409 && b["error"]["code"] == "TOOL_CALL_ALREADY_ANSWERED").count();
        assert_eq!((won, lost), (1, 5), "{answers:?}");
        assert_eq!(api.settled(&run).await["status"], "completed");
        assert_eq!(api.events(&run).await.iter().filter(|e| e["type"] == "resumed").count(), 1);
        assert_eq!(tool_messages(&model.requests(), "tab "), 1, "the model saw one result");

        // The client's error is the call's error; the model is told and answers.
        let turn = api.say(&conv, r#"call ask_user {"question": "Still there?"}"#).await;
        let run = turn["run"]["id"].as_str().unwrap().to_owned();
        let call = turn["interrupt"]["payload"]["callId"].as_str().unwrap().to_owned();
        let (status, body) = api
            .tool_result(&run, json!({"callId": &call, "error": "the user closed the dialog", "idempotencyKey": "e"}))
            .await;
        assert_eq!((status, body["outcome"].as_str()), (200, Some("error")), "{body}");
        assert_eq!(api.settled(&run).await["status"], "completed");
        let finished = api.tool_finished(&run).await;
        assert_eq!((finished[0]["status"].as_str(), finished[0]["errorCode"].as_str()), (Some("error"), Some("client_error")));

        // An `ask` client tool: the card first, then the client is asked.
        let turn = api.say(&conv, r#"call pick_file {"pattern": "*.log"}"#).await;
        let run = turn["run"]["id"].as_str().unwrap().to_owned();
        assert_eq!(turn["interrupt"]["kind"], "confirm_action", "{turn}");
        assert_eq!(turn["interrupt"]["payload"]["title"], "Read a local file (*.log)?");
        let (status, resumed) =
            api.resume(&run, turn["interrupt"]["id"].as_str().unwrap(), json!("approve"), None, "ok-file").await;
        assert_eq!(status, 200, "{resumed}");
        assert_eq!(resumed["interrupt"]["kind"], "tool_call", "{resumed}");
        let call = resumed["interrupt"]["payload"]["callId"].as_str().unwrap().to_owned();
        let (status, _) = api
            .tool_result(&run, json!({"callId": &call, "result": {"lines": 3}, "idempotencyKey": "file-1"}))
            .await;
        assert_eq!(status, 200);
        assert_eq!(api.settled(&run).await["status"], "completed");

        // Cancel: the call ends unanswered; an answer after it is refused.
        let turn = api.say(&conv, r#"call ask_user {"question": "Cancel me?"}"#).await;
        let run = turn["run"]["id"].as_str().unwrap().to_owned();
        let call = turn["interrupt"]["payload"]["callId"].as_str().unwrap().to_owned();
        let (status, _) = api.post(&format!("/v1/runs/{run}/cancel"), json!({})).await;
        assert_eq!(status, 200);
        let view = api.run(&run).await;
        assert_eq!((view["status"].as_str(), view["toolCalls"][0]["state"].as_str()), (Some("cancelled"), Some("failed")));
        let (status, body) =
            api.tool_result(&run, json!({"callId": &call, "result": {"answer": "late"}, "idempotencyKey": "c"})).await;
        assert_eq!((status, body["error"]["code"].as_str()), (409, Some("TOOL_CALL_ALREADY_ANSWERED")), "{body}");

        // Expiry: the tool's own timeout (1s); a late answer is 410 and the run is cancelled.
        let turn = api.say(&conv, r#"call ask_quick {}"#).await;
        let run = turn["run"]["id"].as_str().unwrap().to_owned();
        let call = turn["interrupt"]["payload"]["callId"].as_str().unwrap().to_owned();
        tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
        let (status, body) =
            api.tool_result(&run, json!({"callId": &call, "result": {}, "idempotencyKey": "slow"})).await;
        assert_eq!((status, body["error"]["code"].as_str()), (410, Some("INTERRUPT_EXPIRED")), "{body}");
        let view = api.settled(&run).await;
        assert_eq!(view["status"], "cancelled", "{view}");
        assert_eq!(view["toolCalls"][0]["state"], "failed");
        assert_eq!(api.tool_finished(&run).await[0]["errorCode"], "unanswered");
    });
}

/// How many tool messages holding `needle` the model's last request carried.
fn tool_messages(requests: &[Value], needle: &str) -> usize {
    let last = requests.last().unwrap();
    last["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "tool" && m["content"].as_str().is_some_and(|c| c.contains(needle)))
        .count()
}

/// The AG-UI events of one `RunAgentInput` posted to `/v1/ag-ui/front`.
async fn ag_ui(api: &Api, input: Value) -> Vec<Value> {
    let response = api.http.post(format!("{}/v1/ag-ui/front", api.base)).json(&input).send().await.unwrap();
    assert_eq!(response.status(), 200);
    let body = response.text().await.unwrap();
    body.lines().filter_map(|l| l.strip_prefix("data: ")).map(|l| serde_json::from_str(l).unwrap()).collect()
}

/// A frontend tool over AG-UI: the client declares `ask_user` (a client tool of the agent), the
/// model calls it, the run ends after `TOOL_CALL_END` (`RUN_FINISHED`, success), the client sends
/// the result as a `tool` message in the next input, and the run continues to its answer — once,
/// however often the same input is sent.
#[test]
fn a_frontend_tool_over_ag_ui_is_answered_with_a_tool_message() {
    let dir = tempdir();
    let model = MockModel::start();
    let server = Serve::start(dir.path(), &client_toml(&model.url));
    let api = Api::new(&server);
    runtime().block_on(async {
        let thread = format!("thread-{}", std::process::id());
        let tools = json!([{"name": "ask_user", "description": "Ask the user", "parameters": {"type": "object"}}]);
        let question = json!({"id": "u1", "role": "user", "content": r#"call ask_user {"question": "Which region?"}"#});
        let first =
            ag_ui(&api, json!({"threadId": thread, "runId": "r1", "messages": [question], "tools": tools})).await;
        let types: Vec<&str> = first.iter().map(|e| e["type"].as_str().unwrap()).collect();
        let start = first.iter().find(|e| e["type"] == "TOOL_CALL_START").expect("the call is announced");
        assert_eq!(start["toolCallName"], "ask_user");
        let call = start["toolCallId"].as_str().unwrap().to_owned();
        assert!(!types.contains(&"TOOL_CALL_RESULT"), "{types:?}");
        assert_eq!(first.last().unwrap()["type"], "RUN_FINISHED");
        assert_eq!(first.last().unwrap()["outcome"]["type"], "success");
        let snapshot = first.iter().rev().find(|e| e["type"] == "MESSAGES_SNAPSHOT").unwrap()["messages"].clone();

        let mut messages = snapshot.as_array().unwrap().clone();
        messages.push(json!({"id": "t1", "role": "tool", "toolCallId": call, "content": r#"{"answer": "eu-west"}"#}));
        let answer = json!({"threadId": thread, "runId": "r2", "messages": messages, "tools": tools});
        let second = ag_ui(&api, answer.clone()).await;
        let types: Vec<&str> = second.iter().map(|e| e["type"].as_str().unwrap()).collect();
        assert!(types.contains(&"TOOL_CALL_RESULT"), "{types:?}");
        assert!(!types.contains(&"TOOL_CALL_START"), "the call is not started again: {types:?}");
        assert_eq!(second.last().unwrap()["outcome"]["type"], "success", "{types:?}");
        let text: String =
            second.iter().filter(|e| e["type"] == "TEXT_MESSAGE_CONTENT").filter_map(|e| e["delta"].as_str()).collect();
        assert_eq!(text, r#"tool said: {"answer":"eu-west"}"#);
        let asked = model.requests().len();

        // The same input again: the first answer, nothing continues twice.
        let third = ag_ui(&api, answer).await;
        assert_eq!(third.last().unwrap()["outcome"]["type"], "success");
        assert_eq!(model.requests().len(), asked, "the model was not asked again");
        // A different answer to the answered call is refused before the stream starts.
        messages.pop();
        messages.push(json!({"id": "t2", "role": "tool", "toolCallId": call, "content": r#"{"answer": "us"}"#}));
        let response = api
            .http
            .post(format!("{}/v1/ag-ui/front", api.base))
            .json(&json!({"threadId": thread, "runId": "r3", "messages": messages}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 409);
        let body: Value = response.json().await.unwrap();
        assert_eq!(body["error"]["code"], "TOOL_CALL_ALREADY_ANSWERED");
    });
}

/// A crash after the answer: the client's result is committed, and Keel is SIGKILLed while the
/// continuation's model call is in flight. The restarted server continues the run from its
/// checkpoint, once: the model sees the result once, there is one `resumed` and one
/// `tool_finished`, and the same answer again gets the first answer (the stored response survived
/// the crash) while another is refused.
#[test]
fn a_crash_after_a_client_tools_answer_continues_the_run_once() {
    let dir = tempdir();
    let model = MockModel::start();
    let server = Serve::start(dir.path(), &client_toml(&model.url));
    let api = Api::new(&server);
    let rt = runtime();
    let answer = |call: &str| json!({"callId": call, "result": {"answer": "hang-once"}, "idempotencyKey": "crash-1"});
    let (run, call, first) = rt.block_on(async {
        let conv = api.conversation(Some("front")).await;
        let turn = api.say(&conv, r#"call ask_user {"question": "Which region?"}"#).await;
        let run = turn["run"]["id"].as_str().unwrap().to_owned();
        let call = turn["interrupt"]["payload"]["callId"].as_str().unwrap().to_owned();
        let asked = model.requests().len();
        let (status, first) = api.tool_result(&run, answer(&call)).await;
        assert_eq!(status, 200, "{first}");
        eventually("the continuation to reach the model", || async { (model.requests().len() > asked).then_some(()) })
            .await;
        (run, call, first)
    });
    let server = Serve::again(&server.kill());
    let api = Api::new(&server);
    rt.block_on(async {
        let view = api.settled(&run).await;
        assert_eq!(view["status"], "completed", "{view}");
        assert_eq!(view["toolCalls"][0]["state"], "succeeded");
        assert_eq!(tool_messages(&model.requests(), "hang-once"), 1, "the model saw the result once");
        let events = api.events(&run).await;
        assert_eq!(events.iter().filter(|e| e["type"] == "resumed").count(), 1);
        assert_eq!(events.iter().filter(|e| e["type"] == "tool_finished").count(), 1);
        assert_eq!(events.iter().filter(|e| e["type"] == "done").count(), 1);
        let (status, again) = api.tool_result(&run, answer(&call)).await;
        assert_eq!((status, &again), (200, &first), "the first answer, after the crash");
        let (status, other) = api
            .tool_result(&run, json!({"callId": &call, "result": {"answer": "other"}, "idempotencyKey": "crash-2"}))
            .await;
        assert_eq!((status, other["error"]["code"].as_str()), (409, Some("TOOL_CALL_ALREADY_ANSWERED")));
    });
}

/// One step with an `ask` client tool and an allowed one: the card first; once approved, the client
/// is asked for each call in turn (one `tool_call` interrupt each), and the model gets both results.
#[test]
fn several_client_calls_of_one_step_are_asked_one_after_the_other() {
    let dir = tempdir();
    let model = MockModel::start();
    let server = Serve::start(dir.path(), &client_toml(&model.url));
    let api = Api::new(&server);
    runtime().block_on(async {
        let conv = api.conversation(Some("front")).await;
        let turn = api
            .say(&conv, r#"calls [["pick_file", {"pattern": "*.log"}], ["ask_user", {"question": "Which one?"}]]"#)
            .await;
        let run = turn["run"]["id"].as_str().unwrap().to_owned();
        assert_eq!(turn["interrupt"]["kind"], "confirm_action", "{turn}");
        let (status, resumed) =
            api.resume(&run, turn["interrupt"]["id"].as_str().unwrap(), json!("approve"), None, "ok").await;
        assert_eq!(status, 200, "{resumed}");
        let mut answered = Vec::new();
        for i in 0..2 {
            let view = api.settled(&run).await;
            let pending = &view["pendingInterrupt"];
            assert_eq!(pending["kind"], "tool_call", "{view}");
            let tool = pending["payload"]["tool"].as_str().unwrap().to_owned();
            let call = pending["payload"]["callId"].as_str().unwrap().to_owned();
            let result = if tool == "ask_user" { json!({"answer": "the second"}) } else { json!({"lines": 3}) };
            let (status, body) = api
                .tool_result(&run, json!({"callId": call, "result": result, "idempotencyKey": format!("step-{i}")}))
                .await;
            assert_eq!(status, 200, "{body}");
            answered.push(tool);
        }
        answered.sort();
        assert_eq!(answered, ["ask_user", "pick_file"]);
        let view = api.settled(&run).await;
        assert_eq!(view["status"], "completed", "{view}");
        let told = model.requests().last().unwrap()["messages"].clone();
        let results: Vec<&Value> = told.as_array().unwrap().iter().filter(|m| m["role"] == "tool").collect();
        assert_eq!(results.len(), 2, "{told}");
    });
}

/// An `ask` frontend tool over AG-UI: the first run ends with the approval interrupt; the resume
/// ends with the call waiting for the client (success, the call in the snapshot without a result);
/// a `tool` message answers it and the run completes.
#[test]
fn an_ask_frontend_tool_over_ag_ui_is_approved_then_answered() {
    let dir = tempdir();
    let model = MockModel::start();
    let server = Serve::start(dir.path(), &client_toml(&model.url));
    let api = Api::new(&server);
    runtime().block_on(async {
        let thread = format!("thread-ask-{}", std::process::id());
        let question = json!({"id": "u1", "role": "user", "content": r#"call pick_file {"pattern": "*.log"}"#});
        let first = ag_ui(&api, json!({"threadId": thread, "runId": "r1", "messages": [question]})).await;
        let finished = first.last().unwrap();
        assert_eq!(finished["outcome"]["type"], "interrupt", "{finished}");
        let interrupt = &finished["outcome"]["interrupts"][0];
        let call = interrupt["toolCallId"].as_str().unwrap().to_owned();
        let snapshot = first.iter().rev().find(|e| e["type"] == "MESSAGES_SNAPSHOT").unwrap()["messages"].clone();
        let resume = json!({"threadId": thread, "runId": "r2", "messages": snapshot,
            "resume": [{"interruptId": interrupt["id"], "status": "resolved", "payload": {"approved": true}}]});
        let second = ag_ui(&api, resume).await;
        let types: Vec<&str> = second.iter().map(|e| e["type"].as_str().unwrap()).collect();
        assert_eq!(second.last().unwrap()["outcome"]["type"], "success", "{types:?}");
        assert!(!types.contains(&"TOOL_CALL_RESULT") && !types.contains(&"TOOL_CALL_START"), "{types:?}");
        let snapshot = second.iter().rev().find(|e| e["type"] == "MESSAGES_SNAPSHOT").unwrap()["messages"].clone();
        assert!(snapshot.to_string().contains(&call), "the waiting call is in the snapshot");
        let mut messages = snapshot.as_array().unwrap().clone();
        messages.push(json!({"id": "t1", "role": "tool", "toolCallId": call, "content": r#"{"lines": 3}"#}));
        let third = ag_ui(&api, json!({"threadId": thread, "runId": "r3", "messages": messages})).await;
        let types: Vec<&str> = third.iter().map(|e| e["type"].as_str().unwrap()).collect();
        assert!(types.contains(&"TOOL_CALL_RESULT"), "{types:?}");
        assert_eq!(third.last().unwrap()["outcome"]["type"], "success", "{types:?}");
    });
}
