//! The data lifecycle, through the binary as an operator runs it (docs/operations.md): retention
//! (`keel prune`, the server's background task, replay of a pruned run answering 410), backup and
//! restore (`keel backup` under load, `keel restore`, PostgreSQL's pg_dump and pg_restore), and the
//! audit export (`keel export`).

use std::path::Path;
use std::process::Output;
use std::time::Duration;

use keel_core::store::prelude::*;
use serde_json::{json, Value};

mod support;

use support::{eventually, keel, Server};

fn run_keel(args: &[&str], data: &Path) -> Output {
    keel().args(args).arg("--data-dir").arg(data).output().expect("run keel")
}

fn ok(output: &Output) -> String {
    assert!(
        output.status.success(),
        "exit {:?}\nstdout: {}\nstderr: {}",
        output.status.code(),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

struct Client {
    base: String,
    http: reqwest::Client,
}

impl Client {
    fn new(server: &Server) -> Self {
        Self { base: server.url(), http: reqwest::Client::new() }
    }

    async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let response = self.http.post(format!("{}{path}", self.base)).json(&body).send().await.expect("request");
        let status = response.status().as_u16();
        (status, response.json().await.unwrap_or_default())
    }

    async fn get(&self, path: &str, headers: &[(&str, &str)]) -> (u16, Value, String) {
        let mut request = self.http.get(format!("{}{path}", self.base));
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let response = request.send().await.expect("request");
        let status = response.status().as_u16();
        let text = response.text().await.expect("a body");
        (status, serde_json::from_str(&text).unwrap_or_default(), text)
    }

    async fn conversation(&self) -> String {
        let (status, body) = self.post("/v1/conversations", json!({"title": "lifecycle"})).await;
        assert_eq!(status, 201, "{body}");
        body["id"].as_str().expect("an id").to_owned()
    }

    /// Sends a message and waits for the turn to pause or end.
    async fn say(&self, conversation: &str, content: &str) -> Value {
        let (status, turn) = self
            .post(&format!("/v1/conversations/{conversation}/messages?wait=true"), json!({ "content": content }))
            .await;
        assert_eq!(status, 200, "{turn}");
        turn
    }

    async fn decide(&self, turn: &Value, decision: &str, note: &str) -> Value {
        let run = turn["run"]["id"].as_str().expect("a run");
        let body = json!({
            "interruptId": turn["interrupt"]["id"],
            "decision": decision,
            "note": note,
            "idempotencyKey": format!("{decision}-{run}"),
        });
        let (status, answer) = self.post(&format!("/v1/runs/{run}/resume?wait=true"), body).await;
        assert_eq!(status, 200, "{answer}");
        answer
    }

    async fn run(&self, run: &str) -> Value {
        let (status, body, _) = self.get(&format!("/v1/runs/{run}"), &[]).await;
        assert_eq!(status, 200, "{body}");
        body
    }

    async fn events(&self, run: &str) -> (u16, Value) {
        let (status, body, _) = self.get(&format!("/v1/runs/{run}/events"), &[("accept", "application/json")]).await;
        (status, body)
    }
}

fn last_sequence(run: &Value) -> i64 {
    run["lastSequence"].as_i64().unwrap_or_else(|| panic!("lastSequence in {run}"))
}

/// `keel prune --dry-run` says what would go and deletes nothing; `keel prune` deletes the events of
/// finished runs only; a replay of a pruned run answers 410 `EVENTS_PRUNED` with the first sequence
/// still held (JSON and SSE here; a WebSocket subscription in keel-server's tests/api/ws.rs); the interrupted run is whole and still resumes. Then
/// the server's own background task prunes, and counts what it pruned in /metrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pruning_leaves_active_runs_whole_and_a_pruned_replay_is_gone() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = Server::start(&data, 0);
    let api = Client::new(&server);
    let answered = api.say(&api.conversation().await, "Look at the recent errors of payment-api").await;
    let finished = answered["run"]["id"].as_str().unwrap().to_owned();
    let paused = api.say(&api.conversation().await, "restart pay-prod-a1").await;
    assert_eq!(paused["run"]["status"], "interrupted", "{paused}");
    let interrupted = paused["run"]["id"].as_str().unwrap().to_owned();
    let finished_last = last_sequence(&api.run(&finished).await);
    let interrupted_last = last_sequence(&api.run(&interrupted).await);
    assert!(server.terminate().success());
    // The runs must be older than the retention's 100 ms by the wall clock the keel processes read.
    tokio::time::sleep(Duration::from_millis(300)).await;

    let policy = ["--retention-events-after", "100ms"];
    let dry = ok(&run_keel(&[&["prune", "--dry-run"], &policy[..]].concat(), &data));
    assert_eq!(dry.trim(), format!("Would prune {finished_last} event(s) of 1 finished run(s)."));
    let dry_again = ok(&run_keel(&[&["prune", "--dry-run"], &policy[..]].concat(), &data));
    assert_eq!(dry, dry_again, "a dry run deletes nothing");
    assert!(ok(&run_keel(&["prune"], &data)).contains("No retention policy"), "no policy: nothing is pruned");
    let pruned = ok(&run_keel(&[&["prune"], &policy[..]].concat(), &data));
    assert_eq!(pruned.trim(), format!("Pruned {finished_last} event(s) of finished runs."));

    let server = Server::start(&data, 0);
    let api = Client::new(&server);
    let (status, body) = api.events(&finished).await;
    assert_eq!(status, 410, "{body}");
    assert_eq!(body["error"]["code"], "EVENTS_PRUNED");
    assert_eq!(body["error"]["firstHeldSequence"], finished_last + 1, "none held: its next sequence");
    let (status, _, sse) = api
        .get(&format!("/v1/runs/{finished}/events"), &[("last-event-id", "2"), ("accept", "text/event-stream")])
        .await;
    assert_eq!(status, 410, "{sse}");
    assert!(sse.contains("EVENTS_PRUNED"), "{sse}");
    // The run itself, its messages and its decisions stay.
    let view = api.run(&finished).await;
    assert_eq!((view["status"].as_str(), last_sequence(&view)), (Some("completed"), finished_last));
    // The paused run is whole and goes on.
    let (status, page) = api.events(&interrupted).await;
    assert_eq!(status, 200, "{page}");
    let sequences: Vec<i64> =
        page["events"].as_array().unwrap().iter().map(|e| e["sequence"].as_i64().unwrap()).collect();
    assert_eq!(sequences, (1..=interrupted_last).collect::<Vec<_>>());
    let resumed = api.decide(&paused, "approve", "go").await;
    assert_eq!(resumed["run"]["status"], "completed", "{resumed}");
    assert!(server.terminate().success());

    // The server's background task: a run that ends is pruned within an interval, and counted.
    let server = Server::start_with(&data, 0, &["--retention-events-after", "100ms", "--retention-interval", "100ms"]);
    let api = Client::new(&server);
    let later = api.say(&api.conversation().await, "Look at the recent errors of payment-api").await;
    let later = later["run"]["id"].as_str().unwrap().to_owned();
    let gone = eventually("the background task to prune the run", || async {
        let (status, body) = api.events(&later).await;
        (status == 410).then_some(body)
    })
    .await;
    assert_eq!(gone["error"]["code"], "EVENTS_PRUNED");
    let (_, _, metrics) = api.get("/metrics", &[]).await;
    let counted: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("keel_pruned_rows_total{table=\"run_events\"} "))
        .unwrap_or_else(|| panic!("keel_pruned_rows_total in {metrics}"))
        .parse()
        .unwrap();
    assert!(counted >= 1.0, "{counted}");
}

