//! `keel-bench`: load and latency benchmarks of a running Keel server, over its public HTTP API
//! only (plus a raw SQLite storage floor that needs no server). See docs/benchmarks.md.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use clap::{Parser, Subcommand};
use futures::StreamExt;
use keel_client::{SseFrame, SseParser};
use serde_json::{json, Value};

mod growth;
mod spread;

#[derive(Parser, Debug)]
#[command(name = "keel-bench", about = "Benchmarks of a Keel server over its public HTTP API")]
struct Cli {
    /// The server's base URL.
    #[arg(long, default_value = "http://127.0.0.1:8090", global = true)]
    url: String,
    /// An API key of an operator (`keel users add bench --role operator`); none for a server
    /// without keys, whose local `demo` user is an operator. Read from the environment only.
    #[arg(skip = std::env::var("KEEL_API_KEY").ok())]
    api_key: Option<String>,
    /// Also write the results as JSON to this file.
    #[arg(long, global = true)]
    json: Option<String>,
    /// Repeat the whole scenario this many times; the table shows every repetition and the JSON
    /// holds them all (the docs quote the median).
    #[arg(long, default_value_t = 1, global = true)]
    repeat: usize,
    /// A new TCP connection for every request instead of a keep-alive pool. On a reused
    /// connection the first SSE frames after the response headers can wait for the client's
    /// delayed ACK (~40 ms on Linux) when the server does not set TCP_NODELAY; see docs/benchmarks.md.
    #[arg(long, global = true)]
    fresh_connections: bool,
    #[command(subcommand)]
    scenario: Scenario,
}

#[derive(Subcommand, Debug)]
enum Scenario {
    /// Full OpsPilot restart runs: message → stream to the interrupt → resume approve → stream to done.
    Hitl {
        /// Concurrency levels, comma-separated.
        #[arg(long, default_value = "1,8,32", value_delimiter = ',')]
        concurrency: Vec<usize>,
        /// Measured runs per concurrency level (after `concurrency` warm-up runs).
        #[arg(long, default_value_t = 1000)]
        runs: usize,
        /// Take the fleet's abnormal instances as they are, without re-seeding it first: the
        /// caller re-seeded it before it started counting the server's CPU, which the seeding
        /// (~10,000 rows) would otherwise be part of.
        #[arg(long)]
        keep_fleet: bool,
    },
    /// Many short demo-model runs (no approval), streamed to `done`: events/s.
    Stream {
        #[arg(long, default_value = "1,32", value_delimiter = ',')]
        concurrency: Vec<usize>,
        #[arg(long, default_value_t = 1000)]
        runs: usize,
        /// The message sent; the demo model answers it without a dangerous tool.
        #[arg(long, default_value = "Look at the recent errors of payment-api", conflicts_with = "words")]
        content: String,
        /// Ask the demo model for one long answer of this many words instead ("benchmark: stream N
        /// words", one chunk per word, at most 100,000; docs/models.md): one long stream. The words
        /// of one commit reach the client as one `text_delta`; the bench checks it got N words.
        #[arg(long)]
        words: Option<usize>,
    },
    /// Reconnect with `Last-Event-ID: 0` to finished runs and read all their events.
    Replay {
        #[arg(long, default_value = "1,32", value_delimiter = ',')]
        concurrency: Vec<usize>,
        /// How many finished runs to replay.
        #[arg(long, default_value_t = 1000)]
        runs: usize,
        /// Replay the runs listed in this `hitl --json` output; without it, the finished runs of
        /// the caller's conversations that `GET /v1/conversations` lists (the newest 100 or so).
        #[arg(long)]
        from: Option<String>,
    },
    /// N concurrent SSE subscribers on paused runs, with the server's RSS per stream.
    Idle {
        /// Number of idle streams.
        #[arg(long, default_value_t = 1000)]
        streams: usize,
        /// The server's pid, to read /proc/<pid>/status VmRSS before and after.
        #[arg(long)]
        server_pid: Option<u32>,
        /// How long to hold the streams open before reading the RSS again.
        #[arg(long, default_value_t = 3)]
        settle_secs: u64,
    },
    /// One conversation of many turns, one at a time: how a turn's latency and server CPU grow
    /// with the conversation's length (reported at turns 10, 100, 300, 1,000, …).
    LongConversation {
        #[arg(long, default_value_t = 1000)]
        turns: usize,
        /// The message of every turn (the default has the demo model call a tool, then answer).
        #[arg(long, default_value = "Look at the recent errors of payment-api")]
        content: String,
        /// Each checkpoint's figure is the median of this many turns ending there.
        #[arg(long, default_value_t = 10)]
        window: usize,
        /// The server's pid, to read its CPU time around each turn.
        #[arg(long)]
        server_pid: Option<u32>,
        /// Continue this conversation instead of starting one (its id is printed on stderr), e.g. to
        /// measure turns 1,001–1,020 alone under `callgrind_control -i on`.
        #[arg(long)]
        conversation: Option<String>,
    },
    /// The seeds' flow, one run at a time: a lookup tool, then an action that asks for approval,
    /// approved, to `done` (`keel demo`; size the fleet with --demo-abnormal / --demo-healthy).
    Flow {
        #[arg(long, default_value_t = 200)]
        runs: usize,
        #[arg(long, default_value = "Restart the abnormal instance of payment-api")]
        content: String,
        /// Re-seed the fleet before each run (not measured), so a small fleet is abnormal again.
        #[arg(long)]
        reset_each: bool,
        /// Do not read the fleet's size first (it counts every instance: leave it out of a count
        /// of the server's instructions).
        #[arg(long)]
        no_fleet_summary: bool,
        /// The server's pid, to read its CPU time around each run.
        #[arg(long)]
        server_pid: Option<u32>,
        /// A shell command run just before each run (after the re-seeding), waited for: e.g.
        /// `callgrind_control -z PID`, so a count holds the runs and not what lies between them.
        #[arg(long)]
        before_run: Option<String>,
        /// A shell command run just after each run ends, waited for: e.g.
        /// `sleep 0.3; callgrind_control -d PID`.
        #[arg(long)]
        after_run: Option<String>,
    },
    /// A burst of runs posted through this instance of several sharing a database; the share each
    /// instance ran (each run's `worker`).
    Spread {
        #[arg(long, default_value_t = 200)]
        runs: usize,
        /// Posts in flight at once.
        #[arg(long, default_value_t = 200)]
        concurrency: usize,
        /// The message sent; the demo model answers it without a dangerous tool.
        #[arg(long, default_value = "what can you do?")]
        content: String,
    },
    /// Storage floor: raw batched inserts of event-sized rows into SQLite (WAL, synchronous=NORMAL).
    FloorSqlite {
        #[arg(long, default_value_t = 200_000)]
        rows: usize,
        /// Rows per transaction, comma-separated.
        #[arg(long, default_value = "1,32", value_delimiter = ',')]
        batch: Vec<usize>,
        /// Directory for the throwaway database (default: the system temp dir).
        #[arg(long)]
        dir: Option<String>,
    },
    /// Storage floor: the same batched inserts into PostgreSQL, through the driver the server uses
    /// (a throwaway table in the given database, dropped afterwards).
    FloorPostgres {
        /// The database, e.g. postgres://postgres@127.0.0.1:5432/test.
        #[arg(long)]
        db: String,
        #[arg(long, default_value_t = 100_000)]
        rows: usize,
        /// Rows per transaction, comma-separated.
        #[arg(long, default_value = "1,32", value_delimiter = ',')]
        batch: Vec<usize>,
    },
}

