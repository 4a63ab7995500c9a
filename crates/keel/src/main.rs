//! `keel`: serve the API, run the offline demo, or migrate the database; `chat` and `runs` are the
//! terminal client of a running server.
#![forbid(unsafe_code)]

mod client;
mod config;
mod lifecycle;
mod telemetry;
mod tool_groups;

/// jemalloc: the server allocates and frees many small buffers per request and event from two or
/// more threads; it spends less CPU on that than glibc's malloc (docs/benchmarks.md).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{ArgMatches, CommandFactory, FromArgMatches, Parser, Subcommand};
use keel_bus::RedisBus;
use keel_core::agent::Agent;
use keel_core::context::ContextConfig;
use keel_core::model::Model;
use keel_core::store::{RunStore, Store};
use keel_core::tool::ToolRegistry;
use keel_models::{DemoModel, OpenAiCompatible};
use keel_opspilot::{Fleet, FleetSeed, PostgresFleet, SqliteFleet};
use keel_runtime::{Backend, Builder};
use keel_server::auth::AuthMode;
use keel_server::host::AllowedHosts;
use keel_store::{PostgresStore, SqliteStore};

use crate::config::{BusChoice, Database, ModelChoice, Options, Settings};
use crate::tool_groups::ToolGroups;

/// The user the demo page acts as; an operator, so it may approve restarts.
const DEMO_USER: &str = "demo";

