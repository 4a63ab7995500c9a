use std::collections::HashMap;

use clap::{Args, Command, FromArgMatches};

use super::agents::{AgentContext, ToolConfig};
use super::*;

/// The settings `keel ARGS` would resolve with `file` as its keel.toml and `env` as the variables
/// read by name. A flag's own variable is clap's to read from the process, which these tests leave
/// alone; so here flags have none (tests/cli.rs runs the binary with real variables). Errors come
/// back as the line `keel` prints, with the file's temporary path shown as `keel.toml`.
fn load(args: &[&str], file: Option<&str>, env: &[(&str, &str)]) -> Result<Settings, String> {
    let dir = tempfile::tempdir().unwrap();
    let mut args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    let path = dir.path().join("keel.toml");
    if let Some(text) = file {
        std::fs::write(&path, text).unwrap();
        args.extend(["--config".to_owned(), path.display().to_string()]);
    }
    let command =
        Options::augment_args(Command::new("keel").no_binary_name(true)).mut_args(|arg| arg.env(None::<&str>));
    let matches = command.try_get_matches_from(args).map_err(|e| e.to_string())?;
    let options = Options::from_arg_matches(&matches).map_err(|e| e.to_string())?;
    let env: HashMap<String, String> = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    Settings::load(&options, &matches, &|name| env.get(name).cloned())
        .map_err(|e| format!("{e:#}").replace(&path.display().to_string(), "keel.toml"))
}

fn ok(args: &[&str], file: Option<&str>) -> Settings {
    load(args, file, &[]).unwrap_or_else(|e| panic!("{e}"))
}

fn err(args: &[&str], file: Option<&str>) -> String {
    match load(args, file, &[]) {
        Ok(s) => panic!("{args:?} {file:?} resolved: {s:?}"),
        Err(e) => e,
    }
}

#[test]
fn durations() {
    let d = |text: &str| parse_duration(text);
    assert_eq!(d("15m"), Ok(Duration::from_secs(900)));
    assert_eq!(d("2s"), Ok(Duration::from_secs(2)));
    assert_eq!(d("1h"), Ok(Duration::from_secs(3600)));
    assert_eq!(d("500ms"), Ok(Duration::from_millis(500)));
    assert_eq!(d("1h30m"), Ok(Duration::from_secs(5400)));
    assert_eq!(d("1d"), Ok(Duration::from_secs(86_400)));
    assert_eq!(d(" 30 "), Ok(Duration::from_secs(30)), "a bare number is seconds, as it always was");
    assert_eq!(d("0s"), Ok(Duration::ZERO));
    assert_eq!(d("1.5s"), Ok(Duration::from_millis(1500)), "humantime's, new: fractions");
    for bad in ["", "m", "15x", "-2s", "s15", "99999999999999999999"] {
        let e = d(bad).unwrap_err();
        assert!(e.contains("is not a duration") && e.contains("1h30m"), "{bad:?}: {e}");
    }
    assert!(positive_duration("0s").unwrap_err().contains("longer than zero"));
}

#[test]
fn defaults() {
    let s = ok(&[], None);
    assert_eq!(s.listen, "127.0.0.1:8080");
    assert_eq!(s.data_dir, PathBuf::from("keel-data"));
    assert_eq!(s.database, Database::Sqlite(PathBuf::from("keel-data").join("keel.db")));
    assert_eq!(s.model, ModelChoice::Demo);
    assert_eq!(s.demo_delay, Duration::from_millis(15));
    assert_eq!(s.interrupt_ttl, Duration::from_secs(900));
    assert_eq!(s.heartbeat, Duration::from_secs(15));
    assert_eq!(s.demo_abnormal, 0);
    assert_eq!(s.bus, BusChoice::Local);
    assert_eq!(s.lease_ttl, Duration::from_secs(30));
    let cores = std::thread::available_parallelism().unwrap().get();
    assert_eq!(s.max_concurrent_runs, 64 * cores);
    assert_eq!(s.instance_id, None);
    assert_eq!(s.log_format, LogFormat::Text);
    assert_eq!(s.otlp_endpoint, None);
    assert!(s.allowed_hosts.is_empty() && s.api_keys.is_empty());
    assert!(s.agents.is_empty(), "no configured agents");
}

