//! `--max-concurrent-runs` through the real binary: a burst of runs posted at once to an instance
//! with a small cap runs at most the cap at once there and every run completes; on Postgres, runs
//! posted to an instance at capacity are run by another one, and each run names its worker.
//!
//! The Postgres case needs `KEEL_TEST_POSTGRES_URL` (a fresh schema of its own) and fails if it is
//! set and unreachable; without it, that case says it is skipped.

mod support;

use keel_store::PostgresStore;
use serde_json::{json, Value};
use support::{eventually, Server};

/// Starts `n` runs on `base`, each in a conversation of its own, all at once; their ids.
async fn burst(http: &reqwest::Client, base: &str, n: usize) -> Vec<String> {
    let posts = (0..n).map(|i| {
        let (http, base) = (http.clone(), base.to_owned());
        async move {
            let conv: Value = ok(http.post(format!("{base}/v1/conversations")).json(&json!({})).send().await).await;
            let conv = conv["id"].as_str().expect("a conversation id").to_owned();
            let body = json!({"content": format!("what can you do? ({i})")});
            let sent: Value =
                ok(http.post(format!("{base}/v1/conversations/{conv}/messages")).json(&body).send().await).await;
            sent["runId"].as_str().expect("a run id").to_owned()
        }
    });
    futures::future::join_all(posts).await
}

async fn ok(response: reqwest::Result<reqwest::Response>) -> Value {
    let response = response.expect("request");
    let status = response.status();
    let body: Value = response.json().await.expect("a JSON body");
    assert!(status.is_success(), "{status}: {body}");
    body
}

/// Every run, once all are completed (polled, with a deadline).
async fn all_completed(http: &reqwest::Client, base: &str, runs: &[String]) -> Vec<Value> {
    eventually("every run completed", || async {
        let mut bodies = Vec::new();
        for run in runs {
            let body = ok(http.get(format!("{base}/v1/runs/{run}")).send().await).await;
            if body["status"] != "completed" {
                return None;
            }
            bodies.push(body);
        }
        Some(bodies)
    })
    .await
}

/// A sample of `GET /metrics` (a series without labels).
async fn metric(http: &reqwest::Client, base: &str, name: &str) -> f64 {
    let text = http.get(format!("{base}/metrics")).send().await.unwrap().text().await.unwrap();
    text.lines()
        .find_map(|line| line.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("{name} in {text}"))
        .parse()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_fifty_runs_never_runs_more_than_the_cap_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let flags =
        ["--max-concurrent-runs", "4", "--instance-id", "solo", "--rate-limit", "0", "--rate-limit-per-address", "0"];
    let server = Server::start_with(dir.path(), 20, &flags);
    let http = reqwest::Client::new();
    let base = server.url();
    assert_eq!(metric(&http, &base, "keel_run_capacity").await, 4.0);

    let runs = burst(&http, &base, 50).await;
    let bodies = all_completed(&http, &base, &runs).await;
    // The gauge is the most slots ever held at once (not a sample): the cap, reached and never
    // passed.
    assert_eq!(metric(&http, &base, "keel_run_workers_peak").await, 4.0);
    assert_eq!(metric(&http, &base, "keel_run_workers").await, 0.0);
    for body in &bodies {
        assert_eq!(body["worker"], "solo", "{body}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_posted_to_an_instance_at_capacity_are_run_by_another() {
    let Some(url) = std::env::var("KEEL_TEST_POSTGRES_URL").ok().filter(|u| !u.trim().is_empty()) else {
        eprintln!("capacity: the Postgres case is SKIPPED, KEEL_TEST_POSTGRES_URL is unset");
        return;
    };
    let schema = format!("keel_capacity_{}", keel_core::RunId::new().as_str().trim_start_matches("run_"));
    let setup = PostgresStore::connect_with_schema(&url, &schema).await.expect("Postgres is reachable");
    let sep = if url.contains('?') { '&' } else { '?' };
    let db = format!("{url}{sep}options=-c%20search_path%3D{schema}");
    let dir = tempfile::tempdir().unwrap();
    let common = ["--db", db.as_str(), "--rate-limit", "0", "--rate-limit-per-address", "0", "--lease-ttl", "5s"];
    // A takes two runs at once; B has room.
    let a_flags = [&common[..], &["--instance-id", "a", "--max-concurrent-runs", "2"]].concat();
    let a = Server::start_with(&dir.path().join("a"), 40, &a_flags);
    let b = Server::start_with(&dir.path().join("b"), 40, &[&common[..], &["--instance-id", "b"]].concat());
    let http = reqwest::Client::new();

    let runs = burst(&http, &a.url(), 10).await;
    let bodies = all_completed(&http, &b.url(), &runs).await;
    let on = |name: &str| bodies.iter().filter(|body| body["worker"] == name).count();
    assert_eq!(on("a") + on("b"), runs.len(), "every run names its worker: {bodies:?}");
    assert!(on("b") >= 1, "B ran what A had no room for: a {} b {}", on("a"), on("b"));
    assert!(on("a") >= 2, "A ran what it had room for: a {} b {}", on("a"), on("b"));
    assert!(metric(&http, &a.url(), "keel_run_workers_peak").await <= 2.0, "A never passed its cap");
    drop((a, b));
    setup.drop_schema().await.unwrap();
}
