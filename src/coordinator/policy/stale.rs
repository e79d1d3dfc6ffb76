//! The groups an old Azure source holds: those whose count of who is down it leaves
//! unknown. A source older than `[azure] max_age` (`AzureSources::held`) may miss a VM of
//! its last listing stopped or deallocated since, and a VM made since, whichever group
//! counts them.

use std::collections::{BTreeMap, BTreeSet};

use super::Policy;
use super::down::Down;
use crate::coordinator::fleet::Fleet;

/// Each held group, with the old sources that hold it: each source's own group, every
/// group a VM of its last listing is placed in (a group that matches it by name first
/// counts it), and every group an agent is placed in whose resource id is in the source's
/// resource group while no listing has it (a VM made since the last listing is placed by
/// name, or in the default group, until its source is listed again).
pub(super) fn held_groups(
    fleet: &Fleet,
    policy: &Policy,
    down: &Down,
) -> BTreeMap<usize, BTreeSet<String>> {
    let mut held: BTreeMap<usize, BTreeSet<String>> = BTreeMap::new();
    if fleet.azure_sources.held.is_empty() {
        return held;
    }
    let mut hold = |group: usize, sources: &[String]| {
        held.entry(group)
            .or_default()
            .extend(sources.iter().cloned());
    };
    for (&group, sources) in &fleet.azure_sources.held {
        hold(group, sources);
    }
    for (name, listed) in fleet.azure() {
        if let Some(sources) = fleet.azure_sources.held.get(&listed.group) {
            hold(down.group_of(fleet, policy, name), sources);
        }
    }
    let scopes: Vec<(String, &Vec<String>)> = fleet
        .azure_sources
        .held
        .values()
        .flat_map(|sources| sources.iter().map(move |s| (resource_group_of(s), sources)))
        .collect();
    for (name, vm) in fleet.vms() {
        // An agent joined to a listing (by its resource id) is placed by it: above.
        match fleet.azure_vm(name) {
            Some(listed) => {
                if let Some(sources) = fleet.azure_sources.held.get(&listed.group) {
                    hold(down.group_of(fleet, policy, name), sources);
                }
            }
            None => {
                let Some(id) = vm.resource_id.as_deref() else {
                    continue;
                };
                let id = id.to_ascii_lowercase();
                for (scope, sources) in &scopes {
                    if id.starts_with(scope.as_str()) {
                        hold(down.group_of(fleet, policy, name), sources);
                    }
                }
            }
        }
    }
    held
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
