//! The `[[agents.tools]]` table of keel.toml, as parsed.
//!
//! Parsing checks the shape (known fields, types, the fields a kind requires); [`crate::build`] checks
//! the meaning (a method Keel supports, a URL whose placeholders are arguments, schemas that compile,
//! environment variables that are set) and reports each problem as a [`ToolConfigError`] naming the
//! field.

use std::collections::BTreeMap;

use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::Value;

/// The kinds of tool a `[[agents.tools]]` table can declare.
pub const SUPPORTED_KINDS: &[&str] = &["http", "client"];

/// A problem in a tool's configuration: the field (`url`, `headers.Authorization`, `policy.viewer`)
/// and what is wrong with it. It never holds a secret: header values and environment values are not
/// quoted. The caller prefixes the file, the agent and the tool.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct ToolConfigError {
    pub field: String,
    pub message: String,
}

impl ToolConfigError {
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self { field: field.into(), message: message.into() }
    }
}

/// One `[[agents.tools]]` table, by its `kind`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(try_from = "RawToolConfig")]
#[non_exhaustive]
pub enum ToolConfig {
    Http(HttpToolConfig),
    Client(ClientToolConfig),
}

impl ToolConfig {
    pub fn common(&self) -> &CommonConfig {
        match self {
            ToolConfig::Http(c) => &c.common,
            ToolConfig::Client(c) => &c.common,
        }
    }

    pub fn name(&self) -> &str {
        &self.common().name
    }

    pub fn kind(&self) -> &'static str {
        match self {
            ToolConfig::Http(_) => "http",
            ToolConfig::Client(_) => "client",
        }
    }
}

/// The fields every kind of tool has.
#[derive(Debug, Clone, PartialEq)]
pub struct CommonConfig {
    /// What the model calls it: 1 to 64 of `[A-Za-z0-9_-]`.
    pub name: String,
    /// What the model is told the tool does.
    pub description: String,
    /// Absent: read-only tools are allowed for every role; tools with side effects ask operators and
    /// admins and are denied to viewers.
    pub policy: Option<PolicyConfig>,
    /// Absent: the opposite of `side_effect`.
    pub idempotent: Option<bool>,
    /// Absent: decided by the kind (an HTTP tool: true unless its method is GET).
    pub side_effect: Option<bool>,
    /// The confirmation card's templates.
    pub confirm: ConfirmConfig,
}

/// `policy = "ask"` or `policy = { viewer = "deny", operator = "ask", admin = "allow" }`, as written;
/// the words are checked by [`crate::build`] so that a wrong one is reported with its field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PolicyConfig {
    All(String),
    ByRole(BTreeMap<String, String>),
}

impl<'de> Deserialize<'de> for PolicyConfig {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct PolicyVisitor;

        impl<'de> Visitor<'de> for PolicyVisitor {
            type Value = PolicyConfig;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str(r#""allow", "ask", "deny", or a table by role such as { operator = "ask" }"#)
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<PolicyConfig, E> {
                Ok(PolicyConfig::All(v.to_owned()))
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<PolicyConfig, A::Error> {
                let mut roles = BTreeMap::new();
                while let Some((role, policy)) = map.next_entry::<String, String>()? {
                    if roles.insert(role.clone(), policy).is_some() {
                        return Err(de::Error::custom(format!("the role {role} is given twice")));
                    }
                }
                Ok(PolicyConfig::ByRole(roles))
            }
        }

        deserializer.deserialize_any(PolicyVisitor)
    }
}

/// The confirmation card a human sees before a call runs. Each is a template: `{argName}` is replaced
/// by that argument (masked and cut short); `{{` and `}}` are literal braces.
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfirmConfig {
    /// Default: `Run <name>?`.
    pub title: Option<String>,
    /// Default: names the method, the path and the host.
    pub risk: Option<String>,
    /// Default: the tool's name and its (masked) arguments.
    pub description: Option<String>,
}

/// A tool that is one HTTP request.
#[derive(Clone, PartialEq)]
pub struct HttpToolConfig {
    pub common: CommonConfig,
    /// GET, POST, PUT, PATCH or DELETE.
    pub method: String,
    /// `http://` or `https://`; `{argName}` placeholders only in the path.
    pub url: String,
    /// Header name → value; the value may use `${VAR}` for an environment variable.
    pub headers: BTreeMap<String, String>,
    /// A duration such as `10s` or `500ms`; default 30s.
    pub timeout: Option<String>,
    /// The arguments' JSON Schema (a TOML table).
    pub args_schema: Value,
    pub result_schema: Option<Value>,
    /// Default 1 MiB.
    pub max_response_bytes: Option<u64>,
}

impl std::fmt::Debug for HttpToolConfig {
    // Header values stay out: whatever a config writes there is treated as a secret.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpToolConfig")
            .field("common", &self.common)
            .field("method", &self.method)
            .field("url", &keel_core::mask::mask_text(&self.url))
            .field("headers", &self.headers.keys().collect::<Vec<_>>())
            .field("timeout", &self.timeout)
            .field("args_schema", &self.args_schema)
            .field("result_schema", &self.result_schema)
            .field("max_response_bytes", &self.max_response_bytes)
            .finish()
    }
}

