//! Scenarios that show how a run's cost grows with the data around it: a conversation's length
//! (`long-conversation`) and the fleet's size under the seeds' lookup-then-restart flow (`flow`).
//! Both run one request at a time and read the server's CPU time around each turn, so a turn's
//! cost is the server's alone, at nanosecond resolution.

use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};

use crate::{f2, percentile, str_field, table, Client};

/// The server's CPU time so far, in nanoseconds: the sum of its threads' time on a CPU
/// (`/proc/<pid>/task/*/schedstat`). Threads live as long as the server, so differences are exact.
pub fn cpu_ns(pid: u32) -> Result<u64> {
    let mut total = 0u64;
    let dir = format!("/proc/{pid}/task");
    for task in std::fs::read_dir(&dir).with_context(|| format!("read {dir}"))? {
        let path = task?.path().join("schedstat");
        // a thread that ended between the listing and the read took its time with it
        let Ok(text) = std::fs::read_to_string(&path) else { continue };
        let ns: u64 = text
            .split_whitespace()
            .next()
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| anyhow!("unreadable {}", path.display()))?;
        total += ns;
    }
    Ok(total)
}

/// How one message's run went, read from its stream up to its first pause or end.
struct Streamed {
    run_id: String,
    last: String,
    interrupt_id: Option<String>,
}

async fn send(client: &Client, conv: &str, content: &str) -> Result<Streamed> {
    let mut s =
        Client::sse(client.post(&format!("/v1/conversations/{conv}/messages")).json(&json!({ "content": content })))
            .await?;
    let first = s.expect_next().await?;
    let run_id = str_field(&first.parse()?, "runId")?;
    loop {
        let ev = s.expect_next().await?;
        if ev.ty == "interrupt" {
            let interrupt_id = str_field(&ev.parse()?, "interruptId")?;
            return Ok(Streamed { run_id, last: ev.ty, interrupt_id: Some(interrupt_id) });
        }
        if ev.terminal() {
            return Ok(Streamed { run_id, last: ev.ty, interrupt_id: None });
        }
    }
}