#[test]
fn the_otlp_endpoint_names_the_traces_path_and_must_be_http() {
    let traces = |url: &str| ok(&["--otlp-endpoint", url], None).otlp_endpoint.unwrap().0;
    assert_eq!(traces("http://127.0.0.1:4318"), "http://127.0.0.1:4318/v1/traces");
    assert_eq!(traces("https://otel.internal:4318/"), "https://otel.internal:4318/v1/traces");
    assert_eq!(traces("http://c:4318/v1/traces"), "http://c:4318/v1/traces");
    assert_eq!(ok(&["--otlp-endpoint", ""], None).otlp_endpoint, None);
    let e = err(&["--otlp-endpoint", "grpc://user:hunter2@c:4317"], None);
    assert!(e.starts_with("--otlp-endpoint: ") && e.contains("http://"), "{e}");
    assert!(!e.contains("hunter2"), "{e}");
}

/// Defaults < file < flags for a string, a path, a duration, a number, an enum and a list (the
/// environment's place between the two is tested on the binary, in tests/cli.rs).
#[test]
fn the_file_sits_under_flags() {
    let file = r#"
        listen = "0.0.0.0:9000"
        data_dir = "/srv/keel"
        heartbeat = "5s"
        demo_abnormal = 3
        log_format = "json"
        allowed_hosts = ["file.example"]
    "#;
    let s = ok(&[], Some(file));
    assert_eq!(s.listen, "0.0.0.0:9000");
    assert_eq!(s.database, Database::Sqlite(PathBuf::from("/srv/keel/keel.db")));
    assert_eq!(s.heartbeat, Duration::from_secs(5));
    assert_eq!(s.demo_abnormal, 3);
    assert_eq!(s.log_format, LogFormat::Json);
    assert_eq!(s.allowed_hosts, ["file.example"]);
    assert_eq!(s.interrupt_ttl, Duration::from_secs(900), "what the file leaves out keeps its default");

    let flags = [
        "--listen",
        "127.0.0.1:0",
        "--heartbeat",
        "250ms",
        "--db",
        "sqlite:///tmp/other.db",
        "--allowed-host",
        "a.example,b.example",
    ];
    let s = ok(&flags, Some(file));
    assert_eq!(s.listen, "127.0.0.1:0");
    assert_eq!(s.heartbeat, Duration::from_millis(250));
    assert_eq!(s.database, Database::Sqlite(PathBuf::from("/tmp/other.db")));
    assert_eq!(s.allowed_hosts, ["a.example", "b.example"], "a list given is the list, not added to the file's");
    assert_eq!(s.demo_abnormal, 3);
    let s = ok(&["--demo-abnormal", "0", "--log-format", "text"], Some(file));
    assert_eq!((s.demo_abnormal, s.log_format), (0, LogFormat::Text), "a flag that says the default still wins");
}

#[test]
fn variables_that_are_not_flags_sit_over_the_file() {
    let file =
        "model = \"openai\"\nmodel_base_url = \"http://m/v1\"\nmodel_name = \"n\"\nmodel_api_key = \"sk-file\"\n";
    let key = |s: &Settings| match &s.model {
        ModelChoice::OpenAi(c) => (c.api_key.as_ref().map(|k| k.expose().to_owned()), c.include_usage),
        ModelChoice::Demo => panic!("openai"),
    };
    assert_eq!(key(&load(&[], Some(file), &[]).unwrap()), (Some("sk-file".into()), true));
    let env = [("KEEL_MODEL_API_KEY", "sk-env"), ("KEEL_MODEL_INCLUDE_USAGE", "false")];
    assert_eq!(key(&load(&[], Some(file), &env).unwrap()), (Some("sk-env".into()), false));
    let empty = [("KEEL_MODEL_API_KEY", "")];
    assert_eq!(key(&load(&[], Some(file), &empty).unwrap()).0, None, "an empty key counts as none");
    let usage = format!("{file}model_include_usage = false\n");
    assert!(!key(&load(&[], Some(&usage), &[]).unwrap()).1, "model_include_usage in the file, as docs/models.md says");
}

