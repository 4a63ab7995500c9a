//! `spread`: a burst of runs posted through one instance of several that share a database, and the
//! share of them each instance ran (each run's `worker`, from `GET /v1/runs/{id}`). With
//! `--max-concurrent-runs` below the burst, the instance that received it runs what it has slots
//! for and the others claim the rest.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use futures::StreamExt;
use serde_json::{json, Value};

use crate::{f1, str_field, table, Client};

/// Posts `runs` runs (each in a conversation of its own, `concurrency` posts at a time) through
/// `client`, waits until every one ended, and counts them by worker.
pub async fn spread(client: &Client, runs: usize, concurrency: usize, content: &str) -> Result<Value> {
    let start = Instant::now();
    let posted: Vec<Result<String>> = futures::stream::iter(0..runs)
        .map(|_| {
            let client = client.clone();
            async move {
                let conv = client.conversation().await?;
                let sent = Client::json(
                    client.post(&format!("/v1/conversations/{conv}/messages")).json(&json!({"content": content})),
                )
                .await?;
                str_field(&sent, "runId")
            }
        })
        .buffer_unordered(concurrency.max(1))
        .collect()
        .await;
    let ids: Vec<String> = posted.into_iter().collect::<Result<_>>()?;
    let posted_in = start.elapsed();

    // Every run's worker once it ended (a queued or running run is asked again).
    let deadline = Instant::now() + Duration::from_secs(600);
    let mut workers: BTreeMap<String, usize> = BTreeMap::new();
    let mut statuses: BTreeMap<String, usize> = BTreeMap::new();
    let mut pending = ids;
    while !pending.is_empty() {
        if Instant::now() > deadline {
            bail!("{} runs had not ended after 10 minutes", pending.len());
        }
        let mut still = Vec::new();
        for id in pending {
            let run = Client::json(client.get(&format!("/v1/runs/{id}"))).await?;
            match run["status"].as_str().unwrap_or_default() {
                "queued" | "running" => still.push(id),
                status => {
                    *statuses.entry(status.to_owned()).or_default() += 1;
                    let worker = run["worker"].as_str().unwrap_or("(none)").to_owned();
                    *workers.entry(worker).or_default() += 1;
                }
            }
        }
        pending = still;
        if !pending.is_empty() {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    let wall = start.elapsed();
    let share = |n: usize| 100.0 * n as f64 / runs.max(1) as f64;
    let rows: Vec<Vec<String>> =
        workers.iter().map(|(w, n)| vec![w.clone(), n.to_string(), format!("{}%", f1(share(*n)))]).collect();
    table(&["worker", "runs", "share"], &rows);
    println!(
        "({runs} runs posted through {} in {:.2} s, all ended after {:.2} s; by status: {statuses:?})",
        client.base,
        posted_in.as_secs_f64(),
        wall.as_secs_f64()
    );
    Ok(json!({
        "runs": runs,
        "concurrency": concurrency,
        "postedSecs": posted_in.as_secs_f64(),
        "wallSecs": wall.as_secs_f64(),
        "byStatus": statuses,
        "byWorker": workers,
        "sharePercent": workers.iter().map(|(w, n)| (w.clone(), share(*n))).collect::<BTreeMap<_, _>>(),
    }))
}
