//! Who may go down now: groups of VMs, their disruption budgets, and per event type an
//! action. [`decide`] is a pure function of the fleet, the policy and the time: it returns
//! the drains to start and the approvals to send, earliest NotBefore first, and never more
//! than a group's budget allows.
//!
//! A VM is *down* while an event that lists it is held by the coordinator (being drained,
//! drained, approved) or started by Azure, until its own agent reports the event completed
//! or cancelled. An event that lists several VMs costs each of them against its own group.
//! Events Azure starts by itself at NotBefore count too, but they are Azure's decision:
//! the budget only stops the coordinator from adding to them.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::fleet::{Fleet, Maintenance};

/// The group of VMs that no configured group matches (`[defaults]`).
pub const DEFAULT_GROUP: &str = "default";

/// What to do with a Scheduled event of a type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// Approve at once (within the budget).
    Approve,
    /// Run the drain hook for each VM, approve when every drain succeeded.
    DrainThenApprove,
    /// Never approve: NotBefore decides.
    Never,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rule {
    pub action: Action,
    /// Events that last longer (DurationInSeconds; unknown counts as longer) are `never`.
    pub max_duration: Option<Duration>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Budget {
    /// At most this many VMs down at once.
    Count(u32),
    /// At most this percentage of the group's known VMs, rounded up.
    Percent(u32),
}

/// Which VMs belong to a group; every part that is set must match. There is no availability
/// set part: a VM's resource id does not name its availability set, and neither does the
/// metadata service; group such VMs by name.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Matcher {
    pub vm_name: Option<String>,
    pub resource_group: Option<String>,
    pub scale_set: Option<String>,
}

impl Matcher {
    pub fn is_empty(&self) -> bool {
        self.vm_name.is_none() && self.resource_group.is_none() && self.scale_set.is_none()
    }

    /// Resource-id parts compare ignoring case (Azure's ids are case-insensitive); a VM
    /// whose resource id is unknown (no agent, or an agent without one) matches no
    /// resource-id part.
    pub fn matches(&self, vm: &str, resource_id: Option<&str>) -> bool {
        if self.is_empty() {
            return true;
        }
        if let Some(pattern) = &self.vm_name
            && !glob(pattern, vm)
        {
            return false;
        }
        let part = |segment: &str| {
            resource_id.and_then(|id| {
                let parts: Vec<&str> = id.split('/').collect();
                parts
                    .iter()
                    .position(|p| p.eq_ignore_ascii_case(segment))
                    .and_then(|i| parts.get(i + 1).copied())
            })
        };
        for (wanted, segment) in [
            (&self.resource_group, "resourceGroups"),
            (&self.scale_set, "virtualMachineScaleSets"),
        ] {
            if let Some(wanted) = wanted
                && !part(segment).is_some_and(|found| {
                    glob(&wanted.to_ascii_lowercase(), &found.to_ascii_lowercase())
                })
            {
                return false;
            }
        }
        true
    }
}

/// `*` matches any run of characters, `?` one; everything else itself.
pub fn glob(pattern: &str, text: &str) -> bool {
    let (p, t): (Vec<char>, Vec<char>) = (pattern.chars().collect(), text.chars().collect());
    let (mut pi, mut ti, mut star, mut mark) = (0, 0, None, 0);
    while ti < t.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == t[ti]) {
            pi += 1;
            ti += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some(pi);
            mark = ti;
            pi += 1;
        } else if let Some(s) = star {
            pi = s + 1;
            mark += 1;
            ti = mark;
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|c| *c == '*')
}

#[derive(Debug, Clone, PartialEq)]
pub struct Group {
    pub name: String,
    pub matcher: Matcher,
    pub budget: Budget,
    /// By lower-case EventType.
    pub rules: BTreeMap<String, Rule>,
}

