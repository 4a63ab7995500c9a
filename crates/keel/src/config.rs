//! Settings, layered: defaults < `keel.toml` (or `--config PATH`) < `KEEL_…` environment < flags.
//! clap merges the last two; this module puts the file under them and validates the result once.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use serde::Deserialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

/// The flags every subcommand takes; each may also come from the environment or the file.
#[derive(Debug, Clone, Default, Args)]
#[command(next_help_heading = "Server options (serve, demo, migrate, users)")]
pub struct Options {
    /// A TOML settings file [default: ./keel.toml, if present].
    #[arg(long, global = true, env = "KEEL_CONFIG", value_name = "PATH")]
    pub config: Option<PathBuf>,
    /// The address to listen on [default: 127.0.0.1:8080].
    #[arg(long, global = true, env = "KEEL_LISTEN", value_name = "ADDR")]
    pub listen: Option<String>,
    /// Where the embedded database lives [default: ./keel-data].
    #[arg(long, global = true, env = "KEEL_DATA_DIR", value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// The database URL: `sqlite://PATH` or `postgres://…` [default: sqlite://<data-dir>/keel.db].
    #[arg(long, global = true, env = "KEEL_DB", value_name = "URL")]
    pub db: Option<String>,
    /// The model: `demo` (offline, rule-based) or `openai` (an OpenAI-compatible API) [default: demo].
    #[arg(long, global = true, env = "KEEL_MODEL")]
    pub model: Option<String>,
    /// The demo model's delay between streamed tokens, in milliseconds [default: 15].
    #[arg(long, global = true, env = "KEEL_DEMO_DELAY_MS", value_name = "MS")]
    pub demo_delay_ms: Option<u64>,
    /// How long a human has to decide, e.g. `15m`, `90s`, `1h` [default: 15m].
    #[arg(long, global = true, env = "KEEL_INTERRUPT_TTL", value_name = "DURATION")]
    pub interrupt_ttl: Option<String>,
    /// The SSE keep-alive interval, e.g. `15s`, `500ms` [default: 15s].
    #[arg(long, global = true, env = "KEEL_HEARTBEAT", value_name = "DURATION")]
    pub heartbeat: Option<String>,
    /// Extra abnormal instances per service in the seeded fleet [default: 0].
    #[arg(long, global = true, env = "KEEL_DEMO_ABNORMAL", value_name = "N")]
    pub demo_abnormal: Option<u32>,
    /// Event fan-out between instances: `local` (one process) or `redis://HOST:PORT` [default: local].
    #[arg(long, global = true, env = "KEEL_BUS", value_name = "URL")]
    pub bus: Option<String>,
    /// How long a run's lease lasts without renewal; a dead instance's runs are taken over after it
    /// [default: 30s].
    #[arg(long, global = true, env = "KEEL_LEASE_TTL", value_name = "DURATION")]
    pub lease_ttl: Option<String>,
    /// Names this instance in leases and logs [default: keel-<random>].
    #[arg(long, global = true, env = "KEEL_INSTANCE_ID", value_name = "NAME")]
    pub instance_id: Option<String>,
    /// Log lines as text or JSON; the level comes from RUST_LOG [default: text].
    #[arg(long, global = true, env = "KEEL_LOG_FORMAT", value_enum)]
    pub log_format: Option<LogFormat>,
    /// Export traces over OTLP/HTTP (protobuf) to this collector, e.g. `http://127.0.0.1:4318`
    /// (`/v1/traces` is added unless the URL ends with it) [default: no export].
    #[arg(long, global = true, env = "KEEL_OTLP_ENDPOINT", value_name = "URL")]
    pub otlp_endpoint: Option<String>,
    /// `--model openai`: the API root, e.g. `http://127.0.0.1:11434/v1`. The API key comes from
    /// `KEEL_MODEL_API_KEY` or `model_api_key` in keel.toml, never from a flag.
    #[arg(long, global = true, env = "KEEL_MODEL_BASE_URL", value_name = "URL")]
    pub model_base_url: Option<String>,
    /// `--model openai`: the model (or deployment) name.
    #[arg(long, global = true, env = "KEEL_MODEL_NAME", value_name = "NAME")]
    pub model_name: Option<String>,
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
    /// Serve without API keys on a non-loopback address: every request acts as the local `demo`
    /// user. Only for a network you trust entirely.
    #[arg(long, global = true, env = "KEEL_INSECURE_NO_AUTH")]
    pub insecure_no_auth: bool,
    /// Requests per second per user; 0 turns the limit off [default: 50].
    #[arg(long, global = true, env = "KEEL_RATE_LIMIT", value_name = "PER_SECOND")]
    pub rate_limit: Option<f64>,
    /// Requests a user may send at once before the rate applies [default: 200].
    #[arg(long, global = true, env = "KEEL_RATE_BURST", value_name = "N")]
    pub rate_burst: Option<u32>,
    /// Open streams (SSE, WebSocket) per user; 0 turns the cap off [default: 64].
    #[arg(long, global = true, env = "KEEL_MAX_STREAMS_PER_USER", value_name = "N")]
    pub max_streams_per_user: Option<usize>,
    /// How long a stream ticket can be used [default: 60s].
    #[arg(long, global = true, env = "KEEL_STREAM_TICKET_TTL", value_name = "DURATION")]
    pub stream_ticket_ttl: Option<String>,
    /// The largest request body, in bytes [default: 1048576].
    #[arg(long, global = true, env = "KEEL_BODY_LIMIT", value_name = "BYTES")]
    pub body_limit: Option<usize>,
    /// The deepest nesting of arrays and objects in a JSON body [default: 32].
    #[arg(long, global = true, env = "KEEL_JSON_MAX_DEPTH", value_name = "N")]
    pub json_max_depth: Option<usize>,
    /// The longest user message, in characters [default: 32000].
    #[arg(long, global = true, env = "KEEL_MAX_MESSAGE_CHARS", value_name = "N")]
    pub max_message_chars: Option<usize>,
    /// The most events one JSON replay page holds [default: 1000].
    #[arg(long, global = true, env = "KEEL_REPLAY_PAGE_MAX", value_name = "N")]
    pub replay_page_max: Option<u32>,
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
    pub allowed_hosts: Vec<String>,
}

