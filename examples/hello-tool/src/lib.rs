//! An agent of your own, on Keel's library API: one Rust tool (`count_letters`), its policy, a
//! model, a store — and the same HTTP API, durable runs, approvals and event streams as `keel`.
//!
//! The model here is [`CountingModel`], a few lines that call the tool and then answer with its
//! result, so the example runs offline; swap in `keel_models::OpenAiCompatible` for a real one.
#![forbid(unsafe_code)]

use std::sync::Arc;

use async_trait::async_trait;
use keel_core::model::{Model, ModelChunk, ModelError, ModelMessage, ModelRequest, ModelStream, ModelToolCall};
use keel_core::tool::{Policy, Tool, ToolContext, ToolError, ToolOutput, ToolSpec};
use keel_runtime::{Agent, Backend, Builder, Keel, KeelError, ToolRegistry};
use serde_json::{json, Value};

/// Counts the letters of a word. Read-only, so every role may run it without asking.
pub struct CountLetters(ToolSpec);

impl CountLetters {
    pub fn new() -> Self {
        let schema = json!({
            "type": "object",
            "properties": {"word": {"type": "string", "minLength": 1, "maxLength": 100}},
            "required": ["word"],
            "additionalProperties": false
        });
        Self(ToolSpec::new("count_letters", "Count the letters of a word.", schema, false).policy(Policy::Allow))
    }
}

impl Default for CountLetters {
    fn default() -> Self {
        Self::new()
    }
}

#[async_trait]
impl Tool for CountLetters {
    fn spec(&self) -> &ToolSpec {
        &self.0
    }

    async fn execute(&self, _ctx: &ToolContext, args: &Value) -> Result<ToolOutput, ToolError> {
        let word = args["word"].as_str().ok_or_else(|| ToolError::Invalid("word is required".into()))?;
        let letters = word.chars().filter(|c| c.is_alphabetic()).count();
        Ok(ToolOutput {
            result: json!({"word": word, "letters": letters}),
            summary: format!("{word}: {letters} letters"),
            facts: vec![],
        })
    }
}

/// A stand-in for a real model: "count the letters of WORD" calls the tool, then it answers with
/// the tool's result.
pub struct CountingModel;

#[async_trait]
impl Model for CountingModel {
    fn name(&self) -> &str {
        "counting"
    }

    async fn stream(&self, request: ModelRequest) -> Result<ModelStream, ModelError> {
        let last = request.messages.last();
        let chunks = match last {
            Some(ModelMessage::Tool { content, .. }) => {
                let result: Value = serde_json::from_str(content).unwrap_or_default();
                vec![ModelChunk::Text(format!(
                    "\"{}\" has {} letters.",
                    result["word"].as_str().unwrap_or("?"),
                    result["letters"]
                ))]
            }
            Some(ModelMessage::User { content }) => match content.rsplit(' ').next() {
                Some(word) if content.to_lowercase().starts_with("count the letters of") => {
                    vec![ModelChunk::ToolCall(ModelToolCall {
                        id: format!("call_{}", keel_core::RunId::new().as_str().trim_start_matches("run_")),
                        name: "count_letters".into(),
                        arguments: json!({"word": word}),
                    })]
                }
                _ => vec![ModelChunk::Text("Ask me to count the letters of a word.".into())],
            },
            _ => vec![ModelChunk::Text("Hello.".into())],
        };
        Ok(Box::pin(futures::stream::iter(chunks.into_iter().map(Ok))))
    }
}

/// The agent and its tool, over the database at `url` (`sqlite://…` or `postgres://…`).
pub async fn build(url: &str) -> Result<Keel, KeelError> {
    let backend = Backend::open(url).await?;
    let agent = Agent::new("letters", "Letter counter", Arc::new(CountingModel), "You count letters.")?
        .description("Counts the letters of a word with a Rust tool.")
        .tools(ToolRegistry::new().with(Arc::new(CountLetters::new())));
    Builder::new(backend).agent(agent).start().await
}
