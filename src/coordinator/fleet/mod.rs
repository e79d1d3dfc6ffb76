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

mod actions;
mod inventory;
mod read;
mod said;

pub use actions::{Approval, Drain, Outcome, Sent, Via};
pub use inventory::{AzureSources, Back, Heartbeat, MAX_CONFLICTS, Pause, Vm};
use inventory::{Version, agent};
pub use read::{Incoming, MAX_RESOURCES, read, read_at};
pub use said::Said;
use said::{fields, said, together};

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
    /// The agent's incarnation epoch (`~e<n>` in its ids; 0 until Azure first restarted
    /// the numbering): after a reset, a lower incarnation of a higher epoch is newer.
    #[serde(default)]
    pub epoch: u64,
    /// The event lists this VM in Resources.
    pub affects: bool,
    pub at: DateTime<Utc>,
    /// What this VM's document said of the event when it was last live (Resources,
    /// NotBefore, DurationInSeconds): each VM's word is kept apart, so that one VM's
    /// report can add to what the others say but never take from it. `None` in records
    /// written before these were kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub said: Option<Said>,
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
    /// When an agent first reported it Started.
    #[serde(default)]
    pub started_at: Option<DateTime<Utc>>,
    /// Per affected VM, the evidence that the event is over for it: only this frees the
    /// VM's place in its budget (see [`Back`]).
    #[serde(default)]
    pub back: BTreeMap<String, Back>,
    /// Held past `max_hold` without evidence that its VMs are back: alerted once.
    #[serde(default)]
    pub overdue: bool,
    /// Agents reported it with different EventTypes: which one is true is unknown, so the
    /// coordinator never approves it (Azure starts it at NotBefore) and says why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub type_conflict: Option<String>,
}

impl Maintenance {
    /// An event first reported at `now`, before anything of it is known but its id.
    pub fn new(event_id: String, now: DateTime<Utc>) -> Maintenance {
        Maintenance {
            event_id,
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
            started_at: None,
            back: BTreeMap::new(),
            overdue: false,
            type_conflict: None,
        }
    }

    /// The VMs it takes down: those in Resources, or, if it lists none, the agents that say
    /// it affects them.
    pub fn affected(&self) -> Vec<String> {
        self.affected_names().cloned().collect()
    }

    /// [`Maintenance::affected`], without copying the names.
    pub fn affected_names(&self) -> impl Iterator<Item = &String> {
        // The reports only when Resources lists none.
        let reports = if self.resources.is_empty() {
            self.reports.len()
        } else {
            0
        };
        let reported = self.reports.iter().take(reports).filter(|(_, r)| r.affects);
        self.resources.iter().chain(reported.map(|(vm, _)| vm))
    }

    /// It holds its VMs: the coordinator drains or approved it, someone else approved it, or
    /// it started (an agent said Started, or completed, which it only does after).
    pub fn holds(&self) -> bool {
        self.approval.is_some()
            || self.drain.is_some()
            || self.approved_elsewhere
            || self.started_at.is_some()
            || self.reports.values().any(|r| r.stage == Stage::Completed)
    }

    /// Whether it takes `vm` down (as [`Maintenance::affected`], without building the list).
    pub fn lists(&self, vm: &str) -> bool {
        if self.resources.is_empty() {
            self.reports.get(vm).is_some_and(|r| r.affects)
        } else {
            self.resources.iter().any(|r| r == vm)
        }
    }

    /// Every report says Scheduled: nothing has started, nothing is over.
    pub fn all_scheduled(&self) -> bool {
        self.reports.values().all(|r| r.stage == Stage::Scheduled)
    }

    /// Evidence that the event is over for `vm`: a [`Back`] record (its own agent's
    /// report, a heartbeat, its leaving, an operator), or, for a VM without an agent in the
    /// inventory (`has_agent` false) and without a report of its own, every agent's report.
    pub fn back_for(&self, vm: &str, has_agent: bool) -> bool {
        if self.back.contains_key(vm) {
            return true;
        }
        !has_agent
            && !self.reports.contains_key(vm)
            && !self.reports.is_empty()
            && self.reports.values().all(|r| r.stage.is_over())
    }

