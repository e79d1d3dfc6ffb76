//! What one commit of the coordinator's state writes, whichever store keeps it (the redb
//! file, or NATS KV with a standby): shared by both, so that neither names the other.

use chrono::{DateTime, Utc};

use super::fleet::{Maintenance, Pause, Vm};

/// What one commit writes.
#[derive(Debug, Default)]
pub struct Changes {
    pub events: Vec<(String, Option<Maintenance>)>,
    pub vms: Vec<(String, Vm)>,
    pub vms_removed: Vec<String>,
    pub seen: Vec<((String, String), DateTime<Utc>)>,
    pub unseen: Vec<(String, String)>,
    /// `Some` when the pause switch changed: paused (`Some(Some)`) or resumed.
    pub paused: Option<Option<Pause>>,
}

impl Changes {
    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
            && self.vms.is_empty()
            && self.vms_removed.is_empty()
            && self.seen.is_empty()
            && self.unseen.is_empty()
            && self.paused.is_none()
    }
}
