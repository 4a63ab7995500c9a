//! A run's events for a reader: the stored ones after a cursor, then live ones, with no gap and no
//! duplicate at the hand-over.
//!
//! The reader subscribes to the bus *before* reading the store, so an event is either in the store
//! read or arrives live (events are published only after they commit). Whatever the bus delivers
//! out of order — a gap, a lagged receiver, a closed channel — is answered by re-reading the store,
//! which is the source of truth. Where other processes commit too, an idle reader also polls the
//! store now and then, so their events arrive even without a shared bus (or when it lost one); where
//! the bus delivers every event (one process, the local bus) an idle reader reads nothing. Memory
//! per reader is bounded by the bus channel's capacity and one page of stored events.
//!
//! A reader that subscribed before the write it follows ([`Following`]: the request that starts or
//! resumes the run) and finds the next event already on its subscription reads nothing at all: the
//! bus holds every event from there on, in order, and any gap still sends it to the store.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use futures::Stream;
use tokio::sync::broadcast::{self, error::RecvError};
use tokio::sync::Notify;

use crate::bus::Bus;
use crate::event::Event;
use crate::ids::RunId;
use crate::metrics::Metrics;
use crate::store::{Store, StoreError};

/// When a reader's stream ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Until {
    /// After the terminal event (`done`, `error`, `cancelled`).
    Terminal,
    /// After the terminal event or an `interrupt` (a stream that answers a request: the run is
    /// waiting for a human, and the request is over).
    PauseOrTerminal,
}

impl Until {
    fn ends_with(self, event: &Event) -> bool {
        match self {
            Until::Terminal => event.is_terminal(),
            Until::PauseOrTerminal => event.is_terminal() || event.is_pausing(),
        }
    }
}

const PAGE: u32 = 256;

/// A subscription to a run's events made before a write of the run (by the request that makes
/// it), handed to [`run_events`]: when it holds the event right after the reader's cursor, the
/// stored events before it are the reader's already, and the stream starts without reading the
/// store. Otherwise (a replayed answer wrote nothing, the subscription lagged) it catches up as
/// any reader does.
pub struct Following(broadcast::Receiver<Arc<Event>>);

impl Following {
    /// Subscribes to `run_id`'s events now: make it before the write whose events it follows.
    pub fn new(bus: &dyn Bus, run_id: &RunId) -> Self {
        Self(bus.subscribe(run_id))
    }
}

impl std::fmt::Debug for Following {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Following").finish_non_exhaustive()
    }
}

/// The event after `last` if `rx` holds it now (older ones skipped): then nothing stored after
/// `last` is missing from what `rx` will bring. `None`: read the store.
fn next_on(rx: &mut broadcast::Receiver<Arc<Event>>, last: i64) -> Option<Arc<Event>> {
    loop {
        match rx.try_recv() {
            Ok(event) if event.sequence <= last => {}
            Ok(event) if event.sequence == last + 1 => return Some(event),
            // a gap, nothing yet, lagged, closed: the store says
            _ => return None,
        }
    }
}

/// What the caller of [`run_events`] knew of the run, from a read made before the stream
/// subscribed (the request's own check of the run, or the write that started or resumed it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Known {
    /// Nothing: after its first catch-up the stream reads the run, to end at once if the run is
    /// over and the cursor is at (or past) its last event.
    Unknown,
    /// The run was not over: its end is an event still to come, which the catch-up (committed
    /// before the subscription) or the bus (after it) brings, so the stream need not read the run.
    Active,
    /// The run was over, its last event this one.
    Over { last_sequence: i64 },
}

impl Known {
    /// What `run`, as just read, says.
    pub fn of(run: &crate::domain::Run) -> Self {
        if run.status.is_terminal() {
            Known::Over { last_sequence: run.last_sequence() }
        } else {
            Known::Active
        }
    }
}

/// Why an event stream reads the store (the label of [`Recorder::stream_store_read`]).
mod reason {
    /// Its first read, or one after the bus showed a gap, a lagged or a closed receiver, or after
    /// the process's [`IdleWatch`] saw the run move past it.
    pub const CATCH_UP: &str = "catch_up";
    /// The [`IdleWatch`]'s look at the last sequences of every watched run: one read per process
    /// per interval, however many streams are idle.
    pub const IDLE: &str = "idle";
}