#[test]
fn openai_settings_come_from_flags_and_the_file_and_hide_the_key() {
    let file = r#"
        model = "openai"
        model_base_url = "http://127.0.0.1:11434/v1"
        model_name = "qwen2.5"
        model_api_key = "sk-file-secret"
        model_idle_timeout = "5s"
        [model_headers]
        OpenAI-Organization = "org-1"
    "#;
    let s = ok(&["--model-name", "llama3", "--model-max-tokens", "512"], Some(file));
    let ModelChoice::OpenAi(c) = &s.model else { panic!("openai") };
    assert_eq!(c.model, "llama3");
    assert_eq!(c.base_url, "http://127.0.0.1:11434/v1");
    assert_eq!(c.max_tokens, Some(512));
    assert_eq!(c.idle_timeout, Duration::from_secs(5));
    assert_eq!(c.connect_timeout, keel_models::OpenAiConfig::new("", "").connect_timeout);
    assert_eq!(c.extra_headers, vec![("OpenAI-Organization".to_owned(), "org-1".to_owned())]);
    assert_eq!(c.api_key.as_ref().map(|k| k.expose()), Some("sk-file-secret"));
    assert!(!format!("{s:?}").contains("sk-file-secret"), "the key never shows in Debug");
    assert!(!format!("{s:?}").contains("org-1"), "nor a header's value");

    assert!(err(&["--model", "openai"], None).contains("--model-base-url"));
    assert!(err(&["--model", "openai", "--model-base-url", "http://m/v1"], None).contains("--model-name"));
    let e = err(&["--model-connect-timeout", "0s", "--model", "openai"], Some(file));
    assert!(e.starts_with("--model-connect-timeout: \"0s\" must be longer than zero"), "{e}");
}

#[test]
fn debug_masks_urls_and_secrets_of_the_raw_options_too() {
    let command = Options::augment_args(Command::new("keel").no_binary_name(true)).mut_args(|a| a.env(None::<&str>));
    let matches = command.try_get_matches_from(["--db", "postgres://keel:hunter2@db/keel"]).unwrap();
    let mut options = Options::from_arg_matches(&matches).unwrap();
    options.model_api_key = Some(SecretString("sk-raw".into()));
    let shown = format!("{options:?}");
    assert!(!shown.contains("hunter2") && !shown.contains("sk-raw"), "{shown}");
}

#[test]
fn api_keys_come_from_the_file_by_hash() {
    let hash = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
    let key = |user: &str, role: &str, sha: &str| {
        format!("[[api_keys]]\nuser = {user:?}\nrole = {role:?}\nsha256 = {sha:?}\n")
    };
    let s = ok(&[], Some(&key("alice", "viewer", hash)));
    assert_eq!(
        s.api_keys,
        vec![KeyHash { user: "alice".into(), role: keel_core::UserRole::Viewer, sha256: hash.into() }]
    );
    assert_eq!(
        err(&[], Some(&key("alice", "root", hash))),
        "keel.toml: api_keys[0]: role: unknown role \"root\"; use viewer, operator or admin"
    );
    assert!(err(&[], Some(&key("a b", "viewer", hash))).starts_with("keel.toml: api_keys[0]: user: \"a b\""));
    assert!(err(&[], Some(&key("alice", "viewer", "keel_abc"))).starts_with("keel.toml: api_keys[0]: sha256: "));
    assert_eq!(
        err(&[], Some("[[api_keys]]\nuser = \"a\"\nrole = \"viewer\"\n")),
        "keel.toml: api_keys[0].sha256: required"
    );
    assert_eq!(
        err(&[], Some(&format!("{}usr = \"x\"\n", key("a", "viewer", hash)))),
        "keel.toml: api_keys[0].usr: unknown key (did you mean `user`?)"
    );
}