#[tokio::main]
async fn main() -> Result<()> {
    let cli = Cli::parse();
    let client = Client::new(&cli.url, cli.api_key.as_deref(), cli.fresh_connections)?;
    let mut reps = Vec::new();
    for rep in 0..cli.repeat.max(1) {
        if cli.repeat > 1 {
            println!("== repetition {} of {}", rep + 1, cli.repeat);
        }
        let out = match &cli.scenario {
            Scenario::Hitl { concurrency, runs, keep_fleet } => hitl(&client, concurrency, *runs, !*keep_fleet).await?,
            Scenario::Stream { concurrency, runs, content, words } => {
                let content = match words {
                    Some(n) => format!("benchmark: stream {n} words"),
                    None => content.clone(),
                };
                stream(&client, concurrency, *runs, &content, *words).await?
            }
            Scenario::Replay { concurrency, runs, from } => {
                replay(&client, concurrency, *runs, from.as_deref()).await?
            }
            Scenario::Idle { streams, server_pid, settle_secs } => {
                idle(&client, *streams, *server_pid, *settle_secs).await?
            }
            Scenario::LongConversation { turns, content, window, server_pid, conversation } => {
                growth::long_conversation(&client, *turns, content, *window, *server_pid, conversation.as_deref())
                    .await?
            }
            Scenario::Flow { runs, content, reset_each, no_fleet_summary, server_pid, before_run, after_run } => {
                let hooks = growth::Hooks { before_run: before_run.clone(), after_run: after_run.clone() };
                growth::flow(&client, *runs, content, *reset_each, !*no_fleet_summary, *server_pid, &hooks).await?
            }
            Scenario::Spread { runs, concurrency, content } => {
                spread::spread(&client, *runs, *concurrency, content).await?
            }
            Scenario::FloorSqlite { rows, batch, dir } => floor_sqlite(*rows, batch, dir.as_deref())?,
            Scenario::FloorPostgres { db, rows, batch } => floor_postgres(db, *rows, batch).await?,
        };
        reps.push(out);
    }
    if let Some(path) = &cli.json {
        let doc = json!({
            "scenario": format!("{:?}", cli.scenario),
            "url": cli.url,
            "freshConnections": cli.fresh_connections,
            "repetitions": reps,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)?).with_context(|| format!("write {path}"))?;
        println!("wrote {path}");
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// HTTP + SSE

#[derive(Clone)]
struct Client {
    http: reqwest::Client,
    base: String,
    /// `Bearer <key>`, when there is a key.
    authorization: Option<String>,
}

impl Client {
    fn new(base: &str, api_key: Option<&str>, fresh_connections: bool) -> Result<Self> {
        let http = reqwest::Client::builder()
            .pool_max_idle_per_host(if fresh_connections { 0 } else { 1024 })
            .tcp_nodelay(true)
            .timeout(Duration::from_secs(600))
            .build()?;
        let authorization = api_key.map(|k| format!("Bearer {}", k.trim()));
        Ok(Self { http, base: base.trim_end_matches('/').to_owned(), authorization })
    }

    fn post(&self, path: &str) -> reqwest::RequestBuilder {
        self.authorize(self.http.post(format!("{}{}", self.base, path)))
    }

    fn get(&self, path: &str) -> reqwest::RequestBuilder {
        self.authorize(self.http.get(format!("{}{}", self.base, path)))
    }

    fn authorize(&self, request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.authorization {
            Some(value) => request.header(reqwest::header::AUTHORIZATION, value),
            None => request,
        }
    }

    async fn json(req: reqwest::RequestBuilder) -> Result<Value> {
        let resp = req.send().await?;
        let status = resp.status();
        let body = resp.text().await?;
        if !status.is_success() {
            bail!("{status}: {body}");
        }
        Ok(serde_json::from_str(&body)?)
    }

    async fn conversation(&self) -> Result<String> {
        let v = Self::json(self.post("/v1/conversations").json(&json!({"title": "keel-bench"}))).await?;
        str_field(&v, "id")
    }

    async fn sse(req: reqwest::RequestBuilder) -> Result<SseReader> {
        let resp = req.header("Accept", "text/event-stream").send().await?;
        let status = resp.status();
        if !status.is_success() {
            bail!("{status}: {}", resp.text().await.unwrap_or_default());
        }
        Ok(SseReader::new(resp))
    }

    /// The abnormal instances of the fleet (the server's `--demo-abnormal` sets how many), after
    /// re-seeding it (`reset`) where the server allows it (`keel demo`; `keel serve` answers 404).
    async fn abnormal_instances(&self, reset: bool) -> Result<Vec<String>> {
        if reset {
            let _ = self.post("/v1/demo/reset").send().await?;
        }
        let fleet = Self::json(self.get("/v1/demo/instances")).await?;
        let mut ids: Vec<String> = fleet
            .as_array()
            .ok_or_else(|| anyhow!("GET /v1/demo/instances: not a list"))?
            .iter()
            .filter(|i| i["status"] == "abnormal")
            .filter_map(|i| i["id"].as_str().map(str::to_owned))
            .collect();
        ids.sort();
        Ok(ids)
    }
}

fn str_field(v: &Value, key: &str) -> Result<String> {
    v[key].as_str().map(str::to_owned).ok_or_else(|| anyhow!("no string `{key}` in {v}"))
}

/// One received event: its type, sequence and raw JSON data (parsed only when asked).
struct Ev {
    ty: String,
    seq: u64,
    data: String,
}

impl Ev {
    fn parse(&self) -> Result<Value> {
        Ok(serde_json::from_str(&self.data)?)
    }
    fn terminal(&self) -> bool {
        matches!(self.ty.as_str(), "done" | "error" | "cancelled")
    }
}

struct SseReader {
    resp: reqwest::Response,
    parser: SseParser,
    queue: VecDeque<Ev>,
}

impl SseReader {
    fn new(resp: reqwest::Response) -> Self {
        Self { resp, parser: SseParser::new(), queue: VecDeque::new() }
    }

    /// The next event; `None` when the stream ends.
    async fn next(&mut self) -> Result<Option<Ev>> {
        loop {
            if let Some(ev) = self.queue.pop_front() {
                return Ok(Some(ev));
            }
            let Some(chunk) = self.resp.chunk().await? else { return Ok(None) };
            for frame in self.parser.push(&chunk) {
                if let SseFrame::Event { id, event, data } = frame {
                    let seq = id.as_deref().and_then(|s| s.parse().ok()).unwrap_or(0);
                    self.queue.push_back(Ev { ty: event.unwrap_or_default(), seq, data });
                }
            }
        }
    }

    async fn expect_next(&mut self) -> Result<Ev> {
        self.next().await?.ok_or_else(|| anyhow!("the stream ended early"))
    }
}

// ---------------------------------------------------------------------------------------------
// Statistics and output

#[derive(Default, Clone)]
struct Dist(Vec<f64>);

impl Dist {
    fn push(&mut self, d: Duration) {
        self.0.push(d.as_secs_f64() * 1000.0);
    }
    fn pct(&self, p: f64) -> f64 {
        percentile(&self.0, p)
    }
    fn json(&self) -> Value {
        json!({"n": self.0.len(), "p50Ms": self.pct(50.0), "p99Ms": self.pct(99.0),
               "meanMs": mean(&self.0), "maxMs": self.pct(100.0)})
    }
}

/// Nearest-rank percentile of `xs` (0 for none).
fn percentile(xs: &[f64], p: f64) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    let mut v = xs.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1]
}

