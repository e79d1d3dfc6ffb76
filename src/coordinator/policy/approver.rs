//! Who approves an event, and how: a signed request to a live agent of one of its VMs, or
//! an acknowledgement through Azure Resource Manager at the scope of one of its VMs that
//! Azure lists, as the groups of its VMs allow (`[groups.azure] approve_via`).

use std::collections::BTreeSet;

use chrono::{DateTime, Utc};

use super::Policy;
use super::decide::Wait;
use crate::coordinator::fleet::{Fleet, Maintenance, Via};

/// The VM an approval goes through, and how.
#[derive(Debug, Clone, PartialEq)]
pub struct Approver {
    pub vm: String,
    pub via: Via,
}

/// Who approves `m` now. With `agent_had_its_turn`, ARM goes first where the groups allow
/// it (an agent approval that no agent answered within `outcome_timeout`).
pub fn approver(
    fleet: &Fleet,
    policy: &Policy,
    m: &Maintenance,
    agent_had_its_turn: bool,
    now: DateTime<Utc>,
) -> Option<Approver> {
    let live = |vm: &str| {
        fleet
            .vms()
            .get(vm)
            .is_some_and(|v| !v.silent(now, policy.silent_after))
    };
    choose(
        fleet,
        policy,
        m,
        &placed(fleet, policy, m),
        agent_had_its_turn,
        &live,
    )
    .ok()
}

/// Whether an approval of `m` sent to an agent falls back to ARM when no agent answers:
/// every group of its VMs says `agent_then_arm`.
pub fn falls_back_to_arm(fleet: &Fleet, policy: &Policy, m: &Maintenance) -> bool {
    let placed = placed(fleet, policy, m);
    !placed.is_empty()
        && placed.iter().all(|(_, g)| {
            let via = policy.groups[*g].approve_via;
            via.through_agent() && via.through_arm()
        })
}

fn placed(fleet: &Fleet, policy: &Policy, m: &Maintenance) -> Vec<(String, usize)> {
    m.affected()
        .into_iter()
        .map(|vm| {
            let g = policy.group_of(fleet, &vm);
            (vm, g)
        })
        .collect()
}

/// [`approver`] with the event's VMs and their groups at hand. An agent first, where the
/// groups allow agents (unless `agent_had_its_turn` and they allow ARM too); else ARM, at
/// the first VM Azure lists; an event whose groups allow no common way is left to Azure.
/// `live`: the VM has an agent that is not silent.
pub(super) fn choose(
    fleet: &Fleet,
    policy: &Policy,
    m: &Maintenance,
    placed: &[(String, usize)],
    agent_had_its_turn: bool,
    live: &dyn Fn(&str) -> bool,
) -> Result<Approver, Wait> {
    let groups: BTreeSet<usize> = placed.iter().map(|(_, g)| *g).collect();
    let ways = || groups.iter().map(|g| policy.groups[*g].approve_via);
    let agent = ways().all(|via| via.through_agent());
    let arm = ways().all(|via| via.through_arm());
    if !agent && !arm {
        let names: Vec<&str> = groups
            .iter()
            .map(|g| policy.groups[*g].name.as_str())
            .collect();
        return Err(Wait::Never(format!(
            "its VMs' groups ({}) approve in ways that exclude each other (approve_via)",
            names.join(", ")
        )));
    }
    let affected = placed.iter().map(|(vm, _)| vm);
    let by_agent = || {
        approver_among(m, affected.clone(), live).map(|vm| Approver {
            vm,
            via: Via::Agent,
        })
    };
    if agent
        && !(arm && agent_had_its_turn)
        && let Some(approver) = by_agent()
    {
        return Ok(approver);
    }
    if arm {
        // By the name Azure gives the VM (Resources names VMs so): never by the resource id
        // an agent reports, which would let an agent pick the scope.
        if let Some(vm) = affected.clone().find(|vm| fleet.azure().contains_key(*vm)) {
            return Ok(Approver {
                vm: vm.clone(),
                via: Via::Arm,
            });
        }
        // Nowhere to acknowledge it: an agent again, if one may.
        return match by_agent().filter(|_| agent) {
            Some(approver) => Ok(approver),
            None => Err(Wait::NotListed),
        };
    }
    Err(Wait::NoAgent)
}

/// The agent an approval goes to: the first VM in Resources with a live agent that has
/// reported the event (its document has it, so the agent will not answer `unknown_event`),
/// else the first with a live agent at all. One approval releases every VM the event lists.
fn approver_among<'a>(
    m: &Maintenance,
    affected: impl Iterator<Item = &'a String> + Clone,
    live: &dyn Fn(&str) -> bool,
) -> Option<String> {
    affected
        .clone()
        .find(|vm| live(vm) && m.reports.get(*vm).is_some_and(|r| !r.stage.is_over()))
        .or_else(|| affected.clone().find(|vm| live(vm)))
        .cloned()
}
