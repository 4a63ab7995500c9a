//! `keel chat` and `keel runs` as a person uses them: `keel chat` in a real pseudo-terminal (so it
//! draws its spinner and Ctrl-C is a real SIGINT from the terminal), against the real `keel serve`.

mod support;

use std::process::{Command, Stdio};

use keel_client::{KeelClient, ListRuns};
use keel_core::{RunId, RunStatus};
use rexpect::process::WaitStatus;
use rexpect::session::PtySession;
use serde_json::Value;

use support::serve::read_request;
use support::{eventually, keel, Server, DEADLINE};

/// rexpect hands bytes over one by one as `char`s; these match and read UTF-8 text through that.
fn latin1(text: &str) -> String {
    text.bytes().map(char::from).collect()
}

fn utf8(seen: &str) -> String {
    String::from_utf8_lossy(&seen.chars().map(|c| c as u8).collect::<Vec<u8>>()).into_owned()
}

/// `keel chat --server URL` in a pseudo-terminal.
fn chat(server: &Server) -> Chat {
    let mut cmd = keel();
    cmd.args(["chat", "--server", &server.url()]);
    Chat(rexpect::session::spawn_command(cmd, Some(DEADLINE.as_millis() as u64)).expect("spawn keel chat in a pty"))
}

struct Chat(PtySession);

impl Chat {
    /// Reads up to and including `needle`; returns what came before it.
    fn expect(&mut self, needle: &str) -> String {
        match self.0.exp_string(&latin1(needle)) {
            Ok(before) => utf8(&before),
            Err(e) => panic!("keel chat never printed {needle:?}: {e}"),
        }
    }

    fn type_line(&mut self, line: &str) {
        self.0.send_line(line).expect("type a line");
    }