impl Group {
    /// The rule for an EventType; a type nobody named is `never`.
    pub fn rule(&self, event_type: &str) -> Rule {
        self.rules
            .get(&event_type.to_ascii_lowercase())
            .copied()
            .unwrap_or(Rule {
                action: Action::Never,
                max_duration: None,
            })
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    /// In order; the first that matches a VM is its group; the last is [`DEFAULT_GROUP`].
    pub groups: Vec<Group>,
    /// Events whose NotBefore is closer than this are left to Azure.
    pub min_lead: chrono::Duration,
    /// A held event stops counting this long after its NotBefore and its last report (a
    /// Spot-evicted or deleted VM never reports the end).
    pub max_hold: chrono::Duration,
}

impl Policy {
    pub fn group_of(&self, fleet: &Fleet, vm: &str) -> usize {
        let resource_id = fleet.vms.get(vm).and_then(|v| v.resource_id.as_deref());
        self.groups
            .iter()
            .position(|g| g.matcher.matches(vm, resource_id))
            .unwrap_or(self.groups.len() - 1)
    }
}

/// One group's budget at a moment.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Usage {
    pub group: String,
    /// VMs known in the group (agents, and VMs named in events' Resources).
    pub size: usize,
    pub limit: usize,
    pub down: BTreeSet<String>,
    /// Of `down`, the VMs down only because Azure is about to start an event of theirs
    /// (NotBefore closer than `min_lead`): approving another event of theirs now takes them
    /// down sooner, so it costs a place like any other VM.
    #[serde(skip)]
    pub starting: BTreeSet<String>,
}

/// Every group's VMs with an agent, and the VMs down at `now` (with or without an agent).
pub fn usage(fleet: &Fleet, policy: &Policy, now: DateTime<Utc>) -> Vec<Usage> {
    let mut members: Vec<BTreeSet<&str>> = vec![BTreeSet::new(); policy.groups.len()];
    let mut down: Vec<BTreeSet<String>> = vec![BTreeSet::new(); policy.groups.len()];
    let mut held: Vec<BTreeSet<String>> = vec![BTreeSet::new(); policy.groups.len()];
    // Only agents make a group's size: names in a message's Resources cost nothing to
    // invent, and would widen a percentage.
    for vm in fleet.vms.keys() {
        members[policy.group_of(fleet, vm)].insert(vm);
    }
    let counts = |m: &&Maintenance| {
        let since = m.not_before.unwrap_or(m.first_seen).max(m.last_report);
        // Too close to its NotBefore to approve, or past it: Azure starts it by itself,
        // before its agent can report it Started. Down already, or any approval now could
        // overlap it.
        let starting = m.not_before.is_some_and(|at| at - now < policy.min_lead);
        (m.holds() || starting) && now - since <= policy.max_hold
    };
    for m in fleet.events.values().filter(counts) {
        for vm in m.affected() {
            if !m.over_for(&vm) {
                let g = policy.group_of(fleet, &vm);
                if m.holds() {
                    held[g].insert(vm.clone());
                }
                down[g].insert(vm);
            }
        }
    }
    policy
        .groups
        .iter()
        .zip(members)
        .zip(down.into_iter().zip(held))
        .map(|((group, members), (down, held))| Usage {
            group: group.name.clone(),
            size: members.len(),
            limit: limit(group.budget, members.len()),
            starting: down.difference(&held).cloned().collect(),
            down,
        })
        .collect()
}

fn limit(budget: Budget, size: usize) -> usize {
    match budget {
        Budget::Count(count) => count as usize,
        Budget::Percent(percent) => (size * percent as usize).div_ceil(100),
    }
}

/// Something to do now.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// Drain these VMs (the affected ones with an agent), then approve.
    Drain { key: String, vms: Vec<String> },
    /// Sign and send an approval to `approver`'s agent.
    Approve { key: String, approver: String },
}

/// Why an event is not acted on now.
#[derive(Debug, Clone, PartialEq)]
pub enum Wait {
    /// Its action is `never` (or it lasts longer than the rule allows): NotBefore decides.
    Never(String),
    /// NotBefore is too close (or past): Azure starts it.
    TooLate,
    /// No VM in Resources has an agent to send the approval to.
    NoAgent,
    /// Approving it would put `group` over its budget.
    Budget {
        group: String,
        down: usize,
        limit: usize,
    },
}