/// A secret read from the environment or the file; `***` in `Debug`.
#[derive(Clone, Default, PartialEq, Deserialize)]
#[serde(transparent)]
pub struct SecretString(pub String);

impl std::fmt::Debug for SecretString {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("***")
    }
}

/// `keel.toml`: the same settings, snake_case keys.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub listen: Option<String>,
    pub data_dir: Option<PathBuf>,
    pub db: Option<String>,
    pub model: Option<String>,
    pub demo_delay_ms: Option<u64>,
    pub interrupt_ttl: Option<String>,
    pub heartbeat: Option<String>,
    pub demo_abnormal: Option<u32>,
    pub bus: Option<String>,
    pub lease_ttl: Option<String>,
    pub instance_id: Option<String>,
    pub log_format: Option<LogFormat>,
    pub otlp_endpoint: Option<String>,
    pub model_base_url: Option<String>,
    pub model_name: Option<String>,
    pub model_api_key: Option<SecretString>,
    pub model_api_key_header: Option<String>,
    pub model_temperature: Option<f32>,
    pub model_max_tokens: Option<u32>,
    pub model_connect_timeout: Option<String>,
    pub model_first_token_timeout: Option<String>,
    pub model_idle_timeout: Option<String>,
    pub model_max_retries: Option<u32>,
    /// Extra headers sent to the model server (their values are treated as secrets).
    #[serde(default)]
    pub model_headers: std::collections::BTreeMap<String, SecretString>,
    #[serde(default)]
    pub insecure_no_auth: bool,
    pub rate_limit: Option<f64>,
    pub rate_burst: Option<u32>,
    pub max_streams_per_user: Option<usize>,
    pub stream_ticket_ttl: Option<String>,
    pub body_limit: Option<usize>,
    pub json_max_depth: Option<usize>,
    pub max_message_chars: Option<usize>,
    pub replay_page_max: Option<u32>,
    #[serde(default)]
    pub allowed_hosts: Vec<String>,
    /// API keys by their SHA-256 (`[[api_keys]] user = "…", role = "operator", sha256 = "…"`).
    #[serde(default)]
    pub api_keys: Vec<ConfiguredKey>,
}

/// An API key given in keel.toml, by hash: the file never holds the key itself.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
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

