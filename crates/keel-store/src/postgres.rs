//! The Postgres backend.
//!
//! The same semantics as the SQLite backend, with no reliance on SERIALIZABLE: every transaction
//! runs at READ COMMITTED, and every check that guards a write is part of a conditional statement
//! (`UPDATE … WHERE <condition> RETURNING`), so a concurrent writer either waits for the row lock and
//! then sees the row as it is now, or matches nothing. Where SQLite's single writer serialises a
//! read-then-write, this backend locks the rows first (the conversation row for a new run) or folds
//! the read into the write (idempotency keys).
//!
//! Timestamps are `timestamptz`, which keeps microseconds: times are truncated to the microsecond on
//! the way in, and the values the store returns are truncated the same way, so a returned record
//! equals the record read back.

use std::str::FromStr;
use std::sync::LazyLock;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use keel_core::domain::{
    lease_holder, ApiKey, Conversation, Fact, FactSource, Interrupt, InterruptKind, InterruptStatus, Message, Role,
    Run, RunStatus, StreamTicket, Summary, TicketScope, Timestamp, ToolCall, ToolCallState, User, UserRole,
};
use keel_core::event::{Event, EventKind};
use keel_core::ids::{ConversationId, InterruptId, InvalidId, MessageId, RunId};
use keel_core::mask::Masked;
use keel_core::store::{
    AnswerView, BindingStore, Commit, Committed, ContextWindow, ConversationStore, DueWork, IdempotencyBegin,
    IdentityStore, MessagesThrough, NewLease, NewRun, PruneRule, Pruned, RolledBack, RunStore, StartedRun, Store,
    StoreError, StoreResult,
};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;
use sqlx::migrate::Migrator;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgRow};
use sqlx::{Connection, Executor, PgConnection, PgPool, Postgres, Row, Transaction};

mod commit;
mod group;
mod kept;
mod lifecycle;

use self::commit::PgTx;
use crate::pipeline::{self, static_sql};

pub use group::CommitStats;

static MIGRATOR: Migrator = sqlx::migrate!("./migrations/postgres");

/// Checksums a migration had before an edit that left what it does to an existing database alone:
/// (version, SHA-384 in hex). 0001 lost the demo's tables when the demo moved out of Keel's schema — a
/// database it made before still has them, and 0006 drops them.
const EARLIER_CHECKSUMS: &[(i64, &str)] =
    &[(1, "a47af493a73e34b5997330377134d296c5d86319b51456f174cf3492b91a696ac578243185d724b5c095899b2fca52e6")];

/// The connections of everything but the committers, which have [`PostgresOptions::committers`] more
/// of their own, and the hot statements, which have [`kept::KEEP`] more.
const MAX_CONNECTIONS: u32 = 8;
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(10);
/// The statuses of a run that holds its conversation (`RunStatus::is_active`).
const ACTIVE: &str = "('queued', 'running', 'interrupted')";
// The periodic sweeps' conditions, each shared by its sweep's read and by [`RunStore::due_work`],
// which probes all four in one statement.
const DUE_INTERRUPTS: &str = "status = 'pending' AND expires_at <= $1";
const ROLLBACKS_DUE: &str = "roll_back_requested AND status IN ('completed', 'failed', 'cancelled')";
/// A waiting run (`w`) whose conversation has no active run.
static STRANDED: LazyLock<String> = LazyLock::new(|| {
    format!("w.status = 'waiting' AND NOT EXISTS (SELECT 1 FROM runs a WHERE a.conversation_id = w.conversation_id AND a.status IN {ACTIVE})")
});
/// A run that needs a worker, with the placeholders of the instant and of whether live leases are
/// taken too.
fn claimable(now: &str, steal: &str) -> String {
    format!(
        "status IN ('queued', 'running') AND (lease_owner IS NULL \
         OR lease_expires_at IS NULL OR lease_expires_at <= {now} OR {steal})"
    )
}
/// The partial unique index that keeps one active run per conversation.
const ONE_ACTIVE_RUN: &str = "runs_one_active_per_conversation";
/// How often `start_run` starts over when it lost a race to the unique index and the winner is
/// already gone again.
const START_ATTEMPTS: usize = 3;
/// How often `idempotency_begin` looks again when the key it collided with vanished meanwhile.
const IDEMPOTENCY_ATTEMPTS: usize = 3;

/// How the Postgres store groups its commits (see [`PostgresStore::commit_stats`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PostgresOptions {
    /// How many commits may wait for a committer; past it a commit is refused at once with
    /// [`StoreError::Overloaded`] (a `503` with `Retry-After`) instead of queueing without bound.
    /// Default [`PostgresOptions::COMMIT_QUEUE`].
    pub commit_queue: usize,
    /// How many groups of commits may be in flight at once, each a transaction on a connection of
    /// its own. Default [`PostgresOptions::COMMITTERS`].
    pub committers: usize,
    /// The longest a committer keeps the other committers from the queue while its group's
    /// statements run (it lets them go on once only its `COMMIT` is left, or after this). Default
    /// [`PostgresOptions::HOLD_QUEUE_AT_MOST`].
    pub hold_queue_at_most: std::time::Duration,
}

impl PostgresOptions {
    /// A run's worker waits for each answer before it commits again, so the queue holds about one
    /// commit per busy worker or request: as for SQLite's writer, a few thousand.
    pub const COMMIT_QUEUE: usize = 4096;
    /// Two. Each group in flight costs its round trips whatever its size, so fewer committers make
    /// bigger groups and less work per commit once the machine is busy; more let a commit wait less
    /// for a free committer while it is not. Measured (`docs/benchmarks.md`, "Ninth session"): at
    /// concurrency 32, one committer wrote 19% more runs a second than four, two 14% more; at
    /// concurrency 8, one wrote 5% fewer than four, two as many.
    pub const COMMITTERS: usize = 2;
    /// A group's statements take a few milliseconds; one that waits for a run row another
    /// transaction holds (another instance's group, an operator's session) stops the others no
    /// longer than this.
    pub const HOLD_QUEUE_AT_MOST: std::time::Duration = std::time::Duration::from_millis(20);
}

impl Default for PostgresOptions {
    fn default() -> Self {
        Self {
            commit_queue: Self::COMMIT_QUEUE,
            committers: Self::COMMITTERS,
            hold_queue_at_most: Self::HOLD_QUEUE_AT_MOST,
        }
    }
}

/// The Postgres store. Cloning shares the pool and the committers.
#[derive(Debug, Clone)]
pub struct PostgresStore {
    pool: PgPool,
    /// The dedicated schema of [`PostgresStore::connect_with_schema`], if any.
    schema: Option<String>,
    committer: std::sync::Arc<group::Committer>,
    /// The connections the hot statements use again untested ([`kept`]).
    kept: std::sync::Arc<kept::Kept>,
}

impl PostgresStore {
    /// A pooled connection idle this long is tested (a round trip) before it is used again; one
    /// used more recently is handed out as it is ([`pool_options`]).
    pub const TEST_IDLE_AFTER: Duration = Duration::from_secs(1);

    /// Connects to `postgres://…` and migrates the database (in the connection's default schema,
    /// as its `search_path` says).
    pub async fn connect(url: &str) -> StoreResult<Self> {
        Self::connect_with(url, PostgresOptions::default()).await
    }

    /// [`PostgresStore::connect`] with options.
    pub async fn connect_with(url: &str, options: PostgresOptions) -> StoreResult<Self> {
        let connect = url_options(url)?;
        probe(&connect).await?;
        let pool = pool_options().connect_with(connect).await.map_err(db("connect to the database"))?;
        let store = Self::new(pool, None, &options);
        store.migrate().await?;
        Ok(store)
    }

    fn new(pool: PgPool, schema: Option<String>, options: &PostgresOptions) -> Self {
        let committer =
            group::Committer::start(pool.clone(), options.committers, options.commit_queue, options.hold_queue_at_most);
        let kept = std::sync::Arc::new(kept::Kept::new(kept::by_key(&pool, kept::KEEP)));
        Self { pool, schema, committer: std::sync::Arc::new(committer), kept }
    }

    /// Connects to `postgres://…`, creates `schema` if it does not exist, makes it every
    /// connection's `search_path` and migrates it: the store's tables live in that schema only.
    /// `schema` is a plain identifier (letters, digits and `_`, not starting with a digit or `pg_`).
    pub async fn connect_with_schema(url: &str, schema: &str) -> StoreResult<Self> {
        Self::connect_with_schema_and(url, schema, PostgresOptions::default()).await
    }

