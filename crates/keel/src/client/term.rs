//! Drawing a run's events on a terminal, and reading the user's lines.
//!
//! No TUI framework: text is printed as it streams, a tool step is one line (with a spinner while it
//! runs, only when stdout is a terminal), a confirmation is a question on its own line.

use std::io::{BufRead, IsTerminal, Write};

use keel_core::{EventKind, ToolOutcomeStatus};
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
            EventKind::ToolFinished { tool, status, summary, .. } => {
                let mark = match status {
                    ToolOutcomeStatus::Success => '✓',
                    ToolOutcomeStatus::Error => '✗',
                    ToolOutcomeStatus::Denied => '⊘',
                };
                self.clear_spinner();
                self.line(&format!("{mark} {tool}: {summary}"));
            }
            EventKind::Interrupt { payload, expires_at, .. } => {
                self.line(&format!("⏸ {}", title(payload)));
                if let Some(risk) = payload.get("risk").and_then(Value::as_str) {
                    self.line(&format!("  risk: {risk}"));
                }
                for action in actions(payload) {
                    self.line(&format!("  {} {}", action.tool, action.args));
                }
                self.line(&format!("  (decide before {})", super::time(expires_at)));
            }
            EventKind::Resumed { decision, resolved_by, human_wait_ms, .. } => {
                let waited = std::time::Duration::from_millis(*human_wait_ms);
                self.line(&format!("↳ {} by {resolved_by} after {waited:.1?}", super::decision_text(decision)));
            }
            EventKind::Done { .. } => self.end_line(),
            EventKind::Error { code, message } => self.line(&format!("error {code}: {message}")),
            EventKind::Cancelled { reason } => self.line(&format!("cancelled: {reason}")),
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

/// One action of a `confirm_action` payload.
#[derive(Debug, Clone, PartialEq)]
pub struct Action {
    pub call_id: String,
    pub tool: String,
    pub args: Value,
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
                args: json!({"instanceId": "pay-prod-2"})
            }]
        );
        assert!(actions(&json!({})).is_empty());
        assert_eq!(title(&json!({"title": 3})), "A decision is needed");
    }
}
