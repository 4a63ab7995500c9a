//! A clean stop leaves the database file whole: after SIGTERM (`keel serve` with runs in flight) or
//! after a command that wrote (`keel migrate`, `keel users add`), `keel.db` copied *alone* — without
//! its `-wal` and `-shm` files, as a backup made by copying one file would be — holds every write.
//! Before the store joined its checkpointer thread and checkpointed the WAL whole at close, about
//! one stop in six left `keel.db` behind its WAL.

use std::path::{Path, PathBuf};

use keel_core::store::prelude::*;
use keel_core::RunId;
use keel_store::SqliteStore;
use serde_json::{json, Value};

mod support;

/// `data_dir`'s keel.db copied alone into a new directory, opened.
async fn open_copy_of_the_file_alone(data_dir: &Path) -> (SqliteStore, tempfile::TempDir) {
    let copy_dir = tempfile::tempdir().unwrap();
    let copy: PathBuf = copy_dir.path().join("keel.db");
    std::fs::copy(data_dir.join("keel.db"), &copy).expect("copy keel.db");
    let store = SqliteStore::open(&copy).await.expect("open the copy");
    (store, copy_dir)
}

async fn post(http: &reqwest::Client, url: String, body: Value) -> Value {
    let response = http.post(url).json(&body).send().await.expect("request");
    let status = response.status();
    let body: Value = response.json().await.expect("a JSON answer");
    assert!(status.is_success(), "{status}: {body}");
    body
}

/// 30 times in a row: start `keel serve` on the same data, start runs (restarts that pause for an
/// approval, questions that stream an answer; the runs the previous process left running are
/// continued too), SIGTERM it while they are in flight, wait for it to exit 0, and check that the
/// copy of keel.db alone has every run made so far, with its user message.
#[tokio::test]
async fn after_sigterm_with_runs_in_flight_keel_db_alone_has_every_run() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let http = reqwest::Client::new();
    let mut runs: Vec<(RunId, String, String)> = Vec::new();
    let mut instance = 0;
    for iteration in 0..30 {
        let server = support::Server::start_with(
            &data,
            1,
            &["--demo-abnormal", "100", "--rate-limit", "0", "--rate-limit-per-address", "0"],
        );
        let base = server.url();
        for i in 0..4 {
            let conversation = post(&http, format!("{base}/v1/conversations"), json!({"title": "stop"})).await;
            let conversation_id = conversation["id"].as_str().unwrap().to_owned();
            let content = if i % 2 == 0 {
                instance += 1;
                format!("restart pay-prod-a{instance}")
            } else {
                "Look at the recent errors of payment-api".to_owned()
            };
            let accepted = post(
                &http,
                format!("{base}/v1/conversations/{conversation_id}/messages"),
                json!({ "content": content }),
            )
            .await;
            let run_id: RunId = serde_json::from_value(accepted["runId"].clone()).unwrap();
            let message_id = accepted["messageId"].as_str().unwrap().to_owned();
            runs.push((run_id, conversation_id, message_id));
        }
        let status = server.terminate();
        assert!(status.success(), "iteration {iteration}: keel serve exited with {status:?} after SIGTERM");

        let (copy, _copy_dir) = open_copy_of_the_file_alone(&data).await;
        for (run_id, conversation_id, message_id) in &runs {
            let run = copy.get_run(run_id).await.expect("read the copy");
            assert!(run.is_some(), "iteration {iteration}: run {run_id} is not in keel.db alone");
            let conversation_id = serde_json::from_value(json!(conversation_id)).unwrap();
            let messages = copy.list_messages(&conversation_id).await.expect("read the copy");
            assert!(
                messages.iter().any(|m| m.id.as_str() == message_id),
                "iteration {iteration}: the user message of run {run_id} is not in keel.db alone"
            );
        }
        copy.close().await;
    }
}

/// `keel migrate` leaves a keel.db that has the schema on its own; each `keel users add` leaves one
/// that has the user.
#[tokio::test]
async fn after_migrate_and_users_add_keel_db_alone_has_the_writes() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let output = support::keel().arg("migrate").arg("--data-dir").arg(&data).output().unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let (copy, _copy_dir) = open_copy_of_the_file_alone(&data).await;
    // the schema is there: a query on it answers, and finds the file empty
    assert_eq!(copy.list_users().await.expect("the schema is in keel.db alone"), vec![]);
    copy.close().await;

    for i in 0..10 {
        let name = format!("user{i}");
        let output = support::keel()
            .args(["users", "add", &name, "--role", "operator"])
            .arg("--data-dir")
            .arg(&data)
            .output()
            .unwrap();
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        let (copy, _copy_dir) = open_copy_of_the_file_alone(&data).await;
        let users = copy.list_users().await.expect("read the copy");
        assert_eq!(users.len(), i + 1, "after users add {name}: {users:?}");
        assert!(users.iter().any(|u| u.id == name && u.active_keys == 1), "{name} and its key: {users:?}");
        copy.close().await;
    }
}
