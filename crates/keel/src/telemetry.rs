//! Logs and traces. Logs go to stderr as text or JSON (`--log-format`), level from `RUST_LOG`.
//! With `--otlp-endpoint` (`KEEL_OTLP_ENDPOINT`) the same spans are also exported over OTLP/HTTP
//! (protobuf): the engine's `run` span per worker, its `node` spans, and their `model_call` and
//! `tool_call` children, plus the HTTP request spans.
//!
//! A run outlives its workers (it pauses for a human, continues on another instance), so no one
//! process span can be its root. Every `run` span is instead parented on the run's *logical root*:
//! a remote span context made from the run's trace id (stored on `run_started` and the checkpoint),
//! whose span id is the trace id's low 8 bytes. It is never exported; a trace viewer shows the
//! workers of a run side by side in one trace, each with its nodes, model calls and tool calls.

use std::fmt;
use std::time::Duration;

use anyhow::Context as _;
use keel_core::metrics::RunSpanHook;
use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState, TracerProvider};
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing::field::{Field, Visit};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::field::{RecordFields, VisitOutput};
use tracing_subscriber::fmt::format::{DefaultVisitor, Writer};
use tracing_subscriber::fmt::FormatFields;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

use crate::config::{LogFormat, OtlpEndpoint};

/// Keeps the exporter alive; [`Telemetry::shutdown`] sends what is still buffered.
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    pub fn shutdown(self) {
        if let Some(provider) = self.provider {
            if let Err(e) = provider.shutdown_with_timeout(Duration::from_secs(5)) {
                eprintln!("keel: flushing traces failed: {e}");
            }
        }
    }
}

/// Installs the global subscriber. Call outside the async runtime: the OTLP exporter's blocking
/// HTTP client runs on the batch processor's own thread.
pub fn init(format: LogFormat, otlp: Option<&OtlpEndpoint>) -> anyhow::Result<Telemetry> {
    let mut filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    for directive in keel_server::QUIET_LOG_TARGETS {
        filter = filter.add_directive(directive.parse().context("a built-in log directive")?);
    }
    // Colours only for a terminal, and not there either when NO_COLOR is set (no-color.org: any
    // non-empty value): a file or a pipe gets plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let logs = tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_ansi(ansi);
    let logs = match format {
        LogFormat::Json => logs.json().boxed(),
        LogFormat::Text if !ansi => logs.fmt_fields(PlainFields).boxed(),
        LogFormat::Text => logs.boxed(),
    };
    let provider = match otlp {
        Some(endpoint) => Some(otlp_provider(endpoint)?),
        None => None,
    };
    let traces = provider
        .as_ref()
        .map(|p| tracing_opentelemetry::layer().with_tracer(p.tracer("keel")).with_tracked_inactivity(false));
    tracing_subscriber::registry().with(filter).with(logs).with(traces).init();
    Ok(Telemetry { provider })
}

/// The text log's fields exactly as tracing-subscriber's default writes them without colours
/// (`name=value`, a string quoted and escaped as `Debug` does, the message bare), with less
/// formatting machinery: a string with nothing to escape is copied as it is (the default sends each
/// one through `Debug`, a character at a time), and a name and its `=` are copied, not formatted
/// through the colour wrappers. Every span's fields (`node`, `route`, `run_id`, …) are written so;
/// they were ~2% of a HITL run's instructions.
struct PlainFields;

impl<'writer> FormatFields<'writer> for PlainFields {
    fn format_fields<R: RecordFields>(&self, writer: Writer<'writer>, fields: R) -> fmt::Result {
        let mut visitor = PlainVisitor { writer, first: true, result: Ok(()) };
        fields.record(&mut visitor);
        visitor.result
    }
}

struct PlainVisitor<'writer> {
    writer: Writer<'writer>,
    /// Nothing written yet: no space before the next field.
    first: bool,
    result: fmt::Result,
}

