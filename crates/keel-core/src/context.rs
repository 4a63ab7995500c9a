//! Context assembly: what the model sees of a conversation.
//!
//! Three parts, in this order: the system prompt with the confirmed facts; a summary of earlier
//! turns once the history exceeds the token budget; the recent turns verbatim. Facts come only from
//! validated tool results or explicit user confirmation, never from model text, so "restart it"
//! resolves against what the tools established rather than against what the model once said. The
//! summary is marked as a summary in the prompt and is never turned into facts.
//!
//! Assembly is two pure steps: [`plan`] decides which turns stay verbatim and which older ones the
//! stored summary does not cover yet; [`Plan::render`] builds the messages around a summary text —
//! the extractive one ([`Plan::extractive_summary`]) or one a model wrote from
//! [`Plan::summary_request`]. [`assemble`] is both steps with the extractive summary.
//!
//! The recent part is sticky: once a summary exists, every turn after it stays verbatim for as long
//! as they fit. When they no longer do, older turns are summarised down to half the recent budget,
//! so that a new summary is needed only after that much history has accumulated again.

use std::collections::HashMap;

use crate::domain::{Fact, Message, Role, Summary, ToolCall};
use crate::ids::CallId;
use crate::mask::{truncate, Masked};
use crate::model::{ModelMessage, ModelToolCall};

#[derive(Debug, Clone)]
pub struct ContextConfig {
    pub system_prompt: String,
    /// Tokens (as [`estimate_tokens`] counts them) of the whole prompt: the system prompt, the
    /// facts, the summary and the recent turns. The recent turns get what is left after the others
    /// (with room for a summary of `summary_max_chars` reserved once one is needed). The current
    /// turn is always kept whole, even if alone it is larger. Tool specs are not counted.
    pub context_budget_tokens: usize,
    /// Upper bound of the summary text, in characters.
    pub summary_max_chars: usize,
    /// Have the model write the summary of older turns (a separate call without tools) instead of
    /// the extractive one. If that call fails, the extractive summary is used.
    pub summarize_with_model: bool,
    /// The largest tool result (as JSON text) that reaches the store, the context and events; a
    /// larger one is cut to this with an explicit marker and its total size.
    pub tool_result_max_bytes: usize,
}

/// [`ContextConfig::tool_result_max_bytes`]'s default: 16 KiB.
pub const DEFAULT_TOOL_RESULT_MAX_BYTES: usize = 16 * 1024;

impl Default for ContextConfig {
    fn default() -> Self {
        Self {
            system_prompt: "You are a helpful assistant. Use the tools to find out what you are asked; never \
                            invent names or numbers. Actions that change things may need a human's approval."
                .to_owned(),
            context_budget_tokens: 4000,
            summary_max_chars: 2000,
            summarize_with_model: false,
            tool_result_max_bytes: DEFAULT_TOOL_RESULT_MAX_BYTES,
        }
    }
}

/// How the summary is introduced in the system message.
pub const SUMMARY_LABEL: &str = "Summary of earlier turns (not verified facts):";

/// The system prompt of a summary call; a model server can tell summary calls by it.
pub const SUMMARIZER_PROMPT: &str = "You summarise the earlier part of a conversation between a user and an \
operations assistant, for the assistant's own later use.";

/// A rough, conservative token estimate (about four characters a token).
pub fn estimate_tokens(text: &str) -> usize {
    text.chars().count().div_ceil(4) + 4
}

/// The estimate of one message: its content and the name and arguments of each tool call.
pub fn estimate_message_tokens(message: &ModelMessage) -> usize {
    match message {
        ModelMessage::System { content } | ModelMessage::User { content } | ModelMessage::Tool { content, .. } => {
            estimate_tokens(content)
        }
        ModelMessage::Assistant { content, tool_calls } => {
            estimate_tokens(content)
                + tool_calls.iter().map(|c| estimate_tokens(&format!("{}{}", c.name, c.arguments))).sum::<usize>()
        }
    }
}

