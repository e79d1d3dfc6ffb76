//! The inventory: every VM whose agent speaks (heartbeats above all), whether it is alive,
//! and the evidence that an event is over for a VM ([`Back`]): the only thing that frees
//! its place in a budget, besides its leaving and an operator.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::{Applied, Fleet};

/// Why an event is over for one VM, and whether the group's health gate has passed since.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Back {
    pub at: DateTime<Utc>,
    /// `completed` or `cancelled` (the VM's own agent said so), `heartbeat` (its agent
    /// started again after the event appeared, and its document no longer lists it),
    /// `left` (the VM left the inventory: evicted or deleted), `operator` (released by
    /// hand).
    pub by: String,
    /// When the group's health gate passed (set at once where there is no gate, and for
    /// `left` and `operator`).
    #[serde(default)]
    pub healthy_at: Option<DateTime<Utc>>,
    /// The gate's last failure, for `/fleet`.
    #[serde(default)]
    pub gate: Option<String>,
}

impl Back {
    pub fn new(by: &str, at: DateTime<Utc>) -> Back {
        let final_ = matches!(by, "left" | "operator");
        Back {
            at,
            by: by.to_owned(),
            healthy_at: final_.then_some(at),
            gate: None,
        }
    }
}

/// How fresh the Azure sources are, by the policy's index of their group; not stored.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AzureSources {
    /// When each group's sources were last listed whole (the oldest of them).
    pub listed_at: BTreeMap<usize, DateTime<Utc>>,
    /// The sources older than `[azure] max_age`, by their group: the decision holds every
    /// group that may count their VMs (`policy::stale`; set by the engine before it decides).
    pub held: BTreeMap<usize, Vec<String>>,
}

/// A VM of the inventory: its agent published something (a heartbeat, a document, a
/// transition or an outcome).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Vm {
    pub resource_id: Option<String>,
    pub last_seen: DateTime<Utc>,
    /// Its agent's latest heartbeat; `None` for an agent that sends none (an older
    /// version): such a VM is never judged silent.
    #[serde(default)]
    pub heartbeat: Option<Heartbeat>,
    /// When its agent first spoke to this coordinator (`None` in records written before
    /// this was kept).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_seen: Option<DateTime<Utc>>,
}

impl Vm {
    /// Its agent has missed `silent_after` heartbeats by `now`.
    pub fn silent(&self, now: DateTime<Utc>, silent_after: u32) -> bool {
        self.heartbeat.as_ref().is_some_and(|h| {
            let allowed = h
                .interval_seconds
                .min(3600)
                .saturating_mul(u64::from(silent_after));
            now.signed_duration_since(h.at).num_seconds() > allowed.min(i64::MAX as u64) as i64
        })
    }
}

/// What an agent's heartbeat said.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Heartbeat {
    /// When the VM was last known alive, by this coordinator's clock: the heartbeat's
    /// arrival once the input has caught up; while a stream is replayed, its own `time`
    /// (never later than its arrival), so that an old heartbeat does not look fresh.
    pub at: DateTime<Utc>,
    /// Its CloudEvent `time` (the agent's clock): orders one agent's heartbeats.
    #[serde(default)]
    pub sent: DateTime<Utc>,
    pub interval_seconds: u64,
    pub incarnation: Option<u64>,
    pub epoch: u64,
    pub agent_version: String,
    /// When the agent process started (after a reboot: after the VM came back).
    pub started_at: Option<DateTime<Utc>>,
    /// The EventIds of its last processed document, upper-case.
    pub events: Vec<String>,
}

/// The operator paused approvals (`sched-relay coordinate pause`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Pause {
    pub at: DateTime<Utc>,
    pub reason: String,
}

/// Records that `vm`'s agent spoke at `now`; its resource id is set once and never moved
/// (VM names must be unique on the broker: approvals are routed by name).
pub(super) fn agent<'a>(
    vms: &'a mut BTreeMap<String, Vm>,
    inventory: &mut Version,
    vm: &str,
    resource_id: Option<String>,
    now: DateTime<Utc>,
) -> Result<&'a mut Vm, String> {
    if !vms.contains_key(vm) {
        // Two names that differ only by `.` and `_` share every subject and routing key
        // (`.` becomes `_` there): approvals for one would reach the other.
        let token = subject_token(vm);
        if (token != vm || vm.contains('_'))
            && let Some(other) = vms.keys().find(|other| subject_token(other) == token)
        {
            return Err(format!(
                "VM {vm:?} and VM {other:?} share the subject and routing key token {token:?}: rename one"
            ));
        }
    }
    let agent = vms.entry(vm.to_owned()).or_insert_with(|| {
        // A VM that comes counts in a group.
        *inventory = Version::next();
        Vm {
            resource_id: None,
            last_seen: now,
            heartbeat: None,
            first_seen: Some(now),
        }
    });
    match (&agent.resource_id, resource_id) {
        (Some(known), Some(new)) if !known.eq_ignore_ascii_case(&new) => {
            return Err(format!(
                "VM {vm:?} reported as {new}, but it is {known}: two VMs share a name, or a publisher lies"
            ));
        }
        (Some(known), None) => {
            return Err(format!(
                "VM {vm:?} is known as {known}; a message that does not say which resource it comes from is not its agent's"
            ));
        }
        (None, Some(new)) => {
            // Its resource id may place it in another group.
            *inventory = Version::next();
            agent.resource_id = Some(new);
        }
        (None, None) | (Some(_), Some(_)) => {}
    }
    agent.last_seen = now;
    Ok(agent)
}

