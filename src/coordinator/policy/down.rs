//! Who is down now, and why: the count every budget is checked against.
//!
//! A VM is down while some event that lists it holds it or is about to start, until the
//! evidence that it is back (and, where the group has one, its health gate); and while its
//! agent is silent. The events nobody holds yet are listed apart ([`Down::pending`]):
//! Azure starts each at its NotBefore at the latest, which is what an approval's window
//! must leave room for.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use chrono::{DateTime, Utc};
use serde::Serialize;

use super::{Placement, Policy};
use crate::coordinator::fleet::{Fleet, Maintenance, Vm};

/// Why a VM counts as down.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Cause {
    /// An event (by key) holds it: drained or being drained, approved (by this coordinator
    /// or anyone else), or started; until the evidence that it is back.
    Held(String),
    /// Azure starts an event (by key) of it in a moment, or did at a NotBefore already
    /// past, and no agent has said so yet.
    Starting(String),
    /// Its agent missed `silent_after` heartbeats.
    Silent,
    /// Azure Resource Manager shows it stopped, deallocated, failed or being updated.
    Azure(String),
}

impl Cause {
    fn describe(&self) -> String {
        match self {
            Cause::Held(key) => format!("held by {key}"),
            Cause::Starting(key) => format!("{key} starts at NotBefore"),
            Cause::Silent => "agent silent".into(),
            Cause::Azure(why) => why.clone(),
        }
    }

    /// The event behind it, if any.
    pub fn event(&self) -> Option<&str> {
        match self {
            Cause::Held(key) | Cause::Starting(key) => Some(key),
            Cause::Silent | Cause::Azure(_) => None,
        }
    }
}

/// An event nobody holds yet that Azure will start at its NotBefore unless it is approved
/// earlier, with the VMs it will take down.
#[derive(Debug, Clone)]
pub struct Pending<'f> {
    pub key: &'f str,
    pub event_id: &'f str,
    pub not_before: DateTime<Utc>,
    pub vms: Vec<String>,
}

/// A VM a pending event will take down, at the event's NotBefore.
#[derive(Debug, Clone)]
pub struct Start<'f> {
    pub at: DateTime<Utc>,
    /// The event's key and EventId.
    pub key: &'f str,
    pub event_id: &'f str,
    pub vm: String,
}

/// The whole fleet's count at one moment, over the fleet it was counted from.
#[derive(Debug, Clone)]
pub struct Down<'f> {
    /// Every VM down, with every reason. (A hash map: the decision looks each VM of every
    /// waiting event's window up in it; nothing reads it in its order.)
    pub causes: HashMap<String, BTreeSet<Cause>>,
    /// The VMs of the agents' inventory whose agent is silent.
    silent: HashSet<&'f str>,
    /// Per group, the VMs held past `max_hold` without evidence that they are back.
    pub overdue: Vec<BTreeSet<String>>,
    /// Scheduled events nobody holds, earliest NotBefore first.
    pub pending: Vec<Pending<'f>>,
    /// Per group, how many of its VMs are down (the VMs of `causes` in it).
    pub counts: Vec<usize>,
    /// Per group, each VM a pending event will take down, with its NotBefore and the
    /// event's key, earliest first: what an approval's window is checked against.
    pub starts: Vec<Vec<Start<'f>>>,
    /// Each VM of the inventory by name (an agent's, or one Azure lists), with its group
    /// ([`Policy::group_of`]) and whether an agent speaks for it, per group how many VMs it
    /// has and those of its Azure source no agent speaks for: what the count and the
    /// decision after it look up by name costs one hash, and it is found again only when
    /// the inventory changes (benches/profiling.md, sections 27 and 31).
    placement: Arc<Placement>,
}

