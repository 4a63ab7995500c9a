//! The Redis bus: Redis Streams for what was published, Pub/Sub for what is being published.
//!
//! Publishing: [`Bus::publish`] delivers to this instance's subscribers at once (as `LocalBus`
//! does) and hands a copy to a bounded queue; one background task drains the queue and pipelines,
//! for each commit's events of a run, one `XADD {prefix}run:{run_id} MAXLEN ~ N * data [<events>]
//! src <instance>` and one `PUBLISH {prefix}run:{run_id} "<instance> [<events>]"`, plus an
//! `EXPIRE` per stream, so the streams of finished runs go away. A full queue or a Redis error
//! drops the events and counts them: the caller never waits for Redis. (An entry per event cost a
//! HITL run 26 `XADD`s; docs/benchmarks.md, "Eighteenth session".)
//!
//! Subscribing: whatever the number of runs it follows, an instance holds two connections for
//! them: one in subscribe mode, one for reading streams. The first local subscriber of a run adds
//! it to the runs the instance follows; one follower task keeps the subscribe connection's
//! channels equal to those runs (one `SUBSCRIBE` and one `UNSUBSCRIBE` for all the changes it
//! finds at a time), forwards the messages of other instances (its own were delivered locally
//! already) into the runs' broadcast channels, and every [`RedisBusConfig::release_every`]
//! releases the runs whose channels have no receiver left. An idle stream costs Redis nothing:
//! no connection and no command of its own (a blocking `XREAD` per run used to hold a connection
//! each and ask again every second; docs/benchmarks.md, "Eighteenth session").
//!
//! A message published before a run's `SUBSCRIBE` reached Redis is not delivered by it. So once
//! the `SUBSCRIBE` is answered, the follower reads the run's stream (`XRANGE`) from an id taken
//! from the clock at `subscribe` time, a little in the past ([`RedisBusConfig::replay_window`]),
//! and delivers those entries first; the messages that came meanwhile wait, then follow them, and
//! anything at or below the highest sequence delivered is dropped. Losing Redis, the follower
//! connects again (with backoff), follows every run again and reads each stream from a little
//! before the loss. The bus may replay a few events the reader already has; readers drop
//! `sequence <= last`, and read the store on a gap.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::StreamExt;
use keel_core::bus::Bus;
use keel_core::{Event, RunId};
use redis::aio::{ConnectionManager, ConnectionManagerConfig, MultiplexedConnection};
use redis::{AsyncConnectionConfig, Client, RedisError, Value};
use tokio::runtime::Handle;
use tokio::sync::{broadcast, mpsc, Notify};

