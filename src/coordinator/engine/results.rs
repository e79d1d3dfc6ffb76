//! Results of the work the loop started: a drain finished (the decision then looks at the
//! budget again before it approves: the world moved during the drain), a health gate
//! ran, or an approval was published.

use std::time::Instant;

use chrono::Utc;

use super::{DONE_REASONS, Done, Engine, PUBLISH_RETRY};
use crate::coordinator::azure::Acked;
use crate::coordinator::fleet::Via;
use crate::coordinator::store::Changes;

impl Engine {
    /// A drain, a health gate or a publication finished: decided at once (tests drive the
    /// engine so; the coordinator's loop calls [`Engine::finished_paced`]).
    #[cfg(test)]
    pub fn finished(&mut self, done: Done) {
        self.finished_with(done, false);
    }

    /// [`Engine::finished`], deciding at most once per gap ([`Engine::gap`]), as the
    /// coordinator's loop does: a wave ends hundreds of drains and publications a second.
    pub fn finished_paced(&mut self, done: Done) {
        self.finished_with(done, true);
    }

    fn finished_with(&mut self, done: Done, paced: bool) {
        // A standby may be active: what a stalled instance's work came to is not written
        // (the active one runs its drains again and republishes what it does not know sent).
        // Nor is it lost if the lease comes back fresh (a slow renewal): the work is marked
        // as no longer running, so the tick starts it again from what is stored.
        let not_run = matches!(&done, Done::Drained { result: Err(why), .. } | Done::Published { result: Err(why), .. } | Done::Acknowledged { result: Acked::Failed(why), .. } if why == super::NOT_RUN);
        if !self.may_act() || not_run {
            match done {
                Done::Drained { key, vm, .. } => {
                    self.draining.remove(&(key, vm));
                }
                Done::Published { key, .. } | Done::Acknowledged { key, .. } => {
                    self.publishing.remove(&key);
                }
                Done::Gated { key, vm, .. } => {
                    self.gating.remove(&(key, vm));
                }
            }
            return;
        }
        let now = Utc::now();
        // A publication frees no place and ends no drain: it allows no new decision.
        let allows_a_decision = !matches!(done, Done::Published { .. } | Done::Acknowledged { .. });
        let mut refused = false;
        let key = match done {
            Done::Gated { key, vm, result } => {
                self.gating
                    .insert((key.clone(), vm.clone()), (false, Instant::now()));
                let Some(back) = self
                    .fleet
                    .events
                    .get_mut(&key)
                    .and_then(|m| m.back.get_mut(&vm))
                else {
                    return;
                };
                match result {
                    Ok(()) => {
                        tracing::info!(event_id = %key, vm = %vm, "Health gate passed: the VM's place is free");
                        back.healthy_at = Some(now);
                        back.gate = None;
                        self.gating.remove(&(key.clone(), vm));
                    }
                    Err(why) => {
                        metrics::counter!("sched_relay_coordinator_health_gate_failures_total")
                            .increment(1);
                        if back.gate.as_ref() == Some(&why) {
                            return;
                        }
                        tracing::warn!(event_id = %key, vm = %vm, error = %why, "Health gate not passed; the VM stays counted as down and is checked again");
                        back.gate = Some(why);
                    }
                }
                key
            }
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
            Done::Acknowledged {
                key,
                request_id,
                result,
            } => {
                self.publishing.insert(key.clone(), (false, Instant::now()));
                refused = matches!(result, Acked::Refused { .. });
                if !self.acknowledged(&key, &request_id, result, now) {
                    return;
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
                }
                key
            }
        };
        let mut changes = Changes::default();
        changes
            .events
            .push((key.clone(), self.fleet.events.get(&key).cloned()));
        if let Err(error) = self.store.write(&changes) {
            tracing::error!(error = %error, "Cannot store a drain, gate or approval result");
            self.reload();
            return;
        }
        self.dirty = true;
        if refused {
            self.outcome(&key);
        }
        // A drain that ended is approved by the decision, which checks the budget again; a
        // gate passed frees a place.
        if self.ready && allows_a_decision {
            self.owe(std::time::Instant::now(), now, paced);
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
        // The way of the request answered (an agent may answer after a fallback to ARM).
        let via = m
            .approval
            .as_ref()
            .and_then(|a| a.sent.iter().find(|s| s.request_id == outcome.request_id))
            .map(|s| s.via)
            .unwrap_or_default();
        match outcome.outcome.as_str() {
            "accepted" if via == Via::Arm => {
                tracing::info!(event_id = %m.event_id, request_id = %outcome.request_id, "Approval through Azure Resource Manager accepted: the event started")
            }
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
