//! `DemoModel`: an OFFLINE, rule-based stand-in for a language model, for the OpsPilot demo and
//! for tests. It is not a language model: it reads the conversation like a small planner — the
//! user's last message, the confirmed facts and the tool results of the current turn — emits real
//! tool calls, and streams its answer word by word with a configurable delay. It needs no network
//! and no keys, and it is deterministic.

use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use keel_core::model::{Model, ModelChunk, ModelError, ModelMessage, ModelRequest, ModelStream, ModelToolCall};
use keel_core::FactMap;
use serde_json::{json, Value};

const SERVICES: &[&str] = &["payment-api", "order-api", "inventory-api"];

/// The most words a bench answer ("benchmark: stream N words") streams.
pub const MAX_BENCH_WORDS: usize = 100_000;

#[derive(Debug, Clone)]
pub struct DemoModel {
    /// Pause before each streamed word.
    delay: Duration,
}

impl DemoModel {
    pub fn new(delay: Duration) -> Self {
        Self { delay }
    }
}

impl Default for DemoModel {
    fn default() -> Self {
        Self::new(Duration::from_millis(15))
    }
}

#[async_trait]
impl Model for DemoModel {
    fn name(&self) -> &str {
        "demo"
    }

    async fn stream(&self, request: ModelRequest) -> Result<ModelStream, ModelError> {
        let Plan { text, calls } = plan(&request);
        let delay = self.delay;
        let words = split_words(&text);
        let text_chunks = futures::stream::iter(words).then(move |w| async move {
            if delay.is_zero() {
                tokio::task::yield_now().await;
            } else {
                tokio::time::sleep(delay).await;
            }
            Ok(ModelChunk::Text(w))
        });
        let call_chunks = futures::stream::iter(calls.into_iter().map(|c| Ok(ModelChunk::ToolCall(c))));
        Ok(Box::pin(text_chunks.chain(call_chunks)))
    }
}

/// Words with their trailing whitespace, so the concatenation is the text.
fn split_words(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut current = String::new();
    for ch in text.chars() {
        current.push(ch);
        if ch == ' ' || ch == '\n' {
            out.push(std::mem::take(&mut current));
        }
    }
    if !current.is_empty() {
        out.push(current);
    }
    out
}

#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub text: String,
    pub calls: Vec<ModelToolCall>,
}

impl Plan {
    fn say(text: impl Into<String>) -> Self {
        Self { text: text.into(), calls: Vec::new() }
    }

    fn call(text: impl Into<String>, name: &str, arguments: Value) -> Self {
        let id = format!("call_{}", uuid_like());
        Self { text: text.into(), calls: vec![ModelToolCall { id, name: name.into(), arguments }] }
    }
}

fn uuid_like() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    format!("{t:x}{n:x}")
}

/// A tool result of the current turn.
struct Seen<'a> {
    name: &'a str,
    args: &'a Value,
    result: Value,
}

fn find_result<'s, 'a>(seen: &'s [Seen<'a>], name: &str) -> Option<&'s Seen<'a>> {
    seen.iter().rev().find(|s| s.name == name)
}

