//! The real `keel serve` as a child process on a free port, over a SQLite file in a directory the
//! test owns; and waiting for a condition with a deadline instead of sleeping.

#![allow(dead_code)]

pub mod serve;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const KEEL: &str = env!("CARGO_BIN_EXE_keel");

/// How long any one wait in a test may take before it fails.
pub const DEADLINE: Duration = Duration::from_secs(30);

/// `keel` with no `KEEL_…` settings from the environment of the test run.
pub fn keel() -> Command {
    let mut cmd = Command::new(KEEL);
    cmd.env("RUST_LOG", "warn");
    for (key, _) in std::env::vars() {
        if key.starts_with("KEEL_") {
            cmd.env_remove(key);
        }
    }
    cmd
}

/// A running `keel demo`; killed when dropped.
pub struct Server {
    child: Child,
    pub addr: String,
    pub data_dir: PathBuf,
}

impl Server {
    /// `keel demo` (OpsPilot over a seeded fleet) on 127.0.0.1:0 with the demo model pausing `demo_delay_ms` before each word.
    /// Returns once it listens (its banner is printed after the bind).
    pub fn start(data_dir: &Path, demo_delay_ms: u64) -> Self {
        Self::start_with(data_dir, demo_delay_ms, &[])
    }

    /// [`Server::start`] with more flags.
    pub fn start_with(data_dir: &Path, demo_delay_ms: u64, flags: &[&str]) -> Self {
        let mut child = keel()
            .args(["demo", "--listen", "127.0.0.1:0", "--demo-delay-ms", &demo_delay_ms.to_string()])
            .arg("--data-dir")
            .arg(data_dir)
            .args(flags)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn keel serve");
        let mut banner = String::new();
        BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut banner).expect("banner");
        let addr = banner
            .trim()
            .strip_prefix("Keel demo running at http://")
            .and_then(|rest| rest.strip_suffix('/'))
            .unwrap_or_else(|| panic!("unexpected banner {banner:?}"))
            .to_owned();
        Self { child, addr, data_dir: data_dir.to_owned() }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// SIGTERM, then waits (up to [`DEADLINE`]) for the process to exit: a clean stop.
    pub fn terminate(mut self) -> std::process::ExitStatus {
        let sent = Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status().expect("run kill");
        assert!(sent.success(), "kill -TERM {}", self.child.id());
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("wait for keel serve") {
                return status;
            }
            assert!(start.elapsed() < DEADLINE, "keel serve did not exit within {DEADLINE:?} of SIGTERM");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGKILL: no graceful shutdown, no lease released — a crash.
    pub fn kill(mut self) {
        self.child.kill().expect("kill keel serve");
        self.child.wait().expect("reap keel serve");
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Polls `check` until it returns `Some`, failing after [`DEADLINE`].
pub async fn eventually<T, F, Fut>(what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(start.elapsed() < DEADLINE, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
