//! The tick: approvals without an outcome are published again (the same request while it is
//! fresh), refused or unanswered ones are given up after `max_attempts` with an alert,
//! silent events are forgotten, everything is decided again and `/fleet` refreshed.

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use serde_json::json;

use super::{DONE_REASONS, Engine, PUBLISH_RETRY, RETRY_REASONS, REUSE_REQUEST_FOR, new_request};
use crate::coordinator::policy;
use crate::coordinator::store::Changes;

/// Forgotten events and old ids are looked for this often (each look walks everything).
const PRUNE_EVERY: Duration = Duration::from_secs(60);

impl Engine {
    /// Retries, gives up, forgets, decides again, refreshes `/fleet`.
    pub fn tick(&mut self, now: DateTime<Utc>) {
        let forget = chrono::Duration::from_std(self.config.coordinator.forget_after)
            .unwrap_or(chrono::Duration::days(1));
        let mut changes = Changes::default();
        let mut gone = Vec::new();
        if self.pruned.is_none_or(|at| at.elapsed() >= PRUNE_EVERY) {
            self.pruned = Some(Instant::now());
            (gone, changes.unseen) = self.fleet.prune(now, forget);
        }
        for key in gone {
            tracing::info!(event_id = %key, "Forgotten: no agent has reported on it for forget_after");
            self.publishing.remove(&key);
            changes.events.push((key, None));
        }
        let mut republish = Vec::new();
        let timeout = chrono::Duration::from_std(self.config.coordinator.outcome_timeout)
            .unwrap_or(chrono::Duration::seconds(20));
        for (key, m) in self.fleet.events.iter_mut() {
            let scheduled = m.all_scheduled();
            let Some(approval) = m.approval.as_mut().filter(|a| !a.dry_run && !a.abandoned) else {
                continue;
            };
            if !scheduled {
                continue;
            }
            if matches!(self.publishing.get(key), Some((true, _))) {
                continue;
            }
            let Some(last) = approval.sent.last() else {
                continue;
            };
            let since_attempt = self.publishing.get(key).map(|(_, at)| at.elapsed());
            let renew = match (&approval.outcome, last.published_at) {
                (Some(o), _) if o.outcome == "accepted" => continue,
                (Some(o), _)
                    if o.outcome == "rejected" && DONE_REASONS.contains(&o.reason.as_str()) =>
                {
                    continue;
                }
                (Some(o), _)
                    if o.outcome == "rejected" && !RETRY_REASONS.contains(&o.reason.as_str()) =>
                {
                    approval.abandoned = true;
                    metrics::counter!("sched_relay_coordinator_approvals_abandoned_total")
                        .increment(1);
                    tracing::error!(event_id = %m.event_id, reason = %o.reason, "The agent refuses this coordinator's approvals (check the keys, the VM names and the clocks); given up");
                    changes.events.push((key.clone(), Some(m.clone())));
                    continue;
                }
                (Some(o), _)
                    if now - o.at
                        < chrono::Duration::from_std(PUBLISH_RETRY).unwrap_or_default() =>
                {
                    continue;
                }
                (Some(_), _) => true,
                (None, None) if since_attempt.is_none_or(|t| t >= PUBLISH_RETRY) => {
                    now - last.signed_at > REUSE_REQUEST_FOR
                }
                (None, None) => continue,
                (None, Some(at)) if now - at > timeout => now - last.signed_at > REUSE_REQUEST_FOR,
                (None, Some(_)) => continue,
            };
            if renew {
                if approval.sent.len() as u32 >= self.config.coordinator.max_attempts {
                    approval.abandoned = true;
                    metrics::counter!("sched_relay_coordinator_approvals_abandoned_total")
                        .increment(1);
                    tracing::error!(event_id = %m.event_id, attempts = approval.sent.len(), "No approval accepted after max_attempts; given up, NotBefore decides");
                    changes.events.push((key.clone(), Some(m.clone())));
                    continue;
                }
                approval.sent.push(new_request());
                approval.outcome = None;
                changes.events.push((key.clone(), Some(m.clone())));
            }
            republish.push(key.clone());
        }
        if !changes.is_empty() {
            if let Err(error) = self.store.write(&changes) {
                tracing::error!(error = %error, "Cannot store the fleet's state");
                self.reload();
                return;
            }
            self.dirty = true;
        }
        for key in republish {
            self.publish(&key);
        }
        self.decide(now);
        if self.dirty {
            self.publish_snapshot(now);
        }
    }

    /// Refreshes `/fleet` and the budget gauges.
    pub(super) fn publish_snapshot(&mut self, now: DateTime<Utc>) {
        self.dirty = false;
        let usage = policy::usage(&self.fleet, &self.policy);
        for u in &usage {
            metrics::gauge!("sched_relay_coordinator_budget_in_use", "group" => u.group.clone())
                .set(u.down.len() as f64);
            metrics::gauge!("sched_relay_coordinator_budget_limit", "group" => u.group.clone())
                .set(u.limit as f64);
            metrics::gauge!("sched_relay_coordinator_group_size", "group" => u.group.clone())
                .set(u.size as f64);
        }
        let snapshot = json!({
            "time": now.to_rfc3339(),
            "dryRun": self.config.coordinator.dry_run,
            "groups": usage,
            "vms": self.fleet.vms,
            "events": self.fleet.events.values().collect::<Vec<_>>(),
        });
        *self.snapshot.write().unwrap_or_else(|e| e.into_inner()) = snapshot;
    }
}
