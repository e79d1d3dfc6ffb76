//! The fleet as Azure Resource Manager lists it: each VM of a group's source, with the
//! provisioning and power state Azure gives it. Read from ARM's JSON here, pure; fetched by
//! [`super::refresh`].
//!
//! A VM Azure shows stopped, deallocated, failed or being updated counts as down, as a
//! PodDisruptionBudget counts a pod that is not Ready: whatever its agent says (or when it
//! has none), its workload is not serving.

use std::collections::{BTreeMap, HashMap};

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;

/// One VM of the Azure inventory.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AzureVm {
    pub resource_id: String,
    /// The first group (in the file's order) whose source lists it.
    pub group: usize,
    /// ARM's provisioning state, lower case (`succeeded`, `updating`, `failed`, ...).
    pub provisioning: Option<String>,
    /// ARM's power state, lower case (`running`, `stopped`, `deallocated`, ...).
    pub power: Option<String>,
}

impl AzureVm {
    /// Why Azure's own view counts the VM as down, if it does: provisioning other than
    /// `succeeded` (being created, updated, deleted, or failed), a power state other than
    /// `running`, or no power state at all, unless a live agent speaks for it (Azure did
    /// not say, and nothing else shows that it serves).
    pub fn down(&self, agent_alive: bool) -> Option<String> {
        match (self.provisioning.as_deref(), self.power.as_deref()) {
            (Some(p), _) if p != "succeeded" => Some(format!("Azure: provisioning {p}")),
            (_, Some("running")) => None,
            (_, Some(power)) => Some(format!("Azure: power {power}")),
            (_, None) if agent_alive => None,
            (_, None) => Some("Azure: no power state".into()),
        }
    }
}

/// What Azure approves by itself (`scheduledEventsPolicy`): user-initiated Reboots and
/// Redeploys, and any event while every instance is down.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct AutoApprove {
    pub user_initiated_reboot: bool,
    pub user_initiated_redeploy: bool,
    /// Azure's default is on: only an explicit `false` turns it off.
    pub all_instances_down: bool,
}

impl AutoApprove {
    /// Reads a VM's or scale set's `scheduledEventsPolicy` (absent: Azure's defaults).
    pub fn read(policy: &Value) -> AutoApprove {
        let on = |part: &str| policy[part]["automaticallyApprove"].as_bool();
        AutoApprove {
            user_initiated_reboot: on("userInitiatedReboot").unwrap_or(false),
            user_initiated_redeploy: on("userInitiatedRedeploy").unwrap_or(false),
            all_instances_down: on("allInstancesDown").unwrap_or(true),
        }
    }

    /// Either says Azure approves it.
    pub fn or(self, other: AutoApprove) -> AutoApprove {
        AutoApprove {
            user_initiated_reboot: self.user_initiated_reboot || other.user_initiated_reboot,
            user_initiated_redeploy: self.user_initiated_redeploy || other.user_initiated_redeploy,
            all_instances_down: self.all_instances_down || other.all_instances_down,
        }
    }

    /// The EventTypes whose user-initiated events Azure approves by itself.
    pub fn user_initiated(self) -> Vec<&'static str> {
        [
            (self.user_initiated_reboot, "Reboot"),
            (self.user_initiated_redeploy, "Redeploy"),
        ]
        .into_iter()
        .filter_map(|(on, ty)| on.then_some(ty))
        .collect()
    }
}

/// A VM as one ARM listing gives it.
#[derive(Debug, Clone, PartialEq)]
pub struct Listed {
    /// ARM's `name`: what the VM's own metadata service (and so its agent) calls it.
    pub name: String,
    pub resource_id: String,
    /// The id of the availability set it is in.
    pub availability_set: Option<String>,
    pub provisioning: Option<String>,
    pub power: Option<String>,
    /// Its own `scheduledEventsPolicy` (a standalone VM's).
    pub auto_approve: AutoApprove,
}

/// Reads one VM of a listing (a scale set's VMs, or a resource group's).
pub fn read_vm(item: &Value) -> Result<Listed, String> {
    let text = |v: &Value| v.as_str().filter(|s| !s.is_empty()).map(str::to_owned);
    let name = text(&item["name"]).ok_or("a VM without a name")?;
    let resource_id = text(&item["id"]).ok_or_else(|| format!("VM {name:?} without an id"))?;
    let properties = &item["properties"];
    let (mut provisioning, power) = statuses(&properties["instanceView"]);
    if provisioning.is_none() {
        provisioning = text(&properties["provisioningState"]).map(|s| s.to_ascii_lowercase());
    }
    Ok(Listed {
        name,
        resource_id,
        availability_set: text(&properties["availabilitySet"]["id"]),
        provisioning,
        power,
        auto_approve: AutoApprove::read(&properties["scheduledEventsPolicy"]),
    })
}

