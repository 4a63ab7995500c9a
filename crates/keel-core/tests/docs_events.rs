//! docs/events.md can't drift: every example parses as the event it shows, round-trips, and every
//! event type has an example.

use std::collections::BTreeSet;

use keel_core::{Event, EventKind};

fn json_blocks(markdown: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut current: Option<String> = None;
    for line in markdown.lines() {
        match (&mut current, line.trim_start()) {
            (None, l) if l.starts_with("```json") => current = Some(String::new()),
            (Some(_), l) if l.starts_with("```") => blocks.push(current.take().unwrap_or_default()),
            (Some(buf), _) => {
                buf.push_str(line);
                buf.push('\n');
            }
            (None, _) => {}
        }
    }
    blocks
}

#[test]
fn every_event_example_parses_and_every_type_has_one() {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/events.md")).unwrap();
    let mut seen = BTreeSet::new();
    for block in json_blocks(&doc) {
        let raw: serde_json::Value = serde_json::from_str(&block).unwrap_or_else(|e| panic!("{e}: {block}"));
        let event: Event = serde_json::from_value(raw.clone()).unwrap_or_else(|e| panic!("{e}: {block}"));
        // Nothing in the example is unknown to the type (it round-trips to the same JSON).
        assert_eq!(serde_json::to_value(&event).unwrap(), raw, "example of {} round-trips", event.type_name());
        // The stored form, written as text straight from the event, is the data without the tag.
        let text = event.kind.to_data_text().expect("data text");
        let data: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert_eq!(data, event.kind.to_data(), "stored data of {}", event.type_name());
        assert_eq!(EventKind::from_parts(event.type_name(), &data).unwrap(), event.kind);
        assert_eq!(EventKind::from_data_text(event.type_name(), &text).unwrap(), event.kind);
        seen.insert(event.type_name());
    }
    let all: BTreeSet<&str> = EventKind::TYPES.iter().copied().collect();
    assert_eq!(seen, all, "every event type has an example in docs/events.md");
}
