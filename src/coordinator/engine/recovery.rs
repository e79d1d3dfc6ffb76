//! Starting again: what a dry run decided is decided again for real, and drains the state
//! says are running (after a restart, a failover, or a result that could not be stored) are
//! run again: hooks must be idempotent.

use chrono::{DateTime, Utc};

use super::Engine;
use crate::coordinator::store::Changes;

impl Engine {
    /// Prepares a start: approvals a dry run decided are decided again for real when dry
    /// run is off. Drains a previous run left running are run again by the tick (hooks are
    /// idempotent); approvals without a confirmed publication go out again on the tick.
    pub fn resume(&mut self) {
        let now = Utc::now();
        if !self.config.coordinator.dry_run {
            let mut changes = Changes::default();
            for (key, m) in self.fleet.events.iter_mut() {
                if m.approval.as_ref().is_some_and(|a| a.dry_run) {
                    m.approval = None;
                    m.verdict.clear();
                    changes.events.push((key.clone(), Some(m.clone())));
                }
            }
            if let Err(error) = self.store.write(&changes) {
                tracing::error!(error = %error, "Cannot store the state; dry-run decisions stay as they are");
                self.reload();
            }
        }
        self.publish_snapshot(now);
    }

    /// Runs again every drain the state says is running but this process is not running
    /// (after a restart, or a result that could not be stored).
    pub(super) fn restart_drains(&mut self, now: DateTime<Utc>) {
        // Paused: nothing is drained, not even again (they run once resumed).
        if self.config.coordinator.dry_run || self.fleet.paused.is_some() {
            return;
        }
        let running: Vec<(String, String)> = self
            .fleet
            .events
            .iter()
            .filter_map(|(key, m)| m.drain.as_ref().map(|d| (key, d)))
            .flat_map(|(key, d)| {
                d.vms
                    .iter()
                    .filter(|(_, state)| *state == "running")
                    .map(move |(vm, _)| (key.clone(), vm.clone()))
            })
            .filter(|running| !self.draining.contains_key(running))
            .collect();
        for (key, vm) in running {
            tracing::info!(event_id = %key, vm = %vm, "Running a drain again (a restart, or its result could not be stored)");
            self.start_drain(&key, &vm, now);
        }
    }
}
