//! The HTTP API, spoken over HTTP against the real server.

#[path = "../common/mod.rs"]
mod common;

mod ag_ui;
mod docs;
mod errors;
mod history;
mod hitl;
mod langgraph;
mod metrics;
mod security;
mod streams;
mod ws;