impl Down<'_> {
    /// The group of `vm` (as [`Policy::group_of`] finds it).
    pub fn group_of(&self, fleet: &Fleet, policy: &Policy, vm: &str) -> usize {
        self.place_of(fleet, policy, vm).0
    }

    /// [`Down::group_of`] and [`Down::has_agent`], in one lookup.
    pub fn place_of(&self, fleet: &Fleet, policy: &Policy, vm: &str) -> (usize, bool) {
        self.placement.places.get(vm).map_or_else(
            || (policy.group_of(fleet, vm), false),
            |place| (place.group, place.agent),
        )
    }

    /// `vm` has an agent in the inventory (`fleet.vms()` has it).
    pub fn has_agent(&self, vm: &str) -> bool {
        self.placement
            .places
            .get(vm)
            .is_some_and(|place| place.agent)
    }

    /// `vm` has an agent in the inventory, and it is not silent.
    pub fn live(&self, vm: &str) -> bool {
        self.has_agent(vm) && !self.silent.contains(vm)
    }

    /// How many VMs of the inventory `group` has (each VM's group is the policy's).
    pub fn members(&self, group: usize) -> usize {
        self.placement.members[group]
    }

    /// The VMs of `group`'s Azure source that no agent speaks for.
    pub fn without_agent(&self, group: usize) -> &BTreeSet<String> {
        &self.placement.without_agent[group]
    }

    /// The group's size: the larger of the VMs known and the operator's expected size.
    pub fn size(&self, policy: &Policy, group: usize) -> usize {
        let known = self.members(group);
        policy.groups[group]
            .expected_size
            .map_or(known, |expected| known.max(expected as usize))
    }

    pub fn limit(&self, policy: &Policy, group: usize) -> usize {
        policy.groups[group].budget.limit(self.size(policy, group))
    }

    /// The fleet's limit, if `[fleet]` sets one: of the sum of the groups' sizes.
    pub fn fleet_limit(&self, policy: &Policy) -> Option<usize> {
        // (Summed only when there is a fleet budget: every budget check asks.)
        let budget = policy.fleet_budget?;
        let size = (0..policy.groups.len()).map(|g| self.size(policy, g)).sum();
        Some(budget.limit(size))
    }
}

/// The event holds its VMs ([`Maintenance::holds`]).
pub fn holds(m: &Maintenance) -> bool {
    m.holds()
}

/// When the evidence last said each VM was back from an event: its [`Back`] record, or, for
/// a VM without an agent and without a report of its own, the last report that closed an
/// event listing it. Gathered only where Azure lists VMs.
///
/// [`Back`]: crate::coordinator::fleet::Back
fn back_times(fleet: &Fleet) -> HashMap<String, DateTime<Utc>> {
    let mut backs = HashMap::new();
    if fleet.azure().is_empty() {
        return backs;
    }
    let mut note = |vm: &str, at: DateTime<Utc>| {
        let latest = backs.entry(vm.to_owned()).or_insert(at);
        *latest = (*latest).max(at);
    };
    for m in fleet.events.values() {
        for (vm, back) in &m.back {
            note(vm, back.at);
        }
        if m.over() {
            let closed = m.reports.values().map(|r| r.at).max();
            for vm in m.affected() {
                if !fleet.vms().contains_key(&vm)
                    && !m.reports.contains_key(&vm)
                    && let Some(at) = closed
                {
                    note(&vm, at);
                }
            }
        }
    }
    backs
}

/// Azure's word that `vm` is down, unless it is a restart's passing state (power starting
/// or stopping, provisioning updating) in a listing older than the evidence that the VM is
/// back: a listing taken during a Reboot says `starting` until the next one, up to a
/// `refresh` after the agent said the Reboot completed. A later listing counts again.
fn azure_down(
    fleet: &Fleet,
    backs: &HashMap<String, DateTime<Utc>>,
    vm: &str,
    listed: &crate::coordinator::azure::AzureVm,
    agent_alive: bool,
) -> Option<String> {
    let why = listed.down(agent_alive)?;
    let passing = matches!(
        listed.provisioning.as_deref(),
        Some("succeeded" | "updating")
    ) && matches!(
        listed.power.as_deref(),
        Some("running" | "starting" | "stopping")
    );
    let listed_at = fleet.azure_sources.listed_at.get(&listed.group);
    let stale = passing
        && backs
            .get(vm)
            .zip(listed_at)
            .is_some_and(|(back, listed_at)| back > listed_at);
    (!stale).then_some(why)
}

/// Nobody holds it and some agent still reports it Scheduled: Azure starts it at NotBefore
/// unless it is approved first.
pub fn pending(m: &Maintenance) -> bool {
    !holds(m)
        && m.reports
            .values()
            .any(|r| r.stage == crate::coordinator::fleet::Stage::Scheduled)
}