fn mean(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        0.0
    } else {
        xs.iter().sum::<f64>() / xs.len() as f64
    }
}

fn table(header: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            widths[i] = widths[i].max(c.len());
        }
    }
    let line = |cells: Vec<String>| {
        let s: Vec<String> = cells.iter().enumerate().map(|(i, c)| format!("{:>w$}", c, w = widths[i])).collect();
        println!("| {} |", s.join(" | "));
    };
    line(header.iter().map(|s| s.to_string()).collect());
    println!("|{}|", widths.iter().map(|w| "-".repeat(w + 2)).collect::<Vec<_>>().join("|"));
    for r in rows {
        line(r.clone());
    }
}

fn f1(x: f64) -> String {
    format!("{x:.1}")
}
fn f2(x: f64) -> String {
    format!("{x:.2}")
}

/// Runs `f(0..n)` with at most `concurrency` in flight; the results in completion order.
async fn drive<F, Fut, T>(n: usize, concurrency: usize, f: F) -> Vec<Result<T>>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    futures::stream::iter(0..n).map(f).buffer_unordered(concurrency.max(1)).collect().await
}

fn split_errors<T>(results: Vec<Result<T>>) -> (Vec<T>, Vec<String>) {
    let mut ok = Vec::new();
    let mut errors = Vec::new();
    for r in results {
        match r {
            Ok(t) => ok.push(t),
            Err(e) => errors.push(format!("{e:#}")),
        }
    }
    if let Some(first) = errors.first() {
        eprintln!("{} failed; first error: {first}", errors.len());
    }
    (ok, errors)
}