    /// Every report says completed or cancelled.
    pub fn over(&self) -> bool {
        !self.reports.is_empty() && self.reports.values().all(|r| r.stage.is_over())
    }
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
    /// A heartbeat; the keys of the events it showed to be over for its VM.
    Heartbeat(Vec<String>),
    /// An answer with `dryRun: true`: the agent POSTed nothing, nothing is approved; the
    /// key of the event when the request was ours.
    DryRun(Option<String>),
    Ignored(&'static str),
}

/// The whole known fleet.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Fleet {
    /// By upper-case EventId.
    pub events: BTreeMap<String, Maintenance>,
    /// By name ([`Fleet::vms`]); changed only through the fleet's own functions, each of
    /// which marks what changes where VMs count ([`Fleet::inventory_version`]).
    vms: BTreeMap<String, Vm>,
    /// `(source, id)` of every message applied, with when: at-least-once input.
    #[serde(skip)]
    pub seen: HashMap<(String, String), DateTime<Utc>>,
    /// Set while an operator has paused approvals; stored like the rest.
    #[serde(default)]
    pub paused: Option<Pause>,
    /// Per VM name, the last message refused because it contradicts who the VM is (another
    /// resource id, none where one is known, a name that shares a subject with another):
    /// shown in `/fleet`, not stored.
    #[serde(skip)]
    pub conflicts: BTreeMap<String, String>,
    /// The VMs Azure Resource Manager lists for the groups with an Azure source, by name
    /// ([`Fleet::azure`]): listed again at every refresh ([`Fleet::set_azure`]), not stored.
    #[serde(skip)]
    azure: BTreeMap<String, crate::coordinator::azure::AzureVm>,
    /// The names of `azure` by lower-case resource id ([`Fleet::set_azure`]).
    #[serde(skip)]
    azure_ids: HashMap<String, String>,
    /// How fresh each group's Azure sources are ([`AzureSources`]).
    #[serde(skip)]
    pub azure_sources: AzureSources,
    /// Where VMs count: see [`Fleet::inventory_version`].
    #[serde(skip)]
    inventory: Version,
}

