//! Settings, declared once. [`Options`] is both the command line (each flag with its `KEEL_…`
//! variable) and the shape of `keel.toml`; figment layers them, defaults < the file (`keel.toml` or
//! `--config PATH`) < the environment < flags, and [`Settings::load`] checks the result once into the
//! typed values the rest of the binary uses. A mistake is one line naming the flag, the variable, or
//! the file and key it came from.

pub mod agents;
mod layers;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use clap::parser::ArgMatches;
use clap::{Args, ValueEnum};
use serde::{Deserialize, Serialize};

pub use agents::AgentConfig;
use layers::Layers;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

/// Every setting, once: a flag (global, so it may follow any subcommand) with its `KEEL_…`
/// variable, and a snake_case key of `keel.toml`. A default is clap's `default_value`, which is also
/// the lowest layer (see `layers`). The few that must not be flags (secrets, tables) are
/// `#[arg(skip)]`: they come from the file, or from a variable read by name (`layers::ENV_ONLY`).
/// Values are still raw here (durations are text, URLs unchecked); [`Settings`] is the checked form.
#[derive(Debug, Clone, Args, Serialize, Deserialize)]
#[command(next_help_heading = "Server options (serve, demo, migrate, users)")]
#[serde(deny_unknown_fields)]
pub struct Options {
    /// A TOML settings file [default: ./keel.toml, if present].
    #[arg(long, global = true, env = "KEEL_CONFIG", value_name = "PATH")]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// The address to listen on.
    #[arg(long, global = true, env = "KEEL_LISTEN", value_name = "ADDR", default_value = "127.0.0.1:8080")]
    pub listen: String,
    /// Where the embedded database lives.
    #[arg(long, global = true, env = "KEEL_DATA_DIR", value_name = "DIR", default_value = "keel-data")]
    pub data_dir: PathBuf,
    /// The database URL: `sqlite://PATH` or `postgres://…` [default: sqlite://<data-dir>/keel.db].
    #[arg(long, global = true, env = "KEEL_DB", value_name = "URL")]
    pub db: Option<UrlText>,
    /// The model: `demo` (offline, rule-based) or `openai` (an OpenAI-compatible API).
    #[arg(long, global = true, env = "KEEL_MODEL", default_value = "demo")]
    pub model: String,
    /// The demo model's delay between streamed tokens, in milliseconds.
    #[arg(long, global = true, env = "KEEL_DEMO_DELAY_MS", value_name = "MS", default_value_t = 15)]
    pub demo_delay_ms: u64,
    /// How long a human has to decide, e.g. `15m`, `90s`, `1h`.
    #[arg(long, global = true, env = "KEEL_INTERRUPT_TTL", value_name = "DURATION", default_value = "15m")]
    pub interrupt_ttl: String,
    /// The SSE keep-alive interval, e.g. `15s`, `500ms`.
    #[arg(long, global = true, env = "KEEL_HEARTBEAT", value_name = "DURATION", default_value = "15s")]
    pub heartbeat: String,
    /// Extra abnormal instances per service in the seeded fleet.
    #[arg(long, global = true, env = "KEEL_DEMO_ABNORMAL", value_name = "N", default_value_t = 0)]
    pub demo_abnormal: u32,
    /// Extra healthy instances per service in the seeded fleet (prod, `{prefix}-prod-h1`, …): a
    /// large fleet for benchmarks.
    #[arg(long, global = true, env = "KEEL_DEMO_HEALTHY", value_name = "N", default_value_t = 0)]
    pub demo_healthy: u32,
    /// Event fan-out between instances: `local` (one process) or `redis://HOST:PORT`.
    #[arg(long, global = true, env = "KEEL_BUS", value_name = "URL", default_value = "local")]
    pub bus: UrlText,
    /// How long a run's lease lasts without renewal; a dead instance's runs are taken over after it.
    #[arg(long, global = true, env = "KEEL_LEASE_TTL", value_name = "DURATION", default_value = "30s")]
    pub lease_ttl: String,
    /// The most runs this instance drives at once; the rest wait, queued, for a free slot here or
    /// on another instance [default: 64 × the cores available].
    #[arg(long, global = true, env = "KEEL_MAX_CONCURRENT_RUNS", value_name = "N")]
    pub max_concurrent_runs: Option<usize>,
    /// Names this instance in leases and logs [default: keel-<random>].
    #[arg(long, global = true, env = "KEEL_INSTANCE_ID", value_name = "NAME")]
    pub instance_id: Option<String>,
    /// Log lines as text or JSON; the level comes from RUST_LOG.
    #[arg(long, global = true, env = "KEEL_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Export traces over OTLP/HTTP (protobuf) to this collector, e.g. `http://127.0.0.1:4318`
    /// (`/v1/traces` is added unless the URL ends with it) [default: no export].
    #[arg(long, global = true, env = "KEEL_OTLP_ENDPOINT", value_name = "URL")]
    pub otlp_endpoint: Option<UrlText>,
    /// `--model openai`: the API root, e.g. `http://127.0.0.1:11434/v1`. The API key comes from
    /// `KEEL_MODEL_API_KEY` or `model_api_key` in keel.toml, never from a flag.
    #[arg(long, global = true, env = "KEEL_MODEL_BASE_URL", value_name = "URL")]
    pub model_base_url: Option<UrlText>,
    /// `--model openai`: the model (or deployment) name.
    #[arg(long, global = true, env = "KEEL_MODEL_NAME", value_name = "NAME")]
    pub model_name: Option<String>,
    /// Not a flag: a flag would show the key in `ps` and in shell history.
    #[arg(skip)]
    pub model_api_key: Option<SecretString>,
    /// `--model openai`: send the key in this header as it is (e.g. `api-key` for Azure) instead of
    /// `Authorization: Bearer`.
    #[arg(long, global = true, env = "KEEL_MODEL_API_KEY_HEADER", value_name = "HEADER")]
    pub model_api_key_header: Option<String>,
    #[arg(long, global = true, env = "KEEL_MODEL_TEMPERATURE")]
    pub model_temperature: Option<f32>,
    #[arg(long, global = true, env = "KEEL_MODEL_MAX_TOKENS")]
    pub model_max_tokens: Option<u32>,
    /// [default: 10s]
    #[arg(long, global = true, env = "KEEL_MODEL_CONNECT_TIMEOUT", value_name = "DURATION")]
    pub model_connect_timeout: Option<String>,
    /// [default: 60s]
    #[arg(long, global = true, env = "KEEL_MODEL_FIRST_TOKEN_TIMEOUT", value_name = "DURATION")]
    pub model_first_token_timeout: Option<String>,
    /// [default: 30s]
    #[arg(long, global = true, env = "KEEL_MODEL_IDLE_TIMEOUT", value_name = "DURATION")]
    pub model_idle_timeout: Option<String>,
    /// [default: 2]
    #[arg(long, global = true, env = "KEEL_MODEL_MAX_RETRIES")]
    pub model_max_retries: Option<u32>,
    /// Ask for token usage; off for servers that reject `stream_options` (not a flag: a rare
    /// compatibility switch, as it always was).
    #[arg(skip)]
    pub model_include_usage: Option<bool>,
    /// Extra headers sent to the model server (their values are treated as secrets).
    #[arg(skip)]
    #[serde(default)]
    pub model_headers: BTreeMap<String, SecretString>,
    /// Serve without API keys on a non-loopback address: every request acts as the local `demo`
    /// user. Only for a network you trust entirely.
    #[arg(long, global = true, env = "KEEL_INSECURE_NO_AUTH")]
    pub insecure_no_auth: bool,
    /// Requests per second per user; 0 turns the limit off.
    #[arg(long, global = true, env = "KEEL_RATE_LIMIT", value_name = "PER_SECOND", default_value_t = 50.0)]
    pub rate_limit: f64,
    /// Requests a user may send at once before the rate applies.
    #[arg(long, global = true, env = "KEEL_RATE_BURST", value_name = "N", default_value_t = 200)]
    pub rate_burst: u32,
    /// Requests per second per client address, counted before authentication (so before any key
    /// is looked up); 0 turns the limit off. Behind a proxy every client has the proxy's address.
    #[arg(
        long,
        global = true,
        env = "KEEL_RATE_LIMIT_PER_ADDRESS",
        value_name = "PER_SECOND",
        default_value_t = 200.0
    )]
    pub rate_limit_per_address: f64,
    /// Requests one client address may send at once before its rate applies.
    #[arg(long, global = true, env = "KEEL_RATE_BURST_PER_ADDRESS", value_name = "N", default_value_t = 400)]
    pub rate_burst_per_address: u32,
    /// A reverse proxy in front of the server (an address, or a block such as 10.0.0.0/8); repeat
    /// it or separate them with commas. A request from one is counted, by the limit per client
    /// address, under the address its `X-Forwarded-For` names.
    #[arg(
        long = "trusted-proxy",
        global = true,
        env = "KEEL_TRUSTED_PROXIES",
        value_delimiter = ',',
        value_name = "ADDRESS"
    )]
    #[serde(default)]
    pub trusted_proxies: Vec<String>,
    /// Open streams (SSE, WebSocket) per user; 0 turns the cap off.
    #[arg(long, global = true, env = "KEEL_MAX_STREAMS_PER_USER", value_name = "N", default_value_t = 64)]
    pub max_streams_per_user: usize,
    /// How long a stream ticket can be used.
    #[arg(long, global = true, env = "KEEL_STREAM_TICKET_TTL", value_name = "DURATION", default_value = "60s")]
    pub stream_ticket_ttl: String,
    /// The largest request body, in bytes.
    #[arg(long, global = true, env = "KEEL_BODY_LIMIT", value_name = "BYTES", default_value_t = 1024 * 1024)]
    pub body_limit: usize,
    /// The deepest nesting of arrays and objects in a JSON body.
    #[arg(long, global = true, env = "KEEL_JSON_MAX_DEPTH", value_name = "N", default_value_t = 32)]
    pub json_max_depth: usize,
    /// The longest user message, in characters.
    #[arg(long, global = true, env = "KEEL_MAX_MESSAGE_CHARS", value_name = "N", default_value_t = 32_000)]
    pub max_message_chars: usize,
    /// The most events one JSON replay page holds.
    #[arg(long, global = true, env = "KEEL_REPLAY_PAGE_MAX", value_name = "N", default_value_t = 1000)]
    pub replay_page_max: u32,
    /// A host name requests may be addressed to besides localhost, 127.0.0.1 and [::1]; repeat it
    /// or separate names with commas. A server without API keys answers only these; with keys, the
    /// check is on only when a name is given.
    #[arg(
        long = "allowed-host",
        global = true,
        env = "KEEL_ALLOWED_HOSTS",
        value_delimiter = ',',
        value_name = "NAME"
    )]
    #[serde(default)]
    pub allowed_hosts: Vec<String>,
    /// API keys by their SHA-256 (`[[api_keys]] user = "…", role = "operator", sha256 = "…"`).
    #[arg(skip)]
    #[serde(default)]
    pub api_keys: Vec<ConfiguredKey>,
    /// `[[agents]]`, as written: `agents` checks each one, and leaves its tools' own fields to
    /// keel-tools.
    #[arg(skip)]
    #[serde(default)]
    pub agents: Vec<toml::Table>,
    /// Finished runs keep their events this long after they end, e.g. `30d`; older ones are
    /// pruned in the background (an agent may set its own, `[agents.retention] events_after`)
    /// [default: forever].
    #[arg(long, global = true, env = "KEEL_RETENTION_EVENTS_AFTER", value_name = "DURATION")]
    pub retention_events_after: Option<String>,
    /// How often the retention task looks for events to prune.
    #[arg(long, global = true, env = "KEEL_RETENTION_INTERVAL", value_name = "DURATION", default_value = "10m")]
    pub retention_interval: String,
    /// The most events one retention transaction deletes.
    #[arg(long, global = true, env = "KEEL_RETENTION_BATCH", value_name = "N", default_value_t = 1000)]
    pub retention_batch: u32,
}

