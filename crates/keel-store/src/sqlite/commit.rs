//! The writes of [`Store::commit`](keel_core::store::Store::commit) and [`Store::start_run`], run on
//! the writer thread inside its transaction. Each function either does all of its part or returns an
//! error, and the writer rolls the whole commit back.

use chrono::SecondsFormat;
use keel_core::domain::{lease_holder, Fact, Interrupt, InterruptStatus, Message, Run, RunStatus, Summary, Timestamp};
use keel_core::event::{Event, EventKind};
use keel_core::ids::{ConversationId, MessageId, RunId};
use keel_core::store::{
    Commit, Committed, Fence, InterruptChange, StoreError, StoreResult, TextAppend, ToolCallChange, ToolCallUpdate,
};
use rusqlite::{params, Connection, ToSql};
use serde::Serialize;

use super::db::{db, insert, is_unique_violation};
use super::rows::{exec, exec_or, one, Cols};

/// The statuses of a run that holds its conversation (`RunStatus::is_active`), as a condition.
///
/// Written as `=` terms joined by `OR`, never as `status IN (…)`: SQLite evaluates an `IN` list of
/// three or more values through a temporary b-tree it builds and frees at each execution (a page
/// allocated and zeroed), which was ~14% of the server's instructions per run when every fence
/// and status change did it (docs/benchmarks.md, "Where SQLite's instructions went").
pub const ACTIVE: &str = "(status = 'queued' OR status = 'running' OR status = 'interrupted')";

/// Fixed width, UTC, nanoseconds: sorts as text, round-trips exactly.
pub fn ts(t: &Timestamp) -> String {
    t.to_rfc3339_opts(SecondsFormat::Nanos, true)
}

pub fn opt_ts(t: &Option<Timestamp>) -> Option<String> {
    t.as_ref().map(ts)
}

pub fn json<T: Serialize + ?Sized>(what: &'static str, value: &T) -> StoreResult<String> {
    serde_json::to_string(value).map_err(|e| StoreError::Backend(format!("encode {what}: {e}")))
}

pub fn opt_json<T: Serialize>(what: &'static str, value: &Option<T>) -> StoreResult<Option<String>> {
    value.as_ref().map(|v| json(what, v)).transpose()
}

/// `(status = 'queued' OR status = 'running')`: one term per status (see [`ACTIVE`] for why not
/// `IN`). The names are Keel's own, written into the statement, so a fence's statement depends only
/// on its kind and statuses: a handful, each prepared once.
fn status_is_one_of(statuses: &[RunStatus]) -> String {
    if statuses.is_empty() {
        return "0".into();
    }
    let terms: Vec<String> = statuses.iter().map(|s| format!("status = '{}'", s.as_str())).collect();
    format!("({})", terms.join(" OR "))
}

pub fn active_run_id(conn: &Connection, conversation_id: &ConversationId) -> StoreResult<Option<RunId>> {
    one(
        conn,
        "find the active run",
        &format!("SELECT id FROM runs WHERE conversation_id = ? AND {ACTIVE} LIMIT 1"),
        [conversation_id.as_str()],
        |r| Cols::new(r, "runs").id("id"),
    )
}

pub fn insert_message(conn: &Connection, m: &Message) -> StoreResult<()> {
    exec_or(
        conn,
        "INSERT INTO messages (id, conversation_id, run_id, role, content, tool_call_id, created_at) \
         VALUES (?, ?, ?, ?, ?, ?, ?)",
        params![
            m.id.as_str(),
            m.conversation_id.as_str(),
            m.run_id.as_ref().map(|r| r.as_str()),
            m.role.as_str(),
            m.content.as_str(),
            m.tool_call_id.as_ref().map(|c| c.as_str()),
            ts(&m.created_at),
        ],
        insert("message"),
    )?;
    Ok(())
}

/// Events per `INSERT` statement: a commit's events go in a few multi-row statements (5 parameters a
/// row, far under SQLite's limit), each prepared once per shape.
const EVENTS_PER_INSERT: usize = 64;

