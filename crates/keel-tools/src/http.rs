//! The HTTP tool: one call is one HTTP request, sent with the call's idempotency key.
//!
//! Each way a request can fail is its own [`ToolError`] kind, because the engine decides by the kind
//! whether to try again with the same key, ask a human, or tell the model (see
//! [`ToolError::next`]). The line that matters most is between "the request never left"
//! (`Unreachable`: safe to send again) and "it left and the answer was lost" (`Timeout`,
//! `OutcomeUnknown`: it may have been applied).

use std::collections::BTreeSet;
use std::time::Duration;

use async_trait::async_trait;
use keel_core::mask;
use keel_core::tool::{ActionDescription, JsonSchema, Tool, ToolContext, ToolError, ToolOutput, ToolSpec};
use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use reqwest::header::{HeaderMap, HeaderName, HeaderValue, ACCEPT};
use reqwest::{Method, StatusCode, Url};
use serde_json::{Map, Value};
use tokio::time::{timeout_at, Instant};

use crate::common::{
    check_name, parse_max_response_bytes, parse_timeout, policies, resolve_headers, scrub, scrub_error, tidy_secrets,
    Card,
};
use crate::config::{HttpToolConfig, ToolConfigError};
use crate::template::{schema_properties, Template};

/// Default of `max_response_bytes`.
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 1024 * 1024;

/// How much of an error answer is read for its message: enough for any error text, bounded however
/// large the body.
const ERROR_BODY_BYTES: usize = 4096;
/// How much of an error answer goes into the message the model is shown.
const ERROR_BODY_CHARS: usize = 300;
/// The most the connect phase may take, whatever the tool's timeout.
const MAX_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Everything but RFC 3986's unreserved characters, so an argument is always exactly one path
/// segment: `a/b c` → `a%2Fb%20c`.
const PATH_SEGMENT: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~');

/// Headers Keel sets on every request; a config may not replace them.
const RESERVED_HEADERS: &[&str] = &[
    "idempotency-key",
    "keel-run-id",
    "keel-call-id",
    "keel-attempt",
    "user-agent",
    "accept",
    "content-type",
    "content-length",
    "transfer-encoding",
    "host",
    "connection",
];

pub(crate) const USER_AGENT: &str = concat!("keel/", env!("CARGO_PKG_VERSION"));

/// Where the arguments that are not in the path go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ArgsIn {
    Query,
    Body,
}

/// A URL with `{argName}` placeholders in its path.
#[derive(Debug, Clone)]
struct UrlTemplate {
    /// `scheme://authority`.
    base: String,
    path: Template,
    /// `?…` as configured, or empty.
    query: String,
    host: String,
}

impl UrlTemplate {
    fn parse(url: &str, properties: &BTreeSet<String>) -> Result<Self, String> {
        let url = url.trim();
        let Some(scheme_end) = url.find("://") else {
            return Err("must be an absolute URL starting with http:// or https://".to_owned());
        };
        let authority = scheme_end + 3;
        let path_start = url[authority..].find(['/', '?', '#']).map_or(url.len(), |i| authority + i);
        let path_end = url[path_start..].find(['?', '#']).map_or(url.len(), |i| path_start + i);
        let (base, path, rest) = (&url[..path_start], &url[path_start..path_end], &url[path_end..]);
        if base.contains(['{', '}']) || rest.contains(['{', '}']) {
            return Err("{placeholders} are allowed only in the path".to_owned());
        }
        if rest.contains('#') {
            return Err("a #fragment is never sent to the server; remove it".to_owned());
        }
        let path = Template::parse(if path.is_empty() { "/" } else { path })?;
        path.check_args(properties)?;
        // Check the rest of the URL once, with every placeholder filled by a plain segment.
        let sample = format!("{base}{}{rest}", path.render::<()>(|_| Ok("x".to_owned())).unwrap_or_default());
        let parsed = Url::parse(&sample).map_err(|e| format!("not a valid URL: {e}"))?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err("the scheme must be http or https".to_owned());
        }
        if !parsed.username().is_empty() || parsed.password().is_some() {
            // The URL is shown in cards and logs; credentials belong in a header from the environment.
            return Err("credentials in the URL are not allowed; send them in a header, e.g. \
                        headers = { Authorization = \"Bearer ${TOKEN}\" }"
                .to_owned());
        }
        let host = parsed.host_str().ok_or("the URL names no host")?.to_owned();
        let host = match parsed.port() {
            Some(port) => format!("{host}:{port}"),
            None => host,
        };
        Ok(Self { base: base.to_owned(), path, query: rest.to_owned(), host })
    }

    /// The URL of one call: each path placeholder replaced by its argument, escaped as one segment.
    fn url(&self, args: &Map<String, Value>) -> Result<Url, ToolError> {
        let path = self.path.render(|name| {
            let text = match args.get(name) {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Number(n)) => n.to_string(),
                Some(Value::Bool(b)) => b.to_string(),
                None | Some(Value::Null) => {
                    return Err(ToolError::Invalid(format!(
                        "the argument {name} is required: it is part of the URL path"
                    )))
                }
                Some(_) => {
                    return Err(ToolError::Invalid(format!(
                        "the argument {name} must be a string, number or boolean: it is part of the URL path"
                    )))
                }
            };
            // `.` and `..` would be read as "this" and "the parent" segment, whatever the escaping.
            if text.is_empty() || text == "." || text == ".." {
                return Err(ToolError::Invalid(format!(
                    "the argument {name} cannot be empty, \".\" or \"..\": it is a segment of the URL path"
                )));
            }
            Ok(utf8_percent_encode(&text, PATH_SEGMENT).to_string())
        })?;
        Url::parse(&format!("{}{}{}", self.base, path, self.query))
            .map_err(|e| ToolError::Failed(format!("could not make the URL of {}: {e}", self.path.source())))
    }

    /// The URL as configured, placeholders and all.
    fn source(&self) -> String {
        mask::mask_text(&format!("{}{}{}", self.base, self.path.source(), self.query))
    }
}

