//! The reading threads: every read runs on one of them, on its own read-only connection, and never
//! on a thread of the async runtime, where a slow read (a big scan, a busy disk) would stall every
//! other task of that worker.
//!
//! A read costs a hop there and back (thread switches of a few µs, more than most reads take), so
//! the pool keeps the switches few: a reader that finishes a read takes the next one queued without
//! sleeping, and a sleeping reader is woken only when no reader that is awake will come to the new
//! read soon, that is when every awake reader is on a read that has run longer than [`SLOW_READ`].
//! So reads are mostly served by one thread, one after the other (waking another reader for each
//! read that arrives while one is busy cost 2.5 times the switches in the benchmark), and a slow
//! one holds up the others for about that long at most, as long as reads keep coming (a new read
//! is what wakes another reader). docs/benchmarks.md ("Reads off the async
//! threads") has the measurements and the options that were tried (`block_in_place`,
//! `spawn_blocking`, reading in place).

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use keel_core::store::{StoreError, StoreResult};
use rusqlite::Connection;
use tokio::sync::oneshot;

use super::db::{closed, lock, open_connection, Location};
use super::kept::{Conn, Kept};

/// How many reading threads, each with its connection. Most reads are served by one of them; the
/// others take the reads that arrive while slow ones run.
pub const READERS: usize = 4;

/// A read running longer than this is slow: the next read wakes another reader instead of waiting
/// for it. Reads are index lookups of microseconds to a few hundred.
const SLOW_READ: Duration = Duration::from_millis(1);

/// A read, given its thread's connection (or why there is none). The writer thread runs them too
/// (the brief reads, [`super::db::Database::read_brief`]).
pub(super) type ReadJob = Box<dyn FnOnce(StoreResult<&Conn<'_, '_>>) + Send>;

/// `work` as a read to queue, and where its answer comes: a panic in `work` answers with an error
/// (its text left out), so a read whose answer never comes was never run (the database closed).
pub(super) fn read_job<R, F>(work: F) -> (ReadJob, oneshot::Receiver<StoreResult<R>>)
where
    R: Send + 'static,
    F: FnOnce(&Conn<'_, '_>) -> StoreResult<R> + Send + 'static,
{
    let (reply, answer) = oneshot::channel();
    let job: ReadJob = Box::new(move |conn| {
        let read = catch_unwind(AssertUnwindSafe(|| conn.and_then(work)))
            .unwrap_or_else(|_| Err(StoreError::Backend("read: it panicked".into())));
        // a caller that stopped waiting has nobody to tell
        let _ = reply.send(read);
    });
    (job, answer)
}

pub struct Readers {
    shared: Arc<Shared>,
    threads: Mutex<Vec<thread::JoinHandle<()>>>,
}

struct Shared {
    queue: Mutex<Queue>,
    ready: Condvar,
    location: Location,
    /// For an in-memory database: the writer's connection, shared (any other connection would see
    /// another, empty, database).
    writer: Option<Arc<Mutex<Connection>>>,
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<ReadJob>,
    /// Readers asleep, and how many of them were woken and have not taken a read yet.
    idle: usize,
    woken: usize,
    /// When each reader's current read started; `None` between reads.
    started: [Option<Instant>; READERS],
    /// No read is taken any more; the readers end once the queue is empty.
    closed: bool,
}

impl Queue {
    /// Whether to wake a sleeping reader for the reads queued: only if no reader that is awake (woken,
    /// between two reads, or on a read that is not slow yet) will come to them soon. One such reader
    /// takes them all, one after the other, without a switch in between.
    fn needs_a_reader(&self) -> bool {
        if self.jobs.is_empty() || self.idle <= self.woken || self.woken > 0 {
            return false;
        }
        let running = self.started.iter().flatten().count();
        let between = (READERS - self.idle).saturating_sub(running);
        if between > 0 {
            return false;
        }
        let now = Instant::now();
        !self.started.iter().flatten().any(|since| now.duration_since(*since) < SLOW_READ)
    }
}

impl Readers {
    pub fn start(location: Location, writer: Option<Arc<Mutex<Connection>>>) -> StoreResult<Self> {
        let shared = Arc::new(Shared { queue: Mutex::default(), ready: Condvar::new(), location, writer });
        let mut threads = Vec::with_capacity(READERS);
        for i in 0..READERS {
            let shared = shared.clone();
            let thread = thread::Builder::new()
                .name(format!("keel-sqlite-reader-{i}"))
                .spawn(move || shared.serve(i))
                .map_err(|e| StoreError::Backend(format!("start the database readers: {e}")))?;
            threads.push(thread);
        }
        Ok(Self { shared, threads: Mutex::new(threads) })
    }