/// A secret read from the environment or the file; `***` in `Debug`. It serializes as itself only
/// so that figment can layer it.
#[derive(Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SecretString(pub String);

impl std::fmt::Debug for SecretString {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("***")
    }
}

/// A URL as it was given. It may carry a password, so `Debug` masks it.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct UrlText(pub String);

impl std::str::FromStr for UrlText {
    type Err = std::convert::Infallible;
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Ok(Self(text.to_owned()))
    }
}

impl std::fmt::Debug for UrlText {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", keel_core::mask::mask_text(&self.0))
    }
}

/// An API key given in keel.toml, by hash: the file never holds the key itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfiguredKey {
    pub user: String,
    pub role: String,
    pub sha256: String,
}

/// A configured key, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyHash {
    pub user: String,
    pub role: keel_core::UserRole,
    pub sha256: String,
}

#[derive(Debug, Clone, PartialEq)]
pub enum ModelChoice {
    /// The offline, rule-based `DemoModel`.
    Demo,
    /// An OpenAI-compatible Chat Completions endpoint.
    OpenAi(Box<keel_models::OpenAiConfig>),
}

/// The settings, resolved and validated.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    pub listen: String,
    pub data_dir: PathBuf,
    pub database: Database,
    pub model: ModelChoice,
    pub demo_delay: Duration,
    pub interrupt_ttl: Duration,
    pub heartbeat: Duration,
    pub demo_abnormal: u32,
    pub demo_healthy: u32,
    pub bus: BusChoice,
    pub lease_ttl: Duration,
    pub max_concurrent_runs: usize,
    pub instance_id: Option<String>,
    pub log_format: LogFormat,
    pub insecure_no_auth: bool,
    pub api_keys: Vec<KeyHash>,
    pub rate_limit: f64,
    pub rate_burst: u32,
    pub rate_limit_per_address: f64,
    pub rate_burst_per_address: u32,
    pub trusted_proxies: keel_server::limits::TrustedProxies,
    pub max_streams_per_user: usize,
    pub stream_ticket_ttl: Duration,
    pub body_limit: usize,
    pub json_max_depth: usize,
    pub max_message_chars: usize,
    pub replay_page_max: u32,
    /// Host names served besides the loopback ones (see `--allowed-host`).
    pub allowed_hosts: Vec<String>,
    /// Where traces go over OTLP/HTTP, the full `…/v1/traces` URL; none: traces are only logs.
    pub otlp_endpoint: Option<OtlpEndpoint>,
    /// The agents of `[[agents]]`, in file order; exactly one is the default. Empty: no configured
    /// agents (the server keeps its built-in one).
    pub agents: Vec<AgentConfig>,
    /// How long finished runs keep their events, globally and per agent.
    pub retention: keel_runtime::retention::Retention,
}

