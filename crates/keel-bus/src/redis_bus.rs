//! The Redis Streams bus.
//!
//! Publishing: [`Bus::publish`] delivers to this instance's subscribers at once (as `LocalBus`
//! does) and hands a copy to a bounded queue; one background task drains the queue and pipelines
//! `XADD {prefix}run:{run_id} MAXLEN ~ N * data <event JSON> src <instance>` plus an `EXPIRE` per
//! stream, so the streams of finished runs go away. A full queue or a Redis error drops the events
//! and counts them: the caller never waits for Redis.
//!
//! Subscribing: the first local subscriber of a run starts one reader task for that run, shared
//! by every local subscriber of it. The task `XREAD BLOCK`s on the run's stream and forwards the
//! events other instances published (its own instance's were delivered locally already) into the
//! run's broadcast channel. It ends once the channel has no receiver left, which it checks after
//! every read (a read blocks for at most [`RedisBusConfig::block`]), and leaves its connection,
//! idle, for the next reader task (at most [`IDLE_CONNECTIONS`] are kept): a HITL run's two
//! streams each start a reader, and a new connection per reader cost the server ~13% of its CPU
//! per run (docs/benchmarks.md, "Fourteenth session").
//!
//! The task reads from a stream id taken from the clock at `subscribe` time, a little in the past
//! ([`RedisBusConfig::replay_window`]), rather than from `$`: with `$` an event another instance
//! publishes between `subscribe` returning and the task's first `XREAD` reaching Redis would be
//! missed, and the reader would only find it at its next idle poll of the store. The window may
//! replay a few events the reader already has; readers drop `sequence <= last`.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use keel_core::bus::Bus;
use keel_core::{Event, RunId};
use redis::aio::{ConnectionManager, ConnectionManagerConfig, MultiplexedConnection};
use redis::{AsyncConnectionConfig, Client, RedisError, Value};
use tokio::runtime::Handle;
use tokio::sync::{broadcast, mpsc};

/// Settings of a [`RedisBus`]. `Default` is what [`RedisBus::connect`] uses, with its prefix.
#[derive(Debug, Clone)]
pub struct RedisBusConfig {
    /// Prepended to every key: a run's stream is `{prefix}run:{run_id}`.
    pub prefix: String,
    /// Approximate length a stream is trimmed to (`MAXLEN ~`).
    pub stream_maxlen: usize,
    /// A stream expires this long after its last publish (whole seconds, at least one).
    pub ttl: Duration,
    /// Publish calls that may wait for the writer task; past that, publishing drops and counts.
    pub queue_capacity: usize,
    /// Capacity of each run's local broadcast channel.
    pub channel_capacity: usize,
    /// How long one `XREAD` blocks; a reader task notices it has no receivers within about this.
    pub block: Duration,
    /// How far before `subscribe` a new reader task starts reading (covers its own start-up and
    /// clock skew between instances and Redis).
    pub replay_window: Duration,
    /// Timeout of one attempt to open a connection.
    pub connect_timeout: Duration,
    /// Timeout of one command (a blocking `XREAD` gets `block` on top).
    pub response_timeout: Duration,
}

