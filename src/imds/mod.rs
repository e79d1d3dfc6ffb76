//! Everything that talks to the Instance Metadata Service: the HTTP client, identity look-up
//! and endpoint discovery for VMs outside a VNet. The document model and its parser are pure
//! and live in `sched_relay_core::document`.

mod client;
mod config;
mod connection;
mod discovery;
mod error;
mod identity;
pub mod pacing;

pub use client::{ImdsClient, ImdsError, KNOWN_API_VERSIONS};
pub use config::{ImdsConfig, MIN_POLL_INTERVAL, is_api_version};
pub use connection::KeptAlive;
pub use discovery::resolve_endpoint;
pub use discovery::{DEFAULT_LEASE_PATHS, discover_endpoint, lease_option_245};
pub use identity::{
    IdentityConfig, IdentityResolver, Origin, identity_from_json, identity_to_json,
};

/// The latest document the poller fetched, and when: what the remote-approval checks and the
/// `/events` view read.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub document: std::sync::Arc<sched_relay_core::document::Document>,
    pub fetched: std::time::Instant,
}
