//! Business events: what a client sees of a run.
//!
//! Envelope (JSON, camelCase): `{ "type", …fields, "runId", "sequence", "ts" }`. `sequence` is 1, 2,
//! 3 … within a run with no gaps; the store assigns it inside the transaction that writes the event.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::domain::{FactMap, InterruptKind, Timestamp};
use crate::ids::{CallId, InterruptId, MessageId, RunId};
use crate::mask::Masked;

/// How serde writes an event's JSON, and its kind's: the tag first (`{"type":"<name>"`, then the
/// fields). The stored data is the fields alone; the tag is cut off and put back at this text.
const TAG_START: &str = "{\"type\":\"";

/// The form of an event's stored data ([`EventKind::to_data_text`]): one more whenever the JSON
/// any event type is written as changes (a field added, renamed or removed; a test fingerprints
/// them). A store keeps it with each event it writes as text, and attaches the stored text to an
/// event it reads back ([`Event::with_data_text`]) only when it is this one: data written in
/// another form is serialized again from the kind, as this version writes it.
pub const DATA_FORMAT: i64 = 1;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct Event {
    #[serde(flatten)]
    pub kind: EventKind,
    pub run_id: RunId,
    pub sequence: i64,
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    #[serde(serialize_with = "crate::rfc3339::serialize")]
    pub ts: Timestamp,
    /// The kind's fields as JSON text, as the store wrote them ([`EventKind::to_data_text`]), when
    /// it has them: [`Event::write_json`] copies them instead of serializing the kind again. Not
    /// part of the event's value (equality ignores it).
    #[serde(skip)]
    data_text: Option<std::sync::Arc<str>>,
}

impl PartialEq for Event {
    fn eq(&self, other: &Self) -> bool {
        self.kind == other.kind && self.run_id == other.run_id && self.sequence == other.sequence && self.ts == other.ts
    }
}

impl Event {
    pub fn new(kind: EventKind, run_id: RunId, sequence: i64, ts: Timestamp) -> Self {
        Self { kind, run_id, sequence, ts, data_text: None }
    }

    /// The event with its kind's fields as the store wrote them: `data_text` must be
    /// [`EventKind::to_data_text`] of `kind` (a JSON object).
    pub fn with_data_text(mut self, data_text: std::sync::Arc<str>) -> Self {
        self.data_text = Some(data_text);
        self
    }

