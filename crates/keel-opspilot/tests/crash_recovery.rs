//! A tool call cut off by a crash: retried if its tool is idempotent, otherwise `unknown` and a
//! human decides.

mod common;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use common::*;
use keel_core::tool::{ActionDescription, Tool, ToolContext, ToolError, ToolOutput, ToolRegistry, ToolSpec};
use keel_core::{EventKind, ToolCallState};
use keel_models::DemoModel;
use serde_json::{json, Value};
use tempfile::TempDir;
use tokio::sync::Notify;

/// Wraps a tool; its execution never finishes (the process "dies" during it).
struct Hang {
    inner: Arc<dyn Tool>,
    entered: Arc<Notify>,
}

#[async_trait]
impl Tool for Hang {
    fn spec(&self) -> &ToolSpec {
        self.inner.spec()
    }
    fn describe(&self, args: &Value) -> ActionDescription {
        self.inner.describe(args)
    }
    async fn precheck(&self, ctx: &ToolContext, args: &Value) -> Result<(), ToolError> {
        self.inner.precheck(ctx, args).await
    }
    async fn execute(&self, _ctx: &ToolContext, _args: &Value) -> Result<ToolOutput, ToolError> {
        self.entered.notify_one();
        std::future::pending().await
    }
}

fn registry_hanging(name: &str, entered: Arc<Notify>) -> ToolRegistry {
    let base = keel_opspilot::registry();
    let mut r = ToolRegistry::new();
    for spec in base.specs() {
        let tool = base.get(&spec.name).unwrap().clone();
        if spec.name == name {
            r.register(Arc::new(Hang { inner: tool, entered: entered.clone() }));
        } else {
            r.register(tool);
        }
    }
    r
}

#[tokio::test]
async fn an_idempotent_call_cut_off_by_a_crash_is_retried() {
    let dir = TempDir::new().unwrap();
    let entered = Arc::new(Notify::new());
    let h = Harness::new(
        dir.path(),
        Options { tools: registry_hanging("get_recent_errors", entered.clone()), ..Default::default() },
    )
    .await;
    let clock = h.clock.clone();
    let conv = h.conversation().await;
    let started = h
        .engine
        .send_message(
            "demo",
            &conv,
            keel_core::engine::SendMessage {
                content: "Look at the recent errors of payment-api".into(),
                cancel_on_disconnect: false,
            },
        )
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(10), entered.notified()).await.unwrap();
    let run = started.run.id;
    assert_eq!(h.store.list_tool_calls(&run).await.unwrap()[0].state, ToolCallState::Executing);
    drop(h);

    let h = Harness::open(dir.path(), clock, Arc::new(DemoModel::new(Duration::ZERO)), keel_opspilot::registry()).await;
    let events = h.settle(&run, 0).await;
    assert_eq!(last_type(&events), "done");
    assert!(text(&events).contains("12 5xx errors"));
    assert_contiguous(&events);
    assert_eq!(h.store.list_tool_calls(&run).await.unwrap()[0].state, ToolCallState::Succeeded);
}

#[tokio::test]
async fn a_non_idempotent_call_cut_off_by_a_crash_waits_for_a_human() {
    let dir = TempDir::new().unwrap();
    let entered = Arc::new(Notify::new());
    let h = Harness::new(
        dir.path(),
        Options { tools: registry_hanging("restart_instance", entered.clone()), ..Default::default() },
    )
    .await;
    let clock = h.clock.clone();
    let conv = h.conversation().await;
    let (run, ev) = h.say(&conv, "restart pay-prod-2").await;
    let (interrupt, _) = interrupt_of(&ev);
    let key = "k1";
    let accepted = h.resume(&run, &interrupt, json!("approve"), key).await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), entered.notified()).await.unwrap();
    drop(h);

    let h = Harness::open(dir.path(), clock, Arc::new(DemoModel::new(Duration::ZERO)), keel_opspilot::registry()).await;
    let events = h.settle(&run, accepted.resumed_sequence).await;
    assert_eq!(last_type(&events), "interrupt", "the run pauses for a human");
    let second = events
        .iter()
        .rev()
        .find_map(|e| match &e.kind {
            EventKind::Interrupt { interrupt_id, payload, .. } => Some((interrupt_id.clone(), payload.clone())),
            _ => None,
        })
        .unwrap();
    assert_ne!(second.0, interrupt);
    assert_eq!(second.1["outcomeUnknown"], true);
    assert_eq!(second.1["actions"][0]["outcome"], "unknown");
    let call = h.store.list_tool_calls(&run).await.unwrap().into_iter().find(|c| c.name == "restart_instance").unwrap();
    assert_eq!(call.state, ToolCallState::Unknown);
    assert_eq!(h.restart_count("pay-prod-2").await, 0);

    let after = h.decide(&run, &second.0, json!("approve")).await;
    assert_eq!(last_type(&after), "done");
    assert_eq!(h.restart_count("pay-prod-2").await, 1);
    assert_contiguous(&h.all_events(&run).await);
}
