//! The data lifecycle commands: `keel prune`, `keel backup`, `keel restore`, `keel export`
//! (docs/operations.md).

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use keel_core::domain::{Conversation, Interrupt, Message, Run, Timestamp, ToolCall};
use keel_core::mask::mask_value;
use keel_core::store::Store;
use keel_runtime::retention::{self, Retention};
use serde_json::{json, Value};

use crate::config::Database;

pub async fn prune(store: &dyn Store, policy: &Retention, dry_run: bool) -> anyhow::Result<()> {
    if !policy.enabled() {
        println!("No retention policy: events are kept forever (set retention_events_after, or an agent's [agents.retention]).");
        return Ok(());
    }
    let pruned = retention::prune(store, policy, chrono::Utc::now(), dry_run).await.context("pruning")?;
    if dry_run {
        println!("Would prune {} event(s) of {} finished run(s).", pruned.events, pruned.runs);
    } else {
        println!("Pruned {} event(s) of finished runs.", pruned.events);
    }
    Ok(())
}

pub async fn backup(database: &Database, file: &Path) -> anyhow::Result<()> {
    let Database::Sqlite(path) = database else {
        bail!("keel backup copies the SQLite database; back up PostgreSQL with pg_dump (docs/operations.md, \"Backup and restore\")");
    };
    let (from, to) = (path.clone(), file.to_owned());
    let copied =
        tokio::task::spawn_blocking(move || keel_store::sqlite_backup(&from, &to)).await.context("backing up")??;
    println!("Backed up {} to {} ({} bytes).", path.display(), file.display(), copied.pages * copied.page_size);
    Ok(())
}

pub async fn restore(database: &Database, file: &Path) -> anyhow::Result<()> {
    let Database::Sqlite(path) = database else {
        bail!("keel restore writes the SQLite database; restore PostgreSQL with pg_restore (docs/operations.md, \"Backup and restore\")");
    };
    let (from, to) = (file.to_owned(), path.clone());
    let copied =
        tokio::task::spawn_blocking(move || keel_store::sqlite_restore(&from, &to)).await.context("restoring")??;
    println!("Restored {} from {} ({} bytes).", path.display(), file.display(), copied.pages * copied.page_size);
    Ok(())
}

#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct ExportArgs {
    /// One conversation, by id [default: every conversation the other filters leave].
    pub conversation: Option<String>,
    /// The conversations of this user.
    #[arg(long)]
    pub user: Option<String>,
    /// What changed at or after this time: RFC 3339 (`2030-01-01T00:00:00Z`) or a duration back
    /// from now (`7d`).
    #[arg(long, value_name = "TIME")]
    pub since: Option<String>,
    /// Write to this file instead of standard output.
    #[arg(long, short, value_name = "FILE")]
    pub output: Option<PathBuf>,
}

fn since(text: &str, now: Timestamp) -> anyhow::Result<Timestamp> {
    if let Ok(t) = chrono::DateTime::parse_from_rfc3339(text.trim()) {
        return Ok(t.with_timezone(&chrono::Utc));
    }
    match humantime::parse_duration(text.trim()) {
        Ok(d) => Ok(now - chrono::Duration::from_std(d).context("--since: too long ago")?),
        Err(_) => bail!("--since: {text:?} is neither an RFC 3339 time (2030-01-01T00:00:00Z) nor a duration (7d)"),
    }
}

pub async fn export(store: &dyn Store, args: &ExportArgs) -> anyhow::Result<()> {
    let since = args.since.as_deref().map(|t| since(t, chrono::Utc::now())).transpose()?;
    let conversations = match &args.conversation {
        Some(id) => {
            let id = id.parse().map_err(|_| anyhow::anyhow!("{id:?} is not a conversation id"))?;
            let Some(conversation) = store.get_conversation(&id).await? else { bail!("no conversation {id}") };
            if args.user.as_ref().is_some_and(|u| *u != conversation.user_id) {
                bail!("conversation {id} is not {}'s", args.user.as_deref().unwrap_or_default());
            }
            vec![conversation]
        }
        None => store.find_conversations(args.user.as_deref(), since).await.context("finding conversations")?,
    };
    let mut out: Box<dyn Write> = match &args.output {
        Some(path) => Box::new(std::io::BufWriter::new(
            std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?,
        )),
        None => Box::new(std::io::BufWriter::new(std::io::stdout().lock())),
    };
    let mut lines = 0usize;
    for conversation in conversations {
        for record in conversation_records(store, &conversation, since).await? {
            serde_json::to_writer(&mut out, &record)?;
            out.write_all(b"\n")?;
            lines += 1;
        }
    }
    out.flush()?;
    if let Some(path) = &args.output {
        eprintln!("Wrote {lines} record(s) to {}.", path.display());
    }
    Ok(())
}

