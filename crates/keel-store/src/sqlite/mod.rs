//! The embedded SQLite backend.
//!
//! One writer thread owns the writing connection; every write is a closure it runs, and the writes
//! queued at one moment share one `BEGIN IMMEDIATE … COMMIT` (group commit). A refused write leaves
//! nothing behind and does not affect the others (the group runs again without it); every caller is
//! answered after the shared `COMMIT`, and if that fails, with its error, and none of the group was
//! written. Commits of one run never share a group out of order: a run's worker waits for each
//! answer before it writes again. The writer's queue is bounded ([`SqliteOptions::write_queue`]),
//! and a write that panics fails alone. Reads run on a few reading threads, each with its read-only
//! connection (WAL mode lets them read while the writer writes), off the async runtime's threads; a
//! checkpointer thread copies the WAL into the database file, and closing checkpoints it whole.
//! [`db`] and [`readers`] say why.
//!
//! Timestamps are stored as fixed-width RFC 3339 text (see the migration), so SQL compares them
//! correctly.

mod commit;
mod db;
mod kept;
mod lifecycle;
mod readers;
mod rows;

use std::path::Path;
use std::sync::LazyLock;

use async_trait::async_trait;
use keel_core::domain::{
    lease_holder, ApiKey, Conversation, Fact, Interrupt, Message, Run, RunStatus, StreamTicket, Summary, Timestamp,
    ToolCall, User, UserRole,
};
use keel_core::event::{Event, EventKind};
use keel_core::ids::{ConversationId, InterruptId, MessageId, RunId};
use keel_core::mask::Masked;
use keel_core::store::{
    AnswerView, BindingStore, Commit, Committed, ContextWindow, ConversationStore, DueWork, IdempotencyBegin,
    IdentityStore, MessagesThrough, NewLease, NewRun, PruneRule, Pruned, RolledBack, RunStore, StartedRun, Store,
    StoreError, StoreResult,
};
use rusqlite::params;
use serde_json::Value;

use self::commit::{json, opt_ts, ts, SqliteTx, ACTIVE};
use self::db::{insert, is_foreign_key_violation, Database, Location};
use self::kept::Conn;
pub use self::lifecycle::{backup, restore, Copied};
use self::rows::{
    conversation_from, event_from, exec, exec_or, fact_from, interrupt_from, many, message_from, one, run_from,
    stream_ticket_from, summary_from, tool_call_from, user_from, Cols,
};
use crate::pipeline::{self, ready, static_sql};

// The periodic sweeps' conditions, each shared by its sweep's read and by [`RunStore::due_work`],
// which probes all four in one read. `?1` is the sweep's instant; `?2` (claims) takes live leases too.
const DUE_INTERRUPTS: &str = "status = 'pending' AND expires_at <= ?1";
const ROLLBACKS_DUE: &str =
    "roll_back_requested = 1 AND (status = 'completed' OR status = 'failed' OR status = 'cancelled')";
const CLAIMABLE: &str = "(status = 'queued' OR status = 'running') AND (lease_owner IS NULL \
     OR lease_expires_at IS NULL OR lease_expires_at <= ?1 OR ?2)";
/// A waiting run (`w`) whose conversation has no active run.
static STRANDED: LazyLock<String> = LazyLock::new(|| {
    format!("w.status = 'waiting' AND NOT EXISTS (SELECT 1 FROM runs a WHERE a.conversation_id = w.conversation_id AND {ACTIVE})")
});

/// The SQLite store. Cloning shares the connections and the writer thread.
#[derive(Debug, Clone)]
pub struct SqliteStore {
    db: Database,
}

/// How a [`SqliteStore`] is opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SqliteOptions {
    /// The most writes that may wait for the writer thread, besides the group it is running; a
    /// write beyond them fails at once with [`StoreError::Overloaded`] (the API answers 503 with
    /// `Retry-After`) instead of queueing without bound. Default [`SqliteOptions::WRITE_QUEUE`].
    pub write_queue: usize,
}

impl SqliteOptions {
    pub const WRITE_QUEUE: usize = db::WRITE_QUEUE;
}

impl Default for SqliteOptions {
    fn default() -> Self {
        Self { write_queue: Self::WRITE_QUEUE }
    }
}

impl SqliteStore {
    /// Opens (creating it and its directory if needed) the database file at `path` and migrates it.
    pub async fn open(path: &Path) -> StoreResult<Self> {
        Self::open_with(path, SqliteOptions::default()).await
    }

    /// [`SqliteStore::open`] with options.
    pub async fn open_with(path: &Path, options: SqliteOptions) -> StoreResult<Self> {
        Self::open_at(Location::File(path.to_owned()), options).await
    }

    /// Opens `sqlite://path/to/file.db` (or `sqlite::memory:`) and migrates it.
    pub async fn open_url(url: &str) -> StoreResult<Self> {
        Self::open_at(Location::parse_url(url)?, SqliteOptions::default()).await
    }

    async fn open_at(location: Location, options: SqliteOptions) -> StoreResult<Self> {
        // opening and migrating block on the disk: not on a runtime thread
        let db = tokio::task::spawn_blocking(move || Database::open(location, options.write_queue))
            .await
            .map_err(|e| StoreError::Backend(format!("open the database: {e}")))??;
        Ok(Self { db })
    }

    /// Creates or upgrades the schema of the database at `path`, then closes it (`keel migrate`).
    pub async fn migrate_only(path: &Path) -> StoreResult<()> {
        Self::open(path).await?.close().await;
        Ok(())
    }

    /// [`SqliteStore::migrate_only`] for a `sqlite://` url.
    pub async fn migrate_only_url(url: &str) -> StoreResult<()> {
        Self::open_url(url).await?.close().await;
        Ok(())
    }