/// Reads an environment variable by name. The process environment in the binary
/// ([`process_env`]); a map in tests, which must not change the environment of the test process.
pub type Env<'a> = &'a dyn Fn(&str) -> Option<String>;

/// The process environment; a variable that is not valid UTF-8 counts as unset.
pub fn process_env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// A user name: 1 to 64 of `[A-Za-z0-9_.@-]`.
pub fn valid_user(user: &str) -> bool {
    (1..=64).contains(&user.len())
        && user.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'@' | b'-'))
}

pub fn parse_role(role: &str) -> anyhow::Result<keel_core::UserRole> {
    keel_core::UserRole::parse(role).with_context(|| format!("unknown role {role:?}; use viewer, operator or admin"))
}

/// The collector's traces URL. Masked in `Debug`: a URL may carry credentials.
#[derive(Clone, PartialEq)]
pub struct OtlpEndpoint(pub String);

impl std::fmt::Debug for OtlpEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "OtlpEndpoint({})", keel_core::mask::mask_text(&self.0))
    }
}

/// How committed events reach the readers of other instances.
#[derive(Clone, PartialEq)]
pub enum BusChoice {
    /// In-process only: right for one instance (other instances still see events, by polling).
    Local,
    /// Redis Streams, shared by every instance.
    Redis(String),
}

