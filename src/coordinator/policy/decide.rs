//! The decision: for every event nobody has acted on, and every drained event waiting for
//! its approval, what to do now, earliest NotBefore first.
//!
//! The budget check looks ahead: approving an event takes its VMs down now and, as far as
//! anyone knows, for its expected outage (the group's [`super::Outage`] for its type).
//! Every Scheduled event nobody holds starts at its NotBefore at the latest, so those due
//! inside that window will be down with it, whoever approves them. An approval is sent only
//! if, for each group it touches (and the fleet), the VMs down now, plus its own, plus
//! those Azure starts inside its window, fit the budget. Places are never freed by time,
//! so the count can only grow inside the window: its end is the worst moment.

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, Utc};

use super::approver::{Approver, choose};
use super::down::{Cause, Down, Start, down_now, holds};
use super::{Action, Policy};
use crate::coordinator::fleet::{Fleet, Maintenance, Stage, Via};

/// Something to do now.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// Drain these VMs (every VM the event takes down, by name, that its drain does not
    /// hold yet), then approve.
    Drain { key: String, vms: Vec<String> },
    /// Approve it: a signed request to `approver`'s agent, or through ARM at its scope.
    Approve {
        key: String,
        approver: String,
        via: Via,
    },
}

/// Why an event is not acted on now.
#[derive(Debug, Clone, PartialEq)]
pub enum Wait {
    /// Its action is `never` (or it lasts longer than the rule allows): NotBefore decides.
    Never(String),
    /// NotBefore is too close (or past): Azure starts it.
    TooLate,
    /// No VM in Resources has a live agent to send the approval to.
    NoAgent,
    /// Approved through ARM only (`approve_via = "arm"`), and no VM it takes down is in
    /// Azure's inventory to acknowledge it at.
    NotListed,
    /// Approving it would put `group` over its budget within its outage window.
    Budget {
        group: String,
        /// VMs down now (without this event's own hold).
        down: usize,
        /// VMs this approval takes down.
        adds: usize,
        /// Events Azure starts by itself inside the window (EventId and NotBefore).
        forced: Vec<(String, DateTime<Utc>)>,
        limit: usize,
    },
    /// Some VMs it lists have a live agent, or nobody has spoken for them yet, and have
    /// not reported it.
    Reports(Vec<String>),
    /// Outside every maintenance window of `group`.
    Window(String),
    /// An operator paused approvals.
    Paused(String),
    /// Drained; the drain failed and `on_failure` is `wait`.
    DrainFailed,
    /// `sources` of Azure have not been listed within `[azure] max_age`, and `group` may
    /// count their VMs: who of it is down is not known (the other groups decide on).
    Azure { group: String, sources: String },
}

impl std::fmt::Display for Wait {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Wait::Never(why) => write!(f, "not approved: {why}; NotBefore decides"),
            Wait::TooLate => write!(f, "NotBefore is too close; Azure starts it"),
            Wait::NoAgent => write!(f, "no VM in Resources has a live agent to approve it"),
            Wait::NotListed => write!(
                f,
                "no VM it takes down is in Azure's inventory, to acknowledge it through ARM at"
            ),
            Wait::Budget {
                group,
                down,
                adds,
                forced,
                limit,
            } => {
                write!(
                    f,
                    "waiting for budget: group {group} has {down} of {limit} VM(s) down, this takes {adds}"
                )?;
                if !forced.is_empty() {
                    let list: Vec<String> = forced
                        .iter()
                        .map(|(id, at)| format!("{id} at {}", at.to_rfc3339()))
                        .collect();
                    write!(
                        f,
                        ", and Azure starts {} more within its outage window ({})",
                        forced.len(),
                        list.join(", ")
                    )?;
                }
                Ok(())
            }
            Wait::Reports(vms) => write!(
                f,
                "waiting up to report_wait for the reports of {}",
                vms.join(", ")
            ),
            Wait::Window(group) => write!(
                f,
                "outside group {group}'s maintenance windows; Azure starts it at NotBefore if none opens before"
            ),
            Wait::Paused(reason) => write!(f, "paused by an operator: {reason}"),
            Wait::DrainFailed => write!(f, "drain failed; not approved, NotBefore decides"),
            Wait::Azure { group, sources } => write!(
                f,
                "waiting for Azure to list {sources} again (older than [azure] max_age): group {group} may count its VMs; Azure starts it at NotBefore meanwhile"
            ),
        }
    }
}

