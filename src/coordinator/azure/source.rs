//! A group's Azure inventory source (`[groups.azure] source`): the Azure Resource Manager
//! id of a scale set, a resource group or an availability set, and the ARM paths that list
//! its VMs. Pure.

use std::fmt;

/// What `[groups.azure] source` names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A scale set's VMs (uniform orchestration: ARM lists them under the set).
    ScaleSet {
        subscription: String,
        resource_group: String,
        name: String,
    },
    /// The resource group's VMs (scale sets' uniform VMs are not among them).
    ResourceGroup {
        subscription: String,
        resource_group: String,
    },
    /// The VMs of an availability set (they share its resource group).
    AvailabilitySet {
        subscription: String,
        resource_group: String,
        name: String,
    },
}

const COMPUTE: &str = "Microsoft.Compute";

impl Source {
    /// Reads an ARM resource id. Azure's ids are case-insensitive: the fixed segments are
    /// matched ignoring case, the names kept as written.
    pub fn parse(id: &str) -> Result<Source, String> {
        let expected = "a scale set (/subscriptions/<id>/resourceGroups/<rg>/providers/Microsoft.Compute/virtualMachineScaleSets/<name>), a resource group (/subscriptions/<id>/resourceGroups/<rg>) or an availability set (.../providers/Microsoft.Compute/availabilitySets/<name>)";
        let trimmed = id.trim().trim_end_matches('/');
        let parts: Vec<&str> = trimmed.split('/').collect();
        let valid_name = |s: &str| !s.is_empty() && !s.contains(['?', '#', '%', ' ']);
        let fixed =
            |i: usize, want: &str| parts.get(i).is_some_and(|p| p.eq_ignore_ascii_case(want));
        let well_formed = parts.first() == Some(&"")
            && fixed(1, "subscriptions")
            && fixed(3, "resourceGroups")
            && parts.iter().skip(1).all(|p| valid_name(p));
        if !well_formed || !(parts.len() == 5 || parts.len() == 9) {
            return Err(format!("{id:?} is not {expected}"));
        }
        let (subscription, resource_group) = (parts[2].to_owned(), parts[4].to_owned());
        if parts.len() == 5 {
            return Ok(Source::ResourceGroup {
                subscription,
                resource_group,
            });
        }
        if !fixed(5, "providers") || !fixed(6, COMPUTE) {
            return Err(format!("{id:?} is not {expected}"));
        }
        let name = parts[8].to_owned();
        if fixed(7, "virtualMachineScaleSets") {
            Ok(Source::ScaleSet {
                subscription,
                resource_group,
                name,
            })
        } else if fixed(7, "availabilitySets") {
            Ok(Source::AvailabilitySet {
                subscription,
                resource_group,
                name,
            })
        } else {
            Err(format!("{id:?} is not {expected}"))
        }
    }

    pub fn subscription(&self) -> &str {
        match self {
            Source::ScaleSet { subscription, .. }
            | Source::ResourceGroup { subscription, .. }
            | Source::AvailabilitySet { subscription, .. } => subscription,
        }
    }

    pub fn resource_group(&self) -> &str {
        match self {
            Source::ScaleSet { resource_group, .. }
            | Source::ResourceGroup { resource_group, .. }
            | Source::AvailabilitySet { resource_group, .. } => resource_group,
        }
    }

    fn group_path(&self) -> String {
        format!(
            "/subscriptions/{}/resourceGroups/{}",
            self.subscription(),
            self.resource_group()
        )
    }

    /// The path (no query) that lists the source's VMs: the scale set's VMs, or the
    /// resource group's standalone VMs (an availability set's are those that name it).
    pub fn list_path(&self) -> String {
        match self {
            Source::ScaleSet { name, .. } => format!(
                "{}/providers/{COMPUTE}/virtualMachineScaleSets/{name}/virtualMachines",
                self.group_path()
            ),
            Source::ResourceGroup { .. } | Source::AvailabilitySet { .. } => {
                format!("{}/providers/{COMPUTE}/virtualMachines", self.group_path())
            }
        }
    }

    /// The availability set's own id, to find the VMs that name it.
    pub fn availability_set_id(&self) -> Option<String> {
        match self {
            Source::AvailabilitySet { name, .. } => Some(format!(
                "{}/providers/{COMPUTE}/availabilitySets/{name}",
                self.group_path()
            )),
            _ => None,
        }
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::ScaleSet { name, .. } => write!(
                f,
                "{}/providers/{COMPUTE}/virtualMachineScaleSets/{name}",
                self.group_path()
            ),
            Source::ResourceGroup { .. } => f.write_str(&self.group_path()),
            Source::AvailabilitySet { .. } => f.write_str(
                &self
                    .availability_set_id()
                    .expect("an availability set has an id"),
            ),
        }
    }
}

