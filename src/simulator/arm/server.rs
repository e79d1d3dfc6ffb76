//! The HTTP side of the ARM stand-in: one fallback route that serves the test hooks, the
//! managed-identity token endpoint, and every `/subscriptions/...` call behind the gate
//! (bearer, throttle, rate limit), then routes on the path's segments compared without case.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::super::state::lock;
use super::gate::{Access, Refusal};
use super::routes::{self, Query, failure};
use super::{Arm, ArmRequest};

pub(super) const TOKEN_PATH: &str = "/metadata/identity/oauth2/token";
/// The IMDS identity endpoint's versions `azure_identity` and the docs use.
const TOKEN_API_VERSIONS: &[&str] = &["2018-02-01", "2019-08-01"];
/// The client id the simulated identity reports when the request names none.
const CLIENT_ID: &str = "5a1b2c3d-0000-4000-8000-00000000a12e";

pub(super) async fn handle(
    axum::extract::State(arm): axum::extract::State<Arc<Arm>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let path = uri.path();
    match path {
        "/__arm/requests" => return axum::Json(lock(&arm.requests).clone()).into_response(),
        "/__arm/throttle" => return throttle_hook(&arm, &method, &body),
        "/__arm/fail" => return fail_hook(&arm, &method, &body),
        _ => {}
    }
    let now = Instant::now();
    let query = Query::parse(&uri);
    let (response, bearer_valid) = if path.eq_ignore_ascii_case(TOKEN_PATH) {
        (token(&arm, &method, &query, &headers, now), None)
    } else if starts_with_ignoring_case(path, "/subscriptions/") {
        let (response, valid, delay) = arm_call(&arm, &method, &uri, &query, &headers, now);
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        (response, Some(valid))
    } else {
        let answer = failure(StatusCode::NOT_FOUND, "NotFound", "No such path");
        (answer.into_response(), None)
    };
    let at_ms = u64::try_from(now.duration_since(arm.started).as_millis()).unwrap_or(u64::MAX);
    lock(&arm.requests).push(ArmRequest {
        at_ms,
        method: method.to_string(),
        path: path.to_owned(),
        query: uri.query().map(str::to_owned),
        bearer_valid,
        status: Some(response.status().as_u16()),
    });
    response
}

fn starts_with_ignoring_case(text: &str, prefix: &str) -> bool {
    text.get(..prefix.len())
        .is_some_and(|head| head.eq_ignore_ascii_case(prefix))
}

/// A test hook: a POST of `T` as JSON (`expected` says its shape), applied by `apply` or
/// refused with its reason; answered with what it took.
fn hook<T: serde::de::DeserializeOwned + serde::Serialize>(
    method: &Method,
    body: &[u8],
    expected: &str,
    apply: impl FnOnce(&T) -> Result<(), String>,
) -> Response {
    if *method != Method::POST {
        return StatusCode::METHOD_NOT_ALLOWED.into_response();
    }
    let asked = serde_json::from_slice::<T>(body)
        .map_err(|error| format!("expected {expected}: {error}"))
        .and_then(|asked| apply(&asked).map(|()| asked));
    match asked {
        Ok(asked) => axum::Json(asked).into_response(),
        Err(why) => (StatusCode::BAD_REQUEST, why).into_response(),
    }
}

/// `POST /__arm/throttle {"count": N, "retry_after": S}`: the next N ARM calls answer 429.
fn throttle_hook(arm: &Arm, method: &Method, body: &[u8]) -> Response {
    #[derive(serde::Deserialize, serde::Serialize)]
    #[serde(deny_unknown_fields)]
    struct Throttle {
        count: u32,
        retry_after: u64,
    }
    hook(
        method,
        body,
        r#"{"count": N, "retry_after": S}"#,
        |t: &Throttle| {
            lock(&arm.gate).throttle(t.count, t.retry_after);
            Ok(())
        },
    )
}

/// `POST /__arm/fail {"count": N, "status": S, "delay_ms": D}`: the next N ARM calls answer
/// the server error S (500-599), each after D ms (default 0), as ARM or its gateway does in
/// an outage; or 409, ARM's `Conflict` (another operation on the resource).
fn fail_hook(arm: &Arm, method: &Method, body: &[u8]) -> Response {
    #[derive(serde::Deserialize, serde::Serialize)]
    #[serde(deny_unknown_fields)]
    struct Fail {
        count: u32,
        status: u16,
        #[serde(default)]
        delay_ms: u64,
    }
    hook(
        method,
        body,
        r#"{"count": N, "status": S, "delay_ms": D}"#,
        |f: &Fail| {
            if !(500..=599).contains(&f.status) && f.status != 409 {
                return Err(format!(
                    "expected a server error (500-599) or 409 as status, not {}",
                    f.status
                ));
            }
            let delay = Duration::from_millis(f.delay_ms);
            lock(&arm.gate).fail(f.count, f.status, delay);
            Ok(())
        },
    )
}