/// A VM name as it appears in a subject or routing key (`.` becomes `_`, as every template
/// writes it).
pub fn subject_token(vm: &str) -> String {
    sched_relay_core::binding::template_value(vm)
}

impl Fleet {
    /// The VMs with an agent, by name.
    pub fn vms(&self) -> &BTreeMap<String, Vm> {
        &self.vms
    }

    /// The VMs Azure Resource Manager lists for the groups with an Azure source, by name.
    pub fn azure(&self) -> &BTreeMap<String, crate::coordinator::azure::AzureVm> {
        &self.azure
    }

    /// A mark of what decides where each VM counts: which VMs have an agent, the resource id
    /// each agent reports, and what Azure lists. It changes with any of them (and differs
    /// between any two fleets), so what was found from them can be kept while it stays the
    /// same ([`crate::coordinator::policy::Placement`]). Every change to `vms` and `azure`
    /// goes through this module, which takes a new mark for each.
    pub fn inventory_version(&self) -> u64 {
        self.inventory.0
    }

    /// Puts `vm` in the inventory as it was stored.
    pub fn insert_vm(&mut self, name: String, vm: Vm) {
        self.inventory = Version::next();
        self.vms.insert(name, vm);
    }

    /// Takes `vm` out of the inventory.
    pub fn remove_vm(&mut self, vm: &str) -> Option<Vm> {
        self.inventory = Version::next();
        self.vms.remove(vm)
    }

    /// Forgets the resource id `vm`'s agent reported (its next report says which resource
    /// it is); the VM as it is now, if it had one.
    pub fn forget_resource_id(&mut self, vm: &str) -> Option<&Vm> {
        let known = self.vms.get_mut(vm)?;
        known.resource_id.take()?;
        self.inventory = Version::next();
        Some(known)
    }

    /// The VMs Azure Resource Manager lists now.
    pub fn set_azure(&mut self, vms: BTreeMap<String, crate::coordinator::azure::AzureVm>) {
        self.inventory = Version::next();
        self.azure_ids = vms
            .iter()
            .map(|(name, vm)| (vm.resource_id.to_ascii_lowercase(), name.clone()))
            .collect();
        self.azure = vms;
    }

    /// `vm` as Azure lists it: through the resource id its agent reports (an agent may
    /// name its VM otherwise: a host name, `identity.vm_name`), else by its name when its
    /// agent reports no id (or it has none). A listed VM of the same name but another id
    /// is another VM ([`Fleet::azure_clash`]).
    pub fn azure_vm(&self, vm: &str) -> Option<&crate::coordinator::azure::AzureVm> {
        match self.vms.get(vm).and_then(|v| v.resource_id.as_deref()) {
            Some(id) => self
                .azure
                .get(self.azure_ids.get(&id.to_ascii_lowercase())?),
            None => self.azure.get(vm),
        }
    }

    /// An agent speaks for `vm`, or Azure lists a VM of that name: the inventory has it.
    pub fn knows(&self, vm: &str) -> bool {
        self.vms.contains_key(vm) || self.azure.contains_key(vm)
    }

    /// An agent and a VM Azure lists share a name but not a resource id: two VMs that
    /// approvals, Resources and the count (all by name) cannot tell apart.
    pub fn azure_clash(&self) -> Option<String> {
        self.azure.iter().find_map(|(name, listed)| {
            let id = self.vms.get(name)?.resource_id.as_deref()?;
            (!id.eq_ignore_ascii_case(&listed.resource_id)).then(|| {
                format!(
                    "VM {name:?}: its agent reports {id}, Azure lists {} under that name (rename one)",
                    listed.resource_id
                )
            })
        })
    }

    /// The resource ids the agents report, lower case.
    pub fn agent_ids(&self) -> std::collections::HashSet<String> {
        self.vms
            .values()
            .filter_map(|vm| vm.resource_id.as_deref().map(str::to_ascii_lowercase))
            .collect()
    }

    /// The state as stored, read back after a failed write; the Azure inventory, never
    /// stored, is kept as it was listed.
    pub fn reloaded(&mut self, stored: Fleet) {
        let azure = std::mem::take(&mut self.azure);
        let sources = std::mem::take(&mut self.azure_sources);
        *self = stored;
        self.set_azure(azure);
        self.azure_sources = sources;
    }