// ---------------------------------------------------------------------------------------------
// hitl

struct HitlSample {
    run_id: String,
    ttfe: Duration,
    resume_ttfe: Duration,
    total: Duration,
    events: u64,
    last_seq: u64,
}

async fn hitl_run(client: &Client, instance: &str) -> Result<HitlSample> {
    let conv = client.conversation().await?;
    let t0 = Instant::now();
    let mut s = Client::sse(
        client
            .post(&format!("/v1/conversations/{conv}/messages"))
            .json(&json!({"content": format!("restart {instance}")})),
    )
    .await?;
    let first = s.expect_next().await?;
    let ttfe = t0.elapsed();
    let run_id = str_field(&first.parse()?, "runId")?;
    let mut events = 1;
    let interrupt = loop {
        let ev = s.expect_next().await?;
        events += 1;
        if ev.ty == "interrupt" {
            break str_field(&ev.parse()?, "interruptId")?;
        }
        if ev.terminal() {
            bail!("run {run_id} ended with {} before its interrupt: {}", ev.ty, ev.data);
        }
    };
    drop(s);
    let t1 = Instant::now();
    let mut s = Client::sse(client.post(&format!("/v1/runs/{run_id}/resume")).json(&json!({
        "interruptId": interrupt, "decision": "approve", "idempotencyKey": format!("bench-{interrupt}")
    })))
    .await?;
    let mut ev = s.expect_next().await?;
    let resume_ttfe = t1.elapsed();
    events += 1;
    while !ev.terminal() {
        ev = s.expect_next().await?;
        events += 1;
    }
    if ev.ty != "done" {
        bail!("run {run_id} ended with {}: {}", ev.ty, ev.data);
    }
    Ok(HitlSample { run_id, ttfe, resume_ttfe, total: t0.elapsed(), events, last_seq: ev.seq })
}

async fn hitl(client: &Client, levels: &[usize], runs: usize, reset: bool) -> Result<Value> {
    let instances = Arc::new(client.abnormal_instances(reset).await?);
    let next = Arc::new(AtomicUsize::new(0));
    let capacity = instances.len();
    let needed: usize = levels.iter().map(|c| runs + c).sum();
    if needed > capacity {
        bail!("{needed} runs need as many abnormal instances; the fleet has {capacity} (raise the server's --demo-abnormal, or restart it)");
    }
    let mut rows = Vec::new();
    let mut out = Vec::new();
    for &c in levels {
        let one = |_| {
            let client = client.clone();
            let next = next.clone();
            let instances = instances.clone();
            async move { hitl_run(&client, &instances[next.fetch_add(1, Ordering::Relaxed)]).await }
        };
        // warm-up: one run per connection
        let (_, _) = split_errors(drive(c, c, one).await);
        let start = Instant::now();
        let results = drive(runs, c, one).await;
        let wall = start.elapsed();
        let (ok, errors) = split_errors(results);
        let (mut ttfe, mut rttfe, mut total) = (Dist::default(), Dist::default(), Dist::default());
        let mut seqs = Vec::new();
        let mut received = 0;
        for s in &ok {
            ttfe.push(s.ttfe);
            rttfe.push(s.resume_ttfe);
            total.push(s.total);
            seqs.push(s.last_seq as f64);
            received += s.events;
        }
        let rate = ok.len() as f64 / wall.as_secs_f64();
        rows.push(vec![
            c.to_string(),
            ok.len().to_string(),
            errors.len().to_string(),
            f1(rate),
            f2(ttfe.pct(50.0)),
            f2(ttfe.pct(99.0)),
            f2(rttfe.pct(50.0)),
            f2(rttfe.pct(99.0)),
            f2(total.pct(50.0)),
            f2(total.pct(99.0)),
            f1(mean(&seqs)),
        ]);
        out.push(json!({
            "concurrency": c, "completed": ok.len(), "failed": errors.len(), "wallSecs": wall.as_secs_f64(),
            "runsPerSec": rate, "timeToFirstEvent": ttfe.json(), "resumeToFirstEvent": rttfe.json(),
            "runLatency": total.json(), "storedEventsPerRun": mean(&seqs),
            "eventsReceived": received, "eventsPerSec": received as f64 / wall.as_secs_f64(),
            "firstErrors": errors.iter().take(3).collect::<Vec<_>>(),
            "runIds": ok.iter().map(|s| s.run_id.as_str()).collect::<Vec<_>>(),
        }));
    }
    table(
        &[
            "conc",
            "ok",
            "failed",
            "runs/s",
            "ttfe p50",
            "ttfe p99",
            "resume p50",
            "resume p99",
            "run p50",
            "run p99",
            "events/run",
        ],
        &rows,
    );
    println!(
        "(times in ms; ttfe: request sent → first event of the message stream; resume: resume sent → its first event)"
    );
    Ok(json!({"scenario": "hitl", "levels": out}))
}