/// The IMDS managed-identity token endpoint, as a VM's IMDS serves it.
fn token(arm: &Arm, method: &Method, query: &Query, headers: &HeaderMap, now: Instant) -> Response {
    let invalid = |description: &str| {
        let body = json!({"error": "invalid_request", "error_description": description});
        (StatusCode::BAD_REQUEST, axum::Json(body)).into_response()
    };
    if *method != Method::GET {
        return StatusCode::METHOD_NOT_ALLOWED.into_response();
    }
    let metadata = headers.get("Metadata").and_then(|v| v.to_str().ok());
    if !metadata.is_some_and(|v| v.eq_ignore_ascii_case("true")) {
        return invalid("Required metadata header not specified");
    }
    match query.get("api-version") {
        None => return invalid("Required query variable 'api-version' is missing"),
        Some(version) if !TOKEN_API_VERSIONS.contains(&version) => {
            return invalid(&format!("Invalid API version {version}"));
        }
        Some(_) => {}
    }
    let Some(resource) = query.get("resource").filter(|r| !r.is_empty()) else {
        return invalid("Required audience parameter not specified");
    };
    let lifetime = arm.options.token_lifetime;
    let issued = lock(&arm.gate).issue(resource, lifetime, now);
    let seconds = lifetime.as_secs().to_string();
    axum::Json(json!({
        "access_token": issued.access_token,
        "client_id": query.get("client_id").unwrap_or(CLIENT_ID),
        "expires_in": seconds,
        "expires_on": issued.expires_on.to_string(),
        "ext_expires_in": seconds,
        "not_before": issued.not_before.to_string(),
        "resource": resource,
        "token_type": "Bearer",
    }))
    .into_response()
}

/// One `/subscriptions/...` call: the gate, then the route. Also says whether the bearer was
/// valid, and how long to wait before answering (a failure a test asked for).
fn arm_call(
    arm: &Arm,
    method: &Method,
    uri: &Uri,
    query: &Query,
    headers: &HeaderMap,
    now: Instant,
) -> (Response, bool, Duration) {
    let authorization = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    let mut gate = lock(&arm.gate);
    if let Err(refusal) = gate.check(authorization, now) {
        return (unauthorized(&refusal), false, Duration::ZERO);
    }
    if let Some((status, delay)) = gate.take_failure() {
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
        let (code, message) = if status == StatusCode::CONFLICT {
            (
                "Conflict",
                "The operation conflicts with another operation in progress on the resource.",
            )
        } else {
            (
                "ServiceUnavailable",
                "The service is temporarily unavailable. Please try again later.",
            )
        };
        return (failure(status, code, message).into_response(), true, delay);
    }
    let segments: Vec<&str> = uri.path().split('/').filter(|s| !s.is_empty()).collect();
    let subscription = segments.get(1).copied().unwrap_or_default();
    let (access, limit) = if *method == Method::POST {
        (Access::Write, arm.options.write_limit_per_hour)
    } else {
        (Access::Read, arm.options.read_limit_per_hour)
    };
    let counted = match gate.take_throttle() {
        Some(retry_after) => Err((
            retry_after,
            gate.remaining(subscription, access, limit, now),
        )),
        None => gate
            .count(subscription, access, limit, now)
            .map_err(|retry_after| (retry_after, 0)),
    };
    drop(gate);
    let (mut response, remaining) = match counted {
        Err((retry_after, remaining)) => {
            let mut response = failure(
                StatusCode::TOO_MANY_REQUESTS,
                "TooManyRequests",
                format!("The request is being throttled. Retry after {retry_after} seconds."),
            )
            .into_response();
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(retry_after));
            (response, remaining)
        }
        Ok(remaining) => {
            let base = match headers.get(header::HOST).and_then(|v| v.to_str().ok()) {
                Some(host) => format!("http://{host}"),
                None => format!("http://{}", arm.addr),
            };
            let call = routes::Call {
                arm,
                query,
                base,
                path: uri.path(),
                now,
            };
            let answer = routes::route(&call, method, &segments);
            let response = match answer {
                Ok(value) => axum::Json(value).into_response(),
                Err(failure) => failure.into_response(),
            };
            (response, remaining)
        }
    };
    response
        .headers_mut()
        .insert(access.remaining_header(), HeaderValue::from(remaining));
    (response, true, Duration::ZERO)
}

fn unauthorized(refusal: &Refusal) -> Response {
    let message = refusal.message();
    let challenge = format!(
        "Bearer authorization_uri=\"https://login.microsoftonline.com/common\", error=\"invalid_token\", error_description=\"{}\"",
        message.replace('"', "'")
    );
    let mut response = failure(StatusCode::UNAUTHORIZED, refusal.code(), message).into_response();
    if let Ok(value) = HeaderValue::from_str(&challenge) {
        response
            .headers_mut()
            .insert(header::WWW_AUTHENTICATE, value);
    }
    response
}