impl FileConfig {
    /// `path` if given (it must exist), else `./keel.toml` if it exists, else nothing.
    pub fn load(path: Option<&Path>) -> anyhow::Result<Self> {
        let (path, required) = match path {
            Some(p) => (p.to_owned(), true),
            None => (PathBuf::from("keel.toml"), false),
        };
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if !required && e.kind() == std::io::ErrorKind::NotFound => return Ok(Self::default()),
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
        };
        toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))
    }
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
    pub bus: BusChoice,
    pub lease_ttl: Duration,
    pub instance_id: Option<String>,
    pub log_format: LogFormat,
    pub insecure_no_auth: bool,
    pub api_keys: Vec<KeyHash>,
    pub rate_limit: f64,
    pub rate_burst: u32,
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
}

/// A user name: 1 to 64 of `[A-Za-z0-9_.@-]`.
pub fn valid_user(user: &str) -> bool {
    (1..=64).contains(&user.len())
        && user.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'@' | b'-'))
}

pub fn parse_role(role: &str) -> anyhow::Result<keel_core::UserRole> {
    keel_core::UserRole::parse(role).with_context(|| format!("unknown role {role:?}; use viewer, operator or admin"))
}

fn configured_keys(keys: &[ConfiguredKey]) -> anyhow::Result<Vec<KeyHash>> {
    keys.iter()
        .map(|k| {
            if !valid_user(&k.user) {
                bail!("api_keys: user {:?} must be 1 to 64 of [A-Za-z0-9_.@-]", k.user);
            }
            if !keel_server::auth::is_sha256_hex(&k.sha256) {
                bail!("api_keys: sha256 of {:?} must be 64 lowercase hex digits (`sha256sum` of the key)", k.user);
            }
            Ok(KeyHash { user: k.user.clone(), role: parse_role(&k.role)?, sha256: k.sha256.clone() })
        })
        .collect()
}

/// The collector's traces URL. Masked in `Debug`: a URL may carry credentials.
#[derive(Clone, PartialEq)]
pub struct OtlpEndpoint(pub String);

impl std::fmt::Debug for OtlpEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "OtlpEndpoint({})", keel_core::mask::mask_text(&self.0))
    }
}

