//! docs/api.md can't drift: its examples are executed, in order, against a real server, and its
//! error table names exactly the codes the code can answer with.

use std::collections::{BTreeSet, HashMap};

use serde_json::Value;

use crate::common::TestApp;

const DOC: &str = include_str!("../../../../docs/api.md");

struct Example {
    line: usize,
    method: String,
    path: String,
    headers: Vec<(String, String)>,
    body: String,
    status: u16,
    expected: Value,
}

fn fenced_blocks(doc: &str) -> Vec<(usize, String, String)> {
    let mut blocks = Vec::new();
    let mut open: Option<(usize, String, String)> = None;
    for (i, line) in doc.lines().enumerate() {
        match open.take() {
            None => {
                if let Some(info) = line.strip_prefix("```") {
                    open = Some((i + 1, info.trim().to_owned(), String::new()));
                }
            }
            Some((at, info, mut text)) => {
                if line.starts_with("```") {
                    blocks.push((at, info, text));
                } else {
                    text.push_str(line);
                    text.push('\n');
                    open = Some((at, info, text));
                }
            }
        }
    }
    blocks
}

fn examples() -> Vec<Example> {
    let blocks = fenced_blocks(DOC);
    let mut out = Vec::new();
    let mut i = 0;
    while i < blocks.len() {
        let (line, info, text) = &blocks[i];
        if info != "http" {
            i += 1;
            continue;
        }
        let (answer_line, answer_info, answer) = blocks.get(i + 1).unwrap_or_else(|| panic!("line {line}: no answer"));
        let status: u16 = answer_info
            .strip_prefix("json ")
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or_else(|| panic!("line {answer_line}: the answer must be ```json <status>"));
        let mut lines = text.lines();
        let request_line = lines.next().unwrap_or_default();
        let (method, path) = request_line.split_once(' ').unwrap_or_else(|| panic!("line {line}: `METHOD PATH`"));
        let mut headers = Vec::new();
        for l in lines.by_ref() {
            if l.trim().is_empty() {
                break;
            }
            let (k, v) = l.split_once(':').unwrap_or_else(|| panic!("line {line}: header `{l}`"));
            headers.push((k.trim().to_owned(), v.trim().to_owned()));
        }
        let body: String = lines.collect::<Vec<_>>().join("\n");
        let expected = serde_json::from_str(answer).unwrap_or_else(|e| panic!("line {answer_line}: {e}"));
        out.push(Example {
            line: *line,
            method: method.to_owned(),
            path: path.to_owned(),
            headers,
            body,
            status,
            expected,
        });
        i += 2;
    }
    out
}

/// Replaces `$name` with the remembered value.
fn substitute(text: &str, vars: &HashMap<String, Value>) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(pos) = rest.find('$') {
        out.push_str(&rest[..pos]);
        let after = &rest[pos + 1..];
        let len = after.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(after.len());
        let name = &after[..len];
        match vars.get(name) {
            Some(Value::String(s)) => out.push_str(s),
            Some(v) => out.push_str(&v.to_string()),
            None => panic!("${name} is used before an answer defined it"),
        }
        rest = &after[len..];
    }
    out.push_str(rest);
    out
}

/// Does `actual` match the documented `doc`? See the rules in docs/api.md.
fn check(doc: &Value, actual: &Value, vars: &mut HashMap<String, Value>, path: &str) -> Result<(), String> {
    match doc {
        Value::String(s) if s.starts_with('$') => {
            let name = &s[1..];
            match vars.get(name) {
                Some(known) if known != actual => Err(format!("{path}: expected ${name} = {known}, got {actual}")),
                Some(_) => Ok(()),
                None => {
                    vars.insert(name.to_owned(), actual.clone());
                    Ok(())
                }
            }
        }
        Value::String(s) if s.contains('…') => {
            let (prefix, suffix) = s.split_once('…').unwrap_or_default();
            match actual.as_str() {
                Some(a) if a.starts_with(prefix) && a.ends_with(suffix) => Ok(()),
                _ => Err(format!("{path}: expected a string like {s:?}, got {actual}")),
            }
        }
        Value::Object(fields) => {
            let Some(obj) = actual.as_object() else { return Err(format!("{path}: expected an object, got {actual}")) };
            for (k, v) in fields {
                let got = obj.get(k).ok_or_else(|| format!("{path}.{k}: missing in {actual}"))?;
                check(v, got, vars, &format!("{path}.{k}"))?;
            }
            Ok(())
        }
        Value::Array(items) => {
            let Some(arr) = actual.as_array() else { return Err(format!("{path}: expected an array, got {actual}")) };
            let mut at = 0;
            for (i, item) in items.iter().enumerate() {
                loop {
                    let Some(candidate) = arr.get(at) else {
                        return Err(format!("{path}[{i}]: no item matches {item} (in order) in {actual}"));
                    };
                    at += 1;
                    let mut trial = vars.clone();
                    if check(item, candidate, &mut trial, &format!("{path}[{i}]")).is_ok() {
                        *vars = trial;
                        break;
                    }
                }
            }
            Ok(())
        }
        other if other == actual => Ok(()),
        other => Err(format!("{path}: expected {other}, got {actual}")),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_examples_in_docs_api_md_run_as_written() {
    let app = TestApp::with(crate::common::Options { demo_mode: true, ..Default::default() }).await;
    let examples = examples();
    assert!(examples.len() >= 10, "docs/api.md has its examples");
    let mut vars: HashMap<String, Value> = HashMap::new();
    vars.insert("bob_key".into(), Value::String(app.keys["bob"].clone()));
    // Demo's key unless the example shows its own credentials.
    let anonymous = reqwest::Client::new();
    for ex in examples {
        let path = substitute(&ex.path, &vars);
        let method = reqwest::Method::from_bytes(ex.method.as_bytes()).unwrap();
        let own_credentials =
            path.contains("ticket=") || ex.headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("authorization"));
        let mut request = if own_credentials { &anonymous } else { &app.client }.request(method, app.url(&path));
        for (k, v) in &ex.headers {
            request = request.header(k.as_str(), substitute(v, &vars));
        }
        if !ex.body.trim().is_empty() {
            request = request.body(substitute(&ex.body, &vars));
        }
        let response = request.send().await.unwrap();
        let status = response.status().as_u16();
        let text = response.text().await.unwrap();
        let actual: Value = serde_json::from_str(&text).unwrap_or(Value::String(text.clone()));
        assert_eq!(status, ex.status, "docs/api.md line {}: {} {path} answered {text}", ex.line, ex.method);
        if let Err(e) = check(&ex.expected, &actual, &mut vars, "$") {
            panic!("docs/api.md line {}: {} {path}: {e}", ex.line, ex.method);
        }
    }
}

#[test]
fn the_error_table_lists_every_code() {
    let table: BTreeSet<String> = DOC
        .lines()
        .filter(|l| l.starts_with("| 4") || l.starts_with("| 5"))
        .filter_map(|l| l.split('|').nth(2))
        .flat_map(|cell| cell.split('`').skip(1).step_by(2).map(str::to_owned).collect::<Vec<_>>())
        .collect();
    let mut code: BTreeSet<String> = keel_server::error::ERROR_CODES.iter().map(|c| (*c).to_owned()).collect();
    code.extend(keel_core::engine::EngineError::CODES.iter().map(|c| (*c).to_owned()));
    assert_eq!(table, code, "docs/api.md's error table and the codes in the code differ");
}
