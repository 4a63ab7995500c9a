//! The client against a real Keel server (the library's, in this process, over SQLite in a
//! temporary directory): OpsPilot with the demo model, as `keel demo` runs it, and a second agent
//! with suggestions. Agents listed, a conversation made with a chosen agent (and refused for an
//! unknown one), and a decision sent with a note, which the run then shows.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use keel_client::{decision, KeelClient};
use keel_core::clock::{Clock, SystemClock};
use keel_core::{EventKind, InterruptId, RunId, RunStatus};
use keel_runtime::{Agent, Backend, Builder};

/// A served Keel; stopped (gracefully) when dropped with [`Served::stop`].
struct Served {
    base: String,
    stop: tokio::sync::oneshot::Sender<()>,
    server: tokio::task::JoinHandle<Result<(), keel_runtime::KeelError>>,
    _dir: tempfile::TempDir,
}

impl Served {
    async fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let backend = Backend::open(&format!("sqlite://{}", dir.path().join("keel.db").display())).await.unwrap();
        let Backend::Sqlite(sqlite) = &backend else { unreachable!("a SQLite URL") };
        let fleet = Arc::new(keel_opspilot::SqliteFleet::open(sqlite).await.unwrap());
        keel_opspilot::Fleet::seed(
            fleet.as_ref(),
            keel_opspilot::FleetSeed { extra_abnormal: 2, ..Default::default() },
            SystemClock.now(),
        )
        .await
        .unwrap();
        let model = Arc::new(keel_models::DemoModel::new(Duration::ZERO));
        let opspilot = keel_opspilot::agent(fleet, backend.store(), model.clone());
        let helper = Agent::new("helper", "Helper", model, "You answer questions.")
            .unwrap()
            .description("Answers questions; no tools.")
            .suggestions(vec!["What can you do?".into(), "List the services".into()]);
        let keel = Builder::new(backend)
            .agent(opspilot)
            .agent(helper)
            .default_agent(keel_opspilot::AGENT_ID)
            .start()
            .await
            .unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(keel.serve(listener, async {
            let _ = stopped.await;
        }));
        Served { base, stop, server, _dir: dir }
    }

    async fn stop(self) {
        self.stop.send(()).unwrap();
        self.server.await.unwrap().unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_are_listed_and_a_conversation_talks_to_the_one_chosen() {
    let served = Served::start().await;
    let keel = KeelClient::new(&served.base);

    let list = keel.list_agents().await.unwrap();
    let ids: Vec<&str> = list.agents.iter().map(|a| a.id.as_str()).collect();
    assert_eq!(ids, ["opspilot", "helper"], "in the order the server was given them");
    assert_eq!(list.default_agent().map(|a| a.id.as_str()), Some("opspilot"));
    let helper = &list.agents[1];
    assert_eq!((helper.name.as_str(), helper.default), ("Helper", false));
    assert_eq!(helper.description, "Answers questions; no tools.");
    assert_eq!(helper.suggestions, ["What can you do?", "List the services"]);
    assert!(helper.tools.is_empty());
    let opspilot = &list.agents[0];
    assert_eq!(opspilot.suggestions, keel_opspilot::SUGGESTIONS);
    let restart = opspilot.tools.iter().find(|t| t.name == "restart_instance").expect("restart_instance");
    assert!(restart.side_effect, "{restart:?}");

    let chosen = keel.create_conversation_with_agent("with the helper", "helper").await.unwrap();
    assert_eq!(chosen.agent_id.as_deref(), Some("helper"));
    assert_eq!(chosen.title.as_deref(), Some("with the helper"));
    let view = keel.get_conversation(&chosen.id).await.unwrap();
    assert_eq!(view.conversation.agent_id.as_deref(), Some("helper"));
    let default = keel.create_conversation("with the default").await.unwrap();
    assert_eq!(default.agent_id.as_deref(), Some("opspilot"), "no agentId: the default agent");

    let err = keel.create_conversation_with_agent("nobody", "nobody").await.unwrap_err();
    assert_eq!(err.status().map(|s| s.as_u16()), Some(422), "{err}");
    assert_eq!(err.code(), Some("UNKNOWN_AGENT"));
    assert_eq!(
        err.to_string(),
        "HTTP 422 Unprocessable Entity UNKNOWN_AGENT: agentId: this server runs no such agent (GET /v1/agents lists them)"
    );
    served.stop().await;
}

/// A new conversation with OpsPilot, asked to restart an abnormal instance (the fleet has three):
/// the run, and the interrupt it waits at.
async fn ask_to_restart(keel: &KeelClient) -> (RunId, InterruptId) {
    let conv = keel.create_conversation_with_agent("restart", keel_opspilot::AGENT_ID).await.unwrap();
    let sent = keel.send_message(&conv.id, "Restart the abnormal instance of payment-api").await.unwrap();
    let interrupt = until_interrupt(keel, &sent.run_id).await;
    (sent.run_id, interrupt)
}

/// Follows the run until it waits for a decision; returns the interrupt.
async fn until_interrupt(keel: &KeelClient, run_id: &RunId) -> InterruptId {
    let mut events = keel.events(run_id, 0);
    while let Some(event) = tokio::time::timeout(Duration::from_secs(30), events.next()).await.expect("an event") {
        if let EventKind::Interrupt { interrupt_id, .. } = event.unwrap().kind {
            return interrupt_id;
        }
    }
    panic!("the run ended without asking");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_goes_with_its_note_and_the_run_shows_it() {
    let served = Served::start().await;
    let keel = KeelClient::new(&served.base);
    let (run_id, interrupt) = ask_to_restart(&keel).await;

    let note = "checked the dashboard: pay-prod-2 is stuck";
    let accepted = keel.resume_with_note(&run_id, &interrupt, decision::approve(), Some(note)).await.unwrap();
    assert_eq!(accepted.interrupt_id, interrupt);

    let mut resumed = None;
    let mut events = keel.events(&run_id, 0);
    while let Some(event) = tokio::time::timeout(Duration::from_secs(30), events.next()).await.expect("an event") {
        if let EventKind::Resumed { note, resolved_by, .. } = event.unwrap().kind {
            resumed = Some((note.map(|n| n.into_inner()), resolved_by));
        }
    }
    assert_eq!(resumed, Some((Some(note.to_owned()), "demo".to_owned())));
    let run = keel.get_run(&run_id).await.unwrap();
    assert_eq!(run.status, RunStatus::Completed);
    assert_eq!(run.interrupts[0].note.as_ref().map(|n| n.as_str()), Some(note));

    // Without a note, none is recorded.
    let (run_id, interrupt) = ask_to_restart(&keel).await;
    keel.resume_with_note(&run_id, &interrupt, decision::reject(), None).await.unwrap();
    let run = keel.get_run(&run_id).await.unwrap();
    assert_eq!(run.interrupts[0].note, None, "{:?}", run.interrupts);
    assert!(run.interrupts[0].decision.is_some(), "{:?}", run.interrupts);

    // A note the server refuses is its 422, and the decision is not taken.
    let (run_id, interrupt) = ask_to_restart(&keel).await;
    let long = "n".repeat(2001);
    let err = keel.resume_with_note(&run_id, &interrupt, decision::approve(), Some(&long)).await.unwrap_err();
    assert_eq!(err.code(), Some("VALIDATION_FAILED"), "{err}");
    let run = keel.get_run(&run_id).await.unwrap();
    assert_eq!(run.status, RunStatus::Interrupted);
    assert_eq!(run.pending_interrupt.map(|i| i.id), Some(interrupt), "still waiting");
    served.stop().await;
}
