//! The SQLite connections: one writer thread that owns the writing connection and runs group
//! transactions, the reading threads, and a checkpointer thread.
//!
//! **Why a thread and not a connection pool.** A statement on SQLite takes microseconds; handing it
//! to another thread and waking the waiting task afterwards costs more than that (two thread
//! switches, each ~10 µs on a small virtual machine). So a write is one closure sent to the writer
//! thread, which runs all its statements at once, and the closures queued at that moment share one
//! transaction: one hop there and one back per *group*, not per statement. Reads are one closure
//! too, run on one of a few reading threads, off the async runtime's worker threads
//! ([`super::readers`] says why and at what cost).
//!
//! **Brief reads on the writer's connection.** A reading connection's page cache is dropped
//! whole at its first read after any write (SQLite cannot tell which pages a commit changed), so
//! under load every read finds its pages again, through system calls, and takes its WAL lock with
//! a few more. The writer's connection keeps its cache across its own commits. A read of a few
//! rows by key — a run's context, an answer's view, a role — is therefore run by the writer thread
//! between two of its transactions ([`Database::read_brief`]), unless the writer is busy: more
//! than [`MAX_GROUP`] writes or [`MAX_BRIEF_READS`] such reads waiting send it to a reader.
//! Measured on the HITL flow at concurrency 32: ~10% less of the server's CPU a run, and 3.6
//! `pread`s a run instead of 17.7 (docs/benchmarks.md, "Fifteenth session"). A read that may be
//! long stays on the readers: a slow one here would hold up every write.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use keel_core::store::{StoreError, StoreResult};
use rusqlite::{Connection, OpenFlags, OptionalExtension};
use sha2::{Digest, Sha384};
use tokio::sync::{oneshot, watch};

use super::kept::{Conn, Kept};
use super::readers::{read_job, ReadJob, Readers};

const BUSY_TIMEOUT: Duration = Duration::from_secs(5);
/// Room for every statement shape, the multi-row event inserts included, so none is prepared again.
const STATEMENT_CACHE: usize = 256;

/// How often the checkpointer copies the WAL into the database file.
const CHECKPOINT_EVERY: Duration = Duration::from_millis(100);
/// With nothing new to copy, one tick in this many checkpoints all the same (once a second).
const IDLE_CHECKPOINT_EVERY: u32 = 10;
/// A WAL longer than this many frames (4 KiB pages, ~100 MiB) is restarted: the writer finishes
/// the checkpointer's copy between two of its transactions, and the next one writes the WAL from
/// its start again ([`restart_wal`]). A WAL file left longer (while a reader held it back) is cut
/// back to this length when it restarts.
const WAL_RESTART_FRAMES: i64 = 25_000;
/// The checkpointer's passes back to back before it asks the writer to restart the WAL: until at
/// most [`CATCH_UP_LEFT`] frames are left to copy, or this many.
const CATCH_UP_PASSES: usize = 4;
const CATCH_UP_LEFT: i64 = 256;
/// A WAL frame: its header and a page.
const WAL_FRAME_BYTES: i64 = 24 + 4096;
/// How long the writer waits for the readers' snapshots of the WAL to end when it restarts it.
const RESTART_WAIT: Duration = Duration::from_millis(20);
/// How long closing retries the last checkpoint while readers or a checkpoint hold it back.
const FINAL_CHECKPOINT_WAIT: Duration = Duration::from_secs(10);

/// The most write closures one group transaction takes. Bounded so that one group's transaction,
/// and the wait of its first caller, stay short.
const MAX_GROUP: usize = 64;

/// The most brief reads waiting for the writer thread; past it, or past [`MAX_GROUP`] writes
/// waiting, a brief read goes to a reading thread instead ([`Database::read_brief`]).
const MAX_BRIEF_READS: usize = 64;

/// How long a brief read waits for the writer thread before a reading thread takes it instead. A
/// group and the brief reads after it take a few milliseconds; a writer held this long is held by
/// something (a write waiting for a lock another process holds, a slow disk), and the read does
/// not wait for it ([`Database::read_brief`]).
const BRIEF_READ_PATIENCE: Duration = Duration::from_millis(100);

/// How many writes may wait for the writer thread by default (besides the group it is running).
/// A run's worker waits for each answer before it writes again, so the queue holds about one
/// write per busy worker or request: a few thousand is far more than a healthy server queues, and
/// small enough (each write holds its commit, at most a few hundred KiB) to bound the memory a
/// stalled disk can make the process hold.
pub const WRITE_QUEUE: usize = 4096;

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

