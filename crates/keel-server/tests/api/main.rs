//! The HTTP API, spoken over HTTP against the real server.

#[path = "../common/mod.rs"]
mod common;

mod docs;
mod errors;
mod history;
mod hitl;
mod metrics;
mod security;
mod streams;
