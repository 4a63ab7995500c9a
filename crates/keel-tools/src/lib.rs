//! Tools declared in keel.toml (`[[agents.tools]]`), built into [`keel_core::tool::Tool`]s.
//!
//! Three kinds: `http`, where a call is one HTTP request carrying the call's idempotency key;
//! `mcp`, where one table is an MCP server and yields the tools it lists ([`build_all`]); and
//! `client`, a call the client runs and answers (Keel pauses the run for it). See docs/tools.md for
//! the fields, the headers sent and what each failure leads to.
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
mod mcp;
mod template;

pub use client::ClientTool;
pub use config::{
    ClientToolConfig, CommonConfig, ConfirmConfig, HttpToolConfig, McpToolConfig, McpTransportConfig, PolicyConfig,
    ToolConfig, ToolConfigError, SUPPORTED_KINDS,
};
pub use http::{HttpTool, DEFAULT_MAX_RESPONSE_BYTES};
pub use mcp::{McpServer, McpServerConfig, McpTool, OnToolsChanged, IDEMPOTENCY_META_KEY, NAME_SEPARATOR};

/// Builds the tool a configuration declares: checks every field, compiles its schemas and resolves
/// its `${VAR}` references through `env` (the caller decides where variables come from; tests pass
/// a closure, the binary `std::env::var`). A bad field is an error naming it, here rather than at the
/// first call.
///
/// A table of kind `mcp` is many tools, known only once its server is started: it is refused here
/// (see [`check`] and [`build_all`]).
pub fn build(config: &ToolConfig, env: &dyn Fn(&str) -> Option<String>) -> Result<Arc<dyn Tool>, ToolConfigError> {
    match config {
        ToolConfig::Http(http) => Ok(Arc::new(HttpTool::new(http, env)?)),
        ToolConfig::Client(client) => Ok(Arc::new(ClientTool::new(client)?)),
        ToolConfig::Mcp(_) => Err(ToolConfigError::new(
            "kind",
            "an mcp table is as many tools as its server lists; build it with keel_tools::build_all",
        )),
    }
}

/// Checks every field of a table, as [`build`] does, without starting anything: an MCP server is
/// not run, its variables are resolved.
pub fn check(config: &ToolConfig, env: &dyn Fn(&str) -> Option<String>) -> Result<(), ToolConfigError> {
    match config {
        ToolConfig::Http(http) => HttpTool::new(http, env).map(drop),
        ToolConfig::Client(client) => ClientTool::new(client).map(drop),
        ToolConfig::Mcp(mcp) => McpServerConfig::new(mcp, env).map(drop),
    }
}

/// The tools a table declares: one for `http` and `client`; for `mcp`, the tools its server lists
/// (the server is started here, and kept running by a task of its own — call this inside a Tokio
/// runtime). A server that cannot be started or does not list its tools is an error naming
/// `command` or `url`.
pub async fn build_all(
    config: &ToolConfig,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Vec<Arc<dyn Tool>>, ToolConfigError> {
    match config {
        ToolConfig::Http(_) | ToolConfig::Client(_) => Ok(vec![build(config, env)?]),
        ToolConfig::Mcp(mcp) => {
            let server = McpServerConfig::new(mcp, env)?;
            McpServer::start(server).await
        }
    }
}

/// [`build_all`], and for an `mcp` table `on_change` is given the tools the table selects each time
/// its server's tools are listed again (see [`McpServer::start_watched`]). The tools of an `http`
/// or `client` table never change: `on_change` is dropped unused.
pub async fn build_all_watched(
    config: &ToolConfig,
    env: &dyn Fn(&str) -> Option<String>,
    on_change: OnToolsChanged,
) -> Result<Vec<Arc<dyn Tool>>, ToolConfigError> {
    match config {
        ToolConfig::Http(_) | ToolConfig::Client(_) => Ok(vec![build(config, env)?]),
        ToolConfig::Mcp(mcp) => {
            let server = McpServerConfig::new(mcp, env)?;
            McpServer::start_watched(server, on_change).await
        }
    }
}
