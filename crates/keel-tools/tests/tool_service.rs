//! The test tool service (crates/keel/tests/support/tool_service.py) as a child process, called by
//! real HttpTools: it works, it applies an effect once per Idempotency-Key, and a client that gives
//! up during a delay leaves the effect applied (the crash case end-to-end tests build on).

mod support;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use keel_core::tool::{NextAttempt, ToolError};
use serde_json::{json, Value};

use support::{again, ctx};

/// How long the service may take to start (a safety net, not a measurement).
const START_DEADLINE: Duration = Duration::from_secs(30);

/// The service, killed when dropped.
struct Service {
    child: Child,
    base: String,
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Service {
    fn start() -> Self {
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../keel/tests/support/tool_service.py");
        assert!(script.is_file(), "the test tool service is missing: {}", script.display());
        let mut child = Command::new("python3")
            .arg(&script)
            .arg("0")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("this test needs python3 (3.11 or later) on PATH to run {}: {e}", script.display())
            });
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let mut service = Service { child, base: String::new() };
        let line = rx.recv_timeout(START_DEADLINE).unwrap_or_else(|_| panic!("tool_service.py did not start"));
        let port = line
            .strip_prefix("listening ")
            .and_then(|p| p.trim().parse::<u16>().ok())
            .unwrap_or_else(|| panic!("tool_service.py printed {line:?}, not \"listening <port>\""));
        service.base = format!("http://127.0.0.1:{port}");
        service
    }

    async fn get(&self, path: &str) -> Value {
        reqwest::get(format!("{}{path}", self.base)).await.unwrap().json().await.unwrap()
    }

    async fn control(&self, body: Value) {
        let r = reqwest::Client::new().post(format!("{}/_control", self.base)).json(&body).send().await.unwrap();
        assert!(r.status().is_success(), "{}", r.status());
    }

    fn tool(&self, method: &str, path: &str, timeout: &str) -> std::sync::Arc<dyn keel_core::tool::Tool> {
        support::tool(&format!(
            r#"
kind = "http"
name = "restart_instance"
description = "Restarts an instance"
method = "{method}"
url = "{base}{path}"
timeout = "{timeout}"
args_schema = {{ type = "object", properties = {{ instanceId = {{ type = "string" }}, reason = {{ type = "string" }} }}, required = ["instanceId"] }}
"#,
            base = self.base
        ))
    }
}

#[tokio::test]
async fn the_tool_service_applies_an_effect_once_per_key() {
    let service = Service::start();
    let restart = service.tool("POST", "/restart/{instanceId}", "5s");
    let read = service.tool("GET", "/instances/{instanceId}", "5s");
    let args = json!({"instanceId": "pay-prod-2", "reason": "stuck"});

    let first = ctx();
    let out = restart.execute(&first, &args).await.unwrap();
    assert_eq!(out.result, json!({"instanceId": "pay-prod-2", "restarted": true, "restartCount": 1}));
    // A second attempt of the same call gets the first answer; nothing is applied again.
    let out = restart.execute(&again(&first), &args).await.unwrap();
    assert_eq!(out.result["restartCount"], 1);
    assert_eq!(service.get("/_effects").await, json!({"pay-prod-2": 1}));
    let state = read.execute(&ctx(), &json!({"instanceId": "pay-prod-2"})).await.unwrap();
    assert_eq!(state.result, json!({"id": "pay-prod-2", "status": "healthy", "restartCount": 1}));

    let requests = service.get("/_requests").await;
    let restarts: Vec<&Value> = requests.as_array().unwrap().iter().filter(|r| r["method"] == "POST").collect();
    assert_eq!(restarts.len(), 2);
    for r in &restarts {
        assert_eq!(r["path"], "/restart/pay-prod-2");
        assert_eq!(r["idempotencyKey"], first.idempotency_key.as_str());
        assert_eq!(r["keelRunId"], first.run_id.as_str());
        assert_eq!(r["body"], json!({"reason": "stuck"}));
    }

    // The crash case: the effect is applied, then the answer waits far longer than the tool does
    // (the service's thread sleeps on alone; the test does not wait for it).
    service.control(json!({"mode": "ok", "delay_ms": 60_000, "times": 1})).await;
    let quick = service.tool("POST", "/restart/{instanceId}", "1s");
    let call = ctx();
    let e = quick.execute(&call, &json!({"instanceId": "api-1"})).await.unwrap_err();
    assert!(matches!(e, ToolError::Timeout(_)), "{e:?}");
    assert_eq!(e.next(false), NextAttempt::AskHuman);
    assert_eq!(service.get("/_effects").await["api-1"], 1);
    // Retried with the same key (as for an idempotent tool): the stored answer, still one effect.
    let out = quick.execute(&again(&call), &json!({"instanceId": "api-1"})).await.unwrap();
    assert_eq!(out.result["restartCount"], 1);
    assert_eq!(service.get("/_effects").await["api-1"], 1);

    // Injected failures reach the tool as their kinds.
    service.control(json!({"mode": "500", "times": 1})).await;
    let e = restart.execute(&ctx(), &json!({"instanceId": "api-2"})).await.unwrap_err();
    assert!(matches!(e, ToolError::Status { status: 500, .. }), "{e:?}");
    service.control(json!({"mode": "nonjson", "times": 1})).await;
    let e = restart.execute(&ctx(), &json!({"instanceId": "api-2"})).await.unwrap_err();
    assert!(matches!(e, ToolError::BadResponse(_)), "{e:?}");
    service.control(json!({"mode": "oversize", "times": 1})).await;
    let e = restart.execute(&ctx(), &json!({"instanceId": "api-2"})).await.unwrap_err();
    assert_eq!(e, ToolError::TooLarge { limit: keel_tools::DEFAULT_MAX_RESPONSE_BYTES });
    assert!(service.get("/_effects").await.get("api-2").is_none(), "no failure applied anything");
}