/// A tool that sends one HTTP request per call. Built by [`crate::build`] from an `http` tool's
/// configuration.
pub struct HttpTool {
    spec: ToolSpec,
    common: crate::config::CommonConfig,
    method: Method,
    url: UrlTemplate,
    args_in: ArgsIn,
    /// The configured headers, resolved and marked sensitive.
    headers: HeaderMap,
    /// What went into them, kept out of every error message (a service may echo a header back).
    secrets: Vec<String>,
    path_args: BTreeSet<String>,
    max_response_bytes: usize,
    args_schema: JsonSchema,
    result_schema: Option<JsonSchema>,
    card: Card,
    client: reqwest::Client,
}

impl std::fmt::Debug for HttpTool {
    // Header values are secrets: only their names are shown.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpTool")
            .field("name", &self.spec.name)
            .field("method", &self.method.as_str())
            .field("url", &self.url.source())
            .field("headers", &self.headers.keys().map(HeaderName::as_str).collect::<Vec<_>>())
            .field("timeout", &self.spec.timeout)
            .field("max_response_bytes", &self.max_response_bytes)
            .field("side_effect", &self.spec.side_effect)
            .field("idempotent", &self.spec.idempotent)
            .finish()
    }
}

impl HttpTool {
    /// Checks and resolves an `http` tool's configuration; see [`crate::build`].
    pub fn new(config: &HttpToolConfig, env: &dyn Fn(&str) -> Option<String>) -> Result<Self, ToolConfigError> {
        let common = &config.common;
        check_name(&common.name)?;
        let method = match config.method.trim().to_ascii_uppercase().as_str() {
            "GET" => Method::GET,
            "POST" => Method::POST,
            "PUT" => Method::PUT,
            "PATCH" => Method::PATCH,
            "DELETE" => Method::DELETE,
            _ => {
                return Err(ToolConfigError::new(
                    "method",
                    format!(
                        "{:?} is not supported; use GET, POST, PUT, PATCH or DELETE",
                        mask::truncate(&config.method, 20)
                    ),
                ))
            }
        };
        let args_in = if method == Method::GET || method == Method::DELETE { ArgsIn::Query } else { ArgsIn::Body };

        if config.args_schema.get("type").and_then(Value::as_str) != Some("object") {
            return Err(ToolConfigError::new(
                "args_schema",
                "must be a JSON Schema of an object (type = \"object\"): a tool's arguments are named",
            ));
        }
        let args_schema =
            JsonSchema::compile(&config.args_schema).map_err(|e| ToolConfigError::new("args_schema", e.to_string()))?;
        let result_schema = match &config.result_schema {
            Some(schema) => {
                Some(JsonSchema::compile(schema).map_err(|e| ToolConfigError::new("result_schema", e.to_string()))?)
            }
            None => None,
        };
        let properties = schema_properties(&config.args_schema);

        let url = UrlTemplate::parse(&config.url, &properties).map_err(|m| ToolConfigError::new("url", m))?;
        let path_args: BTreeSet<String> = url.path.args().map(str::to_owned).collect();
        let card = Card::parse(&common.confirm, &properties)?;
        let mut secrets = Vec::new();
        let headers = resolve_headers(
            &config.headers,
            RESERVED_HEADERS,
            "Keel sets this header on every request; remove it",
            env,
            &mut secrets,
        )?;
        tidy_secrets(&mut secrets);
        let timeout = parse_timeout(config.timeout.as_deref())?;
        let max_response_bytes = parse_max_response_bytes(config.max_response_bytes)?;

        let side_effect = common.side_effect.unwrap_or(method != Method::GET);
        let idempotent = common.idempotent.unwrap_or(!side_effect);
        let spec = ToolSpec {
            name: common.name.clone(),
            description: common.description.clone(),
            parameters: config.args_schema.clone(),
            result_schema: config.result_schema.clone(),
            side_effect,
            idempotent,
            policies: policies(common.policy.as_ref(), side_effect)?,
            timeout,
        };

        // A connect that takes half the budget leaves too little for the answer; failing it as
        // unreachable (nothing was sent) lets the engine try again safely, where the whole timeout
        // would have had to be reported as "may have been applied".
        let connect_timeout = (timeout / 2).min(MAX_CONNECT_TIMEOUT);
        let client = reqwest::Client::builder()
            .connect_timeout(connect_timeout)
            .user_agent(USER_AGENT)
            // A redirect would resend (or turn into a GET) a request whose effect Keel accounts for once.
            .redirect(reqwest::redirect::Policy::none())
            // The process environment is read only through `env`: no HTTP_PROXY taken behind its back.
            .no_proxy()
            .tcp_nodelay(true)
            .build()
            .map_err(|e| ToolConfigError::new("url", format!("could not make an HTTP client: {e}")))?;

        Ok(Self {
            spec,
            common: common.clone(),
            method,
            url,
            args_in,
            headers,
            secrets,
            path_args,
            max_response_bytes,
            args_schema,
            result_schema,
            card,
            client,
        })
    }

