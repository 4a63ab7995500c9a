//! MCP tools: one `kind = "mcp"` table is one MCP server, and the agent offers the tools the server
//! lists, each as `<server>__<tool>`.
//!
//! The server is reached with the official SDK (`rmcp`): a child process over stdio, supervised
//! (restarted with backoff when it exits), or a Streamable HTTP endpoint. Its tools are listed when
//! the agent is built; a server that cannot be started or listed then stops Keel with an error
//! naming the agent and the table. They are listed again when the server sends
//! `notifications/tools/list_changed` and after each restart, and the new list goes to the
//! `on_change` given to [`McpServer::start_watched`] (Keel gives the agent its new tools). While the
//! server is down, a call fails at once with [`ToolError::Unreachable`] (nothing was sent) instead
//! of waiting.
//!
//! A call that was sent and got no answer (the server died, the HTTP connection broke, the timeout
//! passed) may have been applied: it is [`ToolError::OutcomeUnknown`] or [`ToolError::Timeout`], and
//! the engine retries it only for a tool the server marks `idempotentHint` (or `readOnlyHint`). A
//! call given up (the timeout, or the engine dropping it) sends `notifications/cancelled`: rmcp
//! sends it when a request's future is dropped.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use keel_core::mask;
use keel_core::tool::{ActionDescription, Policy, Tool, ToolContext, ToolError, ToolOutput, ToolSpec};
use keel_core::UserRole;
use reqwest::header::{HeaderName, HeaderValue};
use rmcp::model::{CallToolRequestParams, ClientConfig, MetaObject, RequestMetaObject};
use rmcp::service::{NotificationContext, RunningService, RunningServiceCancellationToken};
use rmcp::transport::{StreamableHttpClientTransport, TokioChildProcess};
use rmcp::{ClientHandler, Peer, RoleClient, ServiceError, ServiceExt};
use serde_json::{Map, Value};

use crate::common::{
    check_name, interpolate, parse_max_response_bytes, parse_timeout, resolve_headers, scrub, scrub_error, tidy_secrets,
};
use crate::config::{McpToolConfig, McpTransportConfig, ToolConfigError};

/// Between the server's name and its tool's in the names the model sees.
pub const NAME_SEPARATOR: &str = "__";
/// How long connecting and listing the tools may take, at start and on each restart.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
/// The first wait before a stopped server is started again; it doubles up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(200);
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// A server that ran this long before stopping starts again after [`FIRST_BACKOFF`].
const STABLE_AFTER: Duration = Duration::from_secs(60);
/// How much of a tool's error text the model is shown.
const ERROR_TEXT_CHARS: usize = 1000;
/// The variables of Keel's own environment a stdio server also gets: what a program needs to be
/// found and to run (`node`, `python`), nothing that may hold a secret.
const INHERITED_VARS: &[&str] = &["PATH", "HOME", "TMPDIR", "LANG", "LC_ALL", "TZ"];
/// Headers the transport sets itself.
const RESERVED_HEADERS: &[&str] = &[
    "accept",
    "content-type",
    "content-length",
    "transfer-encoding",
    "host",
    "connection",
    "mcp-session-id",
    "mcp-protocol-version",
    "last-event-id",
];
/// The `_meta` key under which each call carries its idempotency key (the call's id, the same on
/// every attempt), for a server that deduplicates.
pub const IDEMPOTENCY_META_KEY: &str = "keel.dev/idempotencyKey";

/// A `kind = "mcp"` table, checked and resolved, not started. See [`McpServer::start`].
pub struct McpServerConfig {
    name: String,
    transport: Transport,
    timeout: Duration,
    max_response_bytes: usize,
    allow: Vec<Pattern>,
    ask: Vec<Pattern>,
    deny: Vec<Pattern>,
    /// Every environment and header value, kept out of messages.
    secrets: Vec<String>,
}

enum Transport {
    Stdio { command: String, args: Vec<String>, env: Vec<(String, String)> },
    Http { url: String, headers: HashMap<HeaderName, HeaderValue> },
}

