//! An incremental Server-Sent Events parser.
//!
//! Follows the "event stream interpretation" of the WHATWG HTML standard (§9.2.6): the stream is
//! UTF-8 with an optional leading BOM; lines end with CRLF, LF or a lone CR; a line starting with
//! `:` is a comment; otherwise the text before the first `:` is the field name and the rest, minus
//! one optional leading space, its value (a line without `:` is a field with an empty value);
//! `data` lines append to the data buffer joined with `\n`; `event` sets the type; `id` sets the
//! last event ID unless it contains NUL; `retry` is honoured only when it is all ASCII digits; other
//! fields are ignored; a blank line dispatches the event if the data buffer is not empty.
//!
//! Bytes may arrive split anywhere — inside a multi-byte UTF-8 character, or between the CR and
//! the LF of a CRLF. The parser buffers the bytes of the current line and decodes only complete
//! lines (lossily: an invalid sequence becomes U+FFFD, as the standard's decoder does). Line
//! terminators are ASCII and never occur inside a multi-byte character, so decoding line by line
//! gives exactly what decoding the whole stream would.
//!
//! Choices where the standard leaves room for a library:
//! - [`SseFrame::Event::id`] is the stream's *last event ID* when the event is dispatched (what
//!   `MessageEvent.lastEventId` shows): it persists across events until another `id` field changes
//!   it, and is `None` while it is empty. A NUL-containing `id` leaves it unchanged.
//! - [`SseFrame::Event::event`] is `None` when no (or an empty) `event` field was given — the
//!   standard's default type `message`.
//! - Comments are reported (the standard drops them): a Keel server sends `: keep-alive`
//!   heartbeats. The text after the `:` is given with one leading space removed, like a field value.
//! - `retry` is reported as a frame when its line is read, in stream order.
//! - **Bounded memory:** a line longer than [`SseParser::max_len`] bytes (1 MiB by default) is not
//!   buffered: its bytes are dropped up to the next line terminator, and the event it belongs to is
//!   discarded whole at its blank line (a truncated `data` would be worse than none). The same
//!   happens when an event's accumulated `data` would exceed the limit.
//!   [`SseParser::oversized_lines`] counts these, so a caller can treat them as a protocol error.

/// The default limit on one line, and on one event's data, in bytes: 1 MiB.
pub const DEFAULT_MAX_LEN: usize = 1024 * 1024;

const BOM: &[u8] = b"\xEF\xBB\xBF";

/// What the parser reports, in stream order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SseFrame {
    /// A dispatched event.
    Event {
        /// The stream's last event ID when the event was dispatched; `None` if it is empty.
        id: Option<String>,
        /// The event type; `None` for the default (`message`).
        event: Option<String>,
        /// The `data` lines joined with `\n`.
        data: String,
    },
    /// A valid `retry:` field: the reconnection time in milliseconds.
    Retry(u64),
    /// A comment line (`: keep-alive`), without the `:` and one optional leading space.
    Comment(String),
}

/// An incremental SSE parser: feed it bytes as they arrive, get complete frames back.
#[derive(Debug, Clone)]
pub struct SseParser {
    max_len: usize,
    /// The bytes of the current, unterminated line.
    line: Vec<u8>,
    /// The current line grew past `max_len`: drop its bytes up to the next terminator.
    overflowing: bool,
    /// The last byte pushed was a CR: an LF first in the next chunk completes that CRLF.
    after_cr: bool,
    /// No line completed yet: the first one may start with a BOM.
    at_start: bool,
    data: String,
    event_type: String,
    last_event_id: String,
    /// The current event had an oversized line or data: discard it at its blank line.
    poisoned: bool,
    oversized: u64,
}

impl Default for SseParser {
    fn default() -> Self {
        Self::new()
    }
}

impl SseParser {
    /// A parser at the start of a stream, with the default 1 MiB limit.
    pub fn new() -> Self {
        Self::with_max_len(DEFAULT_MAX_LEN)
    }

    /// A parser that holds at most `max_len` bytes of one line, and of one event's data.
    pub fn with_max_len(max_len: usize) -> Self {
        Self {
            max_len: max_len.max(1),
            line: Vec::new(),
            overflowing: false,
            after_cr: false,
            at_start: true,
            data: String::new(),
            event_type: String::new(),
            last_event_id: String::new(),
            poisoned: false,
            oversized: 0,
        }
    }

    /// The limit on one line, and on one event's data, in bytes.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// The stream's last event ID (`None` while empty).
    pub fn last_event_id(&self) -> Option<&str> {
        (!self.last_event_id.is_empty()).then_some(self.last_event_id.as_str())
    }

