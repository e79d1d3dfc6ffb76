//! Acting on the decision: drains recorded and started, approvals recorded, signed and
//! handed to the broker, each stored before it starts (see `policy` for what is decided).

use chrono::{DateTime, Utc};

use super::{Engine, new_request};
use crate::coordinator::config::CoordinatorConfig;
use crate::coordinator::fleet::{Approval, Drain, Via};
use crate::coordinator::policy::{self, Step};
use crate::coordinator::store::Changes;

impl Engine {
    /// Decides and starts what the budget allows.
    pub fn decide(&mut self, now: DateTime<Utc>) {
        // Whatever calls it decides what messages are owed too: timed from the earliest.
        // Taken even when this instance may not act, or the loop would wake for it at once
        // again and again (the tick decides once it may).
        let owed = self.owed.take();
        if !self.may_act() || self.azure_missing(now) {
            return;
        }
        // Every decision (the tick's and the operator's too) starts the gap before the next
        // one on arrivals, and sets its length ([`Engine::gap`]).
        let started = std::time::Instant::now();
        self.decided_at = Some(started);
        let decisions = policy::decide(&self.fleet, &self.policy, now);
        self.decision_cost = started.elapsed();
        // A wait the last decision made too, whose words the event still shows, is not put
        // into words again; the waits of this decision replace the last one's.
        let mut last = std::mem::take(&mut self.verdicts);
        for (key, wait) in decisions.waits {
            let Some(m) = self.fleet.events.get_mut(&key) else {
                continue;
            };
            if let Some((was, text)) = last.remove(&key)
                && was == wait
                && m.verdict == text
            {
                self.verdicts.insert(key, (wait, text));
                continue;
            }
            let text = wait.to_string();
            if m.verdict != text {
                metrics::counter!("sched_relay_coordinator_decisions_total", "decision" => wait.label()).increment(1);
                tracing::info!(event_id = %m.event_id, event_type = %m.event_type, verdict = %text, "Decision");
                m.verdict = text.clone();
                self.dirty = true;
            }
            self.verdicts.insert(key, (wait, text));
        }
        if decisions.steps.is_empty() {
            return;
        }
        let mut changes = Changes::default();
        let mut drains = Vec::new();
        let mut approvals = Vec::new();
        let decided = decisions.steps.len();
        for step in decisions.steps {
            match step {
                Step::Drain { key, vms } if !self.config.coordinator.dry_run => {
                    let m = self
                        .fleet
                        .events
                        .get_mut(&key)
                        .expect("decided from the fleet");
                    let deadline = drain_deadline(&self.config, m.not_before, now);
                    let running = vms.iter().map(|vm| (vm.clone(), "running".to_owned()));
                    match &mut m.drain {
                        // VMs the event has come to list since its drain started: drained
                        // too, and the drain is over again only when they are.
                        Some(drain) => {
                            drain.vms.extend(running);
                            drain.deadline = deadline;
                            drain.finished_at = None;
                        }
                        None => {
                            m.drain = Some(Drain {
                                started_at: now,
                                deadline,
                                vms: running.collect(),
                                finished_at: None,
                                deadline_missed: false,
                            })
                        }
                    }
                    m.verdict = format!(
                        "draining {} VM(s) until {}",
                        vms.len(),
                        deadline.to_rfc3339()
                    );
                    metrics::counter!("sched_relay_coordinator_decisions_total", "decision" => "drain").increment(1);
                    tracing::info!(event_id = %m.event_id, event_type = %m.event_type, vms = ?vms, deadline = %deadline, "Draining before approval");
                    changes.events.push((key.clone(), Some(m.clone())));
                    drains.extend(vms.into_iter().map(|vm| (key.clone(), vm)));
                }
                Step::Drain { key, .. } => {
                    let m = &self.fleet.events[&key];
                    let approver = policy::approver(&self.fleet, &self.policy, m, false, now)
                        .expect("checked by decide");
                    approvals.push(self.approve(
                        &key,
                        approver.vm,
                        approver.via,
                        now,
                        &mut changes,
                    ));
                }
                Step::Approve { key, approver, via } => {
                    approvals.push(self.approve(&key, approver, via, now, &mut changes));
                }
            }
        }
        if let Err(error) = self.store.write(&changes) {
            tracing::error!(error = %error, "Cannot store decisions; nothing is started, they are decided again");
            self.reload();
            return;
        }
        self.dirty = true;
        for (key, vm) in drains {
            self.start_drain(&key, &vm, now);
        }
        for key in approvals.into_iter().flatten() {
            self.publish(&key);
        }
        if let Some(trigger) = owed {
            // From the message that allowed them (an event, or another's end) to the
            // drains started and the approvals signed and handed to the broker client.
            let took = trigger.elapsed().as_secs_f64();
            for _ in 0..decided {
                metrics::histogram!("sched_relay_coordinator_decision_seconds").record(took);
            }
        }
    }

    /// Records an approval (signed, not yet published) and returns the key to publish.
    pub(super) fn approve(
        &mut self,
        key: &str,
        approver: String,
        via: Via,
        now: DateTime<Utc>,
        changes: &mut Changes,
    ) -> Option<String> {
        let dry_run = self.config.coordinator.dry_run;
        let m = self
            .fleet
            .events
            .get_mut(key)
            .expect("decided from the fleet");
        if m.not_before.is_some_and(|at| at <= now) {
            metrics::counter!("sched_relay_coordinator_approvals_after_not_before_total")
                .increment(1);
        }
        let sent = (!dry_run).then(|| new_request(via));
        m.approval = Some(Approval {
            approver: approver.clone(),
            via,
            decided_at: now,
            dry_run,
            sent: sent.into_iter().collect(),
            outcome: None,
            abandoned: false,
            dry_run_answers: 0,
        });
        let through = match via {
            Via::Agent => approver.clone(),
            Via::Arm => format!("Azure Resource Manager at {approver}"),
        };
        m.verdict = if dry_run {
            format!("dry run: would approve through {through}")
        } else {
            format!("approved through {through}")
        };
        metrics::counter!("sched_relay_coordinator_decisions_total", "decision" => "approve")
            .increment(1);
        tracing::info!(event_id = %m.event_id, event_type = %m.event_type, approver = %approver, via = ?via, dry_run, resources = ?m.resources, "Approving");
        changes.events.push((key.to_owned(), Some(m.clone())));
        (!dry_run).then(|| key.to_owned())
    }
}

/// NotBefore minus the margin; for a short notice (a Spot eviction's 30 s) at least half of
/// the time left; never later than NotBefore minus two seconds.
fn drain_deadline(
    config: &CoordinatorConfig,
    not_before: Option<DateTime<Utc>>,
    now: DateTime<Utc>,
) -> DateTime<Utc> {
    let margin = config
        .drain
        .as_ref()
        .and_then(|d| chrono::Duration::from_std(d.margin).ok())
        .unwrap_or(chrono::Duration::seconds(60));
    let Some(not_before) = not_before else {
        return now + chrono::Duration::minutes(10);
    };
    let half = now + (not_before - now) / 2;
    (not_before - margin)
        .max(half)
        .min(not_before - chrono::Duration::seconds(2))
}
