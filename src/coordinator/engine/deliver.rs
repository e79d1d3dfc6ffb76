//! Delivered messages: each is read and applied in turn; what a group of them changed is
//! committed once, and only then is each answered (so acknowledged to the broker) and the
//! decision they allow made. Messages that arrive while the last group is handled wait in
//! the input's channel and make up the next group: under a wave, one fsync (or one round of
//! KV writes) serves many messages instead of each waiting for its own behind the others.

use std::time::Instant;

use chrono::{DateTime, Utc};
use sched_relay_transport::inbound::{Answer, Delivery, Reply};
use serde_json::Value;
use tokio::sync::oneshot;

use super::Engine;
use crate::coordinator::fleet::{self, Applied};
use crate::coordinator::store::Changes;

/// The most messages one commit takes: a group's answers (and its messages' acknowledgements)
/// wait for all of them to be applied.
pub const GROUP_MAX: usize = 64;

/// A message applied and waiting for its group's commit.
struct Applying {
    handled: oneshot::Sender<Answer>,
    /// A VM first heard of in it.
    new_vm: Option<String>,
    /// The event whose approval outcome it brought.
    outcome: Option<String>,
    /// Whether it may allow a decision (not a routine heartbeat, the input caught up).
    decides: bool,
}

impl Engine {
    /// Handles one delivered message: read, apply, commit, answer, decide.
    pub fn deliver(&mut self, delivery: Delivery) {
        self.deliver_at(delivery, Utc::now());
    }

    /// [`Engine::deliver`] at `now` (tests drive a day in a second with it).
    pub fn deliver_at(&mut self, delivery: Delivery, now: DateTime<Utc>) {
        self.deliver_group_with(vec![delivery], now, false);
    }

    /// Messages delivered together (at most [`GROUP_MAX`], in their order), paced as
    /// [`Engine::deliver_paced`]: each applied, all committed at once, then each answered.
    pub fn deliver_group_paced(&mut self, deliveries: Vec<Delivery>) {
        self.deliver_group_with(deliveries, Utc::now(), true);
    }

    /// [`Engine::deliver_group_paced`] at `now`, paced or not (tests).
    pub(crate) fn deliver_group_with(
        &mut self,
        deliveries: Vec<Delivery>,
        now: DateTime<Utc>,
        paced: bool,
    ) {
        if !self.may_act() {
            // A standby may be active: leave the messages to it (JetStream offers them again).
            for delivery in deliveries {
                let _ = delivery.handled.send(Answer::NotHandled(
                    "this coordinator's lease is not fresh".into(),
                ));
            }
            return;
        }
        let arrived = Instant::now();
        let mut changes = Changes::default();
        let applied: Vec<Applying> = deliveries
            .into_iter()
            .filter_map(|delivery| self.apply_one(delivery, now, &mut changes))
            .collect();
        if applied.is_empty() {
            return;
        }
        changes.keep_last();
        if let Err(error) = self.store.write(&changes) {
            // Not acknowledged: the broker offers them again, and the fleet is what is stored.
            tracing::error!(error = %error, messages = applied.len(), "Cannot store the fleet's state; the messages will be offered again");
            self.reload();
            for message in applied {
                let _ = message.handled.send(Answer::NotHandled(error.clone()));
            }
            return;
        }
        let mut decides = false;
        for message in applied {
            let _ = message.handled.send(reply("accepted"));
            if let Some(vm) = message
                .new_vm
                .filter(|vm| self.fleet.vms().contains_key(vm))
            {
                self.azure_new_agent(&vm);
            }
            if let Some(event_key) = &message.outcome {
                self.outcome(event_key);
            }
            decides |= message.decides;
        }
        self.dirty = true;
        if decides {
            self.owe(arrived, now, paced);
        }
    }