pub fn open_connection(location: &Location, read_only: bool) -> StoreResult<Connection> {
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

pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // a panic while holding the lock leaves a connection or a list that is still usable
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// What a write that panicked answers: not the panic's message, which may quote the data.
const PANICKED: &str = "write: a write panicked; nothing of it was written";

/// One write, run by the writer thread inside a transaction.
trait WriteJob: Send {
    /// Runs the statements; `false` if they failed or panicked (the caller's error is kept for its
    /// answer). May run again, when the group's transaction was rolled back because another write
    /// failed: the last run's result is the one that counts.
    fn run(&mut self, conn: &Conn<'_, '_>) -> bool;
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
    F: FnMut(&Conn<'_, '_>) -> StoreResult<R> + Send,
{
    fn run(&mut self, conn: &Conn<'_, '_>) -> bool {
        // A panic is this write's failure alone: the group is rolled back and runs again without
        // it, like a refused write, and the writer thread lives on. The closure is not run again,
        // so whatever state the panic left in it is never seen.
        let result = catch_unwind(AssertUnwindSafe(|| (self.work)(conn)))
            .unwrap_or_else(|_| Err(StoreError::Backend(PANICKED.into())));
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
    /// A brief read, run after the group the writer takes it with ([`Database::read_brief`]).
    Read(ReadJob),
    /// Ends the writer thread after the jobs queued before it: waits for the reading threads and
    /// the checkpointer to end (their connections closed), checkpoints the whole WAL into the
    /// database file and closes the connection.
    Close(Closing),
}

/// The database: the writer thread's queue and the readers. Cloning shares them.
#[derive(Clone)]
pub struct Database {
    jobs: mpsc::Sender<Job>,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Database {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Database").field("location", &self.shared.location).finish_non_exhaustive()
    }
}

/// What the writer thread waits for before its last checkpoint.
struct Closing {
    readers: Vec<thread::JoinHandle<()>>,
    checkpointer: Option<Checkpointer>,
}

struct Shared {
    location: Location,
    readers: Readers,
    /// Writes sent to the writer thread that it has not taken yet, and how many may be.
    queued: Arc<AtomicUsize>,
    capacity: usize,
    /// Brief reads sent to the writer thread that it has not taken yet.
    brief_reads: Arc<AtomicUsize>,
    checkpointer: Mutex<Option<Checkpointer>>,
    /// `true` once the writer thread has closed its connection.
    writer_done: watch::Receiver<bool>,
}

impl Database {
    /// Opens the database, migrates it, and starts the writer thread. At most `write_queue`
    /// writes wait for it; more are refused with [`StoreError::Overloaded`].
    pub fn open(location: Location, write_queue: usize) -> StoreResult<Self> {
        Self::open_with(location, write_queue, CHECKPOINT_EVERY, WAL_RESTART_FRAMES)
    }

    /// [`Database::open`] with a checkpoint every `checkpoint_every`, and the WAL restarted past
    /// `wal_restart_frames` frames.
    fn open_with(
        location: Location,
        write_queue: usize,
        checkpoint_every: Duration,
        wal_restart_frames: i64,
    ) -> StoreResult<Self> {
        if let Location::File(path) = &location {
            create_parent_dir(path)?;
        }
        let mut conn = open_connection(&location, false)?;
        migrate(&mut conn)?;
        // The writer skips the schema's CHECK constraints. Every value it writes is typed in Rust
        // first: a status, role or state is an enum's name, and a JSON column is serde_json's
        // output, so no check could fail here. Checking cost ~5% of a HITL run's instructions
        // (each `json_valid` parses the whole text again: an event's data, a checkpoint, a tool's
        // result, on every write; docs/benchmarks.md, "Sixth session"). The checks stay in the
        // schema and hold for anything else that writes the file (the sqlite3 shell, a script);
        // migrations ran above, with them on.
        conn.execute_batch("PRAGMA ignore_check_constraints = ON").map_err(db("open the database"))?;
        let commits = Arc::new(AtomicU64::new(0));
        let restart = Arc::new(AtomicBool::new(false));
        let checkpointer = match &location {
            Location::File(_) => {
                // the writer never checkpoints while open: that work, and its fsync, is the
                // checkpointer's
                conn.execute_batch(&format!(
                    "PRAGMA wal_autocheckpoint = 0; PRAGMA journal_size_limit = {};",
                    wal_restart_frames * WAL_FRAME_BYTES
                ))
                .map_err(db("open the database"))?;
                let restart = (restart.clone(), wal_restart_frames);
                Some(Checkpointer::start(&location, checkpoint_every, commits.clone(), restart)?)
            }
            Location::Memory => None,
        };
        let conn = Arc::new(Mutex::new(conn));
        let (jobs, queue) = mpsc::channel();
        let queued = Arc::new(AtomicUsize::new(0));
        let brief_reads = Arc::new(AtomicUsize::new(0));
        let (done, writer_done) = watch::channel(false);
        let writer = Writer {
            conn: conn.clone(),
            queued: queued.clone(),
            brief_reads: brief_reads.clone(),
            file: location != Location::Memory,
            commits,
            restart: restart.clone(),
        };
        thread::Builder::new()
            .name("keel-sqlite-writer".into())
            .spawn(move || {
                writer.run(&queue);
                let _ = done.send(true);
            })
            .map_err(|e| StoreError::Backend(format!("start the database writer: {e}")))?;
        let readers = Readers::start(location.clone(), (location == Location::Memory).then_some(conn))?;
        let shared = Shared {
            location,
            readers,
            queued,
            capacity: write_queue,
            brief_reads,
            checkpointer: Mutex::new(checkpointer),
            writer_done,
        };
        Ok(Self { jobs, shared: Arc::new(shared) })
    }

    /// Runs `work` on the writer thread, in a transaction it may share with the other writes queued
    /// at that moment. `Err` from `work` (or a panic in it) means nothing of it is written, and the
    /// others are not affected: `work` may therefore run more than once (see [`run_group`]), and
    /// must give the same answer each time it runs on the same database. Answered after the shared
    /// `COMMIT`; if that fails, every write of the group is answered with the error and none of
    /// them was written. A caller that stops waiting does not withdraw its write. With the queue
    /// full, [`StoreError::Overloaded`] at once, and nothing is written.
    pub async fn write<R, F>(&self, work: F) -> StoreResult<R>
    where
        R: Send + 'static,
        F: FnMut(&Conn<'_, '_>) -> StoreResult<R> + Send + 'static,
    {
        self.submit(work)?.await.map_err(|_| closed("write"))?
    }

    /// Queues `work` for the writer thread ([`Database::write`] without the wait).
    fn submit<R, F>(&self, work: F) -> StoreResult<oneshot::Receiver<StoreResult<R>>>
    where
        R: Send + 'static,
        F: FnMut(&Conn<'_, '_>) -> StoreResult<R> + Send + 'static,
    {
        let queued = &self.shared.queued;
        if queued.fetch_add(1, Ordering::AcqRel) >= self.shared.capacity {
            queued.fetch_sub(1, Ordering::AcqRel);
            return Err(StoreError::Overloaded);
        }
        let (reply, answer) = oneshot::channel();
        let job = Pending { work, result: None, reply };
        self.jobs.send(Job::Write(Box::new(job))).map_err(|_| closed("write"))?;
        Ok(answer)
    }

    /// Runs `work` on a reading connection, on a reading thread: off the async runtime's worker
    /// threads, which a slow read (a big scan, a busy disk) would stall. A panic in `work` fails this
    /// read alone.
    pub async fn read<R, F>(&self, work: F) -> StoreResult<R>
    where
        R: Send + 'static,
        F: FnOnce(&Conn<'_, '_>) -> StoreResult<R> + Send + 'static,
    {
        self.shared.readers.read(work).await
    }

    /// Runs `work`, a read of a few rows by key, on the writer thread after the group it is
    /// queued with, where the pages it reads are most likely in the writer's cache; or, when the
    /// writer is busy (more than [`MAX_GROUP`] writes or [`MAX_BRIEF_READS`] such reads wait for
    /// it), on a reading thread, as [`Database::read`] does; and a read the writer has not begun
    /// within [`BRIEF_READ_PATIENCE`] is run by a reading thread instead (once: whichever thread
    /// takes `work` first runs it). It sees every write answered before
    /// it was called. What it writes (it should not) is rolled back, never written, and a panic
    /// in `work` fails this read alone. A read that may take long must use
    /// [`Database::read`]: here it would hold up every write queued behind it.
    pub async fn read_brief<R, F>(&self, work: F) -> StoreResult<R>
    where
        R: Send + 'static,
        F: FnOnce(&Conn<'_, '_>) -> StoreResult<R> + Send + 'static,
    {
        let shared = &self.shared;
        if shared.queued.load(Ordering::Acquire) >= MAX_GROUP {
            return shared.readers.read(work).await;
        }
        if shared.brief_reads.fetch_add(1, Ordering::AcqRel) >= MAX_BRIEF_READS {
            shared.brief_reads.fetch_sub(1, Ordering::AcqRel);
            return shared.readers.read(work).await;
        }
        // the work, for whichever thread takes it first: the writer, or a reader past the patience
        let work = Arc::new(Mutex::new(Some(work)));
        let (job, answer) = read_job({
            let work = work.clone();
            move |conn: &Conn<'_, '_>| match lock(&work).take() {
                Some(work) => work(conn).map(Some),
                // a reader took it: nobody waits for this answer
                None => Ok(None),
            }
        });
        if self.jobs.send(Job::Read(job)).is_err() {
            shared.brief_reads.fetch_sub(1, Ordering::AcqRel);
            return Err(closed("read"));
        }
        // The reply is dropped unsent only if the writer ended before it ran the read. `None`
        // would be a writer that found the work taken while this caller still waited for it.
        let ran = |read: Result<StoreResult<Option<R>>, oneshot::error::RecvError>| {
            read.map_err(|_| closed("read"))?
                .and_then(|read| read.ok_or_else(|| StoreError::Backend("read: taken by no thread".into())))
        };
        let mut answer = std::pin::pin!(answer);
        if let Ok(read) = tokio::time::timeout(BRIEF_READ_PATIENCE, &mut answer).await {
            return ran(read);
        }
        let taken = lock(&work).take();
        match taken {
            Some(work) => shared.readers.read(work).await,
            // the writer took it meanwhile: its answer comes
            None => ran(answer.await),
        }
    }

    /// Closes the readers and, after the writes queued before this call, the writer: the
    /// checkpointer is stopped, the whole WAL is copied into the database file and truncated, and
    /// the connection is closed before this returns, so the database file alone then holds every
    /// write. Later calls on any clone of the store are errors.
    pub async fn close(&self) {
        let readers = self.shared.readers.close();
        let checkpointer = lock(&self.shared.checkpointer).take();
        // past the queue's bound: a close is never refused
        let _ = self.jobs.send(Job::Close(Closing { readers, checkpointer }));
        // every close waits for the same end (a second one too, or one racing the first)
        let mut done = self.shared.writer_done.clone();
        let _ = done.wait_for(|done| *done).await;
    }
}

pub fn closed(what: &str) -> StoreError {
    StoreError::Backend(format!("{what}: the database is closed"))
}

/// The checkpointer thread: every [`CHECKPOINT_EVERY`] it copies what the WAL holds into the
/// database file on its own connection, beside the writer (a passive checkpoint never blocks it).
/// Checkpoints are the only writes that wait for the disk (`synchronous = NORMAL` syncs at a
/// checkpoint, not at a commit), so they stay off the writer's path. A tick after which the writer
/// committed nothing, when the last checkpoint copied the whole WAL, has nothing to copy and is
/// skipped (an idle server's ten checkpoints a second were about a fifth of its instructions); every
/// [`IDLE_CHECKPOINT_EVERY`]th tick checkpoints all the same, for a write from outside the writer.
struct Checkpointer {
    stop: mpsc::Sender<()>,
    thread: thread::JoinHandle<()>,
}

impl Checkpointer {
    /// `restart`: the flag that asks the writer to restart the WAL, and past how many frames.
    fn start(
        location: &Location,
        every: Duration,
        commits: Arc<AtomicU64>,
        (restart, restart_frames): (Arc<AtomicBool>, i64),
    ) -> StoreResult<Self> {
        let conn = open_connection(location, false)?;
        let (stop, stopped) = mpsc::channel::<()>();
        let thread = thread::Builder::new()
            .name("keel-sqlite-checkpoint".into())
            .spawn(move || {
                // the writer's commit count when the WAL was last copied whole (none yet)
                let mut copied: Option<u64> = None;
                let mut skipped = 0;
                while let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(every) {
                    let now = commits.load(Ordering::Acquire);
                    if copied == Some(now) && skipped + 1 < IDLE_CHECKPOINT_EVERY {
                        skipped += 1;
                        continue;
                    }
                    skipped = 0;
                    copied = match checkpoint(&conn, &restart, restart_frames) {
                        Ok(true) => Some(now),
                        Ok(false) => None,
                        Err(e) => {
                            tracing::warn!(error = %e, "the WAL checkpoint failed; the next one retries");
                            None
                        }
                    };
                }
            })
            .map_err(|e| StoreError::Backend(format!("start the database checkpointer: {e}")))?;
        Ok(Self { stop, thread })
    }

    /// Returns once the thread has ended and closed its connection.
    fn stop(self) {
        drop(self.stop);
        let _ = self.thread.join();
    }
}

/// One checkpoint; `true` if it copied the whole WAL. With more than `restart_frames` frames in
/// the WAL, passes follow back to back until little is left to copy, and the writer is asked to
/// restart the WAL (`restart`).
fn checkpoint(conn: &Connection, restart: &AtomicBool, restart_frames: i64) -> rusqlite::Result<bool> {
    let passive = || {
        conn.prepare_cached("PRAGMA wal_checkpoint(PASSIVE)")?
            .query_row([], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)?, r.get::<_, i64>(2)?)))
    };
    let (busy, mut log, mut done) = passive()?;
    if busy != 0 {
        return Ok(false);
    }
    if log > restart_frames {
        // What the writer wrote during that pass is copied by the next ones, each shorter, so
        // the writer has little left to copy when it restarts the WAL.
        let mut advanced = true;
        for _ in 0..CATCH_UP_PASSES {
            if log - done <= CATCH_UP_LEFT || !advanced {
                break;
            }
            let (busy, l, d) = passive()?;
            if busy != 0 {
                return Ok(false);
            }
            advanced = d > done;
            (log, done) = (l, d);
        }
        // A pass that copied nothing while frames were left was held back by a reader still on
        // older frames (a long read): the writer would only wait for it. The next tick asks again.
        if advanced || log - done <= CATCH_UP_LEFT {
            restart.store(true, Ordering::Release);
        }
    }
    Ok(done >= log)
}

