//! The SQLite connections: one writer thread that owns the writing connection and runs group
//! transactions, and a pool of reading connections used in place.
//!
//! **Why a thread and not a connection pool.** A statement on SQLite takes microseconds; handing it
//! to another thread and waking the waiting task afterwards costs more than that (two thread
//! switches, each ~10 µs on a small virtual machine). So a write is one closure sent to the writer
//! thread, which runs all its statements at once, and the closures queued at that moment share one
//! transaction: one hop there and one back per *group*, not per statement. Reads run on the caller's
//! thread, on a connection taken from a small pool: they are index lookups of a few microseconds,
//! shorter than the hop they would otherwise need.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use keel_core::store::{StoreError, StoreResult};
use rusqlite::{Connection, OpenFlags};
use sha2::{Digest, Sha384};
use tokio::sync::oneshot;

const BUSY_TIMEOUT: Duration = Duration::from_secs(5);
/// Room for every statement shape, the multi-row event inserts included, so none is prepared again.
const STATEMENT_CACHE: usize = 256;
/// Reading connections kept open between reads. More may be open at a moment (one per thread
/// reading at once); the ones above this are closed when they are given back.
const IDLE_READERS: usize = 8;

/// How often the checkpointer copies the WAL into the database file.
const CHECKPOINT_EVERY: Duration = Duration::from_millis(100);
/// A WAL longer than this many frames (4 KiB pages) after a passive checkpoint, which readers can
/// hold back, gets a checkpoint that waits for them and restarts the WAL, so it stays bounded.
const WAL_RESTART_FRAMES: i64 = 25_000;

/// The most write closures one group transaction takes. Bounded so that one group's transaction,
/// and the wait of its first caller, stay short.
const MAX_GROUP: usize = 64;

/// Where the database is.
#[derive(Debug, Clone, PartialEq)]
pub enum Location {
    File(PathBuf),
    /// A private in-memory database: every connection would see another, empty one, so reads use
    /// the writer's connection.
    Memory,
}

impl Location {
    /// `sqlite://PATH`, `sqlite:PATH` or `sqlite::memory:` (also `?mode=memory`).
    pub fn parse_url(url: &str) -> StoreResult<Self> {
        let invalid = |why: &str| StoreError::Backend(format!("the database url is not a valid sqlite: url ({why})"));
        let rest = url
            .strip_prefix("sqlite://")
            .or_else(|| url.strip_prefix("sqlite:"))
            .ok_or_else(|| invalid("expected sqlite://PATH or sqlite::memory:"))?;
        let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
        let mut memory = path == ":memory:";
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            match pair {
                "mode=memory" => memory = true,
                "mode=rwc" => {}
                _ => return Err(invalid("the only parameter understood is mode=memory or mode=rwc")),
            }
        }
        if memory {
            return Ok(Location::Memory);
        }
        if path.is_empty() {
            return Err(invalid("it names no file"));
        }
        Ok(Location::File(PathBuf::from(path)))
    }
}

/// Maps a driver error to `Backend`, naming the operation. SQLite's messages never carry the bound
/// parameters, so no value written leaks into the error.
pub fn db(op: &'static str) -> impl FnOnce(rusqlite::Error) -> StoreError {
    move |e| StoreError::Backend(format!("{op}: {e}"))
}

/// Like [`db`], but a unique violation is a reused id: `Duplicate`.
pub fn insert(what: &'static str) -> impl FnOnce(rusqlite::Error) -> StoreError {
    move |e| {
        if is_unique_violation(&e) {
            StoreError::Duplicate(format!("{what} id already exists"))
        } else {
            db(what)(e)
        }
    }
}

fn extended_code(e: &rusqlite::Error) -> Option<i32> {
    match e {
        rusqlite::Error::SqliteFailure(f, _) => Some(f.extended_code),
        _ => None,
    }
}

pub fn is_unique_violation(e: &rusqlite::Error) -> bool {
    matches!(
        extended_code(e),
        Some(rusqlite::ffi::SQLITE_CONSTRAINT_UNIQUE | rusqlite::ffi::SQLITE_CONSTRAINT_PRIMARYKEY)
    )
}

pub fn is_foreign_key_violation(e: &rusqlite::Error) -> bool {
    extended_code(e) == Some(rusqlite::ffi::SQLITE_CONSTRAINT_FOREIGNKEY)
}

