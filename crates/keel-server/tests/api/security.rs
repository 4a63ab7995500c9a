//! Two users and the limits: every endpoint refuses B on A's objects with 404; tickets work once, for
//! one stream; roles are read at resume; rate, depth and stream limits hold.

use std::time::Duration;

use futures::StreamExt;

use keel_core::{ConversationId, InterruptId, RunId, UserRole};
use keel_server::ServerConfig;
use reqwest::header::{ACCEPT, AUTHORIZATION};
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};

use crate::common::{eventually, to_json, Options, SseReader, TestApp, ERRORS_PROMPT, RESTART_PROMPT};

fn assert_error(status: StatusCode, body: &Value, want_status: u16, want_code: &str) {
    assert_eq!(status.as_u16(), want_status, "{body}");
    assert_eq!(body["error"]["code"], want_code, "{body}");
}

async fn as_user(
    app: &TestApp,
    user: &str,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
) -> (StatusCode, Value) {
    let mut request = app.client.request(method.clone(), app.url(path)).header(AUTHORIZATION, app.bearer(user));
    for (k, v) in headers {
        request = request.header(*k, *v);
    }
    if method == Method::POST {
        request = request.json(&json!({"content": "restart it", "interruptId": "int_x", "decision": "approve",
            "idempotencyKey": "k1"}));
    }
    to_json(request.send().await.expect("request")).await
}

/// A request another user tries: method, path, extra headers, the error code expected.
type Probe<'a> = (Method, String, Vec<(&'a str, &'a str)>, &'a str);

/// Alice's conversation, run, interrupt: for bob, each is a 404 through every endpoint and way of
/// asking, exactly like ids that were never made; alice's run is untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_users_objects_are_404_on_every_endpoint() {
    let app = TestApp::spawn().await;
    let (status, conv) = app.post_as("alice", "/v1/conversations", &json!({"title": "alice's"})).await;
    assert_eq!(status, StatusCode::CREATED);
    let conv = conv["id"].as_str().unwrap().to_owned();
    let (status, turn) = app
        .post_as("alice", &format!("/v1/conversations/{conv}/messages?wait=true"), &json!({"content": RESTART_PROMPT}))
        .await;
    assert_eq!(status, StatusCode::OK, "{turn}");
    let run = turn["run"]["id"].as_str().unwrap().to_owned();
    let interrupt = turn["interrupt"]["id"].as_str().unwrap().to_owned();
    let last = turn["run"]["lastSequence"].as_i64().unwrap();

    let guessed_conv = ConversationId::new().to_string();
    let guessed_run = RunId::new().to_string();
    let resume_body = json!({"interruptId": interrupt, "decision": "approve", "idempotencyKey": "bob-1"});
    for (conv, run, what) in [(conv.as_str(), run.as_str(), "alice's"), (&guessed_conv, &guessed_run, "guessed")] {
        let cases: Vec<Probe> = vec![
            (Method::GET, format!("/v1/conversations/{conv}"), vec![], "CONVERSATION_NOT_FOUND"),
            (Method::POST, format!("/v1/conversations/{conv}/messages"), vec![], "CONVERSATION_NOT_FOUND"),
            (
                Method::POST,
                format!("/v1/conversations/{conv}/messages"),
                vec![("accept", "text/event-stream")],
                "CONVERSATION_NOT_FOUND",
            ),
            (Method::GET, format!("/v1/runs/{run}"), vec![], "RUN_NOT_FOUND"),
            (Method::GET, format!("/v1/runs/{run}/events"), vec![], "RUN_NOT_FOUND"),
            (Method::GET, format!("/v1/runs/{run}/events"), vec![("last-event-id", "1")], "RUN_NOT_FOUND"),
            (
                Method::GET,
                format!("/v1/runs/{run}/events?after=0"),
                vec![("accept", "application/json")],
                "RUN_NOT_FOUND",
            ),
            (Method::POST, format!("/v1/runs/{run}/cancel"), vec![], "RUN_NOT_FOUND"),
            (Method::POST, format!("/v1/runs/{run}/stream-ticket"), vec![], "RUN_NOT_FOUND"),
        ];
        for (method, path, headers, code) in cases {
            let (s, b) = as_user(&app, "bob", method.clone(), &path, &headers).await;
            assert_error(s, &b, 404, code);
            assert!(!b.to_string().contains("alice"), "{what} {method} {path}: {b}");
        }
        let (s, b) = app.post_as("bob", &format!("/v1/runs/{run}/resume"), &resume_body).await;
        assert_error(s, &b, 404, "RUN_NOT_FOUND");
        let (s, b) = app.post_as("bob", &format!("/v1/runs/{run}/resume?wait=true"), &resume_body).await;
        assert_error(s, &b, 404, "RUN_NOT_FOUND");
    }
    // Bob's own lists hold none of it.
    let (_, list) = app.get_as("bob", "/v1/conversations").await;
    assert_eq!(list["conversations"], json!([]));

    // Alice's run is as it was: still waiting, nothing restarted, no event added by bob's tries.
    let view = app.get_as("alice", &format!("/v1/runs/{run}")).await.1;
    assert_eq!(view["status"], "interrupted");
    assert_eq!(view["pendingInterrupt"]["id"], interrupt);
    assert_eq!(view["lastSequence"].as_i64().unwrap(), last);
    assert_eq!(app.instance("pay-prod-2").await["restartCount"], 0);
    assert!(app.store.get_interrupt(&InterruptId::parse(&interrupt).unwrap()).await.unwrap().is_some());
}

