//! Everything that talks to the Instance Metadata Service: the HTTP client, identity look-up
//! and endpoint discovery for VMs outside a VNet. The document model and its parser are pure
//! and live in `sched_relay_core::document`.

mod client;
mod discovery;

pub use client::{ImdsClient, ImdsError, KNOWN_API_VERSIONS};
pub use discovery::{DEFAULT_LEASE_PATHS, discover_endpoint, lease_option_245};