pub fn key_of(event_id: &str) -> String {
    event_id.to_ascii_uppercase()
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
                // A document carries no identity but its `source`, which an agent may set
                // to anything else: one without a resource id claims none.
                let resource_id = source.starts_with("/subscriptions/").then_some(source);
                let claims = resource_id.is_some();
                match agent(&mut self.vms, &mut self.inventory, &vm, resource_id, now) {
                    Ok(_) => Applied::Agent,
                    Err(_) if !claims => Applied::Agent,
                    Err(conflict) => {
                        self.note_conflict(&vm, &conflict);
                        Applied::Conflict(conflict)
                    }
                }
            }
            Incoming::Heartbeat {
                vm,
                resource_id,
                beat,
                ..
            } => self.heartbeat(&vm, resource_id, beat, now),
            Incoming::Transition {
                vm,
                resource_id,
                stage,
                update,
                incarnation,
                epoch,
                affects,
                event,
                ..
            } => {
                if let Err(conflict) =
                    agent(&mut self.vms, &mut self.inventory, &vm, resource_id, now)
                {
                    self.note_conflict(&vm, &conflict);
                    return Applied::Conflict(conflict);
                }
                let event_id = event["EventId"].as_str().unwrap_or_default().to_owned();
                let key = key_of(&event_id);
                let entry = self
                    .events
                    .entry(key.clone())
                    .or_insert_with(|| Maintenance::new(event_id.clone(), now));
                let event_type = event["EventType"].as_str().unwrap_or_default();
                // Two EventTypes for one EventId: one of the agents is wrong (or forged),
                // and which is unknown. Refusing the later report would let whoever spoke
                // first decide the type and silence the others (their Started would never
                // count): every report is kept, and the event is never approved.
                let conflicting = !entry.event_type.is_empty()
                    && !entry.event_type.eq_ignore_ascii_case(event_type);
                if conflicting && entry.type_conflict.is_none() {
                    entry.type_conflict = Some(format!(
                        "{vm} reports {event_id} as a {event_type:?}, known as a {:?}",
                        entry.event_type
                    ));
                }
                if let Some(report) = entry.reports.get(&vm) {
                    // Incarnations compare within an epoch: after Azure restarted the
                    // numbering, a lower incarnation of a later epoch is newer.
                    let later = (epoch, incarnation) > (report.epoch, report.incarnation);
                    let newer = stage.rank() > report.stage.rank()
                        || (stage.rank() == report.stage.rank()
                            && !report.stage.is_over()
                            && later
                            && (update || stage != report.stage));
                    if !newer {
                        return Applied::Stale;
                    }
                }
                // An event that is over keeps what the VM said while it was live.
                let said = match entry.reports.get(&vm) {
                    Some(report) if stage.is_over() && report.said.is_some() => report.said.clone(),
                    _ => Some(said(&event)),
                };
                entry.reports.insert(
                    vm.clone(),
                    Report {
                        stage,
                        incarnation,
                        epoch,
                        affects,
                        at: now,
                        said,
                    },
                );
                entry.last_report = now;
                if stage == Stage::Started {
                    entry.started_at.get_or_insert(now);
                }
                if stage.is_over() {
                    let by = if stage == Stage::Completed {
                        "completed"
                    } else {
                        "cancelled"
                    };
                    entry
                        .back
                        .entry(vm.clone())
                        .or_insert_with(|| Back::new(by, now));
                }
                // The type and source of the newest report of a VM the event affects win,
                // except that an event that is over keeps those it had while it was live;
                // Resources, NotBefore and the duration are what every VM said, together.
                if !conflicting && (entry.event_type.is_empty() || (affects && !stage.is_over())) {
                    fields(entry, &event);
                }
                together(entry);
                if conflicting {
                    let why = entry.type_conflict.clone().unwrap_or_default();
                    self.note_conflict(&vm, &why);
                    return Applied::Conflict(why);
                }
                Applied::Changed(key)
            }
            Incoming::Outcome {
                vm,
                resource_id,
                request_id,
                outcome,
                reason,
                event_ids,
                dry_run,
                ..
            } => {
                if let Err(conflict) =
                    agent(&mut self.vms, &mut self.inventory, &vm, resource_id, now)
                {
                    self.note_conflict(&vm, &conflict);
                    return Applied::Conflict(conflict);
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
                    if dry_run {
                        // The agent checked it and POSTed nothing: no outcome yet, so the
                        // request is renewed after `outcome_timeout` like an unanswered one.
                        approval.dry_run_answers += 1;
                        return Applied::DryRun(Some(key));
                    }
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
                if dry_run {
                    return Applied::DryRun(None);
                }
                if outcome == "accepted" {
                    // Someone else started these events: their VMs are going down. Only the
                    // agent of a VM an event concerns can say so (any other could hold the
                    // budget of VMs it has nothing to do with).
                    let mut changed = Vec::new();
                    for event_id in &event_ids {
                        if let Some(entry) = self
                            .events
                            .get_mut(&key_of(event_id))
                            .filter(|m| m.lists(&vm))
                        {
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

    /// Forgets events no agent has reported on for `forget_after` but those in `holding`
    /// (they still hold a VM's place), and seen ids older than that. Returns the keys of
    /// the events and the ids removed.
    pub fn prune(
        &mut self,
        now: DateTime<Utc>,
        forget_after: chrono::Duration,
        holding: &std::collections::BTreeSet<String>,
    ) -> (Vec<String>, Vec<(String, String)>) {
        let gone: Vec<String> = self
            .events
            .iter()
            .filter(|(key, m)| now - m.last_report > forget_after && !holding.contains(*key))
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
        (gone, old)
    }
}