impl std::fmt::Debug for McpServerConfig {
    // Environment and header values are secrets: only their names are shown.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("McpServerConfig");
        d.field("name", &self.name);
        match &self.transport {
            Transport::Stdio { command, env, .. } => {
                d.field("command", command).field("env", &env.iter().map(|(k, _)| k).collect::<Vec<_>>())
            }
            Transport::Http { url, headers } => d
                .field("url", &mask::mask_text(url))
                .field("headers", &headers.keys().map(HeaderName::as_str).collect::<Vec<_>>()),
        };
        d.field("timeout", &self.timeout).field("max_response_bytes", &self.max_response_bytes).finish()
    }
}

/// A tool name pattern: `*` matches any run of characters, anything else itself.
#[derive(Debug, Clone)]
struct Pattern(String);

impl Pattern {
    fn parse(field: &str, text: &str) -> Result<Self, ToolConfigError> {
        let ok = !text.is_empty()
            && text.len() <= 128
            && text.bytes().all(|b| b == b'*' || b.is_ascii_graphic() && b != b'"' && b != b'\\');
        if ok {
            Ok(Self(text.to_owned()))
        } else {
            Err(ToolConfigError::new(
                field,
                format!(
                    "{:?} is not a tool name pattern: 1 to 128 printable characters, * for any run of them",
                    mask::truncate(text, 40)
                ),
            ))
        }
    }

    fn matches(&self, name: &str) -> bool {
        let mut parts = self.0.split('*');
        let first = parts.next().unwrap_or("");
        let Some(mut rest) = name.strip_prefix(first) else { return false };
        let parts: Vec<&str> = parts.collect();
        let Some((last, middle)) = parts.split_last() else { return rest.is_empty() };
        for part in middle {
            match rest.find(part) {
                Some(i) => rest = &rest[i + part.len()..],
                None => return false,
            }
        }
        rest.len() >= last.len() && rest.ends_with(last)
    }
}

impl McpServerConfig {
    /// Checks a table and resolves its `${VAR}`s through `env`; nothing is started. What
    /// [`crate::check`] does for an MCP table, at the time Keel reads its settings.
    pub fn new(config: &McpToolConfig, env: &dyn Fn(&str) -> Option<String>) -> Result<Self, ToolConfigError> {
        check_name(&config.name)?;
        // The shortest tool name must still fit the registry's 64 characters.
        if config.name.len() + NAME_SEPARATOR.len() >= 64 {
            return Err(ToolConfigError::new(
                "name",
                "too long for a prefix: the tools are offered as <name>__<tool>, at most 64 characters",
            ));
        }
        let mut secrets = Vec::new();
        let transport = match &config.transport {
            McpTransportConfig::Stdio { command, args, env: vars } => {
                if command.trim().is_empty() {
                    return Err(ToolConfigError::new("command", "empty; name the program that runs the server"));
                }
                let mut resolved = Vec::new();
                for (name, template) in vars {
                    let field = format!("env.{}", mask::truncate(name, 64));
                    let valid = name.bytes().next().is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
                        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
                    if !valid {
                        return Err(ToolConfigError::new(
                            &field,
                            "not a variable name: letters, digits and _, not starting with a digit",
                        ));
                    }
                    let value = interpolate(&field, template, env, &mut secrets)?;
                    secrets.push(value.clone());
                    resolved.push((name.clone(), value));
                }
                Transport::Stdio { command: command.clone(), args: args.clone(), env: resolved }
            }
            McpTransportConfig::Http { url, headers } => {
                let parsed = reqwest::Url::parse(url.trim())
                    .map_err(|e| ToolConfigError::new("url", format!("not a valid URL: {e}")))?;
                if !matches!(parsed.scheme(), "http" | "https") {
                    return Err(ToolConfigError::new("url", "the scheme must be http or https"));
                }
                if !parsed.username().is_empty() || parsed.password().is_some() {
                    return Err(ToolConfigError::new(
                        "url",
                        "credentials in the URL are not allowed; send them in a header, e.g. \
                         headers = { Authorization = \"Bearer ${TOKEN}\" }",
                    ));
                }
                let resolved = resolve_headers(
                    headers,
                    RESERVED_HEADERS,
                    "the MCP transport sets this header; remove it",
                    env,
                    &mut secrets,
                )?;
                let resolved: HashMap<HeaderName, HeaderValue> =
                    resolved.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
                Transport::Http { url: parsed.to_string(), headers: resolved }
            }
        };
        let timeout = parse_timeout(config.timeout.as_deref())?;
        let max_response_bytes = parse_max_response_bytes(config.max_response_bytes)?;
        let patterns = |field: &str, list: &[String]| -> Result<Vec<Pattern>, ToolConfigError> {
            list.iter().enumerate().map(|(i, p)| Pattern::parse(&format!("{field}[{i}]"), p)).collect()
        };
        tidy_secrets(&mut secrets);
        Ok(Self {
            name: config.name.clone(),
            transport,
            timeout,
            max_response_bytes,
            allow: patterns("allow", &config.allow)?,
            ask: patterns("ask", &config.ask)?,
            deny: patterns("deny", &config.deny)?,
            secrets,
        })
    }

