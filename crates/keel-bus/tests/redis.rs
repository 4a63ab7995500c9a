//! `RedisBus`: the bus conformance suite on one instance and across two instances, plus what only
//! a shared bus has (trimming and expiry, overflow, Redis going away).
//!
//! Tests that need Redis read `KEEL_TEST_REDIS_URL`. Unset, they print that they are skipped and
//! return; set, an unreachable Redis fails them. Each test uses its own key prefix.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use keel_bus::conformance::{self, event, events, receive_through, wait_until};
use keel_bus::{BusError, RedisBus, RedisBusConfig};
use keel_core::bus::Bus;
use keel_core::{Event, RunId};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// The Redis to test against, or `None` (and a line saying the test is skipped).
fn redis_url(test: &str) -> Option<String> {
    match std::env::var("KEEL_TEST_REDIS_URL") {
        Ok(url) if !url.trim().is_empty() => Some(url),
        _ => {
            println!("skipped {test}: KEEL_TEST_REDIS_URL is not set");
            None
        }
    }
}

fn unique_prefix() -> String {
    format!("keel-test-{}:", uuid::Uuid::now_v7().simple())
}

fn test_config(prefix: &str) -> RedisBusConfig {
    // Short-lived keys: a test's streams are gone soon after it.
    RedisBusConfig { prefix: prefix.to_owned(), ttl: Duration::from_secs(120), ..RedisBusConfig::default() }
}

async fn connect(url: &str, config: RedisBusConfig) -> Arc<RedisBus> {
    match RedisBus::connect_with(url, config).await {
        Ok(bus) => Arc::new(bus),
        Err(e) => panic!("KEEL_TEST_REDIS_URL is set but the bus cannot use it: {e}"),
    }
}

/// One bus, or two instances ("processes") sharing a prefix.
async fn buses(url: &str, two: bool) -> (Arc<RedisBus>, Arc<RedisBus>) {
    let prefix = unique_prefix();
    let a = connect(url, test_config(&prefix)).await;
    let b = if two { connect(url, test_config(&prefix)).await } else { a.clone() };
    (a, b)
}

fn as_dyn(bus: &Arc<RedisBus>) -> Arc<dyn Bus> {
    bus.clone()
}

/// Runs the bus follows.
fn live(bus: &Arc<RedisBus>) -> impl Fn() -> usize {
    let bus = bus.clone();
    move || bus.channel_count()
}

macro_rules! on_one_and_two_instances {
    ($($case:ident),* $(,)?) => {$(
        mod $case {
            use super::*;

            #[tokio::test]
            async fn one_instance() {
                let Some(url) = redis_url(concat!(stringify!($case), "::one_instance")) else { return };
                let (a, _) = buses(&url, false).await;
                conformance::$case(as_dyn(&a), as_dyn(&a)).await;
            }

            #[tokio::test]
            async fn two_instances() {
                let Some(url) = redis_url(concat!(stringify!($case), "::two_instances")) else { return };
                let (a, b) = buses(&url, true).await;
                conformance::$case(as_dyn(&a), as_dyn(&b)).await;
            }
        }
    )*};
}

on_one_and_two_instances!(
    delivers_in_order,
    fans_out_to_every_subscriber,
    keeps_runs_apart,
    late_subscriber_gets_later_events,
    many_runs_at_once,
);

#[tokio::test]
async fn idle_publish_holds_nothing() {
    let Some(url) = redis_url("idle_publish_holds_nothing") else { return };
    let (a, _) = buses(&url, false).await;
    conformance::idle_publish_holds_nothing(as_dyn(&a), live(&a)).await;
}

#[tokio::test]
async fn releases_run_after_last_receiver() {
    let Some(url) = redis_url("releases_run_after_last_receiver") else { return };
    let (a, _) = buses(&url, false).await;
    conformance::releases_run_after_last_receiver(as_dyn(&a), live(&a)).await;
    assert_eq!(a.channel_count(), 0);
}

/// A run other instances publish to is released too once its receivers are gone.
#[tokio::test]
async fn a_busy_run_is_released_after_last_receiver() {
    let Some(url) = redis_url("a_busy_run_is_released_after_last_receiver") else { return };
    let (a, b) = buses(&url, true).await;
    let run = RunId::new();
    let mut rx = b.subscribe(&run);
    a.publish(&events(&run, 1, 3));
    receive_through(&mut rx, &run, 3).await;
    assert_eq!(b.channel_count(), 1);
    drop(rx);
    // The run goes on publishing; its messages keep coming, but the run must still be released.
    let mut sequence = 3;
    let publishing = live(&b);
    wait_until("the run to be released while it is still publishing", || {
        sequence += 1;
        a.publish(&[event(&run, sequence)]);
        publishing() == 0
    })
    .await;
}

