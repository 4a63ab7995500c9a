//! AG-UI's `RunAgentInput`, as Keel reads it, and the translation of its `resume` entries into a
//! Keel decision.

use std::collections::BTreeMap;

use keel_core::{CallId, InterruptId};
use serde::Deserialize;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

/// The fields Keel reads; the rest (`state`, `tools`, `context`, `forwardedProps`, …) are accepted
/// and ignored (docs/ag-ui.md says why).
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct RunAgentInput {
    #[schema(min_length = 1, max_length = 200)]
    pub thread_id: String,
    #[schema(min_length = 1, max_length = 200)]
    pub run_id: String,
    pub messages: Vec<InputMessage>,
    #[serde(default)]
    #[schema(max_items = 64)]
    pub resume: Option<Vec<ResumeEntry>>,
    #[serde(default)]
    pub state: Option<Value>,
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    #[serde(default)]
    pub context: Option<Vec<Value>>,
    #[serde(default)]
    pub forwarded_props: Option<Value>,
}

#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct InputMessage {
    #[schema(min_length = 1, max_length = 200)]
    pub id: String,
    pub role: String,
    #[serde(default)]
    pub content: Option<Value>,
    /// A `tool` message's call: the answer to a client-side tool's call.
    #[serde(default)]
    pub tool_call_id: Option<String>,
    /// A `tool` message's error: the client could not run the call.
    #[serde(default)]
    pub error: Option<String>,
}

#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ResumeEntry {
    pub interrupt_id: String,
    pub status: ResumeStatus,
    #[serde(default)]
    pub payload: Option<Value>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ResumeStatus {
    Resolved,
    Cancelled,
}

/// The longest `threadId`, `runId` or message id accepted.
const MAX_ID: usize = 200;

impl RunAgentInput {
    /// Checks what serde can't; the message is a `VALIDATION_FAILED` one.
    pub fn validate(&self) -> Result<(), String> {
        for (name, value) in [("threadId", &self.thread_id), ("runId", &self.run_id)] {
            check_id(name, value)?;
        }
        for (i, m) in self.messages.iter().enumerate() {
            check_id(&format!("messages[{i}].id"), &m.id)?;
        }
        if let Some(resume) = &self.resume {
            if resume.len() > 64 {
                return Err("resume: at most 64 entries".into());
            }
        }
        Ok(())
    }

    /// The last `user` message, with its text.
    pub fn last_user_message(&self) -> Result<Option<(&str, String)>, String> {
        let Some((i, m)) = self.messages.iter().enumerate().rev().find(|(_, m)| m.role == "user") else {
            return Ok(None);
        };
        let text = user_text(m.content.as_ref()).ok_or_else(|| {
            format!("messages[{i}].content: must be a string or a list of text parts ({{type: \"text\", text}})")
        })?;
        Ok(Some((m.id.as_str(), text)))
    }
}

impl RunAgentInput {
    /// The `tool` messages the input ends with, newest first: what a client appends after running
    /// a frontend tool.
    pub fn trailing_tool_messages(&self) -> impl Iterator<Item = &InputMessage> {
        self.messages.iter().rev().take_while(|m| m.role == "tool")
    }
}

impl InputMessage {
    /// A `tool` message as a client-side call's result: its `error` if it has one, else its
    /// content — JSON when it parses as JSON (AG-UI carries results as strings), else the string.
    pub fn tool_outcome(&self) -> Result<(Option<Value>, Option<String>), String> {
        if let Some(error) = &self.error {
            return Ok((None, Some(error.clone())));
        }
        match &self.content {
            Some(Value::String(text)) => {
                Ok((Some(serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.clone()))), None))
            }
            _ => Err("a tool message's content: must be a string".into()),
        }
    }
}

/// The idempotency key of a `tool` message's answer: the same answer to the same call is the same
/// request, whichever input carries it.
pub fn tool_answer_key(call: &CallId, result: &Option<Value>, error: &Option<String>) -> String {
    let digest = Sha256::digest(json!({"result": result, "error": error}).to_string().as_bytes());
    let hex: String = digest.iter().take(12).map(|b| format!("{b:02x}")).collect();
    format!("ag-ui:{call}:{hex}")
}

