//! Keel's HTTP API (v1): axum routes, JSON errors and the SSE encoder, over the engine of
//! `keel-core`. The shapes are those of docs/api.md.
#![forbid(unsafe_code)]

pub mod ag_ui;
pub mod auth;
pub mod error;
pub mod extract;
pub mod host;
pub mod json_error;
pub mod langgraph;
pub mod limits;
pub mod metrics;
pub mod openapi;
pub mod page;
pub mod retention;
pub mod routes;
pub mod sse;
pub mod state;
pub mod views;

use std::future::Future;
use std::pin::pin;

use axum::body::Body;
use axum::extract::DefaultBodyLimit;
use axum::http::Request;
use axum::Router;
use tower::ServiceExt;
use tower_http::trace::{DefaultOnResponse, TraceLayer};
use tracing::Level;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

pub use error::{ApiError, ApiResult};

/// Log directives the binary adds after `RUST_LOG`, whatever it says: these crates log whole
/// WebSocket frames at TRACE, and a frame holds what a client sent (a message, a decision's note),
/// which Keel stores and streams only masked.
pub const QUIET_LOG_TARGETS: &[&str] = &["tungstenite=debug", "tokio_tungstenite=debug"];
pub use metrics::ServerMetrics;
pub use state::{AppState, ServerConfig};

/// The server's routes, with `extra` (routes of an application built on Keel, the demo's say)
/// among the authenticated `/v1` ones. `GET /v1/openapi.json` serves the spec of these routes.
pub fn router(state: AppState, extra: OpenApiRouter<AppState>) -> Router {
    let (public, v1) = api_routes();
    let v1 = v1.merge(extra);
    // `route_layer`: only matched routes authenticate, so an unknown path is a plain 404.
    let v1 = v1.route_layer(axum::middleware::from_fn_with_state(state.clone(), auth::authenticate));
    let (api, mut spec) = public.merge(v1).split_for_parts();
    // LangGraph Server's API, for its SDKs (docs/langgraph.md): not in Keel's OpenAPI spec, which
    // describes Keel's own API.
    let langgraph = langgraph::routes::router()
        .route_layer(axum::middleware::from_fn_with_state(state.clone(), auth::authenticate));
    let api = api.nest("/langgraph", langgraph);
    openapi::finish(&mut spec);
    let _ = state.spec.set(openapi::to_json(&spec));
    let templates = RouteTemplates::new(
        spec.paths
            .paths
            .keys()
            .map(String::as_str)
            .chain(page::PATHS.iter().copied())
            .chain(langgraph::routes::TEMPLATES.iter().copied()),
    );
    api
        .merge(page::routes())
        .fallback(routes::not_found)
        .method_not_allowed_fallback(routes::method_not_allowed)
        .layer(DefaultBodyLimit::max(state.config.body_limit))
        // Before routing, the body and authentication: a refused host runs nothing.
        .layer(axum::middleware::from_fn_with_state(state.clone(), host::check))
        // Outside everything else: a flood from one address costs no store lookup.
        .layer(axum::middleware::from_fn_with_state(state.clone(), limits::limit_address))
        .layer(
            // The span names the route's template (`/v1/runs/{id}`), never the path or the query:
            // an id is the client's to keep out of logs, and `?ticket=` is a credential.
            TraceLayer::new_for_http()
                .make_span_with(move |request: &axum::http::Request<_>| {
                    tracing::info_span!("request", method = %request.method(), route = templates.of(request.uri().path()))
                })
                .on_response(DefaultOnResponse::new().level(Level::INFO)),
        )
        .with_state(state)
}

/// The route templates a request log may name: a path is logged as the template it matches
/// (`/v1/runs/{id}/events`), or as `(no route)`, so no id or secret in a URL reaches the log.
#[derive(Debug, Clone)]
struct RouteTemplates(std::sync::Arc<Vec<Vec<String>>>);

impl RouteTemplates {
    fn new<'a>(templates: impl Iterator<Item = &'a str>) -> Self {
        Self(std::sync::Arc::new(templates.map(|t| t.split('/').map(str::to_owned).collect()).collect()))
    }

    fn of(&self, path: &str) -> String {
        let segments: Vec<&str> = path.split('/').collect();
        self.0
            .iter()
            .find(|t| {
                t.len() == segments.len()
                    && t.iter().zip(&segments).all(|(t, s)| (t.starts_with('{') && !s.is_empty()) || t == s)
            })
            .map(|t| t.join("/"))
            .unwrap_or_else(|| "(no route)".to_owned())
    }
}