    fn scrub_error(&self, e: ToolError) -> ToolError {
        scrub_error(e, |m| scrub(&self.secrets, m))
    }

    /// `POST /restart/{instanceId}`: what events, errors and logs name the request by.
    fn route(&self) -> String {
        format!("{} {}", self.method, self.url.path.source())
    }

    fn request(&self, ctx: &ToolContext, args: &Value) -> Result<reqwest::RequestBuilder, ToolError> {
        let Some(args) = args.as_object() else {
            return Err(ToolError::Invalid("the arguments must be a JSON object".to_owned()));
        };
        let mut url = self.url.url(args)?;
        let rest = args.iter().filter(|(k, _)| !self.path_args.contains(*k));
        let mut request = match self.args_in {
            ArgsIn::Query => {
                // Sorted, so one call's URL is always the same; null means "not given".
                let mut pairs: Vec<(&String, String)> = Vec::new();
                for (key, value) in rest {
                    let text = match value {
                        Value::Null => continue,
                        Value::String(s) => s.clone(),
                        Value::Number(n) => n.to_string(),
                        Value::Bool(b) => b.to_string(),
                        Value::Array(_) | Value::Object(_) => {
                            // The name is the model's (the schema may allow any): masked like a value.
                            return Err(ToolError::Invalid(format!(
                                "the argument {} must be a string, number or boolean: a {} tool sends its \
                                 arguments in the query string",
                                mask::truncate(&mask::mask_text(key), 64),
                                self.method
                            )));
                        }
                    };
                    pairs.push((key, text));
                }
                pairs.sort();
                if !pairs.is_empty() {
                    let mut query = url.query_pairs_mut();
                    for (key, value) in &pairs {
                        query.append_pair(key, value);
                    }
                }
                self.client.request(self.method.clone(), url)
            }
            ArgsIn::Body => {
                let body: Map<String, Value> = rest.map(|(k, v)| (k.clone(), v.clone())).collect();
                self.client.request(self.method.clone(), url).json(&Value::Object(body))
            }
        };
        let header = |value: &str, what: &str| {
            HeaderValue::from_str(value)
                .map_err(|_| ToolError::Failed(format!("the {what} is not a valid header value")))
        };
        request = request
            .headers(self.headers.clone())
            .header("Idempotency-Key", header(&ctx.idempotency_key, "idempotency key")?)
            .header("Keel-Run-Id", header(ctx.run_id.as_str(), "run id")?)
            .header("Keel-Call-Id", header(ctx.call_id.as_str(), "call id")?)
            .header("Keel-Attempt", HeaderValue::from(ctx.attempt))
            .header(ACCEPT, HeaderValue::from_static("application/json"));
        Ok(request)
    }

