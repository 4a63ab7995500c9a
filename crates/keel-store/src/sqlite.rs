//! The embedded SQLite backend.
//!
//! One writer connection (every write transaction starts with `BEGIN IMMEDIATE`, so a transaction
//! never has to upgrade a read lock and never meets `SQLITE_BUSY` half-way) and a pool of readers
//! (WAL mode lets them read while the writer writes). Timestamps are stored as fixed-width RFC 3339
//! text (see the migration), so SQL compares them correctly.
//!
//! **Group commit.** [`Store::commit`] calls are queued to one writer task, which runs the commits
//! waiting at that moment (at most [`MAX_GROUP`]) in one transaction, each inside its own
//! `SAVEPOINT`: a refused commit rolls back to its savepoint and nothing of it is written, the others
//! go on. Every caller gets its answer only after the shared `COMMIT`; if that fails, every commit
//! of the group is answered with the error and none was written. Commits of one run never share a
//! group out of order: a run's worker waits for each answer before it writes again. A caller that
//! stops waiting does not withdraw its commit (as before, when the `COMMIT` could already be sent).

use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, SecondsFormat, Utc};
use keel_core::domain::{
    ApiKey, Checkpoint, Conversation, Fact, FactSource, Interrupt, InterruptKind, InterruptStatus, Message, Role, Run,
    RunStatus, StreamTicket, Summary, TicketScope, Timestamp, ToolCall, ToolCallState, User, UserRole,
};
use keel_core::event::{Event, EventKind};
use keel_core::fleet::{Effect, ErrorLogEntry, FleetSeed, Instance};
use keel_core::ids::{ConversationId, InterruptId, InvalidId, MessageId, RunId};
use keel_core::store::{
    Commit, Committed, Fence, IdempotencyBegin, InterruptChange, NewRun, RunChange, StartedRun, Store, StoreError,
    StoreResult, TextAppend, ToolCallChange,
};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;
use sqlx::migrate::Migrator;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteRow, SqliteSynchronous};
use sqlx::{Row, Sqlite, SqliteConnection, SqlitePool, Transaction};
use tokio::sync::{mpsc, oneshot};

use crate::seed;

static MIGRATOR: Migrator = sqlx::migrate!("./migrations/sqlite");

const BUSY_TIMEOUT: Duration = Duration::from_secs(5);
const READERS: u32 = 4;
const STATEMENT_CACHE: usize = 256;
/// The statuses of a run that holds its conversation (`RunStatus::is_active`).
const ACTIVE: &str = "('queued', 'running', 'interrupted')";

/// The most commits one group transaction takes. Bounded so that one group's transaction, and the
/// wait of its first caller, stay short.
pub const MAX_GROUP: usize = 64;

/// The SQLite store. Cloning shares the pools and the writer task.
#[derive(Debug, Clone)]
pub struct SqliteStore {
    writer: SqlitePool,
    reader: SqlitePool,
    commits: mpsc::UnboundedSender<QueuedCommit>,
}

/// A commit waiting for the writer task, and where its answer goes.
#[derive(Debug)]
struct QueuedCommit {
    commit: Commit,
    answer: oneshot::Sender<StoreResult<Committed>>,
}

impl SqliteStore {
    /// Opens (creating it and its directory if needed) the database file at `path` and migrates it.
    pub async fn open(path: &Path) -> StoreResult<Self> {
        let store = Self::connect(file_options(path)?, false).await?;
        store.migrate().await?;
        Ok(store)
    }

    /// Opens `sqlite://path/to/file.db` (or `sqlite::memory:`) and migrates it.
    pub async fn open_url(url: &str) -> StoreResult<Self> {
        let (options, in_memory) = url_options(url)?;
        let store = Self::connect(options, in_memory).await?;
        store.migrate().await?;
        Ok(store)
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

    /// Closes every connection; waits for the ones in use.
    pub async fn close(&self) {
        self.reader.close().await;
        self.writer.close().await;
    }

    async fn connect(options: SqliteConnectOptions, in_memory: bool) -> StoreResult<Self> {
        let mut options = options
            .create_if_missing(true)
            .synchronous(SqliteSynchronous::Normal)
            .foreign_keys(true)
            .busy_timeout(BUSY_TIMEOUT)
            // room for every statement shape, the multi-row event inserts included, so none is
            // prepared again
            .statement_cache_capacity(STATEMENT_CACHE);
        if !in_memory {
            options = options.journal_mode(SqliteJournalMode::Wal);
        }
        // The writer is never closed for idleness: an in-memory database lives as long as it does.
        let writer = SqlitePoolOptions::new()
            .max_connections(1)
            .min_connections(1)
            .idle_timeout(None)
            .max_lifetime(None)
            .connect_with(options.clone())
            .await
            .map_err(db("open the database"))?;
        let reader = if in_memory {
            // readers on their own connections would each see another, empty database
            writer.clone()
        } else {
            SqlitePoolOptions::new()
                .max_connections(READERS)
                .connect_with(options.pragma("query_only", "ON"))
                .await
                .map_err(db("open the database"))?
        };
        let (commits, queue) = mpsc::unbounded_channel();
        // Ends when the last clone of the store (the last sender) is dropped.
        tokio::spawn(group_commits(writer.clone(), queue));
        Ok(Self { writer, reader, commits })
    }

    async fn migrate(&self) -> StoreResult<()> {
        MIGRATOR.run(&self.writer).await.map_err(|e| StoreError::Backend(format!("migrate the database: {e}")))
    }

    async fn begin(&self) -> StoreResult<Transaction<'static, Sqlite>> {
        self.writer.begin_with("BEGIN IMMEDIATE").await.map_err(db("begin a transaction"))
    }
}

fn file_options(path: &Path) -> StoreResult<SqliteConnectOptions> {
    create_parent_dir(path)?;
    Ok(SqliteConnectOptions::new().filename(path))
}

fn url_options(url: &str) -> StoreResult<(SqliteConnectOptions, bool)> {
    let invalid = || StoreError::Backend("the database url is not a valid sqlite: url".into());
    // the driver would take any other text for a file name
    if !url.starts_with("sqlite:") {
        return Err(invalid());
    }
    let options = SqliteConnectOptions::from_str(url).map_err(|_| invalid())?;
    let in_memory = url.contains(":memory:") || url.contains("mode=memory");
    if !in_memory {
        create_parent_dir(options.get_filename())?;
    }
    Ok((options, in_memory))
}

fn create_parent_dir(path: &Path) -> StoreResult<()> {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => {
            std::fs::create_dir_all(dir).map_err(|e| StoreError::Backend(format!("create the database directory: {e}")))
        }
        _ => Ok(()),
    }
}

// --- errors and encodings

/// Maps a driver error to `Backend`, naming the operation. Driver messages never carry the bound
/// parameters, so no value written leaks into the error.
fn db(op: &'static str) -> impl FnOnce(sqlx::Error) -> StoreError {
    move |e| {
        let detail = match &e {
            sqlx::Error::Database(d) => d.message().to_owned(),
            other => other.to_string(),
        };
        StoreError::Backend(format!("{op}: {detail}"))
    }
}

/// Like [`db`], but a unique violation is a reused id: `Duplicate`.
fn insert(what: &'static str) -> impl FnOnce(sqlx::Error) -> StoreError {
    move |e| match &e {
        sqlx::Error::Database(d) if d.is_unique_violation() => {
            StoreError::Duplicate(format!("{what} id already exists"))
        }
        _ => db(what)(e),
    }
}

fn is_unique_violation(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(d) if d.is_unique_violation())
}

/// Fixed width, UTC, nanoseconds: sorts as text, round-trips exactly.
fn ts(t: &Timestamp) -> String {
    t.to_rfc3339_opts(SecondsFormat::Nanos, true)
}

fn opt_ts(t: &Option<Timestamp>) -> Option<String> {
    t.as_ref().map(ts)
}

fn json<T: Serialize + ?Sized>(what: &'static str, value: &T) -> StoreResult<String> {
    serde_json::to_string(value).map_err(|e| StoreError::Backend(format!("encode {what}: {e}")))
}

fn opt_json(what: &'static str, value: &Option<Value>) -> StoreResult<Option<String>> {
    value.as_ref().map(|v| json(what, v)).transpose()
}

fn in_list(statuses: &[RunStatus]) -> String {
    let marks = vec!["?"; statuses.len()].join(", ");
    format!("({marks})")
}

fn status_list(statuses: &[RunStatus]) -> String {
    statuses.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(" or ")
}

