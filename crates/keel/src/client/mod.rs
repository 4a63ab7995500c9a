//! The terminal client: `keel chat` and `keel runs list|show|watch`, on `keel-client`.
//!
//! The server comes from `--server` (or `KEEL_SERVER`); the API key only from `KEEL_API_KEY`, never
//! from a flag, so it stays out of shell history and `ps`.

mod chat;
mod runs;
mod term;

use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Subcommand};
use futures::StreamExt;
use keel_client::{decision, KeelClient};
use keel_core::{EventKind, InterruptId, InterruptKind, RunId, RunStatus, Timestamp};
use serde_json::Value;

use term::{Answer, Input, OutcomeAnswer, Renderer};

/// Where the server is.
#[derive(Debug, Clone, Args)]
pub struct ServerArgs {
    /// The Keel server. The API key, if it needs one, comes from KEEL_API_KEY.
    #[arg(long, env = "KEEL_SERVER", value_name = "URL", default_value = "http://127.0.0.1:8080")]
    pub server: String,
}

#[derive(Debug, Clone, Args)]
pub struct ChatArgs {
    #[command(flatten)]
    pub server: ServerArgs,
    /// Continue this conversation instead of starting a new one.
    #[arg(long, value_name = "CONV_ID")]
    pub conversation: Option<String>,
    /// Start the new conversation with this agent (one of `GET /v1/agents`) instead of the
    /// server's default one.
    #[arg(long, value_name = "ID", conflicts_with = "conversation")]
    pub agent: Option<String>,
}

#[derive(Debug, Clone, Subcommand)]
pub enum RunsCommand {
    /// Your runs, newest first.
    List {
        #[command(flatten)]
        server: ServerArgs,
        /// Only runs with this status (waiting, queued, running, interrupted, completed, failed, cancelled,
        /// rolled_back).
        #[arg(long)]
        status: Option<String>,
        /// At most this many (1 to 100).
        #[arg(long, default_value_t = 20)]
        limit: u32,
    },
    /// A run's history: its tool calls, and who decided each interrupt, and when.
    Show {
        #[command(flatten)]
        server: ServerArgs,
        run_id: String,
    },
    /// Reattach to a run: replay its events from the start, then follow it live to its end (and
    /// answer its question, if it waits for one).
    Watch {
        #[command(flatten)]
        server: ServerArgs,
        run_id: String,
    },
}

/// Runs a client command; the exit code is 130 when the user detached with Ctrl-C.
pub fn chat(args: ChatArgs) -> ExitCode {
    block_on(chat::run(args))
}

pub fn runs(command: RunsCommand) -> ExitCode {
    block_on(runs::run(command))
}

