//! The tool contract, policies and argument validation.

use std::collections::BTreeMap;
use std::sync::Arc;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::domain::UserRole;
use crate::fleet::Effect;
use crate::ids::{CallId, ConversationId, RunId};
use crate::store::Store;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    Allow,
    Ask,
    Deny,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolSpec {
    pub name: String,
    pub description: String,
    /// JSON Schema of the arguments (the subset [`validate_args`] checks).
    pub parameters: Value,
    /// Changes the world; such tools default to `ask` and are never run concurrently.
    pub side_effect: bool,
    /// Safe to run again with the same call id after a crash cut it off.
    pub idempotent: bool,
    /// Policy per role; a role not listed is denied.
    pub policies: BTreeMap<UserRole, Policy>,
}

impl ToolSpec {
    /// Read-only: allowed for everyone. With side effects: `ask` for operators and admins, denied for
    /// viewers.
    pub fn new(name: &str, description: &str, parameters: Value, side_effect: bool) -> Self {
        let policies = if side_effect {
            BTreeMap::from([
                (UserRole::Viewer, Policy::Deny),
                (UserRole::Operator, Policy::Ask),
                (UserRole::Admin, Policy::Ask),
            ])
        } else {
            UserRole::ALL.iter().map(|r| (*r, Policy::Allow)).collect()
        };
        Self {
            name: name.to_owned(),
            description: description.to_owned(),
            parameters,
            side_effect,
            idempotent: !side_effect,
            policies,
        }
    }

    pub fn idempotent(mut self, idempotent: bool) -> Self {
        self.idempotent = idempotent;
        self
    }

    pub fn policy_for(&self, role: Option<UserRole>) -> Policy {
        role.and_then(|r| self.policies.get(&r).copied()).unwrap_or(Policy::Deny)
    }
}

/// What a human is shown for one action of a `confirm_action` interrupt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ActionDescription {
    pub title: String,
    pub risk: String,
    pub description: String,
}

pub struct ToolContext {
    /// The operation id: stable across retries and recovery.
    pub call_id: CallId,
    pub run_id: RunId,
    pub conversation_id: ConversationId,
    /// The user the run acts for (after a resume: the approver).
    pub user_id: String,
    pub role: Option<UserRole>,
    /// The engine's clock at the start of the call.
    pub now: crate::domain::Timestamp,
    pub store: Arc<dyn Store>,
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct ToolOutput {
    /// What the model sees.
    pub result: Value,
    /// One line for events and the step bar; never the raw result.
    pub summary: String,
    /// Confirmed facts this validated result establishes; written only if the call succeeds.
    pub facts: Vec<(String, String)>,
    /// Side effects the store applies in the transaction that records this result.
    pub effects: Vec<Effect>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ToolError {
    /// Bad arguments or a resource that isn't there: the model is told and may try again.
    #[error("{0}")]
    Invalid(String),
    /// The precheck refused: the world changed since the human was asked.
    #[error("{0}")]
    Precondition(String),
    #[error("{0}")]
    Failed(String),
}

#[async_trait]
pub trait Tool: Send + Sync + 'static {
    fn spec(&self) -> &ToolSpec;

    /// What to show a human before this call runs.
    fn describe(&self, args: &Value) -> ActionDescription {
        ActionDescription {
            title: format!("Run {}?", self.spec().name),
            risk: "This action changes the system.".to_owned(),
            description: format!("{} {}", self.spec().name, args),
        }
    }

    /// Re-checks, just before an approved call runs, that the resource is still as it was when the
    /// human was asked and that the caller may still do this.
    async fn precheck(&self, _ctx: &ToolContext, _args: &Value) -> Result<(), ToolError> {
        Ok(())
    }

    async fn execute(&self, ctx: &ToolContext, args: &Value) -> Result<ToolOutput, ToolError>;
}

/// The tools an engine offers, by name.
#[derive(Clone, Default)]
pub struct ToolRegistry {
    tools: BTreeMap<String, Arc<dyn Tool>>,
}

impl ToolRegistry {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn register(&mut self, tool: Arc<dyn Tool>) {
        self.tools.insert(tool.spec().name.clone(), tool);
    }

    pub fn get(&self, name: &str) -> Option<&Arc<dyn Tool>> {
        self.tools.get(name)
    }