    /// For a program that keeps tables of its own in Keel's database (the demo does): runs `work` on
    /// the writer thread, in a transaction it may share with other writes (group commit). `work`
    /// may run more than once — a group that refused another write runs again without it — so it
    /// must keep its effects inside the transaction and answer the same on the same state. An error
    /// it returns rolls back what it did, and only that.
    pub async fn write_with<R, F>(&self, mut work: F) -> StoreResult<R>
    where
        R: Send + 'static,
        F: FnMut(&rusqlite::Connection) -> StoreResult<R> + Send + 'static,
    {
        self.db.write(move |c| work(c)).await
    }

    /// Runs `work` on a reading connection (see [`SqliteStore::write_with`]).
    pub async fn read_with<R, F>(&self, work: F) -> StoreResult<R>
    where
        R: Send + 'static,
        F: FnOnce(&rusqlite::Connection) -> StoreResult<R> + Send + 'static,
    {
        self.db.read(move |c| work(c)).await
    }

    /// Runs `work`, a read of a few rows by key, on the writer's connection between two of its
    /// transactions, where its pages are likely cached, or on a reading connection when the writer
    /// is busy (the writer thread's `read_brief`, in `sqlite/db.rs`). What `work` writes (it
    /// should not) is rolled back, never written. A read that may take long must use
    /// [`SqliteStore::read_with`]: here it would hold up every write.
    pub async fn read_brief_with<R, F>(&self, work: F) -> StoreResult<R>
    where
        R: Send + 'static,
        F: FnOnce(&rusqlite::Connection) -> StoreResult<R> + Send + 'static,
    {
        self.db.read_brief(move |c| work(c)).await
    }

    /// Closes the readers, and the writer once the writes queued before this call are done, then
    /// checkpoints the whole WAL into the database file: when this returns, the database file alone
    /// holds every write (a copy of it is a backup). Every later call on any clone of the store is an
    /// error.
    pub async fn close(&self) {
        self.db.close().await;
    }
}

// Reads a store method makes alone, and `answer_view` makes together in one read.

/// A tool call's columns, its result left out (`NULL`): for the reads that use none (the
/// context's, an answer's), since a result can be large.
macro_rules! calls_without_results {
    () => {
        "seq, id, run_id, name, args, state, NULL AS result, summary, attempts, started_at, finished_at"
    };
}

fn read_run(c: &Conn<'_, '_>, id: &RunId) -> StoreResult<Option<Run>> {
    read_run_row(c, id.as_str())
}

fn read_run_row(c: &Conn<'_, '_>, id: &str) -> StoreResult<Option<Run>> {
    one(c, "get a run", "SELECT * FROM runs WHERE id = ?", [id], run_from)
}

fn read_interrupts(c: &Conn<'_, '_>, run_id: &RunId) -> StoreResult<Vec<Interrupt>> {
    // Sorted here, not by an `ORDER BY`: the index on (run_id, status, created_at) gives the rows in
    // another order, and SQLite would sort them through a temporary b-tree (a run has a handful).
    let sql = "SELECT * FROM interrupts WHERE run_id = ?";
    let mut interrupts = many(c, "list interrupts", sql, [run_id.as_str()], interrupt_from)?;
    interrupts.sort_unstable_by(|a, b| (a.created_at, a.id.as_str()).cmp(&(b.created_at, b.id.as_str())));
    Ok(interrupts)
}

/// The calls whose results `messages` hold, in the order they were made (`seq`); `with_results`
/// or without them (the context's: each result is in its tool message already). Looked up one by
/// one by id: `id IN (SELECT … FROM messages …) ORDER BY seq` ran through two temporary b-trees
/// (the list, then the sort), each a page allocated and zeroed, at every model call.
fn answered_calls(
    c: &Conn<'_, '_>,
    op: &'static str,
    messages: &[Message],
    with_results: bool,
) -> StoreResult<Vec<ToolCall>> {
    let mut ids: Vec<&str> = messages.iter().filter_map(|m| m.tool_call_id.as_ref().map(|id| id.as_str())).collect();
    ids.sort_unstable();
    ids.dedup();
    let mut calls = Vec::with_capacity(ids.len());
    let sql = if with_results {
        "SELECT * FROM tool_calls WHERE id = ?"
    } else {
        concat!("SELECT ", calls_without_results!(), " FROM tool_calls WHERE id = ?")
    };
    for id in ids {
        let found = one(c, op, sql, [id], |r| Ok((Cols::new(r, "tool_calls").get::<i64>("seq")?, tool_call_from(r)?)))?;
        calls.extend(found);
    }
    calls.sort_unstable_by_key(|(seq, _)| *seq);
    Ok(calls.into_iter().map(|(_, call)| call).collect())
}

/// A run's tool calls, in order; `with_results` or without them.
fn read_tool_calls(c: &Conn<'_, '_>, run_id: &RunId, with_results: bool) -> StoreResult<Vec<ToolCall>> {
    let sql = if with_results {
        "SELECT * FROM tool_calls WHERE run_id = ? ORDER BY seq"
    } else {
        concat!("SELECT ", calls_without_results!(), " FROM tool_calls WHERE run_id = ? ORDER BY seq")
    };
    many(c, "list tool calls", sql, [run_id.as_str()], tool_call_from)
}

/// The conversation's facts, by key.
fn read_facts(c: &Conn<'_, '_>, conversation_id: &ConversationId) -> StoreResult<Vec<Fact>> {
    many(
        c,
        "list facts",
        "SELECT * FROM facts WHERE conversation_id = ? ORDER BY key",
        [conversation_id.as_str()],
        fact_from,
    )
}

/// A step's context ([`ConversationStore::context_window`]), read on `c`.
fn read_context_window(c: &Conn<'_, '_>, conversation_id: &ConversationId) -> StoreResult<ContextWindow> {
    let conversation = conversation_id.as_str();
    let summary =
        one(c, "get the summary", "SELECT * FROM summaries WHERE conversation_id = ?", [conversation], summary_from)?;
    // The messages after the last one the summary covers (by the index on
    // (conversation_id, seq)), and the calls their tool results answer (by id).
    let after: i64 = match &summary {
        Some(s) => one(
            c,
            "find the summary's last message",
            "SELECT seq FROM messages WHERE id = ?",
            [s.through_message_id.as_str()],
            |r| Cols::new(r, "messages").get::<i64>("seq"),
        )?
        .unwrap_or(0),
        None => 0,
    };
    let messages = many(
        c,
        "list the context's messages",
        "SELECT * FROM messages WHERE conversation_id = ? AND seq > ? ORDER BY seq",
        params![conversation, after],
        message_from,
    )?;
    let tool_calls = answered_calls(c, "list the context's tool calls", &messages, false)?;
    let facts = read_facts(c, conversation_id)?;
    Ok(ContextWindow { summary, messages, tool_calls, facts })
}