/// Settings of a [`RedisBus`]. `Default` is what [`RedisBus::connect`] uses, with its prefix.
#[derive(Debug, Clone)]
pub struct RedisBusConfig {
    /// Prepended to every key: a run's stream (and its channel) is `{prefix}run:{run_id}`.
    pub prefix: String,
    /// Approximate length a stream is trimmed to (`MAXLEN ~`), in entries: a commit's events each.
    pub stream_maxlen: usize,
    /// A stream expires this long after its last publish (whole seconds, at least one).
    pub ttl: Duration,
    /// Publish calls that may wait for the writer task; past that, publishing drops and counts.
    pub queue_capacity: usize,
    /// Capacity of each run's local broadcast channel.
    pub channel_capacity: usize,
    /// How often the follower releases the runs nobody receives any more.
    pub release_every: Duration,
    /// How far before `subscribe` (or before losing Redis) a run's stream is read from: covers the
    /// time until its `SUBSCRIBE` is answered, and clock skew between instances and Redis.
    pub replay_window: Duration,
    /// Timeout of one attempt to open a connection.
    pub connect_timeout: Duration,
    /// Timeout of one command.
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
            release_every: Duration::from_secs(1),
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

/// [`Bus`] over Redis Streams and Pub/Sub; see the module docs.
pub struct RedisBus {
    shared: Arc<Shared>,
    queue: mpsc::Sender<Vec<Event>>,
}

struct Shared {
    config: RedisBusConfig,
    client: Client,
    /// Written into every entry and message so a reader skips what its own instance delivered.
    instance: String,
    /// `{prefix}run:`, what a run's channel starts with.
    channel_prefix: String,
    follows: Mutex<Follows>,
    /// Wakes the follower: runs to follow, or the bus is gone.
    wake: Notify,
    closed: AtomicBool,
    /// Gives each follow its own number: a run released and followed again is a new follow.
    next_follow: AtomicU64,
    /// The follower's connections, counted: a stream read for an earlier one is not delivered.
    generation: AtomicU64,
    /// The connection streams are read on, made when first needed, shared by every read.
    commands: tokio::sync::Mutex<Option<MultiplexedConnection>>,
    published: AtomicU64,
    dropped: AtomicU64,
    drop_warning: RateLimit,
    read_warning: RateLimit,
}

/// The runs this instance follows, and what changed since the follower last told Redis.
#[derive(Default)]
struct Follows {
    runs: HashMap<RunId, Follow>,
    added: Vec<RunId>,
    released: Vec<RunId>,
}

/// A run with local subscribers.
struct Follow {
    id: u64,
    tx: broadcast::Sender<Arc<Event>>,
    /// The stream id its stream is read from once it is subscribed.
    since: String,
    /// The highest sequence delivered from Redis: a lower one (the stream's overlap with the
    /// messages) is dropped.
    last: i64,
    /// Messages that came before its stream was read, to follow what that read finds; `None`
    /// once it was delivered.
    waiting: Option<VecDeque<Event>>,
}

impl Follow {
    fn offer(&mut self, event: Event) {
        if event.sequence > self.last {
            self.last = event.sequence;
            // An error means no receiver is left; the next sweep releases the run.
            let _ = self.tx.send(Arc::new(event));
        }
    }
}

/// Longest pause between two attempts of the follower to reach Redis.
const MAX_BACKOFF: Duration = Duration::from_secs(5);
const MIN_BACKOFF: Duration = Duration::from_millis(100);
/// Publish calls the writer folds into one pipeline.
const MAX_BATCHES_PER_PIPELINE: usize = 256;
/// Entries one `XRANGE` returns at most.
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
        if config.release_every < Duration::from_millis(1) {
            return Err(BusError::Config("release_every must be at least one millisecond"));
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
        let channel_prefix = format!("{}run:", config.prefix);
        let shared = Arc::new(Shared {
            config,
            client,
            instance: uuid::Uuid::now_v7().simple().to_string(),
            channel_prefix,
            follows: Mutex::new(Follows::default()),
            wake: Notify::new(),
            closed: AtomicBool::new(false),
            next_follow: AtomicU64::new(0),
            generation: AtomicU64::new(0),
            commands: tokio::sync::Mutex::new(None),
            published: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            drop_warning: RateLimit::default(),
            read_warning: RateLimit::default(),
        });
        runtime.spawn(write_loop(shared.clone(), writer, rx));
        runtime.spawn(follow_loop(shared.clone()));
        Ok(Self { shared, queue })
    }

    /// The stream key of a run (also the name of its channel).
    pub fn stream_key(&self, run_id: &RunId) -> String {
        self.shared.key(run_id)
    }