/// `http://host:4318` → `http://host:4318/v1/traces`; a URL that already names the path stays.
fn otlp_endpoint(url: &str) -> anyhow::Result<OtlpEndpoint> {
    let url = url.trim();
    if !(url.starts_with("http://") || url.starts_with("https://")) {
        bail!(
            "--otlp-endpoint {:?} must be an http:// or https:// URL (OTLP over HTTP)",
            keel_core::mask::mask_text(url)
        );
    }
    let url = url.trim_end_matches('/');
    Ok(OtlpEndpoint(if url.ends_with("/v1/traces") { url.to_owned() } else { format!("{url}/v1/traces") }))
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

impl Settings {
    /// `cli` already holds environment and flags (flags win); `file` sits under both.
    pub fn resolve(cli: &Options, file: &FileConfig) -> anyhow::Result<Self> {
        let pick = |flag: &Option<String>, file: &Option<String>| flag.clone().or_else(|| file.clone());
        let listen = pick(&cli.listen, &file.listen).unwrap_or_else(|| "127.0.0.1:8080".to_owned());
        let data_dir = cli.data_dir.clone().or_else(|| file.data_dir.clone()).unwrap_or_else(|| "keel-data".into());
        let database = match pick(&cli.db, &file.db) {
            None => Database::Sqlite(data_dir.join("keel.db")),
            Some(url) => database(&url)?,
        };
        let model = match pick(&cli.model, &file.model).as_deref().unwrap_or("demo") {
            "demo" => ModelChoice::Demo,
            "openai" => ModelChoice::OpenAi(Box::new(openai_config(cli, file)?)),
            other => bail!("--model {other:?} is not supported; use `demo` or `openai`"),
        };
        let demo_delay = Duration::from_millis(cli.demo_delay_ms.or(file.demo_delay_ms).unwrap_or(15));
        let interrupt_ttl = positive_duration("--interrupt-ttl", pick(&cli.interrupt_ttl, &file.interrupt_ttl), "15m")?;
        let heartbeat = positive_duration("--heartbeat", pick(&cli.heartbeat, &file.heartbeat), "15s")?;
        let lease_ttl = positive_duration("--lease-ttl", pick(&cli.lease_ttl, &file.lease_ttl), "30s")?;
        let bus = match pick(&cli.bus, &file.bus).as_deref() {
            None | Some("local") => BusChoice::Local,
            Some(url) if url.starts_with("redis://") || url.starts_with("rediss://") => {
                BusChoice::Redis(url.to_owned())
            }
            Some(other) => {
                bail!(
                    "--bus {:?} is not supported; use `local` or redis://HOST:PORT",
                    keel_core::mask::mask_text(other)
                )
            }
        };
        let otlp_endpoint = match pick(&cli.otlp_endpoint, &file.otlp_endpoint).filter(|u| !u.trim().is_empty()) {
            Some(url) => Some(otlp_endpoint(&url)?),
            None => None,
        };
        let allowed_hosts = if cli.allowed_hosts.is_empty() { &file.allowed_hosts } else { &cli.allowed_hosts };
        let allowed_hosts: Vec<String> =
            allowed_hosts.iter().map(|h| h.trim().to_owned()).filter(|h| !h.is_empty()).collect();
        if let Some(bad) = allowed_hosts.iter().find(|h| {
            h.len() > 253
                || !h.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b':' | b'[' | b']'))
        }) {
            bail!("--allowed-host {bad:?} must be a host name (letters, digits, dots, dashes; an optional :port)");
        }
        Ok(Self {
            allowed_hosts,
            otlp_endpoint,
            listen,
            data_dir,
            database,
            model,
            demo_delay,
            interrupt_ttl,
            heartbeat,
            demo_abnormal: cli.demo_abnormal.or(file.demo_abnormal).unwrap_or(0),
            bus,
            lease_ttl,
            instance_id: pick(&cli.instance_id, &file.instance_id),
            log_format: cli.log_format.or(file.log_format).unwrap_or(LogFormat::Text),
            insecure_no_auth: cli.insecure_no_auth || file.insecure_no_auth,
            api_keys: configured_keys(&file.api_keys)?,
            rate_limit: match cli.rate_limit.or(file.rate_limit).unwrap_or(50.0) {
                r if r.is_finite() && r >= 0.0 => r,
                r => bail!("--rate-limit {r} must be a number of requests per second, 0 or more"),
            },
            rate_burst: cli.rate_burst.or(file.rate_burst).unwrap_or(200).max(1),
            max_streams_per_user: cli.max_streams_per_user.or(file.max_streams_per_user).unwrap_or(64),
            stream_ticket_ttl: positive_duration(
                "--stream-ticket-ttl",
                pick(&cli.stream_ticket_ttl, &file.stream_ticket_ttl),
                "60s",
            )?,
            body_limit: at_least_one("--body-limit", cli.body_limit.or(file.body_limit).unwrap_or(1024 * 1024))?,
            json_max_depth: at_least_one("--json-max-depth", cli.json_max_depth.or(file.json_max_depth).unwrap_or(32))?,
            max_message_chars: at_least_one(
                "--max-message-chars",
                cli.max_message_chars.or(file.max_message_chars).unwrap_or(32_000),
            )?,
            replay_page_max: at_least_one(
                "--replay-page-max",
                cli.replay_page_max.or(file.replay_page_max).unwrap_or(1000) as usize,
            )? as u32,
        })
    }
}

/// `--model openai`: the flags and environment over the file; the key from the environment or
/// the file only.
fn openai_config(cli: &Options, file: &FileConfig) -> anyhow::Result<keel_models::OpenAiConfig> {
    let pick = |flag: &Option<String>, file: &Option<String>| flag.clone().or_else(|| file.clone());
    let Some(base_url) = pick(&cli.model_base_url, &file.model_base_url) else {
        bail!("--model openai needs --model-base-url (or KEEL_MODEL_BASE_URL), e.g. http://127.0.0.1:11434/v1");
    };
    let Some(name) = pick(&cli.model_name, &file.model_name) else {
        bail!("--model openai needs --model-name (or KEEL_MODEL_NAME)");
    };
    let mut config = keel_models::OpenAiConfig::new(base_url, name);
    let key = std::env::var("KEEL_MODEL_API_KEY").ok().or_else(|| file.model_api_key.clone().map(|k| k.0));
    config.api_key = key.filter(|k| !k.is_empty()).map(keel_models::ApiKey::new);
    config.api_key_header = pick(&cli.model_api_key_header, &file.model_api_key_header);
    config.temperature = cli.model_temperature.or(file.model_temperature);
    config.max_tokens = cli.model_max_tokens.or(file.model_max_tokens);
    config.extra_headers = file.model_headers.iter().map(|(k, v)| (k.clone(), v.0.clone())).collect();
    let duration = |name: &str, flag: &Option<String>, file: &Option<String>, default: Duration| match pick(flag, file)
    {
        Some(text) => positive_duration(name, Some(text), ""),
        None => Ok(default),
    };
    config.connect_timeout = duration(
        "--model-connect-timeout",
        &cli.model_connect_timeout,
        &file.model_connect_timeout,
        config.connect_timeout,
    )?;
    config.first_token_timeout = duration(
        "--model-first-token-timeout",
        &cli.model_first_token_timeout,
        &file.model_first_token_timeout,
        config.first_token_timeout,
    )?;
    config.idle_timeout =
        duration("--model-idle-timeout", &cli.model_idle_timeout, &file.model_idle_timeout, config.idle_timeout)?;
    if let Some(n) = cli.model_max_retries.or(file.model_max_retries) {
        config.max_retries = n;
    }
    if let Ok(v) = std::env::var("KEEL_MODEL_INCLUDE_USAGE") {
        config.include_usage = !matches!(v.as_str(), "0" | "false" | "no");
    }
    Ok(config)
}

