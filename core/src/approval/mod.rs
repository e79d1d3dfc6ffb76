//! The signed approval format: what a StartRequest message may look like on any transport
//! ([`request`]), the canonical text a key signs and how a signature verifies ([`verify`]),
//! and how an orchestrator builds and signs one ([`sign`]). The checks that need the
//! agent's state (freshness records, the latest document) live in the agent.

pub mod request;
pub mod sign;
pub mod verify;

pub use request::{
    Attributes, Limits, MAX_ID_BYTES, PREFIXES, Reason, Rejection, Request, parse, usable_id,
};
pub use sign::Draft;
pub use verify::{CANONICAL_VERSION, Key, SigningKey, canonical, decode_base64};

/// The target value of a request meant for every VM of the fleet.
pub const FLEET_TARGET: &str = "*";
