//! `keel runs list|show|watch`: the runs of the caller, one run's history, and reattaching to a run.

use anyhow::Context;
use keel_client::{ListRuns, RunBody};
use keel_core::{Interrupt, InterruptStatus, RunStatus};

use super::term::{self, Input, Renderer};
use super::{connect, decision_text, detached, follow, parse_run_id, time, Exit, Followed, RunsCommand};

pub async fn run(command: RunsCommand) -> anyhow::Result<Exit> {
    match command {
        RunsCommand::List { server, status, limit } => {
            let keel = connect(&server)?;
            let status = match status.as_deref() {
                None => None,
                Some(raw) => Some(RunStatus::parse(raw).ok_or_else(|| {
                    let all: Vec<&str> = RunStatus::ALL.iter().map(|s| s.as_str()).collect();
                    anyhow::anyhow!("--status: expected one of {}, got `{raw}`", all.join(", "))
                })?),
            };
            let list = keel.list_runs(ListRuns { status, limit: Some(limit) }).await.context("listing runs")?;
            if list.runs.is_empty() {
                println!("No runs.");
                return Ok(Exit::Done);
            }
            println!("{:<38} {:<12} {:<24} {:>6}  CONVERSATION", "RUN", "STATUS", "CREATED", "EVENTS");
            for run in list.runs {
                println!(
                    "{:<38} {:<12} {:<24} {:>6}  {}",
                    run.id.as_str(),
                    run.status.as_str(),
                    time(&run.created_at),
                    run.last_sequence,
                    run.conversation_id
                );
            }
            Ok(Exit::Done)
        }
        RunsCommand::Show { server, run_id } => {
            let keel = connect(&server)?;
            let run_id = parse_run_id(&run_id)?;
            let run = keel.get_run(&run_id).await.with_context(|| format!("reading {run_id}"))?;
            print!("{}", history(&run));
            Ok(Exit::Done)
        }
        RunsCommand::Watch { server, run_id } => {
            let keel = connect(&server)?;
            let run_id = parse_run_id(&run_id)?;
            let run = keel.get_run(&run_id).await.with_context(|| format!("reading {run_id}"))?;
            let mut input = Input::stdin().context("listening for Ctrl-C")?;
            let mut out = Renderer::new();
            out.line(&format!("Run {run_id} ({}), from its first event:", run.status));
            match follow(&keel, &run_id, 0, &mut input, &mut out).await? {
                Followed::Ended(status) => {
                    out.line(&format!("Run {run_id} {status}."));
                    Ok(Exit::Done)
                }
                Followed::Detached => {
                    detached(&mut out, &run_id);
                    Ok(Exit::Detached)
                }
                Followed::Undecided => Ok(Exit::Done),
            }
        }
    }
}

/// `keel runs show`: the run, its tool calls, and each interrupt with who decided what, when.
fn history(run: &RunBody) -> String {
    let mut s = String::new();
    let mut line = |text: String| {
        s.push_str(&text);
        s.push('\n');
    };
    line(format!(
        "Run {}: {}{}",
        run.id,
        run.status,
        run.reason.as_deref().map(|r| format!(" ({r})")).unwrap_or_default()
    ));
    line(format!("  conversation  {}", run.conversation_id));
    line(format!("  created       {}", time(&run.created_at)));
    line(format!("  updated       {}", time(&run.updated_at)));
    line(format!("  events        {}", run.last_sequence));
    // Where it runs, or ran: the instance that holds, or last held, its lease.
    let unclaimed = match run.status {
        RunStatus::Waiting => "none yet (waiting its turn behind the conversation's run)",
        _ => "none yet (queued)",
    };
    line(format!("  worker        {}", run.worker.as_deref().unwrap_or(unclaimed)));
    if run.status.is_active() {
        line(format!("  next step     {}", run.checkpoint.next_step));
    }
    if run.status == RunStatus::RolledBack {
        line("  rolled back   its messages and events were removed; its tool calls and decisions are kept".into());
    }
    if !run.tool_calls.is_empty() {
        line("Tool calls:".into());
        for call in &run.tool_calls {
            let when = match (&call.started_at, &call.finished_at) {
                (Some(start), Some(end)) => format!("  [{} → {}]", time(start), time(end)),
                (Some(start), None) => format!("  [started {}]", time(start)),
                _ => String::new(),
            };
            let summary = call.summary.as_deref().map(|s| format!(": {s}")).unwrap_or_default();
            line(format!("  {} {}{summary}{when}", call.name, call.state));
        }
    }
    if !run.interrupts.is_empty() {
        line("Decisions:".into());
        for text in decision_lines(&run.interrupts) {
            line(text);
        }
    }
    s
}