fn open_connection(location: &Location, read_only: bool) -> StoreResult<Connection> {
    let flags = if read_only {
        OpenFlags::SQLITE_OPEN_READ_ONLY
    } else {
        OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_CREATE
    } | OpenFlags::SQLITE_OPEN_NO_MUTEX
        | OpenFlags::SQLITE_OPEN_URI;
    let conn = match location {
        Location::File(path) => Connection::open_with_flags(path, flags),
        Location::Memory => Connection::open_in_memory_with_flags(flags),
    }
    .map_err(db("open the database"))?;
    conn.busy_timeout(BUSY_TIMEOUT).map_err(db("open the database"))?;
    conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
    // SQLite's default page cache (2 MiB) for the readers: any write makes a reader drop its cache
    // at its next read, so a bigger one would only cost. 8 MiB for the writer, whose cache stays
    // valid (a bigger one costs at every commit: SQLite walks the cache's hash table to drop pages
    // past the end of the file).
    let cache = if read_only { "-2000" } else { "-8192" };
    conn.execute_batch(&format!("PRAGMA foreign_keys = ON; PRAGMA synchronous = NORMAL; PRAGMA cache_size = {cache};"))
        .map_err(db("open the database"))?;
    if !read_only && *location != Location::Memory {
        let mode: String =
            conn.query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0)).map_err(db("open the database"))?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(StoreError::Backend(format!("open the database: journal mode is {mode}, not wal")));
        }
    }
    if read_only {
        conn.execute_batch("PRAGMA query_only = ON").map_err(db("open the database"))?;
    }
    Ok(conn)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // a panic while holding the lock leaves a connection or a list that is still usable
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// One write, run by the writer thread inside a transaction.
trait WriteJob: Send {
    /// Runs the statements; `false` if they failed (the caller's error is kept for its answer). May
    /// run again, when the group's transaction was rolled back because another write failed: the
    /// last run's result is the one that counts.
    fn run(&mut self, conn: &Connection) -> bool;
    /// Answers the caller once the transaction is over: with its own result, or with `failure` if
    /// the transaction as a whole failed (then nothing of it was written).
    fn answer(self: Box<Self>, failure: Option<String>);
}

struct Pending<R, F> {
    work: F,
    result: Option<StoreResult<R>>,
    reply: oneshot::Sender<StoreResult<R>>,
}

impl<R, F> WriteJob for Pending<R, F>
where
    R: Send,
    F: FnMut(&Connection) -> StoreResult<R> + Send,
{
    fn run(&mut self, conn: &Connection) -> bool {
        let result = (self.work)(conn);
        let ok = result.is_ok();
        self.result = Some(result);
        ok
    }

    fn answer(self: Box<Self>, failure: Option<String>) {
        let result = match (failure, self.result) {
            (Some(why), _) => Err(StoreError::Backend(why)),
            (None, Some(result)) => result,
            (None, None) => Err(StoreError::Backend("write: it was never run".into())),
        };
        // a caller that stopped waiting has nobody to tell
        let _ = self.reply.send(result);
    }
}

enum Job {
    Write(Box<dyn WriteJob>),
    /// Ends the writer thread after the jobs queued before it; answered when the connection is closed.
    Close(oneshot::Sender<()>),
}

/// The database: the writer thread's queue and the readers. Cloning shares them.
#[derive(Clone)]
pub struct Database {
    jobs: mpsc::Sender<Job>,
    readers: Arc<Readers>,
}

impl std::fmt::Debug for Database {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Database").field("location", &self.readers.location).finish_non_exhaustive()
    }
}

struct Readers {
    location: Location,
    idle: Mutex<Vec<Connection>>,
    /// For an in-memory database: the writer's connection, shared.
    writer: Option<Arc<Mutex<Connection>>>,
    closed: std::sync::atomic::AtomicBool,
    /// Dropping it stops the checkpointer.
    checkpoints: Mutex<Option<mpsc::Sender<()>>>,
}

impl Database {
    /// Opens the database, migrates it, and starts the writer thread.
    pub fn open(location: Location) -> StoreResult<Self> {
        if let Location::File(path) = &location {
            create_parent_dir(path)?;
        }
        let mut conn = open_connection(&location, false)?;
        migrate(&mut conn)?;
        let checkpoints = match &location {
            Location::File(_) => {
                // the writer never checkpoints: that work, and its fsync, is the checkpointer's
                conn.execute_batch("PRAGMA wal_autocheckpoint = 0").map_err(db("open the database"))?;
                Some(start_checkpointer(&location)?)
            }
            Location::Memory => None,
        };
        let conn = Arc::new(Mutex::new(conn));
        let (jobs, queue) = mpsc::channel();
        let writer = conn.clone();
        thread::Builder::new()
            .name("keel-sqlite-writer".into())
            .spawn(move || write_loop(writer, &queue))
            .map_err(|e| StoreError::Backend(format!("start the database writer: {e}")))?;
        let readers = Readers {
            writer: (location == Location::Memory).then_some(conn),
            location,
            idle: Mutex::new(Vec::new()),
            closed: std::sync::atomic::AtomicBool::new(false),
            checkpoints: Mutex::new(checkpoints),
        };
        Ok(Self { jobs, readers: Arc::new(readers) })
    }