/// Inserts `kinds` as the run's events from `first_sequence` on; the events as written.
pub fn insert_events(
    conn: &Connection,
    run_id: &RunId,
    first_sequence: i64,
    kinds: Vec<EventKind>,
    now: &Timestamp,
) -> StoreResult<Vec<Event>> {
    let created_at = ts(now);
    let mut events = Vec::with_capacity(kinds.len());
    let mut kinds = kinds.into_iter().peekable();
    let mut sequence = first_sequence;
    while kinds.peek().is_some() {
        let chunk: Vec<EventKind> = kinds.by_ref().take(EVENTS_PER_INSERT).collect();
        let mut data = Vec::with_capacity(chunk.len());
        for kind in &chunk {
            data.push(kind.to_data_text().map_err(|e| StoreError::Backend(format!("encode event data: {e}")))?);
        }
        let sequences: Vec<i64> = (sequence..).take(chunk.len()).collect();
        let types: Vec<&str> = chunk.iter().map(EventKind::type_name).collect();
        let run = run_id.as_str();
        let mut values: Vec<&dyn ToSql> = Vec::with_capacity(chunk.len() * 5);
        for ((type_name, data), sequence) in types.iter().zip(&data).zip(&sequences) {
            values.extend([&run as &dyn ToSql, sequence, type_name, data, &created_at]);
        }
        let rows = vec!["(?, ?, ?, ?, ?)"; chunk.len()].join(", ");
        let sql = format!("INSERT INTO run_events (run_id, sequence, type, data, created_at) VALUES {rows}");
        exec_or(conn, &sql, values.as_slice(), insert("event"))?;
        drop(values);
        for (kind, sequence) in chunk.into_iter().zip(sequences) {
            events.push(Event { kind, run_id: run_id.clone(), sequence, ts: *now });
        }
        sequence += i64::try_from(data.len()).map_err(|_| StoreError::Backend("too many events".into()))?;
    }
    Ok(events)
}

/// What the fence read of the run row as the commit leaves it.
struct Fenced {
    conversation_id: ConversationId,
    /// The sequence of the commit's first event.
    first_sequence: i64,
    cancel_requested: bool,
}

/// The fence: one conditional update of the run row that checks the writer's right to write,
/// renews, takes or (when the run pauses or ends) releases the lease, reserves the commit's event
/// sequences, and makes the commit's status change and checkpoint — one statement for what were
/// up to three. A status change is part of the condition (the row's status must be one the new
/// status may follow), so a refused one is told apart in [`fence_refusal`]. The row is read back
/// by a second statement rather than `RETURNING`, which SQLite serves through a temporary b-tree.
fn fence(conn: &Connection, c: &Commit) -> StoreResult<Fenced> {
    let n = i64::try_from(c.events.len()).map_err(|_| StoreError::Backend("too many events".into()))?;
    let now = ts(&c.now);
    let change = c.run.as_ref();
    // A paused or finished run has no worker.
    let release = change.is_some_and(|ch| ch.to == RunStatus::Interrupted || ch.to.is_terminal());
    let to = change.map(|ch| ch.to.as_str());
    let reason = change.and_then(|ch| ch.reason.as_deref());
    let checkpoint = c.checkpoint.as_ref().map(|cp| json("checkpoint", cp)).transpose()?;
    // A status move is allowed only from the statuses it may follow.
    let transition = change.map_or_else(|| "1".to_owned(), |ch| status_is_one_of(&RunStatus::sources_of(ch.to)));
    const COMMON: &str = "next_sequence = next_sequence + ?1, updated_at = ?2, status = COALESCE(?4, status), \
         reason = CASE WHEN ?4 IS NULL THEN reason ELSE ?5 END, checkpoint = COALESCE(?6, checkpoint)";
    let run = c.run_id.as_str();
    let mut values: Vec<&dyn ToSql> = vec![&n, &now, &run, &to, &reason, &checkpoint, &release];
    let (lease_until, worker);
    let sql = match &c.fence {
        Fence::Lease { owner, lease_until: until } => {
            lease_until = ts(until);
            values.extend([&lease_until as &dyn ToSql, owner]);
            format!(
                "UPDATE runs SET {COMMON}, lease_owner = CASE WHEN ?7 THEN NULL ELSE lease_owner END, \
                 lease_expires_at = CASE WHEN ?7 THEN NULL ELSE ?8 END \
                 WHERE id = ?3 AND lease_owner = ?9 AND {ACTIVE} AND {transition}"
            )
        }
        Fence::Acquire { owner, from, lease_until: until } => {
            (lease_until, worker) = (ts(until), lease_holder(owner));
            values.extend([&lease_until as &dyn ToSql, owner, &worker]);
            format!(
                "UPDATE runs SET {COMMON}, lease_owner = CASE WHEN ?7 THEN NULL ELSE ?9 END, \
                 lease_expires_at = CASE WHEN ?7 THEN NULL ELSE ?8 END, worker = ?10 \
                 WHERE id = ?3 AND {} AND {transition}",
                status_is_one_of(from)
            )
        }
        Fence::Unowned { from } => format!(
            "UPDATE runs SET {COMMON}, lease_owner = CASE WHEN ?7 THEN NULL ELSE lease_owner END, \
             lease_expires_at = CASE WHEN ?7 THEN NULL ELSE lease_expires_at END \
             WHERE id = ?3 AND {} AND {transition}",
            status_is_one_of(from)
        ),
    };
    let changed = exec_or(conn, &sql, values.as_slice(), |e| {
        if is_unique_violation(&e) {
            // only a move back to an active status can collide with another active run
            StoreError::Conflict(format!("run {}: the conversation has another active run", c.run_id))
        } else {
            db("fence the run")(e)
        }
    })?;
    if changed == 0 {
        return Err(fence_refusal(conn, c));
    }
    let read = |r: &rusqlite::Row<'_>| {
        let cols = Cols::new(r, "runs");
        let next_sequence: i64 = cols.get("next_sequence")?;
        Ok(Fenced {
            conversation_id: cols.id("conversation_id")?,
            first_sequence: next_sequence - n,
            cancel_requested: cols.get("cancel_requested")?,
        })
    };
    let sql = "SELECT conversation_id, next_sequence, cancel_requested FROM runs WHERE id = ?";
    one(conn, "fence the run", sql, [run], read)?.ok_or(StoreError::NotFound("run"))
}

