//! The `Host` check of a server that needs no credentials.
//!
//! Without API keys, a server on a loopback address serves every request as its local user. A web
//! page the user visits can point its own name at 127.0.0.1 (DNS rebinding) and then, being
//! same-origin, start runs and approve actions. Such a page cannot make the browser send a `Host`
//! other than its own name, so answering only loopback names (and names the operator lists) closes
//! the hole before anything runs.

use axum::extract::{Request, State};
use axum::http::header::HOST;
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;
use crate::state::AppState;

/// The names a request's `Host` may have, with any port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllowedHosts(Vec<String>);

impl AllowedHosts {
    pub const LOOPBACK: [&'static str; 3] = ["localhost", "127.0.0.1", "[::1]"];

    /// The loopback names and `extra` (names or `name:port`; the port is ignored).
    pub fn loopback_and(extra: &[String]) -> Self {
        let mut names: Vec<String> = Self::LOOPBACK.iter().map(|n| (*n).to_owned()).collect();
        names.extend(extra.iter().map(|h| normalize(h)).filter(|h| !h.is_empty()));
        Self(names)
    }

    /// Whether a `Host` header value (`name`, `name:port`, `[v6]:port`) names an allowed host.
    pub fn allows(&self, host: &str) -> bool {
        let name = normalize(host);
        !name.is_empty() && self.0.contains(&name)
    }
}

/// The host name of `host`, lowercased, without its port or a trailing dot.
fn normalize(host: &str) -> String {
    let host = host.trim();
    let name = if host.starts_with('[') {
        match host.find(']') {
            Some(end) => &host[..=end],
            None => return String::new(),
        }
    } else {
        match host.rsplit_once(':') {
            Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
            Some(_) => return String::new(),
            None => host,
        }
    };
    name.trim_end_matches('.').to_ascii_lowercase()
}

/// Refuses a request whose `Host` (or, for an absolute-form request, the URI's authority) is not
/// allowed: 403 `HOST_NOT_ALLOWED`. Does nothing when the server has no list.
pub async fn check(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let Some(allowed) = &state.config.allowed_hosts else { return next.run(request).await };
    let host = request
        .headers()
        .get(HOST)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .or_else(|| request.uri().authority().map(|a| a.to_string()));
    match host {
        Some(host) if allowed.allows(&host) => next.run(request).await,
        _ => {
            // The refused name is the client's: it is not repeated, in the answer or the log.
            tracing::warn!("refused a request whose Host is not an allowed name (a DNS-rebinding page?)");
            ApiError::new(
                StatusCode::FORBIDDEN,
                "HOST_NOT_ALLOWED",
                "this server answers only requests addressed to localhost, 127.0.0.1, [::1] or a name given \
                 with --allowed-host",
            )
            .into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_names_with_any_port() {
        let allowed = AllowedHosts::loopback_and(&[]);
        for ok in ["localhost", "localhost:8080", "LOCALHOST.:1", "127.0.0.1", "127.0.0.1:80", "[::1]", "[::1]:8080"] {
            assert!(allowed.allows(ok), "{ok}");
        }
        for refused in [
            "attacker.example",
            "attacker.example:8080",
            "localhost.attacker.example",
            "127.0.0.1.nip.io",
            "127.0.0.2",
            "[::2]:80",
            "",
            "localhost:80x",
            "[::1",
        ] {
            assert!(!allowed.allows(refused), "{refused}");
        }
    }

    #[test]
    fn named_hosts_are_added() {
        let allowed = AllowedHosts::loopback_and(&["Keel.Internal:9000".into(), "ops.example".into()]);
        assert!(allowed.allows("keel.internal"));
        assert!(allowed.allows("keel.internal:8080"));
        assert!(allowed.allows("ops.example:443"));
        assert!(!allowed.allows("other.example"));
    }
}
