//! Who this VM is: `[identity]` from the configuration first, then
//! `/metadata/instance/compute`, then the hostname.

use sched_relay_core::event::Identity;
use serde::{Deserialize, Serialize};

use super::ImdsClient;

/// `[identity]`: who this VM is. Unset keys come from `/metadata/instance/compute`, then the
/// hostname.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct IdentityConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vm_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vm_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource_id: Option<String>,
    /// The CloudEvents `source`; default the resource id, else `urn:sched-relay:vm:<name>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    #[serde(default = "default_true")]
    pub from_metadata: bool,
}

impl Default for IdentityConfig {
    fn default() -> Self {
        IdentityConfig {
            vm_name: None,
            vm_id: None,
            resource_id: None,
            source: None,
            from_metadata: true,
        }
    }
}

fn default_true() -> bool {
    true
}

impl IdentityConfig {
    /// Problems, as (key under `identity`, message).
    pub fn validate(&self) -> Vec<(String, String)> {
        let mut problems = Vec::new();
        for (key, value) in [("vm_name", &self.vm_name), ("source", &self.source)] {
            if value.as_deref().is_some_and(|v| v.trim().is_empty()) {
                problems.push((
                    key.to_owned(),
                    "is empty; remove the key to use the default".to_owned(),
                ));
            }
        }
        problems
    }
}

/// Identity from configuration first, then `/metadata/instance/compute`, then the hostname.
pub async fn resolve_identity(configured: &IdentityConfig, client: &ImdsClient) -> Identity {
    let mut identity = Identity {
        name: configured.vm_name.clone().unwrap_or_default(),
        vm_id: configured.vm_id.clone(),
        resource_id: configured.resource_id.clone(),
    };
    let complete =
        !identity.name.is_empty() && identity.vm_id.is_some() && identity.resource_id.is_some();
    if configured.from_metadata && !complete {
        match client.identity().await {
            Ok(found) => {
                if identity.name.is_empty() {
                    identity.name = found.name;
                }
                identity.vm_id = identity.vm_id.or(found.vm_id);
                identity.resource_id = identity.resource_id.or(found.resource_id);
            }
            Err(error) => {
                tracing::warn!(error = %error, "Cannot read the VM identity from instance metadata")
            }
        }
    }
    if identity.name.is_empty() {
        identity.name = hostname();
        tracing::warn!(vm_name = %identity.name, "Using the hostname as the VM name; set identity.vm_name if it differs from the name in Resources");
    }
    identity
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .map(|name| name.trim().to_owned())
        .ok()
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "unknown".to_owned())
}