/// A tool the client runs: Keel records the call, pauses the run and takes the client's answer.
#[derive(Debug, Clone, PartialEq)]
pub struct ClientToolConfig {
    pub common: CommonConfig,
    /// The arguments' JSON Schema (a TOML table); its top level must be `type = "object"`.
    pub args_schema: Value,
    /// A JSON Schema the client's result must match (422 `INVALID_RESULT` otherwise).
    pub result_schema: Option<Value>,
    /// How long a call waits for the client's answer, such as `10m`; default: the server's
    /// interrupt TTL.
    pub timeout: Option<String>,
}

/// Every field of every kind, flat, so that the TOML deserializer reads the table directly (its
/// errors keep their line and column) and an unknown field is refused; which fields a kind takes is
/// checked when it is converted.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawToolConfig {
    kind: Option<String>,
    name: String,
    description: String,
    policy: Option<PolicyConfig>,
    idempotent: Option<bool>,
    side_effect: Option<bool>,
    #[serde(default)]
    confirm: ConfirmConfig,
    // kind = "http"
    method: Option<String>,
    url: Option<String>,
    headers: Option<BTreeMap<String, String>>,
    timeout: Option<String>,
    args_schema: Option<Value>,
    result_schema: Option<Value>,
    max_response_bytes: Option<u64>,
}

fn supported() -> String {
    SUPPORTED_KINDS.join(", ")
}

impl TryFrom<RawToolConfig> for ToolConfig {
    type Error = ToolConfigError;

    fn try_from(raw: RawToolConfig) -> Result<Self, ToolConfigError> {
        let Some(kind) = raw.kind else {
            return Err(ToolConfigError::new("kind", format!("missing; supported kinds: {}", supported())));
        };
        let common = CommonConfig {
            name: raw.name,
            description: raw.description,
            policy: raw.policy,
            idempotent: raw.idempotent,
            side_effect: raw.side_effect,
            confirm: raw.confirm,
        };
        match kind.as_str() {
            "http" => {
                let required = |field: &str| {
                    ToolConfigError::new(field, "missing; a tool of kind http needs method, url and args_schema")
                };
                Ok(ToolConfig::Http(HttpToolConfig {
                    common,
                    method: raw.method.ok_or_else(|| required("method"))?,
                    url: raw.url.ok_or_else(|| required("url"))?,
                    headers: raw.headers.unwrap_or_default(),
                    timeout: raw.timeout,
                    args_schema: raw.args_schema.ok_or_else(|| required("args_schema"))?,
                    result_schema: raw.result_schema,
                    max_response_bytes: raw.max_response_bytes,
                }))
            }
            "client" => {
                // The fields only an HTTP tool takes: a client tool sends nothing itself.
                for (field, given) in [
                    ("method", raw.method.is_some()),
                    ("url", raw.url.is_some()),
                    ("headers", raw.headers.is_some()),
                    ("max_response_bytes", raw.max_response_bytes.is_some()),
                ] {
                    if given {
                        return Err(ToolConfigError::new(field, "not a field of a client tool (kind = \"client\")"));
                    }
                }
                Ok(ToolConfig::Client(ClientToolConfig {
                    common,
                    args_schema: raw.args_schema.ok_or_else(|| {
                        ToolConfigError::new("args_schema", "missing; a tool of kind client needs args_schema")
                    })?,
                    result_schema: raw.result_schema,
                    timeout: raw.timeout,
                }))
            }
            other => Err(ToolConfigError::new(
                "kind",
                format!(
                    "unknown tool kind {:?}; supported kinds: {}",
                    keel_core::mask::truncate(other, 40),
                    supported()
                ),
            )),
        }
    }
}