/// Where other processes commit events the bus may not bring (several instances without a shared
/// bus, or a shared bus that can lose a message), one task per process looks, every `interval`,
/// at the last sequence of every run an idle stream follows — one query for all of them — and
/// wakes only the streams that are behind, which then catch up from the store. Where the bus
/// delivers every event (one process, the local bus) there is none, and an idle stream reads
/// nothing.
pub struct IdleWatch {
    store: Arc<dyn Store>,
    interval: Duration,
    metrics: Metrics,
    watched: Mutex<HashMap<RunId, Vec<Weak<Watched>>>>,
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

/// One stream's place in the [`IdleWatch`]: the last sequence it has, and how to wake it.
pub struct Watched {
    last: AtomicI64,
    wake: Notify,
}

/// Runs one look reads at most.
const LOOK_BATCH: usize = 1000;

impl IdleWatch {
    pub fn new(store: Arc<dyn Store>, interval: Duration, metrics: Metrics) -> Arc<Self> {
        Arc::new(Self { store, interval, metrics, watched: Mutex::default(), task: Mutex::default() })
    }

    /// Follows `run_id` from `last` on, until the returned handle is dropped. The looking task
    /// starts with the first stream.
    fn watch(self: &Arc<Self>, run_id: &RunId, last: i64) -> Arc<Watched> {
        let watched = Arc::new(Watched { last: AtomicI64::new(last), wake: Notify::new() });
        self.watched
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(run_id.clone())
            .or_default()
            .push(Arc::downgrade(&watched));
        let mut task = self.task.lock().unwrap_or_else(|e| e.into_inner());
        if task.is_none() {
            // The task holds the watch weakly: it ends with the engine that made it.
            let weak = Arc::downgrade(self);
            let interval = self.interval;
            *task = Some(tokio::spawn(async move {
                let mut tick = tokio::time::interval(interval);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                tick.tick().await;
                loop {
                    tick.tick().await;
                    let Some(watch) = weak.upgrade() else { break };
                    watch.look().await;
                }
            }));
        }
        watched
    }

    /// One look: the last sequences of every watched run, and a wake-up for each stream behind.
    async fn look(&self) {
        let runs: Vec<RunId> = {
            let mut watched = self.watched.lock().unwrap_or_else(|e| e.into_inner());
            watched.retain(|_, streams| {
                streams.retain(|w| w.strong_count() > 0);
                !streams.is_empty()
            });
            watched.keys().cloned().collect()
        };
        for batch in runs.chunks(LOOK_BATCH) {
            self.metrics.stream_store_read(reason::IDLE);
            let last = match self.store.last_sequences(batch).await {
                Ok(last) => last,
                Err(e) => {
                    self.metrics.store_error("read_events");
                    tracing::warn!(error = %e, "reading the last sequences of watched runs failed");
                    continue;
                }
            };
            let watched = self.watched.lock().unwrap_or_else(|e| e.into_inner());
            for (run_id, sequence) in last {
                for stream in watched.get(&run_id).into_iter().flatten().filter_map(Weak::upgrade) {
                    if stream.last.load(Ordering::SeqCst) < sequence {
                        stream.wake.notify_one();
                    }
                }
            }
        }
    }