    /// [`PostgresStore::connect_with_schema`] with options.
    pub async fn connect_with_schema_and(url: &str, schema: &str, options: PostgresOptions) -> StoreResult<Self> {
        let quoted = quote_schema(schema)?;
        let connect = url_options(url)?;
        probe(&connect).await?;
        let set_path = format!("SET search_path TO {quoted}");
        let pool = pool_options()
            .after_connect(move |conn, _meta| {
                let set_path = set_path.clone();
                Box::pin(async move {
                    conn.execute(set_path.as_str()).await?;
                    Ok(())
                })
            })
            .connect_with(connect)
            .await
            .map_err(db("connect to the database"))?;
        sqlx::query(&format!("CREATE SCHEMA IF NOT EXISTS {quoted}"))
            .execute(&pool)
            .await
            .map_err(db("create the schema"))?;
        let store = Self::new(pool, Some(schema.to_owned()), &options);
        store.migrate().await?;
        Ok(store)
    }

    /// Creates or upgrades the schema at `url`, then closes the pool (`keel migrate`).
    pub async fn migrate_only(url: &str) -> StoreResult<()> {
        Self::connect(url).await?.close().await;
        Ok(())
    }

    /// Drops the dedicated schema of [`PostgresStore::connect_with_schema`] with everything in it,
    /// then closes the pool. An error for a store connected without one: it never drops a schema it
    /// did not create for itself.
    pub async fn drop_schema(&self) -> StoreResult<()> {
        let Some(schema) = &self.schema else {
            return Err(StoreError::Backend("drop the schema: the store has no dedicated schema".into()));
        };
        let quoted = quote_schema(schema)?;
        sqlx::query(&format!("DROP SCHEMA IF EXISTS {quoted} CASCADE"))
            .execute(&self.pool)
            .await
            .map_err(db("drop the schema"))?;
        self.close().await;
        Ok(())
    }

    /// The pool, for a program that keeps tables of its own in Keel's database (the demo does).
    /// Its connections work in the store's schema.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Runs `f` on one of the connections the store uses again without sqlx's test on release (a
    /// round trip saved per use, [`kept`]): for a program's own frequent statements that find
    /// rows by key in Keel's database (the demo keeps its tables there). `f` must not leave a
    /// transaction open. After a statement that ended otherwise than with the database's answer
    /// (an I/O error, a caller that stopped waiting), the connection goes back to its pool, which
    /// tests it. These connections keep each statement's first plan and read indexes rather than
    /// whole tables ([`kept`]): a statement that must read a table whole belongs on [`Self::pool`].
    pub async fn run_kept<T>(
        &self,
        f: impl AsyncFnOnce(&mut PgConnection) -> Result<T, sqlx::Error>,
    ) -> Result<T, sqlx::Error> {
        self.kept.run(f).await
    }

    /// The dedicated schema, if the store was connected with one.
    pub fn schema(&self) -> Option<&str> {
        self.schema.as_deref()
    }

    /// The context window, and the role of `user_id` when given, in one statement (one snapshot,
    /// one round trip, one of the database's statement overheads instead of five): see
    /// [`context_window_sql`].
    async fn read_context(
        &self,
        conversation_id: &ConversationId,
        user_id: Option<&str>,
    ) -> StoreResult<(ContextWindow, Option<UserRole>)> {
        let rows = self
            .kept
            .run(async |conn| {
                let query = sqlx::query(context_window_sql(user_id.is_some())).bind(conversation_id.as_str());
                match user_id {
                    Some(user_id) => query.bind(user_id).fetch_all(conn).await,
                    None => query.fetch_all(conn).await,
                }
            })
            .await
            .map_err(db("read the context window"))?;
        let mut window =
            ContextWindow { summary: None, messages: Vec::new(), tool_calls: Vec::new(), facts: Vec::new() };
        let mut role = None;
        for row in &rows {
            match Cols::new(row, "context window").get::<i32>("k")? {
                0 => window.summary = Some(summary_from(row)?),
                1 => window.messages.push(message_from(row)?),
                2 => window.tool_calls.push(tool_call_from(row)?),
                3 => window.facts.push(fact_from(row)?),
                _ => role = Some(Cols::new(row, "users").parse("role", UserRole::parse)?),
            }
        }
        Ok((window, role))
    }

    /// Writes the commits queued before this call, then closes every connection; waits for the
    /// ones in use. Later commits are errors.
    pub async fn close(&self) {
        self.committer.close().await;
        self.kept.close().await;
        self.pool.close().await;
    }

    /// How many commits were answered, in how many group transactions.
    pub fn commit_stats(&self) -> CommitStats {
        self.committer.stats()
    }

    /// Commits waiting for a committer (not those in a group being written).
    pub fn queued_commits(&self) -> usize {
        self.committer.queued()
    }

    async fn migrate(&self) -> StoreResult<()> {
        let fail = |e: sqlx::Error| StoreError::Backend(format!("migrate the database: {e}"));
        // A migration edited without changing what it does to a database it already migrated (see
        // EARLIER_CHECKSUMS) has its recorded checksum brought up to date first.
        let recorded: Option<String> = sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations')::text")
            .fetch_one(&self.pool)
            .await
            .map_err(fail)?;
        if recorded.is_some() {
            let newest: Option<i64> = sqlx::query_scalar("SELECT max(version) FROM _sqlx_migrations")
                .fetch_one(&self.pool)
                .await
                .map_err(fail)?;
            let known = MIGRATOR.iter().map(|m| m.version).max().unwrap_or(0);
            if let Some(version) = newest.filter(|v| *v > known) {
                return Err(StoreError::Backend(format!(
                    "migrate the database: it was migrated to version {version} by a newer Keel, which this one does not know"
                )));
            }
            for (version, earlier) in EARLIER_CHECKSUMS {
                let Some(now) = MIGRATOR.iter().find(|m| m.version == *version) else { continue };
                sqlx::query(
                    "UPDATE _sqlx_migrations SET checksum = $1 WHERE version = $2 AND encode(checksum, 'hex') = $3",
                )
                .bind(now.checksum.as_ref())
                .bind(version)
                .bind(earlier)
                .execute(&self.pool)
                .await
                .map_err(fail)?;
            }
        }
        MIGRATOR.run(&self.pool).await.map_err(|e| StoreError::Backend(format!("migrate the database: {e}")))
    }

    async fn begin(&self) -> StoreResult<Transaction<'static, Postgres>> {
        // READ COMMITTED, the server's default: correctness comes from conditional statements.
        self.pool.begin().await.map_err(db("begin a transaction"))
    }
}

/// The pools' connections: up to [`MAX_CONNECTIONS`], each tested before it is handed out only
/// when it sat idle for [`PostgresStore::TEST_IDLE_AFTER`] or longer.
///
/// sqlx tests every connection before it hands it out (`test_before_acquire`, on by default): a
/// round trip to the database, and a wait for it, before each statement the pool runs. Under load
/// that was a third of a run's round trips and 12–18% of its throughput (docs/benchmarks.md,
/// "Eleventh session"). A connection in steady use has just answered; one that sat idle may have
/// been ended meanwhile (the database restarted, a proxy or a firewall dropped it), and a test
/// finds that out and opens another instead, so the caller never sees it. A connection in use
/// when the database goes away fails the statement it runs, as it would with the test, and is
/// closed (sqlx tests each connection as it comes back, and drops one that fails).
fn pool_options() -> PgPoolOptions {
    PgPoolOptions::new()
        .max_connections(MAX_CONNECTIONS)
        .acquire_timeout(ACQUIRE_TIMEOUT)
        .test_before_acquire(false)
        .before_acquire(|conn, meta| {
            Box::pin(async move {
                if meta.idle_for >= PostgresStore::TEST_IDLE_AFTER {
                    conn.ping().await?;
                }
                Ok(true)
            })
        })
}

/// What a key's row holds for the request `request_hash`.
fn stored_key(row: &PgRow, request_hash: &str) -> StoreResult<IdempotencyBegin> {
    let c = Cols::new(row, "idempotency_keys");
    pipeline::stored_key(request_hash, c.get("request_hash")?, c.get("state")?, || {
        Ok((c.get("status")?, c.json("response")?))
    })
}

