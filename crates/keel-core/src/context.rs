//! Context assembly: what the model sees of a conversation.
//!
//! Three parts, in this order: the system prompt with the confirmed facts; a summary of earlier
//! turns once the history exceeds the token budget; the recent turns verbatim. Facts come only from
//! validated tool results or explicit user confirmation, never from model text, so "restart it"
//! resolves against what the tools established rather than against what the model once said.

use crate::domain::{Fact, Message, Role, Summary, ToolCall};
use crate::mask::truncate;
use crate::model::{ModelMessage, ModelToolCall};

#[derive(Debug, Clone)]
pub struct ContextConfig {
    pub system_prompt: String,
    /// Tokens of recent turns kept verbatim; older turns are summarised. The current turn is always
    /// kept whole.
    pub recent_budget_tokens: usize,
    /// Upper bound of the summary text, in characters.
    pub summary_max_chars: usize,
}

impl Default for ContextConfig {
    fn default() -> Self {
        Self {
            system_prompt: "You are an operations assistant. Use the tools to look at the fleet; never invent \
                            instance names or numbers. Actions that change the fleet need a human's approval."
                .to_owned(),
            recent_budget_tokens: 3000,
            summary_max_chars: 2000,
        }
    }
}

/// A rough, conservative token estimate (about four characters a token).
pub fn estimate_tokens(text: &str) -> usize {
    text.chars().count().div_ceil(4) + 4
}

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