    fn exit_code(&mut self) -> i32 {
        self.0.exp_eof().expect("keel chat exits");
        match self.0.process().wait().expect("wait for keel chat") {
            WaitStatus::Exited(_, code) => code,
            other => panic!("keel chat did not exit normally: {other:?}"),
        }
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

async fn instance(server: &Server, id: &str) -> Value {
    let fleet: Value = reqwest::get(format!("{}/v1/demo/instances", server.url())).await.unwrap().json().await.unwrap();
    fleet.as_array().unwrap().iter().find(|i| i["id"] == id).cloned().expect("the instance")
}

/// `keel runs …` with stdin closed and stdout a pipe: its exit code and output.
fn runs(server: &Server, args: &[&str]) -> (i32, String) {
    runs_at(&server.url(), args)
}

fn runs_at(url: &str, args: &[&str]) -> (i32, String) {
    let output = keel()
        .arg("runs")
        .args(args)
        .args(["--server", url])
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .expect("run keel runs");
    (output.status.code().unwrap_or(-1), String::from_utf8(output.stdout).expect("UTF-8"))
}

async fn only_run(keel: &KeelClient) -> RunId {
    let list = keel.list_runs(ListRuns::default()).await.unwrap();
    assert_eq!(list.runs.len(), 1, "{list:?}");
    list.runs[0].id.clone()
}

#[test]
fn chat_asks_before_the_restart_and_restarts_once_after_y() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), 2);
    let rt = runtime();
    assert_eq!(rt.block_on(instance(&server, "pay-prod-2"))["restartCount"], 0);

    let mut chat = chat(&server);
    chat.expect("you> ");
    chat.type_line("Restart the abnormal instance of payment-api");
    // a tool step on a terminal: a spinner, then the outcome
    chat.expect("⠋ find_abnormal_instances");
    chat.expect("✓ find_abnormal_instances: pay-prod-2 is abnormal");
    let card = chat.expect("Restart pay-prod-2? [y/N/e(dit)] ");
    assert!(card.contains("restart_instance {\"instanceId\":\"pay-prod-2\"}"), "{card}");
    assert!(!card.contains("restarted"), "nothing ran before the answer: {card}");
    chat.type_line("y");
    chat.expect("approved by demo");
    chat.expect("⠋ restart_instance instanceId=pay-prod-2");
    chat.expect("✓ restart_instance: restarted pay-prod-2 (restart #1)");
    let answer = chat.expect("you> ");
    assert!(answer.contains("Restarted pay-prod-2. It is healthy now (restart count 1)."), "{answer}");
    chat.0.send_control('d').unwrap();
    assert_eq!(chat.exit_code(), 0);

    let keel = KeelClient::new(server.url());
    let pay2 = rt.block_on(instance(&server, "pay-prod-2"));
    assert_eq!(pay2["restartCount"], 1, "{pay2}");
    assert_eq!(pay2["status"], "healthy");

    // the history says who approved what, and when
    let run_id = rt.block_on(only_run(&keel));
    let (code, shown) = runs(&server, &["show", run_id.as_str()]);
    assert_eq!(code, 0, "{shown}");
    assert!(shown.starts_with(&format!("Run {run_id}: completed\n")), "{shown}");
    assert!(shown.contains("restart_instance succeeded: restarted pay-prod-2 (restart #1)"), "{shown}");
    let run = rt.block_on(keel.get_run(&run_id)).unwrap();
    // where it ran: the server's instance id (keel-<random> when none is given)
    let worker = run.worker.as_deref().expect("a completed run names its worker");
    assert!(worker.starts_with("keel-"), "{worker}");
    assert!(shown.contains(&format!("\n  worker        {worker}\n")), "{shown}");
    let resolved_at = run.interrupts[0].resolved_at.unwrap().format("%Y-%m-%d %H:%M:%S UTC").to_string();
    assert!(
        shown.contains(&format!(
            "Restart pay-prod-2? (restart_instance {{\"instanceId\":\"pay-prod-2\"}}): approved by demo at {resolved_at}"
        )),
        "{shown}"
    );

    // a replay shows the old question and its answer, and asks nothing
    let (code, watched) = runs(&server, &["watch", run_id.as_str()]);
    assert_eq!(code, 0, "{watched}");
    assert!(watched.contains("⏸ Restart pay-prod-2?\n"), "{watched}");
    assert!(watched.contains("↳ approved by demo after "), "{watched}");
    assert!(!watched.contains("[y/N/e(dit)]"), "{watched}");

    let (code, listed) = runs(&server, &["list", "--status", "completed"]);
    assert_eq!(code, 0);
    assert!(listed.lines().nth(1).unwrap().starts_with(&format!("{run_id} ")), "{listed}");
    assert!(listed.contains(" completed "), "{listed}");
    let (code, listed) = runs(&server, &["list", "--status", "interrupted"]);
    assert_eq!((code, listed.as_str()), (0, "No runs.\n"));
}

#[test]
fn edit_resumes_with_the_edited_arguments() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), 1);
    let mut chat = chat(&server);
    chat.expect("you> ");
    chat.type_line("Restart the abnormal instance of payment-api");
    chat.expect("[y/N/e(dit)] ");
    chat.type_line("maybe");
    chat.expect("answer y (approve), n (reject, the default) or e (edit the arguments)");
    chat.expect("[y/N/e(dit)] ");
    chat.type_line("e");
    chat.expect("restart_instance arguments (JSON; empty keeps {\"instanceId\":\"pay-prod-2\"}): ");
    chat.type_line("[\"not an object\"]");
    chat.expect("the arguments must be a JSON object");
    chat.expect("restart_instance arguments (JSON; empty keeps");
    chat.type_line("{\"instanceId\": \"pay-prod-2\"}");
    chat.expect("approved with edited arguments");
    chat.expect("✓ restart_instance: restarted pay-prod-2 (restart #1)");
    chat.expect("you> ");
    chat.0.send_control('d').unwrap();
    assert_eq!(chat.exit_code(), 0);

    let rt = runtime();
    let keel = KeelClient::new(server.url());
    let run = rt.block_on(keel.get_run(&rt.block_on(only_run(&keel)))).unwrap();
    assert!(run.interrupts[0].decision.as_ref().unwrap().get("edit").is_some(), "{:?}", run.interrupts);
    assert_eq!(rt.block_on(instance(&server, "pay-prod-2"))["restartCount"], 1);
}

