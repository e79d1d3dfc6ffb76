//! Azure's JSON shapes for what the stand-in serves: a VM's model (standalone or scale-set
//! instance), its instance view, a scale set, an availability set, `scheduledEventsPolicy`.
//! Only the fields a coordinator reads, with the names and casing of the Compute REST API.

use serde_json::{Value, json};

use super::super::SimEventsPolicy;
use super::inventory::{ArmVm, Placement, Power, Provisioning, Status};

const LOCATION: &str = "westeurope";

/// `properties.provisioningState`.
fn provisioning_state(provisioning: Provisioning) -> &'static str {
    match provisioning {
        Provisioning::Succeeded => "Succeeded",
        Provisioning::Updating => "Updating",
        Provisioning::Failed => "Failed",
    }
}

/// `instanceView.statuses`: the provisioning state, then the power state, as Azure lists them.
pub(super) fn statuses(status: Status) -> Value {
    let provisioning = match status.provisioning {
        Provisioning::Succeeded => json!({"code": "ProvisioningState/succeeded", "level": "Info",
                                          "displayStatus": "Provisioning succeeded"}),
        Provisioning::Updating => json!({"code": "ProvisioningState/updating", "level": "Info",
                                         "displayStatus": "Updating"}),
        // Azure appends the failure's code to the status code.
        Provisioning::Failed => json!({"code": "ProvisioningState/failed/InternalOperationError",
                                       "level": "Error", "displayStatus": "Provisioning failed"}),
    };
    let (code, display) = match status.power {
        Power::Running => ("PowerState/running", "VM running"),
        Power::Starting => ("PowerState/starting", "VM starting"),
        Power::Stopped => ("PowerState/stopped", "VM stopped"),
        Power::Deallocated => ("PowerState/deallocated", "VM deallocated"),
    };
    json!([provisioning, {"code": code, "level": "Info", "displayStatus": display}])
}

/// `scheduledEventsPolicy`, with only the keys the scenario set.
pub(super) fn policy(policy: &SimEventsPolicy) -> Value {
    let mut object = serde_json::Map::new();
    let approve = |b: bool| json!({"automaticallyApprove": b});
    if let Some(b) = policy.user_initiated_reboot_auto_approve {
        object.insert("userInitiatedReboot".into(), approve(b));
    }
    if let Some(b) = policy.user_initiated_redeploy_auto_approve {
        object.insert("userInitiatedRedeploy".into(), approve(b));
    }
    if let Some(b) = policy.all_instances_down_auto_approve {
        object.insert("allInstancesDown".into(), approve(b));
    }
    Value::Object(object)
}

/// A group-level id: `/subscriptions/S/resourceGroups/RG/providers/Microsoft.Compute/{kind}/{name}`.
pub(super) fn group_resource_id(vm: &ArmVm, kind: &str, name: &str) -> String {
    format!(
        "/subscriptions/{}/resourceGroups/{}/providers/Microsoft.Compute/{kind}/{name}",
        vm.subscription, vm.resource_group
    )
}

/// An availability set's id as Azure writes it inside VM models and availability sets: the
/// resource group and the names in capitals (a known quirk; compare ids case-insensitively).
fn shouted_id(vm: &ArmVm, kind: &str, name: &str) -> String {
    format!(
        "/subscriptions/{}/resourceGroups/{}/providers/Microsoft.Compute/{kind}/{}",
        vm.subscription,
        vm.resource_group.to_ascii_uppercase(),
        name.to_ascii_uppercase()
    )
}

/// A VM's model, with its instance view when `expand` (`$expand=instanceView`).
pub(super) fn vm(vm: &ArmVm, status: Status, expand: bool) -> Value {
    let mut properties = json!({
        "provisioningState": provisioning_state(status.provisioning),
        "vmId": vm.vm_id,
        "osProfile": {"computerName": vm.name},
    });
    let fields = properties.as_object_mut().expect("a JSON object");
    if let Some(set) = vm.availability_set() {
        fields.insert(
            "availabilitySet".into(),
            json!({"id": shouted_id(vm, "availabilitySets", set)}),
        );
    }
    // A scale-set VM's policy is its scale set's, shown there.
    if let (Some(policy_set), None) = (&vm.policy, vm.scale_set()) {
        fields.insert("scheduledEventsPolicy".into(), policy(policy_set));
    }
    if expand {
        fields.insert(
            "instanceView".into(),
            json!({"computerName": vm.name, "statuses": statuses(status)}),
        );
    }
    match &vm.placement {
        Placement::ScaleSet { instance_id, .. } => json!({
            "id": vm.resource_id,
            "name": vm.name,
            "instanceId": instance_id,
            "type": "Microsoft.Compute/virtualMachineScaleSets/virtualMachines",
            "location": LOCATION,
            "properties": properties,
        }),
        Placement::Standalone { .. } => json!({
            "id": vm.resource_id,
            "name": vm.name,
            "type": "Microsoft.Compute/virtualMachines",
            "location": LOCATION,
            "properties": properties,
        }),
    }
}

/// What `statusOnly=true` lists of a VM: its id, name and instance view.
pub(super) fn vm_status_only(vm: &ArmVm, status: Status) -> Value {
    json!({
        "id": vm.resource_id,
        "name": vm.name,
        "type": "Microsoft.Compute/virtualMachines",
        "location": LOCATION,
        "properties": {"instanceView": {"computerName": vm.name, "statuses": statuses(status)}},
    })
}

/// A scale set, from one of its VMs (its policy is theirs) and its live instance count.
pub(super) fn scale_set(member: &ArmVm, name: &str, capacity: usize) -> Value {
    let mut properties = json!({"provisioningState": "Succeeded", "orchestrationMode": "Uniform"});
    if let Some(policy_set) = &member.policy {
        properties["scheduledEventsPolicy"] = policy(policy_set);
    }
    json!({
        "id": group_resource_id(member, "virtualMachineScaleSets", name),
        "name": name,
        "type": "Microsoft.Compute/virtualMachineScaleSets",
        "location": LOCATION,
        "sku": {"name": "Standard_D2s_v5", "tier": "Standard", "capacity": capacity},
        "properties": properties,
    })
}

/// An availability set and the VMs in it that exist.
pub(super) fn availability_set(any_member: &ArmVm, name: &str, members: &[&ArmVm]) -> Value {
    let vms: Vec<Value> = members
        .iter()
        .map(|vm| json!({"id": shouted_id(vm, "virtualMachines", &vm.name)}))
        .collect();
    json!({
        "id": group_resource_id(any_member, "availabilitySets", name),
        "name": name,
        "type": "Microsoft.Compute/availabilitySets",
        "location": LOCATION,
        "sku": {"name": "Aligned"},
        "properties": {
            "platformFaultDomainCount": 2,
            "platformUpdateDomainCount": 5,
            "virtualMachines": vms,
        },
    })
}