/// Builds the model input. Pure: everything it needs is passed in.
pub fn assemble(config: &ContextConfig, input: ContextInput<'_>) -> Assembled {
    let turns = split_turns(input.messages);
    // Keep whole turns from the end while they fit; the last turn always.
    let mut kept = 0usize;
    let mut used = 0usize;
    for turn in turns.iter().rev() {
        let cost: usize = turn.iter().map(|m| estimate_tokens(&m.content)).sum();
        if kept > 0 && used + cost > config.recent_budget_tokens {
            break;
        }
        used += cost;
        kept += 1;
    }
    let older = &turns[..turns.len() - kept];
    let recent = &turns[turns.len() - kept..];

    // The summary covers every older turn; extend the stored one if older turns go past it.
    let mut summary_text = input.summary.map(|s| s.text.clone());
    let mut new_summary = None;
    if let Some(last_older) = older.last().and_then(|t| t.last()) {
        let covered = input.summary.map(|s| &s.through_message_id);
        let start = match covered {
            Some(id) => older.iter().flatten().position(|m| &m.id == id).map(|i| i + 1).unwrap_or(0),
            None => 0,
        };
        let uncovered: Vec<&Message> = older.iter().flatten().skip(start).copied().collect();
        if !uncovered.is_empty() {
            let mut text = summary_text.clone().unwrap_or_default();
            for m in uncovered {
                let line = match m.role {
                    Role::User => format!("- User asked: {}\n", truncate(&m.content, 160)),
                    Role::Assistant if !m.content.is_empty() => {
                        format!("- Assistant answered: {}\n", truncate(&m.content, 200))
                    }
                    _ => continue,
                };
                text.push_str(&line);
            }
            // Keep the most recent part when it grows past the bound.
            let chars = text.chars().count();
            if chars > config.summary_max_chars {
                text = text.chars().skip(chars - config.summary_max_chars).collect();
            }
            new_summary = Some(Summary {
                conversation_id: last_older.conversation_id.clone(),
                through_message_id: last_older.id.clone(),
                text: text.clone(),
            });
            summary_text = Some(text);
        }
    }

    let mut system = config.system_prompt.clone();
    if !input.facts.is_empty() {
        system.push_str("\n\nConfirmed facts (from validated tool results or the user's confirmation):\n");
        for f in input.facts {
            system.push_str(&format!("- {}: {}\n", f.key, f.value));
        }
    }
    if let Some(text) = &summary_text {
        system.push_str("\n\nSummary of earlier turns:\n");
        system.push_str(text);
    }

    let mut messages = vec![ModelMessage::System { content: system }];
    let recent_messages: Vec<&Message> = recent.iter().flatten().copied().collect();
    messages.extend(to_model_messages(&recent_messages, input.tool_calls));
    Assembled { messages, new_summary }
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
fn to_model_messages(messages: &[&Message], calls: &[ToolCall]) -> Vec<ModelMessage> {
    let mut out: Vec<ModelMessage> = Vec::new();
    let mut assistant_for_block: Option<usize> = None;
    for m in messages {
        match m.role {
            Role::User => {
                assistant_for_block = None;
                out.push(ModelMessage::User { content: m.content.clone() });
            }
            Role::Assistant => {
                assistant_for_block = None;
                out.push(ModelMessage::Assistant { content: m.content.clone(), tool_calls: Vec::new() });
            }
            Role::Tool => {
                let Some(call_id) = &m.tool_call_id else { continue };
                let call = calls.iter().find(|c| &c.id == call_id);
                let name = call.map(|c| c.name.clone()).unwrap_or_default();
                let model_call = ModelToolCall {
                    id: call_id.to_string(),
                    name: name.clone(),
                    arguments: call.map(|c| c.args.clone()).unwrap_or_default(),
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
                out.push(ModelMessage::Tool { call_id: call_id.to_string(), name, content: m.content.clone() });
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
            content: content.to_owned(),
            tool_call_id: call.cloned(),
            created_at: Utc::now(),
        }
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
            name: "restart_instance".into(),
            args: json!({"instanceId": "pay-prod-2"}),
            state: crate::domain::ToolCallState::Succeeded,
            result: None,
            summary: None,
            started_at: None,
            finished_at: None,
        }];
        let facts = vec![Fact {
            key: "instance".into(),
            value: "pay-prod-2".into(),
            source: FactSource::ToolResult,
            updated_at: Utc::now(),
        }];
        let config = ContextConfig { recent_budget_tokens: 600, ..Default::default() };
        let out =
            assemble(&config, ContextInput { messages: &messages, tool_calls: &calls, facts: &facts, summary: None });
        let ModelMessage::System { content } = &out.messages[0] else { panic!("system first") };
        assert!(content.contains("- instance: pay-prod-2"));
        assert!(content.contains("Summary of earlier turns"));
        let summary = out.new_summary.expect("older turns summarised");
        // Bounded, keeping the most recent of the older turns.
        assert!(summary.text.chars().count() <= config.summary_max_chars);
        assert!(summary.text.contains("question 20"), "{}", summary.text);
        assert!(!content.contains("question 0 "));
        // The recent part stays within budget and ends with the current turn, verbatim.
        let recent_tokens: usize = out.messages[1..]
            .iter()
            .map(|m| match m {
                ModelMessage::User { content } | ModelMessage::Assistant { content, .. } => estimate_tokens(content),
                ModelMessage::Tool { content, .. } => estimate_tokens(content),
                ModelMessage::System { .. } => 0,
            })
            .sum();
        assert!(recent_tokens <= 600, "{recent_tokens}");
        assert!(
            matches!(&out.messages[out.messages.len() - 3], ModelMessage::User { content } if content == "restart it")
        );
        assert!(matches!(&out.messages[out.messages.len() - 2],
            ModelMessage::Assistant { tool_calls, .. } if tool_calls[0].name == "restart_instance"));
        // With the summary stored, assembling again adds nothing new to it.
        let again = assemble(
            &config,
            ContextInput { messages: &messages, tool_calls: &calls, facts: &facts, summary: Some(&summary) },
        );
        assert!(again.new_summary.is_none());
    }

    #[test]
    fn short_history_needs_no_summary() {
        let conv = ConversationId::new();
        let messages = vec![msg(&conv, Role::User, "hello", None)];
        let out = assemble(
            &ContextConfig::default(),
            ContextInput { messages: &messages, tool_calls: &[], facts: &[], summary: None },
        );
        assert_eq!(out.messages.len(), 2);
        assert!(out.new_summary.is_none());
    }
}
