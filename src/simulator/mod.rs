//! A faithful IMDS Scheduled Events simulator, for tests, demos and rehearsals.
//!
//! It serves `GET`/`POST /metadata/scheduledevents` and `GET /metadata/instance/compute` as the
//! documentation describes them: `Metadata: true` is required (400 without it), the
//! api-version is required and checked (400 with `newest-versions` otherwise), fields are
//! filtered by api-version, an approved or overdue Scheduled event becomes Started and then
//! disappears, and every change of the Events array bumps DocumentIncarnation.
//!
//! Time is computed on each request, not by a ticker: the state at an instant depends only on
//! the scenario and the approvals received, which keeps runs reproducible.
//!
//! Test hooks (not part of IMDS): `GET /__sim/requests` lists every request received, and
//! `GET /__sim/state` tells the incarnation and each event's phase.

mod scenario;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::{Value, json};

pub use scenario::{BUILTIN, Fault, FaultKind, Scenario, SimEvent, SimUpdate, SimVm};

use crate::imds::KNOWN_API_VERSIONS;

/// Where one event is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    Pending,
    Scheduled,
    Started,
    Gone,
}

/// One request as the simulator received it.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct RecordedRequest {
    /// Milliseconds since the simulator started.
    pub at_ms: u64,
    /// Arrival as Unix microseconds (for latency measurements across processes).
    #[serde(default)]
    pub unix_us: i64,
    pub method: String,
    pub path: String,
    pub api_version: Option<String>,
    /// The `Metadata` header, if any.
    pub metadata: Option<String>,
    pub body: String,
    /// The status answered; `None` while in flight, or when the client gave up first.
    pub status: Option<u16>,
}

struct EventState {
    spec: SimEvent,
    phase: Phase,
    appeared_at: Option<Instant>,
    not_before: Option<Instant>,
    approved_at: Option<Instant>,
    started_at: Option<Instant>,
    updates_applied: usize,
    resources: Vec<String>,
    duration_in_seconds: i64,
    description: Option<String>,
}

struct FaultState {
    fault: Fault,
    remaining: u32,
}

struct State {
    scenario: Scenario,
    started: Instant,
    started_wall: DateTime<Utc>,
    incarnation: u64,
    events: Vec<EventState>,
    faults: Vec<FaultState>,
    first_get_done: bool,
    incarnation_reset_done: bool,
    last_served_incarnation: Option<u64>,
    requests: Vec<RecordedRequest>,
}

impl State {
    fn new(scenario: Scenario) -> State {
        let events = scenario
            .events
            .iter()
            .map(|spec| EventState {
                phase: Phase::Pending,
                appeared_at: None,
                not_before: None,
                approved_at: None,
                started_at: None,
                updates_applied: 0,
                resources: spec.resources.clone(),
                duration_in_seconds: spec.duration_in_seconds,
                description: spec.description.clone(),
                spec: spec.clone(),
            })
            .collect();
        let faults = scenario
            .faults
            .iter()
            .map(|fault| FaultState {
                fault: fault.clone(),
                remaining: fault.count,
            })
            .collect();
        State {
            incarnation: scenario.start_incarnation,
            started: Instant::now(),
            started_wall: Utc::now(),
            events,
            faults,
            first_get_done: false,
            incarnation_reset_done: false,
            last_served_incarnation: None,
            requests: Vec::new(),
            scenario,
        }
    }

    fn scaled(&self, offset: Duration) -> Duration {
        offset.mul_f64(self.scenario.time_scale)
    }

    fn wall(&self, instant: Instant) -> DateTime<Utc> {
        self.started_wall + chrono::Duration::from_std(instant - self.started).unwrap_or_default()
    }

