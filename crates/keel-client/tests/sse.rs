//! The SSE parser against the WHATWG event-stream rules, fed in every way bytes can arrive.

use keel_client::sse::{SseFrame, SseParser};
use proptest::prelude::*;

fn ev(id: Option<&str>, event: Option<&str>, data: &str) -> SseFrame {
    SseFrame::Event { id: id.map(str::to_owned), event: event.map(str::to_owned), data: data.to_owned() }
}

fn comment(s: &str) -> SseFrame {
    SseFrame::Comment(s.to_owned())
}

fn whole(input: &[u8]) -> Vec<SseFrame> {
    let mut p = SseParser::new();
    let frames = p.push(input);
    assert!(!p.finish(), "the sample ends with a complete event");
    frames
}

fn chunked(input: &[u8], cuts: &[usize]) -> Vec<SseFrame> {
    let mut p = SseParser::new();
    let mut out = Vec::new();
    let mut start = 0;
    for &cut in cuts {
        out.extend(p.push(&input[start..cut]));
        start = cut;
    }
    out.extend(p.push(&input[start..]));
    out
}

/// A Keel-like stream, LF endings: retry, heartbeats, events with Chinese text, multi-line data.
const SAMPLE: &str = concat!(
    "retry: 3000\n",
    ": keep-alive\n",
    "id: 1\n",
    "event: run_started\n",
    "data: {\"type\":\"run_started\",\"sequence\":1}\n",
    "\n",
    "id: 2\n",
    "event: text_delta\n",
    "data: {\"delta\":\"支付服务出现错误\"}\n",
    "\n",
    ": keep-alive\n",
    "id: 3\n",
    "event: text_delta\n",
    "data: 第一行\n",
    "data:第二行，没有空格\n",
    "data\n",
    "data:  两个空格\n",
    "\n",
    "unknown: field\n",
    "data: 🚀 résumé\n",
    "\n",
    ":\n",
    "id: 4\n",
    "event: done\n",
    "data: {\"messageId\":\"msg_1\"}\n",
    "\n",
);

fn sample_frames() -> Vec<SseFrame> {
    vec![
        SseFrame::Retry(3000),
        comment("keep-alive"),
        ev(Some("1"), Some("run_started"), "{\"type\":\"run_started\",\"sequence\":1}"),
        ev(Some("2"), Some("text_delta"), "{\"delta\":\"支付服务出现错误\"}"),
        comment("keep-alive"),
        ev(Some("3"), Some("text_delta"), "第一行\n第二行，没有空格\n\n 两个空格"),
        // the last event ID persists; no `event:` means the default type
        ev(Some("3"), None, "🚀 résumé"),
        comment(""),
        ev(Some("4"), Some("done"), "{\"messageId\":\"msg_1\"}"),
    ]
}

fn variants() -> Vec<(&'static str, String)> {
    vec![
        ("LF", SAMPLE.to_owned()),
        ("CRLF", SAMPLE.replace('\n', "\r\n")),
        ("CR", SAMPLE.replace('\n', "\r")),
        ("BOM+CRLF", format!("\u{FEFF}{}", SAMPLE.replace('\n', "\r\n"))),
        ("mixed", mixed_endings(SAMPLE)),
    ]
}

/// Cycles LF, CR, CRLF through the sample's line endings. (Never a CR followed by a blank line's
/// LF: that pair would be one CRLF.)
fn mixed_endings(s: &str) -> String {
    let endings = ["\n", "\r", "\r\n"];
    let mut out = String::new();
    for (i, line) in s.split_terminator('\n').enumerate() {
        out.push_str(line);
        out.push_str(endings[i % endings.len()]);
    }
    out
}

#[test]
fn whole_sample_parses_as_expected_with_every_line_ending() {
    for (name, input) in variants() {
        assert_eq!(whole(input.as_bytes()), sample_frames(), "{name}");
    }
}

