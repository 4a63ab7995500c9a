//! Connections a run's hot statements use again without sqlx's test on release.
//!
//! **Why.** sqlx's pool tests a connection each time one comes back to it (a `Sync` message and a
//! wait for the database's `ReadyForQuery`: a round trip, in a task of its own). The statements a
//! run makes at every step — its context, an answer's view, the start of a message — would each
//! cost the database a second wake-up and both processes a send and a receive for that test:
//! counted on the HITL flow at concurrency 32, 18 sends to the database a run, 8 of them those
//! tests (docs/benchmarks.md, "Eleventh session").
//!
//! **How.** [`Kept`] holds up to [`KEEP`] connections taken from the store's pool and hands them
//! out again as they are, without a test, when the statement they ran ended with the database's
//! answer (rows, or an error the database reported): such a connection is idle and in sync. Any
//! other end — an I/O error, a protocol error, a statement cut off because its caller stopped
//! waiting, a transaction left open — gives the connection back to the pool instead, whose test
//! resynchronises it or closes it. A kept connection idle for
//! [`PostgresStore::TEST_IDLE_AFTER`](super::PostgresStore::TEST_IDLE_AFTER) or longer is tested
//! before it is used, as the pool's are, so one the database ended meanwhile is replaced.
//!
//! The kept connections count against the pool's size: up to [`KEEP`] of its connections are kept
//! here, the rest serve every other statement.

use std::sync::Mutex;
use std::time::Instant;

use sqlx::pool::PoolConnection;
use sqlx::{Connection, PgConnection, PgPool, Postgres};

use super::PostgresStore;

/// The most connections kept: about as many as a two-core server has hot statements in flight
/// at once under load; the pool keeps the rest of its twelve.
pub(super) const KEEP: usize = 6;

#[derive(Debug)]
pub(super) struct Kept {
    pool: PgPool,
    idle: Mutex<Vec<(PoolConnection<Postgres>, Instant)>>,
}

impl Kept {
    pub(super) fn new(pool: PgPool) -> Self {
        Self { pool, idle: Mutex::new(Vec::with_capacity(KEEP)) }
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
        let conn = self.take().await.map_err(failed)?;
        let mut lease = Lease { kept: self, conn: Some(conn), answered: false };
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

    /// Gives every kept connection back to the pool (before the pool closes).
    pub(super) fn release(&self) {
        let idle = std::mem::take(&mut *self.idle.lock().unwrap_or_else(|poisoned| poisoned.into_inner()));
        drop(idle);
    }
}

/// A connection out of [`Kept`] while a statement runs on it.
struct Lease<'a> {
    kept: &'a Kept,
    conn: Option<PoolConnection<Postgres>>,
    /// The statement ended with the database's answer: the connection is idle and in sync.
    answered: bool,
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