/// A client's id is stored (thread and message bindings) and echoed (`RUN_STARTED`): one that looks
/// like a secret is refused, and the error does not repeat it.
fn check_id(name: &str, value: &str) -> Result<(), String> {
    if value.is_empty() || value.len() > MAX_ID {
        return Err(format!("{name}: must be 1 to {MAX_ID} characters"));
    }
    if keel_core::mask::looks_secret(value) {
        return Err(format!("{name}: looks like a secret (a key, token or password); use an opaque id"));
    }
    Ok(())
}

fn user_text(content: Option<&Value>) -> Option<String> {
    match content? {
        Value::String(s) => Some(s.clone()),
        Value::Array(parts) => {
            let mut text = Vec::new();
            for part in parts {
                match (part.get("type").and_then(Value::as_str), part.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => text.push(t),
                    _ => return None,
                }
            }
            Some(text.join("\n"))
        }
        _ => None,
    }
}

/// An AG-UI interrupt id split into the Keel interrupt and, for an interrupt over several calls,
/// the call (`int_…` or `int_…:call_…`).
pub fn parse_interrupt_id(id: &str) -> Option<(InterruptId, Option<CallId>)> {
    match id.split_once(':') {
        None => Some((InterruptId::parse(id).ok()?, None)),
        Some((interrupt, call)) => Some((InterruptId::parse(interrupt).ok()?, Some(CallId::parse(call).ok()?))),
    }
}

