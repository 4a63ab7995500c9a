//! What the tests share: a tool from a TOML snippet, and the context of one call.

#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::Arc;

use keel_core::tool::{Tool, ToolContext};
use keel_core::{CallId, ConversationId, RunId, UserRole};
use keel_tools::{ToolConfig, ToolConfigError};

/// The tool a `[[agents.tools]]` table declares, with `vars` as its environment.
pub fn build(toml_text: &str, vars: &[(&str, &str)]) -> Result<Arc<dyn Tool>, ToolConfigError> {
    let config: ToolConfig = toml::from_str(toml_text).expect("the test's TOML parses");
    let vars: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    keel_tools::build(&config, &move |name| vars.get(name).cloned())
}

pub fn tool(toml_text: &str) -> Arc<dyn Tool> {
    build(toml_text, &[]).unwrap_or_else(|e| panic!("{e}"))
}

/// The first attempt of a new call.
pub fn ctx() -> ToolContext {
    let call_id = CallId::new();
    ToolContext {
        idempotency_key: call_id.to_string(),
        call_id,
        attempt: 1,
        run_id: RunId::new(),
        conversation_id: ConversationId::new(),
        agent_id: "ops".to_owned(),
        user_id: "u1".to_owned(),
        role: Some(UserRole::Operator),
        now: chrono::Utc::now(),
    }
}

/// The next attempt of the same call: same key, same run.
pub fn again(ctx: &ToolContext) -> ToolContext {
    ToolContext { attempt: ctx.attempt + 1, now: chrono::Utc::now(), ..ctx.clone() }
}