impl std::fmt::Debug for BusChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BusChoice::Local => f.write_str("Local"),
            BusChoice::Redis(url) => write!(f, "Redis({})", keel_core::mask::mask_text(url)),
        }
    }
}

/// Where runs live.
#[derive(Clone, PartialEq)]
pub enum Database {
    /// The embedded default: one file, one process.
    Sqlite(PathBuf),
    /// Shared by several instances. The URL may carry a password: never printed.
    Postgres(String),
}

impl std::fmt::Debug for Database {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Database::Sqlite(path) => write!(f, "Sqlite({})", path.display()),
            Database::Postgres(url) => write!(f, "Postgres({})", keel_core::mask::mask_text(url)),
        }
    }
}

impl std::fmt::Display for Database {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Database::Sqlite(path) => write!(f, "{}", path.display()),
            Database::Postgres(url) => f.write_str(&keel_core::mask::mask_text(url)),
        }
    }
}

impl Settings {
    /// `options` as clap parsed them (flags, and the variables of flags not given), `matches` to
    /// tell which of the two each value is, `env` for the variables that are not flags. Reads the
    /// file `--config` names (it must exist) or `./keel.toml` (if it exists).
    pub fn load(options: &Options, matches: &ArgMatches, env: Env) -> anyhow::Result<Self> {
        let layers = Layers::new(options, matches, env)?;
        let raw: Options = layers.extract()?;
        Self::resolve(&raw, &layers, env)
    }

