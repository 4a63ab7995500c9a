//! AG-UI 1.0 as a view of a Keel run: the pure mapping from Keel's stored events to AG-UI events,
//! the messages and state snapshots, and the interrupts of a `RUN_FINISHED`.
//!
//! Nothing here executes anything: `routes::ag_ui` reads the same replay-then-live event source as
//! the native SSE stream and feeds each event through a [`Mapper`]. The table of docs/ag-ui.md is
//! this module's contract.
//!
//! AG-UI's rules that shape it: `type` in SCREAMING_SNAKE, camelCase fields, optional fields
//! omitted (never `null`), `timestamp` in integer milliseconds; every text message, tool call and
//! step opened in a run is closed before its `RUN_FINISHED`; a `RUN_FINISHED` that carries an
//! interrupt is preceded by a `STATE_SNAPSHOT` and a `MESSAGES_SNAPSHOT`.

pub mod input;

use std::collections::HashSet;

use keel_core::mask::mask_value;
use keel_core::{fact_map, CallId, Event, EventKind, Fact, InterruptKind, Message, Role, ToolCall};
use serde_json::{json, Map, Value};

/// The id of the AG-UI tool message that carries a call's result. Keel's tool messages hold the
/// result as the model sees it, which never leaves the server; AG-UI is shown the call's summary
/// under this id instead.
pub fn result_message_id(call_id: &str) -> String {
    format!("{call_id}-result")
}

/// The AG-UI state of a Keel conversation: its confirmed facts.
pub fn state(facts: &keel_core::FactMap) -> Value {
    json!({ "facts": facts })
}

/// What a `MESSAGES_SNAPSHOT` and a `STATE_SNAPSHOT` show, read from the store by the caller.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot {
    pub messages: Vec<Value>,
    pub state: Value,
}

impl Snapshot {
    /// The conversation as AG-UI messages: user and assistant text, each tool call as an assistant
    /// message whose id is the call id (what an AG-UI client builds from a `TOOL_CALL_START`
    /// without `parentMessageId`), each result as a tool message with the call's one-line summary.
    /// Calls still waiting (for a human, or running) come last, without a result.
    pub fn build(messages: &[Message], calls: &[ToolCall], facts: &[Fact]) -> Self {
        let mut out = Vec::new();
        let mut shown: HashSet<&CallId> = HashSet::new();
        for m in messages {
            match m.role {
                Role::User => out.push(json!({"id": m.id, "role": "user", "content": m.content})),
                Role::Assistant if !m.content.is_empty() => {
                    out.push(json!({"id": m.id, "role": "assistant", "content": m.content}))
                }
                Role::Assistant => {}
                Role::Tool => {
                    let Some(call_id) = &m.tool_call_id else { continue };
                    let call = calls.iter().find(|c| &c.id == call_id);
                    if shown.insert(call_id) {
                        if let Some(call) = call {
                            out.push(call_message(call));
                        }
                    }
                    let summary = call.and_then(|c| c.summary.clone()).unwrap_or_default();
                    out.push(json!({
                        "id": result_message_id(call_id.as_str()),
                        "role": "tool",
                        "content": summary,
                        "toolCallId": call_id,
                    }));
                }
            }
        }
        for call in calls {
            if !shown.contains(&call.id) {
                out.push(call_message(call));
            }
        }
        Self { messages: out, state: state(&fact_map(facts)) }
    }

    /// The tool call ids the snapshot's messages name.
    pub fn call_ids(&self) -> Vec<String> {
        self.messages
            .iter()
            .filter_map(|m| m.get("toolCalls").and_then(Value::as_array))
            .flatten()
            .filter_map(|c| c.get("id").and_then(Value::as_str).map(str::to_owned))
            .collect()
    }
}

fn call_message(call: &ToolCall) -> Value {
    json!({
        "id": call.id,
        "role": "assistant",
        "toolCalls": [{
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": args_json(&call.args)},
        }],
    })
}