/// What went wrong with a stored JSON value, without quoting it: serde's messages can carry the
/// offending text, which may be anything a tool returned.
fn json_error(e: &serde_json::Error) -> String {
    let kind = match e.classify() {
        serde_json::error::Category::Io => "unreadable",
        serde_json::error::Category::Syntax | serde_json::error::Category::Eof => "not valid JSON",
        serde_json::error::Category::Data => "not the expected shape",
    };
    format!("{kind} (line {}, column {})", e.line(), e.column())
}

/// Reads the columns of one row, turning anything unreadable into `Backend` instead of a panic.
struct Cols<'r> {
    row: &'r SqliteRow,
    table: &'static str,
}

impl<'r> Cols<'r> {
    fn new(row: &'r SqliteRow, table: &'static str) -> Self {
        Self { row, table }
    }

    fn bad(&self, col: &str, why: impl std::fmt::Display) -> StoreError {
        StoreError::Backend(format!("unreadable {}.{col}: {why}", self.table))
    }

    fn get<T>(&self, col: &str) -> StoreResult<T>
    where
        T: sqlx::Decode<'r, Sqlite> + sqlx::Type<Sqlite>,
    {
        self.row.try_get(col).map_err(|e| self.bad(col, e))
    }

    fn id<T: FromStr<Err = InvalidId>>(&self, col: &str) -> StoreResult<T> {
        let s: String = self.get(col)?;
        s.parse().map_err(|e| self.bad(col, e))
    }

    fn opt_id<T: FromStr<Err = InvalidId>>(&self, col: &str) -> StoreResult<Option<T>> {
        let s: Option<String> = self.get(col)?;
        s.map(|s| s.parse().map_err(|e| self.bad(col, e))).transpose()
    }

    fn parse<T>(&self, col: &str, parse: fn(&str) -> Option<T>) -> StoreResult<T> {
        let s: String = self.get(col)?;
        parse(&s).ok_or_else(|| self.bad(col, format!("unknown value `{}`", s.chars().take(40).collect::<String>())))
    }

    fn ts(&self, col: &str) -> StoreResult<Timestamp> {
        let s: String = self.get(col)?;
        self.parse_ts(col, &s)
    }

    fn opt_ts(&self, col: &str) -> StoreResult<Option<Timestamp>> {
        let s: Option<String> = self.get(col)?;
        s.map(|s| self.parse_ts(col, &s)).transpose()
    }

    fn parse_ts(&self, col: &str, s: &str) -> StoreResult<Timestamp> {
        DateTime::parse_from_rfc3339(s).map(|t| t.with_timezone(&Utc)).map_err(|e| self.bad(col, e))
    }

    fn json<T: DeserializeOwned>(&self, col: &str) -> StoreResult<T> {
        let s: String = self.get(col)?;
        serde_json::from_str(&s).map_err(|e| self.bad(col, json_error(&e)))
    }

    fn opt_json<T: DeserializeOwned>(&self, col: &str) -> StoreResult<Option<T>> {
        let s: Option<String> = self.get(col)?;
        s.map(|s| serde_json::from_str(&s).map_err(|e| self.bad(col, json_error(&e)))).transpose()
    }
}

fn conversation_from(row: &SqliteRow) -> StoreResult<Conversation> {
    let c = Cols::new(row, "conversations");
    Ok(Conversation {
        id: c.id("id")?,
        user_id: c.get("user_id")?,
        title: c.get("title")?,
        version: c.get("version")?,
        created_at: c.ts("created_at")?,
    })
}

fn user_from(row: &SqliteRow) -> StoreResult<User> {
    let c = Cols::new(row, "users");
    let active_keys: i64 = c.get("active_keys")?;
    Ok(User { id: c.get("id")?, role: c.parse("role", UserRole::parse)?, active_keys: active_keys as u64 })
}

fn stream_ticket_from(row: &SqliteRow) -> StoreResult<StreamTicket> {
    let c = Cols::new(row, "stream_tickets");
    Ok(StreamTicket {
        ticket_hash: c.get("ticket_hash")?,
        user_id: c.get("user_id")?,
        scope: c.parse("scope", TicketScope::parse)?,
        run_id: c.opt_id("run_id")?,
        expires_at: c.ts("expires_at")?,
        used_at: c.opt_ts("used_at")?,
    })
}

fn message_from(row: &SqliteRow) -> StoreResult<Message> {
    let c = Cols::new(row, "messages");
    Ok(Message {
        id: c.id("id")?,
        conversation_id: c.id("conversation_id")?,
        run_id: c.opt_id("run_id")?,
        role: c.parse("role", Role::parse)?,
        content: c.get("content")?,
        tool_call_id: c.opt_id("tool_call_id")?,
        created_at: c.ts("created_at")?,
    })
}

fn fact_from(row: &SqliteRow) -> StoreResult<Fact> {
    let c = Cols::new(row, "facts");
    Ok(Fact {
        key: c.get("key")?,
        value: c.get("value")?,
        source: c.parse("source", FactSource::parse)?,
        updated_at: c.ts("updated_at")?,
    })
}

fn summary_from(row: &SqliteRow) -> StoreResult<Summary> {
    let c = Cols::new(row, "summaries");
    Ok(Summary {
        conversation_id: c.id("conversation_id")?,
        through_message_id: c.id("through_message_id")?,
        text: c.get("text")?,
    })
}

fn run_from(row: &SqliteRow) -> StoreResult<Run> {
    let c = Cols::new(row, "runs");
    Ok(Run {
        id: c.id("id")?,
        conversation_id: c.id("conversation_id")?,
        user_message_id: c.id("user_message_id")?,
        user_id: c.get("user_id")?,
        status: c.parse("status", RunStatus::parse)?,
        reason: c.get("reason")?,
        cancel_on_disconnect: c.get("cancel_on_disconnect")?,
        cancel_requested: c.get("cancel_requested")?,
        next_sequence: c.get("next_sequence")?,
        lease_owner: c.get("lease_owner")?,
        lease_expires_at: c.opt_ts("lease_expires_at")?,
        checkpoint: c.json("checkpoint")?,
        created_at: c.ts("created_at")?,
        updated_at: c.ts("updated_at")?,
    })
}

fn event_from(run_id: &RunId, row: &SqliteRow) -> StoreResult<Event> {
    let c = Cols::new(row, "run_events");
    let type_name: String = c.get("type")?;
    let data: Value = c.json("data")?;
    let kind = EventKind::from_parts(&type_name, &data).map_err(|e| c.bad("data", json_error(&e)))?;
    Ok(Event { kind, run_id: run_id.clone(), sequence: c.get("sequence")?, ts: c.ts("created_at")? })
}

fn interrupt_from(row: &SqliteRow) -> StoreResult<Interrupt> {
    let c = Cols::new(row, "interrupts");
    Ok(Interrupt {
        id: c.id("id")?,
        run_id: c.id("run_id")?,
        kind: c.parse("kind", InterruptKind::parse)?,
        status: c.parse("status", InterruptStatus::parse)?,
        payload: c.json("payload")?,
        call_ids: c.json("call_ids")?,
        created_at: c.ts("created_at")?,
        expires_at: c.ts("expires_at")?,
        decision: c.opt_json("decision")?,
        resolved_by: c.get("resolved_by")?,
        resolved_at: c.opt_ts("resolved_at")?,
    })
}

fn tool_call_from(row: &SqliteRow) -> StoreResult<ToolCall> {
    let c = Cols::new(row, "tool_calls");
    Ok(ToolCall {
        id: c.id("id")?,
        run_id: c.id("run_id")?,
        name: c.get("name")?,
        args: c.json("args")?,
        state: c.parse("state", ToolCallState::parse)?,
        result: c.opt_json("result")?,
        summary: c.get("summary")?,
        started_at: c.opt_ts("started_at")?,
        finished_at: c.opt_ts("finished_at")?,
    })
}

fn instance_from(row: &SqliteRow) -> StoreResult<Instance> {
    let c = Cols::new(row, "instances");
    Ok(Instance {
        id: c.get("id")?,
        service: c.get("service")?,
        env: c.get("env")?,
        status: c.get("status")?,
        restart_count: c.get("restart_count")?,
        release: c.get("release")?,
        previous_release: c.get("previous_release")?,
    })
}

fn error_log_from(row: &SqliteRow) -> StoreResult<ErrorLogEntry> {
    let c = Cols::new(row, "error_logs");
    Ok(ErrorLogEntry {
        service: c.get("service")?,
        env: c.get("env")?,
        instance_id: c.get("instance_id")?,
        status_code: c.get("status_code")?,
        message: c.get("message")?,
        at: c.ts("at")?,
    })
}

fn all<T>(rows: &[SqliteRow], from: fn(&SqliteRow) -> StoreResult<T>) -> StoreResult<Vec<T>> {
    rows.iter().map(from).collect()
}

// --- writes shared by several operations, on the writer's transaction