    /// `text` without any environment or header value of this server.
    fn scrub(&self, text: &str) -> String {
        mask::mask_text(&scrub(&self.secrets, text.to_owned()))
    }

    /// What the server is, for messages: its command or its host, never an argument or a header.
    fn label(&self) -> String {
        match &self.transport {
            Transport::Stdio { command, .. } => {
                format!("the MCP server {} ({})", self.name, mask::truncate(command, 80))
            }
            Transport::Http { url, .. } => {
                let host = reqwest::Url::parse(url).ok().and_then(|u| u.host_str().map(str::to_owned));
                format!("the MCP server {} (at {})", self.name, host.unwrap_or_default())
            }
        }
    }

    /// Starts the server (or opens the HTTP session), says hello and returns the peer, with the
    /// running service that owns the transport.
    async fn connect(&self, handler: Handler) -> Result<RunningService<RoleClient, Handler>, String> {
        let started = match &self.transport {
            Transport::Stdio { command, args, env } => {
                let mut cmd = tokio::process::Command::new(command);
                cmd.args(args).env_clear();
                for var in INHERITED_VARS {
                    if let Some(value) = std::env::var_os(var) {
                        cmd.env(var, value);
                    }
                }
                cmd.envs(env.iter().map(|(k, v)| (k, v)));
                // The server's own log lines go where Keel's go.
                let (transport, _) = TokioChildProcess::builder(cmd)
                    .stderr(std::process::Stdio::inherit())
                    .spawn()
                    .map_err(|e| format!("could not run {}: {e}", mask::truncate(command, 80)))?;
                tokio::time::timeout(CONNECT_TIMEOUT, handler.serve(transport)).await
            }
            Transport::Http { url, headers } => {
                install_tls_provider();
                let config = rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig::with_uri(
                    url.as_str(),
                )
                .custom_headers(headers.clone());
                let transport = StreamableHttpClientTransport::from_config(config);
                tokio::time::timeout(CONNECT_TIMEOUT, handler.serve(transport)).await
            }
        };
        match started {
            Err(_) => Err(format!("no answer to initialize within {}", humantime::format_duration(CONNECT_TIMEOUT))),
            Ok(Err(e)) => Err(self.scrub(&mask::truncate(&format!("the MCP handshake failed: {e}"), 500))),
            Ok(Ok(running)) => Ok(running),
        }
    }
}

/// rmcp's HTTP client (reqwest 0.13, built without a TLS provider of its own) uses the process's
/// default rustls provider: ring, the one Keel's other HTTP clients use.
fn install_tls_provider() {
    // Already installed (by an earlier server, or by the program): that one stays.
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// The client side of the session: lists the tools again when the server says they changed.
#[derive(Clone)]
struct Handler {
    server: String,
    /// The started server, once there is one (the first session's handshake comes before it).
    started: Arc<OnceLock<Weak<McpServer>>>,
}

impl ClientHandler for Handler {
    fn on_tool_list_changed(
        &self,
        context: NotificationContext<RoleClient>,
    ) -> impl std::future::Future<Output = ()> + Send + '_ {
        tracing::info!(server = %self.server, "the MCP server's tool list changed; listing it again");
        if let Some(server) = self.started.get().and_then(Weak::upgrade) {
            // Not on the session's own task, which must go on reading the answer.
            tokio::spawn(server.relist(context.peer));
        }
        std::future::ready(())
    }

    fn get_info(&self) -> ClientConfig {
        let mut info = ClientConfig::default();
        info.client_info.name = "keel".to_owned();
        info.client_info.version = env!("CARGO_PKG_VERSION").to_owned();
        info
    }
}

