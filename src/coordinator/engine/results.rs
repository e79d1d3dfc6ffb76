//! Results of the work the loop started: a drain finished (approve when every VM is
//! drained, or as `on_failure` says), or an approval was published.

use std::time::Instant;

use chrono::Utc;

use super::{DONE_REASONS, Done, Engine, PUBLISH_RETRY};
use crate::coordinator::config::OnFailure;
use crate::coordinator::policy;
use crate::coordinator::store::Changes;

impl Engine {
    /// A drain or a publication finished.
    pub fn finished(&mut self, done: Done) {
        let now = Utc::now();
        let mut approve = None;
        let key = match done {
            Done::Published {
                key,
                request_id,
                result,
            } => {
                self.publishing.insert(key.clone(), (false, Instant::now()));
                let Some(sent) = self
                    .fleet
                    .events
                    .get_mut(&key)
                    .and_then(|m| m.approval.as_mut())
                    .and_then(|a| a.sent.iter_mut().find(|s| s.request_id == request_id))
                else {
                    return;
                };
                match result {
                    Ok(()) => {
                        sent.published_at.get_or_insert(now);
                        metrics::counter!("sched_relay_coordinator_approvals_sent_total")
                            .increment(1);
                    }
                    Err(error) => {
                        metrics::counter!("sched_relay_coordinator_publish_failures_total")
                            .increment(1);
                        tracing::warn!(event_id = %key, error = %error, retry_in = ?PUBLISH_RETRY, "Cannot publish an approval; it will be tried again");
                        return;
                    }
                }
                key
            }
            Done::Drained {
                key,
                vm,
                result,
                took,
            } => {
                self.draining.remove(&(key.clone(), vm.clone()));
                let on_failure = self.config.drain.as_ref().map(|d| d.on_failure);
                let Some(m) = self.fleet.events.get_mut(&key) else {
                    return;
                };
                let event_id = m.event_id.clone();
                let Some(d) = m.drain.as_mut() else { return };
                let label = if result.is_ok() { "done" } else { "failed" };
                metrics::histogram!("sched_relay_coordinator_drain_seconds", "result" => label)
                    .record(took.as_secs_f64());
                match &result {
                    Ok(()) => {
                        tracing::info!(event_id = %event_id, vm = %vm, took = ?took, "Drained");
                        d.vms.insert(vm, "done".into());
                    }
                    Err(why) => {
                        metrics::counter!("sched_relay_coordinator_drain_failures_total")
                            .increment(1);
                        if now >= d.deadline {
                            d.deadline_missed = true;
                            metrics::counter!("sched_relay_coordinator_deadline_misses_total")
                                .increment(1);
                        }
                        tracing::warn!(event_id = %event_id, vm = %vm, error = %why, "Drain failed");
                        d.vms.insert(vm, format!("failed: {why}"));
                    }
                }
                if !d.running() {
                    d.finished_at = Some(now);
                    if d.all_done() || on_failure == Some(OnFailure::Approve) {
                        approve = Some(key.clone());
                    } else {
                        m.verdict = "drain failed; not approved, NotBefore decides".into();
                    }
                }
                key
            }
        };
        let mut changes = Changes::default();
        let mut publish = None;
        if let Some(key) = approve {
            let m = &self.fleet.events[&key];
            if !m.all_scheduled() {
                tracing::info!(event_id = %m.event_id, "Drained, but the event has started or ended: no approval");
            } else if m
                .not_before
                .is_some_and(|at| at - now < self.policy.min_lead)
            {
                self.fleet.events.get_mut(&key).expect("present").verdict =
                    "drained too late; NotBefore decides".into();
            } else if let Some(approver) = policy::approver(&self.fleet, m) {
                publish = self.approve(&key, approver, now, &mut changes);
            }
        }
        changes
            .events
            .push((key.clone(), self.fleet.events.get(&key).cloned()));
        if let Err(error) = self.store.write(&changes) {
            tracing::error!(error = %error, "Cannot store a drain or approval result");
            self.reload();
            return;
        }
        self.dirty = true;
        if let Some(key) = publish {
            self.publish(&key);
        }
    }

    /// Logs and counts an agent's answer to one of our requests.
    pub(super) fn outcome(&mut self, key: &str) {
        let Some(m) = self.fleet.events.get(key) else {
            return;
        };
        let Some(outcome) = m.approval.as_ref().and_then(|a| a.outcome.as_ref()) else {
            return;
        };
        metrics::counter!("sched_relay_coordinator_approval_outcomes_total", "outcome" => outcome.outcome.clone(), "reason" => outcome.reason.clone()).increment(1);
        match outcome.outcome.as_str() {
            "accepted" => {
                tracing::info!(event_id = %m.event_id, request_id = %outcome.request_id, "Approval accepted by the agent")
            }
            "rejected" if DONE_REASONS.contains(&outcome.reason.as_str()) => {
                tracing::info!(event_id = %m.event_id, reason = %outcome.reason, "Approval not needed any more")
            }
            _ => {
                tracing::warn!(event_id = %m.event_id, outcome = %outcome.outcome, reason = %outcome.reason, request_id = %outcome.request_id, "Approval not accepted")
            }
        }
    }
}
