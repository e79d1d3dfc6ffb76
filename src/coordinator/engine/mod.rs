//! The coordinator's loop: one task owns the fleet. Each delivered message is read, applied,
//! committed and only then acknowledged; each change is decided at once (and again on every
//! tick); every drain and approval is recorded before it is started, and its result comes
//! back to this loop. Nothing here waits on a broker or a hook; the store's commits (a redb
//! fsync, a round of KV writes) block this task only, the runtime's other tasks moving to
//! other threads meanwhile (`offload`).

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use sched_relay_core::approval::{Draft, SigningKey};
use sched_relay_transport::Sink;
use sched_relay_transport::inbound::{Answer, Delivery, Reply};
use serde_json::Value;
use tokio::sync::mpsc;

use super::azure::{Acked, Acknowledge};
use super::config::CoordinatorConfig;
use super::fleet::{self, Applied, Fleet, Sent, Via};
use super::policy::Policy;
use super::store::{Changes, Store};

mod arm;
mod azure;
mod decisions;
mod inventory;
mod pace;
mod recovery;
mod results;
mod snapshot;
mod tick;
mod work;

pub use azure::AzureView;
pub use inventory::Admin;
pub use pace::{DECISION_GAP, DECISION_GAP_MAX, DECISION_SHARE};

/// Results of the work started by the loop.
pub enum Done {
    Drained {
        key: String,
        vm: String,
        result: Result<(), String>,
        took: Duration,
    },
    /// A health gate ran for `vm` after `key` was over for it.
    Gated {
        key: String,
        vm: String,
        result: Result<(), String>,
    },
    Published {
        key: String,
        request_id: String,
        result: Result<(), String>,
    },
    /// ARM answered an acknowledgement (`approve_via`).
    Acknowledged {
        key: String,
        request_id: String,
        result: Acked,
    },
}

/// A signed request is sent again as it is (same id) while it is younger than this; after
/// that a new one is signed (the agents refuse requests older than their `max_age`, 5 min).
const REUSE_REQUEST_FOR: chrono::Duration = chrono::Duration::seconds(120);
/// While catching up, how often the coordinator says how far it is.
const CATCH_UP_LOG_EVERY: Duration = Duration::from_secs(10);
/// Catching up longer than this is said at WARN.
const CATCH_UP_ALERT_AFTER: Duration = Duration::from_secs(300);
/// What a drain or a publication comes back with when the lease went stale before it
/// started: nothing was done, nothing is recorded, it is started again from the state.
const NOT_RUN: &str = "not run: this coordinator's lease is not fresh";
/// A failed publication is tried again after this.
const PUBLISH_RETRY: Duration = Duration::from_secs(2);
/// Rejections that say the event needs no approval any more.
const DONE_REASONS: [&str; 2] = ["event_started", "event_not_scheduled"];
/// Rejections a new request can mend: clocks, a lost record, an approver whose agent had not
/// polled the event yet (the new request picks the approver again).
const RETRY_REASONS: [&str; 4] = ["expired", "from_the_future", "replayed", "unknown_event"];

