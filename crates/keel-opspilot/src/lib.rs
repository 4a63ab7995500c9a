//! OpsPilot: the demo ops agent, built on Keel's library API like any user's agent — its tools, its
//! fleet in tables of its own, its system prompt and its two routes.
//!
//! Read-only tools (`list_services`, `get_recent_errors`, `find_abnormal_instances`,
//! `get_instance`) are allowed for everyone. `restart_instance` and `rollback_release` change the
//! fleet: their policy is `ask`, their precheck re-reads the resource and the caller's role just
//! before they run, and the fleet applies each effect **once per idempotency key** (the call's id,
//! the same on every attempt), in the transaction that records its answer — so the tools are
//! idempotent, and the engine may retry one that a crash cut off.
#![forbid(unsafe_code)]

pub mod fleet;
pub mod routes;

use std::sync::Arc;

use async_trait::async_trait;
use keel_core::agent::Agent;
use keel_core::model::Model;
use keel_core::store::RunStore;
use keel_core::tool::{ActionDescription, Tool, ToolContext, ToolError, ToolOutput, ToolRegistry, ToolSpec};
use keel_core::UserRole;
use serde_json::{json, Value};

pub use fleet::{Fleet, FleetError, FleetSeed, Instance, PostgresFleet, SqliteFleet};

/// The agent's id: `keel demo`'s default agent.
pub const AGENT_ID: &str = "opspilot";

pub const SYSTEM_PROMPT: &str = "You are OpsPilot, an operations assistant. Use the tools to look at the fleet; \
never invent instance names or numbers. Actions that change the fleet need a human's approval.";

/// What the page suggests asking.
pub const SUGGESTIONS: &[&str] = &[
    "Look at the recent errors of payment-api",
    "Continue investigating its recent error logs",
    "Restart this abnormal instance",
    "List the services",
];

pub const SERVICES: &[&str] = &["payment-api", "order-api", "inventory-api"];
pub const ENVS: &[&str] = &["prod", "staging"];

/// The most abnormal instances `find_abnormal_instances` lists; it says how many there are in all.
pub const ABNORMAL_LIMIT: u32 = 10;
/// How far `find_abnormal_instances` counts: past it the result says "at least" this many, so a
/// lookup costs the same in a fleet of fifty instances and of a hundred thousand.
pub const ABNORMAL_COUNT_UP_TO: u32 = 100;

/// The OpsPilot agent over `fleet`; `calls` lets it leave out instances another run is about to
/// restart.
pub fn agent(fleet: Arc<dyn Fleet>, calls: Arc<dyn RunStore>, model: Arc<dyn Model>) -> Agent {
    Agent::new(AGENT_ID, "OpsPilot", model, SYSTEM_PROMPT)
        .expect("a valid agent id")
        .description("An on-call assistant over a simulated fleet: it reads errors and instances; restarts and rollbacks wait for your approval.")
        .suggestions(SUGGESTIONS.iter().map(|s| (*s).to_owned()).collect())
        .tools(registry(fleet, calls))
}

/// Every OpsPilot tool.
pub fn registry(fleet: Arc<dyn Fleet>, calls: Arc<dyn RunStore>) -> ToolRegistry {
    ToolRegistry::new()
        .with(Arc::new(ListServices::new(fleet.clone())))
        .with(Arc::new(GetRecentErrors::new(fleet.clone())))
        .with(Arc::new(FindAbnormalInstances::new(fleet.clone(), calls)))
        .with(Arc::new(GetInstance::new(fleet.clone())))
        .with(Arc::new(RestartInstance::new(fleet.clone())))
        .with(Arc::new(RollbackRelease::new(fleet)))
}

fn service_env_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "service": {"type": "string", "enum": SERVICES},
            "env": {"type": "string", "enum": ENVS}
        },
        "required": ["service", "env"],
        "additionalProperties": false
    })
}

fn instance_schema() -> Value {
    json!({
        "type": "object",
        "properties": {"instanceId": {"type": "string", "minLength": 1, "maxLength": 64}},
        "required": ["instanceId"],
        "additionalProperties": false
    })
}

fn str_arg<'a>(args: &'a Value, key: &str) -> Result<&'a str, ToolError> {
    args.get(key).and_then(Value::as_str).ok_or_else(|| ToolError::Invalid(format!("{key} is required")))
}

/// The fleet's errors, as the model and the events see them: a storage failure's text may name
/// internals, so it goes to the log and the model gets a generic message.
fn tool_error(e: FleetError) -> ToolError {
    match e {
        FleetError::NotFound(m) => ToolError::Invalid(m),
        FleetError::Precondition(m) => ToolError::Precondition(m),
        FleetError::Backend(m) => {
            tracing::error!(error = %m, "the fleet's database failed");
            ToolError::Failed("the fleet database is unavailable".into())
        }
    }
}