/// A call's arguments as AG-UI carries them: a JSON string, masked.
fn args_json(args: &Value) -> String {
    serde_json::to_string(&mask_value(args)).unwrap_or_else(|_| "{}".to_owned())
}

/// What the mapper needs that only the store knows, looked up by the caller for the event at hand.
#[derive(Debug, Clone, Copy, Default)]
pub struct Lookup<'a> {
    /// For `tool_started` / `tool_finished`: the call's arguments.
    pub args: Option<&'a Value>,
    /// For `interrupt`, `done` and `cancelled`: the conversation as it is now.
    pub snapshot: Option<&'a Snapshot>,
}

/// Which events need a [`Lookup::snapshot`].
pub fn needs_snapshot(event: &Event) -> bool {
    matches!(event.kind, EventKind::Interrupt { .. } | EventKind::Done { .. } | EventKind::Cancelled { .. })
}

/// One AG-UI run (one HTTP response) over a Keel run's events. A resumed Keel run is a new AG-UI run
/// on the same thread.
#[derive(Debug)]
pub struct Mapper {
    thread_id: String,
    run_id: String,
    open_text: Option<String>,
    texts: HashSet<String>,
    open_steps: Vec<String>,
    /// Calls this run announced (`TOOL_CALL_START`…`END`) or found in its opening snapshot.
    calls: HashSet<String>,
    results: HashSet<String>,
    finished: bool,
}

impl Mapper {
    pub fn new(thread_id: impl Into<String>, run_id: impl Into<String>) -> Self {
        Self {
            thread_id: thread_id.into(),
            run_id: run_id.into(),
            open_text: None,
            texts: HashSet::new(),
            open_steps: Vec::new(),
            calls: HashSet::new(),
            results: HashSet::new(),
            finished: false,
        }
    }

    /// `RUN_STARTED`; `keel` (Keel's run and conversation ids) goes in its metadata.
    pub fn run_started(&self, timestamp_ms: i64, keel: Value) -> Value {
        json!({
            "type": "RUN_STARTED",
            "threadId": self.thread_id,
            "runId": self.run_id,
            "timestamp": timestamp_ms,
            "metadata": {"keel": keel},
        })
    }

    /// A `MESSAGES_SNAPSHOT` that opens a resumed run: the calls it names count as announced, so
    /// their results can follow without a second `TOOL_CALL_START`.
    pub fn opening_snapshot(&mut self, snapshot: &Snapshot, timestamp_ms: i64) -> Value {
        self.calls.extend(snapshot.call_ids());
        messages_snapshot(snapshot, timestamp_ms)
    }

    /// The run reached its `RUN_FINISHED` or `RUN_ERROR`.
    pub fn is_finished(&self) -> bool {
        self.finished
    }

    /// A `RUN_ERROR` for a stream that cannot go on (the store failed, the server is stopping),
    /// after closing whatever is open.
    pub fn fail(&mut self, code: &str, message: &str, timestamp_ms: i64) -> Vec<Value> {
        if self.finished {
            return Vec::new();
        }
        let mut out = Vec::new();
        self.close_all(&mut out, timestamp_ms);
        out.push(json!({"type": "RUN_ERROR", "message": message, "code": code, "timestamp": timestamp_ms}));
        self.finished = true;
        out
    }