// ---------------------------------------------------------------------------------------------
// stream

struct StreamSample {
    events: u64,
    deltas: u64,
    total: Duration,
    /// first event → terminal event
    streaming: Duration,
    /// Per event: its `ts` (the time its commit was made) → received here.
    commit_to_client: Dist,
}

/// The commit time of an event (its `ts`, the envelope's last field, docs/events.md) → now, read
/// without parsing the whole event: at a hundred thousand events a second the load generator must
/// stay cheap.
fn since_commit(data: &str) -> Result<Duration> {
    let start = data.rfind("\"ts\":\"").ok_or_else(|| anyhow!("an event without ts: {data}"))? + 6;
    let end = data[start..].find('"').ok_or_else(|| anyhow!("an event with a cut ts: {data}"))? + start;
    let ts = chrono::DateTime::parse_from_rfc3339(&data[start..end]).context("an event's ts")?;
    // Client and server share the machine's clock; a negative gap would be clock trouble, shown as 0.
    Ok((chrono::Utc::now() - ts.with_timezone(&chrono::Utc)).to_std().unwrap_or_default())
}

async fn stream_run(client: &Client, content: &str, words: Option<usize>) -> Result<StreamSample> {
    let conv = client.conversation().await?;
    let t0 = Instant::now();
    let mut s =
        Client::sse(client.post(&format!("/v1/conversations/{conv}/messages")).json(&json!({"content": content})))
            .await?;
    let mut ev = s.expect_next().await?;
    let t1 = Instant::now();
    let mut commit_to_client = Dist::default();
    commit_to_client.push(since_commit(&ev.data)?);
    let (mut events, mut deltas, mut streamed_words) = (1, 0, 0usize);
    while !ev.terminal() {
        if ev.ty == "interrupt" {
            bail!("the run paused for approval: use a message the demo model answers without one");
        }
        ev = s.expect_next().await?;
        commit_to_client.push(since_commit(&ev.data)?);
        events += 1;
        if ev.ty == "text_delta" {
            deltas += 1;
            streamed_words += str_field(&ev.parse()?, "delta")?.split_whitespace().count();
        }
    }
    // The deltas of one commit come as one event: the words are counted, not the events.
    if let Some(words) = words {
        if streamed_words != words {
            bail!("asked for {words} words, got {streamed_words} in {deltas} text_delta events (a server with another model?)");
        }
    }
    Ok(StreamSample { events, deltas, total: t0.elapsed(), streaming: t1.elapsed(), commit_to_client })
}

async fn stream(client: &Client, levels: &[usize], runs: usize, content: &str, words: Option<usize>) -> Result<Value> {
    let mut rows = Vec::new();
    let mut out = Vec::new();
    for &c in levels {
        let one = |_| {
            let client = client.clone();
            async move { stream_run(&client, content, words).await }
        };
        let _ = split_errors(drive(c, c, one).await);
        let start = Instant::now();
        let (ok, errors) = split_errors(drive(runs, c, one).await);
        let wall = start.elapsed();
        let events: u64 = ok.iter().map(|s| s.events).sum();
        let deltas: u64 = ok.iter().map(|s| s.deltas).sum();
        let per_stream: Vec<f64> =
            ok.iter().map(|s| s.events.saturating_sub(1) as f64 / s.streaming.as_secs_f64().max(1e-9)).collect();
        let mut total = Dist::default();
        ok.iter().for_each(|s| total.push(s.total));
        let mut lag = Dist::default();
        ok.iter().for_each(|s| lag.0.extend_from_slice(&s.commit_to_client.0));
        let agg = events as f64 / wall.as_secs_f64();
        let epr = events as f64 / ok.len().max(1) as f64;
        rows.push(vec![
            c.to_string(),
            ok.len().to_string(),
            errors.len().to_string(),
            f1(epr),
            f1(agg),
            f1(percentile(&per_stream, 50.0)),
            f2(lag.pct(50.0)),
            f2(lag.pct(99.0)),
            f2(total.pct(50.0)),
            f2(total.pct(99.0)),
        ]);
        out.push(json!({
            "concurrency": c, "completed": ok.len(), "failed": errors.len(), "wallSecs": wall.as_secs_f64(),
            "eventsPerRun": epr, "textDeltasPerRun": deltas as f64 / ok.len().max(1) as f64,
            "aggregateEventsPerSec": agg, "perStreamEventsPerSecP50": percentile(&per_stream, 50.0),
            "perStreamEventsPerSec": per_stream, "commitToClient": lag.json(),
            "runLatency": total.json(), "firstErrors": errors.iter().take(3).collect::<Vec<_>>(),
        }));
    }
    table(
        &[
            "conc",
            "ok",
            "failed",
            "events/run",
            "events/s (all)",
            "events/s (1 stream, p50)",
            "commit→client p50",
            "commit→client p99",
            "run p50",
            "run p99",
        ],
        &rows,
    );
    println!(
        "(events/s (1 stream): one run's events after its first ÷ first → last event; commit→client: an \
         event's ts → received, over every event; times in ms)"
    );
    Ok(json!({"scenario": "stream", "content": content, "levels": out}))
}

// ---------------------------------------------------------------------------------------------
// replay

