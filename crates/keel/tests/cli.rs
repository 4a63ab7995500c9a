//! The binary as a user runs it: settings from file, environment and flags; `migrate`; a demo
//! server that answers and stops on a signal.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

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
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    write!(stream, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").unwrap();
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