/// A closed port fails `connect` with the address in the message, quickly.
#[tokio::test]
async fn connect_fails_clearly_when_redis_is_down() {
    let port = closed_port().await;
    let url = format!("redis://127.0.0.1:{port}");
    let started = Instant::now();
    let result = tokio::time::timeout(Duration::from_secs(30), RedisBus::connect(&url, "keel-test:"))
        .await
        .expect("connect to a closed port should fail, not hang");
    let err = match result {
        Ok(_) => panic!("connected to a closed port"),
        Err(e) => e,
    };
    assert!(matches!(err, BusError::Connect { .. }), "{err:?}");
    let message = err.to_string();
    assert!(message.contains(&url), "the error should name the address: {message}");
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
    println!("{message}");
}

#[tokio::test]
async fn connect_keeps_the_password_out_of_errors() {
    let port = closed_port().await;
    let err = match RedisBus::connect(&format!("redis://:hunter2@127.0.0.1:{port}"), "keel-test:").await {
        Ok(_) => panic!("connected to a closed port"),
        Err(e) => e,
    };
    let message = err.to_string();
    assert!(!message.contains("hunter2"), "{message}");
    assert!(message.contains(&format!("127.0.0.1:{port}")), "{message}");
}

#[tokio::test]
async fn connect_rejects_a_bad_url() {
    let err = match RedisBus::connect("http://127.0.0.1:6379", "keel-test:").await {
        Ok(_) => panic!("accepted an http URL"),
        Err(e) => e,
    };
    assert!(matches!(err, BusError::InvalidUrl { .. }), "{err:?}");
    let err = match RedisBus::connect_with(
        "redis://127.0.0.1:6379",
        RedisBusConfig { stream_maxlen: 0, ..Default::default() },
    )
    .await
    {
        Ok(_) => panic!("accepted stream_maxlen 0"),
        Err(e) => e,
    };
    assert!(matches!(err, BusError::Config(_)), "{err:?}");
}

/// One stream per run under the prefix, an entry per commit holding its events' JSON (an array),
/// trimmed to about `MAXLEN` entries, expiring after the TTL (the default hour here).
#[tokio::test]
async fn streams_are_trimmed_and_expire() {
    let Some(url) = redis_url("streams_are_trimmed_and_expire") else { return };
    let prefix = unique_prefix();
    let bus = RedisBus::connect(&url, &prefix).await.unwrap_or_else(|e| panic!("{e}"));
    let run = RunId::new();
    let key = bus.stream_key(&run);
    assert_eq!(key, format!("{prefix}run:{run}"));
    // 2,500 commits of one event, then one of three
    let sent = events(&run, 1, 2503);
    for one in sent[..2500].chunks(1) {
        bus.publish(one);
    }
    bus.publish(&sent[2500..]);
    wait_until("2503 events to be written", || bus.published_count() >= 2503).await;
    assert_eq!(bus.dropped_count(), 0);

    let mut conn = redis::Client::open(url.as_str()).unwrap().get_multiplexed_async_connection().await.unwrap();
    let len: usize = redis::cmd("XLEN").arg(&key).query_async(&mut conn).await.unwrap();
    // `MAXLEN ~` trims whole radix-tree nodes (100 entries by default), never below the limit.
    assert!((1000..1200).contains(&len), "stream length {len}");
    let ttl: i64 = redis::cmd("TTL").arg(&key).query_async(&mut conn).await.unwrap();
    assert!((3500..=3600).contains(&ttl), "ttl {ttl}");
    let last: redis::streams::StreamRangeReply =
        redis::cmd("XREVRANGE").arg(&key).arg("+").arg("-").arg("COUNT").arg(2).query_async(&mut conn).await.unwrap();
    let data = |i: usize| -> Vec<Event> {
        let data: String = last.ids[i].get("data").expect("a data field");
        serde_json::from_str(&data).unwrap()
    };
    assert_eq!(data(0), sent[2500..], "the last commit's three events, one entry");
    assert_eq!(data(1), [sent[2499].clone()]);
    assert!(last.ids[0].contains_key("src"));
    let _: () = redis::cmd("DEL").arg(&key).query_async(&mut conn).await.unwrap();
}