#[test]
fn limits_have_defaults_and_are_checked() {
    let s = ok(&[], None);
    assert_eq!((s.rate_limit, s.rate_burst, s.max_streams_per_user), (50.0, 200, 64));
    assert_eq!(s.stream_ticket_ttl, Duration::from_secs(60));
    assert!(!s.insecure_no_auth);
    let s = ok(&["--rate-limit", "0", "--max-streams-per-user", "0"], None);
    assert_eq!((s.rate_limit, s.max_streams_per_user), (0.0, 0));
    assert!(err(&["--rate-limit=-1"], None).starts_with("--rate-limit: -1 must be"));
    let s = ok(&[], None);
    assert_eq!((s.body_limit, s.json_max_depth, s.max_message_chars, s.replay_page_max), (1 << 20, 32, 32_000, 1000));
    let s = ok(&["--body-limit", "4096"], Some("json_max_depth = 8\nreplay_page_max = 50\nrate_limit = 5"));
    assert_eq!((s.body_limit, s.json_max_depth, s.replay_page_max, s.rate_limit), (4096, 8, 50, 5.0));
    assert_eq!(err(&["--json-max-depth", "0"], None), "--json-max-depth: must be at least 1");
    assert_eq!(err(&[], Some("replay_page_max = 0")), "keel.toml: replay_page_max: must be at least 1");
    assert_eq!((s.rate_limit_per_address, s.rate_burst_per_address), (200.0, 400));
    let s = ok(&["--rate-limit-per-address", "0"], Some("rate_burst_per_address = 10\nmax_concurrent_runs = 4"));
    assert_eq!((s.rate_limit_per_address, s.rate_burst_per_address, s.max_concurrent_runs), (0.0, 10, 4));
    assert!(err(&["--rate-limit-per-address=-1"], None).starts_with("--rate-limit-per-address: -1 must be"));
    assert!(ok(&[], None).trusted_proxies.is_empty());
    let s = ok(&["--trusted-proxy", "10.0.0.0/8, 192.168.1.7"], None);
    assert_eq!(
        s.trusted_proxies,
        keel_server::limits::TrustedProxies::parse(&["10.0.0.0/8".into(), "192.168.1.7".into()]).unwrap()
    );
    assert!(!ok(&[], Some("trusted_proxies = [\"::1\"]")).trusted_proxies.is_empty());
    assert!(err(&["--trusted-proxy", "proxy.example"], None)
        .starts_with("--trusted-proxy: \"proxy.example\" is not an IP address"));
    assert_eq!(err(&["--max-concurrent-runs", "0"], None), "--max-concurrent-runs: must be at least 1");
    assert!(ok(&["--insecure-no-auth"], None).insecure_no_auth);
    assert!(ok(&[], Some("insecure_no_auth = true")).insecure_no_auth);
}

/// One line, naming the flag, or the file and its key.
#[test]
fn a_bad_value_names_where_it_came_from() {
    let e = err(&["--interrupt-ttl", "soon"], None);
    assert!(e.starts_with("--interrupt-ttl: \"soon\" is not a duration ("), "{e}");
    let e = err(&[], Some("heartbeat = \"soon\""));
    assert!(e.starts_with("keel.toml: heartbeat: \"soon\" is not a duration ("), "{e}");
    assert_eq!(err(&[], Some("lease_ttl = \"0s\"")), "keel.toml: lease_ttl: \"0s\" must be longer than zero");
    assert_eq!(
        err(&[], Some("demo_abnormal = \"three\"")),
        "keel.toml: demo_abnormal: expected u32, found string \"three\""
    );
    assert_eq!(err(&[], Some("heartbeat = 15")), "keel.toml: heartbeat: expected a string, found integer 15");
    assert_eq!(
        err(&[], Some("model_api_key = 12345")),
        "keel.toml: model_api_key: expected a string",
        "a secret is not repeated, even mistyped"
    );
    assert_eq!(
        err(&[], Some("db = \"mysql://u:pw@x/y\"")),
        "keel.toml: db: \"mysql://***@x/y\" is not supported; use sqlite://PATH or postgres://USER@HOST/DB"
    );
    assert!(err(&["--model", "gpt"], None).starts_with("--model: \"gpt\" is not supported; use `demo` or `openai`"));
    assert_eq!(err(&[], Some("model = \"gpt\"")), "keel.toml: model: \"gpt\" is not supported; use `demo` or `openai`");
    assert_eq!(
        err(&[], Some("log_format = \"xml\"")),
        "keel.toml: log_format: expected one of `text`, `json`, found \"xml\""
    );
    assert_eq!(err(&[], Some("demo_abnormal = -1")), "keel.toml: demo_abnormal: expected u32, found integer -1");
    assert!(err(&["--bus", "nats://x"], None).contains("redis://"));
    assert!(err(&["--allowed-host", "a b"], None).starts_with("--allowed-host: \"a b\" must be a host name"));
    let e = err(&[], Some("listen = \"x\"\nlisten = \"y\"\n"));
    assert!(e.starts_with("keel.toml:2:1: duplicate key"), "{e}");
    let e = err(&[], Some("[agents\n"));
    assert!(e.starts_with("keel.toml:1:") && !e.contains('\n'), "{e}");
}