/// What a watched server's owner is given each time the server's tools are listed again: the tools
/// the table selects from the new list.
pub type OnToolsChanged = Box<dyn Fn(Vec<Arc<dyn Tool>>) + Send + Sync>;

/// What a call finds: the server's session, or why there is none.
enum Link {
    Up {
        /// Counts the sessions, so that a call ends only the one it failed on.
        session: u64,
        peer: Peer<RoleClient>,
        /// Ends the session (then the supervisor opens a new one); taken when used.
        stop: Option<RunningServiceCancellationToken>,
    },
    Down(String),
}

/// A started MCP server, shared by its tools, and kept running by a task of its own.
pub struct McpServer {
    config: McpServerConfig,
    link: Mutex<Link>,
    on_change: Option<OnToolsChanged>,
    /// Held while the tools are listed again and handed over, so that two listings (a
    /// notification, a restart) hand over their lists in the order they read them: the newest wins.
    relisting: tokio::sync::Mutex<()>,
}

impl std::fmt::Debug for McpServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("McpServer").field("config", &self.config).finish()
    }
}

impl McpServer {
    /// Starts the server, lists its tools and returns those the table selects, each a [`Tool`].
    /// From then on a task restarts the server whenever it stops, until every tool is dropped.
    pub async fn start(config: McpServerConfig) -> Result<Vec<Arc<dyn Tool>>, ToolConfigError> {
        Self::start_with(config, None).await
    }

    /// [`McpServer::start`], and `on_change` is given the tools the table selects each time they
    /// are listed again: when the server sends `notifications/tools/list_changed`, and after it was
    /// started again. A listing that fails leaves the tools as they were (and is logged).
    pub async fn start_watched(
        config: McpServerConfig,
        on_change: OnToolsChanged,
    ) -> Result<Vec<Arc<dyn Tool>>, ToolConfigError> {
        Self::start_with(config, Some(on_change)).await
    }

    async fn start_with(
        config: McpServerConfig,
        on_change: Option<OnToolsChanged>,
    ) -> Result<Vec<Arc<dyn Tool>>, ToolConfigError> {
        let handler = Handler { server: config.name.clone(), started: Arc::new(OnceLock::new()) };
        let field = match config.transport {
            Transport::Stdio { .. } => "command",
            Transport::Http { .. } => "url",
        };
        let fail = |message: String| ToolConfigError::new(field, message);
        let running = config.connect(handler.clone()).await.map_err(|m| fail(format!("{}: {m}", config.label())))?;
        let listed = match tokio::time::timeout(CONNECT_TIMEOUT, running.peer().list_all_tools()).await {
            Err(_) => return Err(fail(format!("{}: no answer to tools/list", config.label()))),
            Ok(Err(e)) => {
                return Err(fail(
                    config.scrub(&mask::truncate(&format!("{}: tools/list failed: {e}", config.label()), 500)),
                ))
            }
            Ok(Ok(tools)) => tools,
        };
        let link = Link::Up { session: 0, peer: running.peer().clone(), stop: Some(running.cancellation_token()) };
        let server =
            Arc::new(McpServer { link: Mutex::new(link), config, on_change, relisting: tokio::sync::Mutex::new(()) });
        let _ = handler.started.set(Arc::downgrade(&server));
        let tools = server.select(listed);
        if tools.is_empty() {
            // Nothing would ever call it: the server is stopped (dropping its session ends it).
            tracing::warn!(server = %server.config.name, "the MCP server offers no tool this table selects");
            return Ok(tools);
        }
        tokio::spawn(supervise(Arc::downgrade(&server), running, handler));
        Ok(tools)
    }

