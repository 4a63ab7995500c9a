//! The bus conformance suite: what any [`Bus`] does so that readers (`keel_core::stream`) get
//! events live rather than at their next poll of the store.
//!
//! Every case takes a `publisher` and a `subscriber` bus. For a bus of one process they are the
//! same bus; for a shared bus they may be two instances (two processes) on the same backend. A
//! case panics with what it saw when the bus falls short.
//!
//! What a healthy bus must do: deliver every event published after `subscribe` returned, in
//! publish order, to every receiver of that run and of no other run; hold nothing for runs nobody
//! follows; and release a run once its last receiver is gone. What it may do, because readers
//! tolerate it: deliver an event twice, or replay a few events from before `subscribe` (a shared
//! bus may start reading slightly in the past to cover its own start-up). Receivers here therefore
//! skip `sequence <= last`, as readers do. On one bus instance, a late subscriber gets nothing from
//! before it subscribed.

use std::sync::Arc;
use std::time::{Duration, Instant};

use keel_core::bus::Bus;
use keel_core::{Event, EventKind, MessageId, RunId};
use tokio::sync::broadcast::{self, error::RecvError, error::TryRecvError};

/// How long a case waits for something that should happen.
pub const DEADLINE: Duration = Duration::from_secs(10);

/// A text delta of `run_id` with `sequence`.
pub fn event(run_id: &RunId, sequence: i64) -> Event {
    Event::new(
        EventKind::TextDelta { message_id: MessageId::new(), delta: format!("delta {sequence} of {run_id}") },
        run_id.clone(),
        sequence,
        chrono::Utc::now(),
    )
}

/// Events `from..=to` of `run_id`.
pub fn events(run_id: &RunId, from: i64, to: i64) -> Vec<Event> {
    (from..=to).map(|s| event(run_id, s)).collect()
}

/// Receives `run_id`'s events until one with `sequence >= through` arrives, skipping
/// `sequence <= last` as readers do, and returns them in arrival order. Panics on an event of
/// another run, a lagged or closed receiver, or [`DEADLINE`].
pub async fn receive_through(rx: &mut broadcast::Receiver<Arc<Event>>, run_id: &RunId, through: i64) -> Vec<Event> {
    let deadline = Instant::now() + DEADLINE;
    let mut got: Vec<Event> = Vec::new();
    let mut last = i64::MIN;
    while last < through {
        let left = deadline.saturating_duration_since(Instant::now());
        let received = match tokio::time::timeout(left, rx.recv()).await {
            Ok(received) => received,
            Err(_) => panic!(
                "run {run_id}: waited {DEADLINE:?} for sequence {through}; got {:?}",
                got.iter().map(|e| e.sequence).collect::<Vec<_>>()
            ),
        };
        match received {
            Ok(e) if e.run_id != *run_id => panic!("a receiver of run {run_id} got an event of run {}", e.run_id),
            Ok(e) if e.sequence <= last => continue,
            Ok(e) => {
                last = e.sequence;
                got.push(Arc::unwrap_or_clone(e));
            }
            Err(RecvError::Lagged(n)) => panic!("run {run_id}: the receiver lagged by {n}"),
            Err(RecvError::Closed) => panic!("run {run_id}: the channel closed while it had a receiver"),
        }
    }
    got
}

fn sequences(events: &[Event]) -> Vec<i64> {
    events.iter().map(|e| e.sequence).collect()
}