async fn load_instance(fleet: &dyn Fleet, id: &str) -> Result<Instance, ToolError> {
    fleet.instance(id).await.map_err(tool_error)?.ok_or_else(|| ToolError::Invalid(format!("no instance {id}")))
}

fn instance_json(i: &Instance) -> Value {
    json!({
        "id": i.id, "service": i.service, "env": i.env, "status": i.status,
        "restartCount": i.restart_count, "release": i.release
    })
}

pub struct ListServices(ToolSpec, Arc<dyn Fleet>);
impl ListServices {
    pub fn new(fleet: Arc<dyn Fleet>) -> Self {
        Self(
            ToolSpec::new(
                "list_services",
                "List the services, their environments and how many instances are abnormal.",
                json!({"type": "object", "properties": {}, "additionalProperties": false}),
                false,
            ),
            fleet,
        )
    }
}

#[async_trait]
impl Tool for ListServices {
    fn spec(&self) -> &ToolSpec {
        &self.0
    }
    async fn execute(&self, _ctx: &ToolContext, _args: &Value) -> Result<ToolOutput, ToolError> {
        let services = self.1.services().await.map_err(tool_error)?;
        let abnormal: i64 = services.iter().map(|s| s.abnormal).sum();
        let count = services.iter().map(|s| s.service.as_str()).collect::<std::collections::BTreeSet<_>>().len();
        Ok(ToolOutput {
            summary: format!("{count} services, {abnormal} abnormal instances"),
            result: json!({"services": services.iter().map(|s| json!({
                "service": s.service, "env": s.env, "instances": s.instances, "abnormal": s.abnormal
            })).collect::<Vec<_>>()}),
            ..Default::default()
        })
    }
}

pub struct GetRecentErrors(ToolSpec, Arc<dyn Fleet>);
impl GetRecentErrors {
    pub fn new(fleet: Arc<dyn Fleet>) -> Self {
        let mut schema = service_env_schema();
        schema["properties"]["minutes"] = json!({"type": "integer", "minimum": 1, "maximum": 1440});
        Self(
            ToolSpec::new(
                "get_recent_errors",
                "Count and sample the 5xx errors of a service in an environment over the last N minutes (default 15).",
                schema,
                false,
            ),
            fleet,
        )
    }
}

#[async_trait]
impl Tool for GetRecentErrors {
    fn spec(&self) -> &ToolSpec {
        &self.0
    }
    async fn execute(&self, ctx: &ToolContext, args: &Value) -> Result<ToolOutput, ToolError> {
        let service = str_arg(args, "service")?;
        let env = str_arg(args, "env")?;
        let minutes = args.get("minutes").and_then(Value::as_i64).unwrap_or(15);
        let since = ctx.now - chrono::Duration::minutes(minutes);
        let stats = self.1.errors(service, env, since, 3).await.map_err(tool_error)?;
        let by_status: serde_json::Map<String, Value> =
            stats.by_status.iter().map(|(code, n)| (code.to_string(), json!(n))).collect();
        let top = stats.top_instance.as_ref().map(|(i, n)| json!({"instanceId": i, "errors": n}));
        let samples: Vec<Value> = stats
            .samples
            .iter()
            .map(|e| json!({"instanceId": e.instance_id, "status": e.status_code, "message": e.message}))
            .collect();
        Ok(ToolOutput {
            summary: format!("{} 5xx errors in {service}/{env} in the last {minutes} min", stats.count),
            result: json!({
                "service": service, "env": env, "minutes": minutes, "count": stats.count,
                "byStatus": by_status, "topInstance": top, "samples": samples
            }),
            facts: vec![("service".into(), service.into()), ("env".into(), env.into())],
        })
    }
}

pub struct FindAbnormalInstances(ToolSpec, Arc<dyn Fleet>, Arc<dyn RunStore>);
impl FindAbnormalInstances {
    pub fn new(fleet: Arc<dyn Fleet>, calls: Arc<dyn RunStore>) -> Self {
        Self(
            ToolSpec::new(
                "find_abnormal_instances",
                "Find the abnormal instances of a service in an environment (those already waiting for a restart \
                 approval in another run are left out; at most 10 are listed, with how many there are in all, \
                 counted up to 100).",
                service_env_schema(),
                false,
            ),
            fleet,
            calls,
        )
    }
}

