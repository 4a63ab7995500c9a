//! A harness for library-level tests: a real SQLite file in a temp dir, the real engine, the
//! OpsPilot tools and the demo model (or a scripted one), and a clock the test moves.
#![allow(dead_code)]

use std::collections::VecDeque;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use keel_core::agent::{Agent, Agents};
use keel_core::bus::{Bus, LocalBus};
use keel_core::clock::ManualClock;
use keel_core::engine::{Decision, Engine, EngineConfig, EngineParts, ResumeAccepted, ResumeRequest, SendMessage};
use keel_core::event::render_text;
use keel_core::model::{Model, ModelChunk, ModelError, ModelRequest, ModelStream, ModelToolCall};
use keel_core::store::{RunStore, Store};
use keel_core::tool::ToolRegistry;
use keel_core::{ConversationId, Event, EventKind, InterruptId, RunId, UserRole};
use keel_models::DemoModel;
use keel_opspilot::{Fleet, FleetSeed, SqliteFleet};
use keel_store::SqliteStore;
use serde_json::Value;

pub struct Harness {
    pub store: Arc<dyn Store>,
    pub fleet: Arc<dyn Fleet>,
    pub engine: Engine,
    pub clock: Arc<ManualClock>,
    pub bus: Arc<RecordingBus>,
}

/// The local bus, and what was published on it: the engine publishes each commit's events once
/// they are written, in one call, so each call is one commit.
#[derive(Default)]
pub struct RecordingBus {
    inner: LocalBus,
    published: Mutex<Vec<Vec<Event>>>,
    /// How many publishes there were: what [`RecordingBus::until`] waits on.
    count: tokio::sync::watch::Sender<usize>,
}

impl RecordingBus {
    /// Waits (up to 20 s, else panics with `what`) until the commits of `run` satisfy `check`.
    pub async fn until(&self, what: &str, run: &RunId, check: impl Fn(&[Vec<&'static str>]) -> bool) {
        let mut published = self.count.subscribe();
        let waited = tokio::time::timeout(Duration::from_secs(20), published.wait_for(|_| check(&self.commits(run))));
        assert!(matches!(waited.await, Ok(Ok(_))), "timed out waiting until {what}");
    }

    /// The event types of each commit of `run`, in order.
    pub fn commits(&self, run: &RunId) -> Vec<Vec<&'static str>> {
        let published = self.published.lock().unwrap();
        published
            .iter()
            .filter(|events| events.first().is_some_and(|e| &e.run_id == run))
            .map(|events| events.iter().map(Event::type_name).collect())
            .collect()
    }
}

impl Bus for RecordingBus {
    fn publish(&self, events: &[Event]) {
        self.published.lock().unwrap().push(events.to_vec());
        self.count.send_modify(|n| *n += 1);
        self.inner.publish(events);
    }