/// One connection, at once: an unreachable database is an error with its reason (the pool would
/// retry until its timeout and then say only that it timed out).
async fn probe(options: &PgConnectOptions) -> StoreResult<()> {
    let conn = PgConnection::connect_with(options).await.map_err(db("connect to the database"))?;
    conn.close().await.map_err(db("connect to the database"))
}

fn url_options(url: &str) -> StoreResult<PgConnectOptions> {
    // the url is not quoted: it may carry a password
    let invalid = || StoreError::Backend("the database url is not a valid postgres: url".into());
    if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
        return Err(invalid());
    }
    PgConnectOptions::from_str(url).map_err(|_| invalid())
}

/// The schema name as a quoted identifier, after checking it is a plain one.
fn quote_schema(schema: &str) -> StoreResult<String> {
    let plain = !schema.is_empty()
        && schema.len() <= 63
        && schema.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
        && !schema.as_bytes()[0].is_ascii_digit()
        && !schema.to_ascii_lowercase().starts_with("pg_");
    if !plain {
        return Err(StoreError::Backend(
            "the schema name must be letters, digits and `_` (at most 63, not starting with a digit or pg_)".into(),
        ));
    }
    Ok(format!("\"{schema}\""))
}

// --- errors and encodings

/// Maps a driver error to `Backend`, naming the operation. Only the server's primary message is
/// kept (never its detail, which quotes the row), so no value written leaks into the error.
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

/// `timestamptz` keeps microseconds: the time as the database stores it (the driver truncates).
fn micros(t: Timestamp) -> Timestamp {
    t - chrono::Duration::nanoseconds(i64::from(t.timestamp_subsec_nanos() % 1_000))
}

fn json<T: Serialize + ?Sized>(what: &'static str, value: &T) -> StoreResult<Value> {
    serde_json::to_value(value).map_err(|e| StoreError::Backend(format!("encode {what}: {e}")))
}

/// What went wrong with a stored JSON value, without quoting it: serde's messages can carry the
/// offending text, which may be anything a tool returned.
fn json_error(e: &serde_json::Error) -> String {
    let kind = match e.classify() {
        serde_json::error::Category::Io => "unreadable",
        serde_json::error::Category::Syntax | serde_json::error::Category::Eof => "not valid JSON",
        serde_json::error::Category::Data => "not the expected shape",
    };
    kind.to_owned()
}

/// Reads the columns of one row, turning anything unreadable into `Backend` instead of a panic.
struct Cols<'r> {
    row: &'r PgRow,
    table: &'static str,
}

impl<'r> Cols<'r> {
    fn new(row: &'r PgRow, table: &'static str) -> Self {
        Self { row, table }
    }

    fn bad(&self, col: &str, why: impl std::fmt::Display) -> StoreError {
        StoreError::Backend(format!("unreadable {}.{col}: {why}", self.table))
    }

    fn get<T>(&self, col: &str) -> StoreResult<T>
    where
        T: sqlx::Decode<'r, Postgres> + sqlx::Type<Postgres>,
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
        self.get::<DateTime<Utc>>(col)
    }

    fn opt_ts(&self, col: &str) -> StoreResult<Option<Timestamp>> {
        self.get::<Option<DateTime<Utc>>>(col)
    }

    fn json<T: DeserializeOwned>(&self, col: &str) -> StoreResult<T> {
        let v: Value = self.get(col)?;
        serde_json::from_value(v).map_err(|e| self.bad(col, json_error(&e)))
    }

    /// Text written through the masking gate ([`Masked`]).
    fn masked(&self, col: &str) -> StoreResult<Masked<String>> {
        self.get(col).map(Masked::from_store)
    }

    fn opt_masked(&self, col: &str) -> StoreResult<Option<Masked<String>>> {
        Ok(self.get::<Option<String>>(col)?.map(Masked::from_store))
    }

    /// JSON written through the masking gate ([`Masked`]).
    fn masked_json(&self, col: &str) -> StoreResult<Masked<Value>> {
        self.get::<Value>(col).map(Masked::from_store)
    }

    fn opt_masked_json(&self, col: &str) -> StoreResult<Option<Masked<Value>>> {
        Ok(self.get::<Option<Value>>(col)?.map(Masked::from_store))
    }
}

fn conversation_from(row: &PgRow) -> StoreResult<Conversation> {
    let c = Cols::new(row, "conversations");
    Ok(Conversation {
        id: c.id("id")?,
        user_id: c.get("user_id")?,
        title: c.masked("title")?,
        agent_id: c.get("agent_id")?,
        version: c.get("version")?,
        created_at: c.ts("created_at")?,
    })
}

fn user_from(row: &PgRow) -> StoreResult<User> {
    let c = Cols::new(row, "users");
    let active_keys: i64 = c.get("active_keys")?;
    Ok(User { id: c.get("id")?, role: c.parse("role", UserRole::parse)?, active_keys: active_keys as u64 })
}

