//! `GET /metrics`: after a run that pauses for approval and continues, the counters and histograms
//! moved by exactly what the run did, as the stored events tell it.

use std::collections::BTreeMap;

use keel_core::{Event, EventKind, ToolOutcomeStatus};
use reqwest::header::{ACCEPT, CONTENT_TYPE};
use reqwest::StatusCode;
use serde_json::json;

use crate::common::*;

/// One scrape: every sample by its name and labels.
#[derive(Debug)]
struct Scrape {
    samples: BTreeMap<(String, BTreeMap<String, String>), f64>,
    text: String,
}

impl Scrape {
    /// Parses the text format, checking every sample belongs to a family announced by `# TYPE`.
    fn parse(text: String) -> Self {
        let mut families = Vec::new();
        let mut samples = BTreeMap::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let mut parts = rest.split(' ');
                families.push(parts.next().expect("a family name").to_owned());
                let kind = parts.next().expect("a type");
                assert!(["counter", "gauge", "histogram"].contains(&kind), "{line}");
                continue;
            }
            if line.starts_with('#') || line.is_empty() {
                continue;
            }
            let (series, value) = line.rsplit_once(' ').expect("name and value");
            let value: f64 = value.parse().unwrap_or_else(|_| panic!("a number in {line:?}"));
            let (name, labels) = match series.split_once('{') {
                Some((name, labels)) => (name, parse_labels(labels.strip_suffix('}').expect("closing brace"))),
                None => (series, BTreeMap::new()),
            };
            assert!(name.starts_with("keel_"), "every metric is prefixed: {line}");
            assert!(
                families.iter().any(|f| name == f
                    || [f.to_owned() + "_bucket", f.to_owned() + "_sum", f.to_owned() + "_count"]
                        .contains(&name.into())),
                "{name} has no # TYPE line"
            );
            samples.insert((name.to_owned(), labels), value);
        }
        Self { samples, text }
    }

    /// The sample's value; a series that was never touched reads 0.
    fn get(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let labels = labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        self.samples.get(&(name.to_owned(), labels)).copied().unwrap_or(0.0)
    }

    /// The sum over every series of `name`.
    fn total(&self, name: &str) -> f64 {
        self.samples.iter().filter(|((n, _), _)| n == name).map(|(_, v)| v).sum()
    }

    /// Every value `label` takes in the series of `name`.
    fn label_values(&self, name: &str, label: &str) -> Vec<String> {
        self.samples.keys().filter(|(n, _)| n == name).filter_map(|(_, l)| l.get(label).cloned()).collect()
    }
}

fn parse_labels(raw: &str) -> BTreeMap<String, String> {
    // The values here are bounded words (no commas, quotes or escapes), so a plain split will do.
    raw.split(',')
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=').expect("label=value");
            (k.to_owned(), v.trim_matches('"').to_owned())
        })
        .collect()
}

async fn scrape(app: &TestApp) -> Scrape {
    let response = app.client.get(app.url("/metrics")).send().await.expect("GET /metrics");
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        response.headers().get(CONTENT_TYPE).and_then(|v| v.to_str().ok()),
        Some("text/plain; version=0.0.4; charset=utf-8")
    );
    Scrape::parse(response.text().await.expect("body"))
}

async fn scrape_until(app: &TestApp, what: &str, done: impl Fn(&Scrape) -> bool) -> Scrape {
    eventually(what, || async {
        let s = scrape(app).await;
        done(&s).then_some(s)
    })
    .await
}

fn count<'a>(events: impl IntoIterator<Item = &'a Event>, keep: impl Fn(&EventKind) -> bool) -> f64 {
    events.into_iter().filter(|e| keep(&e.kind)).count() as f64
}

