//! The tool contract: what a tool declares ([`ToolSpec`]), what it is given ([`ToolContext`]), what
//! it answers ([`ToolOutput`] or a [`ToolError`] whose kind decides what the engine does next), and
//! the registry that validates arguments against each tool's JSON Schema, compiled once.
//!
//! A tool gets no store: what it needs (an HTTP client, a database of its own, a narrow reader of
//! Keel's records) it is built with.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::domain::{Timestamp, UserRole};
use crate::ids::{CallId, ConversationId, RunId};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    Allow,
    Ask,
    Deny,
}

impl Policy {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "allow" => Some(Policy::Allow),
            "ask" => Some(Policy::Ask),
            "deny" => Some(Policy::Deny),
            _ => None,
        }
    }
}

/// How long a tool call may take before the engine gives up on it, unless the tool says otherwise.
pub const DEFAULT_TOOL_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolSpec {
    pub name: String,
    pub description: String,
    /// JSON Schema of the arguments; the registry compiles it once and checks every call (and every
    /// human edit) against it.
    pub parameters: Value,
    /// JSON Schema of a successful result, checked when given: a result that breaks it is a
    /// [`ToolError::BadResponse`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result_schema: Option<Value>,
    /// Changes the world; such tools default to `ask` and are never run concurrently.
    pub side_effect: bool,
    /// Safe to call again with the same idempotency key (the call id) when an attempt got no answer
    /// (a timeout, a crash): the engine retries it. A call of any other tool that got no answer
    /// has an unknown outcome, and a human decides.
    pub idempotent: bool,
    /// Policy per role; a role not listed is denied.
    pub policies: BTreeMap<UserRole, Policy>,
    /// How long one attempt may take. A tool that enforces it itself (an HTTP tool's deadline
    /// covers connect to last byte) says how it failed; the engine stops an attempt still running
    /// [`TIMEOUT_GRACE`] later and counts it as [`ToolError::Timeout`].
    #[serde(default = "default_timeout", with = "duration_ms")]
    pub timeout: Duration,
}

/// How long past its timeout the engine lets an attempt run, so a tool's own timeout (and the
/// error kind it chooses) wins over the engine's.
pub const TIMEOUT_GRACE: Duration = Duration::from_secs(1);

fn default_timeout() -> Duration {
    DEFAULT_TOOL_TIMEOUT
}

mod duration_ms {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(d.as_millis() as u64)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        u64::deserialize(d).map(Duration::from_millis)
    }
}