/// A ticket opens one run's stream once, without a key; used, expired, for another run or on
/// another route it is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_tickets_are_single_use_and_scoped() {
    let app = TestApp::spawn().await;
    let (_, run, _) = app.interrupted_run().await;
    let other_conversation = app.create_conversation().await;
    let other_run = app.send(&other_conversation, ERRORS_PROMPT).await;
    let anonymous = reqwest::Client::new();
    let mint = |run: String| {
        let app = &app;
        async move {
            let (status, body) = app.post(&format!("/v1/runs/{run}/stream-ticket"), &json!({})).await;
            assert_eq!(status, StatusCode::CREATED, "{body}");
            assert!(body["ticket"].as_str().unwrap().starts_with("kst_"));
            assert_eq!(body["url"], format!("/v1/runs/{run}/events?ticket={}", body["ticket"].as_str().unwrap()));
            body["ticket"].as_str().unwrap().to_owned()
        }
    };

    // Without a key or a ticket: 401.
    let (s, b) = to_json(anonymous.get(app.url(&format!("/v1/runs/{run}/events"))).send().await.unwrap()).await;
    assert_error(s, &b, 401, "UNAUTHENTICATED");

    // An EventSource-style request with the ticket gets the stream (here, its replay up to the pause).
    let ticket = mint(run.clone()).await;
    let response = anonymous
        .get(app.url(&format!("/v1/runs/{run}/events?ticket={ticket}")))
        .header(ACCEPT, "text/event-stream")
        .send()
        .await
        .unwrap();
    let mut reader = SseReader::new(response);
    reader.assert_sse();
    assert_eq!(reader.next_event().await.expect("an event").type_name(), "run_started");
    drop(reader);

    // Used once: spent.
    let (s, b) =
        to_json(anonymous.get(app.url(&format!("/v1/runs/{run}/events?ticket={ticket}"))).send().await.unwrap()).await;
    assert_error(s, &b, 401, "INVALID_TICKET");

    // For another run: refused (and spent).
    let ticket = mint(run.clone()).await;
    let (s, b) =
        to_json(anonymous.get(app.url(&format!("/v1/runs/{other_run}/events?ticket={ticket}"))).send().await.unwrap())
            .await;
    assert_error(s, &b, 401, "INVALID_TICKET");

    // On any route but a stream: refused, and the ticket is not spent by trying.
    let ticket = mint(run.clone()).await;
    for (method, path) in [
        (Method::GET, format!("/v1/runs/{run}?ticket={ticket}")),
        (Method::POST, format!("/v1/runs/{run}/cancel?ticket={ticket}")),
        (Method::GET, format!("/v1/conversations?ticket={ticket}")),
    ] {
        let (s, b) = to_json(anonymous.request(method, app.url(&path)).send().await.unwrap()).await;
        assert_error(s, &b, 401, "INVALID_TICKET");
    }
    let response = anonymous
        .get(app.url(&format!("/v1/runs/{run}/events?ticket={ticket}&limit=1")))
        .header(ACCEPT, "application/json")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(app.get(&format!("/v1/runs/{run}")).await.1["status"], "interrupted", "nothing was cancelled");

    // A made-up ticket.
    let (s, b) = to_json(
        anonymous.get(app.url(&format!("/v1/runs/{run}/events?ticket=kst_{}", "0".repeat(64)))).send().await.unwrap(),
    )
    .await;
    assert_error(s, &b, 401, "INVALID_TICKET");
}

