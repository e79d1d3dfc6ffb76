//! Who may go down now: groups of VMs, their disruption budgets, and per event type an
//! action. [`decide`] is a pure function of the fleet, the policy and the time: it returns
//! the drains to start and the approvals to send, earliest NotBefore first, and never one
//! that would put a group (or the fleet) over its budget at any moment of the approved
//! VM's expected outage.
//!
//! The budget is a ceiling on VMs *down*, whoever took them down ([`down`]): a VM is down
//! while an event listing it is held by the coordinator (drained, being drained, approved),
//! approved by someone else, started by Azure, or about to be (NotBefore within `min_lead`
//! or past), until there is evidence that it is back ([`super::fleet::Back`]: its own
//! agent's `completed` or `cancelled`, a heartbeat of its restarted agent whose document no
//! longer lists the event, its leaving the inventory, or an operator's release), and the
//! group's health gate has passed; and while its agent is silent (it missed
//! `silent_after` heartbeats). Time alone never frees a place: `max_hold` only alerts.
//!
//! An approval must leave room for every start Azure will make by itself while the
//! approved VM is expected down (its [`Outage`]): every Scheduled event nobody holds starts
//! at its NotBefore at the latest, so those whose NotBefore falls inside the window count
//! as down for the whole window. See `decide.rs` for the check, `down.rs` for the count.

mod approver;
mod decide;
mod down;
mod placement;
mod stale;
mod window;

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use approver::{Approver, approver, falls_back_to_arm};
pub use decide::{Decisions, Step, Wait, decide};
pub use down::{Budgets, Cause, Down, Usage, down_now, freed, holds, pending, usage};
pub use placement::Placement;
pub use window::Window;

use super::azure::ApproveVia;
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
    /// At most this percentage of the group's size, rounded up.
    Percent(u32),
}

impl Budget {
    /// How many VMs may be down in a group of `size`.
    pub fn limit(self, size: usize) -> usize {
        match self {
            Budget::Count(count) => count as usize,
            Budget::Percent(percent) => (size * percent as usize).div_ceil(100),
        }
    }
}

/// How long a VM is expected down once an event of a type starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outage {
    For(Duration),
    /// The event's DurationInSeconds ([`UNKNOWN_DURATION_OUTAGE`] when it is unknown).
    EventDuration,
    /// Until the VM leaves the inventory (Spot eviction, Terminate).
    UntilGone,
}

/// The outage of an event with `EventDuration` whose DurationInSeconds is unknown (-1).
pub const UNKNOWN_DURATION_OUTAGE: Duration = Duration::from_secs(15 * 60);

/// `[defaults.outage]` as shipped: Reboot 10 min, Redeploy 15 min, Freeze its
/// DurationInSeconds, Preempt and Terminate until the VM leaves; any other type 15 min.
pub fn default_outage(event_type: &str) -> Outage {
    match event_type.to_ascii_lowercase().as_str() {
        "reboot" => Outage::For(Duration::from_secs(600)),
        "freeze" => Outage::EventDuration,
        "preempt" | "terminate" => Outage::UntilGone,
        _ => Outage::For(Duration::from_secs(900)),
    }
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
    // VM names and resource ids are ASCII: compared as bytes, with nothing allocated.
    if pattern.is_ascii() && text.is_ascii() {
        return glob_in(pattern.as_bytes(), text.as_bytes(), b'*', b'?');
    }
    let (p, t): (Vec<char>, Vec<char>) = (pattern.chars().collect(), text.chars().collect());
    glob_in(&p, &t, '*', '?')
}

fn glob_in<T: PartialEq + Copy>(p: &[T], t: &[T], any_run: T, any_one: T) -> bool {
    let (mut pi, mut ti, mut star, mut mark) = (0, 0, None, 0);
    while ti < t.len() {
        if pi < p.len() && (p[pi] == any_one || p[pi] == t[ti]) {
            pi += 1;
            ti += 1;
        } else if pi < p.len() && p[pi] == any_run {
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
    p[pi..].iter().all(|c| *c == any_run)
}

/// Each memo entry, by VM name: the resource id and the listing group it was found for,
/// and the group found.
type Memo = HashMap<String, (Option<String>, Option<usize>, usize)>;

/// Each VM's group, as last found for its name and resource id. Finding it matches the VM
/// against every group's patterns, and the count of who is down needs every VM's group at
/// every decision: at 10,000 VMs in 100 groups, a million matches per message. Beside it,
/// the whole inventory placed in its groups, kept while the inventory stays the same
/// ([`Placement`]). A cache, not state: a clone starts empty, and two policies compare
/// equal whatever they hold.
#[derive(Default)]
pub struct GroupMemo {
    groups: std::sync::Mutex<Memo>,
    placement: placement::Kept,
}

/// The most VMs remembered; past it the memo starts again (VMs come and go).
const GROUP_MEMO_LIMIT: usize = 200_000;

/// The memo, locked once for a walk over many VMs ([`Policy::lookup`]).
struct GroupLookup<'p> {
    groups: &'p [Group],
    memo: std::sync::MutexGuard<'p, Memo>,
}

impl GroupLookup<'_> {
    /// [`Policy::group_of_known`], under the lock already held.
    fn group_of_known(
        &mut self,
        vm: &str,
        resource_id: Option<&str>,
        listed: Option<usize>,
    ) -> usize {
        if let Some((id, in_list, group)) = self.memo.get(vm)
            && id.as_deref() == resource_id
            && *in_list == listed
        {
            return *group;
        }
        let group = self
            .groups
            .iter()
            .enumerate()
            .position(|(index, g)| {
                listed == Some(index)
                    || (!(g.azure && g.matcher.is_empty()) && g.matcher.matches(vm, resource_id))
            })
            .unwrap_or(self.groups.len() - 1);
        if self.memo.len() >= GROUP_MEMO_LIMIT {
            self.memo.clear();
        }
        self.memo.insert(
            vm.to_owned(),
            (resource_id.map(str::to_owned), listed, group),
        );
        group
    }
}