fn read_role(c: &Conn<'_, '_>, user_id: &str) -> StoreResult<Option<UserRole>> {
    one(c, "get a user's role", "SELECT role FROM users WHERE id = ?", [user_id], |r| {
        Cols::new(r, "users").parse("role", UserRole::parse)
    })
}

#[async_trait]
impl RunStore for SqliteStore {
    async fn start_run(&self, new: NewRun) -> StoreResult<StartedRun> {
        // made once, outside the write, which may run more than once and must answer the same
        let (run_id, message_id) = (RunId::new(), MessageId::new());
        self.db
            .write(move |c| {
                match ready(pipeline::start_run(&mut SqliteTx(c), &new, run_id.clone(), message_id.clone(), ""))? {
                    Some(started) => Ok(started),
                    // the one-active-run index, or (never in practice) a reused id
                    None => Err(match ready(pipeline::active_run_id(&mut SqliteTx(c), &new.conversation_id))? {
                        Some(active) => StoreError::RunActive(active),
                        None => StoreError::Duplicate("run id already exists".into()),
                    }),
                }
            })
            .await
    }

    async fn get_run(&self, id: &RunId) -> StoreResult<Option<Run>> {
        let id = id.to_owned();
        self.db.read_brief(move |c| read_run(c, &id)).await
    }