    fn resolve(o: &Options, layers: &Layers, env: Env) -> anyhow::Result<Self> {
        // Each problem is prefixed by the place its value came from: `--db`, `KEEL_DB` or
        // `keel.toml: db`.
        let bad = |key: &str, problem: String| anyhow!("{}: {problem}", layers.origin(key));
        let duration = |key: &str, text: &str| positive_duration(text).map_err(|problem| bad(key, problem));
        let database = match &o.db {
            None => Database::Sqlite(o.data_dir.join("keel.db")),
            Some(url) => database(&url.0).map_err(|problem| bad("db", problem))?,
        };
        let model = match o.model.as_str() {
            "demo" => ModelChoice::Demo,
            "openai" => ModelChoice::OpenAi(Box::new(openai_config(o, layers)?)),
            other => return Err(bad("model", format!("{other:?} is not supported; use `demo` or `openai`"))),
        };
        let bus = match o.bus.0.as_str() {
            "local" => BusChoice::Local,
            url if url.starts_with("redis://") || url.starts_with("rediss://") => BusChoice::Redis(url.to_owned()),
            other => {
                let shown = keel_core::mask::mask_text(other);
                return Err(bad("bus", format!("{shown:?} is not supported; use `local` or redis://HOST:PORT")));
            }
        };
        let otlp_endpoint = match o.otlp_endpoint.as_ref().filter(|u| !u.0.trim().is_empty()) {
            Some(url) => Some(otlp_endpoint(&url.0).map_err(|problem| bad("otlp_endpoint", problem))?),
            None => None,
        };
        let allowed_hosts: Vec<String> =
            o.allowed_hosts.iter().map(|h| h.trim().to_owned()).filter(|h| !h.is_empty()).collect();
        if let Some(host) = allowed_hosts.iter().find(|h| {
            h.len() > 253
                || !h.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b':' | b'[' | b']'))
        }) {
            let problem = format!("{host:?} must be a host name (letters, digits, dots, dashes; an optional :port)");
            return Err(bad("allowed_hosts", problem));
        }
        for (key, rate) in [("rate_limit", o.rate_limit), ("rate_limit_per_address", o.rate_limit_per_address)] {
            if !(rate.is_finite() && rate >= 0.0) {
                return Err(bad(key, format!("{rate} must be a number of requests per second, 0 or more")));
            }
        }
        let at_least_one = |key: &str, n: usize| match n {
            0 => Err(bad(key, "must be at least 1".to_owned())),
            n => Ok(n),
        };
        let agents = agents::resolve(&o.agents, &layers.file_name(), env)?;
        let retention = keel_runtime::retention::Retention {
            events_after: match &o.retention_events_after {
                Some(text) if text.trim() != "forever" => Some(duration("retention_events_after", text)?),
                _ => None,
            },
            agents: agents.iter().filter_map(|a| a.events_after.map(|d| (a.id.clone(), d))).collect(),
            every: duration("retention_interval", &o.retention_interval)?,
            batch: at_least_one("retention_batch", o.retention_batch as usize)? as u32,
        };
        Ok(Self {
            listen: o.listen.clone(),
            data_dir: o.data_dir.clone(),
            database,
            model,
            demo_delay: Duration::from_millis(o.demo_delay_ms),
            interrupt_ttl: duration("interrupt_ttl", &o.interrupt_ttl)?,
            heartbeat: duration("heartbeat", &o.heartbeat)?,
            demo_abnormal: o.demo_abnormal,
            demo_healthy: o.demo_healthy,
            bus,
            lease_ttl: duration("lease_ttl", &o.lease_ttl)?,
            max_concurrent_runs: match o.max_concurrent_runs {
                Some(n) => at_least_one("max_concurrent_runs", n)?,
                None => keel_core::engine::default_max_concurrent_runs(),
            },
            instance_id: o.instance_id.clone(),
            log_format: o.log_format,
            insecure_no_auth: o.insecure_no_auth,
            api_keys: configured_keys(&o.api_keys)
                .map_err(|(i, problem)| anyhow!("{}[{i}]: {problem}", layers.origin("api_keys")))?,
            rate_limit: o.rate_limit,
            // A burst of 0 would refuse every request; the limit is turned off with a rate of 0.
            rate_burst: o.rate_burst.max(1),
            rate_limit_per_address: o.rate_limit_per_address,
            rate_burst_per_address: o.rate_burst_per_address.max(1),
            trusted_proxies: keel_server::limits::TrustedProxies::parse(
                &o.trusted_proxies.iter().filter(|p| !p.trim().is_empty()).cloned().collect::<Vec<_>>(),
            )
            .map_err(|problem| bad("trusted_proxies", problem))?,
            max_streams_per_user: o.max_streams_per_user,
            stream_ticket_ttl: duration("stream_ticket_ttl", &o.stream_ticket_ttl)?,
            body_limit: at_least_one("body_limit", o.body_limit)?,
            json_max_depth: at_least_one("json_max_depth", o.json_max_depth)?,
            max_message_chars: at_least_one("max_message_chars", o.max_message_chars)?,
            replay_page_max: at_least_one("replay_page_max", o.replay_page_max as usize)? as u32,
            allowed_hosts,
            otlp_endpoint,
            agents,
            retention,
        })
    }
}

