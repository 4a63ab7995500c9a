//! `keel`: serve the API, run the offline demo, or migrate the database; `chat` and `runs` are the
//! terminal client of a running server.
#![forbid(unsafe_code)]

mod client;
mod config;
mod telemetry;

/// jemalloc: the server allocates and frees many small buffers per request and event from two or
/// more threads; it spends less CPU on that than glibc's malloc (docs/benchmarks.md).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use keel_bus::RedisBus;
use keel_core::bus::{Bus, LocalBus};
use keel_core::clock::{Clock, StoreClock, SystemClock};
use keel_core::engine::{Engine, EngineConfig, EngineParts};
use keel_core::fleet::FleetSeed;
use keel_core::model::Model;
use keel_core::store::Store;
use keel_core::UserRole;
use keel_models::{DemoModel, OpenAiCompatible};
use keel_server::auth::AuthMode;
use keel_server::host::AllowedHosts;
use keel_server::{AppState, ServerConfig, ServerMetrics};
use keel_store::{PostgresStore, SqliteStore};
use tokio::sync::watch;

use crate::config::{BusChoice, Database, FileConfig, ModelChoice, Options, Settings};

/// The user the demo page acts as; an operator, so it may approve restarts.
const DEMO_USER: &str = "demo";
/// How long a graceful shutdown waits for open requests, and then for runs to reach a checkpoint.
const GRACE: Duration = Duration::from_secs(10);

#[derive(Debug, Parser)]
#[command(name = "keel", version, about = "Keel: a durable runtime for AI agents")]
struct Cli {
    #[command(subcommand)]
    command: Command,
    #[command(flatten)]
    options: Options,
}

#[derive(Debug, Clone, Subcommand)]
enum Command {
    /// Serve the HTTP API (seeds the demo fleet only if the database has none).
    Serve,
    /// Serve in demo mode: the fleet re-seeded at start, `POST /v1/demo/reset` enabled.
    Demo,
    /// Create or upgrade the database schema, then exit.
    Migrate,
    /// Chat with a running server in this terminal (see `keel chat --help`).
    Chat(client::ChatArgs),
    /// Your runs on a running server: list, show a run's history, watch (reattach to) a run.
    Runs {
        #[command(subcommand)]
        command: client::RunsCommand,
    },
    /// Manage users and their API keys (in the database `--db` / `--data-dir` names).
    #[command(subcommand)]
    Users(UsersCommand),
}

