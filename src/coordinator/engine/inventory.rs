//! The inventory's life on the tick, and what frees a place besides an agent's report: a
//! VM leaves (its Spot eviction or Terminate started and its agent went silent; or silent
//! for `forget_after` with no event holding it), a health gate passes, an operator
//! releases it. Places held past `max_hold` are alerted on, never freed.

use std::time::Instant;

use chrono::{DateTime, Utc};

use super::{Done, Engine};
use crate::coordinator::drain::{self, Job};
use crate::coordinator::fleet::{Pause, Stage};
use crate::coordinator::policy::{self, Cause};
use crate::coordinator::store::Changes;

/// What an operator asks of the running coordinator (`POST /pause`, `/resume`, `/release`).
#[derive(Debug)]
pub enum Admin {
    Pause {
        reason: String,
    },
    Resume,
    /// Frees every place `vm` holds (or only for `event`), and takes it out of the
    /// inventory if its agent is silent.
    Release {
        vm: String,
        event: Option<String>,
    },
}

/// Event types after which a VM does not come back (it is deallocated or deleted).
fn leaves(event_type: &str) -> bool {
    event_type.eq_ignore_ascii_case("preempt") || event_type.eq_ignore_ascii_case("terminate")
}

impl Engine {
    /// VMs that left: a silent agent whose Spot eviction or Terminate started (it will not
    /// come back), or silent for `forget_after` with no event holding its VM (a scale-in
    /// without notice).
    pub(super) fn inventory(
        &mut self,
        now: DateTime<Utc>,
        forget: chrono::Duration,
        changes: &mut Changes,
    ) {
        let silent_after = self.policy.silent_after;
        let down = policy::down_now(&self.fleet, &self.policy, now);
        let mut left = Vec::new();
        for (name, vm) in self.fleet.vms() {
            let heard = vm.heartbeat.as_ref().map_or(vm.last_seen, |h| h.at);
            // An agent without heartbeats (an earlier version) is silent for this purpose when
            // it has said nothing for as long as a heartbeating one may miss at the default
            // interval.
            let gone_quiet = vm.silent(now, silent_after)
                || (vm.heartbeat.is_none()
                    && now - vm.last_seen
                        > chrono::Duration::seconds(300 * i64::from(silent_after)));
            let evicted = gone_quiet
                && self.fleet.events.values().any(|m| {
                    leaves(&m.event_type)
                        && m.lists(name)
                        && !m.back.contains_key(name)
                        && (m.started_at.is_some()
                            || m.reports.values().any(|r| r.stage == Stage::Completed)
                            || m.not_before.is_some_and(|at| at <= now))
                });
            let held = down.causes.get(name).is_some_and(|causes| {
                causes
                    .iter()
                    .any(|c| matches!(c, Cause::Held(_) | Cause::Starting(_)))
            });
            if evicted {
                left.push((
                    name.clone(),
                    "its Spot eviction or Terminate started and its agent went silent",
                ));
            } else if now - heard > forget && !held {
                left.push((name.clone(), "its agent has been silent for forget_after"));
            }
        }
        for (name, why) in left {
            tracing::info!(vm = %name, reason = why, "Left the inventory: its places are free");
            metrics::counter!("sched_relay_coordinator_vms_left_total").increment(1);
            for key in self.fleet.leave(&name, now) {
                changes
                    .events
                    .push((key.clone(), self.fleet.events.get(&key).cloned()));
            }
            changes.vms_removed.push(name);
        }
    }

    /// Places held past `max_hold` without evidence that the VM is back: an alert, once
    /// per event (logged, counted, shown in `/fleet`), and nothing freed.
    pub(super) fn overdue(&mut self, now: DateTime<Utc>, changes: &mut Changes) {
        let down = policy::down_now(&self.fleet, &self.policy, now);
        let overdue: std::collections::BTreeSet<&String> = down.overdue.iter().flatten().collect();
        let mut alerted = Vec::new();
        for (key, m) in &self.fleet.events {
            if m.overdue {
                continue;
            }
            let mut vms: Vec<&String> = down
                .causes
                .iter()
                .filter(|(vm, causes)| {
                    overdue.contains(vm) && causes.contains(&Cause::Held(key.clone()))
                })
                .map(|(vm, _)| vm)
                .collect();
            // By name, as before: the count's causes come in no order.
            vms.sort();
            if !vms.is_empty() {
                tracing::error!(event_id = %m.event_id, event_type = %m.event_type, vms = ?vms, max_hold = ?self.config.coordinator.max_hold, "Held past max_hold with no evidence that its VMs are back; their places stay taken: look at them, and release them by hand (sched-relay coordinate release) if they are fine or gone");
                metrics::counter!("sched_relay_coordinator_holds_overdue_total").increment(1);
                alerted.push(key.clone());
            }
        }
        for key in alerted {
            let m = self.fleet.events.get_mut(&key).expect("listed above");
            m.overdue = true;
            changes.events.push((key, Some(m.clone())));
        }
    }

