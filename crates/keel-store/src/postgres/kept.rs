//! Connections a run's hot statements use again without sqlx's test on release.
//!
//! **Why.** sqlx's pool tests a connection each time one comes back to it (a `Sync` message and a
//! wait for the database's `ReadyForQuery`: a round trip, in a task of its own). The statements a
//! run makes at every step — its context, an answer's view, the start of a message — would each
//! cost the database a second wake-up and both processes a send and a receive for that test:
//! counted on the HITL flow at concurrency 32, about 6 of the 20 sends a run to the database
//! (docs/benchmarks.md, "Eleventh session").
//!
//! **How.** [`Kept`] holds up to [`KEEP`] connections of a pool of its own and hands them out
//! again as they are, without a test, when the statement they ran ended with the database's
//! answer (rows, or an error the database reported): such a connection is idle and in sync. Any
//! other end — an I/O error, a protocol error, a statement cut off because its caller stopped
//! waiting, a transaction left open — gives the connection back to the pool instead, whose test
//! resynchronises it or closes it. A kept connection idle for
//! [`PostgresStore::TEST_IDLE_AFTER`](super::PostgresStore::TEST_IDLE_AFTER) or longer is tested
//! before it is used, as the pool's are, so one the database ended meanwhile is replaced.
//!
//! **Plans.** Every statement run here finds its rows by key, so the connections are opened as
//! the committers' are ([`by_key`]): each statement's first plan is kept (`plan_cache_mode =
//! force_generic_plan`), and it reads the keys' indexes (`enable_seqscan = off`). With the
//! default settings a plan made while a table was a page — a new database — could read the whole
//! table at every later execution: measured on the HITL flow, in one benchmark round of four, the
//! context's read of the tool calls its messages answer read `tool_calls` whole 5,164 times in
//! 3,000 runs (3.7 million rows), and the round ran 20% slower (docs/benchmarks.md, "Eleventh
//! session").

use std::sync::Mutex;
use std::time::{Duration, Instant};

use sqlx::pool::PoolConnection;
use sqlx::{Connection, PgConnection, PgPool, Postgres};
use tokio::sync::{Semaphore, SemaphorePermit};

use super::PostgresStore;

/// The size of the hot statements' pool, and so the most of its connections kept idle (the
/// committers keep theirs, one each).
pub(super) const KEEP: usize = 6;

/// A pool of at most `size` connections like `pool`'s (its options, its hooks), opened as they
/// are first needed, for statements that find their rows by key: each statement's first plan is
/// kept, and reads indexes rather than whole tables (the committers' connections and
/// [`Kept`]'s).
pub(super) fn by_key(pool: &PgPool, size: usize) -> PgPool {
    let connect = (*pool.connect_options())
        .clone()
        .options([("plan_cache_mode", "force_generic_plan"), ("enable_seqscan", "off")]);
    pool.options()
        .clone()
        .min_connections(0)
        .max_connections(u32::try_from(size).unwrap_or(u32::MAX))
        .connect_lazy_with(connect)
}

#[derive(Debug)]
pub(super) struct Kept {
    pool: PgPool,
    idle: Mutex<Vec<(PoolConnection<Postgres>, Instant)>>,
    /// One per connection of `pool`: a statement holds one while it runs, so a caller that finds
    /// no idle connection here always finds the pool with one to give (the kept ones, which the
    /// pool counts as out, would otherwise leave it waiting for a connection nobody returns).
    turns: Semaphore,
    wait: Duration,
}

impl Kept {
    /// Keeps connections of `pool`, which it must be the only user of.
    pub(super) fn new(pool: PgPool) -> Self {
        let size = pool.options().get_max_connections() as usize;
        let wait = pool.options().get_acquire_timeout();
        Self { pool, idle: Mutex::new(Vec::with_capacity(KEEP)), turns: Semaphore::new(size.max(1)), wait }
    }

    /// Runs `f` on a kept connection, or on one from the pool when none is idle; keeps the
    /// connection afterwards if `f` ended with the database's answer.
    pub(super) async fn run<T>(
        &self,
        f: impl AsyncFnOnce(&mut PgConnection) -> Result<T, sqlx::Error>,
    ) -> Result<T, sqlx::Error> {
        self.run_judged(f, |out| matches!(out, Ok(_) | Err(sqlx::Error::Database(_) | sqlx::Error::RowNotFound)), |e| e)
            .await
    }

    /// [`Kept::run`] for an `f` whose errors are not sqlx's: `answered` says whether its outcome
    /// leaves the connection idle and in sync (when unsure, no: the pool tests it), `failed` makes
    /// an error of a connection the pool could not give.
    pub(super) async fn run_judged<T, E>(
        &self,
        f: impl AsyncFnOnce(&mut PgConnection) -> Result<T, E>,
        answered: impl FnOnce(&Result<T, E>) -> bool,
        failed: impl FnOnce(sqlx::Error) -> E,
    ) -> Result<T, E> {
        let turn = match tokio::time::timeout(self.wait, self.turns.acquire()).await {
            Ok(Ok(turn)) => turn,
            Ok(Err(_)) => return Err(failed(sqlx::Error::PoolClosed)),
            Err(_) => return Err(failed(sqlx::Error::PoolTimedOut)),
        };
        let conn = self.take().await.map_err(failed)?;
        let mut lease = Lease { kept: self, conn: Some(conn), answered: false, _turn: turn };
        let out = f(lease.conn.as_mut().expect("a connection")).await;
        lease.answered = answered(&out);
        out
    }

    async fn take(&self) -> Result<PoolConnection<Postgres>, sqlx::Error> {
        loop {
            let idle = self.idle.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).pop();
            let Some((mut conn, since)) = idle else { return self.pool.acquire().await };
            if since.elapsed() < PostgresStore::TEST_IDLE_AFTER || conn.ping().await.is_ok() {
                return Ok(conn);
            }
            // ended while it was idle: the pool closes it as it comes back
        }
    }

    /// Closes the kept connections and their pool; waits for the ones in use.
    pub(super) async fn close(&self) {
        self.turns.close();
        let idle = std::mem::take(&mut *self.idle.lock().unwrap_or_else(|poisoned| poisoned.into_inner()));
        drop(idle);
        self.pool.close().await;
    }
}

/// A connection out of [`Kept`] while a statement runs on it.
struct Lease<'a> {
    kept: &'a Kept,
    conn: Option<PoolConnection<Postgres>>,
    /// The statement ended with the database's answer: the connection is idle and in sync.
    answered: bool,
    /// Given back after the connection (fields drop in order).
    _turn: SemaphorePermit<'a>,
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        let Some(conn) = self.conn.take() else { return };
        if self.answered && !conn.is_in_transaction() && !self.kept.pool.is_closed() {
            let mut idle = self.kept.idle.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            if idle.len() < KEEP {
                idle.push((conn, Instant::now()));
                return;
            }
        }
        // back to the pool, which tests it as it comes back
        drop(conn);
    }
}
