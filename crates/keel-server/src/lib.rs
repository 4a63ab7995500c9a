//! Keel's HTTP API (v1): axum routes, JSON errors and the SSE encoder, over the engine of
//! `keel-core`. The shapes are those of DESIGN.md, "The contract, by example".
#![forbid(unsafe_code)]

pub mod ag_ui;
pub mod auth;
pub mod error;
pub mod extract;
pub mod limits;
pub mod metrics;
pub mod openapi;
pub mod page;
pub mod routes;
pub mod sse;
pub mod state;
pub mod views;

use std::future::Future;

use axum::extract::DefaultBodyLimit;
use axum::Router;
use tower_http::trace::{DefaultOnResponse, TraceLayer};
use tracing::Level;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

pub use error::{ApiError, ApiResult};
pub use metrics::ServerMetrics;
pub use state::{AppState, ServerConfig};

pub fn router(state: AppState) -> Router {
    let (public, v1) = api_routes(state.config.demo_mode);
    // `route_layer`: only matched routes authenticate, so an unknown path is a plain 404.
    let v1 = v1.route_layer(axum::middleware::from_fn_with_state(state.clone(), auth::authenticate));
    let (api, _) = public.merge(v1).split_for_parts();
    api
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

/// The API's routes, each registered with its OpenAPI operation, so none is served without a spec:
/// the ones anyone may call, and the `/v1` ones behind authentication ([`router`] adds it).
/// `/v1/demo/reset` is routed only in demo mode; the spec ([`openapi::spec`]) has it always.
pub fn api_routes(demo_mode: bool) -> (OpenApiRouter<AppState>, OpenApiRouter<AppState>) {
    use routes::{ag_ui, conversations, demo, health, metrics, runs, ws};
    let public = OpenApiRouter::new()
        .routes(routes!(health::healthz))
        .routes(routes!(health::readyz))
        .routes(routes!(metrics::metrics))
        .routes(routes!(openapi::openapi_json));
    let mut v1 = OpenApiRouter::new()
        .routes(routes!(conversations::create, conversations::list))
        .routes(routes!(conversations::get))
        .routes(routes!(conversations::post_message))
        .routes(routes!(runs::list))
        .routes(routes!(runs::get))
        .routes(routes!(runs::events))
        .routes(routes!(runs::resume))
        .routes(routes!(runs::cancel))
        .routes(routes!(runs::stream_ticket))
        .routes(routes!(demo::instances))
        .routes(routes!(ag_ui::run))
        .routes(routes!(ag_ui::run_agent))
        .routes(routes!(ws::ws))
        .routes(routes!(ws::ticket));
    if demo_mode {
        v1 = v1.routes(routes!(demo::reset));
    }
    (public, v1)
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
    // `into_make_service` turns the routes into services once; `axum::serve(listener, app)` would
    // rebuild the whole route table for every connection (~18 KiB each, held while it is open).
    axum::serve(listener, app.into_make_service())
        .with_graceful_shutdown(async move {
            shutdown.await;
            stopping.trigger();
        })
        .await
}
