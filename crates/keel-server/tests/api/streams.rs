//! Event streams: replay from any cursor, reconnects, keep-alives, disconnects.

use std::time::Duration;

use keel_client::sse::SseFrame;
use keel_core::event::render_text;
use keel_core::{Event, EventKind};
use reqwest::StatusCode;
use serde_json::json;

use crate::common::*;

/// A finished run, replayed from every cursor, gives exactly the suffix after it.
#[tokio::test]
async fn reconnecting_at_every_position_gives_exactly_the_suffix() {
    let app = TestApp::with(Options { demo_delay: Duration::ZERO, ..Options::default() }).await;
    let conversation = app.create_conversation().await;
    let turn = app.send_and_wait(&conversation, ERRORS_PROMPT).await;
    assert_eq!(turn["run"]["status"], "completed");
    let run = turn["run"]["id"].as_str().unwrap();
    let all = app.events_json(run, 0).await;
    let last = all.len() as i64;
    assert_eq!(turn["run"]["lastSequence"], last);
    assert_contiguous(&all, 1);
    assert_eq!(all.last().unwrap().type_name(), "done");

    for cursor in 0..=last {
        let mut stream = app.events_stream(run, Some(cursor)).await;
        stream.assert_sse();
        let replay = stream.collect().await;
        assert_eq!(replay, all[cursor as usize..], "Last-Event-ID {cursor}");
        assert_eq!(app.events_json(run, cursor).await, all[cursor as usize..], "?after={cursor}");
    }
    // `?after` works the same for an EventSource's first connection; the header wins over it.
    let response = app
        .client
        .get(app.url(&format!("/v1/runs/{run}/events?after=1")))
        .header("last-event-id", (last - 1).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(SseReader::new(response).collect().await, all[(last - 1) as usize..]);
}

/// The exact bytes of a stream: `retry` once, then `id`/`event`/`data` frames, LF only.
#[tokio::test]
async fn sse_framing_is_exact() {
    let app = TestApp::with(Options { demo_delay: Duration::ZERO, ..Options::default() }).await;
    let conversation = app.create_conversation().await;
    let turn = app.send_and_wait(&conversation, ERRORS_PROMPT).await;
    let run = turn["run"]["id"].as_str().unwrap();
    let all = app.events_json(run, 0).await;
    let mut stream = app.events_stream(run, None).await;
    stream.collect().await;
    let raw = String::from_utf8(stream.raw.clone()).unwrap();
    assert!(!raw.contains('\r'));
    let mut expected = String::from("retry: 2000\n\n");
    for e in &all {
        expected.push_str(&format!(
            "id: {}\nevent: {}\ndata: {}\n\n",
            e.sequence,
            e.type_name(),
            serde_json::to_string(e).unwrap()
        ));
    }
    assert_eq!(raw, expected);
    let first: serde_json::Value =
        serde_json::from_str(raw.lines().nth(4).unwrap().strip_prefix("data: ").unwrap()).unwrap();
    for field in ["type", "runId", "sequence", "ts", "conversationId"] {
        assert!(first.get(field).is_some(), "{field} in {first}");
    }
}

/// A reader that drops mid-text and reconnects with `Last-Event-ID` renders what one that never
/// dropped renders.
#[tokio::test]
async fn a_reader_that_drops_mid_text_renders_the_same_text() {
    let app = TestApp::with(Options { demo_delay: Duration::from_millis(4), ..Options::default() }).await;
    let conversation = app.create_conversation().await;
    let run = app.send(&conversation, ERRORS_PROMPT).await;

    let steady = {
        let mut stream = app.events_stream(&run, None).await;
        tokio::spawn(async move { stream.collect().await })
    };

    let mut first = app.events_stream(&run, None).await;
    let mut seen: Vec<Event> = Vec::new();
    let mut deltas = 0;
    while deltas < 3 {
        let event = first.next_event().await.expect("the stream goes on until text flows");
        assert!(!event.is_terminal(), "the run ended before the reader dropped");
        if matches!(event.kind, EventKind::TextDelta { .. }) {
            deltas += 1;
        }
        seen.push(event);
    }
    first.disconnect();
    let last_seen = seen.last().unwrap().sequence;
    let mut second = app.events_stream(&run, Some(last_seen)).await;
    seen.extend(second.collect().await);

    let steady = steady.await.unwrap();
    assert_contiguous(&seen, 1);
    assert_eq!(seen, steady);
    assert_eq!(seen.last().unwrap().type_name(), "done");
    let rendered = render_text(&seen);
    assert_eq!(rendered, render_text(&steady));
    let (_, view) = app.get(&format!("/v1/conversations/{conversation}")).await;
    let stored: Vec<String> = view["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "assistant")
        .map(|m| m["content"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(rendered.into_iter().map(|(_, t)| t).collect::<Vec<_>>(), stored);
}

/// While a run waits for a human no events flow, but keep-alives do.
#[tokio::test]
async fn keep_alives_flow_while_paused() {
    let app = TestApp::with(Options { heartbeat: Duration::from_millis(100), ..Options::default() }).await;
    let (_, run, _) = app.interrupted_run().await;
    let last = app.run(&run).await["lastSequence"].as_i64().unwrap();
    let mut stream = app.events_stream(&run, Some(last)).await;
    stream.assert_sse();
    assert_eq!(stream.next_frame().await, Some(SseFrame::Retry(2000)));
    for _ in 0..3 {
        assert_eq!(stream.next_frame().await, Some(SseFrame::Comment("keep-alive".into())));
    }
    // The stream follows the run to its end.
    let (status, _) = app.post(&format!("/v1/runs/{run}/cancel"), &json!({})).await;
    assert_eq!(status, StatusCode::OK);
    let rest = stream.collect().await;
    assert_contiguous(&rest, last + 1);
    assert_eq!(rest.last().unwrap().type_name(), "cancelled", "{:?}", types(&rest));
    assert!(String::from_utf8(stream.raw).unwrap().contains("\n\n: keep-alive\n\n"));
}

/// `cancelOnDisconnect: true`: the run ends when its stream's client goes away.
#[tokio::test]
async fn a_disconnect_cancels_a_run_that_asks_for_it() {
    let app = TestApp::with(Options { demo_delay: Duration::from_millis(25), ..Options::default() }).await;
    let conversation = app.create_conversation().await;
    let mut stream =
        app.send_streaming(&conversation, &json!({"content": ERRORS_PROMPT, "cancelOnDisconnect": true})).await;
    let started = stream.next_event().await.unwrap();
    assert_eq!(started.type_name(), "run_started");
    let run = started.run_id.to_string();
    stream.disconnect();
    let view = app.wait_for_status(&run, "cancelled").await;
    assert_eq!(view["cancelRequested"], true);
    let events = app.events_json(&run, 0).await;
    assert_eq!(events.last().unwrap().type_name(), "cancelled");
}

/// Without it, the run goes on.
#[tokio::test]
async fn a_disconnect_leaves_other_runs_running() {
    let app = TestApp::with(Options { demo_delay: Duration::from_millis(10), ..Options::default() }).await;
    let conversation = app.create_conversation().await;
    let mut stream = app.send_streaming(&conversation, &json!({"content": ERRORS_PROMPT})).await;
    let started = stream.next_event().await.unwrap();
    let run = started.run_id.to_string();
    stream.disconnect();
    let view = app.wait_for_status(&run, "completed").await;
    assert_eq!(view["cancelRequested"], false);
}

/// Stopping `serve`: open event streams end, a request in flight is still answered (a `?wait=true`
/// one with `SHUTTING_DOWN`), no new connection is accepted, and `serve` returns.
#[tokio::test]
async fn a_graceful_shutdown_ends_open_streams_and_returns() {
    let app = TestApp::with(Options { demo_delay: Duration::from_millis(20), ..Options::default() }).await;
    let (_, run, _) = app.interrupted_run().await;
    let last = app.run(&run).await["lastSequence"].as_i64().unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let state = keel_server::AppState::new(app.engine.clone(), keel_server::ServerConfig::default());
    let server = tokio::spawn(keel_server::serve(listener, state, Default::default(), async {
        let _ = stopped.await;
    }));
    let url = |path: &str| format!("http://{addr}{path}");

    let response =
        app.client.get(url(&format!("/v1/runs/{run}/events"))).header("last-event-id", last.to_string()).send().await;
    let mut stream = SseReader::new(response.unwrap());
    stream.assert_sse();
    assert_eq!(stream.next_frame().await, Some(SseFrame::Retry(2000)));
    // A turn of the demo model at 20 ms a word is still being answered when the stop comes.
    let conversation = app.create_conversation().await;
    let in_flight = app
        .client
        .post(url(&format!("/v1/conversations/{conversation}/messages?wait=true")))
        .json(&json!({"content": ERRORS_PROMPT}))
        .send();
    let in_flight = tokio::spawn(in_flight);
    tokio::time::sleep(Duration::from_millis(100)).await;
    stop.send(()).unwrap();

    assert_eq!(stream.collect().await, [], "the stream ends, with nothing more");
    let answered = tokio::time::timeout(DEADLINE, in_flight).await.expect("answered in time").unwrap().unwrap();
    assert_eq!(answered.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(answered.json::<serde_json::Value>().await.unwrap()["error"]["code"], "SHUTTING_DOWN");
    tokio::time::timeout(DEADLINE, server).await.expect("serve returns").unwrap().unwrap();
    assert!(tokio::net::TcpStream::connect(addr).await.is_err(), "the listener is closed");
}