#[tokio::test]
async fn a_hitl_run_moves_the_counters_and_histograms_by_what_it_did() {
    let app = TestApp::spawn().await;
    let before = scrape(&app).await;
    assert_eq!(before.get("keel_runs_started_total", &[]), 0.0);
    assert_eq!(before.get("keel_active_connections", &[("transport", "sse")]), 0.0);
    assert!(before.text.contains("keel_runs_finished_total{status=\"completed\"} 0"), "{}", before.text);

    // The request's stream, until the run pauses.
    let conversation = app.create_conversation().await;
    let mut first = app.send_streaming(&conversation, &json!({"content": RESTART_PROMPT})).await;
    let paused = first.collect().await;
    assert_eq!(paused.last().map(Event::type_name), Some("interrupt"));
    let run = paused[0].run_id.to_string();
    let EventKind::Interrupt { interrupt_id, .. } = &paused.last().unwrap().kind else { unreachable!() };
    let interrupt = interrupt_id.to_string();

    // A page that watches the paused run: one open SSE connection, held until the run ends.
    let mut watcher = app.events_stream(&run, Some(paused.len() as i64)).await;
    watcher.assert_sse();
    scrape_until(&app, "the watcher's connection counted", |s| {
        s.get("keel_active_connections", &[("transport", "sse")]) == 1.0
    })
    .await;

    // Approve over SSE; the same approval again (REPLAYED), then a second key (409).
    let response = app
        .client
        .post(app.url(&format!("/v1/runs/{run}/resume")))
        .header(ACCEPT, "text/event-stream")
        .json(&json!({"interruptId": interrupt, "decision": "approve", "idempotencyKey": "approve-1"}))
        .send()
        .await
        .unwrap();
    let resumed = SseReader::new(response).collect().await;
    assert_eq!(resumed.last().map(Event::type_name), Some("done"));
    let (status, _) = app.resume(&run, &interrupt, json!("approve"), "approve-1").await;
    assert_eq!(status, StatusCode::OK);
    let (status, body) = app.resume(&run, &interrupt, json!("approve"), "approve-2").await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    let watched = watcher.collect().await;
    assert_eq!(watched.last().map(Event::type_name), Some("done"));

    // Every stream is over: the gauge is back to 0 (the bodies are dropped once they end).
    let after = scrape_until(&app, "every SSE connection closed and the worker gone", |s| {
        s.get("keel_active_connections", &[("transport", "sse")]) == 0.0 && s.get("keel_run_workers", &[]) == 0.0
    })
    .await;
    let stored = app.events_json(&run, 0).await;
    assert_contiguous(&stored, 1);

    // Runs.
    assert_eq!(after.get("keel_runs_started_total", &[]), 1.0);
    assert_eq!(after.get("keel_runs_finished_total", &[("status", "completed")]), 1.0);
    assert_eq!(after.get("keel_runs_finished_total", &[("status", "failed")]), 0.0);
    assert_eq!(after.get("keel_runs_finished_total", &[("status", "cancelled")]), 0.0);
    assert_eq!(after.get("keel_run_duration_seconds_count", &[("status", "completed")]), 1.0);
    assert!(after.get("keel_run_duration_seconds_sum", &[("status", "completed")]) > 0.0);
    assert_eq!(after.get("keel_run_duration_seconds_bucket", &[("status", "completed"), ("le", "+Inf")]), 1.0);

    // The human: one wait, one accepted resume, one replayed, one refused with its code.
    assert_eq!(after.get("keel_human_wait_seconds_count", &[]), 1.0);
    assert_eq!(after.get("keel_resumes_total", &[("code", "OK")]), 1.0);
    assert_eq!(after.get("keel_resumes_total", &[("code", "REPLAYED")]), 1.0);
    assert_eq!(after.get("keel_resumes_total", &[("code", "INTERRUPT_ALREADY_RESOLVED")]), 1.0);
    assert_eq!(after.total("keel_resumes_total"), 3.0);

    // Nodes, model calls and tools: as many observations as the stored events show.
    for node in ["context", "model", "tools", "approval", "finalize"] {
        let finished = count(&stored, |k| matches!(k, EventKind::NodeFinished { node: n, .. } if n == node));
        assert!(finished > 0.0, "the run went through {node}");
        assert_eq!(after.get("keel_node_duration_seconds_count", &[("node", node)]), finished, "node {node}");
    }
    let model_calls = count(&stored, |k| matches!(k, EventKind::NodeFinished { node, .. } if node == "model"));
    assert_eq!(after.get("keel_model_time_to_first_token_seconds_count", &[]), model_calls);
    let mut tools = BTreeMap::<String, f64>::new();
    for e in &stored {
        if let EventKind::ToolFinished { tool, status: ToolOutcomeStatus::Success, .. } = &e.kind {
            *tools.entry(tool.clone()).or_default() += 1.0;
        }
    }
    assert!(tools.contains_key("restart_instance"), "{tools:?}");
    for (tool, n) in &tools {
        let series = [("tool", tool.as_str()), ("outcome", "success")];
        assert_eq!(after.get("keel_tool_call_duration_seconds_count", &series), *n, "tool {tool}");
    }
    assert_eq!(after.total("keel_tool_call_duration_seconds_count"), tools.values().sum::<f64>());

    // Events: appended = stored, type by type; delivered = what the three streams wrote.
    assert_eq!(after.total("keel_events_appended_total"), stored.len() as f64);
    for e in &stored {
        let of_type = count(&stored, |k| std::mem::discriminant(k) == std::mem::discriminant(&e.kind));
        assert_eq!(after.get("keel_events_appended_total", &[("type", e.type_name())]), of_type, "{}", e.type_name());
    }
    let delivered = (paused.len() + watched.len() + resumed.len()) as f64;
    assert_eq!(after.get("keel_events_delivered_total", &[("transport", "sse")]), delivered);
    assert_eq!(after.get("keel_slow_subscribers_dropped_total", &[("transport", "sse")]), 0.0);
    assert_eq!(after.total("keel_store_errors_total"), 0.0);
    assert_eq!(after.get("keel_bus_dropped_events_total", &[]), 0.0);

    // Bounded labels: no id of any kind appears in the scrape.
    let mut ids = vec![run.clone(), interrupt.clone(), conversation.clone(), "demo".to_owned()];
    for e in &stored {
        match &e.kind {
            EventKind::ToolStarted { call_id, .. } => ids.push(call_id.to_string()),
            EventKind::TextDelta { message_id, .. } => ids.push(message_id.to_string()),
            _ => {}
        }
    }
    for id in &ids {
        assert!(!after.text.contains(id.as_str()), "{id} in the metrics");
    }
    assert_eq!(after.label_values("keel_runs_finished_total", "status").len(), 3);
}