    /// Runs `work` on the writer thread, in a transaction it may share with the other writes queued
    /// at that moment. `Err` from `work` means nothing of it is written, and the others are not
    /// affected: `work` may therefore run more than once (see [`run_group`]), and must give the same
    /// answer each time it runs on the same database. Answered after the shared `COMMIT`; if that
    /// fails, every write of the group is answered with the error and none of them was written. A
    /// caller that stops waiting does not withdraw its write.
    pub async fn write<R, F>(&self, work: F) -> StoreResult<R>
    where
        R: Send + 'static,
        F: FnMut(&Connection) -> StoreResult<R> + Send + 'static,
    {
        let (reply, answer) = oneshot::channel();
        let stopped = || StoreError::Backend("write: the database is closed".into());
        let job = Pending { work, result: None, reply };
        self.jobs.send(Job::Write(Box::new(job))).map_err(|_| stopped())?;
        answer.await.map_err(|_| stopped())?
    }

    /// Runs `work` on a reading connection, on this thread.
    pub fn read<R>(&self, work: impl FnOnce(&Connection) -> StoreResult<R>) -> StoreResult<R> {
        let readers = &self.readers;
        if readers.closed.load(std::sync::atomic::Ordering::Acquire) {
            return Err(StoreError::Backend("read: the database is closed".into()));
        }
        if let Some(writer) = &readers.writer {
            return work(&lock(writer));
        }
        let conn = match lock(&readers.idle).pop() {
            Some(conn) => conn,
            None => open_connection(&readers.location, true)?,
        };
        let result = work(&conn);
        let mut idle = lock(&readers.idle);
        if idle.len() < IDLE_READERS && !readers.closed.load(std::sync::atomic::Ordering::Acquire) {
            idle.push(conn);
        }
        result
    }

    /// Closes the readers and, after the writes queued before this call, the writer.
    pub async fn close(&self) {
        self.readers.closed.store(true, std::sync::atomic::Ordering::Release);
        lock(&self.readers.idle).clear();
        lock(&self.readers.checkpoints).take();
        let (done, closed) = oneshot::channel();
        if self.jobs.send(Job::Close(done)).is_ok() {
            let _ = closed.await;
        }
    }
}

/// Starts the checkpointer thread: every [`CHECKPOINT_EVERY`] it copies what the WAL holds into the
/// database file on its own connection, beside the writer (a passive checkpoint never blocks it).
/// Checkpoints are the only writes that wait for the disk (`synchronous = NORMAL` syncs at a
/// checkpoint, not at a commit), so they stay off the writer's path. Stops when the returned sender
/// is dropped.
fn start_checkpointer(location: &Location) -> StoreResult<mpsc::Sender<()>> {
    let conn = open_connection(location, false)?;
    let (stop, stopped) = mpsc::channel::<()>();
    thread::Builder::new()
        .name("keel-sqlite-checkpoint".into())
        .spawn(move || {
            while let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(CHECKPOINT_EVERY) {
                if let Err(e) = checkpoint(&conn) {
                    tracing::warn!(error = %e, "the WAL checkpoint failed; the next one retries");
                }
            }
        })
        .map_err(|e| StoreError::Backend(format!("start the database checkpointer: {e}")))?;
    Ok(stop)
}

fn checkpoint(conn: &Connection) -> rusqlite::Result<()> {
    let frames = |mode: &str| {
        conn.query_row(&format!("PRAGMA wal_checkpoint({mode})"), [], |r| {
            Ok((r.get::<_, i64>(1)?, r.get::<_, i64>(2)?))
        })
    };
    let (log, done) = frames("PASSIVE")?;
    if log > WAL_RESTART_FRAMES && done < log {
        frames("RESTART")?;
    }
    Ok(())
}

fn create_parent_dir(path: &Path) -> StoreResult<()> {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => {
            std::fs::create_dir_all(dir).map_err(|e| StoreError::Backend(format!("create the database directory: {e}")))
        }
        _ => Ok(()),
    }
}