/// Each configured key, or the first problem with the position of its key.
fn configured_keys(keys: &[ConfiguredKey]) -> Result<Vec<KeyHash>, (usize, String)> {
    keys.iter()
        .enumerate()
        .map(|(i, k)| {
            if !valid_user(&k.user) {
                return Err((i, format!("user: {:?} must be 1 to 64 of [A-Za-z0-9_.@-]", k.user)));
            }
            if !keel_server::auth::is_sha256_hex(&k.sha256) {
                return Err((i, "sha256: must be 64 lowercase hex digits (`sha256sum` of the key)".to_owned()));
            }
            let role = parse_role(&k.role).map_err(|e| (i, format!("role: {e}")))?;
            Ok(KeyHash { user: k.user.clone(), role, sha256: k.sha256.clone() })
        })
        .collect()
}

/// `http://host:4318` → `http://host:4318/v1/traces`; a URL that already names the path stays.
fn otlp_endpoint(url: &str) -> Result<OtlpEndpoint, String> {
    let url = url.trim();
    if !(url.starts_with("http://") || url.starts_with("https://")) {
        let shown = keel_core::mask::mask_text(url);
        return Err(format!("{shown:?} must be an http:// or https:// URL (OTLP over HTTP)"));
    }
    let url = url.trim_end_matches('/');
    Ok(OtlpEndpoint(if url.ends_with("/v1/traces") { url.to_owned() } else { format!("{url}/v1/traces") }))
}

/// What an OpenAI-compatible model is given, by the `--model-*` settings or by an agent's
/// `[agents.model]`; what is not given keeps keel-models' default.
#[derive(Default)]
struct OpenAiParts {
    base_url: String,
    name: String,
    api_key: Option<String>,
    api_key_header: Option<String>,
    temperature: Option<f32>,
    max_tokens: Option<u32>,
    connect_timeout: Option<Duration>,
    first_token_timeout: Option<Duration>,
    idle_timeout: Option<Duration>,
    max_retries: Option<u32>,
    include_usage: Option<bool>,
    extra_headers: Vec<(String, String)>,
}

