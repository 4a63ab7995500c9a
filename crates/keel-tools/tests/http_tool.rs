//! The HTTP tool against real HTTP servers on 127.0.0.1: an axum app for well-formed answers, and
//! a raw TCP listener for connections that break where HTTP servers don't break them.

mod support;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::any;
use axum::Router;
use keel_core::tool::{NextAttempt, Tool, ToolError};
use keel_tools::{HttpTool, ToolConfig};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::Notify;

use support::{again, ctx};

/// How long a test waits for something the server reports (a safety net, not a measurement).
const DEADLINE: Duration = Duration::from_secs(20);
const HUGE: u64 = 100 * 1024 * 1024;
static SPACES: [u8; 65536] = [b' '; 65536];

#[derive(Debug, Clone)]
struct Recorded {
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
}

impl Recorded {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).expect("a JSON body")
    }
}

#[derive(Clone, Default)]
struct Shared {
    requests: Arc<Mutex<Vec<Recorded>>>,
    /// Bytes the streaming handlers produced.
    produced: Arc<AtomicU64>,
    /// Told when a streaming body is dropped: the server stopped sending.
    dropped: Arc<Notify>,
}

struct App {
    addr: SocketAddr,
    shared: Shared,
}

impl App {
    fn requests(&self) -> Vec<Recorded> {
        self.shared.requests.lock().unwrap().clone()
    }

    fn last(&self) -> Recorded {
        self.requests().pop().expect("a request reached the server")
    }

    /// An `http` tool of this app; `extra` holds more `key = value` lines.
    fn tool(&self, method: &str, path: &str, extra: &str) -> Arc<dyn Tool> {
        support::tool(&tool_toml(&self.addr.to_string(), method, path, extra))
    }
}

fn tool_toml(host: &str, method: &str, path: &str, extra: &str) -> String {
    format!(
        r#"
kind = "http"
name = "probe"
description = "a test tool"
method = "{method}"
url = "http://{host}{path}"
timeout = "5s"
{extra}
args_schema = {{ type = "object", properties = {{ id = {{ type = "string" }}, a = {{}}, b = {{}}, flag = {{}}, n = {{}}, tags = {{}}, mode = {{}}, count = {{}}, password = {{}} }} }}
"#
    )
}

struct Guard(Arc<Notify>);

impl Drop for Guard {
    fn drop(&mut self) {
        self.0.notify_one();
    }
}

/// 100 MiB of spaces, 64 KiB at a time, counted as they are produced.
fn huge_body(shared: &Shared) -> Body {
    let guard = Guard(shared.dropped.clone());
    let produced = shared.produced.clone();
    let stream = futures::stream::unfold((0u64, guard), move |(sent, guard)| {
        let produced = produced.clone();
        async move {
            if sent >= HUGE {
                return None;
            }
            produced.fetch_add(SPACES.len() as u64, Ordering::SeqCst);
            Some((Ok::<_, Infallible>(Bytes::from_static(&SPACES)), (sent + SPACES.len() as u64, guard)))
        }
    });
    Body::from_stream(stream)
}

async fn handle(State(shared): State<Shared>, method: Method, uri: Uri, headers: HeaderMap, body: Bytes) -> Response {
    let recorded = Recorded { method: method.clone(), uri: uri.clone(), headers: headers.clone(), body: body.clone() };
    shared.requests.lock().unwrap().push(recorded);
    match uri.path() {
        "/slow" => {
            // Never answers: only the tool's timeout ends the call.
            std::future::pending::<()>().await;
            unreachable!()
        }
        "/slow-body" => {
            let first = futures::stream::once(async { Ok::<_, Infallible>(Bytes::from_static(b"{\"partial\": ")) });
            let never = futures::stream::pending::<Result<Bytes, Infallible>>();
            Response::new(Body::from_stream(futures::StreamExt::chain(first, never)))
        }
        "/fail/500" => {
            let body = format!("database down; the operator's note says Bearer abc.def.ghi {}", "x".repeat(2000));
            (StatusCode::INTERNAL_SERVER_ERROR, body).into_response()
        }
        "/fail/404" => (StatusCode::NOT_FOUND, axum::Json(json!({"error": "no such instance"}))).into_response(),
        "/fail/echo-headers" => {
            // A careless service that quotes the request's headers in its error.
            let echoed: Vec<String> =
                headers.iter().map(|(k, v)| format!("{k}={}", v.to_str().unwrap_or("?"))).collect();
            (StatusCode::BAD_GATEWAY, echoed.join("; ")).into_response()
        }
        "/nonjson" => ([(header::CONTENT_TYPE, "text/html")], "<html>hello</html>").into_response(),
        "/nocontent" => StatusCode::NO_CONTENT.into_response(),
        "/huge" => Response::new(huge_body(&shared)),
        "/huge-declared" => {
            let mut response = Response::new(huge_body(&shared));
            response.headers_mut().insert(header::CONTENT_LENGTH, HUGE.into());
            response
        }
        _ => {
            let body: Value =
                if body.is_empty() { Value::Null } else { serde_json::from_slice(&body).unwrap_or(Value::Null) };
            axum::Json(json!({"method": method.as_str(), "path": uri.path(), "query": uri.query(), "body": body}))
                .into_response()
        }
    }
}