/// One call's answer.
#[derive(Debug, Clone, PartialEq)]
enum Answer {
    Approve,
    Reject,
    Edit(Value),
    /// `retry`, `mark_done` or `mark_failed`.
    Outcome(&'static str),
}

/// The note the answers carry (`payload.note`, a string): the first one given.
pub fn note(entries: &[(usize, &ResumeEntry, Option<CallId>)]) -> Result<Option<String>, String> {
    for (i, entry, _) in entries {
        match entry.payload.as_ref().and_then(|p| p.get("note")) {
            None | Some(Value::Null) => continue,
            Some(Value::String(note)) => return Ok(Some(note.clone())),
            Some(_) => return Err(format!("resume[{i}].payload.note: must be a string")),
        }
    }
    Ok(None)
}

/// The Keel decision for the `entries` answering an interrupt over `call_ids`: `"approve"`,
/// `"reject"`, `{"edit": …}`, `"retry"`, `"mark_done"`, `"mark_failed"` or `{"calls": …}`.
/// `cancelled` means "do not run it" (reject); `resolved` needs a payload
/// `{approved: bool, args?: object}` (a confirmation) or `{decision: "retry" | "mark_done" |
/// "mark_failed"}` (an unknown outcome), either with an optional `note`.
pub fn decision(entries: &[(usize, &ResumeEntry, Option<CallId>)], call_ids: &[CallId]) -> Result<Value, String> {
    let mut answers: BTreeMap<CallId, Answer> = BTreeMap::new();
    for (i, entry, call) in entries {
        let answer = match entry.status {
            ResumeStatus::Cancelled => Answer::Reject,
            ResumeStatus::Resolved if entry.payload.as_ref().is_some_and(|p| p.get("decision").is_some()) => {
                match entry.payload.as_ref().and_then(|p| p["decision"].as_str()) {
                    Some("retry") => Answer::Outcome("retry"),
                    Some("mark_done") => Answer::Outcome("mark_done"),
                    Some("mark_failed") => Answer::Outcome("mark_failed"),
                    _ => {
                        return Err(format!(
                            "resume[{i}].payload.decision: must be \"retry\", \"mark_done\" or \"mark_failed\""
                        ))
                    }
                }
            }
            ResumeStatus::Resolved => {
                let payload = entry.payload.as_ref();
                let approved = payload.and_then(|p| p.get("approved")).and_then(Value::as_bool).ok_or_else(|| {
                    format!("resume[{i}].payload: must be {{\"approved\": true | false, \"args\"?: {{…}}}}")
                })?;
                match (approved, payload.and_then(|p| p.get("args"))) {
                    (false, _) => Answer::Reject,
                    (true, None) => Answer::Approve,
                    (true, Some(args)) if args.is_object() => Answer::Edit(args.clone()),
                    (true, Some(_)) => return Err(format!("resume[{i}].payload.args: must be an object")),
                }
            }
        };
        let targets: Vec<&CallId> = match call {
            Some(c) if call_ids.contains(c) => vec![c],
            Some(_) => return Err(format!("resume[{i}].interruptId: names a call the interrupt does not wait for")),
            None => call_ids.iter().collect(),
        };
        for c in targets {
            answers.insert(c.clone(), answer.clone());
        }
    }
    if let Some(missing) = call_ids.iter().find(|c| !answers.contains_key(*c)) {
        return Err(format!("resume: no answer for the interrupt of {missing}"));
    }
    let all = |a: &Answer| answers.values().all(|x| x == a);
    if call_ids.is_empty() || all(&Answer::Approve) {
        return Ok(json!("approve"));
    }
    if all(&Answer::Reject) {
        return Ok(json!("reject"));
    }
    if let Some(Answer::Outcome(first)) = answers.values().next() {
        if all(&Answer::Outcome(first)) {
            return Ok(json!(first));
        }
    }
    if answers.values().all(|a| matches!(a, Answer::Edit(_) | Answer::Approve)) {
        let edits: serde_json::Map<String, Value> = answers
            .iter()
            .filter_map(|(c, a)| match a {
                Answer::Edit(args) => Some((c.to_string(), args.clone())),
                _ => None,
            })
            .collect();
        if edits.len() == answers.len() {
            return Ok(json!({ "edit": edits }));
        }
    }
    let calls: serde_json::Map<String, Value> = answers
        .into_iter()
        .map(|(c, a)| {
            let v = match a {
                Answer::Approve => json!("approve"),
                Answer::Reject => json!("reject"),
                Answer::Edit(args) => json!({ "edit": args }),
                Answer::Outcome(decision) => json!(decision),
            };
            (c.to_string(), v)
        })
        .collect();
    Ok(json!({ "calls": calls }))
}

/// The idempotency key of an AG-UI resume: the same answer to the same interrupt is the same
/// request (a replayed resume gets the first answer, nothing runs twice); another answer is another
/// request, refused as `INTERRUPT_ALREADY_RESOLVED` once the first won.
pub fn idempotency_key(interrupt: &InterruptId, decision: &Value) -> String {
    let digest = Sha256::digest(decision.to_string().as_bytes());
    let hex: String = digest.iter().take(12).map(|b| format!("{b:02x}")).collect();
    format!("ag-ui:{interrupt}:{hex}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(status: ResumeStatus, payload: Option<Value>) -> ResumeEntry {
        ResumeEntry { interrupt_id: "int_1".into(), status, payload }
    }

    fn calls(ids: &[&str]) -> Vec<CallId> {
        ids.iter().map(|c| CallId::parse(c).unwrap()).collect()
    }

    #[test]
    fn unknown_outcomes_are_answered_by_decision_with_a_note() {
        let one = calls(&["call_a"]);
        for d in ["retry", "mark_done", "mark_failed"] {
            let e = entry(ResumeStatus::Resolved, Some(json!({"decision": d, "note": "checked"})));
            assert_eq!(decision(&[(0, &e, None)], &one).unwrap(), json!(d));
            assert_eq!(note(&[(0, &e, None)]).unwrap().as_deref(), Some("checked"));
        }
        let two = calls(&["call_a", "call_b"]);
        let (a, b) = (Some(CallId::parse("call_a").unwrap()), Some(CallId::parse("call_b").unwrap()));
        let done = entry(ResumeStatus::Resolved, Some(json!({"decision": "mark_done"})));
        let retry = entry(ResumeStatus::Resolved, Some(json!({"decision": "retry"})));
        assert_eq!(
            decision(&[(0, &done, a), (1, &retry, b)], &two).unwrap(),
            json!({"calls": {"call_a": "mark_done", "call_b": "retry"}})
        );
        assert_eq!(note(&[(0, &done, None)]).unwrap(), None);
        let bad = entry(ResumeStatus::Resolved, Some(json!({"decision": "maybe"})));
        assert!(decision(&[(0, &bad, None)], &one).unwrap_err().contains("payload.decision"));
        let bad_note = entry(ResumeStatus::Resolved, Some(json!({"decision": "retry", "note": 5})));
        assert!(note(&[(0, &bad_note, None)]).unwrap_err().contains("payload.note"));
    }

    #[test]
    fn answers_become_keel_decisions() {
        let one = calls(&["call_a"]);
        let approve = entry(ResumeStatus::Resolved, Some(json!({"approved": true})));
        assert_eq!(decision(&[(0, &approve, None)], &one).unwrap(), json!("approve"));
        let no = entry(ResumeStatus::Resolved, Some(json!({"approved": false})));
        assert_eq!(decision(&[(0, &no, None)], &one).unwrap(), json!("reject"));
        let cancelled = entry(ResumeStatus::Cancelled, None);
        assert_eq!(decision(&[(0, &cancelled, None)], &one).unwrap(), json!("reject"));
        let edit = entry(ResumeStatus::Resolved, Some(json!({"approved": true, "args": {"ticketId": "x"}})));
        assert_eq!(decision(&[(0, &edit, None)], &one).unwrap(), json!({"edit": {"call_a": {"ticketId": "x"}}}));

        let two = calls(&["call_a", "call_b"]);
        let a = Some(CallId::parse("call_a").unwrap());
        let b = Some(CallId::parse("call_b").unwrap());
        let d = decision(&[(0, &approve, a.clone()), (1, &no, b.clone())], &two).unwrap();
        assert_eq!(d, json!({"calls": {"call_a": "approve", "call_b": "reject"}}));
        assert!(decision(&[(0, &approve, a)], &two).unwrap_err().contains("no answer"), "every call needs one");
    }

    #[test]
    fn bad_answers_are_refused() {
        let one = calls(&["call_a"]);
        for payload in [None, Some(json!({})), Some(json!({"approved": "yes"})), Some(json!("approve"))] {
            let e = entry(ResumeStatus::Resolved, payload.clone());
            assert!(decision(&[(0, &e, None)], &one).is_err(), "{payload:?}");
        }
        let e = entry(ResumeStatus::Resolved, Some(json!({"approved": true, "args": [1]})));
        assert!(decision(&[(0, &e, None)], &one).is_err());
        let e = entry(ResumeStatus::Resolved, Some(json!({"approved": true})));
        let other = Some(CallId::parse("call_z").unwrap());
        assert!(decision(&[(0, &e, other)], &one).is_err());
    }

    #[test]
    fn interrupt_ids_name_an_interrupt_and_maybe_a_call() {
        let (i, c) = parse_interrupt_id("int_1").unwrap();
        assert_eq!((i.as_str(), c), ("int_1", None));
        let (i, c) = parse_interrupt_id("int_1:call_2").unwrap();
        assert_eq!((i.as_str(), c.unwrap().as_str()), ("int_1", "call_2"));
        for bad in ["", "x", "int_", "int_1:", "int_1:x", "call_1"] {
            assert!(parse_interrupt_id(bad).is_none(), "{bad:?}");
        }
    }

    #[test]
    fn the_same_answer_is_the_same_key() {
        let i = InterruptId::parse("int_1").unwrap();
        assert_eq!(idempotency_key(&i, &json!("approve")), idempotency_key(&i, &json!("approve")));
        assert_ne!(idempotency_key(&i, &json!("approve")), idempotency_key(&i, &json!("reject")));
        assert!(idempotency_key(&i, &json!("approve")).len() <= 200);
    }

    #[test]
    fn user_text_is_a_string_or_text_parts() {
        let input: RunAgentInput = serde_json::from_value(json!({
            "threadId": "t", "runId": "r", "state": {}, "tools": [], "context": [], "forwardedProps": {},
            "messages": [
                {"id": "1", "role": "user", "content": "first"},
                {"id": "2", "role": "assistant", "content": "ok"},
                {"id": "3", "role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            ]
        }))
        .unwrap();
        input.validate().unwrap();
        assert_eq!(input.last_user_message().unwrap(), Some(("3", "a\nb".to_owned())));
        let bad: RunAgentInput = serde_json::from_value(json!({
            "threadId": "t", "runId": "r", "messages": [{"id": "1", "role": "user", "content": [{"type": "image"}]}]
        }))
        .unwrap();
        assert!(bad.last_user_message().is_err());
        let empty: RunAgentInput =
            serde_json::from_value(json!({"threadId": "", "runId": "r", "messages": []})).unwrap();
        assert!(empty.validate().is_err());
    }
}