#[test]
fn split_at_every_byte_into_two_chunks_matches_the_whole() {
    for (name, input) in variants() {
        let bytes = input.as_bytes();
        let expected = whole(bytes);
        for cut in 0..=bytes.len() {
            assert_eq!(chunked(bytes, &[cut]), expected, "{name}, cut at byte {cut}");
        }
    }
}

#[test]
fn split_at_every_pair_of_bytes_into_three_chunks_matches_the_whole() {
    // CRLF: a CR at the end of one chunk, the LF at the start of a later one, an empty chunk between.
    let input = SAMPLE.replace('\n', "\r\n");
    let bytes = input.as_bytes();
    let expected = whole(bytes);
    for a in 0..=bytes.len() {
        for b in (a..=bytes.len()).step_by(7) {
            assert_eq!(chunked(bytes, &[a, b]), expected, "cuts at {a} and {b}");
        }
    }
}

#[test]
fn one_byte_at_a_time_matches_the_whole() {
    for (name, input) in variants() {
        let bytes = input.as_bytes();
        let mut p = SseParser::new();
        let mut out = Vec::new();
        for b in bytes {
            out.extend(p.push(std::slice::from_ref(b)));
            out.extend(p.push(&[])); // empty chunks change nothing
        }
        assert_eq!(out, sample_frames(), "{name}");
        assert!(!p.finish());
    }
}

#[test]
fn several_events_in_one_chunk() {
    let mut p = SseParser::new();
    let frames = p.push(b"id: 1\ndata: a\n\nid: 2\ndata: b\n\n: keep-alive\nid: 3\ndata: c\n\nid: 4\ndata: d");
    assert_eq!(
        frames,
        vec![ev(Some("1"), None, "a"), ev(Some("2"), None, "b"), comment("keep-alive"), ev(Some("3"), None, "c")]
    );
    assert_eq!(p.push(b"\n\n"), vec![ev(Some("4"), None, "d")]);
}

#[test]
fn multibyte_utf8_split_across_chunks() {
    let text = "data: 支付服务出现错误\n\n";
    let bytes = text.as_bytes();
    // "支" is bytes 6..9: cut inside it, one and two bytes in
    for cut in [7, 8] {
        let mut p = SseParser::new();
        assert!(p.push(&bytes[..cut]).is_empty());
        assert_eq!(p.push(&bytes[cut..]), vec![ev(None, None, "支付服务出现错误")]);
    }
    // a four-byte character fed one byte per chunk
    let mut p = SseParser::new();
    let mut out = Vec::new();
    for b in "data: 🚀\n\n".as_bytes() {
        out.extend(p.push(&[*b]));
    }
    assert_eq!(out, vec![ev(None, None, "🚀")]);
}

#[test]
fn crlf_split_between_chunks_is_one_line_ending() {
    let mut p = SseParser::new();
    let mut out = p.push(b"data: a\r");
    // the LF completes the CRLF; it is not the blank line that dispatches
    out.extend(p.push(b"\n"));
    assert!(out.is_empty(), "no spurious event: {out:?}");
    out.extend(p.push(b"\r"));
    out.extend(p.push(b"\n"));
    out.extend(p.push(b"data: b\r"));
    out.extend(p.push(b"\n\r"));
    out.extend(p.push(b"\n"));
    assert_eq!(out, vec![ev(None, None, "a"), ev(None, None, "b")]);
    // an empty chunk between the CR and the LF changes nothing
    let mut p = SseParser::new();
    let mut out = p.push(b"data: c\r\n\r");
    out.extend(p.push(b""));
    out.extend(p.push(b"\ndata: d\r\n\r\n"));
    assert_eq!(out, vec![ev(None, None, "c"), ev(None, None, "d")]);
}

