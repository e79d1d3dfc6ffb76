//! The tick: approvals without an outcome are published again (the same request while it is
//! fresh), refused or unanswered ones are given up after `max_attempts` with an alert; VMs
//! that left the inventory free their places, held places past `max_hold` are alerted on,
//! health gates run, silent events are forgotten, everything is decided again and `/fleet`
//! refreshed.

use std::time::Duration;

use chrono::{DateTime, Utc};

use super::{DONE_REASONS, Engine, PUBLISH_RETRY, RETRY_REASONS, REUSE_REQUEST_FOR, new_request};
use crate::coordinator::fleet::Via;
use crate::coordinator::policy;
use crate::coordinator::store::Changes;

/// `/fleet` and the gauges are refreshed at least this often (seconds), changed or not.
const SNAPSHOT_EVERY_SECONDS: i64 = 5;
/// A refresh of `/fleet` after a change waits this many times its last cost.
const SNAPSHOT_COST_SHARE: u32 = 10;

/// Forgotten events and old ids are looked for this often (each look walks everything).
const PRUNE_EVERY: Duration = Duration::from_secs(60);

impl Engine {
    /// Retries, gives up, forgets, decides again, refreshes `/fleet`.
    pub fn tick(&mut self, now: DateTime<Utc>) {
        // Without a fresh lease, this instance writes nothing: a standby may be active.
        if !self.may_act() {
            return;
        }
        let forget = chrono::Duration::from_std(self.config.coordinator.forget_after)
            .unwrap_or(chrono::Duration::days(1));
        let mut changes = Changes::default();
        // Silence is judged only once the input has caught up: a replayed stream still
        // holds heartbeats that would show a VM alive.
        if self.ready {
            self.inventory(now, forget, &mut changes);
        }
        if self.pruned.is_none_or(|at| {
            now - at >= chrono::Duration::from_std(PRUNE_EVERY).unwrap_or_default()
        }) {
            self.pruned = Some(now);
            // An event that still holds a VM's place stays until the VM is back or released,
            // and so does one a heartbeat still lists (its agent has not reported it again
            // because nothing changed).
            let mut holding: std::collections::BTreeSet<String> =
                policy::down_now(&self.fleet, &self.policy, now)
                    .causes
                    .values()
                    .flatten()
                    .filter_map(|cause| cause.event().map(str::to_owned))
                    .collect();
            holding.extend(
                self.fleet
                    .vms()
                    .values()
                    .filter_map(|vm| vm.heartbeat.as_ref())
                    .flat_map(|h| h.events.iter().cloned()),
            );
            let (gone, unseen) = self.fleet.prune(now, forget, &holding);
            changes.unseen = unseen;
            for key in gone {
                tracing::info!(event_id = %key, "Forgotten: no agent has reported on it for forget_after");
                self.publishing.remove(&key);
                if let Some(view) = self.azure.as_mut() {
                    view.up_at_ack.remove(&key);
                }
                changes.events.push((key, None));
            }
        }
        if self.ready {
            self.overdue(now, &mut changes);
            self.gates(now);
        }
        let took_effect = self.arm_evidence(&mut changes, now);
        let mut republish = Vec::new();
        let timeout = chrono::Duration::from_std(self.config.coordinator.outcome_timeout)
            .unwrap_or(chrono::Duration::seconds(20));
        // First what each approval needs, then the changes (a renewal picks its approver
        // again from the whole fleet).
        enum Next {
            Republish,
            Renew,
            /// No agent answered within `outcome_timeout`: through ARM (`agent_then_arm`).
            Fallback,
            Abandon(String),
        }
        let mut next = Vec::new();
        // Paused: nothing new goes out, renewals included.
        let live = !self.config.coordinator.dry_run && self.fleet.paused.is_none();
        for (key, m) in self.fleet.events.iter().filter(|_| live) {
            let Some(approval) = m.approval.as_ref().filter(|a| !a.dry_run && !a.abandoned) else {
                continue;
            };
            // Started or over: nothing left to approve. Near NotBefore: Azure starts it.
            if !m.all_scheduled()
                || m.not_before
                    .is_some_and(|at| at - now < self.policy.min_lead)
            {
                continue;
            }
            let (in_flight, since_attempt) = match self.publishing.get(key) {
                Some((in_flight, at)) => (*in_flight, Some(at.elapsed())),
                None => (false, None),
            };
            let Some(last) = approval.sent.last().filter(|_| !in_flight) else {
                continue;
            };
            let quiet_for = |d: Duration| since_attempt.is_none_or(|t| t >= d);
            let arm = approval.via == Via::Arm;
            let step = match (&approval.outcome, last.published_at) {
                (Some(o), _) if o.outcome == "accepted" => continue,
                (Some(o), _) if DONE_REASONS.contains(&o.reason.as_str()) => continue,
                (Some(o), _)
                    if o.outcome == "rejected"
                        && !RETRY_REASONS.contains(&o.reason.as_str())
                        && arm =>
                {
                    Next::Abandon(format!(
                        "Azure Resource Manager refuses it: {} (check the role of the coordinator's identity, and [azure] maintenance_api_version)",
                        o.reason
                    ))
                }
                (Some(o), _)
                    if o.outcome == "rejected" && !RETRY_REASONS.contains(&o.reason.as_str()) =>
                {
                    Next::Abandon(format!(
                        "the agent refuses it: {} (check the keys, the VM names and the clocks)",
                        o.reason
                    ))
                }
                (Some(o), _)
                    if now - o.at
                        < chrono::Duration::from_std(PUBLISH_RETRY).unwrap_or_default() =>
                {
                    continue;
                }
                (Some(_), _) => Next::Renew,
                // Not confirmed by the broker (a failure, or a restart): the same request
                // while fresh.
                (None, None) if quiet_for(PUBLISH_RETRY) => {
                    if now - last.signed_at > REUSE_REQUEST_FOR {
                        Next::Renew
                    } else {
                        Next::Republish
                    }
                }
                // Delivered, no outcome: the agent answers a repeated id from its record
                // without a new outcome, so only a new request can bring one.
                (None, Some(at))
                    if now - at > timeout && quiet_for(self.config.coordinator.outcome_timeout) =>
                {
                    Next::Renew
                }
                (None, _) => continue,
            };
            // Silence, or a broker that cannot take the request, hands the approval to ARM
            // (`agent_then_arm`); an agent's answer does not (a retried refusal, a failure,
            // an agent in dry run), nor does a fallback with nowhere to acknowledge it.
            let step = match step {
                Next::Renew | Next::Republish
                    if !arm
                        && approval.outcome.is_none()
                        && approval.dry_run_answers == 0
                        && now - approval.decided_at > timeout
                        && policy::falls_back_to_arm(&self.fleet, &self.policy, m)
                        && policy::approver(&self.fleet, &self.policy, m, true, now)
                            .is_some_and(|a| a.via == Via::Arm) =>
                {
                    Next::Fallback
                }
                step => step,
            };
            // Attempts are counted per way: a fallback to ARM gets its own.
            let delivered = approval
                .sent
                .iter()
                .filter(|s| s.published_at.is_some() && s.via == approval.via)
                .count() as u32;
            let step = match step {
                Next::Renew if delivered >= self.config.coordinator.max_attempts && arm => {
                    Next::Abandon(format!(
                        "{delivered} acknowledgement(s) answered by Azure Resource Manager, and the event is not seen started (max_attempts)"
                    ))
                }
                Next::Renew if delivered >= self.config.coordinator.max_attempts => Next::Abandon(
                    format!("{delivered} request(s) delivered, none accepted (max_attempts)"),
                ),
                step => step,
            };
            next.push((key.clone(), step));
        }
        for (key, step) in next {
            let m = &self.fleet.events[&key];
            let turn_over = matches!(step, Next::Fallback)
                || m.approval.as_ref().is_some_and(|a| a.via == Via::Arm);
            let approver = policy::approver(&self.fleet, &self.policy, m, turn_over, now);
            let m = self.fleet.events.get_mut(&key).expect("listed above");
            let approval = m.approval.as_mut().expect("listed above");
            match step {
                Next::Republish => republish.push(key),
                Next::Renew | Next::Fallback => {
                    if let Some(approver) = approver {
                        if approver.via == Via::Arm && approval.via == Via::Agent {
                            tracing::warn!(event_id = %m.event_id, approver = %approver.vm, via = ?approver.via, outcome_timeout = ?self.config.coordinator.outcome_timeout, "No agent answered the approval in time; approving through Azure Resource Manager");
                        }
                        approval.approver = approver.vm;
                        approval.via = approver.via;
                    }
                    approval.sent.push(new_request(approval.via));
                    approval.outcome = None;
                    changes.events.push((key.clone(), Some(m.clone())));
                    republish.push(key);
                }
                Next::Abandon(why) => {
                    if let Some(view) = self.azure.as_mut() {
                        view.up_at_ack.remove(&key);
                    }
                    approval.abandoned = true;
                    metrics::counter!("sched_relay_coordinator_approvals_abandoned_total")
                        .increment(1);
                    tracing::error!(event_id = %m.event_id, reason = %why, "Approval given up; NotBefore decides");
                    m.verdict = format!("approval given up: {why}");
                    changes.events.push((key, Some(m.clone())));
                }
            }
        }
        if !changes.is_empty() {
            if let Err(error) = self.store.write(&changes) {
                tracing::error!(error = %error, "Cannot store the fleet's state");
                self.reload();
                return;
            }
            self.dirty = true;
        }
        for key in took_effect {
            self.outcome(&key);
        }
        for key in republish {
            self.publish(&key);
        }
        if !self.ready {
            self.catch_up();
        }
        if self.ready {
            self.restart_drains(now);
            self.decide(now);
        }
        // Silence and overdue holds come with time alone: refreshed every few seconds too.
        // After a change, once ten times the last refresh's cost has passed (a fleet of
        // 10,000 VMs is a /fleet of megabytes); every few seconds in any case.
        let affordable = self
            .snapshot_cost
            .is_none_or(|(at, took)| at.elapsed() >= took * SNAPSHOT_COST_SHARE);
        if (self.dirty && affordable)
            || self
                .snapshot_at
                .is_none_or(|at| now - at >= chrono::Duration::seconds(SNAPSHOT_EVERY_SECONDS))
        {
            self.publish_snapshot(now);
        }
    }

