//! The fleet as the coordinator knows it, built only from what the agents publish: per Azure
//! event (one EventId may list several VMs), what each VM's agent last reported, the
//! approvals the coordinator sent and their outcomes, and the drains it ran. Pure: every
//! function takes the time it should use.
//!
//! Deliveries are at least once and may arrive out of order (a broker redelivers, two
//! partitions interleave): a message seen before (same `source` and `id`) changes nothing,
//! and per VM and EventId a transition never moves the report backwards (scheduled and
//! updated < started < completed or cancelled; updates by incarnation).

use std::collections::{BTreeMap, HashMap};

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;

mod read;

pub use read::{Incoming, read};

/// Where one VM's report of an event stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Stage {
    Scheduled,
    Started,
    Completed,
    Cancelled,
}

impl Stage {
    fn rank(self) -> u8 {
        match self {
            Stage::Scheduled => 1,
            Stage::Started => 2,
            Stage::Completed | Stage::Cancelled => 3,
        }
    }

    pub fn is_over(self) -> bool {
        self.rank() == 3
    }
}

/// What one VM's agent last said about an event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    pub stage: Stage,
    pub incarnation: u64,
    /// The event lists this VM in Resources.
    pub affects: bool,
    pub at: DateTime<Utc>,
}

/// A request the coordinator signed for an event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sent {
    pub request_id: String,
    /// The signed `time` (whole seconds count).
    pub signed_at: DateTime<Utc>,
    /// When the broker confirmed it; `None` while it is being published.
    pub published_at: Option<DateTime<Utc>>,
}

/// An agent's answer to one of our requests.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Outcome {
    /// `accepted`, `rejected` or `failed`.
    pub outcome: String,
    pub reason: String,
    pub request_id: String,
    pub at: DateTime<Utc>,
}

/// The coordinator approved (or, in a dry run, would approve) an event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Approval {
    /// The VM whose agent the request goes to (the first in Resources with an agent).
    pub approver: String,
    pub decided_at: DateTime<Utc>,
    pub dry_run: bool,
    /// Every request signed for it, oldest first.
    pub sent: Vec<Sent>,
    pub outcome: Option<Outcome>,
    /// Gave up after `max_attempts` (alerted).
    pub abandoned: bool,
}

/// A drain of each affected VM that has an agent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Drain {
    pub started_at: DateTime<Utc>,
    pub deadline: DateTime<Utc>,
    /// Per VM: `running`, `done` or `failed: <why>`.
    pub vms: BTreeMap<String, String>,
    pub finished_at: Option<DateTime<Utc>>,
    pub deadline_missed: bool,
}

impl Drain {
    pub fn all_done(&self) -> bool {
        self.vms.values().all(|state| state == "done")
    }
    pub fn any_failed(&self) -> bool {
        self.vms.values().any(|state| state.starts_with("failed"))
    }
    pub fn running(&self) -> bool {
        self.vms.values().any(|state| state == "running")
    }
}

/// One Azure event, as the fleet's agents reported it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Maintenance {
    /// As the agents spell it (the key is its upper-case form).
    pub event_id: String,
    pub event_type: String,
    pub event_source: Option<String>,
    pub duration_seconds: Option<i64>,
    pub not_before: Option<DateTime<Utc>>,
    pub resources: Vec<String>,
    pub first_seen: DateTime<Utc>,
    pub last_report: DateTime<Utc>,
    pub reports: BTreeMap<String, Report>,
    pub drain: Option<Drain>,
    pub approval: Option<Approval>,
    /// The latest decision, in words (for `/fleet` and logs).
    #[serde(default)]
    pub verdict: String,
    /// An agent accepted an approval this coordinator did not send (its local policy, or
    /// another orchestrator): the event is starting, its VMs count as down.
    #[serde(default)]
    pub approved_elsewhere: bool,
}

impl Maintenance {
    /// The VMs it takes down: those in Resources, or, if it lists none, the agents that say
    /// it affects them.
    pub fn affected(&self) -> Vec<String> {
        if !self.resources.is_empty() {
            return self.resources.clone();
        }
        self.reports
            .iter()
            .filter(|(_, report)| report.affects)
            .map(|(vm, _)| vm.clone())
            .collect()
    }

    /// Every report says Scheduled: nothing has started, nothing is over.
    pub fn all_scheduled(&self) -> bool {
        self.reports.values().all(|r| r.stage == Stage::Scheduled)
    }

    pub fn any_started(&self) -> bool {
        self.reports.values().any(|r| r.stage == Stage::Started)
    }