fn stream_ticket_from(row: &PgRow) -> StoreResult<StreamTicket> {
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

fn message_from(row: &PgRow) -> StoreResult<Message> {
    let c = Cols::new(row, "messages");
    Ok(Message {
        id: c.id("id")?,
        conversation_id: c.id("conversation_id")?,
        run_id: c.opt_id("run_id")?,
        role: c.parse("role", Role::parse)?,
        content: c.masked("content")?,
        tool_call_id: c.opt_id("tool_call_id")?,
        created_at: c.ts("created_at")?,
    })
}

fn fact_from(row: &PgRow) -> StoreResult<Fact> {
    let c = Cols::new(row, "facts");
    Ok(Fact {
        key: c.get("key")?,
        value: c.masked("value")?,
        source: c.parse("source", FactSource::parse)?,
        updated_at: c.ts("updated_at")?,
    })
}

fn summary_from(row: &PgRow) -> StoreResult<Summary> {
    let c = Cols::new(row, "summaries");
    Ok(Summary {
        conversation_id: c.id("conversation_id")?,
        through_message_id: c.id("through_message_id")?,
        text: c.masked("text")?,
    })
}

fn run_from(row: &PgRow) -> StoreResult<Run> {
    let c = Cols::new(row, "runs");
    Ok(Run {
        id: c.id("id")?,
        conversation_id: c.id("conversation_id")?,
        user_message_id: c.id("user_message_id")?,
        user_id: c.get("user_id")?,
        agent_id: c.get("agent_id")?,
        status: c.parse("status", RunStatus::parse)?,
        reason: c.get("reason")?,
        cancel_on_disconnect: c.get("cancel_on_disconnect")?,
        cancel_requested: c.get("cancel_requested")?,
        next_sequence: c.get("next_sequence")?,
        lease_owner: c.get("lease_owner")?,
        lease_expires_at: c.opt_ts("lease_expires_at")?,
        worker: c.get("worker")?,
        checkpoint: c.json("checkpoint")?,
        created_at: c.ts("created_at")?,
        updated_at: c.ts("updated_at")?,
        hidden_at: c.opt_ts("hidden_at")?,
    })
}

fn event_from(run_id: &RunId, row: &PgRow) -> StoreResult<Event> {
    let c = Cols::new(row, "run_events");
    let type_name: String = c.get("type")?;
    let data: Value = c.json("data")?;
    let kind = EventKind::from_parts(&type_name, &data).map_err(|e| c.bad("data", json_error(&e)))?;
    Ok(Event::new(kind, run_id.clone(), c.get("sequence")?, c.ts("created_at")?))
}

fn interrupt_from(row: &PgRow) -> StoreResult<Interrupt> {
    let c = Cols::new(row, "interrupts");
    Ok(Interrupt {
        id: c.id("id")?,
        run_id: c.id("run_id")?,
        kind: c.parse("kind", InterruptKind::parse)?,
        status: c.parse("status", InterruptStatus::parse)?,
        payload: c.masked_json("payload")?,
        call_ids: c.json("call_ids")?,
        created_at: c.ts("created_at")?,
        expires_at: c.ts("expires_at")?,
        decision: c.opt_masked_json("decision")?,
        note: c.opt_masked("note")?,
        resolved_by: c.get("resolved_by")?,
        resolved_at: c.opt_ts("resolved_at")?,
    })
}

fn tool_call_from(row: &PgRow) -> StoreResult<ToolCall> {
    let c = Cols::new(row, "tool_calls");
    Ok(ToolCall {
        id: c.id("id")?,
        run_id: c.id("run_id")?,
        name: c.get("name")?,
        args: c.masked_json("args")?,
        state: c.parse("state", ToolCallState::parse)?,
        result: c.opt_masked_json("result")?,
        summary: c.opt_masked("summary")?,
        attempts: c.get::<i32>("attempts").map(|n| n.max(0) as u32)?,
        started_at: c.opt_ts("started_at")?,
        finished_at: c.opt_ts("finished_at")?,
    })
}

/// A column a row reader takes, with its type.
type Column = (&'static str, &'static str);

/// One statement over the rows of several tables: a `UNION ALL` of `parts` — `(k, table, the columns
/// its reader takes, condition)` — each of which yields `k` and every column any part takes: its
/// own, and NULL of that type for the others. The rows of each table are then read by that
/// table's row reader, by name, as it reads the table's own rows. (Statements sent at once cost
/// the database its per-statement work each, on as many connections.)
fn union_sql(parts: &[(u8, &str, &[Column], &str)], nulls: &[Column], order: &str) -> String {
    // `nulls`: columns a reader takes that no part reads (NULL in every row)
    let mut columns: Vec<Column> = nulls.to_vec();
    for (_, _, has, _) in parts {
        for column in *has {
            match columns.iter().find(|(name, _)| *name == column.0) {
                Some(known) => debug_assert_eq!(known, column, "one column name, one type"),
                None => columns.push(*column),
            }
        }
    }
    let parts: Vec<String> = parts
        .iter()
        .map(|(k, from, has, filter)| {
            let columns: Vec<String> = columns
                .iter()
                .map(|(name, ty)| {
                    if has.iter().any(|(own, _)| own == name) {
                        format!("t.{name}")
                    } else {
                        format!("NULL::{ty} AS {name}")
                    }
                })
                .collect();
            format!("SELECT {k} AS k, {} FROM {from} t WHERE {filter}", columns.join(", "))
        })
        .collect();
    format!("{} ORDER BY {order}", parts.join(" UNION ALL "))
}

/// The columns [`tool_call_from`] takes, but the result (NULL in the rows of the context and of an
/// answer's view, which use none: a result can be large, and is in its tool message already).
const TOOL_CALL_COLUMNS_BUT_RESULT: [Column; 10] = [
    ("seq", "bigint"),
    ("id", "text"),
    ("run_id", "text"),
    ("name", "text"),
    ("args", "jsonb"),
    ("state", "text"),
    ("summary", "text"),
    ("attempts", "integer"),
    ("started_at", "timestamptz"),
    ("finished_at", "timestamptz"),
];

/// The context window's one statement: the conversation's summary (`k` 0), the messages after the
/// last one it covers, by the index on (conversation_id, seq) (`k` 1), the calls their tool results
/// answer, by id (`k` 2), and the facts (`k` 3), in that order ([`union_sql`]; a step reads its
/// context at every model call); with `role`, the role of the user `$2` too (`k` 4,
/// [`Store::context_window_and_role`]).
fn context_window_sql(role: bool) -> &'static str {
    static SQL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    static WITH_ROLE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    (if role { &WITH_ROLE } else { &SQL }).get_or_init(|| {
        const AFTER: &str = "COALESCE((SELECT m.seq FROM summaries s JOIN messages m ON m.id = s.through_message_id \
                             WHERE s.conversation_id = $1), 0)";
        let messages = format!("t.conversation_id = $1 AND t.seq > {AFTER}");
        let calls = format!(
            "t.id IN (SELECT tool_call_id FROM messages WHERE conversation_id = $1 AND seq > {AFTER} \
             AND tool_call_id IS NOT NULL)"
        );
        let summary: &[Column] = &[("conversation_id", "text"), ("through_message_id", "text"), ("text", "text")];
        let message: &[Column] = &[
            ("seq", "bigint"),
            ("id", "text"),
            ("conversation_id", "text"),
            ("run_id", "text"),
            ("role", "text"),
            ("content", "text"),
            ("tool_call_id", "text"),
            ("created_at", "timestamptz"),
        ];
        let mut parts: Vec<(u8, &str, &[Column], &str)> = vec![
            (0, "summaries", summary, "t.conversation_id = $1"),
            (1, "messages", message, &messages),
            (2, "tool_calls", &TOOL_CALL_COLUMNS_BUT_RESULT, &calls),
            (3, "facts", FACT_COLUMNS, "t.conversation_id = $1"),
        ];
        if role {
            parts.push((4, "users", &[("role", "text")], "t.id = $2"));
        }
        union_sql(&parts, &[("result", "jsonb")], "k, seq, key")
    })
}

/// The columns [`fact_from`] takes.
const FACT_COLUMNS: &[Column] =
    &[("key", "text"), ("value", "text"), ("source", "text"), ("updated_at", "timestamptz")];

/// [`RunStore::answer_view`]'s one statement: the run (`k` 0), its interrupts, oldest first (`k` 1),
/// its tool calls, in order (`k` 2), the role of the user (`k` 3) and the facts of the run's
/// conversation (`k` 4) ([`union_sql`]).
fn answer_view_sql() -> &'static str {
    static SQL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    SQL.get_or_init(|| {
        let run: &[Column] = &[
            ("id", "text"),
            ("conversation_id", "text"),
            ("user_message_id", "text"),
            ("user_id", "text"),
            ("agent_id", "text"),
            ("status", "text"),
            ("reason", "text"),
            ("cancel_on_disconnect", "boolean"),
            ("cancel_requested", "boolean"),
            ("next_sequence", "bigint"),
            ("lease_owner", "text"),
            ("lease_expires_at", "timestamptz"),
            ("worker", "text"),
            ("checkpoint", "jsonb"),
            ("created_at", "timestamptz"),
            ("updated_at", "timestamptz"),
            ("hidden_at", "timestamptz"),
        ];
        let interrupt: &[Column] = &[
            ("id", "text"),
            ("run_id", "text"),
            ("kind", "text"),
            ("status", "text"),
            ("payload", "jsonb"),
            ("call_ids", "jsonb"),
            ("created_at", "timestamptz"),
            ("expires_at", "timestamptz"),
            ("decision", "jsonb"),
            ("note", "text"),
            ("resolved_by", "text"),
            ("resolved_at", "timestamptz"),
        ];
        union_sql(
            &[
                (0, "runs", run, "t.id = $1"),
                (1, "interrupts", interrupt, "t.run_id = $1"),
                (2, "tool_calls", &TOOL_CALL_COLUMNS_BUT_RESULT, "t.run_id = $1"),
                (3, "users", &[("role", "text")], "t.id = $2"),
                (4, "facts", FACT_COLUMNS, "t.conversation_id = (SELECT conversation_id FROM runs WHERE id = $1)"),
            ],
            &[("result", "jsonb")],
            "k, seq, created_at, id, key",
        )
    })
}

fn all<T>(rows: &[PgRow], from: fn(&PgRow) -> StoreResult<T>) -> StoreResult<Vec<T>> {
    rows.iter().map(from).collect()
}

/// Whether a store operation on a kept connection ended with the database's answer — its rows, or
/// a refusal it reported (a conflict, a duplicate, a missing row) — and so left the connection in
/// sync ([`kept::Kept::run_judged`]); a `Backend` error may be the connection's own.
fn answered<T>(out: &StoreResult<T>) -> bool {
    !matches!(out, Err(StoreError::Backend(_)))
}

/// One commit in a transaction of its own: the answer a commit refused inside a group gets, and the
/// one the others of that group get when they are written again without it ([`group`]).
///
/// A commit that is its fence's one statement ([`group::fence_alone`]: the conditional `UPDATE` of
/// the run with its events in the same statement) is sent without `BEGIN` and `COMMIT`: a statement
/// outside a transaction block is a transaction of its own, all of it or nothing, so one round trip
/// does what three did. (When the fence matches nothing, the read that says why writes nothing.)
async fn commit_alone(kept: &kept::Kept, commit: &Commit) -> StoreResult<Committed> {
    // READ COMMITTED, the server's default: correctness comes from conditional statements.
    kept.run_judged(
        async |conn| {
            if group::fence_alone(commit) {
                return pipeline::apply_commit(&mut PgTx(conn), commit).await;
            }
            let mut tx = conn.begin().await.map_err(db("begin a transaction"))?;
            match pipeline::apply_commit(&mut PgTx(&mut tx), commit).await {
                Ok(committed) => {
                    tx.commit().await.map_err(db("commit"))?;
                    Ok(committed)
                }
                Err(refused) => {
                    // at once: the run row stays locked until the rollback is sent
                    tx.rollback().await.map_err(db("roll back"))?;
                    Err(refused)
                }
            }
        },
        answered,
        db("begin a transaction"),
    )
    .await
}