/// Waits until `condition` holds, checking it every few milliseconds; panics after [`DEADLINE`].
pub async fn wait_until(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + DEADLINE;
    while !condition() {
        assert!(Instant::now() < deadline, "waited {DEADLINE:?} for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Nothing more is queued for this receiver, or only events of `run_id` (duplicates allowed).
fn assert_nothing_foreign(rx: &mut broadcast::Receiver<Arc<Event>>, run_id: &RunId) {
    loop {
        match rx.try_recv() {
            Ok(e) => assert_eq!(e.run_id, *run_id, "a receiver of run {run_id} got an event of run {}", e.run_id),
            Err(TryRecvError::Empty) | Err(TryRecvError::Closed) => return,
            Err(TryRecvError::Lagged(n)) => panic!("run {run_id}: the receiver lagged by {n}"),
        }
    }
}

fn publish_in_varied_batches(bus: &dyn Bus, events: &[Event]) {
    // One at a time, then growing batches: 1, 2, 3, …
    let mut rest = events;
    let mut size = 1;
    while !rest.is_empty() {
        let (batch, tail) = rest.split_at(size.min(rest.len()));
        bus.publish(batch);
        rest = tail;
        size += 1;
    }
}

/// Events published after `subscribe` arrive, in order, intact.
pub async fn delivers_in_order(publisher: Arc<dyn Bus>, subscriber: Arc<dyn Bus>) {
    let run = RunId::new();
    let mut rx = subscriber.subscribe(&run);
    let sent = events(&run, 1, 60);
    publish_in_varied_batches(&*publisher, &sent);
    let got = receive_through(&mut rx, &run, 60).await;
    assert_eq!(sequences(&got), (1..=60).collect::<Vec<_>>(), "events out of order or missing");
    assert_eq!(got, sent, "events changed on the way");
}

/// Every receiver of a run gets every event.
pub async fn fans_out_to_every_subscriber(publisher: Arc<dyn Bus>, subscriber: Arc<dyn Bus>) {
    let run = RunId::new();
    let mut first = subscriber.subscribe(&run);
    let mut second = subscriber.subscribe(&run);
    publish_in_varied_batches(&*publisher, &events(&run, 1, 20));
    for rx in [&mut first, &mut second] {
        let got = receive_through(rx, &run, 20).await;
        assert_eq!(sequences(&got), (1..=20).collect::<Vec<_>>());
    }
}

/// A receiver gets its run's events and no other run's.
pub async fn keeps_runs_apart(publisher: Arc<dyn Bus>, subscriber: Arc<dyn Bus>) {
    let (a, b, unwatched) = (RunId::new(), RunId::new(), RunId::new());
    let mut rx_a = subscriber.subscribe(&a);
    let mut rx_b = subscriber.subscribe(&b);
    for s in 1..=10 {
        publisher.publish(&[event(&a, s)]);
        publisher.publish(&[event(&unwatched, s)]);
        publisher.publish(&[event(&b, s)]);
    }
    // A last event of each run after every other run's, so anything misrouted arrives before it.
    publisher.publish(&[event(&a, 11)]);
    publisher.publish(&[event(&b, 11)]);
    assert_eq!(sequences(&receive_through(&mut rx_a, &a, 11).await), (1..=11).collect::<Vec<_>>());
    assert_eq!(sequences(&receive_through(&mut rx_b, &b, 11).await), (1..=11).collect::<Vec<_>>());
    assert_nothing_foreign(&mut rx_a, &a);
    assert_nothing_foreign(&mut rx_b, &b);
}

/// A subscriber that joins after events were published gets the later ones (the store has the
/// earlier ones). From the same bus instance it gets none of the earlier ones; from another
/// instance it may get a recent few, in order, before the later ones.
pub async fn late_subscriber_gets_later_events(publisher: Arc<dyn Bus>, subscriber: Arc<dyn Bus>) {
    let same_instance = std::ptr::addr_eq(Arc::as_ptr(&publisher), Arc::as_ptr(&subscriber));
    // Once with nobody following the run before, once with an early subscriber already there.
    for early_subscriber in [false, true] {
        let run = RunId::new();
        let mut early = early_subscriber.then(|| subscriber.subscribe(&run));
        publish_in_varied_batches(&*publisher, &events(&run, 1, 5));
        if let Some(rx) = early.as_mut() {
            assert_eq!(sequences(&receive_through(rx, &run, 5).await), (1..=5).collect::<Vec<_>>());
        }
        let mut late = subscriber.subscribe(&run);
        publish_in_varied_batches(&*publisher, &events(&run, 6, 10));
        let got = sequences(&receive_through(&mut late, &run, 10).await);
        let first = got.first().copied().unwrap_or(10);
        assert_eq!(got, (first..=10).collect::<Vec<_>>(), "later events out of order or missing");
        if same_instance {
            assert_eq!(first, 6, "a late subscriber of the same bus got events from before it subscribed");
        }
        if let Some(rx) = early.as_mut() {
            assert_eq!(sequences(&receive_through(rx, &run, 10).await), (6..=10).collect::<Vec<_>>());
        }
    }
}

/// Publishing to runs nobody follows holds nothing: `live` (the bus's count of runs it holds
/// channels or tasks for) stays 0.
pub async fn idle_publish_holds_nothing(bus: Arc<dyn Bus>, live: impl Fn() -> usize) {
    bus.publish(&[]);
    for _ in 0..200 {
        let run = RunId::new();
        publish_in_varied_batches(&*bus, &events(&run, 1, 10));
        assert_eq!(live(), 0, "the bus holds something for a run nobody follows");
    }
    tokio::task::yield_now().await;
    assert_eq!(live(), 0, "the bus holds something for a run nobody follows");
}

/// A run's channel (and whatever feeds it) is released once its last receiver is dropped and the
/// run publishes again, within [`DEADLINE`]; dropping one of two receivers keeps it.
pub async fn releases_run_after_last_receiver(bus: Arc<dyn Bus>, live: impl Fn() -> usize) {
    let run = RunId::new();
    let first = bus.subscribe(&run);
    let mut second = bus.subscribe(&run);
    assert_eq!(live(), 1, "two receivers of one run should share one channel");
    drop(first);
    bus.publish(&[event(&run, 1)]);
    assert_eq!(sequences(&receive_through(&mut second, &run, 1).await), [1]);
    assert_eq!(live(), 1, "the run was released while it still had a receiver");
    drop(second);
    bus.publish(&[event(&run, 2)]);
    wait_until("the run's channel to be released after its last receiver dropped", || live() == 0).await;

    // Subscribing again works as the first time.
    let mut again = bus.subscribe(&run);
    bus.publish(&[event(&run, 3)]);
    assert_eq!(sequences(&receive_through(&mut again, &run, 3).await), [3]);
    drop(again);
    bus.publish(&[event(&run, 4)]);
    wait_until("the run's channel to be released again", || live() == 0).await;
}

/// Subscribers of many runs at once, each fed concurrently by its own publisher task.
pub async fn many_runs_at_once(publisher: Arc<dyn Bus>, subscriber: Arc<dyn Bus>) {
    let runs: Vec<RunId> = (0..20).map(|_| RunId::new()).collect();
    let mut receivers: Vec<_> = runs.iter().map(|r| subscriber.subscribe(r)).collect();
    let tasks: Vec<_> = runs
        .iter()
        .cloned()
        .map(|run| {
            let publisher = publisher.clone();
            tokio::spawn(async move {
                for s in 1..=30 {
                    publisher.publish(&[event(&run, s)]);
                    if s % 10 == 0 {
                        tokio::task::yield_now().await;
                    }
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("publisher task");
    }
    for (run, rx) in runs.iter().zip(receivers.iter_mut()) {
        assert_eq!(sequences(&receive_through(rx, run, 30).await), (1..=30).collect::<Vec<_>>());
        assert_nothing_foreign(rx, run);
    }
}