async fn app() -> App {
    let shared = Shared::default();
    let router = Router::new().fallback(any(handle)).with_state(shared.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    App { addr, shared }
}

/// A server that reads a request's head, writes `reply` as it is, and closes the connection.
async fn raw_server(reply: &'static [u8]) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 4096];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match socket.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let _ = socket.write_all(reply).await;
                let _ = socket.shutdown().await;
            });
        }
    });
    addr
}

/// A port nothing listens on: bound, then released.
async fn refused_port() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    listener.local_addr().unwrap()
}

async fn fails(tool: &Arc<dyn Tool>, args: Value) -> ToolError {
    match tool.execute(&ctx(), &args).await {
        Ok(out) => panic!("expected a failure, got {out:?}"),
        Err(e) => e,
    }
}

#[tokio::test]
async fn a_path_argument_is_one_escaped_segment() {
    let app = app().await;
    let tool = app.tool("GET", "/items/{id}/status", "");
    let out = tool.execute(&ctx(), &json!({"id": "a/b c?é#"})).await.unwrap();
    assert_eq!(app.last().uri.path(), "/items/a%2Fb%20c%3F%C3%A9%23/status");
    assert_eq!(out.result["path"], "/items/a%2Fb%20c%3F%C3%A9%23/status");
    // The summary names the route, not the value.
    assert_eq!(out.summary, "GET /items/{id}/status → 200");
    assert!(out.facts.is_empty());

    // `..` would climb out of the path; refused before anything is sent.
    let before = app.requests().len();
    assert!(matches!(fails(&tool, json!({"id": ".."})).await, ToolError::Invalid(_)));
    assert!(matches!(fails(&tool, json!({})).await, ToolError::Invalid(_)));
    assert_eq!(app.requests().len(), before);
}