impl Default for RedisBusConfig {
    fn default() -> Self {
        Self {
            prefix: "keel:".into(),
            stream_maxlen: 1000,
            ttl: Duration::from_secs(3600),
            queue_capacity: 4096,
            channel_capacity: 64,
            block: Duration::from_secs(1),
            replay_window: Duration::from_secs(1),
            connect_timeout: Duration::from_secs(2),
            response_timeout: Duration::from_secs(5),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum BusError {
    #[error("invalid Redis URL `{url}`: {source}")]
    InvalidUrl {
        url: String,
        #[source]
        source: RedisError,
    },
    #[error("cannot reach Redis at `{url}`: {source}")]
    Connect {
        url: String,
        #[source]
        source: RedisError,
    },
    #[error("invalid Redis bus settings: {0}")]
    Config(&'static str),
    #[error("the Redis bus must be created inside a Tokio runtime")]
    NoRuntime,
}

/// [`Bus`] over Redis Streams; see the module docs.
pub struct RedisBus {
    shared: Arc<Shared>,
    queue: mpsc::Sender<Vec<Event>>,
    runtime: Handle,
}

struct Shared {
    config: RedisBusConfig,
    client: Client,
    /// Written into every entry so a reader skips what its own instance already delivered.
    instance: String,
    /// Runs with local subscribers. An entry exists exactly while its reader task runs.
    channels: Mutex<HashMap<RunId, broadcast::Sender<Arc<Event>>>>,
    readers: AtomicUsize,
    /// Reader connections whose task ended, each idle (its last `XREAD` answered), for the next
    /// reader task: a connection is a TCP connect and a handshake of several round trips, and a
    /// run's streams start a reader each (two in a HITL run).
    idle_connections: Mutex<Vec<MultiplexedConnection>>,
    published: AtomicU64,
    dropped: AtomicU64,
    drop_warning: RateLimit,
    read_warning: RateLimit,
}

/// Longest pause between two attempts of a reader to reach Redis.
const MAX_BACKOFF: Duration = Duration::from_secs(5);
const MIN_BACKOFF: Duration = Duration::from_millis(100);
/// Publish calls the writer folds into one pipeline.
const MAX_BATCHES_PER_PIPELINE: usize = 256;
/// Idle reader connections kept for the next reader tasks at most.
const IDLE_CONNECTIONS: usize = 64;
/// Entries one `XREAD` returns at most.
const READ_COUNT: usize = 512;
/// The JSON buffer an event is written into starts this large (most events' JSON is smaller).
const EVENT_JSON_CAPACITY: usize = 512;
/// A warning of one kind is logged at most this often.
const WARN_EVERY: Duration = Duration::from_secs(10);

impl RedisBus {
    /// Connects to `url` (checked with `PING`) with the default settings and `prefix` for keys.
    pub async fn connect(url: &str, prefix: &str) -> Result<Self, BusError> {
        Self::connect_with(url, RedisBusConfig { prefix: prefix.to_owned(), ..RedisBusConfig::default() }).await
    }

    /// Connects to `url` (checked with `PING`). Must be called inside a Tokio runtime: the bus's
    /// tasks run on it.
    pub async fn connect_with(url: &str, config: RedisBusConfig) -> Result<Self, BusError> {
        if config.stream_maxlen == 0 {
            return Err(BusError::Config("stream_maxlen must be at least 1"));
        }
        if config.ttl < Duration::from_secs(1) {
            return Err(BusError::Config("ttl must be at least one second"));
        }
        if config.queue_capacity == 0 || config.channel_capacity == 0 {
            return Err(BusError::Config("queue_capacity and channel_capacity must be at least 1"));
        }
        if config.block < Duration::from_millis(1) {
            return Err(BusError::Config("block must be at least one millisecond"));
        }
        let runtime = Handle::try_current().map_err(|_| BusError::NoRuntime)?;
        let shown = redact(url);
        let client = Client::open(url).map_err(|source| BusError::InvalidUrl { url: shown.clone(), source })?;
        // redis 0.32 hands these to `backon`: reconnect delays start at one second and multiply by
        // `factor` per retry, so its default factor of 100 would wait 1 s, then 100 s (capped by
        // `max_delay`). One retry with factor 2 keeps a writer waiting on a dead Redis to a few
        // seconds per pipeline; the next pipeline starts another reconnect.
        let manager_config = ConnectionManagerConfig::new()
            .set_connection_timeout(config.connect_timeout)
            .set_response_timeout(config.response_timeout)
            .set_factor(2)
            .set_number_of_retries(1)
            .set_max_delay(MAX_BACKOFF.as_millis() as u64);
        let connect = async {
            // One attempt and a PING, so a wrong or dead address fails at once and clearly.
            let mut probe = client.get_multiplexed_async_connection_with_config(&connection_config(&config)).await?;
            redis::cmd("PING").query_async::<String>(&mut probe).await?;
            ConnectionManager::new_with_config(client.clone(), manager_config).await
        };
        let writer = connect.await.map_err(|source| BusError::Connect { url: shown, source })?;

        let (queue, rx) = mpsc::channel(config.queue_capacity);
        let shared = Arc::new(Shared {
            config,
            client,
            instance: uuid::Uuid::now_v7().simple().to_string(),
            channels: Mutex::new(HashMap::new()),
            readers: AtomicUsize::new(0),
            idle_connections: Mutex::new(Vec::new()),
            published: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            drop_warning: RateLimit::default(),
            read_warning: RateLimit::default(),
        });
        runtime.spawn(write_loop(shared.clone(), writer, rx));
        Ok(Self { shared, queue, runtime })
    }

    /// The stream key of a run.
    pub fn stream_key(&self, run_id: &RunId) -> String {
        self.shared.key(run_id)
    }

    /// Runs with local subscribers, each with one reader task (tests and metrics).
    pub fn channel_count(&self) -> usize {
        self.shared.channels().len()
    }

    /// Reader tasks still running (tests and metrics). Reaches the channel count once the tasks of
    /// released channels have finished.
    pub fn reader_count(&self) -> usize {
        self.shared.readers.load(Ordering::SeqCst)
    }

    /// Events written to Redis.
    pub fn published_count(&self) -> u64 {
        self.shared.published.load(Ordering::Relaxed)
    }

    /// Events not written to Redis: the queue was full or Redis failed. Readers found them in the
    /// store.
    pub fn dropped_count(&self) -> u64 {
        self.shared.dropped.load(Ordering::Relaxed)
    }
}

impl Bus for RedisBus {
    fn dropped_events(&self) -> u64 {
        self.dropped_count()
    }

    fn publish(&self, events: &[Event]) {
        if events.is_empty() {
            return;
        }
        {
            let channels = self.shared.channels();
            let mut current: Option<(&RunId, Option<&broadcast::Sender<Arc<Event>>>)> = None;
            for e in events {
                let tx = match current {
                    Some((run_id, tx)) if *run_id == e.run_id => tx,
                    _ => {
                        let tx = channels.get(&e.run_id);
                        current = Some((&e.run_id, tx));
                        tx
                    }
                };
                if let Some(tx) = tx {
                    // An error means no receiver is left; the reader task notices and ends.
                    let _ = tx.send(Arc::new(e.clone()));
                }
            }
        }
        match self.queue.try_send(events.to_vec()) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(events)) => self.shared.drop_events(events.len(), &"queue is full"),
            Err(mpsc::error::TrySendError::Closed(events)) => {
                self.shared.drop_events(events.len(), &"writer task is gone")
            }
        }
    }

    fn subscribe(&self, run_id: &RunId) -> broadcast::Receiver<Arc<Event>> {
        let start = start_id(self.shared.config.replay_window);
        let (tx, rx) = {
            let mut channels = self.shared.channels();
            if let Some(tx) = channels.get(run_id) {
                return tx.subscribe();
            }
            let (tx, rx) = broadcast::channel(self.shared.config.channel_capacity);
            channels.insert(run_id.clone(), tx.clone());
            self.shared.readers.fetch_add(1, Ordering::SeqCst);
            (tx, rx)
        };
        // Outside the lock: a runtime that is shutting down drops the task (and its guard, which
        // takes the lock) right away.
        let guard = ReaderGuard { shared: self.shared.clone(), run_id: run_id.clone(), tx };
        self.runtime.spawn(read_loop(guard, start));
        rx
    }
}

impl Shared {
    fn key(&self, run_id: &RunId) -> String {
        format!("{}run:{}", self.config.prefix, run_id)
    }

    fn channels(&self) -> MutexGuard<'_, HashMap<RunId, broadcast::Sender<Arc<Event>>>> {
        self.channels.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn idle_connections(&self) -> MutexGuard<'_, Vec<MultiplexedConnection>> {
        self.idle_connections.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn drop_events(&self, count: usize, reason: &dyn std::fmt::Display) {
        let total = self.dropped.fetch_add(count as u64, Ordering::Relaxed) + count as u64;
        if let Some(suppressed) = self.drop_warning.check() {
            tracing::warn!(
                dropped = count,
                dropped_total = total,
                suppressed_warnings = suppressed,
                "redis bus dropped events ({reason}); readers fall back to the store"
            );
        }
    }
}

/// One background task: drains the queue into pipelined `XADD`s on a reconnecting connection.
async fn write_loop(shared: Arc<Shared>, mut conn: ConnectionManager, mut rx: mpsc::Receiver<Vec<Event>>) {
    let maxlen = shared.config.stream_maxlen;
    let ttl = shared.config.ttl.as_secs().max(1);
    let mut batches = Vec::with_capacity(MAX_BATCHES_PER_PIPELINE);
    while rx.recv_many(&mut batches, MAX_BATCHES_PER_PIPELINE).await > 0 {
        let mut pipe = redis::pipe();
        let mut keys = BTreeSet::new();
        let mut count = 0;
        // a batch is one commit's events, all of one run: its key is made once
        let mut run_key: Option<(RunId, String)> = None;
        for event in batches.drain(..).flatten() {
            // an event's JSON is a few hundred bytes: written without growing the buffer
            let mut json = Vec::with_capacity(EVENT_JSON_CAPACITY);
            if let Err(e) = event.write_json(&mut json) {
                shared.drop_events(1, &format_args!("an event did not serialize: {e}"));
                continue;
            }
            let key = match &run_key {
                Some((run, key)) if *run == event.run_id => key,
                _ => {
                    let key = shared.key(&event.run_id);
                    keys.insert(key.clone());
                    &run_key.insert((event.run_id.clone(), key)).1
                }
            };
            // sized for its arguments up front, so appending them never grows it
            let mut xadd = redis::Cmd::with_capacity(10, 64 + key.len() + json.len() + shared.instance.len());
            xadd.arg("XADD")
                .arg(key)
                .arg("MAXLEN")
                .arg("~")
                .arg(maxlen)
                .arg("*")
                .arg("data")
                .arg(json)
                .arg("src")
                .arg(&shared.instance);
            pipe.add_command(xadd).ignore();
            count += 1;
        }
        for key in &keys {
            pipe.cmd("EXPIRE").arg(key).arg(ttl).ignore();
        }
        if count == 0 {
            continue;
        }
        // The connection manager reconnects (with backoff) after a failure; until it has, commands
        // fail and these events are dropped while new ones wait in, or overflow, the queue.
        match pipe.exec_async(&mut conn).await {
            Ok(()) => {
                shared.published.fetch_add(count as u64, Ordering::Relaxed);
            }
            Err(e) => shared.drop_events(count, &format_args!("redis error: {e}")),
        }
    }
}

/// Owns a run's channel for its reader task: when the task ends (or is dropped with its runtime)
/// the run's entry goes, unless a newer channel replaced it.
struct ReaderGuard {
    shared: Arc<Shared>,
    run_id: RunId,
    tx: broadcast::Sender<Arc<Event>>,
}

impl ReaderGuard {
    /// Whether the channel has no receiver left; if so it is released, atomically with respect to
    /// `subscribe`, so a new subscriber either joins this channel before the check or gets a new one.
    fn release_if_unused(&self) -> bool {
        let mut channels = self.shared.channels();
        if self.tx.receiver_count() > 0 {
            return false;
        }
        if channels.get(&self.run_id).is_some_and(|tx| tx.same_channel(&self.tx)) {
            channels.remove(&self.run_id);
        }
        true
    }
}

impl Drop for ReaderGuard {
    fn drop(&mut self) {
        {
            let mut channels = self.shared.channels();
            if channels.get(&self.run_id).is_some_and(|tx| tx.same_channel(&self.tx)) {
                channels.remove(&self.run_id);
            }
        }
        self.shared.readers.fetch_sub(1, Ordering::SeqCst);
    }
}

/// One run's reader task: `XREAD BLOCK` from `last_id` on, forwarding other instances' events.
async fn read_loop(guard: ReaderGuard, mut last_id: String) {
    let shared = guard.shared.clone();
    let key = shared.key(&guard.run_id);
    let block_ms = shared.config.block.as_millis().max(1) as u64;
    let connection_config =
        connection_config(&shared.config).set_response_timeout(shared.config.response_timeout + shared.config.block);
    let mut conn: Option<MultiplexedConnection> = None;
    // the connection was another task's and has not answered this one yet
    let mut kept = false;
    let mut backoff = MIN_BACKOFF;
    let mut retry_at: Option<Instant> = None;
    loop {
        if guard.release_if_unused() {
            // idle: its last `XREAD` was answered
            if let Some(c) = conn {
                let mut idle = shared.idle_connections();
                if idle.len() < IDLE_CONNECTIONS {
                    idle.push(c);
                }
            }
            return;
        }
        if let Some(at) = retry_at {
            let now = Instant::now();
            if now < at {
                // Wake up at least once per `block` to notice the receivers are gone.
                tokio::time::sleep((at - now).min(shared.config.block)).await;
                continue;
            }
            retry_at = None;
        }
        if conn.is_none() {
            conn = shared.idle_connections().pop();
            kept = conn.is_some();
        }
        let c = match conn.as_mut() {
            Some(c) => c,
            None => match shared.client.get_multiplexed_async_connection_with_config(&connection_config).await {
                Ok(c) => conn.insert(c),
                Err(e) => {
                    read_failed(&shared, &guard.run_id, &e, backoff);
                    retry_at = Some(Instant::now() + backoff);
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                    continue;
                }
            },
        };
        let read = redis::cmd("XREAD")
            .arg("COUNT")
            .arg(READ_COUNT)
            .arg("BLOCK")
            .arg(block_ms)
            .arg("STREAMS")
            .arg(&key)
            .arg(&last_id)
            .query_async::<Value>(c)
            .await;
        // The entries are read in place, borrowing the reply: an entry this instance published
        // (most of them, when its own runs are the ones subscribed) is skipped by comparing its
        // `src` bytes, its data never copied.
        let failure = match read {
            Ok(reply) => match read_entries(&reply) {
                Ok(entries) => {
                    kept = false;
                    backoff = MIN_BACKOFF;
                    if let Some(last) = entries.last() {
                        last_id = String::from_utf8_lossy(last.id).into_owned();
                    }
                    for entry in entries {
                        if entry.src == Some(shared.instance.as_bytes()) {
                            continue;
                        }
                        let parsed = entry
                            .data
                            .ok_or_else(|| "no data field".to_owned())
                            .and_then(|data| serde_json::from_slice::<Event>(data).map_err(|e| e.to_string()));
                        match parsed {
                            // An error means no receiver is left; the next turn ends the task.
                            Ok(event) => {
                                let _ = guard.tx.send(Arc::new(event));
                            }
                            Err(e) => {
                                if let Some(suppressed) = shared.read_warning.check() {
                                    let entry = String::from_utf8_lossy(entry.id);
                                    tracing::warn!(key = %key, entry = %entry, error = %e,
                                        suppressed_warnings = suppressed, "redis bus skipped an unreadable stream entry");
                                }
                            }
                        }
                    }
                    continue;
                }
                Err(why) => RedisError::from((redis::ErrorKind::TypeError, "unexpected XREAD reply", why.to_owned())),
            },
            Err(e) => e,
        };
        conn = None;
        // a kept connection Redis closed while it was idle: a new one at once
        if std::mem::take(&mut kept) {
            continue;
        }
        read_failed(&shared, &guard.run_id, &failure, backoff);
        retry_at = Some(Instant::now() + backoff);
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// One entry of an `XREAD` reply, borrowed from it: its id, and its `src` and `data` fields.
#[derive(Debug, PartialEq)]
struct Entry<'v> {
    id: &'v [u8],
    src: Option<&'v [u8]>,
    data: Option<&'v [u8]>,
}

/// The entries of an `XREAD` reply, in order, whatever stream they are of: nil (no entry before
/// the block ended), or per stream its key and its entries — an array of pairs (RESP2) or a map
/// (RESP3) — each entry its id and its fields, flat (RESP2) or a map (RESP3).
fn read_entries(reply: &Value) -> Result<Vec<Entry<'_>>, &'static str> {
    let streams: Vec<&Value> = match reply {
        Value::Nil => return Ok(Vec::new()),
        Value::Array(streams) => streams
            .iter()
            .map(|stream| match stream {
                Value::Array(pair) if pair.len() == 2 => Ok(&pair[1]),
                _ => Err("a stream is not its key and its entries"),
            })
            .collect::<Result<_, _>>()?,
        Value::Map(streams) => streams.iter().map(|(_, entries)| entries).collect(),
        _ => return Err("not a list of streams"),
    };
    let mut out = Vec::new();
    for entries in streams {
        let Value::Array(entries) = entries else { return Err("a stream's entries are not a list") };
        for entry in entries {
            let Value::Array(parts) = entry else { return Err("an entry is not a list") };
            let [id, fields] = parts.as_slice() else { return Err("an entry is not its id and its fields") };
            let mut read = Entry { id: bytes(id)?, src: None, data: None };
            match fields {
                Value::Array(flat) if flat.len() % 2 == 0 => {
                    for pair in flat.chunks_exact(2) {
                        read.field(&pair[0], &pair[1])?;
                    }
                }
                Value::Map(pairs) => {
                    for (name, value) in pairs {
                        read.field(name, value)?;
                    }
                }
                _ => return Err("an entry's fields are not pairs"),
            }
            out.push(read);
        }
    }
    Ok(out)
}

impl<'v> Entry<'v> {
    /// Keeps the field `name` if it is one the reader uses.
    fn field(&mut self, name: &'v Value, value: &'v Value) -> Result<(), &'static str> {
        match bytes(name)? {
            b"src" => self.src = Some(bytes(value)?),
            b"data" => self.data = Some(bytes(value)?),
            _ => {}
        }
        Ok(())
    }
}

fn bytes(v: &Value) -> Result<&[u8], &'static str> {
    match v {
        Value::BulkString(b) => Ok(b),
        Value::SimpleString(s) => Ok(s.as_bytes()),
        _ => Err("a field is not a string"),
    }
}

fn read_failed(shared: &Shared, run_id: &RunId, error: &RedisError, retry_in: Duration) {
    if let Some(suppressed) = shared.read_warning.check() {
        tracing::warn!(run_id = %run_id, error = %error, retry_in = ?retry_in, suppressed_warnings = suppressed,
            "redis bus reader lost redis; local subscribers fall back to the store until it is back");
    }
}

fn connection_config(config: &RedisBusConfig) -> AsyncConnectionConfig {
    AsyncConnectionConfig::new()
        .set_connection_timeout(config.connect_timeout)
        .set_response_timeout(config.response_timeout)
}

/// The stream id `replay_window` before now: entries after it are read.
fn start_id(replay_window: Duration) -> String {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    let ms = now.saturating_sub(replay_window).as_millis();
    format!("{}-0", ms.saturating_sub(1))
}

/// The URL without its password, for messages.
fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else { return url.to_owned() };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => {
            let user = rest[..at].split(':').next().unwrap_or("");
            format!("{scheme}://{user}:***@{}", &rest[at + 1..])
        }
        None => url.to_owned(),
    }
}

