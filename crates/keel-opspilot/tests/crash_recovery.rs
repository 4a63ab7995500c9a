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

/// Wraps a tool; its execution never finishes (the process "dies" during it). With `applied`, the
/// effect happens first: the process dies after the side effect, before it recorded the result.
struct Hang {
    inner: Arc<dyn Tool>,
    spec: ToolSpec,
    entered: Arc<Notify>,
    applied: bool,
}

#[async_trait]
impl Tool for Hang {
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
        if self.applied {
            self.inner.execute(ctx, args).await?;
        }
        self.entered.notify_one();
        std::future::pending().await
    }
}

/// OpsPilot's tools with `name` hanging; `idempotent` overrides what that tool declares.
fn hanging(name: &'static str, entered: Arc<Notify>, idempotent: Option<bool>, applied: bool) -> Tools {
    Arc::new(move |fleet, calls| {
        let base = keel_opspilot::registry(fleet, calls);
        let mut r = ToolRegistry::new();
        for spec in base.specs().iter() {
            let tool = base.get(&spec.name).unwrap().clone();
            if spec.name == name {
                let mut spec = spec.clone();
                spec.idempotent = idempotent.unwrap_or(spec.idempotent);
                r.register(Arc::new(Hang { inner: tool, spec, entered: entered.clone(), applied })).unwrap();
            } else {
                r.register(tool).unwrap();
            }
        }
        r
    })
}

#[tokio::test]
async fn an_idempotent_call_cut_off_by_a_crash_is_retried() {
    let dir = TempDir::new().unwrap();
    let entered = Arc::new(Notify::new());
    let h = Harness::new(
        dir.path(),
        Options { tools: hanging("get_recent_errors", entered.clone(), None, false), ..Default::default() },
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
    // A read-only call's attempt is written with its result, or, while the call takes its time,
    // on its own once `delta_flush_interval` has passed: the call that hangs is shown started.
    h.bus
        .until("the hanging call's attempt is written", &run, |commits| {
            commits.iter().any(|c| c.contains(&"tool_started"))
        })
        .await;
    assert_eq!(h.store.list_tool_calls(&run).await.unwrap()[0].state, ToolCallState::Executing);
    let commits = h.bus.commits(&run);
    assert!(commits.last().unwrap().ends_with(&["node_started", "tool_started"]), "{commits:?}");
    drop(h);

    let h = Harness::open(dir.path(), clock, Arc::new(DemoModel::new(Duration::ZERO)), opspilot()).await;
    let events = h.settle(&run, 0).await;
    assert_eq!(last_type(&events), "done");
    assert!(text(&events).contains("12 5xx errors"));
    assert_contiguous(&events);
    let call = h.store.list_tool_calls(&run).await.unwrap().remove(0);
    assert_eq!((call.state, call.attempts), (ToolCallState::Succeeded, 2), "attempted twice, with one key");
}

/// The restart is applied, then the process dies before it records the result: the retry after the
/// crash carries the same key, and the fleet answers what it did without restarting again.
#[tokio::test]
async fn a_restart_cut_off_after_its_effect_is_retried_and_applied_once() {
    let dir = TempDir::new().unwrap();
    let entered = Arc::new(Notify::new());
    let h = Harness::new(
        dir.path(),
        Options { tools: hanging("restart_instance", entered.clone(), None, true), ..Default::default() },
    )
    .await;
    let clock = h.clock.clone();
    let conv = h.conversation().await;
    let (run, ev) = h.say(&conv, "restart pay-prod-2").await;
    let (interrupt, _) = interrupt_of(&ev);
    let accepted = h.resume(&run, &interrupt, json!("approve"), "k1").await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), entered.notified()).await.unwrap();
    assert_eq!(h.restart_count("pay-prod-2").await, 1, "applied before the crash");
    drop(h);

    let h = Harness::open(dir.path(), clock, Arc::new(DemoModel::new(Duration::ZERO)), opspilot()).await;
    let events = h.settle(&run, accepted.resumed_sequence).await;
    assert_eq!(last_type(&events), "done", "no human asked: the tool is idempotent");
    assert_eq!(h.restart_count("pay-prod-2").await, 1, "the retry did not restart it again");
    let call = h.store.list_tool_calls(&run).await.unwrap().into_iter().find(|c| c.name == "restart_instance").unwrap();
    assert_eq!((call.state, call.attempts), (ToolCallState::Succeeded, 2));
    assert_contiguous(&h.all_events(&run).await);
}

/// A non-idempotent call cut off by a crash: its outcome is unknown, and the run asks a human
/// (`outcome_unknown`), who may retry it with the same key, say it was done, or say it failed.
async fn cut_off_restart(applied: bool) -> (TempDir, Harness, keel_core::RunId, keel_core::InterruptId, Value) {
    let dir = TempDir::new().unwrap();
    let entered = Arc::new(Notify::new());
    let h = Harness::new(
        dir.path(),
        Options { tools: hanging("restart_instance", entered.clone(), Some(false), applied), ..Default::default() },
    )
    .await;
    let clock = h.clock.clone();
    let conv = h.conversation().await;
    let (run, ev) = h.say(&conv, "restart pay-prod-2").await;
    let (interrupt, _) = interrupt_of(&ev);
    let accepted = h.resume(&run, &interrupt, json!("approve"), "k1").await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), entered.notified()).await.unwrap();
    drop(h);

    // The same tools, still not idempotent, now answering.
    let tools: Tools = Arc::new(|fleet, calls| {
        let base = keel_opspilot::registry(fleet, calls);
        let mut r = ToolRegistry::new();
        for spec in base.specs().iter() {
            let tool = base.get(&spec.name).unwrap().clone();
            r.register(if spec.name == "restart_instance" { Arc::new(NotIdempotent(tool)) } else { tool }).unwrap();
        }
        r
    });
    let h = Harness::open(dir.path(), clock, Arc::new(DemoModel::new(Duration::ZERO)), tools).await;
    let events = h.settle(&run, accepted.resumed_sequence).await;
    assert_eq!(last_type(&events), "interrupt", "the run pauses for a human");
    let (second, payload, kind) = events
        .iter()
        .rev()
        .find_map(|e| match &e.kind {
            EventKind::Interrupt { interrupt_id, payload, kind, .. } => {
                Some((interrupt_id.clone(), payload.inner().clone(), *kind))
            }
            _ => None,
        })
        .unwrap();
    assert_ne!(second, interrupt);
    assert_eq!(kind, keel_core::InterruptKind::OutcomeUnknown);
    assert_eq!(payload["outcomeUnknown"], true);
    assert_eq!(payload["actions"][0]["outcome"], "unknown");
    assert_eq!(payload["decisions"], json!(["retry", "mark_done", "mark_failed"]));
    let call = h.store.list_tool_calls(&run).await.unwrap().into_iter().find(|c| c.name == "restart_instance").unwrap();
    assert_eq!(call.state, ToolCallState::Unknown);
    (dir, h, run, second, payload)
}

