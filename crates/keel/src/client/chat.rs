//! `keel chat`: a conversation in the terminal, with the server's default agent or the one
//! `--agent` names. Each line is a message; its run streams as it arrives; a dangerous action is
//! asked about; Ctrl-C detaches and leaves the run going.

use anyhow::Context;
use keel_client::{ClientError, KeelClient};
use keel_core::ConversationId;

use super::term::{Input, Renderer};
use super::{connect, detached, follow, ChatArgs, Exit, Followed};

pub async fn run(args: ChatArgs) -> anyhow::Result<Exit> {
    let keel = connect(&args.server)?;
    let mut input = Input::stdin().context("listening for Ctrl-C")?;
    let mut out = Renderer::new();
    let (conversation, agent) = match (&args.conversation, &args.agent) {
        (Some(raw), _) => {
            let id = ConversationId::parse(raw).map_err(|_| anyhow::anyhow!("`{raw}` is not a conversation id"))?;
            let view = keel.get_conversation(&id).await.with_context(|| format!("opening {id}"))?;
            if let Some(active) = &view.active_run_id {
                out.line(&format!("Run {active} is still going here; see it with: keel runs watch {active}"));
            }
            (view.conversation.id, view.conversation.agent_id)
        }
        (None, Some(agent)) => match keel.create_conversation_with_agent("keel chat", agent).await {
            Ok(created) => (created.id, created.agent_id),
            Err(e) if e.code() == Some("UNKNOWN_AGENT") => return Err(unknown_agent(&keel, agent, e).await),
            Err(e) => return Err(e).with_context(|| format!("reaching {}", args.server.server)),
        },
        (None, None) => {
            let created = keel
                .create_conversation("keel chat")
                .await
                .with_context(|| format!("reaching {}", args.server.server))?;
            (created.id, created.agent_id)
        }
    };
    match agent {
        Some(agent) => out.line(&format!("Conversation {conversation} with {agent} on {}.", keel.base_url())),
        None => out.line(&format!("Conversation {conversation} on {}.", keel.base_url())),
    }
    out.line("Type a message and Enter. Ctrl-C detaches from a run (it goes on); Ctrl-D quits.");
    loop {
        out.prompt("you> ");
        let Some(line) = input.line().await else {
            out.line("");
            return Ok(Exit::Done);
        };
        let content = line.trim();
        if content.is_empty() {
            continue;
        }
        let sent = match keel.send_message(&conversation, content).await {
            Ok(sent) => sent,
            // RUN_ACTIVE and other refusals are the user's to read, not the end of the session.
            Err(e) if e.status().is_some_and(|s| s.is_client_error()) => {
                out.line(&format!("  {e}"));
                continue;
            }
            Err(e) => return Err(e).context("sending the message"),
        };
        match follow(&keel, &sent.run_id, 0, &mut input, &mut out).await? {
            // Undecided: the run waits; the next message is refused (RUN_ACTIVE) until someone decides.
            Followed::Ended(_) | Followed::Undecided => {}
            Followed::Detached => {
                detached(&mut out, &sent.run_id);
                return Ok(Exit::Detached);
            }
        }
    }
}

/// `--agent ID` names an agent the server does not run: the server's message, and the ids it does
/// run when it says.
async fn unknown_agent(keel: &KeelClient, agent: &str, e: ClientError) -> anyhow::Error {
    let known = match keel.list_agents().await {
        Ok(list) if !list.agents.is_empty() => {
            let ids: Vec<&str> = list.agents.iter().map(|a| a.id.as_str()).collect();
            format!(" (the server's agents: {})", ids.join(", "))
        }
        _ => String::new(),
    };
    anyhow::Error::new(e).context(format!("--agent {agent}{known}"))
}