/// `keel backup` while a server runs under load makes a consistent copy; `keel restore` refuses
/// while a server has the database open; restored, a server continues the runs of the backup: the
/// run that waited for an approval in it is approved and completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_taken_under_load_restores_to_a_server_whose_runs_continue() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = Server::start_with(&data, 1, &["--rate-limit", "0", "--rate-limit-per-address", "0"]);
    let api = Client::new(&server);
    let paused = api.say(&api.conversation().await, "restart pay-prod-a1").await;
    assert_eq!(paused["run"]["status"], "interrupted", "{paused}");

    // Load: runs started and streamed one after another while the backup is taken.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let made = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let load = {
        let (base, stop, made) = (server.url(), stop.clone(), made.clone());
        tokio::spawn(async move {
            let api = Client { base, http: reqwest::Client::new() };
            let mut runs = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let conversation = api.conversation().await;
                api.say(&conversation, "Look at the recent errors of payment-api").await;
                runs += 1;
                made.store(runs, std::sync::atomic::Ordering::Relaxed);
            }
            runs
        })
    };
    eventually("the load to be under way", || async {
        (made.load(std::sync::atomic::Ordering::Relaxed) >= 1).then_some(())
    })
    .await;
    let backup = dir.path().join("keel-backup.db");
    let taken = ok(&run_keel(&["backup", backup.to_str().unwrap()], &data));
    assert!(taken.starts_with("Backed up "), "{taken}");
    let again = run_keel(&["backup", backup.to_str().unwrap()], &data);
    assert!(!again.status.success(), "an existing file is never overwritten");

    let refused = run_keel(&["restore", backup.to_str().unwrap()], &data);
    assert_eq!(refused.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("in use"), "{stderr}");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let runs = load.await.unwrap();
    assert!(runs >= 1, "the load made runs");
    assert!(server.terminate().success());

    // The copy alone is a whole database: open it and look.
    let restored = dir.path().join("restored");
    let answer = ok(&run_keel(&["restore", backup.to_str().unwrap()], &restored));
    assert!(answer.starts_with("Restored "), "{answer}");
    {
        let store = keel_store::SqliteStore::open(&restored.join("keel.db")).await.expect("open the restored copy");
        let run =
            store.get_run(&paused["run"]["id"].as_str().unwrap().parse().unwrap()).await.unwrap().expect("the run");
        assert_eq!(run.status.as_str(), "interrupted");
        let events = store.list_events(&run.id, 0, 1_000).await.unwrap();
        assert_eq!(events.len() as i64, run.last_sequence(), "every event of the run, contiguous");
        store.close().await;
    }
    let server = Server::start(&restored, 0);
    let api = Client::new(&server);
    let resumed = api.decide(&paused, "approve", "restored").await;
    assert_eq!(resumed["run"]["status"], "completed", "{resumed}");
    let more = api.say(&api.conversation().await, "Look at the recent errors of payment-api").await;
    assert_eq!(more["run"]["status"], "completed", "{more}");
    assert!(server.terminate().success());
    // And back over the original database, the server stopped.
    ok(&run_keel(&["restore", backup.to_str().unwrap()], &data));
}