#[async_trait]
impl Tool for FindAbnormalInstances {
    fn spec(&self) -> &ToolSpec {
        &self.0
    }
    async fn execute(&self, _ctx: &ToolContext, args: &Value) -> Result<ToolOutput, ToolError> {
        let service = str_arg(args, "service")?;
        let env = str_arg(args, "env")?;
        let awaiting: Vec<String> = self
            .2
            .asking_calls("restart_instance")
            .await
            .map_err(|e| tool_error(FleetError::from(e)))?
            .iter()
            .filter_map(|c| c.args.get("instanceId").and_then(Value::as_str).map(str::to_owned))
            .collect();
        let (abnormal, total) =
            self.1.abnormal(service, env, &awaiting, ABNORMAL_LIMIT, ABNORMAL_COUNT_UP_TO).await.map_err(tool_error)?;
        let at_least = total >= i64::from(ABNORMAL_COUNT_UP_TO);
        let mut facts = vec![("service".to_owned(), service.to_owned()), ("env".to_owned(), env.to_owned())];
        if let ([only], 1) = (abnormal.as_slice(), total) {
            facts.push(("instance".into(), only.id.clone()));
        }
        let summary = match (abnormal.as_slice(), total) {
            ([], _) => format!("no abnormal instance of {service}/{env}"),
            ([one], 1) => format!("{} is abnormal", one.id),
            (_, n) if at_least => format!("at least {n} abnormal instances of {service}/{env}"),
            (_, n) => format!("{n} abnormal instances of {service}/{env}"),
        };
        Ok(ToolOutput {
            summary,
            result: json!({
                "service": service, "env": env, "abnormalTotal": total, "abnormalTotalIsAtLeast": at_least,
                "abnormal": abnormal.iter().map(instance_json).collect::<Vec<_>>()
            }),
            facts,
        })
    }
}

pub struct GetInstance(ToolSpec, Arc<dyn Fleet>);
impl GetInstance {
    pub fn new(fleet: Arc<dyn Fleet>) -> Self {
        Self(
            ToolSpec::new(
                "get_instance",
                "Show one instance: status, restart count, release.",
                instance_schema(),
                false,
            ),
            fleet,
        )
    }
}

#[async_trait]
impl Tool for GetInstance {
    fn spec(&self) -> &ToolSpec {
        &self.0
    }
    async fn execute(&self, _ctx: &ToolContext, args: &Value) -> Result<ToolOutput, ToolError> {
        let i = load_instance(self.1.as_ref(), str_arg(args, "instanceId")?).await?;
        Ok(ToolOutput {
            summary: format!("{} is {} ({} restarts)", i.id, i.status, i.restart_count),
            result: instance_json(&i),
            facts: vec![
                ("instance".into(), i.id.clone()),
                ("service".into(), i.service.clone()),
                ("env".into(), i.env.clone()),
            ],
        })
    }
}

fn require_operator(ctx: &ToolContext) -> Result<(), ToolError> {
    match ctx.role {
        Some(UserRole::Operator | UserRole::Admin) => Ok(()),
        Some(UserRole::Viewer) | None => {
            Err(ToolError::Precondition(format!("{} is no longer an operator; nothing was changed", ctx.user_id)))
        }
    }
}

pub struct RestartInstance(ToolSpec, Arc<dyn Fleet>);
impl RestartInstance {
    pub fn new(fleet: Arc<dyn Fleet>) -> Self {
        // Idempotent: the fleet applies a restart once per key, so a retry after a crash answers
        // what the first attempt did.
        Self(
            ToolSpec::new("restart_instance", "Restart an abnormal instance.", instance_schema(), true)
                .idempotent(true),
            fleet,
        )
    }
}

#[async_trait]
impl Tool for RestartInstance {
    fn spec(&self) -> &ToolSpec {
        &self.0
    }
    fn describe(&self, args: &Value) -> ActionDescription {
        let id = args.get("instanceId").and_then(Value::as_str).unwrap_or("?");
        ActionDescription {
            title: format!("Restart {id}?"),
            risk: format!("Restarting {id} drops the requests it is serving; the other instances keep serving."),
            description: format!("Restart instance {id} (sets it healthy and counts a restart)."),
        }
    }
    async fn precheck(&self, ctx: &ToolContext, args: &Value) -> Result<(), ToolError> {
        require_operator(ctx)?;
        let i = load_instance(self.1.as_ref(), str_arg(args, "instanceId")?).await?;
        if i.status != "abnormal" {
            return Err(ToolError::Precondition(format!("{} is already {}; it was not restarted", i.id, i.status)));
        }
        Ok(())
    }
    async fn execute(&self, ctx: &ToolContext, args: &Value) -> Result<ToolOutput, ToolError> {
        let id = str_arg(args, "instanceId")?;
        let done = self.1.restart(id, &ctx.idempotency_key).await.map_err(tool_error)?;
        Ok(ToolOutput {
            summary: format!("restarted {} (restart #{})", done.instance_id, done.restart_count),
            result: json!({"instanceId": done.instance_id, "status": "healthy", "restartCount": done.restart_count, "restarted": true}),
            facts: vec![("instance".into(), done.instance_id)],
        })
    }
}