    /// How many lines (or event data buffers) went over the limit and were dropped, with their
    /// events, since the parser was made.
    pub fn oversized_lines(&self) -> u64 {
        self.oversized
    }

    /// Feeds the next bytes of the stream; returns the frames they complete, in order.
    pub fn push(&mut self, chunk: &[u8]) -> Vec<SseFrame> {
        let mut out = Vec::new();
        let mut i = 0;
        if self.after_cr && !chunk.is_empty() {
            self.after_cr = false;
            if chunk[0] == b'\n' {
                i = 1;
            }
        }
        while i < chunk.len() {
            let rest = &chunk[i..];
            match rest.iter().position(|&b| b == b'\n' || b == b'\r') {
                Some(off) => {
                    self.append(&rest[..off]);
                    let terminator = rest[off];
                    i += off + 1;
                    if terminator == b'\r' {
                        match chunk.get(i) {
                            Some(b'\n') => i += 1,
                            Some(_) => {}
                            None => self.after_cr = true,
                        }
                    }
                    self.end_line(&mut out);
                }
                None => {
                    self.append(rest);
                    break;
                }
            }
        }
        out
    }

    /// The stream has ended. An unterminated line and an event without its blank line are
    /// discarded, as the standard requires; returns whether anything was (the stream was cut in
    /// the middle of a line or an event). The parser is then ready for a new stream (a reconnect):
    /// it keeps the last event ID and its counters, and accepts a BOM again.
    pub fn finish(&mut self) -> bool {
        let discarded = !self.line.is_empty() || self.overflowing || !self.data.is_empty() || self.poisoned;
        self.line = Vec::new();
        self.overflowing = false;
        self.after_cr = false;
        self.at_start = true;
        self.data.clear();
        self.event_type.clear();
        self.poisoned = false;
        discarded
    }

    fn append(&mut self, bytes: &[u8]) {
        if self.overflowing || bytes.is_empty() {
            return;
        }
        if self.line.len() + bytes.len() > self.max_len {
            self.overflowing = true;
            self.line = Vec::new();
        } else {
            self.line.extend_from_slice(bytes);
        }
    }

    fn end_line(&mut self, out: &mut Vec<SseFrame>) {
        let at_start = std::mem::replace(&mut self.at_start, false);
        if self.overflowing {
            self.overflowing = false;
            self.oversized += 1;
            self.poisoned = true;
            return;
        }
        let line = std::mem::take(&mut self.line);
        let bytes = if at_start { line.strip_prefix(BOM).unwrap_or(&line) } else { &line[..] };
        let text = String::from_utf8_lossy(bytes);
        self.process_line(&text, out);
        // Reuse the allocation for the next line.
        self.line = line;
        self.line.clear();
    }

    fn process_line(&mut self, line: &str, out: &mut Vec<SseFrame>) {
        if line.is_empty() {
            self.dispatch(out);
            return;
        }
        if let Some(comment) = line.strip_prefix(':') {
            out.push(SseFrame::Comment(strip_one_space(comment).to_owned()));
            return;
        }
        let (field, value) = match line.split_once(':') {
            Some((field, value)) => (field, strip_one_space(value)),
            None => (line, ""),
        };
        match field {
            "event" => {
                self.event_type.clear();
                self.event_type.push_str(value);
            }
            "data" => {
                if self.poisoned {
                    return;
                }
                if self.data.len() + value.len() + 1 > self.max_len {
                    self.oversized += 1;
                    self.poisoned = true;
                    self.data = String::new();
                } else {
                    self.data.push_str(value);
                    self.data.push('\n');
                }
            }
            "id" if !value.contains('\0') => {
                self.last_event_id.clear();
                self.last_event_id.push_str(value);
            }
            "retry" if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) => {
                // All digits but too large for u64: ignored like any invalid value.
                if let Ok(ms) = value.parse::<u64>() {
                    out.push(SseFrame::Retry(ms));
                }
            }
            // Unknown fields, an `id` with NUL, a `retry` that is not all digits.
            _ => {}
        }
    }

    fn dispatch(&mut self, out: &mut Vec<SseFrame>) {
        let event_type = std::mem::take(&mut self.event_type);
        if std::mem::take(&mut self.poisoned) {
            self.data.clear();
            return;
        }
        if self.data.is_empty() {
            return;
        }
        let mut data = std::mem::take(&mut self.data);
        data.pop(); // the `\n` after the last data line
        out.push(SseFrame::Event {
            id: self.last_event_id().map(str::to_owned),
            event: (!event_type.is_empty()).then_some(event_type),
            data,
        });
    }
}

fn strip_one_space(s: &str) -> &str {
    s.strip_prefix(' ').unwrap_or(s)
}
