//! A human's decision: the API's shapes as a typed enum, and its translation into one decision per
//! call of the interrupt it answers.

use super::*;

/// What a human decided, as the API takes it (`POST /v1/runs/{id}/resume`'s `decision`):
/// `"approve"`, `"reject"`, `{"edit": {callId: args}}` (approve, with these arguments for these
/// calls) or `{"calls": {callId: decision}}` for a `confirm_action` interrupt; `"retry"`,
/// `"mark_done"`, `"mark_failed"` or `{"calls": …}` for an `outcome_unknown` one; `{"select": …}`
/// and `{"provide": …}` for the kinds that take them.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    Approve,
    Reject,
    Retry,
    MarkDone,
    MarkFailed,
    /// Call id (as sent) → the arguments to run it with.
    Edit(BTreeMap<String, Value>),
    /// Call id (as sent) → that call's decision.
    Calls(BTreeMap<String, CallDecision>),
    Select(Value),
    Provide(Value),
}

/// What a human decided for one call.
#[derive(Debug, Clone, PartialEq)]
pub enum CallDecision {
    Approve,
    Reject,
    Edit(Value),
    /// Run it again with the same idempotency key (its outcome was unknown).
    Retry,
    /// It was done: the call succeeded (the human says so).
    MarkDone,
    /// It did not happen, or failed: the call failed (the human says so).
    MarkFailed,
}

impl CallDecision {
    fn parse(value: &Value) -> Result<Self, String> {
        match value {
            Value::String(s) => match s.as_str() {
                "approve" => Ok(CallDecision::Approve),
                "reject" => Ok(CallDecision::Reject),
                "retry" => Ok(CallDecision::Retry),
                "mark_done" => Ok(CallDecision::MarkDone),
                "mark_failed" => Ok(CallDecision::MarkFailed),
                _ => Err(Self::EXPECTED.into()),
            },
            Value::Object(o) if o.len() == 1 && o.contains_key("edit") => Ok(CallDecision::Edit(o["edit"].clone())),
            _ => Err(Self::EXPECTED.into()),
        }
    }

    const EXPECTED: &'static str =
        "a call's decision must be \"approve\", \"reject\", {\"edit\": {…args}}, \"retry\", \
                                    \"mark_done\" or \"mark_failed\"";

    fn to_value(&self) -> Value {
        match self {
            CallDecision::Approve => json!("approve"),
            CallDecision::Reject => json!("reject"),
            CallDecision::Retry => json!("retry"),
            CallDecision::MarkDone => json!("mark_done"),
            CallDecision::MarkFailed => json!("mark_failed"),
            CallDecision::Edit(args) => json!({"edit": args}),
        }
    }
}

impl Decision {
    /// Reads the API's JSON shape. The error names the rule, never the value (it may hold
    /// anything a client pasted).
    pub fn parse(value: &Value) -> Result<Self, String> {
        const EXPECTED: &str = "expected \"approve\", \"reject\", \"retry\", \"mark_done\", \"mark_failed\", \
                                {\"edit\": …}, {\"calls\": …}, {\"select\": …} or {\"provide\": …}";
        match value {
            Value::String(s) => match s.as_str() {
                "approve" => Ok(Decision::Approve),
                "reject" => Ok(Decision::Reject),
                "retry" => Ok(Decision::Retry),
                "mark_done" => Ok(Decision::MarkDone),
                "mark_failed" => Ok(Decision::MarkFailed),
                _ => Err(format!("decision: {EXPECTED}")),
            },
            Value::Object(o) if o.len() == 1 => {
                let (key, inner) = o.iter().next().expect("one entry");
                match key.as_str() {
                    "edit" => {
                        let Some(edits) = inner.as_object() else {
                            return Err("decision.edit: must map call ids to arguments".into());
                        };
                        Ok(Decision::Edit(edits.iter().map(|(k, v)| (k.clone(), v.clone())).collect()))
                    }
                    "calls" => {
                        let Some(per_call) = inner.as_object() else {
                            return Err("decision.calls: must map call ids to decisions".into());
                        };
                        let mut out = BTreeMap::new();
                        for (i, (k, v)) in per_call.iter().enumerate() {
                            let d = CallDecision::parse(v).map_err(|e| format!("decision.calls (entry {i}): {e}"))?;
                            out.insert(k.clone(), d);
                        }
                        Ok(Decision::Calls(out))
                    }
                    "select" => Ok(Decision::Select(inner.clone())),
                    "provide" => Ok(Decision::Provide(inner.clone())),
                    _ => Err(format!("decision: {EXPECTED}")),
                }
            }
            _ => Err(format!("decision: {EXPECTED}")),
        }
    }

    /// The API's JSON shape (what is stored, masked, with the interrupt and on `resumed`).
    pub fn to_value(&self) -> Value {
        match self {
            Decision::Approve => json!("approve"),
            Decision::Reject => json!("reject"),
            Decision::Retry => json!("retry"),
            Decision::MarkDone => json!("mark_done"),
            Decision::MarkFailed => json!("mark_failed"),
            Decision::Edit(edits) => json!({"edit": edits}),
            Decision::Calls(calls) => {
                json!({"calls": calls.iter().map(|(k, d)| (k.clone(), d.to_value())).collect::<serde_json::Map<_, _>>()})
            }
            Decision::Select(v) => json!({"select": v}),
            Decision::Provide(v) => json!({"provide": v}),
        }
    }
}