/// Copies the whole WAL into the database file and truncates it, retrying for up to
/// [`FINAL_CHECKPOINT_WAIT`] while a reader or another checkpoint holds it back (SQLite reports
/// that as "busy", or as fewer frames copied than the WAL holds). `Err` says what is left.
fn final_checkpoint(conn: &Connection) -> Result<(), String> {
    let deadline = Instant::now() + FINAL_CHECKPOINT_WAIT;
    loop {
        let outcome = conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| {
            Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)?, r.get::<_, i64>(2)?))
        });
        let left = match outcome {
            Ok((0, log, done)) if done == log => return Ok(()),
            Ok((busy, log, done)) => format!("busy {busy}, {done} of {log} WAL frames copied"),
            Err(e) if matches!(e.sqlite_error_code(), Some(rusqlite::ErrorCode::DatabaseBusy)) => e.to_string(),
            Err(e) => return Err(e.to_string()),
        };
        if Instant::now() >= deadline {
            return Err(left);
        }
        // the busy handler already waited (BUSY_TIMEOUT) for what holds it; this is only a pause
        // between attempts
        thread::sleep(Duration::from_millis(10));
    }
}

fn create_parent_dir(path: &Path) -> StoreResult<()> {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => {
            std::fs::create_dir_all(dir).map_err(|e| StoreError::Backend(format!("create the database directory: {e}")))
        }
        _ => Ok(()),
    }
}

/// Runs a group's work on the writer's connection.
type WithConn<'a> = dyn FnMut(&mut dyn FnMut(&Conn<'_, '_>) -> Option<String>) -> Option<String> + 'a;

/// The writer thread's side of the database.
struct Writer {
    /// Set by the checkpointer when the WAL is long enough to restart ([`restart_wal`]).
    restart: Arc<AtomicBool>,
    conn: Arc<Mutex<Connection>>,
    queued: Arc<AtomicUsize>,
    brief_reads: Arc<AtomicUsize>,
    /// A file (not memory): it has a WAL to checkpoint at the end.
    file: bool,
    /// Transactions committed, for the checkpointer.
    commits: Arc<AtomicU64>,
}

