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
pub const SUPPORTED_KINDS: &[&str] = &["http", "mcp", "client"];

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
    /// An MCP server: one table, as many tools as the server lists.
    Mcp(McpToolConfig),
    Client(ClientToolConfig),
}

impl ToolConfig {
    /// The fields every tool that is one tool has; `None` for an MCP server, whose tools are the
    /// server's.
    pub fn common(&self) -> Option<&CommonConfig> {
        match self {
            ToolConfig::Http(c) => Some(&c.common),
            ToolConfig::Mcp(_) => None,
            ToolConfig::Client(c) => Some(&c.common),
        }
    }

    /// The tool's name; for an MCP server, the server's (its tools' prefix).
    pub fn name(&self) -> &str {
        match self {
            ToolConfig::Http(c) => &c.common.name,
            ToolConfig::Mcp(c) => &c.name,
            ToolConfig::Client(c) => &c.common.name,
        }
    }

    pub fn kind(&self) -> &'static str {
        match self {
            ToolConfig::Http(_) => "http",
            ToolConfig::Mcp(_) => "mcp",
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

/// An MCP server whose tools an agent offers: started as a child process (`command`) or reached
/// over Streamable HTTP (`url`). See docs/tools.md, "MCP tools".
#[derive(Clone, PartialEq)]
pub struct McpToolConfig {
    /// The server's name in this agent; its tools are offered as `<name>__<tool>`.
    pub name: String,
    pub transport: McpTransportConfig,
    /// How long one call may take, a duration such as `10s`; default 30s.
    pub timeout: Option<String>,
    /// The largest result accepted, in bytes of JSON; default 1 MiB.
    pub max_response_bytes: Option<u64>,
    /// Name patterns (`*` matches any run of characters) of the server's tools, by policy. A tool
    /// that matches `deny` is not offered; else `ask`, else `allow`; else its annotations decide.
    pub allow: Vec<String>,
    pub ask: Vec<String>,
    pub deny: Vec<String>,
}

/// How Keel reaches an MCP server.
#[derive(Clone, PartialEq)]
pub enum McpTransportConfig {
    /// A child process speaking MCP on its stdin and stdout.
    Stdio {
        command: String,
        args: Vec<String>,
        /// Variable name → value; the value may use `${VAR}`. The child sees only these and a few
        /// of Keel's own (see docs/tools.md).
        env: BTreeMap<String, String>,
    },
    /// A server speaking MCP's Streamable HTTP.
    Http {
        url: String,
        /// Header name → value; the value may use `${VAR}`.
        headers: BTreeMap<String, String>,
    },
}

impl std::fmt::Debug for McpToolConfig {
    // Environment and header values stay out: whatever a config writes there is treated as a secret.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("McpToolConfig");
        d.field("name", &self.name);
        match &self.transport {
            McpTransportConfig::Stdio { command, args, env } => {
                d.field("command", command).field("args", &args.len()).field("env", &env.keys().collect::<Vec<_>>())
            }
            McpTransportConfig::Http { url, headers } => {
                d.field("url", &keel_core::mask::mask_text(url)).field("headers", &headers.keys().collect::<Vec<_>>())
            }
        };
        d.field("timeout", &self.timeout)
            .field("max_response_bytes", &self.max_response_bytes)
            .field("allow", &self.allow)
            .field("ask", &self.ask)
            .field("deny", &self.deny)
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
    description: Option<String>,
    policy: Option<PolicyConfig>,
    idempotent: Option<bool>,
    side_effect: Option<bool>,
    confirm: Option<ConfirmConfig>,
    // kind = "http"
    method: Option<String>,
    url: Option<String>,
    headers: Option<BTreeMap<String, String>>,
    timeout: Option<String>,
    args_schema: Option<Value>,
    result_schema: Option<Value>,
    max_response_bytes: Option<u64>,
    // kind = "mcp" (with url, headers, timeout, max_response_bytes)
    command: Option<String>,
    args: Option<Vec<String>>,
    env: Option<BTreeMap<String, String>>,
    allow: Option<Vec<String>>,
    ask: Option<Vec<String>>,
    deny: Option<Vec<String>>,
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
        match kind.as_str() {
            "http" => {
                let required = |field: &str| {
                    ToolConfigError::new(
                        field,
                        "missing; a tool of kind http needs description, method, url and args_schema",
                    )
                };
                let mcp_only = [
                    ("command", raw.command.is_some()),
                    ("args", raw.args.is_some()),
                    ("env", raw.env.is_some()),
                    ("allow", raw.allow.is_some()),
                    ("ask", raw.ask.is_some()),
                    ("deny", raw.deny.is_some()),
                ];
                if let Some((field, _)) = mcp_only.iter().find(|(_, given)| *given) {
                    return Err(ToolConfigError::new(*field, "only for kind mcp"));
                }
                let common = CommonConfig {
                    name: raw.name,
                    description: raw.description.ok_or_else(|| required("description"))?,
                    policy: raw.policy,
                    idempotent: raw.idempotent,
                    side_effect: raw.side_effect,
                    confirm: raw.confirm.unwrap_or_default(),
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
            "mcp" => {
                // What the server says about its tools (their descriptions, schemas and annotations)
                // is not written here; a field that would be is refused rather than ignored.
                let not_for_mcp = [
                    ("description", raw.description.is_some(), "the server describes its tools"),
                    ("policy", raw.policy.is_some(), "use allow, ask and deny with tool name patterns"),
                    ("idempotent", raw.idempotent.is_some(), "the server's idempotentHint decides"),
                    ("side_effect", raw.side_effect.is_some(), "the server's readOnlyHint decides"),
                    ("confirm", raw.confirm.is_some(), "the card names the tool and its arguments"),
                    ("method", raw.method.is_some(), "only for kind http"),
                    ("args_schema", raw.args_schema.is_some(), "the server gives each tool's input schema"),
                    ("result_schema", raw.result_schema.is_some(), "only for kind http"),
                ];
                if let Some((field, _, why)) = not_for_mcp.iter().find(|(_, given, _)| *given) {
                    return Err(ToolConfigError::new(*field, format!("not for kind mcp: {why}")));
                }
                let transport = match (raw.command, raw.url) {
                    (Some(command), None) => {
                        if raw.headers.is_some() {
                            return Err(ToolConfigError::new("headers", "only with url (an MCP server over HTTP)"));
                        }
                        McpTransportConfig::Stdio {
                            command,
                            args: raw.args.unwrap_or_default(),
                            env: raw.env.unwrap_or_default(),
                        }
                    }
                    (None, Some(url)) => {
                        if raw.args.is_some() || raw.env.is_some() {
                            let field = if raw.args.is_some() { "args" } else { "env" };
                            return Err(ToolConfigError::new(field, "only with command (an MCP server over stdio)"));
                        }
                        McpTransportConfig::Http { url, headers: raw.headers.unwrap_or_default() }
                    }
                    (Some(_), Some(_)) => {
                        return Err(ToolConfigError::new(
                            "command",
                            "give command (a server over stdio) or url (over HTTP), not both",
                        ))
                    }
                    (None, None) => {
                        return Err(ToolConfigError::new(
                            "command",
                            "missing; a tool of kind mcp needs command (a server over stdio) or url (over HTTP)",
                        ))
                    }
                };
                Ok(ToolConfig::Mcp(McpToolConfig {
                    name: raw.name,
                    transport,
                    timeout: raw.timeout,
                    max_response_bytes: raw.max_response_bytes,
                    allow: raw.allow.unwrap_or_default(),
                    ask: raw.ask.unwrap_or_default(),
                    deny: raw.deny.unwrap_or_default(),
                }))
            }
            "client" => {
                // The fields only an HTTP tool or an MCP server takes: a client tool sends nothing itself.
                for (field, given) in [
                    ("method", raw.method.is_some()),
                    ("url", raw.url.is_some()),
                    ("headers", raw.headers.is_some()),
                    ("max_response_bytes", raw.max_response_bytes.is_some()),
                    ("command", raw.command.is_some()),
                    ("args", raw.args.is_some()),
                    ("env", raw.env.is_some()),
                    ("allow", raw.allow.is_some()),
                    ("ask", raw.ask.is_some()),
                    ("deny", raw.deny.is_some()),
                ] {
                    if given {
                        return Err(ToolConfigError::new(field, "not a field of a client tool (kind = \"client\")"));
                    }
                }
                let required = |field: &str| {
                    ToolConfigError::new(field, "missing; a tool of kind client needs description and args_schema")
                };
                let common = CommonConfig {
                    name: raw.name,
                    description: raw.description.ok_or_else(|| required("description"))?,
                    policy: raw.policy,
                    idempotent: raw.idempotent,
                    side_effect: raw.side_effect,
                    confirm: raw.confirm.unwrap_or_default(),
                };
                Ok(ToolConfig::Client(ClientToolConfig {
                    common,
                    args_schema: raw.args_schema.ok_or_else(|| required("args_schema"))?,
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