impl PlainVisitor<'_> {
    /// A field written not at all: after an error, or the `log` crate's metadata (`log.` fields,
    /// which the default skips).
    fn skips(&self, field: &Field) -> bool {
        self.result.is_err() || field.name().starts_with("log.")
    }

    /// A field the default's own formatting is kept for: the message (written bare) and a raw name
    /// (`r#` cut off).
    fn by_default(field: &Field) -> bool {
        field.name() == "message" || field.name().starts_with("r#")
    }

    /// A field as the default writes it.
    fn default(&mut self, record: impl FnOnce(&mut DefaultVisitor<'_>)) {
        let mut visitor = DefaultVisitor::new(self.writer.by_ref(), self.first);
        record(&mut visitor);
        self.result = visitor.finish();
        self.first = false;
    }

    /// ` name=` (no space before the first field), piece by piece (`write!` would go through
    /// `fmt::write`), then `value`.
    fn write(&mut self, field: &Field, value: impl FnOnce(&mut Writer<'_>) -> fmt::Result) {
        let space = if std::mem::take(&mut self.first) { "" } else { " " };
        let w = &mut self.writer;
        self.result =
            [space, field.name(), "="].into_iter().try_for_each(|piece| w.write_str(piece)).and_then(|()| value(w));
    }
}

/// Written by `Debug` as it is, between quotes: printable ASCII but the quote and the backslash.
fn plain(value: &str) -> bool {
    value.bytes().all(|b| (b' '..=b'~').contains(&b) && b != b'"' && b != b'\\')
}

impl Visit for PlainVisitor<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        if self.skips(field) {
            return;
        }
        if Self::by_default(field) || !plain(value) {
            self.default(|v| v.record_str(field, value));
        } else {
            self.write(field, |w| ["\"", value, "\""].into_iter().try_for_each(|piece| w.write_str(piece)));
        }
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        if !self.skips(field) {
            self.default(|v| v.record_error(field, value));
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if self.skips(field) {
            return;
        }
        if Self::by_default(field) {
            self.default(|v| v.record_debug(field, value));
        } else {
            // the default's `name=value`, without its colour wrappers around the name and the `=`
            self.write(field, |w| w.write_fmt(format_args!("{value:?}")));
        }
    }
}

fn otlp_provider(endpoint: &OtlpEndpoint) -> anyhow::Result<SdkTracerProvider> {
    use opentelemetry_otlp::WithExportConfig;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_endpoint(endpoint.0.clone())
        .with_timeout(Duration::from_secs(10))
        .build()
        .with_context(|| format!("building the OTLP exporter for {endpoint:?}"))?;
    let resource = opentelemetry_sdk::Resource::builder().with_service_name("keel").build();
    Ok(SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource).build())
}

/// The engine's hook: parents each `run` span on its run's logical root, so all of a run's
/// workers share its trace id.
pub fn run_span_hook() -> RunSpanHook {
    RunSpanHook::new(|span, trace_id| {
        let Some(root) = logical_root(trace_id) else {
            tracing::warn!(trace_id, "not a W3C trace id; the run's spans start a trace of their own");
            return;
        };
        let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(root));
    })
}

