//! Keel as a library: your agents — their models, their tools (anything that implements
//! [`keel_core::tool::Tool`], or HTTP tools from `keel-tools`) and their approval policies — over a
//! store, served on the same HTTP API as the `keel` binary (which is built on this crate).
//!
//! ```no_run
//! # async fn run(my_tool: std::sync::Arc<dyn keel_core::tool::Tool>, model: std::sync::Arc<dyn keel_core::model::Model>) -> Result<(), keel_runtime::KeelError> {
//! use keel_runtime::{Agent, Backend, Builder, ToolRegistry};
//!
//! let backend = Backend::open("sqlite://./keel-data/keel.db").await?;
//! let agent = Agent::new("support", "Support", model, "You answer customers' questions.")?
//!     .tools(ToolRegistry::new().with(my_tool));
//! let keel = Builder::new(backend).agent(agent).start().await?;
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
//! keel.serve(listener, async { let _ = tokio::signal::ctrl_c().await; }).await?;
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]

pub mod retention;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

pub use keel_core::agent::{Agent, AgentError, Agents};
use keel_core::bus::{Bus, LocalBus};
use keel_core::clock::{Clock, StoreClock, SystemClock};
use keel_core::engine::EngineParts;
pub use keel_core::engine::{Engine, EngineConfig};
use keel_core::store::Store;
pub use keel_core::tool::{Tool, ToolRegistry};
use keel_core::UserRole;
pub use keel_server::{AppState, ServerConfig, ServerMetrics};
use keel_store::{PostgresStore, SqliteStore};
use utoipa_axum::router::OpenApiRouter;

#[derive(Debug, thiserror::Error)]
pub enum KeelError {
    #[error("opening the database: {0}")]
    Store(#[from] keel_core::store::StoreError),
    #[error(transparent)]
    Agent(#[from] AgentError),
    #[error("the server has no agent: add one with Builder::agent")]
    NoAgent,
    #[error("starting the engine: {0}")]
    Engine(#[from] keel_core::engine::EngineError),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// Where runs live: embedded SQLite (one process) or Postgres (shared by several instances).
#[derive(Debug, Clone)]
pub enum Backend {
    Sqlite(SqliteStore),
    Postgres(PostgresStore),
}

impl Backend {
    /// `sqlite://PATH`, `sqlite::memory:` or `postgres://…`; the schema is created or upgraded.
    pub async fn open(url: &str) -> Result<Self, KeelError> {
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Ok(Backend::Postgres(PostgresStore::connect(url).await?))
        } else {
            Ok(Backend::Sqlite(SqliteStore::open_url(url).await?))
        }
    }

    pub fn store(&self) -> Arc<dyn Store> {
        match self {
            Backend::Sqlite(s) => Arc::new(s.clone()),
            Backend::Postgres(s) => Arc::new(s.clone()),
        }
    }

    /// SQLite is opened by this process alone, so leases a previous process left are stale; a
    /// shared Postgres may have other live instances, whose leases must expire first.
    pub fn single_process(&self) -> bool {
        matches!(self, Backend::Sqlite(_))
    }

    /// Closes the database (SQLite: checkpoints its WAL, so the file alone is the whole database).
    pub async fn close(&self) {
        match self {
            Backend::Sqlite(s) => s.close().await,
            Backend::Postgres(s) => s.close().await,
        }
    }
}

/// How long a graceful stop waits for open requests, and then for runs to reach a checkpoint.
pub const GRACE: Duration = Duration::from_secs(10);

/// Everything a Keel server is built from; [`Builder::start`] recovers what a previous process
/// left and starts the engine.
pub struct Builder {
    backend: Backend,
    agents: Vec<Agent>,
    default_agent: Option<String>,
    bus: Option<Arc<dyn Bus>>,
    clock: Option<Arc<dyn Clock>>,
    engine: EngineConfig,
    server: ServerConfig,
    routes: OpenApiRouter<AppState>,
    metrics: ServerMetrics,
    retention: retention::Retention,
}

impl Builder {
    pub fn new(backend: Backend) -> Self {
        let single = backend.single_process();
        let metrics = ServerMetrics::new();
        let engine = EngineConfig {
            steal_leases_on_start: single,
            metrics: metrics.recorder(),
            // How often the process looks at the runs its idle streams follow (one query for all):
            // the only news of runs written by another instance without a shared bus. One process
            // with its local bus has every event delivered: no idle reads (`Builder::bus` sets
            // an interval again).
            poll_interval: if single { None } else { Some(Duration::from_secs(1)) },
            ..EngineConfig::default()
        };
        Self {
            backend,
            agents: Vec::new(),
            default_agent: None,
            bus: None,
            clock: None,
            engine,
            server: ServerConfig::default(),
            routes: OpenApiRouter::new(),
            metrics,
            retention: retention::Retention::default(),
        }
    }

    /// Adds an agent; the first one added is the default unless [`Builder::default_agent`] says.
    pub fn agent(mut self, agent: Agent) -> Self {
        self.agents.push(agent);
        self
    }

    pub fn default_agent(mut self, id: &str) -> Self {
        self.default_agent = Some(id.to_owned());
        self
    }

    /// Fan-out between instances (the default: in-process only). A shared bus may lose a message,
    /// so the process then looks at the runs its idle streams follow every 3 s (unless
    /// [`Builder::engine_config`] set an interval).
    pub fn bus(mut self, bus: Arc<dyn Bus>) -> Self {
        self.bus = Some(bus);
        if self.engine.poll_interval.is_none() {
            self.engine.poll_interval = Some(Duration::from_secs(3));
        }
        self
    }

    /// The clock (the default: this machine's with SQLite, the database's with Postgres).
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = Some(clock);
        self
    }

    pub fn engine_config(mut self, change: impl FnOnce(&mut EngineConfig)) -> Self {
        change(&mut self.engine);
        self
    }

    pub fn server_config(mut self, change: impl FnOnce(&mut ServerConfig)) -> Self {
        change(&mut self.server);
        self
    }

    /// How long finished runs keep their events (the default: forever): a background task prunes
    /// older ones (see [`retention`]).
    pub fn retention(mut self, retention: retention::Retention) -> Self {
        self.retention = retention;
        self
    }

    /// Routes of the application's own, served among the authenticated `/v1` routes.
    pub fn routes(mut self, routes: OpenApiRouter<AppState>) -> Self {
        self.routes = self.routes.merge(routes);
        self
    }

    /// Builds the engine, continues the runs a previous process left, and starts the sweeper.
    pub async fn start(self) -> Result<Keel, KeelError> {
        if self.agents.is_empty() {
            return Err(KeelError::NoAgent);
        }
        let store = self.backend.store();
        if let keel_server::auth::AuthMode::SingleUser(user) = &self.server.auth {
            // The one user of a server without keys may run and approve its agents' tools: an
            // operator, unless a role was given to it (with `keel users`) before.
            if store.user_role(user).await?.is_none() {
                store.set_user_role(user, UserRole::Operator).await?;
            }
        }
        let agents = Agents::new(self.agents, self.default_agent.as_deref())?;
        let bus = self.bus.unwrap_or_else(|| Arc::new(LocalBus::default()));
        let clock: Arc<dyn Clock> = match self.clock {
            Some(clock) => clock,
            None if self.backend.single_process() => Arc::new(SystemClock),
            None => StoreClock::start(store.clone(), Duration::from_secs(30)).await?,
        };
        let engine = Arc::new(Engine::new(EngineParts { store, agents, bus, clock }, self.engine));
        let recovered = engine.start().await?;
        if recovered > 0 {
            tracing::info!(recovered, "continuing runs left by the previous process");
        }
        let pruner =
            self.retention.enabled().then(|| pruner(engine.store().clone(), self.retention, self.metrics.clone()));
        let state = AppState::new(engine.clone(), self.server).with_metrics(self.metrics);
        Ok(Keel { engine, state, routes: self.routes, backend: self.backend, recovered, pruner })
    }
}

/// A started server: the engine runs; [`Keel::serve`] answers HTTP until told to stop.
pub struct Keel {
    engine: Arc<Engine>,
    state: AppState,
    routes: OpenApiRouter<AppState>,
    backend: Backend,
    recovered: usize,
    /// The retention task, when a policy prunes anything.
    pruner: Option<tokio::task::JoinHandle<()>>,
}

/// Prunes what `retention` covers now and then every `retention.every`, until aborted. A failed
/// pass is logged and tried again at the next.
fn pruner(
    store: Arc<dyn Store>,
    retention: retention::Retention,
    metrics: ServerMetrics,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut every = tokio::time::interval(retention.every);
        let mut pruner = retention::Pruner::new(retention);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            every.tick().await;
            let counted = |batch: keel_core::store::Pruned| metrics.pruned("run_events", batch.events);
            match pruner.pass(store.as_ref(), chrono::Utc::now(), counted).await {
                Ok(pruned) if pruned.events > 0 => tracing::info!(events = pruned.events, "retention pruned events"),
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "retention failed; the next pass tries again"),
            }
        }
    })
}