/// The place `vm` (of `group`; with an agent in the inventory, `has_agent`) takes for `m`
/// is free: the event is over for it, and the group's health gate (if any) has passed since.
pub fn freed(
    policy: &Policy,
    fleet: &Fleet,
    (key, m): (&str, &Maintenance),
    vm: &str,
    group: usize,
    has_agent: bool,
) -> bool {
    if !m.back_for(vm, has_agent) {
        // (Looked up only for an event over for every reporter but this VM.)
        return has_agent
            && m.over()
            && fleet
                .vms()
                .get(vm)
                .is_some_and(|agent| over_before_its_agent(key, m, vm, agent));
    }
    match m.back.get(vm) {
        Some(back) => back.healthy_at.is_some() || !policy.groups[group].gated,
        None => true,
    }
}

/// `m` (`key`) is over for `vm` by every agent's report, made while `vm` had no agent; its
/// agent first spoke (`first_seen`) only after the last of them, and its own latest
/// heartbeat does not list the event. It never reports an event gone before it started, so
/// those reports stand as its evidence (without them its place would be held for good).
fn over_before_its_agent(key: &str, m: &Maintenance, vm: &str, agent: &Vm) -> bool {
    !m.back.contains_key(vm)
        && !m.reports.contains_key(vm)
        && m.over()
        && agent
            .heartbeat
            .as_ref()
            .is_some_and(|beat| !beat.events.iter().any(|listed| listed == key))
        && agent
            .first_seen
            .is_some_and(|first| m.reports.values().all(|r| r.at < first))
}

/// Who is down at `now`, and the events Azure will start by itself.
pub fn down_now<'f>(fleet: &'f Fleet, policy: &Policy, now: DateTime<Utc>) -> Down<'f> {
    let groups = policy.groups.len();
    let mut down = Down {
        causes: HashMap::new(),
        silent: HashSet::new(),
        overdue: vec![BTreeSet::new(); groups],
        pending: Vec::new(),
        counts: Vec::new(),
        starts: Vec::new(),
        placement: policy.placement(fleet),
    };
    let backs = back_times(fleet);
    // Holding (by the coordinator, anyone else, or Azure) is the event's own state.
    for (name, vm) in fleet.vms() {
        let silent = vm.silent(now, policy.silent_after);
        if silent {
            down.silent.insert(name);
            down.causes
                .entry(name.clone())
                .or_default()
                .insert(Cause::Silent);
        }
        // Azure's own word that the VM is not serving.
        // (A fleet without an Azure source looks nothing up for it.)
        if fleet.azure().is_empty() {
            continue;
        }
        if let Some(why) = fleet
            .azure_vm(name)
            .and_then(|a| azure_down(fleet, &backs, name, a, !silent))
        {
            down.causes
                .entry(name.clone())
                .or_default()
                .insert(Cause::Azure(why));
        }
    }
    // The VMs Azure lists that no agent speaks for: down when Azure says so.
    for name in down.placement.without_agent.iter().flatten() {
        if let Some(why) = fleet
            .azure()
            .get(name)
            .and_then(|azure| azure_down(fleet, &backs, name, azure, false))
        {
            down.causes
                .entry(name.clone())
                .or_default()
                .insert(Cause::Azure(why));
        }
    }
    for (key, m) in &fleet.events {
        let held = holds(m);
        let starting = m.not_before.is_some_and(|at| at - now < policy.min_lead);
        let is_pending = !held && pending(m);
        let since = [
            m.not_before,
            m.approval.as_ref().map(|a| a.decided_at),
            m.started_at,
        ]
        .into_iter()
        .flatten()
        .max()
        .unwrap_or(m.first_seen);
        let overdue = held && now - since > policy.max_hold;
        let mut waiting = Vec::new();
        for vm in m.affected_names() {
            let (g, agent) = down.place_of(fleet, policy, vm);
            if freed(policy, fleet, (key, m), vm, g, agent) {
                continue;
            }
            let cause = if held {
                Cause::Held(key.clone())
            } else if is_pending && starting {
                Cause::Starting(key.clone())
            } else {
                if is_pending {
                    waiting.push(vm.clone());
                }
                continue;
            };
            if overdue {
                down.overdue[g].insert(vm.clone());
            }
            down.causes.entry(vm.clone()).or_default().insert(cause);
        }
        if let (true, Some(not_before)) = (is_pending && !starting, m.not_before)
            && !waiting.is_empty()
        {
            down.pending.push(Pending {
                key,
                event_id: &m.event_id,
                not_before,
                vms: waiting,
            });
        }
    }
    // (Keys are unique: an unstable sort orders them the same, without a buffer.)
    down.pending
        .sort_unstable_by(|a, b| (a.not_before, a.key).cmp(&(b.not_before, b.key)));
    down.counts = vec![0; groups];
    for vm in down.causes.keys() {
        let g = down.group_of(fleet, policy, vm);
        down.counts[g] += 1;
    }
    down.starts = vec![Vec::new(); groups];
    for p in &down.pending {
        for vm in &p.vms {
            let g = down.group_of(fleet, policy, vm);
            down.starts[g].push(Start {
                at: p.not_before,
                key: p.key,
                event_id: p.event_id,
                vm: vm.clone(),
            });
        }
    }
    down
}