/// Where a VM's scheduled events are acknowledged through ARM: a scale set's VM at its
/// scale set (`.../virtualMachineScaleSets/{name}`), any other VM at its own id. `None`
/// for an id that is not a VM's, or that holds anything but plain path segments (it is
/// put into a URL path).
pub fn acknowledge_scope(resource_id: &str) -> Option<String> {
    let segments: Vec<&str> = resource_id.trim_end_matches('/').split('/').collect();
    let plain = |s: &&str| {
        !s.is_empty()
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.()".contains(c))
            && *s != "."
            && *s != ".."
    };
    if !segments.first().is_some_and(|s| s.is_empty()) || !segments[1..].iter().all(plain) {
        return None;
    }
    let lowered: Vec<String> = segments.iter().map(|s| s.to_ascii_lowercase()).collect();
    let kinds: Vec<&str> = lowered.iter().map(String::as_str).collect();
    match kinds.as_slice() {
        [
            _,
            "subscriptions",
            _,
            "resourcegroups",
            _,
            "providers",
            "microsoft.compute",
            "virtualmachinescalesets",
            _,
            "virtualmachines",
            _,
        ] => Some(segments[..9].join("/")),
        [
            _,
            "subscriptions",
            _,
            "resourcegroups",
            _,
            "providers",
            "microsoft.compute",
            "virtualmachines",
            _,
        ] => Some(segments.join("/")),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::{Source, acknowledge_scope};

    #[test]
    fn a_scale_sets_vm_is_acknowledged_at_its_scale_set_and_any_other_vm_at_itself() {
        let set = format!(
            "{SUB}/resourceGroups/web-rg/providers/Microsoft.Compute/virtualMachineScaleSets/web"
        );
        assert_eq!(
            acknowledge_scope(&format!("{set}/virtualMachines/3")).as_deref(),
            Some(set.as_str())
        );
        let vm = format!("{SUB}/resourceGroups/db/providers/Microsoft.Compute/virtualMachines/db1");
        assert_eq!(acknowledge_scope(&vm).as_deref(), Some(vm.as_str()));
        for not_a_vm in [
            set.clone(),
            format!("{SUB}/resourceGroups/db"),
            format!("{SUB}/resourceGroups/db/providers/Microsoft.Compute/virtualMachines/../x"),
            format!("{SUB}/resourceGroups/db/providers/Microsoft.Compute/virtualMachines/a?b"),
            format!("{SUB}/resourceGroups/db/providers/Microsoft.Compute/virtualMachines/a%2Fb"),
            "db1".to_owned(),
        ] {
            assert_eq!(acknowledge_scope(&not_a_vm), None, "{not_a_vm}");
        }
    }

    const SUB: &str = "/subscriptions/0b1f6471-1bf0-4dda-aec3-111122223333";

    #[test]
    fn a_scale_set_id_is_read_ignoring_the_case_of_its_fixed_segments() {
        let id = format!(
            "{SUB}/resourcegroups/web-rg/providers/microsoft.compute/virtualmachinescalesets/web/"
        );
        let source = Source::parse(&id).unwrap();
        assert_eq!(
            source,
            Source::ScaleSet {
                subscription: "0b1f6471-1bf0-4dda-aec3-111122223333".into(),
                resource_group: "web-rg".into(),
                name: "web".into(),
            }
        );
        assert_eq!(
            source.list_path(),
            format!(
                "{SUB}/resourceGroups/web-rg/providers/Microsoft.Compute/virtualMachineScaleSets/web/virtualMachines"
            )
        );
    }

    #[test]
    fn a_resource_group_and_an_availability_set_list_the_groups_vms() {
        let rg = Source::parse(&format!("{SUB}/resourceGroups/db")).unwrap();
        let set = Source::parse(&format!(
            "{SUB}/resourceGroups/db/providers/Microsoft.Compute/availabilitySets/db-as"
        ))
        .unwrap();
        assert_eq!(rg.list_path(), set.list_path());
        assert_eq!(
            set.availability_set_id().unwrap(),
            format!("{SUB}/resourceGroups/db/providers/Microsoft.Compute/availabilitySets/db-as")
        );
        assert_eq!(rg.availability_set_id(), None);
        assert_eq!(set.to_string(), set.availability_set_id().unwrap());
    }

    #[test]
    fn ids_of_anything_else_are_refused_saying_what_is_expected() {
        for bad in [
            "web".to_owned(),
            SUB.to_owned(),
            format!("{SUB}/resourceGroups/rg/providers/Microsoft.Compute/virtualMachines/vm1"),
            format!("{SUB}/resourceGroups/rg/providers/Microsoft.Network/virtualNetworks/v"),
            format!("{SUB}/resourceGroups//providers/Microsoft.Compute/availabilitySets/a"),
            format!("{SUB}/resourceGroups/rg?x=1"),
            "subscriptions/x/resourceGroups/rg".to_owned(),
        ] {
            let error = Source::parse(&bad).unwrap_err();
            assert!(error.contains("is not a scale set"), "{bad}: {error}");
        }
    }
}
