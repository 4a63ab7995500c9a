//! An incremental parser for the `text/event-stream` wire format, as OpenAI-compatible servers speak
//! it: bytes go in split anywhere (inside a line, inside a UTF-8 character, between `\r` and `\n`),
//! the `data` of each event comes out. Comments (`: ping`), `event:`/`id:`/`retry:` fields and blank
//! lines are handled as the spec says; lines may end in `\n`, `\r\n` or `\r`.
//!
//! One tolerance beyond the spec: some servers forget the blank line between events and write
//! `data: {…}` lines back to back. A `data:` line that follows a complete JSON payload (or `[DONE]`)
//! starts a new event instead of being joined to it.

/// Why the stream can't be parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SseError {
    /// A line longer than the limit: not an event stream, or a runaway server.
    LineTooLong(usize),
    /// A line that is not UTF-8.
    InvalidUtf8,
}

impl std::fmt::Display for SseError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SseError::LineTooLong(max) => write!(f, "an event-stream line is longer than {max} bytes"),
            SseError::InvalidUtf8 => f.write_str("the event stream is not valid UTF-8"),
        }
    }
}

impl std::error::Error for SseError {}

#[derive(Debug)]
pub struct SseParser {
    /// The bytes of the line being read (not yet terminated).
    line: Vec<u8>,
    /// The last line ended in `\r`: a `\n` right after it belongs to that line ending.
    skip_lf: bool,
    /// Nothing read yet: a leading byte-order mark is dropped.
    at_start: bool,
    /// The data lines of the event being read, joined by `\n`.
    data: String,
    has_data: bool,
    max_line: usize,
}

impl Default for SseParser {
    fn default() -> Self {
        Self::new(4 * 1024 * 1024)
    }
}

impl SseParser {
    /// `max_line`: the longest line accepted, in bytes.
    pub fn new(max_line: usize) -> Self {
        Self { line: Vec::new(), skip_lf: false, at_start: true, data: String::new(), has_data: false, max_line }
    }

    /// Feeds bytes; the data of every event they complete is pushed to `out`.
    pub fn feed(&mut self, bytes: &[u8], out: &mut Vec<String>) -> Result<(), SseError> {
        let mut start = 0;
        for (i, &b) in bytes.iter().enumerate() {
            if self.skip_lf {
                self.skip_lf = false;
                if b == b'\n' {
                    start = i + 1;
                    continue;
                }
            }
            if b == b'\n' || b == b'\r' {
                self.push_bytes(&bytes[start..i])?;
                self.end_line(out)?;
                self.skip_lf = b == b'\r';
                start = i + 1;
            }
        }
        self.push_bytes(&bytes[start..])
    }

    /// The stream ended: a last line without its line ending, and a last event without its blank
    /// line, still count.
    pub fn finish(&mut self, out: &mut Vec<String>) -> Result<(), SseError> {
        if !self.line.is_empty() {
            self.end_line(out)?;
        }
        self.dispatch(out);
        Ok(())
    }

    fn push_bytes(&mut self, bytes: &[u8]) -> Result<(), SseError> {
        if self.line.len() + bytes.len() > self.max_line {
            return Err(SseError::LineTooLong(self.max_line));
        }
        self.line.extend_from_slice(bytes);
        Ok(())
    }

    fn end_line(&mut self, out: &mut Vec<String>) -> Result<(), SseError> {
        let raw = std::mem::take(&mut self.line);
        let mut line = std::str::from_utf8(&raw).map_err(|_| SseError::InvalidUtf8)?;
        if self.at_start {
            self.at_start = false;
            line = line.strip_prefix('\u{feff}').unwrap_or(line);
        }
        if line.is_empty() {
            self.dispatch(out);
            return Ok(());
        }
        if line.starts_with(':') {
            return Ok(());
        }
        let (field, value) = match line.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (line, ""),
        };
        if field == "data" {
            if self.has_data && is_complete(&self.data) {
                self.dispatch(out);
            }
            if self.has_data {
                self.data.push('\n');
            }
            self.data.push_str(value);
            self.has_data = true;
        }
        // `event`, `id`, `retry` and unknown fields carry nothing an OpenAI stream needs.
        Ok(())
    }

    fn dispatch(&mut self, out: &mut Vec<String>) {
        if self.has_data {
            self.has_data = false;
            out.push(std::mem::take(&mut self.data));
        }
    }
}