    /// The AG-UI events for one Keel event, in order.
    pub fn map(&mut self, event: &Event, lookup: Lookup<'_>) -> Vec<Value> {
        let ts = event.ts.timestamp_millis();
        let mut out = Vec::new();
        if self.finished {
            return out;
        }
        match &event.kind {
            EventKind::RunStarted { .. }
            | EventKind::RunWaiting { .. }
            | EventKind::GraphTopology { .. }
            | EventKind::Resumed { .. } => {}
            EventKind::NodeStarted { node } => {
                self.close_text(&mut out, ts);
                self.open_steps.push(node.clone());
                out.push(json!({"type": "STEP_STARTED", "stepName": node, "timestamp": ts}));
            }
            EventKind::NodeFinished { node, .. } => {
                self.close_text(&mut out, ts);
                // A step opened in an earlier AG-UI run (the approval a resume ends) is not this
                // run's to finish.
                if let Some(at) = self.open_steps.iter().rposition(|s| s == node) {
                    self.open_steps.remove(at);
                    out.push(json!({"type": "STEP_FINISHED", "stepName": node, "timestamp": ts}));
                }
            }
            EventKind::TextDelta { message_id, delta } => {
                let id = message_id.as_str();
                if self.open_text.as_deref() != Some(id) {
                    self.close_text(&mut out, ts);
                    // A message closed once is not reopened (AG-UI ids are unique per run).
                    if delta.is_empty() || !self.texts.insert(id.to_owned()) {
                        return out;
                    }
                    out.push(
                        json!({"type": "TEXT_MESSAGE_START", "messageId": id, "role": "assistant", "timestamp": ts}),
                    );
                    self.open_text = Some(id.to_owned());
                }
                if !delta.is_empty() {
                    out.push(json!({"type": "TEXT_MESSAGE_CONTENT", "messageId": id, "delta": delta, "timestamp": ts}));
                }
            }
            EventKind::TextDiscarded { message_id, .. } => {
                // AG-UI has no "drop this text": the message is closed here, and the snapshot at
                // the run's end no longer holds it.
                if self.open_text.as_deref() == Some(message_id.as_str()) {
                    self.close_text(&mut out, ts);
                }
            }
            EventKind::ToolStarted { call_id, tool, .. } => {
                self.close_text(&mut out, ts);
                self.announce(&mut out, call_id.as_str(), tool, lookup.args, ts);
            }
            EventKind::ToolFinished { call_id, tool, summary, .. } => {
                self.close_text(&mut out, ts);
                self.announce(&mut out, call_id.as_str(), tool, lookup.args, ts);
                if self.results.insert(call_id.to_string()) {
                    out.push(json!({
                        "type": "TOOL_CALL_RESULT",
                        "messageId": result_message_id(call_id.as_str()),
                        "toolCallId": call_id,
                        "content": summary,
                        "role": "tool",
                        "timestamp": ts,
                    }));
                }
            }
            EventKind::FactsUpdated { facts } => {
                out.push(json!({"type": "STATE_SNAPSHOT", "snapshot": state(facts), "timestamp": ts}));
            }
            EventKind::Interrupt { kind: InterruptKind::ToolCall, payload, .. } => {
                // A frontend tool's call: announced, and the run ends as AG-UI has it — the client
                // runs the tool and sends its result as a `tool` message in the next input.
                self.close_text(&mut out, ts);
                for action in payload.get("actions").and_then(Value::as_array).into_iter().flatten() {
                    if let (Some(call_id), Some(tool)) =
                        (action.get("callId").and_then(Value::as_str), action.get("tool").and_then(Value::as_str))
                    {
                        self.announce(&mut out, call_id, tool, action.get("args"), ts);
                    }
                }
                self.close_all(&mut out, ts);
                self.snapshots(&mut out, lookup.snapshot, true, ts);
                out.push(self.run_finished(json!({"type": "success"}), ts));
            }
            EventKind::Interrupt { interrupt_id, payload, expires_at, .. } => {
                self.close_text(&mut out, ts);
                let actions = payload.get("actions").and_then(Value::as_array).cloned().unwrap_or_default();
                for action in &actions {
                    let (Some(call_id), Some(tool)) =
                        (action.get("callId").and_then(Value::as_str), action.get("tool").and_then(Value::as_str))
                    else {
                        continue;
                    };
                    self.announce(&mut out, call_id, tool, action.get("args"), ts);
                }
                self.close_all(&mut out, ts);
                self.snapshots(&mut out, lookup.snapshot, true, ts);
                let interrupts = interrupts(interrupt_id.as_str(), payload, &actions, &expires_at.to_rfc3339());
                out.push(self.run_finished(json!({"type": "interrupt", "interrupts": interrupts}), ts));
            }
            EventKind::Done { .. } => {
                self.close_all(&mut out, ts);
                self.snapshots(&mut out, lookup.snapshot, false, ts);
                out.push(self.run_finished(json!({"type": "success"}), ts));
            }
            EventKind::Cancelled { .. } => {
                self.close_all(&mut out, ts);
                self.snapshots(&mut out, lookup.snapshot, false, ts);
                out.push(self.run_finished(json!({"type": "cancelled"}), ts));
            }
            EventKind::Error { code, message } => {
                self.close_all(&mut out, ts);
                out.push(json!({"type": "RUN_ERROR", "message": message, "code": code, "timestamp": ts}));
                self.finished = true;
            }
        }
        out
    }