    async fn last_sequences(&self, ids: &[RunId]) -> StoreResult<Vec<(RunId, i64)>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        // One statement whatever the number of ids: they go in as one JSON array.
        let ids = serde_json::to_string(&ids.iter().map(RunId::as_str).collect::<Vec<_>>())
            .map_err(|e| StoreError::Backend(format!("run ids: {e}")))?;
        self.db
            .read(move |c| {
                many(
                    c,
                    "read last sequences",
                    "SELECT id, next_sequence FROM runs WHERE id IN (SELECT value FROM json_each(?))",
                    [ids.as_str()],
                    |r| {
                        let cols = Cols::new(r, "runs");
                        Ok((cols.id("id")?, cols.get::<i64>("next_sequence")? - 1))
                    },
                )
            })
            .await
    }

    async fn active_run(&self, conversation_id: &ConversationId) -> StoreResult<Option<Run>> {
        let conversation_id = conversation_id.to_owned();
        self.db
            .read(move |c| {
                one(
                    c,
                    "get the active run",
                    static_sql!("SELECT * FROM runs WHERE conversation_id = ? AND {ACTIVE} LIMIT 1"),
                    [conversation_id.as_str()],
                    run_from,
                )
            })
            .await
    }

    async fn waiting_runs(&self, conversation_id: &ConversationId, limit: u32) -> StoreResult<Vec<Run>> {
        let conversation_id = conversation_id.to_owned();
        self.db
            .read(move |c| {
                many(
                    c,
                    "list waiting runs",
                    "SELECT * FROM runs WHERE conversation_id = ? AND status = 'waiting' ORDER BY created_at, id LIMIT ?",
                    params![conversation_id.as_str(), i64::from(limit)],
                    run_from,
                )
            })
            .await
    }

    async fn promote_waiting(
        &self,
        conversation_id: &ConversationId,
        events: Vec<EventKind>,
        lease: Option<NewLease>,
        now: Timestamp,
    ) -> StoreResult<Option<StartedRun>> {
        let conversation_id = conversation_id.to_owned();
        let promoted = self
            .db
            .write(move |c| {
                let Some(promoted) =
                    ready(pipeline::promote(&mut SqliteTx(c), &conversation_id, &events, lease.as_ref(), now, ""))?
                else {
                    return Ok(None);
                };
                let run = one(
                    c,
                    "promote a waiting run",
                    "SELECT * FROM runs WHERE id = ?",
                    [promoted.run_id.as_str()],
                    run_from,
                )?
                .ok_or(StoreError::NotFound("run"))?;
                Ok(Some(StartedRun { message: promoted.message, run, events: promoted.events, user_role: None }))
            })
            .await;
        match promoted {
            // promoted by another writer after all: nothing of this one was written
            Err(StoreError::Conflict(_)) => Ok(None),
            other => other,
        }
    }

    async fn stranded_conversations(&self, limit: u32) -> StoreResult<Vec<ConversationId>> {
        self.db
            .read(move |c| {
                many(
                    c,
                    "find stranded waiting runs",
                    static_sql!(
                        "SELECT w.conversation_id FROM runs w WHERE {} \
                         GROUP BY w.conversation_id ORDER BY MIN(w.created_at) LIMIT ?",
                        *STRANDED
                    ),
                    [i64::from(limit)],
                    |r| Cols::new(r, "runs").id("conversation_id"),
                )
            })
            .await
    }

    async fn roll_back_run(&self, run_id: &RunId, now: Timestamp) -> StoreResult<RolledBack> {
        let run_id = run_id.to_owned();
        self.db.write(move |c| ready(pipeline::roll_back(&mut SqliteTx(c), &run_id, now))).await
    }

    async fn claim_runs(
        &self,
        owner: &str,
        now: Timestamp,
        lease_until: Timestamp,
        steal: bool,
        limit: u32,
    ) -> StoreResult<Vec<Run>> {
        // Most claims (a sweep every second) find nothing: a read says so, and the writer's
        // transaction (its write lock, a `BEGIN` and a `COMMIT`) is taken only when there may be
        // runs to claim. The write checks again, in its transaction.
        if limit == 0 {
            return Ok(Vec::new());
        }
        let (at, until) = (ts(&now), ts(&lease_until));
        let claimable = self
            .db
            .read(move |c| {
                one(
                    c,
                    "claim runs",
                    static_sql!("SELECT 1 FROM runs WHERE {CLAIMABLE} LIMIT 1"),
                    params![at, steal],
                    |_| Ok(()),
                )
            })
            .await?;
        if claimable.is_none() {
            return Ok(Vec::new());
        }
        let (owner, worker) = (owner.to_owned(), lease_holder(owner).to_owned());
        let runs = self
            .db
            .write(move |c| {
                // The claimable runs are read first, then each is updated and read back, all in the
                // writer's transaction (no other write comes between). One `UPDATE … WHERE id IN
                // (…) RETURNING *` went through three temporary b-trees at every sweep, once a
                // second, whether or not it found a run; an idle sweep is now one indexed read.
                let now = ts(&now);
                let lease_until = until.as_str();
                let ids: Vec<String> = many(
                    c,
                    "claim runs",
                    static_sql!("SELECT id FROM runs WHERE {CLAIMABLE} ORDER BY created_at, id LIMIT ?3"),
                    params![now, steal, i64::from(limit)],
                    |r| Cols::new(r, "runs").get("id"),
                )?;
                let mut runs = Vec::with_capacity(ids.len());
                for id in &ids {
                    exec(
                        c,
                        "claim runs",
                        "UPDATE runs SET status = 'running', lease_owner = ?1, lease_expires_at = ?2, \
                         updated_at = ?3, worker = ?4 WHERE id = ?5",
                        params![owner, lease_until, now, worker, id],
                    )?;
                    runs.extend(read_run_row(c, id)?);
                }
                Ok(runs)
            })
            .await?;
        Ok(runs)
    }

    async fn due_work(&self, now: Timestamp) -> StoreResult<DueWork> {
        let at = ts(&now);
        self.db
            .read(move |c| {
                let sql = static_sql!(
                    "SELECT EXISTS (SELECT 1 FROM interrupts WHERE {DUE_INTERRUPTS}), \
                     EXISTS (SELECT 1 FROM runs WHERE {ROLLBACKS_DUE}), \
                     EXISTS (SELECT 1 FROM runs w WHERE {}), \
                     EXISTS (SELECT 1 FROM runs WHERE {CLAIMABLE})",
                    *STRANDED
                );
                let due = one(c, "look for due work", sql, params![at, false], |r| {
                    let flag = |i: usize| r.get::<_, bool>(i).map_err(db::db("look for due work"));
                    Ok(DueWork {
                        expired_interrupts: flag(0)?,
                        rollbacks: flag(1)?,
                        stranded: flag(2)?,
                        claimable: flag(3)?,
                    })
                })?;
                Ok(due.unwrap_or_default())
            })
            .await
    }

    async fn renew_lease(&self, run_id: &RunId, owner: &str, lease_until: Timestamp) -> StoreResult<bool> {
        let (run_id, owner) = (run_id.to_string(), owner.to_owned());
        let done = self
            .db
            .write(move |c| {
                exec(
                    c,
                    "renew a lease",
                    static_sql!("UPDATE runs SET lease_expires_at = ? WHERE id = ? AND lease_owner = ? AND {ACTIVE}"),
                    [ts(&lease_until).as_str(), run_id.as_str(), owner.as_str()],
                )
            })
            .await?;
        Ok(done > 0)
    }

    async fn release_lease(&self, run_id: &RunId, owner: &str) -> StoreResult<()> {
        let (run_id, owner) = (run_id.to_string(), owner.to_owned());
        self.db
            .write(move |c| {
                exec(
                    c,
                    "release a lease",
                    "UPDATE runs SET lease_owner = NULL, lease_expires_at = NULL WHERE id = ? AND lease_owner = ?",
                    [run_id.as_str(), owner.as_str()],
                )
            })
            .await?;
        Ok(())
    }

    async fn request_cancel(&self, run_id: &RunId, now: Timestamp, roll_back: bool) -> StoreResult<Run> {
        let run_id = run_id.to_string();
        self.db
            .write(move |c| {
                let updated = one(
                    c,
                    "request a cancel",
                    static_sql!(
                        "UPDATE runs SET cancel_requested = 1, updated_at = ?1, \
                         roll_back_requested = (roll_back_requested = 1 OR ?3) WHERE id = ?2 \
                         AND ({ACTIVE} OR status = 'waiting') RETURNING *"
                    ),
                    params![ts(&now).as_str(), run_id.as_str(), roll_back],
                    run_from,
                )?;
                match updated {
                    Some(run) => Ok(run),
                    // a finished run stays as it is
                    None => one(c, "request a cancel", "SELECT * FROM runs WHERE id = ?", [run_id.as_str()], run_from)?
                        .ok_or(StoreError::NotFound("run")),
                }
            })
            .await
    }

    async fn rollbacks_due(&self, limit: u32) -> StoreResult<Vec<RunId>> {
        self.db
            .read(move |c| {
                many(
                    c,
                    "find the rollbacks due",
                    static_sql!("SELECT id FROM runs WHERE {ROLLBACKS_DUE} ORDER BY id LIMIT ?"),
                    [i64::from(limit)],
                    |r| Cols::new(r, "runs").id("id"),
                )
            })
            .await
    }

    async fn hide_run(&self, run_id: &RunId, now: Timestamp) -> StoreResult<bool> {
        let run_id = run_id.to_string();
        self.db
            .write(move |c| {
                let hidden = exec(
                    c,
                    "hide a run",
                    "UPDATE runs SET hidden_at = ?1 WHERE id = ?2 AND hidden_at IS NULL \
                     AND (status = 'completed' OR status = 'failed' OR status = 'cancelled' OR status = 'rolled_back')",
                    [ts(&now).as_str(), run_id.as_str()],
                )?;
                if hidden == 1 {
                    return Ok(true);
                }
                let run = one(c, "hide a run", "SELECT * FROM runs WHERE id = ?", [run_id.as_str()], run_from)?;
                match run {
                    None => Err(StoreError::NotFound("run")),
                    Some(run) if run.hidden_at.is_some() => Ok(false),
                    Some(run) => Err(StoreError::Conflict(format!(
                        "run {run_id} is {}: only a run that is over is hidden",
                        run.status
                    ))),
                }
            })
            .await
    }

    async fn commit(&self, commit: Commit) -> StoreResult<Committed> {
        self.db.write(move |c| ready(pipeline::apply_commit(&mut SqliteTx(c), &commit))).await
    }

    async fn list_runs(&self, user_id: &str, status: Option<RunStatus>, limit: u32) -> StoreResult<Vec<Run>> {
        let user_id = user_id.to_owned();
        self.db
            .read(move |c| {
                many(
                    c,
                    "list runs",
                    "SELECT * FROM runs WHERE user_id = ?1 AND (?2 IS NULL OR status = ?2) \
                 ORDER BY created_at DESC, id DESC LIMIT ?3",
                    params![user_id, status.map(RunStatus::as_str), i64::from(limit)],
                    run_from,
                )
            })
            .await
    }

    async fn list_events(&self, run_id: &RunId, after: i64, limit: u32) -> StoreResult<Vec<Event>> {
        let run_id = run_id.to_owned();
        self.db
            .read(move |c| {
                many(
                    c,
                    "list events",
                    "SELECT sequence, type, data, created_at, data_format FROM run_events WHERE run_id = ? AND sequence > ? \
                 ORDER BY sequence LIMIT ?",
                    params![run_id.as_str(), after, i64::from(limit)],
                    |r| event_from(&run_id, r),
                )
            })
            .await
    }

    async fn get_interrupt(&self, id: &InterruptId) -> StoreResult<Option<Interrupt>> {
        let id = id.to_owned();
        self.db
            .read_brief(move |c| {
                one(c, "get an interrupt", "SELECT * FROM interrupts WHERE id = ?", [id.as_str()], interrupt_from)
            })
            .await
    }

    async fn pending_interrupt(&self, run_id: &RunId) -> StoreResult<Option<Interrupt>> {
        let run_id = run_id.to_owned();
        self.db
            .read_brief(move |c| {
                one(
                    c,
                    "get the pending interrupt",
                    "SELECT * FROM interrupts WHERE run_id = ? AND status = 'pending' \
                 ORDER BY created_at DESC, id DESC LIMIT 1",
                    [run_id.as_str()],
                    interrupt_from,
                )
            })
            .await
    }

    async fn due_interrupts(&self, now: Timestamp, limit: u32) -> StoreResult<Vec<Interrupt>> {
        self.db
            .read(move |c| {
                many(
                    c,
                    "list due interrupts",
                    static_sql!("SELECT * FROM interrupts WHERE {DUE_INTERRUPTS} ORDER BY expires_at, id LIMIT ?2"),
                    params![ts(&now), i64::from(limit)],
                    interrupt_from,
                )
            })
            .await
    }

    async fn list_interrupts(&self, run_id: &RunId) -> StoreResult<Vec<Interrupt>> {
        let run_id = run_id.to_owned();
        self.db.read(move |c| read_interrupts(c, &run_id)).await
    }

    async fn list_tool_calls(&self, run_id: &RunId) -> StoreResult<Vec<ToolCall>> {
        let run_id = run_id.to_owned();
        self.db.read(move |c| read_tool_calls(c, &run_id, true)).await
    }

    async fn answer_view(&self, run_id: &RunId, user_id: &str) -> StoreResult<AnswerView> {
        let (run_id, user_id) = (run_id.to_owned(), user_id.to_owned());
        self.db
            .read_brief(move |c| {
                let run = read_run(c, &run_id)?;
                let facts = match &run {
                    Some(run) => read_facts(c, &run.conversation_id)?,
                    None => Vec::new(),
                };
                Ok(AnswerView {
                    run,
                    interrupts: read_interrupts(c, &run_id)?,
                    tool_calls: read_tool_calls(c, &run_id, false)?,
                    role: read_role(c, &user_id)?,
                    facts,
                })
            })
            .await
    }

    async fn list_conversation_tool_calls(&self, conversation_id: &ConversationId) -> StoreResult<Vec<ToolCall>> {
        let conversation_id = conversation_id.to_owned();
        self.db
            .read(move |c| {
                many(
                    c,
                    "list tool calls",
                    "SELECT * FROM tool_calls t WHERE conversation_id = ? AND NOT EXISTS \
                     (SELECT 1 FROM runs r WHERE r.id = t.run_id AND r.status = 'rolled_back') ORDER BY seq",
                    [conversation_id.as_str()],
                    tool_call_from,
                )
            })
            .await
    }

    async fn asking_calls(&self, name: &str) -> StoreResult<Vec<ToolCall>> {
        let name = name.to_owned();
        self.db
            .read(move |c| {
                many(
                    c,
                    "list calls waiting for a human",
                    "SELECT * FROM tool_calls WHERE name = ? AND state = 'asking' ORDER BY seq",
                    [name],
                    tool_call_from,
                )
            })
            .await
    }

    async fn idempotency_begin(
        &self,
        user_id: &str,
        key: &str,
        request_hash: &str,
        now: Timestamp,
        expires_at: Timestamp,
    ) -> StoreResult<IdempotencyBegin> {
        let (user_id, key, request_hash) = (user_id.to_owned(), key.to_owned(), request_hash.to_owned());
        self.db
            .write(move |c| {
                if let Some(stored) = find_key(c, "begin an idempotent request", &user_id, &key, &request_hash, &now)? {
                    return Ok(stored);
                }
                // new, or expired: this request starts it (again)
                exec(
                    c,
                    "begin an idempotent request",
                    "INSERT INTO idempotency_keys (user_id, key, request_hash, state, status, response, expires_at) \
                     VALUES (?, ?, ?, 'in_flight', NULL, NULL, ?) \
                     ON CONFLICT (user_id, key) DO UPDATE SET request_hash = excluded.request_hash, \
                     state = 'in_flight', status = NULL, response = NULL, expires_at = excluded.expires_at",
                    [&user_id, &key, &request_hash, &ts(&expires_at)],
                )?;
                Ok(IdempotencyBegin::Started)
            })
            .await
    }

    async fn idempotency_find(
        &self,
        user_id: &str,
        key: &str,
        request_hash: &str,
        now: Timestamp,
    ) -> StoreResult<Option<IdempotencyBegin>> {
        let (user_id, key, request_hash) = (user_id.to_owned(), key.to_owned(), request_hash.to_owned());
        self.db.read(move |c| find_key(c, "read an idempotency key", &user_id, &key, &request_hash, &now)).await
    }

    async fn idempotency_complete(&self, user_id: &str, key: &str, status: u16, response: &Value) -> StoreResult<()> {
        let (user_id, key, response) = (user_id.to_owned(), key.to_owned(), json("idempotent response", response)?);
        let done = self
            .db
            .write(move |c| {
                exec(
                    c,
                    "complete an idempotent request",
                    "UPDATE idempotency_keys SET state = 'done', status = ?, response = ? WHERE user_id = ? AND key = ?",
                    params![i64::from(status), response, user_id, key],
                )
            })
            .await?;
        if done == 0 {
            return Err(StoreError::NotFound("idempotency key"));
        }
        Ok(())
    }

    async fn idempotency_abandon(&self, user_id: &str, key: &str) -> StoreResult<()> {
        let (user_id, key) = (user_id.to_owned(), key.to_owned());
        self.db
            .write(move |c| {
                exec(
                    c,
                    "abandon an idempotent request",
                    "DELETE FROM idempotency_keys WHERE user_id = ? AND key = ? AND state = 'in_flight'",
                    [user_id.as_str(), key.as_str()],
                )
            })
            .await?;
        Ok(())
    }

    async fn abandon_all_in_flight_keys(&self) -> StoreResult<u64> {
        let done = self
            .db
            .write(|c| {
                exec(
                    c,
                    "abandon in-flight idempotency keys",
                    "DELETE FROM idempotency_keys WHERE state = 'in_flight'",
                    [],
                )
            })
            .await?;
        Ok(done as u64)
    }

    async fn prune_events(&self, rule: &PruneRule, max_events: u32, dry_run: bool) -> StoreResult<Pruned> {
        self.prune(rule, max_events, dry_run).await
    }

    async fn first_held_sequence(&self, run_id: &RunId) -> StoreResult<Option<i64>> {
        self.first_held(run_id).await
    }

    async fn list_conversation_runs(&self, conversation_id: &ConversationId) -> StoreResult<Vec<Run>> {
        self.conversation_runs(conversation_id).await
    }

    async fn newest_conversation_runs(&self, conversation_id: &ConversationId, limit: u32) -> StoreResult<Vec<Run>> {
        self.newest_runs(conversation_id, limit).await
    }
}