/// The API's routes, each registered with its OpenAPI operation, so none is served without a spec:
/// the ones anyone may call, and the `/v1` ones behind authentication ([`router`] adds it).
pub fn api_routes() -> (OpenApiRouter<AppState>, OpenApiRouter<AppState>) {
    use routes::{ag_ui, agents, conversations, health, metrics, runs, ws};
    let public = OpenApiRouter::new()
        .routes(routes!(health::healthz))
        .routes(routes!(health::readyz))
        .routes(routes!(metrics::metrics))
        .routes(routes!(openapi::openapi_json));
    let v1 = OpenApiRouter::new()
        .routes(routes!(agents::list))
        .routes(routes!(conversations::create, conversations::list))
        .routes(routes!(conversations::get))
        .routes(routes!(conversations::post_message))
        .routes(routes!(runs::list))
        .routes(routes!(runs::get))
        .routes(routes!(runs::events))
        .routes(routes!(runs::resume))
        .routes(routes!(runs::tool_result))
        .routes(routes!(runs::cancel))
        .routes(routes!(runs::stream_ticket))
        .routes(routes!(ag_ui::run))
        .routes(routes!(ag_ui::run_agent))
        .routes(routes!(ws::ws))
        .routes(routes!(ws::ticket));
    (public, v1)
}

/// Serves the API on `listener` until `shutdown` resolves; then stops accepting, ends the open
/// event streams and waits for in-flight requests. The caller shuts the engine down afterwards.
///
/// HTTP/1.1, as `axum::serve` did (axum is built without HTTP/2), but with hyper's HTTP/1
/// connection made directly: `axum::serve` goes through hyper-util's auto-detecting builder, which
/// reads a connection's first bytes on their own to look for the HTTP/2 preface; hyper's next read
/// then doubled its 8 KiB read buffer to 16 KiB, kept for as long as the connection is open.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: AppState,
    extra: OpenApiRouter<AppState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let stopping = state.shutdown.clone();
    let app = router(state, extra);
    let http = hyper::server::conn::http1::Builder::new();
    // Every connection task holds a receiver; `closed()` resolves once the last one is done.
    let (open_tx, open_rx) = tokio::sync::watch::channel(());
    let mut shutdown = pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut shutdown => break,
        };
        let (tcp, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) if reset_before_accepted(&e) => continue,
            Err(e) => {
                // Out of file descriptors, say: accepting again at once would spin. As axum::serve
                // did, wait a second (or for the stop).
                tracing::error!(error = %e, "accepting a connection failed");
                tokio::select! {
                    () = tokio::time::sleep(std::time::Duration::from_secs(1)) => continue,
                    () = &mut shutdown => break,
                }
            }
        };
        // Events are small writes: without TCP_NODELAY, Nagle's algorithm meeting the client's
        // delayed ACK holds each one back ~40 ms on a kept-alive connection.
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::warn!(error = %e, "could not set TCP_NODELAY");
        }
        let service = hyper_util::service::TowerToHyperService::new(
            // The socket's peer: what the per-address limit counts by (behind a proxy, the proxy).
            app.clone().map_request(move |request: Request<hyper::body::Incoming>| {
                let mut request = request.map(Body::new);
                request.extensions_mut().insert(axum::extract::ConnectInfo(peer));
                request
            }),
        );
        let connection = http.serve_connection(hyper_util::rt::TokioIo::new(tcp), service).with_upgrades();
        let stopping = stopping.clone();
        let open = open_rx.clone();
        tokio::spawn(async move {
            let mut connection = pin!(connection);
            let result = tokio::select! {
                result = connection.as_mut() => result,
                () = stopping.wait() => {
                    // No new request on this connection; the one in flight is answered.
                    connection.as_mut().graceful_shutdown();
                    connection.await
                }
            };
            if let Err(e) = result {
                tracing::trace!(error = %e, "connection ended with an error");
            }
            drop(open);
        });
    }
    drop(listener);
    // Tells the open event streams to end and every connection to close after its current request.
    stopping.trigger();
    drop(open_rx);
    open_tx.closed().await;
    Ok(())
}

/// A connection the client gave up on before it was accepted: the client's business.
fn reset_before_accepted(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    matches!(e.kind(), ConnectionRefused | ConnectionAborted | ConnectionReset)
}
