//! The binary as a user runs it: settings from file, environment and flags; `migrate`; a demo
//! server that answers and stops on a signal.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

mod support;

const KEEL: &str = env!("CARGO_BIN_EXE_keel");

fn keel(dir: &std::path::Path) -> Command {
    let mut cmd = Command::new(KEEL);
    cmd.current_dir(dir).env("RUST_LOG", "warn");
    for (key, _) in std::env::vars() {
        if key.starts_with("KEEL_") {
            cmd.env_remove(key);
        }
    }
    cmd
}

fn http_get(addr: &str, path: &str) -> String {
    http_get_with(addr, path, "")
}

/// `extra`: header lines, each ending in CRLF.
fn http_get_with(addr: &str, path: &str, extra: &str) -> String {
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    write!(stream, "GET {path} HTTP/1.1\r\nHost: {addr}\r\n{extra}Connection: close\r\n\r\n").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("read");
    response
}

#[test]
fn migrate_creates_the_database() {
    let dir = tempfile::tempdir().unwrap();
    let output = keel(dir.path()).args(["migrate", "--data-dir", "data"]).output().unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    assert!(dir.path().join("data/keel.db").exists());
}

#[test]
fn unsupported_settings_are_clear_startup_errors() {
    let dir = tempfile::tempdir().unwrap();
    for (args, needle) in [
        (vec!["serve", "--db", "mysql://localhost/keel"], "use sqlite://PATH or postgres://"),
        (vec!["serve", "--model", "gpt-4o"], "use `demo` or `openai`"),
        (vec!["serve", "--model", "openai"], "--model-base-url"),
        (vec!["serve", "--interrupt-ttl", "soon"], "--interrupt-ttl"),
        (vec!["serve", "--config", "missing.toml"], "missing.toml"),
    ] {
        let output = keel(dir.path()).args(&args).output().unwrap();
        assert_eq!(output.status.code(), Some(1), "{args:?}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
        assert!(!stderr.contains("backtrace"), "{stderr}");
    }
}

/// defaults < keel.toml < KEEL_ environment < flags; then a demo that answers and stops on SIGINT.
#[cfg(unix)]
#[test]
fn demo_serves_with_layered_settings_and_stops_on_a_signal() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("keel.toml"),
        "listen = \"256.0.0.1:1\"\ndemo_delay_ms = 0\ndemo_abnormal = 3\ndata_dir = \"from-file\"\n",
    )
    .unwrap();
    let mut child = keel(dir.path())
        .args(["demo", "--demo-abnormal", "1"])
        .env("KEEL_LISTEN", "127.0.0.1:0")
        .env("KEEL_DEMO_ABNORMAL", "2")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut banner = String::new();
    stdout.read_line(&mut banner).unwrap();
    let addr = banner
        .trim()
        .strip_prefix("Keel demo running at http://")
        .and_then(|rest| rest.strip_suffix('/'))
        .unwrap_or_else(|| panic!("unexpected banner {banner:?}"))
        .to_owned();

    assert!(http_get(&addr, "/healthz").starts_with("HTTP/1.1 200"));
    let instances = http_get(&addr, "/v1/demo/instances");
    assert!(instances.contains("\"pay-prod-2\""), "{instances}");
    assert!(instances.contains("\"pay-prod-a1\""), "the flag's 1 extra abnormal instance: {instances}");
    assert!(!instances.contains("\"pay-prod-a2\""), "not the environment's 2 or the file's 3: {instances}");
    assert!(dir.path().join("from-file/keel.db").exists());

    let killed = Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap();
    assert!(killed.success());
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait());
    });
    let status = rx.recv_timeout(Duration::from_secs(20)).expect("keel stops after SIGINT").unwrap();
    assert!(status.success(), "{status:?}");
}

/// `keel serve` over `dir`'s `keel-data` (where `keel users` writes without `--data-dir`).
fn serve(dir: &std::path::Path, flags: &[&str]) -> (support::Server, String) {
    let server = support::Server::start_with(&dir.join("keel-data"), 0, flags);
    let addr = server.addr.clone();
    (server, addr)
}

fn users(dir: &std::path::Path, args: &[&str]) -> std::process::Output {
    let output = keel(dir).arg("users").args(args).output().unwrap();
    assert!(output.status.success(), "users {args:?}: {}", String::from_utf8_lossy(&output.stderr));
    output
}