impl Writer {
    /// Takes the writes queued at that moment (at most [`MAX_GROUP`]), runs them as one
    /// transaction, answers them. Ends when every handle is dropped, or at [`Job::Close`]; then
    /// checkpoints and closes the connection.
    fn run(self, queue: &mpsc::Receiver<Job>) {
        let close = if self.file {
            // The connection is this thread's alone: held for the thread's life, it keeps its
            // statements (`kept`).
            let conn = lock(&self.conn);
            let kept = Kept::default();
            let conn = Conn::new(&conn, Some(&kept));
            self.serve(queue, &mut |work| work(&conn))
        } else {
            // An in-memory database's connection is shared with the readers: taken for each group.
            self.serve(queue, &mut |work| work(&Conn::new(&lock(&self.conn), None)))
        };
        self.finish(close);
    }

    /// Runs the groups until every handle is dropped or a [`Job::Close`] comes (returned).
    /// `with_conn` gives each group the connection.
    fn serve(&self, queue: &mpsc::Receiver<Job>, with_conn: &mut WithConn<'_>) -> Option<Closing> {
        let mut group: Vec<Box<dyn WriteJob>> = Vec::with_capacity(MAX_GROUP);
        let mut reads: Vec<ReadJob> = Vec::new();
        let mut close = None;
        while let Ok(first) = queue.recv() {
            let mut next = Some(first);
            while let Some(job) = next.take() {
                match job {
                    Job::Write(w) => {
                        self.queued.fetch_sub(1, Ordering::AcqRel);
                        group.push(w);
                    }
                    Job::Read(read) => {
                        self.brief_reads.fetch_sub(1, Ordering::AcqRel);
                        reads.push(read);
                    }
                    Job::Close(closing) => {
                        close = Some(closing);
                        break;
                    }
                }
                if group.len() < MAX_GROUP {
                    next = queue.try_recv().ok();
                }
            }
            let wrote = !group.is_empty();
            if wrote {
                // A panic outside the writes themselves (they catch their own) fails the group, not
                // the thread.
                let failure = with_conn(&mut |conn: &Conn<'_, '_>| {
                    catch_unwind(AssertUnwindSafe(|| run_group(conn, &mut group))).unwrap_or_else(|_| {
                        if !conn.is_autocommit() {
                            let _ = conn.execute_batch("ROLLBACK");
                        }
                        Some("write: the group transaction panicked; nothing of it was written".into())
                    })
                });
                if failure.is_none() {
                    // (a group whose writes were all refused counts too: one checkpoint more)
                    self.commits.fetch_add(1, Ordering::Release);
                }
                for job in group.drain(..) {
                    job.answer(failure.clone());
                }
            }
            if !reads.is_empty() {
                with_conn(&mut |conn: &Conn<'_, '_>| {
                    run_brief_reads(conn, &mut reads);
                    None
                });
            }
            // after the answers and the reads: neither the group's callers nor the reads wait for
            // the copy (up to 20 ms for a reader's snapshot, and the copy's fsyncs)
            if wrote && self.file && self.restart.swap(false, Ordering::AcqRel) {
                with_conn(&mut |conn: &Conn<'_, '_>| {
                    restart_wal(conn);
                    None
                });
            }
            if close.is_some() {
                break;
            }
        }
        close
    }

    /// After the last write: the readers and the checkpointer ended (their connections closed, so
    /// no checkpoint of the checkpointer's races this one, and this connection is the last, which
    /// makes SQLite delete the -wal and -shm files), the WAL checkpointed whole, then the connection
    /// closed.
    fn finish(self, closing: Option<Closing>) {
        if let Some(closing) = closing {
            for reader in closing.readers {
                let _ = reader.join();
            }
            if let Some(checkpointer) = closing.checkpointer {
                checkpointer.stop();
            }
        }
        if self.file {
            if let Err(left) = final_checkpoint(&lock(&self.conn)) {
                tracing::warn!(
                    %left,
                    "closing the database: the WAL could not be checkpointed whole; the database file \
                     needs its -wal file beside it until the next open"
                );
            }
        }
        // An in-memory database's connection is shared with its readers and lives as long as they do.
        if let Ok(conn) = Arc::try_unwrap(self.conn) {
            let conn = conn.into_inner().unwrap_or_else(|poisoned| poisoned.into_inner());
            if let Err((_, e)) = conn.close() {
                tracing::warn!(error = %e, "closing the database connection failed");
            }
        }
    }
}

/// Finishes the checkpoint the checkpointer started, between two of the writer's transactions, so
/// that the next one writes the WAL from its start again.
///
/// **Why the writer.** SQLite writes from the WAL's start again only when a write transaction
/// begins with every frame of the WAL copied into the database file and no reader on a frame. A
/// checkpointer beside a writer that never pauses never sees that moment: the writer adds frames
/// while it copies, and its `RESTART` checkpoint needs the writer's lock, which a busy writer
/// takes again at once, so it waited `BUSY_TIMEOUT` (no checkpoint meanwhile) and gave up. The
/// WAL grew by every page written: 251–390 MiB after 3,096 HITL runs (docs/benchmarks.md,
/// "Fourteenth session"), and each of those frames was a page the file system had to add to the file. Here
/// the writer is between transactions, so what is left to copy is what it wrote since the
/// checkpointer's last pass, and the readers are waited for at most [`RESTART_WAIT`].
fn restart_wal(conn: &Conn<'_, '_>) {
    let _ = conn.busy_timeout(RESTART_WAIT);
    let outcome = conn.query_row("PRAGMA wal_checkpoint(RESTART)", [], |r| r.get::<_, i64>(0));
    let _ = conn.busy_timeout(BUSY_TIMEOUT);
    if let Err(e) = outcome {
        tracing::warn!(error = %e, "restarting the WAL failed; the checkpointer asks again");
    }
}

/// Runs `group` in one transaction; `Some(error)` if the transaction failed as a whole.
///
/// Optimistically, without savepoints (a savepoint makes SQLite copy every page a write touches to a
/// statement journal first, which cost ~8% of the server's CPU): when a write fails, the whole
/// transaction is rolled back and the group runs again without it. The writes before it run again on
/// the same database state, so they give the same answers; refused writes are rare (lost races,
/// conflicts, a panic), and each one costs one more run of the writes before it.
fn run_group(conn: &Conn<'_, '_>, group: &mut [Box<dyn WriteJob>]) -> Option<String> {
    let result = try_run_group(conn, group);
    if result.is_err() && !conn.is_autocommit() {
        let _ = conn.execute_batch("ROLLBACK");
    }
    result.err().map(|e| match e {
        StoreError::Backend(why) => why,
        other => other.to_string(),
    })
}

fn try_run_group(conn: &Conn<'_, '_>, group: &mut [Box<dyn WriteJob>]) -> StoreResult<()> {
    let mut refused = vec![false; group.len()];
    'attempt: loop {
        control(conn, "BEGIN IMMEDIATE", "begin a transaction")?;
        for (job, refused) in group.iter_mut().zip(refused.iter_mut()) {
            if *refused {
                continue;
            }
            if !job.run(conn) {
                *refused = true;
                // a write that panicked mid-statement may have left it unfinished: the rollback
                // undoes that too
                control(conn, "ROLLBACK", "roll back")?;
                continue 'attempt;
            }
        }
        if refused.iter().all(|r| *r) {
            control(conn, "ROLLBACK", "roll back")?;
        } else {
            control(conn, "COMMIT", "commit")?;
        }
        return Ok(());
    }
}