#[test]
fn lone_cr_then_cr_is_a_blank_line() {
    let mut p = SseParser::new();
    assert!(p.push(b"data: a\r").is_empty());
    assert_eq!(p.push(b"\r"), vec![ev(None, None, "a")]);
    // a CR at a chunk's end, then another field: the CR ended the line
    let mut p = SseParser::new();
    assert!(p.push(b"data: a\r").is_empty());
    assert_eq!(p.push(b"data: b\r\r"), vec![ev(None, None, "a\nb")]);
}

#[test]
fn optional_single_space_after_the_colon() {
    let mut p = SseParser::new();
    let frames = p.push(b"data:x\n\ndata: x\n\ndata:  x\n\ndata:\tx\n\nevent:  t\ndata: a:b: c\n\n");
    assert_eq!(
        frames,
        vec![
            ev(None, None, "x"),
            ev(None, None, "x"),
            ev(None, None, " x"),
            ev(None, None, "\tx"),
            ev(None, Some(" t"), "a:b: c"),
        ]
    );
}

#[test]
fn fields_without_a_colon_have_empty_values() {
    let mut p = SseParser::new();
    assert_eq!(p.push(b"data\n\n"), vec![ev(None, None, "")]);
    assert_eq!(p.push(b"data\ndata\n\n"), vec![ev(None, None, "\n")]);
    assert_eq!(p.push(b"id: 5\ndata: x\n\nid\ndata: y\n\n"), vec![ev(Some("5"), None, "x"), ev(None, None, "y")]);
    assert_eq!(p.push(b"event\ndata: z\n\n"), vec![ev(None, None, "z")]);
}

#[test]
fn bom_is_stripped_only_at_the_start() {
    let mut p = SseParser::new();
    assert_eq!(p.push("\u{FEFF}data: x\n\n".as_bytes()), vec![ev(None, None, "x")]);
    // later, the BOM is part of the field name, which is then unknown
    assert!(p.push("\u{FEFF}data: y\n\n".as_bytes()).is_empty());

    // split across chunks, byte by byte
    let mut p = SseParser::new();
    let mut out = Vec::new();
    for b in "\u{FEFF}data: x\n\n".as_bytes() {
        out.extend(p.push(&[*b]));
    }
    assert_eq!(out, vec![ev(None, None, "x")]);

    // a BOM then an immediate blank line
    let mut p = SseParser::new();
    assert_eq!(p.push("\u{FEFF}\ndata: x\n\n".as_bytes()), vec![ev(None, None, "x")]);

    // only one BOM is stripped
    let mut p = SseParser::new();
    assert!(p.push("\u{FEFF}\u{FEFF}data: x\n\n".as_bytes()).is_empty());
}

#[test]
fn unknown_fields_are_ignored() {
    let mut p = SseParser::new();
    let frames = p.push(b"foo: bar\nDATA: no\nData: no\ndata: yes\nevents: nope\n\n");
    assert_eq!(frames, vec![ev(None, None, "yes")]);
}

#[test]
fn id_with_nul_is_ignored_and_the_last_id_persists() {
    let mut p = SseParser::new();
    let frames = p.push(b"id: 1\ndata: a\n\nid: 2\0x\ndata: b\n\ndata: c\n\nid:\ndata: d\n\n");
    assert_eq!(
        frames,
        vec![ev(Some("1"), None, "a"), ev(Some("1"), None, "b"), ev(Some("1"), None, "c"), ev(None, None, "d")]
    );
    assert_eq!(p.last_event_id(), None);
    // an id-only block sets the last event ID without dispatching
    assert!(p.push(b"id: 7\n\n").is_empty());
    assert_eq!(p.last_event_id(), Some("7"));
    assert_eq!(p.push(b"data: e\n\n"), vec![ev(Some("7"), None, "e")]);
}