    /// Over for `vm`: its own agent said completed or cancelled, or, for a VM without a
    /// report, every agent did.
    pub fn over_for(&self, vm: &str) -> bool {
        match self.reports.get(vm) {
            Some(report) => report.stage.is_over(),
            None => !self.reports.is_empty() && self.reports.values().all(|r| r.stage.is_over()),
        }
    }

    pub fn over(&self) -> bool {
        self.affected().iter().all(|vm| self.over_for(vm))
            && self.reports.values().all(|r| r.stage.is_over())
    }

    /// The coordinator holds it (a drain or an approval) or Azure started it: its VMs count
    /// as down until each is over.
    pub fn holds(&self) -> bool {
        self.approval.is_some()
            || self.drain.is_some()
            || self.approved_elsewhere
            || self.any_started()
    }
}

/// A VM that has an agent (it published something).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Vm {
    pub resource_id: Option<String>,
    pub last_seen: DateTime<Utc>,
}

/// What applying a message did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Applied {
    /// The event (by key) changed.
    Changed(String),
    /// An outcome of a request of ours.
    Outcome(String),
    /// Seen before (same source and id).
    Duplicate,
    /// Older than what the VM already reported.
    Stale,
    /// An outcome of a request the coordinator did not send (an agent's local policy, or
    /// another orchestrator).
    Foreign,
    /// An accepted outcome of someone else's request for known events (by key).
    ApprovedElsewhere(Vec<String>),
    /// Contradicts what is known (another EventType for an EventId, another resource id for
    /// a VM name): not applied.
    Conflict(String),
    /// A document: its VM has an agent.
    Agent,
    Ignored(&'static str),
}

/// The whole known fleet.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Fleet {
    /// By upper-case EventId.
    pub events: BTreeMap<String, Maintenance>,
    pub vms: BTreeMap<String, Vm>,
    /// `(source, id)` of every message applied, with when: at-least-once input.
    #[serde(skip)]
    pub seen: HashMap<(String, String), DateTime<Utc>>,
}

pub fn key_of(event_id: &str) -> String {
    event_id.to_ascii_uppercase()
}

/// Records that `vm`'s agent spoke at `now`; its resource id is set once and never moved
/// (VM names must be unique on the broker: approvals are routed by name).
fn agent<'a>(
    vms: &'a mut BTreeMap<String, Vm>,
    vm: &str,
    resource_id: Option<String>,
    now: DateTime<Utc>,
) -> Result<&'a mut Vm, String> {
    let agent = vms.entry(vm.to_owned()).or_insert(Vm {
        resource_id: None,
        last_seen: now,
    });
    match (&agent.resource_id, resource_id) {
        (Some(known), Some(new)) if !known.eq_ignore_ascii_case(&new) => {
            return Err(format!(
                "VM {vm:?} reported as {new}, but it is {known}: two VMs share a name, or a publisher lies"
            ));
        }
        (None, Some(new)) => agent.resource_id = Some(new),
        _ => {}
    }
    agent.last_seen = now;
    Ok(agent)
}