#[test]
fn unknown_file_keys_are_refused() {
    assert_eq!(err(&[], Some("lisen = \"x\"")), "keel.toml: lisen: unknown key (did you mean `listen`?)");
    assert_eq!(err(&[], Some("zzz = 1")), "keel.toml: zzz: unknown key");
    assert_eq!(err(&[], Some("config = \"other.toml\"")), "keel.toml: config: unknown key", "a file names no file");
}

#[test]
fn unsupported_choices_are_clear_errors() {
    assert!(err(&["--db", "mysql://u:pw@x/y"], None).contains("sqlite://"));
    assert!(!err(&["--db", "mysql://u:pw@x/y"], None).contains("pw"));
    let pg = ok(&["--db", "postgres://keel:secret@db/keel"], None);
    assert_eq!(pg.database, Database::Postgres("postgres://keel:secret@db/keel".into()));
    assert!(!format!("{pg:?}").contains("secret"));
    assert!(err(&["--config", "/nonexistent/keel.toml"], None).starts_with("/nonexistent/keel.toml: cannot read it: "));
}

const TWO_AGENTS: &str = r#"
[[agents]]
id = "ops"
name = "Ops assistant"
description = "Looks at services and restarts them with approval."
system_prompt = "You are the ops assistant."
suggestions = ["Is checkout healthy?", "Restart checkout-api"]
[agents.model]
kind = "openai"
base_url = "http://127.0.0.1:11434/v1"
name = "llama3.1"
api_key_env = "OPS_MODEL_KEY"
api_key_header = "api-key"
temperature = 0.2
max_tokens = 800
idle_timeout = "45s"
max_retries = 4
[agents.context]
budget_tokens = 8000
summary_max_chars = 1500
tool_result_max_bytes = 4096
[[agents.tools]]
kind = "http"
name = "restart_instance"
description = "Restart an instance"
method = "POST"
url = "http://ops.internal/restart"
args_schema = { type = "object" }
[[agents.tools]]
kind = "http"
name = "status"
description = "Status"
method = "GET"
url = "http://ops.internal/status"
[agents.tools.args_schema]
type = "object"

[[agents]]
id = "helper"
system_prompt = "You answer questions."
default = true
"#;

#[test]
fn two_agents_parse_into_their_configs() {
    let s = load(&[], Some(TWO_AGENTS), &[("OPS_MODEL_KEY", "sk-ops")]).unwrap();
    let [ops, helper] = &s.agents[..] else { panic!("two agents: {:?}", s.agents) };

    let mut model = keel_models::OpenAiConfig::new("http://127.0.0.1:11434/v1", "llama3.1");
    model.api_key = Some(keel_models::ApiKey::new("sk-ops"));
    model.api_key_header = Some("api-key".into());
    model.temperature = Some(0.2);
    model.max_tokens = Some(800);
    model.idle_timeout = Duration::from_secs(45);
    model.max_retries = 4;
    let tool = |text: &str| toml::from_str::<toml::Table>(text).unwrap();
    assert_eq!(
        *ops,
        AgentConfig {
            id: "ops".into(),
            name: "Ops assistant".into(),
            description: Some("Looks at services and restarts them with approval.".into()),
            system_prompt: "You are the ops assistant.".into(),
            default: false,
            model: Some(ModelChoice::OpenAi(Box::new(model))),
            context: AgentContext {
                budget_tokens: Some(8000),
                summary_max_chars: Some(1500),
                tool_result_max_bytes: Some(4096)
            },
            tools: vec![
                ToolConfig {
                    name: "restart_instance".into(),
                    kind: "http".into(),
                    table: tool(
                        "kind = \"http\"\nname = \"restart_instance\"\ndescription = \"Restart an instance\"\n\
                         method = \"POST\"\nurl = \"http://ops.internal/restart\"\nargs_schema = { type = \"object\" }",
                    ),
                },
                ToolConfig {
                    name: "status".into(),
                    kind: "http".into(),
                    table: tool(
                        "kind = \"http\"\nname = \"status\"\ndescription = \"Status\"\nmethod = \"GET\"\n\
                         url = \"http://ops.internal/status\"\n[args_schema]\ntype = \"object\"",
                    ),
                },
            ],
            suggestions: vec!["Is checkout healthy?".into(), "Restart checkout-api".into()],
            events_after: None,
        }
    );
    assert_eq!(
        *helper,
        AgentConfig {
            id: "helper".into(),
            name: "helper".into(),
            description: None,
            system_prompt: "You answer questions.".into(),
            default: true,
            model: None,
            context: AgentContext::default(),
            tools: vec![],
            suggestions: vec![],
            events_after: None,
        }
    );
    assert!(!format!("{s:?}").contains("sk-ops"), "the key never shows in Debug");

    // Without a `default = true`, the first agent is the default.
    let s = load(&[], Some(&TWO_AGENTS.replace("default = true", "")), &[("OPS_MODEL_KEY", "k")]).unwrap();
    assert_eq!(s.agents.iter().map(|a| a.default).collect::<Vec<_>>(), [true, false]);
    let demo = "[[agents]]\nid = \"d\"\nsystem_prompt = \"p\"\n[agents.model]\nkind = \"demo\"\n";
    assert_eq!(ok(&[], Some(demo)).agents[0].suggestions, Vec::<String>::new(), "no suggestions: none");
    assert_eq!(ok(&[], Some(demo)).agents[0].model, Some(ModelChoice::Demo));
}