#[async_trait]
impl ConversationStore for SqliteStore {
    async fn create_conversation(
        &self,
        user_id: &str,
        title: &Masked<String>,
        agent_id: &str,
        now: Timestamp,
    ) -> StoreResult<Conversation> {
        let conversation = Conversation {
            id: ConversationId::new(),
            user_id: user_id.to_owned(),
            title: title.clone(),
            agent_id: Some(agent_id.to_owned()),
            version: 0,
            created_at: now,
        };
        self.db
            .write(move |c| {
                exec_or(
                    c,
                    "INSERT INTO conversations (id, user_id, title, agent_id, version, created_at) VALUES (?, ?, ?, ?, ?, ?)",
                    params![
                        conversation.id.as_str(),
                        conversation.user_id,
                        conversation.title.as_str(),
                        conversation.agent_id,
                        conversation.version,
                        ts(&conversation.created_at),
                    ],
                    insert("conversation"),
                )?;
                Ok(conversation.clone())
            })
            .await
    }

    async fn get_conversation(&self, id: &ConversationId) -> StoreResult<Option<Conversation>> {
        let id = id.to_owned();
        self.db
            .read_brief(move |c| {
                one(
                    c,
                    "get a conversation",
                    "SELECT * FROM conversations WHERE id = ?",
                    [id.as_str()],
                    conversation_from,
                )
            })
            .await
    }

