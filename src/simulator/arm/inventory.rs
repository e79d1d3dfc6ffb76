//! The ARM resources the simulated VMs make up: each VM's place (a scale set's instance, or a
//! standalone VM, maybe in an availability set) parsed from its scenario's `resource_id`,
//! the lookups the routes need (all case-insensitive, as ARM's are), and the one mapping from
//! a VM's simulated life to the power and provisioning state ARM shows.
//!
//! Nothing here is copied out of a VM's `State`: a status or an acknowledge locks that VM's
//! state (one at a time, never two) and advances it to the request's instant first, as its
//! IMDS server does.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::super::state::{Phase, State, lock};
use super::super::{SimEventsPolicy, SimPowerState, SimProvisioningState, Simulator};
use super::ArmError;

/// Where a VM sits in ARM.
pub(super) enum Placement {
    /// `.../virtualMachineScaleSets/{scale_set}/virtualMachines/{instance_id}`.
    ScaleSet {
        scale_set: String,
        instance_id: String,
    },
    /// `.../virtualMachines/{name}`, in an availability set of its resource group or none.
    Standalone { availability_set: Option<String> },
}

/// One simulated VM as ARM knows it. Names keep the scenario's case; lookups ignore it.
pub(super) struct ArmVm {
    /// A scale-set VM: the scenario's `[vm] name` (`web_3`); a standalone VM: the last
    /// segment of its resource id. The name an event's Resources list.
    pub(super) name: String,
    pub(super) resource_id: String,
    pub(super) subscription: String,
    pub(super) resource_group: String,
    pub(super) placement: Placement,
    pub(super) vm_id: String,
    power: SimPowerState,
    provisioning: SimProvisioningState,
    pub(super) policy: Option<SimEventsPolicy>,
    state: Arc<Mutex<State>>,
}

/// What ARM shows of a VM that exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Status {
    pub(super) provisioning: Provisioning,
    pub(super) power: Power,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Provisioning {
    Succeeded,
    Updating,
    Failed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Power {
    Running,
    Starting,
    Stopped,
    Deallocated,
}

/// What a started event does to the VM it lists, as the control plane sees it; the
/// strongest one wins (declared weakest first).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Effect {
    /// A Freeze (live migration, memory-preserving update) pauses the guest for seconds;
    /// ARM sees no operation and the VM stays running. Also any event once it has ended.
    None,
    /// A Reboot or Redeploy, while its down record is open: Azure is restarting the VM (on
    /// the same host or another), an operation is in progress (`updating`) and the VM is
    /// coming up (`starting`). Back to the scenario's state when the event ends.
    Restarting,
    /// A Preempt (Spot eviction, deallocate policy): the VM is deallocated and stays so,
    /// event over or not, until someone starts it again, which nothing here does.
    Deallocated,
    /// A Terminate: the scale set deletes the instance; from the start it is gone from every
    /// listing and a GET of it is a 404, for good.
    Deleted,
}

fn effect(event_type: &str, still_down: bool) -> Effect {
    match event_type {
        "Terminate" => Effect::Deleted,
        "Preempt" => Effect::Deallocated,
        "Reboot" | "Redeploy" if still_down => Effect::Restarting,
        _ => Effect::None,
    }
}

/// How an acknowledge went for one VM's document.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Acknowledged {
    Approved,
    AlreadyStarted,
}

impl ArmVm {
    /// The VM's state at `now`, or `None` once it is deleted.
    pub(super) fn status(&self, now: Instant) -> Option<Status> {
        let mut state = lock(&self.state);
        state.advance(now);
        let strongest = state
            .events
            .iter()
            .filter(|event| event.started_at.is_some() && names(&event.resources, &self.name))
            .map(|event| effect(&event.spec.event_type, event.ended_at.is_none()))
            .max()
            .unwrap_or(Effect::None);
        let mut status = Status {
            provisioning: match self.provisioning {
                SimProvisioningState::Succeeded => Provisioning::Succeeded,
                SimProvisioningState::Failed => Provisioning::Failed,
            },
            power: match self.power {
                SimPowerState::Running => Power::Running,
                SimPowerState::Stopped => Power::Stopped,
                SimPowerState::Deallocated => Power::Deallocated,
            },
        };
        match strongest {
            Effect::None => {}
            Effect::Restarting => {
                status.provisioning = Provisioning::Updating;
                status.power = Power::Starting;
            }
            Effect::Deallocated => status.power = Power::Deallocated,
            Effect::Deleted => return None,
        }
        Some(status)
    }