/// The estimate of a whole prompt.
pub fn estimate_prompt_tokens(messages: &[ModelMessage]) -> usize {
    messages.iter().map(estimate_message_tokens).sum()
}

#[derive(Debug, Clone, Copy)]
pub struct ContextInput<'a> {
    pub messages: &'a [Message],
    pub tool_calls: &'a [ToolCall],
    pub facts: &'a [Fact],
    pub summary: Option<&'a Summary>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Assembled {
    pub messages: Vec<ModelMessage>,
    /// A new or extended summary to store, when older turns fell out of the budget.
    pub new_summary: Option<Summary>,
}

/// Which turns stay verbatim and which older ones still need summarising.
#[derive(Debug, Clone)]
pub struct Plan<'a> {
    config: &'a ContextConfig,
    input: ContextInput<'a>,
    /// The system prompt with the facts.
    header: String,
    /// Older messages the stored summary does not cover yet, oldest first.
    uncovered: Vec<&'a Message>,
    /// The turns kept verbatim, oldest first.
    recent: Vec<&'a Message>,
    /// The input's calls by id.
    calls: Calls<'a>,
}

/// Tool calls by id: a tool result finds its call in constant time.
type Calls<'a> = HashMap<&'a CallId, &'a ToolCall>;

/// Decides what of the history is sent verbatim. Pure.
pub fn plan<'a>(config: &'a ContextConfig, input: ContextInput<'a>) -> Plan<'a> {
    let header = header(config, input.facts);
    let calls: Calls<'a> = input.tool_calls.iter().map(|c| (&c.id, c)).collect();
    let turns = split_turns(input.messages);
    let cost: Vec<usize> = turns.iter().map(|t| estimate_prompt_tokens(&to_model_messages(t, &calls))).collect();
    let available = config.context_budget_tokens.saturating_sub(estimate_tokens(&header));

    // Turns the stored summary covers: up to the one that ends with its last message.
    let covered = input
        .summary
        .and_then(|s| turns.iter().position(|t| t.iter().any(|m| m.id == s.through_message_id)))
        .map(|i| i + 1)
        .unwrap_or(0);
    let total: usize = cost[covered..].iter().sum();
    let (summarise_to, keep_from) = if input.summary.is_none() && total <= available {
        // Everything fits: no summary.
        (0, 0)
    } else {
        let recent_budget = available.saturating_sub(summary_reserve(config));
        if total <= recent_budget {
            // The stored summary still does: the turns after it stay verbatim.
            (covered, covered)
        } else {
            // Summarise down to half the recent budget, so the next summary waits until that much
            // history has accumulated again. The last turn is always kept.
            let low = recent_budget / 2;
            let mut keep = turns.len();
            let mut used = 0usize;
            while keep > covered {
                let c = cost[keep - 1];
                if keep < turns.len() && used + c > low {
                    break;
                }
                used += c;
                keep -= 1;
            }
            (keep, keep)
        }
    };
    let uncovered = turns[covered.min(summarise_to)..summarise_to].iter().flatten().copied().collect();
    let recent = turns[keep_from..].iter().flatten().copied().collect();
    Plan { config, input, header, uncovered, recent, calls }
}

/// Room for the label and a summary of the largest allowed size.
fn summary_reserve(config: &ContextConfig) -> usize {
    estimate_tokens(SUMMARY_LABEL) + config.summary_max_chars.div_ceil(4) + 1
}

fn header(config: &ContextConfig, facts: &[Fact]) -> String {
    let mut system = config.system_prompt.clone();
    if !facts.is_empty() {
        system.push_str("\n\nConfirmed facts (from validated tool results or the user's confirmation):\n");
        for f in facts {
            system.push_str(&format!("- {}: {}\n", f.key, f.value));
        }
    }
    system
}