/// A full queue drops (and counts) what Redis would have got, never what local subscribers get;
/// later events go through again.
#[tokio::test]
async fn a_full_queue_drops_and_counts() {
    let Some(url) = redis_url("a_full_queue_drops_and_counts") else { return };
    let prefix = unique_prefix();
    // A one-thread runtime: the writer cannot drain the queue while this test publishes.
    let a = connect(&url, RedisBusConfig { queue_capacity: 4, channel_capacity: 2048, ..test_config(&prefix) }).await;
    let b = connect(&url, test_config(&prefix)).await;
    let run = RunId::new();
    let mut local = a.subscribe(&run);
    let mut remote = b.subscribe(&run);
    let started = Instant::now();
    for s in 1..=1000 {
        a.publish(&[event(&run, s)]);
    }
    assert!(started.elapsed() < Duration::from_secs(2), "publishing blocked: {:?}", started.elapsed());
    assert_eq!(a.dropped_count(), 996);

    let got = receive_through(&mut local, &run, 1000).await;
    assert_eq!(got.len(), 1000, "local subscribers get every event whatever Redis gets");

    a.publish(&[event(&run, 1001)]);
    let got: Vec<i64> = receive_through(&mut remote, &run, 1001).await.iter().map(|e| e.sequence).collect();
    assert_eq!(got, [1, 2, 3, 4, 1001], "the queued events, then the next one");
    wait_until("the writer to catch up", || a.published_count() == 5).await;
}

/// Redis going away: publishing neither blocks nor panics, the run stays followed, and events
/// flow again once Redis is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn survives_losing_redis() {
    let Some(url) = redis_url("survives_losing_redis") else { return };
    let proxy = Proxy::start(&url).await;
    let prefix = unique_prefix();
    let a = connect(&proxy.url, test_config(&prefix)).await;
    let b = connect(&proxy.url, test_config(&prefix)).await;
    let run = RunId::new();
    let mut rx = b.subscribe(&run);
    a.publish(&[event(&run, 1)]);
    receive_through(&mut rx, &run, 1).await;

    proxy.go_down();
    let started = Instant::now();
    for s in 2..=501 {
        a.publish(&[event(&run, s)]);
    }
    assert!(started.elapsed() < Duration::from_secs(2), "publishing blocked: {:?}", started.elapsed());
    // The writer fails its pipelines while Redis is away and says so in its count.
    wait_until("the writer to drop events while Redis is down", || a.dropped_count() > 0).await;
    assert_eq!(b.channel_count(), 1, "the run should stay followed through the outage");
    proxy.come_back();

    // Publish until one event from after the outage reaches the other instance.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut sequence = 501;
    'resumed: loop {
        assert!(Instant::now() < deadline, "no event reached the other instance within 30 s of Redis coming back");
        sequence += 1;
        a.publish(&[event(&run, sequence)]);
        let until = Instant::now() + Duration::from_millis(200);
        while let Ok(received) = tokio::time::timeout_at(until.into(), rx.recv()).await {
            match received {
                Ok(e) if e.sequence > 501 => break 'resumed,
                Ok(_) => {}
                // A burst from before the outage may overflow the bounded channel: readers re-read
                // the store then, so a lag is allowed here.
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                Err(e) => panic!("receiver failed: {e}"),
            }
        }
    }
    // And from then on, in order.
    a.publish(&events(&run, sequence + 1, sequence + 20));
    let got = receive_through(&mut rx, &run, sequence + 20).await;
    let tail: Vec<i64> = got.iter().map(|e| e.sequence).filter(|s| *s > sequence).collect();
    assert_eq!(tail, (sequence + 1..=sequence + 20).collect::<Vec<_>>());
}

/// However many runs an instance follows, it holds the same few connections to Redis (the
/// writer's, the follower's, the one streams are read on), and a run nobody publishes to costs
/// Redis no command: with a blocking `XREAD` per run, following 100 runs took 100 connections
/// and 100 commands a second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn following_many_runs_takes_a_few_connections_and_no_idle_commands() {
    let Some(url) = redis_url("following_many_runs_takes_a_few_connections_and_no_idle_commands") else { return };
    let proxy = Proxy::start(&url).await;
    let prefix = unique_prefix();
    // `a` publishes straight to Redis; `b` follows through the proxy, which counts its connections
    // and what it sends
    let a = connect(&url, test_config(&prefix)).await;
    let b =
        connect(&proxy.url, RedisBusConfig { release_every: Duration::from_millis(100), ..test_config(&prefix) }).await;
    // one run followed first: the follower's connections are open
    let first = RunId::new();
    let mut rx = b.subscribe(&first);
    a.publish(&events(&first, 1, 1));
    receive_through(&mut rx, &first, 1).await;
    drop(rx);
    wait_until("the first run to be released", || b.channel_count() == 0).await;
    let connected = proxy.accepted.load(Ordering::SeqCst);
    let runs: Vec<RunId> = (0..100).map(|_| RunId::new()).collect();
    let mut receivers: Vec<_> = runs.iter().map(|run| b.subscribe(run)).collect();
    for run in &runs {
        a.publish(&events(run, 1, 3));
    }
    for (run, rx) in runs.iter().zip(receivers.iter_mut()) {
        receive_through(rx, run, 3).await;
    }
    assert_eq!(b.channel_count(), 100);
    let opened = proxy.accepted.load(Ordering::SeqCst) - connected;
    assert_eq!(opened, 0, "following 100 runs opened {opened} connections");

    // idle: three sweeps, not a byte to Redis
    let sent = proxy.sent.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(350)).await;
    assert_eq!(proxy.sent.load(Ordering::SeqCst), sent, "idle runs made the follower send commands");

    // half the runs released: one UNSUBSCRIBE; the other half still get their events
    receivers.truncate(50);
    wait_until("the released runs to go", || b.channel_count() == 50).await;
    for run in &runs[..50] {
        a.publish(&events(run, 4, 4));
    }
    for (run, rx) in runs.iter().zip(receivers.iter_mut()) {
        receive_through(rx, run, 4).await;
    }
    assert_eq!(proxy.accepted.load(Ordering::SeqCst), connected);
}

