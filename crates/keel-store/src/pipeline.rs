//! The commit pipeline, written once for both backends: what [`Store::commit`] writes, in which
//! order, with which checks and which refusals — and the inserts of a new run.
//!
//! Each backend supplies only a [`Tx`]: a transaction that runs a statement with typed arguments and
//! reads one row back, plus the few things that really differ between SQLite and PostgreSQL (how a
//! timestamp or a JSON value is stored, how a batch of events is inserted, whether the fence can
//! read its row back with `RETURNING`). The statements are written once, with `$1`-style
//! placeholders; SQLite takes them as `?1` (the same numbering).
//!
//! SQLite's writer runs on a thread of its own and never waits: its [`Tx`] answers every call at
//! once, so [`ready`] runs the pipeline's future to its end in one poll. PostgreSQL's awaits the
//! server. PostgreSQL's group commit (`postgres/group.rs`) is a second way to write a *group* of
//! commits with one statement per table; a group that meets a refusal past the fence is written
//! again one commit at a time through this pipeline.
//!
//! [`Store::commit`]: keel_core::store::RunStore::commit

use std::future::Future;
use std::sync::OnceLock;
use std::task::{Context, Poll, Waker};

use keel_core::domain::{
    lease_holder, Checkpoint, Fact, Interrupt, InterruptStatus, Message, Role, Run, RunStatus, Summary, Timestamp,
    UserRole,
};
use keel_core::event::{Event, EventKind};
use keel_core::ids::{ConversationId, MessageId, RunId};
use keel_core::mask::Masked;
use keel_core::store::{
    Commit, Committed, Fence, IdempotencyBegin, InterruptChange, NewLease, NewRun, RolledBack, RunChange, StartedRun,
    StoreError, StoreResult, TextAppend, ToolCallChange, ToolCallUpdate,
};
use serde::Serialize;
use serde_json::Value;

/// The statuses of a run that holds its conversation (`RunStatus::is_active`), as a condition.
///
/// Written as `=` terms joined by `OR`, never as `status IN (…)`: SQLite evaluates an `IN` list of
/// three or more values through a temporary b-tree it builds and frees at each execution (a page
/// allocated and zeroed), which was ~14% of the server's instructions per run when every fence
/// and status change did it (docs/benchmarks.md, "Where SQLite's instructions went"). PostgreSQL
/// plans both forms alike, and proves either implies the one-active-run index's predicate.
pub const ACTIVE: &str = "(status = 'queued' OR status = 'running' OR status = 'interrupted')";

/// How a backend numbers its placeholders.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dialect {
    /// `$1`, and `UPDATE … RETURNING` is cheap.
    Postgres,
    /// `?1`; `RETURNING` goes through a temporary b-tree, so a row is read back by a `SELECT`.
    Sqlite,
}

impl Dialect {
    /// `sql`, written with `$N` placeholders, in this dialect.
    pub(crate) fn text(self, sql: String) -> String {
        match self {
            Dialect::Postgres => sql,
            Dialect::Sqlite => sql.replace('$', "?"),
        }
    }
}

/// A statement's text made once, from constants, by `format!`'s arguments, and kept for the
/// process: a `&'static str`, which SQLite's kept statements are found by (`sqlite/kept.rs`).
macro_rules! static_sql {
    ($($format:tt)*) => {{
        static SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| format!($($format)*));
        SQL.as_str()
    }};
}
pub(crate) use static_sql;

/// A statement written once, with `$N` placeholders; its SQLite text is made on first use.
pub(crate) struct Sql {
    text: &'static str,
    sqlite: OnceLock<String>,
}

impl Sql {
    pub(crate) const fn new(text: &'static str) -> Self {
        Self { text, sqlite: OnceLock::new() }
    }