pub struct Engine {
    pub fleet: Fleet,
    policy: Policy,
    config: CoordinatorConfig,
    store: Store,
    signer: SigningKey,
    publisher: Arc<dyn Sink>,
    http: reqwest::Client,
    done: mpsc::UnboundedSender<Done>,
    /// The earliest arrival of the messages (or results of drains and health gates) handled
    /// since the last decision, whose decision waits for the gap ([`Engine::gap`]) to
    /// pass: a burst is decided once at the gap's end, not once per message (each decision
    /// counts the whole fleet).
    owed: Option<Instant>,
    /// When the last decision was made.
    decided_at: Option<Instant>,
    /// [`DECISION_GAP`]; tests that cannot promise a commit within it set a longer one.
    pub decision_gap: std::time::Duration,
    /// What the last decision cost to make (the count of the whole fleet and the policy's
    /// judgement): the gap grows with it ([`Engine::gap`]).
    decision_cost: std::time::Duration,
    /// The last decision's waits, each with its verdict in words: one put into words again
    /// only when its wait changed (1,000 waiting events cost 2 ms a decision to format).
    verdicts: HashMap<String, (super::policy::Wait, String)>,
    /// When forgotten events and old ids were last pruned (the tick's clock).
    pruned: Option<DateTime<Utc>>,
    /// Decisions wait until the input has delivered everything it held when it started,
    /// however long that takes: deciding on half of a replayed stream could miss VMs
    /// already down. Until then, replayed messages are judged by their own `time`.
    ready: bool,
    /// How far the input is through its backlog (`None`: nothing to wait for).
    pub progress: Option<tokio::sync::watch::Receiver<sched_relay_transport::inbound::CatchUp>>,
    /// When the catch-up was last logged.
    catch_up_logged: Option<Instant>,
    /// When this engine started.
    started: Instant,
    /// Publications in flight, and when each event's last one started.
    publishing: HashMap<String, (bool, Instant)>,
    /// Drains running in this process (not restarted on the tick).
    draining: HashMap<(String, String), ()>,
    /// Health gates running, or when each last failed: (event key, VM) -> (running, when).
    gating: HashMap<(String, String), (bool, Instant)>,
    /// `/fleet`, as it is served.
    pub snapshot: Arc<RwLock<bytes::Bytes>>,
    /// `/fleet`'s parts as last written, each written again only when it changes.
    written: snapshot::Written,
    dirty: bool,
    /// When `/fleet` was last refreshed (the tick's clock).
    snapshot_at: Option<DateTime<Utc>>,
    /// When `/fleet` was last refreshed, and what that took.
    snapshot_cost: Option<(Instant, std::time::Duration)>,
    /// What a message's subject or routing key must be for the VM it speaks for
    /// (`Input::channel_template`).
    pub channel_template: Option<String>,
    /// With a standby: whether this instance may act now (it holds a fresh lease).
    pub gate: Option<Arc<dyn Fn() -> bool + Send + Sync>>,
    /// With groups listed by Azure Resource Manager: their inventory's state.
    pub azure: Option<AzureView>,
    /// With groups approved through ARM (`approve_via`): what acknowledges their events.
    pub acknowledger: Option<Arc<dyn Acknowledge>>,
}