/// The writer thread: takes the writes queued at that moment (at most [`MAX_GROUP`]), runs them as
/// one transaction, answers them. Ends when every handle is dropped, or at [`Job::Close`].
fn write_loop(conn: Arc<Mutex<Connection>>, queue: &mpsc::Receiver<Job>) {
    let mut group: Vec<Box<dyn WriteJob>> = Vec::with_capacity(MAX_GROUP);
    let mut close = None;
    while let Ok(first) = queue.recv() {
        let mut next = Some(first);
        while let Some(job) = next.take() {
            match job {
                Job::Write(w) => group.push(w),
                Job::Close(done) => {
                    close = Some(done);
                    break;
                }
            }
            if group.len() < MAX_GROUP {
                next = queue.try_recv().ok();
            }
        }
        if !group.is_empty() {
            let failure = run_group(&lock(&conn), &mut group);
            for job in group.drain(..) {
                job.answer(failure.clone());
            }
        }
        if close.is_some() {
            break;
        }
    }
    // Close the connection (SQLite checkpoints the WAL when its last connection closes) before
    // telling the closer. An in-memory database's connection is shared with its readers and lives as
    // long as they do.
    drop(conn);
    if let Some(done) = close {
        let _ = done.send(());
    }
}

/// Runs `group` in one transaction; `Some(error)` if the transaction failed as a whole.
///
/// Optimistically, without savepoints (a savepoint makes SQLite copy every page a write touches to a
/// statement journal first, which cost ~8% of the server's CPU): when a write fails, the whole
/// transaction is rolled back and the group runs again without it. The writes before it run again on
/// the same database state, so they give the same answers; refused writes are rare (lost races,
/// conflicts), and each one costs one more run of the writes before it.
fn run_group(conn: &Connection, group: &mut [Box<dyn WriteJob>]) -> Option<String> {
    let result = try_run_group(conn, group);
    if result.is_err() && !conn.is_autocommit() {
        let _ = conn.execute_batch("ROLLBACK");
    }
    result.err().map(|e| match e {
        StoreError::Backend(why) => why,
        other => other.to_string(),
    })
}

fn try_run_group(conn: &Connection, group: &mut [Box<dyn WriteJob>]) -> StoreResult<()> {
    let mut refused = vec![false; group.len()];
    'attempt: loop {
        conn.execute_batch("BEGIN IMMEDIATE").map_err(db("begin a transaction"))?;
        for (job, refused) in group.iter_mut().zip(refused.iter_mut()) {
            if *refused {
                continue;
            }
            if !job.run(conn) {
                *refused = true;
                conn.execute_batch("ROLLBACK").map_err(db("roll back"))?;
                continue 'attempt;
            }
        }
        if refused.iter().all(|r| *r) {
            conn.execute_batch("ROLLBACK").map_err(db("roll back"))?;
        } else {
            conn.execute_batch("COMMIT").map_err(db("commit"))?;
        }
        return Ok(());
    }
}

// --- migrations

/// The schema's migrations, in order: (version, description, SQL).
const MIGRATIONS: &[(i64, &str, &str)] = &[
    (1, "init", include_str!("../../migrations/sqlite/0001_init.sql")),
    (2, "credentials", include_str!("../../migrations/sqlite/0002_credentials.sql")),
    (3, "ag ui", include_str!("../../migrations/sqlite/0003_ag_ui.sql")),
    (4, "runs by user", include_str!("../../migrations/sqlite/0004_runs_by_user.sql")),
    (5, "interrupt notes", include_str!("../../migrations/sqlite/0005_interrupt_notes.sql")),
];

