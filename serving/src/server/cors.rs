//! CORS for browser front-ends (`--cors-origin`, off by default): answers preflight `OPTIONS`
//! requests and marks responses to allowed origins. With no origin configured nothing is added
//! and `OPTIONS` gets the usual 405, so a page on another site cannot read the API.

use super::AppState;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;

/// Headers a browser may send (what OpenAI and Anthropic clients use).
const ALLOW_HEADERS: &str =
    "authorization, content-type, x-api-key, anthropic-version, anthropic-beta, x-stainless-os, x-stainless-lang";

/// The value of `Access-Control-Allow-Origin` for this request's origin, if it is allowed.
fn allowed_origin(origins: &[String], headers: &HeaderMap) -> Option<HeaderValue> {
    let origin = headers.get(header::ORIGIN)?;
    if origins.iter().any(|o| o == "*") {
        return Some(HeaderValue::from_static("*"));
    }
    let o = origin.to_str().ok()?;
    origins
        .iter()
        .any(|a| a.trim_end_matches('/').eq_ignore_ascii_case(o))
        .then(|| origin.clone())
}

pub(crate) async fn cors(State(s): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let origins = &s.config.cors_origins;
    if origins.is_empty() {
        return next.run(req).await;
    }
    let allow = allowed_origin(origins, req.headers());
    let preflight = req.method() == Method::OPTIONS
        && req
            .headers()
            .contains_key(header::ACCESS_CONTROL_REQUEST_METHOD);
    if preflight {
        let Some(allow) = allow else {
            return super::ApiError::new(
                StatusCode::FORBIDDEN,
                "permission_error",
                "this origin may not call the API (see --cors-origin)",
            )
            .into_response();
        };
        let mut r = StatusCode::NO_CONTENT.into_response();
        let h = r.headers_mut();
        h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, allow);
        h.insert(
            header::ACCESS_CONTROL_ALLOW_METHODS,
            HeaderValue::from_static("GET, POST, OPTIONS"),
        );
        h.insert(
            header::ACCESS_CONTROL_ALLOW_HEADERS,
            HeaderValue::from_static(ALLOW_HEADERS),
        );
        h.insert(
            header::ACCESS_CONTROL_MAX_AGE,
            HeaderValue::from_static("600"),
        );
        h.insert(header::VARY, HeaderValue::from_static("Origin"));
        return r;
    }
    let mut r = next.run(req).await;
    if let Some(allow) = allow {
        let h = r.headers_mut();
        h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, allow);
        h.insert(header::VARY, HeaderValue::from_static("Origin"));
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origin_matching() {
        let mut h = HeaderMap::new();
        h.insert(header::ORIGIN, HeaderValue::from_static("http://a.test"));
        let list = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            allowed_origin(&list(&["http://a.test/"]), &h).unwrap(),
            "http://a.test"
        );
        assert_eq!(allowed_origin(&list(&["*"]), &h).unwrap(), "*");
        assert!(allowed_origin(&list(&["http://b.test"]), &h).is_none());
        assert!(allowed_origin(&list(&["*"]), &HeaderMap::new()).is_none());
    }
}
