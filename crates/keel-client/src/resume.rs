//! Resuming a run's event stream: the cursor that de-duplicates across reconnects, the reconnect
//! policy, and the stream that ties them to HTTP.
//!
//! Reconnect with `Last-Event-ID` (docs/events.md). A run's events carry `sequence` 1, 2, 3 … with no
//! gaps, and `GET /v1/runs/{id}/events` with `Last-Event-ID: N` replays everything after `N`, then
//! streams live events, until the run's terminal event. So a client that remembers the last
//! sequence it delivered can reconnect after any drop and deliver every event exactly once.

use std::collections::VecDeque;
use std::pin::Pin;
use std::time::Duration;

use bytes::Bytes;
use futures::{Stream, StreamExt};
use keel_core::{Event, RunId};

use crate::sse::{SseFrame, SseParser};
use crate::ClientError;

/// What to do with an event the stream received.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// The next event: deliver it (the cursor has moved to its sequence).
    Deliver,
    /// Already delivered (sequence ≤ the cursor), e.g. replayed after a reconnect: skip it.
    Duplicate,
    /// A sequence beyond the next one: events are missing. The cursor does not move.
    Gap { expected: i64, got: i64 },
    /// The run's terminal event was already delivered: nothing more is accepted.
    AfterEnd,
}

/// The cursor of a resuming event stream: the last delivered sequence, and whether the run ended.
///
/// Pure: no I/O, so the de-duplication rules are testable on their own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resumer {
    last: i64,
    finished: bool,
}

impl Resumer {
    /// A cursor that delivers events with sequence > `after` (0: from the start; a negative
    /// cursor counts as 0).
    pub fn new(after: i64) -> Self {
        Self { last: after.max(0), finished: false }
    }

    /// The last delivered sequence: the `Last-Event-ID` to reconnect with.
    pub fn last_sequence(&self) -> i64 {
        self.last
    }

    /// Whether a terminal event (`done`, `error`, `cancelled`) was delivered.
    pub fn is_finished(&self) -> bool {
        self.finished
    }

    /// Classifies the event with this `sequence`, moving the cursor if it is delivered.
    pub fn observe(&mut self, sequence: i64, terminal: bool) -> Step {
        if self.finished {
            return Step::AfterEnd;
        }
        if sequence <= self.last {
            return Step::Duplicate;
        }
        let expected = self.last + 1;
        if sequence != expected {
            return Step::Gap { expected, got: sequence };
        }
        self.last = sequence;
        self.finished = terminal;
        Step::Deliver
    }

    /// [`Resumer::observe`] for an event.
    pub fn accept(&mut self, event: &Event) -> Step {
        self.observe(event.sequence, event.is_terminal())
    }
}

/// How a resuming event stream reconnects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReconnectPolicy {
    /// Reconnects in a row that deliver no new event before the stream gives up with
    /// [`ClientError::ReconnectsExhausted`]. A connection that delivers an event resets the count.
    pub max_attempts: u32,
    /// The delay before the first reconnect, unless the server sent `retry:`, which replaces it.
    /// It doubles with each further failure in a row.
    pub initial_backoff: Duration,
    /// The longest delay between reconnects (or the server's `retry:`, if that is longer).
    pub max_backoff: Duration,
    /// No bytes for this long (not even a `: keep-alive`; the server sends one every 15 s by
    /// default) counts as a dropped connection. Also bounds waiting for the response headers.
    pub idle_timeout: Duration,
}

impl Default for ReconnectPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 5,
            initial_backoff: Duration::from_millis(250),
            max_backoff: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(45),
        }
    }
}

impl ReconnectPolicy {
    /// The delay before the reconnect that follows `failures` failures in a row (1 for the
    /// first): the base (`retry:` from the server, else `initial_backoff`) doubled per further
    /// failure, capped at `max_backoff` (or at the base, if the server asked for more).
    pub fn backoff(&self, failures: u32, server_retry: Option<Duration>) -> Duration {
        let base = server_retry.unwrap_or(self.initial_backoff);
        let cap = self.max_backoff.max(base);
        let factor = 1u32.checked_shl(failures.saturating_sub(1)).unwrap_or(u32::MAX);
        base.checked_mul(factor).unwrap_or(cap).min(cap)
    }
}

type Body = Pin<Box<dyn Stream<Item = Result<Bytes, reqwest::Error>> + Send>>;

/// The state of one resuming event stream (see [`crate::KeelClient::events`]).
pub(crate) struct EventStream {
    http: reqwest::Client,
    url: String,
    /// Who is asking (`Authorization`), sent on every reconnect.
    identity: reqwest::header::HeaderMap,
    run_id: RunId,
    policy: ReconnectPolicy,
    cursor: Resumer,
    parser: SseParser,
    body: Option<Body>,
    frames: VecDeque<SseFrame>,
    /// Connections in a row that ended without delivering a new event.
    failures: u32,
    last_error: Option<ClientError>,
    server_retry: Option<Duration>,
    done: bool,
}

