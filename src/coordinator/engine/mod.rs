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
use tokio::sync::mpsc;

use super::azure::{Acked, Acknowledge};
use super::config::CoordinatorConfig;
use super::fleet::{Fleet, Sent, Via};
use super::policy::Policy;
use super::store::Store;

mod arm;
mod azure;
mod decisions;
mod deliver;
mod inventory;
mod pace;
mod recovery;
mod results;
mod snapshot;
mod tick;
mod work;

pub use azure::AzureView;
pub use deliver::GROUP_MAX;
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

    /// Whether it decides yet: its input has caught up.
    pub fn deciding(&self) -> bool {
        self.ready
    }

    /// Tests: the input has caught up (decisions start at once).
    #[cfg(test)]
    pub(crate) fn caught_up(&mut self) {
        self.ready = true;
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