/// A note may follow the answer ("y, checked …"): it goes with the decision, the run's events show
/// it, and so does its history. A note longer than the server takes is asked again.
#[test]
fn a_note_after_the_answer_goes_with_the_decision() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), 1);
    let mut chat = chat(&server);
    chat.expect("you> ");
    chat.type_line("Restart the abnormal instance of payment-api");
    let card = chat.expect("Restart pay-prod-2? [y/N/e(dit)] ");
    assert!(
        card.contains("(a note may follow the answer, e.g. `n wrong instance`: it is kept with the decision)"),
        "{card}"
    );
    chat.type_line(&format!("y {}", "x".repeat(2001)));
    chat.expect("a note is at most 2000 characters");
    chat.expect("Restart pay-prod-2? [y/N/e(dit)] ");
    chat.type_line("yes, checked the dashboard: pay-prod-2 is stuck");
    chat.expect("↳ approved by demo after ");
    chat.expect("  note: checked the dashboard: pay-prod-2 is stuck");
    chat.expect("✓ restart_instance: restarted pay-prod-2 (restart #1)");
    chat.expect("you> ");
    chat.0.send_control('d').unwrap();
    assert_eq!(chat.exit_code(), 0);

    let rt = runtime();
    let keel = KeelClient::new(server.url());
    let run_id = rt.block_on(only_run(&keel));
    let run = rt.block_on(keel.get_run(&run_id)).unwrap();
    assert_eq!(
        run.interrupts[0].note.as_deref().map(String::as_str),
        Some("checked the dashboard: pay-prod-2 is stuck")
    );
    assert_eq!(run.interrupts[0].decision.as_deref(), Some(&serde_json::json!("approve")));
    let (code, shown) = runs(&server, &["show", run_id.as_str()]);
    assert_eq!(code, 0, "{shown}");
    assert!(shown.contains("\n    note: checked the dashboard: pay-prod-2 is stuck\n"), "{shown}");
}

#[test]
fn runs_watch_reattaches_to_a_waiting_run_and_asks() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), 1);
    let rt = runtime();
    let api = KeelClient::new(server.url());
    let conversation = rt.block_on(api.create_conversation("paused elsewhere")).unwrap();
    let sent = rt.block_on(api.send_message(&conversation.id, "Restart the abnormal instance of payment-api")).unwrap();
    rt.block_on(eventually("the run to wait for approval", || async {
        (api.get_run(&sent.run_id).await.unwrap().status == RunStatus::Interrupted).then_some(())
    }));

    let mut cmd = keel();
    cmd.args(["runs", "watch", sent.run_id.as_str(), "--server", &server.url()]);
    let mut watch = Chat(rexpect::session::spawn_command(cmd, Some(DEADLINE.as_millis() as u64)).unwrap());
    watch.expect(&format!("Run {} (interrupted), from its first event:", sent.run_id));
    watch.expect("✓ find_abnormal_instances: pay-prod-2 is abnormal");
    watch.expect("Restart pay-prod-2? [y/N/e(dit)] ");
    watch.type_line("");
    watch.expect("↳ rejected by demo");
    watch.expect("⊘ restart_instance");
    watch.expect(&format!("Run {} completed.", sent.run_id));
    assert_eq!(watch.exit_code(), 0);
    assert_eq!(rt.block_on(instance(&server, "pay-prod-2"))["restartCount"], 0, "rejected: no restart");
}