    pub fn type_name(&self) -> &'static str {
        self.kind.type_name()
    }

    /// The run is over after this event: nothing follows it.
    pub fn is_terminal(&self) -> bool {
        self.kind.is_terminal()
    }

    /// The run waits for a human after this event.
    pub fn is_pausing(&self) -> bool {
        matches!(self.kind, EventKind::Interrupt { .. })
    }

    /// Appends the event's JSON to `out`: the text its `Serialize` writes, but with the kind
    /// serialized as the struct it is and the envelope's fields appended, where the derived
    /// `Serialize` goes through serde's map path for the flattened kind (~4,500 instructions an
    /// event; every event of every stream is written so).
    pub fn write_json(&self, out: &mut Vec<u8>) -> Result<(), serde_json::Error> {
        match self.data_text.as_deref().and_then(|t| t.trim().strip_prefix('{')?.strip_suffix('}')) {
            // the stored fields, copied after the tag: the kind is not serialized again
            Some(fields) => {
                out.extend_from_slice(TAG_START.as_bytes());
                out.extend_from_slice(self.type_name().as_bytes());
                out.push(b'"');
                if !fields.trim().is_empty() {
                    out.push(b',');
                    out.extend_from_slice(fields.as_bytes());
                }
            }
            None => {
                serde_json::to_writer(&mut *out, &self.kind)?;
                // the kind is an object (`{"type":…,…}`): the envelope's fields go before its brace
                if out.last() != Some(&b'}') {
                    return Err(serde::ser::Error::custom("an event's kind is not a JSON object"));
                }
                out.pop();
            }
        }
        out.extend_from_slice(b",\"runId\":");
        serde_json::to_writer(&mut *out, &self.run_id)?;
        out.extend_from_slice(b",\"sequence\":");
        serde_json::to_writer(&mut *out, &self.sequence)?;
        out.extend_from_slice(b",\"ts\":\"");
        out.extend_from_slice(crate::rfc3339::format(&self.ts, crate::rfc3339::Fraction::Auto).as_str().as_bytes());
        out.extend_from_slice(b"\"}");
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum ToolOutcomeStatus {
    Success,
    Error,
    Denied,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct GraphNode {
    pub id: String,
    pub label: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct GraphEdge {
    pub from: String,
    pub to: String,
}

/// The fields of each event type (docs/events.md). `RunStarted::trace_id` is the run's W3C trace
/// id: its spans, and the log lines written inside them, carry it (`None` for older runs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
// `rename_all` on each variant rather than `rename_all_fields` on the enum: the same to serde, and
// the form utoipa reads, so the OpenAPI schema names the fields as the JSON does.
#[serde(tag = "type", rename_all = "snake_case")]
pub enum EventKind {
    #[serde(rename_all = "camelCase")]
    RunStarted { conversation_id: crate::ids::ConversationId, trace_id: Option<String> },
    /// The run's message waits behind the conversation's active run (`multitaskStrategy`
    /// `enqueue`): the first event of a run created `waiting`; `run_started` follows when its turn
    /// comes.
    #[serde(rename_all = "camelCase")]
    RunWaiting { conversation_id: crate::ids::ConversationId },
    #[serde(rename_all = "camelCase")]
    GraphTopology { nodes: Vec<GraphNode>, edges: Vec<GraphEdge> },
    #[serde(rename_all = "camelCase")]
    NodeStarted { node: String },
    #[serde(rename_all = "camelCase")]
    NodeFinished { node: String, duration_ms: u64 },
    #[serde(rename_all = "camelCase")]
    TextDelta { message_id: MessageId, delta: String },
    #[serde(rename_all = "camelCase")]
    ToolStarted {
        call_id: CallId,
        tool: String,
        #[cfg_attr(feature = "openapi", schema(value_type = String))]
        args_summary: Masked<String>,
    },
    #[serde(rename_all = "camelCase")]
    ToolFinished {
        call_id: CallId,
        tool: String,
        status: ToolOutcomeStatus,
        #[cfg_attr(feature = "openapi", schema(value_type = String))]
        summary: Masked<String>,
        /// Why a call failed, when it did: `timeout`, `unreachable`, `http_503`, `bad_response`,
        /// `too_large`, `invalid`, `precondition`, `marked_failed`, … (docs/tools.md).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error_code: Option<String>,
    },
    #[serde(rename_all = "camelCase")]
    FactsUpdated {
        #[cfg_attr(feature = "openapi", schema(inline))]
        facts: FactMap,
    },
    #[serde(rename_all = "camelCase")]
    Interrupt {
        interrupt_id: InterruptId,
        kind: InterruptKind,
        #[cfg_attr(feature = "openapi", schema(value_type = Object))]
        payload: Masked<Value>,
        #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
        expires_at: Timestamp,
    },
    #[serde(rename_all = "camelCase")]
    Resumed {
        interrupt_id: InterruptId,
        #[cfg_attr(feature = "openapi", schema(value_type = serde_json::Value))]
        decision: Masked<Value>,
        /// What the human wrote with the decision, if anything.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        #[cfg_attr(feature = "openapi", schema(value_type = Option<String>))]
        note: Option<Masked<String>>,
        human_wait_ms: u64,
        resolved_by: String,
    },
    #[serde(rename_all = "camelCase")]
    TextDiscarded { message_id: MessageId, reason: String },
    #[serde(rename_all = "camelCase")]
    Done { message_id: Option<MessageId> },
    #[serde(rename_all = "camelCase")]
    Error { code: String, message: String },
    #[serde(rename_all = "camelCase")]
    Cancelled { reason: String },
}

impl EventKind {
    pub const TYPES: &'static [&'static str] = &[
        "run_started",
        "run_waiting",
        "graph_topology",
        "node_started",
        "node_finished",
        "text_delta",
        "tool_started",
        "tool_finished",
        "facts_updated",
        "interrupt",
        "resumed",
        "text_discarded",
        "done",
        "error",
        "cancelled",
    ];

    pub fn type_name(&self) -> &'static str {
        match self {
            EventKind::RunStarted { .. } => "run_started",
            EventKind::RunWaiting { .. } => "run_waiting",
            EventKind::GraphTopology { .. } => "graph_topology",
            EventKind::NodeStarted { .. } => "node_started",
            EventKind::NodeFinished { .. } => "node_finished",
            EventKind::TextDelta { .. } => "text_delta",
            EventKind::ToolStarted { .. } => "tool_started",
            EventKind::ToolFinished { .. } => "tool_finished",
            EventKind::FactsUpdated { .. } => "facts_updated",
            EventKind::Interrupt { .. } => "interrupt",
            EventKind::Resumed { .. } => "resumed",
            EventKind::TextDiscarded { .. } => "text_discarded",
            EventKind::Done { .. } => "done",
            EventKind::Error { .. } => "error",
            EventKind::Cancelled { .. } => "cancelled",
        }
    }

    pub fn is_terminal(&self) -> bool {
        matches!(self, EventKind::Done { .. } | EventKind::Error { .. } | EventKind::Cancelled { .. })
    }

    /// The fields without the `type` tag, as stored in `run_events.data`.
    pub fn to_data(&self) -> Value {
        let mut v = serde_json::to_value(self).unwrap_or(Value::Null);
        if let Some(obj) = v.as_object_mut() {
            obj.remove("type");
        }
        v
    }

    /// [`EventKind::to_data`] as JSON text, written straight from the event: serde writes the `type`
    /// tag first, and it is cut from the front, in place (no intermediate `Value`, no copy).
    pub fn to_data_text(&self) -> Result<String, serde_json::Error> {
        let mut text = serde_json::to_string(self)?;
        // `{"type":"<name>"` then `,` and the fields, or `}`
        let name = self.type_name();
        let tag = TAG_START.len() + name.len() + 1;
        let tagged = text.starts_with(TAG_START)
            && text.get(TAG_START.len()..tag - 1) == Some(name)
            && text.as_bytes().get(tag - 1) == Some(&b'"');
        match text.as_bytes().get(tag) {
            Some(b',') if tagged => {
                text.replace_range(1..=tag, "");
                Ok(text)
            }
            Some(b'}') if tagged => Ok("{}".to_owned()),
            _ => serde_json::to_string(&self.to_data()),
        }
    }

    /// Rebuilds an event from its stored type and data text (as [`EventKind::to_data_text`] wrote
    /// it): the tag is put back in front of the fields and the text parsed once, with no
    /// intermediate `Value`.
    pub fn from_data_text(type_name: &str, data: &str) -> Result<Self, serde_json::Error> {
        use serde::de::Error as _;
        if type_name.is_empty() || !type_name.bytes().all(|b| b.is_ascii_lowercase() || b == b'_') {
            return Err(serde_json::Error::custom(format_args!("unknown event type `{type_name}`")));
        }
        let fields = data
            .trim_start()
            .strip_prefix('{')
            .ok_or_else(|| serde_json::Error::custom("an event's data is not a JSON object"))?;
        let mut text = String::with_capacity(data.len() + type_name.len() + 12);
        text.push_str(TAG_START);
        text.push_str(type_name);
        text.push('"');
        if !fields.trim_start().starts_with('}') {
            text.push(',');
        }
        text.push_str(fields);
        serde_json::from_str(&text)
    }

    /// Rebuilds an event from its stored type and data.
    pub fn from_parts(type_name: &str, data: &Value) -> Result<Self, serde_json::Error> {
        let mut obj = data.as_object().cloned().unwrap_or_default();
        obj.insert("type".into(), Value::String(type_name.to_owned()));
        serde_json::from_value(Value::Object(obj))
    }
}

/// What a client renders from a run's events: the assistant text per message, in order, with
/// discarded messages removed. Used by tests and by anything that needs "the answer" from a replay.
pub fn render_text(events: &[Event]) -> Vec<(MessageId, String)> {
    let mut out: Vec<(MessageId, String)> = Vec::new();
    for e in events {
        match &e.kind {
            EventKind::TextDelta { message_id, delta } => match out.iter_mut().find(|(id, _)| id == message_id) {
                Some((_, text)) => text.push_str(delta),
                None => out.push((message_id.clone(), delta.clone())),
            },
            EventKind::TextDiscarded { message_id, .. } => out.retain(|(id, _)| id != message_id),
            _ => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Utc;

    #[test]
    fn envelope_is_camel_case_with_type_tag() {
        let e = Event::new(
            EventKind::ToolFinished {
                call_id: CallId::parse("call_1").unwrap(),
                tool: "get_order".into(),
                status: ToolOutcomeStatus::Success,
                summary: "ok".into(),
                error_code: None,
            },
            RunId::parse("run_1").unwrap(),
            3,
            Utc::now(),
        );
        let v = serde_json::to_value(&e).unwrap();
        assert_eq!(v["type"], "tool_finished");
        assert_eq!(v["callId"], "call_1");
        assert_eq!(v["runId"], "run_1");
        assert_eq!(v["sequence"], 3);
        assert_eq!(v["status"], "success");
        let back: Event = serde_json::from_value(v).unwrap();
        assert_eq!(back, e);
        let data = e.kind.to_data();
        assert!(data.get("type").is_none());
        assert_eq!(EventKind::from_parts("tool_finished", &data).unwrap(), e.kind);
    }

    /// One event of every type (two of some), with text that needs escaping.
    fn samples() -> Vec<EventKind> {
        let message_id = MessageId::parse("msg_1").unwrap();
        let odd = "quote \" backslash \\ newline \n tab \t nul-free \u{1} é 错 😀".to_owned();
        vec![
            EventKind::RunStarted {
                conversation_id: crate::ids::ConversationId::parse("conv_1").unwrap(),
                trace_id: Some("0af7651916cd43dd8448eb211c80319c".into()),
            },
            EventKind::RunStarted {
                conversation_id: crate::ids::ConversationId::parse("conv_1").unwrap(),
                trace_id: None,
            },
            EventKind::RunWaiting { conversation_id: crate::ids::ConversationId::parse("conv_2").unwrap() },
            EventKind::GraphTopology {
                nodes: vec![GraphNode { id: "model".into(), label: odd.clone() }],
                edges: vec![GraphEdge { from: "model".into(), to: "tools".into() }],
            },
            EventKind::NodeStarted { node: "model".into() },
            EventKind::NodeFinished { node: "tools".into(), duration_ms: u64::MAX },
            EventKind::TextDelta { message_id: message_id.clone(), delta: odd.clone() },
            EventKind::ToolStarted {
                call_id: CallId::parse("call_1").unwrap(),
                tool: "restart".into(),
                args_summary: odd.as_str().into(),
            },
            EventKind::ToolFinished {
                call_id: CallId::parse("call_1").unwrap(),
                tool: "restart".into(),
                status: ToolOutcomeStatus::Error,
                summary: "failed".into(),
                error_code: Some("timeout".into()),
            },
            EventKind::FactsUpdated { facts: [("a".to_owned(), odd.clone())].into_iter().collect() },
            EventKind::Interrupt {
                interrupt_id: InterruptId::parse("int_1").unwrap(),
                kind: InterruptKind::ConfirmAction,
                payload: serde_json::json!({"title": odd, "n": [1, 2.5, null, true]}).into(),
                expires_at: chrono::DateTime::from_timestamp(1_893_499_200, 123_000).unwrap(),
            },
            EventKind::Resumed {
                interrupt_id: InterruptId::parse("int_1").unwrap(),
                decision: serde_json::json!({"decision": "approve"}).into(),
                note: Some("ok".into()),
                human_wait_ms: 1_500,
                resolved_by: "alice".into(),
            },
            EventKind::TextDiscarded { message_id: message_id.clone(), reason: "cancelled".into() },
            EventKind::Done { message_id: Some(message_id) },
            EventKind::Done { message_id: None },
            EventKind::Error { code: "model".into(), message: odd.clone() },
            EventKind::Cancelled { reason: "user".into() },
        ]
    }

    #[test]
    fn written_json_is_the_serialized_json() {
        let kinds = samples();
        let listed: std::collections::BTreeSet<_> = kinds.iter().map(EventKind::type_name).collect();
        assert_eq!(listed.len(), EventKind::TYPES.len(), "a sample of every type");
        for (i, kind) in kinds.into_iter().enumerate() {
            for (sequence, nanos) in [(1, 0), (i as i64 * 1_000 + 7, 5_000_000), (i64::MAX, 123_456_789)] {
                let event = Event::new(
                    kind.clone(),
                    RunId::parse("run_1").unwrap(),
                    sequence,
                    chrono::DateTime::from_timestamp(1_893_499_200 + i as i64, nanos).unwrap(),
                );
                let mut written = Vec::new();
                event.write_json(&mut written).unwrap();
                let expected = serde_json::to_string(&event).unwrap();
                assert_eq!(String::from_utf8(written).unwrap(), expected);
                // from the stored fields, the same text
                let stored = event.clone().with_data_text(kind.to_data_text().unwrap().into());
                let mut written = Vec::new();
                stored.write_json(&mut written).unwrap();
                assert_eq!(
                    String::from_utf8(written).unwrap(),
                    expected,
                    "from the stored data of {}",
                    kind.type_name()
                );
                assert_eq!(stored, event, "the stored text is not part of the value");
            }
        }
    }

    /// The stored data of every sample, as this version writes it, fingerprinted. A change here is a
    /// change of [`DATA_FORMAT`]: data stored before it would be copied into frames as it was.
    #[test]
    fn the_data_format_names_the_json_the_events_are_stored_as() {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        for kind in samples() {
            h.update(kind.type_name());
            h.update(b"\n");
            h.update(kind.to_data_text().unwrap());
            h.update(b"\n");
        }
        let fingerprint: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(
            (DATA_FORMAT, fingerprint.as_str()),
            (1, "659651aabafa4306421bed6f8f1f7b3a1e332665869c47e8a35b0071c5f5dfa9"),
            "the JSON an event type is stored as changed: add one to DATA_FORMAT, and put the new \
             format and this fingerprint here"
        );
    }

    #[test]
    fn every_type_name_is_listed() {
        let k = EventKind::Cancelled { reason: "x".into() };
        assert!(EventKind::TYPES.contains(&k.type_name()));
        assert!(k.is_terminal());
    }
}
