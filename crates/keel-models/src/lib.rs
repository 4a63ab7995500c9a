//! Model adapters: the offline [`DemoModel`] and [`OpenAiCompatible`], a streaming client for
//! OpenAI-compatible Chat Completions endpoints (OpenAI, Azure OpenAI, vLLM, Ollama, llama.cpp).
#![forbid(unsafe_code)]

pub mod demo;
pub mod openai;
pub mod sse;

pub use demo::DemoModel;
pub use openai::{ApiKey, OpenAiCompatible, OpenAiConfig, Usage};