fn at_least_one(name: &str, n: usize) -> anyhow::Result<usize> {
    if n == 0 {
        bail!("{name} must be at least 1");
    }
    Ok(n)
}

fn positive_duration(name: &str, value: Option<String>, default: &str) -> anyhow::Result<Duration> {
    let text = value.unwrap_or_else(|| default.to_owned());
    let d = parse_duration(&text).with_context(|| format!("{name} {text:?}"))?;
    if d.is_zero() {
        bail!("{name} must be longer than zero");
    }
    Ok(d)
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

/// `sqlite://PATH` (or `sqlite:PATH`) or `postgres://…` (or `postgresql://…`).
fn database(url: &str) -> anyhow::Result<Database> {
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        return Ok(Database::Postgres(url.to_owned()));
    }
    let path = url.strip_prefix("sqlite://").or_else(|| url.strip_prefix("sqlite:"));
    match path {
        Some(p) if !p.is_empty() => Ok(Database::Sqlite(PathBuf::from(p.split('?').next().unwrap_or(p)))),
        Some(_) => bail!("--db {url:?} names no file; expected sqlite://PATH"),
        None => bail!(
            "--db {:?} is not supported; use sqlite://PATH or postgres://USER@HOST/DB",
            keel_core::mask::mask_text(url)
        ),
    }
}