    async fn list_conversations(&self, user_id: &str, limit: u32) -> StoreResult<Vec<Conversation>> {
        let user_id = user_id.to_owned();
        self.db
            .read(move |c| {
                many(
                    c,
                    "list conversations",
                    "SELECT * FROM conversations WHERE user_id = ? ORDER BY created_at DESC, id DESC LIMIT ?",
                    params![user_id, i64::from(limit)],
                    conversation_from,
                )
            })
            .await
    }

    async fn list_messages(&self, conversation_id: &ConversationId) -> StoreResult<Vec<Message>> {
        let conversation_id = conversation_id.to_owned();
        self.db
            .read(move |c| {
                many(
                    c,
                    "list messages",
                    "SELECT * FROM messages WHERE conversation_id = ? ORDER BY seq",
                    [conversation_id.as_str()],
                    message_from,
                )
            })
            .await
    }

    async fn recent_messages(&self, conversation_id: &ConversationId, limit: u32) -> StoreResult<Vec<Message>> {
        let conversation_id = conversation_id.to_owned();
        self.db
            .read(move |c| {
                let mut newest_first = many(
                    c,
                    "list recent messages",
                    "SELECT * FROM messages WHERE conversation_id = ? AND role <> 'tool' ORDER BY seq DESC LIMIT ?",
                    params![conversation_id.as_str(), i64::from(limit)],
                    message_from,
                )?;
                newest_first.reverse();
                Ok(newest_first)
            })
            .await
    }

    async fn list_run_messages(&self, run_id: &RunId) -> StoreResult<Vec<Message>> {
        let run_id = run_id.to_owned();
        self.db
            .read(move |c| {
                many(
                    c,
                    "list a run's messages",
                    "SELECT * FROM messages WHERE run_id = ? ORDER BY seq",
                    [run_id.as_str()],
                    message_from,
                )
            })
            .await
    }

