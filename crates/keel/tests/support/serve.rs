//! `keel serve` with agents from a keel.toml, as a child process, and what drives it: an
//! OpenAI-compatible mock model scripted by the last message, and the public API as the local
//! user of a keyless server.
//!
//! The mock model: a user message `call TOOL {json}` makes it call TOOL with those arguments (the
//! call id always `call_0`, as some models number their calls), `calls [[TOOL, {json}], …]` makes
//! it call several at once; after a tool result it answers `tool said: <the result>` (a result
//! holding `hang-once` is held the first time, for a crash test); anything else gets `hello`.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use serde_json::{json, Value};

use super::{eventually, keel};

// ------------------------------------------------------------------------------ the mock model

/// An OpenAI-compatible chat completions endpoint on a free port (see the module's doc).
pub struct MockModel {
    pub url: String,
    requests: Arc<Mutex<Vec<Value>>>,
}

impl MockModel {
    pub fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/v1", listener.local_addr().unwrap());
        let requests = Arc::new(Mutex::new(Vec::new()));
        let seen = requests.clone();
        std::thread::spawn(move || {
            for socket in listener.incoming() {
                let Ok(socket) = socket else { continue };
                let seen = seen.clone();
                std::thread::spawn(move || answer(socket, &seen));
            }
        });
        Self { url, requests }
    }

    pub fn requests(&self) -> Vec<Value> {
        self.requests.lock().unwrap().clone()
    }
}

/// Reads one HTTP/1.1 request: its head (lower-cased) and its body.
pub fn read_request(socket: &mut TcpStream) -> Option<(String, Vec<u8>)> {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if socket.read(&mut byte).ok()? == 0 {
            return None;
        }
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head).to_ascii_lowercase();
    let length = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|n| n.trim().parse::<usize>().ok())
        .unwrap_or(0);
    let mut body = vec![0; length];
    socket.read_exact(&mut body).ok()?;
    Some((head, body))
}

/// Whether the model already held a `hang-once` continuation (see [`answer`]).
static HUNG_ONCE: AtomicBool = AtomicBool::new(false);