#[async_trait]
impl RunStore for PostgresStore {
    async fn start_run(&self, new: NewRun) -> StoreResult<StartedRun> {
        if new.enqueue.is_none() {
            let at_once = self
                .kept
                .run_judged(
                    async |conn| commit::start_at_once(conn, &new, RunId::new(), MessageId::new()).await,
                    answered,
                    db("start a run"),
                )
                .await;
            match at_once? {
                commit::AtOnce::Started(started) => return Ok(*started),
                commit::AtOnce::Blocked(active) => return Err(StoreError::RunActive(active)),
                // something changed the conversation meanwhile: the locking way
                commit::AtOnce::Raced => {}
            }
        }
        for _ in 0..START_ATTEMPTS {
            let mut tx = self.begin().await?;
            // On an error the transaction is dropped, which rolls it back.
            let (run_id, message_id) = (RunId::new(), MessageId::new());
            if let Some(started) =
                pipeline::start_run(&mut PgTx(&mut tx), &new, run_id, message_id, ONE_ACTIVE_RUN).await?
            {
                tx.commit().await.map_err(db("start a run"))?;
                return Ok(started);
            }
            // Another run became active between the check and the insert (the unique index saw
            // it): the transaction is aborted; the winner, read afresh, is the answer (an enqueued
            // message starts again, and waits behind it).
            tx.rollback().await.map_err(db("start a run"))?;
            let mut conn = self.pool.acquire().await.map_err(db("start a run"))?;
            if let Some(active) = pipeline::active_run_id(&mut PgTx(&mut conn), &new.conversation_id).await? {
                if new.enqueue.is_none() {
                    return Err(StoreError::RunActive(active));
                }
            }
            // ... unless it is over already: start again.
        }
        Err(StoreError::Backend("start a run: the conversation's active run kept changing".into()))
    }

    async fn get_run(&self, id: &RunId) -> StoreResult<Option<Run>> {
        let row = self
            .kept
            .run(async |conn| {
                sqlx::query("SELECT * FROM runs WHERE id = $1").bind(id.as_str()).fetch_optional(conn).await
            })
            .await
            .map_err(db("get a run"))?;
        row.as_ref().map(run_from).transpose()
    }