/// `keel export CONVERSATION` lists the conversation, its messages, its runs, their tool calls with
/// their (masked) arguments, and every interrupt with who decided what and when.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_export_of_a_conversation_lists_every_decision_with_its_decider() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = Server::start(&data, 0);
    let api = Client::new(&server);
    let conversation = api.conversation().await;
    let first = api.say(&conversation, "restart pay-prod-a1").await;
    assert_eq!(api.decide(&first, "approve", "checked the dashboard").await["run"]["status"], "completed");
    let second = api.say(&conversation, "restart pay-prod-a2").await;
    assert_eq!(second["run"]["status"], "interrupted", "{second}");
    let rejected = api.decide(&second, "reject", "not during the sale").await;
    assert_ne!(rejected["run"]["status"], "interrupted", "{rejected}");
    let other = api.say(&api.conversation().await, "Look at the recent errors of payment-api").await;
    assert_eq!(other["run"]["status"], "completed");

    // While the server runs.
    let export = ok(&run_keel(&["export", &conversation], &data));
    let records: Vec<Value> =
        export.lines().map(|l| serde_json::from_str(l).expect("one JSON object a line")).collect();
    assert_eq!(records[0]["type"], "conversation");
    assert_eq!(records[0]["id"], conversation.as_str());
    let of = |kind: &str| records.iter().filter(|r| r["type"] == kind).collect::<Vec<_>>();
    assert!(of("message").len() >= 4, "two questions and two answers at least: {export}");
    assert_eq!(of("run").len(), 2);
    let interrupts = of("interrupt");
    assert_eq!(interrupts.len(), 2, "{export}");
    for (interrupt, (turn, decision, note)) in interrupts
        .iter()
        .zip([(&first, "approve", "checked the dashboard"), (&second, "reject", "not during the sale")])
    {
        assert_eq!(interrupt["id"], turn["interrupt"]["id"]);
        assert_eq!(interrupt["runId"], turn["run"]["id"]);
        assert_eq!(interrupt["status"], "resolved");
        assert_eq!(interrupt["decidedBy"], "demo", "the decider: {interrupt}");
        assert_eq!(interrupt["decision"], decision);
        assert_eq!(interrupt["note"], note);
        assert!(interrupt["decidedAt"].is_string(), "when: {interrupt}");
    }
    let calls = of("tool_call");
    assert!(calls.iter().any(|c| c["args"].is_object() && c["runId"] == first["run"]["id"]), "{export}");
    assert!(export.lines().all(|l| !l.contains("\"result\"")), "never a tool's full result");

    // By user, and since.
    let everything = ok(&run_keel(&["export", "--user", "demo"], &data));
    assert_eq!(everything.lines().filter(|l| l.contains("\"type\":\"conversation\"")).count(), 2);
    let file = dir.path().join("audit.jsonl");
    ok(&run_keel(&["export", "--since", "1h", "--output", file.to_str().unwrap()], &data));
    assert_eq!(std::fs::read_to_string(&file).unwrap(), everything);
    assert_eq!(ok(&run_keel(&["export", "--since", "2999-01-01T00:00:00Z"], &data)), "");
    let bad = run_keel(&["export", "--since", "yesterday"], &data);
    assert_eq!(bad.status.code(), Some(1));
}