impl ToolSpec {
    /// Read-only: allowed for everyone. With side effects: `ask` for operators and admins, denied for
    /// viewers; not idempotent.
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
            result_schema: None,
            side_effect,
            idempotent: !side_effect,
            policies,
            timeout: DEFAULT_TOOL_TIMEOUT,
        }
    }

    pub fn idempotent(mut self, idempotent: bool) -> Self {
        self.idempotent = idempotent;
        self
    }

    /// The same policy for every role.
    pub fn policy(mut self, policy: Policy) -> Self {
        self.policies = UserRole::ALL.iter().map(|r| (*r, policy)).collect();
        self
    }

    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    pub fn result_schema(mut self, schema: Value) -> Self {
        self.result_schema = Some(schema);
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

/// What a tool is told about the call it executes.
#[derive(Debug, Clone)]
pub struct ToolContext {
    /// The model's call id: stable across attempts and recovery.
    pub call_id: CallId,
    /// The key a side effect is deduplicated by (an HTTP tool sends it as `Idempotency-Key`): the
    /// same on every attempt of the call, unique across calls.
    pub idempotency_key: String,
    /// 1 for the first attempt; more when the engine retries an idempotent call that got no answer.
    pub attempt: u32,
    pub run_id: RunId,
    pub conversation_id: ConversationId,
    pub agent_id: String,
    /// The user the run acts for (after a resume: still the run's user; the approver is recorded on
    /// the interrupt).
    pub user_id: String,
    /// That user's role now.
    pub role: Option<UserRole>,
    /// The engine's clock at the start of the attempt.
    pub now: Timestamp,
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct ToolOutput {
    /// What the model sees (masked, and cut to the agent's result budget, before it is stored).
    pub result: Value,
    /// One line for events and the step bar; never the raw result.
    pub summary: String,
    /// Confirmed facts this validated result establishes; written only if the call succeeds.
    pub facts: Vec<(String, String)>,
}

/// Why a call did not succeed. The kind decides what happens next: the model is told (most
/// kinds), the call is tried again with the same key (no answer from an idempotent tool, or a
/// service that could not be reached), or a human decides (no answer from any other tool).
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
    /// The service could not be reached (a refused connection, a name that does not resolve): the
    /// request never left, so it is safe to try again.
    #[error("{0}")]
    Unreachable(String),
    /// No answer within the tool's timeout. The request may have been applied.
    #[error("{0}")]
    Timeout(String),
    /// The service answered with an error status.
    #[error("{message}")]
    Status { status: u16, message: String },
    /// The answer was not what the tool expects: not JSON, or against its result schema.
    #[error("{0}")]
    BadResponse(String),
    /// The answer was larger than the tool accepts.
    #[error("the answer was larger than {limit} bytes")]
    TooLarge { limit: usize },
    /// The request was sent and the answer was lost (the connection broke): it may have been applied.
    #[error("{0}")]
    OutcomeUnknown(String),
}

impl ToolError {
    /// Stable, for events (`tool_finished.errorCode`) and metrics.
    pub fn code(&self) -> String {
        match self {
            ToolError::Invalid(_) => "invalid".into(),
            ToolError::Precondition(_) => "precondition".into(),
            ToolError::Failed(_) => "failed".into(),
            ToolError::Unreachable(_) => "unreachable".into(),
            ToolError::Timeout(_) => "timeout".into(),
            ToolError::Status { status, .. } => format!("http_{status}"),
            ToolError::BadResponse(_) => "bad_response".into(),
            ToolError::TooLarge { .. } => "too_large".into(),
            ToolError::OutcomeUnknown(_) => "outcome_unknown".into(),
        }
    }

    /// What the engine does with this failure of a call of a tool that is (or is not) idempotent.
    pub fn next(&self, idempotent: bool) -> NextAttempt {
        match self {
            // The request never left.
            ToolError::Unreachable(_) => NextAttempt::Retry,
            ToolError::Timeout(_) | ToolError::OutcomeUnknown(_) if idempotent => NextAttempt::Retry,
            ToolError::Timeout(_) | ToolError::OutcomeUnknown(_) => NextAttempt::AskHuman,
            ToolError::Status { status, .. } if idempotent && (*status >= 500 || *status == 429) => NextAttempt::Retry,
            _ => NextAttempt::Fail,
        }
    }
}

/// See [`ToolError::next`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NextAttempt {
    /// Call again with the same key, while attempts remain; then fail.
    Retry,
    /// The outcome is unknown: the call waits for a human (`outcome_unknown`).
    AskHuman,
    /// Tell the model.
    Fail,
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

    /// `Some` for a tool the client runs (a browser action, a question only the user can answer):
    /// the engine never calls [`Tool::execute`] for it; a call pauses the run on a `tool_call`
    /// interrupt until the client answers `POST /v1/runs/{id}/tool-results`.
    fn client_side(&self) -> Option<ClientSide> {
        None
    }
}

/// How the engine treats a client-side tool's calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ClientSide {
    /// How long a call waits for the client's answer; `None`: the server's interrupt TTL. Past it
    /// the interrupt expires and the run is cancelled, as any interrupt's.
    pub answer_within: Option<Duration>,
}

/// A JSON Schema, compiled once (the `jsonschema` crate, no remote references).
#[derive(Clone)]
pub struct JsonSchema {
    validator: Arc<jsonschema::Validator>,
}

impl std::fmt::Debug for JsonSchema {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("JsonSchema")
    }
}

/// Where a value breaks its schema: a JSON path (`$.orderId`, `$.items[2]`) and the rule, in
/// words that quote the schema, never the value (it may hold anything).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{path}: {rule}")]
pub struct Violation {
    pub path: String,
    pub rule: String,
}

