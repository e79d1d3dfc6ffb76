//! Azure Resource Manager, for the groups with an Azure source (`[groups.azure]`): their
//! VMs as Azure lists them, with or without an agent, and the state Azure gives each.
//!
//! Layout: [`source`] reads a group's source (an ARM id) and names the calls that list its
//! VMs, [`inventory`] reads ARM's answers (pure); with the `azure` feature, `credential`
//! gets tokens through Microsoft's `azure_identity`, `client` makes the calls (pages,
//! throttling), and [`refresh`] lists every source on an interval for the engine.

#[cfg(feature = "azure")]
mod client;
#[cfg(feature = "azure")]
mod credential;
pub mod inventory;
#[cfg(feature = "azure")]
pub mod refresh;
mod settings;
mod source;
#[cfg(all(test, feature = "azure"))]
mod tests;

pub use inventory::{AzureVm, Snapshot, SourceStatus};
pub use settings::{AZURE_IDENTITY_ENDPOINT, AzureConfig, Credential, GroupAzure};
pub use source::Source;