#[test]
fn ctrl_c_detaches_the_run_goes_on_and_runs_watch_shows_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    // 60 ms a word: the answer streams for more than a second after its tool step
    let server = Server::start(dir.path(), 60);
    let mut chat = chat(&server);
    chat.expect("you> ");
    chat.type_line("Look at the recent errors of payment-api");
    let before = chat.expect("✓ get_recent_errors:");
    chat.0.send_control('c').unwrap();
    let streamed = chat.expect("Reattach with: keel runs watch ");
    let (_, run_id) = chat.0.exp_regex("run_[0-9a-f]+").expect("the run id");
    let run_id = RunId::parse(&run_id).unwrap();
    assert!(streamed.contains(&format!("Detached from {run_id}; the run goes on")), "{streamed}");
    assert_eq!(chat.exit_code(), 130);

    // the run was not cancelled: it finishes on its own
    let rt = runtime();
    let keel = KeelClient::new(server.url());
    let run = rt.block_on(eventually("the detached run to finish", || async {
        let run = keel.get_run(&run_id).await.unwrap();
        run.status.is_terminal().then_some(run)
    }));
    assert_eq!(run.status, RunStatus::Completed, "{run:?}");
    let conversation = rt.block_on(keel.get_conversation(&run.conversation_id)).unwrap();
    let answer = conversation.messages.last().unwrap().content.clone();
    assert!(answer.starts_with("payment-api in prod had 12 5xx errors"), "{answer}");
    let chat_saw = format!("{before}{streamed}");
    assert!(!chat_saw.contains(answer.as_str()), "the chat detached before the answer ended: {chat_saw}");

    // reattach: the whole story again, then the end
    let (code, watched) = runs(&server, &["watch", run_id.as_str()]);
    assert_eq!(code, 0, "{watched}");
    assert!(watched.starts_with(&format!("Run {run_id} (completed), from its first event:\n")), "{watched}");
    assert!(watched.contains("… get_recent_errors"), "no spinner off a terminal: {watched}");
    assert!(!watched.contains('⠋'), "{watched}");
    assert!(watched.contains(answer.as_str()), "{watched}");
    assert!(watched.ends_with(&format!("Run {run_id} completed.\n")), "{watched}");
}

#[test]
fn runs_commands_refuse_bad_input_with_a_message() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), 1);
    for (args, needle) in [
        (vec!["show", "nope"], "`nope` is not a run id"),
        (vec!["watch", "run_0123"], "RUN_NOT_FOUND"),
        (vec!["list", "--status", "done"], "--status: expected one of queued"),
        (vec!["list", "--limit", "0"], "INVALID_QUERY"),
    ] {
        let output =
            keel().arg("runs").args(&args).args(["--server", &server.url()]).stdin(Stdio::null()).output().unwrap();
        assert_eq!(output.status.code(), Some(1), "{args:?}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
    let output = Command::new(support::KEEL).args(["chat", "--server", "localhost:1"]).output().unwrap();
    assert_eq!(output.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&output.stderr).contains("--server: expected an http:// or https:// URL"));
}

/// The API key comes from `KEEL_API_KEY` and goes out as a Bearer token (checked on a one-request
/// HTTP server that records what it is sent).
#[test]
fn the_api_key_comes_from_the_environment_as_a_bearer_token() {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let server = std::thread::spawn(move || {
        let (mut socket, _) = listener.accept().unwrap();
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            socket.read_exact(&mut byte).unwrap();
            head.push(byte[0]);
        }
        let body = r#"{"runs": []}"#;
        write!(
            socket,
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        String::from_utf8(head).unwrap().to_ascii_lowercase()
    });
    let output = keel()
        .args(["runs", "list", "--server", &url])
        .env("KEEL_API_KEY", "keel_test_key_42")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    assert_eq!(String::from_utf8_lossy(&output.stdout), "No runs.\n");
    let head = server.join().unwrap();
    assert!(head.starts_with("get /v1/runs?limit=20 http/1.1\r\n"), "{head}");
    assert!(head.contains("\r\nauthorization: bearer keel_test_key_42\r\n"), "{head}");
}

// ------------------------------------------------------------------ an outcome unknown