    /// Reads and applies one message, adding what it changed to `changes`; answers it at
    /// once when there is nothing to store (skipped), else leaves it for the commit.
    fn apply_one(
        &mut self,
        delivery: Delivery,
        now: DateTime<Utc>,
        changes: &mut Changes,
    ) -> Option<Applying> {
        let Some(event) = crate::watch::decode(&delivery.message) else {
            input("invalid");
            tracing::warn!(channel = %delivery.message.channel, "Not a CloudEvent (binary or structured JSON); skipped");
            let _ = delivery.handled.send(reply("skipped"));
            return None;
        };
        // While a backlog is replayed, a message counts as of its own `time` (never later
        // than now): an hour-old report must not look an hour younger.
        let now = if self.ready {
            now
        } else {
            event["time"]
                .as_str()
                .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
                .map_or(now, |t| t.with_timezone(&Utc).min(now))
        };
        let incoming = match fleet::read_at(&event, now, self.ready) {
            Ok(incoming) => incoming,
            Err(why) => {
                input("invalid");
                tracing::warn!(channel = %delivery.message.channel, id = %printable(&event["id"]), error = %why, "An event that fails the contract; skipped");
                let _ = delivery.handled.send(reply("skipped"));
                return None;
            }
        };
        // The channel must name the VM the message speaks for: with per-VM publish rights,
        // no agent can then report for another.
        if let (Some(template), Some(claimed)) = (&self.channel_template, incoming.vm()) {
            let actual = delivery
                .message
                .route
                .as_deref()
                .unwrap_or(&delivery.message.channel);
            let expected = serde_json::from_value::<sched_relay_core::Event>(event.clone())
                .map(|e| sched_relay_core::binding::expand_template(template, &e));
            if expected.as_deref().ok() != Some(actual) {
                input("conflict");
                let why = format!(
                    "came on {actual:?}, but a message of VM {claimed:?} comes on {:?}",
                    expected.unwrap_or_default()
                );
                // An ERROR: either a publisher speaks for another VM, or every agent's
                // messages are refused because `[input] agent_subject` (or
                // `agent_routing_key`) is not the template the agents publish with.
                tracing::error!(vm = %claimed, id = %printable(&event["id"]), conflict = %why, "A message whose subject or routing key does not name its VM; not applied (if every agent's are refused, set [input] agent_subject or agent_routing_key to the template they publish with)");
                self.fleet.note_conflict(claimed, &why);
                self.dirty = true;
                let _ = delivery.handled.send(reply("skipped"));
                return None;
            }
        }
        let key = incoming.key();
        let vm = match &incoming {
            fleet::Incoming::Transition { vm, .. }
            | fleet::Incoming::Outcome { vm, .. }
            | fleet::Incoming::Heartbeat { vm, .. }
            | fleet::Incoming::Document { vm, .. } => Some(vm.clone()),
            fleet::Incoming::Ignored(_) => None,
        };
        // A heartbeat of a VM already known alive changes no decision (unless it shows an
        // event over): deciding after each would cost a whole decision per VM per interval.
        let routine_beat = matches!(&incoming, fleet::Incoming::Heartbeat { vm, .. }
            if self.fleet.vms().get(vm).is_some_and(|v| v.heartbeat.is_some() && !v.silent(now, self.policy.silent_after)));
        let new_vm = vm.clone().filter(|vm| !self.fleet.vms().contains_key(vm));
        let applied = self.fleet.apply(incoming, now);
        let routine_beat =
            routine_beat && matches!(&applied, Applied::Heartbeat(back) if back.is_empty());
        let mut mine = Changes::default();
        match &applied {
            Applied::Changed(event_key) | Applied::Outcome(event_key) => {
                mine.events
                    .push((event_key.clone(), self.fleet.events.get(event_key).cloned()));
            }
            Applied::ApprovedElsewhere(keys) | Applied::Heartbeat(keys) => {
                for event_key in keys {
                    mine.events
                        .push((event_key.clone(), self.fleet.events.get(event_key).cloned()));
                }
            }
            Applied::Foreign => {
                tracing::info!(vm = ?vm, id = ?key, "An approval outcome for a request this coordinator did not send (an agent's local policy, or another orchestrator)");
            }
            Applied::Conflict(why) => {
                tracing::warn!(vm = ?vm, id = ?key, conflict = %why, "A message that contradicts what is known; not applied");
            }
            Applied::DryRun(ours) => {
                tracing::info!(vm = ?vm, id = ?key, "An agent in dry run answered accepted but POSTed nothing: nothing is approved");
                if let Some(event_key) = ours {
                    mine.events
                        .push((event_key.clone(), self.fleet.events.get(event_key).cloned()));
                }
            }
            _ => {}
        }
        input(match &applied {
            Applied::Changed(_) => "applied",
            Applied::Outcome(_) => "outcome",
            Applied::Duplicate => "duplicate",
            Applied::Stale => "stale",
            Applied::Foreign => "foreign",
            Applied::ApprovedElsewhere(_) => "approved_elsewhere",
            Applied::Conflict(_) => "conflict",
            Applied::Agent => "document",
            Applied::Heartbeat(_) => "heartbeat",
            Applied::DryRun(_) => "dry_run",
            Applied::Ignored(_) => "ignored",
        });
        if let Applied::Heartbeat(back) = &applied {
            for event_key in back {
                tracing::info!(event_id = %event_key, vm = ?vm, "Back: its agent started again since the event appeared and its document no longer lists it");
            }
        }
        if let Some(vm) = vm
            .as_ref()
            .and_then(|vm| Some((vm, self.fleet.vms().get(vm)?)))
        {
            mine.vms.push((vm.0.clone(), vm.1.clone()));
        }
        if let Applied::ApprovedElsewhere(event_keys) = &applied {
            tracing::info!(event_ids = ?event_keys, vm = ?vm, "Approved by someone else (the agent's local policy, or another orchestrator): its VMs count as down");
        }
        if let (Some(key), false) = (&key, applied == Applied::Duplicate) {
            mine.seen.push((key.clone(), now));
        }
        if mine.is_empty() {
            let _ = delivery.handled.send(reply("skipped"));
            return None;
        }
        changes.extend(mine);
        Some(Applying {
            handled: delivery.handled,
            new_vm,
            outcome: match &applied {
                Applied::Outcome(event_key) => Some(event_key.clone()),
                _ => None,
            },
            decides: self.ready && !routine_beat,
        })
    }
}

fn reply(outcome: &'static str) -> Answer {
    Answer::Handled(Reply {
        outcome,
        body: Value::Null,
    })
}

fn input(result: &'static str) {
    metrics::counter!("sched_relay_coordinator_input_total", "result" => result).increment(1);
}

fn printable(value: &Value) -> String {
    crate::watch::printable(&value.to_string()).into_owned()
}
