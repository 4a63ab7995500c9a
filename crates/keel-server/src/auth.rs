//! Who is calling: API keys (`Authorization: Bearer keel_…`), single-use stream tickets
//! (`?ticket=kst_…`, for an EventSource or a browser WebSocket, which can't send headers), or, on a
//! server with no keys, the one local user.
//!
//! Secrets are never stored: a key or ticket is 32 random bytes, and the store keeps its SHA-256.
//! A slow hash (argon2, bcrypt) protects low-entropy passwords; these secrets have 256 bits, so a
//! fast hash loses nothing and keeps the per-request lookup cheap.

use std::time::Duration;

use axum::extract::{MatchedPath, Request, State};
use axum::http::header::{AUTHORIZATION, WWW_AUTHENTICATE};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use keel_core::store::{Store, StoreError};
use keel_core::{ApiKey, RunId, StreamTicket, TicketScope, Timestamp, UserRole};
use rand::RngCore;
use sha2::{Digest, Sha256};

use crate::error::ApiError;
use crate::extract::Caller;
use crate::state::AppState;

/// How requests are authenticated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AuthMode {
    /// Every `/v1` request carries an API key, or a stream ticket where one is accepted.
    Keys,
    /// No keys are configured: a request without credentials acts as this user. Only for a server
    /// on a loopback address, or one started with `--insecure-no-auth`. Credentials that are sent
    /// are still checked.
    SingleUser(String),
}

pub const API_KEY_PREFIX: &str = "keel_";
pub const TICKET_PREFIX: &str = "kst_";

/// A new secret: `prefix` and 64 hex digits (32 bytes from the OS-seeded CSPRNG).
fn new_secret(prefix: &str) -> String {
    let mut bytes = [0u8; 32];
    rand::thread_rng().fill_bytes(&mut bytes);
    format!("{prefix}{}", hex(&bytes))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The stored form of a key or ticket.
pub fn secret_hash(secret: &str) -> String {
    hex(&Sha256::digest(secret.as_bytes()))
}

/// A key that was just made: the secret (shown once, never stored) and its record.
#[derive(Debug)]
pub struct IssuedKey {
    pub secret: String,
    pub record: ApiKey,
}

/// Makes an API key for `user_id` with `role` (the user is created, or its role set).
pub async fn issue_api_key(
    store: &dyn Store,
    user_id: &str,
    role: UserRole,
    now: Timestamp,
) -> Result<IssuedKey, StoreError> {
    store.set_user_role(user_id, role).await?;
    let secret = new_secret(API_KEY_PREFIX);
    let key_hash = secret_hash(&secret);
    let record =
        ApiKey { id: key_id(&key_hash), user_id: user_id.to_owned(), key_hash, created_at: now, revoked_at: None };
    store.insert_api_key(&record).await?;
    Ok(IssuedKey { secret, record })
}

/// Registers a key given by its hash (from configuration); a hash already stored is left alone.
pub async fn register_key_hash(
    store: &dyn Store,
    user_id: &str,
    role: UserRole,
    key_hash: &str,
    now: Timestamp,
) -> Result<(), StoreError> {
    store.set_user_role(user_id, role).await?;
    let record = ApiKey {
        id: key_id(key_hash),
        user_id: user_id.to_owned(),
        key_hash: key_hash.to_owned(),
        created_at: now,
        revoked_at: None,
    };
    match store.insert_api_key(&record).await {
        Ok(()) | Err(StoreError::Duplicate(_)) => Ok(()),
        Err(e) => Err(e),
    }
}

/// A public name for a key: enough of its hash to tell keys apart in a listing.
fn key_id(key_hash: &str) -> String {
    format!("key_{}", &key_hash[..key_hash.len().min(12)])
}

/// Whether `hash` looks like a SHA-256 in hex (what configuration must give).
pub fn is_sha256_hex(hash: &str) -> bool {
    hash.len() == 64 && hash.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
}

/// A ticket that was just made.
#[derive(Debug)]
pub struct IssuedTicket {
    pub secret: String,
    pub expires_at: Timestamp,
}

pub async fn issue_ticket(
    store: &dyn Store,
    user_id: &str,
    scope: TicketScope,
    run_id: Option<RunId>,
    now: Timestamp,
    ttl: Duration,
) -> Result<IssuedTicket, StoreError> {
    let secret = new_secret(TICKET_PREFIX);
    let expires_at = now + chrono::Duration::from_std(ttl).unwrap_or(chrono::Duration::seconds(60));
    let ticket = StreamTicket {
        ticket_hash: secret_hash(&secret),
        user_id: user_id.to_owned(),
        scope,
        run_id,
        expires_at,
        used_at: None,
    };
    store.insert_stream_ticket(&ticket, now).await?;
    Ok(IssuedTicket { secret, expires_at })
}

/// Mints a ticket of `scope` for the caller and answers `201 {ticket, expiresAt, url}`, where `url`
/// is `path` with the ticket in its query.
pub(crate) async fn ticket_created(
    state: &AppState,
    caller: &Caller,
    scope: TicketScope,
    run_id: Option<RunId>,
    path: &str,
) -> Result<Response, ApiError> {
    let engine = &state.engine;
    let ticket =
        issue_ticket(engine.store().as_ref(), &caller.0, scope, run_id, engine.now(), state.config.stream_ticket_ttl)
            .await?;
    let url = format!("{path}?ticket={}", ticket.secret);
    let body = crate::views::TicketBody { ticket: ticket.secret, expires_at: ticket.expires_at, url };
    Ok((StatusCode::CREATED, axum::Json(body)).into_response())
}

fn unauthenticated(message: &str) -> Response {
    let mut response = ApiError::new(StatusCode::UNAUTHORIZED, "UNAUTHENTICATED", message).into_response();
    response.headers_mut().insert(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer realm=\"keel\""));
    response
}

