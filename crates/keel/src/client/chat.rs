//! `keel chat`: a conversation in the terminal. Each line is a message; its run streams as it
//! arrives; a dangerous action is asked about; Ctrl-C detaches and leaves the run going.

use anyhow::Context;
use keel_core::ConversationId;

use super::term::{Input, Renderer};
use super::{connect, detached, follow, ChatArgs, Exit, Followed};

pub async fn run(args: ChatArgs) -> anyhow::Result<Exit> {
    let keel = connect(&args.server)?;
    let mut input = Input::stdin().context("listening for Ctrl-C")?;
    let mut out = Renderer::new();
    let conversation = match &args.conversation {
        Some(raw) => {
            let id = ConversationId::parse(raw).map_err(|_| anyhow::anyhow!("`{raw}` is not a conversation id"))?;
            let view = keel.get_conversation(&id).await.with_context(|| format!("opening {id}"))?;
            if let Some(active) = &view.active_run_id {
                out.line(&format!("Run {active} is still going here; see it with: keel runs watch {active}"));
            }
            view.conversation.id
        }
        None => {
            keel.create_conversation("keel chat").await.with_context(|| format!("reaching {}", args.server.server))?.id
        }
    };
    out.line(&format!("Conversation {conversation} on {}.", keel.base_url()));
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
            Followed::Ended(_) => {}
            Followed::Detached => {
                detached(&mut out, &sent.run_id);
                return Ok(Exit::Detached);
            }
        }
    }
}
