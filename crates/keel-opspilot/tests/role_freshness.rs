//! The role a tools step classifies its calls with. A step's role is read before its model call
//! (with the run's start, or with the step's context), so it is as old as the model's answer: it
//! serves only when every call it classifies would be asked about. A call that would run, or be
//! refused, is classified with the role read again after the answer.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use common::*;
use keel_core::engine::{EngineError, SendMessage};
use keel_core::model::{Model, ModelError, ModelRequest, ModelStream};
use keel_core::tool::{ActionDescription, Policy, Tool, ToolContext, ToolError, ToolOutput, ToolRegistry, ToolSpec};
use keel_core::{ConversationId, RunId, UserRole};
use keel_models::DemoModel;
use serde_json::{json, Value};
use tempfile::TempDir;
use tokio::sync::Semaphore;

/// The demo model, each of whose calls waits for a permit the test gives.
struct Gated {
    inner: DemoModel,
    permits: Arc<Semaphore>,
}

#[async_trait]
impl Model for Gated {
    fn name(&self) -> &str {
        "gated"
    }
    async fn stream(&self, request: ModelRequest) -> Result<ModelStream, ModelError> {
        self.permits.acquire().await.expect("the gate is open").forget();
        self.inner.stream(request).await
    }
}

/// A tool as it is, under another spec (its policies).
struct Respec {
    inner: Arc<dyn Tool>,
    spec: ToolSpec,
}

#[async_trait]
impl Tool for Respec {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }
    fn describe(&self, args: &Value) -> ActionDescription {
        self.inner.describe(args)
    }
    async fn precheck(&self, ctx: &ToolContext, args: &Value) -> Result<(), ToolError> {
        self.inner.precheck(ctx, args).await
    }
    async fn execute(&self, ctx: &ToolContext, args: &Value) -> Result<ToolOutput, ToolError> {
        self.inner.execute(ctx, args).await
    }
}

/// OpsPilot's tools, with `restart_instance` allowed for admins without asking (asked for
/// operators, refused for viewers).
fn admins_restart_at_once() -> Tools {
    Arc::new(|fleet, calls| {
        let base = keel_opspilot::registry(fleet, calls);
        let mut registry = ToolRegistry::new();
        for spec in base.specs().iter() {
            let tool = base.get(&spec.name).expect("registered").clone();
            if spec.name == "restart_instance" {
                let mut spec = spec.clone();
                spec.policies = BTreeMap::from([
                    (UserRole::Viewer, Policy::Deny),
                    (UserRole::Operator, Policy::Ask),
                    (UserRole::Admin, Policy::Allow),
                ]);
                registry.register(Arc::new(Respec { inner: tool, spec })).expect("register");
            } else {
                registry.register(tool).expect("register");
            }
        }
        registry
    })
}

async fn gated_harness(dir: &TempDir) -> (Harness, Arc<Semaphore>) {
    let permits = Arc::new(Semaphore::new(0));
    let model = Arc::new(Gated { inner: DemoModel::new(Duration::ZERO), permits: permits.clone() });
    let options = Options { model, tools: admins_restart_at_once(), extra_abnormal: 2, ..Default::default() };
    let h = Harness::new(dir.path(), options).await;
    (h, permits)
}

/// Sends `text`; while its first model call waits, sets the user's role to `role`; lets the model
/// answer; returns the run and its events once it pauses or ends.
async fn say_then_change_role(
    h: &Harness,
    permits: &Semaphore,
    conv: &ConversationId,
    text: &str,
    role: UserRole,
) -> (RunId, Vec<keel_core::Event>) {
    let started = h
        .engine
        .send_message("demo", conv, SendMessage { content: text.into(), cancel_on_disconnect: false })
        .await
        .expect("send");
    // the step read its role (with the start, or with its context) before its model call
    h.bus
        .until("the model step started", &started.run.id, |commits| {
            commits.iter().flatten().any(|t| *t == "node_started")
        })
        .await;
    h.store.set_user_role("demo", role).await.expect("role");
    permits.add_permits(8);
    let events = h.settle(&started.run.id, 0).await;
    (started.run.id, events)
}

/// An admin, made an operator while the model was thinking, is asked before the restart: the
/// call would have run with the role read before the answer, so it was classified with the role
/// as it is after. On a conversation's first run (the role read with its start) and on a later
/// one (the role read with the step's context).
#[tokio::test]
async fn a_call_that_would_run_is_classified_with_the_role_read_after_the_answer() {
    let dir = TempDir::new().unwrap();
    let (h, permits) = gated_harness(&dir).await;
    let first_turn = h.conversation().await;
    let later_turn = h.conversation().await;
    h.store.set_user_role("demo", UserRole::Admin).await.unwrap();
    permits.add_permits(8);
    let (_, earlier) = h.say(&later_turn, "what can you do?").await;
    assert_eq!(last_type(&earlier), "done");

    for (conv, instance) in [(&first_turn, "pay-prod-2"), (&later_turn, "pay-prod-a1")] {
        h.store.set_user_role("demo", UserRole::Admin).await.unwrap();
        let permits_left = permits.available_permits();
        permits.forget_permits(permits_left);
        let (run, events) =
            say_then_change_role(&h, &permits, conv, &format!("restart {instance}"), UserRole::Operator).await;
        assert_eq!(last_type(&events), "interrupt", "{run}: asked, not run");
        assert_eq!(h.restart_count(instance).await, 0, "{run}");
    }

    // with the role unchanged, an admin's restart runs at once
    h.store.set_user_role("demo", UserRole::Admin).await.unwrap();
    let conv = h.conversation().await;
    permits.forget_permits(permits.available_permits());
    let (run, events) = say_then_change_role(&h, &permits, &conv, "restart pay-prod-a2", UserRole::Admin).await;
    assert_eq!(last_type(&events), "done", "{run}");
    assert_eq!(h.restart_count("pay-prod-a2").await, 1);
}

/// The role read before the answer only ever asks: nothing runs and nothing is refused by it. An
/// operator made a viewer while the model was thinking is asked, and the viewer's approval is
/// refused (the answer is authorized with the role as it is then); an operator made an admin is
/// asked too, where the new role would have let the call run at once.
#[tokio::test]
async fn a_call_only_asked_about_is_asked_with_the_role_read_before_the_answer() {
    let dir = TempDir::new().unwrap();
    let (h, permits) = gated_harness(&dir).await;
    let conv = h.conversation().await;
    let (run, events) = say_then_change_role(&h, &permits, &conv, "restart pay-prod-2", UserRole::Viewer).await;
    assert_eq!(last_type(&events), "interrupt");
    let (interrupt, _) = interrupt_of(&events);
    let refused = h.resume(&run, &interrupt, json!("approve"), "k1").await;
    assert!(matches!(refused, Err(EngineError::Forbidden(_))), "{refused:?}");
    assert_eq!(h.restart_count("pay-prod-2").await, 0);

    h.store.set_user_role("demo", UserRole::Operator).await.unwrap();
    let conv = h.conversation().await;
    permits.forget_permits(permits.available_permits());
    let (run, events) = say_then_change_role(&h, &permits, &conv, "restart pay-prod-a1", UserRole::Admin).await;
    assert_eq!(last_type(&events), "interrupt", "{run}");
    assert_eq!(h.restart_count("pay-prod-a1").await, 0);
}