    pub fn specs(&self) -> Vec<ToolSpec> {
        self.tools.values().map(|t| t.spec().clone()).collect()
    }
}

/// Validates `args` against the subset of JSON Schema tool specs use: `type` (object, string,
/// integer, number, boolean, array), `properties`, `required`, `additionalProperties: false`,
/// `enum`, `minimum`, `maximum`, `minLength`, `maxLength`. Returns the first problem, with its path.
pub fn validate_args(schema: &Value, args: &Value) -> Result<(), String> {
    validate_at(schema, args, "$")
}

fn validate_at(schema: &Value, value: &Value, path: &str) -> Result<(), String> {
    if let Some(ty) = schema.get("type").and_then(Value::as_str) {
        let ok = match ty {
            "object" => value.is_object(),
            "string" => value.is_string(),
            "integer" => value.is_i64() || value.is_u64(),
            "number" => value.is_number(),
            "boolean" => value.is_boolean(),
            "array" => value.is_array(),
            "null" => value.is_null(),
            _ => true,
        };
        if !ok {
            return Err(format!("{path}: expected {ty}"));
        }
    }
    if let Some(options) = schema.get("enum").and_then(Value::as_array) {
        if !options.contains(value) {
            return Err(format!("{path}: must be one of {}", Value::Array(options.clone())));
        }
    }
    if let Some(n) = value.as_f64() {
        if let Some(min) = schema.get("minimum").and_then(Value::as_f64) {
            if n < min {
                return Err(format!("{path}: must be at least {min}"));
            }
        }
        if let Some(max) = schema.get("maximum").and_then(Value::as_f64) {
            if n > max {
                return Err(format!("{path}: must be at most {max}"));
            }
        }
    }
    if let Some(s) = value.as_str() {
        let len = s.chars().count() as u64;
        if let Some(min) = schema.get("minLength").and_then(Value::as_u64) {
            if len < min {
                return Err(format!("{path}: must be at least {min} characters"));
            }
        }
        if let Some(max) = schema.get("maxLength").and_then(Value::as_u64) {
            if len > max {
                return Err(format!("{path}: must be at most {max} characters"));
            }
        }
    }
    if let Some(obj) = value.as_object() {
        let props = schema.get("properties").and_then(Value::as_object);
        if let Some(required) = schema.get("required").and_then(Value::as_array) {
            for key in required.iter().filter_map(Value::as_str) {
                if !obj.contains_key(key) {
                    return Err(format!("{path}.{key}: is required"));
                }
            }
        }
        for (key, v) in obj {
            match props.and_then(|p| p.get(key)) {
                Some(sub) => validate_at(sub, v, &format!("{path}.{key}"))?,
                None if schema.get("additionalProperties") == Some(&Value::Bool(false)) => {
                    return Err(format!("{path}.{key}: is not allowed"));
                }
                None => {}
            }
        }
    }
    if let (Some(items), Some(arr)) = (schema.get("items"), value.as_array()) {
        for (i, v) in arr.iter().enumerate() {
            validate_at(items, v, &format!("{path}[{i}]"))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn schema_subset_is_checked() {
        let schema = json!({
            "type": "object",
            "properties": {"instanceId": {"type": "string", "minLength": 1}, "minutes": {"type": "integer", "minimum": 1}},
            "required": ["instanceId"],
            "additionalProperties": false
        });
        assert!(validate_args(&schema, &json!({"instanceId": "pay-prod-2"})).is_ok());
        assert!(validate_args(&schema, &json!({})).unwrap_err().contains("required"));
        assert!(validate_args(&schema, &json!({"instanceId": 3})).unwrap_err().contains("string"));
        assert!(validate_args(&schema, &json!({"instanceId": "x", "y": 1})).unwrap_err().contains("not allowed"));
        assert!(validate_args(&schema, &json!({"instanceId": "x", "minutes": 0})).is_err());
        assert!(validate_args(&schema, &json!({"instanceId": ""})).is_err());
        assert!(validate_args(&schema, &json!("x")).is_err());
    }

    #[test]
    fn unlisted_role_is_denied() {
        let spec = ToolSpec::new("restart", "", json!({}), true);
        assert_eq!(spec.policy_for(None), Policy::Deny);
        assert_eq!(spec.policy_for(Some(UserRole::Viewer)), Policy::Deny);
        assert_eq!(spec.policy_for(Some(UserRole::Operator)), Policy::Ask);
        assert!(!spec.idempotent);
    }
}