/// A schema that is not a valid JSON Schema.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not a valid JSON Schema: {0}")]
pub struct InvalidSchema(pub String);

impl JsonSchema {
    pub fn compile(schema: &Value) -> Result<Self, InvalidSchema> {
        let validator = jsonschema::options().build(schema).map_err(|e| {
            // Checked against the meta-schema: the error's instance path is where in the schema.
            let at = e.instance_path().as_str();
            let message = if at.is_empty() { e.to_string() } else { format!("at {at}: {e}") };
            InvalidSchema(describe_schema_error(&message))
        })?;
        Ok(Self { validator: Arc::new(validator) })
    }

    /// The first violation, if any.
    pub fn validate(&self, value: &Value) -> Result<(), Violation> {
        match self.validator.iter_errors(value).next() {
            None => Ok(()),
            Some(e) => Err(violation(&e)),
        }
    }
}

/// The compiler's message names the part of the schema it could not read; it quotes the schema
/// (configuration), not a client's value.
fn describe_schema_error(message: &str) -> String {
    crate::mask::truncate(message, 300)
}

fn violation(e: &jsonschema::ValidationError<'_>) -> Violation {
    use jsonschema::error::ValidationErrorKind as K;
    let limit = |what: &str, n: &dyn std::fmt::Display| format!("{what} {n}");
    let rule = match e.kind() {
        K::Type { kind } => format!("must be of type {}", type_names(kind)),
        K::Required { property } => match property.as_str() {
            Some(name) => format!("the property {name} is required"),
            None => format!("the property {property} is required"),
        },
        K::AdditionalProperties { .. } => "has a property the schema does not allow".to_owned(),
        K::Pattern { pattern } => format!("must match the pattern {pattern}"),
        K::Enum { options } => format!("must be one of {options}"),
        K::Constant { expected_value } => format!("must be {expected_value}"),
        K::OneOfNotValid { .. } => "must match one of the schemas of oneOf, and matches none".to_owned(),
        K::OneOfMultipleValid { .. } => {
            "must match exactly one of the schemas of oneOf, and matches several".to_owned()
        }
        K::AnyOf { .. } => "must match at least one of the schemas of anyOf".to_owned(),
        K::Not { .. } => "must not match the schema of not".to_owned(),
        K::MinLength { limit: n } => limit("must be at least this many characters long:", n),
        K::MaxLength { limit: n } => limit("must be at most this many characters long:", n),
        K::Minimum { limit: n } => limit("must be at least", n),
        K::Maximum { limit: n } => limit("must be at most", n),
        K::ExclusiveMinimum { limit: n } => limit("must be more than", n),
        K::ExclusiveMaximum { limit: n } => limit("must be less than", n),
        K::MinItems { limit: n } => limit("must have at least this many items:", n),
        K::MaxItems { limit: n } => limit("must have at most this many items:", n),
        K::MinProperties { limit: n } => limit("must have at least this many properties:", n),
        K::MaxProperties { limit: n } => limit("must have at most this many properties:", n),
        K::MultipleOf { multiple_of } => limit("must be a multiple of", multiple_of),
        K::UniqueItems => "must not repeat an item".to_owned(),
        K::Format { format } => format!("must be a valid {format}"),
        K::FalseSchema => "is not allowed here".to_owned(),
        _ => {
            let keyword = e.schema_path().as_str().rsplit('/').next().unwrap_or("").to_owned();
            format!("does not satisfy the schema's {keyword}")
        }
    };
    Violation { path: json_path(e.instance_path().as_str()), rule }
}

fn type_names(kind: &jsonschema::error::TypeKind) -> String {
    use jsonschema::error::TypeKind;
    match kind {
        TypeKind::Single(t) => t.to_string(),
        TypeKind::Multiple(ts) => ts.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(" or "),
    }
}

/// `/items/2/name` → `$.items[2].name`; a segment that a client chose and that looks like a secret is
/// shown as `?`.
fn json_path(pointer: &str) -> String {
    let mut out = String::from("$");
    for raw in pointer.split('/').skip(1) {
        let segment = raw.replace("~1", "/").replace("~0", "~");
        if !segment.is_empty() && segment.bytes().all(|b| b.is_ascii_digit()) {
            out.push_str(&format!("[{segment}]"));
        } else if crate::mask::looks_secret(&segment) || segment.len() > 64 {
            out.push_str(".?");
        } else {
            out.push('.');
            out.push_str(&segment);
        }
    }
    out
}

