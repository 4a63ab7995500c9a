//! The bus conformance suite against `LocalBus`, the one-process bus.

use std::sync::Arc;

use keel_bus::conformance;
use keel_core::bus::{Bus, LocalBus};

fn bus() -> (Arc<LocalBus>, Arc<dyn Bus>) {
    let bus = Arc::new(LocalBus::default());
    let dyn_bus: Arc<dyn Bus> = bus.clone();
    (bus, dyn_bus)
}

#[tokio::test]
async fn delivers_in_order() {
    let (_, bus) = bus();
    conformance::delivers_in_order(bus.clone(), bus).await;
}

#[tokio::test]
async fn fans_out_to_every_subscriber() {
    let (_, bus) = bus();
    conformance::fans_out_to_every_subscriber(bus.clone(), bus).await;
}

#[tokio::test]
async fn keeps_runs_apart() {
    let (_, bus) = bus();
    conformance::keeps_runs_apart(bus.clone(), bus).await;
}

#[tokio::test]
async fn late_subscriber_gets_later_events() {
    let (_, bus) = bus();
    conformance::late_subscriber_gets_later_events(bus.clone(), bus).await;
}

#[tokio::test]
async fn idle_publish_holds_nothing() {
    let (local, bus) = bus();
    conformance::idle_publish_holds_nothing(bus, || local.channel_count()).await;
}

#[tokio::test]
async fn releases_run_after_last_receiver() {
    let (local, bus) = bus();
    conformance::releases_run_after_last_receiver(bus, || local.channel_count()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_runs_at_once() {
    let (_, bus) = bus();
    conformance::many_runs_at_once(bus.clone(), bus).await;
}