#[tokio::test]
async fn an_expired_ticket_is_refused() {
    let server = ServerConfig { stream_ticket_ttl: Duration::from_millis(50), ..Options::default().server };
    let app = TestApp::with(Options { server, ..Options::default() }).await;
    let (_, run, _) = app.interrupted_run().await;
    let (_, body) = app.post(&format!("/v1/runs/{run}/stream-ticket"), &json!({})).await;
    let ticket = body["ticket"].as_str().unwrap();
    let expires: chrono::DateTime<chrono::Utc> = body["expiresAt"].as_str().unwrap().parse().unwrap();
    // Time has to pass for a ticket to expire: wait until its expiry is behind us.
    while chrono::Utc::now() <= expires {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let response = reqwest::Client::new().get(app.url(&format!("/v1/runs/{run}/events?ticket={ticket}"))).send().await;
    let (s, b) = to_json(response.unwrap()).await;
    assert_error(s, &b, 401, "INVALID_TICKET");
}

/// The role is read when the resume is sent: an operator demoted to viewer while a confirmation
/// waits can't approve it (403), the interrupt stays pending, nothing restarts; promoted again,
/// the same request goes through once, and the approver is recorded.
#[tokio::test]
async fn a_viewer_cannot_approve_and_a_demoted_operator_loses_the_right() {
    let app = TestApp::spawn().await;
    let (_, run, interrupt) = app.interrupted_run().await;
    app.store.set_user_role("demo", UserRole::Viewer).await.unwrap();
    let (s, b) = app.resume(&run, &interrupt, json!("approve"), "approve-1").await;
    assert_error(s, &b, 403, "FORBIDDEN");
    let view = app.run(&run).await;
    assert_eq!(view["status"], "interrupted");
    assert_eq!(view["pendingInterrupt"]["id"], interrupt);
    assert_eq!(app.instance("pay-prod-2").await["restartCount"], 0);

    app.store.set_user_role("demo", UserRole::Operator).await.unwrap();
    let (s, b) = app.resume(&run, &interrupt, json!("approve"), "approve-1").await;
    assert_eq!(s, StatusCode::OK, "a refused resume does not use up its key: {b}");
    app.wait_for_status(&run, "completed").await;
    assert_eq!(app.instance("pay-prod-2").await["restartCount"], 1);
    let resolved = app.store.get_interrupt(&InterruptId::parse(&interrupt).unwrap()).await.unwrap().unwrap();
    assert_eq!(resolved.resolved_by.as_deref(), Some("demo"));
}

#[tokio::test]
async fn too_deep_json_is_refused_before_it_is_parsed() {
    let app = TestApp::spawn().await;
    let conversation = app.create_conversation().await;
    let deep = format!("{}1{}", "[".repeat(33), "]".repeat(33));
    for body in [
        format!(r#"{{"content": "hi", "extra": {deep}}}"#),
        // deeper than serde_json would go on its own
        format!(r#"{{"content": {}}}"#, "[".repeat(100_000)),
    ] {
        let response = app
            .client
            .post(app.url(&format!("/v1/conversations/{conversation}/messages")))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        let (s, b) = to_json(response).await;
        assert_error(s, &b, 400, "JSON_TOO_DEEP");
    }
    // 32 levels are fine (the body is then checked as usual).
    let ok = format!(r#"{{"content": "hi", "extra": {}1{}}}"#, "[".repeat(31), "]".repeat(31));
    let response = app
        .client
        .post(app.url(&format!("/v1/conversations/{conversation}/messages")))
        .header("content-type", "application/json")
        .body(ok)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::ACCEPTED);
}

/// Past the burst, 429 with `Retry-After`; another user is not slowed by it.
#[tokio::test]
async fn the_rate_limit_is_per_user_with_retry_after() {
    let server = ServerConfig { rate_limit_per_second: 1.0, rate_limit_burst: 5, ..Options::default().server };
    let app = TestApp::with(Options { server, ..Options::default() }).await;
    for _ in 0..5 {
        assert_eq!(app.get("/v1/conversations").await.0, StatusCode::OK);
    }
    let response = app.client.get(app.url("/v1/conversations")).send().await.unwrap();
    let retry_after: u64 = response.headers()["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=2).contains(&retry_after), "{retry_after}");
    let (s, b) = to_json(response).await;
    assert_error(s, &b, 429, "RATE_LIMITED");
    assert_eq!(app.get_as("bob", "/v1/conversations").await.0, StatusCode::OK);
    // Health checks are not rate limited.
    for _ in 0..10 {
        assert_eq!(app.client.get(app.url("/healthz")).send().await.unwrap().status(), StatusCode::OK);
    }
}

/// A sample of the server's metrics, read from its registry (not over HTTP, which this address may
/// be refused).
fn metric(app: &TestApp, series: &str) -> f64 {
    let text = app.metrics.encode(&app.engine).expect("metrics");
    text.lines()
        .find_map(|line| line.strip_prefix(series).and_then(|rest| rest.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("{series} in {text}"))
        .parse()
        .expect("a number")
}

/// A flood of made-up keys from one address: past the per-address burst, requests are answered 429
/// before their key is looked up, so the store sees at most what the limit allows; another address
/// is not slowed by it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_per_address_limit_is_checked_before_any_key_lookup() {
    const REQUESTS: usize = 10_000;
    let (rate, burst) = (50.0, 100);
    let server = ServerConfig {
        rate_limit_per_address: rate,
        rate_burst_per_address: burst,
        // The per-user limit never gets to count these: none of them authenticates.
        ..Options::default().server
    };
    let app = TestApp::with(Options { server, ..Options::default() }).await;
    let lookups = |app: &TestApp| metric(app, "keel_credential_lookups_total{outcome=\"unknown\"}");
    assert_eq!(lookups(&app), 0.0);

    let started = std::time::Instant::now();
    let statuses: Vec<(StatusCode, Option<String>, Value)> = futures::stream::iter(0..REQUESTS)
        .map(|i| {
            let request = app
                .client
                .get(app.url("/v1/conversations"))
                .header(AUTHORIZATION, format!("Bearer keel_{:064x}", rand_key(i)));
            async move {
                let response = request.send().await.expect("GET");
                let retry_after = response.headers().get("retry-after").map(|v| v.to_str().unwrap().to_owned());
                let (status, body) = to_json(response).await;
                (status, retry_after, body)
            }
        })
        .buffer_unordered(32)
        .collect()
        .await;
    let elapsed = started.elapsed().as_secs_f64();

    let unauthorized = statuses.iter().filter(|(s, _, _)| *s == StatusCode::UNAUTHORIZED).count();
    let limited: Vec<_> = statuses.iter().filter(|(s, _, _)| *s == StatusCode::TOO_MANY_REQUESTS).collect();
    assert_eq!(unauthorized + limited.len(), REQUESTS, "every request is 401 or 429");
    for (status, retry_after, body) in &limited {
        assert_error(*status, body, 429, "RATE_LIMITED");
        let seconds: u64 = retry_after.as_deref().expect("Retry-After").parse().expect("seconds");
        assert!(seconds >= 1, "{seconds}");
    }
    // The store looked up exactly the keys that got past the limit, and the limit let through no
    // more than its burst and its rate over the time the flood took.
    let looked_up = lookups(&app);
    assert_eq!(looked_up, unauthorized as f64);
    let allowed = f64::from(burst) + (rate * elapsed).ceil() + 1.0;
    assert!(looked_up <= allowed, "{looked_up} key lookups in {elapsed:.2} s; the limit allows {allowed}");
    assert!(looked_up >= f64::from(burst), "the burst gets through: {looked_up}");
    assert_eq!(metric(&app, "keel_rate_limited_total{limit=\"address\"}"), limited.len() as f64);

    // Another address has a bucket of its own.
    let other =
        reqwest::Client::builder().local_address("127.0.0.2".parse::<std::net::IpAddr>().unwrap()).build().unwrap();
    let response =
        other.get(app.url("/v1/conversations")).header(AUTHORIZATION, app.bearer("demo")).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
}

/// Behind a trusted reverse proxy, each client is limited under the address the proxy names in
/// `X-Forwarded-For`, not under the proxy's; a peer that is not a trusted proxy gains nothing by
/// sending the header.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_a_trusted_proxy_each_forwarded_client_has_its_own_bucket() {
    let burst = 5;
    let server = ServerConfig {
        rate_limit_per_address: 0.001,
        rate_burst_per_address: burst,
        trusted_proxies: keel_server::limits::TrustedProxies::parse(&["127.0.0.1".to_owned()]).unwrap(),
        ..Options::default().server
    };
    let app = TestApp::with(Options { server, ..Options::default() }).await;
    let get = |client: &reqwest::Client, forwarded: Option<&str>| {
        let mut request = client.get(app.url("/v1/conversations")).header(AUTHORIZATION, app.bearer("demo"));
        if let Some(f) = forwarded {
            request = request.header("x-forwarded-for", f);
        }
        async move { request.send().await.unwrap().status() }
    };
    // From the trusted proxy (127.0.0.1): one client uses its burst up, another still has its own.
    for _ in 0..burst {
        assert_eq!(get(&app.client, Some("203.0.113.1")).await, StatusCode::OK);
    }
    assert_eq!(get(&app.client, Some("203.0.113.1")).await, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        get(&app.client, Some("6.6.6.6, 203.0.113.1")).await,
        StatusCode::TOO_MANY_REQUESTS,
        "what a client prepends is not believed"
    );
    assert_eq!(get(&app.client, Some("203.0.113.2")).await, StatusCode::OK);

    // Not a trusted proxy (127.0.0.2): the header is ignored, the peer's own bucket counts.
    let other =
        reqwest::Client::builder().local_address("127.0.0.2".parse::<std::net::IpAddr>().unwrap()).build().unwrap();
    for i in 0..burst {
        assert_eq!(get(&other, Some(&format!("198.51.100.{i}"))).await, StatusCode::OK);
    }
    assert_eq!(get(&other, Some("198.51.100.99")).await, StatusCode::TOO_MANY_REQUESTS);
}

/// A key shaped like an API key that nobody was issued (different for each `i`).
fn rand_key(i: usize) -> u128 {
    use std::hash::{BuildHasher, RandomState};
    let state = RandomState::new();
    (u128::from(state.hash_one(i)) << 64) | u128::from(state.hash_one(i + 1))
}

/// A user's open streams are capped; a refused stream starts nothing; a closed one frees its slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_streams_are_capped_per_user() {
    let server = ServerConfig { max_streams_per_user: 2, ..Options::default().server };
    let app = TestApp::with(Options { server, ..Options::default() }).await;
    let (_, run, _) = app.interrupted_run().await;
    // A paused run's event stream stays open (heartbeats) until the run ends.
    let mut first = app.events_stream(&run, None).await;
    first.assert_sse();
    let mut second = app.events_stream(&run, None).await;
    second.assert_sse();
    first.next_event().await.expect("the first stream is open");
    second.next_event().await.expect("the second stream is open");

    let refused = app.events_stream(&run, None).await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.headers["retry-after"], "1");
    let conversation = app.create_conversation().await;
    let response = app
        .client
        .post(app.url(&format!("/v1/conversations/{conversation}/messages")))
        .header(ACCEPT, "text/event-stream")
        .json(&json!({"content": "Look at the recent errors of payment-api"}))
        .send()
        .await
        .unwrap();
    let (s, b) = to_json(response).await;
    assert_error(s, &b, 429, "TOO_MANY_STREAMS");
    let (_, view) = app.get(&format!("/v1/conversations/{conversation}")).await;
    assert_eq!(view["messages"], json!([]), "the refused stream started no run: {view}");
    // The other transports count against the same cap.
    let agui = json!({"threadId": conversation, "runId": "r1", "state": {}, "tools": [], "context": [],
        "forwardedProps": {}, "messages": [{"id": "m1", "role": "user", "content": "Look at the recent errors of payment-api"}]});
    let (s, b) = app.post("/v1/ag-ui", &agui).await;
    assert_error(s, &b, 429, "TOO_MANY_STREAMS");
    let (_, view) = app.get(&format!("/v1/conversations/{conversation}")).await;
    assert_eq!(view["messages"], json!([]), "the refused AG-UI stream started no run: {view}");
    let tcp = tokio::net::TcpStream::connect(app.addr).await.unwrap();
    match tokio_tungstenite::client_async(app.ws_request(None), tcp).await {
        Err(tokio_tungstenite::tungstenite::Error::Http(response)) => assert_eq!(response.status(), 429),
        Ok(_) => panic!("a WebSocket past the cap was accepted"),
        Err(e) => panic!("{e}"),
    }

    // Bob has slots of his own.
    let response = app
        .client
        .get(app.url(&format!("/v1/runs/{run}/events")))
        .header(AUTHORIZATION, app.bearer("bob"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::NOT_FOUND, "bob is counted apart (and it is not his run)");

    drop(first);
    eventually("a closed stream frees its slot", || async {
        let reader = app.events_stream(&run, None).await;
        (reader.status == StatusCode::OK).then_some(())
    })
    .await;
    drop(second);
}