/// The provisioning and power states of an instance view's `statuses`
/// (`ProvisioningState/succeeded`, `PowerState/running`), lower case.
pub fn statuses(instance_view: &Value) -> (Option<String>, Option<String>) {
    let mut found = (None, None);
    for status in instance_view["statuses"].as_array().into_iter().flatten() {
        let Some((kind, state)) = status["code"].as_str().and_then(|c| c.split_once('/')) else {
            continue;
        };
        let state = Some(state.to_ascii_lowercase());
        if kind.eq_ignore_ascii_case("ProvisioningState") {
            found.0 = state;
        } else if kind.eq_ignore_ascii_case("PowerState") {
            found.1 = state;
        }
    }
    found
}

/// Provisioning and power state by lower-case resource id.
pub type States = HashMap<String, (Option<String>, Option<String>)>;

/// The states of a subscription's VMs (`statusOnly=true`), by lower-case resource id.
pub fn read_states(items: &[Value]) -> States {
    items
        .iter()
        .filter_map(|item| {
            let id = item["id"].as_str()?.to_ascii_lowercase();
            Some((id, statuses(&item["properties"]["instanceView"])))
        })
        .collect()
}

/// Gives each VM of a resource group's listing the state of the subscription's listing; a
/// VM the second does not have keeps no power state (it counts as down).
pub fn with_states(vms: &mut [Listed], states: &States) {
    for vm in vms {
        if let Some((provisioning, power)) = states.get(&vm.resource_id.to_ascii_lowercase()) {
            if provisioning.is_some() {
                vm.provisioning.clone_from(provisioning);
            }
            vm.power.clone_from(power);
        }
    }
}

/// Every source's VMs as one inventory, by name: a VM several sources list is the first
/// group's (the file's order, as for matching by name). Two VMs of one name (two
/// resource ids) cannot be told apart by their agents' names: each later group that lists
/// one is returned with why, and its listing is not used.
pub fn merge(
    per_group: &[(usize, Vec<Listed>)],
) -> (BTreeMap<String, AzureVm>, Vec<(usize, String)>) {
    let mut vms: BTreeMap<String, AzureVm> = BTreeMap::new();
    let mut clashes = Vec::new();
    for (group, listed) in per_group {
        let clash = listed.iter().find_map(|vm| {
            let known = vms.get(&vm.name)?;
            (!known.resource_id.eq_ignore_ascii_case(&vm.resource_id)).then(|| {
                format!(
                    "VM {:?} is {} here but {} in another source: two VMs of one name cannot be told apart (rename one)",
                    vm.name, vm.resource_id, known.resource_id
                )
            })
        });
        if let Some(why) = clash {
            clashes.push((*group, why));
            continue;
        }
        for vm in listed {
            let entry = vms.entry(vm.name.clone()).or_insert_with(|| AzureVm {
                resource_id: vm.resource_id.clone(),
                group: *group,
                provisioning: vm.provisioning.clone(),
                power: vm.power.clone(),
            });
            if *group < entry.group {
                entry.group = *group;
            }
        }
    }
    (vms, clashes)
}

/// How one group's source fared, for `/fleet` and the log.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SourceStatus {
    pub group: usize,
    pub source: String,
    /// When it was last listed whole; `None` until it has been.
    pub listed_at: Option<DateTime<Utc>>,
    /// VMs in its last whole listing.
    pub vms: usize,
    /// Why its last listing failed (the previous one is used meanwhile).
    pub error: Option<String>,
    /// What Azure approves by itself for its VMs (a scale set's policy, or any of a
    /// resource group's or availability set's VMs').
    pub auto_approve: AutoApprove,
}

/// One refresh of every source: the inventory (each source's last whole listing) and how
/// each source fared.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    pub vms: BTreeMap<String, AzureVm>,
    pub sources: Vec<SourceStatus>,
}