impl OpenAiParts {
    fn build(self) -> keel_models::OpenAiConfig {
        let mut config = keel_models::OpenAiConfig::new(self.base_url, self.name);
        // An empty key counts as none, as it always has (an unset `KEEL_MODEL_API_KEY=`).
        config.api_key = self.api_key.filter(|k| !k.is_empty()).map(keel_models::ApiKey::new);
        config.api_key_header = self.api_key_header;
        config.temperature = self.temperature;
        config.max_tokens = self.max_tokens;
        config.extra_headers = self.extra_headers;
        config.connect_timeout = self.connect_timeout.unwrap_or(config.connect_timeout);
        config.first_token_timeout = self.first_token_timeout.unwrap_or(config.first_token_timeout);
        config.idle_timeout = self.idle_timeout.unwrap_or(config.idle_timeout);
        config.max_retries = self.max_retries.unwrap_or(config.max_retries);
        config.include_usage = self.include_usage.unwrap_or(config.include_usage);
        config
    }
}

/// `--model openai` from the `--model-*` settings.
fn openai_config(o: &Options, layers: &Layers) -> anyhow::Result<keel_models::OpenAiConfig> {
    let Some(base_url) = &o.model_base_url else {
        bail!(
            "--model openai needs --model-base-url (KEEL_MODEL_BASE_URL, model_base_url in keel.toml), \
             e.g. http://127.0.0.1:11434/v1"
        );
    };
    let Some(name) = &o.model_name else {
        bail!("--model openai needs --model-name (KEEL_MODEL_NAME, model_name in keel.toml)");
    };
    let duration = |key: &str, text: &Option<String>| match text {
        Some(text) => positive_duration(text).map(Some).map_err(|problem| anyhow!("{}: {problem}", layers.origin(key))),
        None => Ok(None),
    };
    Ok(OpenAiParts {
        base_url: base_url.0.clone(),
        name: name.clone(),
        api_key: o.model_api_key.as_ref().map(|k| k.0.clone()),
        api_key_header: o.model_api_key_header.clone(),
        temperature: o.model_temperature,
        max_tokens: o.model_max_tokens,
        connect_timeout: duration("model_connect_timeout", &o.model_connect_timeout)?,
        first_token_timeout: duration("model_first_token_timeout", &o.model_first_token_timeout)?,
        idle_timeout: duration("model_idle_timeout", &o.model_idle_timeout)?,
        max_retries: o.model_max_retries,
        include_usage: o.model_include_usage,
        extra_headers: o.model_headers.iter().map(|(k, v)| (k.clone(), v.0.clone())).collect(),
    }
    .build())
}

/// A duration longer than zero; see [`parse_duration`].
fn positive_duration(text: &str) -> Result<Duration, String> {
    let d = parse_duration(text)?;
    if d.is_zero() {
        return Err(format!("{text:?} must be longer than zero"));
    }
    Ok(d)
}

/// humantime's durations (`500ms`, `90s`, `15m`, `1h30m`, `1d`…); a bare number is seconds, as keel
/// has always read it.
fn parse_duration(text: &str) -> Result<Duration, String> {
    let trimmed = text.trim();
    let parsed = if !trimmed.is_empty() && trimmed.bytes().all(|b| b.is_ascii_digit()) {
        trimmed.parse().map(Duration::from_secs).map_err(|_| "too large".to_owned())
    } else {
        humantime::parse_duration(trimmed).map_err(|e| e.to_string())
    };
    parsed.map_err(|e| format!("{text:?} is not a duration ({e}); durations look like 500ms, 90s, 15m, 1h30m"))
}

/// `sqlite://PATH` (or `sqlite:PATH`) or `postgres://…` (or `postgresql://…`).
fn database(url: &str) -> Result<Database, String> {
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        return Ok(Database::Postgres(url.to_owned()));
    }
    let path = url.strip_prefix("sqlite://").or_else(|| url.strip_prefix("sqlite:"));
    match path {
        Some(p) if !p.is_empty() => Ok(Database::Sqlite(PathBuf::from(p.split('?').next().unwrap_or(p)))),
        Some(_) => Err(format!("{url:?} names no file; expected sqlite://PATH")),
        None => Err(format!(
            "{:?} is not supported; use sqlite://PATH or postgres://USER@HOST/DB",
            keel_core::mask::mask_text(url)
        )),
    }
}

#[cfg(test)]
mod tests;