/// Finished runs of the caller, discovered from its conversations' messages.
async fn finished_runs(client: &Client, limit: usize) -> Result<Vec<String>> {
    let list = Client::json(client.get("/v1/conversations")).await?;
    let ids: Vec<String> = list["conversations"]
        .as_array()
        .ok_or_else(|| anyhow!("no conversations in {list}"))?
        .iter()
        .filter(|c| c["activeRunId"].is_null())
        .filter_map(|c| c["id"].as_str().map(str::to_owned))
        .take(limit)
        .collect();
    let found = drive(ids.len(), 16, |i| {
        let client = client.clone();
        let id = ids[i].clone();
        async move {
            let conv = Client::json(client.get(&format!("/v1/conversations/{id}"))).await?;
            let mut runs: Vec<String> = conv["messages"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|m| m["runId"].as_str().map(str::to_owned))
                .collect();
            runs.dedup();
            Ok(runs)
        }
    })
    .await;
    let (lists, _) = split_errors(found);
    let mut runs: Vec<String> = lists.into_iter().flatten().collect();
    runs.sort();
    runs.dedup();
    runs.truncate(limit);
    Ok(runs)
}

fn runs_from(path: &str, limit: usize) -> Result<Vec<String>> {
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(path).with_context(|| format!("read {path}"))?)?;
    let mut runs = Vec::new();
    for rep in doc["repetitions"].as_array().into_iter().flatten() {
        for level in rep["levels"].as_array().into_iter().flatten() {
            runs.extend(level["runIds"].as_array().into_iter().flatten().filter_map(|r| r.as_str().map(str::to_owned)));
        }
    }
    runs.truncate(limit);
    Ok(runs)
}

async fn replay(client: &Client, levels: &[usize], limit: usize, from: Option<&str>) -> Result<Value> {
    let runs = Arc::new(match from {
        Some(path) => runs_from(path, limit)?,
        None => finished_runs(client, limit).await?,
    });
    if runs.is_empty() {
        bail!("no finished run to replay: run the hitl scenario first");
    }
    println!("replaying {} finished runs", runs.len());
    let mut rows = Vec::new();
    let mut out = Vec::new();
    for &c in levels {
        let one = |i: usize| {
            let client = client.clone();
            let run = runs[i].clone();
            async move {
                let t0 = Instant::now();
                let mut s =
                    Client::sse(client.get(&format!("/v1/runs/{run}/events")).header("Last-Event-ID", "0")).await?;
                let mut n = 0u64;
                loop {
                    let ev = s.expect_next().await?;
                    n += 1;
                    if ev.terminal() {
                        return Ok((n, t0.elapsed()));
                    }
                }
            }
        };
        let start = Instant::now();
        let (ok, errors) = split_errors(drive(runs.len(), c, one).await);
        let wall = start.elapsed();
        let events: u64 = ok.iter().map(|s| s.0).sum();
        let mut catch = Dist::default();
        ok.iter().for_each(|s| catch.push(s.1));
        let per_stream: Vec<f64> = ok.iter().map(|s| s.0 as f64 / s.1.as_secs_f64().max(1e-9)).collect();
        let agg = events as f64 / wall.as_secs_f64();
        rows.push(vec![
            c.to_string(),
            ok.len().to_string(),
            errors.len().to_string(),
            f1(events as f64 / ok.len().max(1) as f64),
            f1(agg),
            f1(percentile(&per_stream, 50.0)),
            f2(catch.pct(50.0)),
            f2(catch.pct(99.0)),
        ]);
        out.push(json!({
            "concurrency": c, "replayed": ok.len(), "failed": errors.len(), "wallSecs": wall.as_secs_f64(),
            "eventsPerReplay": events as f64 / ok.len().max(1) as f64, "aggregateEventsPerSec": agg,
            "perStreamEventsPerSecP50": percentile(&per_stream, 50.0), "catchUp": catch.json(),
        }));
    }
    table(
        &[
            "conc",
            "ok",
            "failed",
            "events/run",
            "events/s (all)",
            "events/s (1 stream, p50)",
            "catch-up p50",
            "catch-up p99",
        ],
        &rows,
    );
    println!("(catch-up: GET sent with Last-Event-ID: 0 → terminal event received, ms)");
    Ok(json!({"scenario": "replay", "levels": out}))
}

// ---------------------------------------------------------------------------------------------
// idle