async fn active_run_id(conn: &mut SqliteConnection, conversation_id: &ConversationId) -> StoreResult<Option<RunId>> {
    let row = sqlx::query(&format!("SELECT id FROM runs WHERE conversation_id = ? AND status IN {ACTIVE} LIMIT 1"))
        .bind(conversation_id.as_str())
        .fetch_optional(&mut *conn)
        .await
        .map_err(db("find the active run"))?;
    row.map(|r| Cols::new(&r, "runs").id("id")).transpose()
}

async fn insert_message(conn: &mut SqliteConnection, m: &Message) -> StoreResult<()> {
    sqlx::query(
        "INSERT INTO messages (id, conversation_id, run_id, role, content, tool_call_id, created_at) \
         VALUES (?, ?, ?, ?, ?, ?, ?)",
    )
    .bind(m.id.as_str())
    .bind(m.conversation_id.as_str())
    .bind(m.run_id.as_ref().map(|r| r.as_str()))
    .bind(m.role.as_str())
    .bind(&m.content)
    .bind(m.tool_call_id.as_ref().map(|c| c.as_str()))
    .bind(ts(&m.created_at))
    .execute(&mut *conn)
    .await
    .map_err(insert("message"))?;
    Ok(())
}

/// Events per `INSERT` statement: every statement is a round trip to the connection's thread, so a
/// commit's events go in a few multi-row statements (5 parameters a row, far under SQLite's limit).
const EVENTS_PER_INSERT: usize = 64;

async fn insert_events(
    conn: &mut SqliteConnection,
    run_id: &RunId,
    first_sequence: i64,
    kinds: &[EventKind],
    now: &Timestamp,
) -> StoreResult<Vec<Event>> {
    let created_at = ts(now);
    let mut events = Vec::with_capacity(kinds.len());
    for (chunk_index, chunk) in kinds.chunks(EVENTS_PER_INSERT).enumerate() {
        let rows = vec!["(?, ?, ?, ?, ?)"; chunk.len()].join(", ");
        let sql = format!("INSERT INTO run_events (run_id, sequence, type, data, created_at) VALUES {rows}");
        let mut query = sqlx::query(&sql);
        let first = first_sequence + (chunk_index * EVENTS_PER_INSERT) as i64;
        for (sequence, kind) in (first..).zip(chunk) {
            query = query
                .bind(run_id.as_str())
                .bind(sequence)
                .bind(kind.type_name())
                .bind(json("event data", &kind.to_data())?)
                .bind(&created_at);
            events.push(Event { kind: kind.clone(), run_id: run_id.clone(), sequence, ts: *now });
        }
        query.execute(&mut *conn).await.map_err(insert("event"))?;
    }
    Ok(events)
}

/// What the fence read of the run row, before the commit changes it.
struct Fenced {
    status: RunStatus,
    conversation_id: ConversationId,
    /// The sequence of the commit's first event.
    first_sequence: i64,
    cancel_requested: bool,
}

/// The fence: one conditional update of the run row that checks the writer's right to write,
/// renews or takes the lease and reserves the commit's event sequences.
async fn fence(conn: &mut SqliteConnection, c: &Commit) -> StoreResult<Fenced> {
    let n = i64::try_from(c.events.len()).map_err(|_| StoreError::Backend("too many events".into()))?;
    let now = ts(&c.now);
    const RETURNING: &str = "RETURNING status, conversation_id, next_sequence, cancel_requested";
    let row = match &c.fence {
        Fence::Lease { owner, lease_until } => {
            let sql = format!(
                "UPDATE runs SET lease_expires_at = ?, next_sequence = next_sequence + ?, updated_at = ? \
                 WHERE id = ? AND lease_owner = ? AND status IN {ACTIVE} {RETURNING}"
            );
            sqlx::query(&sql)
                .bind(ts(lease_until))
                .bind(n)
                .bind(&now)
                .bind(c.run_id.as_str())
                .bind(owner)
                .fetch_optional(&mut *conn)
                .await
        }
        Fence::Acquire { owner, from, lease_until } => {
            let sql = format!(
                "UPDATE runs SET lease_owner = ?, lease_expires_at = ?, next_sequence = next_sequence + ?, \
                 updated_at = ? WHERE id = ? AND status IN {} {RETURNING}",
                in_list(from)
            );
            let mut q = sqlx::query(&sql).bind(owner).bind(ts(lease_until)).bind(n).bind(&now).bind(c.run_id.as_str());
            for s in from {
                q = q.bind(s.as_str());
            }
            q.fetch_optional(&mut *conn).await
        }
        Fence::Unowned { from } => {
            let sql = format!(
                "UPDATE runs SET next_sequence = next_sequence + ?, updated_at = ? WHERE id = ? AND status IN {} \
                 {RETURNING}",
                in_list(from)
            );
            let mut q = sqlx::query(&sql).bind(n).bind(&now).bind(c.run_id.as_str());
            for s in from {
                q = q.bind(s.as_str());
            }
            q.fetch_optional(&mut *conn).await
        }
    }
    .map_err(db("fence the run"))?;

    let Some(row) = row else {
        return Err(fence_refusal(conn, c).await);
    };
    let cols = Cols::new(&row, "runs");
    let next_sequence: i64 = cols.get("next_sequence")?;
    Ok(Fenced {
        status: cols.parse("status", RunStatus::parse)?,
        conversation_id: cols.id("conversation_id")?,
        first_sequence: next_sequence - n,
        cancel_requested: cols.get("cancel_requested")?,
    })
}

/// Why the fence matched nothing: the run is missing, or it is not in the state the writer expects.
async fn fence_refusal(conn: &mut SqliteConnection, c: &Commit) -> StoreError {
    let status = sqlx::query_scalar::<_, String>("SELECT status FROM runs WHERE id = ?")
        .bind(c.run_id.as_str())
        .fetch_optional(&mut *conn)
        .await;
    let status = match status {
        Ok(Some(status)) => status,
        Ok(None) => return StoreError::NotFound("run"),
        Err(e) => return db("fence the run")(e),
    };
    StoreError::Conflict(match &c.fence {
        Fence::Lease { .. } => format!("run {} ({status}) is not leased by this worker", c.run_id),
        Fence::Acquire { from, .. } | Fence::Unowned { from } => {
            format!("run {} is {status}, not {}", c.run_id, status_list(from))
        }
    })
}

async fn change_status(
    conn: &mut SqliteConnection,
    c: &Commit,
    from: RunStatus,
    change: &RunChange,
) -> StoreResult<()> {
    if !from.can_transition_to(change.to) {
        return Err(StoreError::Conflict(format!("run {}: {from} -> {} is not allowed", c.run_id, change.to)));
    }
    // A paused or finished run has no worker.
    let release = change.to == RunStatus::Interrupted || change.to.is_terminal();
    sqlx::query(
        "UPDATE runs SET status = ?, reason = ?, \
         lease_owner = CASE WHEN ? THEN NULL ELSE lease_owner END, \
         lease_expires_at = CASE WHEN ? THEN NULL ELSE lease_expires_at END \
         WHERE id = ?",
    )
    .bind(change.to.as_str())
    .bind(&change.reason)
    .bind(release)
    .bind(release)
    .bind(c.run_id.as_str())
    .execute(&mut *conn)
    .await
    .map_err(|e| {
        if is_unique_violation(&e) {
            // only a move back to an active status can collide with another active run
            StoreError::Conflict(format!("run {}: the conversation has another active run", c.run_id))
        } else {
            db("change the run status")(e)
        }
    })?;
    Ok(())
}

async fn append_text(
    conn: &mut SqliteConnection,
    c: &Commit,
    conversation_id: &ConversationId,
    t: &TextAppend,
) -> StoreResult<()> {
    let done = sqlx::query(
        "INSERT INTO messages (id, conversation_id, run_id, role, content, tool_call_id, created_at) \
         VALUES (?, ?, ?, 'assistant', ?, NULL, ?) \
         ON CONFLICT (id) DO UPDATE SET content = content || excluded.content \
         WHERE messages.run_id = excluded.run_id AND messages.role = 'assistant'",
    )
    .bind(t.message_id.as_str())
    .bind(conversation_id.as_str())
    .bind(c.run_id.as_str())
    .bind(&t.text)
    .bind(ts(&c.now))
    .execute(&mut *conn)
    .await
    .map_err(db("append text"))?;
    if done.rows_affected() == 0 {
        return Err(StoreError::Conflict(format!(
            "message {} is not an assistant message of run {}",
            t.message_id, c.run_id
        )));
    }
    Ok(())
}