/// PostgreSQL is backed up with its own tools, as docs/operations.md has it: `pg_dump` of Keel's
/// schema while it is in use, `pg_restore` of the dump, and the store continues the runs it held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_database_is_backed_up_with_pg_dump_and_restored_with_pg_restore() {
    let Some(url) = std::env::var("KEEL_TEST_POSTGRES_URL").ok().filter(|u| !u.trim().is_empty()) else {
        eprintln!("lifecycle: the Postgres backup case is SKIPPED because KEEL_TEST_POSTGRES_URL is unset");
        return;
    };
    let schema = format!("keel_backup_{}", keel_core::RunId::new().as_str().trim_start_matches("run_"));
    let store = keel_store::PostgresStore::connect_with_schema(&url, &schema)
        .await
        .expect("KEEL_TEST_POSTGRES_URL is set, but Postgres is unreachable");
    let now = chrono::Utc::now();
    let conversation = store.create_conversation("alice", &"backed up".into(), "ops", now).await.unwrap();
    let started = store
        .start_run(keel_core::store::NewRun {
            conversation_id: conversation.id.clone(),
            agent_id: "ops".into(),
            user_id: "alice".into(),
            content: "restart it".into(),
            cancel_on_disconnect: false,
            now,
            events: vec![keel_core::EventKind::RunStarted { conversation_id: conversation.id.clone(), trace_id: None }],
            enqueue: None,
            lease: None,
        })
        .await
        .unwrap();
    store.set_user_role("alice", keel_core::UserRole::Operator).await.unwrap();

    let dump = tempfile::tempdir().unwrap();
    let file = dump.path().join("keel.dump");
    let dumped = std::process::Command::new("pg_dump")
        .args(["--format=custom", "--schema", &schema, "--file"])
        .arg(&file)
        .arg(format!("--dbname={url}"))
        .output()
        .expect("pg_dump is installed");
    assert!(dumped.status.success(), "{}", String::from_utf8_lossy(&dumped.stderr));
    store.close().await;

    use keel_store::sqlx::{Connection, Executor, PgConnection};
    let mut conn = PgConnection::connect(&url).await.unwrap();
    conn.execute(format!("DROP SCHEMA \"{schema}\" CASCADE").as_str()).await.unwrap();
    let restored = std::process::Command::new("pg_restore")
        .arg(format!("--dbname={url}"))
        .arg(&file)
        .output()
        .expect("pg_restore is installed");
    assert!(restored.status.success(), "{}", String::from_utf8_lossy(&restored.stderr));

    let store = keel_store::PostgresStore::connect_with_schema(&url, &schema).await.expect("open the restored schema");
    let run = store.get_run(&started.run.id).await.unwrap().expect("the run");
    assert_eq!(run.status.as_str(), "queued");
    assert_eq!(store.list_events(&run.id, 0, 100).await.unwrap().len(), 1);
    assert_eq!(store.user_role("alice").await.unwrap(), Some(keel_core::UserRole::Operator));
    // The runs continue: a worker claims the queued run.
    let later = chrono::Utc::now();
    let claimed = store.claim_runs("w1", later, later + chrono::Duration::seconds(30), false, 10).await.unwrap();
    assert_eq!(claimed.iter().map(|r| &r.id).collect::<Vec<_>>(), [&run.id]);
    store.close().await;
    conn.execute(format!("DROP SCHEMA \"{schema}\" CASCADE").as_str()).await.unwrap();
}