/// Why the fence matched nothing: the run is missing, not in the state the writer expects, or in
/// a state the commit's new status may not follow.
fn fence_refusal(conn: &Connection, c: &Commit) -> StoreError {
    let row =
        one(conn, "fence the run", "SELECT status, lease_owner FROM runs WHERE id = ?", [c.run_id.as_str()], |r| {
            let cols = Cols::new(r, "runs");
            Ok((cols.get::<String>("status")?, cols.get::<Option<String>>("lease_owner")?))
        });
    let (status, owner) = match row {
        Ok(Some(row)) => row,
        Ok(None) => return StoreError::NotFound("run"),
        Err(e) => return e,
    };
    crate::fence::refusal(c, &status, owner.as_deref())
}

fn append_text(conn: &Connection, c: &Commit, conversation_id: &ConversationId, t: &TextAppend) -> StoreResult<()> {
    let done = exec(
        conn,
        "append text",
        "INSERT INTO messages (id, conversation_id, run_id, role, content, tool_call_id, created_at) \
         VALUES (?, ?, ?, 'assistant', ?, NULL, ?) \
         ON CONFLICT (id) DO UPDATE SET content = content || excluded.content \
         WHERE messages.run_id = excluded.run_id AND messages.role = 'assistant'",
        params![t.message_id.as_str(), conversation_id.as_str(), c.run_id.as_str(), t.text, ts(&c.now)],
    )?;
    if done == 0 {
        return Err(StoreError::Conflict(format!(
            "message {} is not an assistant message of run {}",
            t.message_id, c.run_id
        )));
    }
    Ok(())
}

fn discard_message(conn: &Connection, c: &Commit, id: &MessageId) -> StoreResult<()> {
    // A message that never got its first text was never created: nothing to delete is fine.
    exec(
        conn,
        "discard a message",
        "DELETE FROM messages WHERE id = ? AND run_id = ? AND role = 'assistant'",
        [id.as_str(), c.run_id.as_str()],
    )?;
    Ok(())
}

/// A record handed to a commit must belong to the commit's run.
fn check_owner<T: PartialEq + std::fmt::Display>(
    what: std::fmt::Arguments<'_>,
    of: &T,
    expected: &T,
) -> StoreResult<()> {
    if of == expected {
        Ok(())
    } else {
        Err(StoreError::Conflict(format!("{what} belongs to {of}, not {expected}")))
    }
}

