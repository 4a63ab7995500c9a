//! Tools declared in keel.toml (`[[agents.tools]]`), built into [`keel_core::tool::Tool`]s.
//!
//! Two kinds: `http` (a call is one HTTP request carrying the call's idempotency key) and `client`
//! (a call the client runs and answers; Keel pauses the run for it). See docs/tools.md for the
//! fields, the headers sent and what each failure leads to.
//!
//! ```
//! let config: keel_tools::ToolConfig = toml::from_str(r#"
//!     kind = "http"
//!     name = "get_instance"
//!     description = "Reads one instance"
//!     method = "GET"
//!     url = "http://127.0.0.1:9000/instances/{id}"
//!     args_schema = { type = "object", properties = { id = { type = "string" } }, required = ["id"] }
//! "#).unwrap();
//! let tool = keel_tools::build(&config, &|_| None).unwrap();
//! assert_eq!(tool.spec().name, "get_instance");
//! assert!(!tool.spec().side_effect);
//! ```
#![forbid(unsafe_code)]

use std::sync::Arc;

use keel_core::tool::Tool;

mod client;
mod common;
mod config;
mod http;
mod template;

pub use client::ClientTool;
pub use config::{
    ClientToolConfig, CommonConfig, ConfirmConfig, HttpToolConfig, PolicyConfig, ToolConfig, ToolConfigError,
    SUPPORTED_KINDS,
};
pub use http::{HttpTool, DEFAULT_MAX_RESPONSE_BYTES};

/// Builds the tool a configuration declares: checks every field, compiles its schemas and resolves
/// its `${VAR}` references through `env` (the caller decides where variables come from; tests pass
/// a closure, the binary `std::env::var`). A bad field is an error naming it, here rather than at the
/// first call.
pub fn build(config: &ToolConfig, env: &dyn Fn(&str) -> Option<String>) -> Result<Arc<dyn Tool>, ToolConfigError> {
    match config {
        ToolConfig::Http(http) => Ok(Arc::new(HttpTool::new(http, env)?)),
        ToolConfig::Client(client) => Ok(Arc::new(ClientTool::new(client)?)),
    }
}