    fn run_finished(&mut self, outcome: Value, ts: i64) -> Value {
        self.finished = true;
        json!({
            "type": "RUN_FINISHED",
            "threadId": self.thread_id,
            "runId": self.run_id,
            "outcome": outcome,
            "timestamp": ts,
        })
    }

    fn snapshots(&self, out: &mut Vec<Value>, snapshot: Option<&Snapshot>, with_state: bool, ts: i64) {
        let Some(snapshot) = snapshot else { return };
        if with_state {
            out.push(json!({"type": "STATE_SNAPSHOT", "snapshot": snapshot.state, "timestamp": ts}));
        }
        out.push(messages_snapshot(snapshot, ts));
    }

    /// `TOOL_CALL_START`, `_ARGS`, `_END` for a call this run has not announced yet.
    fn announce(&mut self, out: &mut Vec<Value>, call_id: &str, tool: &str, args: Option<&Value>, ts: i64) {
        if !self.calls.insert(call_id.to_owned()) {
            return;
        }
        let args = args.map(args_json).unwrap_or_else(|| "{}".to_owned());
        out.push(json!({"type": "TOOL_CALL_START", "toolCallId": call_id, "toolCallName": tool, "timestamp": ts}));
        out.push(json!({"type": "TOOL_CALL_ARGS", "toolCallId": call_id, "delta": args, "timestamp": ts}));
        out.push(json!({"type": "TOOL_CALL_END", "toolCallId": call_id, "timestamp": ts}));
    }

    fn close_text(&mut self, out: &mut Vec<Value>, ts: i64) {
        if let Some(id) = self.open_text.take() {
            out.push(json!({"type": "TEXT_MESSAGE_END", "messageId": id, "timestamp": ts}));
        }
    }

    fn close_all(&mut self, out: &mut Vec<Value>, ts: i64) {
        self.close_text(out, ts);
        while let Some(step) = self.open_steps.pop() {
            out.push(json!({"type": "STEP_FINISHED", "stepName": step, "timestamp": ts}));
        }
    }
}

fn messages_snapshot(snapshot: &Snapshot, ts: i64) -> Value {
    json!({"type": "MESSAGES_SNAPSHOT", "messages": snapshot.messages, "timestamp": ts})
}

/// The AG-UI id of the interrupt for one action of a Keel interrupt: the Keel interrupt id when it
/// waits for one call, `int_…:call_…` when it waits for several (AG-UI interrupts name one call
/// each).
pub fn interrupt_id(interrupt_id: &str, call_id: &str, actions: usize) -> String {
    if actions <= 1 {
        interrupt_id.to_owned()
    } else {
        format!("{interrupt_id}:{call_id}")
    }
}

/// The answer an interrupt expects: approve or not, optionally with edited arguments.
pub fn response_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "approved": {"type": "boolean", "description": "true runs the action, false does not"},
            "args": {"type": "object", "description": "edited arguments to run the action with (approved only)"},
        },
        "required": ["approved"],
    })
}