/// A registered tool with its compiled schemas.
#[derive(Clone)]
struct Entry {
    tool: Arc<dyn Tool>,
    args: JsonSchema,
    result: Option<JsonSchema>,
}

/// Why a tool cannot be registered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegistryError {
    #[error("tool {0}: the name must be 1 to 64 of [A-Za-z0-9_-]")]
    BadName(String),
    #[error("tool {0} is registered twice")]
    Duplicate(String),
    #[error("tool {tool}: args_schema is {error}")]
    ArgsSchema { tool: String, error: InvalidSchema },
    #[error("tool {tool}: result_schema is {error}")]
    ResultSchema { tool: String, error: InvalidSchema },
}

/// The tools an agent offers, in the order they were registered (the order the model and
/// `GET /v1/agents` see), with their schemas compiled.
#[derive(Clone, Default)]
pub struct ToolRegistry {
    tools: Vec<Entry>,
    by_name: BTreeMap<String, usize>,
    /// The tools' specs, shared: every model call offers them, and a copy of each schema per call
    /// would cost as much as the call's own bookkeeping.
    specs: Arc<[ToolSpec]>,
}

impl ToolRegistry {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a tool, compiling its schemas; refused if the name is taken or a schema is invalid.
    pub fn register(&mut self, tool: Arc<dyn Tool>) -> Result<(), RegistryError> {
        let spec = tool.spec();
        let name = spec.name.clone();
        if name.is_empty()
            || name.len() > 64
            || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        {
            return Err(RegistryError::BadName(crate::mask::truncate(&name, 80)));
        }
        if self.by_name.contains_key(&name) {
            return Err(RegistryError::Duplicate(name));
        }
        let args = JsonSchema::compile(&spec.parameters)
            .map_err(|error| RegistryError::ArgsSchema { tool: name.clone(), error })?;
        let result = match &spec.result_schema {
            Some(schema) => Some(
                JsonSchema::compile(schema)
                    .map_err(|error| RegistryError::ResultSchema { tool: name.clone(), error })?,
            ),
            None => None,
        };
        self.by_name.insert(name, self.tools.len());
        self.tools.push(Entry { tool, args, result });
        self.specs = self.tools.iter().map(|e| e.tool.spec().clone()).collect();
        Ok(())
    }

    /// [`ToolRegistry::register`] for tools whose specs are the program's own (a bad one is a bug).
    pub fn with(mut self, tool: Arc<dyn Tool>) -> Self {
        if let Err(e) = self.register(tool) {
            panic!("{e}");
        }
        self
    }

    fn entry(&self, name: &str) -> Option<&Entry> {
        self.by_name.get(name).map(|&i| &self.tools[i])
    }

    pub fn get(&self, name: &str) -> Option<&Arc<dyn Tool>> {
        self.entry(name).map(|e| &e.tool)
    }

    /// The tools' specs, in order (shared, not copied).
    pub fn specs(&self) -> Arc<[ToolSpec]> {
        self.specs.clone()
    }

    /// No tool is registered.
    pub fn is_empty(&self) -> bool {
        self.tools.is_empty()
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tools.iter().map(|e| e.tool.spec().name.as_str())
    }

    /// Checks `args` against the tool's schema. `None` if there is no such tool.
    pub fn validate_args(&self, name: &str, args: &Value) -> Option<Result<(), Violation>> {
        self.entry(name).map(|e| e.args.validate(args))
    }

