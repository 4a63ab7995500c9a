//! `[[agents]]` in keel.toml: several agents per server, each checked here into an
//! [`AgentConfig`]. Nothing here runs them; the engine's wiring does. A tool stays the table it was
//! written as: its fields belong to keel-tools, which checks them when it builds the tool.
//!
//! Checks come in two passes, and the errors say which by how they name the agent. The first reads
//! each agent alone, before its id is known to be good, so it names it by position (and its id, if
//! it has one as text): `agents[1] (id "ops"): model.base_url: required for kind "openai"`. The
//! second looks across agents and at the environment, once every id is checked and unique, so it
//! names the agent by id: `agent "ops": model.api_key_env: the environment variable OPS_MODEL_KEY
//! is not set`.

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::anyhow;
use serde::Deserialize;

use super::{positive_duration, Env, ModelChoice, OpenAiParts};

/// One agent of `[[agents]]`, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct AgentConfig {
    /// `[a-z0-9][a-z0-9_-]{0,63}`, unique among the agents.
    pub id: String,
    /// For people; the id when the file gives none.
    pub name: String,
    pub description: Option<String>,
    /// Not empty.
    pub system_prompt: String,
    /// Exactly one agent of the list is: the one that says `default = true`, else the first.
    pub default: bool,
    /// `None` (no `[agents.model]`): the server's own model, `--model` and the `--model-*`
    /// settings. A given table stands alone: what it leaves out keeps keel-models' defaults, not the
    /// server's settings, which are for another endpoint.
    pub model: Option<ModelChoice>,
    pub context: AgentContext,
    /// In file order; names unique within the agent.
    pub tools: Vec<ToolConfig>,
    /// Prompts a client may offer to start a conversation with (the page's starter chips), in file
    /// order: at most [`MAX_SUGGESTIONS`], each not empty and at most [`MAX_SUGGESTION_CHARS`].
    pub suggestions: Vec<String>,
    /// `[agents.retention] events_after`: how long this agent's finished runs keep their events
    /// (`Some(None)`: forever, `"forever"`); `None`: the server's `retention_events_after`.
    pub events_after: Option<Option<Duration>>,
}

/// The most `suggestions` an agent may have.
pub const MAX_SUGGESTIONS: usize = 8;
/// The longest a suggestion may be, in characters.
pub const MAX_SUGGESTION_CHARS: usize = 200;

/// `[agents.context]`; what is not given keeps the engine's default.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AgentContext {
    /// The whole prompt's budget, in estimated tokens; more than 0.
    pub budget_tokens: Option<usize>,
    /// The summary's upper bound, in characters; more than 0.
    pub summary_max_chars: Option<usize>,
    /// The largest tool result kept, in bytes of JSON text; more than 0.
    pub tool_result_max_bytes: Option<usize>,
}

/// One `[[agents.tools]]`: its name and kind, read and checked, and the whole table as written
/// (`name` and `kind` included), for `keel_tools::build`.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolConfig {
    pub name: String,
    pub kind: String,
    pub table: toml::Table,
}