impl Serialize for Decision {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.to_value().serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Decision {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let value = Value::deserialize(deserializer)?;
        Decision::parse(&value).map_err(serde::de::Error::custom)
    }
}

/// The decisions an interrupt of `kind` takes, for error messages.
fn expected_for(kind: InterruptKind) -> &'static str {
    match kind {
        InterruptKind::ConfirmAction => "\"approve\", \"reject\", {\"edit\": …} or {\"calls\": …}",
        InterruptKind::OutcomeUnknown => "\"retry\", \"mark_done\", \"mark_failed\" or {\"calls\": …}",
        InterruptKind::ToolCall => {
            "none: the client answers a tool_call interrupt with POST /v1/runs/{id}/tool-results"
        }
        _ => "no decision this server's tools support",
    }
}

/// Whether a per-call decision fits an interrupt of `kind`.
fn fits(kind: InterruptKind, decision: &CallDecision) -> bool {
    match kind {
        InterruptKind::ConfirmAction => {
            matches!(decision, CallDecision::Approve | CallDecision::Reject | CallDecision::Edit(_))
        }
        InterruptKind::OutcomeUnknown => {
            matches!(decision, CallDecision::Retry | CallDecision::MarkDone | CallDecision::MarkFailed)
        }
        _ => false,
    }
}

/// One decision per call of the interrupt, edits checked against the tool's schema (masked first:
/// what is checked is what would be stored).
pub(super) fn per_call(
    interrupt: &Interrupt,
    decision: &Decision,
    calls: &[ToolCall],
    tools: &ToolRegistry,
) -> EngineResult<BTreeMap<CallId, CallDecision>> {
    let kind = interrupt.kind;
    let all = |d: CallDecision| -> BTreeMap<CallId, CallDecision> {
        interrupt.call_ids.iter().map(|id| (id.clone(), d.clone())).collect()
    };
    // The key is the client's: it is checked, never repeated in the error.
    let check_id = |field: &str, raw: &str| -> EngineResult<CallId> {
        CallId::parse(raw)
            .ok()
            .filter(|id| interrupt.call_ids.contains(id))
            .ok_or_else(|| EngineError::InvalidDecision(format!("{field}: a key is not a call of this interrupt")))
    };
    let unfit = || {
        EngineError::InvalidDecision(format!(
            "not a valid decision for a {kind} interrupt; expected {}",
            expected_for(kind)
        ))
    };
    let mut out = match decision {
        Decision::Approve => all(CallDecision::Approve),
        Decision::Reject => all(CallDecision::Reject),
        Decision::Retry => all(CallDecision::Retry),
        Decision::MarkDone => all(CallDecision::MarkDone),
        Decision::MarkFailed => all(CallDecision::MarkFailed),
        Decision::Edit(edits) => {
            let mut out = all(CallDecision::Approve);
            for (raw, args) in edits {
                out.insert(check_id("decision.edit", raw)?, CallDecision::Edit(args.clone()));
            }
            out
        }
        Decision::Calls(per_call) => {
            let mut out = BTreeMap::new();
            for (raw, d) in per_call {
                out.insert(check_id("decision.calls", raw)?, d.clone());
            }
            if let Some(missing) = interrupt.call_ids.iter().find(|id| !out.contains_key(*id)) {
                return Err(EngineError::InvalidDecision(format!("decision.calls: no decision for {missing}")));
            }
            out
        }
        Decision::Select(_) | Decision::Provide(_) => {
            return Err(EngineError::InvalidDecision(format!(
                "select and provide decisions are not supported by this run's tools; expected {}",
                expected_for(kind)
            )))
        }
    };
    if out.values().any(|d| !fits(kind, d)) {
        return Err(unfit());
    }
    for (call_id, d) in out.iter_mut() {
        if let CallDecision::Edit(args) = d {
            let call = calls.iter().find(|c| &c.id == call_id).ok_or(EngineError::NotFound("tool call"))?;
            *args = mask_value(args);
            tools
                .validate_args(&call.name, args)
                .ok_or_else(|| EngineError::InvalidArgs(format!("unknown tool {}", call.name)))?
                .map_err(|e| EngineError::InvalidArgs(format!("edited arguments of {call_id}: {e}")))?;
            if *args == *call.args {
                *d = CallDecision::Approve;
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_round_trip() {
        for raw in [
            json!("approve"),
            json!("reject"),
            json!("retry"),
            json!("mark_done"),
            json!("mark_failed"),
            json!({"edit": {"call_1": {"a": 1}}}),
            json!({"calls": {"call_1": "approve", "call_2": {"edit": {"a": 2}}, "call_3": "mark_failed"}}),
            json!({"select": "a"}),
            json!({"provide": {"x": 1}}),
        ] {
            let d: Decision = serde_json::from_value(raw.clone()).unwrap();
            assert_eq!(d.to_value(), raw);
        }
    }

    #[test]
    fn bad_shapes_do_not_repeat_the_value() {
        for raw in [json!("sk-proj-AbC123dEf456"), json!({"calls": {"call_1": "sk-proj-AbC123dEf456"}}), json!(3)] {
            let e = Decision::parse(&raw).unwrap_err();
            assert!(!e.contains("sk-proj"), "{e}");
        }
        assert!(Decision::parse(&json!({"edit": [1]})).unwrap_err().contains("decision.edit"));
    }
}