impl EventStream {
    pub(crate) fn new(
        http: reqwest::Client,
        url: String,
        identity: reqwest::header::HeaderMap,
        run_id: RunId,
        policy: ReconnectPolicy,
        after: i64,
    ) -> Self {
        Self {
            http,
            url,
            identity,
            run_id,
            policy,
            cursor: Resumer::new(after),
            parser: SseParser::new(),
            body: None,
            frames: VecDeque::new(),
            failures: 0,
            last_error: None,
            server_retry: None,
            done: false,
        }
    }

    pub(crate) fn into_stream(self) -> impl Stream<Item = Result<Event, ClientError>> + Send + Unpin + 'static {
        Box::pin(futures::stream::unfold(self, |mut state| async move {
            let item = state.next_event().await?;
            Some((item, state))
        }))
    }

    fn fail(&mut self, err: ClientError) -> Option<Result<Event, ClientError>> {
        self.done = true;
        self.body = None;
        self.frames.clear();
        Some(Err(err))
    }

    /// The connection is lost (or unusable): reconnect later, from the cursor.
    fn drop_connection(&mut self, err: ClientError) {
        self.body = None;
        self.frames.clear();
        self.failures += 1;
        self.last_error = Some(err);
    }

    async fn next_event(&mut self) -> Option<Result<Event, ClientError>> {
        loop {
            if self.done {
                return None;
            }
            while let Some(frame) = self.frames.pop_front() {
                match frame {
                    SseFrame::Event { data, .. } => {
                        let event: Event = match serde_json::from_str(&data) {
                            Ok(event) => event,
                            Err(source) => {
                                return self.fail(ClientError::Decode { context: snippet(&data), source });
                            }
                        };
                        if event.run_id != self.run_id {
                            return self.fail(ClientError::Protocol(format!(
                                "event {} of run {} on the stream of run {}",
                                event.sequence, event.run_id, self.run_id
                            )));
                        }
                        match self.cursor.accept(&event) {
                            Step::Deliver => {
                                self.failures = 0;
                                self.last_error = None;
                                if self.cursor.is_finished() {
                                    // Nothing follows a terminal event: stop reading.
                                    self.done = true;
                                    self.body = None;
                                    self.frames.clear();
                                }
                                return Some(Ok(event));
                            }
                            Step::Duplicate | Step::AfterEnd => {}
                            Step::Gap { expected, got } => {
                                self.drop_connection(ClientError::SequenceGap { expected, got });
                                break;
                            }
                        }
                    }
                    SseFrame::Retry(ms) => self.server_retry = Some(Duration::from_millis(ms)),
                    SseFrame::Comment(_) => {}
                }
            }

            let Some(body) = self.body.as_mut() else {
                if self.failures > 0 {
                    if self.failures > self.policy.max_attempts {
                        let last = self.last_error.take().unwrap_or(ClientError::StreamEnded);
                        return self.fail(ClientError::ReconnectsExhausted {
                            attempts: self.policy.max_attempts,
                            last_sequence: self.cursor.last_sequence(),
                            last: Box::new(last),
                        });
                    }
                    tokio::time::sleep(self.policy.backoff(self.failures, self.server_retry)).await;
                }
                match self.connect().await {
                    Ok(body) => {
                        self.parser = SseParser::new();
                        self.body = Some(body);
                    }
                    Err(err) if err.is_retryable() => {
                        self.failures += 1;
                        self.last_error = Some(err);
                    }
                    Err(err) => return self.fail(err),
                }
                continue;
            };

            match tokio::time::timeout(self.policy.idle_timeout, body.next()).await {
                Ok(Some(Ok(chunk))) => {
                    let frames = self.parser.push(&chunk);
                    if self.parser.oversized_lines() > 0 {
                        return self.fail(ClientError::Protocol(format!(
                            "an SSE line or event is longer than {} bytes",
                            self.parser.max_len()
                        )));
                    }
                    self.frames.extend(frames);
                }
                Ok(Some(Err(err))) => self.drop_connection(ClientError::Http(err)),
                Ok(None) => {
                    self.parser.finish();
                    self.drop_connection(ClientError::StreamEnded);
                }
                Err(_) => self.drop_connection(ClientError::IdleTimeout(self.policy.idle_timeout)),
            }
        }
    }

    // `&mut self`: the state is `Send` but not `Sync` (the body stream), and this future must be `Send`.
    async fn connect(&mut self) -> Result<Body, ClientError> {
        let req = self
            .http
            .get(&self.url)
            .headers(self.identity.clone())
            .header(reqwest::header::ACCEPT, "text/event-stream")
            .header(reqwest::header::CACHE_CONTROL, "no-cache")
            .header("Last-Event-ID", self.cursor.last_sequence().to_string());
        let resp = match tokio::time::timeout(self.policy.idle_timeout, req.send()).await {
            Ok(resp) => resp?,
            Err(_) => return Err(ClientError::IdleTimeout(self.policy.idle_timeout)),
        };
        if !resp.status().is_success() {
            return Err(crate::api_error(resp).await);
        }
        if let Some(ct) = resp.headers().get(reqwest::header::CONTENT_TYPE) {
            let ct = ct.to_str().unwrap_or_default();
            if !ct.trim_start().to_ascii_lowercase().starts_with("text/event-stream") {
                return Err(ClientError::Protocol(format!("expected text/event-stream, got `{ct}`")));
            }
        }
        Ok(Box::pin(resp.bytes_stream()))
    }
}