pub struct RollbackRelease(ToolSpec, Arc<dyn Fleet>);
impl RollbackRelease {
    pub fn new(fleet: Arc<dyn Fleet>) -> Self {
        Self(
            ToolSpec::new(
                "rollback_release",
                "Roll a service in an environment back to its previous release.",
                service_env_schema(),
                true,
            )
            .idempotent(true),
            fleet,
        )
    }
}

/// The release every instance of `service` in `env` is on, and the previous one.
async fn current_release(fleet: &dyn Fleet, service: &str, env: &str) -> Result<(String, String), ToolError> {
    let releases = fleet.releases(service, env).await.map_err(tool_error)?;
    match releases.as_slice() {
        [] => Err(ToolError::Invalid(format!("no instances of {service}/{env}"))),
        [(release, Some(previous))] => Ok((release.clone(), previous.clone())),
        [(_, None)] => Err(ToolError::Precondition(format!("{service}/{env} has no previous release"))),
        _ => Err(ToolError::Precondition(format!("{service}/{env} is mid-deploy; nothing was rolled back"))),
    }
}

#[async_trait]
impl Tool for RollbackRelease {
    fn spec(&self) -> &ToolSpec {
        &self.0
    }
    fn describe(&self, args: &Value) -> ActionDescription {
        let service = args.get("service").and_then(Value::as_str).unwrap_or("?");
        let env = args.get("env").and_then(Value::as_str).unwrap_or("?");
        ActionDescription {
            title: format!("Roll back {service} in {env}?"),
            risk: format!("Every instance of {service} in {env} goes back to the previous release."),
            description: format!("Roll back the current release of {service} in {env}."),
        }
    }
    async fn precheck(&self, ctx: &ToolContext, args: &Value) -> Result<(), ToolError> {
        require_operator(ctx)?;
        current_release(self.1.as_ref(), str_arg(args, "service")?, str_arg(args, "env")?).await.map(|_| ())
    }
    async fn execute(&self, ctx: &ToolContext, args: &Value) -> Result<ToolOutput, ToolError> {
        let service = str_arg(args, "service")?;
        let env = str_arg(args, "env")?;
        let (from, _) = current_release(self.1.as_ref(), service, env).await?;
        let done = self.1.rollback(service, env, &from, &ctx.idempotency_key).await.map_err(tool_error)?;
        Ok(ToolOutput {
            summary: format!("rolled back {service}/{env} from {} to {}", done.from, done.to),
            result: json!({"service": service, "env": env, "from": done.from, "to": done.to, "rolledBack": true}),
            facts: vec![("service".into(), service.into()), ("env".into(), env.into())],
        })
    }
}

/// OpsPilot over Keel's SQLite database: its fleet opened (and seeded with `seed` when empty), and
/// the agent with `model`. What the binary's demo mode does, for tests and examples.
pub async fn on_sqlite(
    store: &keel_store::SqliteStore,
    model: Arc<dyn Model>,
    seed: FleetSeed,
) -> Result<(Agent, Arc<dyn Fleet>), FleetError> {
    let fleet: Arc<dyn Fleet> = Arc::new(SqliteFleet::open(store).await?);
    if fleet.instances(1).await?.is_empty() {
        fleet.seed(seed, chrono::Utc::now()).await?;
    }
    let calls: Arc<dyn RunStore> = Arc::new(store.clone());
    Ok((agent(fleet.clone(), calls, model), fleet))
}

/// The same over Postgres.
pub async fn on_postgres(
    store: &keel_store::PostgresStore,
    model: Arc<dyn Model>,
    seed: FleetSeed,
) -> Result<(Agent, Arc<dyn Fleet>), FleetError> {
    let fleet: Arc<dyn Fleet> = Arc::new(PostgresFleet::open(store).await?);
    if fleet.instances(1).await?.is_empty() {
        fleet.seed(seed, chrono::Utc::now()).await?;
    }
    let calls: Arc<dyn RunStore> = Arc::new(store.clone());
    Ok((agent(fleet.clone(), calls, model), fleet))
}