    /// Runs with local subscribers, which the follower follows at Redis (or will again once Redis
    /// is back) until the sweep after their last receiver went releases them (tests and metrics).
    pub fn channel_count(&self) -> usize {
        self.shared.follows().runs.len()
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

impl Drop for RedisBus {
    fn drop(&mut self) {
        // the follower ends (the writer ends with the queue)
        self.shared.closed.store(true, Ordering::SeqCst);
        self.shared.wake.notify_one();
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
            let follows = self.shared.follows();
            for run in events.chunk_by(|a, b| a.run_id == b.run_id) {
                if let Some(follow) = follows.runs.get(&run[0].run_id) {
                    for e in run {
                        // An error means no receiver is left; the next sweep releases the run.
                        let _ = follow.tx.send(Arc::new(e.clone()));
                    }
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
        let rx = {
            let mut follows = self.shared.follows();
            if let Some(follow) = follows.runs.get(run_id) {
                return follow.tx.subscribe();
            }
            let (tx, rx) = broadcast::channel(self.shared.config.channel_capacity);
            let follow = Follow {
                id: self.shared.next_follow.fetch_add(1, Ordering::Relaxed),
                tx,
                since: start_id(self.shared.config.replay_window),
                last: i64::MIN,
                waiting: Some(VecDeque::new()),
            };
            follows.runs.insert(run_id.clone(), follow);
            follows.added.push(run_id.clone());
            rx
        };
        self.shared.wake.notify_one();
        rx
    }
}

impl Shared {
    fn key(&self, run_id: &RunId) -> String {
        format!("{}run:{}", self.config.prefix, run_id)
    }

    fn follows(&self) -> MutexGuard<'_, Follows> {
        self.follows.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
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

    fn read_failed(&self, what: &str, error: &dyn std::fmt::Display) {
        if let Some(suppressed) = self.read_warning.check() {
            tracing::warn!(error = %error, suppressed_warnings = suppressed,
                "redis bus: {what}; local subscribers fall back to the store until Redis answers");
        }
    }

    /// Releases every run whose channel has no receiver left (atomically with respect to
    /// `subscribe`: a new subscriber either joins a channel before it is released or gets a new
    /// one), for the follower to unsubscribe.
    fn release_unused(&self) {
        let mut follows = self.follows();
        let Follows { runs, released, .. } = &mut *follows;
        runs.retain(|run, follow| {
            let used = follow.tx.receiver_count() > 0;
            if !used {
                released.push(run.clone());
            }
            used
        });
    }

    /// After a new connection: every run is followed anew, from `since`, its messages waiting for
    /// that read.
    fn rewind(&self, since: &str) {
        let mut follows = self.follows();
        let Follows { runs, added, .. } = &mut *follows;
        for (run, follow) in runs.iter_mut() {
            follow.since = since.to_owned();
            follow.waiting = Some(VecDeque::new());
            added.push(run.clone());
        }
    }
}

/// One background task: drains the queue into pipelined commands on a reconnecting connection:
/// for each run's events of each commit, one `XADD` of them all and one `PUBLISH` of the same.
async fn write_loop(shared: Arc<Shared>, mut conn: ConnectionManager, mut rx: mpsc::Receiver<Vec<Event>>) {
    let mut batches = Vec::with_capacity(MAX_BATCHES_PER_PIPELINE);
    while rx.recv_many(&mut batches, MAX_BATCHES_PER_PIPELINE).await > 0 {
        let mut pipe = redis::pipe();
        let mut keys = BTreeSet::new();
        let mut count = 0;
        for batch in batches.drain(..) {
            // a batch is one commit's events, all of one run (a caller's batch of several runs
            // is cut where the run changes)
            for run in batch.chunk_by(|a, b| a.run_id == b.run_id) {
                let key = shared.key(&run[0].run_id);
                count += add_commit(&shared, &mut pipe, &key, run);
                keys.insert(key);
            }
        }
        let ttl = shared.config.ttl.as_secs().max(1);
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

/// Adds one run's events of one commit to `pipe`: `XADD key MAXLEN ~ N * data [events] src
/// instance`, then `PUBLISH key "instance [events]"`. The events it could write.
fn add_commit(shared: &Shared, pipe: &mut redis::Pipeline, key: &str, events: &[Event]) -> usize {
    let instance = shared.instance.as_bytes();
    // the message is the instance, a space and the array; the entry's data the array alone
    let mut message = Vec::with_capacity(instance.len() + 2 + EVENT_JSON_CAPACITY * events.len());
    message.extend_from_slice(instance);
    message.extend_from_slice(b" [");
    let mut count = 0;
    for event in events {
        let mark = message.len();
        if count > 0 {
            message.push(b',');
        }
        if let Err(e) = event.write_json(&mut message) {
            message.truncate(mark);
            shared.drop_events(1, &format_args!("an event did not serialize: {e}"));
            continue;
        }
        count += 1;
    }
    if count == 0 {
        return 0;
    }
    message.push(b']');
    let array = &message[instance.len() + 1..];
    // sized for its arguments up front, so appending them never grows it
    let mut xadd = redis::Cmd::with_capacity(10, 64 + key.len() + array.len() + instance.len());
    xadd.arg("XADD")
        .arg(key)
        .arg("MAXLEN")
        .arg("~")
        .arg(shared.config.stream_maxlen)
        .arg("*")
        .arg("data")
        .arg(array)
        .arg("src")
        .arg(instance);
    pipe.add_command(xadd).ignore();
    pipe.cmd("PUBLISH").arg(key).arg(message).ignore();
    count
}

/// The follower: one connection in subscribe mode for every run this instance follows. It keeps
/// the connection's channels equal to the runs followed, forwards other instances' messages, and
/// releases unused runs every [`RedisBusConfig::release_every`]. Losing the connection, it
/// connects again (with backoff) and follows every run again from a little before the loss.
async fn follow_loop(shared: Arc<Shared>) {
    let mut backoff = MIN_BACKOFF;
    let mut since_loss: Option<String> = None;
    let mut sweep = tokio::time::interval(shared.config.release_every);
    sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        if shared.closed() {
            return;
        }
        let connected = tokio::time::timeout(shared.config.connect_timeout, shared.client.get_async_pubsub()).await;
        let pubsub = match connected {
            Ok(Ok(pubsub)) => pubsub,
            failed => {
                let why = match failed {
                    Ok(Err(e)) => e.to_string(),
                    _ => "connecting timed out".to_owned(),
                };
                shared.read_failed("the follower cannot connect", &format_args!("{why}; again in {backoff:?}"));
                // runs keep being released while Redis is away
                let until = tokio::time::Instant::now() + backoff;
                while tokio::time::Instant::now() < until && !shared.closed() {
                    tokio::select! {
                        _ = tokio::time::sleep_until(until) => {}
                        _ = sweep.tick() => shared.release_unused(),
                        _ = shared.wake.notified() => {}
                    }
                }
                backoff = (backoff * 2).min(MAX_BACKOFF);
                continue;
            }
        };
        backoff = MIN_BACKOFF;
        let generation = shared.generation.fetch_add(1, Ordering::SeqCst) + 1;
        if let Some(since) = since_loss.take() {
            shared.rewind(&since);
        }
        let (mut sink, mut stream) = pubsub.split();
        let mut subscribed: HashMap<RunId, u64> = HashMap::new();
        let mut changed = true;
        let failure = loop {
            if std::mem::take(&mut changed) {
                if let Err(e) = follow_changes(&shared, &mut sink, &mut subscribed, generation).await {
                    break e;
                }
            }
            tokio::select! {
                message = stream.next() => match message {
                    Some(message) => deliver(&shared, &message),
                    None => break "the connection closed".to_owned(),
                },
                _ = shared.wake.notified() => {
                    if shared.closed() {
                        return;
                    }
                    changed = true;
                }
                _ = sweep.tick() => {
                    shared.release_unused();
                    changed = true;
                }
            }
        };
        since_loss = Some(start_id(shared.config.replay_window));
        shared.read_failed("the follower lost its connection", &failure);
    }
}

/// Tells Redis the runs released and followed since the last call (one `UNSUBSCRIBE`, one
/// `SUBSCRIBE`, each of many channels), then reads the new follows' streams. An error: the
/// connection is given up.
async fn follow_changes(
    shared: &Arc<Shared>,
    sink: &mut redis::aio::PubSubSink,
    subscribed: &mut HashMap<RunId, u64>,
    generation: u64,
) -> Result<(), String> {
    let mut unsubscribe = Vec::new();
    let mut subscribe = Vec::new();
    let mut backfills = Vec::new();
    {
        let mut follows = shared.follows();
        let Follows { runs, added, released } = &mut *follows;
        for run in released.drain(..) {
            if !runs.contains_key(&run) && subscribed.remove(&run).is_some() {
                unsubscribe.push(shared.key(&run));
            }
        }
        for run in added.drain(..) {
            let Some(follow) = runs.get(&run) else { continue };
            let before = subscribed.insert(run.clone(), follow.id);
            if before.is_none() {
                subscribe.push(shared.key(&run));
            }
            // a run released and followed again before this call is a new follow: read again
            if before != Some(follow.id) || follow.waiting.is_some() {
                backfills.push((run, follow.id));
            }
        }
    }
    let timeout = shared.config.response_timeout;
    if !unsubscribe.is_empty() {
        match tokio::time::timeout(timeout, sink.unsubscribe(&unsubscribe)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(format!("UNSUBSCRIBE failed: {e}")),
            Err(_) => return Err("UNSUBSCRIBE timed out".to_owned()),
        }
    }
    if !subscribe.is_empty() {
        match tokio::time::timeout(timeout, sink.subscribe(&subscribe)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(format!("SUBSCRIBE failed: {e}")),
            Err(_) => return Err("SUBSCRIBE timed out".to_owned()),
        }
    }
    // subscribed now: whatever is published from here on comes as a message, and what was
    // published before is in the stream
    for (run, id) in backfills {
        tokio::spawn(backfill(shared.clone(), run, id, generation));
    }
    Ok(())
}

/// Reads a new follow's stream from its `since` and delivers the other instances' entries, then
/// the messages that came meanwhile. A failed read delivers the messages alone: readers fill any
/// gap from the store.
async fn backfill(shared: Arc<Shared>, run: RunId, id: u64, generation: u64) {
    let since = match shared.follows().runs.get(&run) {
        Some(follow) if follow.id == id => follow.since.clone(),
        _ => return,
    };
    let read = read_stream(&shared, &run, since).await;
    let mut follows = shared.follows();
    // a later connection follows every run again, and reads again
    if shared.generation.load(Ordering::SeqCst) != generation {
        return;
    }
    let Some(follow) = follows.runs.get_mut(&run).filter(|follow| follow.id == id) else { return };
    let waiting = follow.waiting.take().unwrap_or_default();
    match read {
        Ok(events) => events.into_iter().for_each(|event| follow.offer(event)),
        Err(e) => shared.read_failed("a stream could not be read", &e),
    }
    waiting.into_iter().for_each(|event| follow.offer(event));
}

/// The other instances' events in `run`'s stream after `since`, in order (`XRANGE`, a page at a
/// time), on the connection backfills share.
async fn read_stream(shared: &Shared, run: &RunId, since: String) -> Result<Vec<Event>, String> {
    let mut conn = {
        let mut commands = shared.commands.lock().await;
        match commands.as_ref() {
            Some(conn) => conn.clone(),
            None => {
                let conn = shared
                    .client
                    .get_multiplexed_async_connection_with_config(&connection_config(&shared.config))
                    .await
                    .map_err(|e| e.to_string())?;
                commands.insert(conn).clone()
            }
        }
    };
    let key = shared.key(run);
    let mut events = Vec::new();
    let mut from = since;
    loop {
        let reply = redis::cmd("XRANGE")
            .arg(&key)
            .arg(&from)
            .arg("+")
            .arg("COUNT")
            .arg(READ_COUNT)
            .query_async::<Value>(&mut conn)
            .await;
        let reply = match reply {
            Ok(reply) => reply,
            Err(e) => {
                // the next backfill connects again
                *shared.commands.lock().await = None;
                return Err(e.to_string());
            }
        };
        let entries = stream_entries(&reply).map_err(str::to_owned)?;
        let full = entries.len() >= READ_COUNT;
        for entry in &entries {
            if entry.src == Some(shared.instance.as_bytes()) {
                continue;
            }
            match entry.data.map(entry_events) {
                Some(Ok(read)) => events.extend(read),
                _ => shared.read_failed("an unreadable stream entry was skipped", &String::from_utf8_lossy(entry.id)),
            }
        }
        match entries.last() {
            Some(last) if full => from = format!("({}", String::from_utf8_lossy(last.id)),
            _ => return Ok(events),
        }
    }
}

/// The events of a stream entry's `data`: a commit's, as an array (an entry written by an
/// earlier version holds one event, as an object).
fn entry_events(data: &[u8]) -> Result<Vec<Event>, serde_json::Error> {
    match data.iter().find(|b| !b.is_ascii_whitespace()) {
        Some(b'[') => serde_json::from_slice(data),
        _ => serde_json::from_slice::<Event>(data).map(|event| vec![event]),
    }
}

/// A message of a followed run's channel: another instance's events, delivered (or kept until
/// the run's stream was read).
fn deliver(shared: &Shared, message: &redis::Msg) {
    let channel = message.get_channel_name();
    let Some(run) = channel.strip_prefix(shared.channel_prefix.as_str()).and_then(|id| RunId::parse(id).ok()) else {
        return;
    };
    let payload = message.get_payload_bytes();
    let Some(space) = payload.iter().position(|b| *b == b' ') else {
        shared.read_failed("a message without its source was skipped", &channel);
        return;
    };
    if &payload[..space] == shared.instance.as_bytes() {
        return;
    }
    let events: Vec<Event> = match serde_json::from_slice(&payload[space + 1..]) {
        Ok(events) => events,
        Err(e) => {
            shared.read_failed("an unreadable message was skipped", &format_args!("{channel}: {e}"));
            return;
        }
    };
    let capacity = shared.config.channel_capacity;
    let mut follows = shared.follows();
    let Some(follow) = follows.runs.get_mut(&run) else { return };
    match follow.waiting.as_mut() {
        Some(waiting) => {
            for event in events {
                // more than a channel holds: the oldest go, and readers see the gap
                if waiting.len() >= capacity {
                    waiting.pop_front();
                }
                waiting.push_back(event);
            }
        }
        None => events.into_iter().for_each(|event| follow.offer(event)),
    }
}

/// One entry of an `XRANGE` reply, borrowed from it: its id, and its `src` and `data` fields.
#[derive(Debug, PartialEq)]
struct Entry<'v> {
    id: &'v [u8],
    src: Option<&'v [u8]>,
    data: Option<&'v [u8]>,
}

/// The entries of an `XRANGE` reply, in order: each its id and its fields, flat (RESP2) or a map
/// (RESP3).
fn stream_entries(reply: &Value) -> Result<Vec<Entry<'_>>, &'static str> {
    let Value::Array(entries) = reply else { return Err("a stream's entries are not a list") };
    let mut out = Vec::with_capacity(entries.len());
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
    fn stream_entries_are_read_in_place_in_both_protocols() {
        // RESP2: [[id, [field, value, …]], …]
        let entry = |id: &str, src: &str, data: &str| {
            Value::Array(vec![bulk(id), Value::Array(vec![bulk("data"), bulk(data), bulk("src"), bulk(src)])])
        };
        let resp2 = Value::Array(vec![entry("1-0", "me", "{}"), entry("1-1", "other", "[1]")]);
        let expected = vec![
            Entry { id: b"1-0", src: Some(b"me"), data: Some(b"{}") },
            Entry { id: b"1-1", src: Some(b"other"), data: Some(b"[1]") },
        ];
        assert_eq!(stream_entries(&resp2).unwrap(), expected);
        // RESP3: [[id, {field: value, …}], …]
        let resp3 = Value::Array(vec![Value::Array(vec![
            bulk("3-0"),
            Value::Map(vec![(bulk("src"), bulk("me")), (bulk("data"), bulk("{}")), (bulk("extra"), Value::Int(1))]),
        ])]);
        assert_eq!(stream_entries(&resp3).unwrap(), vec![Entry { id: b"3-0", src: Some(b"me"), data: Some(b"{}") }]);
        // an empty stream, or none
        assert_eq!(stream_entries(&Value::Array(vec![])).unwrap(), vec![]);
        // an entry without data is read; its reader reports it
        let bare = Value::Array(vec![Value::Array(vec![bulk("4-0"), Value::Array(vec![])])]);
        assert_eq!(stream_entries(&bare).unwrap(), vec![Entry { id: b"4-0", src: None, data: None }]);
        // what is not a stream's entries is an error, never a panic
        for odd in [
            Value::Nil,
            Value::Int(3),
            Value::Array(vec![Value::Int(1)]),
            Value::Array(vec![Value::Array(vec![bulk("5-0")])]),
            Value::Array(vec![Value::Array(vec![bulk("5-0"), Value::Array(vec![bulk("odd")])])]),
            Value::Array(vec![Value::Array(vec![bulk("5-0"), Value::Int(2)])]),
            Value::Array(vec![Value::Array(vec![Value::Nil, Value::Array(vec![])])]),
        ] {
            assert!(stream_entries(&odd).is_err(), "{odd:?}");
        }
    }

    #[test]
    fn an_entry_holds_a_commits_events_or_one_event_of_an_earlier_version() {
        let run = RunId::new();
        let event = |sequence| {
            Event::new(
                keel_core::EventKind::RunStarted { conversation_id: keel_core::ConversationId::new(), trace_id: None },
                run.clone(),
                sequence,
                chrono::Utc::now(),
            )
        };
        let (one, two) = (event(1), event(2));
        let array = serde_json::to_vec(&[&one, &two]).unwrap();
        assert_eq!(entry_events(&array).unwrap(), vec![one.clone(), two]);
        assert_eq!(entry_events(&serde_json::to_vec(&one).unwrap()).unwrap(), vec![one]);
        assert!(entry_events(b"[{\"type\":\"nothing\"}]").is_err());
        assert!(entry_events(b"").is_err());
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