fn snippet(s: &str) -> String {
    const MAX: usize = 200;
    match s.char_indices().nth(MAX) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delivers_in_order_and_skips_replayed_events() {
        let mut c = Resumer::new(0);
        assert_eq!(c.observe(1, false), Step::Deliver);
        assert_eq!(c.observe(2, false), Step::Deliver);
        assert_eq!(c.observe(3, false), Step::Deliver);
        // reconnect with Last-Event-ID: 3; a server that replays a little too much
        assert_eq!(c.last_sequence(), 3);
        assert_eq!(c.observe(2, false), Step::Duplicate);
        assert_eq!(c.observe(3, false), Step::Duplicate);
        assert_eq!(c.observe(4, false), Step::Deliver);
        assert_eq!(c.observe(4, false), Step::Duplicate);
        assert_eq!(c.last_sequence(), 4);
    }

    #[test]
    fn starts_after_the_cursor() {
        let mut c = Resumer::new(4);
        assert_eq!(c.observe(1, false), Step::Duplicate);
        assert_eq!(c.observe(4, false), Step::Duplicate);
        assert_eq!(c.observe(5, false), Step::Deliver);
        assert_eq!(Resumer::new(-3).last_sequence(), 0);
    }

    #[test]
    fn a_gap_does_not_move_the_cursor() {
        let mut c = Resumer::new(2);
        assert_eq!(c.observe(5, false), Step::Gap { expected: 3, got: 5 });
        assert_eq!(c.last_sequence(), 2);
        assert_eq!(c.observe(3, false), Step::Deliver);
    }

    #[test]
    fn nothing_is_accepted_after_the_terminal_event() {
        let mut c = Resumer::new(0);
        assert_eq!(c.observe(1, false), Step::Deliver);
        assert!(!c.is_finished());
        assert_eq!(c.observe(2, true), Step::Deliver);
        assert!(c.is_finished());
        assert_eq!(c.observe(3, false), Step::AfterEnd);
        assert_eq!(c.observe(2, true), Step::AfterEnd);
        assert_eq!(c.last_sequence(), 2);
    }

    #[test]
    fn any_replay_pattern_delivers_each_event_once() {
        // Connections that each replay from some earlier point (as a server may after a reconnect)
        // deliver 1..=n exactly once, in order.
        let n = 20;
        let mut c = Resumer::new(0);
        let mut delivered = Vec::new();
        for (start, end) in [(1, 5), (1, 3), (4, 9), (7, 12), (12, 12), (2, 20)] {
            for seq in start..=end {
                if c.observe(seq, seq == n) == Step::Deliver {
                    delivered.push(seq);
                }
            }
        }
        assert_eq!(delivered, (1..=n).collect::<Vec<_>>());
        assert!(c.is_finished());
    }

    #[test]
    fn accepts_events() {
        let event = |seq: i64, kind: &str| -> Event {
            let extra = match kind {
                "done" => r#","messageId":null"#,
                _ => r#","node":"plan""#,
            };
            serde_json::from_str(&format!(
                r#"{{"type":"{kind}","runId":"run_1","sequence":{seq},"ts":"2025-01-01T00:00:00Z"{extra}}}"#
            ))
            .unwrap()
        };
        let mut c = Resumer::new(0);
        assert_eq!(c.accept(&event(1, "node_started")), Step::Deliver);
        assert_eq!(c.accept(&event(1, "node_started")), Step::Duplicate);
        assert_eq!(c.accept(&event(2, "done")), Step::Deliver);
        assert!(c.is_finished());
    }

    #[test]
    fn backoff_doubles_and_is_capped() {
        let p = ReconnectPolicy {
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(1),
            ..ReconnectPolicy::default()
        };
        let ms = |f, r: Option<u64>| p.backoff(f, r.map(Duration::from_millis)).as_millis();
        assert_eq!(ms(1, None), 100);
        assert_eq!(ms(2, None), 200);
        assert_eq!(ms(3, None), 400);
        assert_eq!(ms(4, None), 800);
        assert_eq!(ms(5, None), 1000);
        assert_eq!(ms(64, None), 1000);
        assert_eq!(ms(u32::MAX, None), 1000);
        // the server's `retry:` replaces the initial delay; a long one is honoured as the cap
        assert_eq!(ms(1, Some(20)), 20);
        assert_eq!(ms(2, Some(20)), 40);
        assert_eq!(ms(1, Some(3000)), 3000);
        assert_eq!(ms(3, Some(3000)), 3000);
    }
}