impl<'a> Plan<'a> {
    /// Older turns fell out of the budget that the stored summary does not cover.
    pub fn needs_summary(&self) -> bool {
        !self.uncovered.is_empty()
    }

    /// The messages the stored summary does not cover yet and the new one has to.
    pub fn uncovered(&self) -> &[&'a Message] {
        &self.uncovered
    }

    /// The summary so far followed by a line per uncovered user question and assistant answer,
    /// bounded by keeping its most recent part. `None` when no new summary is needed.
    pub fn extractive_summary(&self) -> Option<String> {
        if !self.needs_summary() {
            return None;
        }
        let mut text = self.input.summary.map(|s| s.text.as_str().to_owned()).unwrap_or_default();
        if !text.is_empty() && !text.ends_with('\n') {
            text.push('\n');
        }
        for m in &self.uncovered {
            match m.role {
                Role::User => text.push_str(&format!("- User asked: {}\n", truncate(&m.content, 160))),
                Role::Assistant if !m.content.is_empty() => {
                    text.push_str(&format!("- Assistant answered: {}\n", truncate(&m.content, 200)))
                }
                _ => {}
            }
        }
        // Keep the most recent whole lines within the bound.
        let chars = text.chars().count();
        if chars > self.config.summary_max_chars {
            let tail: String = text.chars().skip(chars - self.config.summary_max_chars).collect();
            text = match tail.split_once('\n') {
                Some((_, rest)) if !rest.is_empty() => rest.to_owned(),
                _ => tail,
            };
        }
        Some(text)
    }

    /// The request for a model-written summary: the previous summary and the uncovered turns, in a
    /// prompt that fits the context budget. `None` when no new summary is needed.
    pub fn summary_request(&self) -> Option<Vec<ModelMessage>> {
        if !self.needs_summary() {
            return None;
        }
        let words = (self.config.summary_max_chars / 7).max(20);
        let system = format!(
            "{SUMMARIZER_PROMPT} Write a short, factual summary, at most {words} words, of the turns you are \
             given, merged with the previous summary if there is one: what the user asked, what the tools \
             reported, what was done and what is still open. Keep instance names, numbers and decisions \
             exactly as they are; add nothing that is not in the turns; no preamble."
        );
        let mut head = String::new();
        if let Some(previous) = self.input.summary {
            head.push_str("Previous summary:\n");
            head.push_str(&truncate(&previous.text, self.config.summary_max_chars));
            head.push_str("\n\n");
        }
        head.push_str("Turns to add to it:\n");
        let lines: Vec<String> = self
            .uncovered
            .iter()
            .filter_map(|m| {
                let (who, text) = match m.role {
                    Role::User => ("User".to_owned(), m.content.as_str()),
                    Role::Assistant if m.content.is_empty() => return None,
                    Role::Assistant => ("Assistant".to_owned(), m.content.as_str()),
                    Role::Tool => {
                        let call = m.tool_call_id.as_ref().and_then(|id| self.calls.get(id));
                        (
                            format!("Tool result ({})", call.map(|c| c.name.as_str()).unwrap_or("tool")),
                            m.content.as_str(),
                        )
                    }
                };
                Some(format!("{who}: {}\n", truncate(text, 600)))
            })
            .collect();
        // Keep the most recent lines that fit in the budget.
        let room = self
            .config
            .context_budget_tokens
            .saturating_sub(estimate_tokens(&system) + estimate_tokens(&head))
            .saturating_mul(4);
        let mut used = 0usize;
        let mut from = lines.len();
        while from > 0 && used + lines[from - 1].chars().count() <= room {
            used += lines[from - 1].chars().count();
            from -= 1;
        }
        let mut user = head;
        for line in &lines[from..] {
            user.push_str(line);
        }
        Some(vec![ModelMessage::System { content: system }, ModelMessage::User { content: user }])
    }