    /// Applies everything due by `now`; one incarnation bump per call that changed anything.
    fn advance(&mut self, now: Instant) {
        let scale = self.scenario.time_scale;
        let start = self.started;
        if let Some(reset) = self.scenario.incarnation_reset_after
            && !self.incarnation_reset_done
            && now >= start + reset.mul_f64(scale)
        {
            self.incarnation_reset_done = true;
            self.incarnation = self.scenario.start_incarnation;
        }
        let mut changed = false;
        for event in &mut self.events {
            let scaled = |d: Duration| d.mul_f64(scale);
            if event.phase == Phase::Pending {
                let due = start + scaled(event.spec.appear_after);
                if now < due {
                    continue;
                }
                event.appeared_at = Some(due);
                event.not_before = Some(due + scaled(event.spec.notice));
                if event.spec.status == "Started" {
                    event.phase = Phase::Started;
                    event.started_at = Some(due);
                } else {
                    event.phase = Phase::Scheduled;
                }
                changed = true;
            }
            let appeared = event.appeared_at.expect("set when the event appeared");
            while let Some(update) = event.spec.updates.get(event.updates_applied) {
                if event.phase == Phase::Gone || now < appeared + scaled(update.after) {
                    break;
                }
                if let Some(notice) = update.notice {
                    event.not_before = Some(appeared + scaled(notice));
                }
                if let Some(resources) = &update.resources {
                    event.resources = resources.clone();
                }
                if let Some(duration) = update.duration_in_seconds {
                    event.duration_in_seconds = duration;
                }
                if let Some(description) = &update.description {
                    event.description = Some(description.clone());
                }
                event.updates_applied += 1;
                changed = true;
            }
            if event.phase == Phase::Scheduled {
                let cancel_due = event
                    .spec
                    .cancel_after
                    .map(|after| appeared + scaled(after));
                let start_due = match (event.approved_at, event.not_before) {
                    (Some(approved), Some(not_before)) => Some(approved.min(not_before)),
                    (approved, not_before) => approved.or(not_before),
                };
                let cancelled = cancel_due.is_some_and(|due| now >= due)
                    && start_due.is_none_or(|start| cancel_due < Some(start) || now < start);
                if cancelled {
                    event.phase = Phase::Gone;
                    changed = true;
                } else if let Some(start_due) = start_due.filter(|due| now >= *due) {
                    event.phase = Phase::Started;
                    event.started_at = Some(start_due);
                    changed = true;
                }
            }
            if event.phase == Phase::Started {
                let started = event.started_at.expect("set when the event started");
                if now >= started + scaled(event.spec.started_for) {
                    event.phase = Phase::Gone;
                    changed = true;
                }
            }
        }
        if changed {
            self.incarnation += 1;
        }
    }

    /// The document as a client of `api_version` sees it.
    fn document(&self, api_version: &str) -> Value {
        let at_least = |version: &str| api_version >= version;
        let events: Vec<Value> = self
            .events
            .iter()
            .filter(|e| matches!(e.phase, Phase::Scheduled | Phase::Started))
            .filter(|e| match e.spec.event_type.as_str() {
                "Preempt" => at_least("2017-11-01"),
                "Terminate" => at_least("2019-01-01"),
                _ => true,
            })
            .map(|e| {
                let preview = api_version == "2017-03-01";
                let resources: Vec<String> = e
                    .resources
                    .iter()
                    .map(|r| if preview { format!("_{r}") } else { r.clone() })
                    .collect();
                let not_before = match (e.phase, e.not_before) {
                    (Phase::Scheduled, Some(at)) if preview => {
                        self.wall(at).format("%Y-%m-%dT%H:%M:%SZ").to_string()
                    }
                    (Phase::Scheduled, Some(at)) => self
                        .wall(at)
                        .format("%a, %d %b %Y %H:%M:%S GMT")
                        .to_string(),
                    _ => String::new(),
                };
                let status = if e.phase == Phase::Started {
                    "Started"
                } else {
                    "Scheduled"
                };
                let mut object = json!({
                    "EventId": e.spec.id,
                    "EventStatus": status,
                    "EventType": e.spec.event_type,
                    "ResourceType": "VirtualMachine",
                    "Resources": resources,
                    "NotBefore": not_before,
                });
                let fields = object.as_object_mut().expect("a JSON object");
                if at_least("2019-04-01") {
                    fields.insert(
                        "Description".into(),
                        json!(e.description.clone().unwrap_or_default()),
                    );
                }
                if at_least("2019-08-01") {
                    fields.insert("EventSource".into(), json!(e.spec.source));
                }
                if at_least("2020-07-01") {
                    fields.insert("DurationInSeconds".into(), json!(e.duration_in_seconds));
                }
                object
            })
            .collect();
        json!({"DocumentIncarnation": self.incarnation, "Events": events})
    }

