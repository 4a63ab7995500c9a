//! The demo fleet on PostgreSQL: a restart is applied once per key — whoever asks again, at once or
//! later, from this instance or another — in one statement. Runs when `KEEL_TEST_POSTGRES_URL` is
//! set (and fails if that database cannot be used); says it is skipped otherwise.

use std::io::Write;

use chrono::Utc;
use keel_core::ids::RunId;
use keel_opspilot::fleet::{Fleet, FleetError, FleetSeed, PostgresFleet, Restarted};
use keel_store::PostgresStore;

const URL_VAR: &str = "KEEL_TEST_POSTGRES_URL";

fn url() -> Option<String> {
    match std::env::var(URL_VAR) {
        Ok(url) if !url.trim().is_empty() => Some(url),
        _ => {
            let _ = writeln!(
                std::io::stderr(),
                "keel-opspilot: the Postgres fleet test is SKIPPED because {URL_VAR} is unset"
            );
            None
        }
    }
}

/// Two fleets (two instances of the server) over one fresh schema, seeded.
async fn fleets(url: &str) -> (PostgresStore, PostgresFleet, PostgresFleet) {
    let schema = format!("keel_fleet_{}", RunId::new().as_str().trim_start_matches(RunId::PREFIX));
    let connect = || async {
        PostgresStore::connect_with_schema(url, &schema)
            .await
            .unwrap_or_else(|e| panic!("{URL_VAR} is set, but the database cannot be used: {e}"))
    };
    let (a, b) = (connect().await, connect().await);
    let fleet_a = PostgresFleet::open(&a).await.expect("open the fleet");
    let fleet_b = PostgresFleet::open(&b).await.expect("open the fleet again");
    fleet_a.seed(FleetSeed { extra_abnormal: 2, extra_healthy: 0 }, Utc::now()).await.expect("seed");
    (a, fleet_a, fleet_b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_is_applied_once_per_key_even_when_asked_at_once() {
    let Some(url) = url() else { return };
    let (store, a, b) = fleets(&url).await;
    let abnormal = a.instance("pay-prod-2").await.expect("read").expect("seeded");
    assert_eq!((abnormal.status.as_str(), abnormal.restart_count), ("abnormal", 0));

    // the same key, eight times at once, from two instances: one restart, one answer
    let mut asks = Vec::new();
    for i in 0..8 {
        let fleet = if i % 2 == 0 { a.clone() } else { b.clone() };
        asks.push(tokio::spawn(async move { fleet.restart("pay-prod-2", "call-1").await }));
    }
    let mut answers = Vec::new();
    for ask in asks {
        answers.push(ask.await.expect("task").expect("restart"));
    }
    let expected = Restarted { instance_id: "pay-prod-2".into(), restart_count: 1 };
    assert!(answers.iter().all(|a| *a == expected), "{answers:?}");
    let after = a.instance("pay-prod-2").await.expect("read").expect("there");
    assert_eq!((after.status.as_str(), after.restart_count), ("healthy", 1));

    // later, the same key answers the same and changes nothing
    assert_eq!(b.restart("pay-prod-2", "call-1").await.expect("replay"), expected);
    assert_eq!(a.instance("pay-prod-2").await.expect("read").expect("there").restart_count, 1);

    // another key on the restarted instance: refused, nothing recorded under it
    match a.restart("pay-prod-2", "call-2").await {
        Err(FleetError::Precondition(why)) => assert!(why.contains("already healthy"), "{why}"),
        other => panic!("expected a precondition failure, got {other:?}"),
    }
    // an instance that does not exist: not found
    assert!(matches!(a.restart("pay-prod-404", "call-3").await, Err(FleetError::NotFound(_))));

    // two keys on one abnormal instance at once: one restarts it, the other is refused
    let (x, y) = tokio::join!(a.restart("pay-prod-a1", "call-4"), b.restart("pay-prod-a1", "call-5"));
    let applied = [&x, &y].iter().filter(|r| r.is_ok()).count();
    assert_eq!(applied, 1, "{x:?} {y:?}");
    assert_eq!(a.instance("pay-prod-a1").await.expect("read").expect("there").restart_count, 1);
    store.drop_schema().await.expect("drop the schema");
}