/// The never-exported span a run's worker spans hang from: `trace_id`, span id = its low 8 bytes.
pub fn logical_root(trace_id: &str) -> Option<SpanContext> {
    let id = TraceId::from_hex(trace_id).ok().filter(|id| *id != TraceId::INVALID)?;
    let low: [u8; 8] = id.to_bytes()[8..].try_into().ok()?;
    let span_id = Some(SpanId::from_bytes(low)).filter(|s| *s != SpanId::INVALID)?;
    Some(SpanContext::new(id, span_id, TraceFlags::SAMPLED, true, TraceState::default()))
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::Arc;

    use keel_core::bus::LocalBus;
    use keel_core::clock::SystemClock;
    use keel_core::engine::{Engine, EngineConfig, EngineParts, ResumeRequest, SendMessage};
    use keel_core::store::Store;
    use keel_core::{EventKind, RunStatus, UserRole};
    use keel_models::DemoModel;
    use keel_store::SqliteStore;
    use opentelemetry_sdk::trace::{InMemorySpanExporter, SpanData};

    use super::*;

    const SECRET: &str = "hunter2-sk-live-0123456789";

    fn attr(span: &SpanData, key: &str) -> Option<String> {
        span.attributes.iter().find(|kv| kv.key.as_str() == key).map(|kv| kv.value.as_str().into_owned())
    }

    /// What a layer with `fields` writes for spans and events with every kind of field, without
    /// colours or times.
    fn log_lines<F>(fields: F) -> String
    where
        F: for<'w> FormatFields<'w> + Send + Sync + 'static,
    {
        #[derive(Clone, Default)]
        struct Buffer(Arc<std::sync::Mutex<Vec<u8>>>);
        impl std::io::Write for Buffer {
            fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(bytes);
                Ok(bytes.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buffer = Buffer::default();
        let out = buffer.clone();
        let layer = tracing_subscriber::fmt::layer()
            .with_ansi(false)
            .without_time()
            .with_writer(move || out.clone())
            .fmt_fields(fields);
        let subscriber = tracing_subscriber::registry().with(layer);
        tracing::subscriber::with_default(subscriber, || {
            let error = std::io::Error::other("disk full");
            let span = tracing::info_span!("request", method = %"POST", route = "/v1/runs/{id}/resume", n = 3_u64);
            let _entered = span.enter();
            let inner = tracing::info_span!("node", node = "model", quoted = "say \"hi\"", r#type = "raw");
            let _inner = inner.enter();
            tracing::info!(plain = "a b", escaped = "tab\there", unicode = "café", flag = true, "the message");
            tracing::warn!(error = &error as &(dyn std::error::Error + 'static), empty = "", "with an error");
            tracing::info!(newline = "two\nlines", number = -4_i64);
        });
        let bytes = buffer.0.lock().unwrap().clone();
        String::from_utf8(bytes).unwrap()
    }

    #[test]
    fn plain_fields_write_what_the_default_writes() {
        let default = log_lines(tracing_subscriber::fmt::format::DefaultFields::new());
        assert_eq!(log_lines(PlainFields), default);
        // the cases above are in it, escaped where they need it
        for expected in
            [r#"route="/v1/runs/{id}/resume""#, r#"quoted="say \"hi\"""#, r#"escaped="tab\there""#, "node=\"model\""]
        {
            assert!(default.contains(expected), "{expected} in {default}");
        }
    }

    /// One run that pauses for approval and continues, traced into the SDK's in-memory exporter
    /// through the same layer and hook the binary installs.
    #[tokio::test]
    async fn one_run_is_one_trace_of_runs_nodes_model_and_tool_calls() {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder().with_simple_exporter(exporter.clone()).build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_subscriber::EnvFilter::new("info"))
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("keel")).with_tracked_inactivity(false));
        // Global, as in the binary: spans entered on the SQLite driver's threads are released through
        // the global default (a thread-local default would leave them open forever). This is the only
        // test of this binary that installs a subscriber; spans of other tests are told apart below
        // by their trace id.
        tracing::subscriber::set_global_default(subscriber).expect("the only subscriber of this test binary");

        let dir = tempfile::tempdir().unwrap();
        let sqlite = SqliteStore::open(&dir.path().join("keel.db")).await.unwrap();
        let (agent, _) =
            keel_opspilot::on_sqlite(&sqlite, Arc::new(DemoModel::new(Duration::from_millis(1))), Default::default())
                .await
                .unwrap();
        let store: Arc<dyn Store> = Arc::new(sqlite);
        store.set_user_role("demo", UserRole::Operator).await.unwrap();
        let engine = Engine::new(
            EngineParts {
                store: store.clone(),
                agents: keel_core::agent::Agents::single(agent),
                bus: Arc::new(LocalBus::default()),
                clock: Arc::new(SystemClock),
            },
            EngineConfig { run_span_hook: Some(run_span_hook()), ..EngineConfig::default() },
        );
        let conversation = engine.create_conversation("demo", "trace me", None).await.unwrap();
        // A secret in the user's words: no span may carry it.
        let content = format!("Restart the abnormal instance of payment-api (my token is {SECRET})");
        let started = engine
            .send_message("demo", &conversation.id, SendMessage { content, cancel_on_disconnect: false })
            .await
            .unwrap();
        let run_id = started.run.id.clone();
        let paused = engine.wait_settled(&run_id, 0).await.unwrap();
        let EventKind::Interrupt { interrupt_id, .. } = &paused.last().unwrap().kind else {
            panic!("the run pauses for approval: {:?}", paused.last())
        };
        let request = ResumeRequest {
            interrupt_id: interrupt_id.clone(),
            decision: keel_core::engine::Decision::Approve,
            idempotency_key: "k".into(),
            note: None,
        };
        let accepted = engine.resume("demo", &run_id, request).await.unwrap();
        engine.wait_settled(&run_id, accepted.resumed_sequence - 1).await.unwrap();
        let run = store.get_run(&run_id).await.unwrap().unwrap();
        assert_eq!(run.status, RunStatus::Completed);
        // The trace id: on run_started, on the checkpoint, on every span of the run.
        let EventKind::RunStarted { trace_id: Some(trace_id), .. } = &paused[0].kind else {
            panic!("run_started carries the trace id: {:?}", paused[0])
        };
        assert_eq!(run.checkpoint.trace_id.as_ref(), Some(trace_id));
        // A worker's span closes once its task has ended and every clone of it is dropped (the
        // SQLite driver's threads hold one while they answer a query): poll for both of them.
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        let spans = loop {
            provider.force_flush().unwrap();
            let spans = exporter.get_finished_spans().unwrap();
            let ours = |s: &&SpanData| s.span_context.trace_id().to_string() == *trace_id;
            if spans.iter().filter(ours).filter(|s| s.name == "run").count() == 2 {
                break spans;
            }
            assert!(std::time::Instant::now() < deadline, "both workers' run spans are exported");
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        let root = logical_root(trace_id).unwrap();
        let spans: Vec<SpanData> = spans.into_iter().filter(|s| s.span_context.trace_id() == root.trace_id()).collect();
        let by_id: HashMap<SpanId, &SpanData> = spans.iter().map(|s| (s.span_context.span_id(), s)).collect();
        let parent = |s: &SpanData| by_id.get(&s.parent_span_id).copied();

        // Two workers: one until the pause, one after the approval; both children of the root.
        let runs: Vec<&SpanData> = spans.iter().filter(|s| s.name == "run").collect();
        assert_eq!(runs.len(), 2, "{:?}", spans.iter().map(|s| &s.name).collect::<Vec<_>>());
        for span in &runs {
            assert_eq!(span.span_context.trace_id(), root.trace_id());
            assert_eq!(span.parent_span_id, root.span_id());
            assert!(span.parent_span_is_remote);
            assert_eq!(attr(span, "run_id").as_deref(), Some(run_id.as_str()));
            assert_eq!(attr(span, "trace_id").as_deref(), Some(trace_id.as_str()));
            assert_eq!(attr(span, "outcome").as_deref(), Some("settled"));
        }

        // Nodes hang from a run span; model calls from a model node; tool calls from a tools node.
        let nodes_of = |run: &SpanData| -> Vec<String> {
            let mut nodes: Vec<&SpanData> =
                spans.iter().filter(|s| s.name == "node" && s.parent_span_id == run.span_context.span_id()).collect();
            nodes.sort_by_key(|s| s.start_time);
            nodes.iter().map(|s| attr(s, "node").unwrap()).collect()
        };
        let mut runs = runs;
        runs.sort_by_key(|s| s.start_time);
        let before = nodes_of(runs[0]);
        let after = nodes_of(runs[1]);
        assert_eq!(&before[..2], ["context", "model"], "{before:?}");
        assert_eq!(before.last().map(String::as_str), Some("tools"), "the first worker stops at the pause");
        assert_eq!(after.first().map(String::as_str), Some("tools"), "{after:?}");
        assert_eq!(after.last().map(String::as_str), Some("finalize"), "{after:?}");

        let model_calls: Vec<&SpanData> = spans.iter().filter(|s| s.name == "model_call").collect();
        assert!(model_calls.len() >= 2, "a model call before the pause and one after it");
        for call in &model_calls {
            let node = parent(call).expect("a model call's parent is exported");
            assert_eq!((node.name.as_ref(), attr(node, "node").as_deref()), ("node", Some("model")));
            assert_eq!(attr(call, "outcome").as_deref(), Some("completed"));
            assert!(attr(call, "message_id").unwrap().starts_with("msg_"));
            assert_eq!(call.span_context.trace_id(), root.trace_id());
        }

        let tool_calls: Vec<&SpanData> = spans.iter().filter(|s| s.name == "tool_call").collect();
        let calls = store.list_tool_calls(&run_id).await.unwrap();
        for span in &tool_calls {
            let node = parent(span).expect("a tool call's parent is exported");
            assert_eq!((node.name.as_ref(), attr(node, "node").as_deref()), ("node", Some("tools")));
            assert_eq!(attr(span, "outcome").as_deref(), Some("success"));
            let call_id = attr(span, "call_id").unwrap();
            let call = calls.iter().find(|c| c.id.as_str() == call_id).expect("the span names a stored call");
            assert_eq!(attr(span, "tool"), Some(call.name.clone()));
        }
        let tools: Vec<String> = tool_calls.iter().filter_map(|s| attr(s, "tool")).collect();
        assert!(tools.contains(&"find_abnormal_instances".to_owned()), "{tools:?}");
        assert!(tools.contains(&"restart_instance".to_owned()), "{tools:?}");
        let restart = tool_calls.iter().find(|s| attr(s, "tool").as_deref() == Some("restart_instance")).unwrap();
        let restart_node = parent(restart).unwrap();
        assert_eq!(parent(restart_node).map(|r| r.span_context.span_id()), Some(runs[1].span_context.span_id()));

        // No attribute, and no event recorded inside a span, carries the user's secret.
        for span in &spans {
            let values = span
                .attributes
                .iter()
                .chain(span.events.iter().flat_map(|e| e.attributes.iter()))
                .map(|kv| kv.value.as_str().into_owned());
            for value in values {
                assert!(!value.contains(SECRET) && !value.contains("hunter2"), "{}: {value}", span.name);
            }
            for key in ["args", "result", "content", "decision", "arguments"] {
                assert!(attr(span, key).is_none(), "{} has {key}", span.name);
            }
        }
    }
}