async fn discard_message(conn: &mut SqliteConnection, c: &Commit, id: &MessageId) -> StoreResult<()> {
    // A message that never got its first text was never created: nothing to delete is fine.
    sqlx::query("DELETE FROM messages WHERE id = ? AND run_id = ? AND role = 'assistant'")
        .bind(id.as_str())
        .bind(c.run_id.as_str())
        .execute(&mut *conn)
        .await
        .map_err(db("discard a message"))?;
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

async fn apply_tool_call(
    conn: &mut SqliteConnection,
    c: &Commit,
    conversation_id: &ConversationId,
    change: &ToolCallChange,
) -> StoreResult<()> {
    match change {
        ToolCallChange::Insert(call) => {
            check_owner(format_args!("tool call {}", call.id), &call.run_id, &c.run_id)?;
            sqlx::query(
                "INSERT INTO tool_calls (id, run_id, conversation_id, name, args, state, result, summary, \
                 started_at, finished_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            )
            .bind(call.id.as_str())
            .bind(call.run_id.as_str())
            .bind(conversation_id.as_str())
            .bind(&call.name)
            .bind(json("tool call args", &call.args)?)
            .bind(call.state.as_str())
            .bind(opt_json("tool call result", &call.result)?)
            .bind(&call.summary)
            .bind(opt_ts(&call.started_at))
            .bind(opt_ts(&call.finished_at))
            .execute(&mut *conn)
            .await
            .map_err(insert("tool call"))?;
        }
        ToolCallChange::Update { id, from, to, args, result, summary, started_at, finished_at } => {
            if !from.can_transition_to(*to) {
                return Err(StoreError::Conflict(format!("tool call {id}: {from} -> {to} is not allowed")));
            }
            let done = sqlx::query(
                "UPDATE tool_calls SET state = ?, args = COALESCE(?, args), result = COALESCE(?, result), \
                 summary = COALESCE(?, summary), started_at = COALESCE(?, started_at), \
                 finished_at = COALESCE(?, finished_at) \
                 WHERE id = ? AND run_id = ? AND state = ?",
            )
            .bind(to.as_str())
            .bind(args.as_ref().map(|a| json("tool call args", a)).transpose()?)
            .bind(opt_json("tool call result", result)?)
            .bind(summary)
            .bind(opt_ts(started_at))
            .bind(opt_ts(finished_at))
            .bind(id.as_str())
            .bind(c.run_id.as_str())
            .bind(from.as_str())
            .execute(&mut *conn)
            .await
            .map_err(db("update a tool call"))?;
            if done.rows_affected() == 0 {
                let state = sqlx::query_scalar::<_, String>("SELECT state FROM tool_calls WHERE id = ? AND run_id = ?")
                    .bind(id.as_str())
                    .bind(c.run_id.as_str())
                    .fetch_optional(&mut *conn)
                    .await
                    .map_err(db("update a tool call"))?;
                return Err(StoreError::Conflict(match state {
                    Some(state) => format!("tool call {id} is {state}, not {from}"),
                    None => format!("tool call {id} is not a call of run {}", c.run_id),
                }));
            }
        }
    }
    Ok(())
}

async fn insert_interrupt(conn: &mut SqliteConnection, c: &Commit, i: &Interrupt) -> StoreResult<()> {
    check_owner(format_args!("interrupt {}", i.id), &i.run_id, &c.run_id)?;
    sqlx::query(
        "INSERT INTO interrupts (id, run_id, kind, status, payload, call_ids, created_at, expires_at, decision, \
         resolved_by, resolved_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
    )
    .bind(i.id.as_str())
    .bind(i.run_id.as_str())
    .bind(i.kind.as_str())
    .bind(i.status.as_str())
    .bind(json("interrupt payload", &i.payload)?)
    .bind(json("interrupt call ids", &i.call_ids)?)
    .bind(ts(&i.created_at))
    .bind(ts(&i.expires_at))
    .bind(opt_json("interrupt decision", &i.decision)?)
    .bind(&i.resolved_by)
    .bind(opt_ts(&i.resolved_at))
    .execute(&mut *conn)
    .await
    .map_err(insert("interrupt"))?;
    Ok(())
}

async fn change_interrupt(conn: &mut SqliteConnection, c: &Commit, change: &InterruptChange) -> StoreResult<()> {
    let id = &change.id;
    if !InterruptStatus::Pending.can_transition_to(change.to) {
        return Err(StoreError::Conflict(format!("interrupt {id}: pending -> {} is not allowed", change.to)));
    }
    let now = ts(&c.now);
    // An interrupt past its expiry may still expire or be cancelled, never be resolved.
    let resolving = change.to == InterruptStatus::Resolved;
    let done = sqlx::query(
        "UPDATE interrupts SET status = ?, decision = COALESCE(?, decision), \
         resolved_by = COALESCE(?, resolved_by), resolved_at = ? \
         WHERE id = ? AND run_id = ? AND status = 'pending' AND (NOT ? OR expires_at > ?)",
    )
    .bind(change.to.as_str())
    .bind(opt_json("interrupt decision", &change.decision)?)
    .bind(&change.resolved_by)
    .bind(&now)
    .bind(id.as_str())
    .bind(c.run_id.as_str())
    .bind(resolving)
    .bind(&now)
    .execute(&mut *conn)
    .await
    .map_err(db("change an interrupt"))?;
    if done.rows_affected() > 0 {
        return Ok(());
    }
    let row = sqlx::query("SELECT status FROM interrupts WHERE id = ? AND run_id = ?")
        .bind(id.as_str())
        .bind(c.run_id.as_str())
        .fetch_optional(&mut *conn)
        .await
        .map_err(db("change an interrupt"))?;
    Err(StoreError::Conflict(match row {
        None => format!("interrupt {id} is not an interrupt of run {}", c.run_id),
        Some(row) => match Cols::new(&row, "interrupts").parse("status", InterruptStatus::parse)? {
            InterruptStatus::Pending => format!("interrupt {id} has expired"),
            status => format!("interrupt {id} is already {status}"),
        },
    }))
}

async fn upsert_fact(conn: &mut SqliteConnection, conversation_id: &ConversationId, f: &Fact) -> StoreResult<()> {
    sqlx::query(
        "INSERT INTO facts (conversation_id, key, value, source, updated_at) VALUES (?, ?, ?, ?, ?) \
         ON CONFLICT (conversation_id, key) DO UPDATE SET value = excluded.value, source = excluded.source, \
         updated_at = excluded.updated_at",
    )
    .bind(conversation_id.as_str())
    .bind(&f.key)
    .bind(&f.value)
    .bind(f.source.as_str())
    .bind(ts(&f.updated_at))
    .execute(&mut *conn)
    .await
    .map_err(db("upsert a fact"))?;
    Ok(())
}

async fn upsert_summary(conn: &mut SqliteConnection, conversation_id: &ConversationId, s: &Summary) -> StoreResult<()> {
    check_owner(format_args!("the summary"), &s.conversation_id, conversation_id)?;
    sqlx::query(
        "INSERT INTO summaries (conversation_id, through_message_id, text) VALUES (?, ?, ?) \
         ON CONFLICT (conversation_id) DO UPDATE SET through_message_id = excluded.through_message_id, \
         text = excluded.text",
    )
    .bind(conversation_id.as_str())
    .bind(s.through_message_id.as_str())
    .bind(&s.text)
    .execute(&mut *conn)
    .await
    .map_err(db("upsert the summary"))?;
    Ok(())
}

async fn apply_effect(conn: &mut SqliteConnection, effect: &Effect) -> StoreResult<()> {
    match effect {
        Effect::RestartInstance { instance_id } => {
            let done = sqlx::query(
                "UPDATE instances SET status = 'healthy', restart_count = restart_count + 1 \
                 WHERE id = ? AND status = 'abnormal'",
            )
            .bind(instance_id)
            .execute(&mut *conn)
            .await
            .map_err(db("restart an instance"))?;
            if done.rows_affected() == 0 {
                return Err(StoreError::EffectRefused(format!("instance {instance_id} is not abnormal")));
            }
        }
        Effect::RollbackRelease { service, env, from_release } => {
            let row = sqlx::query(
                "SELECT COUNT(*) AS total, \
                 COALESCE(SUM(release = ? AND previous_release IS NOT NULL), 0) AS ready \
                 FROM instances WHERE service = ? AND env = ?",
            )
            .bind(from_release)
            .bind(service)
            .bind(env)
            .fetch_one(&mut *conn)
            .await
            .map_err(db("roll back a release"))?;
            let cols = Cols::new(&row, "instances");
            let (total, ready): (i64, i64) = (cols.get("total")?, cols.get("ready")?);
            if total == 0 {
                return Err(StoreError::EffectRefused(format!("{service} has no instances in {env}")));
            }
            if ready != total {
                return Err(StoreError::EffectRefused(format!(
                    "not every instance of {service} in {env} is on {from_release} with a release to go back to"
                )));
            }
            sqlx::query(
                "UPDATE instances SET release = previous_release, previous_release = ?, status = 'healthy' \
                 WHERE service = ? AND env = ?",
            )
            .bind(from_release)
            .bind(service)
            .bind(env)
            .execute(&mut *conn)
            .await
            .map_err(db("roll back a release"))?;
        }
    }
    Ok(())
}

/// Everything of one commit, in the writer's transaction; the caller commits or drops it.
async fn apply_commit(conn: &mut SqliteConnection, c: &Commit) -> StoreResult<Committed> {
    let run = fence(conn, c).await?;
    if let Some(change) = &c.run {
        change_status(conn, c, run.status, change).await?;
    }
    if let Some(checkpoint) = &c.checkpoint {
        sqlx::query("UPDATE runs SET checkpoint = ? WHERE id = ?")
            .bind(json("checkpoint", checkpoint)?)
            .bind(c.run_id.as_str())
            .execute(&mut *conn)
            .await
            .map_err(db("write the checkpoint"))?;
    }
    for t in &c.text {
        append_text(conn, c, &run.conversation_id, t).await?;
    }
    for m in &c.messages {
        check_owner(format_args!("message {}", m.id), &m.conversation_id, &run.conversation_id)?;
        if let Some(run_id) = &m.run_id {
            check_owner(format_args!("message {}", m.id), run_id, &c.run_id)?;
        }
        insert_message(conn, m).await?;
    }
    for id in &c.discard_messages {
        discard_message(conn, c, id).await?;
    }
    for change in &c.tool_calls {
        apply_tool_call(conn, c, &run.conversation_id, change).await?;
    }
    for i in &c.new_interrupts {
        insert_interrupt(conn, c, i).await?;
    }
    for change in &c.interrupt_changes {
        change_interrupt(conn, c, change).await?;
    }
    for f in &c.facts {
        upsert_fact(conn, &run.conversation_id, f).await?;
    }
    if let Some(s) = &c.summary {
        upsert_summary(conn, &run.conversation_id, s).await?;
    }
    for effect in &c.effects {
        apply_effect(conn, effect).await?;
    }
    let events = insert_events(conn, &c.run_id, run.first_sequence, &c.events, &c.now).await?;
    Ok(Committed { events, cancel_requested: run.cancel_requested })
}

/// One commit: [`apply_commit`] and the answer stored under its idempotency key.
async fn apply_answered_commit(conn: &mut SqliteConnection, c: &Commit) -> StoreResult<Committed> {
    let committed = apply_commit(conn, c).await?;
    if let Some(answer) = &c.idempotency {
        let done = sqlx::query(
            "UPDATE idempotency_keys SET state = 'done', status = ?, response = ?, expires_at = ? \
             WHERE user_id = ? AND key = ? AND state = 'in_flight'",
        )
        .bind(i64::from(answer.status))
        .bind(json("idempotent response", &answer.response)?)
        .bind(ts(&answer.expires_at))
        .bind(&answer.user_id)
        .bind(&answer.key)
        .execute(&mut *conn)
        .await
        .map_err(db("store the answer under its idempotency key"))?;
        if done.rows_affected() == 0 {
            return Err(StoreError::Conflict("the idempotency key is not in flight".into()));
        }
    }
    Ok(committed)
}

/// The writer task: takes the commits queued at that moment, runs them as one group, answers them.
async fn group_commits(writer: SqlitePool, mut queue: mpsc::UnboundedReceiver<QueuedCommit>) {
    let mut group = Vec::with_capacity(MAX_GROUP);
    while queue.recv_many(&mut group, MAX_GROUP).await > 0 {
        let commits: Vec<&Commit> = group.iter().map(|q| &q.commit).collect();
        let answers = commit_group(&writer, &commits).await;
        for (queued, answer) in group.drain(..).zip(answers) {
            // a caller that stopped waiting has nobody to tell
            let _ = queued.answer.send(answer);
        }
    }
}

/// Runs `commits` in one transaction, each in its own savepoint; one answer per commit, in order.
async fn commit_group(writer: &SqlitePool, commits: &[&Commit]) -> Vec<StoreResult<Committed>> {
    match try_commit_group(writer, commits).await {
        Ok(answers) => answers,
        // The transaction failed as a whole (rolled back when dropped): nothing of it was written.
        Err(e) => {
            let why = match e {
                StoreError::Backend(why) => why,
                other => other.to_string(),
            };
            commits.iter().map(|_| Err(StoreError::Backend(why.clone()))).collect()
        }
    }
}

async fn try_commit_group(writer: &SqlitePool, commits: &[&Commit]) -> StoreResult<Vec<StoreResult<Committed>>> {
    let mut tx = writer.begin_with("BEGIN IMMEDIATE").await.map_err(db("begin a transaction"))?;
    if let [c] = commits {
        // Alone, a commit needs no savepoint: refused, its whole transaction is rolled back (dropped).
        let answer = apply_answered_commit(&mut tx, c).await;
        if answer.is_ok() {
            tx.commit().await.map_err(db("commit"))?;
        }
        return Ok(vec![answer]);
    }
    let mut answers = Vec::with_capacity(commits.len());
    for c in commits {
        sqlx::query("SAVEPOINT one_commit").execute(&mut *tx).await.map_err(db("begin a commit of the group"))?;
        let answer = apply_answered_commit(&mut tx, c).await;
        if answer.is_err() {
            // SQLite may have rolled back the whole transaction on some errors (a full disk, I/O):
            // then the savepoint is gone, this fails, and the group fails with it.
            sqlx::query("ROLLBACK TO one_commit")
                .execute(&mut *tx)
                .await
                .map_err(db("roll back a refused commit of the group"))?;
        }
        sqlx::query("RELEASE one_commit").execute(&mut *tx).await.map_err(db("end a commit of the group"))?;
        answers.push(answer);
    }
    tx.commit().await.map_err(db("commit"))?;
    Ok(answers)
}

async fn insert_run(conn: &mut SqliteConnection, run: &Run) -> StoreResult<()> {
    let result = sqlx::query(
        "INSERT INTO runs (id, conversation_id, user_message_id, user_id, status, reason, cancel_on_disconnect, \
         cancel_requested, next_sequence, lease_owner, lease_expires_at, checkpoint, created_at, updated_at) \
         VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
    )
    .bind(run.id.as_str())
    .bind(run.conversation_id.as_str())
    .bind(run.user_message_id.as_str())
    .bind(&run.user_id)
    .bind(run.status.as_str())
    .bind(&run.reason)
    .bind(run.cancel_on_disconnect)
    .bind(run.cancel_requested)
    .bind(run.next_sequence)
    .bind(&run.lease_owner)
    .bind(opt_ts(&run.lease_expires_at))
    .bind(json("checkpoint", &run.checkpoint)?)
    .bind(ts(&run.created_at))
    .bind(ts(&run.updated_at))
    .execute(&mut *conn)
    .await;
    match result {
        Ok(_) => Ok(()),
        // the partial unique index: another active run got in first
        Err(e) if is_unique_violation(&e) => match active_run_id(conn, &run.conversation_id).await? {
            Some(active) => Err(StoreError::RunActive(active)),
            None => Err(StoreError::Duplicate("run id already exists".into())),
        },
        Err(e) => Err(db("insert the run")(e)),
    }
}

#[async_trait]
impl Store for SqliteStore {
    async fn ping(&self) -> StoreResult<()> {
        sqlx::query("SELECT 1").execute(&self.reader).await.map_err(db("ping"))?;
        Ok(())
    }

    /// An embedded database runs on this machine: its clock is this process's.
    async fn db_now(&self) -> StoreResult<Timestamp> {
        Ok(chrono::Utc::now())
    }

    async fn create_conversation(&self, user_id: &str, title: &str, now: Timestamp) -> StoreResult<Conversation> {
        let conversation = Conversation {
            id: ConversationId::new(),
            user_id: user_id.to_owned(),
            title: title.to_owned(),
            version: 0,
            created_at: now,
        };
        sqlx::query("INSERT INTO conversations (id, user_id, title, version, created_at) VALUES (?, ?, ?, ?, ?)")
            .bind(conversation.id.as_str())
            .bind(&conversation.user_id)
            .bind(&conversation.title)
            .bind(conversation.version)
            .bind(ts(&conversation.created_at))
            .execute(&self.writer)
            .await
            .map_err(insert("conversation"))?;
        Ok(conversation)
    }

    async fn get_conversation(&self, id: &ConversationId) -> StoreResult<Option<Conversation>> {
        let row = sqlx::query("SELECT * FROM conversations WHERE id = ?")
            .bind(id.as_str())
            .fetch_optional(&self.reader)
            .await
            .map_err(db("get a conversation"))?;
        row.as_ref().map(conversation_from).transpose()
    }

    async fn list_conversations(&self, user_id: &str, limit: u32) -> StoreResult<Vec<Conversation>> {
        let rows =
            sqlx::query("SELECT * FROM conversations WHERE user_id = ? ORDER BY created_at DESC, id DESC LIMIT ?")
                .bind(user_id)
                .bind(i64::from(limit))
                .fetch_all(&self.reader)
                .await
                .map_err(db("list conversations"))?;
        all(&rows, conversation_from)
    }

    async fn list_messages(&self, conversation_id: &ConversationId) -> StoreResult<Vec<Message>> {
        let rows = sqlx::query("SELECT * FROM messages WHERE conversation_id = ? ORDER BY seq")
            .bind(conversation_id.as_str())
            .fetch_all(&self.reader)
            .await
            .map_err(db("list messages"))?;
        all(&rows, message_from)
    }

    async fn list_facts(&self, conversation_id: &ConversationId) -> StoreResult<Vec<Fact>> {
        let rows = sqlx::query("SELECT * FROM facts WHERE conversation_id = ? ORDER BY key")
            .bind(conversation_id.as_str())
            .fetch_all(&self.reader)
            .await
            .map_err(db("list facts"))?;
        all(&rows, fact_from)
    }

    async fn get_summary(&self, conversation_id: &ConversationId) -> StoreResult<Option<Summary>> {
        let row = sqlx::query("SELECT * FROM summaries WHERE conversation_id = ?")
            .bind(conversation_id.as_str())
            .fetch_optional(&self.reader)
            .await
            .map_err(db("get the summary"))?;
        row.as_ref().map(summary_from).transpose()
    }

    async fn start_run(&self, new: NewRun) -> StoreResult<StartedRun> {
        let mut tx = self.begin().await?;
        let version = sqlx::query_scalar::<_, i64>(
            "UPDATE conversations SET version = version + 1 WHERE id = ? RETURNING version",
        )
        .bind(new.conversation_id.as_str())
        .fetch_optional(&mut *tx)
        .await
        .map_err(db("start a run"))?
        .ok_or(StoreError::NotFound("conversation"))?;
        if let Some(active) = active_run_id(&mut tx, &new.conversation_id).await? {
            return Err(StoreError::RunActive(active));
        }
        let events_len = i64::try_from(new.events.len()).map_err(|_| StoreError::Backend("too many events".into()))?;
        let run = Run {
            id: RunId::new(),
            conversation_id: new.conversation_id.clone(),
            user_message_id: MessageId::new(),
            user_id: new.user_id.clone(),
            status: RunStatus::Queued,
            reason: None,
            cancel_on_disconnect: new.cancel_on_disconnect,
            cancel_requested: false,
            next_sequence: 1 + events_len,
            lease_owner: None,
            lease_expires_at: None,
            checkpoint: Checkpoint::start(version),
            created_at: new.now,
            updated_at: new.now,
        };
        let message = Message {
            id: run.user_message_id.clone(),
            conversation_id: new.conversation_id.clone(),
            run_id: Some(run.id.clone()),
            role: Role::User,
            content: new.content,
            tool_call_id: None,
            created_at: new.now,
        };
        // the run first: the message refers to it
        insert_run(&mut tx, &run).await?;
        insert_message(&mut tx, &message).await?;
        let events = insert_events(&mut tx, &run.id, 1, &new.events, &new.now).await?;
        tx.commit().await.map_err(db("start a run"))?;
        Ok(StartedRun { message, run, events })
    }

    async fn get_run(&self, id: &RunId) -> StoreResult<Option<Run>> {
        let row = sqlx::query("SELECT * FROM runs WHERE id = ?")
            .bind(id.as_str())
            .fetch_optional(&self.reader)
            .await
            .map_err(db("get a run"))?;
        row.as_ref().map(run_from).transpose()
    }

    async fn active_run(&self, conversation_id: &ConversationId) -> StoreResult<Option<Run>> {
        let row = sqlx::query(&format!("SELECT * FROM runs WHERE conversation_id = ? AND status IN {ACTIVE} LIMIT 1"))
            .bind(conversation_id.as_str())
            .fetch_optional(&self.reader)
            .await
            .map_err(db("get the active run"))?;
        row.as_ref().map(run_from).transpose()
    }

    async fn claim_runs(
        &self,
        owner: &str,
        now: Timestamp,
        lease_until: Timestamp,
        steal: bool,
        limit: u32,
    ) -> StoreResult<Vec<Run>> {
        let mut tx = self.begin().await?;
        let rows = sqlx::query(
            "UPDATE runs SET status = 'running', lease_owner = ?1, lease_expires_at = ?2, updated_at = ?3 \
             WHERE id IN (SELECT id FROM runs \
                 WHERE status = 'queued' \
                    OR (status = 'running' AND (lease_owner IS NULL OR lease_expires_at IS NULL \
                        OR lease_expires_at <= ?3 OR ?4)) \
                 ORDER BY created_at, id LIMIT ?5) \
             RETURNING *",
        )
        .bind(owner)
        .bind(ts(&lease_until))
        .bind(ts(&now))
        .bind(steal)
        .bind(i64::from(limit))
        .fetch_all(&mut *tx)
        .await
        .map_err(db("claim runs"))?;
        let mut runs = all(&rows, run_from)?;
        tx.commit().await.map_err(db("claim runs"))?;
        runs.sort_by(|a, b| (a.created_at, &a.id).cmp(&(b.created_at, &b.id)));
        Ok(runs)
    }

    async fn renew_lease(&self, run_id: &RunId, owner: &str, lease_until: Timestamp) -> StoreResult<bool> {
        let done = sqlx::query(&format!(
            "UPDATE runs SET lease_expires_at = ? WHERE id = ? AND lease_owner = ? AND status IN {ACTIVE}"
        ))
        .bind(ts(&lease_until))
        .bind(run_id.as_str())
        .bind(owner)
        .execute(&self.writer)
        .await
        .map_err(db("renew a lease"))?;
        Ok(done.rows_affected() > 0)
    }

    async fn release_lease(&self, run_id: &RunId, owner: &str) -> StoreResult<()> {
        sqlx::query("UPDATE runs SET lease_owner = NULL, lease_expires_at = NULL WHERE id = ? AND lease_owner = ?")
            .bind(run_id.as_str())
            .bind(owner)
            .execute(&self.writer)
            .await
            .map_err(db("release a lease"))?;
        Ok(())
    }

    async fn request_cancel(&self, run_id: &RunId, now: Timestamp) -> StoreResult<Run> {
        let mut tx = self.begin().await?;
        let updated = sqlx::query(&format!(
            "UPDATE runs SET cancel_requested = 1, updated_at = ? WHERE id = ? AND status IN {ACTIVE} RETURNING *"
        ))
        .bind(ts(&now))
        .bind(run_id.as_str())
        .fetch_optional(&mut *tx)
        .await
        .map_err(db("request a cancel"))?;
        let row = match updated {
            Some(row) => row,
            // a finished run stays as it is
            None => sqlx::query("SELECT * FROM runs WHERE id = ?")
                .bind(run_id.as_str())
                .fetch_optional(&mut *tx)
                .await
                .map_err(db("request a cancel"))?
                .ok_or(StoreError::NotFound("run"))?,
        };
        let run = run_from(&row)?;
        tx.commit().await.map_err(db("request a cancel"))?;
        Ok(run)
    }

    async fn commit(&self, commit: Commit) -> StoreResult<Committed> {
        let (answer, answered) = oneshot::channel();
        let stopped = || StoreError::Backend("commit: the writer task has stopped".into());
        self.commits.send(QueuedCommit { commit, answer }).map_err(|_| stopped())?;
        answered.await.map_err(|_| stopped())?
    }

    async fn list_events(&self, run_id: &RunId, after: i64, limit: u32) -> StoreResult<Vec<Event>> {
        let rows = sqlx::query(
            "SELECT sequence, type, data, created_at FROM run_events WHERE run_id = ? AND sequence > ? \
             ORDER BY sequence LIMIT ?",
        )
        .bind(run_id.as_str())
        .bind(after)
        .bind(i64::from(limit))
        .fetch_all(&self.reader)
        .await
        .map_err(db("list events"))?;
        rows.iter().map(|row| event_from(run_id, row)).collect()
    }

    async fn get_interrupt(&self, id: &InterruptId) -> StoreResult<Option<Interrupt>> {
        let row = sqlx::query("SELECT * FROM interrupts WHERE id = ?")
            .bind(id.as_str())
            .fetch_optional(&self.reader)
            .await
            .map_err(db("get an interrupt"))?;
        row.as_ref().map(interrupt_from).transpose()
    }

    async fn pending_interrupt(&self, run_id: &RunId) -> StoreResult<Option<Interrupt>> {
        let row = sqlx::query(
            "SELECT * FROM interrupts WHERE run_id = ? AND status = 'pending' ORDER BY created_at DESC, id DESC LIMIT 1",
        )
        .bind(run_id.as_str())
        .fetch_optional(&self.reader)
        .await
        .map_err(db("get the pending interrupt"))?;
        row.as_ref().map(interrupt_from).transpose()
    }

    async fn due_interrupts(&self, now: Timestamp, limit: u32) -> StoreResult<Vec<Interrupt>> {
        let rows = sqlx::query(
            "SELECT * FROM interrupts WHERE status = 'pending' AND expires_at <= ? ORDER BY expires_at, id LIMIT ?",
        )
        .bind(ts(&now))
        .bind(i64::from(limit))
        .fetch_all(&self.reader)
        .await
        .map_err(db("list due interrupts"))?;
        all(&rows, interrupt_from)
    }

    async fn list_tool_calls(&self, run_id: &RunId) -> StoreResult<Vec<ToolCall>> {
        let rows = sqlx::query("SELECT * FROM tool_calls WHERE run_id = ? ORDER BY seq")
            .bind(run_id.as_str())
            .fetch_all(&self.reader)
            .await
            .map_err(db("list tool calls"))?;
        all(&rows, tool_call_from)
    }

    async fn list_conversation_tool_calls(&self, conversation_id: &ConversationId) -> StoreResult<Vec<ToolCall>> {
        let rows = sqlx::query("SELECT * FROM tool_calls WHERE conversation_id = ? ORDER BY seq")
            .bind(conversation_id.as_str())
            .fetch_all(&self.reader)
            .await
            .map_err(db("list tool calls"))?;
        all(&rows, tool_call_from)
    }

    async fn instances_awaiting_restart(&self) -> StoreResult<Vec<String>> {
        let rows = sqlx::query(
            "SELECT DISTINCT json_extract(args, '$.instanceId') AS instance_id FROM tool_calls \
             WHERE name = 'restart_instance' AND state = 'asking' \
               AND json_type(args, '$.instanceId') = 'text' \
             ORDER BY instance_id",
        )
        .fetch_all(&self.reader)
        .await
        .map_err(db("list instances awaiting a restart"))?;
        rows.iter().map(|row| Cols::new(row, "tool_calls").get("instance_id")).collect()
    }

    async fn idempotency_begin(
        &self,
        user_id: &str,
        key: &str,
        request_hash: &str,
        now: Timestamp,
        expires_at: Timestamp,
    ) -> StoreResult<IdempotencyBegin> {
        let mut tx = self.begin().await?;
        let row = sqlx::query("SELECT * FROM idempotency_keys WHERE user_id = ? AND key = ? AND expires_at > ?")
            .bind(user_id)
            .bind(key)
            .bind(ts(&now))
            .fetch_optional(&mut *tx)
            .await
            .map_err(db("begin an idempotent request"))?;
        let Some(row) = row else {
            // new, or expired: this request starts it (again)
            sqlx::query(
                "INSERT INTO idempotency_keys (user_id, key, request_hash, state, status, response, expires_at) \
                 VALUES (?, ?, ?, 'in_flight', NULL, NULL, ?) \
                 ON CONFLICT (user_id, key) DO UPDATE SET request_hash = excluded.request_hash, \
                 state = 'in_flight', status = NULL, response = NULL, expires_at = excluded.expires_at",
            )
            .bind(user_id)
            .bind(key)
            .bind(request_hash)
            .bind(ts(&expires_at))
            .execute(&mut *tx)
            .await
            .map_err(db("begin an idempotent request"))?;
            tx.commit().await.map_err(db("begin an idempotent request"))?;
            return Ok(IdempotencyBegin::Started);
        };
        let c = Cols::new(&row, "idempotency_keys");
        let stored_hash: String = c.get("request_hash")?;
        if stored_hash != request_hash {
            return Ok(IdempotencyBegin::Mismatch);
        }
        let state: String = c.get("state")?;
        match state.as_str() {
            "in_flight" => Ok(IdempotencyBegin::InFlight),
            "done" => {
                let status: i64 = c.get("status")?;
                let status = u16::try_from(status).map_err(|e| c.bad("status", e))?;
                Ok(IdempotencyBegin::Done { status, response: c.json("response")? })
            }
            _ => Err(c.bad("state", "unknown value")),
        }
    }

    async fn idempotency_complete(&self, user_id: &str, key: &str, status: u16, response: &Value) -> StoreResult<()> {
        let done = sqlx::query(
            "UPDATE idempotency_keys SET state = 'done', status = ?, response = ? WHERE user_id = ? AND key = ?",
        )
        .bind(i64::from(status))
        .bind(json("idempotent response", response)?)
        .bind(user_id)
        .bind(key)
        .execute(&self.writer)
        .await
        .map_err(db("complete an idempotent request"))?;
        if done.rows_affected() == 0 {
            return Err(StoreError::NotFound("idempotency key"));
        }
        Ok(())
    }

    async fn abandon_all_in_flight_keys(&self) -> StoreResult<u64> {
        let done = sqlx::query("DELETE FROM idempotency_keys WHERE state = 'in_flight'")
            .execute(&self.writer)
            .await
            .map_err(db("abandon in-flight idempotency keys"))?;
        Ok(done.rows_affected())
    }

    async fn idempotency_abandon(&self, user_id: &str, key: &str) -> StoreResult<()> {
        sqlx::query("DELETE FROM idempotency_keys WHERE user_id = ? AND key = ? AND state = 'in_flight'")
            .bind(user_id)
            .bind(key)
            .execute(&self.writer)
            .await
            .map_err(db("abandon an idempotent request"))?;
        Ok(())
    }

    async fn user_role(&self, user_id: &str) -> StoreResult<Option<UserRole>> {
        let row = sqlx::query("SELECT role FROM users WHERE id = ?")
            .bind(user_id)
            .fetch_optional(&self.reader)
            .await
            .map_err(db("get a user's role"))?;
        row.map(|row| Cols::new(&row, "users").parse("role", UserRole::parse)).transpose()
    }

    async fn set_user_role(&self, user_id: &str, role: UserRole) -> StoreResult<()> {
        sqlx::query("INSERT INTO users (id, role) VALUES (?, ?) ON CONFLICT (id) DO UPDATE SET role = excluded.role")
            .bind(user_id)
            .bind(role.as_str())
            .execute(&self.writer)
            .await
            .map_err(db("set a user's role"))?;
        Ok(())
    }

    async fn list_users(&self) -> StoreResult<Vec<User>> {
        let rows = sqlx::query(
            "SELECT u.id, u.role, (SELECT COUNT(*) FROM api_keys k WHERE k.user_id = u.id AND k.revoked_at IS NULL) \
             AS active_keys FROM users u ORDER BY u.id",
        )
        .fetch_all(&self.reader)
        .await
        .map_err(db("list users"))?;
        rows.iter().map(user_from).collect()
    }

    async fn insert_api_key(&self, key: &ApiKey) -> StoreResult<()> {
        sqlx::query("INSERT INTO api_keys (id, user_id, key_hash, created_at, revoked_at) VALUES (?, ?, ?, ?, ?)")
            .bind(&key.id)
            .bind(&key.user_id)
            .bind(&key.key_hash)
            .bind(ts(&key.created_at))
            .bind(opt_ts(&key.revoked_at))
            .execute(&self.writer)
            .await
            .map_err(|e| match &e {
                sqlx::Error::Database(d) if d.is_foreign_key_violation() => StoreError::NotFound("user"),
                _ => insert("api key")(e),
            })?;
        Ok(())
    }

    async fn api_key_user(&self, key_hash: &str) -> StoreResult<Option<String>> {
        sqlx::query_scalar("SELECT user_id FROM api_keys WHERE key_hash = ? AND revoked_at IS NULL")
            .bind(key_hash)
            .fetch_optional(&self.reader)
            .await
            .map_err(db("look up an api key"))
    }

    async fn count_active_api_keys(&self) -> StoreResult<u64> {
        let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM api_keys WHERE revoked_at IS NULL")
            .fetch_one(&self.reader)
            .await
            .map_err(db("count api keys"))?;
        Ok(n as u64)
    }

    async fn revoke_api_keys(&self, user_id: &str, now: Timestamp) -> StoreResult<u64> {
        let done = sqlx::query("UPDATE api_keys SET revoked_at = ? WHERE user_id = ? AND revoked_at IS NULL")
            .bind(ts(&now))
            .bind(user_id)
            .execute(&self.writer)
            .await
            .map_err(db("revoke api keys"))?;
        Ok(done.rows_affected())
    }

    async fn insert_stream_ticket(&self, ticket: &StreamTicket, now: Timestamp) -> StoreResult<()> {
        let mut tx = self.begin().await?;
        sqlx::query("DELETE FROM stream_tickets WHERE expires_at < ?")
            .bind(ts(&(now - chrono::Duration::hours(1))))
            .execute(&mut *tx)
            .await
            .map_err(db("forget old stream tickets"))?;
        sqlx::query(
            "INSERT INTO stream_tickets (ticket_hash, user_id, scope, run_id, expires_at, used_at) \
             VALUES (?, ?, ?, ?, ?, ?)",
        )
        .bind(&ticket.ticket_hash)
        .bind(&ticket.user_id)
        .bind(ticket.scope.as_str())
        .bind(ticket.run_id.as_ref().map(|id| id.to_string()))
        .bind(ts(&ticket.expires_at))
        .bind(opt_ts(&ticket.used_at))
        .execute(&mut *tx)
        .await
        .map_err(insert("stream ticket"))?;
        tx.commit().await.map_err(db("store a stream ticket"))?;
        Ok(())
    }

    async fn redeem_stream_ticket(&self, ticket_hash: &str, now: Timestamp) -> StoreResult<Option<StreamTicket>> {
        let row = sqlx::query(
            "UPDATE stream_tickets SET used_at = ? WHERE ticket_hash = ? AND used_at IS NULL AND expires_at > ? \
             RETURNING *",
        )
        .bind(ts(&now))
        .bind(ticket_hash)
        .bind(ts(&now))
        .fetch_optional(&self.writer)
        .await
        .map_err(db("redeem a stream ticket"))?;
        row.as_ref().map(stream_ticket_from).transpose()
    }

    async fn seed_fleet(&self, fleet: FleetSeed, now: Timestamp) -> StoreResult<()> {
        let mut tx = self.begin().await?;
        for table in ["DELETE FROM error_logs", "DELETE FROM instances"] {
            sqlx::query(table).execute(&mut *tx).await.map_err(db("seed the fleet"))?;
        }
        for i in seed::instances(fleet) {
            sqlx::query(
                "INSERT INTO instances (id, service, env, status, restart_count, release, previous_release) \
                 VALUES (?, ?, ?, ?, ?, ?, ?)",
            )
            .bind(&i.id)
            .bind(&i.service)
            .bind(&i.env)
            .bind(&i.status)
            .bind(i.restart_count)
            .bind(&i.release)
            .bind(&i.previous_release)
            .execute(&mut *tx)
            .await
            .map_err(db("seed the fleet"))?;
        }
        for e in seed::error_logs(now) {
            sqlx::query(
                "INSERT INTO error_logs (service, env, instance_id, status_code, message, at) VALUES (?, ?, ?, ?, ?, ?)",
            )
            .bind(&e.service)
            .bind(&e.env)
            .bind(&e.instance_id)
            .bind(e.status_code)
            .bind(&e.message)
            .bind(ts(&e.at))
            .execute(&mut *tx)
            .await
            .map_err(db("seed the fleet"))?;
        }
        sqlx::query("INSERT INTO users (id, role) VALUES (?, ?) ON CONFLICT (id) DO NOTHING")
            .bind(seed::DEMO_USER)
            .bind(UserRole::Operator.as_str())
            .execute(&mut *tx)
            .await
            .map_err(db("seed the fleet"))?;
        tx.commit().await.map_err(db("seed the fleet"))?;
        Ok(())
    }

    async fn list_instances(&self, service: Option<&str>, env: Option<&str>) -> StoreResult<Vec<Instance>> {
        let rows = sqlx::query(
            "SELECT * FROM instances WHERE (?1 IS NULL OR service = ?1) AND (?2 IS NULL OR env = ?2) ORDER BY id",
        )
        .bind(service)
        .bind(env)
        .fetch_all(&self.reader)
        .await
        .map_err(db("list instances"))?;
        all(&rows, instance_from)
    }

    async fn get_instance(&self, id: &str) -> StoreResult<Option<Instance>> {
        let row = sqlx::query("SELECT * FROM instances WHERE id = ?")
            .bind(id)
            .fetch_optional(&self.reader)
            .await
            .map_err(db("get an instance"))?;
        row.as_ref().map(instance_from).transpose()
    }

    async fn recent_errors(&self, service: &str, env: &str, since: Timestamp) -> StoreResult<Vec<ErrorLogEntry>> {
        let rows =
            sqlx::query("SELECT * FROM error_logs WHERE service = ? AND env = ? AND at >= ? ORDER BY at DESC, id DESC")
                .bind(service)
                .bind(env)
                .bind(ts(&since))
                .fetch_all(&self.reader)
                .await
                .map_err(db("list recent errors"))?;
        all(&rows, error_log_from)
    }

    async fn list_runs(&self, user_id: &str, status: Option<RunStatus>, limit: u32) -> StoreResult<Vec<Run>> {
        let rows = sqlx::query(
            "SELECT * FROM runs WHERE user_id = ? AND (? IS NULL OR status = ?) \
             ORDER BY created_at DESC, id DESC LIMIT ?",
        )
        .bind(user_id)
        .bind(status.map(RunStatus::as_str))
        .bind(status.map(RunStatus::as_str))
        .bind(i64::from(limit))
        .fetch_all(&self.reader)
        .await
        .map_err(db("list runs"))?;
        all(&rows, run_from)
    }

    async fn list_interrupts(&self, run_id: &RunId) -> StoreResult<Vec<Interrupt>> {
        let rows = sqlx::query("SELECT * FROM interrupts WHERE run_id = ? ORDER BY created_at, id")
            .bind(run_id.as_str())
            .fetch_all(&self.reader)
            .await
            .map_err(db("list interrupts"))?;
        all(&rows, interrupt_from)
    }

    async fn ag_ui_thread(&self, user_id: &str, thread_id: &str) -> StoreResult<Option<ConversationId>> {
        let row = sqlx::query("SELECT conversation_id FROM ag_ui_threads WHERE user_id = ? AND thread_id = ?")
            .bind(user_id)
            .bind(thread_id)
            .fetch_optional(&self.reader)
            .await
            .map_err(db("get an AG-UI thread"))?;
        row.map(|row| Cols::new(&row, "ag_ui_threads").id("conversation_id")).transpose()
    }

    async fn bind_ag_ui_thread(
        &self,
        user_id: &str,
        thread_id: &str,
        conversation_id: &ConversationId,
        now: Timestamp,
    ) -> StoreResult<ConversationId> {
        sqlx::query(
            "INSERT INTO ag_ui_threads (user_id, thread_id, conversation_id, created_at) VALUES (?, ?, ?, ?) \
             ON CONFLICT (user_id, thread_id) DO NOTHING",
        )
        .bind(user_id)
        .bind(thread_id)
        .bind(conversation_id.as_str())
        .bind(ts(&now))
        .execute(&self.writer)
        .await
        .map_err(db("bind an AG-UI thread"))?;
        let row = sqlx::query("SELECT conversation_id FROM ag_ui_threads WHERE user_id = ? AND thread_id = ?")
            .bind(user_id)
            .bind(thread_id)
            .fetch_one(&self.writer)
            .await
            .map_err(db("bind an AG-UI thread"))?;
        Cols::new(&row, "ag_ui_threads").id("conversation_id")
    }

    async fn ag_ui_message(
        &self,
        conversation_id: &ConversationId,
        client_message_id: &str,
    ) -> StoreResult<Option<MessageId>> {
        let row =
            sqlx::query("SELECT message_id FROM ag_ui_messages WHERE conversation_id = ? AND client_message_id = ?")
                .bind(conversation_id.as_str())
                .bind(client_message_id)
                .fetch_optional(&self.reader)
                .await
                .map_err(db("get an AG-UI message id"))?;
        row.map(|row| Cols::new(&row, "ag_ui_messages").id("message_id")).transpose()
    }

    async fn record_ag_ui_message(
        &self,
        conversation_id: &ConversationId,
        client_message_id: &str,
        message_id: &MessageId,
    ) -> StoreResult<()> {
        sqlx::query(
            "INSERT INTO ag_ui_messages (conversation_id, client_message_id, message_id) VALUES (?, ?, ?) \
             ON CONFLICT (conversation_id, client_message_id) DO NOTHING",
        )
        .bind(conversation_id.as_str())
        .bind(client_message_id)
        .bind(message_id.as_str())
        .execute(&self.writer)
        .await
        .map_err(db("record an AG-UI message id"))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

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
}
