//! Request extractors whose failures are [`ApiError`]s, never axum's plain-text rejections.

use std::collections::HashMap;

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Path, Query, Request};
use axum::http::header::{ACCEPT, CONTENT_TYPE};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode};
use keel_core::engine::EngineError;
use keel_core::{ConversationId, RunId};
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::error::ApiError;
use crate::json_error;
use crate::limits::json_depth;
use crate::state::AppState;

/// Who is calling: the user id the authentication middleware ([`crate::auth::authenticate`])
/// resolved. A route outside that middleware has no caller, and asking for one is a 500.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller(pub String);

impl<S: Send + Sync> FromRequestParts<S> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parts.extensions.get::<Caller>().cloned().ok_or_else(|| {
            let route = parts.extensions.get::<axum::extract::MatchedPath>().map(|p| p.as_str().to_owned());
            tracing::error!(?route, "a route outside the authentication middleware asked for its caller");
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "INTERNAL", "internal error")
        })
    }
}

/// A JSON request body. Malformed JSON is 400 `MALFORMED_JSON`, a body that is not declared JSON 415
/// `UNSUPPORTED_MEDIA_TYPE`, one over the limit 413 `PAYLOAD_TOO_LARGE`, missing or mistyped fields
/// 422 `VALIDATION_FAILED`.
#[derive(Debug)]
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned> FromRequest<AppState> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, Self::Rejection> {
        if !is_json(req.headers()) {
            return Err(unsupported_media_type());
        }
        parse_json(&read_body(req, state).await?, state.config.json_max_depth).map(ApiJson)
    }
}

/// Like [`ApiJson`], but an empty body (with or without a content type), or `null`, means
/// `T::default()`.
#[derive(Debug)]
pub struct OptionalJson<T>(pub T);

impl<T: DeserializeOwned + Default> FromRequest<AppState> for OptionalJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, Self::Rejection> {
        let json_declared = is_json(req.headers());
        let body = read_body(req, state).await?;
        if body.iter().all(u8::is_ascii_whitespace) {
            return Ok(OptionalJson(T::default()));
        }
        if !json_declared {
            return Err(unsupported_media_type());
        }
        if body.trim_ascii() == b"null" {
            return Ok(OptionalJson(T::default()));
        }
        parse_json(&body, state.config.json_max_depth).map(OptionalJson)
    }
}

async fn read_body<S: Send + Sync>(req: Request, state: &S) -> Result<Bytes, ApiError> {
    Bytes::from_request(req, state).await.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "PAYLOAD_TOO_LARGE", "the request body is too large")
        } else {
            ApiError::bad_request("INVALID_BODY", "the request body could not be read")
        }
    })
}

fn unsupported_media_type() -> ApiError {
    ApiError::new(
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "UNSUPPORTED_MEDIA_TYPE",
        "expected a body with Content-Type: application/json",
    )
}

/// Every JSON body of the API is an object: serde would also read a struct from an array of its
/// fields (`["hi"]` as `{"content": "hi"}`), so the top level is checked first.
fn parse_json<T: DeserializeOwned>(body: &[u8], max_depth: usize) -> Result<T, ApiError> {
    if json_depth(body) > max_depth {
        return Err(ApiError::bad_request(
            "JSON_TOO_DEEP",
            format!("the body nests arrays and objects deeper than {max_depth} levels"),
        ));
    }
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::bad_request("MALFORMED_JSON", format!("the body is not valid JSON: {}", json_error::syntax(&e)))
    })?;
    if !value.is_object() {
        return Err(ApiError::validation("the body must be a JSON object"));
    }
    json_error::from_value(value).map_err(ApiError::validation)
}

/// `application/json` or `application/<anything>+json`, parameters ignored.
fn is_json(headers: &HeaderMap) -> bool {
    let Some(value) = headers.get(CONTENT_TYPE).and_then(|v| v.to_str().ok()) else { return false };
    let essence = value.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
    essence == "application/json" || (essence.starts_with("application/") && essence.ends_with("+json"))
}

/// Whether the `Accept` header names `media` (exactly; `*/*` does not count, so that the default
/// representation stays the default).
pub fn accepts(headers: &HeaderMap, media: &str) -> bool {
    headers.get_all(ACCEPT).iter().filter_map(|v| v.to_str().ok()).flat_map(|v| v.split(',')).any(|item| {
        let essence = item.split(';').next().unwrap_or("").trim();
        essence.eq_ignore_ascii_case(media)
    })
}

pub const EVENT_STREAM: &str = "text/event-stream";
pub const APPLICATION_JSON: &str = "application/json";

/// The query string as key → value; a query that cannot be decoded is 400 `INVALID_QUERY`.
#[derive(Debug, Default)]
pub struct Params(pub HashMap<String, String>);