/// `keel users add` prints a key once; with a key in the database every /v1 request needs one; a
/// revoked key stops working at once; a demoted user is a viewer at once.
#[test]
fn users_and_keys_from_the_command_line() {
    let dir = tempfile::tempdir().unwrap();
    let added = users(dir.path(), &["add", "alice", "--role", "operator"]);
    let key = String::from_utf8(added.stdout).unwrap().trim().to_owned();
    assert!(key.starts_with("keel_") && key.len() == 69, "the key alone on stdout: {key:?}");
    let stderr = String::from_utf8_lossy(&added.stderr);
    assert!(stderr.contains("shown only this once"), "{stderr}");
    let db = std::fs::read(dir.path().join("keel-data/keel.db")).unwrap();
    assert!(!db.windows(key.len()).any(|w| w == key.as_bytes()), "the key itself is not stored");

    let bad = keel(dir.path()).args(["users", "add", "bob", "--role", "root"]).output().unwrap();
    assert_eq!(bad.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("viewer, operator or admin"));
    let bad = keel(dir.path()).args(["users", "add", "not a name"]).output().unwrap();
    assert_eq!(bad.status.code(), Some(1));

    let (server, addr) = serve(dir.path(), &[]);
    let anonymous = http_get(&addr, "/v1/conversations");
    assert!(anonymous.starts_with("HTTP/1.1 401"), "{anonymous}");
    assert!(anonymous.contains("UNAUTHENTICATED"), "{anonymous}");
    let bearer = format!("Authorization: Bearer {key}\r\n");
    let ok = http_get_with(&addr, "/v1/conversations", &bearer);
    assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
    assert!(http_get(&addr, "/healthz").starts_with("HTTP/1.1 200"), "health needs no key");

    let listed = String::from_utf8(users(dir.path(), &["list"]).stdout).unwrap();
    assert!(listed.lines().any(|l| l.split_whitespace().collect::<Vec<_>>() == ["alice", "operator", "1"]), "{listed}");
    users(dir.path(), &["set-role", "alice", "viewer"]);
    let listed = String::from_utf8(users(dir.path(), &["list"]).stdout).unwrap();
    assert!(listed.contains("viewer"), "{listed}");

    users(dir.path(), &["revoke", "alice"]);
    let revoked = http_get_with(&addr, "/v1/conversations", &bearer);
    assert!(revoked.starts_with("HTTP/1.1 401"), "{revoked}");
    server.kill();
}