    async fn last_sequences(&self, ids: &[RunId]) -> StoreResult<Vec<(RunId, i64)>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<&str> = ids.iter().map(RunId::as_str).collect();
        let rows = sqlx::query("SELECT id, next_sequence FROM runs WHERE id = ANY($1)")
            .bind(&ids)
            .fetch_all(&self.pool)
            .await
            .map_err(db("read last sequences"))?;
        all(&rows, |row| {
            let c = Cols::new(row, "runs");
            Ok((c.id("id")?, c.get::<i64>("next_sequence")? - 1))
        })
    }

    async fn active_run(&self, conversation_id: &ConversationId) -> StoreResult<Option<Run>> {
        let row = sqlx::query(&format!("SELECT * FROM runs WHERE conversation_id = $1 AND status IN {ACTIVE} LIMIT 1"))
            .bind(conversation_id.as_str())
            .fetch_optional(&self.pool)
            .await
            .map_err(db("get the active run"))?;
        row.as_ref().map(run_from).transpose()
    }

    async fn waiting_runs(&self, conversation_id: &ConversationId, limit: u32) -> StoreResult<Vec<Run>> {
        let rows = sqlx::query(
            "SELECT * FROM runs WHERE conversation_id = $1 AND status = 'waiting' ORDER BY created_at, id LIMIT $2",
        )
        .bind(conversation_id.as_str())
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await
        .map_err(db("list waiting runs"))?;
        all(&rows, run_from)
    }

    async fn promote_waiting(
        &self,
        conversation_id: &ConversationId,
        events: Vec<EventKind>,
        lease: Option<NewLease>,
        now: Timestamp,
    ) -> StoreResult<Option<StartedRun>> {
        let mut tx = self.begin().await?;
        // On an error the transaction is dropped, which rolls it back.
        let promoted =
            match pipeline::promote(&mut PgTx(&mut tx), conversation_id, &events, lease.as_ref(), now, ONE_ACTIVE_RUN)
                .await
            {
                Ok(Some(promoted)) => promoted,
                Ok(None) => return Ok(None),
                // promoted by another instance after all: this transaction is rolled back
                Err(StoreError::Conflict(_)) => return Ok(None),
                Err(e) => return Err(e),
            };
        let row = sqlx::query("SELECT * FROM runs WHERE id = $1")
            .bind(promoted.run_id.as_str())
            .fetch_one(&mut *tx)
            .await
            .map_err(db("promote a waiting run"))?;
        let run = run_from(&row)?;
        tx.commit().await.map_err(db("promote a waiting run"))?;
        Ok(Some(StartedRun { message: promoted.message, run, events: promoted.events, user_role: None }))
    }

    async fn stranded_conversations(&self, limit: u32) -> StoreResult<Vec<ConversationId>> {
        let rows = sqlx::query(static_sql!(
            "SELECT w.conversation_id FROM runs w WHERE {} GROUP BY w.conversation_id ORDER BY MIN(w.created_at) LIMIT $1",
            *STRANDED
        ))
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await
        .map_err(db("find stranded waiting runs"))?;
        all(&rows, |row| Cols::new(row, "runs").id("conversation_id"))
    }

    async fn roll_back_run(&self, run_id: &RunId, now: Timestamp) -> StoreResult<RolledBack> {
        let mut tx = self.begin().await?;
        // On an error the transaction is dropped, which rolls it back.
        let rolled_back = pipeline::roll_back(&mut PgTx(&mut tx), run_id, now).await?;
        tx.commit().await.map_err(db("roll back a run"))?;
        Ok(rolled_back)
    }

    async fn claim_runs(
        &self,
        owner: &str,
        now: Timestamp,
        lease_until: Timestamp,
        steal: bool,
        limit: u32,
    ) -> StoreResult<Vec<Run>> {
        // One statement: the subquery locks the rows it picks and skips the ones another claimer
        // (or a commit) holds, so concurrent claimers never take the same run and never wait.
        // A row changed since the statement began is re-checked against the condition when locked.
        let sql = static_sql!(
            "UPDATE runs SET status = 'running', lease_owner = $1, lease_expires_at = $2, updated_at = $3, worker = $6 \
             WHERE id IN (SELECT id FROM runs WHERE {} ORDER BY created_at, id LIMIT $5 FOR UPDATE SKIP LOCKED) \
             RETURNING *",
            claimable("$3", "$4")
        );
        let rows = sqlx::query(sql)
            .bind(owner)
            .bind(lease_until)
            .bind(now)
            .bind(steal)
            .bind(i64::from(limit))
            .bind(lease_holder(owner))
            .fetch_all(&self.pool)
            .await
            .map_err(db("claim runs"))?;
        let mut runs = all(&rows, run_from)?;
        runs.sort_by(|a, b| (a.created_at, &a.id).cmp(&(b.created_at, &b.id)));
        Ok(runs)
    }

    async fn due_work(&self, now: Timestamp) -> StoreResult<DueWork> {
        let sql = static_sql!(
            "SELECT EXISTS (SELECT 1 FROM interrupts WHERE {DUE_INTERRUPTS}), \
             EXISTS (SELECT 1 FROM runs WHERE {ROLLBACKS_DUE}), \
             EXISTS (SELECT 1 FROM runs w WHERE {}), \
             EXISTS (SELECT 1 FROM runs WHERE {})",
            *STRANDED,
            claimable("$1", "false")
        );
        let row = sqlx::query(sql).bind(now).fetch_one(&self.pool).await.map_err(db("look for due work"))?;
        let flag = |i: usize| row.try_get::<bool, _>(i).map_err(db("look for due work"));
        Ok(DueWork { expired_interrupts: flag(0)?, rollbacks: flag(1)?, stranded: flag(2)?, claimable: flag(3)? })
    }

    async fn renew_lease(&self, run_id: &RunId, owner: &str, lease_until: Timestamp) -> StoreResult<bool> {
        let done = sqlx::query(&format!(
            "UPDATE runs SET lease_expires_at = $1 WHERE id = $2 AND lease_owner = $3 AND status IN {ACTIVE}"
        ))
        .bind(lease_until)
        .bind(run_id.as_str())
        .bind(owner)
        .execute(&self.pool)
        .await
        .map_err(db("renew a lease"))?;
        Ok(done.rows_affected() > 0)
    }

    async fn release_lease(&self, run_id: &RunId, owner: &str) -> StoreResult<()> {
        sqlx::query("UPDATE runs SET lease_owner = NULL, lease_expires_at = NULL WHERE id = $1 AND lease_owner = $2")
            .bind(run_id.as_str())
            .bind(owner)
            .execute(&self.pool)
            .await
            .map_err(db("release a lease"))?;
        Ok(())
    }

    async fn request_cancel(&self, run_id: &RunId, now: Timestamp, roll_back: bool) -> StoreResult<Run> {
        let mut tx = self.begin().await?;
        let updated = sqlx::query(&format!(
            "UPDATE runs SET cancel_requested = true, updated_at = $1, \
             roll_back_requested = roll_back_requested OR $3 WHERE id = $2 \
             AND (status IN {ACTIVE} OR status = 'waiting') RETURNING *"
        ))
        .bind(now)
        .bind(run_id.as_str())
        .bind(roll_back)
        .fetch_optional(&mut *tx)
        .await
        .map_err(db("request a cancel"))?;
        let row = match updated {
            Some(row) => row,
            // a finished run stays as it is
            None => sqlx::query("SELECT * FROM runs WHERE id = $1")
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

    async fn rollbacks_due(&self, limit: u32) -> StoreResult<Vec<RunId>> {
        let rows = sqlx::query(static_sql!("SELECT id FROM runs WHERE {ROLLBACKS_DUE} ORDER BY id LIMIT $1"))
            .bind(i64::from(limit))
            .fetch_all(&self.pool)
            .await
            .map_err(db("find the rollbacks due"))?;
        rows.iter().map(|r| Cols::new(r, "runs").id("id")).collect()
    }

    async fn hide_run(&self, run_id: &RunId, now: Timestamp) -> StoreResult<bool> {
        let mut tx = self.begin().await?;
        let hidden = sqlx::query(
            "UPDATE runs SET hidden_at = $1 WHERE id = $2 AND hidden_at IS NULL \
             AND status IN ('completed', 'failed', 'cancelled', 'rolled_back')",
        )
        .bind(now)
        .bind(run_id.as_str())
        .execute(&mut *tx)
        .await
        .map_err(db("hide a run"))?
        .rows_affected();
        let hid = if hidden == 1 {
            true
        } else {
            let row = sqlx::query("SELECT * FROM runs WHERE id = $1")
                .bind(run_id.as_str())
                .fetch_optional(&mut *tx)
                .await
                .map_err(db("hide a run"))?
                .ok_or(StoreError::NotFound("run"))?;
            let run = run_from(&row)?;
            if run.hidden_at.is_none() {
                return Err(StoreError::Conflict(format!(
                    "run {run_id} is {}: only a run that is over is hidden",
                    run.status
                )));
            }
            false
        };
        tx.commit().await.map_err(db("hide a run"))?;
        Ok(hid)
    }

    async fn commit(&self, commit: Commit) -> StoreResult<Committed> {
        self.committer.commit(commit).await
    }

    async fn list_runs(&self, user_id: &str, status: Option<RunStatus>, limit: u32) -> StoreResult<Vec<Run>> {
        let rows = sqlx::query(
            "SELECT * FROM runs WHERE user_id = $1 AND ($2::text IS NULL OR status = $2) \
             ORDER BY created_at DESC, id DESC LIMIT $3",
        )
        .bind(user_id)
        .bind(status.map(RunStatus::as_str))
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await
        .map_err(db("list runs"))?;
        all(&rows, run_from)
    }

    async fn list_events(&self, run_id: &RunId, after: i64, limit: u32) -> StoreResult<Vec<Event>> {
        let rows = sqlx::query(
            "SELECT sequence, type, data, created_at FROM run_events WHERE run_id = $1 AND sequence > $2 \
             ORDER BY sequence LIMIT $3",
        )
        .bind(run_id.as_str())
        .bind(after)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await
        .map_err(db("list events"))?;
        rows.iter().map(|row| event_from(run_id, row)).collect()
    }

    async fn get_interrupt(&self, id: &InterruptId) -> StoreResult<Option<Interrupt>> {
        let row = sqlx::query("SELECT * FROM interrupts WHERE id = $1")
            .bind(id.as_str())
            .fetch_optional(&self.pool)
            .await
            .map_err(db("get an interrupt"))?;
        row.as_ref().map(interrupt_from).transpose()
    }

    async fn pending_interrupt(&self, run_id: &RunId) -> StoreResult<Option<Interrupt>> {
        let row = sqlx::query(
            "SELECT * FROM interrupts WHERE run_id = $1 AND status = 'pending' \
             ORDER BY created_at DESC, id DESC LIMIT 1",
        )
        .bind(run_id.as_str())
        .fetch_optional(&self.pool)
        .await
        .map_err(db("get the pending interrupt"))?;
        row.as_ref().map(interrupt_from).transpose()
    }

    async fn due_interrupts(&self, now: Timestamp, limit: u32) -> StoreResult<Vec<Interrupt>> {
        let rows = sqlx::query(static_sql!(
            "SELECT * FROM interrupts WHERE {DUE_INTERRUPTS} ORDER BY expires_at, id LIMIT $2"
        ))
        .bind(now)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await
        .map_err(db("list due interrupts"))?;
        all(&rows, interrupt_from)
    }

    async fn list_interrupts(&self, run_id: &RunId) -> StoreResult<Vec<Interrupt>> {
        let rows = sqlx::query("SELECT * FROM interrupts WHERE run_id = $1 ORDER BY created_at, id")
            .bind(run_id.as_str())
            .fetch_all(&self.pool)
            .await
            .map_err(db("list interrupts"))?;
        all(&rows, interrupt_from)
    }

    async fn list_tool_calls(&self, run_id: &RunId) -> StoreResult<Vec<ToolCall>> {
        let rows = sqlx::query("SELECT * FROM tool_calls WHERE run_id = $1 ORDER BY seq")
            .bind(run_id.as_str())
            .fetch_all(&self.pool)
            .await
            .map_err(db("list tool calls"))?;
        all(&rows, tool_call_from)
    }

    async fn answer_view(&self, run_id: &RunId, user_id: &str) -> StoreResult<AnswerView> {
        let rows = self
            .kept
            .run(async |conn| sqlx::query(answer_view_sql()).bind(run_id.as_str()).bind(user_id).fetch_all(conn).await)
            .await
            .map_err(db("read a run for an answer"))?;
        let mut view = AnswerView::default();
        for row in &rows {
            match Cols::new(row, "answer view").get::<i32>("k")? {
                0 => view.run = Some(run_from(row)?),
                1 => view.interrupts.push(interrupt_from(row)?),
                2 => view.tool_calls.push(tool_call_from(row)?),
                3 => view.role = Some(Cols::new(row, "users").parse("role", UserRole::parse)?),
                _ => view.facts.push(fact_from(row)?),
            }
        }
        Ok(view)
    }

    async fn list_conversation_tool_calls(&self, conversation_id: &ConversationId) -> StoreResult<Vec<ToolCall>> {
        let rows = sqlx::query(
            "SELECT * FROM tool_calls t WHERE conversation_id = $1 AND NOT EXISTS \
             (SELECT 1 FROM runs r WHERE r.id = t.run_id AND r.status = 'rolled_back') ORDER BY seq",
        )
        .bind(conversation_id.as_str())
        .fetch_all(&self.pool)
        .await
        .map_err(db("list tool calls"))?;
        all(&rows, tool_call_from)
    }

    async fn asking_calls(&self, name: &str) -> StoreResult<Vec<ToolCall>> {
        let rows = sqlx::query("SELECT * FROM tool_calls WHERE name = $1 AND state = 'asking' ORDER BY seq")
            .bind(name)
            .fetch_all(&self.pool)
            .await
            .map_err(db("list calls waiting for a human"))?;
        all(&rows, tool_call_from)
    }

    async fn idempotency_begin(
        &self,
        user_id: &str,
        key: &str,
        request_hash: &str,
        now: Timestamp,
        expires_at: Timestamp,
    ) -> StoreResult<IdempotencyBegin> {
        for _ in 0..IDEMPOTENCY_ATTEMPTS {
            // New, or expired: this request starts it (again). One statement, so two requests with
            // one new key cannot both start it.
            let started = sqlx::query(
                "INSERT INTO idempotency_keys (user_id, key, request_hash, state, status, response, expires_at) \
                 VALUES ($1, $2, $3, 'in_flight', NULL, NULL, $5) \
                 ON CONFLICT (user_id, key) DO UPDATE SET request_hash = excluded.request_hash, \
                 state = 'in_flight', status = NULL, response = NULL, expires_at = excluded.expires_at \
                 WHERE idempotency_keys.expires_at <= $4 \
                 RETURNING 1",
            )
            .bind(user_id)
            .bind(key)
            .bind(request_hash)
            .bind(now)
            .bind(expires_at)
            .fetch_optional(&self.pool)
            .await
            .map_err(db("begin an idempotent request"))?;
            if started.is_some() {
                return Ok(IdempotencyBegin::Started);
            }
            // A live key: what it holds decides.
            let row = sqlx::query(
                "SELECT request_hash, state, status, response FROM idempotency_keys WHERE user_id = $1 AND key = $2",
            )
            .bind(user_id)
            .bind(key)
            .fetch_optional(&self.pool)
            .await
            .map_err(db("begin an idempotent request"))?;
            // abandoned since: try again
            let Some(row) = row else { continue };
            return stored_key(&row, request_hash);
        }
        // the key keeps being started and abandoned by other requests: one of them is in flight
        Ok(IdempotencyBegin::InFlight)
    }

    async fn idempotency_find(
        &self,
        user_id: &str,
        key: &str,
        request_hash: &str,
        now: Timestamp,
    ) -> StoreResult<Option<IdempotencyBegin>> {
        let row = sqlx::query(
            "SELECT request_hash, state, status, response FROM idempotency_keys \
             WHERE user_id = $1 AND key = $2 AND expires_at > $3",
        )
        .bind(user_id)
        .bind(key)
        .bind(now)
        .fetch_optional(&self.pool)
        .await
        .map_err(db("read an idempotency key"))?;
        row.map(|row| stored_key(&row, request_hash)).transpose()
    }

    async fn idempotency_complete(&self, user_id: &str, key: &str, status: u16, response: &Value) -> StoreResult<()> {
        let done = sqlx::query(
            "UPDATE idempotency_keys SET state = 'done', status = $1, response = $2 WHERE user_id = $3 AND key = $4",
        )
        .bind(i64::from(status))
        .bind(response)
        .bind(user_id)
        .bind(key)
        .execute(&self.pool)
        .await
        .map_err(db("complete an idempotent request"))?;
        if done.rows_affected() == 0 {
            return Err(StoreError::NotFound("idempotency key"));
        }
        Ok(())
    }

    async fn idempotency_abandon(&self, user_id: &str, key: &str) -> StoreResult<()> {
        sqlx::query("DELETE FROM idempotency_keys WHERE user_id = $1 AND key = $2 AND state = 'in_flight'")
            .bind(user_id)
            .bind(key)
            .execute(&self.pool)
            .await
            .map_err(db("abandon an idempotent request"))?;
        Ok(())
    }

    async fn abandon_all_in_flight_keys(&self) -> StoreResult<u64> {
        let done = sqlx::query("DELETE FROM idempotency_keys WHERE state = 'in_flight'")
            .execute(&self.pool)
            .await
            .map_err(db("abandon in-flight idempotency keys"))?;
        Ok(done.rows_affected())
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
impl ConversationStore for PostgresStore {
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
            created_at: micros(now),
        };
        self.kept
            .run(async |conn| {
                sqlx::query(
                    "INSERT INTO conversations (id, user_id, title, version, created_at, agent_id) \
                     VALUES ($1, $2, $3, $4, $5, $6)",
                )
                .bind(conversation.id.as_str())
                .bind(&conversation.user_id)
                .bind(conversation.title.as_str())
                .bind(conversation.version)
                .bind(conversation.created_at)
                .bind(&conversation.agent_id)
                .execute(conn)
                .await
            })
            .await
            .map_err(insert("conversation"))?;
        Ok(conversation)
    }

    async fn get_conversation(&self, id: &ConversationId) -> StoreResult<Option<Conversation>> {
        let row = sqlx::query("SELECT * FROM conversations WHERE id = $1")
            .bind(id.as_str())
            .fetch_optional(&self.pool)
            .await
            .map_err(db("get a conversation"))?;
        row.as_ref().map(conversation_from).transpose()
    }

    async fn list_conversations(&self, user_id: &str, limit: u32) -> StoreResult<Vec<Conversation>> {
        let rows =
            sqlx::query("SELECT * FROM conversations WHERE user_id = $1 ORDER BY created_at DESC, id DESC LIMIT $2")
                .bind(user_id)
                .bind(i64::from(limit))
                .fetch_all(&self.pool)
                .await
                .map_err(db("list conversations"))?;
        all(&rows, conversation_from)
    }

    async fn list_messages(&self, conversation_id: &ConversationId) -> StoreResult<Vec<Message>> {
        let rows = sqlx::query("SELECT * FROM messages WHERE conversation_id = $1 ORDER BY seq")
            .bind(conversation_id.as_str())
            .fetch_all(&self.pool)
            .await
            .map_err(db("list messages"))?;
        all(&rows, message_from)
    }

    async fn recent_messages(&self, conversation_id: &ConversationId, limit: u32) -> StoreResult<Vec<Message>> {
        let rows = sqlx::query(
            "SELECT * FROM (SELECT * FROM messages WHERE conversation_id = $1 AND role <> 'tool' \
             ORDER BY seq DESC LIMIT $2) newest ORDER BY seq",
        )
        .bind(conversation_id.as_str())
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await
        .map_err(db("list recent messages"))?;
        all(&rows, message_from)
    }

    async fn list_run_messages(&self, run_id: &RunId) -> StoreResult<Vec<Message>> {
        let rows = sqlx::query("SELECT * FROM messages WHERE run_id = $1 ORDER BY seq")
            .bind(run_id.as_str())
            .fetch_all(&self.pool)
            .await
            .map_err(db("list a run's messages"))?;
        all(&rows, message_from)
    }

    async fn messages_through_run(
        &self,
        conversation_id: &ConversationId,
        run_id: &RunId,
        limit: u32,
    ) -> StoreResult<MessagesThrough> {
        // The run's last message (by the run's index), then the newest messages up to it (by the
        // conversation's); the calls their results answer, by id. A run's messages are written
        // before the next run's, so the two reads agree.
        const WINDOW: &str = "SELECT * FROM messages WHERE conversation_id = $1 AND seq <= \
             (SELECT MAX(seq) FROM messages WHERE run_id = $2 AND conversation_id = $1) \
             ORDER BY seq DESC LIMIT $3";
        let calls_sql = format!(
            "SELECT * FROM tool_calls WHERE id IN \
             (SELECT tool_call_id FROM ({WINDOW}) w WHERE tool_call_id IS NOT NULL) ORDER BY seq"
        );
        let (messages, tool_calls) = tokio::try_join!(
            async {
                sqlx::query(WINDOW)
                    .bind(conversation_id.as_str())
                    .bind(run_id.as_str())
                    .bind(i64::from(limit))
                    .fetch_all(&self.pool)
                    .await
                    .map_err(db("list the messages through a run"))
            },
            async {
                sqlx::query(&calls_sql)
                    .bind(conversation_id.as_str())
                    .bind(run_id.as_str())
                    .bind(i64::from(limit))
                    .fetch_all(&self.pool)
                    .await
                    .map_err(db("list the tool calls through a run"))
            },
        )?;
        Ok(MessagesThrough { messages: all(&messages, message_from)?, tool_calls: all(&tool_calls, tool_call_from)? })
    }

    async fn context_window(&self, conversation_id: &ConversationId) -> StoreResult<ContextWindow> {
        Ok(self.read_context(conversation_id, None).await?.0)
    }

    async fn list_facts(&self, conversation_id: &ConversationId) -> StoreResult<Vec<Fact>> {
        let rows = sqlx::query("SELECT * FROM facts WHERE conversation_id = $1 ORDER BY key")
            .bind(conversation_id.as_str())
            .fetch_all(&self.pool)
            .await
            .map_err(db("list facts"))?;
        all(&rows, fact_from)
    }

    async fn get_summary(&self, conversation_id: &ConversationId) -> StoreResult<Option<Summary>> {
        let row = sqlx::query("SELECT * FROM summaries WHERE conversation_id = $1")
            .bind(conversation_id.as_str())
            .fetch_optional(&self.pool)
            .await
            .map_err(db("get the summary"))?;
        row.as_ref().map(summary_from).transpose()
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
impl IdentityStore for PostgresStore {
    async fn user_role(&self, user_id: &str) -> StoreResult<Option<UserRole>> {
        let row = self
            .kept
            .run(async |conn| {
                sqlx::query("SELECT role FROM users WHERE id = $1").bind(user_id).fetch_optional(conn).await
            })
            .await
            .map_err(db("get a user's role"))?;
        row.map(|row| Cols::new(&row, "users").parse("role", UserRole::parse)).transpose()
    }

    async fn set_user_role(&self, user_id: &str, role: UserRole) -> StoreResult<()> {
        sqlx::query("INSERT INTO users (id, role) VALUES ($1, $2) ON CONFLICT (id) DO UPDATE SET role = excluded.role")
            .bind(user_id)
            .bind(role.as_str())
            .execute(&self.pool)
            .await
            .map_err(db("set a user's role"))?;
        Ok(())
    }

    async fn list_users(&self) -> StoreResult<Vec<User>> {
        let rows = sqlx::query(
            "SELECT u.id, u.role, (SELECT COUNT(*) FROM api_keys k WHERE k.user_id = u.id AND k.revoked_at IS NULL) \
             AS active_keys FROM users u ORDER BY u.id",
        )
        .fetch_all(&self.pool)
        .await
        .map_err(db("list users"))?;
        rows.iter().map(user_from).collect()
    }

    async fn insert_api_key(&self, key: &ApiKey) -> StoreResult<()> {
        sqlx::query("INSERT INTO api_keys (id, user_id, key_hash, created_at, revoked_at) VALUES ($1, $2, $3, $4, $5)")
            .bind(&key.id)
            .bind(&key.user_id)
            .bind(&key.key_hash)
            .bind(micros(key.created_at))
            .bind(key.revoked_at.map(micros))
            .execute(&self.pool)
            .await
            .map_err(|e| match &e {
                sqlx::Error::Database(d) if d.is_foreign_key_violation() => StoreError::NotFound("user"),
                _ => insert("api key")(e),
            })?;
        Ok(())
    }

    async fn api_key_user(&self, key_hash: &str) -> StoreResult<Option<String>> {
        sqlx::query_scalar("SELECT user_id FROM api_keys WHERE key_hash = $1 AND revoked_at IS NULL")
            .bind(key_hash)
            .fetch_optional(&self.pool)
            .await
            .map_err(db("look up an api key"))
    }

    async fn count_active_api_keys(&self) -> StoreResult<u64> {
        let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM api_keys WHERE revoked_at IS NULL")
            .fetch_one(&self.pool)
            .await
            .map_err(db("count api keys"))?;
        Ok(n as u64)
    }

    async fn revoke_api_keys(&self, user_id: &str, now: Timestamp) -> StoreResult<u64> {
        let done = sqlx::query("UPDATE api_keys SET revoked_at = $1 WHERE user_id = $2 AND revoked_at IS NULL")
            .bind(micros(now))
            .bind(user_id)
            .execute(&self.pool)
            .await
            .map_err(db("revoke api keys"))?;
        Ok(done.rows_affected())
    }

    async fn insert_stream_ticket(&self, ticket: &StreamTicket, now: Timestamp) -> StoreResult<()> {
        let mut tx = self.begin().await?;
        sqlx::query("DELETE FROM stream_tickets WHERE expires_at < $1")
            .bind(now - chrono::Duration::hours(1))
            .execute(&mut *tx)
            .await
            .map_err(db("forget old stream tickets"))?;
        sqlx::query(
            "INSERT INTO stream_tickets (ticket_hash, user_id, scope, run_id, expires_at, used_at) \
             VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(&ticket.ticket_hash)
        .bind(&ticket.user_id)
        .bind(ticket.scope.as_str())
        .bind(ticket.run_id.as_ref().map(|id| id.to_string()))
        .bind(micros(ticket.expires_at))
        .bind(ticket.used_at.map(micros))
        .execute(&mut *tx)
        .await
        .map_err(insert("stream ticket"))?;
        tx.commit().await.map_err(db("store a stream ticket"))?;
        Ok(())
    }

    async fn redeem_stream_ticket(&self, ticket_hash: &str, now: Timestamp) -> StoreResult<Option<StreamTicket>> {
        let row = sqlx::query(
            "UPDATE stream_tickets SET used_at = $1 WHERE ticket_hash = $2 AND used_at IS NULL AND expires_at > $3 \
             RETURNING *",
        )
        .bind(micros(now))
        .bind(ticket_hash)
        .bind(micros(now))
        .fetch_optional(&self.pool)
        .await
        .map_err(db("redeem a stream ticket"))?;
        row.as_ref().map(stream_ticket_from).transpose()
    }
}

#[async_trait]
impl BindingStore for PostgresStore {
    async fn binding(&self, namespace: &str, scope: &str, external_id: &str) -> StoreResult<Option<String>> {
        sqlx::query_scalar("SELECT value FROM bindings WHERE namespace = $1 AND scope = $2 AND external_id = $3")
            .bind(namespace)
            .bind(scope)
            .bind(external_id)
            .fetch_optional(&self.pool)
            .await
            .map_err(db("read a binding"))
    }

    async fn bind(
        &self,
        namespace: &str,
        scope: &str,
        external_id: &str,
        value: &str,
        now: Timestamp,
    ) -> StoreResult<String> {
        // The first binding wins: a losing insert does nothing, and the row read after it is the
        // winner's (READ COMMITTED sees the committed row once the insert waited for it).
        sqlx::query(
            "INSERT INTO bindings (namespace, scope, external_id, value, created_at) VALUES ($1, $2, $3, $4, $5) \
             ON CONFLICT (namespace, scope, external_id) DO NOTHING",
        )
        .bind(namespace)
        .bind(scope)
        .bind(external_id)
        .bind(value)
        .bind(micros(now))
        .execute(&self.pool)
        .await
        .map_err(db("bind an id"))?;
        self.binding(namespace, scope, external_id).await?.ok_or(StoreError::NotFound("binding"))
    }
}

#[async_trait]
impl Store for PostgresStore {
    async fn context_window_and_role(
        &self,
        conversation_id: &ConversationId,
        user_id: &str,
    ) -> StoreResult<(ContextWindow, Option<UserRole>)> {
        self.read_context(conversation_id, Some(user_id)).await
    }

    async fn ping(&self) -> StoreResult<()> {
        sqlx::query("SELECT 1").execute(&self.pool).await.map_err(db("ping"))?;
        Ok(())
    }

    async fn db_now(&self) -> StoreResult<Timestamp> {
        sqlx::query_scalar::<_, Timestamp>("SELECT clock_timestamp()")
            .fetch_one(&self.pool)
            .await
            .map_err(db("read the database clock"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    #[test]
    fn micros_truncates_like_the_driver() {
        let t = Utc.with_ymd_and_hms(2030, 1, 1, 10, 0, 0).unwrap() + chrono::Duration::nanoseconds(123_456_789);
        assert_eq!(
            micros(t),
            Utc.with_ymd_and_hms(2030, 1, 1, 10, 0, 0).unwrap() + chrono::Duration::microseconds(123_456)
        );
        assert_eq!(micros(micros(t)), micros(t));
        let before_2000 = Utc.with_ymd_and_hms(1990, 1, 1, 0, 0, 0).unwrap() + chrono::Duration::nanoseconds(999);
        assert_eq!(micros(before_2000), Utc.with_ymd_and_hms(1990, 1, 1, 0, 0, 0).unwrap());
    }

    #[test]
    fn schema_names_are_plain_identifiers() {
        assert_eq!(quote_schema("keel_test_01").unwrap(), "\"keel_test_01\"");
        for bad in ["", "1abc", "a-b", "a\"b", "pg_temp", "PG_x", "x; DROP TABLE runs", &"a".repeat(64)] {
            assert!(matches!(quote_schema(bad), Err(StoreError::Backend(_))), "{bad}");
        }
    }

    #[test]
    fn a_bad_url_is_refused_without_quoting_it() {
        for url in ["sqlite://keel.db", "postgres://user:secret-pw@host:notaport/db"] {
            match url_options(url) {
                Err(StoreError::Backend(message)) => assert!(!message.contains("secret"), "{message}"),
                other => panic!("{url}: expected a backend error, got {other:?}"),
            }
        }
    }
}