    /// Checks a successful result against the tool's result schema, if it has one.
    pub fn validate_result(&self, name: &str, result: &Value) -> Result<(), Violation> {
        match self.entry(name).and_then(|e| e.result.as_ref()) {
            Some(schema) => schema.validate(result),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn schema() -> JsonSchema {
        JsonSchema::compile(&json!({
            "type": "object",
            "properties": {
                "orderId": {"type": "string", "pattern": "^[a-z]+-[0-9]+$"},
                "mode": {"oneOf": [{"const": "soft"}, {"const": "hard"}]},
                "minutes": {"type": "integer", "minimum": 1},
                "tags": {"type": "array", "items": {"type": "string"}}
            },
            "required": ["orderId"],
            "additionalProperties": false
        }))
        .unwrap()
    }

    #[test]
    fn violations_name_the_path_and_the_rule_not_the_value() {
        let s = schema();
        assert!(s.validate(&json!({"orderId": "api-2"})).is_ok());
        let e = s.validate(&json!({"orderId": "sk-proj-AbC123dEf456"})).unwrap_err();
        assert_eq!(e.to_string(), "$.orderId: must match the pattern ^[a-z]+-[0-9]+$");
        let e = s.validate(&json!({"orderId": "api-2", "mode": "sk-proj-AbC123dEf456"})).unwrap_err();
        assert_eq!(e.path, "$.mode");
        assert!(e.rule.contains("oneOf"), "{e}");
        let e = s.validate(&json!({})).unwrap_err();
        assert_eq!(e.to_string(), "$: the property orderId is required");
        let e = s.validate(&json!({"orderId": "api-2", "sk-proj-AbC123dEf456": 1})).unwrap_err();
        assert!(!e.to_string().contains("sk-proj"), "{e}");
        let e = s.validate(&json!({"orderId": "api-2", "tags": ["a", 5]})).unwrap_err();
        assert_eq!(e.to_string(), "$.tags[1]: must be of type string");
        let e = s.validate(&json!({"orderId": "api-2", "minutes": 0})).unwrap_err();
        assert_eq!(e.to_string(), "$.minutes: must be at least 1");
    }

    #[test]
    fn a_bad_schema_is_refused_at_registration() {
        struct T(ToolSpec);
        #[async_trait]
        impl Tool for T {
            fn spec(&self) -> &ToolSpec {
                &self.0
            }
            async fn execute(&self, _: &ToolContext, _: &Value) -> Result<ToolOutput, ToolError> {
                Ok(ToolOutput::default())
            }
        }
        let mut r = ToolRegistry::new();
        let bad = T(ToolSpec::new("bad", "", json!({"type": 12}), false));
        assert!(matches!(r.register(Arc::new(bad)), Err(RegistryError::ArgsSchema { .. })));
        r.register(Arc::new(T(ToolSpec::new("ok", "", json!({"type": "object"}), false)))).unwrap();
        let again = T(ToolSpec::new("ok", "", json!({}), false));
        assert_eq!(r.register(Arc::new(again)), Err(RegistryError::Duplicate("ok".into())));
        let named = T(ToolSpec::new("a b", "", json!({}), false));
        assert!(matches!(r.register(Arc::new(named)), Err(RegistryError::BadName(_))));
        assert_eq!(r.validate_args("ok", &json!([])).unwrap().unwrap_err().to_string(), "$: must be of type object");
        assert!(r.validate_args("missing", &json!({})).is_none());
    }

    #[test]
    fn unlisted_role_is_denied() {
        let spec = ToolSpec::new("restart", "", json!({}), true);
        assert_eq!(spec.policy_for(None), Policy::Deny);
        assert_eq!(spec.policy_for(Some(UserRole::Viewer)), Policy::Deny);
        assert_eq!(spec.policy_for(Some(UserRole::Operator)), Policy::Ask);
        assert!(!spec.idempotent);
    }

    #[test]
    fn what_follows_a_failure() {
        let t = ToolError::Timeout("t".into());
        assert_eq!(t.next(true), NextAttempt::Retry);
        assert_eq!(t.next(false), NextAttempt::AskHuman);
        assert_eq!(ToolError::Unreachable("x".into()).next(false), NextAttempt::Retry);
        let s500 = ToolError::Status { status: 500, message: "x".into() };
        assert_eq!(s500.next(true), NextAttempt::Retry);
        assert_eq!(s500.next(false), NextAttempt::Fail);
        assert_eq!(ToolError::Status { status: 404, message: "x".into() }.next(true), NextAttempt::Fail);
        assert_eq!(s500.code(), "http_500");
    }
}