    /// Takes the next fault due for this method, if any.
    fn take_fault(&mut self, method: &str, now: Instant) -> Option<Fault> {
        let start = self.started;
        let scale = self.scenario.time_scale;
        let active = self.faults.iter_mut().find(|f| {
            f.remaining > 0
                && f.fault.method == method
                && now >= start + f.fault.after.mul_f64(scale)
        })?;
        active.remaining -= 1;
        Some(active.fault.clone())
    }
}

/// A running simulator.
pub struct Simulator {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

/// What `/__sim/state` reports, and what tests and the demo wait on.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct Snapshot {
    pub incarnation: u64,
    pub last_served_incarnation: Option<u64>,
    pub phases: Vec<(String, Phase)>,
    /// Every event has come and gone, and the last document was served since.
    pub finished: bool,
    /// When the scenario's clock started, as Unix microseconds: offsets count from here.
    #[serde(default)]
    pub started_unix_us: i64,
}

impl Simulator {
    /// Binds `listen` (port 0 picks a free one) and serves the scenario.
    pub async fn start(scenario: Scenario, listen: SocketAddr) -> std::io::Result<Simulator> {
        let listener = tokio::net::TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(Mutex::new(State::new(scenario)));
        let app = axum::Router::new()
            .fallback(handle)
            .with_state(state.clone());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let served = axum::serve(listener, app).with_graceful_shutdown(async {
                let _ = stopped.await;
            });
            if let Err(error) = served.await {
                tracing::error!(error = %error, "Simulator stopped serving");
            }
        });
        Ok(Simulator {
            addr,
            state,
            stop,
            task,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The base URL to configure as `imds.endpoint`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn snapshot(&self) -> Snapshot {
        let mut state = lock(&self.state);
        state.advance(Instant::now());
        snapshot(&state)
    }

    pub fn requests(&self) -> Vec<RecordedRequest> {
        lock(&self.state).requests.clone()
    }

    pub async fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.task.await;
    }
}

fn snapshot(state: &State) -> Snapshot {
    let phases: Vec<(String, Phase)> = state
        .events
        .iter()
        .map(|e| (e.spec.id.clone(), e.phase))
        .collect();
    let finished = phases.iter().all(|(_, phase)| *phase == Phase::Gone)
        && state.last_served_incarnation == Some(state.incarnation);
    Snapshot {
        incarnation: state.incarnation,
        last_served_incarnation: state.last_served_incarnation,
        phases,
        finished,
        started_unix_us: state.started_wall.timestamp_micros(),
    }
}

fn lock(state: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    state
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn bad_request(message: &str) -> (StatusCode, Value) {
    (StatusCode::BAD_REQUEST, json!({ "error": message }))
}

async fn handle(
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
    }
}

