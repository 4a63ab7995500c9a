//! `kind = "client"`: a tool the client runs — a browser action, a local file, a question only the
//! user can answer. Keel never executes it: a call pauses the run on a `tool_call` interrupt (after
//! the tool's policy, so an `ask` tool shows its confirmation card first) and the client answers
//! `POST /v1/runs/{id}/tool-results` with the result, which is checked against `result_schema`.

use std::time::Duration;

use async_trait::async_trait;
use keel_core::tool::{ActionDescription, ClientSide, JsonSchema, Tool, ToolContext, ToolError, ToolOutput, ToolSpec};
use serde_json::Value;

use crate::common::{check_name, policies, Card};
use crate::config::{ClientToolConfig, CommonConfig, ToolConfigError};
use crate::template::schema_properties;

/// A tool whose calls the client answers.
#[derive(Debug)]
pub struct ClientTool {
    spec: ToolSpec,
    common: CommonConfig,
    card: Card,
    answer_within: Option<Duration>,
}

impl ClientTool {
    pub fn new(config: &ClientToolConfig) -> Result<Self, ToolConfigError> {
        let common = &config.common;
        check_name(&common.name)?;
        if config.args_schema.get("type").and_then(Value::as_str) != Some("object") {
            return Err(ToolConfigError::new("args_schema", "its top level must be type = \"object\""));
        }
        JsonSchema::compile(&config.args_schema).map_err(|e| ToolConfigError::new("args_schema", e.to_string()))?;
        if let Some(schema) = &config.result_schema {
            JsonSchema::compile(schema).map_err(|e| ToolConfigError::new("result_schema", e.to_string()))?;
        }
        let answer_within = match &config.timeout {
            None => None,
            Some(text) => {
                let d = humantime::parse_duration(text.trim()).map_err(|e| {
                    ToolConfigError::new("timeout", format!("{e}; write a duration such as \"10m\" or \"1h\""))
                })?;
                if d.is_zero() {
                    return Err(ToolConfigError::new("timeout", "must be more than 0"));
                }
                Some(d)
            }
        };
        let card = Card::parse(&common.confirm, &schema_properties(&config.args_schema))?;
        let side_effect = common.side_effect.unwrap_or(false);
        let mut spec = ToolSpec::new(&common.name, &common.description, config.args_schema.clone(), side_effect);
        spec.result_schema = config.result_schema.clone();
        spec.idempotent = common.idempotent.unwrap_or(!side_effect);
        spec.policies = policies(common.policy.as_ref(), side_effect)?;
        if let Some(d) = answer_within {
            spec.timeout = d;
        }
        Ok(Self { spec, common: common.clone(), card, answer_within })
    }
}

#[async_trait]
impl Tool for ClientTool {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    fn describe(&self, args: &Value) -> ActionDescription {
        self.card.describe(&self.common, args, || "This asks your client (the page or app you use) to run it.".into())
    }

    fn client_side(&self) -> Option<ClientSide> {
        Some(ClientSide { answer_within: self.answer_within })
    }

    async fn execute(&self, _ctx: &ToolContext, _args: &Value) -> Result<ToolOutput, ToolError> {
        // The engine hands client-side calls to the client; reaching this is a bug, told plainly.
        Err(ToolError::Failed(format!("{} runs on the client; Keel does not execute it", self.spec.name)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ToolConfig;

    fn build(toml_text: &str) -> Result<std::sync::Arc<dyn Tool>, ToolConfigError> {
        let config: ToolConfig = toml::from_str(toml_text).map_err(|e| ToolConfigError::new("toml", e.to_string()))?;
        crate::build(&config, &|_| None)
    }

    #[test]
    fn a_client_tool_is_built_with_its_schemas_and_policy() {
        let tool = build(
            r#"
            kind = "client"
            name = "ask_user"
            description = "Ask the user a question"
            timeout = "10m"
            policy = "allow"
            args_schema = { type = "object", properties = { question = { type = "string" } }, required = ["question"] }
            result_schema = { type = "object", properties = { answer = { type = "string" } }, required = ["answer"] }
            "#,
        )
        .unwrap();
        assert_eq!(tool.spec().name, "ask_user");
        assert!(!tool.spec().side_effect);
        assert_eq!(tool.client_side(), Some(ClientSide { answer_within: Some(Duration::from_secs(600)) }));
        assert!(tool.spec().result_schema.is_some());
    }

    #[test]
    fn mistakes_name_their_field() {
        let e = build(
            r#"
            kind = "client"
            name = "x"
            description = "d"
            args_schema = { type = "array" }
            "#,
        )
        .err()
        .unwrap();
        assert_eq!(e.field, "args_schema");
        let e = build(
            r#"
            kind = "client"
            name = "x"
            description = "d"
            timeout = "soon"
            args_schema = { type = "object" }
            "#,
        )
        .err()
        .unwrap();
        assert_eq!(e.field, "timeout");
        let e = build(
            r#"
            kind = "client"
            name = "x"
            description = "d"
            url = "http://example.com"
            args_schema = { type = "object" }
            "#,
        )
        .err()
        .unwrap();
        assert!(e.to_string().contains("url"), "{e}");
    }
}