impl Wait {
    /// The metric label.
    pub fn label(&self) -> &'static str {
        match self {
            Wait::Never(_) => "never",
            Wait::TooLate => "too_late",
            Wait::NoAgent => "no_agent",
            Wait::NotListed => "not_listed",
            Wait::Budget { .. } => "budget",
            Wait::Reports(_) => "reports",
            Wait::Window(_) => "window",
            Wait::Paused(_) => "paused",
            Wait::DrainFailed => "drain_failed",
            Wait::Azure { .. } => "azure",
        }
    }
}

#[derive(Debug, Default, PartialEq)]
pub struct Decisions {
    pub steps: Vec<Step>,
    pub waits: Vec<(String, Wait)>,
}

/// Where an event stands for the decision.
enum Candidate {
    /// Nobody acted on it yet.
    New,
    /// Its drain ended (all drained, or failed with `on_failure = "approve"`); waiting
    /// for its approval.
    Drained,
}

/// Decides, for every event nobody has acted on and every drained one, what to do now.
pub fn decide(fleet: &Fleet, policy: &Policy, now: DateTime<Utc>) -> Decisions {
    let mut decisions = Decisions::default();
    let mut candidates: Vec<(&String, &Maintenance, Candidate)> = Vec::new();
    for (key, m) in &fleet.events {
        if m.reports.is_empty() || !m.reports.values().all(|r| r.stage == Stage::Scheduled) {
            continue;
        }
        match (&m.drain, &m.approval) {
            (None, None) if !holds(m) => candidates.push((key, m, Candidate::New)),
            (Some(drain), None) if drain.finished_at.is_some() && !m.approved_elsewhere => {
                if drain.all_done() || policy.approve_failed_drains {
                    candidates.push((key, m, Candidate::Drained));
                } else {
                    decisions.waits.push((key.clone(), Wait::DrainFailed));
                }
            }
            _ => {}
        }
    }
    // Counting who is down visits every VM: only when there is something to decide.
    if candidates.is_empty() {
        return decisions;
    }
    let mut down = down_now(fleet, policy, now);
    let held = super::stale::held_groups(fleet, policy, &down);
    // (Compared in place: a key copied per comparison was 20,000 copies at 1,000 events.
    // Keys are unique: an unstable sort orders them the same.)
    candidates.sort_unstable_by(|(a, am, _), (b, bm, _)| {
        (am.not_before, am.first_seen, a).cmp(&(bm.not_before, bm.first_seen, b))
    });
    for (key, m, candidate) in candidates {
        match one(fleet, policy, &mut down, &held, key, m, &candidate, now) {
            // The drain hook runs by VM name, for every VM the approval takes down: those
            // with an agent, those Azure lists without one, and those nobody has spoken
            // for yet (an agent that starts after the coordinator, or reports after its
            // peer): one approval starts the event on all of them. A drained event that
            // has come to list another VM since (an update, a later report) drains that
            // one too before its approval. A VM that left the inventory is gone: nothing
            // to drain.
            Ok(Taken {
                action,
                placed,
                approver,
            }) => {
                let undrained: Vec<String> = placed
                    .into_iter()
                    .map(|(vm, _)| vm)
                    .filter(|vm| {
                        action == Action::DrainThenApprove
                            && !m.drain.as_ref().is_some_and(|d| d.vms.contains_key(vm))
                            && !gone(fleet, m, vm)
                    })
                    .collect();
                decisions.steps.push(if undrained.is_empty() {
                    Step::Approve {
                        key: key.clone(),
                        approver: approver.vm,
                        via: approver.via,
                    }
                } else {
                    Step::Drain {
                        key: key.clone(),
                        vms: undrained,
                    }
                });
            }
            Err(wait) => decisions.waits.push((key.clone(), wait)),
        }
    }
    decisions
}

/// `vm` left the inventory (evicted, deleted, scaled in, or its agent silent past
/// `forget_after`) while `m` listed it, and has not come back since (no agent speaks for
/// it, no Azure listing has it): there is nothing left to drain, and no report to wait for.
fn gone(fleet: &Fleet, m: &Maintenance, vm: &str) -> bool {
    m.back.get(vm).is_some_and(|back| back.by == "left") && !fleet.knows(vm)
}