/// `500ms`, `2s`, `15m`, `1h`, `1d`, or a combination like `1h30m`; a bare number is seconds.
pub fn parse_duration(text: &str) -> anyhow::Result<Duration> {
    let text = text.trim();
    if text.is_empty() {
        bail!("empty duration");
    }
    if text.bytes().all(|b| b.is_ascii_digit()) {
        return Ok(Duration::from_secs(text.parse().context("duration out of range")?));
    }
    let mut total = Duration::ZERO;
    let mut rest = text;
    while !rest.is_empty() {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            bail!("expected a number in {text:?}; durations look like 500ms, 2s, 15m, 1h");
        }
        let n: u64 = rest[..digits].parse().context("duration out of range")?;
        rest = &rest[digits..];
        let unit_len = rest.bytes().take_while(u8::is_ascii_alphabetic).count();
        let unit = &rest[..unit_len];
        rest = &rest[unit_len..];
        let part = match unit {
            "ms" => Duration::from_millis(n),
            "s" => Duration::from_secs(n),
            "m" => Duration::from_secs(n.saturating_mul(60)),
            "h" => Duration::from_secs(n.saturating_mul(3600)),
            "d" => Duration::from_secs(n.saturating_mul(86_400)),
            "" => bail!("missing unit in {text:?}; use ms, s, m, h or d"),
            other => bail!("unknown unit {other:?} in {text:?}; use ms, s, m, h or d"),
        };
        total = total.saturating_add(part);
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("15m").unwrap(), Duration::from_secs(900));
        assert_eq!(parse_duration("2s").unwrap(), Duration::from_secs(2));
        assert_eq!(parse_duration("1h").unwrap(), Duration::from_secs(3600));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("1h30m").unwrap(), Duration::from_secs(5400));
        assert_eq!(parse_duration(" 30 ").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("0s").unwrap(), Duration::ZERO);
        for bad in ["", "m", "15x", "1.5s", "-2s", "s15", "10 m"] {
            assert!(parse_duration(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn defaults() {
        let s = Settings::resolve(&Options::default(), &FileConfig::default()).unwrap();
        assert_eq!(s.listen, "127.0.0.1:8080");
        assert_eq!(s.database, Database::Sqlite(PathBuf::from("keel-data").join("keel.db")));
        assert_eq!(s.model, ModelChoice::Demo);
        assert_eq!(s.demo_delay, Duration::from_millis(15));
        assert_eq!(s.interrupt_ttl, Duration::from_secs(900));
        assert_eq!(s.heartbeat, Duration::from_secs(15));
        assert_eq!(s.demo_abnormal, 0);
        assert_eq!(s.bus, BusChoice::Local);
        assert_eq!(s.lease_ttl, Duration::from_secs(30));
        assert_eq!(s.log_format, LogFormat::Text);
        assert_eq!(s.otlp_endpoint, None);
    }

    #[test]
    fn the_otlp_endpoint_names_the_traces_path_and_must_be_http() {
        let with = |url: &str| {
            Settings::resolve(
                &Options { otlp_endpoint: Some(url.into()), ..Default::default() },
                &FileConfig::default(),
            )
        };
        let traces = |url: &str| with(url).unwrap().otlp_endpoint.unwrap().0;
        assert_eq!(traces("http://127.0.0.1:4318"), "http://127.0.0.1:4318/v1/traces");
        assert_eq!(traces("https://otel.internal:4318/"), "https://otel.internal:4318/v1/traces");
        assert_eq!(traces("http://c:4318/v1/traces"), "http://c:4318/v1/traces");
        assert_eq!(with("").unwrap().otlp_endpoint, None);
        let err = with("grpc://user:hunter2@c:4317").unwrap_err().to_string();
        assert!(err.contains("http://"), "{err}");
        assert!(!err.contains("hunter2"), "{err}");
    }

    #[test]
    fn the_file_sits_under_environment_and_flags() {
        let file: FileConfig = toml::from_str(
            r#"
            listen = "0.0.0.0:9000"
            data_dir = "/srv/keel"
            heartbeat = "5s"
            demo_abnormal = 3
            log_format = "json"
            "#,
        )
        .unwrap();
        let s = Settings::resolve(&Options::default(), &file).unwrap();
        assert_eq!(s.listen, "0.0.0.0:9000");
        assert_eq!(s.database, Database::Sqlite(PathBuf::from("/srv/keel/keel.db")));
        assert_eq!(s.heartbeat, Duration::from_secs(5));
        assert_eq!(s.demo_abnormal, 3);
        assert_eq!(s.log_format, LogFormat::Json);

        let cli = Options {
            listen: Some("127.0.0.1:0".into()),
            heartbeat: Some("250ms".into()),
            db: Some("sqlite:///tmp/other.db".into()),
            ..Options::default()
        };
        let s = Settings::resolve(&cli, &file).unwrap();
        assert_eq!(s.listen, "127.0.0.1:0");
        assert_eq!(s.heartbeat, Duration::from_millis(250));
        assert_eq!(s.database, Database::Sqlite(PathBuf::from("/tmp/other.db")));
        assert_eq!(s.demo_abnormal, 3);
    }

    #[test]
    fn openai_settings_come_from_flags_and_the_file_and_hide_the_key() {
        let file: FileConfig = toml::from_str(
            r#"
            model = "openai"
            model_base_url = "http://127.0.0.1:11434/v1"
            model_name = "qwen2.5"
            model_api_key = "sk-file-secret"
            model_idle_timeout = "5s"
            [model_headers]
            OpenAI-Organization = "org-1"
            "#,
        )
        .unwrap();
        assert!(!format!("{file:?}").contains("sk-file-secret"));
        let cli = Options { model_name: Some("llama3".into()), model_max_tokens: Some(512), ..Default::default() };
        let s = Settings::resolve(&cli, &file).unwrap();
        let ModelChoice::OpenAi(c) = &s.model else { panic!("openai") };
        assert_eq!(c.model, "llama3");
        assert_eq!(c.base_url, "http://127.0.0.1:11434/v1");
        assert_eq!(c.max_tokens, Some(512));
        assert_eq!(c.idle_timeout, Duration::from_secs(5));
        assert_eq!(c.extra_headers, vec![("OpenAI-Organization".to_owned(), "org-1".to_owned())]);
        if std::env::var("KEEL_MODEL_API_KEY").is_err() {
            assert_eq!(c.api_key.as_ref().map(|k| k.expose()), Some("sk-file-secret"));
        }
        assert!(!format!("{s:?}").contains("sk-file-secret"), "the key never shows in Debug");
    }

    #[test]
    fn api_keys_come_from_the_file_by_hash() {
        let hash = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
        let file: FileConfig =
            toml::from_str(&format!("[[api_keys]]\nuser = \"alice\"\nrole = \"viewer\"\nsha256 = \"{hash}\"\n"))
                .unwrap();
        let s = Settings::resolve(&Options::default(), &file).unwrap();
        assert_eq!(
            s.api_keys,
            vec![KeyHash { user: "alice".into(), role: keel_core::UserRole::Viewer, sha256: hash.into() }]
        );
        for (user, role, sha) in [("alice", "root", hash), ("a b", "viewer", hash), ("alice", "viewer", "keel_abc")] {
            let file = FileConfig {
                api_keys: vec![ConfiguredKey { user: user.into(), role: role.into(), sha256: sha.into() }],
                ..Default::default()
            };
            assert!(Settings::resolve(&Options::default(), &file).is_err(), "{user} {role} {sha}");
        }
    }

    #[test]
    fn limits_have_defaults_and_are_checked() {
        let s = Settings::resolve(&Options::default(), &FileConfig::default()).unwrap();
        assert_eq!((s.rate_limit, s.rate_burst, s.max_streams_per_user), (50.0, 200, 64));
        assert_eq!(s.stream_ticket_ttl, Duration::from_secs(60));
        assert!(!s.insecure_no_auth);
        let off = Options { rate_limit: Some(0.0), max_streams_per_user: Some(0), ..Default::default() };
        let s = Settings::resolve(&off, &FileConfig::default()).unwrap();
        assert_eq!((s.rate_limit, s.max_streams_per_user), (0.0, 0));
        let bad = Options { rate_limit: Some(-1.0), ..Default::default() };
        assert!(Settings::resolve(&bad, &FileConfig::default()).is_err());
        let s = Settings::resolve(&Options::default(), &FileConfig::default()).unwrap();
        assert_eq!(
            (s.body_limit, s.json_max_depth, s.max_message_chars, s.replay_page_max),
            (1 << 20, 32, 32_000, 1000)
        );
        let file: FileConfig = toml::from_str("json_max_depth = 8\nreplay_page_max = 50").unwrap();
        let s = Settings::resolve(&Options { body_limit: Some(4096), ..Default::default() }, &file).unwrap();
        assert_eq!((s.body_limit, s.json_max_depth, s.replay_page_max), (4096, 8, 50));
        let zero = Options { json_max_depth: Some(0), ..Default::default() };
        assert!(Settings::resolve(&zero, &FileConfig::default()).unwrap_err().to_string().contains("at least 1"));
    }

    #[test]
    fn unknown_file_keys_are_refused() {
        assert!(toml::from_str::<FileConfig>("lisen = \"x\"").is_err());
    }

    #[test]
    fn unsupported_choices_are_clear_errors() {
        let with = |o: Options| Settings::resolve(&o, &FileConfig::default()).unwrap_err().to_string();
        assert!(with(Options { db: Some("mysql://u:pw@x/y".into()), ..Default::default() }).contains("sqlite://"));
        assert!(!with(Options { db: Some("mysql://u:pw@x/y".into()), ..Default::default() }).contains("pw"));
        let pg = Settings::resolve(
            &Options { db: Some("postgres://keel:secret@db/keel".into()), ..Default::default() },
            &FileConfig::default(),
        )
        .unwrap();
        assert_eq!(pg.database, Database::Postgres("postgres://keel:secret@db/keel".into()));
        assert!(!format!("{pg:?}").contains("secret"));
        assert!(with(Options { model: Some("gpt".into()), ..Default::default() }).contains("demo"));
        assert!(with(Options { bus: Some("nats://x".into()), ..Default::default() }).contains("redis://"));
        assert!(with(Options { model: Some("openai".into()), ..Default::default() }).contains("--model-base-url"));
        let no_name = Options {
            model: Some("openai".into()),
            model_base_url: Some("http://127.0.0.1:11434/v1".into()),
            ..Default::default()
        };
        assert!(with(no_name).contains("--model-name"));
        let err = Settings::resolve(
            &Options { interrupt_ttl: Some("0s".into()), ..Default::default() },
            &FileConfig::default(),
        )
        .unwrap_err();
        assert!(err.to_string().contains("longer than zero"));
    }
}