fn apply_tool_call(
    conn: &Connection,
    c: &Commit,
    conversation_id: &ConversationId,
    change: &ToolCallChange,
) -> StoreResult<()> {
    match change {
        ToolCallChange::Insert(call) => {
            check_owner(format_args!("tool call {}", call.id), &call.run_id, &c.run_id)?;
            let args = json("tool call args", &call.args)?;
            let result = opt_json("tool call result", &call.result)?;
            exec_or(
                conn,
                "INSERT INTO tool_calls (id, run_id, conversation_id, name, args, state, result, summary, \
                 attempts, started_at, finished_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                params![
                    call.id.as_str(),
                    call.run_id.as_str(),
                    conversation_id.as_str(),
                    call.name,
                    args,
                    call.state.as_str(),
                    result,
                    call.summary.as_ref().map(|s| s.as_str()),
                    call.attempts,
                    opt_ts(&call.started_at),
                    opt_ts(&call.finished_at),
                ],
                insert("tool call"),
            )?;
        }
        ToolCallChange::Update(ToolCallUpdate {
            id,
            from,
            to,
            args,
            result,
            summary,
            attempts,
            started_at,
            finished_at,
        }) => {
            if !from.can_transition_to(*to) {
                return Err(StoreError::Conflict(format!("tool call {id}: {from} -> {to} is not allowed")));
            }
            let done = exec(
                conn,
                "update a tool call",
                "UPDATE tool_calls SET state = ?, args = COALESCE(?, args), result = COALESCE(?, result), \
                 summary = COALESCE(?, summary), attempts = COALESCE(?, attempts), \
                 started_at = COALESCE(?, started_at), finished_at = COALESCE(?, finished_at) \
                 WHERE id = ? AND run_id = ? AND state = ?",
                params![
                    to.as_str(),
                    args.as_ref().map(|a| json("tool call args", a)).transpose()?,
                    opt_json("tool call result", result)?,
                    summary.as_ref().map(|s| s.as_str()),
                    attempts,
                    opt_ts(started_at),
                    opt_ts(finished_at),
                    id.as_str(),
                    c.run_id.as_str(),
                    from.as_str(),
                ],
            )?;
            if done == 0 {
                let state = one(
                    conn,
                    "update a tool call",
                    "SELECT state FROM tool_calls WHERE id = ? AND run_id = ?",
                    [id.as_str(), c.run_id.as_str()],
                    |r| Cols::new(r, "tool_calls").get::<String>("state"),
                )?;
                return Err(StoreError::Conflict(match state {
                    Some(state) => format!("tool call {id} is {state}, not {from}"),
                    None => format!("tool call {id} is not a call of run {}", c.run_id),
                }));
            }
        }
    }
    Ok(())
}

fn insert_interrupt(conn: &Connection, c: &Commit, i: &Interrupt) -> StoreResult<()> {
    check_owner(format_args!("interrupt {}", i.id), &i.run_id, &c.run_id)?;
    let payload = json("interrupt payload", &i.payload)?;
    let call_ids = json("interrupt call ids", &i.call_ids)?;
    let decision = opt_json("interrupt decision", &i.decision)?;
    exec_or(
        conn,
        "INSERT INTO interrupts (id, run_id, kind, status, payload, call_ids, created_at, expires_at, decision, \
         note, resolved_by, resolved_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        params![
            i.id.as_str(),
            i.run_id.as_str(),
            i.kind.as_str(),
            i.status.as_str(),
            payload,
            call_ids,
            ts(&i.created_at),
            ts(&i.expires_at),
            decision,
            i.note.as_ref().map(|n| n.as_str()),
            i.resolved_by,
            opt_ts(&i.resolved_at),
        ],
        insert("interrupt"),
    )?;
    Ok(())
}

fn change_interrupt(conn: &Connection, c: &Commit, change: &InterruptChange) -> StoreResult<()> {
    let id = &change.id;
    if !InterruptStatus::Pending.can_transition_to(change.to) {
        return Err(StoreError::Conflict(format!("interrupt {id}: pending -> {} is not allowed", change.to)));
    }
    let now = ts(&c.now);
    // An interrupt past its expiry may still expire or be cancelled, never be resolved.
    let resolving = change.to == InterruptStatus::Resolved;
    let done = exec(
        conn,
        "change an interrupt",
        "UPDATE interrupts SET status = ?, decision = COALESCE(?, decision), note = COALESCE(?, note), \
         resolved_by = COALESCE(?, resolved_by), resolved_at = ? \
         WHERE id = ? AND run_id = ? AND status = 'pending' AND (NOT ? OR expires_at > ?)",
        params![
            change.to.as_str(),
            opt_json("interrupt decision", &change.decision)?,
            change.note.as_ref().map(|n| n.as_str()),
            change.resolved_by,
            now,
            id.as_str(),
            c.run_id.as_str(),
            resolving,
            now,
        ],
    )?;
    if done > 0 {
        return Ok(());
    }
    let status = one(
        conn,
        "change an interrupt",
        "SELECT status FROM interrupts WHERE id = ? AND run_id = ?",
        [id.as_str(), c.run_id.as_str()],
        |r| Cols::new(r, "interrupts").parse("status", InterruptStatus::parse),
    )?;
    Err(StoreError::Conflict(match status {
        None => format!("interrupt {id} is not an interrupt of run {}", c.run_id),
        Some(InterruptStatus::Pending) => format!("interrupt {id} has expired"),
        Some(status) => format!("interrupt {id} is already {status}"),
    }))
}

