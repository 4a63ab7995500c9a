//! The bench's scenarios, each run by the `keel-bench` binary against a real Keel server (the
//! library's, in this process, over SQLite in a temporary directory: OpsPilot with the demo model
//! and the demo's routes, as `keel demo` serves it), at a small size. Each asserts what its JSON
//! says — every run completed, the events counted, the figures present — so a change to the API or
//! the demo that breaks a scenario fails here, not in the middle of a benchmark.
//!
//! `spread` needs two instances on PostgreSQL and Redis; `scripts/bench OUT postgres spread` runs it.
//! The PostgreSQL floor runs when `KEEL_TEST_POSTGRES_URL` names a database.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use keel_core::clock::{Clock, SystemClock};
use keel_runtime::{Backend, Builder};
use serde_json::Value;

/// Abnormal instances per service on top of the seeded one: enough for every restart below.
const EXTRA_ABNORMAL: u32 = 30;

struct Served {
    base: String,
    stop: tokio::sync::oneshot::Sender<()>,
    server: tokio::task::JoinHandle<Result<(), keel_runtime::KeelError>>,
    dir: tempfile::TempDir,
}

impl Served {
    async fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let backend = Backend::open(&format!("sqlite://{}", dir.path().join("keel.db").display())).await.unwrap();
        let Backend::Sqlite(sqlite) = &backend else { unreachable!("a SQLite URL") };
        let fleet: Arc<dyn keel_opspilot::Fleet> = Arc::new(keel_opspilot::SqliteFleet::open(sqlite).await.unwrap());
        let seed = keel_opspilot::FleetSeed { extra_abnormal: EXTRA_ABNORMAL, ..Default::default() };
        fleet.seed(seed, SystemClock.now()).await.unwrap();
        let model = Arc::new(keel_models::DemoModel::new(Duration::ZERO));
        let opspilot = keel_opspilot::agent(fleet.clone(), backend.store(), model);
        let keel = Builder::new(backend)
            .agent(opspilot)
            .default_agent(keel_opspilot::AGENT_ID)
            .routes(keel_opspilot::routes::routes(fleet, seed, true))
            .start()
            .await
            .unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(keel.serve(listener, async {
            let _ = stopped.await;
        }));
        Served { base, stop, server, dir }
    }

    /// Runs `keel-bench --url … --json FILE ARGS…`, asserts it succeeded, and returns the scenario's
    /// JSON (its one repetition).
    async fn bench(&self, name: &str, args: &[&str]) -> Value {
        bench_with(Some(&self.base), &self.dir.path().join(format!("{name}.json")), args).await
    }

    async fn stop(self) {
        self.stop.send(()).unwrap();
        self.server.await.unwrap().unwrap();
    }
}