/// Applies the migrations the database lacks, each in its own transaction, recorded in
/// `_sqlx_migrations` (the table, and its checksums, of the migrator earlier versions used, so a
/// database they made opens as it is). Refuses a database whose applied migrations differ from these,
/// one a failed migration left half-done, and one migrated by a newer version.
fn migrate(conn: &mut Connection) -> StoreResult<()> {
    let fail = |e: rusqlite::Error| StoreError::Backend(format!("migrate the database: {e}"));
    conn.execute_batch(
        "CREATE TABLE IF NOT EXISTS _sqlx_migrations (
            version BIGINT PRIMARY KEY,
            description TEXT NOT NULL,
            installed_on TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP,
            success BOOLEAN NOT NULL,
            checksum BLOB NOT NULL,
            execution_time BIGINT NOT NULL
        )",
    )
    .map_err(fail)?;
    let applied: Vec<(i64, bool, Vec<u8>)> = {
        let mut st =
            conn.prepare("SELECT version, success, checksum FROM _sqlx_migrations ORDER BY version").map_err(fail)?;
        let rows = st.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?))).map_err(fail)?;
        rows.collect::<Result<_, _>>().map_err(fail)?
    };
    let refuse = |why: String| Err(StoreError::Backend(format!("migrate the database: {why}")));
    for (version, success, checksum) in &applied {
        let Some((_, _, sql)) = MIGRATIONS.iter().find(|(v, _, _)| v == version) else {
            return refuse(format!(
                "it was migrated to version {version} by a newer Keel, which this one does not know"
            ));
        };
        if !success {
            return refuse(format!("migration {version} failed part-way earlier; restore the database from a backup"));
        }
        if checksum.as_slice() != Sha384::digest(sql.as_bytes()).as_slice() {
            return refuse(format!("migration {version} differs from the one applied to this database"));
        }
    }
    for (version, description, sql) in MIGRATIONS {
        if applied.iter().any(|(v, _, _)| v == version) {
            continue;
        }
        let started = Instant::now();
        let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate).map_err(fail)?;
        tx.execute_batch(sql).map_err(fail)?;
        let elapsed = i64::try_from(started.elapsed().as_nanos()).unwrap_or(i64::MAX);
        tx.execute(
            "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
             VALUES (?, ?, 1, ?, ?)",
            rusqlite::params![version, description, Sha384::digest(sql.as_bytes()).as_slice(), elapsed],
        )
        .map_err(fail)?;
        tx.commit().map_err(fail)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job<F>(work: F) -> (Box<dyn WriteJob>, oneshot::Receiver<StoreResult<i64>>)
    where
        F: FnMut(&Connection) -> StoreResult<i64> + Send + 'static,
    {
        let (reply, answer) = oneshot::channel();
        (Box::new(Pending { work, result: None, reply }), answer)
    }

    fn insert(conn: &Connection, n: i64) -> StoreResult<i64> {
        conn.execute("INSERT INTO t (n) VALUES (?)", [n]).map_err(db("insert"))?;
        conn.query_row("SELECT COUNT(*) FROM t", [], |r| r.get(0)).map_err(db("count"))
    }

    /// A refused write leaves nothing behind; the others are written once, with the answers of the
    /// run that was committed.
    #[test]
    fn a_refused_write_in_a_group_is_alone_in_being_refused() {
        let conn = Connection::open_in_memory().unwrap();
        conn.execute_batch("CREATE TABLE t (n INTEGER PRIMARY KEY)").unwrap();
        let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = runs.clone();
        let (first, first_answer) = job(move |c| {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            insert(c, 1)
        });
        // writes, then fails: its row must not stay
        let (refused, refused_answer) = job(|c| {
            insert(c, 2)?;
            Err(StoreError::Conflict("no".into()))
        });
        let (duplicate, duplicate_answer) = job(|c| insert(c, 1));
        let (last, last_answer) = job(|c| insert(c, 3));
        let mut group = vec![first, refused, duplicate, last];
        assert_eq!(run_group(&conn, &mut group), None);
        for job in group {
            job.answer(None);
        }
        assert_eq!(first_answer.blocking_recv().unwrap().unwrap(), 1);
        assert!(matches!(refused_answer.blocking_recv().unwrap(), Err(StoreError::Conflict(_))));
        assert!(matches!(duplicate_answer.blocking_recv().unwrap(), Err(StoreError::Backend(_))));
        assert_eq!(last_answer.blocking_recv().unwrap().unwrap(), 2, "counted without the refused rows");
        let rows: Vec<i64> = {
            let mut st = conn.prepare("SELECT n FROM t ORDER BY n").unwrap();
            st.query_map([], |r| r.get(0)).unwrap().collect::<Result<_, _>>().unwrap()
        };
        assert_eq!(rows, [1, 3]);
        assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 3, "run again after each refusal");
        assert!(conn.is_autocommit(), "no transaction left open");
    }

    #[test]
    fn a_group_of_refused_writes_commits_nothing() {
        let conn = Connection::open_in_memory().unwrap();
        conn.execute_batch("CREATE TABLE t (n INTEGER PRIMARY KEY)").unwrap();
        let (a, a_answer) = job(|c| {
            insert(c, 1)?;
            Err(StoreError::Conflict("no".into()))
        });
        let mut group = vec![a];
        assert_eq!(run_group(&conn, &mut group), None);
        group.pop().unwrap().answer(None);
        assert!(a_answer.blocking_recv().unwrap().is_err());
        assert_eq!(conn.query_row("SELECT COUNT(*) FROM t", [], |r| r.get::<_, i64>(0)).unwrap(), 0);
    }
}
