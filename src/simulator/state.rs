//! The simulated VM's state: its events, their phases and timed updates, the fault injection
//! plan, and the log of requests received. Everything here is computed from the scenario and
//! the instant given, so a state can be driven without a server or a clock.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::{Value, json};

use super::{Fault, FaultEndpoint, Scenario, SimEvent};

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

pub(super) struct EventState {
    pub(super) spec: SimEvent,
    pub(super) phase: Phase,
    appeared_at: Option<Instant>,
    pub(super) not_before: Option<Instant>,
    pub(super) approved_at: Option<Instant>,
    pub(super) started_at: Option<Instant>,
    /// When a started event ended (the VM back up; for a Terminate, deleted).
    pub(super) ended_at: Option<Instant>,
    updates_applied: usize,
    pub(super) resources: Vec<String>,
    duration_in_seconds: i64,
    description: Option<String>,
}

struct FaultState {
    fault: Fault,
    remaining: u32,
}

pub(super) struct State {
    pub(super) scenario: Scenario,
    pub(super) started: Instant,
    pub(super) started_wall: DateTime<Utc>,
    pub(super) incarnation: u64,
    pub(super) events: Vec<EventState>,
    faults: Vec<FaultState>,
    pub(super) first_get_done: bool,
    incarnation_reset_done: bool,
    pub(super) last_served_incarnation: Option<u64>,
    pub(super) requests: Vec<RecordedRequest>,
    /// When each event was approved, by EventId, shared by every VM this process serves: one
    /// Azure event that lists several VMs is in each one's document under the same EventId,
    /// and a StartRequest from any of them starts it for all, as Azure does. Locked only
    /// while this VM's state is locked (never the other way round).
    released: Released,
}

/// Approvals by EventId, shared by the VMs of one simulator process.
pub(super) type Released = Arc<Mutex<HashMap<String, Instant>>>;

impl State {
    pub(super) fn new(scenario: Scenario) -> State {
        State::in_fleet(scenario, Instant::now(), Utc::now(), Released::default())
    }

    /// One VM of several served by one process: the same clock origin for all, so that an
    /// event they share appears for each at the same instant, and approvals shared.
    pub(super) fn in_fleet(
        scenario: Scenario,
        started: Instant,
        started_wall: DateTime<Utc>,
        released: Released,
    ) -> State {
        let events = scenario
            .events
            .iter()
            .map(|spec| EventState {
                phase: Phase::Pending,
                appeared_at: None,
                not_before: None,
                approved_at: None,
                started_at: None,
                ended_at: None,
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
            started,
            started_wall,
            events,
            faults,
            first_get_done: false,
            incarnation_reset_done: false,
            last_served_incarnation: None,
            requests: Vec::new(),
            released,
            scenario,
        }
    }

    /// A StartRequest for `ids` at `now`: each that is Scheduled here is approved, here and
    /// on every VM of this process whose document has it.
    pub(super) fn approve(&mut self, ids: &[String], now: Instant) {
        let mut released = lock(&self.released);
        for event in self.events.iter_mut() {
            if ids.contains(&event.spec.id) && event.phase == Phase::Scheduled {
                let at = *event.approved_at.get_or_insert(now);
                released.entry(event.spec.id.clone()).or_insert(at);
            }
        }
    }

    pub(super) fn scaled(&self, offset: Duration) -> Duration {
        offset.mul_f64(self.scenario.time_scale)
    }

    pub(super) fn wall(&self, instant: Instant) -> DateTime<Utc> {
        self.started_wall + chrono::Duration::from_std(instant - self.started).unwrap_or_default()
    }

    /// Applies everything due by `now`; one incarnation bump per call that changed anything.
    pub(super) fn advance(&mut self, now: Instant) {
        {
            // Approved through another VM that has the same event.
            let released = lock(&self.released);
            for event in self.events.iter_mut() {
                if event.approved_at.is_none()
                    && let Some(at) = released.get(&event.spec.id)
                {
                    event.approved_at = Some(*at);
                }
            }
        }
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
                    event.ended_at = Some(started + scaled(event.spec.started_for));
                    changed = true;
                }
            }
        }
        if changed {
            self.incarnation += 1;
        }
    }

    /// The document as a client of `api_version` sees it.
    pub(super) fn document(&self, api_version: &str) -> Value {
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

    /// Takes the next fault due for this method on this endpoint, if any.
    pub(super) fn take_fault(
        &mut self,
        method: &str,
        endpoint: FaultEndpoint,
        now: Instant,
    ) -> Option<Fault> {
        let start = self.started;
        let scale = self.scenario.time_scale;
        let active = self.faults.iter_mut().find(|f| {
            let from = start + f.fault.after.mul_f64(scale);
            let due = match f.fault.lasting {
                Some(lasting) => now < from + lasting.mul_f64(scale),
                None => f.remaining > 0,
            };
            due && f.fault.method == method && f.fault.endpoint == endpoint && now >= from
        })?;
        active.remaining = active.remaining.saturating_sub(1);
        Some(active.fault.clone())
    }
}

pub(super) fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
