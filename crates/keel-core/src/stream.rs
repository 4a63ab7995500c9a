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

use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use tokio::sync::broadcast::error::RecvError;

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

/// Why an event stream reads the store (the label of [`Recorder::stream_store_read`]).
mod reason {
    /// Its first read, or one after the bus showed a gap, a lagged or a closed receiver.
    pub const CATCH_UP: &str = "catch_up";
    /// An idle stream's periodic look, for what another instance may have committed.
    pub const IDLE: &str = "idle";
}

/// Events of `run_id` with `sequence > after`, stored then live, until `until`.
///
/// `idle_reads`: how often an idle stream looks at the store in case a writer elsewhere committed
/// something the bus did not bring (another instance without a shared bus, a message a shared bus
/// lost). `None` where the bus delivers every event (one process, the local bus): an idle stream
/// then costs no store reads at all, and the store is read only on a gap, a lagged or a closed
/// receiver.
pub fn run_events(
    store: Arc<dyn Store>,
    bus: Arc<dyn Bus>,
    run_id: RunId,
    after: i64,
    until: Until,
    idle_reads: Option<Duration>,
    metrics: Metrics,
) -> impl Stream<Item = Result<Event, StoreError>> + Send {
    async_stream::try_stream! {
        let mut rx = bus.subscribe(&run_id);
        let mut last = after;
        let mut why = reason::CATCH_UP;
        'outer: loop {
            // Catch up from the store.
            loop {
                metrics.stream_store_read(why);
                let page = store.list_events(&run_id, last, PAGE).await?;
                let full = page.len() as u32 == PAGE;
                for event in page {
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
            // whose cursor is at (or past) its terminal event ends here instead of waiting.
            metrics.stream_store_read(why);
            if let Some(run) = store.get_run(&run_id).await? {
                if run.status.is_terminal() && last >= run.last_sequence() {
                    break 'outer;
                }
            }
            // Then follow the bus until something is out of order.
            loop {
                let received = match idle_reads {
                    Some(every) => match tokio::time::timeout(every, rx.recv()).await {
                        Ok(received) => received,
                        // Idle: look at the store in case a writer elsewhere committed.
                        Err(_elapsed) => {
                            why = reason::IDLE;
                            continue 'outer;
                        }
                    },
                    None => rx.recv().await,
                };
                why = reason::CATCH_UP;
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
