//! The HTTP side of the simulator: one fallback route that records every request, answers
//! the test hooks (`/__sim/*`), checks headers and api-version as IMDS does, applies the
//! scenario's faults and delays, and serves or approves Scheduled Events.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::body::Bytes;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use chrono::Utc;
use serde_json::{Value, json};

use super::snapshot;
use super::state::{Phase, RecordedRequest, State, lock};
use super::{Fault, FaultEndpoint, FaultKind};
use crate::imds::KNOWN_API_VERSIONS;

fn bad_request(message: &str) -> (StatusCode, Value) {
    (StatusCode::BAD_REQUEST, json!({ "error": message }))
}

pub(super) async fn handle(
    axum::extract::State(state): axum::extract::State<Arc<Mutex<State>>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let path = uri.path().to_owned();
    let api_version = uri.query().and_then(|query| {
        url::form_urlencoded::parse(query.as_bytes())
            .find(|(key, _)| key == "api-version")
            .map(|(_, value)| value.into_owned())
    });
    match path.as_str() {
        "/__sim/requests" => return axum::Json(lock(&state).requests.clone()).into_response(),
        "/__sim/state" => {
            let mut state = lock(&state);
            state.advance(Instant::now());
            return axum::Json(snapshot(&state)).into_response();
        }
        _ => {}
    }
    let metadata = headers
        .get("Metadata")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    // Recorded on arrival, so that a request the client abandons (a timeout) still shows.
    let now = Instant::now();
    let index = {
        let mut state = lock(&state);
        let at_ms =
            u64::try_from(now.duration_since(state.started).as_millis()).unwrap_or(u64::MAX);
        state.requests.push(RecordedRequest {
            at_ms,
            unix_us: Utc::now().timestamp_micros(),
            method: method.to_string(),
            path: path.clone(),
            api_version: api_version.clone(),
            metadata: metadata.clone(),
            body: String::from_utf8_lossy(&body).into_owned(),
            status: None,
        });
        state.requests.len() - 1
    };
    let (status, body_out) = respond(
        &state,
        &method,
        &path,
        api_version.as_deref(),
        metadata.as_deref(),
        &body,
        now,
    )
    .await;
    lock(&state).requests[index].status = Some(status.as_u16());
    match body_out {
        Reply::Json(value) => (status, axum::Json(value)).into_response(),
        Reply::Text(text) => (status, text).into_response(),
        Reply::RetryAfter(text, seconds) => {
            (status, [("Retry-After", seconds.to_string())], text).into_response()
        }
    }
}

enum Reply {
    Json(Value),
    Text(String),
    /// A text answer with a `Retry-After` header (seconds), as a throttled service sends.
    RetryAfter(String, u64),
}