#[derive(Debug, Clone, PartialEq, Eq, Subcommand)]
enum UsersCommand {
    /// Create a user (or give an existing one this role) with a new API key, printed once.
    Add {
        name: String,
        #[arg(long, default_value = "viewer")]
        role: String,
    },
    /// Every user, their role and how many active keys they hold.
    List,
    /// Change a user's role; it applies to their next request, including pending approvals.
    SetRole { name: String, role: String },
    /// Revoke every API key of a user.
    Revoke { name: String },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The client commands talk to a server; they need none of the server's settings.
    match cli.command {
        Command::Chat(args) => return client::chat(args),
        Command::Runs { command } => return client::runs(command),
        Command::Serve | Command::Demo | Command::Migrate | Command::Users(_) => {}
    }
    match try_main(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // The cause chain on one line; no backtrace for a configuration mistake.
            eprintln!("keel: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn try_main(cli: Cli) -> anyhow::Result<()> {
    let file = FileConfig::load(cli.options.config.as_deref())?;
    let settings = Settings::resolve(&cli.options, &file)?;
    let telemetry = telemetry::init(settings.log_format, settings.otlp_endpoint.as_ref())?;
    let runtime =
        tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting the async runtime")?;
    let result = runtime.block_on(run(cli.command, settings));
    drop(runtime);
    // After the runtime: the spans of the last runs are sent before the process exits.
    telemetry.shutdown();
    result
}

async fn run(command: Command, settings: Settings) -> anyhow::Result<()> {
    std::fs::create_dir_all(&settings.data_dir)
        .with_context(|| format!("creating the data directory {}", settings.data_dir.display()))?;
    let store = open_store(&settings.database).await?;
    match command {
        Command::Migrate => {
            store.close().await;
            println!("Database {} is up to date.", settings.database);
            Ok(())
        }
        Command::Serve => serve(store, settings, false).await,
        Command::Demo => serve(store, settings, true).await,
        Command::Users(command) => {
            let result = users(store.shared().as_ref(), command).await;
            store.close().await;
            result
        }
        Command::Chat(_) | Command::Runs { .. } => unreachable!("client commands are dispatched in main"),
    }
}

async fn users(store: &dyn Store, command: UsersCommand) -> anyhow::Result<()> {
    let now = chrono::Utc::now();
    let named = |name: &str| {
        anyhow::ensure!(config::valid_user(name), "user {name:?} must be 1 to 64 of [A-Za-z0-9_.@-]");
        Ok(())
    };
    match command {
        UsersCommand::Add { name, role } => {
            named(&name)?;
            let role = config::parse_role(&role)?;
            let issued = keel_server::auth::issue_api_key(store, &name, role, now).await.context("adding the user")?;
            eprintln!("User {name} ({role}) has a new API key ({}). It is shown only this once:", issued.record.id);
            println!("{}", issued.secret);
        }
        UsersCommand::List => {
            println!("{:<24} {:<9} active keys", "user", "role");
            for user in store.list_users().await.context("listing users")? {
                println!("{:<24} {:<9} {}", user.id, user.role, user.active_keys);
            }
        }
        UsersCommand::SetRole { name, role } => {
            named(&name)?;
            let role = config::parse_role(&role)?;
            anyhow::ensure!(store.user_role(&name).await?.is_some(), "no user {name:?}");
            store.set_user_role(&name, role).await.context("setting the role")?;
            println!("User {name} is now {role}.");
        }
        UsersCommand::Revoke { name } => {
            named(&name)?;
            let revoked = store.revoke_api_keys(&name, now).await.context("revoking keys")?;
            println!("Revoked {revoked} key(s) of {name}.");
        }
    }
    Ok(())
}

/// Who a request without credentials is, decided once the address is bound: with keys, nobody;
/// without keys, the local demo user, but only on loopback or when explicitly allowed.
fn auth_mode(active_keys: u64, addr: std::net::SocketAddr, insecure_no_auth: bool) -> anyhow::Result<AuthMode> {
    if active_keys > 0 {
        tracing::info!(active_keys, "API keys required on every /v1 request");
        return Ok(AuthMode::Keys);
    }
    if addr.ip().is_loopback() {
        tracing::info!("no API keys configured: every request acts as the local user `{DEMO_USER}` (loopback only)");
    } else if insecure_no_auth {
        tracing::warn!(%addr, "--insecure-no-auth: anyone who can reach this address acts as `{DEMO_USER}`");
    } else {
        anyhow::bail!(
            "refusing to serve {addr} without API keys: anyone who can reach it could act as `{DEMO_USER}`. \
             Add a key with `keel users add NAME --role operator`, listen on 127.0.0.1, or pass --insecure-no-auth"
        );
    }
    Ok(AuthMode::SingleUser(DEMO_USER.to_owned()))
}

/// Which `Host` names are served. A keyless server on loopback acts for its local user on every
/// request, so it answers only loopback names and the ones given: a page that rebinds its own name to
/// 127.0.0.1 is refused. Otherwise the check is on only when names are given.
fn allowed_hosts(auth: &AuthMode, addr: std::net::SocketAddr, extra: &[String]) -> Option<AllowedHosts> {
    let keyless_loopback = matches!(auth, AuthMode::SingleUser(_)) && addr.ip().is_loopback();
    (keyless_loopback || !extra.is_empty()).then(|| AllowedHosts::loopback_and(extra))
}

/// The backend, chosen once, here.
enum OpenStore {
    Sqlite(SqliteStore),
    Postgres(PostgresStore),
}

impl OpenStore {
    fn shared(&self) -> Arc<dyn Store> {
        match self {
            OpenStore::Sqlite(s) => Arc::new(s.clone()),
            OpenStore::Postgres(s) => Arc::new(s.clone()),
        }
    }

    /// SQLite is opened by this process alone, so leases a previous process left are stale; a
    /// shared Postgres may have other live instances, whose leases must expire first.
    fn single_process(&self) -> bool {
        matches!(self, OpenStore::Sqlite(_))
    }

    async fn close(&self) {
        match self {
            OpenStore::Sqlite(s) => s.close().await,
            OpenStore::Postgres(s) => s.close().await,
        }
    }
}

async fn open_store(database: &Database) -> anyhow::Result<OpenStore> {
    Ok(match database {
        Database::Sqlite(path) => OpenStore::Sqlite(
            SqliteStore::open(path).await.with_context(|| format!("opening the database {}", path.display()))?,
        ),
        Database::Postgres(url) => {
            OpenStore::Postgres(PostgresStore::connect(url).await.with_context(|| format!("connecting to {database}"))?)
        }
    })
}

async fn serve(opened: OpenStore, settings: Settings, demo_mode: bool) -> anyhow::Result<()> {
    let store = opened.shared();
    let seed = FleetSeed { extra_abnormal: settings.demo_abnormal };
    if demo_mode || store.list_instances(None, None).await.context("reading the fleet")?.is_empty() {
        store.seed_fleet(seed, chrono::Utc::now()).await.context("seeding the demo fleet")?;
    }
    for key in &settings.api_keys {
        keel_server::auth::register_key_hash(store.as_ref(), &key.user, key.role, &key.sha256, chrono::Utc::now())
            .await
            .with_context(|| format!("registering the configured key of {}", key.user))?;
    }
    let active_keys = store.count_active_api_keys().await.context("counting API keys")?;

    let model: Arc<dyn Model> = match &settings.model {
        ModelChoice::Demo => Arc::new(DemoModel::new(settings.demo_delay)),
        ModelChoice::OpenAi(config) => {
            tracing::info!(base_url = %config.base_url, model = %config.model, "using an OpenAI-compatible model");
            Arc::new(OpenAiCompatible::new((**config).clone()).context("model settings")?)
        }
    };
    let bus: Arc<dyn Bus> = match &settings.bus {
        BusChoice::Local => Arc::new(LocalBus::default()),
        BusChoice::Redis(url) => Arc::new(
            RedisBus::connect(url, "keel:").await.map_err(|e| anyhow::anyhow!("connecting the event bus: {e}"))?,
        ),
    };
    // A shared database's clock decides leases and expiries; an embedded one is this machine's.
    let clock: Arc<dyn Clock> = if opened.single_process() {
        Arc::new(SystemClock)
    } else {
        StoreClock::start(store.clone(), Duration::from_secs(30)).await.context("reading the database clock")?
    };
    let metrics = ServerMetrics::new();
    let mut engine_config = EngineConfig { metrics: metrics.recorder(), ..EngineConfig::default() };
    if let Some(id) = &settings.instance_id {
        engine_config.instance_id = id.clone();
    }
    let engine = Arc::new(Engine::new(
        EngineParts { store, model, tools: keel_opspilot::registry(), bus, clock },
        EngineConfig {
            steal_leases_on_start: opened.single_process(),
            interrupt_ttl: settings.interrupt_ttl,
            max_message_chars: settings.max_message_chars,
            lease_ttl: settings.lease_ttl,
            // How often an idle reader re-reads the store: its only news source for runs written by
            // another instance without a shared bus, a safety net otherwise.
            poll_interval: match (&settings.bus, opened.single_process()) {
                (_, true) => Duration::from_secs(10),
                (BusChoice::Redis(_), false) => Duration::from_secs(3),
                (BusChoice::Local, false) => Duration::from_secs(1),
            },
            // Exported traces: every worker of a run joins the run's trace.
            run_span_hook: settings.otlp_endpoint.is_some().then(telemetry::run_span_hook),
            context: keel_core::context::ContextConfig {
                // A real model writes the summary of earlier turns; the demo model keeps the
                // deterministic extractive one.
                summarize_with_model: matches!(settings.model, ModelChoice::OpenAi(_)),
                ..Default::default()
            },
            ..engine_config
        },
    ));
    let recovered = engine.start().await.context("starting the engine")?;
    if recovered > 0 {
        tracing::info!(recovered, "continuing runs left by the previous process");
    }

    let listener = tokio::net::TcpListener::bind(&settings.listen)
        .await
        .with_context(|| format!("listening on {}", settings.listen))?;
    let addr = listener.local_addr().context("reading the bound address")?;
    let auth = auth_mode(active_keys, addr, settings.insecure_no_auth)?;
    if matches!(auth, AuthMode::SingleUser(_)) {
        // The local user of a server without keys is an operator, so the demo can approve restarts.
        engine.store().set_user_role(DEMO_USER, UserRole::Operator).await.context("setting up the demo user")?;
    }
    let server_config = ServerConfig {
        allowed_hosts: allowed_hosts(&auth, addr, &settings.allowed_hosts),
        heartbeat: settings.heartbeat,
        demo_mode,
        demo_abnormal: settings.demo_abnormal,
        auth,
        rate_limit_per_second: settings.rate_limit,
        rate_limit_burst: settings.rate_burst,
        max_streams_per_user: settings.max_streams_per_user,
        body_limit: settings.body_limit,
        json_max_depth: settings.json_max_depth,
        replay_page_max: settings.replay_page_max,
        stream_ticket_ttl: settings.stream_ticket_ttl,
        ..ServerConfig::default()
    };
    let state = AppState::new(engine.clone(), server_config).with_metrics(metrics);

    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::spawn(async move {
        shutdown_signal().await;
        tracing::info!("shutting down; a second signal exits at once");
        stop_tx.send_replace(true);
        shutdown_signal().await;
        eprintln!("second signal: exiting now");
        std::process::exit(130);
    });
    let stopped = move || {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|stop| *stop).await;
        }
    };

    if demo_mode {
        println!("Keel demo running at http://{addr}/");
    } else {
        println!("Keel listening on http://{addr}/");
    }
    tracing::info!(%addr, demo_mode, otlp = ?settings.otlp_endpoint, "serving");

    let mut server = tokio::spawn(keel_server::serve(listener, state, stopped()));
    tokio::select! {
        result = &mut server => result.context("the server task failed")?.context("serving")?,
        () = stopped() => match tokio::time::timeout(GRACE, &mut server).await {
            Ok(result) => result.context("the server task failed")?.context("serving")?,
            Err(_) => tracing::warn!("open connections did not close within {GRACE:?}; closing them"),
        },
    }
    engine.shutdown(GRACE).await;
    let still_running = engine.active_workers();
    opened.close().await;
    tracing::info!(still_running, "stopped");
    Ok(())
}

/// SIGINT (Ctrl-C) or, on Unix, SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!(error = %e, "cannot listen for Ctrl-C");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = terminate => {}
    }
}
