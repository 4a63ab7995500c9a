//! Asks OpsPilot to restart the abnormal instance of payment-api, prints the run as it streams, and
//! approves the restart when the run pauses for it.
//!
//! ```sh
//! cargo run -p keel -- demo &                     # a server on 127.0.0.1:8080
//! cargo run -p keel-client --example approve      # KEEL_SERVER / KEEL_API_KEY to point elsewhere
//! ```

use futures::StreamExt;
use keel_client::{decision, ClientError, KeelClient};
use keel_core::EventKind;

#[tokio::main]
async fn main() -> Result<(), ClientError> {
    let server = std::env::var("KEEL_SERVER").unwrap_or_else(|_| "http://127.0.0.1:8080".into());
    let mut keel = KeelClient::new(server);
    if let Ok(key) = std::env::var("KEEL_API_KEY") {
        keel = keel.with_api_key(&key)?;
    }

    let conversation = keel.create_conversation("example: restart with approval").await?;
    let sent = keel.send_message(&conversation.id, "Restart the abnormal instance of payment-api").await?;
    // One stream for the whole run: it stays open while the run waits, and reconnects by itself.
    let mut events = keel.events(&sent.run_id, 0);
    while let Some(event) = events.next().await {
        let event = event?;
        match &event.kind {
            EventKind::TextDelta { delta, .. } => print!("{delta}"),
            EventKind::ToolStarted { tool, args_summary, .. } => println!("\n  → {tool} {args_summary}"),
            EventKind::ToolFinished { tool, summary, .. } => println!("  ✓ {tool}: {summary}"),
            EventKind::Interrupt { interrupt_id, payload, .. } => {
                println!("\n{} — approving", payload["title"].as_str().unwrap_or("A decision is needed"));
                // The client makes the idempotency key, and retries with it if the answer is lost.
                keel.resume(&sent.run_id, interrupt_id, decision::approve()).await?;
            }
            EventKind::Done { .. } => println!("\n(done)"),
            _ => {}
        }
    }
    let run = keel.get_run(&sent.run_id).await?;
    for interrupt in &run.interrupts {
        println!(
            "interrupt {}: {} by {} at {}",
            interrupt.id,
            interrupt.status,
            interrupt.resolved_by.as_deref().unwrap_or("-"),
            interrupt.resolved_at.map(|t| t.to_rfc3339()).unwrap_or_default()
        );
    }
    Ok(())
}