fn block_on(work: impl std::future::Future<Output = anyhow::Result<Exit>>) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("keel: starting the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(work);
    // The stdin thread may be blocked in a read: don't wait for it.
    runtime.shutdown_background();
    match result {
        Ok(Exit::Done) => ExitCode::SUCCESS,
        Ok(Exit::Detached) => ExitCode::from(130),
        Err(e) => {
            eprintln!("keel: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Exit {
    Done,
    Detached,
}

fn connect(args: &ServerArgs) -> anyhow::Result<KeelClient> {
    if !(args.server.starts_with("http://") || args.server.starts_with("https://")) {
        anyhow::bail!("--server: expected an http:// or https:// URL, got `{}`", args.server);
    }
    let client = KeelClient::new(&args.server);
    match std::env::var("KEEL_API_KEY") {
        Ok(key) if !key.trim().is_empty() => client.with_api_key(&key).context("KEEL_API_KEY"),
        _ => Ok(client),
    }
}

fn parse_run_id(raw: &str) -> anyhow::Result<RunId> {
    RunId::parse(raw).map_err(|_| anyhow::anyhow!("`{raw}` is not a run id (run_…)"))
}

/// How a followed run left the terminal.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Followed {
    /// Its terminal event was shown.
    Ended(RunStatus),
    /// The user pressed Ctrl-C (or closed stdin at a question): the run goes on without us.
    Detached,
    /// The run waits for a decision the user left for later (or that this client cannot take).
    Undecided,
}

/// Shows the run's events after `after` as they come, until its terminal event; asks the user when
/// it waits for a decision that is still open, and resumes it with the answer.
async fn follow(
    keel: &KeelClient,
    run_id: &RunId,
    after: i64,
    input: &mut Input,
    out: &mut Renderer,
) -> anyhow::Result<Followed> {
    let mut events = keel.events(run_id, after);
    let mut spinner = tokio::time::interval(std::time::Duration::from_millis(100));
    loop {
        let event = tokio::select! {
            event = events.next() => event,
            _ = spinner.tick(), if out.is_spinning() => {
                out.tick();
                continue;
            }
            () = input.ctrl_c() => return Ok(Followed::Detached),
        };
        let Some(event) = event else {
            anyhow::bail!("the event stream of {run_id} ended before the run did");
        };
        let event = event.with_context(|| format!("following run {run_id}"))?;
        out.event(&event.kind);
        match &event.kind {
            EventKind::Interrupt { interrupt_id, kind, payload, expires_at } => {
                // A replay shows decisions taken long ago: ask only while this one is still open.
                let run = keel.get_run(run_id).await?;
                let open = run.pending_interrupt.as_ref().map(|i| &i.id) == Some(interrupt_id);
                if !open {
                    continue;
                }
                let question = Question { run_id, interrupt_id, kind: *kind, payload };
                match ask(keel, &question, input, out).await? {
                    Asked::Answered => {}
                    Asked::Detached => return Ok(Followed::Detached),
                    Asked::Later => {
                        out.line(&format!(
                            "  Left undecided: the run waits for a decision until {}. Decide with: keel runs watch {run_id}",
                            time(expires_at)
                        ));
                        return Ok(Followed::Undecided);
                    }
                }
            }
            EventKind::Done { .. } => return Ok(Followed::Ended(RunStatus::Completed)),
            EventKind::Error { .. } => return Ok(Followed::Ended(RunStatus::Failed)),
            EventKind::Cancelled { .. } => return Ok(Followed::Ended(RunStatus::Cancelled)),
            _ => {}
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Asked {
    Answered,
    Detached,
    /// Nothing was sent: the run keeps waiting.
    Later,
}

/// An open interrupt of a run.
struct Question<'a> {
    run_id: &'a RunId,
    interrupt_id: &'a InterruptId,
    kind: InterruptKind,
    payload: &'a Value,
}

/// Asks the user what to do about an open interrupt, then resumes the run with the answer (and
/// the note that followed it, if any). A refused resume (someone else decided, it expired) is
/// shown, and the events tell what happened instead.
async fn ask(keel: &KeelClient, q: &Question<'_>, input: &mut Input, out: &mut Renderer) -> anyhow::Result<Asked> {
    let (decision, note) = match q.kind {
        InterruptKind::ConfirmAction => match confirm(q.payload, input, out).await? {
            Some(decided) => decided,
            None => return Ok(Asked::Detached),
        },
        InterruptKind::OutcomeUnknown => match outcome(q.payload, input, out).await? {
            None => return Ok(Asked::Detached),
            Some((answer, note)) => match answer.decision() {
                Some(decision) => (decision, note),
                None => return Ok(Asked::Later),
            },
        },
        other => {
            out.line(&format!("  keel chat cannot answer a {other} question; answer it from another client."));
            return Ok(Asked::Later);
        }
    };
    if let Err(e) = keel.resume_with_note(q.run_id, q.interrupt_id, decision, note.as_deref()).await {
        // Someone else decided, or it expired: the events that follow say what happened. Refused
        // (a role that may not approve): the run keeps waiting for someone who may.
        out.line(&format!("  the decision was not taken: {e}"));
        out.line("  (the run's events follow; Ctrl-C detaches)");
    }
    Ok(Asked::Answered)
}

/// "Restart pay-prod-2? [y/N/e(dit)]": the decision and the note after the answer ("n wrong
/// instance"), or `None` when the user detached.
async fn confirm(
    payload: &Value,
    input: &mut Input,
    out: &mut Renderer,
) -> anyhow::Result<Option<(Value, Option<String>)>> {
    out.line(&term::note_hint("n wrong instance"));
    let (answer, note) = loop {
        out.prompt(&format!("{} [y/N/e(dit)] ", term::title(payload)));
        let Some(line) = input.line().await else { return Ok(None) };
        let (choice, note) = term::split_note(&line);
        match (term::parse_answer(choice), term::check_note(note)) {
            (Some(answer), Ok(())) => break (answer, note.map(str::to_owned)),
            (Some(_), Err(e)) => out.line(&format!("  {e}")),
            (None, _) => out.line("  answer y (approve), n (reject, the default) or e (edit the arguments)"),
        }
    };
    let decision = match answer {
        Answer::Approve => decision::approve(),
        Answer::Reject => decision::reject(),
        Answer::Edit => {
            let mut edits = Vec::new();
            for action in term::actions(payload) {
                let args = loop {
                    out.prompt(&format!("{} arguments (JSON; empty keeps {}): ", action.tool, action.args));
                    let Some(line) = input.line().await else { return Ok(None) };
                    match term::parse_args(&line, &action.args) {
                        Ok(args) => break args,
                        Err(e) => out.line(&format!("  {e}")),
                    }
                };
                edits.push((action.call_id, args));
            }
            decision::edit(edits.iter().map(|(id, args)| (id.as_str(), args.clone())))
        }
    };
    Ok(Some((decision, note)))
}

/// "Did … happen? [r]etry / it was [d]one / it [f]ailed / Enter: decide later": there is no safe
/// default here (the call may or may not have happened), so an empty line sends nothing. The
/// answer and the note after it ("d it restarted at 12:03").
async fn outcome(
    payload: &Value,
    input: &mut Input,
    out: &mut Renderer,
) -> anyhow::Result<Option<(OutcomeAnswer, Option<String>)>> {
    out.line(&term::note_hint("f checked: it never restarted"));
    loop {
        out.prompt(&format!("{} {} ", term::title(payload), term::OUTCOME_CHOICES));
        let Some(line) = input.line().await else { return Ok(None) };
        let (choice, note) = term::split_note(&line);
        match (term::parse_outcome(choice), term::check_note(note)) {
            (Some(answer), Ok(())) => return Ok(Some((answer, note.map(str::to_owned)))),
            (Some(_), Err(e)) => out.line(&format!("  {e}")),
            (None, _) => out.line(
                "  answer r (retry with the same idempotency key), d (it was done), f (it failed, it did not \
                 happen) or Enter (decide later)",
            ),
        }
    }
}

fn detached(out: &mut Renderer, run_id: &RunId) {
    out.line(&format!("Detached from {run_id}; the run goes on without this terminal."));
    out.line(&format!("Reattach with: keel runs watch {run_id}"));
}

/// A time as people read it in a terminal.
fn time(t: &Timestamp) -> String {
    t.format("%Y-%m-%d %H:%M:%S UTC").to_string()
}

/// `"approve"` → "approved", `{"edit": …}` → "approved with edited arguments …".
fn decision_text(decision: &Value) -> String {
    match decision {
        Value::String(s) if s == "approve" => "approved".into(),
        Value::String(s) if s == "reject" => "rejected".into(),
        Value::String(s) if s == "retry" => "retried with the same idempotency key".into(),
        Value::String(s) if s == "mark_done" => "marked done".into(),
        Value::String(s) if s == "mark_failed" => "marked failed".into(),
        Value::Object(o) if o.contains_key("edit") => format!("approved with edited arguments {}", o["edit"]),
        Value::Object(o) if o.contains_key("calls") => format!("decided per call {}", o["calls"]),
        Value::Object(o) if o.contains_key("select") => format!("selected {}", o["select"]),
        Value::Object(o) if o.contains_key("provide") => format!("provided {}", o["provide"]),
        other => format!("decided {other}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn decisions_read_as_words() {
        assert_eq!(decision_text(&json!("approve")), "approved");
        assert_eq!(decision_text(&json!("reject")), "rejected");
        assert_eq!(decision_text(&json!("retry")), "retried with the same idempotency key");
        assert_eq!(decision_text(&json!("mark_done")), "marked done");
        assert_eq!(decision_text(&json!("mark_failed")), "marked failed");
        assert_eq!(
            decision_text(&json!({"edit": {"call_1": {"instanceId": "pay-prod-3"}}})),
            r#"approved with edited arguments {"call_1":{"instanceId":"pay-prod-3"}}"#
        );
        assert_eq!(decision_text(&json!({"calls": {"call_1": "reject"}})), r#"decided per call {"call_1":"reject"}"#);
        assert_eq!(decision_text(&json!(7)), "decided 7");
    }

    #[test]
    fn times_are_utc_to_the_second() {
        let t = chrono::DateTime::parse_from_rfc3339("2030-01-01T12:00:05.123Z").unwrap().to_utc();
        assert_eq!(time(&t), "2030-01-01 12:00:05 UTC");
    }
}
