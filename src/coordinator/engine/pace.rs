//! Decisions paced under load: a decision counts every VM of the fleet, so messages that
//! arrive within [`DECISION_GAP`] of the last decision are decided together at its end
//! (the coordinator's loop sleeps until [`Engine::owed_at`]), not once each.

use std::time::Instant;

use chrono::{DateTime, Utc};
use sched_relay_transport::inbound::Delivery;

use super::Engine;

/// The least time between two decisions made on messages' arrival (see
/// [`Engine::deliver_paced`]): a decision counts every VM, and a wave of 10,000 VMs brings
/// hundreds of messages a second.
pub const DECISION_GAP: std::time::Duration = std::time::Duration::from_millis(20);

impl Engine {
    /// [`Engine::deliver`], deciding at most once per [`DECISION_GAP`]: what a message
    /// allows within the gap after a decision is decided at its end ([`Engine::owed_at`]).
    pub fn deliver_paced(&mut self, delivery: Delivery) {
        self.deliver_with(delivery, Utc::now(), true);
    }

    /// When the decision owed to messages is due, if one is.
    pub fn owed_at(&self) -> Option<Instant> {
        self.owed.map(|_| {
            self.decided_at
                .map_or_else(Instant::now, |at| at + self.decision_gap)
        })
    }

    /// Makes the decision owed to messages, if any ([`Engine::decide`] takes what is owed
    /// and times it from the earliest message).
    pub fn decide_owed(&mut self, now: DateTime<Utc>) {
        if self.owed.is_some() {
            self.decide(now);
        }
    }
}