async fn respond(
    state: &Arc<Mutex<State>>,
    method: &Method,
    path: &str,
    api_version: Option<&str>,
    metadata: Option<&str>,
    body: &[u8],
    now: Instant,
) -> (StatusCode, Reply) {
    let json_reply = |(status, value): (StatusCode, Value)| (status, Reply::Json(value));
    if !matches!(
        path,
        "/metadata/scheduledevents" | "/metadata/instance/compute"
    ) {
        return (StatusCode::NOT_FOUND, Reply::Text("Not found".into()));
    }
    if !metadata.is_some_and(|value| value.eq_ignore_ascii_case("true")) {
        return json_reply(bad_request(
            "Bad request. Required metadata header not specified",
        ));
    }
    if path == "/metadata/instance/compute" {
        if *method != Method::GET {
            return (
                StatusCode::METHOD_NOT_ALLOWED,
                Reply::Text("Method not allowed".into()),
            );
        }
        let fault = lock(state).take_fault("GET", FaultEndpoint::Compute, now);
        if let Some(reply) = apply(fault).await {
            return reply;
        }
        let vm = lock(state).scenario.vm.clone();
        return (
            StatusCode::OK,
            Reply::Json(
                json!({"name": vm.name, "vmId": vm.vm_id, "resourceId": vm.resource_id,
                               "azEnvironment": "AzurePublicCloud", "location": "westeurope"}),
            ),
        );
    }
    let Some(version) = api_version.filter(|v| KNOWN_API_VERSIONS.contains(v)) else {
        let newest: Vec<&str> = KNOWN_API_VERSIONS.iter().rev().take(3).copied().collect();
        return json_reply((
            StatusCode::BAD_REQUEST,
            json!({"error": "Bad request. api-version is invalid or was not specified in the request. For more information refer to aka.ms/azureimds",
                   "newest-versions": newest}),
        ));
    };
    let method_name = method.as_str().to_owned();
    let (fault, first_delay) = {
        let mut state = lock(state);
        let first_delay = if *method == Method::GET && !state.first_get_done {
            state.first_get_done = true;
            state.scenario.first_call_delay.map(|d| state.scaled(d))
        } else {
            None
        };
        let fault = state.take_fault(&method_name, FaultEndpoint::ScheduledEvents, now);
        (fault, first_delay)
    };
    if let Some(delay) = first_delay {
        tokio::time::sleep(delay).await;
    }
    if let Some(reply) = apply(fault).await {
        return reply;
    }
    let now = Instant::now();
    let mut state = lock(state);
    state.advance(now);
    match *method {
        Method::GET => {
            state.last_served_incarnation = Some(state.incarnation);
            (StatusCode::OK, Reply::Json(state.document(version)))
        }
        Method::POST => match start_requests(body) {
            Err(message) => json_reply(bad_request(&message)),
            Ok(ids) => {
                let unknown: Vec<&String> = ids
                    .iter()
                    .filter(|id| {
                        !state.events.iter().any(|e| {
                            &&e.spec.id == id
                                && matches!(e.phase, Phase::Scheduled | Phase::Started)
                        })
                    })
                    .collect();
                if !unknown.is_empty() {
                    return json_reply(bad_request(&format!(
                        "Bad request. Unknown EventId(s): {unknown:?}"
                    )));
                }
                state.approve(&ids, now);
                state.advance(now);
                (StatusCode::OK, Reply::Text(String::new()))
            }
        },
        _ => (
            StatusCode::METHOD_NOT_ALLOWED,
            Reply::Text("Method not allowed".into()),
        ),
    }
}

/// The answer a fault gives instead of the normal one (`delay` only waits: `None`).
async fn apply(fault: Option<Fault>) -> Option<(StatusCode, Reply)> {
    let fault = fault?;
    match fault.kind {
        FaultKind::Status => {
            let code = fault.status.unwrap_or(500);
            let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            let text = format!("simulated fault: {code}");
            Some(match fault.retry_after {
                Some(seconds) => (status, Reply::RetryAfter(text, seconds)),
                None => (status, Reply::Text(text)),
            })
        }
        FaultKind::Malformed => Some((
            StatusCode::OK,
            Reply::Text("{\"DocumentIncarnation\": 3, \"Events\": [{\"EventId\"".into()),
        )),
        FaultKind::BadRequest => {
            let (status, value) =
                bad_request("Bad request. Required metadata header not specified");
            Some((status, Reply::Json(value)))
        }
        FaultKind::Delay => {
            if let Some(delay) = fault.delay {
                tokio::time::sleep(delay).await;
            }
            None
        }
    }
}

/// Parses `{"StartRequests": [{"EventId": "..."}]}` strictly, as the service does.
pub(super) fn start_requests(body: &[u8]) -> Result<Vec<String>, String> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| format!("Bad request. The body is not JSON: {e}"))?;
    let requests = value
        .get("StartRequests")
        .and_then(Value::as_array)
        .filter(|requests| !requests.is_empty())
        .ok_or("Bad request. Expected {\"StartRequests\": [{\"EventId\": \"...\"}]}")?;
    requests
        .iter()
        .map(|request| {
            request
                .get("EventId")
                .and_then(Value::as_str)
                .filter(|id| !id.is_empty())
                .map(str::to_owned)
                .ok_or_else(|| "Bad request. Every StartRequest needs an EventId".to_owned())
        })
        .collect()
}