    /// The tools the table selects from a `tools/list` answer, each a [`Tool`] on this server.
    fn select(self: &Arc<Self>, listed: Vec<rmcp::model::Tool>) -> Vec<Arc<dyn Tool>> {
        let server = self;
        let mut tools: Vec<Arc<dyn Tool>> = Vec::new();
        for listed in listed {
            let remote = listed.name.to_string();
            let offered = format!("{}{NAME_SEPARATOR}{remote}", server.config.name);
            if server.config.deny.iter().any(|p| p.matches(&remote)) {
                continue;
            }
            if check_name(&offered).is_err() {
                tracing::warn!(server = %server.config.name, tool = %mask::truncate(&remote, 80),
                    "an MCP tool whose name cannot be offered (more than 64 characters, or not A-Z a-z 0-9 _ -) is left out");
                continue;
            }
            let annotations = listed.annotations.clone().unwrap_or_default();
            let read_only = annotations.read_only_hint == Some(true);
            let side_effect = !read_only;
            let policy = if server.config.ask.iter().any(|p| p.matches(&remote)) {
                Some(Policy::Ask)
            } else if server.config.allow.iter().any(|p| p.matches(&remote)) {
                Some(Policy::Allow)
            } else {
                None
            };
            let policies = match policy {
                Some(policy) => UserRole::ALL.iter().map(|r| (*r, policy)).collect(),
                None => ToolSpec::new("", "", Value::Null, side_effect).policies,
            };
            let description = listed
                .description
                .as_deref()
                .map(str::to_owned)
                .or_else(|| listed.title.clone())
                .unwrap_or_else(|| format!("The tool {remote} of the MCP server {}.", server.config.name));
            let parameters = Value::Object((*listed.input_schema).clone());
            if let Err(e) = keel_core::tool::JsonSchema::compile(&parameters) {
                // One tool Keel cannot check the arguments of is left out, not the whole server.
                tracing::warn!(server = %server.config.name, tool = %mask::truncate(&remote, 80), error = %e,
                    "an MCP tool whose input schema Keel cannot compile is left out");
                continue;
            }
            let spec = ToolSpec {
                name: offered,
                description,
                parameters,
                result_schema: None,
                side_effect,
                idempotent: read_only || annotations.idempotent_hint == Some(true),
                policies,
                timeout: server.config.timeout,
            };
            tools.push(Arc::new(McpTool { spec, remote, server: server.clone() }));
        }
        tools
    }

    /// Lists the tools again on `peer` and hands what the table selects to `on_change`, if any.
    async fn relist(self: Arc<Self>, peer: Peer<RoleClient>) {
        let Some(on_change) = &self.on_change else { return };
        let _one_at_a_time = self.relisting.lock().await;
        match tokio::time::timeout(CONNECT_TIMEOUT, peer.list_all_tools()).await {
            Ok(Ok(listed)) => {
                let tools = self.select(listed);
                tracing::info!(server = %self.config.name, tools = tools.len(), "the MCP server's tools were listed again");
                on_change(tools);
            }
            Ok(Err(e)) => {
                let why = self.config.scrub(&mask::truncate(&e.to_string(), 300));
                tracing::warn!(server = %self.config.name, error = %why, "listing the MCP server's tools again failed; they stay as they were");
            }
            Err(_) => {
                tracing::warn!(server = %self.config.name, "no answer to tools/list; the tools stay as they were");
            }
        }
    }

    /// The session a call is sent on, and its number.
    fn peer(&self) -> Result<(u64, Peer<RoleClient>), ToolError> {
        let link = self.link.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        match &*link {
            Link::Up { session, peer, .. } if !peer.is_transport_closed() => Ok((*session, peer.clone())),
            Link::Up { .. } => {
                Err(ToolError::Unreachable(format!("{} has stopped; it is being restarted", self.config.label())))
            }
            Link::Down(why) => Err(ToolError::Unreachable(format!("{} is not running: {why}", self.config.label()))),
        }
    }

    fn set(&self, link: Link) {
        *self.link.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = link;
    }

    /// Ends `session` after its transport failed, so that the supervisor opens a new one: a
    /// Streamable HTTP session whose server went away does not end by itself.
    fn end_session(&self, failed: u64) {
        let mut link = self.link.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Link::Up { session, stop, .. } = &mut *link {
            if *session == failed {
                if let Some(stop) = stop.take() {
                    stop.cancel();
                }
            }
        }
    }
}