impl std::fmt::Display for Wait {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Wait::Never(why) => write!(f, "not approved: {why}; NotBefore decides"),
            Wait::TooLate => write!(f, "NotBefore is too close; Azure starts it"),
            Wait::NoAgent => write!(f, "no VM in Resources has an agent to approve it"),
            Wait::Budget { group, down, limit } => write!(
                f,
                "waiting for budget: group {group} has {down} of {limit} VM(s) down"
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
            Wait::Budget { .. } => "budget",
        }
    }
}

#[derive(Debug, Default, PartialEq)]
pub struct Decisions {
    pub steps: Vec<Step>,
    pub waits: Vec<(String, Wait)>,
}

/// Decides, for every event nobody has acted on yet, what to do now.
pub fn decide(fleet: &Fleet, policy: &Policy, now: DateTime<Utc>) -> Decisions {
    let mut usage = usage(fleet, policy, now);
    let mut pending: Vec<(&String, &Maintenance)> = fleet
        .events
        .iter()
        .filter(|(_, m)| {
            m.approval.is_none() && m.drain.is_none() && !m.approved_elsewhere && m.all_scheduled()
        })
        .filter(|(_, m)| !m.reports.is_empty())
        .collect();
    pending.sort_by_key(|(key, m)| (m.not_before, m.first_seen, (*key).clone()));
    let mut decisions = Decisions::default();
    for (key, m) in pending {
        match one(fleet, policy, &mut usage, m, now) {
            Ok(step) => decisions.steps.push(match step {
                Action::DrainThenApprove => Step::Drain {
                    key: key.clone(),
                    vms: m
                        .affected()
                        .into_iter()
                        .filter(|vm| fleet.vms.contains_key(vm))
                        .collect(),
                },
                _ => Step::Approve {
                    key: key.clone(),
                    approver: approver(fleet, m).expect("checked by one()"),
                },
            }),
            Err(wait) => decisions.waits.push((key.clone(), wait)),
        }
    }
    decisions
}

/// The agent an approval goes to: the first VM in Resources whose agent has reported the
/// event (its document has it, so the agent will not answer `unknown_event`), else the first
/// with an agent at all. One approval releases every VM the event lists.
pub fn approver(fleet: &Fleet, m: &Maintenance) -> Option<String> {
    let affected = m.affected();
    affected
        .iter()
        .find(|vm| {
            fleet.vms.contains_key(*vm) && m.reports.get(*vm).is_some_and(|r| !r.stage.is_over())
        })
        .or_else(|| affected.iter().find(|vm| fleet.vms.contains_key(*vm)))
        .cloned()
}

fn one(
    fleet: &Fleet,
    policy: &Policy,
    usage: &mut [Usage],
    m: &Maintenance,
    now: DateTime<Utc>,
) -> Result<Action, Wait> {
    let affected = m.affected();
    let groups: Vec<usize> = affected
        .iter()
        .map(|vm| policy.group_of(fleet, vm))
        .collect();
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
    if affected.is_empty() {
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
    if approver(fleet, m).is_none() {
        return Err(Wait::NoAgent);
    }
    // Budget: each VM not down yet adds one to its group.
    let mut adds: BTreeMap<usize, Vec<&String>> = BTreeMap::new();
    for (vm, &g) in affected.iter().zip(&groups) {
        // A VM down only because Azure starts an event of its in a moment costs a place
        // again (counted twice: conservative by one, for a second at most).
        let down_now = usage[g].down.contains(vm) && !usage[g].starting.contains(vm);
        if !down_now && !adds.get(&g).is_some_and(|v| v.contains(&vm)) {
            adds.entry(g).or_default().push(vm);
        }
    }
    for (&g, vms) in &adds {
        let u = &usage[g];
        if u.down.len() + vms.len() > u.limit {
            return Err(Wait::Budget {
                group: u.group.clone(),
                down: u.down.len(),
                limit: u.limit,
            });
        }
    }
    for (g, vms) in adds {
        for vm in vms {
            usage[g].starting.remove(vm);
            usage[g].down.insert(vm.clone());
        }
    }
    Ok(action)
}