fn invalid_ticket(message: &str) -> Response {
    ApiError::new(StatusCode::UNAUTHORIZED, "INVALID_TICKET", message).into_response()
}

/// The routes that take a `?ticket=` instead of a key, and what the ticket must open.
enum TicketRoute {
    RunEvents(String),
    WebSocket,
}

fn ticket_route(matched: Option<&str>, path: &str) -> Option<TicketRoute> {
    match matched? {
        "/v1/runs/{id}/events" => {
            let id = path.strip_prefix("/v1/runs/")?.strip_suffix("/events")?;
            Some(TicketRoute::RunEvents(id.to_owned()))
        }
        "/v1/ws" => Some(TicketRoute::WebSocket),
        _ => None,
    }
}

fn query_param<'a>(query: Option<&'a str>, name: &str) -> Option<&'a str> {
    query?.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        (k == name).then_some(v)
    })
}

/// The middleware in front of every `/v1` route: resolves the [`Caller`], then applies the caller's
/// rate limit.
pub async fn authenticate(State(state): State<AppState>, mut request: Request, next: Next) -> Response {
    // Owned copies: the request (its body is not `Sync`) must not be borrowed across an await.
    let credentials = Credentials {
        // LangGraph's SDKs send the key as `x-api-key`: the same key, another header. Only a server
        // with keys reads it: the SDKs send whatever key the environment holds (LANGSMITH_API_KEY…),
        // which a server without keys must not refuse them for.
        authorization: match (request.headers().get(AUTHORIZATION), &state.config.auth) {
            (Some(v), _) => Some(v.to_str().map(str::to_owned).ok()),
            (None, AuthMode::Keys) => {
                request.headers().get("x-api-key").map(|v| v.to_str().ok().map(|k| format!("Bearer {k}")))
            }
            (None, _) => None,
        },
        ticket: query_param(request.uri().query(), "ticket").map(str::to_owned),
        route: ticket_route(request.extensions().get::<MatchedPath>().map(MatchedPath::as_str), request.uri().path()),
    };
    let caller = match resolve(&state, credentials).await {
        Ok(caller) => caller,
        Err(response) => return response,
    };
    if let Err(wait) = state.limits.rate.check(&caller.0) {
        state.metrics.rate_limited("user");
        let seconds = wait.as_secs_f64().ceil().max(1.0) as u64;
        return ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "RATE_LIMITED",
            format!("too many requests; retry in {seconds} s"),
        )
        .retry_after(seconds)
        .into_response();
    }
    request.extensions_mut().insert(caller);
    next.run(request).await
}

