//! OpsPilot: the demo ops agent's tools over a simulated fleet kept in Keel's own database.
//!
//! Read-only tools (`list_services`, `get_recent_errors`, `find_abnormal_instances`,
//! `get_instance`) are allowed for everyone. `restart_instance` and `rollback_release` change the
//! fleet: their policy is `ask`, their precheck re-reads the resource and the caller's role just
//! before they run, and their effect is applied by the store in the same transaction that records
//! the tool result — so the effect happens once or not at all.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::sync::Arc;

use async_trait::async_trait;
use keel_core::fleet::{Effect, Instance};
use keel_core::tool::{ActionDescription, Tool, ToolContext, ToolError, ToolOutput, ToolRegistry, ToolSpec};
use keel_core::UserRole;
use serde_json::{json, Value};

pub const SERVICES: &[&str] = &["payment-api", "order-api", "inventory-api"];
pub const ENVS: &[&str] = &["prod", "staging"];

/// Every OpsPilot tool.
pub fn registry() -> ToolRegistry {
    let mut r = ToolRegistry::new();
    r.register(Arc::new(ListServices::new()));
    r.register(Arc::new(GetRecentErrors::new()));
    r.register(Arc::new(FindAbnormalInstances::new()));
    r.register(Arc::new(GetInstance::new()));
    r.register(Arc::new(RestartInstance::new()));
    r.register(Arc::new(RollbackRelease::new()));
    r
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

/// The store's error text may name internals: the model and the events see a generic message.
fn backend(e: keel_core::store::StoreError) -> ToolError {
    tracing::error!(error = %e, "fleet store failed");
    ToolError::Failed("the fleet database is unavailable".into())
}

async fn load_instance(ctx: &ToolContext, id: &str) -> Result<Instance, ToolError> {
    ctx.store.get_instance(id).await.map_err(backend)?.ok_or_else(|| ToolError::Invalid(format!("no instance {id}")))
}

fn instance_json(i: &Instance) -> Value {
    json!({
        "id": i.id, "service": i.service, "env": i.env, "status": i.status,
        "restartCount": i.restart_count, "release": i.release
    })
}

pub struct ListServices(ToolSpec);
impl ListServices {
    pub fn new() -> Self {
        Self(ToolSpec::new(
            "list_services",
            "List the services, their environments and how many instances are abnormal.",
            json!({"type": "object", "properties": {}, "additionalProperties": false}),
            false,
        ))
    }
}
impl Default for ListServices {
    fn default() -> Self {
        Self::new()
    }
}

#[async_trait]
impl Tool for ListServices {
    fn spec(&self) -> &ToolSpec {
        &self.0
    }
    async fn execute(&self, ctx: &ToolContext, _args: &Value) -> Result<ToolOutput, ToolError> {
        let instances = ctx.store.list_instances(None, None).await.map_err(backend)?;
        let mut by: BTreeMap<(String, String), (u32, u32)> = BTreeMap::new();
        for i in &instances {
            let e = by.entry((i.service.clone(), i.env.clone())).or_default();
            e.0 += 1;
            if i.status == "abnormal" {
                e.1 += 1;
            }
        }
        let services: Vec<Value> =
            by.iter().map(|((s, e), (n, a))| json!({"service": s, "env": e, "instances": n, "abnormal": a})).collect();
        let abnormal: u32 = by.values().map(|v| v.1).sum();
        Ok(ToolOutput {
            summary: format!("{} services, {} abnormal instances", SERVICES.len(), abnormal),
            result: json!({"services": services}),
            ..Default::default()
        })
    }
}

pub struct GetRecentErrors(ToolSpec);
impl GetRecentErrors {
    pub fn new() -> Self {
        let mut schema = service_env_schema();
        schema["properties"]["minutes"] = json!({"type": "integer", "minimum": 1, "maximum": 1440});
        Self(ToolSpec::new(
            "get_recent_errors",
            "Count and sample the 5xx errors of a service in an environment over the last N minutes (default 15).",
            schema,
            false,
        ))
    }
}
impl Default for GetRecentErrors {
    fn default() -> Self {
        Self::new()
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
        let errors = ctx.store.recent_errors(service, env, since).await.map_err(backend)?;
        let mut by_instance: BTreeMap<&str, u32> = BTreeMap::new();
        let mut by_status: BTreeMap<String, u32> = BTreeMap::new();
        for e in &errors {
            *by_instance.entry(e.instance_id.as_str()).or_default() += 1;
            *by_status.entry(e.status_code.to_string()).or_default() += 1;
        }
        let top = by_instance.iter().max_by_key(|(_, n)| **n).map(|(i, n)| json!({"instanceId": i, "errors": n}));
        let samples: Vec<Value> = errors
            .iter()
            .take(3)
            .map(|e| json!({"instanceId": e.instance_id, "status": e.status_code, "message": e.message}))
            .collect();
        Ok(ToolOutput {
            summary: format!("{} 5xx errors in {service}/{env} in the last {minutes} min", errors.len()),
            result: json!({
                "service": service, "env": env, "minutes": minutes, "count": errors.len(),
                "byStatus": by_status, "topInstance": top, "samples": samples
            }),
            facts: vec![("service".into(), service.into()), ("env".into(), env.into())],
            effects: vec![],
        })
    }
}

pub struct FindAbnormalInstances(ToolSpec);
impl FindAbnormalInstances {
    pub fn new() -> Self {
        Self(ToolSpec::new(
            "find_abnormal_instances",
            "Find the abnormal instances of a service in an environment (those already waiting for a restart \
             approval in another run are left out).",
            service_env_schema(),
            false,
        ))
    }
}
impl Default for FindAbnormalInstances {
    fn default() -> Self {
        Self::new()
    }
}

#[async_trait]
impl Tool for FindAbnormalInstances {
    fn spec(&self) -> &ToolSpec {
        &self.0
    }
    async fn execute(&self, ctx: &ToolContext, args: &Value) -> Result<ToolOutput, ToolError> {
        let service = str_arg(args, "service")?;
        let env = str_arg(args, "env")?;
        let awaiting = ctx.store.instances_awaiting_restart().await.map_err(backend)?;
        let instances = ctx.store.list_instances(Some(service), Some(env)).await.map_err(backend)?;
        let abnormal: Vec<&Instance> =
            instances.iter().filter(|i| i.status == "abnormal" && !awaiting.contains(&i.id)).collect();
        let mut facts = vec![("service".to_owned(), service.to_owned()), ("env".to_owned(), env.to_owned())];
        if let [only] = abnormal.as_slice() {
            facts.push(("instance".into(), only.id.clone()));
        }
        let summary = match abnormal.as_slice() {
            [] => format!("no abnormal instance of {service}/{env}"),
            [one] => format!("{} is abnormal", one.id),
            many => format!("{} abnormal instances of {service}/{env}", many.len()),
        };
        Ok(ToolOutput {
            summary,
            result: json!({
                "service": service, "env": env, "total": instances.len(),
                "abnormal": abnormal.iter().map(|i| instance_json(i)).collect::<Vec<_>>()
            }),
            facts,
            effects: vec![],
        })
    }
}

pub struct GetInstance(ToolSpec);
impl GetInstance {
    pub fn new() -> Self {
        Self(ToolSpec::new(
            "get_instance",
            "Show one instance: status, restart count, release.",
            instance_schema(),
            false,
        ))
    }
}
impl Default for GetInstance {
    fn default() -> Self {
        Self::new()
    }
}

#[async_trait]
impl Tool for GetInstance {
    fn spec(&self) -> &ToolSpec {
        &self.0
    }
    async fn execute(&self, ctx: &ToolContext, args: &Value) -> Result<ToolOutput, ToolError> {
        let i = load_instance(ctx, str_arg(args, "instanceId")?).await?;
        Ok(ToolOutput {
            summary: format!("{} is {} ({} restarts)", i.id, i.status, i.restart_count),
            result: instance_json(&i),
            facts: vec![
                ("instance".into(), i.id.clone()),
                ("service".into(), i.service.clone()),
                ("env".into(), i.env.clone()),
            ],
            effects: vec![],
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

pub struct RestartInstance(ToolSpec);
impl RestartInstance {
    pub fn new() -> Self {
        // Not declared idempotent: after a crash mid-call a human decides, as for any tool whose
        // effect Keel cannot see. (This one's effect commits with its result, so it can't half-happen.)
        Self(
            ToolSpec::new("restart_instance", "Restart an abnormal instance.", instance_schema(), true)
                .idempotent(false),
        )
    }
}
impl Default for RestartInstance {
    fn default() -> Self {
        Self::new()
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
        let i = load_instance(ctx, str_arg(args, "instanceId")?).await?;
        if i.status != "abnormal" {
            return Err(ToolError::Precondition(format!("{} is already {}; it was not restarted", i.id, i.status)));
        }
        Ok(())
    }
    async fn execute(&self, ctx: &ToolContext, args: &Value) -> Result<ToolOutput, ToolError> {
        let i = load_instance(ctx, str_arg(args, "instanceId")?).await?;
        let count = i.restart_count + 1;
        Ok(ToolOutput {
            summary: format!("restarted {} (restart #{count})", i.id),
            result: json!({"instanceId": i.id, "status": "healthy", "restartCount": count, "restarted": true}),
            facts: vec![("instance".into(), i.id.clone())],
            effects: vec![Effect::RestartInstance { instance_id: i.id.clone() }],
        })
    }
}

pub struct RollbackRelease(ToolSpec);
impl RollbackRelease {
    pub fn new() -> Self {
        Self(
            ToolSpec::new(
                "rollback_release",
                "Roll a service in an environment back to its previous release.",
                service_env_schema(),
                true,
            )
            .idempotent(false),
        )
    }
}
impl Default for RollbackRelease {
    fn default() -> Self {
        Self::new()
    }
}

async fn current_release(ctx: &ToolContext, service: &str, env: &str) -> Result<(String, String), ToolError> {
    let instances = ctx.store.list_instances(Some(service), Some(env)).await.map_err(backend)?;
    let first = instances.first().ok_or_else(|| ToolError::Invalid(format!("no instances of {service}/{env}")))?;
    if instances.iter().any(|i| i.release != first.release) {
        return Err(ToolError::Precondition(format!("{service}/{env} is mid-deploy; nothing was rolled back")));
    }
    let previous = first
        .previous_release
        .clone()
        .ok_or_else(|| ToolError::Precondition(format!("{service}/{env} has no previous release")))?;
    Ok((first.release.clone(), previous))
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
        current_release(ctx, str_arg(args, "service")?, str_arg(args, "env")?).await.map(|_| ())
    }
    async fn execute(&self, ctx: &ToolContext, args: &Value) -> Result<ToolOutput, ToolError> {
        let service = str_arg(args, "service")?;
        let env = str_arg(args, "env")?;
        let (from, to) = current_release(ctx, service, env).await?;
        Ok(ToolOutput {
            summary: format!("rolled back {service}/{env} from {from} to {to}"),
            result: json!({"service": service, "env": env, "from": from, "to": to, "rolledBack": true}),
            facts: vec![("service".into(), service.into()), ("env".into(), env.into())],
            effects: vec![Effect::RollbackRelease { service: service.into(), env: env.into(), from_release: from }],
        })
    }
}
