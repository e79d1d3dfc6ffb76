//! The poller's side of heartbeats (`crate::agent::heartbeat`): when one is due, it is
//! made from the last processed document and handed to the sinks.

use super::Poller;
use crate::agent::heartbeat::Heartbeats;

impl Poller {
    /// Publishes heartbeats as `heartbeats` says.
    pub(in crate::agent) fn with_heartbeats(mut self, heartbeats: Option<Heartbeats>) -> Poller {
        self.heartbeats = heartbeats;
        self
    }

    /// Makes and hands over a heartbeat if one is due; never waits for the store.
    pub(super) fn heartbeat_if_due(&mut self) {
        let settled = self.unstored.is_empty() && self.previous_stored;
        let Some(heartbeats) = self.heartbeats.as_mut() else {
            return;
        };
        if let Some(event) =
            heartbeats.due(settled, self.previous.as_deref(), self.epoch, &self.factory)
        {
            heartbeats.store(event, self.fanout.publisher());
        }
    }
}
