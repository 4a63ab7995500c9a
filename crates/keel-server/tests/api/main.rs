//! The HTTP API, spoken over HTTP against the real server.

#[path = "../common/mod.rs"]
mod common;

mod docs;
mod errors;
mod hitl;
mod metrics;
mod streams;
