//! The groups an old Azure source holds: those whose count of who is down it leaves
//! unknown. A source older than `[azure] max_age` (`AzureSources::held`) may miss a VM of
//! its last listing stopped or deallocated since, and a VM made since, whichever group
//! counts them.

use std::collections::{BTreeMap, BTreeSet};

use super::Policy;
use super::down::Down;
use crate::coordinator::fleet::Fleet;

/// Each held group, with the groups of the old sources that hold it (keys of
/// `AzureSources::held`): each source's own group; every group a VM of its last listing is
/// placed in (a group that matches it by name first counts it); every group an agent is
/// placed in whose resource id is in the source's resource group while no listing has it
/// (a VM made since the last listing is placed by name, or in the default group, until
/// its source is listed again); and every group an agent without an Azure resource id
/// that no listing has is placed in (which VM it is, nobody can tell: any old source's).
/// Walks every listed VM and agent, only while a source is old and something waits.
pub(super) fn held_groups(
    fleet: &Fleet,
    policy: &Policy,
    down: &Down,
) -> BTreeMap<usize, BTreeSet<usize>> {
    let old = &fleet.azure_sources.held;
    let mut held: BTreeMap<usize, BTreeSet<usize>> = BTreeMap::new();
    if old.is_empty() {
        return held;
    }
    let mut hold = |group: usize, source: usize| {
        held.entry(group).or_default().insert(source);
    };
    for &source in old.keys() {
        hold(source, source);
    }
    for (name, listed) in fleet.azure() {
        if old.contains_key(&listed.group) {
            hold(down.group_of(fleet, policy, name), listed.group);
        }
    }
    let scopes: Vec<(String, usize)> = old
        .iter()
        .flat_map(|(&group, sources)| sources.iter().map(move |s| (resource_group_of(s), group)))
        .collect();
    for (name, vm) in fleet.vms() {
        match (fleet.azure_vm(name), vm.resource_id.as_deref()) {
            // Joined to a listing (by its resource id, or by name without one).
            (Some(listed), _) => {
                if old.contains_key(&listed.group) {
                    hold(down.group_of(fleet, policy, name), listed.group);
                }
            }
            (None, Some(id))
                if id
                    .get(..15)
                    .is_some_and(|s| s.eq_ignore_ascii_case("/subscriptions/")) =>
            {
                let id = id.to_ascii_lowercase();
                for (scope, source) in &scopes {
                    if id.starts_with(scope.as_str()) {
                        hold(down.group_of(fleet, policy, name), *source);
                    }
                }
            }
            // No resource id (or none that is Azure's).
            (None, _) => {
                let group = down.group_of(fleet, policy, name);
                for &source in old.keys() {
                    hold(group, source);
                }
            }
        }
    }
    held
}

/// The old sources of `groups` (keys of `AzureSources::held`), for the words of a wait.
pub(super) fn sources_of<'f>(fleet: &'f Fleet, groups: &BTreeSet<usize>) -> Vec<&'f str> {
    groups
        .iter()
        .filter_map(|g| fleet.azure_sources.held.get(g))
        .flatten()
        .map(String::as_str)
        .collect()
}

/// `/subscriptions/S/resourcegroups/RG/` of a source's ARM id (a resource group, a scale
/// set or an availability set), in lower case; a shorter id stands for itself.
fn resource_group_of(source: &str) -> String {
    let segments: Vec<&str> = source
        .split('/')
        .filter(|s| !s.is_empty())
        .take(4)
        .collect();
    format!("/{}/", segments.join("/")).to_ascii_lowercase()
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_sources_resource_group_is_its_first_four_segments() {
        assert_eq!(
            super::resource_group_of(
                "/subscriptions/S1/resourceGroups/RG-Web/providers/Microsoft.Compute/virtualMachineScaleSets/ss"
            ),
            "/subscriptions/s1/resourcegroups/rg-web/"
        );
        assert_eq!(
            super::resource_group_of("/subscriptions/s1/resourceGroups/rg"),
            "/subscriptions/s1/resourcegroups/rg/"
        );
    }
}