#[test]
fn retry_only_if_all_digits() {
    let mut p = SseParser::new();
    let frames = p.push(
        b"retry: 100\nretry:250\nretry: 1e3\nretry: -1\nretry: 10 \nretry: \nretry\nretry: +5\nretry:  5\n\
          retry: 99999999999999999999999\nretry: 0\nretry: 18446744073709551615\n",
    );
    assert_eq!(frames, vec![SseFrame::Retry(100), SseFrame::Retry(250), SseFrame::Retry(0), SseFrame::Retry(u64::MAX)]);
}

#[test]
fn event_type_resets_and_events_without_data_are_not_dispatched() {
    let mut p = SseParser::new();
    assert!(p.push(b"event: x\n\n").is_empty());
    assert_eq!(p.push(b"data: y\n\n"), vec![ev(None, None, "y")]);
    assert_eq!(p.push(b"event: a\nevent: b\ndata: z\n\n"), vec![ev(None, Some("b"), "z")]);
    assert!(p.push(b"\n\n\n").is_empty(), "blank lines alone dispatch nothing");
}

#[test]
fn keep_alive_comments_are_counted() {
    let mut p = SseParser::new();
    let mut input = String::new();
    for i in 0..10 {
        input.push_str(": keep-alive\r\n");
        if i % 3 == 0 {
            input.push_str(&format!("id: {i}\r\ndata: {i}\r\n\r\n"));
        }
    }
    let frames = p.push(input.as_bytes());
    let heartbeats = frames.iter().filter(|f| **f == comment("keep-alive")).count();
    assert_eq!(heartbeats, 10);
    assert_eq!(frames.iter().filter(|f| matches!(f, SseFrame::Event { .. })).count(), 4);
}

#[test]
fn invalid_utf8_is_replaced() {
    let mut p = SseParser::new();
    assert_eq!(p.push(b"data: a\xFFb\xE6\n\n"), vec![ev(None, None, "a\u{FFFD}b\u{FFFD}")]);
}

#[test]
fn finish_discards_an_unterminated_event() {
    let mut p = SseParser::new();
    assert_eq!(p.push(b"id: 1\ndata: complete\n\ndata: cut"), vec![ev(Some("1"), None, "complete")]);
    assert!(p.finish(), "a partial line was discarded");

    let mut p = SseParser::new();
    assert!(p.push(b"data: no blank line\n").is_empty());
    assert!(p.finish(), "an event without its blank line was discarded");
    // the parser is ready for a new stream, and does not dispatch the old event
    assert!(p.push(b"\n").is_empty());
    assert_eq!(p.push(b"data: next\n\n"), vec![ev(None, None, "next")]);

    let mut p = SseParser::new();
    p.push(b"id: 9\ndata: x\n\n: keep-alive\n");
    assert!(!p.finish(), "nothing pending");
    assert_eq!(p.last_event_id(), Some("9"), "the last event ID survives a reconnect");
    assert_eq!(
        p.push("\u{FEFF}data: y\n\n".as_bytes()),
        vec![ev(Some("9"), None, "y")],
        "a new stream may start with a BOM"
    );
}

#[test]
fn finish_after_a_trailing_cr_is_clean() {
    let mut p = SseParser::new();
    assert_eq!(p.push(b"data: x\r\r"), vec![ev(None, None, "x")]);
    assert!(!p.finish());
    // a new stream: its first LF is a (blank) line of its own, not the end of the old CRLF
    assert_eq!(p.push(b"\ndata: y\r\n\r\n"), vec![ev(None, None, "y")]);
}

#[test]
fn oversized_lines_are_dropped_with_their_event() {
    let mut p = SseParser::with_max_len(16);
    let long = format!("data: {}\n\n", "x".repeat(100));
    let input = format!(": hi\n{long}data: ok\n\nid: {}\ndata: after\n\n", "9".repeat(40));
    // whole, and split at every byte: the same frames, and the long lines are never buffered
    for cut in 0..=input.len() {
        let mut p = SseParser::with_max_len(16);
        let mut out = p.push(&input.as_bytes()[..cut]);
        out.extend(p.push(&input.as_bytes()[cut..]));
        assert_eq!(out, vec![comment("hi"), ev(None, None, "ok")], "cut at {cut}");
        assert_eq!(p.oversized_lines(), 2);
    }
    // a line of exactly the limit is fine
    assert_eq!(p.push(format!("data:{}\n\n", "y".repeat(11)).as_bytes()), vec![ev(None, None, &"y".repeat(11))]);
    assert_eq!(p.oversized_lines(), 0);
}

