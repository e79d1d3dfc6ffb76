//! Decisions paced under load: a decision counts every VM of the fleet, so messages (and
//! ended drains) that arrive within the gap after the last decision are decided together at
//! its end (the coordinator's loop sleeps until [`Engine::owed_at`]), not once each. The
//! gap is [`DECISION_GAP`], or [`DECISION_SHARE`] times what the last decision cost when
//! that is longer (up to [`DECISION_GAP_MAX`]): however large the fleet, decisions on arrivals
//! leave most of the loop to reading and storing what comes in. Without that, a fleet whose
//! decision costs more than the gap decides all the time, reads its input ever later, and
//! the backlog of waiting events makes each decision dearer still (10,000 VMs: section 25
//! of benches/profiling.md).

use std::time::Instant;

use chrono::{DateTime, Utc};
use sched_relay_transport::inbound::Delivery;

use super::Engine;

/// The least time between two decisions made on messages' arrival (see
/// [`Engine::deliver_paced`]) when decisions are cheap: a decision counts every VM, and a
/// wave of 10,000 VMs brings hundreds of messages a second.
pub const DECISION_GAP: std::time::Duration = std::time::Duration::from_millis(20);

/// The gap is at least this many times the last decision's cost...
pub const DECISION_SHARE: u32 = 5;

/// ... but no longer than this (one slow decision, a stalled process, must not hold the
/// next for long; the tick decides anyway).
pub const DECISION_GAP_MAX: std::time::Duration = std::time::Duration::from_secs(1);

impl Engine {
    /// [`Engine::deliver`], deciding at most once per gap ([`Engine::gap`]): what a message
    /// allows within the gap after a decision is decided at its end ([`Engine::owed_at`]).
    pub fn deliver_paced(&mut self, delivery: Delivery) {
        self.deliver_group_paced(vec![delivery]);
    }

    /// When the decision owed to messages is due, if one is.
    pub fn owed_at(&self) -> Option<Instant> {
        self.owed.map(|_| {
            self.decided_at
                .map_or_else(Instant::now, |at| at + self.gap())
        })
    }

    /// The least time from one decision to the next on arrivals: [`DECISION_GAP`], or
    /// [`DECISION_SHARE`] times the last decision's cost when that is longer, at most
    /// [`DECISION_GAP_MAX`] (or the gap tests set, when longer). A gap set to zero (tests)
    /// stays zero.
    pub fn gap(&self) -> std::time::Duration {
        if self.decision_gap.is_zero() {
            return self.decision_gap;
        }
        let scaled = (self.decision_cost * DECISION_SHARE).min(DECISION_GAP_MAX);
        self.decision_gap.max(scaled)
    }

    /// Tests: as if the last decision had cost `cost`.
    #[cfg(test)]
    pub(crate) fn last_decision_cost(&mut self, cost: std::time::Duration) {
        self.decision_cost = cost;
    }

    /// Something (a message that arrived at `since`, an ended drain) allows a decision: it
    /// is made now, or, `paced` within the gap after the last one, at the gap's end.
    pub(super) fn owe(&mut self, since: Instant, now: DateTime<Utc>, paced: bool) {
        self.owed.get_or_insert(since);
        let recent = self.decided_at.is_some_and(|at| at.elapsed() < self.gap());
        if !(paced && recent) {
            self.decide(now);
        }
    }

    /// Makes the decision owed to messages, if any ([`Engine::decide`] takes what is owed
    /// and times it from the earliest message).
    pub fn decide_owed(&mut self, now: DateTime<Utc>) {
        if self.owed.is_some() {
            self.decide(now);
        }
    }
}
