//! Time as a dependency, so expiry and lease tests move time instead of sleeping.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use chrono::{Duration, Utc};

use crate::domain::Timestamp;
use crate::store::Store;

pub trait Clock: Send + Sync + 'static {
    fn now(&self) -> Timestamp;
}

/// The wall clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Timestamp {
        Utc::now()
    }
}

/// A clock that moves only when told to (tests).
#[derive(Debug)]
pub struct ManualClock(Mutex<Timestamp>);

impl ManualClock {
    pub fn new(start: Timestamp) -> Self {
        Self(Mutex::new(start))
    }

    pub fn advance(&self, by: Duration) {
        let mut now = self.0.lock().unwrap_or_else(|e| e.into_inner());
        *now += by;
    }
}

impl Default for ManualClock {
    fn default() -> Self {
        Self::new(Utc::now())
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Timestamp {
        *self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The database's clock, read cheaply: the offset between the database and this machine is
/// measured (halving the round trip) at start and then every `refresh`, and `now()` is the local
/// clock plus that offset. Instances sharing a database thus agree on lease and expiry times even
/// when their own clocks drift.
pub struct StoreClock {
    offset_micros: AtomicI64,
}

impl StoreClock {
    /// Measures the offset once (an error if the database can't be read), then keeps it fresh in
    /// the background for as long as the clock lives.
    pub async fn start(
        store: Arc<dyn Store>,
        refresh: std::time::Duration,
    ) -> Result<Arc<Self>, crate::store::StoreError> {
        let clock = Arc::new(Self { offset_micros: AtomicI64::new(measure(store.as_ref()).await?) });
        let weak = Arc::downgrade(&clock);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(refresh).await;
                let Some(clock) = weak.upgrade() else { break };
                match measure(store.as_ref()).await {
                    Ok(offset) => clock.offset_micros.store(offset, Ordering::Relaxed),
                    Err(e) => tracing::warn!(error = %e, "could not read the database clock; keeping the last offset"),
                }
            }
        });
        Ok(clock)
    }

    /// The database clock minus this machine's, as last measured.
    pub fn offset(&self) -> Duration {
        Duration::microseconds(self.offset_micros.load(Ordering::Relaxed))
    }
}

async fn measure(store: &dyn Store) -> Result<i64, crate::store::StoreError> {
    let sent = Instant::now();
    let local_before = Utc::now();
    let db = store.db_now().await?;
    let round_trip = Duration::from_std(sent.elapsed()).unwrap_or_default();
    let local_mid = local_before + round_trip / 2;
    Ok((db - local_mid).num_microseconds().unwrap_or(0))
}

impl Clock for StoreClock {
    fn now(&self) -> Timestamp {
        Utc::now() + self.offset()
    }
}
