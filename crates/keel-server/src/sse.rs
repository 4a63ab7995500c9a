//! The SSE encoder: a run's events as `text/event-stream`.
//!
//! The body is fed through a bounded channel by one task per response, which reads the run's
//! events (stored, then live) and writes keep-alives while none flow. The task waits at most
//! `sse_send_timeout` for the reader to take a frame: a reader that slow is cut off, reconnects
//! with `Last-Event-ID` and catches up from the store, so the server's memory never grows with a
//! slow reader.

use std::convert::Infallible;
use std::future::Future;
use std::pin::{pin, Pin};
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE};
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::{FutureExt, Stream, StreamExt};
use keel_core::engine::Engine;
use keel_core::store::StoreError;
use keel_core::stream::{Following, Known, Until};
use keel_core::{Event, RunId};
use tokio::sync::mpsc;
use tokio::sync::mpsc::error::SendTimeoutError;
use tokio_stream::wrappers::ReceiverStream;

use crate::limits::StreamPermit;
use crate::metrics::{ServerMetrics, SSE};
use crate::state::AppState;

pub const KEEP_ALIVE: &[u8] = b": keep-alive\n\n";

/// `retry: <ms>`, written once at the start of a stream.
pub fn retry_frame(ms: u64) -> Bytes {
    Bytes::from(format!("retry: {ms}\n\n"))
}

/// `id: <sequence>`, `event: <type>`, `data: <the event as one line of JSON>`, blank line.
pub fn event_frame(event: &Event) -> Result<Bytes, serde_json::Error> {
    let mut out = Vec::new();
    encode_into(&mut out, event)?;
    Ok(Bytes::from(out))
}

/// The response streaming `run_id`'s events with `sequence > after` until `until`. The caller has
/// checked that the run is the caller's.
/// One of the caller's stream slots when the request asks for a stream (`Accept:
/// text/event-stream`), taken before anything happens, so a refused stream starts nothing.
pub fn permit_if_streaming(
    state: &AppState,
    caller: &crate::extract::Caller,
    headers: &axum::http::HeaderMap,
) -> Result<Option<StreamPermit>, crate::error::ApiError> {
    if !crate::extract::accepts(headers, crate::extract::EVENT_STREAM) {
        return Ok(None);
    }
    state.limits.streams.acquire(&caller.0).map(Some)
}

/// `permit` holds the caller's stream slot for as long as the stream is fed; `known`: what the
/// request's read or write of the run said of it (see [`Known`]).
pub fn stream_run(
    state: &AppState,
    permit: StreamPermit,
    run_id: RunId,
    after: i64,
    until: Until,
    known: Known,
    following: Option<Following>,
) -> Response {
    let (tx, rx) = mpsc::channel::<Bytes>(state.config.sse_buffer.max(1));
    // Counted open for as long as the body lives: the server drops it when the response ends or
    // the client goes away.
    let connection = state.metrics.connection_opened(SSE);
    let state = state.clone();
    tokio::spawn(async move {
        feed(state, tx, run_id, after, until, known, following).await;
        drop(permit);
    });
    let body = ReceiverStream::new(rx).map(move |frame| {
        let _open = &connection;
        Ok::<_, Infallible>(frame)
    });
    sse_response(Body::from_stream(body))
}

pub(crate) fn sse_response(body: Body) -> Response {
    let mut response = (StatusCode::OK, body).into_response();
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream; charset=utf-8"));
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache, no-transform"));
    headers.insert("x-accel-buffering", HeaderValue::from_static("no"));
    response
}

/// How a stream ended.
#[derive(Debug, PartialEq, Eq)]
enum End {
    /// The run reached the stream's end (terminal event, or pause for a request's stream).
    Finished,
    /// The client went away first.
    Detached,
    /// The client did not take a frame within the send timeout.
    TooSlow,
    /// Reading or encoding the run's events failed (the reason, for the log).
    Failed(String),
    /// The server is stopping.
    Shutdown,
}

/// The timing of one stream.
#[derive(Debug, Clone, Copy)]
struct Pacing {
    retry_ms: u64,
    heartbeat: Duration,
    send_timeout: Duration,
}