    async fn messages_through_run(
        &self,
        conversation_id: &ConversationId,
        run_id: &RunId,
        limit: u32,
    ) -> StoreResult<MessagesThrough> {
        let conversation_id = conversation_id.to_owned();
        let run_id = run_id.to_owned();
        self.db
            .read(move |c| {
                // The run's last message (by the run's index), then the newest messages up to it (by
                // the conversation's).
                const WINDOW: &str = "SELECT * FROM messages WHERE conversation_id = ?1 AND seq <= \
                     (SELECT MAX(seq) FROM messages WHERE run_id = ?2 AND conversation_id = ?1) \
                     ORDER BY seq DESC LIMIT ?3";
                let args = params![conversation_id.as_str(), run_id.as_str(), i64::from(limit)];
                let messages = many(c, "list the messages through a run", WINDOW, args, message_from)?;
                let tool_calls = answered_calls(c, "list the tool calls through a run", &messages, true)?;
                Ok(MessagesThrough { messages, tool_calls })
            })
            .await
    }

    async fn context_window(&self, conversation_id: &ConversationId) -> StoreResult<ContextWindow> {
        let conversation_id = conversation_id.to_owned();
        self.db.read_brief(move |c| read_context_window(c, &conversation_id)).await
    }

    async fn list_facts(&self, conversation_id: &ConversationId) -> StoreResult<Vec<Fact>> {
        let conversation_id = conversation_id.to_owned();
        self.db.read(move |c| read_facts(c, &conversation_id)).await
    }

    async fn get_summary(&self, conversation_id: &ConversationId) -> StoreResult<Option<Summary>> {
        let conversation_id = conversation_id.to_owned();
        self.db
            .read(move |c| {
                one(
                    c,
                    "get the summary",
                    "SELECT * FROM summaries WHERE conversation_id = ?",
                    [conversation_id.as_str()],
                    summary_from,
                )
            })
            .await
    }

    async fn find_conversations(
        &self,
        user_id: Option<&str>,
        since: Option<Timestamp>,
    ) -> StoreResult<Vec<Conversation>> {
        self.conversations_for(user_id, since).await
    }
}

#[async_trait]
impl IdentityStore for SqliteStore {
    async fn user_role(&self, user_id: &str) -> StoreResult<Option<UserRole>> {
        let user_id = user_id.to_owned();
        self.db.read_brief(move |c| read_role(c, &user_id)).await
    }

    async fn set_user_role(&self, user_id: &str, role: UserRole) -> StoreResult<()> {
        let user_id = user_id.to_owned();
        self.db
            .write(move |c| {
                exec(
                    c,
                    "set a user's role",
                    "INSERT INTO users (id, role) VALUES (?, ?) ON CONFLICT (id) DO UPDATE SET role = excluded.role",
                    [user_id.as_str(), role.as_str()],
                )
            })
            .await?;
        Ok(())
    }

    async fn list_users(&self) -> StoreResult<Vec<User>> {
        self.db
            .read(move |c| {
                many(
                    c,
                    "list users",
                    "SELECT u.id, u.role, \
                 (SELECT COUNT(*) FROM api_keys k WHERE k.user_id = u.id AND k.revoked_at IS NULL) AS active_keys \
                 FROM users u ORDER BY u.id",
                    [],
                    user_from,
                )
            })
            .await
    }

    async fn insert_api_key(&self, key: &ApiKey) -> StoreResult<()> {
        let key = key.clone();
        self.db
            .write(move |c| {
                exec_or(
                    c,
                    "INSERT INTO api_keys (id, user_id, key_hash, created_at, revoked_at) VALUES (?, ?, ?, ?, ?)",
                    params![key.id, key.user_id, key.key_hash, ts(&key.created_at), opt_ts(&key.revoked_at)],
                    |e| {
                        if is_foreign_key_violation(&e) {
                            StoreError::NotFound("user")
                        } else {
                            insert("api key")(e)
                        }
                    },
                )?;
                Ok(())
            })
            .await
    }

    async fn api_key_user(&self, key_hash: &str) -> StoreResult<Option<String>> {
        let key_hash = key_hash.to_owned();
        self.db
            .read(move |c| {
                one(
                    c,
                    "look up an api key",
                    "SELECT user_id FROM api_keys WHERE key_hash = ? AND revoked_at IS NULL",
                    [key_hash],
                    |r| Cols::new(r, "api_keys").get("user_id"),
                )
            })
            .await
    }

    async fn count_active_api_keys(&self) -> StoreResult<u64> {
        let n = self
            .db
            .read(move |c| {
                one(c, "count api keys", "SELECT COUNT(*) AS n FROM api_keys WHERE revoked_at IS NULL", [], |r| {
                    Cols::new(r, "api_keys").get::<i64>("n")
                })
            })
            .await?;
        Ok(n.unwrap_or(0) as u64)
    }

    async fn revoke_api_keys(&self, user_id: &str, now: Timestamp) -> StoreResult<u64> {
        let user_id = user_id.to_owned();
        let done = self
            .db
            .write(move |c| {
                exec(
                    c,
                    "revoke api keys",
                    "UPDATE api_keys SET revoked_at = ? WHERE user_id = ? AND revoked_at IS NULL",
                    [ts(&now).as_str(), user_id.as_str()],
                )
            })
            .await?;
        Ok(done as u64)
    }

    async fn insert_stream_ticket(&self, ticket: &StreamTicket, now: Timestamp) -> StoreResult<()> {
        let ticket = ticket.clone();
        self.db
            .write(move |c| {
                exec(
                    c,
                    "forget old stream tickets",
                    "DELETE FROM stream_tickets WHERE expires_at < ?",
                    [ts(&(now - chrono::Duration::hours(1)))],
                )?;
                exec_or(
                    c,
                    "INSERT INTO stream_tickets (ticket_hash, user_id, scope, run_id, expires_at, used_at) \
                     VALUES (?, ?, ?, ?, ?, ?)",
                    params![
                        ticket.ticket_hash,
                        ticket.user_id,
                        ticket.scope.as_str(),
                        ticket.run_id.as_ref().map(|id| id.to_string()),
                        ts(&ticket.expires_at),
                        opt_ts(&ticket.used_at),
                    ],
                    insert("stream ticket"),
                )?;
                Ok(())
            })
            .await
    }

