//! Where each VM of the inventory counts: its group, and whether an agent speaks for it.
//!
//! Every count of who is down needs it for every VM, and it changes only when the inventory
//! does (a VM comes or goes, an agent's resource id is learned or forgotten, Azure lists
//! again), which [`Fleet::inventory_version`] marks: so it is found once per version and
//! kept with the policy, not found again for each of the many counts a wave of events asks
//! for. At 10,000 VMs finding it was about half of a count (benches/profiling.md, section
//! 31). Builds with debug assertions (every test) find it again at each count and check
//! that what was kept is the same.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

use super::{GroupLookup, Policy};
use crate::coordinator::fleet::Fleet;

/// A VM of the inventory, as [`Placement`] found it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Place {
    pub group: usize,
    /// In the agents' inventory ([`Fleet::vms`]).
    pub agent: bool,
    /// The inventory version it was found for ([`Placement::find`] drops the others).
    found: u64,
}

/// Each VM of one version of the inventory ([`Fleet::inventory_version`]) placed in its
/// group.
#[derive(Debug, PartialEq)]
pub struct Placement {
    version: u64,
    /// Each VM by name (an agent's, or one Azure lists), with its group
    /// ([`Policy::group_of`]) and whether an agent speaks for it.
    pub(super) places: HashMap<String, Place>,
    /// Per group, how many VMs of the inventory it has.
    pub(super) members: Vec<usize>,
    /// Per group, the VMs of its Azure source that no agent speaks for.
    pub(super) without_agent: Vec<BTreeSet<String>>,
}

impl Placement {
    /// Finds every VM's place in `fleet` as it is now: in the places of `last` (a placement
    /// of an earlier version that nothing else holds) when there is one, so that the names
    /// of the VMs that stay are not copied again at every change.
    fn find(
        fleet: &Fleet,
        lookup: &mut GroupLookup<'_>,
        groups: usize,
        last: Option<Placement>,
    ) -> Placement {
        let version = fleet.inventory_version();
        let mut places = last.map_or_else(
            || HashMap::with_capacity(fleet.vms().len() + fleet.azure().len()),
            |last| last.places,
        );
        let mut members = vec![0; groups];
        let mut without_agent = vec![BTreeSet::new(); groups];
        // A place found for this version is replaced only `over_another` (an agent's over
        // a VM of the same name Azure lists); one found for an earlier version always.
        let mut place = |name: &String, group: usize, agent: bool, over_another: bool| {
            let found = Place {
                group,
                agent,
                found: version,
            };
            match places.get_mut(name.as_str()) {
                Some(kept) if over_another || kept.found != version => *kept = found,
                Some(_) => {}
                None => {
                    places.insert(name.clone(), found);
                }
            }
        };
        for (name, vm) in fleet.vms() {
            // (A fleet without an Azure source looks nothing up for it.)
            let azure = if fleet.azure().is_empty() {
                None
            } else {
                fleet.azure_vm(name)
            };
            let resource_id = vm
                .resource_id
                .as_deref()
                .or(azure.map(|a| a.resource_id.as_str()));
            let group = lookup.group_of_known(name, resource_id, azure.map(|a| a.group));
            place(name, group, true, true);
            members[group] += 1;
        }
        // The VMs Azure lists that no agent speaks for: each is one of its group's.
        // (A fleet without an Azure source pays nothing for this.)
        let agent_ids = if fleet.azure().is_empty() {
            Default::default()
        } else {
            fleet.agent_ids()
        };
        for (name, azure) in fleet.azure() {
            let agent = fleet.vms().get(name);
            let spoken_for = agent.is_some_and(|a| a.resource_id.is_none())
                || agent_ids.contains(&azure.resource_id.to_ascii_lowercase());
            if agent.is_some() && spoken_for {
                continue;
            }
            let group = lookup.group_of_known(name, Some(&azure.resource_id), Some(azure.group));
            // A VM no agent is named after is found by Azure's word alone, as `group_of` does
            // (one an agent is named after keeps the agent's place).
            place(name, group, false, false);
            if spoken_for {
                continue;
            }
            members[group] += 1;
            without_agent[group].insert(name.clone());
        }
        // The VMs gone since.
        places.retain(|_, place| place.found == version);
        Placement {
            version,
            places,
            members,
            without_agent,
        }
    }
}

/// The last [`Placement`] found, kept with the policy: a cache, not state (a clone of the
/// policy starts without one).
#[derive(Default)]
pub(super) struct Kept(Mutex<Option<Arc<Placement>>>);

impl Policy {
    /// Every VM of `fleet` placed in its group: the one kept when it was found for this
    /// version of the inventory, else found now (and kept).
    pub(super) fn placement(&self, fleet: &Fleet) -> Arc<Placement> {
        let groups = self.groups.len();
        let mut kept = self
            .memo
            .placement
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        // (A policy's groups do not change once it is in use; the count of them is checked
        // all the same, so that a test that changes them cannot index past the kept ones.)
        if let Some(placement) = kept
            .as_ref()
            .filter(|p| p.version == fleet.inventory_version() && p.members.len() == groups)
        {
            debug_assert_eq!(
                **placement,
                Placement::find(fleet, &mut self.lookup(), groups, None),
                "the placement kept for this inventory version is not what the fleet says now: \
                 something changed the inventory without a new version"
            );
            return Arc::clone(placement);
        }
        // Found in the last one's places when nothing else holds it (every count made from
        // it has ended) and it was found for an earlier version (one of this version, under
        // other groups, would have its places count as found now).
        let last = kept
            .take()
            .and_then(|last| Arc::try_unwrap(last).ok())
            .filter(|last| last.version != fleet.inventory_version());
        let placement = Placement::find(fleet, &mut self.lookup(), groups, last);
        debug_assert_eq!(
            placement,
            Placement::find(fleet, &mut self.lookup(), groups, None),
            "a placement found in the last one's places is not one found from scratch"
        );
        let placement = Arc::new(placement);
        *kept = Some(Arc::clone(&placement));
        placement
    }
}