/// Lets one warning through per [`WARN_EVERY`], counting the ones it held back.
#[derive(Default)]
struct RateLimit {
    last: Mutex<Option<Instant>>,
    suppressed: AtomicU64,
}

impl RateLimit {
    /// `Some(warnings suppressed since the last one)` when this one may be logged.
    fn check(&self) -> Option<u64> {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        if last.is_some_and(|t| now.duration_since(t) < WARN_EVERY) {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        *last = Some(now);
        Some(self.suppressed.swap(0, Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacts_passwords() {
        assert_eq!(redact("redis://127.0.0.1:6379"), "redis://127.0.0.1:6379");
        assert_eq!(redact("redis://:secret@host:6379/0"), "redis://:***@host:6379/0");
        assert_eq!(redact("rediss://user:secret@host"), "rediss://user:***@host");
        assert_eq!(redact("not a url"), "not a url");
    }

    #[test]
    fn start_id_is_in_the_past() {
        let id = start_id(Duration::from_secs(1));
        let (ms, seq) = id.split_once('-').unwrap();
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis();
        let ms: u128 = ms.parse().unwrap();
        assert!(ms < now && now - ms <= 1_000 + 1_000, "{id} vs {now}");
        assert_eq!(seq, "0");
    }

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn xread_replies_are_read_in_place_in_both_protocols() {
        let entry = |id: &str, src: &str, data: &str| {
            Value::Array(vec![bulk(id), Value::Array(vec![bulk("data"), bulk(data), bulk("src"), bulk(src)])])
        };
        // RESP2: [[key, [[id, [field, value, …]], …]], …]
        let resp2 = Value::Array(vec![
            Value::Array(vec![
                bulk("keel:run:a"),
                Value::Array(vec![entry("1-0", "me", "{}"), entry("1-1", "other", "[1]")]),
            ]),
            Value::Array(vec![bulk("keel:run:b"), Value::Array(vec![entry("2-0", "other", "{\"x\":2}")])]),
        ]);
        let expected = vec![
            Entry { id: b"1-0", src: Some(b"me"), data: Some(b"{}") },
            Entry { id: b"1-1", src: Some(b"other"), data: Some(b"[1]") },
            Entry { id: b"2-0", src: Some(b"other"), data: Some(b"{\"x\":2}") },
        ];
        assert_eq!(read_entries(&resp2).unwrap(), expected);
        // RESP3: {key: [[id, {field: value, …}], …]}
        let resp3 = Value::Map(vec![(
            bulk("keel:run:a"),
            Value::Array(vec![Value::Array(vec![
                bulk("3-0"),
                Value::Map(vec![(bulk("src"), bulk("me")), (bulk("data"), bulk("{}")), (bulk("extra"), Value::Int(1))]),
            ])]),
        )]);
        assert_eq!(read_entries(&resp3).unwrap(), vec![Entry { id: b"3-0", src: Some(b"me"), data: Some(b"{}") }]);
        // no entry before the block ended
        assert_eq!(read_entries(&Value::Nil).unwrap(), vec![]);
        // an entry without data is read; its reader reports it
        let bare = Value::Array(vec![Value::Array(vec![
            bulk("k"),
            Value::Array(vec![Value::Array(vec![bulk("4-0"), Value::Array(vec![])])]),
        ])]);
        assert_eq!(read_entries(&bare).unwrap(), vec![Entry { id: b"4-0", src: None, data: None }]);
        // what is not a stream reply is an error, never a panic
        for odd in [
            Value::Int(3),
            Value::Array(vec![Value::Int(1)]),
            Value::Array(vec![Value::Array(vec![bulk("k"), Value::Int(2)])]),
            Value::Array(vec![Value::Array(vec![bulk("k"), Value::Array(vec![Value::Array(vec![bulk("5-0")])])])]),
            Value::Array(vec![Value::Array(vec![
                bulk("k"),
                Value::Array(vec![Value::Array(vec![bulk("5-0"), Value::Array(vec![bulk("odd")])])]),
            ])]),
            Value::Array(vec![Value::Array(vec![
                bulk("k"),
                Value::Array(vec![Value::Array(vec![Value::Nil, Value::Array(vec![])])]),
            ])]),
        ] {
            assert!(read_entries(&odd).is_err(), "{odd:?}");
        }
    }

    #[test]
    fn rate_limit_lets_one_through_then_counts() {
        let r = RateLimit::default();
        assert_eq!(r.check(), Some(0));
        assert_eq!(r.check(), None);
        assert_eq!(r.check(), None);
        assert_eq!(r.suppressed.load(Ordering::Relaxed), 2);
    }
}