async fn bench_with(url: Option<&str>, json: &Path, args: &[&str]) -> Value {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_keel-bench"));
    if let Some(url) = url {
        command.arg(format!("--url={url}"));
    }
    let out = command.arg("--json").arg(json).args(args).env_remove("KEEL_API_KEY").output().await.unwrap();
    assert!(
        out.status.success(),
        "keel-bench {args:?} failed: {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: Value = serde_json::from_slice(&std::fs::read(json).unwrap()).unwrap();
    let reps = doc["repetitions"].as_array().expect("repetitions");
    assert_eq!(reps.len(), 1, "{doc}");
    reps[0].clone()
}

fn num(v: &Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or_else(|| panic!("no number `{key}` in {v}"))
}

fn levels(v: &Value) -> &[Value] {
    v["levels"].as_array().unwrap_or_else(|| panic!("no levels in {v}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hitl_runs_complete_with_their_approval_and_replay_reads_them_back() {
    let served = Served::start().await;
    let hitl = served.bench("hitl", &["hitl", "--concurrency", "1,2", "--runs", "3"]).await;
    let levels_run = levels(&hitl);
    assert_eq!(levels_run.len(), 2);
    for (level, concurrency) in levels_run.iter().zip([1, 2]) {
        assert_eq!(num(level, "concurrency"), f64::from(concurrency));
        assert_eq!(num(level, "completed"), 3.0, "{level}");
        assert_eq!(num(level, "failed"), 0.0, "{level}");
        // a restart's run: started, its steps, the interrupt, resumed, the restart, done
        let stored = num(level, "storedEventsPerRun");
        assert!((20.0..40.0).contains(&stored), "{stored} events a run");
        assert!(num(level, "runsPerSec") > 0.0);
        assert_eq!(level["runIds"].as_array().unwrap().len(), 3);
        assert!(num(&level["runLatency"], "p50Ms") > 0.0, "{level}");
    }

    // the finished runs the hitl JSON lists, read again from their first event
    let from = served.dir.path().join("hitl.json");
    let replay = served
        .bench("replay", &["replay", "--concurrency", "2", "--runs", "6", "--from", from.to_str().unwrap()])
        .await;
    let level = &levels(&replay)[0];
    assert_eq!(num(level, "replayed"), 6.0, "{level}");
    assert_eq!(num(level, "failed"), 0.0, "{level}");
    let stored = num(&levels_run[0], "storedEventsPerRun");
    assert!(num(level, "eventsPerReplay") >= stored - 1.0, "a replay reads every stored event: {level}");
    served.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_streams_and_one_long_stream_arrive_whole() {
    let served = Served::start().await;
    let stream = served.bench("stream", &["stream", "--concurrency", "2", "--runs", "4"]).await;
    let level = &levels(&stream)[0];
    assert_eq!(num(level, "completed"), 4.0, "{level}");
    assert_eq!(num(level, "failed"), 0.0, "{level}");
    assert!(num(level, "eventsPerRun") > 3.0, "{level}");

    // the bench fails the run unless it counted every word
    let long = served.bench("long", &["stream", "--concurrency", "1", "--runs", "1", "--words", "500"]).await;
    let level = &levels(&long)[0];
    assert_eq!(num(level, "completed"), 1.0, "{level}");
    assert_eq!(num(level, "failed"), 0.0, "{level}");
    assert!(num(level, "textDeltasPerRun") >= 1.0, "{level}");
    served.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_seeds_flow_and_a_long_conversation_report_latency_and_cpu() {
    let served = Served::start().await;
    // the server is this process: its CPU is what the bench reads
    let pid = std::process::id().to_string();
    let flow = served.bench("flow", &["flow", "--runs", "2", "--reset-each", "--server-pid", &pid]).await;
    assert_eq!(flow["runs"], 2, "{flow}");
    assert_eq!(flow["latencyMs"].as_array().unwrap().len(), 2, "{flow}");
    assert_eq!(flow["serverCpuMs"].as_array().unwrap().len(), 2, "{flow}");
    assert!(num(&flow, "runLatencyMsP50") > 0.0, "{flow}");
    assert!(num(&flow, "abnormal") >= 1.0, "{flow}");

    let long = served
        .bench("long-conversation", &["long-conversation", "--turns", "12", "--window", "2", "--server-pid", &pid])
        .await;
    assert_eq!(long["latencyMs"].as_array().unwrap().len(), 12, "{long}");
    let checkpoints = long["checkpoints"].as_array().unwrap();
    assert!(checkpoints.iter().any(|c| c["turn"] == 10), "turn 10 is reported: {long}");
    for c in checkpoints {
        assert!(num(c, "latencyMsP50") > 0.0, "{c}");
        assert!(c["serverCpuMsP50"].is_number(), "{c}");
    }
    served.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_streams_stay_open_on_paused_runs() {
    let served = Served::start().await;
    let pid = std::process::id().to_string();
    let idle = served.bench("idle", &["idle", "--streams", "4", "--settle-secs", "1", "--server-pid", &pid]).await;
    assert_eq!(idle["open"], 4, "{idle}");
    assert_eq!(idle["failed"], 0, "{idle}");
    assert!(idle["rssAfterKiB"].as_u64().is_some_and(|kib| kib > 0), "{idle}");
    served.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sqlite_floor_writes_its_rows() {
    let dir = tempfile::tempdir().unwrap();
    let floor = bench_with(
        None,
        &dir.path().join("floor.json"),
        &["floor-sqlite", "--rows", "2000", "--batch", "1,32", "--dir", dir.path().to_str().unwrap()],
    )
    .await;
    let levels = levels(&floor);
    assert_eq!(levels.len(), 2);
    for (level, batch) in levels.iter().zip([1.0, 32.0]) {
        assert_eq!(num(level, "rowsPerTx"), batch);
        assert_eq!(num(level, "rows"), 2000.0, "{level}");
        assert!(num(level, "rowsPerSec") > 0.0, "{level}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_postgres_floor_writes_its_rows() {
    let Some(url) = std::env::var("KEEL_TEST_POSTGRES_URL").ok().filter(|u| !u.trim().is_empty()) else {
        eprintln!("keel-bench: the PostgreSQL floor is SKIPPED because KEEL_TEST_POSTGRES_URL is unset");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let floor = bench_with(
        None,
        &dir.path().join("floor.json"),
        &["floor-postgres", "--db", &url, "--rows", "640", "--batch", "1,32"],
    )
    .await;
    let levels = levels(&floor);
    assert_eq!(levels.len(), 2);
    for level in levels {
        assert_eq!(num(level, "rows"), 640.0, "{level}");
        assert!(num(level, "rowsPerSec") > 0.0, "{level}");
    }
}