/// What [`one`] decided to do for an event: its action, the VMs it takes down (each with its
/// group), and who approves it, how.
struct Taken {
    action: Action,
    placed: Vec<(String, usize)>,
    approver: Approver,
}

#[allow(clippy::too_many_arguments)]
fn one(
    fleet: &Fleet,
    policy: &Policy,
    down: &mut Down,
    held: &BTreeMap<usize, BTreeSet<usize>>,
    key: &str,
    m: &Maintenance,
    candidate: &Candidate,
    now: DateTime<Utc>,
) -> Result<Taken, Wait> {
    if let Some(why) = &m.type_conflict {
        return Err(Wait::Never(format!(
            "its agents disagree on its EventType ({why}): left to Azure"
        )));
    }
    // Each affected VM with its group, found once for the whole decision on this event.
    let placed: Vec<(String, usize)> = m
        .affected()
        .into_iter()
        .map(|vm| {
            let g = down.group_of(fleet, policy, &vm);
            (vm, g)
        })
        .collect();
    let groups: BTreeSet<usize> = placed.iter().map(|(_, g)| *g).collect();
    // The strictest rule of the groups involved.
    let mut action = Action::Approve;
    for &g in &groups {
        let rule = policy.groups[g].rule(&m.event_type);
        if let Some(max) = rule.max_duration {
            let lasts = m.duration_seconds.filter(|d| *d >= 0);
            if lasts.is_none_or(|d| d as u64 > max.as_secs()) {
                return Err(Wait::Never(format!(
                    "{} lasts {} s, group {} approves at most {} s",
                    m.event_type,
                    m.duration_seconds
                        .map_or("an unknown number of".into(), |d| d.to_string()),
                    policy.groups[g].name,
                    max.as_secs()
                )));
            }
        }
        action = action.max(rule.action);
    }
    if placed.is_empty() {
        action = Action::Never;
    }
    if action == Action::Never {
        return Err(Wait::Never(format!(
            "the action for {:?} is never",
            m.event_type
        )));
    }
    if m.not_before.is_some_and(|at| at - now < policy.min_lead) {
        return Err(Wait::TooLate);
    }
    if let Some(pause) = &fleet.paused {
        return Err(Wait::Paused(pause.reason.clone()));
    }
    if let Some(&g) = groups.iter().find(|&&g| !policy.groups[g].open(now)) {
        return Err(Wait::Window(policy.groups[g].name.clone()));
    }
    if !held.is_empty() {
        // A VM named in Resources that neither an agent nor a listing knows (one made since
        // an old listing, under Azure's name) is placed by name alone: held too.
        let unknown = placed.iter().find(|(vm, _)| !fleet.knows(vm));
        let holding = match groups.iter().find_map(|g| held.get_key_value(g)) {
            Some((&g, sources)) => Some((g, sources.clone())),
            None => unknown.map(|(_, g)| (*g, fleet.azure_sources.held.keys().copied().collect())),
        };
        if let Some((g, sources)) = holding {
            return Err(Wait::Azure {
                group: policy.groups[g].name.clone(),
                sources: super::stale::sources_of(fleet, &sources).join(", "),
            });
        }
    }
    let affected = placed.iter().map(|(vm, _)| vm);
    // (Live: an agent, not silent, as the count found it: one hash each, where the fleet's
    // VMs were searched by name.)
    let approver = choose(fleet, policy, m, &placed, false, &|vm| down.live(vm))?;
    if matches!(candidate, Candidate::New) && now - m.first_seen < policy.report_wait {
        // A live agent that has not reported it yet, and a VM nobody has spoken for yet
        // (an agent that starts late, or reports after its peer): its report places it by
        // its resource id, in the group the operator meant.
        let missing: Vec<String> = affected
            .filter(|vm| {
                (down.live(vm) || !fleet.knows(vm))
                    && !m.reports.contains_key(*vm)
                    && !gone(fleet, m, vm)
            })
            .cloned()
            .collect();
        if !missing.is_empty() {
            return Err(Wait::Reports(missing));
        }
    }
    fits(policy, down, key, m, &placed, now)?;
    // Taken: its VMs are down for the events decided after it.
    for (vm, g) in placed.iter().cloned() {
        let causes = down.causes.entry(vm).or_default();
        if causes.is_empty() {
            down.counts[g] += 1;
        }
        causes.insert(Cause::Held(key.to_owned()));
    }
    Ok(Taken {
        action,
        placed,
        approver,
    })
}