async fn approve(client: &Client, run_id: &str, interrupt_id: &str) -> Result<String> {
    let mut s = Client::sse(client.post(&format!("/v1/runs/{run_id}/resume")).json(&json!({
        "interruptId": interrupt_id, "decision": "approve", "idempotencyKey": format!("bench-{interrupt_id}")
    })))
    .await?;
    loop {
        let ev = s.expect_next().await?;
        if ev.terminal() {
            return Ok(ev.ty);
        }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn median(xs: &[f64]) -> f64 {
    percentile(xs, 50.0)
}

/// One conversation of `turns` turns, one after the other; each turn's latency (message sent →
/// its run's last event) and, with `pid`, the server's CPU time for it. Reported at checkpoints:
/// the median of the `window` turns that end at each.
pub async fn long_conversation(
    client: &Client,
    turns: usize,
    content: &str,
    window: usize,
    pid: Option<u32>,
    conversation: Option<&str>,
) -> Result<Value> {
    let conv = match conversation {
        Some(id) => id.to_owned(),
        None => client.conversation().await?,
    };
    eprintln!("conversation {conv}");
    let mut latency = Vec::with_capacity(turns);
    let mut cpu = Vec::with_capacity(turns);
    let started = Instant::now();
    for turn in 1..=turns {
        let before = pid.map(cpu_ns).transpose()?;
        let t0 = Instant::now();
        let ran = send(client, &conv, content).await?;
        let took = t0.elapsed();
        if ran.last != "done" {
            bail!("turn {turn}: run {} ended with {}", ran.run_id, ran.last);
        }
        let after = pid.map(cpu_ns).transpose()?;
        latency.push(ms(took));
        if let (Some(b), Some(a)) = (before, after) {
            cpu.push((a - b) as f64 / 1e6);
        }
        if turn % 100 == 0 {
            eprintln!("turn {turn} of {turns} ({:.0}s)", started.elapsed().as_secs_f64());
        }
    }
    let window = window.clamp(1, turns);
    let mut checkpoints: Vec<usize> =
        [10, 100, 300, 1000, 3000, 10_000].into_iter().filter(|&c| c >= window && c <= turns).collect();
    if checkpoints.last() != Some(&turns) {
        checkpoints.push(turns);
    }
    let at = |xs: &[f64], c: usize| if xs.is_empty() { f64::NAN } else { median(&xs[c - window..c]) };
    let (first_latency, first_cpu) = (at(&latency, checkpoints[0]), at(&cpu, checkpoints[0]));
    let mut rows = Vec::new();
    let mut out = Vec::new();
    for &c in &checkpoints {
        let (l, p) = (at(&latency, c), at(&cpu, c));
        rows.push(vec![
            c.to_string(),
            f2(l),
            f2(l / first_latency),
            if cpu.is_empty() { "-".into() } else { f2(p) },
            if cpu.is_empty() { "-".into() } else { f2(p / first_cpu) },
        ]);
        out.push(json!({"turn": c, "latencyMsP50": l, "serverCpuMsP50": if cpu.is_empty() { Value::Null } else { json!(p) }}));
    }
    table(&["turn", "latency p50", "× first", "server CPU p50", "× first"], &rows);
    println!("(ms; each figure the median of the {window} turns that end at that turn)");
    Ok(json!({"scenario": "long-conversation", "turns": turns, "window": window, "checkpoints": out,
              "latencyMs": latency, "serverCpuMs": cpu}))
}

/// Shell commands run around each run of [`flow`], waited for (e.g. to zero and dump a profiler's
/// counts, so a count holds the runs and not the re-seeding between them).
#[derive(Debug, Default)]
pub struct Hooks {
    pub before_run: Option<String>,
    pub after_run: Option<String>,
}

impl Hooks {
    async fn run(&self, command: Option<&str>) -> Result<()> {
        let Some(command) = command else { return Ok(()) };
        let status = tokio::process::Command::new("sh").arg("-c").arg(command).status().await?;
        if !status.success() {
            bail!("`{command}` failed: {status}");
        }
        Ok(())
    }
}

/// The seeds' flow, `runs` times, one at a time: a message that makes the agent look something up
/// and then ask to act on it, approved, streamed to `done`. With `reset`, the demo is re-seeded
/// before each run (outside the measured time), so a small fleet has its abnormal instance again.
/// With `describe_fleet`, the fleet's size is read first (a count over the whole fleet).
pub async fn flow(
    client: &Client,
    runs: usize,
    content: &str,
    reset: bool,
    describe_fleet: bool,
    pid: Option<u32>,
    hooks: &Hooks,
) -> Result<Value> {
    let mut latency = Vec::with_capacity(runs);
    let mut cpu = Vec::with_capacity(runs);
    let mut fleet = Value::Null;
    for i in 0..runs {
        if reset {
            let answer = client.post("/v1/demo/reset").send().await?;
            if !answer.status().is_success() {
                bail!("POST /v1/demo/reset: {} (flow needs `keel demo`)", answer.status());
            }
            // let the WAL checkpointer (every 100 ms) copy the re-seeded rows before the clock starts
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        if i == 0 && describe_fleet {
            fleet = Client::json(client.get("/v1/demo/services")).await?;
        }
        hooks.run(hooks.before_run.as_deref()).await?;
        let conv = client.conversation().await?;
        let before = pid.map(cpu_ns).transpose()?;
        let t0 = Instant::now();
        let ran = send(client, &conv, content).await?;
        let Some(interrupt) = ran.interrupt_id else {
            bail!("run {} ended with {} before asking for an approval", ran.run_id, ran.last);
        };
        let end = approve(client, &ran.run_id, &interrupt).await?;
        let took = t0.elapsed();
        if end != "done" {
            bail!("run {} ended with {end}", ran.run_id);
        }
        let after = pid.map(cpu_ns).transpose()?;
        hooks.run(hooks.after_run.as_deref()).await?;
        latency.push(ms(took));
        if let (Some(b), Some(a)) = (before, after) {
            cpu.push((a - b) as f64 / 1e6);
        }
    }
    let instances: i64 = fleet.as_array().map(|s| s.iter().filter_map(|x| x["instances"].as_i64()).sum()).unwrap_or(0);
    let abnormal: i64 = fleet.as_array().map(|s| s.iter().filter_map(|x| x["abnormal"].as_i64()).sum()).unwrap_or(0);
    let cpu_p50 = if cpu.is_empty() { f64::NAN } else { median(&cpu) };
    table(
        &["runs", "instances", "abnormal", "run p50", "run p99", "server CPU p50"],
        &[vec![
            runs.to_string(),
            instances.to_string(),
            abnormal.to_string(),
            f2(median(&latency)),
            f2(percentile(&latency, 99.0)),
            if cpu.is_empty() { "-".into() } else { f2(cpu_p50) },
        ]],
    );
    println!("(ms per run: message sent → interrupt → approve → done; the server's CPU for it)");
    Ok(json!({"scenario": "flow", "content": content, "runs": runs, "instances": instances, "abnormal": abnormal,
              "runLatencyMsP50": median(&latency), "serverCpuMsP50": if cpu.is_empty() { Value::Null } else { json!(cpu_p50) },
              "latencyMs": latency, "serverCpuMs": cpu}))
}