    pub(crate) fn text(&'static self, dialect: Dialect) -> &'static str {
        match dialect {
            Dialect::Postgres => self.text,
            Dialect::Sqlite => self.sqlite.get_or_init(|| self.text.replace('$', "?")),
        }
    }
}

/// A JSON value encoded the way a backend stores it: text for SQLite, `jsonb` for PostgreSQL.
#[derive(Debug)]
pub(crate) enum Encoded {
    Text(String),
    Json(Value),
}

/// A statement's argument. `None` is a typed `NULL` (PostgreSQL checks a parameter's type against
/// its column even when it is null).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Arg<'a> {
    Text(Option<&'a str>),
    Int(Option<i64>),
    /// An `integer` column on PostgreSQL.
    I32(Option<i32>),
    Bool(bool),
    Time(Option<Timestamp>),
    Json(Option<&'a Value>),
    Encoded(Option<&'a Encoded>),
    /// A `text[]`: PostgreSQL's only (SQLite has no arrays, and refuses one).
    Texts(&'a [String]),
}

/// The type of a column read back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ty {
    Text,
    OptText,
    Int,
    Bool,
}

/// A column read back, as [`Ty`] asked.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Cell {
    Text(Option<String>),
    Int(i64),
    Bool(bool),
}

impl Cell {
    fn text(self, col: &str) -> StoreResult<String> {
        match self {
            Cell::Text(Some(s)) => Ok(s),
            _ => Err(unreadable(col)),
        }
    }

    fn opt_text(self, col: &str) -> StoreResult<Option<String>> {
        match self {
            Cell::Text(s) => Ok(s),
            _ => Err(unreadable(col)),
        }
    }

    fn int(self, col: &str) -> StoreResult<i64> {
        match self {
            Cell::Int(n) => Ok(n),
            _ => Err(unreadable(col)),
        }
    }

    fn bool(self, col: &str) -> StoreResult<bool> {
        match self {
            Cell::Bool(b) => Ok(b),
            _ => Err(unreadable(col)),
        }
    }
}

fn unreadable(col: &str) -> StoreError {
    StoreError::Backend(format!("column {col}: not the expected type"))
}

/// A statement the database refused, in terms the pipeline decides on.
#[derive(Debug)]
pub(crate) struct DbError {
    /// A unique (or primary key) violation.
    pub unique: bool,
    /// The violated constraint, where the backend names it.
    pub constraint: Option<String>,
    /// The database's message, never quoting a value written.
    pub message: String,
}

impl DbError {
    /// `Backend`, naming the operation.
    pub(crate) fn backend(self, op: &str) -> StoreError {
        StoreError::Backend(format!("{op}: {}", self.message))
    }

    /// Like [`DbError::backend`], but a unique violation is a reused id: `Duplicate`.
    pub(crate) fn insert(self, what: &str) -> StoreError {
        if self.unique {
            StoreError::Duplicate(format!("{what} id already exists"))
        } else {
            self.backend(what)
        }
    }
}

/// A backend's transaction, as the pipeline uses it.
pub(crate) trait Tx {
    const DIALECT: Dialect;

    /// A typed value as the backend stores JSON.
    fn encode<T: Serialize + ?Sized>(what: &'static str, value: &T) -> StoreResult<Encoded>;

    /// `t` as the backend keeps it (PostgreSQL's `timestamptz` keeps microseconds), so that what a
    /// commit returns equals what is read back.
    fn stored(t: Timestamp) -> Timestamp;

    /// Runs a statement; the number of rows it changed.
    fn execute(&mut self, sql: &'static str, args: &[Arg<'_>]) -> impl Future<Output = Result<u64, DbError>>;

    /// The first row of a query, its columns as `shape` says.
    fn row(
        &mut self,
        sql: &'static str,
        args: &[Arg<'_>],
        shape: &[Ty],
    ) -> impl Future<Output = Result<Option<Vec<Cell>>, DbError>>;

    /// Inserts `kinds` as the run's events from `first_sequence` on, at `now` (already as stored);
    /// the events as written.
    fn insert_events(
        &mut self,
        run_id: &RunId,
        first_sequence: i64,
        kinds: &[EventKind],
        now: Timestamp,
    ) -> impl Future<Output = StoreResult<Vec<Event>>>;

    /// A new run's rows ([`NewRows`]); the events as written, or `None` if a unique index refused
    /// the run (see [`insert_run`]). One statement after another; a backend where each is a round
    /// trip writes them as one.
    fn insert_start(&mut self, rows: &NewRows<'_>) -> impl Future<Output = StoreResult<Option<Vec<Event>>>>
    where
        Self: Sized,
    {
        async move {
            if !insert_run(self, rows.run, rows.pending, rows.one_active_run).await? {
                return Ok(None);
            }
            if let Some(message) = rows.message {
                insert_message(self, message).await?;
            }
            self.insert_events(&rows.run.id, 1, rows.events, rows.run.created_at).await.map(Some)
        }
    }
}

/// What [`start_run`] writes: the run (with the text of its message while it waits, `pending`), its
/// user message unless it waits, and its first events from sequence 1, all at the run's
/// `created_at`.
pub(crate) struct NewRows<'a> {
    pub run: &'a Run,
    pub pending: Option<&'a str>,
    pub message: Option<&'a Message>,
    pub events: &'a [EventKind],
    /// The name of the unique index that keeps one active run per conversation.
    pub one_active_run: &'a str,
}

/// An event's data as `run_events.data` stores it: its fields as JSON text, without the type.
pub(crate) fn event_data(kind: &EventKind) -> StoreResult<String> {
    kind.to_data_text().map_err(|e| StoreError::Backend(format!("encode event data: {e}")))
}

/// `kinds` as the events they are once written as the run's from `first_sequence` on, at `now`.
pub(crate) fn numbered(run_id: &RunId, first_sequence: i64, kinds: &[EventKind], now: Timestamp) -> Vec<Event> {
    (first_sequence..)
        .zip(kinds)
        .map(|(sequence, kind)| Event::new(kind.clone(), run_id.clone(), sequence, now))
        .collect()
}

/// Runs a future that never waits (SQLite's pipeline) to its end.
pub(crate) fn ready<T>(future: impl Future<Output = StoreResult<T>>) -> StoreResult<T> {
    let mut future = std::pin::pin!(future);
    match future.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(answer) => answer,
        Poll::Pending => Err(StoreError::Backend("a write waited on the SQLite writer thread".into())),
    }
}

async fn execute<T: Tx>(tx: &mut T, op: &'static str, sql: &'static Sql, args: &[Arg<'_>]) -> StoreResult<u64> {
    tx.execute(sql.text(T::DIALECT), args).await.map_err(|e| e.backend(op))
}

async fn insert<T: Tx>(tx: &mut T, what: &'static str, sql: &'static Sql, args: &[Arg<'_>]) -> StoreResult<()> {
    tx.execute(sql.text(T::DIALECT), args).await.map_err(|e| e.insert(what))?;
    Ok(())
}

async fn row<T: Tx>(
    tx: &mut T,
    op: &'static str,
    sql: &'static Sql,
    args: &[Arg<'_>],
    shape: &[Ty],
) -> StoreResult<Option<Vec<Cell>>> {
    tx.row(sql.text(T::DIALECT), args, shape).await.map_err(|e| e.backend(op))
}

/// The one column of a row.
fn only(row: Vec<Cell>) -> StoreResult<Cell> {
    row.into_iter().next().ok_or_else(|| StoreError::Backend("a row without its column".into()))
}

fn text(s: &str) -> Arg<'_> {
    Arg::Text(Some(s))
}

fn time(t: Timestamp) -> Arg<'static> {
    Arg::Time(Some(t))
}

/// `(status = 'queued' OR status = 'running')`: one term per status (see [`ACTIVE`] for why not
/// `IN`). The names are Keel's own, written into the statement, so a fence's statement depends only
/// on its kind and statuses: a handful, each prepared once.
fn status_is_one_of(statuses: &[RunStatus]) -> String {
    if statuses.is_empty() {
        return "FALSE".into();
    }
    let terms: Vec<String> = statuses.iter().map(|s| format!("status = '{}'", s.as_str())).collect();
    format!("({})", terms.join(" OR "))
}

static INSERT_MESSAGE: Sql = Sql::new(
    "INSERT INTO messages (id, conversation_id, run_id, role, content, tool_call_id, created_at) \
     VALUES ($1, $2, $3, $4, $5, $6, $7)",
);

async fn insert_message<T: Tx>(tx: &mut T, m: &Message) -> StoreResult<()> {
    let args = [
        text(m.id.as_str()),
        text(m.conversation_id.as_str()),
        Arg::Text(m.run_id.as_ref().map(|r| r.as_str())),
        text(m.role.as_str()),
        text(m.content.as_str()),
        Arg::Text(m.tool_call_id.as_ref().map(|c| c.as_str())),
        time(m.created_at),
    ];
    insert(tx, "message", &INSERT_MESSAGE, &args).await
}

pub(crate) static INSERT_RUN: Sql = Sql::new(
    "INSERT INTO runs (id, conversation_id, user_message_id, user_id, agent_id, status, reason, \
     cancel_on_disconnect, cancel_requested, next_sequence, lease_owner, lease_expires_at, checkpoint, \
     created_at, updated_at, pending_content, worker) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17)",
);

/// Inserts the run (with the text of its message while it waits, `pending`); `Ok(false)` if a
/// unique index refused it: the one-active-run index (another run of the conversation is active),
/// or, where the backend does not name the index, possibly the id. The caller tells them apart.
async fn insert_run<T: Tx>(tx: &mut T, run: &Run, pending: Option<&str>, one_active_run: &str) -> StoreResult<bool> {
    let checkpoint = T::encode("checkpoint", &run.checkpoint)?;
    let args = run_args(run, pending, &checkpoint);
    match tx.execute(INSERT_RUN.text(T::DIALECT), &args).await {
        Ok(_) => Ok(true),
        Err(e) if refused_as_active(&e, one_active_run) => Ok(false),
        Err(e) => Err(e.insert("run")),
    }
}

/// A unique violation of the one-active-run index (or, where the backend does not name the index,
/// of any: the caller tells them apart).
pub(crate) fn refused_as_active(e: &DbError, one_active_run: &str) -> bool {
    e.unique && e.constraint.as_deref().is_none_or(|c| c == one_active_run)
}

/// The parameters of [`INSERT_RUN`], in its order: `$1` … `$17`.
pub(crate) fn run_args<'a>(run: &'a Run, pending: Option<&'a str>, checkpoint: &'a Encoded) -> [Arg<'a>; 17] {
    [
        text(run.id.as_str()),
        text(run.conversation_id.as_str()),
        text(run.user_message_id.as_str()),
        text(&run.user_id),
        Arg::Text(run.agent_id.as_deref()),
        text(run.status.as_str()),
        Arg::Text(run.reason.as_deref()),
        Arg::Bool(run.cancel_on_disconnect),
        Arg::Bool(run.cancel_requested),
        Arg::Int(Some(run.next_sequence)),
        Arg::Text(run.lease_owner.as_deref()),
        Arg::Time(run.lease_expires_at),
        Arg::Encoded(Some(checkpoint)),
        time(run.created_at),
        time(run.updated_at),
        Arg::Text(pending),
        Arg::Text(run.worker.as_deref()),
    ]
}

static BUMP_CONVERSATION: Sql =
    Sql::new("UPDATE conversations SET version = version + 1 WHERE id = $1 RETURNING version");
/// Locks the conversation's row (PostgreSQL) without a new version: an enqueued message that may
/// wait, and a promotion that may find nothing to start, bump the version only once they know
/// their message joins the conversation.
static LOCK_CONVERSATION: Sql = Sql::new("UPDATE conversations SET version = version WHERE id = $1 RETURNING version");
static BUMP_CONVERSATION_ONLY: Sql = Sql::new("UPDATE conversations SET version = version + 1 WHERE id = $1");
static CONVERSATION_VERSION: Sql = Sql::new("SELECT version FROM conversations WHERE id = $1");

/// The conversation's version, one more than before with `bump`. On PostgreSQL the update locks
/// the row and returns it. On SQLite, whose one writer needs no lock and whose `RETURNING` goes
/// through a temporary b-tree, the update (when it bumps) and then a read of the version.
async fn conversation_version<T: Tx>(
    tx: &mut T,
    op: &'static str,
    bump: bool,
    conversation: &[Arg<'_>],
) -> StoreResult<i64> {
    let found = match T::DIALECT {
        Dialect::Postgres => {
            let sql = if bump { &BUMP_CONVERSATION } else { &LOCK_CONVERSATION };
            row(tx, op, sql, conversation, &[Ty::Int]).await?
        }
        Dialect::Sqlite => {
            if bump {
                execute(tx, op, &BUMP_CONVERSATION_ONLY, conversation).await?;
            }
            row(tx, op, &CONVERSATION_VERSION, conversation, &[Ty::Int]).await?
        }
    };
    only(found.ok_or(StoreError::NotFound("conversation"))?)?.int("version")
}
static ACTIVE_RUN: Sql = Sql::new(
    "SELECT id FROM runs WHERE conversation_id = $1 \
     AND (status = 'queued' OR status = 'running' OR status = 'interrupted') LIMIT 1",
);
/// The run a new message of the conversation would come after: its active run, else its oldest
/// waiting one. One row, of two scalar probes of two partial indexes (the one-active-run index,
/// `runs_waiting`): no sort, so SQLite builds no temporary b-tree for it (a `UNION ALL … ORDER BY`
/// built two at every start).
pub(crate) static BLOCKING_RUN: Sql = Sql::new(
    "SELECT COALESCE((SELECT id FROM runs WHERE conversation_id = $1 \
     AND (status = 'queued' OR status = 'running' OR status = 'interrupted') LIMIT 1), \
     (SELECT id FROM runs WHERE conversation_id = $1 AND status = 'waiting' ORDER BY created_at, id LIMIT 1))",
);

fn run_id_of(row: Vec<Cell>) -> StoreResult<RunId> {
    only(row)?.text("id")?.parse().map_err(|_| StoreError::Backend("column runs.id: not a run id".into()))
}

/// The conversation's active run, if any.
pub(crate) async fn active_run_id<T: Tx>(tx: &mut T, conversation_id: &ConversationId) -> StoreResult<Option<RunId>> {
    match row(tx, "find the active run", &ACTIVE_RUN, &[text(conversation_id.as_str())], &[Ty::Text]).await? {
        Some(row) => run_id_of(row).map(Some),
        None => Ok(None),
    }
}

/// The run a new message of the conversation comes after, if any: its active run, else its oldest
/// waiting one.
pub(crate) async fn blocking_run_id<T: Tx>(tx: &mut T, conversation_id: &ConversationId) -> StoreResult<Option<RunId>> {
    let found =
        row(tx, "find the runs not over", &BLOCKING_RUN, &[text(conversation_id.as_str())], &[Ty::OptText]).await?;
    match found.map(only).transpose()?.map(|id| id.opt_text("id")).transpose()?.flatten() {
        Some(id) => id.parse().map(Some).map_err(|_| StoreError::Backend("column runs.id: not a run id".into())),
        None => Ok(None),
    }
}

/// The run and user message [`start_run`] writes, at conversation `version`; a run that `waits`
/// is `waiting`, with no lease. `events`: how many first events it is written with.
pub(crate) fn new_run_rows<T: Tx>(
    new: &NewRun,
    run_id: RunId,
    message_id: MessageId,
    version: i64,
    waits: bool,
    events: usize,
) -> StoreResult<(Run, Message)> {
    let now = T::stored(new.now);
    let events_len = i64::try_from(events).map_err(|_| StoreError::Backend("too many events".into()))?;
    // A run that starts at once may be created leased to its worker; a waiting one never is.
    let lease = new.lease.as_ref().filter(|_| !waits);
    let run = Run {
        id: run_id,
        conversation_id: new.conversation_id.clone(),
        user_message_id: message_id,
        user_id: new.user_id.clone(),
        agent_id: Some(new.agent_id.clone()),
        status: if waits { RunStatus::Waiting } else { RunStatus::Queued },
        reason: None,
        cancel_on_disconnect: new.cancel_on_disconnect,
        cancel_requested: false,
        next_sequence: 1 + events_len,
        lease_owner: lease.map(|l| l.owner.clone()),
        lease_expires_at: lease.map(|l| T::stored(l.until)),
        worker: lease.map(|l| lease_holder(&l.owner).to_owned()),
        checkpoint: Checkpoint::start(version),
        created_at: now,
        updated_at: now,
        hidden_at: None,
    };
    let message = Message {
        id: run.user_message_id.clone(),
        conversation_id: new.conversation_id.clone(),
        run_id: Some(run.id.clone()),
        role: Role::User,
        content: new.content.clone(),
        tool_call_id: None,
        created_at: now,
    };
    Ok((run, message))
}

/// A new run, `queued`, with its user message and first events, under the ids given (made once by
/// the caller, so that a write run again answers the same). `Ok(None)` if the one-active-run index
/// refused the run: another run of the conversation became active between the check and the insert
/// (or, where the backend does not name the index, the run id was taken); the caller tells which.
///
/// A conversation with a run that is not over (active, or waiting) refuses it with `RunActive`,
/// unless `new.enqueue` asks it to wait: then the run is `waiting`, its message's text kept on it
/// (`pending_content`), with the enqueue's first events, and neither the message nor a new version
/// is written (both come with [`promote`]).
///
/// Bumping (or, for an enqueued message, locking) the conversation's version first locks its row on
/// PostgreSQL: starts and promotions on one conversation are serialised, and the check sees the run
/// of a start that committed while this one waited. The version is the run's checkpoint's: what
/// the context was built from.
pub(crate) async fn start_run<T: Tx>(
    tx: &mut T,
    new: &NewRun,
    run_id: RunId,
    message_id: MessageId,
    one_active_run: &str,
) -> StoreResult<Option<StartedRun>> {
    let conversation = [text(new.conversation_id.as_str())];
    let mut version = conversation_version(tx, "start a run", new.enqueue.is_none(), &conversation).await?;
    let waits = match (blocking_run_id(tx, &new.conversation_id).await?, &new.enqueue) {
        (Some(blocking), None) => return Err(StoreError::RunActive(blocking)),
        (Some(_), Some(_)) => true,
        (None, Some(_)) => {
            // nothing ahead: it starts now, as a message that would not wait
            version = conversation_version(tx, "start a run", true, &conversation).await?;
            false
        }
        (None, None) => false,
    };
    let first_events = match &new.enqueue {
        Some(waiting_events) if waits => waiting_events,
        _ => &new.events,
    };
    let (run, message) = new_run_rows::<T>(new, run_id, message_id, version, waits, first_events.len())?;
    // the run first: the message refers to it
    let rows = NewRows {
        run: &run,
        pending: waits.then(|| new.content.as_str()),
        message: (!waits).then_some(&message),
        events: first_events,
        one_active_run,
    };
    let Some(events) = tx.insert_start(&rows).await? else {
        return Ok(None);
    };
    // what the run's first step classifies its calls with (a run that waits has no step yet)
    let user_role = if waits { None } else { Some(user_role(tx, &new.user_id).await?) };
    Ok(Some(StartedRun { message, run, events, user_role }))
}

static USER_ROLE: Sql = Sql::new("SELECT role FROM users WHERE id = $1");

/// The role of `user_id` (`None`: the user has none stored).
async fn user_role<T: Tx>(tx: &mut T, user_id: &str) -> StoreResult<Option<UserRole>> {
    let found = row(tx, "get a user's role", &USER_ROLE, &[text(user_id)], &[Ty::Text]).await?;
    stored_role(found.map(|row| only(row)?.text("role")).transpose()?)
}

/// A `users.role` as read (`None`: no row).
pub(crate) fn stored_role(role: Option<String>) -> StoreResult<Option<UserRole>> {
    role.map(|role| UserRole::parse(&role).ok_or_else(|| StoreError::Backend("column users.role: not a role".into())))
        .transpose()
}

static OLDEST_WAITING: Sql = Sql::new(
    "SELECT id, user_message_id, pending_content, next_sequence FROM runs \
     WHERE conversation_id = $1 AND status = 'waiting' ORDER BY created_at, id LIMIT 1",
);
static PROMOTE: Sql = Sql::new(
    "UPDATE runs SET status = 'queued', pending_content = NULL, next_sequence = next_sequence + $2, \
     checkpoint = $3, updated_at = $4, lease_owner = $5, lease_expires_at = $6, worker = $7 \
     WHERE id = $1 AND status = 'waiting'",
);

/// A waiting run that [`promote`] started: its id, its message (now stored) and the events it was
/// given.
pub(crate) struct Promoted {
    pub run_id: RunId,
    pub message: Message,
    pub events: Vec<Event>,
}

/// Starts the conversation's oldest waiting run if the conversation has no active run: `waiting →
/// queued` (conditional on `waiting`), its message stored with a new conversation version (the
/// run's checkpoint's), `events` appended after the ones it has. `Ok(None)` when there is nothing
/// to start; then nothing was written but the lock. With `lease`, the run is leased to the worker
/// that will drive it (see [`keel_core::store::NewLease`]). `Conflict` when the run was promoted by another
/// writer after all (the caller rolls back the version it bumped; the one-active-run index refuses
/// a second active run the same way).
///
/// The conversation's row is locked first (PostgreSQL), as [`start_run`] locks it: a promotion and
/// a new message on one conversation are serialised, so of two instances promoting the same run one
/// waits for the other and then finds the run active.
pub(crate) async fn promote<T: Tx>(
    tx: &mut T,
    conversation_id: &ConversationId,
    events: &[EventKind],
    lease: Option<&NewLease>,
    now: Timestamp,
    one_active_run: &str,
) -> StoreResult<Option<Promoted>> {
    let now = T::stored(now);
    let conversation = [text(conversation_id.as_str())];
    conversation_version(tx, "promote a waiting run", false, &conversation).await?;
    if active_run_id(tx, conversation_id).await?.is_some() {
        return Ok(None);
    }
    let shape = [Ty::Text, Ty::Text, Ty::OptText, Ty::Int];
    let Some(oldest) = row(tx, "promote a waiting run", &OLDEST_WAITING, &conversation, &shape).await? else {
        return Ok(None);
    };
    let [id, message_id, content, next_sequence] =
        <[Cell; 4]>::try_from(oldest).map_err(|_| StoreError::Backend("promote a waiting run: a short row".into()))?;
    let run_id: RunId =
        id.text("id")?.parse().map_err(|_| StoreError::Backend("column runs.id: not a run id".into()))?;
    let message_id: MessageId = message_id
        .text("user_message_id")?
        .parse()
        .map_err(|_| StoreError::Backend("column runs.user_message_id: not a message id".into()))?;
    let content = content.opt_text("pending_content")?.unwrap_or_default();
    let first_sequence = next_sequence.int("next_sequence")?;
    let version = conversation_version(tx, "promote a waiting run", true, &conversation).await?;
    let checkpoint = T::encode("checkpoint", &Checkpoint::start(version))?;
    let n = i64::try_from(events.len()).map_err(|_| StoreError::Backend("too many events".into()))?;
    let args = [
        text(run_id.as_str()),
        Arg::Int(Some(n)),
        Arg::Encoded(Some(&checkpoint)),
        time(now),
        Arg::Text(lease.map(|l| l.owner.as_str())),
        Arg::Time(lease.map(|l| T::stored(l.until))),
        Arg::Text(lease.map(|l| lease_holder(&l.owner))),
    ];
    match tx.execute(PROMOTE.text(T::DIALECT), &args).await {
        Ok(0) => return Err(StoreError::Conflict(format!("run {run_id} is no longer waiting"))),
        Ok(_) => {}
        Err(e) if e.unique && e.constraint.as_deref().is_none_or(|c| c == one_active_run) => {
            return Err(StoreError::Conflict(format!("run {run_id}: the conversation has another active run")))
        }
        Err(e) => return Err(e.backend("promote a waiting run")),
    }
    let message = Message {
        id: message_id,
        conversation_id: conversation_id.clone(),
        run_id: Some(run_id.clone()),
        role: Role::User,
        content: Masked::from_store(content),
        tool_call_id: None,
        created_at: now,
    };
    insert_message(tx, &message).await?;
    let events = tx.insert_events(&run_id, first_sequence, events, now).await?;
    Ok(Some(Promoted { run_id, message, events }))
}

static READ_ROLLBACK: Sql =
    Sql::new("SELECT status, CAST(checkpoint AS TEXT), next_sequence, conversation_id FROM runs WHERE id = $1");
static ROLL_BACK: Sql = Sql::new(
    "UPDATE runs SET status = 'rolled_back', checkpoint = $2, updated_at = $3, lease_owner = NULL, \
     lease_expires_at = NULL, roll_back_requested = FALSE WHERE id = $1 AND (status = 'completed' OR status = 'failed' OR status = 'cancelled')",
);
/// The conversation's summary, when the last message it covers comes at or after the run's first
/// message (so it covers one of the run's messages).
static DROP_COVERING_SUMMARY: Sql = Sql::new(
    "DELETE FROM summaries WHERE conversation_id = $1 \
     AND (SELECT seq FROM messages WHERE id = summaries.through_message_id) \
         >= (SELECT MIN(seq) FROM messages WHERE run_id = $2)",
);
static DELETE_RUN_MESSAGES: Sql = Sql::new("DELETE FROM messages WHERE run_id = $1");
static DELETE_RUN_EVENTS: Sql = Sql::new("DELETE FROM run_events WHERE run_id = $1");
static HOLDS_NO_EVENT: Sql = Sql::new(
    "INSERT INTO run_prunes (run_id, first_held_sequence, pruned_at) VALUES ($1, $2, $3) \
     ON CONFLICT (run_id) DO UPDATE SET first_held_sequence = excluded.first_held_sequence, \
     pruned_at = excluded.pruned_at",
);

/// [`keel_core::store::RunStore::roll_back_run`]: a finished run's messages, events and checkpoint
/// removed (and the summary that covers one of those messages), the run `rolled_back`, in the
/// caller's transaction.
pub(crate) async fn roll_back<T: Tx>(tx: &mut T, run_id: &RunId, now: Timestamp) -> StoreResult<RolledBack> {
    let now = T::stored(now);
    let id = [text(run_id.as_str())];
    let shape = [Ty::Text, Ty::Text, Ty::Int, Ty::Text];
    let Some(found) = row(tx, "roll back a run", &READ_ROLLBACK, &id, &shape).await? else {
        return Err(StoreError::NotFound("run"));
    };
    let [status, checkpoint, next_sequence, conversation_id] =
        <[Cell; 4]>::try_from(found).map_err(|_| StoreError::Backend("roll back a run: a short row".into()))?;
    let status = status.text("status")?;
    match RunStatus::parse(&status) {
        Some(RunStatus::RolledBack) => return Ok(RolledBack::default()),
        Some(s) if s.can_transition_to(RunStatus::RolledBack) => {}
        _ => return Err(StoreError::Conflict(format!("run {run_id} is {status}: only a finished run is rolled back"))),
    }
    // What it did is gone: a checkpoint that names none of it, with the run's trace id (its logs
    // and spans stay joinable to it).
    let old: Checkpoint = serde_json::from_str(&checkpoint.text("checkpoint")?)
        .map_err(|_| StoreError::Backend("column runs.checkpoint: not a checkpoint".into()))?;
    let cleared = Checkpoint { trace_id: old.trace_id, ..Checkpoint::start(old.conversation_version) };
    let cleared = T::encode("checkpoint", &cleared)?;
    let args = [text(run_id.as_str()), Arg::Encoded(Some(&cleared)), time(now)];
    if execute(tx, "roll back a run", &ROLL_BACK, &args).await? == 0 {
        // Moved since it was read (PostgreSQL: another rollback of it committed meanwhile).
        let now_status = row(tx, "roll back a run", &READ_ROLLBACK, &id, &shape).await?;
        return match now_status.map(|r| r.into_iter().next().map(|s| s.text("status"))) {
            Some(Some(Ok(s))) if s == RunStatus::RolledBack.as_str() => Ok(RolledBack::default()),
            _ => Err(StoreError::Conflict(format!("run {run_id} changed while it was rolled back"))),
        };
    }
    let conversation_id = conversation_id.text("conversation_id")?;
    let summary =
        execute(tx, "roll back a run", &DROP_COVERING_SUMMARY, &[text(&conversation_id), text(run_id.as_str())])
            .await?
            > 0;
    let messages = execute(tx, "roll back a run", &DELETE_RUN_MESSAGES, &id).await?;
    let events = execute(tx, "roll back a run", &DELETE_RUN_EVENTS, &id).await?;
    let next_sequence = next_sequence.int("next_sequence")?;
    execute(tx, "roll back a run", &HOLDS_NO_EVENT, &[text(run_id.as_str()), Arg::Int(Some(next_sequence)), time(now)])
        .await?;
    Ok(RolledBack { messages, events, summary })
}

/// What the fence read of the run row as the commit leaves it.
struct Fenced {
    conversation_id: ConversationId,
    /// The sequence of the commit's first event.
    first_sequence: i64,
    cancel_requested: bool,
    /// The fence's statement wrote the commit's events too (PostgreSQL).
    events_written: bool,
}

const FENCED: [Ty; 3] = [Ty::Text, Ty::Int, Ty::Bool];
static READ_FENCED: Sql = Sql::new("SELECT conversation_id, next_sequence, cancel_requested FROM runs WHERE id = $1");

/// The fence: one conditional update of the run row that checks the writer's right to write,
/// renews, takes or (when the run pauses or ends) releases the lease, reserves the commit's event
/// sequences, and makes the commit's status change and checkpoint — one statement for what were
/// up to three. A status change is part of the condition (the row's status must be one the new
/// status may follow), so a refused one is told apart in [`fence_refusal`].
///
/// On PostgreSQL it locks the run row until the transaction ends: commits on one run are
/// serialised, and a concurrent writer that waited for the lock re-checks the condition against
/// the row as the winner left it, and the row comes back with `RETURNING`. SQLite's one writer
/// needs no lock, and reads the row back with a second statement.
async fn fence<T: Tx>(tx: &mut T, c: &Commit, now: Timestamp) -> StoreResult<Fenced> {
    let n = i64::try_from(c.events.len()).map_err(|_| StoreError::Backend("too many events".into()))?;
    let change = c.run.as_ref();
    // A paused or finished run has no worker.
    let release = change.is_some_and(|ch| ch.to == RunStatus::Interrupted || ch.to.is_terminal());
    let checkpoint = c.checkpoint.as_ref().map(|cp| T::encode("checkpoint", cp)).transpose()?;
    let worker;
    let mut args = vec![
        Arg::Int(Some(n)),
        time(now),
        text(c.run_id.as_str()),
        Arg::Text(change.map(|ch| ch.to.as_str())),
        Arg::Text(change.and_then(|ch| ch.reason.as_deref())),
        Arg::Encoded(checkpoint.as_ref()),
        Arg::Bool(release),
    ];
    match &c.fence {
        Fence::Lease { owner, lease_until } => args.extend([time(*lease_until), text(owner)]),
        Fence::Acquire { owner, lease_until, .. } => {
            worker = lease_holder(owner);
            args.extend([time(*lease_until), text(owner), text(worker)]);
        }
        Fence::Unowned { .. } => {}
    }
    // On PostgreSQL the commit's events go in with the fence, in its statement: a round trip fewer
    // per commit (SQLite's writer makes no round trips, and inserts them at the commit's end).
    let events_written = T::DIALECT == Dialect::Postgres && !c.events.is_empty();
    let (types, data): (Vec<String>, Vec<String>);
    if events_written {
        types = c.events.iter().map(|k| k.type_name().to_owned()).collect();
        data = c.events.iter().map(event_data).collect::<StoreResult<_>>()?;
        debug_assert_eq!(args.len(), fence_params(&c.fence), "the events' arrays follow the fence's parameters");
        args.extend([Arg::Texts(&types), Arg::Texts(&data)]);
    }
    // The statement checks the first move (through `via`, for two joined ones; the second was
    // checked when they were joined); the status written is `to` ($4).
    debug_assert!(change.is_none_or(|ch| ch.via.is_none_or(|via| via.can_transition_to(ch.to))));
    let sql = fence_sql(T::DIALECT, &c.fence, change.map(RunChange::first_move), events_written);
    let refused = |e: DbError| {
        if e.unique {
            // only a move back to an active status can collide with another active run
            StoreError::Conflict(format!("run {}: the conversation has another active run", c.run_id))
        } else {
            e.backend("fence the run")
        }
    };
    let row = match T::DIALECT {
        Dialect::Postgres => tx.row(sql, &args, &FENCED).await.map_err(refused)?,
        Dialect::Sqlite => {
            let changed = tx.execute(sql, &args).await.map_err(refused)?;
            if changed == 0 {
                None
            } else {
                row(tx, "fence the run", &READ_FENCED, &[text(c.run_id.as_str())], &FENCED).await?
            }
        }
    };
    let Some(row) = row else {
        return Err(fence_refusal(tx, c).await);
    };
    let [conversation_id, next_sequence, cancel_requested] =
        <[Cell; 3]>::try_from(row).map_err(|_| StoreError::Backend("fence the run: a short row".into()))?;
    Ok(Fenced {
        conversation_id: conversation_id
            .text("conversation_id")?
            .parse()
            .map_err(|_| StoreError::Backend("column runs.conversation_id: not a conversation id".into()))?,
        first_sequence: next_sequence.int("next_sequence")? - n,
        cancel_requested: cancel_requested.bool("cancel_requested")?,
        events_written,
    })
}

/// The fence's statement for its shape — the kind of fence, the statuses it takes the run from,
/// the status it moves the run to — in `dialect`, made once per shape and kept for the process (a
/// handful of shapes, a few hundred bytes each), so a commit neither formats nor converts it.
fn fence_sql(dialect: Dialect, fence: &Fence, to: Option<RunStatus>, with_events: bool) -> &'static str {
    type Shapes = std::collections::HashMap<u32, &'static str>;
    static SHAPES: OnceLock<std::sync::Mutex<Shapes>> = OnceLock::new();
    let mask = |statuses: &[RunStatus]| -> u32 {
        statuses.iter().map(|s| 1u32 << RunStatus::ALL.iter().position(|a| a == s).unwrap_or(31)).fold(0, |a, b| a | b)
    };
    let (kind, from) = match fence {
        Fence::Lease { .. } => (0u32, 0),
        Fence::Acquire { from, .. } => (1, mask(from)),
        Fence::Unowned { from } => (2, mask(from)),
    };
    let to_bits = to.map_or(0, |t| 1 + RunStatus::ALL.iter().position(|a| *a == t).unwrap_or(30) as u32);
    let key = (dialect as u32) << 28 | u32::from(with_events) << 27 | kind << 24 | to_bits << 16 | from;
    let mut shapes = SHAPES.get_or_init(Default::default).lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    shapes.entry(key).or_insert_with(|| Box::leak(make_fence_sql(dialect, fence, to, with_events).into_boxed_str()))
}

/// How many parameters the fence's statement of `fence`'s kind takes (what [`fence`] binds).
fn fence_params(fence: &Fence) -> usize {
    match fence {
        Fence::Lease { .. } => 9,
        Fence::Acquire { .. } => 10,
        Fence::Unowned { .. } => 7,
    }
}

fn make_fence_sql(dialect: Dialect, fence: &Fence, to: Option<RunStatus>, with_events: bool) -> String {
    // A status move is allowed only from the statuses it may follow.
    let transition = to.map_or_else(|| "TRUE".to_owned(), |to| status_is_one_of(&RunStatus::sources_of(to)));
    const COMMON: &str = "next_sequence = next_sequence + $1, updated_at = $2, status = COALESCE($4, status), \
         reason = CASE WHEN $4 IS NULL THEN reason ELSE $5 END, checkpoint = COALESCE($6, checkpoint)";
    let sql = match fence {
        // A commit that leaves the run's status as it is (most of a run's) names neither the status
        // nor the lease in its `SET`: SQLite rewrites the entries of every index whose columns, or
        // whose condition's columns, the `SET` names — the one-active-run and claim indexes, two
        // more pages in every transaction's WAL — even when the values stay the same. The lease
        // is kept alive by the worker's renewer (every third of its time to live), not by commits.
        // Its parameters are bound as for the other shapes; the ones it does not name ($4, $5: no
        // status; $7, $8: no lease change) are left unread.
        Fence::Lease { .. } if to.is_none() => format!(
            "UPDATE runs SET next_sequence = next_sequence + $1, updated_at = $2, \
             checkpoint = COALESCE($6, checkpoint) \
             WHERE id = $3 AND lease_owner = $9 AND {ACTIVE}"
        ),
        Fence::Lease { .. } => format!(
            "UPDATE runs SET {COMMON}, lease_owner = CASE WHEN $7 THEN NULL ELSE lease_owner END, \
             lease_expires_at = CASE WHEN $7 THEN NULL ELSE $8 END \
             WHERE id = $3 AND lease_owner = $9 AND {ACTIVE} AND {transition}"
        ),
        Fence::Acquire { from, .. } => format!(
            "UPDATE runs SET {COMMON}, lease_owner = CASE WHEN $7 THEN NULL ELSE $9 END, \
             lease_expires_at = CASE WHEN $7 THEN NULL ELSE $8 END, worker = $10 \
             WHERE id = $3 AND {} AND {transition}",
            status_is_one_of(from)
        ),
        Fence::Unowned { from } => format!(
            "UPDATE runs SET {COMMON}, lease_owner = CASE WHEN $7 THEN NULL ELSE lease_owner END, \
             lease_expires_at = CASE WHEN $7 THEN NULL ELSE lease_expires_at END \
             WHERE id = $3 AND {} AND {transition}",
            status_is_one_of(from)
        ),
    };
    match dialect {
        // The row comes back with the update: one statement, one round trip.
        Dialect::Postgres if !with_events => {
            format!("{sql} RETURNING conversation_id, next_sequence, cancel_requested")
        }
        // ... and the commit's events go in with it, numbered from the sequences the update reserved
        // (`next_sequence` comes back advanced by their count, $1), as two arrays after the fence's
        // parameters: nothing is inserted when the fence matches no row.
        Dialect::Postgres => {
            let (types, data) = (fence_params(fence) + 1, fence_params(fence) + 2);
            format!(
                "WITH f AS ({sql} RETURNING conversation_id, next_sequence, cancel_requested), \
                 e AS (INSERT INTO run_events (run_id, sequence, type, data, created_at) \
                       SELECT $3, f.next_sequence - $1 + u.ord - 1, u.type, u.data::jsonb, $2 \
                       FROM f, unnest(${types}::text[], ${data}::text[]) WITH ORDINALITY AS u (type, data, ord)) \
                 SELECT conversation_id, next_sequence, cancel_requested FROM f"
            )
        }
        Dialect::Sqlite => dialect.text(sql),
    }
}

static READ_FENCE_ROW: Sql = Sql::new("SELECT status, lease_owner FROM runs WHERE id = $1");

/// Why the fence matched nothing: the run is missing, not in the state the writer expects, or in
/// a state the commit's new status may not follow.
async fn fence_refusal<T: Tx>(tx: &mut T, c: &Commit) -> StoreError {
    let read = row(tx, "fence the run", &READ_FENCE_ROW, &[text(c.run_id.as_str())], &[Ty::Text, Ty::OptText]).await;
    let row = match read {
        Ok(Some(row)) => row,
        Ok(None) => return StoreError::NotFound("run"),
        Err(e) => return e,
    };
    let mut cells = row.into_iter();
    let status = cells.next().map(|s| s.text("status"));
    let owner = cells.next().map(|o| o.opt_text("lease_owner"));
    match (status, owner) {
        (Some(Ok(status)), Some(Ok(owner))) => crate::fence::refusal(c, &status, owner.as_deref()),
        (Some(Err(e)), _) | (_, Some(Err(e))) => e,
        _ => StoreError::Backend("fence the run: a short row".into()),
    }
}

static APPEND_TEXT: Sql = Sql::new(
    "INSERT INTO messages (id, conversation_id, run_id, role, content, tool_call_id, created_at) \
     VALUES ($1, $2, $3, 'assistant', $4, NULL, $5) \
     ON CONFLICT (id) DO UPDATE SET content = messages.content || excluded.content \
     WHERE messages.run_id = excluded.run_id AND messages.role = 'assistant'",
);

async fn append_text<T: Tx>(
    tx: &mut T,
    c: &Commit,
    conversation_id: &ConversationId,
    t: &TextAppend,
    now: Timestamp,
) -> StoreResult<()> {
    let args = [
        text(t.message_id.as_str()),
        text(conversation_id.as_str()),
        text(c.run_id.as_str()),
        text(&t.text),
        time(now),
    ];
    if execute(tx, "append text", &APPEND_TEXT, &args).await? == 0 {
        return Err(StoreError::Conflict(format!(
            "message {} is not an assistant message of run {}",
            t.message_id, c.run_id
        )));
    }
    Ok(())
}

static DISCARD_MESSAGE: Sql = Sql::new("DELETE FROM messages WHERE id = $1 AND run_id = $2 AND role = 'assistant'");

async fn discard_message<T: Tx>(tx: &mut T, c: &Commit, id: &MessageId) -> StoreResult<()> {
    // A message that never got its first text was never created: nothing to delete is fine.
    execute(tx, "discard a message", &DISCARD_MESSAGE, &[text(id.as_str()), text(c.run_id.as_str())]).await?;
    Ok(())
}

/// A record handed to a commit must belong to the commit's run.
fn check_owner<V: PartialEq + std::fmt::Display>(
    what: std::fmt::Arguments<'_>,
    of: &V,
    expected: &V,
) -> StoreResult<()> {
    if of == expected {
        Ok(())
    } else {
        Err(StoreError::Conflict(format!("{what} belongs to {of}, not {expected}")))
    }
}

static INSERT_TOOL_CALL: Sql = Sql::new(
    "INSERT INTO tool_calls (id, run_id, conversation_id, name, args, state, result, summary, attempts, \
     started_at, finished_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
);
static UPDATE_TOOL_CALL: Sql = Sql::new(
    "UPDATE tool_calls SET state = $1, args = COALESCE($2, args), result = COALESCE($3, result), \
     summary = COALESCE($4, summary), attempts = COALESCE($5, attempts), started_at = COALESCE($6, started_at), \
     finished_at = COALESCE($7, finished_at) WHERE id = $8 AND run_id = $9 AND state = $10",
);
static TOOL_CALL_STATE: Sql = Sql::new("SELECT state FROM tool_calls WHERE id = $1 AND run_id = $2");

async fn apply_tool_call<T: Tx>(
    tx: &mut T,
    c: &Commit,
    conversation_id: &ConversationId,
    change: &ToolCallChange,
) -> StoreResult<()> {
    match change {
        ToolCallChange::Insert(call) => {
            check_owner(format_args!("tool call {}", call.id), &call.run_id, &c.run_id)?;
            let args = [
                text(call.id.as_str()),
                text(call.run_id.as_str()),
                text(conversation_id.as_str()),
                text(&call.name),
                Arg::Json(Some(call.args.inner())),
                text(call.state.as_str()),
                Arg::Json(call.result.as_ref().map(|r| r.inner())),
                Arg::Text(call.summary.as_ref().map(|s| s.as_str())),
                Arg::I32(Some(attempts(call.attempts)?)),
                Arg::Time(call.started_at),
                Arg::Time(call.finished_at),
            ];
            insert(tx, "tool call", &INSERT_TOOL_CALL, &args).await?;
        }
        ToolCallChange::Update(ToolCallUpdate {
            id,
            from,
            to,
            args,
            result,
            summary,
            attempts: n,
            started_at,
            finished_at,
        }) => {
            if !from.can_transition_to(*to) {
                return Err(StoreError::Conflict(format!("tool call {id}: {from} -> {to} is not allowed")));
            }
            let values = [
                text(to.as_str()),
                Arg::Json(args.as_ref().map(|a| a.inner())),
                Arg::Json(result.as_ref().map(|r| r.inner())),
                Arg::Text(summary.as_ref().map(|s| s.as_str())),
                Arg::I32(n.map(attempts).transpose()?),
                Arg::Time(*started_at),
                Arg::Time(*finished_at),
                text(id.as_str()),
                text(c.run_id.as_str()),
                text(from.as_str()),
            ];
            if execute(tx, "update a tool call", &UPDATE_TOOL_CALL, &values).await? == 0 {
                let keys = [text(id.as_str()), text(c.run_id.as_str())];
                let state = row(tx, "update a tool call", &TOOL_CALL_STATE, &keys, &[Ty::Text]).await?;
                return Err(StoreError::Conflict(match state {
                    Some(state) => format!("tool call {id} is {}, not {from}", only(state)?.text("state")?),
                    None => format!("tool call {id} is not a call of run {}", c.run_id),
                }));
            }
        }
    }
    Ok(())
}

fn attempts(n: u32) -> StoreResult<i32> {
    i32::try_from(n).map_err(|_| StoreError::Backend("a tool call's attempts: too many".into()))
}

static INSERT_INTERRUPT: Sql = Sql::new(
    "INSERT INTO interrupts (id, run_id, kind, status, payload, call_ids, created_at, expires_at, decision, \
     note, resolved_by, resolved_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)",
);

async fn insert_interrupt<T: Tx>(tx: &mut T, c: &Commit, i: &Interrupt) -> StoreResult<()> {
    check_owner(format_args!("interrupt {}", i.id), &i.run_id, &c.run_id)?;
    let call_ids = T::encode("interrupt call ids", &i.call_ids)?;
    let args = [
        text(i.id.as_str()),
        text(i.run_id.as_str()),
        text(i.kind.as_str()),
        text(i.status.as_str()),
        Arg::Json(Some(i.payload.inner())),
        Arg::Encoded(Some(&call_ids)),
        time(i.created_at),
        time(i.expires_at),
        Arg::Json(i.decision.as_ref().map(|d| d.inner())),
        Arg::Text(i.note.as_ref().map(|n| n.as_str())),
        Arg::Text(i.resolved_by.as_deref()),
        Arg::Time(i.resolved_at),
    ];
    insert(tx, "interrupt", &INSERT_INTERRUPT, &args).await
}

static CHANGE_INTERRUPT: Sql = Sql::new(
    "UPDATE interrupts SET status = $1, decision = COALESCE($2, decision), note = COALESCE($3, note), \
     resolved_by = COALESCE($4, resolved_by), resolved_at = $5 \
     WHERE id = $6 AND run_id = $7 AND status = 'pending' AND (NOT $8 OR expires_at > $5)",
);
static INTERRUPT_STATUS: Sql = Sql::new("SELECT status FROM interrupts WHERE id = $1 AND run_id = $2");

async fn change_interrupt<T: Tx>(tx: &mut T, c: &Commit, change: &InterruptChange, now: Timestamp) -> StoreResult<()> {
    let id = &change.id;
    if !InterruptStatus::Pending.can_transition_to(change.to) {
        return Err(StoreError::Conflict(format!("interrupt {id}: pending -> {} is not allowed", change.to)));
    }
    // An interrupt past its expiry may still expire or be cancelled, never be resolved.
    let resolving = change.to == InterruptStatus::Resolved;
    let args = [
        text(change.to.as_str()),
        Arg::Json(change.decision.as_ref().map(|d| d.inner())),
        Arg::Text(change.note.as_ref().map(|n| n.as_str())),
        Arg::Text(change.resolved_by.as_deref()),
        time(now),
        text(id.as_str()),
        text(c.run_id.as_str()),
        Arg::Bool(resolving),
    ];
    if execute(tx, "change an interrupt", &CHANGE_INTERRUPT, &args).await? > 0 {
        return Ok(());
    }
    let keys = [text(id.as_str()), text(c.run_id.as_str())];
    let status = match row(tx, "change an interrupt", &INTERRUPT_STATUS, &keys, &[Ty::Text]).await? {
        None => return Err(StoreError::Conflict(format!("interrupt {id} is not an interrupt of run {}", c.run_id))),
        Some(row) => only(row)?.text("status")?,
    };
    Err(StoreError::Conflict(match InterruptStatus::parse(&status) {
        Some(InterruptStatus::Pending) => format!("interrupt {id} has expired"),
        _ => format!("interrupt {id} is already {status}"),
    }))
}

static UPSERT_FACT: Sql = Sql::new(
    "INSERT INTO facts (conversation_id, key, value, source, updated_at) VALUES ($1, $2, $3, $4, $5) \
     ON CONFLICT (conversation_id, key) DO UPDATE SET value = excluded.value, source = excluded.source, \
     updated_at = excluded.updated_at",
);

async fn upsert_fact<T: Tx>(tx: &mut T, conversation_id: &ConversationId, f: &Fact) -> StoreResult<()> {
    let args = [
        text(conversation_id.as_str()),
        text(&f.key),
        text(f.value.as_str()),
        text(f.source.as_str()),
        time(f.updated_at),
    ];
    execute(tx, "upsert a fact", &UPSERT_FACT, &args).await?;
    Ok(())
}

static UPSERT_SUMMARY: Sql = Sql::new(
    "INSERT INTO summaries (conversation_id, through_message_id, text) VALUES ($1, $2, $3) \
     ON CONFLICT (conversation_id) DO UPDATE SET through_message_id = excluded.through_message_id, \
     text = excluded.text",
);

async fn upsert_summary<T: Tx>(tx: &mut T, conversation_id: &ConversationId, s: &Summary) -> StoreResult<()> {
    check_owner(format_args!("the summary"), &s.conversation_id, conversation_id)?;
    let args = [text(conversation_id.as_str()), text(s.through_message_id.as_str()), text(s.text.as_str())];
    execute(tx, "upsert the summary", &UPSERT_SUMMARY, &args).await?;
    Ok(())
}

/// What a live key's row holds for the request `request_hash` (both backends' readers): its
/// `request_hash` and `state` as stored, and `done` to read its answer (status, response).
pub(crate) fn stored_key(
    request_hash: &str,
    stored_hash: String,
    state: String,
    done: impl FnOnce() -> StoreResult<(i64, Value)>,
) -> StoreResult<IdempotencyBegin> {
    if stored_hash != request_hash {
        return Ok(IdempotencyBegin::Mismatch);
    }
    match state.as_str() {
        "in_flight" => Ok(IdempotencyBegin::InFlight),
        "done" => {
            let (status, response) = done()?;
            let status = u16::try_from(status)
                .map_err(|e| StoreError::Backend(format!("unreadable idempotency_keys.status: {e}")))?;
            Ok(IdempotencyBegin::Done { status, response })
        }
        _ => Err(StoreError::Backend("unreadable idempotency_keys.state: unknown value".into())),
    }
}

/// The answer under its key: a free key (new, or expired at the commit) is taken, the same request's
/// in-flight key completed; a key holding an answer changes nothing, which refuses the commit.
static STORE_ANSWER: Sql = Sql::new(
    "INSERT INTO idempotency_keys (user_id, key, request_hash, state, status, response, expires_at) \
     VALUES ($4, $5, $6, 'done', $1, $2, $3) \
     ON CONFLICT (user_id, key) DO UPDATE SET request_hash = excluded.request_hash, state = 'done', \
     status = excluded.status, response = excluded.response, expires_at = excluded.expires_at \
     WHERE idempotency_keys.expires_at <= $7 \
        OR (idempotency_keys.state = 'in_flight' AND idempotency_keys.request_hash = excluded.request_hash)",
);

/// Everything of one commit, and the answer stored under its idempotency key, in the caller's
/// transaction; on an error the caller rolls the whole of it back.
pub(crate) async fn apply_commit<T: Tx>(tx: &mut T, c: &Commit) -> StoreResult<Committed> {
    let now = T::stored(c.now);
    let run = fence(tx, c, now).await?;
    for t in &c.text {
        append_text(tx, c, &run.conversation_id, t, now).await?;
    }
    for m in &c.messages {
        check_owner(format_args!("message {}", m.id), &m.conversation_id, &run.conversation_id)?;
        if let Some(run_id) = &m.run_id {
            check_owner(format_args!("message {}", m.id), run_id, &c.run_id)?;
        }
        insert_message(tx, m).await?;
    }
    for id in &c.discard_messages {
        discard_message(tx, c, id).await?;
    }
    for change in &c.tool_calls {
        apply_tool_call(tx, c, &run.conversation_id, change).await?;
    }
    for i in &c.new_interrupts {
        insert_interrupt(tx, c, i).await?;
    }
    for change in &c.interrupt_changes {
        change_interrupt(tx, c, change, now).await?;
    }
    for f in &c.facts {
        upsert_fact(tx, &run.conversation_id, f).await?;
    }
    if let Some(s) = &c.summary {
        upsert_summary(tx, &run.conversation_id, s).await?;
    }
    if let Some(answer) = &c.idempotency {
        let args = [
            Arg::Int(Some(i64::from(answer.status))),
            Arg::Json(Some(&answer.response)),
            time(answer.expires_at),
            text(&answer.user_id),
            text(&answer.key),
            text(&answer.request_hash),
            time(c.now),
        ];
        if execute(tx, "store the answer under its idempotency key", &STORE_ANSWER, &args).await? == 0 {
            return Err(StoreError::Conflict("the idempotency key holds another answer".into()));
        }
    }
    // A run's end looks, in the same transaction, for runs waiting behind it (one probe of an
    // index that holds only waiting runs), so the engine starts the next one without a read of
    // its own, and does nothing when none waits — the common case.
    let waiting_behind = match &c.run {
        Some(change) if change.to.is_terminal() => {
            let found =
                row(tx, "look for waiting runs", &WAITING_BEHIND, &[text(run.conversation_id.as_str())], &[Ty::Bool])
                    .await?;
            matches!(found.as_deref(), Some([Cell::Bool(true)]))
        }
        _ => false,
    };
    let events = if run.events_written {
        numbered(&c.run_id, run.first_sequence, &c.events, now)
    } else {
        tx.insert_events(&c.run_id, run.first_sequence, &c.events, now).await?
    };
    Ok(Committed { events, cancel_requested: run.cancel_requested, waiting_behind })
}

static WAITING_BEHIND: Sql =
    Sql::new("SELECT EXISTS (SELECT 1 FROM runs WHERE conversation_id = $1 AND status = 'waiting')");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_statement_reads_the_same_in_both_dialects_but_for_its_placeholders() {
        static S: Sql = Sql::new("UPDATE t SET a = $1 WHERE b = $2 AND c = $1");
        assert_eq!(S.text(Dialect::Postgres), "UPDATE t SET a = $1 WHERE b = $2 AND c = $1");
        assert_eq!(S.text(Dialect::Sqlite), "UPDATE t SET a = ?1 WHERE b = ?2 AND c = ?1");
    }

    #[test]
    fn no_status_matches_an_empty_list() {
        assert_eq!(status_is_one_of(&[]), "FALSE");
        assert_eq!(
            status_is_one_of(&[RunStatus::Queued, RunStatus::Running]),
            "(status = 'queued' OR status = 'running')"
        );
    }

    #[test]
    fn a_fence_shape_is_made_once_per_dialect() {
        let lease = Fence::Lease { owner: "w".into(), lease_until: chrono::Utc::now() };
        let a = fence_sql(Dialect::Sqlite, &lease, Some(RunStatus::Completed), false);
        assert!(std::ptr::eq(a, fence_sql(Dialect::Sqlite, &lease, Some(RunStatus::Completed), false)));
        assert!(!a.contains('$') && a.contains("lease_owner = ?9") && !a.contains("RETURNING"), "{a}");
        let pg = fence_sql(Dialect::Postgres, &lease, Some(RunStatus::Completed), false);
        assert!(pg.contains("lease_owner = $9") && pg.ends_with("cancel_requested"), "{pg}");
        assert_ne!(a, fence_sql(Dialect::Sqlite, &lease, None, false));
        let from_queued = Fence::Unowned { from: vec![RunStatus::Queued] };
        let from_both = Fence::Unowned { from: vec![RunStatus::Queued, RunStatus::Interrupted] };
        let one = fence_sql(Dialect::Sqlite, &from_queued, Some(RunStatus::Cancelled), false);
        let two = fence_sql(Dialect::Sqlite, &from_both, Some(RunStatus::Cancelled), false);
        assert!(!one.contains("'interrupted' AND") && two.contains("status = 'interrupted')"), "{one}\n{two}");
        // with the events, on PostgreSQL: their arrays follow the fence's parameters, for each kind
        for (fence, last) in [(&lease, 9), (&from_queued, 7)] {
            let with = fence_sql(Dialect::Postgres, fence, Some(RunStatus::Cancelled), true);
            assert_ne!(with, fence_sql(Dialect::Postgres, fence, Some(RunStatus::Cancelled), false));
            let arrays = format!("unnest(${}::text[], ${}::text[])", last + 1, last + 2);
            assert!(with.starts_with("WITH f AS (UPDATE runs") && with.contains(&arrays), "{with}");
            assert_eq!(fence_params(fence), last);
        }
    }

    #[test]
    fn a_future_that_waits_is_an_error_not_a_hang() {
        let pending = std::future::pending::<StoreResult<()>>();
        assert!(matches!(ready(pending), Err(StoreError::Backend(_))));
        assert_eq!(ready(async { Ok(7) }).unwrap(), 7);
    }
}