/// Up to 8 suggestions of up to 200 characters (not bytes) each, kept as written, in file order.
#[test]
fn suggestions_are_kept_within_their_bounds() {
    let longest = "é".repeat(200);
    let mut texts: Vec<String> = (1..8).map(|i| format!("Question {i}?")).collect();
    texts.push(longest.clone());
    let file = format!(
        "[[agents]]\nid = \"ops\"\nsystem_prompt = \"p\"\nsuggestions = [{}]\n",
        texts.iter().map(|t| format!("{t:?}")).collect::<Vec<_>>().join(", ")
    );
    let s = ok(&[], Some(&file));
    assert_eq!(s.agents[0].suggestions, texts);
    assert_eq!(s.agents[0].suggestions[7].len(), 400, "200 characters, 400 bytes");
    let spaced = "[[agents]]\nid = \"ops\"\nsystem_prompt = \"p\"\nsuggestions = [\" Is it up? \"]\n";
    assert_eq!(ok(&[], Some(spaced)).agents[0].suggestions, [" Is it up? "]);
}

/// Each mistake in `[[agents]]` is one line naming the file, the agent and the field.
#[test]
fn agent_mistakes_name_the_file_the_agent_and_the_field() {
    let agent = |id: &str, rest: &str| format!("[[agents]]\nid = {id:?}\nsystem_prompt = \"p\"\n{rest}\n");
    let openai = "[agents.model]\nkind = \"openai\"\nbase_url = \"http://m/v1\"\nname = \"n\"\n";
    let cases: Vec<(String, &str)> = vec![
        (
            agent("ops", "[agents.model]\nkind = \"openai\"\nname = \"n\""),
            r#"keel.toml: agents[0] (id "ops"): model.base_url: required for kind "openai""#,
        ),
        (
            format!("{}{}", agent("a", ""), agent("ops", "[agents.model]\nkind = \"openai\"\nbase_url = \"http://m\"")),
            r#"keel.toml: agents[1] (id "ops"): model.name: required for kind "openai""#,
        ),
        (format!("{}{}", agent("ops", ""), agent("ops", "")), r#"keel.toml: agents: two agents have the id "ops""#),
        ("[[agents]]\nid = \"ops\"\n".into(), r#"keel.toml: agents[0] (id "ops"): system_prompt: required"#),
        (agent("ops", "system_prompt = \" \"").replace("system_prompt = \"p\"\n", ""), r#"keel.toml: agents[0] (id "ops"): system_prompt: empty"#),
        ("[[agents]]\nsystem_prompt = \"p\"\n".into(), "keel.toml: agents[0]: id: required"),
        (
            agent("Ops!", ""),
            r#"keel.toml: agents[0] (id "Ops!"): id: must be 1 to 64 of a-z, 0-9, _ and -, starting with a letter or a digit"#,
        ),
        (agent("-x", ""), r#"keel.toml: agents[0] (id "-x"): id: must be 1 to 64 of a-z, 0-9, _ and -, starting with a letter or a digit"#),
        (
            agent("ops", &format!("{openai}api_key = \"sk-literal-secret\"")),
            r#"keel.toml: agents[0] (id "ops"): model.api_key: a key is never written in keel.toml; put it in an environment variable and name that variable with model.api_key_env"#,
        ),
        (
            agent("ops", &format!("{openai}api_key_env = \"OPS_MODEL_KEY\"")),
            r#"keel.toml: agent "ops": model.api_key_env: the environment variable OPS_MODEL_KEY is not set"#,
        ),
        (
            agent("ops", &format!("{openai}api_key_env = \"sk-pasted-secret\"")),
            r#"keel.toml: agents[0] (id "ops"): model.api_key_env: must be the name of an environment variable (A-Z, 0-9 and _, e.g. OPS_MODEL_KEY), not the key itself"#,
        ),
        (
            agent("ops", "[[agents.tools]]\nkind = \"http\"\nname = \"restart\"\ndescription = \"Restart it\"\nmethod = \"POST\"\nurl = \"http://127.0.0.1:9/restart\"\nargs_schema = { type = \"object\" }\n[[agents.tools]]\nkind = \"http\"\nname = \"restart\"\ndescription = \"Restart it\"\nmethod = \"POST\"\nurl = \"http://127.0.0.1:9/restart\"\nargs_schema = { type = \"object\" }"),
            r#"keel.toml: agent "ops": tools[0] ("restart"): name: the tool name "restart" is used twice"#,
        ),
        (
            agent("ops", "[[agents.tools]]\nkind = \"\"\nname = \"restart\""),
            r#"keel.toml: agent "ops": tools[0] ("restart"): kind: required, a non-empty string"#,
        ),
        (agent("ops", "[[agents.tools]]\nkind = \"http\""), r#"keel.toml: agent "ops": tools[0]: name: required, a non-empty string"#),
        (
            agent("ops", "[[agents.tools]]\nkind = \"http\"\nname = 7"),
            r#"keel.toml: agent "ops": tools[0]: name: required, a non-empty string"#,
        ),
        (
            format!("{}{}", agent("a", "default = true"), agent("b", "default = true")),
            r#"keel.toml: agents: two agents say default = true ("a" and "b"); at most one may"#,
        ),
        (
            agent("ops", "[agents.model]\nkind = \"gpt\""),
            r#"keel.toml: agents[0] (id "ops"): model.kind: unknown variant `gpt`, expected `demo` or `openai`"#,
        ),
        (agent("ops", "[agents.model]\nname = \"n\""), r#"keel.toml: agents[0] (id "ops"): model.kind: required, "demo" or "openai""#),
        (
            agent("ops", "[agents.model]\nkind = \"demo\"\nbase_url = \"http://m\""),
            r#"keel.toml: agents[0] (id "ops"): model.base_url: only for kind "openai""#,
        ),
        (
            agent("ops", &format!("{openai}idle_timeout = \"soon\"")),
            r#"keel.toml: agents[0] (id "ops"): model.idle_timeout: "soon" is not a duration (expected number at 0); durations look like 500ms, 90s, 15m, 1h30m"#,
        ),
        (
            agent("ops", &format!("{openai}temperature = \"hot\"")),
            r#"keel.toml: agents[0] (id "ops"): model.temperature: invalid type: string "hot", expected f32"#,
        ),
        (agent("ops", "[agents.context]\nbudget_tokens = 0"), r#"keel.toml: agents[0] (id "ops"): context.budget_tokens: must be more than 0"#),
        (
            agent("ops", "sytem_prompt = \"p\""),
            r#"keel.toml: agents[0] (id "ops"): sytem_prompt: unknown key (did you mean `system_prompt`?)"#,
        ),
        (
            agent("ops", "[agents.context]\nbudget = 1"),
            r#"keel.toml: agents[0] (id "ops"): context.budget: unknown key (did you mean `budget_tokens`?)"#,
        ),
        ("agents = \"ops\"".into(), r#"keel.toml: agents: expected an array, found string "ops""#),
        (
            agent("ops", &format!("suggestions = [{}]", ["\"s\""; 9].join(", "))),
            r#"keel.toml: agents[0] (id "ops"): suggestions: at most 8 (9 given)"#,
        ),
        (agent("ops", "suggestions = [\"a\", \" \"]"), r#"keel.toml: agents[0] (id "ops"): suggestions[1]: empty"#),
        (
            agent("ops", &format!("suggestions = [{:?}]", "x".repeat(201))),
            r#"keel.toml: agents[0] (id "ops"): suggestions[0]: at most 200 characters (201 given)"#,
        ),
        (
            agent("ops", "suggestions = \"Restart it\""),
            r#"keel.toml: agents[0] (id "ops"): suggestions: invalid type: string "Restart it", expected a sequence"#,
        ),
        (agent("ops", "suggestions = [7]"), r#"keel.toml: agents[0] (id "ops"): suggestions[0]: invalid type: integer `7`, expected a string"#),
        (
            agent("ops", "suggestion = [\"a\"]"),
            r#"keel.toml: agents[0] (id "ops"): suggestion: unknown key (did you mean `suggestions`?)"#,
        ),
    ];
    for (file, expected) in cases {
        let e = err(&[], Some(&file));
        assert_eq!(e, expected, "\n{file}");
        assert!(!e.contains("secret"), "{e}");
    }
    let hex_key = "d41d8cd98f00b204e9800998ecf8427e";
    let e = err(&[], Some(&agent("ops", &format!("{openai}api_key_env = {hex_key:?}"))));
    assert!(e.contains("not the key itself") && !e.contains(hex_key), "a pasted key is not printed: {e}");
    let empty = [("OPS_MODEL_KEY", " ")];
    let file = agent("ops", &format!("{openai}api_key_env = \"OPS_MODEL_KEY\""));
    assert_eq!(
        load(&[], Some(&file), &empty).unwrap_err(),
        r#"keel.toml: agent "ops": model.api_key_env: the environment variable OPS_MODEL_KEY is empty"#
    );
}

#[test]
fn retention_is_global_with_per_agent_durations() {
    let none = ok(&[], None).retention;
    assert!(!none.enabled(), "forever by default: {none:?}");
    assert_eq!((none.every, none.batch), (Duration::from_secs(600), 1000));
    let file = r#"
retention_events_after = "30d"
retention_batch = 50

[[agents]]
id = "payments"
system_prompt = "p"
[agents.retention]
events_after = "365d"

[[agents]]
id = "chat"
system_prompt = "c"
[agents.retention]
events_after = "forever"

[[agents]]
id = "plain"
system_prompt = "x"
"#;
    let r = ok(&["--retention-interval", "1m"], Some(file)).retention;
    assert_eq!(r.events_after, Some(Duration::from_secs(30 * 86_400)));
    assert_eq!(
        r.agents,
        vec![("payments".to_owned(), Some(Duration::from_secs(365 * 86_400))), ("chat".to_owned(), None)]
    );
    assert_eq!((r.every, r.batch), (Duration::from_secs(60), 50));
    let rules = r.rules(chrono::DateTime::from_timestamp(1_893_499_200, 0).unwrap());
    assert_eq!(rules.len(), 2, "payments' own, then the global one; chat keeps everything: {rules:?}");
    assert_eq!(rules[0].agent.as_deref(), Some("payments"));
    assert_eq!(
        (rules[1].agent.as_deref(), rules[1].except_agents.clone()),
        (None, vec!["payments".into(), "chat".into()])
    );

    assert!(err(&["--retention-events-after", "soon"], None)
        .starts_with("--retention-events-after: \"soon\" is not a duration"));
    let bad = "[[agents]]\nid = \"a\"\nsystem_prompt = \"p\"\n[agents.retention]\nevents_after = \"0s\"\n";
    assert!(
        err(&[], Some(bad)).contains("agent") && err(&[], Some(bad)).contains("retention.events_after"),
        "{}",
        err(&[], Some(bad))
    );
    assert!(err(&["--retention-batch", "0"], None).contains("must be at least 1"));
}