    fn subscribe(&self, run_id: &RunId) -> tokio::sync::broadcast::Receiver<Arc<Event>> {
        self.inner.subscribe(run_id)
    }
}

/// Builds an agent's tools over the fleet and Keel's records (OpsPilot's, or wrapped ones).
pub type Tools = Arc<dyn Fn(Arc<dyn Fleet>, Arc<dyn RunStore>) -> ToolRegistry + Send + Sync>;

/// OpsPilot's own tools.
pub fn opspilot() -> Tools {
    Arc::new(keel_opspilot::registry)
}

pub struct Options {
    pub model: Arc<dyn Model>,
    pub tools: Tools,
    pub extra_abnormal: u32,
    pub config: EngineConfig,
    /// The agent's context settings (its system prompt, budget, summaries).
    pub context: keel_core::context::ContextConfig,
}

/// OpsPilot's system prompt and the default budget.
pub fn opspilot_context() -> keel_core::context::ContextConfig {
    keel_core::context::ContextConfig { system_prompt: keel_opspilot::SYSTEM_PROMPT.into(), ..Default::default() }
}

impl Default for Options {
    fn default() -> Self {
        Self {
            model: Arc::new(DemoModel::new(Duration::ZERO)),
            tools: opspilot(),
            extra_abnormal: 0,
            config: engine_config(),
            context: opspilot_context(),
        }
    }
}

pub fn engine_config() -> EngineConfig {
    EngineConfig {
        steal_leases_on_start: true,
        poll_interval: Some(Duration::from_millis(50)),
        sweep_interval: Duration::from_millis(200),
        ..Default::default()
    }
}

impl Harness {
    /// A fresh database with the seeded fleet.
    pub async fn new(dir: &Path, options: Options) -> Self {
        let clock = Arc::new(ManualClock::default());
        let h = Self::open_with(dir, clock, options.model, options.tools, options.config, options.context).await;
        h.fleet
            .seed(FleetSeed { extra_abnormal: options.extra_abnormal, ..Default::default() }, h.clock_now())
            .await
            .unwrap();
        h.store.set_user_role("demo", UserRole::Operator).await.unwrap();
        h
    }

    /// Opens (or reopens) the database in `dir`; recovers what a previous engine left.
    pub async fn open(dir: &Path, clock: Arc<ManualClock>, model: Arc<dyn Model>, tools: Tools) -> Self {
        Self::open_with(dir, clock, model, tools, engine_config(), opspilot_context()).await
    }

    pub async fn open_with(
        dir: &Path,
        clock: Arc<ManualClock>,
        model: Arc<dyn Model>,
        tools: Tools,
        config: EngineConfig,
        context: keel_core::context::ContextConfig,
    ) -> Self {
        let sqlite = SqliteStore::open(&dir.join("keel.db")).await.unwrap();
        let fleet: Arc<dyn Fleet> = Arc::new(SqliteFleet::open(&sqlite).await.unwrap());
        let store: Arc<dyn Store> = Arc::new(sqlite);
        let agent = Agent::new(keel_opspilot::AGENT_ID, "OpsPilot", model, keel_opspilot::SYSTEM_PROMPT)
            .unwrap()
            .tools(tools(fleet.clone(), store.clone()))
            .context(context);
        let bus = Arc::new(RecordingBus::default());
        let engine = Engine::new(
            EngineParts { store: store.clone(), agents: Agents::single(agent), bus: bus.clone(), clock: clock.clone() },
            config,
        );
        engine.start().await.unwrap();
        Self { store, fleet, engine, clock, bus }
    }

    pub fn clock_now(&self) -> chrono::DateTime<chrono::Utc> {
        use keel_core::clock::Clock;
        self.clock.now()
    }

    pub async fn conversation(&self) -> ConversationId {
        self.engine.create_conversation("demo", "test", None).await.unwrap().id
    }

    /// Sends a message as `demo` and waits until the run pauses or ends.
    pub async fn say(&self, conv: &ConversationId, text: &str) -> (RunId, Vec<Event>) {
        self.say_as("demo", conv, text).await
    }

    pub async fn say_as(&self, user: &str, conv: &ConversationId, text: &str) -> (RunId, Vec<Event>) {
        let started = self
            .engine
            .send_message(user, conv, SendMessage { content: text.into(), cancel_on_disconnect: false })
            .await
            .unwrap();
        let events = self.settle(&started.run.id, 0).await;
        (started.run.id, events)
    }

    /// Waits (with a deadline) until the run pauses or ends; its events after `after`.
    pub async fn settle(&self, run: &RunId, after: i64) -> Vec<Event> {
        tokio::time::timeout(Duration::from_secs(20), self.engine.wait_settled(run, after))
            .await
            .expect("run settles within 20 s")
            .unwrap()
    }