#[tokio::test]
async fn get_and_delete_send_the_other_arguments_as_a_sorted_query() {
    let app = app().await;
    let args = json!({"id": "x1", "b": 2, "a": "hello world", "flag": true, "n": null});
    for method in ["GET", "DELETE"] {
        let tool = app.tool(method, "/things/{id}?v=1", "");
        tool.execute(&ctx(), &args).await.unwrap();
        let r = app.last();
        assert_eq!(r.method.as_str(), method);
        assert_eq!(r.uri.path(), "/things/x1");
        assert_eq!(r.uri.query(), Some("v=1&a=hello+world&b=2&flag=true"));
        assert!(r.body.is_empty());
    }

    // Only scalars fit a query string; an array is refused at the call, and nothing is sent.
    let before = app.requests().len();
    let tool = app.tool("GET", "/things", "");
    match fails(&tool, json!({"tags": ["a", "b"]})).await {
        ToolError::Invalid(m) => assert!(m.contains("tags") && m.contains("query string"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(app.requests().len(), before);
}

#[tokio::test]
async fn post_put_patch_send_the_other_arguments_as_a_json_body() {
    let app = app().await;
    for method in ["POST", "PUT", "PATCH"] {
        let tool = app.tool(method, "/things/{id}", "");
        let out = tool.execute(&ctx(), &json!({"id": "x1", "mode": "soft", "count": 3, "tags": ["a"]})).await.unwrap();
        let r = app.last();
        assert_eq!(r.method.as_str(), method);
        assert_eq!(r.uri.path(), "/things/x1");
        assert_eq!(r.uri.query(), None);
        assert_eq!(r.header("content-type"), Some("application/json"));
        assert_eq!(r.json(), json!({"count": 3, "mode": "soft", "tags": ["a"]}));
        assert_eq!(out.summary, format!("{method} /things/{{id}} → 200"));
    }
    // No arguments left: an empty object, still JSON.
    app.tool("POST", "/things/{id}", "").execute(&ctx(), &json!({"id": "x"})).await.unwrap();
    assert_eq!(app.last().json(), json!({}));
}

#[tokio::test]
async fn headers_come_from_the_environment_given() {
    let app = app().await;
    let toml_text = tool_toml(
        &app.addr.to_string(),
        "GET",
        "/h",
        r#"headers = { Authorization = "Bearer ${OPS_TOKEN}", X-Tenant = "acme-${REGION}" }"#,
    );
    let tool = support::build(&toml_text, &[("OPS_TOKEN", "tok-123456"), ("REGION", "eu")]).unwrap();
    tool.execute(&ctx(), &json!({})).await.unwrap();
    let r = app.last();
    assert_eq!(r.header("authorization"), Some("Bearer tok-123456"));
    assert_eq!(r.header("x-tenant"), Some("acme-eu"));
    assert_eq!(r.header("user-agent"), Some(concat!("keel/", env!("CARGO_PKG_VERSION"))));
    assert_eq!(r.header("accept"), Some("application/json"));
}

#[tokio::test]
async fn every_attempt_of_a_call_carries_the_same_key_and_run() {
    let app = app().await;
    let tool = app.tool("POST", "/restart/{id}", "");
    let first = ctx();
    let second = again(&first);
    tool.execute(&first, &json!({"id": "pay-2"})).await.unwrap();
    tool.execute(&second, &json!({"id": "pay-2"})).await.unwrap();
    let requests = app.requests();
    assert_eq!(requests.len(), 2);
    for (r, attempt) in requests.iter().zip(["1", "2"]) {
        assert_eq!(r.header("idempotency-key"), Some(first.idempotency_key.as_str()));
        assert_eq!(r.header("keel-run-id"), Some(first.run_id.as_str()));
        assert_eq!(r.header("keel-call-id"), Some(first.call_id.as_str()));
        assert_eq!(r.header("keel-attempt"), Some(attempt));
    }
    // Another call, another key.
    tool.execute(&ctx(), &json!({"id": "pay-2"})).await.unwrap();
    assert_ne!(app.last().header("idempotency-key"), Some(first.idempotency_key.as_str()));
}

#[tokio::test]
async fn no_complete_answer_within_the_timeout_is_a_timeout() {
    let app = app().await;
    for path in ["/slow", "/slow-body"] {
        let tool = support::tool(&tool_toml(&app.addr.to_string(), "POST", path, "").replace("\"5s\"", "\"300ms\""));
        let e = fails(&tool, json!({})).await;
        assert!(matches!(e, ToolError::Timeout(_)), "{path}: {e:?}");
        assert!(e.to_string().contains("300ms"), "{e}");
        // It may have been applied: retried only if the tool says it is idempotent.
        assert_eq!(e.next(false), NextAttempt::AskHuman);
        assert_eq!(e.next(true), NextAttempt::Retry);
    }
}

#[tokio::test]
async fn a_refused_connection_is_unreachable() {
    let addr = refused_port().await;
    let tool = support::tool(&tool_toml(&addr.to_string(), "POST", "/restart/{id}", ""));
    let e = fails(&tool, json!({"id": "x"})).await;
    assert!(matches!(e, ToolError::Unreachable(_)), "{e:?}");
    assert!(e.to_string().contains(&addr.to_string()), "{e}");
    // Nothing was sent: safe to send again, even for a tool that is not idempotent.
    assert_eq!(e.next(false), NextAttempt::Retry);
}

#[tokio::test]
async fn a_connect_that_does_not_complete_is_unreachable() {
    // A listener that never accepts, with its accept queue full: Linux drops further SYNs, so a
    // connect neither succeeds nor is refused. (Linux queues backlog + 1 connections.)
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let listener = socket.listen(1).unwrap();
    let addr = listener.local_addr().unwrap();
    let mut queued = Vec::new();
    for _ in 0..2 {
        let connect = tokio::net::TcpStream::connect(addr);
        queued.push(tokio::time::timeout(DEADLINE, connect).await.expect("the queue has room").unwrap());
    }
    let tool = support::tool(&tool_toml(&addr.to_string(), "POST", "/restart/{id}", "").replace("\"5s\"", "\"1s\""));
    let e = fails(&tool, json!({"id": "x"})).await;
    // The connect phase has half the timeout: a request that never left is safe to send again.
    assert!(matches!(e, ToolError::Unreachable(_)), "{e:?}");
    assert_eq!(e.next(false), NextAttempt::Retry);
    drop((queued, listener));
}

#[tokio::test]
async fn a_name_that_does_not_resolve_is_unreachable() {
    let tool = support::tool(&tool_toml("no-such-host.invalid", "GET", "/x", ""));
    let e = fails(&tool, json!({})).await;
    assert!(matches!(e, ToolError::Unreachable(_)), "{e:?}");
}

#[tokio::test]
async fn an_error_status_tells_the_model_the_status_and_the_start_of_the_body() {
    let app = app().await;
    let e = fails(&app.tool("GET", "/fail/500", ""), json!({})).await;
    let ToolError::Status { status: 500, message } = &e else { panic!("{e:?}") };
    assert!(message.starts_with("HTTP 500 Internal Server Error from GET /fail/500: database down"), "{message}");
    // Masked, and cut: the status line plus about 300 characters of the body.
    assert!(message.contains("Bearer ***") && !message.contains("abc.def.ghi"), "{message}");
    assert!(message.chars().count() < 400, "{}", message.len());
    assert_eq!(e.code(), "http_500");
    assert_eq!(e.next(true), NextAttempt::Retry);
    assert_eq!(e.next(false), NextAttempt::Fail);

    let e = fails(&app.tool("GET", "/fail/404", ""), json!({})).await;
    let ToolError::Status { status: 404, message } = &e else { panic!("{e:?}") };
    assert_eq!(message, r#"HTTP 404 Not Found from GET /fail/404: {"error":"no such instance"}"#);
    assert_eq!(e.next(true), NextAttempt::Fail);
}

#[tokio::test]
async fn a_body_that_is_not_json_is_a_bad_response() {
    let app = app().await;
    let e = fails(&app.tool("GET", "/nonjson", ""), json!({})).await;
    let ToolError::BadResponse(message) = &e else { panic!("{e:?}") };
    assert!(message.contains("not JSON") && !message.contains("hello"), "{message}");
    assert_eq!(e.next(true), NextAttempt::Fail);
}

#[tokio::test]
async fn no_content_is_a_null_result() {
    let app = app().await;
    let out = app.tool("DELETE", "/nocontent", "").execute(&ctx(), &json!({})).await.unwrap();
    assert_eq!(out.result, Value::Null);
    assert_eq!(out.summary, "DELETE /nocontent → 204");
}

#[tokio::test]
async fn an_oversize_body_is_refused_without_reading_it_all() {
    let app = app().await;
    let tool = app.tool("GET", "/huge", "max_response_bytes = 65536");
    let e = fails(&tool, json!({})).await;
    assert_eq!(e, ToolError::TooLarge { limit: 65536 });
    // The server stops once the client has gone: its body is dropped long before 100 MiB.
    tokio::time::timeout(DEADLINE, app.shared.dropped.notified()).await.expect("the server stopped sending");
    let produced = app.shared.produced.load(Ordering::SeqCst);
    assert!(produced < HUGE / 4, "the server produced {produced} bytes");

    // A declared length over the limit is refused before the body is read.
    let e = fails(&app.tool("GET", "/huge-declared", "max_response_bytes = 65536"), json!({})).await;
    assert_eq!(e, ToolError::TooLarge { limit: 65536 });
    assert_eq!(e.next(true), NextAttempt::Fail);
}

#[tokio::test]
async fn a_connection_that_breaks_after_the_request_is_outcome_unknown() {
    // Before any answer: the request was sent, so it may have been applied.
    let addr = raw_server(b"").await;
    let tool = support::tool(&tool_toml(&addr.to_string(), "POST", "/restart/{id}", ""));
    let e = fails(&tool, json!({"id": "x"})).await;
    assert!(matches!(e, ToolError::OutcomeUnknown(_)), "{e:?}");
    assert_eq!(e.next(false), NextAttempt::AskHuman);
    assert_eq!(e.next(true), NextAttempt::Retry);

    // In the middle of the body.
    let addr =
        raw_server(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"partial\": ")
            .await;
    let tool = support::tool(&tool_toml(&addr.to_string(), "POST", "/restart/{id}", ""));
    let e = fails(&tool, json!({"id": "x"})).await;
    let ToolError::OutcomeUnknown(message) = &e else { panic!("{e:?}") };
    assert!(message.contains("middle of the answer"), "{message}");
}

#[tokio::test]
async fn a_result_against_the_result_schema_is_a_bad_response() {
    let app = app().await;
    let schema = r#"result_schema = { type = "object", required = ["restarted"], properties = { restarted = { type = "boolean" } } }"#;
    let e = fails(&app.tool("POST", "/restart/{id}", schema), json!({"id": "x"})).await;
    let ToolError::BadResponse(message) = &e else { panic!("{e:?}") };
    // The violation's path and rule, as keel-core words them.
    assert!(
        message.starts_with("the answer to POST /restart/{id} does not match result_schema: $: the property "),
        "{message}"
    );
    assert!(message.contains("restarted") && message.ends_with("is required"), "{message}");

    let schema =
        r#"result_schema = { type = "object", required = ["method"], properties = { method = { const = "POST" } } }"#;
    app.tool("POST", "/restart/{id}", schema).execute(&ctx(), &json!({"id": "x"})).await.unwrap();
}

#[tokio::test]
async fn secrets_stay_out_of_debug_output_and_errors() {
    const SECRET: &str = "s3cr3t-tok-9f8e7d6c";
    const LITERAL: &str = "literal-secret-4242";
    let app = app().await;
    let headers = format!(r#"headers = {{ Authorization = "Bearer ${{OPS_TOKEN}}", X-Api-Key = "{LITERAL}" }}"#);
    let toml_for = |host: &str, path: &str| tool_toml(host, "GET", path, &headers).replace("\"5s\"", "\"300ms\"");
    let vars = [("OPS_TOKEN", SECRET)];
    let leaks = |text: &str| text.contains(SECRET) || text.contains(LITERAL) || text.contains("s3cr3t");

    let config: ToolConfig = toml::from_str(&toml_for(&app.addr.to_string(), "/x")).unwrap();
    assert!(!leaks(&format!("{config:?}")), "{config:?}");
    let ToolConfig::Http(http) = &config else { unreachable!() };
    let tool = HttpTool::new(http, &|k| (k == "OPS_TOKEN").then(|| SECRET.to_owned())).unwrap();
    let debug = format!("{tool:?}");
    assert!(!leaks(&debug) && debug.contains("authorization"), "{debug}");

    // The service echoes the headers in its error: the message must not.
    let refused = refused_port().await.to_string();
    let cases = [
        (app.addr.to_string(), "/fail/echo-headers"),
        (app.addr.to_string(), "/nonjson"),
        (app.addr.to_string(), "/slow"),
        (refused, "/x"),
    ];
    for (host, path) in cases {
        let tool = support::build(&toml_for(&host, path), &vars).unwrap();
        let e = fails(&tool, json!({})).await;
        assert!(!leaks(&e.to_string()) && !leaks(&format!("{e:?}")), "{path}: {e:?}");
    }
    // The request did carry them.
    let echoed = app.requests().into_iter().find(|r| r.uri.path() == "/fail/echo-headers").unwrap();
    assert_eq!(echoed.header("authorization"), Some(format!("Bearer {SECRET}").as_str()));
}

#[tokio::test]
async fn the_card_fills_its_templates_with_masked_arguments() {
    let app = app().await;
    let tool = app.tool(
        "POST",
        "/restart/{id}",
        r#"confirm = { title = "Restart {id}?", risk = "Drops {id}'s requests ({{mode}} = {mode}).", description = "with {password}" }"#,
    );
    let card = tool.describe(&json!({"id": "pay-prod-2", "mode": "sk-proj-AbC123dEf456ghi789", "password": "hunter2"}));
    assert_eq!(card.title, "Restart pay-prod-2?");
    assert_eq!(card.risk, "Drops pay-prod-2's requests ({mode} = ***).");
    assert_eq!(card.description, "with ***");
    let long = tool.describe(&json!({"id": "x".repeat(500)}));
    assert!(long.title.chars().count() <= 200, "{}", long.title);

    // Without templates: the defaults.
    let plain = app.tool("POST", "/restart/{id}", "");
    let card = plain.describe(&json!({"id": "pay-prod-2", "password": "hunter2"}));
    assert_eq!(card.title, "Run probe?");
    assert!(card.risk.contains("POST /restart/{id}") && card.risk.contains(&app.addr.to_string()), "{}", card.risk);
    assert!(card.description.contains("pay-prod-2") && !card.description.contains("hunter2"), "{}", card.description);
}