/// One conversation's audit records, in this order: the conversation, its messages, then each run
/// with its tool calls and interrupts. With `since`, only what changed at or after it.
async fn conversation_records(
    store: &dyn Store,
    conversation: &Conversation,
    since: Option<Timestamp>,
) -> anyhow::Result<Vec<Value>> {
    let after = |t: &Timestamp| since.is_none_or(|s| *t >= s);
    let mut records = vec![json!({
        "type": "conversation",
        "id": conversation.id,
        "userId": conversation.user_id,
        "agentId": conversation.agent_id,
        "title": conversation.title.as_str(),
        "createdAt": conversation.created_at,
    })];
    let messages = store.list_messages(&conversation.id).await.context("reading messages")?;
    records.extend(messages.iter().filter(|m| after(&m.created_at)).map(message_record));
    for run in store.list_conversation_runs(&conversation.id).await.context("reading runs")? {
        if !after(&run.updated_at) {
            continue;
        }
        records.push(run_record(&run));
        // The run's own calls: a rolled-back run's too (the conversation no longer lists them;
        // the audit does).
        let calls = store.list_tool_calls(&run.id).await.context("reading tool calls")?;
        records.extend(calls.iter().map(call_record));
        let interrupts = store.list_interrupts(&run.id).await.context("reading interrupts")?;
        records.extend(interrupts.iter().map(|i| interrupt_record(i, &run)));
    }
    Ok(records)
}

fn message_record(m: &Message) -> Value {
    json!({
        "type": "message",
        "id": m.id,
        "conversationId": m.conversation_id,
        "runId": m.run_id,
        "role": m.role.as_str(),
        "content": m.content.as_str(),
        "toolCallId": m.tool_call_id,
        "createdAt": m.created_at,
    })
}

fn run_record(r: &Run) -> Value {
    json!({
        "type": "run",
        "id": r.id,
        "conversationId": r.conversation_id,
        "userId": r.user_id,
        "agentId": r.agent_id,
        "status": r.status.as_str(),
        "reason": r.reason,
        "worker": r.worker,
        "lastSequence": r.last_sequence(),
        "createdAt": r.created_at,
        "updatedAt": r.updated_at,
    })
}

/// Arguments are masked when stored; masked again here, so an export never carries a secret a
/// record from an older release might hold. The result is left out (its summary stays).
fn call_record(c: &ToolCall) -> Value {
    json!({
        "type": "tool_call",
        "id": c.id,
        "runId": c.run_id,
        "name": c.name,
        "args": mask_value(&c.args),
        "state": c.state.as_str(),
        "summary": c.summary.as_ref().map(|s| s.as_str()),
        "attempts": c.attempts,
        "startedAt": c.started_at,
        "finishedAt": c.finished_at,
    })
}

fn interrupt_record(i: &Interrupt, run: &Run) -> Value {
    json!({
        "type": "interrupt",
        "id": i.id,
        "runId": i.run_id,
        "conversationId": run.conversation_id,
        "kind": i.kind.as_str(),
        "status": i.status.as_str(),
        "callIds": i.call_ids,
        "payload": mask_value(&i.payload),
        "createdAt": i.created_at,
        "expiresAt": i.expires_at,
        "decision": i.decision.as_ref().map(|d| mask_value(d)),
        "note": i.note.as_ref().map(|n| n.as_str()),
        "decidedBy": i.resolved_by,
        "decidedAt": i.resolved_at,
    })
}

#[cfg(test)]
mod tests {
    use keel_core::domain::ToolCallState;
    use keel_core::mask::Masked;

    use super::*;

    #[test]
    fn a_tool_call_is_exported_with_masked_arguments_and_without_its_result() {
        let call = ToolCall {
            id: keel_core::CallId::new(),
            run_id: keel_core::RunId::new(),
            name: "deploy".into(),
            args: Masked::new(json!({"service": "checkout", "api_key": "sk-live-0123456789abcdef0123"})),
            state: ToolCallState::Succeeded,
            result: Some(Masked::new(json!({"log": "the whole output"}))),
            summary: Some("deployed".into()),
            attempts: 1,
            started_at: None,
            finished_at: None,
        };
        let record = call_record(&call);
        assert_eq!(record["args"], json!({"service": "checkout", "api_key": "***"}));
        assert_eq!(record["summary"], "deployed");
        assert!(!record.to_string().contains("the whole output"), "{record}");
    }

    #[test]
    fn since_is_a_time_or_a_duration_back() {
        let now = chrono::DateTime::from_timestamp(1_893_499_200, 0).unwrap();
        assert_eq!(since("2030-01-01T00:00:00Z", now).unwrap().to_rfc3339(), "2030-01-01T00:00:00+00:00");
        assert_eq!(since("1h", now).unwrap(), now - chrono::Duration::hours(1));
        assert!(since("yesterday", now).unwrap_err().to_string().contains("neither an RFC 3339 time"));
    }
}