/// An agent as the file has it.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AgentFile {
    id: Option<String>,
    name: Option<String>,
    description: Option<String>,
    system_prompt: Option<String>,
    #[serde(default)]
    default: bool,
    model: Option<ModelFile>,
    #[serde(default)]
    context: ContextFile,
    #[serde(default)]
    tools: Vec<toml::Table>,
    #[serde(default)]
    suggestions: Vec<String>,
    retention: Option<RetentionFile>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RetentionFile {
    events_after: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ModelFile {
    kind: Option<ModelKind>,
    base_url: Option<String>,
    name: Option<String>,
    api_key_env: Option<String>,
    api_key_header: Option<String>,
    temperature: Option<f32>,
    max_tokens: Option<u32>,
    connect_timeout: Option<String>,
    first_token_timeout: Option<String>,
    idle_timeout: Option<String>,
    max_retries: Option<u32>,
}

#[derive(Clone, Copy, Deserialize)]
enum ModelKind {
    #[serde(rename = "demo")]
    Demo,
    #[serde(rename = "openai")]
    OpenAi,
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ContextFile {
    budget_tokens: Option<usize>,
    summary_max_chars: Option<usize>,
    tool_result_max_bytes: Option<usize>,
}

/// An agent after the first pass: all but what needs the other agents or the environment.
struct Draft {
    config: AgentConfig,
    /// Set by the agent itself, as opposed to being the first.
    said_default: bool,
    /// The variable that holds the key of its OpenAI-compatible model.
    api_key_env: Option<String>,
    tools: Vec<toml::Table>,
}

/// Every agent of `tables`, checked; `file` names the file in errors.
pub(super) fn resolve(tables: &[toml::Table], file: &str, env: Env) -> anyhow::Result<Vec<AgentConfig>> {
    let drafts = tables
        .iter()
        .enumerate()
        .map(|(i, table)| draft(table).map_err(|problem| anyhow!("{file}: {}: {problem}", position(i, table))))
        .collect::<anyhow::Result<Vec<_>>>()?;

    let mut seen = BTreeSet::new();
    for d in &drafts {
        if !seen.insert(d.config.id.as_str()) {
            return Err(anyhow!("{file}: agents: two agents have the id {:?}", d.config.id));
        }
    }
    let defaults: Vec<&str> = drafts.iter().filter(|d| d.said_default).map(|d| d.config.id.as_str()).collect();
    if let [first, second, ..] = defaults[..] {
        return Err(anyhow!(
            "{file}: agents: two agents say default = true ({first:?} and {second:?}); at most one may"
        ));
    }
    let none_said = defaults.is_empty();

    drafts
        .into_iter()
        .enumerate()
        .map(|(i, d)| {
            let id = d.config.id.clone();
            finish(d, i == 0 && none_said, env).map_err(|problem| anyhow!("{file}: agent {id:?}: {problem}"))
        })
        .collect()
}

/// `agents[1] (id "ops")`, or `agents[1]` when it has no id as text. A long id is cut: this
/// labels an error line.
fn position(i: usize, table: &toml::Table) -> String {
    match table.get("id").and_then(toml::Value::as_str) {
        Some(id) if id.chars().count() > 64 => {
            format!("agents[{i}] (id {:?}…)", id.chars().take(64).collect::<String>())
        }
        Some(id) => format!("agents[{i}] (id {id:?})"),
        None => format!("agents[{i}]"),
    }
}

/// The first pass: one agent, alone. The error is `field: problem`.
fn draft(table: &toml::Table) -> Result<Draft, String> {
    // Before anything else, and with its own advice: a key written into the file is the mistake
    // this section is designed to prevent, and deny_unknown_fields would only say "unknown field".
    if let Some(path) = key_named("api_key", table, "") {
        return Err(format!(
            "{path}: a key is never written in keel.toml; put it in an environment variable and name that \
             variable with model.api_key_env"
        ));
    }
    let agent: AgentFile = serde_path_to_error::deserialize(toml::Value::Table(table.clone())).map_err(|e| {
        let path = e.path().to_string();
        let message = e.inner().message().trim();
        let message = serde_unknown_field(message).unwrap_or_else(|| message.to_owned());
        if path == "." {
            message
        } else {
            format!("{path}: {message}")
        }
    })?;

    let events_after = match agent.retention.and_then(|r| r.events_after) {
        None => None,
        Some(text) if text.trim() == "forever" => Some(None),
        Some(text) => {
            Some(Some(positive_duration(&text).map_err(|problem| format!("retention.events_after: {problem}"))?))
        }
    };
    let id = agent.id.ok_or("id: required")?;
    if !valid_id(&id) {
        return Err("id: must be 1 to 64 of a-z, 0-9, _ and -, starting with a letter or a digit".to_owned());
    }
    let name = match agent.name {
        Some(name) if name.trim().is_empty() => return Err("name: empty (leave it out to use the id)".to_owned()),
        Some(name) => name,
        None => id.clone(),
    };
    let system_prompt = match agent.system_prompt {
        Some(prompt) if !prompt.trim().is_empty() => prompt,
        Some(_) => return Err("system_prompt: empty".to_owned()),
        None => return Err("system_prompt: required".to_owned()),
    };
    let (model, api_key_env) = match agent.model {
        None => (None, None),
        Some(model) => {
            let (choice, key_env) = model_choice(model)?;
            (Some(choice), key_env)
        }
    };
    let positive = |field: &str, n: Option<usize>| match n {
        Some(0) => Err(format!("context.{field}: must be more than 0")),
        n => Ok(n),
    };
    let context = AgentContext {
        budget_tokens: positive("budget_tokens", agent.context.budget_tokens)?,
        summary_max_chars: positive("summary_max_chars", agent.context.summary_max_chars)?,
        tool_result_max_bytes: positive("tool_result_max_bytes", agent.context.tool_result_max_bytes)?,
    };
    check_suggestions(&agent.suggestions)?;
    Ok(Draft {
        config: AgentConfig {
            id,
            name,
            description: agent.description,
            system_prompt,
            default: agent.default,
            model,
            context,
            tools: Vec::new(),
            suggestions: agent.suggestions,
            events_after,
        },
        said_default: agent.default,
        api_key_env,
        tools: agent.tools,
    })
}

/// At most [`MAX_SUGGESTIONS`], each with some text and at most [`MAX_SUGGESTION_CHARS`]. A
/// suggestion is named by its index, not quoted: this is one line, and a suggestion may not be.
fn check_suggestions(suggestions: &[String]) -> Result<(), String> {
    if suggestions.len() > MAX_SUGGESTIONS {
        return Err(format!("suggestions: at most {MAX_SUGGESTIONS} ({} given)", suggestions.len()));
    }
    for (i, text) in suggestions.iter().enumerate() {
        let chars = text.chars().count();
        if text.trim().is_empty() {
            return Err(format!("suggestions[{i}]: empty"));
        }
        if chars > MAX_SUGGESTION_CHARS {
            return Err(format!("suggestions[{i}]: at most {MAX_SUGGESTION_CHARS} characters ({chars} given)"));
        }
    }
    Ok(())
}

/// `[agents.model]`, without its key (read in the second pass), and the variable that holds it.
fn model_choice(model: ModelFile) -> Result<(ModelChoice, Option<String>), String> {
    let kind = model.kind.ok_or(r#"model.kind: required, "demo" or "openai""#)?;
    if let ModelKind::Demo = kind {
        // The demo model takes none of these; one that is given is a mistake, not a no-op.
        let given = [
            ("base_url", model.base_url.is_some()),
            ("name", model.name.is_some()),
            ("api_key_env", model.api_key_env.is_some()),
            ("api_key_header", model.api_key_header.is_some()),
            ("temperature", model.temperature.is_some()),
            ("max_tokens", model.max_tokens.is_some()),
            ("connect_timeout", model.connect_timeout.is_some()),
            ("first_token_timeout", model.first_token_timeout.is_some()),
            ("idle_timeout", model.idle_timeout.is_some()),
            ("max_retries", model.max_retries.is_some()),
        ];
        if let Some((field, _)) = given.iter().find(|(_, given)| *given) {
            return Err(format!(r#"model.{field}: only for kind "openai""#));
        }
        return Ok((ModelChoice::Demo, None));
    }
    let required = |field: &str, value: Option<String>| match value {
        Some(v) if !v.trim().is_empty() => Ok(v),
        _ => Err(format!(r#"model.{field}: required for kind "openai""#)),
    };
    let base_url = required("base_url", model.base_url)?;
    if !(base_url.starts_with("http://") || base_url.starts_with("https://")) {
        return Err("model.base_url: must be an http:// or https:// URL".to_owned());
    }
    let name = required("name", model.name)?;
    if let Some(var) = &model.api_key_env {
        // Not repeated: someone may have pasted the key itself here.
        if !valid_variable(var) {
            return Err("model.api_key_env: must be the name of an environment variable (A-Z, 0-9 and _, \
                        e.g. OPS_MODEL_KEY), not the key itself"
                .to_owned());
        }
    }
    if model.temperature.is_some_and(|t| !t.is_finite() || t < 0.0) {
        return Err("model.temperature: must be a number of at least 0".to_owned());
    }
    if model.max_tokens == Some(0) {
        return Err("model.max_tokens: must be at least 1".to_owned());
    }
    let duration = |field: &str, text: Option<String>| -> Result<Option<Duration>, String> {
        text.map(|t| positive_duration(&t).map_err(|problem| format!("model.{field}: {problem}"))).transpose()
    };
    let parts = OpenAiParts {
        base_url,
        name,
        api_key_header: model.api_key_header,
        temperature: model.temperature,
        max_tokens: model.max_tokens,
        connect_timeout: duration("connect_timeout", model.connect_timeout)?,
        first_token_timeout: duration("first_token_timeout", model.first_token_timeout)?,
        idle_timeout: duration("idle_timeout", model.idle_timeout)?,
        max_retries: model.max_retries,
        ..OpenAiParts::default()
    };
    Ok((ModelChoice::OpenAi(Box::new(parts.build())), model.api_key_env))
}

/// The second pass: the key from the environment, the tools, the default. The error is
/// `field: problem`.
fn finish(mut d: Draft, first_by_default: bool, env: Env) -> Result<AgentConfig, String> {
    d.config.default = d.said_default || first_by_default;
    if let (Some(var), Some(ModelChoice::OpenAi(config))) = (&d.api_key_env, &mut d.config.model) {
        match env(var) {
            None => return Err(format!("model.api_key_env: the environment variable {var} is not set")),
            Some(key) if key.trim().is_empty() => {
                return Err(format!("model.api_key_env: the environment variable {var} is empty"))
            }
            Some(key) => config.api_key = Some(keel_models::ApiKey::new(key)),
        }
    }
    let mut tools = Vec::with_capacity(d.tools.len());
    for (j, table) in d.tools.into_iter().enumerate() {
        let text = |field: &str| table.get(field).and_then(toml::Value::as_str).filter(|s| !s.trim().is_empty());
        let Some(name) = text("name") else {
            return Err(format!("tools[{j}]: name: required, a non-empty string"));
        };
        let at = format!("tools[{j}] ({name:?})");
        let Some(kind) = text("kind") else {
            return Err(format!("{at}: kind: required, a non-empty string"));
        };
        let (name, kind) = (name.to_owned(), kind.to_owned());
        // Every field of the tool is checked here, at start, with its kind's rules (and the
        // environment variables its headers name): a mistake stops the server with one line. An MCP
        // server is started later, when the agent is built (`build_tools`).
        check_tool(&table, env).map_err(|e| format!("{at}: {e}"))?;
        tools.push(ToolConfig { name, kind, table });
    }
    // Named at the first of the two, which is where a reader of the file meets the name first.
    for (j, tool) in tools.iter().enumerate() {
        let uses = tools.iter().filter(|t| t.name == tool.name).count();
        if uses > 1 {
            let times = if uses == 2 { "twice".to_owned() } else { format!("{uses} times") };
            return Err(format!("tools[{j}] ({:?}): name: the tool name {:?} is used {times}", tool.name, tool.name));
        }
    }
    d.config.tools = tools;
    Ok(d.config)
}

fn parse_tool(table: &toml::Table) -> Result<keel_tools::ToolConfig, String> {
    toml::Value::Table(table.clone()).try_into().map_err(|e: toml::de::Error| {
        let message = e.message().trim().to_owned();
        serde_unknown_field(&message).unwrap_or(message)
    })
}

/// Checks a `[[agents.tools]]` table with its kind's rules (`keel-tools`), starting nothing; the
/// error is `field: problem`.
pub fn check_tool(table: &toml::Table, env: Env) -> Result<(), String> {
    keel_tools::check(&parse_tool(table)?, env).map_err(|e| e.to_string())
}

/// The tools a `[[agents.tools]]` table declares, built by its kind's crate (`keel-tools`): one, or
/// for an MCP server the tools it lists (the server is started here), and then `on_change` gets the
/// tools the table selects each time the server's list is read again
/// (`notifications/tools/list_changed`, a restart). The error is `field: problem`.
pub async fn build_tools_watched(
    table: &toml::Table,
    env: Env<'_>,
    on_change: keel_tools::OnToolsChanged,
) -> Result<Vec<std::sync::Arc<dyn keel_core::tool::Tool>>, String> {
    keel_tools::build_all_watched(&parse_tool(table)?, env, on_change).await.map_err(|e| e.to_string())
}

/// serde's ``unknown field `x`, expected one of `a`, `b` `` in the words the rest of the settings
/// use for it; `None` for any other message, which is then shown as it is.
fn serde_unknown_field(message: &str) -> Option<String> {
    let (name, expected) = message.strip_prefix("unknown field `")?.split_once('`')?;
    let known: Vec<&str> = expected.split('`').skip(1).step_by(2).collect();
    Some(super::layers::unknown_key(name, &known))
}

/// `[a-z0-9][a-z0-9_-]{0,63}`.
fn valid_id(id: &str) -> bool {
    let bytes = id.as_bytes();
    (1..=64).contains(&bytes.len())
        && matches!(bytes[0], b'a'..=b'z' | b'0'..=b'9')
        && bytes.iter().all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-'))
}

/// A variable name as the environment's conventions have it: `[A-Z_][A-Z0-9_]{0,127}`. Stricter
/// than a shell needs, on purpose: a key pasted here instead of a name (often lowercase hex or
/// base64, or long) fails this check, so the error about an unset variable never prints a key.
fn valid_variable(name: &str) -> bool {
    let mut bytes = name.bytes();
    name.len() <= 128
        && bytes.next().is_some_and(|b| b.is_ascii_uppercase() || b == b'_')
        && bytes.all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')
}

/// The path of the first key called `name` in `table` or the tables under it, the tools aside (a
/// tool's fields are keel-tools' to judge).
fn key_named(name: &str, table: &toml::Table, prefix: &str) -> Option<String> {
    for (key, value) in table {
        let path = if prefix.is_empty() { key.clone() } else { format!("{prefix}.{key}") };
        if key == name {
            return Some(path);
        }
        if prefix.is_empty() && key == "tools" {
            continue;
        }
        if let Some(found) = value.as_table().and_then(|t| key_named(name, t, &path)) {
            return Some(found);
        }
    }
    None
}