impl<S: Send + Sync> FromRequestParts<S> for Params {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        Query::<HashMap<String, String>>::from_request_parts(parts, state)
            .await
            .map(|Query(q)| Params(q))
            .map_err(|_| ApiError::bad_request("INVALID_QUERY", "the query string could not be decoded"))
    }
}

impl Params {
    /// `?name=true|1` or `?name=false|0`; absent is false.
    pub fn flag(&self, name: &str) -> Result<bool, ApiError> {
        match self.0.get(name).map(String::as_str) {
            None | Some("false") | Some("0") => Ok(false),
            Some("true") | Some("1") | Some("") => Ok(true),
            Some(_) => Err(ApiError::bad_request("INVALID_QUERY", format!("{name}: must be true or false"))),
        }
    }
}

/// A cursor — "events with sequence > N" — from `Last-Event-ID` or else `?after=N`. Both are checked
/// when both are sent: a malformed `after` is refused even though the header wins.
pub fn cursor(headers: &HeaderMap, params: &Params) -> Result<i64, ApiError> {
    let invalid = || ApiError::bad_request("INVALID_CURSOR", "the cursor must be a non-negative integer");
    let parse = |raw: &str| {
        if raw.is_empty() || !raw.bytes().all(|b| b.is_ascii_digit()) {
            return Err(invalid());
        }
        raw.parse::<i64>().map_err(|_| invalid())
    };
    let after = params.0.get("after").map(|raw| parse(raw)).transpose()?;
    match headers.get("last-event-id") {
        Some(v) => parse(v.to_str().map_err(|_| invalid())?),
        None => Ok(after.unwrap_or(0)),
    }
}

/// The id segment of a `/v1/conversations/{id}…` path; a malformed one is a conversation that
/// does not exist.
#[derive(Debug, Clone)]
pub struct ConversationPath(pub ConversationId);

impl<S: Send + Sync> FromRequestParts<S> for ConversationPath {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let raw = path_id(parts, state).await;
        raw.and_then(|raw| ConversationId::parse(&raw).ok())
            .map(ConversationPath)
            .ok_or_else(|| EngineError::NotFound("conversation").into())
    }
}

/// The id segment of a `/v1/runs/{id}…` path; a malformed one is a run that does not exist.
#[derive(Debug, Clone)]
pub struct RunPath(pub RunId);

impl<S: Send + Sync> FromRequestParts<S> for RunPath {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let raw = path_id(parts, state).await;
        raw.and_then(|raw| RunId::parse(&raw).ok()).map(RunPath).ok_or_else(|| EngineError::NotFound("run").into())
    }
}

async fn path_id<S: Send + Sync>(parts: &mut Parts, state: &S) -> Option<String> {
    Path::<String>::from_request_parts(parts, state).await.ok().map(|Path(id)| id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    #[test]
    fn the_header_cursor_wins_and_must_be_a_number() {
        let mut headers = HeaderMap::new();
        let params = Params(HashMap::from([("after".to_owned(), "3".to_owned())]));
        assert_eq!(cursor(&headers, &params).unwrap(), 3);
        headers.insert("last-event-id", HeaderValue::from_static("7"));
        assert_eq!(cursor(&headers, &params).unwrap(), 7);
        for bad in ["-1", "+1", "x", "", " 1", "1.5", "99999999999999999999"] {
            headers.insert("last-event-id", HeaderValue::from_str(bad).unwrap());
            assert_eq!(cursor(&headers, &params).unwrap_err().code, "INVALID_CURSOR", "{bad:?}");
        }
        assert_eq!(cursor(&HeaderMap::new(), &Params::default()).unwrap(), 0);
    }

    /// Found by scripts/fuzz-api: a valid `Last-Event-ID` used to hide a malformed `?after=`.
    #[test]
    fn a_malformed_after_is_refused_beside_a_valid_header() {
        let mut headers = HeaderMap::new();
        headers.insert("last-event-id", HeaderValue::from_static("0"));
        for bad in ["9223372036854775808", "-1", "x", ""] {
            let params = Params(HashMap::from([("after".to_owned(), bad.to_owned())]));
            assert_eq!(cursor(&headers, &params).unwrap_err().code, "INVALID_CURSOR", "{bad:?}");
        }
    }

    #[test]
    fn accept_matches_media_types_in_a_list() {
        let mut headers = HeaderMap::new();
        headers.insert(ACCEPT, HeaderValue::from_static("application/json;q=0.9, Text/Event-Stream"));
        assert!(accepts(&headers, EVENT_STREAM));
        assert!(accepts(&headers, APPLICATION_JSON));
        headers.insert(ACCEPT, HeaderValue::from_static("*/*"));
        assert!(!accepts(&headers, EVENT_STREAM));
    }

    #[test]
    fn json_content_types() {
        let mut headers = HeaderMap::new();
        assert!(!is_json(&headers));
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json; charset=utf-8"));
        assert!(is_json(&headers));
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/merge-patch+json"));
        assert!(is_json(&headers));
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        assert!(!is_json(&headers));
    }
}