enum Reply {
    Json(Value),
    Text(String),
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
        (state.take_fault(&method_name, now), first_delay)
    };
    if let Some(delay) = first_delay {
        tokio::time::sleep(delay).await;
    }
    match fault.as_ref().map(|f| f.kind) {
        Some(FaultKind::Status) => {
            let code = fault.and_then(|f| f.status).unwrap_or(500);
            let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            return (status, Reply::Text(format!("simulated fault: {code}")));
        }
        Some(FaultKind::Malformed) => {
            return (
                StatusCode::OK,
                Reply::Text("{\"DocumentIncarnation\": 3, \"Events\": [{\"EventId\"".into()),
            );
        }
        Some(FaultKind::BadRequest) => {
            return json_reply(bad_request(
                "Bad request. Required metadata header not specified",
            ));
        }
        Some(FaultKind::Delay) => {
            if let Some(delay) = fault.and_then(|f| f.delay) {
                tokio::time::sleep(delay).await;
            }
        }
        None => {}
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
                for event in state.events.iter_mut() {
                    if ids.contains(&event.spec.id) && event.phase == Phase::Scheduled {
                        event.approved_at.get_or_insert(now);
                    }
                }
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

/// Parses `{"StartRequests": [{"EventId": "..."}]}` strictly, as the service does.
fn start_requests(body: &[u8]) -> Result<Vec<String>, String> {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn scenario(text: &str) -> Scenario {
        Scenario::from_toml(text).unwrap()
    }

    const FREEZE: &str = r#"
        [[events]]
        id = "E1"
        type = "Freeze"
        resources = ["WestNO_0"]
        appear_after = "10s"
        notice = "15m"
        started_for = "1m"
        duration_in_seconds = 5
        source = "User"
        description = "Live migration"
    "#;

    #[test]
    fn an_event_appears_starts_at_not_before_and_disappears() {
        let mut state = State::new(scenario(FREEZE));
        let t0 = state.started;
        state.advance(t0);
        assert_eq!(state.incarnation, 1);
        assert_eq!(state.document("2020-07-01")["Events"], json!([]));
        state.advance(t0 + Duration::from_secs(10));
        assert_eq!(state.incarnation, 2);
        assert_eq!(
            state.document("2020-07-01")["Events"][0]["EventStatus"],
            "Scheduled"
        );
        state.advance(t0 + Duration::from_secs(11));
        assert_eq!(state.incarnation, 2, "nothing changed, same incarnation");
        state.advance(t0 + Duration::from_secs(10 + 900));
        let document = state.document("2020-07-01");
        assert_eq!(document["Events"][0]["EventStatus"], "Started");
        assert_eq!(document["Events"][0]["NotBefore"], "");
        state.advance(t0 + Duration::from_secs(10 + 900 + 60));
        assert_eq!(state.document("2020-07-01")["Events"], json!([]));
        assert_eq!(state.incarnation, 4);
    }

    #[test]
    fn fields_are_filtered_by_api_version() {
        let mut state = State::new(scenario(FREEZE));
        state.advance(state.started + Duration::from_secs(10));
        let newest = &state.document("2020-07-01")["Events"][0];
        assert_eq!(newest["DurationInSeconds"], 5);
        assert_eq!(newest["EventSource"], "User");
        assert_eq!(newest["Description"], "Live migration");
        let old = &state.document("2019-04-01")["Events"][0];
        assert!(old.get("DurationInSeconds").is_none() && old.get("EventSource").is_none());
        assert_eq!(old["Description"], "Live migration");
        let oldest = &state.document("2017-08-01")["Events"][0];
        assert!(oldest.get("Description").is_none());
        let preview = &state.document("2017-03-01")["Events"][0];
        assert_eq!(preview["Resources"], json!(["_WestNO_0"]));
        assert!(
            sched_relay_core::document::parse_not_before(preview["NotBefore"].as_str().unwrap())
                .is_some()
        );
    }

    #[test]
    fn preempt_and_terminate_are_hidden_from_versions_that_predate_them() {
        let mut state = State::new(scenario(
            "[[events]]\nid='p'\ntype='Preempt'\nresources=['a']\n[[events]]\nid='t'\ntype='Terminate'\nresources=['a']\n",
        ));
        state.advance(state.started);
        let count = |v: &str| state.document(v)["Events"].as_array().unwrap().len();
        assert_eq!(count("2017-08-01"), 0);
        assert_eq!(count("2017-11-01"), 1);
        assert_eq!(count("2019-01-01"), 2);
    }

    #[test]
    fn a_cancelled_event_disappears_without_starting() {
        let mut state = State::new(scenario(
            "[[events]]\nid='c'\ntype='Reboot'\nresources=['a']\ncancel_after='5m'\n[[events.updates]]\nafter='1m'\nnotice='20m'\n",
        ));
        let t0 = state.started;
        state.advance(t0);
        let first = state.document("2020-07-01")["Events"][0]["NotBefore"].clone();
        state.advance(t0 + Duration::from_secs(60));
        assert_ne!(
            state.document("2020-07-01")["Events"][0]["NotBefore"],
            first
        );
        state.advance(t0 + Duration::from_secs(300));
        assert_eq!(state.document("2020-07-01")["Events"], json!([]));
        assert_eq!(state.incarnation, 4);
    }

    #[test]
    fn start_requests_are_parsed_strictly() {
        assert_eq!(
            start_requests(br#"{"StartRequests": [{"EventId": "a"}, {"EventId": "b"}]}"#).unwrap(),
            ["a", "b"]
        );
        for bad in [
            &b"nope"[..],
            br#"{}"#,
            br#"{"StartRequests": []}"#,
            br#"{"StartRequests": [{"Id": "a"}]}"#,
        ] {
            assert!(
                start_requests(bad).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}