    /// Why `send` failed, by whether the request can have left.
    fn send_error(&self, e: reqwest::Error) -> ToolError {
        let cause = cause(&e);
        if e.is_connect() {
            // Refused, a name that does not resolve, the connect timeout, a failed TLS handshake: no
            // byte of the request was sent.
            ToolError::Unreachable(format!("could not reach {}: {cause}", self.url.host))
        } else if e.is_builder() {
            ToolError::Failed(format!("could not make the request {}: {cause}", self.route()))
        } else {
            ToolError::OutcomeUnknown(format!(
                "{} was sent and the connection broke before the answer came: {cause}",
                self.route()
            ))
        }
    }

    fn timed_out(&self) -> ToolError {
        ToolError::Timeout(format!(
            "no complete answer to {} within {}",
            self.route(),
            humantime::format_duration(self.spec.timeout)
        ))
    }

    async fn attempt(&self, ctx: &ToolContext, args: &Value) -> Result<ToolOutput, ToolError> {
        let deadline = Instant::now() + self.spec.timeout;
        // The registry checks arguments before a call; checked again here because what is sent to
        // another service must never depend on every caller having done so.
        self.args_schema
            .validate(args)
            .map_err(|v| ToolError::Invalid(format!("the arguments do not match args_schema: {v}")))?;
        let request = self.request(ctx, args)?;
        let mut response = match timeout_at(deadline, request.send()).await {
            Err(_) => return Err(self.timed_out()),
            Ok(Err(e)) => return Err(self.send_error(e)),
            Ok(Ok(response)) => response,
        };
        let status = response.status();
        if !status.is_success() {
            return Err(self.status_error(status, &mut response, deadline).await);
        }
        if response.content_length().is_some_and(|n| n > self.max_response_bytes as u64) {
            return Err(ToolError::TooLarge { limit: self.max_response_bytes });
        }
        let mut body = Vec::new();
        loop {
            match timeout_at(deadline, response.chunk()).await {
                Err(_) => return Err(self.timed_out()),
                Ok(Err(e)) => {
                    return Err(ToolError::OutcomeUnknown(format!(
                        "{} answered {} and the connection broke in the middle of the answer: {}",
                        self.route(),
                        status.as_u16(),
                        cause(&e)
                    )))
                }
                Ok(Ok(None)) => break,
                Ok(Ok(Some(chunk))) => {
                    // Stop at the first chunk past the limit: dropping the response closes the
                    // connection, so the rest is never read.
                    if body.len() + chunk.len() > self.max_response_bytes {
                        return Err(ToolError::TooLarge { limit: self.max_response_bytes });
                    }
                    body.extend_from_slice(&chunk);
                }
            }
        }
        let result = if status == StatusCode::NO_CONTENT || status == StatusCode::RESET_CONTENT {
            Value::Null
        } else {
            serde_json::from_slice::<Value>(&body).map_err(|e| {
                ToolError::BadResponse(format!("the answer to {} ({}) is not JSON: {e}", self.route(), status.as_u16()))
            })?
        };
        if let Some(schema) = &self.result_schema {
            schema.validate(&result).map_err(|v| {
                ToolError::BadResponse(format!("the answer to {} does not match result_schema: {v}", self.route()))
            })?;
        }
        Ok(ToolOutput { result, summary: format!("{} → {}", self.route(), status.as_u16()), facts: Vec::new() })
    }