/// Runs the brief reads on the writer's connection, in one read transaction that is rolled back:
/// what a read writes (none should) is never written, and the reads share one snapshot and one WAL
/// lock. (`PRAGMA query_only` would refuse writes outright, but each change of it makes SQLite
/// prepare every statement of the connection again: measured, 12% more of the server's CPU.) A
/// read that panics answers its caller with an error (the read catches it itself). A read that
/// ends the transaction itself is logged, and the next ones get a transaction of their own.
fn run_brief_reads(conn: &Conn<'_, '_>, reads: &mut Vec<ReadJob>) {
    let mut begun = control(conn, "BEGIN", "begin the reads' transaction");
    for read in reads.drain(..) {
        if let Err(e) = &begun {
            read(Err(StoreError::Backend(e.to_string())));
            continue;
        }
        read(Ok(conn));
        if conn.is_autocommit() {
            tracing::error!("a brief read ended the writer's read transaction; what it wrote may be written");
            begun = control(conn, "BEGIN", "begin the reads' transaction");
        }
    }
    if !conn.is_autocommit() {
        let _ = control(conn, "ROLLBACK", "roll back");
    }
}

/// A transaction's `BEGIN`, `COMMIT` or `ROLLBACK`, prepared once and kept, as every other
/// statement is (`execute_batch` would parse it again each time: two of them per transaction).
fn control(conn: &Conn<'_, '_>, sql: &'static str, what: &'static str) -> StoreResult<()> {
    conn.prepare_kept(sql).and_then(|mut statement| statement.execute([])).map(drop).map_err(db(what))
}

// --- migrations

/// The schema's migrations, in order: (version, description, SQL).
const MIGRATIONS: &[(i64, &str, &str)] = &[
    (1, "init", include_str!("../../migrations/sqlite/0001_init.sql")),
    (2, "credentials", include_str!("../../migrations/sqlite/0002_credentials.sql")),
    (3, "ag ui", include_str!("../../migrations/sqlite/0003_ag_ui.sql")),
    (4, "runs by user", include_str!("../../migrations/sqlite/0004_runs_by_user.sql")),
    (5, "interrupt notes", include_str!("../../migrations/sqlite/0005_interrupt_notes.sql")),
    (6, "agents", include_str!("../../migrations/sqlite/0006_agents.sql")),
    (7, "run worker", include_str!("../../migrations/sqlite/0007_run_worker.sql")),
    (8, "checks without in lists", include_str!("../../migrations/sqlite/0008_checks_without_in_lists.sql")),
    (9, "retention", include_str!("../../migrations/sqlite/0009_retention.sql")),
    (10, "multitask", include_str!("../../migrations/sqlite/0010_multitask.sql")),
    (11, "rollback intent", include_str!("../../migrations/sqlite/0011_rollback_intent.sql")),
    (12, "run hidden", include_str!("../../migrations/sqlite/0012_run_hidden.sql")),
    (13, "event data format", include_str!("../../migrations/sqlite/0013_event_data_format.sql")),
];

/// Checksums a migration had before an edit that left what it does to an existing database alone:
/// (version, SHA-384 in hex). 0001 lost the demo's tables when the demo moved out of Keel's schema — a
/// database it made before still has them, and 0006 drops them.
const EARLIER_CHECKSUMS: &[(i64, &str)] =
    &[(1, "7dacd8512306d5144d88321e2ca1e29f1d8c1066737709f8d8f199a8e20e854179aca18e308923eb0b099d222245376a")];

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Applies the migrations the database lacks, each in its own transaction, recorded in
/// `_sqlx_migrations` (the table, and its checksums, of the migrator earlier versions used, so a
/// database they made opens as it is). Refuses a database whose applied migrations differ from these,
/// one a failed migration left half-done, and one migrated by a newer version.
fn migrate(conn: &mut Connection) -> StoreResult<()> {
    let fail = |e: rusqlite::Error| StoreError::Backend(format!("migrate the database: {e}"));
    // A new database gives the pages that retention frees back to the file system (`PRAGMA
    // incremental_vacuum` after a prune). The mode is fixed once a table exists: a database made
    // before keeps reusing freed pages instead, until converted (docs/operations.md, "Retention").
    let tables: i64 = conn.query_row("SELECT count(*) FROM sqlite_master", [], |r| r.get(0)).map_err(fail)?;
    if tables == 0 {
        // (WAL mode, set when the connection opened, already wrote the file's header: the new mode
        // takes a VACUUM, instant on an empty file.)
        conn.execute_batch("PRAGMA auto_vacuum = INCREMENTAL; VACUUM;").map_err(fail)?;
    }
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
        let earlier = EARLIER_CHECKSUMS.iter().any(|(v, sum)| v == version && *sum == hex(checksum));
        if checksum.as_slice() != Sha384::digest(sql.as_bytes()).as_slice() && !earlier {
            return refuse(format!("migration {version} differs from the one applied to this database"));
        }
    }
    let pending: Vec<_> =
        MIGRATIONS.iter().filter(|(version, _, _)| !applied.iter().any(|(v, _, _)| v == version)).collect();
    if pending.is_empty() {
        return Ok(());
    }
    // A migration that rebuilds a table (SQLite cannot change a constraint in place) drops a
    // table other tables refer to: foreign keys are off while migrations run, as SQLite's ALTER
    // TABLE procedure has it, and each migration is checked against them before it commits.
    // (The pragma is a no-op inside a transaction, so it is set between them.)
    conn.execute_batch("PRAGMA foreign_keys = OFF").map_err(fail)?;
    let migrated = apply_migrations(conn, &pending);
    conn.execute_batch("PRAGMA foreign_keys = ON").map_err(fail)?;
    migrated
}