impl Engine {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        fleet: Fleet,
        policy: Policy,
        config: CoordinatorConfig,
        store: Store,
        signer: SigningKey,
        publisher: Arc<dyn Sink>,
        done: mpsc::UnboundedSender<Done>,
    ) -> Engine {
        Engine {
            fleet,
            policy,
            config,
            store,
            signer,
            publisher,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(600))
                .build()
                .expect("an HTTP client builds"),
            done,
            owed: None,
            decided_at: None,
            decision_gap: DECISION_GAP,
            decision_cost: Duration::ZERO,
            verdicts: HashMap::new(),
            pruned: None,
            ready: false,
            progress: None,
            catch_up_logged: None,
            started: Instant::now(),
            publishing: HashMap::new(),
            draining: HashMap::new(),
            gating: HashMap::new(),
            snapshot: Arc::new(RwLock::new(bytes::Bytes::from_static(b"null"))),
            written: Default::default(),
            dirty: true,
            snapshot_at: None,
            snapshot_cost: None,
            channel_template: None,
            gate: None,
            azure: None,
            acknowledger: None,
        }
    }

    /// Tests: the input has caught up (decisions start at once).
    #[cfg(test)]
    pub(crate) fn caught_up(&mut self) {
        self.ready = true;
    }

    /// Handles one delivered message: read, apply, commit, answer, decide.
    pub fn deliver(&mut self, delivery: Delivery) {
        self.deliver_at(delivery, Utc::now());
    }

    /// [`Engine::deliver`] at `now` (tests drive a day in a second with it).
    pub fn deliver_at(&mut self, delivery: Delivery, now: DateTime<Utc>) {
        self.deliver_with(delivery, now, false);
    }

    pub(super) fn deliver_with(&mut self, delivery: Delivery, now: DateTime<Utc>, paced: bool) {
        if !self.may_act() {
            // A standby may be active: leave the message to it (JetStream offers it again).
            let _ = delivery.handled.send(Answer::NotHandled(
                "this coordinator's lease is not fresh".into(),
            ));
            return;
        }
        let arrived = Instant::now();
        let reply = |outcome: &'static str| {
            Answer::Handled(Reply {
                outcome,
                body: Value::Null,
            })
        };
        let Some(event) = crate::watch::decode(&delivery.message) else {
            input("invalid");
            tracing::warn!(channel = %delivery.message.channel, "Not a CloudEvent (binary or structured JSON); skipped");
            let _ = delivery.handled.send(reply("skipped"));
            return;
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
                return;
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
                return;
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
        let mut changes = Changes::default();
        match &applied {
            Applied::Changed(event_key) | Applied::Outcome(event_key) => {
                changes
                    .events
                    .push((event_key.clone(), self.fleet.events.get(event_key).cloned()));
            }
            Applied::ApprovedElsewhere(keys) | Applied::Heartbeat(keys) => {
                for event_key in keys {
                    changes
                        .events
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
                    changes
                        .events
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
            changes.vms.push((vm.0.clone(), vm.1.clone()));
        }
        if let Applied::ApprovedElsewhere(event_keys) = &applied {
            tracing::info!(event_ids = ?event_keys, vm = ?vm, "Approved by someone else (the agent's local policy, or another orchestrator): its VMs count as down");
        }
        if let (Some(key), false) = (&key, applied == Applied::Duplicate) {
            changes.seen.push((key.clone(), now));
        }
        if changes.is_empty() {
            let _ = delivery.handled.send(reply("skipped"));
            return;
        }
        if let Err(error) = self.store.write(&changes) {
            // Not acknowledged: the broker offers it again, and the fleet is what is stored.
            tracing::error!(error = %error, "Cannot store the fleet's state; the message will be offered again");
            self.reload();
            let _ = delivery.handled.send(Answer::NotHandled(error));
            return;
        }
        let _ = delivery.handled.send(reply("accepted"));
        if let Some(vm) = new_vm.filter(|vm| self.fleet.vms().contains_key(vm)) {
            self.azure_new_agent(&vm);
        }
        if let Applied::Outcome(event_key) = &applied {
            self.outcome(event_key);
        }
        self.dirty = true;
        if self.ready && !routine_beat {
            self.owe(arrived, now, paced);
        }
    }

    /// After a failed write: the fleet in memory may hold what was not stored, so it is read
    /// back. If that fails too, the process exits (its supervisor starts it again on what
    /// is stored): acting on unstored decisions could break a budget after a failover.
    pub(crate) fn reload(&mut self) {
        // A write refused with a stale lease: another coordinator is active (with a standby,
        // every write is fenced). Stop rather than act on a state this one did not write.
        if !self.may_act() {
            tracing::error!(
                "A write was refused and this coordinator's lease is not fresh: another one is active; exiting"
            );
            eprintln!("error: fenced: another coordinator is active");
            crate::logging::exit_now(1);
        }
        match self.store.load() {
            Ok(fleet) => self.fleet.reloaded(fleet),
            Err(error) => {
                tracing::error!(error = %error, "Cannot read the state store back; exiting so that nothing unstored is acted on");
                eprintln!("error: cannot read the state store back: {error}");
                crate::logging::exit_now(1);
            }
        }
    }

    /// This instance holds a fresh lease (or runs alone).
    pub(super) fn may_act(&self) -> bool {
        self.gate.as_ref().is_none_or(|gate| gate())
    }
}

fn new_request(via: Via) -> Sent {
    let draft = Draft::new("", None, Vec::new());
    Sent {
        request_id: draft.id,
        signed_at: draft.time,
        published_at: None,
        via,
    }
}

fn input(result: &'static str) {
    metrics::counter!("sched_relay_coordinator_input_total", "result" => result).increment(1);
}

fn printable(value: &Value) -> String {
    crate::watch::printable(&value.to_string()).into_owned()
}
