//! The OpenAPI spec: the committed `docs/openapi.json` is what the code generates and what the
//! server serves, and every operation in it is a route the server answers.
//! `KEEL_UPDATE_OPENAPI=1 cargo test -p keel-server --test openapi` rewrites the committed copy.

mod common;

use std::path::PathBuf;

use common::{Options, TestApp};
use keel_core::EventKind;
use reqwest::{Method, StatusCode};
use serde_json::Value;

fn committed_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../docs/openapi.json")
}

fn spec() -> Value {
    serde_json::from_str(keel_server::openapi::spec_json()).expect("the spec is JSON")
}

/// Each (method, path) of the spec.
fn operations(spec: &Value) -> Vec<(Method, String, Value)> {
    let mut out = Vec::new();
    for (path, item) in spec["paths"].as_object().expect("paths") {
        for (method, operation) in item.as_object().expect("a path item") {
            let method = Method::from_bytes(method.to_ascii_uppercase().as_bytes()).expect("an HTTP method");
            out.push((method, path.clone(), operation.clone()));
        }
    }
    out
}

#[tokio::test]
async fn the_committed_spec_is_the_generated_one_and_the_served_one() {
    let generated = keel_server::openapi::spec_json();
    let path = committed_path();
    if std::env::var_os("KEEL_UPDATE_OPENAPI").is_some_and(|v| v == "1") {
        std::fs::write(&path, generated).expect("write docs/openapi.json");
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "docs/openapi.json differs from the spec the code generates; \
         run `KEEL_UPDATE_OPENAPI=1 cargo test -p keel-server --test openapi` and commit it"
    );

    // Served without credentials: the spec of the routes this server serves — the core API's and
    // the ones an application added (the demo's here).
    let app = TestApp::spawn().await;
    let response = reqwest::get(app.url("/v1/openapi.json")).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["content-type"], "application/json");
    let served: Value = serde_json::from_str(&response.text().await.unwrap()).unwrap();
    let core: Value = serde_json::from_str(generated).unwrap();
    let paths =
        |spec: &Value| spec["paths"].as_object().unwrap().keys().cloned().collect::<std::collections::BTreeSet<_>>();
    let mut expected = paths(&core);
    expected.insert("/v1/demo/instances".to_owned());
    expected.insert("/v1/demo/services".to_owned());
    assert_eq!(paths(&served), expected);
    for (path, item) in core["paths"].as_object().unwrap() {
        assert_eq!(&served["paths"][path], item, "{path} is served as generated");
    }
}

/// The router is built from the operations (`routes!`), so a route can't lack one; this checks the
/// other way: every operation of the spec is routed, by the server `keel demo` runs.
#[tokio::test]
async fn every_operation_of_the_spec_is_a_route() {
    let app = TestApp::with(Options { demo_mode: true, ..Options::default() }).await;
    let client = reqwest::Client::new();
    let operations = operations(&spec());
    assert!(operations.len() >= 19, "{} operations", operations.len());
    for (method, path, _) in operations {
        let url = app.url(&path.replace("{id}", "x").replace("{agent}", "opspilot"));
        let response = client.request(method.clone(), url).send().await.unwrap();
        let status = response.status();
        let body: Value = response.json().await.unwrap_or(Value::Null);
        if path.starts_with("/v1/") && path != "/v1/openapi.json" {
            // Only a matched route authenticates: an unrouted one would be 404 or 405.
            assert_eq!(status, StatusCode::UNAUTHORIZED, "{method} {path}: {body}");
        } else {
            assert_eq!(status, StatusCode::OK, "{method} {path}: {body}");
        }
    }
}

#[test]
fn v1_operations_need_a_key_and_document_their_errors() {
    let spec = spec();
    let mut ids: Vec<String> = operations(&spec).into_iter().map(|(_, _, o)| o["operationId"].to_string()).collect();
    ids.sort_unstable();
    let count = ids.len();
    ids.dedup();
    assert_eq!(ids.len(), count, "operationIds repeat");
    let schemes = &spec["components"]["securitySchemes"];
    assert_eq!(schemes["bearer"]["scheme"], "bearer");
    assert_eq!(schemes["ticket"]["in"], "query");
    for (method, path, operation) in operations(&spec) {
        let public = !path.starts_with("/v1/") || path == "/v1/openapi.json";
        // An operation without `security` takes the document's: bearer.
        let security = operation.get("security").unwrap_or(&spec["security"]);
        let bearer = security.as_array().unwrap().iter().any(|s| s.get("bearer").is_some());
        assert_eq!(bearer, !public, "{method} {path}: security {security}");
        let responses = operation["responses"].as_object().unwrap();
        if !public {
            for status in ["401", "429", "500", "503"] {
                assert!(responses.contains_key(status), "{method} {path} lacks {status}");
            }
            assert!(responses["429"]["headers"].get("Retry-After").is_some(), "{method} {path}");
        }
        for (status, response) in responses {
            if status.starts_with('4') && status != "426" || status.starts_with('5') {
                let schema = &response["content"]["application/json"]["schema"];
                assert_eq!(schema["$ref"], "#/components/schemas/ErrorBody", "{method} {path} {status}");
            } else {
                assert!(response.get("content").is_some() || status == "101", "{method} {path} {status}: no body");
            }
        }
    }
    // The stream routes take a ticket instead of a key.
    for path in ["/v1/runs/{id}/events", "/v1/ws"] {
        let security = spec["paths"][path]["get"]["security"].as_array().unwrap().clone();
        assert!(security.iter().any(|s| s.get("ticket").is_some()), "{path}");
    }
}

#[test]
fn an_event_is_one_of_its_types_with_the_envelope() {
    let spec = spec();
    let schemas = &spec["components"]["schemas"];
    let kinds = schemas["EventKind"]["oneOf"].as_array().expect("EventKind is a oneOf");
    let mut types: Vec<&str> = kinds
        .iter()
        .map(|k| {
            let tag = &k["properties"]["type"]["enum"];
            assert!(k["required"].as_array().unwrap().contains(&Value::from("type")), "{k}");
            tag[0].as_str().expect("a type tag")
        })
        .collect();
    types.sort_unstable();
    let mut expected = EventKind::TYPES.to_vec();
    expected.sort_unstable();
    assert_eq!(types, expected);
    // Fields are named as the JSON names them (camelCase), e.g. `tool_finished`'s `callId`.
    let tool_finished = kinds.iter().find(|k| k["properties"]["type"]["enum"][0] == "tool_finished").unwrap();
    assert!(tool_finished["properties"].get("callId").is_some(), "{tool_finished}");
    let envelope = schemas["Event"].to_string();
    for field in ["runId", "sequence", "ts"] {
        assert!(envelope.contains(&format!("\"{field}\"")), "Event lacks {field}: {envelope}");
    }
}