    /// A heartbeat: the VM is in the inventory and alive as of the heartbeat's time; and
    /// where its agent started after an event listing it appeared and its document no
    /// longer lists the event, the event is over for it (a VM back from a reboot whose
    /// agent lost its state never reports `completed`).
    pub(super) fn heartbeat(
        &mut self,
        vm: &str,
        resource_id: Option<String>,
        beat: Heartbeat,
        now: DateTime<Utc>,
    ) -> Applied {
        let agent = match agent(&mut self.vms, &mut self.inventory, vm, resource_id, now) {
            Ok(agent) => agent,
            Err(conflict) => {
                self.note_conflict(vm, &conflict);
                return Applied::Conflict(conflict);
            }
        };
        // Heartbeats may arrive out of order (a replay, two partitions): the newest by the
        // agent's own clock wins, and an older one says nothing new.
        let previous = agent.heartbeat.clone();
        if previous.as_ref().is_some_and(|p| p.sent > beat.sent) {
            return Applied::Heartbeat(Vec::new());
        }
        let restarted = match (&previous, beat.started_at) {
            (Some(p), Some(started)) => p.started_at.is_some_and(|before| started > before),
            _ => false,
        };
        let listed = beat.events.clone();
        let at = beat.at;
        agent.heartbeat = Some(beat);
        let mut back = Vec::new();
        if !restarted {
            return Applied::Heartbeat(back);
        }
        // Its agent started again since its last heartbeat (a reboot), and the first document
        // it processed no longer lists an event this VM had shown: the event is over for it.
        // Only the agent's own clock is compared, and only events that hold the VM count.
        for (key, m) in self.events.iter_mut() {
            let shown = m.reports.contains_key(vm)
                || previous.as_ref().is_some_and(|p| p.events.contains(key));
            if m.back.contains_key(vm)
                || !m.lists(vm)
                || listed.contains(key)
                || !shown
                || !m.holds()
            {
                continue;
            }
            m.back.insert(vm.to_owned(), Back::new("heartbeat", at));
            back.push(key.clone());
        }
        Applied::Heartbeat(back)
    }

    /// The VM leaves the inventory (evicted, deleted): every event that lists it is over for
    /// it (`by`: `left`), those still to come too (they cannot start on a VM that is gone),
    /// so it frees its places. Returns the keys of the events changed.
    pub fn leave(&mut self, vm: &str, now: DateTime<Utc>) -> Vec<String> {
        self.remove_vm(vm);
        let mut changed = Vec::new();
        for (k, m) in self.events.iter_mut() {
            if m.lists(vm) && m.back.get(vm).is_none_or(|b| b.healthy_at.is_none()) {
                m.back.insert(vm.to_owned(), Back::new("left", now));
                changed.push(k.clone());
            }
        }
        changed
    }

    /// Records that the events holding `vm` (or only `key`) are over for it, `by` an
    /// operator: those an agent said started, that were approved or are being drained,
    /// or whose NotBefore has passed. An event still to come keeps its claim on the VM: a
    /// release frees what has happened, never what Azure has yet to start. Returns the keys
    /// of the events changed.
    pub fn release(
        &mut self,
        vm: &str,
        key: Option<&str>,
        by: &str,
        now: DateTime<Utc>,
    ) -> Vec<String> {
        let mut changed = Vec::new();
        for (k, m) in self.events.iter_mut() {
            let happened = m.holds() || m.not_before.is_some_and(|at| at <= now);
            if key.is_some_and(|key| key != k) || !m.lists(vm) || !happened {
                continue;
            }
            let done = m.back.get(vm).is_some_and(|b| b.healthy_at.is_some());
            if !done {
                m.back.insert(vm.to_owned(), Back::new(by, now));
                changed.push(k.clone());
            }
        }
        changed
    }
}

/// A mark of one state of the inventory ([`Fleet::inventory_version`]), unique in the
/// process: a new fleet (loaded, reloaded, made for a test) and every change takes the next
/// number, so that no two states of any two fleets share one. A cache key, not state: two
/// fleets compare equal whatever their marks, and a clone keeps its source's until either
/// changes.
#[derive(Debug, Clone, Copy)]
pub(super) struct Version(pub(super) u64);

impl Version {
    pub(super) fn next() -> Version {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Version(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
    }
}

impl Default for Version {
    fn default() -> Self {
        Version::next()
    }
}

impl PartialEq for Version {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

/// The most names `/fleet` lists as conflicting (a publisher can claim any name).
pub const MAX_CONFLICTS: usize = 1000;

impl Fleet {
    /// Notes why a message about `vm` was refused, for `/fleet` (at most
    /// [`MAX_CONFLICTS`] names).
    pub fn note_conflict(&mut self, vm: &str, why: &str) {
        if self.conflicts.len() < MAX_CONFLICTS || self.conflicts.contains_key(vm) {
            self.conflicts.insert(vm.to_owned(), why.to_owned());
        }
    }
}