#[tokio::test]
async fn cancelled_runs_and_refused_resumes_are_counted_by_status_and_code() {
    let app = TestApp::spawn().await;
    let (_, run, interrupt) = app.interrupted_run().await;
    let (status, _) = app.post(&format!("/v1/runs/{run}/cancel"), &json!({})).await;
    assert_eq!(status, StatusCode::OK);
    let (status, body) = app.resume(&run, &interrupt, json!("approve"), "late").await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    let code = body["error"]["code"].as_str().unwrap().to_owned();

    let s = scrape(&app).await;
    assert_eq!(s.get("keel_runs_finished_total", &[("status", "cancelled")]), 1.0);
    assert_eq!(s.get("keel_runs_finished_total", &[("status", "completed")]), 0.0);
    assert_eq!(s.get("keel_run_duration_seconds_count", &[("status", "cancelled")]), 1.0);
    assert_eq!(s.get("keel_resumes_total", &[("code", code.as_str())]), 1.0);
    assert_eq!(s.get("keel_resumes_total", &[("code", "OK")]), 0.0);
    assert_eq!(s.get("keel_human_wait_seconds_count", &[]), 0.0, "nobody decided");
    assert_eq!(s.get("keel_events_appended_total", &[("type", "cancelled")]), 1.0);
}

#[tokio::test]
async fn metrics_is_outside_v1_and_refuses_other_methods() {
    let app = TestApp::spawn().await;
    let (status, body) = app.post("/metrics", &json!({})).await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    assert!(body["error"]["code"].is_string(), "{body}");
    let (status, body) = app.get("/v1/metrics").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(body["error"]["code"].is_string(), "{body}");
}

#[tokio::test]
async fn a_client_that_goes_away_is_no_longer_an_open_connection() {
    let app = TestApp::spawn().await;
    let (_, run, _) = app.interrupted_run().await;
    // Two pages watch the paused run; one closes its tab.
    let first = app.events_stream(&run, None).await;
    let mut second = app.events_stream(&run, None).await;
    assert_eq!(second.next_event().await.map(|e| e.sequence), Some(1));
    scrape_until(&app, "two open streams", |s| s.get("keel_active_connections", &[("transport", "sse")]) == 2.0).await;
    first.disconnect();
    scrape_until(&app, "one open stream", |s| s.get("keel_active_connections", &[("transport", "sse")]) == 1.0).await;
    second.disconnect();
    let s = scrape_until(&app, "no open stream", |s| s.get("keel_active_connections", &[("transport", "sse")]) == 0.0)
        .await;
    assert_eq!(
        s.get("keel_slow_subscribers_dropped_total", &[("transport", "sse")]),
        0.0,
        "they left; nobody was cut off"
    );
}