/// The agent `keel serve` runs when keel.toml declares none: the configured model, no tools.
const ASSISTANT_ID: &str = "assistant";
const ASSISTANT_PROMPT: &str = "You are a helpful assistant. You have no tools: say so when a question needs one.";

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
    /// Serve the HTTP API with the agents of keel.toml (or a plain assistant without tools).
    Serve,
    /// Serve the OpsPilot demo beside those agents: its fleet seeded into an empty database, `/v1/demo/*` routed.
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
    /// Delete the events of finished runs older than the retention policy now (what the server's
    /// background task does), or with --dry-run say what would go.
    Prune {
        /// Count what would be deleted; delete nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Copy the SQLite database into FILE, also while a server runs on it (PostgreSQL: pg_dump,
    /// see docs/operations.md).
    Backup {
        /// A new file: an existing one is never overwritten.
        file: std::path::PathBuf,
    },
    /// Replace the SQLite database with the backup FILE; refused while a server has it open.
    Restore { file: std::path::PathBuf },
    /// Write an audit record as JSON Lines: conversations, their messages, runs, tool calls
    /// (arguments masked) and interrupts with who decided what and when.
    Export(lifecycle::ExportArgs),
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
    // As `Cli::parse()`, keeping the matches: they tell a flag from its environment variable, so a
    // bad value can be named as the user gave it.
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.format(&mut Cli::command()).exit());
    // The client commands talk to a server; they need none of the server's settings.
    match cli.command {
        Command::Chat(args) => return client::chat(args),
        Command::Runs { command } => return client::runs(command),
        Command::Serve
        | Command::Demo
        | Command::Migrate
        | Command::Users(_)
        | Command::Prune { .. }
        | Command::Backup { .. }
        | Command::Restore { .. }
        | Command::Export(_) => {}
    }
    match try_main(cli, &matches) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // The cause chain on one line; no backtrace for a configuration mistake.
            eprintln!("keel: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn try_main(cli: Cli, matches: &ArgMatches) -> anyhow::Result<()> {
    let settings = Settings::load(&cli.options, matches, &config::process_env)?;
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
    // The copies work on the database file, not through a store: a backup beside a running server,
    // a restore with none.
    match &command {
        Command::Backup { file } => return lifecycle::backup(&settings.database, file).await,
        Command::Restore { file } => return lifecycle::restore(&settings.database, file).await,
        _ => {}
    }
    let store = open_store(&settings.database).await?;
    let database = settings.database.clone();
    let migrate = matches!(command, Command::Migrate);
    let result = match command {
        Command::Migrate => Ok(()),
        Command::Serve => serve(store.clone(), settings, false).await,
        Command::Demo => serve(store.clone(), settings, true).await,
        Command::Users(command) => users(store.store().as_ref(), command).await,
        Command::Prune { dry_run } => lifecycle::prune(store.store().as_ref(), &settings.retention, dry_run).await,
        Command::Export(args) => lifecycle::export(store.store().as_ref(), &args).await,
        Command::Chat(_) | Command::Runs { .. } | Command::Backup { .. } | Command::Restore { .. } => {
            unreachable!("dispatched before the store is opened")
        }
    };
    // Whatever happened, once nothing uses the store any more (`serve` returns after the engine
    // shut down): closing SQLite checkpoints its WAL, so keel.db alone holds every write.
    store.close().await;
    if result.is_ok() && migrate {
        println!("Database {database} is up to date.");
    }
    result
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
async fn open_store(database: &Database) -> anyhow::Result<Backend> {
    Ok(match database {
        Database::Sqlite(path) => Backend::Sqlite(
            SqliteStore::open(path).await.with_context(|| format!("opening the database {}", path.display()))?,
        ),
        Database::Postgres(url) => {
            Backend::Postgres(PostgresStore::connect(url).await.with_context(|| format!("connecting to {database}"))?)
        }
    })
}

fn model_of(choice: &ModelChoice, demo_delay: Duration) -> anyhow::Result<Arc<dyn Model>> {
    Ok(match choice {
        ModelChoice::Demo => Arc::new(DemoModel::new(demo_delay)),
        ModelChoice::OpenAi(config) => {
            tracing::info!(base_url = %config.base_url, model = %config.model, "using an OpenAI-compatible model");
            Arc::new(OpenAiCompatible::new((**config).clone()).context("model settings")?)
        }
    })
}

/// A real model writes the summary of earlier turns; the demo model keeps the deterministic
/// extractive one.
fn context_for(choice: &ModelChoice, prompt: &str) -> ContextConfig {
    ContextConfig {
        system_prompt: prompt.to_owned(),
        summarize_with_model: matches!(choice, ModelChoice::OpenAi(_)),
        ..ContextConfig::default()
    }
}

/// The agents keel.toml declares, each with its model (or the server's) and its tools, and the
/// groups their tools came in (an MCP server's change its agent's tools; see `tool_groups`).
async fn configured_agents(settings: &Settings) -> anyhow::Result<(Vec<Agent>, Vec<Arc<ToolGroups>>)> {
    let mut agents = Vec::new();
    let mut all_groups = Vec::new();
    for config in &settings.agents {
        let choice = config.model.as_ref().unwrap_or(&settings.model);
        let model = model_of(choice, settings.demo_delay)?;
        let groups = ToolGroups::new(&config.id);
        let mut tools = ToolRegistry::new();
        for (index, tool) in config.tools.iter().enumerate() {
            // Checked when the settings were read; built here for this process (an MCP server is
            // started, and its tools listed, now). Its group is the table's place in the list.
            let watcher = Arc::downgrade(&groups);
            let on_change: keel_tools::OnToolsChanged = Box::new(move |tools| {
                if let Some(groups) = watcher.upgrade() {
                    groups.replace(index, tools);
                }
            });
            let built = config::agents::build_tools_watched(&tool.table, &config::process_env, on_change)
                .await
                .map_err(|e| anyhow::anyhow!("agent {:?}: tool {:?}: {e}", config.id, tool.name))?;
            for one in &built {
                tools
                    .register(one.clone())
                    .map_err(|e| anyhow::anyhow!("agent {:?}: tool {:?}: {e}", config.id, tool.name))?;
            }
            groups.built(index, built);
        }
        all_groups.push(groups);
        let mut context = context_for(choice, &config.system_prompt);
        if let Some(budget) = config.context.budget_tokens {
            context.context_budget_tokens = budget;
        }
        if let Some(max) = config.context.summary_max_chars {
            context.summary_max_chars = max;
        }
        if let Some(max) = config.context.tool_result_max_bytes {
            context.tool_result_max_bytes = max;
        }
        let agent = Agent::new(&config.id, &config.name, model, &config.system_prompt)?
            .description(config.description.as_deref().unwrap_or(""))
            .suggestions(config.suggestions.clone())
            .tools(tools)
            .context(context);
        agents.push(agent);
    }
    Ok((agents, all_groups))
}

/// The demo fleet of `backend`, seeded when it has no instance yet (a restarted demo keeps its
/// fleet; `POST /v1/demo/reset` puts it back as seeded).
async fn demo_fleet(backend: &Backend, seed: FleetSeed) -> anyhow::Result<Arc<dyn Fleet>> {
    let fleet: Arc<dyn Fleet> = match backend {
        Backend::Sqlite(s) => Arc::new(SqliteFleet::open(s).await.context("opening the demo fleet")?),
        Backend::Postgres(p) => Arc::new(PostgresFleet::open(p).await.context("opening the demo fleet")?),
    };
    if fleet.instances(1).await.context("reading the demo fleet")?.is_empty() {
        fleet.seed(seed, chrono::Utc::now()).await.context("seeding the demo fleet")?;
    }
    Ok(fleet)
}

async fn serve(backend: Backend, settings: Settings, demo_mode: bool) -> anyhow::Result<()> {
    let store = backend.store();
    for key in &settings.api_keys {
        keel_server::auth::register_key_hash(store.as_ref(), &key.user, key.role, &key.sha256, chrono::Utc::now())
            .await
            .with_context(|| format!("registering the configured key of {}", key.user))?;
    }
    let active_keys = store.count_active_api_keys().await.context("counting API keys")?;

    let mut builder = Builder::new(backend.clone()).retention(settings.retention.clone());
    if demo_mode {
        // OpsPilot, a user of the library like any agent, is the demo's default agent.
        let seed = FleetSeed { extra_abnormal: settings.demo_abnormal, extra_healthy: settings.demo_healthy };
        let fleet = demo_fleet(&backend, seed).await?;
        let calls: Arc<dyn RunStore> = store.clone();
        let model = model_of(&settings.model, settings.demo_delay)?;
        let agent = keel_opspilot::agent(fleet.clone(), calls, model)
            .context(context_for(&settings.model, keel_opspilot::SYSTEM_PROMPT));
        builder = builder
            .agent(agent)
            .default_agent(keel_opspilot::AGENT_ID)
            .routes(keel_opspilot::routes::routes(fleet, seed, true));
    }
    let (configured, tool_groups) = configured_agents(&settings).await?;
    if !demo_mode {
        if let Some(default) = settings.agents.iter().find(|a| a.default) {
            builder = builder.default_agent(&default.id);
        }
    }
    if configured.is_empty() && !demo_mode {
        let model = model_of(&settings.model, settings.demo_delay)?;
        let agent = Agent::new(ASSISTANT_ID, "Assistant", model, ASSISTANT_PROMPT)?
            .description("A plain assistant: the configured model, no tools (declare agents in keel.toml).")
            .context(context_for(&settings.model, ASSISTANT_PROMPT));
        builder = builder.agent(agent);
    }
    for agent in configured {
        builder = builder.agent(agent);
    }
    if let BusChoice::Redis(url) = &settings.bus {
        let bus =
            RedisBus::connect(url, "keel:").await.map_err(|e| anyhow::anyhow!("connecting the event bus: {e}"))?;
        builder = builder.bus(Arc::new(bus));
    }
    let single = backend.single_process();
    let bus = settings.bus.clone();
    let listener = tokio::net::TcpListener::bind(&settings.listen)
        .await
        .with_context(|| format!("listening on {}", settings.listen))?;
    let addr = listener.local_addr().context("reading the bound address")?;
    let auth = auth_mode(active_keys, addr, settings.insecure_no_auth)?;
    let allowed = allowed_hosts(&auth, addr, &settings.allowed_hosts);
    let keel = builder
        .engine_config(|c| {
            if let Some(id) = &settings.instance_id {
                c.instance_id = id.clone();
            }
            c.interrupt_ttl = settings.interrupt_ttl;
            c.max_message_chars = settings.max_message_chars;
            c.lease_ttl = settings.lease_ttl;
            c.max_concurrent_runs = settings.max_concurrent_runs;
            // How often the instance looks at the runs its idle streams follow (one query for all):
            // the only news of runs written by another instance without a shared bus, a safety net
            // where a shared bus may lose a message. One process with its local bus is delivered
            // every event: no idle reads.
            c.poll_interval = match (&bus, single) {
                (BusChoice::Local, true) => None,
                (BusChoice::Redis(_), _) => Some(Duration::from_secs(3)),
                (BusChoice::Local, false) => Some(Duration::from_secs(1)),
            };
            // Exported traces: every worker of a run joins the run's trace.
            c.run_span_hook = settings.otlp_endpoint.is_some().then(telemetry::run_span_hook);
        })
        .server_config(|c| {
            c.allowed_hosts = allowed;
            c.heartbeat = settings.heartbeat;
            c.auth = auth;
            c.rate_limit_per_second = settings.rate_limit;
            c.rate_limit_burst = settings.rate_burst;
            c.rate_limit_per_address = settings.rate_limit_per_address;
            c.rate_burst_per_address = settings.rate_burst_per_address;
            c.trusted_proxies = settings.trusted_proxies.clone();
            c.max_streams_per_user = settings.max_streams_per_user;
            c.body_limit = settings.body_limit;
            c.json_max_depth = settings.json_max_depth;
            c.replay_page_max = settings.replay_page_max;
            c.stream_ticket_ttl = settings.stream_ticket_ttl;
        })
        .start()
        .await
        .context("starting the engine")?;
    for groups in &tool_groups {
        groups.attach(keel.engine().agents().downgrade());
    }

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    // Listening before the banner says we serve: a signal sent once it is printed stops cleanly.
    let mut signals = ShutdownSignals::listen();
    tokio::spawn(async move {
        signals.recv().await;
        tracing::info!("shutting down; a second signal exits at once");
        stop_tx.send_replace(true);
        signals.recv().await;
        eprintln!("second signal: exiting now");
        std::process::exit(130);
    });
    if demo_mode {
        println!("Keel demo running at http://{addr}/");
    } else {
        println!("Keel listening on http://{addr}/");
    }
    tracing::info!(%addr, demo_mode, otlp = ?settings.otlp_endpoint, "serving");
    let mut rx = stop_rx;
    keel.serve(listener, async move {
        let _ = rx.wait_for(|stop| *stop).await;
    })
    .await
    .context("serving")?;
    Ok(())
}

/// SIGINT (Ctrl-C) or, on Unix, SIGTERM, caught from the moment [`ShutdownSignals::listen`]
/// returns (until then they would end the process at once, without a clean stop).
struct ShutdownSignals {
    #[cfg(unix)]
    interrupt: Option<tokio::signal::unix::Signal>,
    #[cfg(unix)]
    terminate: Option<tokio::signal::unix::Signal>,
}

impl ShutdownSignals {
    fn listen() -> Self {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            let listen = |kind: SignalKind, name: &str| match signal(kind) {
                Ok(s) => Some(s),
                Err(e) => {
                    tracing::error!(error = %e, "cannot listen for {name}");
                    None
                }
            };
            Self {
                interrupt: listen(SignalKind::interrupt(), "SIGINT"),
                terminate: listen(SignalKind::terminate(), "SIGTERM"),
            }
        }
        #[cfg(not(unix))]
        Self {}
    }

    async fn recv(&mut self) {
        #[cfg(unix)]
        {
            async fn next(signal: &mut Option<tokio::signal::unix::Signal>) {
                match signal {
                    Some(s) => {
                        s.recv().await;
                    }
                    None => std::future::pending().await,
                }
            }
            tokio::select! {
                () = next(&mut self.interrupt) => {}
                () = next(&mut self.terminate) => {}
            }
        }
        #[cfg(not(unix))]
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!(error = %e, "cannot listen for Ctrl-C");
            std::future::pending::<()>().await;
        }
    }
}