    /// Streams followed now (for tests and diagnostics).
    pub fn streams(&self) -> usize {
        self.watched
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .flatten()
            .filter(|w| w.strong_count() > 0)
            .count()
    }
}

impl Drop for IdleWatch {
    fn drop(&mut self) {
        if let Some(task) = self.task.get_mut().unwrap_or_else(|e| e.into_inner()).take() {
            task.abort();
        }
    }
}

/// Events of `run_id` with `sequence > after`, stored then live, until `until`. `known`: what a
/// read of the run made before this call said (it spares the stream a read of its own).
///
/// `idle`: the process's [`IdleWatch`], where other processes may commit events the bus does not
/// bring; `None` where the bus delivers every event (one process, the local bus): an idle stream
/// then costs no store reads at all, and the store is read only on a gap, a lagged or a closed
/// receiver. `following`: a subscription made before the write the reader follows (see
/// [`Following`]); `None`: subscribe now.
#[allow(clippy::too_many_arguments)]
pub fn run_events(
    store: Arc<dyn Store>,
    bus: Arc<dyn Bus>,
    run_id: RunId,
    after: i64,
    until: Until,
    known: Known,
    following: Option<Following>,
    idle: Option<Arc<IdleWatch>>,
    metrics: Metrics,
) -> impl Stream<Item = Result<Event, StoreError>> + Send {
    async_stream::try_stream! {
        let (mut rx, mut next) = match following {
            Some(Following(mut rx)) => {
                let next = next_on(&mut rx, after);
                (rx, next)
            }
            None => (bus.subscribe(&run_id), None),
        };
        let mut last = after;
        let watched = idle.as_ref().map(|watch| watch.watch(&run_id, after));
        let mut known = known;
        'outer: loop {
            if let Some(event) = next.take() {
                // The subscription holds the next event: the bus brings everything from it on,
                // and nothing before it is this reader's to read.
                last = event.sequence;
                let end = until.ends_with(&event);
                yield Arc::unwrap_or_clone(event);
                if end {
                    break 'outer;
                }
                // as after a first catch-up: a later one reads the run
                known = Known::Unknown;
            } else {
                // Catch up from the store.
                loop {
                    metrics.stream_store_read(reason::CATCH_UP);
                    let page = store.list_events(&run_id, last, PAGE).await?;
                    let full = page.len() as u32 == PAGE;
                    for event in page {
                        // Sequences are contiguous, so a hole means retention pruned the oldest events
                        // of this finished run while the reader was catching up: end here rather than
                        // tell a story with a gap; a reconnect from the cursor is answered 410
                        // EVENTS_PRUNED with the first sequence held.
                        if event.sequence != last + 1 {
                            break 'outer;
                        }
                        last = event.sequence;
                        let end = until.ends_with(&event);
                        yield event;
                        if end {
                            break 'outer;
                        }
                    }
                    if !full {
                        break;
                    }
                }
                // Nothing more is stored. A run that already ended has nothing more to say: a reader
                // whose cursor is at (or past) its terminal event ends here instead of waiting. (What
                // the caller knew serves the first time; a run is read after a later catch-up.)
                match std::mem::replace(&mut known, Known::Unknown) {
                    Known::Active => {}
                    Known::Over { last_sequence } => {
                        if last >= last_sequence {
                            break 'outer;
                        }
                    }
                    Known::Unknown => {
                        metrics.stream_store_read(reason::CATCH_UP);
                        if let Some(run) = store.get_run(&run_id).await? {
                            if run.status.is_terminal() && last >= run.last_sequence() {
                                break 'outer;
                            }
                        }
                    }
                }
            }
            // Then follow the bus until something is out of order.
            loop {
                if let Some(watched) = &watched {
                    watched.last.store(last, Ordering::SeqCst);
                }
                let received = match &watched {
                    Some(watched) => tokio::select! {
                        received = rx.recv() => received,
                        // The run moved past this stream and the bus did not say: catch up.
                        () = watched.wake.notified() => continue 'outer,
                    },
                    None => rx.recv().await,
                };
                match received {
                    Ok(event) if event.sequence <= last => continue,
                    Ok(event) if event.sequence == last + 1 => {
                        last = event.sequence;
                        let end = until.ends_with(&event);
                        // The channel's slot let go of it when this receiver took it: no copy
                        // unless another receiver of the run has yet to take it.
                        yield Arc::unwrap_or_clone(event);
                        if end {
                            break 'outer;
                        }
                    }
                    // A gap: the store has what we missed.
                    Ok(_) => continue 'outer,
                    Err(RecvError::Lagged(_)) => continue 'outer,
                    Err(RecvError::Closed) => {
                        rx = bus.subscribe(&run_id);
                        continue 'outer;
                    }
                }
            }
        }
    }
}