impl Fleet {
    /// Applies one message received at `now`.
    pub fn apply(&mut self, incoming: Incoming, now: DateTime<Utc>) -> Applied {
        if let Some(key) = incoming.key() {
            if self.seen.contains_key(&key) {
                return Applied::Duplicate;
            }
            self.seen.insert(key, now);
        }
        match incoming {
            Incoming::Ignored(what) => Applied::Ignored(what),
            Incoming::Document { vm, source, .. } => {
                let resource_id = source.starts_with("/subscriptions/").then_some(source);
                match agent(&mut self.vms, &vm, resource_id, now) {
                    Ok(_) => Applied::Agent,
                    Err(conflict) => Applied::Conflict(conflict),
                }
            }
            Incoming::Transition {
                vm,
                resource_id,
                stage,
                update,
                incarnation,
                affects,
                event,
                ..
            } => {
                if let Err(conflict) = agent(&mut self.vms, &vm, resource_id, now) {
                    return Applied::Conflict(conflict);
                }
                let event_id = event["EventId"].as_str().unwrap_or_default().to_owned();
                let key = key_of(&event_id);
                let entry = self
                    .events
                    .entry(key.clone())
                    .or_insert_with(|| Maintenance {
                        event_id: event_id.clone(),
                        event_type: String::new(),
                        event_source: None,
                        duration_seconds: None,
                        not_before: None,
                        resources: Vec::new(),
                        first_seen: now,
                        last_report: now,
                        reports: BTreeMap::new(),
                        drain: None,
                        approval: None,
                        verdict: String::new(),
                        approved_elsewhere: false,
                    });
                let event_type = event["EventType"].as_str().unwrap_or_default();
                if !entry.event_type.is_empty()
                    && !entry.event_type.eq_ignore_ascii_case(event_type)
                {
                    return Applied::Conflict(format!(
                        "{vm} reports {event_id} as a {event_type:?}, known as a {:?}",
                        entry.event_type
                    ));
                }
                if let Some(report) = entry.reports.get(&vm) {
                    let newer = stage.rank() > report.stage.rank()
                        || (stage.rank() == report.stage.rank()
                            && !report.stage.is_over()
                            && incarnation > report.incarnation
                            && (update || stage != report.stage));
                    if !newer {
                        return Applied::Stale;
                    }
                }
                entry.reports.insert(
                    vm,
                    Report {
                        stage,
                        incarnation,
                        affects,
                        at: now,
                    },
                );
                entry.last_report = now;
                // The fields of the newest report of a VM the event affects win (another
                // VM's document may lag behind), except that an event that is over keeps the
                // fields it had while it was live.
                if entry.event_type.is_empty() || (affects && !stage.is_over()) {
                    fields(entry, &event);
                }
                Applied::Changed(key)
            }
            Incoming::Outcome {
                vm,
                request_id,
                outcome,
                reason,
                event_ids,
                ..
            } => {
                if let Some(agent) = self.vms.get_mut(&vm) {
                    agent.last_seen = now;
                }
                for event_id in &event_ids {
                    let key = key_of(event_id);
                    let Some(entry) = self.events.get_mut(&key) else {
                        continue;
                    };
                    let Some(approval) = entry.approval.as_mut() else {
                        continue;
                    };
                    let Some(index) = approval
                        .sent
                        .iter()
                        .position(|s| s.request_id == request_id)
                    else {
                        continue;
                    };
                    // An accepted outcome is final; the outcome of an older request than the
                    // newest counts only if it is an acceptance.
                    let accepted = outcome == "accepted";
                    if approval
                        .outcome
                        .as_ref()
                        .is_some_and(|o| o.outcome == "accepted")
                        || (!accepted && index + 1 != approval.sent.len())
                    {
                        return Applied::Outcome(key);
                    }
                    approval.outcome = Some(Outcome {
                        outcome,
                        reason,
                        request_id,
                        at: now,
                    });
                    return Applied::Outcome(key);
                }
                if outcome == "accepted" {
                    // Someone else started these events: their VMs are going down.
                    let mut changed = Vec::new();
                    for event_id in &event_ids {
                        if let Some(entry) = self.events.get_mut(&key_of(event_id)) {
                            entry.approved_elsewhere = true;
                            changed.push(key_of(event_id));
                        }
                    }
                    if !changed.is_empty() {
                        return Applied::ApprovedElsewhere(changed);
                    }
                }
                Applied::Foreign
            }
        }
    }

    /// Forgets events no agent has reported on for `forget_after`, and seen ids older than
    /// that. Returns the keys of the events and the ids removed.
    pub fn prune(
        &mut self,
        now: DateTime<Utc>,
        forget_after: chrono::Duration,
    ) -> (Vec<String>, Vec<(String, String)>, Vec<String>) {
        let gone: Vec<String> = self
            .events
            .iter()
            .filter(|(_, m)| now - m.last_report > forget_after)
            .map(|(key, _)| key.clone())
            .collect();
        for key in &gone {
            self.events.remove(key);
        }
        let old: Vec<(String, String)> = self
            .seen
            .iter()
            .filter(|(_, at)| now - **at > forget_after)
            .map(|(key, _)| key.clone())
            .collect();
        for key in &old {
            self.seen.remove(key);
        }
        // Agents silent that long are gone (a scale set shrank): they leave the group sizes.
        let silent: Vec<String> = self
            .vms
            .iter()
            .filter(|(_, vm)| now - vm.last_seen > forget_after)
            .map(|(name, _)| name.clone())
            .collect();
        for name in &silent {
            self.vms.remove(name);
        }
        (gone, old, silent)
    }
}

/// Copies the Azure event's fields (as received) into the record.
fn fields(entry: &mut Maintenance, event: &Value) {
    if let Some(ty) = event["EventType"].as_str() {
        entry.event_type = ty.to_owned();
    }
    entry.event_source = event["EventSource"].as_str().map(str::to_owned);
    entry.duration_seconds = event["DurationInSeconds"].as_i64();
    entry.not_before = event["NotBefore"]
        .as_str()
        .filter(|t| !t.is_empty())
        .and_then(|t| DateTime::parse_from_rfc2822(t).ok())
        .map(|t| t.with_timezone(&Utc));
    if let Some(resources) = event["Resources"].as_array() {
        entry.resources = resources
            .iter()
            .filter_map(|r| r.as_str().map(str::to_owned))
            .collect();
    }
}