/// An OpenAI-compatible model on a free port: asked with tools and no tool result yet, it calls
/// `restart_service {"service": "checkout"}`; after a tool result, it answers in words.
fn mock_model() -> String {
    use std::io::Write;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/v1", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for (n, socket) in listener.incoming().enumerate() {
            let Ok(mut socket) = socket else { continue };
            std::thread::spawn(move || {
                let Some((_, body)) = read_request(&mut socket) else { return };
                let request: Value = serde_json::from_slice(&body).unwrap_or_default();
                let after_tool =
                    request["messages"].as_array().and_then(|m| m.last()).is_some_and(|m| m["role"] == "tool");
                let chunk = |delta: Value, finish: Value| {
                    serde_json::json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "mock",
                        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
                };
                let chunks = if after_tool {
                    vec![
                        chunk(serde_json::json!({"content": "Understood: checkout was not restarted."}), Value::Null),
                        chunk(serde_json::json!({}), "stop".into()),
                    ]
                } else {
                    vec![
                        chunk(serde_json::json!({"content": "Restarting checkout."}), Value::Null),
                        chunk(
                            serde_json::json!({"tool_calls": [{"index": 0, "id": format!("call_chat{n}"), "type": "function",
                                "function": {"name": "restart_service", "arguments": "{\"service\": \"checkout\"}"}}]}),
                            Value::Null,
                        ),
                        chunk(serde_json::json!({}), "tool_calls".into()),
                    ]
                };
                let body: String =
                    chunks.iter().map(|c| format!("data: {c}\n\n")).chain(["data: [DONE]\n\n".to_owned()]).collect();
                let _ = write!(
                    socket,
                    "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
            });
        }
    });
    url
}

/// A service that takes each request and never answers it; the heads it got go to the channel.
fn silent_service() -> (String, std::sync::mpsc::Receiver<String>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for socket in listener.incoming() {
            let Ok(mut socket) = socket else { continue };
            if let Some((head, _)) = read_request(&mut socket) {
                let _ = tx.send(head);
            }
            held.push(socket); // open, unanswered
        }
    });
    (url, rx)
}

/// `keel serve --config FILE` on a free port; killed when dropped.
struct Serve(std::process::Child, String);

