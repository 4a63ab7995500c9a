//! Drawing a run's events on a terminal, and reading the user's lines.
//!
//! No TUI framework: text is printed as it streams, a tool step is one line (with a spinner while it
//! runs, only when stdout is a terminal), a confirmation is a question on its own line.

use std::io::{BufRead, IsTerminal, Write};

use keel_core::{EventKind, InterruptKind, ToolOutcomeStatus};
use serde_json::Value;
use tokio::sync::mpsc;

const SPINNER: &[char] = &['⠋', '⠙', '⠹', '⠸', '⠼', '⠴', '⠦', '⠧', '⠇', '⠏'];

/// What the user types: lines, read on a thread of their own so that a select can wait for a line
/// and an event at once, and Ctrl-C.
pub struct Input {
    lines: mpsc::UnboundedReceiver<String>,
    /// One SIGINT listener for the whole session: a Ctrl-C between two waits is not lost.
    interrupts: Interrupts,
}

#[cfg(unix)]
type Interrupts = tokio::signal::unix::Signal;
#[cfg(not(unix))]
struct Interrupts;

impl Input {
    /// Must be called inside the runtime. From now on Ctrl-C no longer kills the process: it is
    /// reported by [`Input::ctrl_c`] and [`Input::line`].
    pub fn stdin() -> std::io::Result<Self> {
        let (tx, lines) = mpsc::unbounded_channel();
        std::thread::spawn(move || {
            for line in std::io::stdin().lock().lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        #[cfg(unix)]
        let interrupts = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
        #[cfg(not(unix))]
        let interrupts = Interrupts;
        Ok(Self { lines, interrupts })
    }

    /// The next line; `None` on Ctrl-C or once stdin is closed (Ctrl-D).
    pub async fn line(&mut self) -> Option<String> {
        tokio::select! {
            line = self.lines.recv() => line,
            () = interrupted(&mut self.interrupts) => None,
        }
    }

    /// Resolves when the user presses Ctrl-C.
    pub async fn ctrl_c(&mut self) {
        interrupted(&mut self.interrupts).await
    }
}

#[cfg(unix)]
async fn interrupted(signal: &mut Interrupts) {
    if signal.recv().await.is_none() {
        std::future::pending::<()>().await;
    }
}

#[cfg(not(unix))]
async fn interrupted(_: &mut Interrupts) {
    if tokio::signal::ctrl_c().await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// Prints events as a person reads them.
pub struct Renderer {
    out: std::io::Stdout,
    /// Spinners and line rewrites only on a terminal.
    tty: bool,
    /// The cursor is not at the start of a line (streamed text is being written).
    mid_line: bool,
    /// The tool step being drawn with a spinner, and the spinner's frame.
    spinning: Option<(String, usize)>,
}

impl Renderer {
    pub fn new() -> Self {
        let out = std::io::stdout();
        let tty = out.is_terminal();
        Self { out, tty, mid_line: false, spinning: None }
    }

    pub fn is_spinning(&self) -> bool {
        self.spinning.is_some()
    }

    /// Prints a line of its own (after whatever was being written).
    pub fn line(&mut self, text: &str) {
        self.end_line();
        self.write(&format!("{text}\n"));
    }

    /// Prints `text` without a newline (a question), and flushes.
    pub fn prompt(&mut self, text: &str) {
        self.end_line();
        self.write(text);
        self.mid_line = false;
    }

    /// The next spinner frame.
    pub fn tick(&mut self) {
        if let Some((label, frame)) = &mut self.spinning {
            *frame = (*frame + 1) % SPINNER.len();
            let text = format!("\r{} {label}", SPINNER[*frame]);
            self.write(&text);
        }
    }

    pub fn event(&mut self, kind: &EventKind) {
        match kind {
            EventKind::TextDelta { delta, .. } => {
                self.clear_spinner();
                self.write(delta);
                self.mid_line = !delta.ends_with('\n');
            }
            EventKind::TextDiscarded { .. } => {
                self.line("  (the answer was cut off by a restart of the server; it starts again)");
            }
            EventKind::ToolStarted { tool, args_summary, .. } => {
                self.end_line();
                let label = format!("{tool} {args_summary}").trim_end().to_owned();
                if self.tty {
                    self.write(&format!("{} {label}", SPINNER[0]));
                    self.spinning = Some((label, 0));
                } else {
                    self.write(&format!("… {label}\n"));
                }
            }
            EventKind::ToolFinished { tool, status, summary, error_code, .. } => {
                let mark = match status {
                    ToolOutcomeStatus::Success => '✓',
                    ToolOutcomeStatus::Error => '✗',
                    ToolOutcomeStatus::Denied => '⊘',
                };
                self.clear_spinner();
                // Why it failed, as a code (`timeout`, `http_503`, `marked_failed`, …).
                let code = error_code.as_deref().map(|c| format!(" [{c}]")).unwrap_or_default();
                self.line(&format!("{mark} {tool}{code}: {summary}"));
            }
            EventKind::Interrupt { kind, payload, expires_at, .. } => {
                let unknown = *kind == InterruptKind::OutcomeUnknown;
                if let (true, Some((label, _))) = (unknown, self.spinning.take()) {
                    // The step that was sent and never answered.
                    self.write("\r\x1b[2K");
                    self.line(&format!("? {label}: no answer came back"));
                }
                self.line(&format!("⏸ {}", title(payload)));
                if let Some(risk) = payload.get("risk").and_then(Value::as_str) {
                    self.line(&format!("  {}: {risk}", if unknown { "outcome unknown" } else { "risk" }));
                }
                for action in actions(payload) {
                    let attempts = match action.attempts {
                        Some(1) => " (outcome unknown after 1 attempt)".to_owned(),
                        Some(n) => format!(" (outcome unknown after {n} attempts)"),
                        None if unknown => " (outcome unknown)".to_owned(),
                        None => String::new(),
                    };
                    self.line(&format!("  {} {}{attempts}", action.tool, action.args));
                }
                self.line(&format!("  (decide before {})", super::time(expires_at)));
            }
            EventKind::Resumed { decision, note, resolved_by, human_wait_ms, .. } => {
                let waited = std::time::Duration::from_millis(*human_wait_ms);
                self.line(&format!("↳ {} by {resolved_by} after {waited:.1?}", super::decision_text(decision)));
                if let Some(note) = note {
                    self.line(&format!("  note: {note}"));
                }
            }
            EventKind::Done { .. } => self.end_line(),
            EventKind::Error { code, message } => self.line(&format!("error {code}: {message}")),
            EventKind::Cancelled { reason } => self.line(&format!("cancelled: {reason}")),
            EventKind::RunWaiting { .. } => {
                self.line("⧗ waiting its turn: this message runs once the conversation's runs before it have ended")
            }
            EventKind::RunStarted { .. }
            | EventKind::GraphTopology { .. }
            | EventKind::NodeStarted { .. }
            | EventKind::NodeFinished { .. }
            | EventKind::FactsUpdated { .. } => {}
        }
    }

    /// Ends the line being written, if any: the next output starts on a line of its own.
    pub fn end_line(&mut self) {
        self.clear_spinner();
        if self.mid_line {
            self.write("\n");
            self.mid_line = false;
        }
    }

    fn clear_spinner(&mut self) {
        if self.spinning.take().is_some() {
            self.write("\r\x1b[2K");
        }
    }

    fn write(&mut self, text: &str) {
        // A closed stdout (a pipe to `head`) is not worth an error: the run goes on regardless.
        let _ = self.out.write_all(text.as_bytes());
        let _ = self.out.flush();
    }
}

/// One action of an interrupt's payload (`confirm_action`, `outcome_unknown`).
#[derive(Debug, Clone, PartialEq)]
pub struct Action {
    pub call_id: String,
    pub tool: String,
    pub args: Value,
    /// `outcome_unknown`: how often the call was sent without an answer.
    pub attempts: Option<u64>,
}

pub fn actions(payload: &Value) -> Vec<Action> {
    payload
        .get("actions")
        .and_then(Value::as_array)
        .map(|actions| {
            actions
                .iter()
                .map(|a| Action {
                    call_id: a.get("callId").and_then(Value::as_str).unwrap_or_default().to_owned(),
                    tool: a.get("tool").and_then(Value::as_str).unwrap_or("?").to_owned(),
                    args: a.get("args").cloned().unwrap_or(Value::Null),
                    attempts: a.get("attempts").and_then(Value::as_u64),
                })
                .collect()
        })
        .unwrap_or_default()
}

pub fn title(payload: &Value) -> &str {
    payload.get("title").and_then(Value::as_str).unwrap_or("A decision is needed")
}

/// An answer to "… [y/N/e(dit)]".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    Approve,
    Reject,
    Edit,
}

/// `y`/`yes` approves, `e`/`edit` edits, an empty line or `n`/`no` rejects (the default is the safe
/// one); anything else is asked again.
pub fn parse_answer(line: &str) -> Option<Answer> {
    match line.trim().to_ascii_lowercase().as_str() {
        "y" | "yes" => Some(Answer::Approve),
        "" | "n" | "no" => Some(Answer::Reject),
        "e" | "edit" => Some(Answer::Edit),
        _ => None,
    }
}

/// What an `outcome_unknown` question offers.
pub const OUTCOME_CHOICES: &str = "[r]etry / it was [d]one / it [f]ailed / Enter: decide later";

/// An answer to an `outcome_unknown` question: a call was sent and no answer came back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutcomeAnswer {
    /// Send it again, with the same idempotency key.
    Retry,
    /// It happened.
    Done,
    /// It did not happen.
    Failed,
    /// Send nothing now; the run keeps waiting.
    Later,
}

impl OutcomeAnswer {
    /// The resume's `decision`; `None` for [`OutcomeAnswer::Later`].
    pub fn decision(self) -> Option<Value> {
        match self {
            OutcomeAnswer::Retry => Some(Value::from("retry")),
            OutcomeAnswer::Done => Some(Value::from("mark_done")),
            OutcomeAnswer::Failed => Some(Value::from("mark_failed")),
            OutcomeAnswer::Later => None,
        }
    }
}

/// `r`/`retry`, `d`/`done`, `f`/`failed`, an empty line for later; anything else is asked again.
/// No answer is the default: the call may or may not have happened, so guessing is never safe.
pub fn parse_outcome(line: &str) -> Option<OutcomeAnswer> {
    match line.trim().to_ascii_lowercase().as_str() {
        "r" | "retry" => Some(OutcomeAnswer::Retry),
        "d" | "done" => Some(OutcomeAnswer::Done),
        "f" | "failed" | "fail" => Some(OutcomeAnswer::Failed),
        "" => Some(OutcomeAnswer::Later),
        _ => None,
    }
}

/// The line said at a question that may take a note, e.g. "n wrong instance" or "d: it restarted":
/// its first word (the choice, with a trailing `:` or `,` dropped) and the rest, trimmed, as the
/// note (`None` when there is none).
pub fn split_note(line: &str) -> (&str, Option<&str>) {
    let line = line.trim();
    let (choice, rest) = line.split_once(char::is_whitespace).unwrap_or((line, ""));
    let (choice, rest) = match choice.find([':', ',']) {
        // "d:it restarted" as well as "d: it restarted"; ": text" is no choice (not Enter's).
        Some(i) if i > 0 => (&choice[..i], &line[i + 1..]),
        _ => (choice, rest),
    };
    let note = rest.trim();
    (choice, (!note.is_empty()).then_some(note))
}

/// Said before a question that takes a note: how to give one.
pub fn note_hint(example: &str) -> String {
    format!("  (a note may follow the answer, e.g. `{example}`: it is kept with the decision)")
}

/// A note the server takes: at most [`keel_core::engine::MAX_NOTE_CHARS`] characters.
pub fn check_note(note: Option<&str>) -> Result<(), String> {
    let max = keel_core::engine::MAX_NOTE_CHARS;
    match note {
        Some(note) if note.chars().count() > max => Err(format!("a note is at most {max} characters")),
        _ => Ok(()),
    }
}

/// Edited arguments: an empty line keeps `current`; otherwise a JSON object.
pub fn parse_args(line: &str, current: &Value) -> Result<Value, String> {
    let line = line.trim();
    if line.is_empty() {
        return Ok(current.clone());
    }
    match serde_json::from_str::<Value>(line) {
        Ok(v @ Value::Object(_)) => Ok(v),
        Ok(_) => Err("the arguments must be a JSON object, e.g. {\"instanceId\": \"pay-prod-3\"}".into()),
        Err(e) => Err(format!("not JSON: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn answers_default_to_reject() {
        assert_eq!(parse_answer("y"), Some(Answer::Approve));
        assert_eq!(parse_answer(" YES "), Some(Answer::Approve));
        assert_eq!(parse_answer(""), Some(Answer::Reject));
        assert_eq!(parse_answer("N"), Some(Answer::Reject));
        assert_eq!(parse_answer("e"), Some(Answer::Edit));
        assert_eq!(parse_answer("edit"), Some(Answer::Edit));
        assert_eq!(parse_answer("maybe"), None);
        assert_eq!(parse_answer("yy"), None);
    }

    #[test]
    fn outcome_answers_have_no_default_but_later() {
        assert_eq!(parse_outcome("r"), Some(OutcomeAnswer::Retry));
        assert_eq!(parse_outcome(" Retry "), Some(OutcomeAnswer::Retry));
        assert_eq!(parse_outcome("d"), Some(OutcomeAnswer::Done));
        assert_eq!(parse_outcome("DONE"), Some(OutcomeAnswer::Done));
        assert_eq!(parse_outcome("f"), Some(OutcomeAnswer::Failed));
        assert_eq!(parse_outcome("failed"), Some(OutcomeAnswer::Failed));
        assert_eq!(parse_outcome(""), Some(OutcomeAnswer::Later));
        assert_eq!(parse_outcome("   "), Some(OutcomeAnswer::Later));
        for wrong in ["y", "n", "yes", "e", "rd", "maybe"] {
            assert_eq!(parse_outcome(wrong), None, "{wrong:?}");
        }
        assert_eq!(OutcomeAnswer::Retry.decision(), Some(json!("retry")));
        assert_eq!(OutcomeAnswer::Done.decision(), Some(json!("mark_done")));
        assert_eq!(OutcomeAnswer::Failed.decision(), Some(json!("mark_failed")));
        assert_eq!(OutcomeAnswer::Later.decision(), None);
    }

    #[test]
    fn a_note_follows_the_choice() {
        assert_eq!(split_note("y"), ("y", None));
        assert_eq!(split_note(""), ("", None));
        assert_eq!(split_note("   "), ("", None));
        assert_eq!(split_note(" n  wrong instance "), ("n", Some("wrong instance")));
        assert_eq!(split_note("d: it restarted at 12:03"), ("d", Some("it restarted at 12:03")));
        assert_eq!(split_note("d:it restarted"), ("d", Some("it restarted")));
        assert_eq!(split_note("yes, checked the dashboard"), ("yes", Some("checked the dashboard")));
        assert_eq!(split_note("y:"), ("y", None));
        assert_eq!(split_note("e\tpay-prod-3 instead"), ("e", Some("pay-prod-3 instead")));
        assert_eq!(split_note("maybe later"), ("maybe", Some("later")), "the choice is still checked");
        assert_eq!(split_note(": wrong"), (":", Some("wrong")), "no choice: asked again");
        assert_eq!(parse_answer(split_note(", wrong").0), None);
        assert_eq!(parse_outcome(split_note(":later").0), None);
        assert_eq!(parse_answer(split_note("yy ok").0), None);
        assert_eq!(parse_answer(split_note("n: no").0), Some(Answer::Reject));
        assert_eq!(parse_outcome(split_note("f it never restarted").0), Some(OutcomeAnswer::Failed));
        assert_eq!(check_note(Some(&"é".repeat(2000))), Ok(()));
        assert_eq!(check_note(Some(&"é".repeat(2001))), Err("a note is at most 2000 characters".into()));
        assert_eq!(check_note(None), Ok(()));
    }

    #[test]
    fn edited_args_are_a_json_object_or_kept() {
        let current = json!({"instanceId": "pay-prod-2"});
        assert_eq!(parse_args("  ", &current), Ok(current.clone()));
        assert_eq!(parse_args(r#"{"instanceId": "pay-prod-3"}"#, &current), Ok(json!({"instanceId": "pay-prod-3"})));
        assert!(parse_args("[1]", &current).unwrap_err().contains("JSON object"));
        assert!(parse_args("{instanceId", &current).unwrap_err().starts_with("not JSON"));
    }

    #[test]
    fn actions_are_read_from_the_payload() {
        let payload = json!({"title": "Restart pay-prod-2?", "actions": [
            {"callId": "call_1", "tool": "restart_instance", "args": {"instanceId": "pay-prod-2"}}
        ]});
        assert_eq!(title(&payload), "Restart pay-prod-2?");
        assert_eq!(
            actions(&payload),
            vec![Action {
                call_id: "call_1".into(),
                tool: "restart_instance".into(),
                args: json!({"instanceId": "pay-prod-2"}),
                attempts: None,
            }]
        );
        let unknown = json!({"actions": [{"callId": "call_2", "tool": "restart_service", "args": {}, "attempts": 2}]});
        assert_eq!(actions(&unknown)[0].attempts, Some(2));
        assert!(actions(&json!({})).is_empty());
        assert_eq!(title(&json!({"title": 3})), "A decision is needed");
    }
}