/// The budget check over the time the approval adds to the event's VMs' downtime, for each
/// group it touches and the fleet: down now (without this event's own hold) + its VMs +
/// every VM Azure starts by itself inside that window.
///
/// The window runs from now to the end of the event's expected outage, but no further than
/// its own NotBefore: Azure starts it then whoever approves it, so from there on its VMs are
/// down either way and the approval adds nothing (it only ends their outage sooner).
/// `placed` is each VM the event takes down, with its group.
fn fits(
    policy: &Policy,
    down: &Down,
    key: &str,
    m: &Maintenance,
    placed: &[(String, usize)],
    now: DateTime<Utc>,
) -> Result<(), Wait> {
    // Down now for any reason but this event.
    let otherwise = |vm: &str| {
        down.causes
            .get(vm)
            .is_some_and(|causes| causes.iter().any(|c| c.event() != Some(key)))
    };
    let down_now = |vm: &str| down.causes.contains_key(vm);
    let affected = |vm: &str| placed.iter().any(|(mine, _)| mine == vm);
    let window_end = |g: usize| -> Option<DateTime<Utc>> {
        // An outage past what a date can hold is "until gone".
        let end = policy.groups[g]
            .outage(m)
            .and_then(|outage| now.checked_add_signed(outage));
        match (end, m.not_before) {
            (Some(end), Some(not_before)) => Some(end.min(not_before)),
            (None, not_before) => not_before,
            (end, None) => end,
        }
    };
    // The VMs Azure starts inside the window, not down otherwise and not this event's.
    let starts = |list: &[Start<'_>], end: Option<DateTime<Utc>>| {
        let mut vms: BTreeSet<&str> = BTreeSet::new();
        let mut events: Vec<(String, DateTime<Utc>)> = Vec::new();
        // Earliest NotBefore first: the first one past the window ends the look.
        for start in list.iter().take_while(|s| end.is_none_or(|end| s.at < end)) {
            let vm = start.vm.as_str();
            if start.key == key || otherwise(vm) || affected(vm) || !vms.insert(vm) {
                continue;
            }
            if !events.iter().any(|(known, _)| known == start.event_id) {
                events.push((start.event_id.to_owned(), start.at));
            }
        }
        (vms.len(), events)
    };
    let groups: BTreeSet<usize> = placed.iter().map(|(_, g)| *g).collect();
    let mut fleet_end = Some(now);
    for &g in &groups {
        let end = window_end(g);
        fleet_end = fleet_end.zip(end).map(|(a, b)| a.max(b));
        let mine: BTreeSet<&String> = placed
            .iter()
            .filter(|(_, group)| *group == g)
            .map(|(vm, _)| vm)
            .collect();
        // Down only because of this event: counted among its own VMs, not as down now.
        let only_mine = mine
            .iter()
            .filter(|vm| down_now(vm) && !otherwise(vm))
            .count();
        let base = down.counts[g] - only_mine;
        let adds = mine.iter().filter(|vm| !otherwise(vm)).count();
        let (forced, events) = starts(&down.starts[g], end);
        let limit = down.limit(policy, g);
        if base + adds + forced > limit {
            return Err(Wait::Budget {
                group: policy.groups[g].name.clone(),
                down: base,
                adds,
                forced: events,
                limit,
            });
        }
    }
    if let Some(limit) = down.fleet_limit(policy) {
        let mine: BTreeSet<&String> = placed.iter().map(|(vm, _)| vm).collect();
        let only_mine = mine
            .iter()
            .filter(|vm| down_now(vm) && !otherwise(vm))
            .count();
        let base = down.causes.len() - only_mine;
        let adds = mine.iter().filter(|vm| !otherwise(vm)).count();
        let all: Vec<Start<'_>> = down
            .pending
            .iter()
            .take_while(|p| fleet_end.is_none_or(|end| p.not_before < end))
            .flat_map(|p| {
                p.vms.iter().map(|vm| Start {
                    at: p.not_before,
                    key: p.key,
                    event_id: p.event_id,
                    vm: vm.clone(),
                })
            })
            .collect();
        let (forced, events) = starts(&all, fleet_end);
        if base + adds + forced > limit {
            return Err(Wait::Budget {
                group: "fleet".into(),
                down: base,
                adds,
                forced: events,
                limit,
            });
        }
    }
    Ok(())
}