fn interrupts(keel_id: &str, payload: &Value, actions: &[Value], expires_at: &str) -> Vec<Value> {
    let title = payload.get("title").and_then(Value::as_str);
    let mut out = Vec::new();
    for action in actions {
        let Some(call_id) = action.get("callId").and_then(Value::as_str) else { continue };
        let mut metadata = Map::new();
        metadata.insert("interruptId".into(), json!(keel_id));
        for key in ["tool", "args", "risk", "description"] {
            if let Some(v) = action.get(key) {
                metadata.insert(key.into(), v.clone());
            }
        }
        if let Some(unknown) = payload.get("outcomeUnknown") {
            metadata.insert("outcomeUnknown".into(), unknown.clone());
        }
        let mut interrupt = json!({
            "id": interrupt_id(keel_id, call_id, actions.len()),
            "reason": "tool_call",
            "toolCallId": call_id,
            "responseSchema": response_schema(),
            "expiresAt": expires_at,
            "metadata": {"keel": metadata},
        });
        if let Some(message) = action.get("title").and_then(Value::as_str).or(title) {
            interrupt["message"] = json!(message);
        }
        out.push(interrupt);
    }
    if out.is_empty() {
        // An interrupt that names no call (not raised by any shipped tool): one AG-UI interrupt.
        let mut interrupt = json!({
            "id": keel_id,
            "reason": "input_required",
            "responseSchema": response_schema(),
            "expiresAt": expires_at,
        });
        if let Some(message) = title {
            interrupt["message"] = json!(message);
        }
        out.push(interrupt);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::DateTime;
    use keel_core::{
        ConversationId, FactSource, InterruptId, InterruptKind, MessageId, RunId, ToolCallState, ToolOutcomeStatus,
    };

    fn ev(sequence: i64, kind: EventKind) -> Event {
        Event::new(
            kind,
            RunId::parse("run_1").unwrap(),
            sequence,
            DateTime::from_timestamp_millis(1_000 + sequence).unwrap(),
        )
    }

    fn msg(id: &str) -> MessageId {
        MessageId::parse(id).unwrap()
    }

    fn call(id: &str) -> CallId {
        CallId::parse(id).unwrap()
    }

    fn types(events: &[Value]) -> Vec<&str> {
        events.iter().map(|e| e["type"].as_str().unwrap()).collect()
    }

    fn interrupt_event(sequence: i64) -> Event {
        ev(
            sequence,
            EventKind::Interrupt {
                interrupt_id: InterruptId::parse("int_1").unwrap(),
                kind: InterruptKind::ConfirmAction,
                payload: json!({"title": "Close T-42?", "risk": "drops requests", "outcomeUnknown": false,
                    "actions": [{"callId": "call_r", "tool": "close_ticket", "args": {"ticketId": "T-42"},
                                 "title": "Close T-42?", "description": "Close it"}]})
                .into(),
                expires_at: DateTime::from_timestamp(2_000_000_000, 0).unwrap(),
            },
        )
    }

    #[test]
    fn text_deltas_open_stream_and_close_one_message() {
        let mut m = Mapper::new("t", "r");
        let mut out = Vec::new();
        out.extend(m.map(&ev(3, EventKind::NodeStarted { node: "model".into() }), Lookup::default()));
        for (i, d) in ["Hello", "", " there"].iter().enumerate() {
            let kind = EventKind::TextDelta { message_id: msg("msg_a"), delta: (*d).into() };
            out.extend(m.map(&ev(4 + i as i64, kind), Lookup::default()));
        }
        out.extend(m.map(&ev(7, EventKind::NodeFinished { node: "model".into(), duration_ms: 5 }), Lookup::default()));
        assert_eq!(
            types(&out),
            [
                "STEP_STARTED",
                "TEXT_MESSAGE_START",
                "TEXT_MESSAGE_CONTENT",
                "TEXT_MESSAGE_CONTENT",
                "TEXT_MESSAGE_END",
                "STEP_FINISHED"
            ]
        );
        assert_eq!(out[1]["messageId"], "msg_a");
        assert_eq!(out[1]["role"], "assistant");
        assert_eq!(out[3]["delta"], " there", "empty deltas are dropped");
        assert_eq!(out[0]["stepName"], "model");
        assert_eq!(out[0]["timestamp"], 1003, "integer milliseconds");
        assert!(out.iter().all(|e| e.as_object().unwrap().values().all(|v| !v.is_null())), "no nulls");
    }

    #[test]
    fn a_tool_call_is_announced_once_and_its_result_is_the_summary() {
        let mut m = Mapper::new("t", "r");
        let args = json!({"service": "payment-api", "apiToken": "sk-secret"});
        let started = ev(
            5,
            EventKind::ToolStarted {
                call_id: call("call_1"),
                tool: "get_recent_errors".into(),
                args_summary: "".into(),
            },
        );
        let finished = ev(
            6,
            EventKind::ToolFinished {
                call_id: call("call_1"),
                tool: "get_recent_errors".into(),
                status: ToolOutcomeStatus::Success,
                summary: "12 errors".into(),
                error_code: None,
            },
        );
        let mut out = m.map(&started, Lookup { args: Some(&args), snapshot: None });
        out.extend(m.map(&finished, Lookup { args: Some(&args), snapshot: None }));
        assert_eq!(types(&out), ["TOOL_CALL_START", "TOOL_CALL_ARGS", "TOOL_CALL_END", "TOOL_CALL_RESULT"]);
        assert_eq!(out[0]["toolCallName"], "get_recent_errors");
        let sent: Value = serde_json::from_str(out[1]["delta"].as_str().unwrap()).expect("args are JSON");
        assert_eq!(sent["service"], "payment-api");
        assert_ne!(sent["apiToken"], "sk-secret", "arguments are masked");
        assert_eq!(out[3]["toolCallId"], "call_1");
        assert_eq!(out[3]["content"], "12 errors");
        assert_eq!(out[3]["role"], "tool");
        assert_eq!(out[3]["messageId"], "call_1-result");
    }

    #[test]
    fn an_interrupt_closes_everything_then_snapshots_then_finishes_with_the_interrupt() {
        let mut m = Mapper::new("thread-9", "agui-run-1");
        let mut out = Vec::new();
        out.extend(m.map(&ev(3, EventKind::NodeStarted { node: "approval".into() }), Lookup::default()));
        let snapshot = Snapshot {
            messages: vec![json!({"id": "msg_u", "role": "user", "content": "hi"})],
            state: json!({"facts": {}}),
        };
        out.extend(m.map(&interrupt_event(4), Lookup { args: None, snapshot: Some(&snapshot) }));
        assert_eq!(
            types(&out),
            [
                "STEP_STARTED",
                "TOOL_CALL_START",
                "TOOL_CALL_ARGS",
                "TOOL_CALL_END",
                "STEP_FINISHED",
                "STATE_SNAPSHOT",
                "MESSAGES_SNAPSHOT",
                "RUN_FINISHED"
            ]
        );
        assert_eq!(out[1]["toolCallId"], "call_r");
        assert_eq!(out[2]["delta"], r#"{"ticketId":"T-42"}"#);
        let finished = out.last().unwrap();
        assert_eq!(finished["threadId"], "thread-9");
        assert_eq!(finished["runId"], "agui-run-1");
        assert_eq!(finished["outcome"]["type"], "interrupt");
        let interrupt = &finished["outcome"]["interrupts"][0];
        assert_eq!(interrupt["id"], "int_1");
        assert_eq!(interrupt["toolCallId"], "call_r");
        assert_eq!(interrupt["reason"], "tool_call");
        assert_eq!(interrupt["message"], "Close T-42?");
        assert_eq!(interrupt["expiresAt"], "2033-05-18T03:33:20+00:00");
        assert!(interrupt["responseSchema"].is_object());
        assert_eq!(interrupt["metadata"]["keel"]["tool"], "close_ticket");
        assert!(m.is_finished());
        assert!(
            m.map(&ev(5, EventKind::Done { message_id: None }), Lookup::default()).is_empty(),
            "nothing after the end"
        );
    }

    #[test]
    fn a_resumed_run_reports_the_result_of_the_call_its_snapshot_names_without_restarting_it() {
        let mut m = Mapper::new("t", "r2");
        let snapshot = Snapshot {
            messages: vec![
                json!({"id": "call_r", "role": "assistant", "toolCalls": [{"id": "call_r", "type": "function",
                "function": {"name": "close_ticket", "arguments": "{}"}}]}),
            ],
            state: json!({"facts": {}}),
        };
        let opening = m.opening_snapshot(&snapshot, 10);
        assert_eq!(opening["type"], "MESSAGES_SNAPSHOT");
        let mut out = Vec::new();
        out.extend(
            m.map(&ev(12, EventKind::NodeFinished { node: "approval".into(), duration_ms: 9 }), Lookup::default()),
        );
        out.extend(m.map(&ev(13, EventKind::NodeStarted { node: "tools".into() }), Lookup::default()));
        out.extend(m.map(
            &ev(
                14,
                EventKind::ToolStarted {
                    call_id: call("call_r"),
                    tool: "close_ticket".into(),
                    args_summary: "".into(),
                },
            ),
            Lookup::default(),
        ));
        out.extend(m.map(
            &ev(
                15,
                EventKind::ToolFinished {
                    call_id: call("call_r"),
                    tool: "close_ticket".into(),
                    status: ToolOutcomeStatus::Success,
                    summary: "closed T-42".into(),
                    error_code: None,
                },
            ),
            Lookup::default(),
        ));
        out.extend(m.map(&ev(16, EventKind::NodeFinished { node: "tools".into(), duration_ms: 1 }), Lookup::default()));
        let end = Snapshot::default();
        out.extend(m.map(&ev(17, EventKind::Done { message_id: None }), Lookup { args: None, snapshot: Some(&end) }));
        assert_eq!(
            types(&out),
            ["STEP_STARTED", "TOOL_CALL_RESULT", "STEP_FINISHED", "MESSAGES_SNAPSHOT", "RUN_FINISHED"],
            "the approval step of the earlier run is not finished here; the call is not started again"
        );
        assert_eq!(out[1]["toolCallId"], "call_r");
        assert_eq!(out.last().unwrap()["outcome"], json!({"type": "success"}));
    }

    #[test]
    fn errors_and_cancellations_end_the_run() {
        let mut m = Mapper::new("t", "r");
        m.map(&ev(3, EventKind::TextDelta { message_id: msg("msg_a"), delta: "x".into() }), Lookup::default());
        let out = m.map(
            &ev(4, EventKind::Error { code: "MODEL_ERROR".into(), message: "the model failed".into() }),
            Lookup::default(),
        );
        assert_eq!(types(&out), ["TEXT_MESSAGE_END", "RUN_ERROR"]);
        assert_eq!(out[1]["code"], "MODEL_ERROR");
        assert_eq!(out[1]["message"], "the model failed");

        let mut m = Mapper::new("t", "r");
        let out = m.map(&ev(3, EventKind::Cancelled { reason: "cancelled_by_user".into() }), Lookup::default());
        assert_eq!(out[0]["outcome"], json!({"type": "cancelled"}));
        assert!(m.fail("INTERNAL", "x", 0).is_empty(), "a finished run is not failed again");
    }

    #[test]
    fn a_discarded_message_is_closed_and_not_reopened() {
        let mut m = Mapper::new("t", "r");
        let mut out =
            m.map(&ev(3, EventKind::TextDelta { message_id: msg("msg_a"), delta: "cut".into() }), Lookup::default());
        out.extend(m.map(
            &ev(4, EventKind::TextDiscarded { message_id: msg("msg_a"), reason: "retry".into() }),
            Lookup::default(),
        ));
        out.extend(
            m.map(&ev(5, EventKind::TextDelta { message_id: msg("msg_a"), delta: "late".into() }), Lookup::default()),
        );
        out.extend(
            m.map(&ev(6, EventKind::TextDelta { message_id: msg("msg_b"), delta: "again".into() }), Lookup::default()),
        );
        assert_eq!(
            types(&out),
            [
                "TEXT_MESSAGE_START",
                "TEXT_MESSAGE_CONTENT",
                "TEXT_MESSAGE_END",
                "TEXT_MESSAGE_START",
                "TEXT_MESSAGE_CONTENT"
            ]
        );
        assert_eq!(out[3]["messageId"], "msg_b");
    }

    #[test]
    fn several_actions_become_one_interrupt_each() {
        let payload = json!({"title": "Two things", "actions": [
            {"callId": "call_a", "tool": "close_ticket", "args": {}},
            {"callId": "call_b", "tool": "close_ticket", "args": {}}]});
        let actions = payload["actions"].as_array().unwrap().clone();
        let out = interrupts("int_1", &payload, &actions, "2030-01-01T00:00:00Z");
        assert_eq!(out.len(), 2);
        assert_eq!(out[0]["id"], "int_1:call_a");
        assert_eq!(out[1]["id"], "int_1:call_b");
        assert_eq!(out[1]["message"], "Two things");
    }

    #[test]
    fn the_snapshot_pairs_calls_with_results_and_hides_full_results() {
        let conversation = ConversationId::parse("conv_1").unwrap();
        let run = RunId::parse("run_1").unwrap();
        let at = DateTime::from_timestamp(0, 0).unwrap();
        let message = |id: &str, role: Role, content: &str, call_id: Option<&str>| Message {
            id: msg(id),
            conversation_id: conversation.clone(),
            run_id: Some(run.clone()),
            role,
            content: content.into(),
            tool_call_id: call_id.map(call),
            created_at: at,
        };
        let tool_call = |id: &str, state: ToolCallState, summary: Option<&str>| ToolCall {
            id: call(id),
            run_id: run.clone(),
            name: "close_ticket".into(),
            args: json!({"ticketId": "T-42"}).into(),
            state,
            result: Some(json!({"secret": "full result"}).into()),
            summary: summary.map(Into::into),
            attempts: 0,
            started_at: None,
            finished_at: None,
        };
        let messages = [
            message("msg_u", Role::User, "Close it", None),
            message("msg_a", Role::Assistant, "Looking.", None),
            message("msg_t", Role::Tool, "{\"secret\": \"full result\"}", Some("call_1")),
            message("msg_e", Role::Assistant, "", None),
        ];
        let calls = [
            tool_call("call_1", ToolCallState::Succeeded, Some("found 1")),
            tool_call("call_2", ToolCallState::Asking, None),
        ];
        let facts = [Fact {
            key: "service".into(),
            value: "payment-api".into(),
            source: FactSource::ToolResult,
            updated_at: at,
        }];
        let snapshot = Snapshot::build(&messages, &calls, &facts);
        let ids: Vec<&str> = snapshot.messages.iter().map(|m| m["id"].as_str().unwrap()).collect();
        assert_eq!(ids, ["msg_u", "msg_a", "call_1", "call_1-result", "call_2"]);
        assert_eq!(snapshot.messages[3]["content"], "found 1");
        assert_eq!(snapshot.messages[3]["toolCallId"], "call_1");
        assert!(!serde_json::to_string(&snapshot.messages).unwrap().contains("full result"));
        assert_eq!(snapshot.messages[4]["toolCalls"][0]["function"]["arguments"], r#"{"ticketId":"T-42"}"#);
        assert_eq!(snapshot.call_ids(), ["call_1", "call_2"]);
        assert_eq!(snapshot.state, json!({"facts": {"service": "payment-api"}}));
    }
}