    pub async fn resume(
        &self,
        run: &RunId,
        interrupt: &InterruptId,
        decision: Value,
        key: &str,
    ) -> Result<ResumeAccepted, keel_core::engine::EngineError> {
        self.engine
            .resume(
                "demo",
                run,
                ResumeRequest {
                    interrupt_id: interrupt.clone(),
                    decision: Decision::parse(&decision).map_err(keel_core::engine::EngineError::InvalidDecision)?,
                    idempotency_key: key.into(),
                    note: None,
                },
            )
            .await
    }

    /// Resumes and waits for the run to pause or end; the events from `resumed` on.
    pub async fn decide(&self, run: &RunId, interrupt: &InterruptId, decision: Value) -> Vec<Event> {
        let key = format!("key-{}", uuid_ish());
        let accepted = self.resume(run, interrupt, decision, &key).await.unwrap();
        self.settle(run, accepted.resumed_sequence - 1).await
    }

    pub async fn all_events(&self, run: &RunId) -> Vec<Event> {
        self.store.list_events(run, 0, 10_000).await.unwrap()
    }

    pub async fn restart_count(&self, instance: &str) -> i64 {
        self.fleet.instance(instance).await.unwrap().unwrap().restart_count
    }

    pub async fn instance_status(&self, instance: &str) -> String {
        self.fleet.instance(instance).await.unwrap().unwrap().status
    }
}

fn uuid_ish() -> String {
    keel_core::RunId::new().as_str().trim_start_matches("run_").to_owned()
}

/// The interrupt event of a list of events.
pub fn interrupt_of(events: &[Event]) -> (InterruptId, Value) {
    events
        .iter()
        .find_map(|e| match &e.kind {
            EventKind::Interrupt { interrupt_id, payload, .. } => Some((interrupt_id.clone(), payload.inner().clone())),
            _ => None,
        })
        .expect("an interrupt event")
}

/// The text a client renders from these events, all messages joined.
pub fn text(events: &[Event]) -> String {
    render_text(events).into_iter().map(|(_, t)| t).collect::<Vec<_>>().join("")
}

pub fn last_type(events: &[Event]) -> &'static str {
    events.last().map(|e| e.type_name()).unwrap_or("none")
}

/// Sequences 1..=n with no gap and no duplicate.
pub fn assert_contiguous(events: &[Event]) {
    for (i, e) in events.iter().enumerate() {
        assert_eq!(e.sequence, i as i64 + 1, "event {i} ({}) has sequence {}", e.type_name(), e.sequence);
    }
}

/// One model call of a script: its text and its tool calls as (id, name, arguments).
pub type ScriptStep<'a> = (&'a str, Vec<(&'a str, &'a str, Value)>);

/// A model that plays back a script: each call takes the next step; when the script is done it
/// answers "ok".
pub struct ScriptedModel {
    steps: Mutex<VecDeque<(String, Vec<ModelToolCall>)>>,
}

impl ScriptedModel {
    pub fn new(steps: Vec<ScriptStep<'_>>) -> Self {
        Self {
            steps: Mutex::new(
                steps
                    .into_iter()
                    .map(|(text, calls)| {
                        (
                            text.to_owned(),
                            calls
                                .into_iter()
                                .map(|(id, name, arguments)| ModelToolCall {
                                    id: id.into(),
                                    name: name.into(),
                                    arguments,
                                })
                                .collect(),
                        )
                    })
                    .collect(),
            ),
        }
    }
}

#[async_trait]
impl Model for ScriptedModel {
    fn name(&self) -> &str {
        "scripted"
    }
    async fn stream(&self, _request: ModelRequest) -> Result<ModelStream, ModelError> {
        let (text, calls) = self.steps.lock().unwrap().pop_front().unwrap_or_else(|| ("ok".into(), vec![]));
        let mut chunks = vec![Ok(ModelChunk::Text(text))];
        chunks.extend(calls.into_iter().map(|c| Ok(ModelChunk::ToolCall(c))));
        Ok(Box::pin(futures::stream::iter(chunks)))
    }
}