async fn feed(
    state: AppState,
    tx: mpsc::Sender<Bytes>,
    run_id: RunId,
    after: i64,
    until: Until,
    known: Known,
    following: Option<Following>,
) {
    let engine: Arc<Engine> = state.engine.clone();
    let pacing = Pacing {
        retry_ms: state.config.sse_retry_ms,
        heartbeat: state.config.heartbeat,
        send_timeout: state.config.sse_send_timeout,
    };
    let metrics: &ServerMetrics = &state.metrics;
    let delivered = || metrics.event_delivered(SSE);
    // Pinned here, in a block of their own, and lent to `pump`: a future keeps room for its
    // arguments and its locals until their scope ends, so pinning them inside `pump` held them
    // twice, and pinning them in `feed`'s scope would keep that room beside `client_detached`'s
    // future. That halves an idle stream's task (4.1 → 2.2 KiB).
    let end = {
        let events = pin!(engine.events_following(&run_id, after, until, known, following));
        let shutdown = pin!(state.shutdown.wait());
        pump(&tx, events, pacing, shutdown, delivered).await
    };
    // The response ends when the last sender goes.
    drop(tx);
    match end {
        End::Detached => {
            tracing::debug!(run_id = %run_id, "SSE client went away");
            if let Err(e) = engine.client_detached(&run_id).await {
                tracing::warn!(run_id = %run_id, error = %e, "handling a detached client failed");
            }
        }
        End::TooSlow => {
            metrics.subscriber_dropped(SSE);
            tracing::info!(run_id = %run_id, "SSE client too slow to drain its buffer; cut off (it may reconnect)")
        }
        End::Failed(reason) => {
            keel_core::metrics::Recorder::store_error(metrics, "read_events");
            tracing::error!(run_id = %run_id, %reason, "ending the SSE stream")
        }
        End::Finished | End::Shutdown => {}
    }
}

/// Writes `retry`, then every event as a frame and a keep-alive whenever `heartbeat` passes without
/// one, until the events end, the client goes or is too slow, or `shutdown` resolves. `delivered` is
/// called for each event the client's buffer took.
async fn pump<S>(
    tx: &mpsc::Sender<Bytes>,
    mut events: Pin<&mut S>,
    pacing: Pacing,
    mut shutdown: Pin<&mut impl Future<Output = ()>>,
    delivered: impl Fn(),
) -> End
where
    S: Stream<Item = Result<Event, StoreError>>,
{
    let send = |frame: Bytes| async move {
        match tx.send_timeout(frame, pacing.send_timeout).await {
            Ok(()) => None,
            Err(SendTimeoutError::Closed(_)) => Some(End::Detached),
            Err(SendTimeoutError::Timeout(_)) => Some(End::TooSlow),
        }
    };
    if let Some(end) = send(retry_frame(pacing.retry_ms)).await {
        return end;
    }
    let heartbeat = pacing.heartbeat.max(Duration::from_millis(1));
    let mut keep_alive = tokio::time::interval_at(tokio::time::Instant::now() + heartbeat, heartbeat);
    keep_alive.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let mut frames = 0;
        let mut end = None;
        let frame = tokio::select! {
            biased;
            () = tx.closed() => return End::Detached,
            () = &mut shutdown => return End::Shutdown,
            next = events.next() => match next {
                None => return End::Finished,
                Some(Err(e)) => return End::Failed(format!("reading the run's events failed: {e}")),
                Some(Ok(event)) => {
                    keep_alive.reset();
                    // The events that are ready now (a commit's, or a replay's page) go in one write:
                    // one frame each would be one TCP segment, and one read by the client, each.
                    let mut batch = Vec::new();
                    let mut next = Some(event);
                    while let Some(event) = next.take() {
                        match encode_into(&mut batch, &event) {
                            Ok(()) => frames += 1,
                            Err(e) => return End::Failed(format!("encoding event {} failed: {e}", event.sequence)),
                        }
                        if frames == MAX_BATCH_EVENTS || batch.len() >= MAX_BATCH_BYTES {
                            break;
                        }
                        match events.next().now_or_never() {
                            Some(Some(Ok(event))) => next = Some(event),
                            // the events end after this batch is sent
                            Some(None) => end = Some(End::Finished),
                            Some(Some(Err(e))) => {
                                end = Some(End::Failed(format!("reading the run's events failed: {e}")))
                            }
                            None => {}
                        }
                    }
                    Bytes::from(batch)
                }
            },
            _ = keep_alive.tick() => Bytes::from_static(KEEP_ALIVE),
        };
        if let Some(end) = send(frame).await {
            return end;
        }
        for _ in 0..frames {
            delivered();
        }
        if let Some(end) = end {
            return end;
        }
    }
}