    /// Builds the model input around `new_summary_text` — the summary of the uncovered turns merged
    /// with the stored one — or, when none is given, the stored summary. The text is masked and cut
    /// to `summary_max_chars`.
    pub fn render(&self, new_summary_text: Option<String>) -> Assembled {
        let new_summary = match (new_summary_text, self.uncovered.last()) {
            (Some(text), Some(last)) => Some(Summary {
                conversation_id: last.conversation_id.clone(),
                through_message_id: last.id.clone(),
                text: Masked::truncated(text.trim(), self.config.summary_max_chars),
            }),
            _ => None,
        };
        let mut system = self.header.clone();
        if let Some(summary) = new_summary.as_ref().or(self.input.summary) {
            system.push_str("\n\n");
            system.push_str(SUMMARY_LABEL);
            system.push('\n');
            system.push_str(&truncate(&summary.text, self.config.summary_max_chars));
        }
        let mut messages = vec![ModelMessage::System { content: system }];
        messages.extend(to_model_messages(&self.recent, &self.calls));
        Assembled { messages, new_summary }
    }
}

/// Builds the model input with the extractive summary. Pure: everything it needs is passed in.
pub fn assemble(config: &ContextConfig, input: ContextInput<'_>) -> Assembled {
    let plan = plan(config, input);
    let summary = plan.extractive_summary();
    plan.render(summary)
}

/// A turn: a user message and everything after it up to the next user message.
fn split_turns(messages: &[Message]) -> Vec<Vec<&Message>> {
    let mut turns: Vec<Vec<&Message>> = Vec::new();
    for m in messages {
        if m.role == Role::User || turns.is_empty() {
            turns.push(Vec::new());
        }
        if let Some(t) = turns.last_mut() {
            t.push(m);
        }
    }
    turns
}