fn is_complete(data: &str) -> bool {
    data == "[DONE]" || serde_json::from_str::<serde::de::IgnoredAny>(data).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn parse_all(pieces: &[&[u8]]) -> Result<Vec<String>, SseError> {
        let mut p = SseParser::default();
        let mut out = Vec::new();
        for piece in pieces {
            p.feed(piece, &mut out)?;
        }
        p.finish(&mut out)?;
        Ok(out)
    }

    #[test]
    fn events_comments_and_line_endings() {
        let wire = "\u{feff}: hello\r\n\r\ndata: {\"a\":1}\r\n\r\nevent: x\nid: 3\ndata:{\"b\":2}\n\n: ping\n\ndata: [DONE]\r\r";
        assert_eq!(parse_all(&[wire.as_bytes()]).unwrap(), vec![r#"{"a":1}"#, r#"{"b":2}"#, "[DONE]"]);
    }

    #[test]
    fn multi_line_data_is_joined() {
        assert_eq!(parse_all(&[b"data: {\"a\":\ndata: 1}\n\n"]).unwrap(), vec!["{\"a\":\n1}"]);
    }

    #[test]
    fn missing_blank_lines_are_tolerated() {
        let wire = b"data: {\"a\":1}\ndata: {\"b\":2}\ndata: [DONE]\n";
        assert_eq!(parse_all(&[wire]).unwrap(), vec![r#"{"a":1}"#, r#"{"b":2}"#, "[DONE]"]);
    }

    #[test]
    fn a_last_event_without_its_blank_line_counts() {
        assert_eq!(parse_all(&[b"data: {\"a\":1}"]).unwrap(), vec![r#"{"a":1}"#]);
    }

    #[test]
    fn invalid_utf8_and_long_lines_are_errors() {
        assert_eq!(parse_all(&[b"data: \xff\xfe\n\n"]), Err(SseError::InvalidUtf8));
        let mut p = SseParser::new(16);
        let mut out = Vec::new();
        assert_eq!(p.feed(&[b'x'; 17], &mut out), Err(SseError::LineTooLong(16)));
    }

    proptest! {
        /// The same events come out however the bytes are split, whatever the line endings.
        #[test]
        fn any_split_gives_the_same_events(
            texts in proptest::collection::vec("[a-zé🚀\"\\\\ ]{0,12}", 1..6),
            ending in 0usize..3,
            cuts in proptest::collection::vec(0usize..400, 0..12),
        ) {
            let nl = ["\n", "\r\n", "\r"][ending];
            let payloads: Vec<String> = texts.iter().map(|t| serde_json::json!({"t": t}).to_string()).collect();
            let mut wire = format!(": keep-alive{nl}{nl}");
            for p in &payloads {
                wire.push_str(&format!("data: {p}{nl}{nl}"));
            }
            wire.push_str(&format!("data: [DONE]{nl}{nl}"));
            let bytes = wire.as_bytes();
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (bytes.len() + 1)).collect();
            cuts.sort_unstable();
            let mut pieces = Vec::new();
            let mut last = 0;
            for c in cuts {
                pieces.push(&bytes[last..c]);
                last = c;
            }
            pieces.push(&bytes[last..]);
            let mut expected = payloads.clone();
            expected.push("[DONE]".into());
            prop_assert_eq!(parse_all(&pieces).unwrap(), expected);
        }
    }
}