/// A run followed again, once released or before its release, gets every event published after
/// each `subscribe`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_followed_again_gets_what_is_published_after() {
    let Some(url) = redis_url("a_run_followed_again_gets_what_is_published_after") else { return };
    let (a, b) = buses(&url, true).await;
    let run = RunId::new();
    for round in 0..20 {
        let from = round * 3 + 1;
        let mut rx = b.subscribe(&run);
        a.publish(&events(&run, from, from + 2));
        let got: Vec<i64> = receive_through(&mut rx, &run, from + 2).await.iter().map(|e| e.sequence).collect();
        assert_eq!(got.last(), Some(&(from + 2)), "round {round}: {got:?}");
        assert!(got.contains(&from), "round {round}: the first event after subscribe is missing: {got:?}");
        drop(rx);
        if round % 2 == 0 {
            wait_until("the run to be released", || b.channel_count() == 0).await;
        }
    }
}

async fn closed_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    listener.local_addr().unwrap().port()
    // Dropped here: nothing listens on the port any more.
}

/// A TCP forwarder to Redis that can go down: it cuts every connection and refuses new ones until
/// it comes back.
struct Proxy {
    url: String,
    down: Arc<AtomicBool>,
    cut: watch::Sender<u64>,
    /// Connections it forwarded.
    accepted: Arc<std::sync::atomic::AtomicUsize>,
    /// Bytes its clients sent to Redis.
    sent: Arc<std::sync::atomic::AtomicUsize>,
}

impl Proxy {
    async fn start(upstream_url: &str) -> Self {
        let rest = upstream_url.strip_prefix("redis://").expect("this test proxies plain redis:// URLs");
        let (authority, path) = match rest.split_once('/') {
            Some((authority, path)) => (authority, format!("/{path}")),
            None => (rest, String::new()),
        };
        let (userinfo, host) = match authority.rsplit_once('@') {
            Some((userinfo, host)) => (format!("{userinfo}@"), host),
            None => (String::new(), authority),
        };
        let host = if host.contains(':') { host.to_owned() } else { format!("{host}:6379") };
        let upstream: SocketAddr = tokio::net::lookup_host(&host).await.unwrap().next().expect("an address for Redis");
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("redis://{userinfo}{}{path}", listener.local_addr().unwrap());
        let down = Arc::new(AtomicBool::new(false));
        let (cut, _) = watch::channel(0u64);
        let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let sent = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (accept_down, accept_cut, counted, sent_by_all) =
            (down.clone(), cut.clone(), accepted.clone(), sent.clone());
        tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                if accept_down.load(Ordering::SeqCst) {
                    continue; // dropped: refused
                }
                counted.fetch_add(1, Ordering::SeqCst);
                let mut cut = accept_cut.subscribe();
                let sent = sent_by_all.clone();
                tokio::spawn(async move {
                    let Ok(outbound) = TcpStream::connect(upstream).await else { return };
                    let (mut from_client, mut to_client) = inbound.split();
                    let (mut from_redis, mut to_redis) = outbound.into_split();
                    let upstream = async {
                        let mut buf = vec![0u8; 16 * 1024];
                        loop {
                            let n = match from_client.read(&mut buf).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => n,
                            };
                            sent.fetch_add(n, Ordering::SeqCst);
                            if to_redis.write_all(&buf[..n]).await.is_err() {
                                return;
                            }
                        }
                    };
                    tokio::select! {
                        _ = upstream => {}
                        _ = tokio::io::copy(&mut from_redis, &mut to_client) => {}
                        _ = cut.changed() => {}
                    }
                });
            }
        });
        Self { url, down, cut, accepted, sent }
    }

    fn go_down(&self) {
        self.down.store(true, Ordering::SeqCst);
        self.cut.send_modify(|generation| *generation += 1);
    }

    fn come_back(&self) {
        self.down.store(false, Ordering::SeqCst);
    }
}