    /// Approves `event_id` if this VM's document has it and it lists one of `members` (the
    /// VMs of the resource acknowledged through), exactly as a StartRequest from this VM
    /// would: it starts on every VM that lists it. `None`: this document has no such event.
    pub(super) fn acknowledge(
        &self,
        event_id: &str,
        members: &[&str],
        now: Instant,
    ) -> Option<Acknowledged> {
        let mut state = lock(&self.state);
        state.advance(now);
        let event = state.events.iter().find(|event| {
            event.spec.id.eq_ignore_ascii_case(event_id)
                && matches!(event.phase, Phase::Scheduled | Phase::Started)
                && members.iter().any(|member| names(&event.resources, member))
        })?;
        if event.phase == Phase::Started {
            return Some(Acknowledged::AlreadyStarted);
        }
        let id = event.spec.id.clone();
        state.approve(&[id], now);
        state.advance(now);
        Some(Acknowledged::Approved)
    }

    pub(super) fn scale_set(&self) -> Option<&str> {
        match &self.placement {
            Placement::ScaleSet { scale_set, .. } => Some(scale_set),
            Placement::Standalone { .. } => None,
        }
    }

    pub(super) fn availability_set(&self) -> Option<&str> {
        match &self.placement {
            Placement::Standalone { availability_set } => availability_set.as_deref(),
            Placement::ScaleSet { .. } => None,
        }
    }
}

/// Whether an event's Resources name `vm` (names are case-insensitive in Azure).
fn names(resources: &[String], vm: &str) -> bool {
    resources.iter().any(|r| r.eq_ignore_ascii_case(vm))
}

/// Every simulated VM that is in ARM.
pub(super) struct Inventory {
    pub(super) vms: Vec<ArmVm>,
}

impl Inventory {
    pub(super) fn of(simulators: &[&Simulator]) -> Result<Inventory, ArmError> {
        let mut vms: Vec<ArmVm> = Vec::new();
        for (index, simulator) in simulators.iter().enumerate() {
            let state = simulator.state.clone();
            let vm = lock(&state).scenario.vm.clone();
            let Some(resource_id) = vm.resource_id.clone() else {
                continue;
            };
            let parsed = parse_resource_id(&resource_id).ok_or_else(|| ArmError::ResourceId {
                vm: vm.name.clone(),
                resource_id: resource_id.clone(),
            })?;
            if let Some(other) = vms
                .iter()
                .find(|other| other.resource_id.eq_ignore_ascii_case(&resource_id))
            {
                return Err(ArmError::SameResource {
                    resource_id,
                    first: other.name.clone(),
                    second: vm.name,
                });
            }
            let (name, placement) = match parsed.scale_set {
                Some((scale_set, instance_id)) => {
                    if let Some(availability_set) = vm.availability_set {
                        return Err(ArmError::AvailabilitySetInScaleSet {
                            vm: vm.name,
                            scale_set,
                            availability_set,
                        });
                    }
                    let placement = Placement::ScaleSet {
                        scale_set,
                        instance_id,
                    };
                    (vm.name, placement)
                }
                None => {
                    let availability_set = vm.availability_set;
                    (parsed.name, Placement::Standalone { availability_set })
                }
            };
            vms.push(ArmVm {
                name,
                resource_id: resource_id.trim_end_matches('/').to_owned(),
                subscription: parsed.subscription,
                resource_group: parsed.resource_group,
                placement,
                vm_id: vm
                    .vm_id
                    .unwrap_or_else(|| format!("00000000-0000-4000-8000-{index:012x}")),
                power: vm.power_state,
                provisioning: vm.provisioning_state,
                policy: vm.scheduled_events_policy,
                state,
            });
        }
        check_scale_set_policies(&vms)?;
        Ok(Inventory { vms })
    }

    pub(super) fn knows_subscription(&self, subscription: &str) -> bool {
        self.vms
            .iter()
            .any(|vm| vm.subscription.eq_ignore_ascii_case(subscription))
    }

    /// The VMs of a resource group, deleted ones included; empty: no such group.
    pub(super) fn group<'a>(&'a self, subscription: &str, group: &str) -> Vec<&'a ArmVm> {
        self.vms
            .iter()
            .filter(|vm| {
                vm.subscription.eq_ignore_ascii_case(subscription)
                    && vm.resource_group.eq_ignore_ascii_case(group)
            })
            .collect()
    }

    /// The VMs of a subscription, deleted ones included.
    pub(super) fn subscription<'a>(&'a self, subscription: &str) -> Vec<&'a ArmVm> {
        self.vms
            .iter()
            .filter(|vm| vm.subscription.eq_ignore_ascii_case(subscription))
            .collect()
    }
}

/// Filters that pick the members of one resource out of a resource group's VMs.
pub(super) fn in_scale_set<'a>(vms: &[&'a ArmVm], name: &str) -> Vec<&'a ArmVm> {
    vms.iter()
        .copied()
        .filter(|vm| vm.scale_set().is_some_and(|s| s.eq_ignore_ascii_case(name)))
        .collect()
}

