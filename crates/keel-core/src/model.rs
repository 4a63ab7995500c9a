//! The model contract: a stream of text deltas and tool calls.

use std::pin::Pin;
use std::sync::Arc;

use async_trait::async_trait;
use futures::Stream;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::domain::FactMap;
use crate::tool::ToolSpec;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelToolCall {
    /// The call id; Keel's `call_…` ids are handed back to the model as they are.
    pub id: String,
    pub name: String,
    pub arguments: Value,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "role", rename_all = "snake_case")]
pub enum ModelMessage {
    System { content: String },
    User { content: String },
    Assistant { content: String, tool_calls: Vec<ModelToolCall> },
    Tool { call_id: String, name: String, content: String },
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelRequest {
    pub messages: Vec<ModelMessage>,
    /// The tools the model may call, shared with the agent's registry.
    pub tools: Arc<[ToolSpec]>,
    /// The confirmed facts, also rendered into the system message; structured here for models that
    /// can use them directly.
    pub facts: FactMap,
}

#[derive(Debug, Clone, PartialEq)]
pub enum ModelChunk {
    Text(String),
    ToolCall(ModelToolCall),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelError {
    /// Worth another try (timeouts, 5xx, rate limits).
    #[error("model temporarily unavailable: {0}")]
    Transient(String),
    #[error("model error: {0}")]
    Fatal(String),
}

pub type ModelStream = Pin<Box<dyn Stream<Item = Result<ModelChunk, ModelError>> + Send>>;

#[async_trait]
pub trait Model: Send + Sync + 'static {
    fn name(&self) -> &str;
    async fn stream(&self, request: ModelRequest) -> Result<ModelStream, ModelError>;
}
