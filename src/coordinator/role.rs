//! What this instance is to its fleet, as `/healthz`, `/fleet` and the admin endpoint say:
//! `starting` (loading the state it holds the lease for), `standby` (another instance holds
//! the lease, or this one lost it), `active`, or `paused`: it holds the lease, but its last
//! renewal is too old to act on (NATS out of reach, a stall that just ended), so a standby
//! may be taking over and what it shows may no longer be the fleet's state.

use std::sync::{Arc, OnceLock, RwLock};

/// Whether the lease is fresh enough to act on (`Ha::may_act`).
pub(super) type Fresh = Arc<dyn Fn() -> bool + Send + Sync>;

pub(super) struct Role {
    said: RwLock<&'static str>,
    /// With a standby: the lease's freshness, once this instance holds one.
    fresh: OnceLock<Fresh>,
}

impl Role {
    pub(super) fn new() -> Arc<Role> {
        Arc::new(Role {
            said: RwLock::new("starting"),
            fresh: OnceLock::new(),
        })
    }

    /// `starting`, `standby` or `active`, from now on.
    pub(super) fn set(&self, role: &'static str) {
        *self.said.write().unwrap_or_else(|e| e.into_inner()) = role;
    }

    /// An active instance is `paused` whenever `fresh` says its lease is not fresh.
    // Only a standby (NATS) has a lease.
    #[cfg_attr(not(feature = "nats"), allow(dead_code))]
    pub(super) fn gated_by(&self, fresh: Fresh) {
        let _ = self.fresh.set(fresh);
    }

    /// The lease's freshness (what every action checks), once this instance holds one.
    pub(super) fn fresh(&self) -> Option<Fresh> {
        self.fresh.get().cloned()
    }

    /// What this instance is now.
    pub(super) fn now(&self) -> &'static str {
        let said = *self.said.read().unwrap_or_else(|e| e.into_inner());
        match self.fresh.get() {
            Some(fresh) if said == "active" && !fresh() => "paused",
            _ => said,
        }
    }
}