pub(super) fn in_availability_set<'a>(vms: &[&'a ArmVm], name: &str) -> Vec<&'a ArmVm> {
    vms.iter()
        .copied()
        .filter(|vm| {
            vm.availability_set()
                .is_some_and(|s| s.eq_ignore_ascii_case(name))
        })
        .collect()
}

pub(super) fn standalone<'a>(vms: &[&'a ArmVm], name: &str) -> Option<&'a ArmVm> {
    vms.iter()
        .copied()
        .find(|vm| vm.scale_set().is_none() && vm.name.eq_ignore_ascii_case(name))
}

/// A scale set has one policy: every VM of it must bring the same.
fn check_scale_set_policies(vms: &[ArmVm]) -> Result<(), ArmError> {
    let mut first_of: HashMap<(String, String, String), &ArmVm> = HashMap::new();
    for vm in vms {
        let Some(scale_set) = vm.scale_set() else {
            continue;
        };
        let key = (
            vm.subscription.to_ascii_lowercase(),
            vm.resource_group.to_ascii_lowercase(),
            scale_set.to_ascii_lowercase(),
        );
        match first_of.get(&key) {
            Some(first) if first.policy != vm.policy => {
                return Err(ArmError::PoliciesDiffer {
                    scale_set: scale_set.to_owned(),
                    first: first.name.clone(),
                    second: vm.name.clone(),
                });
            }
            Some(_) => {}
            None => {
                first_of.insert(key, vm);
            }
        }
    }
    Ok(())
}

/// A resource id's parts, keeping their case.
#[derive(Debug, PartialEq)]
struct ParsedId {
    subscription: String,
    resource_group: String,
    /// The last segment: a standalone VM's name, a scale-set VM's instance id.
    name: String,
    /// For a scale-set VM: the scale set and the instance id.
    scale_set: Option<(String, String)>,
}

/// `/subscriptions/S/resourceGroups/RG/providers/Microsoft.Compute/virtualMachines/NAME` or
/// `.../virtualMachineScaleSets/SS/virtualMachines/ID`, keywords in any case.
fn parse_resource_id(id: &str) -> Option<ParsedId> {
    let parts: Vec<&str> = id.split('/').filter(|part| !part.is_empty()).collect();
    let is = |at: usize, word: &str| parts.get(at).is_some_and(|p| p.eq_ignore_ascii_case(word));
    let head = is(0, "subscriptions")
        && is(2, "resourceGroups")
        && is(4, "providers")
        && is(5, "Microsoft.Compute");
    if !head {
        return None;
    }
    let (subscription, resource_group) = (parts[1].to_owned(), parts[3].to_owned());
    match parts.len() {
        8 if is(6, "virtualMachines") => Some(ParsedId {
            subscription,
            resource_group,
            name: parts[7].to_owned(),
            scale_set: None,
        }),
        10 if is(6, "virtualMachineScaleSets") && is(8, "virtualMachines") => Some(ParsedId {
            subscription,
            resource_group,
            name: parts[9].to_owned(),
            scale_set: Some((parts[7].to_owned(), parts[9].to_owned())),
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resource_ids_are_parsed_whatever_the_case_of_their_keywords() {
        let parsed = parse_resource_id(
            "/SUBSCRIPTIONS/s1/resourcegroups/Rg/providers/microsoft.compute/VIRTUALMACHINESCALESETS/web/virtualmachines/3",
        )
        .unwrap();
        assert_eq!(parsed.scale_set, Some(("web".into(), "3".into())));
        assert_eq!(
            (parsed.subscription, parsed.resource_group),
            ("s1".into(), "Rg".into())
        );
        let parsed = parse_resource_id(
            "/subscriptions/s1/resourceGroups/rg/providers/Microsoft.Compute/virtualMachines/db-1",
        )
        .unwrap();
        assert_eq!((parsed.name.as_str(), parsed.scale_set), ("db-1", None));
        for bad in [
            "/subscriptions/s1/resourceGroups/rg/providers/Microsoft.Network/virtualMachines/x",
            "/subscriptions/s1/resourceGroups/rg/providers/Microsoft.Compute/disks/x",
            "/subscriptions/s1/resourceGroups/rg",
        ] {
            assert_eq!(parse_resource_id(bad), None, "{bad}");
        }
    }

    #[test]
    fn the_strongest_effect_of_a_started_event_wins() {
        assert!(effect("Terminate", false) > effect("Preempt", true));
        assert!(effect("Preempt", false) > effect("Reboot", true));
        assert_eq!(effect("Reboot", false), Effect::None, "over once it ended");
        assert_eq!(effect("Freeze", true), Effect::None);
    }
}