/// Without keys: loopback serves the local demo user; any other address refuses to start unless
/// told `--insecure-no-auth`.
#[test]
fn no_keys_means_loopback_only() {
    let dir = tempfile::tempdir().unwrap();
    let (server, addr) = serve(dir.path(), &[]);
    let ok = http_get(&addr, "/v1/conversations");
    assert!(ok.starts_with("HTTP/1.1 200"), "the local demo user: {ok}");
    let wrong = http_get_with(&addr, "/v1/conversations", "Authorization: Bearer keel_guess\r\n");
    assert!(wrong.starts_with("HTTP/1.1 401"), "a key that is sent is checked: {wrong}");
    server.kill();

    let refused = keel(dir.path()).args(["serve", "--listen", "0.0.0.0:0"]).output().unwrap();
    assert_eq!(refused.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("without API keys") && stderr.contains("--insecure-no-auth"), "{stderr}");

    let mut child = keel(dir.path())
        .args(["serve", "--listen", "0.0.0.0:0", "--insecure-no-auth"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut banner = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut banner).unwrap();
    assert!(banner.starts_with("Keel listening on http://0.0.0.0:"), "{banner:?}");
    child.kill().unwrap();
    child.wait().unwrap();
}

/// Keys listed in keel.toml by their SHA-256 work like keys made by `keel users add`.
#[test]
fn keys_from_the_file_by_hash() {
    let dir = tempfile::tempdir().unwrap();
    // sha256("abc")
    std::fs::write(
        dir.path().join("keel.toml"),
        "[[api_keys]]\nuser = \"ci\"\nrole = \"operator\"\n\
         sha256 = \"ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad\"\n",
    )
    .unwrap();
    let config = dir.path().join("keel.toml");
    let (server, addr) = serve(dir.path(), &["--config", config.to_str().unwrap()]);
    assert!(http_get(&addr, "/v1/conversations").starts_with("HTTP/1.1 401"));
    let ok = http_get_with(&addr, "/v1/conversations", "Authorization: Bearer abc\r\n");
    assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
    server.kill();
}

/// A request sent as `host` names it, whatever address it goes to.
fn http_as_host(addr: &str, host: &str, method: &str, path: &str, extra: &str) -> String {
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let body = if method == "POST" { "{}" } else { "" };
    let length = if method == "POST" { "Content-Type: application/json\r\nContent-Length: 2\r\n" } else { "" };
    write!(stream, "{method} {path} HTTP/1.1\r\nHost: {host}\r\n{length}{extra}Connection: close\r\n\r\n{body}")
        .unwrap();
    let mut response = Vec::new();
    // An SSE or WebSocket answer does not end by itself: its head is enough.
    let mut chunk = [0u8; 4096];
    while let Ok(n) = stream.read(&mut chunk) {
        if n == 0 {
            break;
        }
        response.extend_from_slice(&chunk[..n]);
        if response.windows(4).any(|w| w == b"\r\n\r\n") && !response.starts_with(b"HTTP/1.1 200") {
            break;
        }
        if response.starts_with(b"HTTP/1.1 101") || response.starts_with(b"HTTP/1.1 200") {
            break;
        }
    }
    String::from_utf8_lossy(&response).into_owned()
}

/// Every kind of route: REST reads and writes, an SSE stream, the WebSocket upgrade, AG-UI, the
/// page and its assets, health.
const ROUTES: &[(&str, &str, &str)] = &[
    ("GET", "/v1/conversations", ""),
    ("POST", "/v1/conversations", ""),
    ("GET", "/v1/runs/run_x/events", "Accept: text/event-stream\r\n"),
    (
        "GET",
        "/v1/ws",
        "Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n",
    ),
    ("POST", "/v1/ag-ui", "Accept: text/event-stream\r\n"),
    ("GET", "/", ""),
    ("GET", "/assets/app.js", ""),
    ("GET", "/healthz", ""),
];

/// Without keys on loopback, a request addressed to another name (a page that rebound its name to
/// 127.0.0.1) is refused on every route before anything runs; loopback names and `--allowed-host`
/// names are served; with keys the check is off.
#[test]
fn keyless_loopback_answers_only_loopback_hosts() {
    let dir = tempfile::tempdir().unwrap();
    let (server, addr) = serve(dir.path(), &["--allowed-host", "keel.test,ops.example"]);
    let port = addr.rsplit(':').next().unwrap().to_owned();
    for (method, path, extra) in ROUTES {
        for host in [format!("attacker.example:{port}"), "attacker.example".into(), format!("127.0.0.1.nip.io:{port}")]
        {
            let answer = http_as_host(&addr, &host, method, path, extra);
            assert!(answer.starts_with("HTTP/1.1 403"), "{method} {path} as {host}: {answer}");
            assert!(answer.contains("HOST_NOT_ALLOWED"), "{answer}");
            assert!(!answer.contains("attacker"), "the refused name is not repeated: {answer}");
        }
        for host in [
            format!("127.0.0.1:{port}"),
            format!("localhost:{port}"),
            format!("[::1]:{port}"),
            "localhost".into(),
            format!("keel.test:{port}"),
            "OPS.example".into(),
        ] {
            let answer = http_as_host(&addr, &host, method, path, extra);
            assert!(!answer.starts_with("HTTP/1.1 403"), "{method} {path} as {host}: {answer}");
        }
    }
    let missing = {
        let mut stream = TcpStream::connect(&addr).unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        write!(stream, "GET /v1/conversations HTTP/1.0\r\n\r\n").unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).unwrap();
        answer
    };
    assert!(missing.starts_with("HTTP/1.0 403") || missing.starts_with("HTTP/1.1 403"), "no Host: {missing}");
    server.kill();

    // With a key, the key is the protection: any Host is served.
    let added = users(dir.path(), &["add", "alice", "--role", "operator"]);
    let key = String::from_utf8(added.stdout).unwrap().trim().to_owned();
    let (server, addr) = serve(dir.path(), &[]);
    let answer =
        http_as_host(&addr, "keel.internal", "GET", "/v1/conversations", &format!("Authorization: Bearer {key}\r\n"));
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    server.kill();
}

/// `keel demo` in `dir` (which may hold a keel.toml) with `args` and `env`; its address once it
/// listens.
fn demo_with(dir: &std::path::Path, args: &[&str], env: &[(&str, &str)]) -> (std::process::Child, String) {
    // A data directory of its own each time: the demo seeds its fleet only into an empty database.
    static STARTS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let data = dir.join(format!("data-{}", STARTS.fetch_add(1, std::sync::atomic::Ordering::SeqCst)));
    let mut child = keel(dir)
        .arg("demo")
        .arg("--data-dir")
        .arg(data)
        .args(args)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut banner = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut banner).unwrap();
    let addr = banner
        .trim()
        .strip_prefix("Keel demo running at http://")
        .and_then(|rest| rest.strip_suffix('/'))
        .unwrap_or_else(|| panic!("unexpected banner {banner:?} for {args:?} {env:?}"))
        .to_owned();
    (child, addr)
}

