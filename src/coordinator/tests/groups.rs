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

/// The count of who is down finds each VM's group once, by name, for itself and the decision
/// after it: the same group the policy finds, for agents and for the VMs Azure lists, however
/// each is named (an agent without a resource id, one Azure lists under another name, one
/// whose name Azure lists with another id), and for a name neither knows.
#[cfg(feature = "azure")]
#[test]
fn the_count_places_every_vm_in_the_group_the_policy_finds_for_it() {
    use super::azure::{BATCH, listed};
    use super::quiet_day::start_with;
    use crate::coordinator::fleet::Vm;
    use crate::coordinator::policy::down_now;

    let world = start_with(tempfile::tempdir().unwrap(), BATCH);
    let (policy, mut fleet) = (world.engine.policy(), world.engine.fleet.clone());
    let listed = listed(&[
        ("batch-1", "running"),
        ("batch-2", "running"),
        ("web-2", "running"),
        ("db-7", "deallocated"),
        ("batch-3", "running"),
        ("batch-4", "running"),
        ("batch-7", "running"),
    ]);
    let id = |name: &str| listed.vms[name].resource_id.clone();
    let agent = |resource_id: Option<String>| Vm {
        resource_id,
        last_seen: super::t0(),
        heartbeat: None,
        first_seen: None,
    };
    // Named as Azure lists it, with Azure's id.
    fleet.insert_vm("batch-1".into(), agent(Some(id("batch-1"))));
    // Named as Azure lists it, without a resource id.
    fleet.insert_vm("batch-2".into(), agent(None));
    // Azure's db-7, under another name.
    fleet.insert_vm("db-7-renamed".into(), agent(Some(id("db-7"))));
    // Azure lists web-2 with another id.
    let elsewhere =
        "/subscriptions/s/resourceGroups/rg-web/providers/Microsoft.Compute/virtualMachines/web-2";
    fleet.insert_vm("web-2".into(), agent(Some(elsewhere.into())));
    // Azure's batch-4 under a name no pattern takes: batch by Azure's word alone.
    fleet.insert_vm("x-1".into(), agent(Some(id("batch-4"))));
    // Azure lists batch-7 with another id: the agent's batch-7 is not Azure's, so no
    // group takes it (batch takes only what its source lists).
    fleet.insert_vm(
        "batch-7".into(),
        agent(Some(elsewhere.replace("web-2", "batch-7"))),
    );
    // Agents Azure does not list.
    fleet.insert_vm(
        "web-1".into(),
        agent(Some(elsewhere.replace("web-2", "web-1"))),
    );
    fleet.insert_vm("batch-9".into(), agent(None));
    fleet.set_azure(listed.vms.clone());
    let down = down_now(&fleet, policy, super::t0());
    let names: Vec<String> = fleet
        .vms()
        .keys()
        .chain(fleet.azure().keys())
        .cloned()
        .chain(["nobody-knows-me".to_owned()])
        .collect();
    for name in &names {
        assert_eq!(
            down.group_of(&fleet, policy, name),
            policy.group_of(&fleet, name),
            "{name}"
        );
        assert_eq!(
            down.has_agent(name),
            fleet.vms().contains_key(name),
            "{name}"
        );
    }
    // Where a lookup that missed Azure's word, or took it over the agent's, would differ.
    let group = |name: &str| {
        policy.groups[down.group_of(&fleet, policy, name)]
            .name
            .as_str()
    };
    assert_eq!(
        [
            group("batch-3"),
            group("x-1"),
            group("batch-7"),
            group("web-2"),
            group("db-7")
        ],
        ["batch", "batch", "default", "web", "db"]
    );
    drop(down);
    // Azure lists again without batch-4 (x-1's resource): the count places x-1 by its name
    // again, with what the policy kept for the last listing as without it.
    let mut relisted = listed.vms.clone();
    relisted.remove("batch-4");
    let version = fleet.inventory_version();
    fleet.set_azure(relisted);
    assert_ne!(fleet.inventory_version(), version, "a new listing");
    let kept = down_now(&fleet, policy, super::t0());
    let scratch = down_now(&fleet, &policy.clone(), super::t0());
    for name in &names {
        assert_eq!(
            kept.group_of(&fleet, policy, name),
            scratch.group_of(&fleet, policy, name),
            "{name}"
        );
    }
    for g in 0..policy.groups.len() {
        assert_eq!(kept.members(g), scratch.members(g));
        assert_eq!(kept.without_agent(g), scratch.without_agent(g));
    }
    assert_eq!(
        policy.groups[kept.group_of(&fleet, policy, "x-1")].name,
        "default"
    );
}
