//! `[[agents.tools]]` tables: what they build, and every mistake reported with its field.

mod support;

use std::time::Duration;

use keel_core::tool::Policy;
use keel_core::UserRole;
use keel_tools::{ToolConfig, ToolConfigError};

const SCHEMA: &str = r#"args_schema = { type = "object", properties = { instanceId = { type = "string" } }, required = ["instanceId"] }"#;

/// A valid http tool with `lines` added (a later key must not repeat an earlier one).
fn toml_with(lines: &str) -> String {
    format!("kind = \"http\"\nname = \"restart_instance\"\ndescription = \"Restarts an instance\"\n{lines}\n")
}

fn valid(extra: &str) -> String {
    toml_with(&format!("method = \"POST\"\nurl = \"http://127.0.0.1:1/restart/{{instanceId}}\"\n{extra}\n{SCHEMA}"))
}

/// The error of a table that parses but does not build.
fn build_error(toml_text: &str, vars: &[(&str, &str)]) -> ToolConfigError {
    match support::build(toml_text, vars) {
        Ok(tool) => panic!("built {}", tool.spec().name),
        Err(e) => e,
    }
}

/// The error of a table that does not parse.
fn parse_error(toml_text: &str) -> String {
    match toml::from_str::<ToolConfig>(toml_text) {
        Ok(c) => panic!("parsed {c:?}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn a_complete_table_builds_a_tool() {
    let tool = support::build(
        &toml_with(
            r#"
method = "POST"
url = "https://ops.example.com/v1/restart/{instanceId}"
headers = { Authorization = "Bearer ${OPS_TOKEN}" }
timeout = "1m 30s"
idempotent = true
policy = { operator = "ask", admin = "allow" }
max_response_bytes = 2048
result_schema = { type = "object" }
confirm = { title = "Restart {instanceId}?" }
args_schema = { type = "object", properties = { instanceId = { type = "string" } }, required = ["instanceId"] }
"#,
        ),
        &[("OPS_TOKEN", "t0ken-value")],
    )
    .unwrap();
    let spec = tool.spec();
    assert_eq!(spec.name, "restart_instance");
    assert_eq!(spec.description, "Restarts an instance");
    assert!(spec.side_effect && spec.idempotent);
    assert_eq!(spec.timeout, Duration::from_secs(90));
    assert_eq!(spec.policy_for(Some(UserRole::Operator)), Policy::Ask);
    assert_eq!(spec.policy_for(Some(UserRole::Admin)), Policy::Allow);
    // A role the table does not list is denied.
    assert_eq!(spec.policy_for(Some(UserRole::Viewer)), Policy::Deny);
    assert_eq!(spec.parameters["required"][0], "instanceId");
    assert!(spec.result_schema.is_some());
}

#[test]
fn defaults_follow_the_method() {
    let get = support::tool(&toml_with(&format!(
        "method = \"GET\"\nurl = \"http://127.0.0.1:1/i/{{instanceId}}\"\n{SCHEMA}"
    )));
    let spec = get.spec();
    assert!(!spec.side_effect && spec.idempotent);
    assert_eq!(spec.timeout, keel_core::tool::DEFAULT_TOOL_TIMEOUT);
    assert!(UserRole::ALL.iter().all(|r| spec.policy_for(Some(*r)) == Policy::Allow));

    let post = support::tool(&valid(""));
    let spec = post.spec();
    assert!(spec.side_effect && !spec.idempotent);
    assert_eq!(spec.policy_for(Some(UserRole::Viewer)), Policy::Deny);
    assert_eq!(spec.policy_for(Some(UserRole::Operator)), Policy::Ask);

    let read_only_post = support::tool(&valid("side_effect = false\npolicy = \"allow\"\ntimeout = \"500ms\""));
    assert!(!read_only_post.spec().side_effect && read_only_post.spec().idempotent);
    assert_eq!(read_only_post.spec().timeout, Duration::from_millis(500));
    assert_eq!(read_only_post.spec().policy_for(Some(UserRole::Viewer)), Policy::Allow);
}

#[test]
fn an_unknown_or_missing_kind_lists_the_supported_ones() {
    let e = parse_error(&valid("").replace("kind = \"http\"", "kind = \"grpc\""));
    assert!(e.contains(r#"kind: unknown tool kind "grpc"; supported kinds: http, mcp"#), "{e}");
    let e = parse_error(&valid("").replace("kind = \"http\"", ""));
    assert!(e.contains("kind: missing; supported kinds: http, mcp"), "{e}");
}

#[test]
fn mcp_tables_name_the_field_that_is_wrong() {
    let mcp = |lines: &str| format!("kind = \"mcp\"\nname = \"files\"\n{lines}\n");
    // What the server says about its tools is not written in the table.
    let e = parse_error(&valid("").replace("kind = \"http\"", "kind = \"mcp\""));
    assert!(e.contains("description: not for kind mcp: the server describes its tools"), "{e}");
    let e = parse_error(&mcp("command = \"x\"\npolicy = \"ask\""));
    assert!(e.contains("policy: not for kind mcp: use allow, ask and deny"), "{e}");
    let e = parse_error(&mcp(""));
    assert!(e.contains("command: missing; a tool of kind mcp needs command"), "{e}");
    let e = parse_error(&mcp("command = \"x\"\nurl = \"http://h/mcp\""));
    assert!(e.contains("not both"), "{e}");
    let e = parse_error(&mcp("url = \"http://h/mcp\"\nargs = [\"a\"]"));
    assert!(e.contains("args: only with command"), "{e}");
    let e = parse_error(&mcp("command = \"x\"\nheaders = { A = \"b\" }"));
    assert!(e.contains("headers: only with url"), "{e}");
    let e = parse_error(&toml_with("allow = [\"*\"]"));
    assert!(e.contains("allow: only for kind mcp"), "{e}");

    // Checked without starting anything; a build of one tool is refused.
    let check = |text: &str, vars: &[(&str, &str)]| {
        let config: ToolConfig = toml::from_str(text).unwrap();
        let vars: std::collections::HashMap<String, String> =
            vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        keel_tools::check(&config, &move |n| vars.get(n).cloned())
    };
    let ok = mcp("command = \"/nonexistent/server\"\nenv = { TOKEN = \"${FILES_TOKEN}\" }\nallow = [\"get_*\"]");
    check(&ok, &[("FILES_TOKEN", "s3cret-value")]).unwrap();
    let e = check(&ok, &[]).unwrap_err();
    assert_eq!(e.to_string(), "env.TOKEN: the environment variable FILES_TOKEN is not set");
    assert!(keel_tools::build(&toml::from_str(&ok).unwrap(), &|_| None).is_err());
    let e = check(&mcp("command = \"x\"\ndeny = [\"\"]"), &[]).unwrap_err();
    assert_eq!(e.field, "deny[0]");
    let e = check(&mcp("url = \"ftp://h/mcp\""), &[]).unwrap_err();
    assert_eq!(e.to_string(), "url: the scheme must be http or https");
    let e = check(&mcp("url = \"http://h/mcp\"\nheaders = { Mcp-Session-Id = \"x\" }"), &[]).unwrap_err();
    assert_eq!(e.field, "headers.Mcp-Session-Id");
    let e = check(&mcp("command = \"x\"\ntimeout = \"0s\""), &[]).unwrap_err();
    assert_eq!(e.to_string(), "timeout: must be more than 0");
    let e = check(&format!("kind = \"mcp\"\nname = \"{}\"\ncommand = \"x\"", "n".repeat(62)), &[]).unwrap_err();
    assert_eq!(e.field, "name");

    // Environment and header values stay out of Debug.
    let config: ToolConfig = toml::from_str(&mcp(
        "url = \"https://mcp.example.com/mcp\"\nheaders = { Authorization = \"Bearer s3cret-value\" }",
    ))
    .unwrap();
    let shown = format!("{config:?}");
    assert!(shown.contains("Authorization") && !shown.contains("s3cret-value"), "{shown}");
    let resolved = keel_tools::McpServerConfig::new(
        match &config {
            ToolConfig::Mcp(m) => m,
            other => panic!("{other:?}"),
        },
        &|_| None,
    )
    .unwrap();
    let shown = format!("{resolved:?}");
    assert!(!shown.contains("s3cret-value"), "{shown}");
}

#[test]
fn shape_errors_name_the_field() {
    let e = parse_error(&toml_with(&format!("method = \"POST\"\n{SCHEMA}")));
    assert!(e.contains("url: missing"), "{e}");
    let e = parse_error(&toml_with("method = \"POST\"\nurl = \"http://h/x\""));
    assert!(e.contains("args_schema: missing"), "{e}");
    let e = parse_error(&valid("retries = 3"));
    assert!(e.contains("unknown field `retries`"), "{e}");
    let e = parse_error(&valid("confirm = { titel = \"x\" }"));
    assert!(e.contains("unknown field `titel`"), "{e}");
    let e = parse_error(&valid("policy = 3"));
    assert!(e.contains("a table by role"), "{e}");
}

#[test]
fn meaning_errors_name_the_field() {
    let e = build_error(&valid("").replace("method = \"POST\"", "method = \"FETCH\""), &[]);
    assert_eq!(e.field, "method");
    assert!(e.message.contains("GET, POST, PUT, PATCH or DELETE"), "{e}");

    let e = build_error(&valid("").replace("{instanceId}", "{instance}"), &[]);
    assert_eq!(e.field, "url");
    assert!(e.message.contains("{instance}") && e.message.contains("instanceId"), "{e}");

    let e = build_error(&valid("").replace("127.0.0.1:1/restart/{instanceId}", "{instanceId}.example.com/x"), &[]);
    assert_eq!((e.field.as_str(), e.message.contains("only in the path")), ("url", true), "{e}");

    let e = build_error(&valid("").replace("http://", "ftp://"), &[]);
    assert_eq!(e.field, "url");

    let e = build_error(&valid("confirm = { risk = \"Drops {who}\" }"), &[]);
    assert_eq!(e.field, "confirm.risk");

    let bad_schema = valid("").replace("type = \"string\"", "type = 12");
    let e = build_error(&bad_schema, &[]);
    assert_eq!(e.field, "args_schema");
    assert!(e.message.contains("not a valid JSON Schema"), "{e}");

    let e = build_error(&valid("result_schema = { type = \"nope\" }"), &[]);
    assert_eq!(e.field, "result_schema");

    let e = build_error(&valid("").replace("type = \"object\"", "type = \"array\""), &[]);
    assert_eq!(e.field, "args_schema");

    let e = build_error(&valid("policy = { viewer = \"deny\", superuser = \"allow\" }"), &[]);
    assert_eq!(e.field, "policy.superuser");
    assert!(e.message.contains("viewer, operator, admin"), "{e}");

    let e = build_error(&valid("policy = { operator = \"maybe\" }"), &[]);
    assert_eq!(e.field, "policy.operator");
    let e = build_error(&valid("policy = \"sometimes\""), &[]);
    assert_eq!(e.field, "policy");

    let e = build_error(&valid("headers = { Authorization = \"Bearer ${OPS_TOKEN}\" }"), &[]);
    assert_eq!(e.to_string(), "headers.Authorization: the environment variable OPS_TOKEN is not set");

    let e = build_error(&valid("headers = { Idempotency-Key = \"mine\" }"), &[]);
    assert_eq!(e.field, "headers.Idempotency-Key");

    let e = build_error(&valid("headers = { X-Token = \"${TOKEN}\" }"), &[("TOKEN", "a\nb")]);
    assert_eq!(e.field, "headers.X-Token");
    assert!(!e.to_string().contains("a\nb"), "{e}");

    let e = build_error(&valid("timeout = \"0s\""), &[]);
    assert_eq!(e.to_string(), "timeout: must be more than 0");
    let e = build_error(&valid("timeout = \"ten seconds\""), &[]);
    assert_eq!(e.field, "timeout");

    let e = build_error(&valid("max_response_bytes = 0"), &[]);
    assert_eq!(e.field, "max_response_bytes");

    let e = build_error(&valid("").replace("restart_instance", "restart instance"), &[]);
    assert_eq!(e.field, "name");
}

/// The example of docs/tools.md is a table that builds.
#[test]
fn the_documented_example_builds() {
    let doc = include_str!("../../../docs/tools.md");
    let block = doc.split("```toml\n").nth(1).and_then(|rest| rest.split("```").next()).expect("a toml block");
    let file: toml::Table = toml::from_str(block).unwrap();
    let table = file["agents"]["tools"].as_array().and_then(|tools| tools.first()).expect("[[agents.tools]]");
    let config: ToolConfig = table.clone().try_into().unwrap();
    let tool = support::build(&toml::to_string(table).unwrap(), &[("OPS_TOKEN", "t0ken-value")]).unwrap();
    assert_eq!(config.name(), "restart_instance");
    assert_eq!(config.kind(), "http");
    let spec = tool.spec();
    assert!(spec.side_effect && spec.idempotent);
    assert_eq!(spec.timeout, Duration::from_secs(10));
    assert_eq!(spec.policy_for(Some(UserRole::Admin)), Policy::Allow);
    let card = tool.describe(&serde_json::json!({"instanceId": "pay-prod-2", "reason": "stuck"}));
    assert_eq!(card.title, "Restart pay-prod-2?");
    assert_eq!(card.description, "POST /v1/instances/pay-prod-2/restart (reason: stuck)");
}

/// The MCP example of docs/tools.md: two tables that check (nothing is started).
#[test]
fn the_documented_mcp_example_checks() {
    let doc = include_str!("../../../docs/tools.md");
    let section = doc.split("## MCP tools").nth(1).expect("the MCP section");
    let block = section.split("```toml\n").nth(1).and_then(|rest| rest.split("```").next()).expect("a toml block");
    let file: toml::Table = toml::from_str(block).unwrap();
    let tools = file["agents"]["tools"].as_array().expect("[[agents.tools]]");
    assert_eq!(tools.len(), 2);
    let vars = |name: &str| ["GITHUB_TOKEN", "TICKETS_TOKEN"].contains(&name).then(|| "t0ken-value".to_owned());
    for table in tools {
        let config: ToolConfig = table.clone().try_into().unwrap();
        assert_eq!(config.kind(), "mcp");
        keel_tools::check(&config, &vars).unwrap_or_else(|e| panic!("{}: {e}", config.name()));
    }
}