impl Keel {
    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    pub fn store(&self) -> Arc<dyn Store> {
        self.engine.store().clone()
    }

    /// Runs the previous process left that this one continued.
    pub fn recovered(&self) -> usize {
        self.recovered
    }

    /// The server's shared state (its metrics registry, its settings).
    pub fn state(&self) -> &AppState {
        &self.state
    }

    /// Serves the API on `listener` until `shutdown` resolves; then stops accepting, lets open
    /// requests finish (up to [`GRACE`]), lets every run reach its next checkpoint and closes the
    /// database. A run that was mid-way continues from its checkpoint when a server starts again.
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), KeelError> {
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let stopped = move || {
            let mut rx = stop_rx.clone();
            async move {
                let _ = rx.wait_for(|stop| *stop).await;
            }
        };
        tokio::spawn(async move {
            shutdown.await;
            stop_tx.send_replace(true);
        });
        let mut server = tokio::spawn(keel_server::serve(listener, self.state.clone(), self.routes, stopped()));
        let served: Result<(), KeelError> = tokio::select! {
            result = &mut server => result.map_err(std::io::Error::other).and_then(|r| r).map_err(KeelError::from),
            () = stopped() => match tokio::time::timeout(GRACE, &mut server).await {
                Ok(result) => result.map_err(std::io::Error::other).and_then(|r| r).map_err(KeelError::from),
                Err(_) => {
                    tracing::warn!("open connections did not close within {GRACE:?}; closing them");
                    Ok(())
                }
            },
        };
        // On every path, an error included: no worker writes after the store is closed.
        if let Some(pruner) = &self.pruner {
            pruner.abort();
        }
        self.engine.shutdown(GRACE).await;
        let still_running = self.engine.active_workers();
        self.backend.close().await;
        tracing::info!(still_running, "stopped");
        served
    }
}
