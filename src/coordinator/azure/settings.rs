//! `[azure]` (how the coordinator reaches Azure Resource Manager, and as whom) and
//! `[groups.azure]` (a group's inventory from ARM), as the configuration file gives them;
//! checked with the rest of the file (`config`).

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// `[azure]`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct AzureConfig {
    /// Who the coordinator is to Azure: `managed_identity` (the VM's or scale set's, through
    /// the metadata service), `workload_identity` (AKS: `AZURE_TENANT_ID`,
    /// `AZURE_CLIENT_ID`, `AZURE_FEDERATED_TOKEN_FILE`) or `client_secret` (a service
    /// principal: `AZURE_TENANT_ID`, `AZURE_CLIENT_ID`, `AZURE_CLIENT_SECRET`). Tokens are
    /// Microsoft's `azure_identity`'s: fetched, cached and refreshed by it.
    #[serde(default)]
    pub credential: Credential,
    /// A user-assigned managed identity's client id (default: the system-assigned one).
    #[serde(default)]
    pub client_id: Option<String>,
    /// Azure Resource Manager (a sovereign cloud's, or the simulator's).
    #[serde(default = "default_resource_manager")]
    pub resource_manager: String,
    /// The audience of the tokens asked for (default: `resource_manager`, as in Azure's
    /// public and sovereign clouds; `https://management.azure.com` for the simulator).
    #[serde(default)]
    pub audience: Option<String>,
    /// Where the metadata service's token endpoint is reached (the simulator's in tests;
    /// Azure's own is `http://169.254.169.254`).
    #[serde(default = "default_identity_endpoint")]
    pub managed_identity_endpoint: String,
    /// The api-version of the compute calls (listing VMs and their states).
    #[serde(default = "default_compute_api_version")]
    pub compute_api_version: String,
    /// The api-version of `Microsoft.Maintenance/scheduledevents/{id}/acknowledge` (the
    /// approvals of groups with `approve_via = "arm"` or `"agent_then_arm"`).
    #[serde(default = "default_maintenance_api_version")]
    pub maintenance_api_version: String,
    /// How often every group's source is listed again.
    #[serde(default = "default_refresh", with = "humantime_serde")]
    pub refresh: Duration,
    /// A source whose last whole listing is older than this (failing since, or a
    /// refresher stuck) holds the decisions of every group that may count its VMs (every
    /// group's under a `[fleet]` budget) until it is listed again: an old listing misses
    /// the VMs stopped or deallocated since.
    #[serde(default = "default_max_age", with = "humantime_serde")]
    pub max_age: Duration,
    /// One ARM call (a page) may take this long.
    #[serde(default = "default_timeout", with = "humantime_serde")]
    pub timeout: Duration,
}

#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Credential {
    #[default]
    ManagedIdentity,
    WorkloadIdentity,
    ClientSecret,
}

/// `[groups.azure]`: the group's VMs as Azure lists them.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct GroupAzure {
    /// The ARM id of a scale set, a resource group or an availability set: its VMs are the
    /// group's (with or without an agent), its size the inventory's.
    pub source: String,
    /// How the group's events are approved: `agent` (a signed StartRequest to an agent of
    /// the event's VMs, as without Azure), `arm` (acknowledged through Azure Resource
    /// Manager at the VM's or its scale set's scope, no agent needed) or `agent_then_arm`
    /// (through an agent, and through ARM when none answers within `outcome_timeout` or
    /// none of the event's VMs has a live agent).
    #[serde(default)]
    pub approve_via: ApproveVia,
}

/// `[groups.azure] approve_via`.
#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ApproveVia {
    #[default]
    Agent,
    Arm,
    AgentThenArm,
}

impl ApproveVia {
    pub fn through_agent(self) -> bool {
        self != ApproveVia::Arm
    }
    pub fn through_arm(self) -> bool {
        self != ApproveVia::Agent
    }
}

pub const AZURE_IDENTITY_ENDPOINT: &str = "http://169.254.169.254";

fn default_resource_manager() -> String {
    "https://management.azure.com".into()
}
fn default_identity_endpoint() -> String {
    AZURE_IDENTITY_ENDPOINT.into()
}
fn default_compute_api_version() -> String {
    "2024-07-01".into()
}
fn default_maintenance_api_version() -> String {
    "2023-10-01-preview".into()
}
fn default_refresh() -> Duration {
    Duration::from_secs(60)
}
fn default_max_age() -> Duration {
    Duration::from_secs(300)
}
fn default_timeout() -> Duration {
    Duration::from_secs(30)
}
