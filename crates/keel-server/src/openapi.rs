//! The OpenAPI 3.1 spec of the HTTP API, generated from the code: every route is registered with
//! its `#[utoipa::path]` operation ([`crate::api_routes`]), and the bodies are the types the
//! handlers serialize. `GET /v1/openapi.json` serves it; `docs/openapi.json` is the committed copy,
//! and `tests/openapi.rs` fails when the two differ.

use std::sync::LazyLock;

use axum::http::header::CONTENT_TYPE;
use axum::http::HeaderValue;
use axum::response::{IntoResponse, Response};
use keel_core::EventKind;
use utoipa::openapi::path::Operation;
use utoipa::openapi::schema::{ObjectBuilder, Schema, Type};
use utoipa::openapi::security::{ApiKey, ApiKeyValue, HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::{ContentBuilder, HeaderBuilder, OpenApi, Ref, RefOr, ResponseBuilder};
use utoipa::OpenApi as _;

use crate::views::ErrorBody;

#[derive(utoipa::OpenApi)]
#[openapi(
    info(
        title = "Keel API",
        description = "The v1 HTTP API of Keel, a durable runtime for AI agents. docs/api.md is the prose \
                       contract; this spec is generated from the code.\n\n\
                       Every `/v1` operation takes `Authorization: Bearer <api key>` (a server with no keys, on \
                       a loopback address, acts for its one local user instead). A run's event stream and the \
                       WebSocket also take a single-use `?ticket=`. Any `/v1` operation may answer 401 \
                       `UNAUTHENTICATED`, 429 `RATE_LIMITED` (with `Retry-After`), 503 `SHUTTING_DOWN` or \
                       `OVERLOADED` (with `Retry-After`) and 500 `INTERNAL`; every error is \
                       `{\"error\": {\"code\", \"message\"}}`.",
        license(name = "Apache-2.0", identifier = "Apache-2.0"),
    ),
    security(("bearer" = [])),
    components(schemas(ErrorBody)),
    modifiers(&SecuritySchemes),
    tags(
        (name = "conversations", description = "Conversations and the messages that start runs"),
        (name = "runs", description = "Runs: state, events, resume, cancel"),
        (name = "streams", description = "AG-UI over SSE and the WebSocket"),
        (name = "operations", description = "Health, readiness, metrics and this spec; no authentication"),
    )
)]
struct ApiDoc;

struct SecuritySchemes;

impl utoipa::Modify for SecuritySchemes {
    fn modify(&self, openapi: &mut OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        let bearer = HttpBuilder::new()
            .scheme(HttpAuthScheme::Bearer)
            .description(Some("An API key, `keel_…` (`keel users add`)."))
            .build();
        components.add_security_scheme("bearer", SecurityScheme::Http(bearer));
        let ticket = ApiKeyValue::with_description(
            "ticket",
            "A single-use stream ticket, `kst_…`, from `POST /v1/runs/{id}/stream-ticket` or `POST /v1/ws/ticket`.",
        );
        components.add_security_scheme("ticket", SecurityScheme::ApiKey(ApiKey::Query(ticket)));
    }
}

/// The spec of the whole v1 API, demo-only routes included.
pub fn spec() -> OpenApi {
    let (public, v1) = crate::api_routes();
    let mut openapi = public.merge(v1).into_openapi();
    finish(&mut openapi);
    openapi
}

/// The spec of a router's routes: the document's own parts, and the responses every operation
/// shares.
pub(crate) fn finish(openapi: &mut OpenApi) {
    let mut full = ApiDoc::openapi();
    full.merge(std::mem::take(openapi));
    add_common_responses(&mut full);
    *openapi = full;
}

/// As served and committed: pretty-printed, keys in a stable order, with a final newline.
pub fn to_json(openapi: &OpenApi) -> String {
    let mut json = serde_json::to_string_pretty(openapi).expect("the OpenAPI spec serializes");
    json.push('\n');
    json
}

/// [`spec`], the core API's (what `docs/openapi.json` holds), as JSON.
pub fn spec_json() -> &'static str {
    static JSON: LazyLock<String> = LazyLock::new(|| to_json(&spec()));
    &JSON
}