fn vm_rss_kib(pid: u32) -> Result<u64> {
    let status =
        std::fs::read_to_string(format!("/proc/{pid}/status")).with_context(|| format!("read /proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .ok_or_else(|| anyhow!("no VmRSS in /proc/{pid}/status"))
}

async fn idle(client: &Client, streams: usize, pid: Option<u32>, settle: u64) -> Result<Value> {
    let instances = client.abnormal_instances(true).await?;
    if streams > instances.len() {
        bail!("{streams} paused runs need as many abnormal instances; the fleet has {}", instances.len());
    }
    // The last ones: the hitl scenario restarts from the first.
    let instances = Arc::new(instances[instances.len() - streams..].to_vec());
    let made = Instant::now();
    let paused = drive(streams, 32, |i| {
        let client = client.clone();
        let instances = instances.clone();
        async move {
            let conv = client.conversation().await?;
            let v = Client::json(
                client
                    .post(&format!("/v1/conversations/{conv}/messages?wait=true"))
                    .json(&json!({"content": format!("restart {}", instances[i])})),
            )
            .await?;
            let run = &v["run"];
            if run["status"] != "interrupted" {
                bail!("the run did not pause: {v}");
            }
            Ok((str_field(run, "id")?, run["lastSequence"].as_u64().unwrap_or(0)))
        }
    })
    .await;
    let (paused, errors) = split_errors(paused);
    if !errors.is_empty() {
        bail!("{} runs did not pause", errors.len());
    }
    println!("{} paused runs in {:.1}s", paused.len(), made.elapsed().as_secs_f64());
    tokio::time::sleep(Duration::from_secs(1)).await;
    let before = pid.map(vm_rss_kib).transpose()?;
    let alive = Arc::new(AtomicU64::new(0));
    let opened = Instant::now();
    // Each stream starts after the run's last stored event, so the server has nothing to replay:
    // it holds a live subscription. The response headers mean the stream is set up.
    let holders = drive(paused.len(), 256, |i| {
        let client = client.clone();
        let (run, last) = paused[i].clone();
        let alive = alive.clone();
        async move {
            let resp = client
                .get(&format!("/v1/runs/{run}/events"))
                .header("Accept", "text/event-stream")
                .header("Last-Event-ID", last.to_string())
                .send()
                .await?;
            if !resp.status().is_success() {
                bail!("{}: {}", resp.status(), resp.text().await.unwrap_or_default());
            }
            alive.fetch_add(1, Ordering::Relaxed);
            let alive = alive.clone();
            Ok(tokio::spawn(async move {
                let mut body = resp.bytes_stream();
                while let Some(Ok(_)) = body.next().await {}
                alive.fetch_sub(1, Ordering::Relaxed);
            }))
        }
    })
    .await;
    let (holders, errors) = split_errors(holders);
    let open_secs = opened.elapsed().as_secs_f64();
    tokio::time::sleep(Duration::from_secs(settle)).await;
    let after = pid.map(vm_rss_kib).transpose()?;
    let open = alive.load(Ordering::Relaxed);
    let per_stream = match (before, after) {
        (Some(b), Some(a)) if open > 0 => Some((a as f64 - b as f64) * 1024.0 / open as f64),
        _ => None,
    };
    for h in &holders {
        h.abort();
    }
    let rows = vec![vec![
        streams.to_string(),
        open.to_string(),
        errors.len().to_string(),
        f2(open_secs),
        before.map(|b| format!("{:.1}", b as f64 / 1024.0)).unwrap_or_else(|| "-".into()),
        after.map(|a| format!("{:.1}", a as f64 / 1024.0)).unwrap_or_else(|| "-".into()),
        per_stream.map(|p| format!("{:.1}", p / 1024.0)).unwrap_or_else(|| "-".into()),
    ]];
    table(&["streams", "open", "failed", "open secs", "RSS before MiB", "RSS after MiB", "KiB/stream"], &rows);
    Ok(json!({
        "scenario": "idle", "streams": streams, "open": open, "failed": errors.len(), "openSecs": open_secs,
        "rssBeforeKiB": before, "rssAfterKiB": after, "bytesPerStream": per_stream,
        "firstErrors": errors.iter().take(3).collect::<Vec<_>>(),
    }))
}

// ---------------------------------------------------------------------------------------------
// floor-sqlite

/// A text_delta-sized event, as the server stores it.
fn floor_row() -> String {
    json!({"type": "text_delta", "messageId": "msg_0193a1b2c3d4e5f60718293a4b5c6d7e",
        "delta": "restart ", "runId": "run_0193a1b2c3d4e5f60718293a4b5c6d7e", "sequence": 12,
        "ts": "2026-12-01T10:00:00.123456Z"})
    .to_string()
}

/// Rows per multi-row `INSERT`, as the server writes a commit's events.
const FLOOR_ROWS_PER_INSERT: usize = 64;

/// The (run id, sequence) of the `n`th floor row: 30 events per run, like a HITL run.
fn floor_key(n: usize) -> (String, i64) {
    (format!("run_{:032}", n / 30), (n % 30 + 1) as i64)
}

struct FloorLevel {
    batch: usize,
    rows: usize,
    secs: f64,
    transactions: usize,
}

fn floor_report(name: &str, setup: String, row_bytes: usize, levels: &[FloorLevel]) -> Value {
    let table_rows: Vec<Vec<String>> = levels
        .iter()
        .map(|l| {
            vec![
                l.batch.to_string(),
                l.rows.to_string(),
                f2(l.secs),
                f1(l.rows as f64 / l.secs),
                f1(l.transactions as f64 / l.secs),
            ]
        })
        .collect();
    table(&["rows/tx", "rows", "secs", "rows/s", "tx/s"], &table_rows);
    println!("({setup}, {row_bytes}-byte JSON rows, multi-row INSERTs of up to {FLOOR_ROWS_PER_INSERT} rows)");
    let out: Vec<Value> = levels
        .iter()
        .map(|l| {
            json!({"rowsPerTx": l.batch, "rows": l.rows, "secs": l.secs, "rowsPerSec": l.rows as f64 / l.secs,
                   "txPerSec": l.transactions as f64 / l.secs, "rowBytes": row_bytes})
        })
        .collect();
    json!({"scenario": name, "setup": setup, "levels": out})
}

/// The server's SQLite setup (WAL, synchronous=NORMAL, one writing connection, the `run_events`
/// table as the migration makes it), driven directly on this thread: what SQLite itself allows.
fn floor_sqlite(rows: usize, batches: &[usize], dir: Option<&str>) -> Result<Value> {
    let dir = dir.map(std::path::PathBuf::from).unwrap_or_else(std::env::temp_dir);
    let data = floor_row();
    let mut levels = Vec::new();
    for &batch in batches {
        let batch = batch.max(1);
        let path = dir.join(format!("keel-bench-floor-{}-{batch}.db", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let conn = rusqlite::Connection::open(&path)?;
        let _: String = conn.query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))?;
        conn.execute_batch(
            "PRAGMA synchronous = NORMAL; \
             CREATE TABLE run_events (run_id TEXT NOT NULL, sequence INTEGER NOT NULL CHECK (sequence >= 1), \
             type TEXT NOT NULL, data TEXT NOT NULL CHECK (json_valid(data)), created_at TEXT NOT NULL, \
             PRIMARY KEY (run_id, sequence)) WITHOUT ROWID",
        )?;
        let start = Instant::now();
        let (mut written, mut transactions) = (0, 0);
        while written < rows {
            conn.execute_batch("BEGIN IMMEDIATE")?;
            let mut left = batch.min(rows - written);
            while left > 0 {
                let n = left.min(FLOOR_ROWS_PER_INSERT);
                let sql = format!(
                    "INSERT INTO run_events (run_id, sequence, type, data, created_at) VALUES {}",
                    vec!["(?, ?, 'text_delta', ?, '2026-12-01T10:00:00.123456000Z')"; n].join(", ")
                );
                let keys: Vec<(String, i64)> = (written..written + n).map(floor_key).collect();
                let mut values: Vec<&dyn rusqlite::ToSql> = Vec::with_capacity(n * 3);
                for (run, sequence) in &keys {
                    values.extend([run as &dyn rusqlite::ToSql, sequence, &data]);
                }
                conn.prepare_cached(&sql)?.execute(values.as_slice())?;
                written += n;
                left -= n;
            }
            conn.execute_batch("COMMIT")?;
            transactions += 1;
        }
        levels.push(FloorLevel { batch, rows, secs: start.elapsed().as_secs_f64(), transactions });
        drop(conn);
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
        }
    }
    let setup = format!("SQLite {} WAL, synchronous=NORMAL, one connection, in {}", rusqlite::version(), dir.display());
    Ok(floor_report("floor-sqlite", setup, data.len(), &levels))
}

/// The same inserts into PostgreSQL over one sqlx connection (the server's driver), in a throwaway
/// table shaped like `run_events`.
async fn floor_postgres(url: &str, rows: usize, batches: &[usize]) -> Result<Value> {
    use sqlx::Connection;
    let data = floor_row();
    let mut conn = sqlx::PgConnection::connect(url).await?;
    let table = format!("keel_bench_floor_{}", std::process::id());
    let mut levels = Vec::new();
    for &batch in batches {
        let batch = batch.max(1);
        sqlx::query(&format!("DROP TABLE IF EXISTS {table}")).execute(&mut conn).await?;
        sqlx::query(&format!(
            "CREATE TABLE {table} (run_id TEXT NOT NULL, sequence BIGINT NOT NULL CHECK (sequence >= 1), \
             type TEXT NOT NULL, data JSONB NOT NULL, created_at TIMESTAMPTZ NOT NULL, \
             PRIMARY KEY (run_id, sequence))"
        ))
        .execute(&mut conn)
        .await?;
        let start = Instant::now();
        let (mut written, mut transactions) = (0, 0);
        while written < rows {
            let mut tx = conn.begin().await?;
            let mut left = batch.min(rows - written);
            while left > 0 {
                let n = left.min(FLOOR_ROWS_PER_INSERT);
                let values: Vec<String> = (0..n)
                    .map(|i| format!("(${}, ${}, 'text_delta', ${}::jsonb, now())", 3 * i + 1, 3 * i + 2, 3 * i + 3))
                    .collect();
                let sql = format!(
                    "INSERT INTO {table} (run_id, sequence, type, data, created_at) VALUES {}",
                    values.join(", ")
                );
                let mut query = sqlx::query(&sql);
                for (run, sequence) in (written..written + n).map(floor_key) {
                    query = query.bind(run).bind(sequence).bind(&data);
                }
                query.execute(&mut *tx).await?;
                written += n;
                left -= n;
            }
            tx.commit().await?;
            transactions += 1;
        }
        levels.push(FloorLevel { batch, rows, secs: start.elapsed().as_secs_f64(), transactions });
    }
    sqlx::query(&format!("DROP TABLE IF EXISTS {table}")).execute(&mut conn).await?;
    let version: String = sqlx::query_scalar("SHOW server_version").fetch_one(&mut conn).await?;
    let commit: String = sqlx::query_scalar("SHOW synchronous_commit").fetch_one(&mut conn).await?;
    conn.close().await?;
    let setup = format!("PostgreSQL {version}, synchronous_commit={commit}, one sqlx connection");
    Ok(floor_report("floor-postgres", setup, data.len(), &levels))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let xs: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&xs, 50.0), 50.0);
        assert_eq!(percentile(&xs, 99.0), 99.0);
        assert_eq!(percentile(&xs, 100.0), 100.0);
        assert_eq!(percentile(&[], 50.0), 0.0);
    }
}