/// The most events, and about the most bytes (it may pass by one event), one write takes. Small, so
/// that the frames a slow reader leaves in its buffer stay small too (`sse_buffer` frames of at most
/// this, plus one event).
const MAX_BATCH_EVENTS: usize = 64;
const MAX_BATCH_BYTES: usize = 4 * 1024;

/// Appends the event's frame (see [`event_frame`]) to `out`.
fn encode_into(out: &mut Vec<u8>, event: &Event) -> Result<(), serde_json::Error> {
    // byte by byte: `write!` goes through `fmt::write` for every frame
    out.extend_from_slice(b"id: ");
    serde_json::to_writer(&mut *out, &event.sequence)?;
    out.extend_from_slice(b"\nevent: ");
    out.extend_from_slice(event.type_name().as_bytes());
    out.extend_from_slice(b"\ndata: ");
    // serde_json escapes every control character inside strings, so the JSON is one line.
    event.write_json(out)?;
    out.extend_from_slice(b"\n\n");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_core::EventKind;

    #[test]
    fn frames_are_exact() {
        assert_eq!(&retry_frame(2000)[..], b"retry: 2000\n\n");
        let event = Event::new(
            EventKind::TextDelta {
                message_id: keel_core::MessageId::parse("msg_1").unwrap(),
                delta: "two\nlines\r\n".into(),
            },
            RunId::parse("run_1").unwrap(),
            7,
            chrono::DateTime::from_timestamp(0, 0).unwrap(),
        );
        let frame = String::from_utf8(event_frame(&event).unwrap().to_vec()).unwrap();
        let mut lines = frame.split('\n');
        assert_eq!(lines.next(), Some("id: 7"));
        assert_eq!(lines.next(), Some("event: text_delta"));
        let data = lines.next().unwrap().strip_prefix("data: ").unwrap();
        let back: Event = serde_json::from_str(data).unwrap();
        assert_eq!(back, event);
        assert_eq!(lines.collect::<Vec<_>>(), vec!["", ""]);
        assert!(!frame.contains('\r'));
    }

    fn event(sequence: i64) -> Event {
        Event::new(
            EventKind::NodeStarted { node: "model".into() },
            RunId::parse("run_1").unwrap(),
            sequence,
            chrono::DateTime::from_timestamp(0, 0).unwrap(),
        )
    }

    const PACING: Pacing =
        Pacing { retry_ms: 2000, heartbeat: Duration::from_millis(100), send_timeout: Duration::from_secs(30) };

    fn drain(rx: &mut mpsc::Receiver<Bytes>) -> Vec<String> {
        let mut out = Vec::new();
        while let Ok(frame) = rx.try_recv() {
            out.push(String::from_utf8(frame.to_vec()).unwrap());
        }
        out
    }

    #[tokio::test(start_paused = true)]
    async fn a_finished_stream_is_retry_then_events() {
        let (tx, mut rx) = mpsc::channel(16);
        let events = futures::stream::iter((1..=3).map(|n| Ok(event(n))));
        let delivered = std::cell::Cell::new(0);
        let count = || delivered.set(delivered.get() + 1);
        assert_eq!(pump(&tx, pin!(events), PACING, pin!(std::future::pending()), count).await, End::Finished);
        assert_eq!(delivered.get(), 3, "each event counted once; retry is not an event");
        let frames = drain(&mut rx);
        // the events that were ready together went in one write, in order
        assert_eq!(frames.len(), 2);
        assert_eq!(frames[0], "retry: 2000\n\n");
        let ids: Vec<&str> = frames[1].lines().filter(|l| l.starts_with("id: ")).collect();
        assert_eq!(ids, ["id: 1", "id: 2", "id: 3"]);
        assert!(frames[1].starts_with("id: 1\nevent: node_started\ndata: {"));
        assert!(frames[1].ends_with("}\n\n"));
    }

    /// A reader that takes nothing holds at most the buffer; then the stream is cut off.
    #[tokio::test(start_paused = true)]
    async fn a_reader_too_slow_is_cut_off_with_bounded_memory() {
        let (tx, mut rx) = mpsc::channel(4);
        let events = futures::stream::iter((1..).map(|n| Ok(event(n))));
        let started = tokio::time::Instant::now();
        let delivered = std::cell::Cell::new(0);
        let count = || delivered.set(delivered.get() + 1);
        assert_eq!(pump(&tx, pin!(events), PACING, pin!(std::future::pending()), count).await, End::TooSlow);
        assert_eq!(started.elapsed(), PACING.send_timeout);
        let frames = drain(&mut rx);
        assert_eq!(frames.len(), 4);
        assert!(frames.iter().all(|f| f.len() <= MAX_BATCH_BYTES + 200), "each frame is bounded");
        let held: usize = frames[1..].iter().map(|f| f.matches("id: ").count()).sum();
        assert_eq!(delivered.get(), held, "retry and three batches fit; the fourth was never delivered");
    }

    #[tokio::test(start_paused = true)]
    async fn keep_alives_flow_while_no_events_do() {
        let (tx, mut rx) = mpsc::channel(16);
        let events = futures::stream::pending::<Result<Event, StoreError>>();
        let shutdown = tokio::time::sleep(Duration::from_millis(350));
        assert_eq!(pump(&tx, pin!(events), PACING, pin!(shutdown), || {}).await, End::Shutdown);
        assert_eq!(drain(&mut rx), vec!["retry: 2000\n\n", ": keep-alive\n\n", ": keep-alive\n\n", ": keep-alive\n\n"]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_reader_that_goes_away_is_noticed_while_idle() {
        let (tx, rx) = mpsc::channel(16);
        let events = futures::stream::pending::<Result<Event, StoreError>>();
        let (events, shutdown) = (pin!(events), pin!(std::future::pending()));
        let pump = pump(&tx, events, PACING, shutdown, || {});
        drop(rx);
        assert_eq!(pump.await, End::Detached);
    }

    #[tokio::test(start_paused = true)]
    async fn a_store_error_ends_the_stream_without_an_event() {
        let (tx, mut rx) = mpsc::channel(16);
        let events = futures::stream::iter(vec![Ok(event(1)), Err(StoreError::Backend("disk on fire".into()))]);
        let end = pump(&tx, pin!(events), PACING, pin!(std::future::pending()), || {}).await;
        assert!(matches!(end, End::Failed(_)), "{end:?}");
        let frames = drain(&mut rx);
        assert_eq!(frames.len(), 2, "retry, then the event read before the error");
        assert!(frames[1].starts_with("id: 1\n"));
        assert!(!frames.iter().any(|f| f.contains("event: error")));
    }

    /// The task of an idle stream is mostly this future: it must not hold its stream twice (it was
    /// 4 KiB when `pump` pinned its arguments itself; ~2 KiB now). 10,000 idle streams hold 10,000.
    #[tokio::test]
    async fn an_idle_stream_task_stays_small() {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn keel_core::store::Store> =
            Arc::new(keel_store::SqliteStore::open(&dir.path().join("keel.db")).await.unwrap());
        let engine = Arc::new(Engine::new(
            keel_core::engine::EngineParts {
                store,
                agents: keel_core::agent::Agents::single(
                    keel_core::agent::Agent::new("a", "A", Arc::new(keel_models::DemoModel::new(Duration::ZERO)), "p")
                        .unwrap(),
                ),
                bus: Arc::new(keel_core::bus::LocalBus::default()),
                clock: Arc::new(keel_core::clock::SystemClock),
            },
            keel_core::engine::EngineConfig::default(),
        ));
        let state = AppState::new(engine, crate::ServerConfig::default());
        let (tx, _rx) = mpsc::channel(1);
        let feed = feed(state, tx, RunId::new(), 0, Until::Terminal, Known::Unknown, None);
        let size = std::mem::size_of_val(&feed);
        assert!(size <= 3 * 1024, "the feed future takes {size} bytes");
    }
}
