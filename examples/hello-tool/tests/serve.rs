//! The example, served for real: a conversation with the agent over HTTP runs the Rust tool and
//! answers with its result, and the run's events say so.

use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_custom_tool_runs_over_the_http_api() {
    let dir = tempfile_dir();
    let keel = hello_tool::build(&format!("sqlite://{}/keel.db", dir.display())).await.unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(keel.serve(listener, async {
        let _ = stopped.await;
    }));
    let http = reqwest::Client::new();

    let agents: Value = http.get(format!("{base}/v1/agents")).send().await.unwrap().json().await.unwrap();
    assert_eq!(agents["agents"][0]["id"], "letters");
    assert_eq!(agents["agents"][0]["tools"][0]["name"], "count_letters");

    let conv: Value =
        http.post(format!("{base}/v1/conversations")).json(&json!({})).send().await.unwrap().json().await.unwrap();
    let conv = conv["id"].as_str().unwrap();
    let turn: Value = http
        .post(format!("{base}/v1/conversations/{conv}/messages?wait=true"))
        .json(&json!({"content": "Count the letters of keel"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(turn["run"]["status"], "completed", "{turn}");
    assert_eq!(turn["message"]["content"], "\"keel\" has 4 letters.");
    let run = turn["run"]["id"].as_str().unwrap();
    let events: Value = http
        .get(format!("{base}/v1/runs/{run}/events"))
        .header("accept", "application/json")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let finished = events["events"].as_array().unwrap().iter().find(|e| e["type"] == "tool_finished").cloned();
    assert_eq!(finished.unwrap()["summary"], "keel: 4 letters");

    stop.send(()).unwrap();
    server.await.unwrap().unwrap();
    std::fs::remove_dir_all(dir).ok();
}

fn tempfile_dir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("hello-tool-{}", keel_core::RunId::new().as_str()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