    /// Runs `work` on a reading thread. A panic in `work` fails this read alone.
    pub async fn read<R, F>(&self, work: F) -> StoreResult<R>
    where
        R: Send + 'static,
        F: FnOnce(&Conn<'_, '_>) -> StoreResult<R> + Send + 'static,
    {
        let (job, answer) = read_job(work);
        self.push(job)?;
        answer.await.map_err(|_| closed("read"))?
    }

    fn push(&self, job: ReadJob) -> StoreResult<()> {
        let mut queue = lock(&self.shared.queue);
        if queue.closed {
            return Err(closed("read"));
        }
        queue.jobs.push_back(job);
        let wake = queue.needs_a_reader();
        if wake {
            queue.woken += 1;
        }
        drop(queue);
        if wake {
            self.shared.ready.notify_one();
        }
        Ok(())
    }

    /// Takes no more reads; returns the threads, which end (closing their connections) once the
    /// reads queued before have run.
    pub fn close(&self) -> Vec<thread::JoinHandle<()>> {
        self.shared.stop();
        std::mem::take(&mut *lock(&self.threads))
    }
}

impl Drop for Readers {
    /// Without a close (every handle dropped): the threads end on their own.
    fn drop(&mut self) {
        self.shared.stop();
    }
}

impl Shared {
    fn stop(&self) {
        lock(&self.queue).closed = true;
        self.ready.notify_all();
    }

    /// Reading thread `i`: runs the queued reads until the readers are closed.
    fn serve(&self, i: usize) {
        if let Some(writer) = &self.writer {
            while let Some(job) = self.next(i) {
                job(Ok(&Conn::new(&lock(writer), None)));
            }
            return;
        }
        // Opened at the first read, kept for the next, with the statements it prepared; a read that
        // finds it cannot be opened fails, and the next tries again.
        let (first, conn) = loop {
            let Some(job) = self.next(i) else { return };
            match open_connection(&self.location, true) {
                Ok(conn) => break (job, conn),
                Err(e) => job(Err(e)),
            }
        };
        let kept = Kept::default();
        let conn = Conn::new(&conn, Some(&kept));
        first(Ok(&conn));
        while let Some(job) = self.next(i) {
            job(Ok(&conn));
        }
    }

    /// The next read for reader `i`; `None` once closed and nothing is left.
    fn next(&self, i: usize) -> Option<ReadJob> {
        let mut queue = lock(&self.queue);
        queue.started[i] = None;
        loop {
            if let Some(job) = queue.jobs.pop_front() {
                queue.started[i] = Some(Instant::now());
                return Some(job);
            }
            if queue.closed {
                return None;
            }
            queue.idle += 1;
            queue = self.ready.wait(queue).unwrap_or_else(|poisoned| poisoned.into_inner());
            queue.idle -= 1;
            queue.woken = queue.woken.saturating_sub(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queue(jobs: usize, idle: usize, woken: usize, started: &[Option<Duration>]) -> Queue {
        let now = Instant::now();
        let mut q = Queue { idle, woken, ..Queue::default() };
        for _ in 0..jobs {
            q.jobs.push_back(Box::new(|_| {}));
        }
        for (slot, ago) in q.started.iter_mut().zip(started) {
            *slot = ago.map(|ago| now - ago);
        }
        q
    }

    /// Who takes a new read: the reader on a short read does, a slow one does not; one is woken
    /// only when nobody awake will take it soon.
    #[test]
    fn a_sleeping_reader_is_woken_only_for_reads_nobody_awake_will_take_soon() {
        let fresh = Some(Duration::ZERO);
        let slow = Some(SLOW_READ * 2);
        // every reader asleep: wake one
        assert!(queue(1, READERS, 0, &[]).needs_a_reader());
        // one already woken for it
        assert!(!queue(1, READERS, 1, &[]).needs_a_reader());
        // ... and for the reads queued behind it
        assert!(!queue(5, READERS, 1, &[]).needs_a_reader());
        // one reader awake on a short read: it takes the next ones, no switch
        assert!(!queue(1, READERS - 1, 0, &[fresh]).needs_a_reader());
        assert!(!queue(5, READERS - 1, 0, &[fresh]).needs_a_reader());
        // one awake on a slow read: wake another; one on a slow read and one on a short one: no
        assert!(queue(1, READERS - 1, 0, &[slow]).needs_a_reader());
        assert!(!queue(1, READERS - 2, 0, &[slow, fresh]).needs_a_reader());
        // one awake between reads (it will look at the queue before sleeping)
        assert!(!queue(1, READERS - 1, 0, &[None]).needs_a_reader());
        // every reader on a slow read: nobody left to wake
        assert!(!queue(1, 0, 0, &[slow; READERS]).needs_a_reader());
    }
}