impl Snapshot {
    /// Every source has been listed whole at least once: only then is a group's size, and
    /// who of it is down, known.
    pub fn complete(&self) -> bool {
        self.sources.iter().all(|s| s.listed_at.is_some())
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn scale_set_vm(name: &str, power: &str, provisioning: &str) -> Value {
        json!({
            "id": format!("/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachineScaleSets/web/virtualMachines/{name}"),
            "name": name,
            "instanceId": "0",
            "properties": {
                "provisioningState": "Succeeded",
                "instanceView": {"statuses": [
                    {"code": format!("ProvisioningState/{provisioning}"), "level": "Info"},
                    {"code": format!("PowerState/{power}"), "level": "Info"},
                ]},
            },
        })
    }

    #[test]
    fn a_scale_set_vm_takes_its_instance_views_states() {
        let vm = read_vm(&scale_set_vm("web_0", "running", "succeeded")).unwrap();
        assert_eq!(vm.name, "web_0");
        assert_eq!(vm.power.as_deref(), Some("running"));
        assert_eq!(vm.provisioning.as_deref(), Some("succeeded"));
        let updating = read_vm(&scale_set_vm("web_1", "starting", "updating")).unwrap();
        assert_eq!(updating.provisioning.as_deref(), Some("updating"));
    }

    #[test]
    fn stopped_deallocated_failed_updating_and_unknown_vms_count_as_down() {
        let vm = |provisioning: Option<&str>, power: Option<&str>| AzureVm {
            resource_id: "id".into(),
            group: 0,
            provisioning: provisioning.map(str::to_owned),
            power: power.map(str::to_owned),
        };
        assert_eq!(vm(Some("succeeded"), Some("running")).down(false), None);
        assert_eq!(vm(Some("succeeded"), None).down(true), None);
        assert!(vm(Some("failed"), None).down(true).is_some());
        for (p, s, why) in [
            (Some("succeeded"), Some("stopped"), "Azure: power stopped"),
            (
                Some("succeeded"),
                Some("deallocated"),
                "Azure: power deallocated",
            ),
            (
                Some("failed"),
                Some("running"),
                "Azure: provisioning failed",
            ),
            (
                Some("updating"),
                Some("starting"),
                "Azure: provisioning updating",
            ),
            (Some("succeeded"), None, "Azure: no power state"),
        ] {
            assert_eq!(vm(p, s).down(false).as_deref(), Some(why), "{p:?} {s:?}");
        }
    }

    #[test]
    fn a_resource_groups_vm_takes_its_power_state_from_the_subscriptions_listing() {
        let model = json!({
            "id": "/subscriptions/s/resourceGroups/RG/providers/Microsoft.Compute/virtualMachines/db1",
            "name": "db1",
            "properties": {
                "provisioningState": "Succeeded",
                "availabilitySet": {"id": "/subscriptions/s/resourceGroups/RG/providers/Microsoft.Compute/availabilitySets/DB"},
            },
        });
        let mut listed = vec![read_vm(&model).unwrap()];
        assert_eq!(listed[0].power, None);
        assert!(
            listed[0]
                .availability_set
                .as_deref()
                .unwrap()
                .ends_with("/DB")
        );
        let states = read_states(&[json!({
            "id": "/subscriptions/s/resourcegroups/rg/providers/Microsoft.Compute/virtualMachines/DB1",
            "name": "db1",
            "properties": {"instanceView": {"statuses": [{"code": "PowerState/deallocated"}]}},
        })]);
        with_states(&mut listed, &states);
        assert_eq!(listed[0].power.as_deref(), Some("deallocated"));
        assert_eq!(listed[0].provisioning.as_deref(), Some("succeeded"));
    }

    #[test]
    fn azures_own_approvals_are_read_with_its_defaults() {
        let none = AutoApprove::read(&Value::Null);
        assert_eq!(none.user_initiated(), Vec::<&str>::new());
        assert!(none.all_instances_down, "Azure's default");
        let policy = AutoApprove::read(&json!({
            "userInitiatedReboot": {"automaticallyApprove": true},
            "userInitiatedRedeploy": {"automaticallyApprove": false},
            "allInstancesDown": {"automaticallyApprove": false},
        }));
        assert_eq!(policy.user_initiated(), vec!["Reboot"]);
        assert!(!policy.all_instances_down);
        assert_eq!(none.or(policy).user_initiated(), vec!["Reboot"]);
    }

    #[test]
    fn a_vm_two_sources_list_is_the_first_groups() {
        let vm = read_vm(&scale_set_vm("web_0", "running", "succeeded")).unwrap();
        let (merged, clashes) = merge(&[(2, vec![vm.clone()]), (1, vec![vm])]);
        assert_eq!(merged["web_0"].group, 1);
        assert!(clashes.is_empty());
    }

    #[test]
    fn two_vms_of_one_name_in_two_sources_are_a_clash_and_the_later_listing_is_not_used() {
        let vm = read_vm(&scale_set_vm("web_0", "running", "succeeded")).unwrap();
        let mut other = vm.clone();
        other.resource_id = other.resource_id.replace("/rg/", "/rg-west/");
        let (merged, clashes) = merge(&[(0, vec![vm.clone()]), (1, vec![other])]);
        assert_eq!(merged["web_0"].resource_id, vm.resource_id);
        assert_eq!(clashes.len(), 1, "{clashes:?}");
        assert_eq!(clashes[0].0, 1);
        assert!(clashes[0].1.contains("two VMs of one name"), "{clashes:?}");
    }

    #[test]
    fn a_vm_without_a_name_or_an_id_is_an_error_naming_it() {
        assert!(
            read_vm(&json!({"id": "x"}))
                .unwrap_err()
                .contains("without a name")
        );
        assert!(
            read_vm(&json!({"name": "vm1"}))
                .unwrap_err()
                .contains("\"vm1\"")
        );
    }
}