pub fn answer(mut socket: TcpStream, seen: &Mutex<Vec<Value>>) {
    let Some((_, body)) = read_request(&mut socket) else { return };
    let request: Value = serde_json::from_slice(&body).unwrap_or_default();
    seen.lock().unwrap().push(request.clone());
    let last = request["messages"].as_array().and_then(|m| m.last()).cloned().unwrap_or_default();
    let chunk = |delta: Value, finish: Value| {
        json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "mock",
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
    };
    let content = last["content"].as_str().unwrap_or("");
    if last["role"] == "tool" && content.contains("hang-once") && !HUNG_ONCE.swap(true, Ordering::SeqCst) {
        // Holds the first continuation after a result that asks for it, so a test can kill Keel
        // while the run continues; every later request is answered.
        std::thread::sleep(std::time::Duration::from_secs(60));
        return;
    }
    let several: Option<Vec<(String, Value)>> =
        content.strip_prefix("calls ").and_then(|rest| serde_json::from_str(rest).ok());
    let chunks = if let Some(calls) = several.filter(|_| last["role"] == "user") {
        let calls: Vec<Value> = calls
            .iter()
            .enumerate()
            .map(|(i, (tool, args))| {
                json!({"index": i, "id": format!("call_{i}"), "type": "function",
                       "function": {"name": tool, "arguments": args.to_string()}})
            })
            .collect();
        vec![chunk(json!({"tool_calls": calls}), Value::Null), chunk(json!({}), "tool_calls".into())]
    } else if last["role"] == "tool" {
        vec![chunk(json!({"content": format!("tool said: {content}")}), Value::Null), chunk(json!({}), "stop".into())]
    } else if let Some((tool, args)) = content.strip_prefix("call ").and_then(|rest| rest.split_once(' ')) {
        vec![
            chunk(
                json!({"tool_calls": [{"index": 0, "id": "call_0", "type": "function",
                                       "function": {"name": tool, "arguments": args}}]}),
                Value::Null,
            ),
            chunk(json!({}), "tool_calls".into()),
        ]
    } else {
        vec![chunk(json!({"content": "hello"}), Value::Null), chunk(json!({}), "stop".into())]
    };
    let body: String = chunks.iter().map(|c| format!("data: {c}\n\n")).chain(["data: [DONE]\n\n".to_owned()]).collect();
    let _ = write!(
        socket,
        "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
}

// ------------------------------------------------------------------------------ keel serve

/// `keel serve --config DIR/keel.toml --data-dir DIR/data` on a free port; killed when dropped.
pub struct Serve {
    child: Child,
    pub url: String,
    pub dir: PathBuf,
}

impl Serve {
    pub fn start(dir: &Path, toml: &str) -> Self {
        std::fs::write(dir.join("keel.toml"), toml).unwrap();
        Self::again(dir)
    }

    /// [`Serve::start`] with more environment variables for `keel serve`.
    pub fn start_with_env(dir: &Path, toml: &str, env: &[(&str, &str)]) -> Self {
        std::fs::write(dir.join("keel.toml"), toml).unwrap();
        Self::spawn(dir, env)
    }

    /// With the keel.toml already in `dir`.
    pub fn again(dir: &Path) -> Self {
        Self::spawn(dir, &[])
    }

    fn spawn(dir: &Path, env: &[(&str, &str)]) -> Self {
        let mut child = keel()
            .envs(env.iter().copied())
            .args(["serve", "--listen", "127.0.0.1:0"])
            .arg("--config")
            .arg(dir.join("keel.toml"))
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
        Self { child, url, dir: dir.to_owned() }
    }

    /// SIGKILL: no graceful stop, no lease released, the tool's request left hanging.
    pub fn kill(mut self) -> PathBuf {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
        self.dir.clone()
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The public API of one server, as the local user of a keyless server.
pub struct Api {
    pub base: String,
    pub http: reqwest::Client,
}

impl Api {
    pub fn new(server: &Serve) -> Self {
        Self { base: server.url.clone(), http: reqwest::Client::new() }
    }

    pub async fn get(&self, path: &str) -> Value {
        let response = self.http.get(format!("{}{path}", self.base)).send().await.unwrap();
        assert_eq!(response.status(), 200, "GET {path}");
        response.json().await.unwrap()
    }

    pub async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let response = self.http.post(format!("{}{path}", self.base)).json(&body).send().await.unwrap();
        let status = response.status().as_u16();
        (status, response.json().await.unwrap_or_default())
    }

    pub async fn conversation(&self, agent: Option<&str>) -> String {
        let body = match agent {
            Some(a) => json!({"agentId": a}),
            None => json!({}),
        };
        let (status, conv) = self.post("/v1/conversations", body).await;
        assert_eq!(status, 201, "{conv}");
        conv["id"].as_str().unwrap().to_owned()
    }

    /// Sends a message and waits for the run to pause or end: the turn.
    pub async fn say(&self, conv: &str, content: &str) -> Value {
        let (status, turn) =
            self.post(&format!("/v1/conversations/{conv}/messages?wait=true"), json!({"content": content})).await;
        assert_eq!(status, 200, "{turn}");
        turn
    }

    /// Sends a message and returns its run at once.
    pub async fn start(&self, conv: &str, content: &str) -> String {
        let (status, accepted) =
            self.post(&format!("/v1/conversations/{conv}/messages"), json!({"content": content})).await;
        assert_eq!(status, 202, "{accepted}");
        accepted["runId"].as_str().unwrap().to_owned()
    }

    pub async fn resume(
        &self,
        run: &str,
        interrupt: &str,
        decision: Value,
        note: Option<&str>,
        key: &str,
    ) -> (u16, Value) {
        let mut body = json!({"interruptId": interrupt, "decision": decision, "idempotencyKey": key});
        if let Some(note) = note {
            body["note"] = json!(note);
        }
        self.post(&format!("/v1/runs/{run}/resume?wait=true"), body).await
    }

    pub async fn run(&self, run: &str) -> Value {
        self.get(&format!("/v1/runs/{run}")).await
    }

    pub async fn events(&self, run: &str) -> Vec<Value> {
        let response = self
            .http
            .get(format!("{}/v1/runs/{run}/events", self.base))
            .header("accept", "application/json")
            .send()
            .await
            .unwrap();
        let page: Value = response.json().await.unwrap();
        page["events"].as_array().unwrap().clone()
    }

    pub async fn settled(&self, run: &str) -> Value {
        eventually("the run to pause or end", || async {
            let view = self.run(run).await;
            (view["status"] != "running" && view["status"] != "queued").then_some(view)
        })
        .await
    }

    pub async fn tool_finished(&self, run: &str) -> Vec<Value> {
        self.events(run).await.into_iter().filter(|e| e["type"] == "tool_finished").collect()
    }
}