/// What a running demo server says about four of its settings: its port (`listen`, a string), how
/// long a stream ticket lasts (`stream_ticket_ttl`, a duration), how many extra abnormal instances it
/// seeded (`demo_abnormal`, a number), and which of the names it serves (`allowed_hosts`, a list).
struct Observed {
    port: u16,
    ticket_ttl: Duration,
    abnormal: u32,
    serves: Vec<&'static str>,
}

fn observe(addr: &str) -> Observed {
    let ticket = http_as_host(addr, addr, "POST", "/v1/ws/ticket", "");
    assert!(ticket.starts_with("HTTP/1.1 201"), "{ticket}");
    let expires = ticket.split("\"expiresAt\":\"").nth(1).and_then(|rest| rest.split('"').next()).unwrap();
    let expires = chrono::DateTime::parse_from_rfc3339(expires).unwrap().with_timezone(&chrono::Utc);
    let ticket_ttl = (expires - chrono::Utc::now()).to_std().unwrap();
    let instances = http_get(addr, "/v1/demo/instances");
    let abnormal = (1..10).take_while(|n| instances.contains(&format!("\"pay-prod-a{n}\""))).count() as u32;
    let serves = ["file.test", "env.test", "flag.test"]
        .into_iter()
        .filter(|host| !http_as_host(addr, host, "GET", "/v1/conversations", "").starts_with("HTTP/1.1 403"))
        .collect();
    Observed { port: addr.rsplit(':').next().unwrap().parse().unwrap(), ticket_ttl, abnormal, serves }
}

/// defaults < keel.toml < KEEL_ environment < flags, for a string, a duration, a number and a list:
/// each layer is given values of its own, a lower layer's would show, and an unusable address in a
/// lower layer would stop the server.
#[cfg(unix)]
#[test]
fn each_layer_overrides_the_one_below_for_each_kind_of_setting() {
    let dir = tempfile::tempdir().unwrap();
    let about = |ttl: Duration, observed: Duration| observed <= ttl && observed + Duration::from_secs(60) > ttl;

    // Defaults: 60 s tickets, no extra instance, loopback names only (the port is a flag: the
    // default 8080 may be taken).
    let (mut child, addr) = demo_with(dir.path(), &["--listen", "127.0.0.1:0"], &[]);
    let seen = observe(&addr);
    assert!(about(Duration::from_secs(60), seen.ticket_ttl), "{:?}", seen.ticket_ttl);
    assert_eq!((seen.abnormal, seen.serves.len()), (0, 0));
    child.kill().unwrap();
    child.wait().unwrap();

    std::fs::write(
        dir.path().join("keel.toml"),
        "listen = \"127.0.0.1:0\"\nstream_ticket_ttl = \"2h\"\ndemo_abnormal = 1\nallowed_hosts = [\"file.test\"]\n",
    )
    .unwrap();
    let (mut child, addr) = demo_with(dir.path(), &[], &[]);
    let seen = observe(&addr);
    assert_ne!(seen.port, 8080);
    assert!(about(Duration::from_secs(2 * 3600), seen.ticket_ttl), "{:?}", seen.ticket_ttl);
    assert_eq!((seen.abnormal, seen.serves), (1, vec!["file.test"]));
    child.kill().unwrap();
    child.wait().unwrap();

    std::fs::write(
        dir.path().join("keel.toml"),
        "listen = \"256.0.0.1:1\"\nstream_ticket_ttl = \"2h\"\ndemo_abnormal = 1\nallowed_hosts = [\"file.test\"]\n",
    )
    .unwrap();
    let env = [
        ("KEEL_LISTEN", "127.0.0.1:0"),
        ("KEEL_STREAM_TICKET_TTL", "3h"),
        ("KEEL_DEMO_ABNORMAL", "2"),
        ("KEEL_ALLOWED_HOSTS", "env.test"),
    ];
    let (mut child, addr) = demo_with(dir.path(), &[], &env);
    let seen = observe(&addr);
    assert!(about(Duration::from_secs(3 * 3600), seen.ticket_ttl), "{:?}", seen.ticket_ttl);
    assert_eq!((seen.abnormal, seen.serves), (2, vec!["env.test"]));
    child.kill().unwrap();
    child.wait().unwrap();

    let env = [
        ("KEEL_LISTEN", "256.0.0.2:1"),
        ("KEEL_STREAM_TICKET_TTL", "3h"),
        ("KEEL_DEMO_ABNORMAL", "2"),
        ("KEEL_ALLOWED_HOSTS", "env.test"),
    ];
    let flags =
        ["--listen", "127.0.0.1:0", "--stream-ticket-ttl", "4h", "--demo-abnormal", "3", "--allowed-host", "flag.test"];
    let (mut child, addr) = demo_with(dir.path(), &flags, &env);
    let seen = observe(&addr);
    assert!(about(Duration::from_secs(4 * 3600), seen.ticket_ttl), "{:?}", seen.ticket_ttl);
    assert_eq!((seen.abnormal, seen.serves), (3, vec!["flag.test"]));
    child.kill().unwrap();
    child.wait().unwrap();
}

