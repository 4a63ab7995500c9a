//! `keel-client`'s event stream against the real server when the connection goes away mid-stream:
//! the server killed (SIGKILL) and started again on the same data directory, or every connection
//! cut. Each time the consumer reconnects with `Last-Event-ID` and sees each event once, in order,
//! and what it renders equals what the server stored.
//!
//! The client talks to a small TCP proxy in front of the server, so a restarted server may come
//! back on another port (no port reuse races) and connections can be cut on purpose.

mod support;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use keel_client::{ClientError, KeelClient, ReconnectPolicy};
use keel_core::event::render_text;
use keel_core::{Event, EventKind, Role, RunId, RunStatus};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::AbortHandle;

use support::{eventually, Server, DEADLINE};

const ERRORS_PROMPT: &str = "Look at the recent errors of payment-api";

/// Forwards each connection to the current backend; `cut` drops every open connection.
struct Proxy {
    addr: SocketAddr,
    backend: Arc<Mutex<String>>,
    open: Arc<Mutex<Vec<AbortHandle>>>,
}

impl Proxy {
    async fn start(backend: &str) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let backend = Arc::new(Mutex::new(backend.to_owned()));
        let open = Arc::new(Mutex::new(Vec::<AbortHandle>::new()));
        let (to, conns) = (backend.clone(), open.clone());
        tokio::spawn(async move {
            loop {
                let (mut client, _) = listener.accept().await.unwrap();
                let target = to.lock().unwrap().clone();
                let task = tokio::spawn(async move {
                    // A backend that is down: the client's connection just closes, as it would.
                    if let Ok(mut server) = TcpStream::connect(&target).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                });
                conns.lock().unwrap().push(task.abort_handle());
            }
        });
        Self { addr, backend, open }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn point_to(&self, backend: &str) {
        *self.backend.lock().unwrap() = backend.to_owned();
    }

    fn cut(&self) {
        for conn in self.open.lock().unwrap().drain(..) {
            conn.abort();
        }
    }
}

fn patient() -> ReconnectPolicy {
    ReconnectPolicy {
        max_attempts: 100,
        initial_backoff: Duration::from_millis(20),
        max_backoff: Duration::from_millis(200),
        idle_timeout: Duration::from_secs(10),
    }
}

/// Sends the errors question over `keel` and consumes its run's events on a task of their own;
/// returns the run and the consumer's events as they arrive.
async fn ask_and_consume(keel: &KeelClient) -> (RunId, mpsc::UnboundedReceiver<Result<Event, ClientError>>) {
    let conversation = keel.create_conversation("reconnect").await.unwrap();
    let sent = keel.send_message(&conversation.id, ERRORS_PROMPT).await.unwrap();
    let (tx, rx) = mpsc::unbounded_channel();
    let mut events = keel.events(&sent.run_id, 0);
    tokio::spawn(async move {
        while let Some(event) = events.next().await {
            if tx.send(event).is_err() {
                break;
            }
        }
    });
    (sent.run_id, rx)
}

async fn next(rx: &mut mpsc::UnboundedReceiver<Result<Event, ClientError>>) -> Option<Event> {
    let item = tokio::time::timeout(DEADLINE, rx.recv()).await.expect("an event within the deadline");
    item.map(|r| r.expect("the stream reconnects instead of failing"))
}

/// Each event once, in order, to the terminal one; identical to the server's stored events; the
/// text it renders is the run's stored answer.
async fn assert_seen_once_in_order(keel: &KeelClient, run_id: &RunId, seen: &[Event]) {
    let sequences: Vec<i64> = seen.iter().map(|e| e.sequence).collect();
    assert_eq!(sequences, (1..=seen.len() as i64).collect::<Vec<_>>(), "each event once, in order");
    assert!(matches!(seen.last().unwrap().kind, EventKind::Done { .. }), "{:?}", seen.last());

    let run = keel.get_run(run_id).await.unwrap();
    assert_eq!(run.status, RunStatus::Completed);
    assert_eq!(run.last_sequence, seen.len() as i64, "nothing after the terminal event");
    let stored: Vec<Event> = keel.events(run_id, 0).map(Result::unwrap).collect().await;
    assert_eq!(stored, seen, "the consumer saw exactly what the server stored");

    let conversation = keel.get_conversation(&run.conversation_id).await.unwrap();
    let answer: String = conversation
        .messages
        .iter()
        .filter(|m| m.role == Role::Assistant && m.run_id.as_ref() == Some(run_id))
        .map(|m| m.content.as_str())
        .collect();
    let rendered: String = render_text(seen).into_iter().map(|(_, text)| text).collect();
    assert_eq!(rendered, answer, "nothing drawn twice, nothing missing");
    assert!(answer.contains("payment-api in prod had 12 5xx errors"), "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_and_restarted_mid_stream_is_followed_to_the_end() {
    let dir = tempfile::tempdir().unwrap();
    // 40 ms a word: the answer streams for about a second, time enough to kill the server in it.
    let server = Server::start(dir.path(), 40);
    let proxy = Proxy::start(&server.addr).await;
    let keel = KeelClient::new(proxy.url()).reconnect_policy(patient());
    let (run_id, mut rx) = ask_and_consume(&keel).await;

    let mut seen = Vec::new();
    while let Some(event) = next(&mut rx).await {
        let text = matches!(event.kind, EventKind::TextDelta { .. });
        seen.push(event);
        if text && seen.iter().filter(|e| matches!(e.kind, EventKind::TextDelta { .. })).count() == 3 {
            break;
        }
    }
    server.kill();
    let restarted = Server::start(dir.path(), 1);
    proxy.point_to(&restarted.addr);
    while let Some(event) = next(&mut rx).await {
        seen.push(event);
    }

    assert!(
        seen.iter().any(|e| matches!(e.kind, EventKind::TextDiscarded { .. })),
        "the crash cut the answer off and the restarted server discarded it"
    );
    assert_seen_once_in_order(&keel, &run_id, &seen).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_cut_mid_stream_are_resumed_without_a_duplicate() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), 20);
    let proxy = Proxy::start(&server.addr).await;
    let keel = KeelClient::new(proxy.url()).reconnect_policy(patient());
    let (run_id, mut rx) = ask_and_consume(&keel).await;

    let mut seen = Vec::new();
    let mut cuts = 0;
    while let Some(event) = next(&mut rx).await {
        // cut every connection after the 2nd, 5th and 8th text delta
        if matches!(event.kind, EventKind::TextDelta { .. }) {
            let deltas = seen.iter().filter(|e: &&Event| matches!(e.kind, EventKind::TextDelta { .. })).count() + 1;
            if [2, 5, 8].contains(&deltas) {
                proxy.cut();
                cuts += 1;
            }
        }
        seen.push(event);
    }
    assert_eq!(cuts, 3);
    assert_seen_once_in_order(&keel, &run_id, &seen).await;
    drop(server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finished_run_replays_once_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), 1);
    let keel = KeelClient::new(server.url());
    let (run_id, mut rx) = ask_and_consume(&keel).await;
    let mut seen = Vec::new();
    while let Some(event) = next(&mut rx).await {
        seen.push(event);
    }
    server.kill();
    let restarted = Server::start(dir.path(), 1);
    let keel = KeelClient::new(restarted.url());
    let run = eventually("the restarted server answers", || async { keel.get_run(&run_id).await.ok() }).await;
    assert_eq!(run.last_sequence, seen.len() as i64);
    assert_seen_once_in_order(&keel, &run_id, &seen).await;
}