/// What a request says about who sent it.
struct Credentials {
    /// `Some(None)`: an `Authorization` header that is not visible ASCII.
    authorization: Option<Option<String>>,
    ticket: Option<String>,
    route: Option<TicketRoute>,
}

fn lookup_outcome<T>(found: &Result<Option<T>, StoreError>) -> &'static str {
    match found {
        Ok(Some(_)) => "known",
        Ok(None) => "unknown",
        Err(_) => "error",
    }
}

async fn resolve(state: &AppState, credentials: Credentials) -> Result<Caller, Response> {
    let store = state.engine.store();
    if let Some(value) = credentials.authorization {
        let token = value
            .as_deref()
            .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| unauthenticated("Authorization: expected `Bearer <api key>`"))?;
        let found = store.api_key_user(&secret_hash(token)).await;
        state.metrics.credential_lookup(lookup_outcome(&found));
        return match found {
            Ok(Some(user)) => Ok(Caller(user)),
            Ok(None) => Err(unauthenticated("unknown or revoked API key")),
            Err(e) => Err(ApiError::from(e).into_response()),
        };
    }
    if let Some(ticket) = credentials.ticket {
        let Some(route) = credentials.route else {
            return Err(invalid_ticket("a ticket opens only a run's event stream or a WebSocket"));
        };
        let redeemed = store.redeem_stream_ticket(&secret_hash(&ticket), state.engine.now()).await;
        state.metrics.credential_lookup(lookup_outcome(&redeemed));
        let ticket = match redeemed {
            Ok(Some(ticket)) => ticket,
            Ok(None) => return Err(invalid_ticket("the ticket is unknown, used or expired")),
            Err(e) => return Err(ApiError::from(e).into_response()),
        };
        let fits = match (&route, ticket.scope) {
            (TicketRoute::RunEvents(id), TicketScope::RunEvents) => {
                ticket.run_id.as_ref().is_some_and(|run| run.to_string() == *id)
            }
            (TicketRoute::WebSocket, TicketScope::WebSocket) => true,
            _ => false,
        };
        if !fits {
            return Err(invalid_ticket("the ticket is not for this stream"));
        }
        return Ok(Caller(ticket.user_id));
    }
    match &state.config.auth {
        AuthMode::SingleUser(user) => Ok(Caller(user.clone())),
        AuthMode::Keys => Err(unauthenticated("send `Authorization: Bearer <api key>`")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_long_random_and_hashed() {
        let a = new_secret(API_KEY_PREFIX);
        let b = new_secret(API_KEY_PREFIX);
        assert_ne!(a, b);
        assert!(a.starts_with("keel_") && a.len() == 5 + 64, "{a}");
        assert!(is_sha256_hex(&secret_hash(&a)));
        assert_ne!(secret_hash(&a), secret_hash(&b));
        // the known SHA-256 of "abc"
        assert_eq!(secret_hash("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
        assert!(!is_sha256_hex("BA7816BF8F01CFEA414140DE5DAE2223B00361A396177A9CB410FF61F20015AD"));
        assert!(!is_sha256_hex("abc"));
    }

    #[test]
    fn tickets_are_accepted_only_on_streams() {
        assert!(matches!(
            ticket_route(Some("/v1/runs/{id}/events"), "/v1/runs/run_x/events"),
            Some(TicketRoute::RunEvents(id)) if id == "run_x"
        ));
        assert!(matches!(ticket_route(Some("/v1/ws"), "/v1/ws"), Some(TicketRoute::WebSocket)));
        assert!(ticket_route(Some("/v1/runs/{id}"), "/v1/runs/run_x").is_none());
        assert!(ticket_route(Some("/v1/runs/{id}/resume"), "/v1/runs/run_x/resume").is_none());
        assert!(ticket_route(None, "/v1/runs/run_x/events").is_none());
    }

    #[test]
    fn query_params_are_found_by_name() {
        assert_eq!(query_param(Some("after=3&ticket=kst_1"), "ticket"), Some("kst_1"));
        assert_eq!(query_param(Some("tickets=1"), "ticket"), None);
        assert_eq!(query_param(None, "ticket"), None);
    }
}