/// An `[[agents]]` agent, with `rest` after its id and system prompt.
fn agent(id: &str, rest: &str) -> String {
    format!("[[agents]]\nid = \"{id}\"\nsystem_prompt = \"You help.\"\n{rest}\n")
}

const OPENAI: &str =
    "[agents.model]\nkind = \"openai\"\nbase_url = \"http://127.0.0.1:11434/v1\"\nname = \"llama3.1\"\n";

/// A variable no test run sets: the agent that names it must be refused.
const UNSET_KEY_VAR: &str = "KEEL_TEST_UNSET_AGENT_KEY";

/// Each bad keel.toml stops `keel serve` before it listens: exit code 1 and the one line that
/// names the file, the agent and the field.
#[test]
fn a_bad_keel_toml_stops_serve_with_one_line() {
    let cases: Vec<(String, &str)> = vec![
        ("lisen = \"127.0.0.1:0\"\n".into(), "keel.toml: lisen: unknown key (did you mean `listen`?)"),
        (
            "heartbeat = \"soon\"\n".into(),
            "keel.toml: heartbeat: \"soon\" is not a duration (expected number at 0); durations look like 500ms, 90s, 15m, 1h30m",
        ),
        (format!("{}{}", agent("ops", ""), agent("ops", "")), "keel.toml: agents: two agents have the id \"ops\""),
        ("[[agents]]\nid = \"ops\"\n".into(), "keel.toml: agents[0] (id \"ops\"): system_prompt: required"),
        (
            format!("{}{}", agent("a", ""), agent("ops", "[agents.model]\nkind = \"openai\"\nname = \"llama3.1\"")),
            "keel.toml: agents[1] (id \"ops\"): model.base_url: required for kind \"openai\"",
        ),
        (
            agent("ops", &format!("{OPENAI}api_key = \"sk-do-not-print\"")),
            "keel.toml: agents[0] (id \"ops\"): model.api_key: a key is never written in keel.toml; put it in an \
             environment variable and name that variable with model.api_key_env",
        ),
        (
            agent("ops", &format!("{OPENAI}api_key_env = \"{UNSET_KEY_VAR}\"")),
            "keel.toml: agent \"ops\": model.api_key_env: the environment variable KEEL_TEST_UNSET_AGENT_KEY is not set",
        ),
        (
            agent("ops", "[[agents.tools]]\nkind = \"http\"\nname = \"restart\"\ndescription = \"Restart it\"\nmethod = \"POST\"\nurl = \"http://127.0.0.1:9/restart\"\nargs_schema = { type = \"object\" }\n[[agents.tools]]\nkind = \"http\"\nname = \"restart\"\ndescription = \"Restart it\"\nmethod = \"POST\"\nurl = \"http://127.0.0.1:9/restart\"\nargs_schema = { type = \"object\" }"),
            "keel.toml: agent \"ops\": tools[0] (\"restart\"): name: the tool name \"restart\" is used twice",
        ),
        (
            agent("ops", "[[agents.tools]]\nkind = \"\"\nname = \"restart\""),
            "keel.toml: agent \"ops\": tools[0] (\"restart\"): kind: required, a non-empty string",
        ),
        (
            format!("{}{}", agent("a", "default = true"), agent("b", "default = true")),
            "keel.toml: agents: two agents say default = true (\"a\" and \"b\"); at most one may",
        ),
        (
            agent("ops", "suggestions = [\"Restart checkout\", \"\"]"),
            "keel.toml: agents[0] (id \"ops\"): suggestions[1]: empty",
        ),
    ];
    for (file, line) in cases {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("keel.toml"), &file).unwrap();
        let output =
            keel(dir.path()).args(["serve", "--listen", "127.0.0.1:0"]).env_remove(UNSET_KEY_VAR).output().unwrap();
        assert_eq!(output.status.code(), Some(1), "{file}");
        assert_eq!(String::from_utf8_lossy(&output.stderr), format!("keel: {line}\n"), "{file}");
        assert!(output.stdout.is_empty(), "it never listened: {file}");
    }
}

