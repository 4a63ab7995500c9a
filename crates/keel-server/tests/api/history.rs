//! A run's history: `GET /v1/runs` (the caller's runs, newest first) and the interrupts of
//! `GET /v1/runs/{id}` (who decided what, when).

use reqwest::StatusCode;
use serde_json::json;

use crate::common::*;

#[tokio::test]
async fn runs_are_listed_newest_first_per_user_with_filters() {
    let app = TestApp::spawn().await;
    let (_, paused, _) = app.interrupted_run().await;
    let conversation = app.create_conversation().await;
    let answered = app.send_and_wait(&conversation, ERRORS_PROMPT).await;
    let answered = answered["run"]["id"].as_str().unwrap().to_owned();

    let (status, body) = app.get("/v1/runs").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let runs = body["runs"].as_array().unwrap();
    let ids: Vec<&str> = runs.iter().map(|r| r["id"].as_str().unwrap()).collect();
    assert_eq!(ids, vec![answered.as_str(), paused.as_str()], "newest first");
    assert_eq!(runs[0]["status"], "completed");
    assert_eq!(runs[0]["conversationId"], conversation.as_str());
    assert!(runs[0]["lastSequence"].as_i64().unwrap() > 2);
    assert!(runs[0]["createdAt"].is_string() && runs[0]["updatedAt"].is_string());
    assert!(runs[0].get("checkpoint").is_none(), "a summary, not the whole run");

    let (_, body) = app.get("/v1/runs?limit=1").await;
    assert_eq!(body["runs"].as_array().unwrap().len(), 1);
    assert_eq!(body["runs"][0]["id"], answered.as_str());
    let (_, body) = app.get("/v1/runs?status=interrupted&limit=100").await;
    assert_eq!(body["runs"].as_array().unwrap().len(), 1);
    assert_eq!(body["runs"][0]["id"], paused.as_str());
    let (_, body) = app.get("/v1/runs?status=failed").await;
    assert_eq!(body, json!({"runs": []}));

    // another user has none of them
    let (status, body) = app.get_as("mallory", "/v1/runs").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body, json!({"runs": []}));
}

#[tokio::test]
async fn bad_list_parameters_are_400_invalid_query() {
    let app = TestApp::spawn().await;
    for query in ["limit=0", "limit=101", "limit=-1", "limit=ten", "limit=", "status=done", "status=", "status=QUEUED"]
    {
        let (status, body) = app.get(&format!("/v1/runs?{query}")).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{query}: {body}");
        assert_eq!(body["error"]["code"], "INVALID_QUERY", "{query}: {body}");
        assert!(body["error"]["message"].as_str().unwrap().len() > 5, "{query}: {body}");
    }
    let (status, body) = app.get("/v1/runs?limit=%ZZ").await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    let (status, body) = app.post("/v1/runs", &json!({})).await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED, "{body}");
}

#[tokio::test]
async fn a_run_shows_every_interrupt_with_who_decided_and_when() {
    let app = TestApp::spawn().await;
    let (_, run, interrupt) = app.interrupted_run().await;
    let view = app.run(&run).await;
    let interrupts = view["interrupts"].as_array().unwrap();
    assert_eq!(interrupts.len(), 1);
    assert_eq!(interrupts[0]["id"], interrupt.as_str());
    assert_eq!(interrupts[0]["status"], "pending");
    assert_eq!(interrupts[0]["resolvedBy"], json!(null));
    assert_eq!(interrupts[0], view["pendingInterrupt"]);

    let (status, body) = app.resume(&run, &interrupt, json!("reject"), "reject-1").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let view = app.wait_for_status(&run, "completed").await;
    assert_eq!(view["pendingInterrupt"], json!(null));
    let decided = &view["interrupts"][0];
    assert_eq!(decided["id"], interrupt.as_str());
    assert_eq!(decided["status"], "resolved");
    assert_eq!(decided["decision"], "reject");
    assert_eq!(decided["resolvedBy"], "demo");
    let created = chrono::DateTime::parse_from_rfc3339(decided["createdAt"].as_str().unwrap()).unwrap();
    let resolved = chrono::DateTime::parse_from_rfc3339(decided["resolvedAt"].as_str().unwrap()).unwrap();
    assert!(resolved >= created, "{decided}");
    assert_eq!(decided["payload"]["title"], "Restart pay-prod-2?");
    assert_eq!(app.instance("pay-prod-2").await["restartCount"], 0, "rejected: nothing ran");
}