    /// Runs the health gate of every VM an event is over for whose group has one and whose
    /// gate has not passed (again after a failure, every `interval`).
    pub(super) fn gates(&mut self, now: DateTime<Utc>) {
        if self.config.coordinator.dry_run {
            // Nothing is run in a dry run: a gate counts as passed, or no place would free.
            let mut changes = Changes::default();
            for (key, m) in self.fleet.events.iter_mut() {
                let mut changed = false;
                for back in m.back.values_mut().filter(|b| b.healthy_at.is_none()) {
                    back.healthy_at = Some(now);
                    back.gate = Some("dry run: not run, counted as passed".into());
                    changed = true;
                }
                if changed {
                    changes.events.push((key.clone(), Some(m.clone())));
                }
            }
            if !changes.is_empty() && self.store.write(&changes).is_err() {
                self.reload();
            }
            return;
        }
        let mut due = Vec::new();
        for (key, m) in &self.fleet.events {
            for (vm, back) in &m.back {
                if back.healthy_at.is_some() {
                    continue;
                }
                let g = self.policy.group_of(&self.fleet, vm);
                let Some(gate) = self.config.health(g) else {
                    continue;
                };
                let waited = match self.gating.get(&(key.clone(), vm.clone())) {
                    Some((true, _)) => false,
                    Some((false, at)) => at.elapsed() >= gate.interval,
                    None => true,
                };
                if waited {
                    due.push((
                        key.clone(),
                        vm.clone(),
                        gate.clone(),
                        m.event_id.clone(),
                        m.event_type.clone(),
                    ));
                }
            }
        }
        for (key, vm, gate, event_id, event_type) in due {
            self.gating
                .insert((key.clone(), vm.clone()), (true, Instant::now()));
            let job = Job {
                vm: vm.clone(),
                event_id,
                event_type,
                not_before: None,
                deadline: now
                    + chrono::Duration::from_std(gate.timeout)
                        .unwrap_or(chrono::Duration::seconds(30)),
            };
            let (http, done) = (self.http.clone(), self.done.clone());
            tokio::spawn(async move {
                let result = drain::check(&gate, &http, &job).await;
                let _ = done.send(Done::Gated { key, vm, result });
            });
        }
    }

    /// Applies an operator's command at `now`, stores it, and says what it did.
    pub fn admin(&mut self, command: Admin, now: DateTime<Utc>) -> Result<String, String> {
        if !self.may_act() {
            return Err("this coordinator's lease is not fresh; ask the active one".into());
        }
        let mut changes = Changes::default();
        let said = match command {
            Admin::Pause { reason } => {
                let reason = if reason.trim().is_empty() {
                    "no reason given".to_owned()
                } else {
                    reason.chars().take(500).collect()
                };
                tracing::warn!(reason = %reason, "Paused by an operator: nothing is drained or approved until resumed");
                self.fleet.paused = Some(Pause { at: now, reason });
                changes.paused = Some(self.fleet.paused.clone());
                "paused: nothing is drained or approved until resumed".to_owned()
            }
            Admin::Resume => {
                tracing::warn!("Resumed by an operator");
                self.fleet.paused = None;
                changes.paused = Some(None);
                "resumed".to_owned()
            }
            Admin::Release { vm, event } => {
                let key = event.as_deref().map(crate::coordinator::fleet::key_of);
                let known = self.fleet.vms().contains_key(&vm)
                    || self.fleet.events.values().any(|m| m.lists(&vm));
                if !known {
                    return Err(format!("no VM named {vm:?} is known"));
                }
                let released = self.fleet.release(&vm, key.as_deref(), "operator", now);
                // A VM moved to another resource group, or recreated: its next report says
                // which resource it is.
                if event.is_none()
                    && let Some(known) = self.fleet.forget_resource_id(&vm)
                {
                    changes.vms.push((vm.clone(), known.clone()));
                }
                self.fleet.conflicts.remove(&vm);
                for k in &released {
                    changes
                        .events
                        .push((k.clone(), self.fleet.events.get(k).cloned()));
                }
                let silent = self
                    .fleet
                    .vms()
                    .get(&vm)
                    .is_some_and(|v| v.silent(now, self.policy.silent_after));
                if silent && event.is_none() {
                    self.fleet.remove_vm(&vm);
                    changes.vms_removed.push(vm.clone());
                }
                tracing::warn!(vm = %vm, events = ?released, removed = silent && event.is_none(), "Released by an operator");
                format!(
                    "released {vm} from {} event(s){}",
                    released.len(),
                    if silent && event.is_none() {
                        "; its agent is silent, so it left the inventory (it comes back with its next heartbeat)"
                    } else {
                        ""
                    }
                )
            }
        };
        if let Err(error) = self.store.write(&changes) {
            self.reload();
            return Err(format!("cannot store it: {error}"));
        }
        self.dirty = true;
        self.publish_snapshot(now);
        if self.ready {
            self.decide(now);
        }
        Ok(said)
    }
}