/// What the demo model does next, given the conversation.
pub fn plan(request: &ModelRequest) -> Plan {
    let last_user = request.messages.iter().rposition(|m| matches!(m, ModelMessage::User { .. }));
    let Some(idx) = last_user else { return Plan::say(help()) };
    let ModelMessage::User { content } = &request.messages[idx] else { return Plan::say(help()) };
    let text = content.to_lowercase();
    if let Some(words) = bench_words(&text) {
        return Plan::say(bench_answer(words));
    }

    // Tool calls of this turn, with their results.
    let mut seen: Vec<Seen<'_>> = Vec::new();
    for m in &request.messages[idx + 1..] {
        if let ModelMessage::Tool { call_id, name, content } = m {
            let args = request.messages[idx + 1..]
                .iter()
                .find_map(|m| match m {
                    ModelMessage::Assistant { tool_calls, .. } => tool_calls.iter().find(|c| &c.id == call_id),
                    _ => None,
                })
                .map(|c| &c.arguments)
                .unwrap_or(&Value::Null);
            let result = serde_json::from_str(content).unwrap_or(Value::Null);
            seen.push(Seen { name, args, result });
        }
    }
    let result_of = |name: &str| find_result(&seen, name);
    let facts = &request.facts;
    let service_in_text =
        SERVICES.iter().find(|s| text.contains(*s) || text.contains(s.trim_end_matches("-api"))).copied();
    let service = service_in_text.map(str::to_owned).or_else(|| facts.get("service").cloned());
    let env = if text.contains("staging") {
        "staging".to_owned()
    } else if text.contains("prod") {
        "prod".to_owned()
    } else {
        facts.get("env").cloned().unwrap_or_else(|| "prod".to_owned())
    };

    if text.contains("restart") {
        return plan_restart(&text, service_in_text, service.as_deref(), &env, facts, &seen);
    }
    if text.contains("rollback") || text.contains("roll back") {
        let Some(service) = service else { return Plan::say(which_service()) };
        return match result_of("rollback_release") {
            None => Plan::call(
                format!("I'll roll back {service} in {env}. This needs your approval. "),
                "rollback_release",
                json!({"service": service, "env": env}),
            ),
            Some(s) => Plan::say(match outcome(&s.result) {
                Outcome::Done => format!(
                    "Rolled back {service} in {env} from {} to {}.",
                    s.result["from"].as_str().unwrap_or("?"),
                    s.result["to"].as_str().unwrap_or("?")
                ),
                Outcome::Denied(why) | Outcome::Failed(why) => {
                    format!("I did not roll back {service} in {env}: {why}.")
                }
            }),
        };
    }
    if text.contains("continu")
        || text.contains("investigat")
        || text.contains("abnormal")
        || text.contains("which instance")
    {
        let Some(service) = service else { return Plan::say(which_service()) };
        return match result_of("find_abnormal_instances") {
            None => Plan::call(
                format!("Checking the instances of {service} in {env}. "),
                "find_abnormal_instances",
                json!({"service": service, "env": env}),
            ),
            Some(s) => Plan::say(describe_abnormal(&service, &env, &s.result)),
        };
    }
    if text.contains("error") {
        let Some(service) = service else { return Plan::say(which_service()) };
        return match result_of("get_recent_errors") {
            None => Plan::call(
                format!("Let me look at the recent errors of {service} in {env}. "),
                "get_recent_errors",
                json!({"service": service, "env": env, "minutes": 15}),
            ),
            Some(s) => Plan::say(describe_errors(&s.result)),
        };
    }
    if text.contains("service") || text.contains("list") || text.contains("fleet") {
        return match result_of("list_services") {
            None => Plan::call("Here is the fleet. ", "list_services", json!({})),
            Some(s) => {
                let rows: Vec<String> = s.result["services"]
                    .as_array()
                    .map(|a| {
                        a.iter()
                            .map(|r| {
                                format!(
                                    "{} in {}: {} instances, {} abnormal",
                                    r["service"].as_str().unwrap_or("?"),
                                    r["env"].as_str().unwrap_or("?"),
                                    r["instances"],
                                    r["abnormal"]
                                )
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                Plan::say(rows.join("; ") + ".")
            }
        };
    }
    Plan::say(help())
}

fn plan_restart(
    text: &str,
    service_in_text: Option<&str>,
    service: Option<&str>,
    env: &str,
    facts: &FactMap,
    seen: &[Seen<'_>],
) -> Plan {
    let result_of = |name: &str| find_result(seen, name);
    if let Some(done) = result_of("restart_instance") {
        let id = done.args["instanceId"].as_str().unwrap_or("the instance");
        return Plan::say(match outcome(&done.result) {
            Outcome::Done => {
                format!("Restarted {id}. It is healthy now (restart count {}).", done.result["restartCount"])
            }
            Outcome::Denied(why) => format!("I did not restart {id}: {why}."),
            Outcome::Failed(why) => format!("I did not restart {id}: {why}."),
        });
    }
    let restart = |id: &str| {
        Plan::call(
            format!("I'll restart {id}. This needs your approval. "),
            "restart_instance",
            json!({"instanceId": id}),
        )
    };
    if let Some(id) = instance_in_text(text) {
        return restart(&id);
    }
    // "the abnormal instance of payment-api": find it first, unless the facts already name one of
    // that service.
    let known = facts
        .get("instance")
        .filter(|_| service_in_text.is_none() || facts.get("service").map(String::as_str) == service_in_text);
    if let (Some(id), None) = (known, result_of("find_abnormal_instances")) {
        return restart(id);
    }
    let Some(service) = service else { return Plan::say(which_service()) };
    match result_of("find_abnormal_instances") {
        None => Plan::call(
            format!("Looking for the abnormal instance of {service} in {env}. "),
            "find_abnormal_instances",
            json!({"service": service, "env": env}),
        ),
        Some(s) => match s.result["abnormal"].as_array().and_then(|a| a.first()).and_then(|i| i["id"].as_str()) {
            Some(id) => restart(id),
            None => Plan::say(format!("There is no abnormal instance of {service} in {env} to restart.")),
        },
    }
}

/// An instance id written in the text, like `pay-prod-2`.
fn instance_in_text(text: &str) -> Option<String> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
        .find(|w| {
            let parts: Vec<&str> = w.split('-').collect();
            parts.len() == 3 && (parts[1] == "prod" || parts[1] == "staging") && !parts[2].is_empty()
        })
        .map(str::to_owned)
}

enum Outcome {
    Done,
    Denied(String),
    Failed(String),
}

fn outcome(result: &Value) -> Outcome {
    match result["status"].as_str() {
        Some("denied") => Outcome::Denied(result["reason"].as_str().unwrap_or("it was rejected").to_owned()),
        Some("error") => Outcome::Failed(result["error"].as_str().unwrap_or("it failed").to_owned()),
        _ => Outcome::Done,
    }
}

fn describe_errors(result: &Value) -> String {
    if result["status"] == "error" {
        return format!("I could not read the errors: {}.", result["error"].as_str().unwrap_or("unknown error"));
    }
    let service = result["service"].as_str().unwrap_or("the service");
    let env = result["env"].as_str().unwrap_or("prod");
    let count = result["count"].as_u64().unwrap_or(0);
    let minutes = result["minutes"].as_u64().unwrap_or(15);
    if count == 0 {
        return format!("{service} in {env} had no 5xx errors in the last {minutes} minutes.");
    }
    let top = result["topInstance"]["instanceId"].as_str().unwrap_or("one instance");
    let sample = result["samples"][0]["message"].as_str().unwrap_or("");
    format!(
        "{service} in {env} had {count} 5xx errors in the last {minutes} minutes, most of them from {top} \
         (latest: \"{sample}\"). Ask me to continue investigating if you want to know which instance is abnormal."
    )
}

fn describe_abnormal(service: &str, env: &str, result: &Value) -> String {
    if result["status"] == "error" {
        return format!("I could not check the instances: {}.", result["error"].as_str().unwrap_or("unknown error"));
    }
    let abnormal = result["abnormal"].as_array().cloned().unwrap_or_default();
    match abnormal.as_slice() {
        [] => format!("All instances of {service} in {env} are healthy."),
        [one] => format!(
            "{} is abnormal (restarted {} times so far, release {}). It is the source of the errors; I can restart it if you want.",
            one["id"].as_str().unwrap_or("?"),
            one["restartCount"],
            one["release"].as_str().unwrap_or("?")
        ),
        many => {
            let listed = many.iter().filter_map(|i| i["id"].as_str()).collect::<Vec<_>>().join(", ");
            let total = result["abnormalTotal"].as_u64().unwrap_or(many.len() as u64);
            match (total as usize == many.len(), result["abnormalTotalIsAtLeast"] == true) {
                (true, _) => format!("{total} instances of {service} in {env} are abnormal: {listed}."),
                (false, at_least) => format!(
                    "{}{total} instances of {service} in {env} are abnormal; the first {}: {listed}.",
                    if at_least { "At least " } else { "" },
                    many.len()
                ),
            }
        }
    }
}

/// A bench aid: "benchmark: stream N words" asks for a long answer of N numbered words (at most
/// [`MAX_BENCH_WORDS`]), one `text_delta` each, to measure one long stream (`keel-bench stream
/// --words N`). The whole message must be that request, so no ordinary question is taken for it.
fn bench_words(text: &str) -> Option<usize> {
    let n = text.trim().strip_prefix("benchmark: stream ")?.strip_suffix(" words")?;
    let n: usize = n.parse().ok()?;
    Some(n.min(MAX_BENCH_WORDS))
}

/// `w1 w2 … wN`: deterministic, and a client can check that no word is missing or out of order.
fn bench_answer(words: usize) -> String {
    let mut text = String::with_capacity(words * 8);
    for i in 1..=words {
        if i > 1 {
            text.push(' ');
        }
        text.push('w');
        text.push_str(&i.to_string());
    }
    text
}

fn which_service() -> String {
    "Which service do you mean? I know payment-api, order-api and inventory-api.".to_owned()
}

fn help() -> String {
    "I'm OpsPilot (running on the offline demo model). I can look at recent errors (\"Look at the recent errors \
     of payment-api\"), find abnormal instances, restart an instance or roll back a release; changes wait for \
     your approval."
        .to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(messages: Vec<ModelMessage>, facts: &[(&str, &str)]) -> ModelRequest {
        ModelRequest {
            messages,
            tools: std::sync::Arc::default(),
            facts: facts.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        }
    }

    fn user(s: &str) -> ModelMessage {
        ModelMessage::User { content: s.into() }
    }

    #[test]
    fn errors_question_calls_the_tool_then_answers() {
        let p = plan(&req(vec![user("Look at the recent errors of payment-api")], &[]));
        assert_eq!(p.calls[0].name, "get_recent_errors");
        assert_eq!(p.calls[0].arguments, json!({"service": "payment-api", "env": "prod", "minutes": 15}));
        let call = p.calls[0].clone();
        let p2 = plan(&req(
            vec![
                user("Look at the recent errors of payment-api"),
                ModelMessage::Assistant { content: p.text.clone(), tool_calls: vec![call.clone()] },
                ModelMessage::Tool {
                    call_id: call.id,
                    name: call.name,
                    content: json!({"service": "payment-api", "env": "prod", "minutes": 15, "count": 12,
                        "topInstance": {"instanceId": "pay-prod-2"}, "samples": [{"message": "upstream timeout"}]})
                    .to_string(),
                },
            ],
            &[],
        ));
        assert!(p2.calls.is_empty());
        assert!(p2.text.contains("12 5xx errors"), "{}", p2.text);
    }

    #[test]
    fn pronouns_resolve_from_facts() {
        let p = plan(&req(
            vec![user("Continue investigating its recent error logs")],
            &[("service", "payment-api"), ("env", "prod")],
        ));
        assert_eq!(p.calls[0].name, "find_abnormal_instances");
        let p = plan(&req(
            vec![user("Restart this abnormal instance")],
            &[("service", "payment-api"), ("instance", "pay-prod-2")],
        ));
        assert_eq!(p.calls[0].name, "restart_instance");
        assert_eq!(p.calls[0].arguments["instanceId"], "pay-prod-2");
    }

    #[test]
    fn one_shot_restart_finds_the_instance_first() {
        let p = plan(&req(vec![user("Restart the abnormal instance of payment-api")], &[]));
        assert_eq!(p.calls[0].name, "find_abnormal_instances");
        assert_eq!(plan(&req(vec![user("restart pay-prod-3")], &[])).calls[0].arguments["instanceId"], "pay-prod-3");
    }

    #[test]
    fn anything_else_gets_help_and_no_tools() {
        let p = plan(&req(vec![user("what's the weather?")], &[]));
        assert!(p.calls.is_empty());
        assert!(p.text.contains("OpsPilot"));
    }

    #[test]
    fn a_bench_request_streams_that_many_numbered_words_capped() {
        let p = plan(&req(vec![user("benchmark: stream 5 words")], &[]));
        assert!(p.calls.is_empty());
        assert_eq!(split_words(&p.text), ["w1 ", "w2 ", "w3 ", "w4 ", "w5"]);
        let p = plan(&req(vec![user("Benchmark: stream 999999999 words")], &[]));
        assert_eq!(split_words(&p.text).len(), MAX_BENCH_WORDS);
        assert!(p.text.ends_with(&format!(" w{MAX_BENCH_WORDS}")));
        // only the whole message is a bench request
        let p = plan(&req(vec![user("benchmark: stream 5 words, then restart pay-prod-2")], &[]));
        assert_eq!(p.calls[0].name, "restart_instance");
    }

    #[test]
    fn words_concatenate_to_the_text() {
        let t = "Restarted pay-prod-2. It is  healthy\nnow.";
        assert_eq!(split_words(t).concat(), t);
    }
}