/// Each interrupt on a line of its own, and the decider's note, if any, on the next one.
fn decision_lines(interrupts: &[Interrupt]) -> Vec<String> {
    let mut lines = Vec::new();
    for interrupt in interrupts {
        lines.push(format!("  {}", decided(interrupt)));
        if let Some(note) = &interrupt.note {
            lines.push(format!("    note: {note}"));
        }
    }
    lines
}

/// "[confirm_action] Restart pay-prod-2? (restart_instance {…}): approved by demo at 2030-01-01
/// 12:00:05 UTC (asked …)".
fn decided(interrupt: &Interrupt) -> String {
    let actions: Vec<String> =
        term::actions(&interrupt.payload).into_iter().map(|a| format!("{} {}", a.tool, a.args)).collect();
    let what = if actions.is_empty() {
        term::title(&interrupt.payload).to_owned()
    } else {
        format!("{} ({})", term::title(&interrupt.payload), actions.join(", "))
    };
    let outcome = match interrupt.status {
        InterruptStatus::Resolved => {
            let decision = interrupt.decision.as_deref().map(decision_text).unwrap_or_else(|| "decided".into());
            let by = interrupt.resolved_by.as_deref().unwrap_or("someone");
            let at = interrupt.resolved_at.as_ref().map(time).unwrap_or_else(|| "an unknown time".into());
            format!("{decision} by {by} at {at}")
        }
        InterruptStatus::Pending => format!("waiting for a decision until {}", time(&interrupt.expires_at)),
        InterruptStatus::Expired => format!("expired at {}, nobody decided", time(&interrupt.expires_at)),
        InterruptStatus::Cancelled => {
            let at = interrupt.resolved_at.as_ref().map(time).unwrap_or_else(|| time(&interrupt.expires_at));
            format!("cancelled at {at}")
        }
    };
    format!("[{}] {what}: {outcome} (asked {})", interrupt.kind, time(&interrupt.created_at))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn interrupt(status: &str, decision: serde_json::Value) -> Interrupt {
        interrupt_of("confirm_action", status, decision, None)
    }

    fn interrupt_of(kind: &str, status: &str, decision: serde_json::Value, note: Option<&str>) -> Interrupt {
        serde_json::from_value(json!({
            "id": "int_1", "runId": "run_1", "kind": kind, "status": status, "note": note,
            "payload": {"title": "Restart pay-prod-2?", "actions": [
                {"callId": "call_1", "tool": "restart_instance", "args": {"instanceId": "pay-prod-2"}}]},
            "callIds": ["call_1"], "createdAt": "2030-01-01T12:00:00Z", "expiresAt": "2030-01-01T12:15:00Z",
            "decision": decision, "resolvedBy": "alice", "resolvedAt": "2030-01-01T12:00:05Z"
        }))
        .unwrap()
    }

    #[test]
    fn a_decision_says_who_decided_what_and_when() {
        assert_eq!(
            decided(&interrupt("resolved", json!("approve"))),
            "[confirm_action] Restart pay-prod-2? (restart_instance {\"instanceId\":\"pay-prod-2\"}): approved by alice at \
             2030-01-01 12:00:05 UTC (asked 2030-01-01 12:00:00 UTC)"
        );
        assert!(decided(&interrupt("resolved", json!("reject"))).contains(": rejected by alice at"));
        assert!(
            decided(&interrupt("pending", json!(null))).contains("waiting for a decision until 2030-01-01 12:15:00")
        );
        assert!(
            decided(&interrupt("expired", json!(null))).contains("expired at 2030-01-01 12:15:00 UTC, nobody decided")
        );
    }

    #[test]
    fn the_history_names_each_kind_and_shows_the_notes() {
        let unknown =
            interrupt_of("outcome_unknown", "resolved", json!("mark_failed"), Some("checked: it never restarted"));
        assert!(decided(&unknown).starts_with("[outcome_unknown] Restart pay-prod-2? "), "{}", decided(&unknown));
        assert!(
            decided(&unknown).contains(": marked failed by alice at 2030-01-01 12:00:05 UTC"),
            "{}",
            decided(&unknown)
        );
        let lines = decision_lines(&[unknown, interrupt("resolved", json!("approve"))]);
        let shown = lines.join("\n");
        assert_eq!(lines.len(), 3, "{shown}");
        assert!(lines[0].starts_with("  [outcome_unknown] "), "{shown}");
        assert_eq!(lines[1], "    note: checked: it never restarted");
        assert!(lines[2].starts_with("  [confirm_action] "), "{shown}");
    }
}