#[test]
fn oversized_event_data_is_dropped() {
    let mut p = SseParser::with_max_len(16);
    let frames = p.push(b"data: 12345\ndata: 12345\ndata: 12345\ndata: 12345\n\ndata: small\n\n");
    assert_eq!(frames, vec![ev(None, None, "small")]);
    assert_eq!(p.oversized_lines(), 1);
}

#[test]
fn default_limit_is_one_mebibyte() {
    let mut p = SseParser::new();
    assert_eq!(p.max_len(), 1024 * 1024);
    let big = "a".repeat(1024 * 1024 - 6);
    assert_eq!(p.push(format!("data: {big}\n\n").as_bytes()), vec![ev(None, None, &big)]);
    let chunk = vec![b'b'; 64 * 1024];
    for _ in 0..32 {
        assert!(p.push(&chunk).is_empty());
    }
    assert_eq!(p.push(b"\ndata: ok\n\n"), vec![]);
    assert_eq!(p.oversized_lines(), 1);
    assert_eq!(p.push(b"data: ok\n\n"), vec![ev(None, None, "ok")]);
}

fn cuts_strategy(len: usize) -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(0..=len, 0..12).prop_map(|mut cuts| {
        cuts.sort_unstable();
        cuts
    })
}

proptest! {
    #[test]
    fn random_chunking_matches_the_whole_feed(
        variant in 0usize..5,
        cuts in cuts_strategy(SAMPLE.len() * 2 + 3),
    ) {
        let (_, input) = variants().swap_remove(variant);
        let bytes = input.as_bytes();
        let cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(bytes.len())).collect();
        prop_assert_eq!(chunked(bytes, &cuts), whole(bytes));
    }

    #[test]
    fn random_events_round_trip_through_random_chunks(
        events in prop::collection::vec(
            (
                prop::option::of("[0-9a-z_]{1,8}"),
                prop::option::of("[a-z_]{1,12}"),
                prop::collection::vec("[^\r\n]{0,20}", 1..4),
            ),
            1..8,
        ),
        ending in prop::sample::select(vec!["\n", "\r\n", "\r"]),
        split in prop::collection::vec(1usize..40, 1..50),
    ) {
        let mut input = String::new();
        let mut expected = Vec::new();
        let mut last_id: Option<String> = None;
        for (id, event, lines) in &events {
            input.push_str(&format!(": keep-alive{ending}"));
            expected.push(comment("keep-alive"));
            if let Some(id) = id {
                input.push_str(&format!("id: {id}{ending}"));
                last_id = Some(id.clone());
            }
            if let Some(event) = event {
                input.push_str(&format!("event: {event}{ending}"));
            }
            for line in lines {
                // a value starting with a space needs the separator space to keep it
                input.push_str(&format!("data: {line}{ending}"));
            }
            input.push_str(ending);
            expected.push(SseFrame::Event { id: last_id.clone(), event: event.clone(), data: lines.join("\n") });
        }
        let bytes = input.as_bytes();
        let mut p = SseParser::new();
        let mut out = Vec::new();
        let mut pos = 0;
        for len in split.iter().cycle() {
            if pos >= bytes.len() {
                break;
            }
            let end = (pos + len).min(bytes.len());
            out.extend(p.push(&bytes[pos..end]));
            pos = end;
        }
        prop_assert_eq!(out, expected);
        prop_assert!(!p.finish());
    }
}