/// One group's budget at a moment, as `/fleet` and the metrics show it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Usage {
    pub group: String,
    /// The larger of the VMs known and `expected_size`: what a percentage is of.
    pub size: usize,
    /// VMs in the inventory (agents that spoke, and the VMs of its Azure source), silent
    /// ones included.
    pub known: usize,
    pub expected_size: Option<u32>,
    pub limit: usize,
    pub down: BTreeSet<String>,
    /// Of the inventory, the VMs whose agent missed `silent_after` heartbeats.
    pub silent: BTreeSet<String>,
    /// Held past `max_hold` without evidence that they are back: look at them.
    pub overdue: BTreeSet<String>,
    /// Of its Azure source's VMs, those no agent speaks for (counted, approved only
    /// through Azure).
    pub without_agent: BTreeSet<String>,
    /// Why each VM of `down` is down.
    pub why: BTreeMap<String, Vec<String>>,
}

/// Every group's budget, and the fleet's when `[fleet]` sets one.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Budgets {
    pub groups: Vec<Usage>,
    pub fleet: Option<Usage>,
}

pub fn usage(fleet: &Fleet, policy: &Policy, now: DateTime<Utc>) -> Budgets {
    let down = down_now(fleet, policy, now);
    let mut groups: Vec<Usage> = policy
        .groups
        .iter()
        .enumerate()
        .map(|(g, group)| Usage {
            group: group.name.clone(),
            size: down.size(policy, g),
            known: down.members(g),
            expected_size: group.expected_size,
            limit: down.limit(policy, g),
            down: BTreeSet::new(),
            silent: BTreeSet::new(),
            overdue: down.overdue[g].clone(),
            without_agent: down.without_agent(g).clone(),
            why: BTreeMap::new(),
        })
        .collect();
    for (vm, causes) in &down.causes {
        let g = down.group_of(fleet, policy, vm);
        let usage = &mut groups[g];
        usage.down.insert(vm.clone());
        if causes.contains(&Cause::Silent) {
            usage.silent.insert(vm.clone());
        }
        usage
            .why
            .insert(vm.clone(), causes.iter().map(Cause::describe).collect());
    }
    let fleet_usage = down.fleet_limit(policy).map(|limit| Usage {
        group: "fleet".into(),
        size: groups.iter().map(|u| u.size).sum(),
        known: groups.iter().map(|u| u.known).sum(),
        expected_size: None,
        limit,
        down: groups.iter().flat_map(|u| u.down.iter().cloned()).collect(),
        silent: groups
            .iter()
            .flat_map(|u| u.silent.iter().cloned())
            .collect(),
        overdue: groups
            .iter()
            .flat_map(|u| u.overdue.iter().cloned())
            .collect(),
        without_agent: groups
            .iter()
            .flat_map(|u| u.without_agent.iter().cloned())
            .collect(),
        why: BTreeMap::new(),
    });
    Budgets {
        groups,
        fleet: fleet_usage,
    }
}