/// `restart_instance`, declared not idempotent.
#[allow(non_snake_case)]
fn NotIdempotent(inner: Arc<dyn Tool>) -> NotIdempotentTool {
    let mut spec = inner.spec().clone();
    spec.idempotent = false;
    NotIdempotentTool(inner, spec)
}

struct NotIdempotentTool(Arc<dyn Tool>, ToolSpec);

#[async_trait]
impl Tool for NotIdempotentTool {
    fn spec(&self) -> &ToolSpec {
        &self.1
    }
    fn describe(&self, args: &Value) -> ActionDescription {
        self.0.describe(args)
    }
    async fn precheck(&self, ctx: &ToolContext, args: &Value) -> Result<(), ToolError> {
        self.0.precheck(ctx, args).await
    }
    async fn execute(&self, ctx: &ToolContext, args: &Value) -> Result<ToolOutput, ToolError> {
        self.0.execute(ctx, args).await
    }
}

#[tokio::test]
async fn an_unknown_outcome_retried_runs_the_call_again_with_its_key() {
    let (_dir, h, run, interrupt, _) = cut_off_restart(false).await;
    assert_eq!(h.restart_count("pay-prod-2").await, 0);
    let after = h.decide(&run, &interrupt, json!("retry")).await;
    assert_eq!(last_type(&after), "done");
    assert_eq!(h.restart_count("pay-prod-2").await, 1);
    let call = h.store.list_tool_calls(&run).await.unwrap().into_iter().find(|c| c.name == "restart_instance").unwrap();
    assert_eq!((call.state, call.attempts), (ToolCallState::Succeeded, 2));
    let decided = h.store.list_interrupts(&run).await.unwrap().pop().unwrap();
    assert_eq!(decided.resolved_by.as_deref(), Some("demo"));
    assert_contiguous(&h.all_events(&run).await);
}

#[tokio::test]
async fn an_unknown_outcome_that_did_happen_is_marked_done_by_a_human() {
    let (_dir, h, run, interrupt, _) = cut_off_restart(true).await;
    assert_eq!(h.restart_count("pay-prod-2").await, 1, "it happened before the crash");
    let accepted = h
        .engine
        .resume(
            "demo",
            &run,
            keel_core::engine::ResumeRequest {
                interrupt_id: interrupt.clone(),
                decision: keel_core::engine::Decision::MarkDone,
                idempotency_key: "mark".into(),
                note: Some("checked the dashboard: it restarted".into()),
            },
        )
        .await
        .unwrap();
    let after = h.settle(&run, accepted.resumed_sequence - 1).await;
    assert_eq!(last_type(&after), "done");
    assert_eq!(h.restart_count("pay-prod-2").await, 1, "nothing ran again");
    let call = h.store.list_tool_calls(&run).await.unwrap().into_iter().find(|c| c.name == "restart_instance").unwrap();
    assert_eq!(call.state, ToolCallState::Succeeded);
    assert_eq!(call.result.as_ref().unwrap()["confirmedBy"], "demo");
    let decided = h.store.list_interrupts(&run).await.unwrap().pop().unwrap();
    assert_eq!(decided.resolved_by.as_deref(), Some("demo"));
    assert_eq!(decided.note.as_ref().map(|n| n.as_str()), Some("checked the dashboard: it restarted"));
    assert!(after.iter().any(
        |e| matches!(&e.kind, EventKind::ToolFinished { summary, .. } if summary.contains("marked done by demo"))
    ));
}

#[tokio::test]
async fn an_unknown_outcome_that_did_not_happen_is_marked_failed_by_a_human() {
    let (_dir, h, run, interrupt, _) = cut_off_restart(false).await;
    let after = h.decide(&run, &interrupt, json!("mark_failed")).await;
    assert_eq!(last_type(&after), "done");
    assert_eq!(h.restart_count("pay-prod-2").await, 0);
    let call = h.store.list_tool_calls(&run).await.unwrap().into_iter().find(|c| c.name == "restart_instance").unwrap();
    assert_eq!(call.state, ToolCallState::Failed);
    assert!(after
        .iter()
        .any(|e| matches!(&e.kind, EventKind::ToolFinished { error_code: Some(c), .. } if c == "marked_failed")));
    // A decision that does not fit the kind of question is refused.
    let (_dir2, h2, run2, interrupt2, _) = cut_off_restart(false).await;
    let refused = h2.resume(&run2, &interrupt2, json!("approve"), "k9").await.unwrap_err();
    assert_eq!(refused.code(), "INVALID_DECISION");
}
