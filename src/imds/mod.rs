//! Everything that talks to, or describes, the Instance Metadata Service: the document model
//! and parser, the HTTP client, identity look-up and endpoint discovery for VMs outside a VNet.

mod client;
mod discovery;
mod document;

pub use client::{Identity, ImdsClient, ImdsError, KNOWN_API_VERSIONS};
pub use discovery::{DEFAULT_LEASE_PATHS, discover_endpoint, lease_option_245};
pub use document::{
    Document, DocumentError, EventSource, EventStatus, EventType, Parsed, ScheduledEvent,
    parse_not_before,
};