/// Stored messages to model messages: each block of tool results is preceded by one assistant
/// message that carries the calls, as chat APIs require.
fn to_model_messages(messages: &[&Message], calls: &Calls<'_>) -> Vec<ModelMessage> {
    let mut out: Vec<ModelMessage> = Vec::new();
    let mut assistant_for_block: Option<usize> = None;
    for m in messages {
        match m.role {
            Role::User => {
                assistant_for_block = None;
                out.push(ModelMessage::User { content: m.content.as_str().to_owned() });
            }
            Role::Assistant => {
                assistant_for_block = None;
                out.push(ModelMessage::Assistant { content: m.content.as_str().to_owned(), tool_calls: Vec::new() });
            }
            Role::Tool => {
                let Some(call_id) = &m.tool_call_id else { continue };
                let call = calls.get(call_id);
                let name = call.map(|c| c.name.clone()).unwrap_or_default();
                let model_call = ModelToolCall {
                    id: call_id.to_string(),
                    name: name.clone(),
                    arguments: call.map(|c| c.args.inner().clone()).unwrap_or_default(),
                };
                let idx = match assistant_for_block {
                    Some(i) => i,
                    None => {
                        // Attach to the assistant text just before, if there is one.
                        let i = match out.last() {
                            Some(ModelMessage::Assistant { .. }) => out.len() - 1,
                            _ => {
                                out.push(ModelMessage::Assistant { content: String::new(), tool_calls: Vec::new() });
                                out.len() - 1
                            }
                        };
                        assistant_for_block = Some(i);
                        i
                    }
                };
                if let Some(ModelMessage::Assistant { tool_calls, .. }) = out.get_mut(idx) {
                    tool_calls.push(model_call);
                }
                out.push(ModelMessage::Tool {
                    call_id: call_id.to_string(),
                    name,
                    content: m.content.as_str().to_owned(),
                });
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::FactSource;
    use crate::ids::{CallId, ConversationId, MessageId, RunId};
    use chrono::Utc;
    use serde_json::json;

    fn msg(conv: &ConversationId, role: Role, content: &str, call: Option<&CallId>) -> Message {
        Message {
            id: MessageId::new(),
            conversation_id: conv.clone(),
            run_id: None,
            role,
            content: content.into(),
            tool_call_id: call.cloned(),
            created_at: Utc::now(),
        }
    }

    fn system_of(messages: &[ModelMessage]) -> &str {
        match &messages[0] {
            ModelMessage::System { content } => content,
            other => panic!("system first, not {other:?}"),
        }
    }

    fn user_texts(messages: &[ModelMessage]) -> Vec<&str> {
        messages
            .iter()
            .filter_map(|m| match m {
                ModelMessage::User { content } => Some(content.as_str()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn facts_summary_and_recent_turns() {
        let conv = ConversationId::new();
        let call = CallId::new();
        let mut messages = Vec::new();
        for i in 0..30 {
            messages.push(msg(&conv, Role::User, &format!("question {i} {}", "x".repeat(200)), None));
            messages.push(msg(&conv, Role::Assistant, &format!("answer {i} {}", "y".repeat(200)), None));
        }
        messages.push(msg(&conv, Role::User, "restart it", None));
        messages.push(msg(&conv, Role::Tool, "{\"ok\":true}", Some(&call)));
        let calls = vec![ToolCall {
            id: call.clone(),
            run_id: RunId::new(),
            name: "cancel_order".into(),
            args: json!({"orderId": "ord-2"}).into(),
            state: crate::domain::ToolCallState::Succeeded,
            result: None,
            summary: None,
            attempts: 1,
            started_at: None,
            finished_at: None,
        }];
        let facts = vec![Fact {
            key: "order".into(),
            value: "ord-2".into(),
            source: FactSource::ToolResult,
            updated_at: Utc::now(),
        }];
        let config = ContextConfig { context_budget_tokens: 1400, ..Default::default() };
        let input = ContextInput { messages: &messages, tool_calls: &calls, facts: &facts, summary: None };
        let out = assemble(&config, input);
        let content = system_of(&out.messages);
        assert!(content.contains("- order: ord-2"));
        assert!(content.contains(SUMMARY_LABEL));
        let summary = out.new_summary.expect("older turns summarised");
        // Bounded, keeping the most recent of the older turns.
        assert!(summary.text.chars().count() <= config.summary_max_chars);
        assert!(summary.text.starts_with("- "), "whole lines: {}", summary.text);
        assert!(!content.contains("question 0 "));
        // The whole prompt stays within budget and ends with the current turn, verbatim.
        let total = estimate_prompt_tokens(&out.messages);
        assert!(total <= config.context_budget_tokens, "{total}");
        assert!(
            matches!(&out.messages[out.messages.len() - 3], ModelMessage::User { content } if content == "restart it")
        );
        assert!(matches!(&out.messages[out.messages.len() - 2],
            ModelMessage::Assistant { tool_calls, .. } if tool_calls[0].name == "cancel_order"));
        // The summary covers exactly the turns before the first verbatim one.
        let first_recent = user_texts(&out.messages[1..])[0];
        let n: usize = first_recent.split(' ').nth(1).unwrap().parse().unwrap();
        assert!(summary.text.contains(&format!("question {}", n - 1)));
        assert!(!summary.text.contains(&format!("question {n} ")));
        // With the summary stored, assembling again adds nothing new to it and shows it.
        let again = assemble(&config, ContextInput { summary: Some(&summary), ..input });
        assert!(again.new_summary.is_none());
        assert_eq!(again.messages, out.messages);
    }

    #[test]
    fn short_history_needs_no_summary() {
        let conv = ConversationId::new();
        let messages = vec![msg(&conv, Role::User, "hello", None)];
        let input = ContextInput { messages: &messages, tool_calls: &[], facts: &[], summary: None };
        let config = ContextConfig::default();
        let plan = plan(&config, input);
        assert!(!plan.needs_summary());
        assert!(plan.summary_request().is_none());
        let out = plan.render(None);
        assert_eq!(out.messages.len(), 2);
        assert!(out.new_summary.is_none());
        assert!(!system_of(&out.messages).contains(SUMMARY_LABEL));
    }

    /// A long conversation, assembled before each answer as the engine does: every prompt within
    /// budget, no turn ever lost between the summary and the verbatim part, and a new summary only
    /// now and then.
    #[test]
    fn long_conversation_stays_in_budget_with_few_summaries() {
        let conv = ConversationId::new();
        let config = ContextConfig { context_budget_tokens: 800, summary_max_chars: 600, ..Default::default() };
        let mut messages: Vec<Message> = Vec::new();
        let mut stored: Option<Summary> = None;
        let mut summaries = 0;
        for i in 0..200 {
            messages.push(msg(&conv, Role::User, &format!("question {i} about ord-{}", i % 7), None));
            let input = ContextInput { messages: &messages, tool_calls: &[], facts: &[], summary: stored.as_ref() };
            let plan = plan(&config, input);
            let text = if plan.needs_summary() {
                summaries += 1;
                let request = plan.summary_request().unwrap();
                assert!(estimate_prompt_tokens(&request) <= config.context_budget_tokens);
                let ModelMessage::User { content } = &request[1] else { panic!("a user message") };
                // Only what is not covered yet, and the summary so far.
                let first = plan.uncovered()[0].content.clone();
                assert!(content.contains(first.as_str()), "{content}");
                if let Some(s) = &stored {
                    assert!(content.contains(&format!("Previous summary:\n{}", s.text)));
                }
                let last = plan.uncovered().last().unwrap().content.clone();
                Some(format!("The user asked up to «{last}»."))
            } else {
                None
            };
            let out = plan.render(text);
            let total = estimate_prompt_tokens(&out.messages);
            assert!(total <= config.context_budget_tokens, "turn {i}: {total} tokens");
            let users = user_texts(&out.messages);
            assert_eq!(users.last().copied(), Some(messages.last().unwrap().content.as_str()));
            if let Some(s) = out.new_summary.clone() {
                stored = Some(s);
            }
            if let Some(s) = &stored {
                // The turn right after the summary's last one is the first verbatim turn.
                let through = messages.iter().position(|m| m.id == s.through_message_id).unwrap();
                assert_eq!(users[0], messages[through + 1].content, "turn {i}");
                assert!(system_of(&out.messages).contains(&format!("{SUMMARY_LABEL}\n{}", s.text)));
            } else {
                assert_eq!(users.len(), messages.iter().filter(|m| m.role == Role::User).count());
            }
            messages.push(msg(&conv, Role::Assistant, &format!("answer {i}"), None));
        }
        assert!(stored.is_some());
        assert!((2..=40).contains(&summaries), "{summaries} summaries for 200 turns");
    }

    #[test]
    fn a_model_summary_is_masked_cut_and_marked() {
        let conv = ConversationId::new();
        let mut messages = Vec::new();
        for i in 0..20 {
            messages.push(msg(&conv, Role::User, &format!("question {i} {}", "x".repeat(100)), None));
        }
        let config = ContextConfig { context_budget_tokens: 300, summary_max_chars: 100, ..Default::default() };
        let plan = plan(&config, ContextInput { messages: &messages, tool_calls: &[], facts: &[], summary: None });
        assert!(plan.needs_summary());
        let ModelMessage::System { content } = &plan.summary_request().unwrap()[0] else { panic!() };
        assert!(content.starts_with(SUMMARIZER_PROMPT));
        let out = plan.render(Some(format!("  It used password=hunter2 and {}  ", "z".repeat(300))));
        let summary = out.new_summary.unwrap();
        assert!(!summary.text.contains("hunter2"), "{}", summary.text);
        assert!(summary.text.starts_with("It used password=***"));
        assert!(summary.text.chars().count() <= 100);
        assert!(system_of(&out.messages).contains(SUMMARY_LABEL));
        assert_eq!(summary.through_message_id, plan.uncovered().last().unwrap().id);
    }
}