impl Clone for GroupMemo {
    fn clone(&self) -> Self {
        GroupMemo::default()
    }
}

impl PartialEq for GroupMemo {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl std::fmt::Debug for GroupMemo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GroupMemo")
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Group {
    pub name: String,
    pub matcher: Matcher,
    pub budget: Budget,
    /// The operator's count of the group's VMs (as a PodDisruptionBudget takes the
    /// controller's scale): a percentage is of the larger of it and the VMs known.
    pub expected_size: Option<u32>,
    /// By lower-case EventType.
    pub rules: BTreeMap<String, Rule>,
    /// Overrides of [`default_outage`], by lower-case EventType.
    pub outages: BTreeMap<String, Outage>,
    /// When set, nothing is drained or approved outside them (UTC).
    pub windows: Vec<Window>,
    /// A health gate runs after an event is over for a VM before its place is freed.
    pub gated: bool,
    /// It has an Azure source (`[groups.azure]`): the VMs it lists are the group's, and
    /// with no other part set, only they are.
    pub azure: bool,
    /// How its events are approved (`[groups.azure] approve_via`; `agent` without one).
    pub approve_via: ApproveVia,
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

    /// How long an event keeps a VM of this group down once started; `None`: until the VM
    /// leaves the inventory.
    pub fn outage(&self, m: &Maintenance) -> Option<chrono::Duration> {
        let outage = self
            .outages
            .get(&m.event_type.to_ascii_lowercase())
            .copied()
            .unwrap_or_else(|| default_outage(&m.event_type));
        let duration = match outage {
            Outage::For(duration) => duration,
            Outage::EventDuration => m
                .duration_seconds
                .filter(|d| *d >= 0)
                .map_or(UNKNOWN_DURATION_OUTAGE, |d| Duration::from_secs(d as u64)),
            Outage::UntilGone => return None,
        };
        Some(chrono::Duration::from_std(duration).unwrap_or(chrono::Duration::days(365)))
    }

    /// The group may be disrupted now (no windows, or inside one).
    pub fn open(&self, now: chrono::DateTime<chrono::Utc>) -> bool {
        self.windows.is_empty() || self.windows.iter().any(|w| w.contains(now))
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    /// In order; the first that matches a VM is its group; the last is [`DEFAULT_GROUP`].
    pub groups: Vec<Group>,
    /// At most this many VMs down across every group (`[fleet]`), if set.
    pub fleet_budget: Option<Budget>,
    /// Events whose NotBefore is closer than this are left to Azure.
    pub min_lead: chrono::Duration,
    /// A place held this long past the event's NotBefore (or its approval, or its start)
    /// without evidence that its VM is back is alerted on (never freed).
    pub max_hold: chrono::Duration,
    /// A VM whose agent missed this many heartbeats counts as down.
    pub silent_after: u32,
    /// An event that lists several VMs waits this long for the report of each that has a
    /// live agent, or that nobody has spoken for yet, before it is decided.
    pub report_wait: chrono::Duration,
    /// Approve after a drain that failed (`[drain] on_failure = "approve"`).
    pub approve_failed_drains: bool,
    /// Each VM's group, found once ([`Policy::group_of`]).
    pub memo: GroupMemo,
}

impl Policy {
    /// The first group whose matcher takes `vm` (with its resource id, when the fleet knows
    /// one); the default group when none does.
    pub fn group_of(&self, fleet: &Fleet, vm: &str) -> usize {
        let azure = fleet.azure_vm(vm);
        let resource_id = fleet
            .vms()
            .get(vm)
            .and_then(|v| v.resource_id.as_deref())
            .or(azure.map(|a| a.resource_id.as_str()));
        self.group_of_known(vm, resource_id, azure.map(|a| a.group))
    }

    /// [`Policy::group_of`] for a VM whose resource id is at hand (`None` when the fleet
    /// knows none), and the group whose Azure source lists it, if one does: a walk over the
    /// fleet's VMs looks none of them up again, which at 10,000 VMs was most of the string
    /// comparisons, themselves a fifth of the coordinator's CPU (benches/profiling.md,
    /// section 25). A group takes the VMs its Azure source lists, and (unless it has no
    /// other part) those its matcher takes.
    pub fn group_of_known(
        &self,
        vm: &str,
        resource_id: Option<&str>,
        listed: Option<usize>,
    ) -> usize {
        self.lookup().group_of_known(vm, resource_id, listed)
    }

    /// The group memo, locked for a walk that finds many VMs' groups (the count's): every
    /// other way to a group would wait for it forever on the same thread, so nothing that
    /// holds it may find a group any other way. Private to the policy for that reason.
    fn lookup(&self) -> GroupLookup<'_> {
        GroupLookup {
            groups: &self.groups,
            memo: self.memo.groups.lock().unwrap_or_else(|e| e.into_inner()),
        }
    }
}