/// What the middleware in front of `/v1` and the failure paths every handler shares can answer,
/// added to each operation once here rather than in every annotation.
fn add_common_responses(openapi: &mut OpenApi) {
    for (path, item) in openapi.paths.paths.iter_mut() {
        let authenticated = path.starts_with("/v1/") && path != "/v1/openapi.json";
        let operations = [
            &mut item.get,
            &mut item.put,
            &mut item.post,
            &mut item.delete,
            &mut item.options,
            &mut item.head,
            &mut item.patch,
            &mut item.trace,
        ];
        for operation in operations.into_iter().flatten() {
            if authenticated {
                add_error(
                    operation,
                    "401",
                    "`UNAUTHENTICATED`: a missing, unknown or revoked API key; `INVALID_TICKET`: a bad stream ticket",
                );
                add_error(
                    operation,
                    "503",
                    "`SHUTTING_DOWN`: the server is stopping; retry on another instance; `OVERLOADED`: too many \
                     writes are waiting, nothing was written; retry after `Retry-After`",
                );
            }
            add_rate_limited(operation, authenticated);
            add_error(operation, "500", "`INTERNAL`: the cause is in the server's log, never in the answer");
        }
    }
}

fn error_content() -> utoipa::openapi::Content {
    ContentBuilder::new().schema(Some(RefOr::Ref(Ref::from_schema_name("ErrorBody")))).build()
}

fn add_error(operation: &mut Operation, status: &str, description: &str) {
    let responses = &mut operation.responses.responses;
    if !responses.contains_key(status) {
        let response = ResponseBuilder::new().description(description).content("application/json", error_content());
        responses.insert(status.to_owned(), RefOr::T(response.build()));
    }
}

/// Every request counts against its client address's rate (before authentication); an
/// authenticated one against its user's too.
fn add_rate_limited(operation: &mut Operation, authenticated: bool) {
    let retry_after = HeaderBuilder::new()
        .schema(ObjectBuilder::new().schema_type(Type::Integer))
        .description(Some("Seconds to wait (with `RATE_LIMITED`)."))
        .build();
    let description = if authenticated {
        "`RATE_LIMITED`: over the client address's or the caller's request rate (see `Retry-After`); \
         `TOO_MANY_STREAMS` on a stream"
    } else {
        "`RATE_LIMITED`: over the client address's request rate (see `Retry-After`)"
    };
    let response = ResponseBuilder::new()
        .description(description)
        .content("application/json", error_content())
        .header("Retry-After", retry_after);
    operation.responses.responses.insert("429".to_owned(), RefOr::T(response.build()));
}

/// One event of a run's `text/event-stream`, as OpenAPI 3.2 (and schemathesis) read a stream's
/// schema: the fields of the frame. `data` is the [`keel_core::Event`] as one line of JSON.
pub struct RunEventFrame;

impl utoipa::PartialSchema for RunEventFrame {
    fn schema() -> RefOr<Schema> {
        ObjectBuilder::new()
            .description(Some("One SSE event: `id` (the sequence), `event` (the type), `data` (the Event as JSON)"))
            .property("id", ObjectBuilder::new().schema_type(Type::String).pattern(Some("^[1-9][0-9]*$")))
            .required("id")
            .property(
                "event",
                ObjectBuilder::new().schema_type(Type::String).enum_values(Some(EventKind::TYPES.to_vec())),
            )
            .required("event")
            .property("data", json_text("An `Event` (components/schemas/Event)"))
            .required("data")
            .property("retry", ObjectBuilder::new().schema_type(Type::Integer))
            .into()
    }
}

impl utoipa::ToSchema for RunEventFrame {}

/// One event of an AG-UI stream: `data` only, an AG-UI event as JSON (docs/ag-ui.md).
pub struct AgUiEventFrame;

impl utoipa::PartialSchema for AgUiEventFrame {
    fn schema() -> RefOr<Schema> {
        ObjectBuilder::new()
            .description(Some("One SSE event: `data`, an AG-UI event as JSON, with its `type`"))
            .property("data", json_text("An AG-UI event"))
            .required("data")
            .property("retry", ObjectBuilder::new().schema_type(Type::Integer))
            .into()
    }
}

impl utoipa::ToSchema for AgUiEventFrame {}

fn json_text(description: &str) -> ObjectBuilder {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .content_media_type("application/json")
        .description(Some(description))
        .pattern(Some("^\\{.*\\}$"))
}

/// `GET /v1/openapi.json`: no authentication, like `/healthz`.
#[utoipa::path(
    get,
    path = "/v1/openapi.json",
    operation_id = "openapi",
    tag = "operations",
    security(()),
    responses((status = 200, description = "This spec (OpenAPI 3.1)", content_type = "application/json", body = Object))
)]
pub async fn openapi_json(axum::extract::State(state): axum::extract::State<crate::AppState>) -> Response {
    let served = state.spec.get().cloned().unwrap_or_else(|| spec_json().to_owned());
    let mut response = served.into_response();
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}