    /// Starts deciding once the input has delivered what it held when it started; says how
    /// far it is meanwhile.
    fn catch_up(&mut self) {
        use sched_relay_transport::inbound::CatchUp;
        let state = self
            .progress
            .as_ref()
            .map_or(CatchUp::CaughtUp, |progress| *progress.borrow());
        let left = match state {
            CatchUp::CaughtUp => 0,
            CatchUp::Behind(left) => left,
            CatchUp::Unknown => 1,
        };
        metrics::gauge!("sched_relay_coordinator_catching_up").set(left as f64);
        if state == CatchUp::CaughtUp {
            tracing::info!(
                events = self.fleet.events.len(),
                vms = self.fleet.vms().len(),
                "Input caught up; deciding"
            );
            self.ready = true;
            self.dirty = true;
            return;
        }
        if self
            .catch_up_logged
            .is_none_or(|at| at.elapsed() >= super::CATCH_UP_LOG_EVERY)
        {
            self.catch_up_logged = Some(std::time::Instant::now());
            // Nothing is decided meanwhile: Azure starts events at NotBefore. Long enough,
            // that is an operator's problem.
            let long = self.started.elapsed() >= super::CATCH_UP_ALERT_AFTER;
            match (state, long) {
                (CatchUp::Behind(left), false) => tracing::info!(
                    left,
                    "Catching up with the input: nothing is decided until what it held at the start is read"
                ),
                (CatchUp::Behind(left), true) => tracing::warn!(
                    left,
                    since = ?self.started.elapsed(),
                    "Still catching up with the input: nothing is decided meanwhile (a slow or stuck input; check the broker and sched_relay_coordinator_catching_up)"
                ),
                (_, false) => tracing::info!(
                    "Waiting for the input to connect: nothing is decided until it has caught up"
                ),
                (_, true) => tracing::warn!(
                    since = ?self.started.elapsed(),
                    "The input has not connected: nothing is decided meanwhile (check the broker)"
                ),
            }
        }
    }
}