fn apply_migrations(conn: &mut Connection, pending: &[&(i64, &str, &str)]) -> StoreResult<()> {
    let fail = |e: rusqlite::Error| StoreError::Backend(format!("migrate the database: {e}"));
    for (version, description, sql) in pending {
        let started = Instant::now();
        let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate).map_err(fail)?;
        tx.execute_batch(sql).map_err(fail)?;
        let broken: Option<String> = tx
            .query_row("SELECT \"table\" FROM pragma_foreign_key_check LIMIT 1", [], |r| r.get(0))
            .optional()
            .map_err(fail)?;
        if let Some(table) = broken {
            return Err(StoreError::Backend(format!(
                "migrate the database: migration {version} would leave rows of {table} referring to rows that do not exist"
            )));
        }
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
        let mut work = work;
        (Box::new(Pending { work: move |c: &Conn<'_, '_>| work(c), result: None, reply }), answer)
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
        assert_eq!(run_group(&Conn::new(&conn, None), &mut group), None);
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

    /// A database file with a table `t`, and a way to hold the writer thread inside a write.
    async fn open_with_table(dir: &tempfile::TempDir, write_queue: usize) -> Database {
        let database = Database::open(Location::File(dir.path().join("t.db")), write_queue).unwrap();
        database
            .write(|c| c.execute_batch("CREATE TABLE t (n INTEGER PRIMARY KEY)").map_err(db("create")))
            .await
            .unwrap();
        database
    }

    /// Queues a write that holds the writer thread until the returned sender is dropped or sent to,
    /// and returns once the writer is inside it (so it is no longer counted as queued).
    fn block_the_writer(database: &Database) -> (mpsc::Sender<()>, oneshot::Receiver<StoreResult<()>>) {
        let (release, released) = mpsc::channel::<()>();
        let (inside, is_inside) = mpsc::channel::<()>();
        let answer = database
            .submit(move |_| {
                let _ = inside.send(());
                let _ = released.recv();
                Ok(())
            })
            .unwrap();
        is_inside.recv_timeout(Duration::from_secs(30)).expect("the writer runs the blocking write");
        (release, answer)
    }

    fn rows(database: &Database) -> Vec<i64> {
        let conn = open_connection(&database.shared.location, true).unwrap();
        let mut st = conn.prepare("SELECT n FROM t ORDER BY n").unwrap();
        st.query_map([], |r| r.get(0)).unwrap().collect::<Result<_, _>>().unwrap()
    }

    /// With `write_queue` writes waiting, the next one is refused at once with `Overloaded`; every
    /// write accepted before it is then written and answered.
    #[tokio::test]
    async fn a_full_queue_refuses_the_next_write_and_keeps_every_accepted_one() {
        let dir = tempfile::TempDir::new().unwrap();
        let database = open_with_table(&dir, 8).await;
        let (release, blocker) = block_the_writer(&database);
        let accepted: Vec<_> = (1..=8).map(|n| database.submit(move |c| insert(c, n)).unwrap()).collect();
        let refused = database.submit(move |c| insert(c, 100));
        assert!(matches!(refused, Err(StoreError::Overloaded)), "{:?}", refused.map(|_| ()));
        assert!(matches!(database.write(move |c| insert(c, 101)).await, Err(StoreError::Overloaded)));

        release.send(()).unwrap();
        blocker.await.unwrap().unwrap();
        for answer in accepted {
            answer.await.unwrap().expect("an accepted write is written");
        }
        assert_eq!(rows(&database), (1..=8).collect::<Vec<_>>(), "every accepted write, none refused");
        // the queue drained: writes are accepted again
        assert_eq!(database.write(move |c| insert(c, 9)).await.unwrap(), 9);
        database.close().await;
    }

    /// A brief read does not wait for a writer held up (here by a write that waits on this test):
    /// past [`BRIEF_READ_PATIENCE`] a reading thread answers it, and the writer, once free, finds
    /// it taken and runs it not again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_brief_read_does_not_wait_for_a_writer_held_up() {
        let dir = tempfile::TempDir::new().unwrap();
        let database = open_with_table(&dir, 64).await;
        database.write(|c| insert(c, 1)).await.unwrap();
        let (release, blocker) = block_the_writer(&database);
        let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let started = Instant::now();
        let counted = runs.clone();
        let (count, thread) = tokio::time::timeout(
            Duration::from_secs(10),
            database.read_brief(move |c| {
                counted.fetch_add(1, Ordering::SeqCst);
                let count: i64 = c.query_row("SELECT COUNT(*) FROM t", [], |r| r.get(0)).map_err(db("count"))?;
                Ok((count, thread::current().name().map(str::to_owned)))
            }),
        )
        .await
        .expect("answered while the writer is held")
        .unwrap();
        assert_eq!(count, 1, "it sees the write answered before it");
        assert!(started.elapsed() >= BRIEF_READ_PATIENCE, "the writer had its chance first");
        assert!(thread.is_some_and(|n| n.starts_with("keel-sqlite-reader")), "a reading thread answered");

        release.send(()).unwrap();
        blocker.await.unwrap().unwrap();
        // the writer has taken the read from its queue, found it taken, and gone on
        assert_eq!(database.write(|c| insert(c, 2)).await.unwrap(), 2);
        assert_eq!(runs.load(Ordering::SeqCst), 1, "run once");
        // with the writer free, a brief read is its again
        let on = database.read_brief(|_| Ok(thread::current().name().map(str::to_owned))).await.unwrap();
        assert!(on.is_some_and(|n| !n.starts_with("keel-sqlite-reader")), "the writer's thread");
        database.close().await;
    }

    /// A write that panics fails alone, with an answer that does not quote the panic; the writes
    /// grouped with it are written once, and the writer thread keeps serving.
    #[tokio::test]
    async fn a_write_that_panics_fails_alone_and_the_writer_lives_on() {
        let dir = tempfile::TempDir::new().unwrap();
        let database = open_with_table(&dir, 64).await;
        let (release, blocker) = block_the_writer(&database);
        let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = runs.clone();
        let before = database
            .submit(move |c| {
                counted.fetch_add(1, Ordering::SeqCst);
                insert(c, 1)
            })
            .unwrap();
        let panics = database
            .submit(|c| -> StoreResult<i64> {
                insert(c, 2)?;
                panic!("secret-payload-42")
            })
            .unwrap();
        let after = database.submit(|c| insert(c, 3)).unwrap();
        release.send(()).unwrap();
        blocker.await.unwrap().unwrap();

        assert_eq!(before.await.unwrap().unwrap(), 1);
        match panics.await.unwrap() {
            Err(StoreError::Backend(why)) => {
                assert!(why.contains("panicked"), "{why}");
                assert!(!why.contains("secret-payload"), "the panic's text is not in the answer: {why}");
            }
            other => panic!("expected a backend error, got {other:?}"),
        }
        assert_eq!(after.await.unwrap().unwrap(), 2, "counted without the panicking write's row");
        assert_eq!(runs.load(Ordering::SeqCst), 2, "one group: run again without the write that panicked");
        assert_eq!(rows(&database), [1, 3]);

        // alone in its group too, and the thread still serves
        let alone = database.write(|c| -> StoreResult<i64> { panic!("again {}", insert(c, 4)?) }).await;
        assert!(matches!(alone, Err(StoreError::Backend(_))), "{alone:?}");
        assert_eq!(database.write(|c| insert(c, 5)).await.unwrap(), 3);
        assert_eq!(rows(&database), [1, 3, 5]);
        database.close().await;
    }

    /// Reads run on the reading threads, never on the caller's: a read that blocks leaves the
    /// runtime's one thread free, and other reads are answered meanwhile.
    #[tokio::test(flavor = "current_thread")]
    async fn a_slow_read_blocks_neither_the_runtime_nor_the_other_reads() {
        let dir = tempfile::TempDir::new().unwrap();
        let database = open_with_table(&dir, 64).await;
        let caller = thread::current().id();
        let (release, released) = mpsc::channel::<()>();
        let (inside, is_inside) = oneshot::channel::<()>();
        let slow = tokio::spawn({
            let database = database.clone();
            async move {
                database
                    .read(move |_| {
                        let _ = inside.send(());
                        // the deadline only keeps a broken build from hanging the test
                        let waited = released.recv_timeout(Duration::from_secs(30));
                        Ok((thread::current().id(), waited.is_ok()))
                    })
                    .await
            }
        });
        is_inside.await.unwrap();
        // The runtime's thread still runs other tasks: this one, and the read it waits for, once the
        // slow read has run long enough for another reader to be woken (asked again until then).
        let deadline = Instant::now() + Duration::from_secs(30);
        let (reader, name) = loop {
            let read = database.read(|c| {
                c.query_row("SELECT COUNT(*) FROM t", [], |r| r.get::<_, i64>(0)).map_err(db("count"))?;
                Ok((thread::current().id(), thread::current().name().map(str::to_owned)))
            });
            match tokio::time::timeout(Duration::from_millis(20), read).await {
                Ok(answer) => break answer.unwrap(),
                Err(_) => assert!(Instant::now() < deadline, "no read was answered while another was slow"),
            }
        };
        assert_ne!(reader, caller, "the read ran on the caller's thread");
        assert!(name.is_some_and(|n| n.starts_with("keel-sqlite-reader")), "a reading thread");
        release.send(()).unwrap();
        let (slow_reader, was_released) = slow.await.unwrap().unwrap();
        assert!(was_released, "the slow read was released by this task, so the runtime was not blocked");
        assert_ne!(slow_reader, caller);
        database.close().await;
    }

    /// A database checkpointed every 5 ms (what is written between two checkpoints comes on top of
    /// the bound) and whose WAL is restarted past 256 frames (~1 MiB), with a table `t` of a page a
    /// row ([`insert_page`]).
    async fn open_restarting_early(dir: &tempfile::TempDir) -> Database {
        let location = Location::File(dir.path().join("t.db"));
        let database = Database::open_with(location, 4_096, Duration::from_millis(5), 256).unwrap();
        database
            .write(|c| c.execute_batch("CREATE TABLE t (n INTEGER PRIMARY KEY, b BLOB NOT NULL)").map_err(db("create")))
            .await
            .unwrap();
        database
    }

    fn insert_page(c: &Connection, n: i64) -> StoreResult<usize> {
        c.execute("INSERT INTO t (n, b) VALUES (?1, zeroblob(4000))", [n]).map_err(db("insert"))
    }

    /// Writes that never pause, with reads beside them, keep the WAL bounded: once the checkpointer
    /// has copied most of it, the writer restarts it between two transactions, and the file is cut
    /// back. (Before, a writer that never paused kept the checkpointer from restarting it, and the
    /// WAL grew by every page written, never cut back: past 128 MiB here.)
    ///
    /// What is checked is that the WAL is cut back while the writes go on. How long it grows
    /// between two restarts depends on when the checkpointer's thread gets a core: on a quiet
    /// machine under 40 MiB here, but 112 MiB once when the test suite's other tests loaded both
    /// cores. The bound a server keeps under load is a benchmark's figure (docs/benchmarks.md,
    /// "Fourteenth session").
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_wal_stays_bounded_while_writes_never_pause() {
        const WRITERS: i64 = 32;
        const ROWS: i64 = 1_000;
        let dir = tempfile::TempDir::new().unwrap();
        let database = open_restarting_early(&dir).await;
        let stop = Arc::new(AtomicBool::new(false));
        // the WAL file's length, as each write finds it: the longest, the last, and how many times
        // it was found shorter than the write before found it (cut back by a restart)
        let longest = Arc::new(AtomicU64::new(0));
        let last = Arc::new(AtomicU64::new(0));
        let cut = Arc::new(AtomicU64::new(0));
        let wal = Arc::new(dir.path().join("t.db-wal"));
        // reads beside the writes, as a server makes them
        let reads = tokio::spawn({
            let (database, stop) = (database.clone(), stop.clone());
            async move {
                let mut reads = 0;
                while !stop.load(Ordering::Acquire) {
                    database
                        .read(|c| {
                            c.query_row("SELECT max(n) FROM t", [], |r| r.get::<_, Option<i64>>(0)).map_err(db("read"))
                        })
                        .await
                        .unwrap();
                    reads += 1;
                }
                reads
            }
        });
        // a page a row: 32,000 pages (125 MiB) written, at least one WAL frame each
        let writers: Vec<_> = (0..WRITERS)
            .map(|w| {
                let (database, wal) = (database.clone(), wal.clone());
                let (longest, last, cut) = (longest.clone(), last.clone(), cut.clone());
                tokio::spawn(async move {
                    for i in 0..ROWS {
                        let n = w * ROWS + i;
                        let (longest, last, cut, wal) = (longest.clone(), last.clone(), cut.clone(), wal.clone());
                        database
                            .write(move |c| {
                                // the writes are one after the other: so are these readings
                                let length = std::fs::metadata(&*wal).map_or(0, |m| m.len());
                                longest.fetch_max(length, Ordering::Relaxed);
                                if length < last.swap(length, Ordering::Relaxed) {
                                    cut.fetch_add(1, Ordering::Relaxed);
                                }
                                insert_page(c, n)
                            })
                            .await
                            .unwrap();
                    }
                })
            })
            .collect();
        for writer in writers {
            writer.await.unwrap();
        }
        stop.store(true, Ordering::Release);
        let (reads, longest, cut) =
            (reads.await.unwrap(), longest.load(Ordering::Relaxed), cut.load(Ordering::Relaxed));
        assert!(reads > 0);
        assert!(longest > 0, "the WAL was sampled");
        // ~125 MiB of pages written, the WAL restarted past ~1 MiB: cut back ~200 times on a quiet
        // machine, and as often with three busy loops beside the test; without the restart never,
        // and 632 MiB long at the end
        assert!(cut >= 1, "the WAL was cut back {cut} times while the writes went on (longest {} MiB)", longest >> 20);
        let count =
            database.read(|c| c.query_row("SELECT count(*) FROM t", [], |r| r.get::<_, i64>(0)).map_err(db("count")));
        assert_eq!(count.await.unwrap(), WRITERS * ROWS, "every write is kept");
        database.close().await;
    }

    /// A long read holds the WAL's copy back, and with it the restart, without holding up the
    /// writes; once it ends, the WAL is restarted and cut back.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_long_read_holds_the_restart_back_but_not_the_writes() {
        let dir = tempfile::TempDir::new().unwrap();
        let database = open_restarting_early(&dir).await;
        let wal = dir.path().join("t.db-wal");
        let write_pages = |from: i64, rows: i64| {
            let database = database.clone();
            async move {
                for n in from..from + rows {
                    database.write(move |c| insert_page(c, n)).await.unwrap();
                }
            }
        };
        // a read that keeps its snapshot until released
        let (release, released) = mpsc::channel::<()>();
        let (inside, is_inside) = oneshot::channel::<()>();
        let long = tokio::spawn({
            let database = database.clone();
            async move {
                database
                    .read(move |c| {
                        c.execute_batch("BEGIN").map_err(db("begin"))?;
                        let before: i64 =
                            c.query_row("SELECT count(*) FROM t", [], |r| r.get(0)).map_err(db("count"))?;
                        let _ = inside.send(());
                        // the deadline only keeps a broken build from hanging the test
                        let _ = released.recv_timeout(Duration::from_secs(60));
                        let after: i64 =
                            c.query_row("SELECT count(*) FROM t", [], |r| r.get(0)).map_err(db("count"))?;
                        c.execute_batch("COMMIT").map_err(db("commit"))?;
                        Ok((before, after))
                    })
                    .await
            }
        });
        is_inside.await.unwrap();
        // 2,000 pages written while it reads: the WAL cannot restart, and the writes go on
        tokio::time::timeout(Duration::from_secs(60), write_pages(0, 2_000)).await.expect("the writes went on");
        let held = std::fs::metadata(&wal).unwrap().len();
        assert!(held > 2_000 * 4_096, "the WAL kept the frames the read may need: {held} bytes");
        release.send(()).unwrap();
        let (before, after) = long.await.unwrap().unwrap();
        assert_eq!((before, after), (0, 0), "the read kept its snapshot");
        // once the read is over, writes restart the WAL, which is cut back to ~1 MiB
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut next = 2_000;
        loop {
            write_pages(next, 50).await;
            next += 50;
            let length = std::fs::metadata(&wal).unwrap().len();
            if length < 4 << 20 {
                break;
            }
            assert!(Instant::now() < deadline, "the WAL was not restarted after the read: {length} bytes");
        }
        database.close().await;
    }

    /// A read that panics fails alone; the reading threads go on serving.
    #[tokio::test]
    async fn a_read_that_panics_fails_alone() {
        let dir = tempfile::TempDir::new().unwrap();
        let database = open_with_table(&dir, 64).await;
        for _ in 0..super::super::readers::READERS + 1 {
            let panicked = database.read(|_| -> StoreResult<()> { panic!("secret-payload-7") }).await;
            match panicked {
                Err(StoreError::Backend(why)) => assert!(!why.contains("secret"), "{why}"),
                other => panic!("expected a backend error, got {other:?}"),
            }
        }
        assert_eq!(database.write(|c| insert(c, 1)).await.unwrap(), 1);
        assert_eq!(rows(&database), [1]);
        let n = database
            .read(|c| c.query_row("SELECT COUNT(*) FROM t", [], |r| r.get::<_, i64>(0)).map_err(db("count")))
            .await;
        assert_eq!(n.unwrap(), 1);
        database.close().await;
        assert!(matches!(database.read(|_| Ok(())).await, Err(StoreError::Backend(_))), "closed");
    }

    /// The thread a read ran on, and the rows of `t` it saw.
    fn where_and_count(c: &Conn<'_, '_>) -> StoreResult<(String, i64)> {
        let count = c.query_row("SELECT COUNT(*) FROM t", [], |r| r.get(0)).map_err(db("count"))?;
        Ok((thread::current().name().unwrap_or_default().to_owned(), count))
    }

    /// Waits until `n` brief reads are queued for the writer thread.
    async fn until_brief_reads_queued(database: &Database, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while database.shared.brief_reads.load(Ordering::Acquire) < n {
            assert!(Instant::now() < deadline, "the brief reads are queued");
            tokio::task::yield_now().await;
        }
    }

    /// A brief read queued behind writes runs on the writer thread once their group is committed,
    /// and sees them.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_brief_read_runs_on_the_writer_after_its_group_and_sees_its_writes() {
        let dir = tempfile::TempDir::new().unwrap();
        let database = open_with_table(&dir, 64).await;
        let (release, blocker) = block_the_writer(&database);
        let written = database.submit(|c| insert(c, 1)).unwrap();
        let reader = database.clone();
        let read = tokio::spawn(async move { reader.read_brief(where_and_count).await });
        until_brief_reads_queued(&database, 1).await;
        release.send(()).unwrap();
        blocker.await.unwrap().unwrap();
        assert_eq!(written.await.unwrap().unwrap(), 1);
        let (thread, count) = read.await.unwrap().unwrap();
        assert_eq!(thread, "keel-sqlite-writer");
        assert_eq!(count, 1, "the write queued before it is committed and seen");
        assert_eq!(database.shared.brief_reads.load(Ordering::Acquire), 0);
        database.close().await;
    }

    /// What a brief read writes is rolled back, never written; one that panics fails alone; one
    /// that leaves a transaction open does not hold the writer. The writes after them go on.
    #[tokio::test]
    async fn a_brief_read_writes_nothing_and_one_that_panics_fails_alone() {
        let dir = tempfile::TempDir::new().unwrap();
        let database = open_with_table(&dir, 64).await;
        database.read_brief(|c| insert(c, 7)).await.unwrap();
        assert_eq!(rows(&database), [0_i64; 0], "the brief read's row is not written");
        let panicked = database.read_brief(|_| -> StoreResult<()> { panic!("secret-payload-9") }).await;
        match panicked {
            Err(StoreError::Backend(why)) => assert!(why.contains("panicked") && !why.contains("secret"), "{why}"),
            other => panic!("expected a backend error, got {other:?}"),
        }
        let opened =
            database.read_brief(|c| c.execute_batch("SAVEPOINT s; SELECT COUNT(*) FROM t;").map_err(db("open"))).await;
        assert!(opened.is_ok(), "{opened:?}");
        assert_eq!(database.write(|c| insert(c, 1)).await.unwrap(), 1, "no transaction left open");
        assert_eq!(rows(&database), [1]);
        assert_eq!(database.read_brief(where_and_count).await.unwrap().1, 1);
        database.close().await;
        match database.read_brief(|_| Ok(())).await {
            Err(StoreError::Backend(why)) => assert!(why.contains("closed"), "{why}"),
            other => panic!("expected the database closed, got {other:?}"),
        }
    }

    /// While the writer is busy — [`MAX_GROUP`] writes or [`MAX_BRIEF_READS`] brief reads
    /// waiting for it — a brief read is served by a reading thread, without waiting for it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_brief_read_goes_to_a_reader_while_the_writer_is_busy() {
        let dir = tempfile::TempDir::new().unwrap();
        let database = open_with_table(&dir, 4 * MAX_GROUP).await;
        let (release, blocker) = block_the_writer(&database);

        // brief reads waiting: the next one goes to a reader
        let waiting: Vec<_> = (0..MAX_BRIEF_READS)
            .map(|_| {
                let reader = database.clone();
                tokio::spawn(async move { reader.read_brief(where_and_count).await })
            })
            .collect();
        until_brief_reads_queued(&database, MAX_BRIEF_READS).await;
        let (thread, _) = database.read_brief(where_and_count).await.unwrap();
        assert!(thread.starts_with("keel-sqlite-reader"), "{thread}");

        // writes waiting: the same
        let writes: Vec<_> = (1..=MAX_GROUP as i64).map(|n| database.submit(move |c| insert(c, n)).unwrap()).collect();
        let (thread, count) = database.read_brief(where_and_count).await.unwrap();
        assert!(thread.starts_with("keel-sqlite-reader"), "{thread}");
        assert_eq!(count, 0, "the writer is still held");

        release.send(()).unwrap();
        blocker.await.unwrap().unwrap();
        for write in writes {
            write.await.unwrap().unwrap();
        }
        for read in waiting {
            assert_eq!(read.await.unwrap().unwrap().0, "keel-sqlite-writer");
        }
        // the writer is free again: brief reads go to it
        assert_eq!(
            database.read_brief(where_and_count).await.unwrap(),
            ("keel-sqlite-writer".to_owned(), MAX_GROUP as i64)
        );
        database.close().await;
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
        assert_eq!(run_group(&Conn::new(&conn, None), &mut group), None);
        group.pop().unwrap().answer(None);
        assert!(a_answer.blocking_recv().unwrap().is_err());
        assert_eq!(conn.query_row("SELECT COUNT(*) FROM t", [], |r| r.get::<_, i64>(0)).unwrap(), 0);
    }
}
