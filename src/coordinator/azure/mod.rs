//! Azure Resource Manager, for the groups with an Azure source (`[groups.azure]`): their
//! VMs as Azure lists them, with or without an agent, and the state Azure gives each.
//!
//! Layout: [`source`] reads a group's source (an ARM id) and names the calls that list its
//! VMs, [`inventory`] reads ARM's answers (pure); with the `azure` feature, `credential`
//! gets tokens through Microsoft's `azure_identity`, `client` makes the calls (pages,
//! throttling), [`refresh`] lists every source on an interval for the engine, and
//! [`acknowledge`] approves events through ARM (`approve_via`), held back per subscription
//! by `hold` while ARM throttles or fails.

mod ack;
#[cfg(feature = "azure")]
pub mod acknowledge;
#[cfg(feature = "azure")]
mod client;
#[cfg(feature = "azure")]
mod credential;
#[cfg(feature = "azure")]
mod hold;
pub mod inventory;
#[cfg(feature = "azure")]
pub mod refresh;
mod settings;
mod source;
#[cfg(all(test, feature = "azure"))]
mod tests;

pub use ack::{Acked, Acknowledge};
pub use inventory::{AzureVm, Snapshot, SourceStatus};
pub use settings::{AZURE_IDENTITY_ENDPOINT, ApproveVia, AzureConfig, Credential, GroupAzure};
pub use source::{Source, acknowledge_scope};
