//! Keel's HTTP API (v1): axum routes, JSON errors and the SSE encoder, over the engine of
//! `keel-core`. The shapes are those of DESIGN.md, "The contract, by example".
#![forbid(unsafe_code)]

pub mod ag_ui;
pub mod auth;
pub mod error;
pub mod extract;
pub mod limits;
pub mod metrics;
pub mod page;
pub mod routes;
pub mod sse;
pub mod state;
pub mod views;

use std::future::Future;

use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use axum::Router;
use tower_http::trace::{DefaultOnResponse, TraceLayer};
use tracing::Level;

pub use error::{ApiError, ApiResult};
pub use metrics::ServerMetrics;
pub use state::{AppState, ServerConfig};

pub fn router(state: AppState) -> Router {
    use routes::{ag_ui, conversations, demo, health, metrics, runs, ws};
    let mut v1 = Router::new()
        .route("/v1/conversations", post(conversations::create).get(conversations::list))
        .route("/v1/conversations/{id}", get(conversations::get))
        .route("/v1/conversations/{id}/messages", post(conversations::post_message))
        .route("/v1/runs", get(runs::list))
        .route("/v1/runs/{id}", get(runs::get))
        .route("/v1/runs/{id}/events", get(runs::events))
        .route("/v1/runs/{id}/resume", post(runs::resume))
        .route("/v1/runs/{id}/cancel", post(runs::cancel))
        .route("/v1/runs/{id}/stream-ticket", post(runs::stream_ticket))
        .route("/v1/demo/instances", get(demo::instances))
        .route("/v1/ag-ui", post(ag_ui::run))
        .route("/v1/ag-ui/{agent}", post(ag_ui::run_agent))
        .route("/v1/ws", get(ws::ws))
        .route("/v1/ws/ticket", post(ws::ticket));
    if state.config.demo_mode {
        v1 = v1.route("/v1/demo/reset", post(demo::reset));
    }
    // `route_layer`: only matched routes authenticate, so an unknown path is a plain 404.
    let v1 = v1.route_layer(axum::middleware::from_fn_with_state(state.clone(), auth::authenticate));
    Router::new()
        .route("/healthz", get(health::healthz))
        .route("/readyz", get(health::readyz))
        .route("/metrics", get(metrics::metrics))
        .merge(v1)
        .merge(page::routes())
        .fallback(routes::not_found)
        .method_not_allowed_fallback(routes::method_not_allowed)
        .layer(DefaultBodyLimit::max(state.config.body_limit))
        .layer(
            // The span names the path, never the query: `?ticket=` is a credential.
            TraceLayer::new_for_http()
                .make_span_with(|request: &axum::http::Request<_>| {
                    tracing::info_span!("request", method = %request.method(), path = %request.uri().path())
                })
                .on_response(DefaultOnResponse::new().level(Level::INFO)),
        )
        .with_state(state)
}

/// Serves the API on `listener` until `shutdown` resolves; then stops accepting, ends the open
/// event streams and waits for in-flight requests. The caller shuts the engine down afterwards.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let stopping = state.shutdown.clone();
    let app = router(state);
    // Events are small writes: without TCP_NODELAY, Nagle's algorithm meeting the client's delayed
    // ACK holds each one back ~40 ms on a kept-alive connection.
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::warn!(error = %e, "could not set TCP_NODELAY");
        }
    });
    axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            shutdown.await;
            stopping.trigger();
        })
        .await
}