    async fn redeem_stream_ticket(&self, ticket_hash: &str, now: Timestamp) -> StoreResult<Option<StreamTicket>> {
        let ticket_hash = ticket_hash.to_owned();
        self.db
            .write(move |c| {
                one(
                    c,
                    "redeem a stream ticket",
                    "UPDATE stream_tickets SET used_at = ?1 WHERE ticket_hash = ?2 AND used_at IS NULL \
                     AND expires_at > ?1 RETURNING *",
                    [ts(&now).as_str(), ticket_hash.as_str()],
                    stream_ticket_from,
                )
            })
            .await
    }
}

#[async_trait]
impl BindingStore for SqliteStore {
    async fn binding(&self, namespace: &str, scope: &str, external_id: &str) -> StoreResult<Option<String>> {
        let namespace = namespace.to_owned();
        let scope = scope.to_owned();
        let external_id = external_id.to_owned();
        self.db
            .read(move |c| {
                one(
                    c,
                    "read a binding",
                    "SELECT value FROM bindings WHERE namespace = ? AND scope = ? AND external_id = ?",
                    [namespace, scope, external_id],
                    |r| Cols::new(r, "bindings").get("value"),
                )
            })
            .await
    }

    async fn bind(
        &self,
        namespace: &str,
        scope: &str,
        external_id: &str,
        value: &str,
        now: Timestamp,
    ) -> StoreResult<String> {
        let values = [namespace.to_owned(), scope.to_owned(), external_id.to_owned(), value.to_owned(), ts(&now)];
        self.db
            .write(move |c| {
                let [namespace, scope, external_id, value, now] = &values;
                exec(
                    c,
                    "bind an id",
                    "INSERT INTO bindings (namespace, scope, external_id, value, created_at) VALUES (?, ?, ?, ?, ?) \
                     ON CONFLICT (namespace, scope, external_id) DO NOTHING",
                    [namespace, scope, external_id, value, now],
                )?;
                one(
                    c,
                    "bind an id",
                    "SELECT value FROM bindings WHERE namespace = ? AND scope = ? AND external_id = ?",
                    [namespace, scope, external_id],
                    |r| Cols::new(r, "bindings").get("value"),
                )?
                .ok_or(StoreError::NotFound("binding"))
            })
            .await
    }
}

#[async_trait]
impl Store for SqliteStore {
    /// One brief read: both in one read transaction.
    async fn context_window_and_role(
        &self,
        conversation_id: &ConversationId,
        user_id: &str,
    ) -> StoreResult<(ContextWindow, Option<UserRole>)> {
        let (conversation_id, user_id) = (conversation_id.to_owned(), user_id.to_owned());
        self.db.read_brief(move |c| Ok((read_context_window(c, &conversation_id)?, read_role(c, &user_id)?))).await
    }

    async fn ping(&self) -> StoreResult<()> {
        self.db.read(move |c| one(c, "ping", "SELECT 1", [], |_| Ok(()))).await?;
        // the writer thread answers too
        self.db.write(|_| Ok(())).await
    }

    /// An embedded database runs on this machine: its clock is this process's.
    async fn db_now(&self) -> StoreResult<Timestamp> {
        Ok(chrono::Utc::now())
    }
}

/// What a live key (not expired at `now`) holds for the request `request_hash` ([`RunStore::idempotency_find`]).
fn find_key(
    c: &Conn<'_, '_>,
    what: &'static str,
    user_id: &str,
    key: &str,
    request_hash: &str,
    now: &Timestamp,
) -> StoreResult<Option<IdempotencyBegin>> {
    one(
        c,
        what,
        "SELECT * FROM idempotency_keys WHERE user_id = ? AND key = ? AND expires_at > ?",
        [user_id, key, &ts(now)],
        |r| {
            let c = Cols::new(r, "idempotency_keys");
            pipeline::stored_key(request_hash, c.get("request_hash")?, c.get("state")?, || {
                Ok((c.get("status")?, c.json("response")?))
            })
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::{DateTime, TimeZone, Utc};

    #[test]
    fn timestamps_sort_as_text_and_round_trip() {
        let a = Utc.with_ymd_and_hms(2030, 1, 1, 9, 59, 59).unwrap() + chrono::Duration::nanoseconds(999_999_999);
        let b = Utc.with_ymd_and_hms(2030, 1, 1, 10, 0, 0).unwrap();
        let c = b + chrono::Duration::nanoseconds(1);
        assert!(ts(&a) < ts(&b) && ts(&b) < ts(&c));
        assert_eq!(ts(&b), "2030-01-01T10:00:00.000000000Z");
        for t in [a, b, c] {
            let back = DateTime::parse_from_rfc3339(&ts(&t)).unwrap().with_timezone(&Utc);
            assert_eq!(back, t);
        }
    }

    #[test]
    fn urls() {
        assert_eq!(Location::parse_url("sqlite::memory:").unwrap(), Location::Memory);
        assert_eq!(Location::parse_url("sqlite://a/b.db?mode=memory").unwrap(), Location::Memory);
        assert_eq!(Location::parse_url("sqlite://a/b.db").unwrap(), Location::File("a/b.db".into()));
        assert_eq!(Location::parse_url("sqlite:///tmp/b.db?mode=rwc").unwrap(), Location::File("/tmp/b.db".into()));
        assert_eq!(Location::parse_url("sqlite:b.db").unwrap(), Location::File("b.db".into()));
        for bad in ["postgres://x/y", "sqlite://", "sqlite://a.db?cache=shared", "keel.db"] {
            assert!(Location::parse_url(bad).is_err(), "{bad}");
        }
    }
}