    /// `HTTP 404 Not Found from GET /instances/{id}: <the start of the body, masked>`. The body is
    /// read only as far as a message needs, and only until the deadline: the status alone is an answer.
    async fn status_error(&self, status: StatusCode, response: &mut reqwest::Response, deadline: Instant) -> ToolError {
        let mut body = Vec::new();
        while body.len() < ERROR_BODY_BYTES {
            match timeout_at(deadline, response.chunk()).await {
                Ok(Ok(Some(chunk))) => body.extend_from_slice(&chunk),
                _ => break,
            }
        }
        body.truncate(ERROR_BODY_BYTES);
        let text = String::from_utf8_lossy(&body);
        let text = text.split_whitespace().collect::<Vec<_>>().join(" ");
        let excerpt = mask::truncate(&mask::mask_text(&text), ERROR_BODY_CHARS);
        let mut message = format!("HTTP {status} from {}", self.route());
        if !excerpt.is_empty() {
            message.push_str(": ");
            message.push_str(&excerpt);
        }
        ToolError::Status { status: status.as_u16(), message }
    }
}

/// The causes of a reqwest error, without the URL (it holds argument values) and masked.
fn cause(e: &reqwest::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(s) = source {
        let text = s.to_string();
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        source = s.source();
    }
    if parts.is_empty() {
        parts.push(e.to_string());
    }
    mask::truncate(&mask::mask_text(&parts.join(": ")), 300)
}

#[async_trait]
impl Tool for HttpTool {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    fn describe(&self, args: &Value) -> ActionDescription {
        self.card.describe(&self.common, args, || {
            format!("This sends {} to {}, which may change the system.", self.route(), self.url.host)
        })
    }

    async fn execute(&self, ctx: &ToolContext, args: &Value) -> Result<ToolOutput, ToolError> {
        let started = std::time::Instant::now();
        // Every message passes the scrubber, whichever path made it.
        let outcome = self.attempt(ctx, args).await.map_err(|e| self.scrub_error(e));
        let elapsed_ms = started.elapsed().as_millis() as u64;
        match &outcome {
            Ok(out) => tracing::debug!(tool = %self.spec.name, route = %self.route(), summary = %out.summary,
                elapsed_ms, "http tool call"),
            Err(e) => tracing::debug!(tool = %self.spec.name, route = %self.route(), error_code = %e.code(),
                elapsed_ms, "http tool call failed"),
        }
        outcome
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::common::interpolate;
    use serde_json::json;

    fn props(names: &[&str]) -> BTreeSet<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn url_templates() {
        let t = UrlTemplate::parse("http://127.0.0.1:9/restart/{id}?v=2", &props(&["id"])).unwrap();
        assert_eq!(t.host, "127.0.0.1:9");
        let url = t.url(json!({"id": "a/b c"}).as_object().unwrap()).unwrap();
        assert_eq!(url.as_str(), "http://127.0.0.1:9/restart/a%2Fb%20c?v=2");
        for bad in ["..", ".", ""] {
            assert!(matches!(t.url(json!({"id": bad}).as_object().unwrap()), Err(ToolError::Invalid(_))));
        }
        assert!(matches!(t.url(json!({}).as_object().unwrap()), Err(ToolError::Invalid(_))));
        let bare = UrlTemplate::parse("https://example.com", &props(&[])).unwrap();
        assert_eq!(bare.url(&Map::new()).unwrap().as_str(), "https://example.com/");

        let err = |url: &str| UrlTemplate::parse(url, &props(&["id"])).unwrap_err();
        assert!(err("http://{id}.example.com/x").contains("only in the path"));
        assert!(err("http://h/x?q={id}").contains("only in the path"));
        assert!(err("http://h/x/{other}").contains("{other}"));
        assert!(err("ftp://h/x").contains("http or https"));
        assert!(err("h/x").contains("absolute"));
        assert!(err("http://u:p@h/x").contains("credentials"));
        assert!(err("http://h/x#top").contains("fragment"));
    }

    #[test]
    fn header_interpolation() {
        let env = |k: &str| (k == "TOKEN").then(|| "s3cr3t".to_owned());
        let mut secrets = Vec::new();
        let mut i = |t: &str| interpolate("headers.X", t, &env, &mut secrets);
        assert_eq!(i("Bearer ${TOKEN}").unwrap(), "Bearer s3cr3t");
        assert_eq!(i("$5 and ${TOKEN}!").unwrap(), "$5 and s3cr3t!");
        assert_eq!(i("${NOPE}").unwrap_err().to_string(), "headers.X: the environment variable NOPE is not set");
        assert!(i("${TOKEN").is_err());
        assert!(i("${1X}").is_err());
        assert!(i("${}").is_err());
        assert_eq!(secrets, ["s3cr3t", "s3cr3t"]);
    }
}