impl Serve {
    fn start(dir: &std::path::Path, toml: &str) -> Self {
        use std::io::{BufRead, BufReader};
        let config = dir.join("keel.toml");
        std::fs::write(&config, toml).unwrap();
        let mut child = keel()
            .args(["serve", "--listen", "127.0.0.1:0"])
            .arg("--config")
            .arg(&config)
            .arg("--data-dir")
            .arg(dir.join("data"))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn keel serve");
        let mut banner = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut banner).unwrap();
        let url = banner
            .trim()
            .strip_prefix("Keel listening on ")
            .map(|u| u.trim_end_matches('/').to_owned())
            .unwrap_or_else(|| panic!("unexpected banner {banner:?}"));
        Serve(child, url)
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A call to a tool that is not idempotent times out: its outcome is unknown, so `keel chat` asks
/// what happened. `r` retries it with the same idempotency key (which times out again), Enter
/// leaves it for later, a decision with a note from another client ends it, and `keel runs show`
/// tells the whole story, kinds and note included.
#[test]
fn an_unknown_outcome_is_asked_retried_with_the_same_key_and_left_for_later() {
    let dir = tempfile::tempdir().unwrap();
    let model = mock_model();
    let (service, requests) = silent_service();
    let server = Serve::start(
        dir.path(),
        &format!(
            r#"
[[agents]]
id = "ops"
name = "Ops"
system_prompt = "You restart services when asked."
[agents.model]
kind = "openai"
base_url = "{model}"
name = "mock"
max_retries = 0
[[agents.tools]]
kind = "http"
name = "restart_service"
description = "Restart a service"
method = "POST"
url = "{service}/restart/{{service}}"
timeout = "300ms"
idempotent = false
policy = "allow"
args_schema = {{ type = "object", properties = {{ service = {{ type = "string" }} }}, required = ["service"] }}
"#
        ),
    );
    let mut cmd = keel();
    cmd.args(["chat", "--server", &server.1]);
    let mut chat = Chat(rexpect::session::spawn_command(cmd, Some(DEADLINE.as_millis() as u64)).unwrap());
    chat.expect("you> ");
    chat.type_line("Restart checkout");
    chat.expect("? restart_service service=checkout: no answer came back");
    let card = chat.expect("[r]etry / it was [d]one / it [f]ailed / Enter: decide later ");
    assert!(card.contains("outcome unknown: The request was sent and no answer came back"), "{card}");
    assert!(card.contains("restart_service {\"service\":\"checkout\"} (outcome unknown after 1 attempt)"), "{card}");
    chat.type_line("y");
    chat.expect("answer r (retry with the same idempotency key), d (it was done), f (it failed");
    chat.expect("Enter: decide later ");
    chat.type_line("r");
    chat.expect("↳ retried with the same idempotency key by demo");
    let again = chat.expect("Enter: decide later ");
    assert!(again.contains("(outcome unknown after 2 attempts)"), "{again}");
    chat.type_line("");
    chat.expect("Left undecided: the run waits for a decision until ");
    chat.expect("you> ");
    chat.0.send_control('d').unwrap();
    assert_eq!(chat.exit_code(), 0);

    // Both attempts carried the call's one idempotency key.
    let heads: Vec<String> = (0..2).map(|_| requests.recv_timeout(DEADLINE).expect("a request")).collect();
    let key = |head: &str| head.lines().find_map(|l| l.strip_prefix("idempotency-key:")).map(|k| k.trim().to_owned());
    assert!(heads[0].starts_with("post /restart/checkout "), "{heads:?}");
    assert_eq!(key(&heads[0]), key(&heads[1]), "{heads:?}");
    assert!(key(&heads[0]).is_some(), "{heads:?}");

    // Decided elsewhere, with a note: the run ends, and the history shows kinds, decisions and note.
    let rt = runtime();
    let api = KeelClient::new(&server.1);
    let run_id = rt.block_on(only_run(&api));
    let run = rt.block_on(api.get_run(&run_id)).unwrap();
    let pending = run.pending_interrupt.expect("still waiting");
    assert_eq!(pending.kind.as_str(), "outcome_unknown");
    let resume = rt.block_on(async {
        reqwest::Client::new()
            .post(format!("{}/v1/runs/{run_id}/resume", server.1))
            .json(&serde_json::json!({"interruptId": pending.id, "decision": "mark_failed",
                "note": "checked the service: it never restarted", "idempotencyKey": "chat-test-1"}))
            .send()
            .await
            .unwrap()
            .status()
    });
    assert_eq!(resume, 200);
    rt.block_on(eventually("the run to end", || async {
        api.get_run(&run_id).await.unwrap().status.is_terminal().then_some(())
    }));
    let (code, shown) = runs_at(&server.1, &["show", run_id.as_str()]);
    assert_eq!(code, 0, "{shown}");
    assert!(shown.starts_with(&format!("Run {run_id}: completed\n")), "{shown}");
    let decisions: Vec<&str> = shown.lines().skip_while(|l| *l != "Decisions:").skip(1).collect();
    assert_eq!(decisions.len(), 3, "{shown}");
    assert!(decisions[0].starts_with("  [outcome_unknown] "), "{shown}");
    assert!(decisions[0].contains(": retried with the same idempotency key by demo at "), "{shown}");
    assert!(decisions[1].contains(": marked failed by demo at "), "{shown}");
    assert_eq!(decisions[2], "    note: checked the service: it never restarted", "{shown}");
    assert!(shown.contains("restart_service failed: marked failed by demo: checked the service"), "{shown}");
}

/// `keel serve` with two agents: `helper`, the default, and `ops`, whose `restart_service` times
/// out (the model and the service of the test above).
fn two_agents(dir: &std::path::Path) -> Serve {
    let model = mock_model();
    // What the service is sent is not looked at here: it takes and holds each request all the same.
    let (service, _) = silent_service();
    Serve::start(
        dir,
        &format!(
            r#"
[[agents]]
id = "helper"
system_prompt = "You answer questions."
default = true

[[agents]]
id = "ops"
name = "Ops"
system_prompt = "You restart services when asked."
[agents.model]
kind = "openai"
base_url = "{model}"
name = "mock"
max_retries = 0
[[agents.tools]]
kind = "http"
name = "restart_service"
description = "Restart a service"
method = "POST"
url = "{service}/restart/{{service}}"
timeout = "300ms"
idempotent = false
policy = "allow"
args_schema = {{ type = "object", properties = {{ service = {{ type = "string" }} }}, required = ["service"] }}
"#
        ),
    )
}

/// `keel chat --agent ops` talks to `ops`, not the default agent; an unknown agent is the server's
/// UNKNOWN_AGENT, and exit code 1; `--agent` and `--conversation` don't go together. At an
/// unknown outcome, a note follows the answer and goes with the decision.
#[test]
fn chat_with_an_agent_talks_to_it_and_an_outcome_takes_a_note() {
    let dir = tempfile::tempdir().unwrap();
    let server = two_agents(dir.path());

    let output =
        keel().args(["chat", "--server", &server.1, "--agent", "nobody"]).stdin(Stdio::null()).output().unwrap();
    assert_eq!(output.status.code(), Some(1));
    assert!(output.stdout.is_empty(), "no conversation: {}", String::from_utf8_lossy(&output.stdout));
    assert_eq!(
        String::from_utf8_lossy(&output.stderr),
        "keel: --agent nobody (the server's agents: helper, ops): HTTP 422 Unprocessable Entity UNKNOWN_AGENT: \
         agentId: this server runs no such agent (GET /v1/agents lists them)\n"
    );
    let output = keel()
        .args(["chat", "--server", &server.1, "--agent", "ops", "--conversation", "conv_1"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2), "a usage error");
    assert!(String::from_utf8_lossy(&output.stderr).contains("cannot be used with"), "{output:?}");

    let mut cmd = keel();
    cmd.args(["chat", "--server", &server.1, "--agent", "ops"]);
    let mut chat = Chat(rexpect::session::spawn_command(cmd, Some(DEADLINE.as_millis() as u64)).unwrap());
    chat.expect("Conversation conv_");
    chat.expect(&format!(" with ops on {}.", server.1));
    chat.expect("you> ");
    chat.type_line("Restart checkout");
    chat.expect("? restart_service service=checkout: no answer came back");
    let card = chat.expect("[r]etry / it was [d]one / it [f]ailed / Enter: decide later ");
    assert!(card.contains("(a note may follow the answer, e.g. `f checked: it never restarted`"), "{card}");
    chat.type_line("f checked the service: it never restarted");
    chat.expect("↳ marked failed by demo after ");
    chat.expect("  note: checked the service: it never restarted");
    chat.expect("✗ restart_service [marked_failed]");
    let answer = chat.expect("you> ");
    assert!(answer.contains("Understood: checkout was not restarted."), "{answer}");
    chat.0.send_control('d').unwrap();
    assert_eq!(chat.exit_code(), 0);

    let rt = runtime();
    let api = KeelClient::new(&server.1);
    let run_id = rt.block_on(only_run(&api));
    let run = rt.block_on(api.get_run(&run_id)).unwrap();
    let conversation = rt.block_on(api.get_conversation(&run.conversation_id)).unwrap();
    assert_eq!(conversation.conversation.agent_id.as_deref(), Some("ops"));
    assert_eq!(run.interrupts[0].kind.as_str(), "outcome_unknown");
    assert_eq!(run.interrupts[0].decision.as_deref(), Some(&serde_json::json!("mark_failed")));
    assert_eq!(run.interrupts[0].note.as_deref().map(String::as_str), Some("checked the service: it never restarted"));

    // Without --agent: the default agent.
    let mut cmd = keel();
    cmd.args(["chat", "--server", &server.1]);
    let mut chat = Chat(rexpect::session::spawn_command(cmd, Some(DEADLINE.as_millis() as u64)).unwrap());
    chat.expect(" with helper on ");
    chat.expect("you> ");
    chat.0.send_control('d').unwrap();
    assert_eq!(chat.exit_code(), 0);
}