fn upsert_fact(conn: &Connection, conversation_id: &ConversationId, f: &Fact) -> StoreResult<()> {
    exec(
        conn,
        "upsert a fact",
        "INSERT INTO facts (conversation_id, key, value, source, updated_at) VALUES (?, ?, ?, ?, ?) \
         ON CONFLICT (conversation_id, key) DO UPDATE SET value = excluded.value, source = excluded.source, \
         updated_at = excluded.updated_at",
        params![conversation_id.as_str(), f.key, f.value.as_str(), f.source.as_str(), ts(&f.updated_at)],
    )?;
    Ok(())
}

fn upsert_summary(conn: &Connection, conversation_id: &ConversationId, s: &Summary) -> StoreResult<()> {
    check_owner(format_args!("the summary"), &s.conversation_id, conversation_id)?;
    exec(
        conn,
        "upsert the summary",
        "INSERT INTO summaries (conversation_id, through_message_id, text) VALUES (?, ?, ?) \
         ON CONFLICT (conversation_id) DO UPDATE SET through_message_id = excluded.through_message_id, \
         text = excluded.text",
        params![conversation_id.as_str(), s.through_message_id.as_str(), s.text.as_str()],
    )?;
    Ok(())
}

/// Everything of one commit, and the answer stored under its idempotency key, in the writer's
/// transaction.
pub fn apply_commit(conn: &Connection, c: &Commit) -> StoreResult<Committed> {
    let run = fence(conn, c)?;
    for t in &c.text {
        append_text(conn, c, &run.conversation_id, t)?;
    }
    for m in &c.messages {
        check_owner(format_args!("message {}", m.id), &m.conversation_id, &run.conversation_id)?;
        if let Some(run_id) = &m.run_id {
            check_owner(format_args!("message {}", m.id), run_id, &c.run_id)?;
        }
        insert_message(conn, m)?;
    }
    for id in &c.discard_messages {
        discard_message(conn, c, id)?;
    }
    for change in &c.tool_calls {
        apply_tool_call(conn, c, &run.conversation_id, change)?;
    }
    for i in &c.new_interrupts {
        insert_interrupt(conn, c, i)?;
    }
    for change in &c.interrupt_changes {
        change_interrupt(conn, c, change)?;
    }
    for f in &c.facts {
        upsert_fact(conn, &run.conversation_id, f)?;
    }
    if let Some(s) = &c.summary {
        upsert_summary(conn, &run.conversation_id, s)?;
    }
    if let Some(answer) = &c.idempotency {
        let done = exec(
            conn,
            "store the answer under its idempotency key",
            "UPDATE idempotency_keys SET state = 'done', status = ?, response = ?, expires_at = ? \
             WHERE user_id = ? AND key = ? AND state = 'in_flight'",
            params![
                i64::from(answer.status),
                json("idempotent response", &answer.response)?,
                ts(&answer.expires_at),
                answer.user_id,
                answer.key,
            ],
        )?;
        if done == 0 {
            return Err(StoreError::Conflict("the idempotency key is not in flight".into()));
        }
    }
    let events = insert_events(conn, &c.run_id, run.first_sequence, c.events.clone(), &c.now)?;
    Ok(Committed { events, cancel_requested: run.cancel_requested })
}

pub fn insert_run(conn: &Connection, run: &Run) -> StoreResult<()> {
    let checkpoint = json("checkpoint", &run.checkpoint)?;
    let result = conn
        .prepare_cached(
            "INSERT INTO runs (id, conversation_id, user_message_id, user_id, agent_id, status, reason, \
             cancel_on_disconnect, cancel_requested, next_sequence, lease_owner, lease_expires_at, checkpoint, \
             created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        )
        .and_then(|mut s| {
            s.execute(params![
                run.id.as_str(),
                run.conversation_id.as_str(),
                run.user_message_id.as_str(),
                run.user_id,
                run.agent_id,
                run.status.as_str(),
                run.reason,
                run.cancel_on_disconnect,
                run.cancel_requested,
                run.next_sequence,
                run.lease_owner,
                opt_ts(&run.lease_expires_at),
                checkpoint,
                ts(&run.created_at),
                ts(&run.updated_at),
            ])
        });
    match result {
        Ok(_) => Ok(()),
        // the partial unique index: another active run got in first
        Err(e) if is_unique_violation(&e) => match active_run_id(conn, &run.conversation_id)? {
            Some(active) => Err(StoreError::RunActive(active)),
            None => Err(StoreError::Duplicate("run id already exists".into())),
        },
        Err(e) => Err(db("insert the run")(e)),
    }
}
