//! Fan-out of committed events to live subscribers.
//!
//! The bus is a wake-up and a fast path, never the source of truth: a subscriber that lags, misses
//! a message or sees a gap re-reads the store (see [`crate::stream`]).
//!
//! Channels carry `Arc<Event>`: a run's channel allocates all its slots when it is made, one per
//! event it can hold, so a slot of one pointer keeps an idle subscription small (~2 KiB for 64
//! slots instead of ~10 KiB), and fan-out to several receivers shares one copy of each event.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::broadcast;

use crate::event::Event;
use crate::ids::RunId;

pub trait Bus: Send + Sync + 'static {
    /// Called after the events were committed, in sequence order. Must not block: a commit path
    /// calls it.
    fn publish(&self, events: &[Event]);
    /// Every event published after this returns must be delivered to the receiver (unless it
    /// lags): readers subscribe before they read the store and rely on that to see no gap. A shared
    /// bus therefore starts reading no later than the call (duplicates are fine; readers drop them).
    fn subscribe(&self, run_id: &RunId) -> broadcast::Receiver<Arc<Event>>;
    /// Events this bus failed to fan out since it started (a shared bus that was unreachable or
    /// full); readers found them in the store instead. Read by the metrics endpoint.
    fn dropped_events(&self) -> u64 {
        0
    }
}

/// One process: a bounded broadcast channel per run with live subscribers.
pub struct LocalBus {
    capacity: usize,
    channels: Mutex<HashMap<RunId, broadcast::Sender<Arc<Event>>>>,
}

impl LocalBus {
    pub fn new(capacity: usize) -> Self {
        Self { capacity, channels: Mutex::new(HashMap::new()) }
    }

    /// Runs with a channel (tests and metrics).
    pub fn channel_count(&self) -> usize {
        self.channels.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

impl Default for LocalBus {
    fn default() -> Self {
        Self::new(64)
    }
}

impl Bus for LocalBus {
    fn publish(&self, events: &[Event]) {
        let Some(first) = events.first() else { return };
        let mut channels = self.channels.lock().unwrap_or_else(|e| e.into_inner());
        let Some(tx) = channels.get(&first.run_id) else { return };
        if tx.receiver_count() == 0 {
            channels.remove(&first.run_id);
            return;
        }
        for e in events {
            // An error means every receiver is gone; they re-read the store if they come back.
            let _ = tx.send(Arc::new(e.clone()));
        }
        if events.iter().any(Event::is_terminal) && tx.receiver_count() == 0 {
            channels.remove(&first.run_id);
        }
    }

    fn subscribe(&self, run_id: &RunId) -> broadcast::Receiver<Arc<Event>> {
        let mut channels = self.channels.lock().unwrap_or_else(|e| e.into_inner());
        channels.retain(|_, tx| tx.receiver_count() > 0);
        channels.entry(run_id.clone()).or_insert_with(|| broadcast::channel(self.capacity).0).subscribe()
    }
}