/// Waits for the session to end, then starts the server again, with backoff; ends when the
/// server's tools are gone.
async fn supervise(server: Weak<McpServer>, mut running: RunningService<RoleClient, Handler>, handler: Handler) {
    let mut backoff = FIRST_BACKOFF;
    let mut session = 0;
    loop {
        let up_since = Instant::now();
        let reason = match running.waiting().await {
            Ok(reason) => format!("{reason:?}"),
            Err(e) => format!("its session task failed: {e}"),
        };
        let Some(alive) = server.upgrade() else { return };
        let why = alive.config.scrub(&format!("it stopped ({})", mask::truncate(&reason, 200)));
        tracing::warn!(server = %alive.config.name, reason = %why, "the MCP server stopped; starting it again");
        alive.set(Link::Down(why));
        drop(alive);
        if up_since.elapsed() >= STABLE_AFTER {
            backoff = FIRST_BACKOFF;
        }
        loop {
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(MAX_BACKOFF);
            let Some(alive) = server.upgrade() else { return };
            match alive.config.connect(handler.clone()).await {
                Ok(next) => {
                    tracing::info!(server = %alive.config.name, "the MCP server is running again");
                    session += 1;
                    alive.set(Link::Up { session, peer: next.peer().clone(), stop: Some(next.cancellation_token()) });
                    // A server started again may list other tools than it did.
                    tokio::spawn(alive.clone().relist(next.peer().clone()));
                    running = next;
                    break;
                }
                Err(e) => {
                    tracing::warn!(server = %alive.config.name, error = %e, "the MCP server could not be started again");
                    alive.set(Link::Down(format!("the last start failed: {e}")));
                }
            }
        }
    }
}

/// One tool of an MCP server, as the agent offers it.
pub struct McpTool {
    spec: ToolSpec,
    /// The server's name for it.
    remote: String,
    server: Arc<McpServer>,
}

impl std::fmt::Debug for McpTool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("McpTool")
            .field("name", &self.spec.name)
            .field("server", &self.server.config.name)
            .field("side_effect", &self.spec.side_effect)
            .field("idempotent", &self.spec.idempotent)
            .finish()
    }
}

impl McpTool {
    async fn call(&self, ctx: &ToolContext, args: &Value) -> Result<ToolOutput, ToolError> {
        let Some(arguments) = args.as_object() else {
            return Err(ToolError::Invalid("the arguments must be a JSON object".to_owned()));
        };
        let (session, peer) = self.server.peer()?;
        let mut meta = Map::new();
        meta.insert(IDEMPOTENCY_META_KEY.to_owned(), Value::String(ctx.idempotency_key.clone()));
        let mut params = CallToolRequestParams::new(self.remote.clone()).with_arguments(arguments.clone());
        params.meta = Some(RequestMetaObject(MetaObject(meta)));
        let label = self.server.config.label();
        // Dropping the call (here at the timeout, or the engine dropping this future) makes rmcp
        // send notifications/cancelled for it.
        let result = match tokio::time::timeout(self.spec.timeout, peer.call_tool(params)).await {
            Err(_) => {
                return Err(ToolError::Timeout(format!(
                    "no answer from {label} to {} within {}; the call was cancelled",
                    self.remote,
                    humantime::format_duration(self.spec.timeout)
                )))
            }
            Ok(Err(e)) => {
                if matches!(e, ServiceError::TransportClosed | ServiceError::TransportSend(_)) {
                    self.server.end_session(session);
                }
                return Err(self.service_error(e, &label));
            }
            Ok(Ok(result)) => result,
        };
        let result = serde_json::to_value(&result)
            .map_err(|e| ToolError::BadResponse(format!("the answer of {label} could not be read: {e}")))?;
        let content = result.get("content").and_then(Value::as_array).cloned().unwrap_or_default();
        if result.get("isError").and_then(Value::as_bool) == Some(true) {
            let text = mask::truncate(&text_of(&content), ERROR_TEXT_CHARS);
            return Err(ToolError::Failed(if text.is_empty() {
                format!("{} failed (the server gave no message)", self.remote)
            } else {
                format!("{} failed: {text}", self.remote)
            }));
        }
        let value = match result.get("structuredContent") {
            Some(structured) => structured.clone(),
            None => content_value(content),
        };
        let size = serde_json::to_vec(&value).map(|v| v.len()).unwrap_or(usize::MAX);
        if size > self.server.config.max_response_bytes {
            return Err(ToolError::TooLarge { limit: self.server.config.max_response_bytes });
        }
        Ok(ToolOutput {
            result: value,
            summary: format!("{}: {} → ok", self.server.config.name, self.remote),
            facts: Vec::new(),
        })
    }

