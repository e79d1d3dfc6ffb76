//! Which group a VM is in: the first whose name pattern, resource-id parts or Azure source
//! takes it.

use crate::coordinator::policy::{Matcher, glob};

#[test]
fn groups_match_names_and_resource_id_parts() {
    assert!(glob("web-*", "web-12"));
    assert!(glob("w?b-*-x", "wab-1-2-x"));
    assert!(!glob("web-*", "db-1"));
    assert!(glob("*", ""));
    let id = "/subscriptions/s/resourceGroups/RG-Web/providers/Microsoft.Compute/virtualMachineScaleSets/front/virtualMachines/3";
    let by_group = Matcher {
        resource_group: Some("rg-web".into()),
        ..Matcher::default()
    };
    assert!(by_group.matches("front_3", Some(id)));
    assert!(
        !by_group.matches("front_3", None),
        "no resource id, no match"
    );
    let by_set = Matcher {
        scale_set: Some("front".into()),
        vm_name: Some("front_*".into()),
        ..Matcher::default()
    };
    assert!(by_set.matches("front_3", Some(id)));
    assert!(!by_set.matches("back_3", Some(id)));
}

#[cfg(feature = "azure")]
#[test]
fn a_group_with_only_an_azure_source_takes_only_the_vms_it_lists() {
    use super::azure::{BATCH, listed};
    use super::quiet_day::start_with;

    let world = start_with(tempfile::tempdir().unwrap(), BATCH);
    let (policy, mut fleet) = (world.engine.policy(), world.engine.fleet.clone());
    // Not listed: the default group, whatever its name or resource group.
    assert_eq!(policy.group_of(&fleet, "batch-7"), policy.groups.len() - 1);
    fleet.set_azure(listed(&[("batch-7", "running")]).vms);
    assert_eq!(
        policy.groups[policy.group_of(&fleet, "batch-7")].name,
        "batch"
    );
    // A VM the web group's name pattern takes stays web's: the first group wins.
    fleet.set_azure(listed(&[("web-1", "running")]).vms);
    assert_eq!(policy.groups[policy.group_of(&fleet, "web-1")].name, "web");
}
