//! The web page: `/` and `/assets/{file}`, embedded in the binary with `include_str!` (no build
//! step, no framework). The page talks to the v1 API only, like any other client.

use axum::extract::Path;
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE, X_CONTENT_TYPE_OPTIONS};
use axum::http::HeaderValue;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

use crate::error::ApiError;

const INDEX_HTML: &str = include_str!("../assets/index.html");
const APP_JS: &str = include_str!("../assets/app.js");
const APP_CSS: &str = include_str!("../assets/app.css");

/// The page uses its own files and the same-origin API only; no inline script or style.
const CSP: &str = "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
                   connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// The page's routes.
pub const PATHS: [&str; 2] = ["/", "/assets/{file}"];

/// `GET /` and `GET /assets/{file}`; merge into the API router.
pub fn routes<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new().route(PATHS[0], get(index)).route(PATHS[1], get(asset))
}

async fn index() -> Response {
    let mut response = file(INDEX_HTML, "text/html; charset=utf-8");
    response.headers_mut().insert("content-security-policy", HeaderValue::from_static(CSP));
    response
}

async fn asset(Path(name): Path<String>) -> Response {
    match name.as_str() {
        "app.js" => file(APP_JS, "text/javascript; charset=utf-8"),
        "app.css" => file(APP_CSS, "text/css; charset=utf-8"),
        _ => ApiError::not_found().into_response(),
    }
}

fn file(body: &'static str, content_type: &'static str) -> Response {
    let mut response = body.into_response();
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    headers.insert(X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::{to_bytes, Body};
    use axum::http::{Request, StatusCode};
    use tower::ServiceExt;

    async fn get(path: &str) -> Response {
        routes::<()>().oneshot(Request::get(path).body(Body::empty()).unwrap()).await.unwrap()
    }

    #[tokio::test]
    async fn serves_the_page_and_its_assets_with_their_types() {
        for (path, ty, body) in [
            ("/", "text/html; charset=utf-8", INDEX_HTML),
            ("/assets/app.js", "text/javascript; charset=utf-8", APP_JS),
            ("/assets/app.css", "text/css; charset=utf-8", APP_CSS),
        ] {
            let response = get(path).await;
            assert_eq!(response.status(), StatusCode::OK, "{path}");
            assert_eq!(response.headers()[CONTENT_TYPE], ty, "{path}");
            assert_eq!(response.headers()[CACHE_CONTROL], "no-cache", "{path}");
            let bytes = to_bytes(response.into_body(), usize::MAX).await.unwrap();
            assert_eq!(bytes, body.as_bytes(), "{path}");
        }
        assert!(get("/").await.headers().contains_key("content-security-policy"));
    }

    #[tokio::test]
    async fn unknown_assets_are_json_404s() {
        let response = get("/assets/nope.js").await;
        assert_eq!(response.status(), StatusCode::NOT_FOUND);
        let bytes = to_bytes(response.into_body(), usize::MAX).await.unwrap();
        let body: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(body["error"]["code"], "NOT_FOUND");
    }

    #[test]
    fn the_page_links_only_embedded_assets() {
        for link in INDEX_HTML.split("\"/assets/").skip(1) {
            let name = link.split('"').next().unwrap();
            assert!(["app.js", "app.css"].contains(&name), "index.html links /assets/{name}, which is not embedded");
        }
        assert!(INDEX_HTML.contains("/assets/app.js") && INDEX_HTML.contains("/assets/app.css"));
    }
}