    fn service_error(&self, e: ServiceError, label: &str) -> ToolError {
        match e {
            // A JSON-RPC error: the server answered, and refused (an unknown tool, bad arguments).
            ServiceError::McpError(error) => ToolError::Invalid(format!(
                "{label} refused {}: {}",
                self.remote,
                mask::truncate(&error.message, ERROR_TEXT_CHARS)
            )),
            ServiceError::Timeout { .. } => ToolError::Timeout(format!("no answer from {label} to {}", self.remote)),
            ServiceError::TransportClosed | ServiceError::TransportSend(_) => ToolError::OutcomeUnknown(format!(
                "{label} stopped before it answered {}: the call may have been applied; the server is being \
                 restarted",
                self.remote
            )),
            other => ToolError::OutcomeUnknown(format!(
                "{label} did not answer {}: {}",
                self.remote,
                mask::truncate(&other.to_string(), 300)
            )),
        }
    }

    fn scrub_error(&self, e: ToolError) -> ToolError {
        scrub_error(e, |m| self.server.config.scrub(&m))
    }
}

/// The text blocks of a result, joined.
fn text_of(content: &[Value]) -> String {
    content.iter().filter_map(|block| block.get("text").and_then(Value::as_str)).collect::<Vec<_>>().join("\n")
}

/// What the model sees of a result without structured content: its text, when it is all text;
/// otherwise the blocks, with images and audio replaced by their type and size (the model cannot
/// read base64, and it would fill the context).
fn content_value(content: Vec<Value>) -> Value {
    let all_text = content.iter().all(|b| b.get("type").and_then(Value::as_str) == Some("text"));
    if all_text {
        return Value::String(text_of(&content));
    }
    Value::Array(
        content
            .into_iter()
            .map(|mut block| {
                if let Some(obj) = block.as_object_mut() {
                    if let Some(Value::String(data)) = obj.remove("data") {
                        obj.insert("omittedBytes".to_owned(), Value::from(data.len() / 4 * 3));
                    }
                }
                block
            })
            .collect(),
    )
}

#[async_trait]
impl Tool for McpTool {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    fn describe(&self, args: &Value) -> ActionDescription {
        ActionDescription {
            title: format!("Run {}?", self.spec.name),
            risk: format!(
                "This calls the tool {} of {}, which may change the system.",
                self.remote,
                self.server.config.label()
            ),
            description: mask::truncate(&format!("{} {}", self.spec.name, mask::mask_value(args)), 1000),
        }
    }

    async fn execute(&self, ctx: &ToolContext, args: &Value) -> Result<ToolOutput, ToolError> {
        let started = std::time::Instant::now();
        let outcome = self.call(ctx, args).await.map_err(|e| self.scrub_error(e));
        let elapsed_ms = started.elapsed().as_millis() as u64;
        match &outcome {
            Ok(_) => tracing::debug!(tool = %self.spec.name, elapsed_ms, "mcp tool call"),
            Err(e) => {
                tracing::debug!(tool = %self.spec.name, error_code = %e.code(), elapsed_ms, "mcp tool call failed")
            }
        }
        outcome
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns() {
        let p = |s: &str| Pattern::parse("allow[0]", s).unwrap();
        assert!(p("*").matches("anything"));
        assert!(p("get_*").matches("get_sum"));
        assert!(p("get_*").matches("get_"));
        assert!(!p("get_*").matches("set_sum"));
        assert!(p("*_sum").matches("get_sum"));
        assert!(!p("*_sum").matches("get_sums"));
        assert!(p("a*b*c").matches("axxbyyc"));
        assert!(!p("a*b*c").matches("axxcyyb"));
        assert!(p("echo").matches("echo"));
        assert!(!p("echo").matches("echo2"));
        assert!(p("a*a").matches("aa"));
        assert!(!p("a*a").matches("a"));
        assert!(Pattern::parse("deny[1]", "").is_err());
        assert!(Pattern::parse("deny[1]", "a b").is_err());
    }

    #[test]
    fn content_without_structure() {
        let text =
            vec![serde_json::json!({"type": "text", "text": "a"}), serde_json::json!({"type": "text", "text": "b"})];
        assert_eq!(content_value(text), Value::String("a\nb".to_owned()));
        let image = vec![serde_json::json!({"type": "image", "data": "AAAA", "mimeType": "image/png"})];
        assert_eq!(content_value(image)[0]["omittedBytes"], 3);
    }
}