/// A good `[[agents]]` section does not keep the server from starting, and `GET /v1/agents` lists
/// its agents as declared: the default, the tools, the suggestions (none when none are given).
#[test]
fn a_server_with_configured_agents_starts() {
    let dir = tempfile::tempdir().unwrap();
    let file = format!(
        "{}{}",
        agent(
            "ops",
            &format!("{OPENAI}api_key_env = \"OPS_MODEL_KEY\"\n[[agents.tools]]\nkind = \"http\"\nname = \"restart\"\ndescription = \"Restart it\"\nmethod = \"POST\"\nurl = \"http://127.0.0.1:9/restart\"\nargs_schema = {{ type = \"object\" }}")
        ),
        agent("helper", "default = true\nsuggestions = [\"What changed in checkout today?\", \"Explain error 503\"]")
    );
    std::fs::write(dir.path().join("keel.toml"), file).unwrap();
    let mut child = keel(dir.path())
        .args(["serve", "--listen", "127.0.0.1:0"])
        .env("OPS_MODEL_KEY", "sk-test")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut banner = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut banner).unwrap();
    assert!(banner.starts_with("Keel listening on http://127.0.0.1:"), "{banner:?}");
    let addr = banner.trim().trim_start_matches("Keel listening on http://").trim_end_matches('/').to_owned();
    let response = http_get(&addr, "/v1/agents");
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{response}");
    let listed: serde_json::Value = serde_json::from_str(body).unwrap();
    let agents = listed["agents"].as_array().unwrap();
    let by_id = |id: &str| agents.iter().find(|a| a["id"] == id).unwrap_or_else(|| panic!("{id}: {listed}"));
    assert_eq!(
        by_id("helper")["suggestions"],
        serde_json::json!(["What changed in checkout today?", "Explain error 503"])
    );
    assert_eq!(by_id("helper")["default"], true);
    assert_eq!(by_id("ops")["suggestions"], serde_json::json!([]));
    assert_eq!(by_id("ops")["tools"][0]["name"], "restart");
    child.kill().unwrap();
    child.wait().unwrap();
}

/// Logs carry colour codes on a terminal only, and not even there when `NO_COLOR` is set: a file,
/// a pipe or the journal gets plain text. The terminal is a pseudo-terminal from util-linux's
/// `script`; each server is stopped by `timeout`'s SIGTERM after its start-up lines.
#[cfg(target_os = "linux")]
#[test]
fn logs_have_colour_codes_only_on_a_terminal_without_no_color() {
    let dir = tempfile::tempdir().unwrap();
    let logs = |terminal: bool, no_color: bool| -> String {
        let data = dir.path().join(format!("data-{terminal}-{no_color}"));
        let serve = format!("{KEEL} serve --listen 127.0.0.1:0 --data-dir {}", data.display());
        let mut cmd = Command::new("timeout");
        if terminal {
            cmd.args(["3", "script", "-qec", &serve, "/dev/null"]);
        } else {
            cmd.args(["3", "sh", "-c", &serve]);
        }
        for (key, _) in std::env::vars() {
            if key.starts_with("KEEL_") {
                cmd.env_remove(key);
            }
        }
        cmd.current_dir(dir.path()).env("RUST_LOG", "info").env_remove("NO_COLOR");
        if no_color {
            cmd.env("NO_COLOR", "1");
        }
        let output = cmd.output().unwrap();
        let text = String::from_utf8_lossy(&output.stdout).into_owned() + &String::from_utf8_lossy(&output.stderr);
        assert!(text.contains("serving"), "the start-up log line: {text}");
        text
    };
    assert!(!logs(false, false).contains('\x1b'), "a pipe gets no colour codes");
    assert!(!logs(true, true).contains('\x1b'), "NO_COLOR: no colour codes on a terminal either");
    assert!(logs(true, false).contains('\x1b'), "a terminal without NO_COLOR gets colours");
}
