//! The engine through a simulated day and more, on the shipped defaults (`forget_after`
//! 24 h, `silent_after` 3, `max_hold` 1 h, heartbeats every 5 minutes): a quiet fleet stays
//! known; a scale-in without notice counts as down, then leaves; a Spot-evicted VM leaves as
//! soon as its agent is silent; a Reboot whose VM never comes back keeps its place past
//! `max_hold` (alerted) until an operator releases it; the pause switch is stored. The
//! engine's own store (redb) and a recording publisher; the clock is the test's.

use std::sync::{Arc, Mutex};

use chrono::{DateTime, Utc};
use sched_relay_core::approval::SigningKey;
use sched_relay_core::event::Event;
use sched_relay_transport::inbound::{Answer, Delivery, Inbound};
use sched_relay_transport::{DeliveryError, Sink};
use serde_json::Value;
use tokio::sync::{mpsc, oneshot};

use super::{document, published, t0};
use crate::coordinator::config::CoordinatorConfig;
use crate::coordinator::engine::{Admin, Done, Engine};
use crate::coordinator::store::Store;

/// Keeps every approval the engine publishes.
#[derive(Default)]
pub(crate) struct Recorder(Mutex<Vec<Event>>);

#[async_trait::async_trait]
impl Sink for Recorder {
    async fn deliver(&self, batch: &[Event]) -> Result<(), DeliveryError> {
        self.0.lock().unwrap().extend(batch.iter().cloned());
        Ok(())
    }
}

impl Recorder {
    /// The EventIds approved so far.
    pub(crate) fn approved(&self) -> Vec<String> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .map(|e| {
                let value = serde_json::to_value(e).unwrap();
                value["data"]["StartRequests"][0]["EventId"]
                    .as_str()
                    .unwrap()
                    .to_owned()
            })
            .collect()
    }
}

pub(crate) struct World {
    pub(crate) engine: Engine,
    pub(crate) recorder: Arc<Recorder>,
    done: mpsc::UnboundedReceiver<Done>,
    _dir: tempfile::TempDir,
}

fn minutes(n: i64) -> chrono::Duration {
    chrono::Duration::minutes(n)
}

pub(super) fn start(dir: tempfile::TempDir) -> World {
    start_with(dir, "")
}

/// [`start`] with `extra` at the end of the configuration (more groups, `[azure]`).
pub(crate) fn start_with(dir: tempfile::TempDir, extra: &str) -> World {
    crate::install_crypto_provider();
    let key_file = dir.path().join("key");
    std::fs::write(&key_file, SigningKey::generate_ed25519().unwrap()).unwrap();
    let text = format!(
        r#"
[coordinator]
state_dir = "{state}"
[input]
kind = "nats"
url = "nats://127.0.0.1:4222"
stream = "SCHEDULEDEVENTS"
[approvals]
kind = "nats"
url = "nats://127.0.0.1:4222"
subject = "scheduledapprovals.{{vmname}}"
[signing]
key_file = "{key}"
key_id = "fleet"
[defaults.actions]
Reboot = "approve"
Preempt = "never"
[[groups]]
name = "web"
vm_name = "web-*"
max_down = 1
[[groups]]
name = "db"
vm_name = "db-*"
max_down_percent = 34
{extra}
"#,
        state = dir.path().join("state").display(),
        key = key_file.display()
    );
    let config: CoordinatorConfig = toml::from_str(&text).unwrap();
    let policy = config.policy().unwrap();
    let store = Store::open(&config.coordinator.state_dir).unwrap();
    let fleet = store.load().unwrap();
    let signer = SigningKey::parse(&std::fs::read_to_string(&key_file).unwrap()).unwrap();
    let recorder = Arc::new(Recorder::default());
    let (done_tx, done) = mpsc::unbounded_channel();
    let mut engine = Engine::new(
        fleet,
        policy,
        config,
        store,
        signer,
        recorder.clone(),
        done_tx,
    );
    engine.resume();
    engine.caught_up();
    engine.channel_template = Some("scheduledevents.{vmname}.{transition}".into());
    World {
        engine,
        recorder,
        done,
        _dir: dir,
    }
}

impl World {
    /// Delivers `event` on the subject its agent publishes it on.
    pub(crate) fn deliver(&mut self, event: &Value, now: DateTime<Utc>) {
        self.deliver_on(event, now, &subject_of(event));
    }

    /// Delivers `event` on `channel`.
    pub(super) fn deliver_on(&mut self, event: &Value, now: DateTime<Utc>, channel: &str) {
        self.deliver_with(event, now, channel, false);
    }

    /// Delivers `event` as the coordinator's loop does ([`Engine::deliver_paced`]), or at
    /// once.
    pub(super) fn deliver_with(
        &mut self,
        event: &Value,
        now: DateTime<Utc>,
        channel: &str,
        paced: bool,
    ) {
        let (delivery, answer) = delivery(event, channel);
        if paced {
            self.engine.deliver_paced(delivery);
        } else {
            self.engine.deliver_at(delivery, now);
        }
        match answer.blocking_recv_or_now() {
            Answer::Handled(_) => {}
            other => panic!("{other:?} for {event}"),
        }
    }

    pub(crate) fn beat(
        &mut self,
        vm: &str,
        now: DateTime<Utc>,
        started: DateTime<Utc>,
        events: &[&str],
    ) {
        self.deliver(&super::ceiling::heartbeat(vm, now, started, events), now);
    }

    /// Lets the publications finish and hands their results to the engine.
    pub(crate) async fn settle(&mut self) {
        tokio::task::yield_now().await;
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        while let Ok(done) = self.done.try_recv() {
            self.engine.finished(done);
        }
    }

    pub(crate) fn group(&self, name: &str) -> Value {
        let snapshot = self.engine.fleet_json();
        snapshot["groups"]
            .as_array()
            .unwrap()
            .iter()
            .find(|g| g["group"] == name)
            .cloned()
            .unwrap()
    }
}

/// `event` delivered on `channel`, with where its answer comes.
pub(super) fn delivery(event: &Value, channel: &str) -> (Delivery, oneshot::Receiver<Answer>) {
    let (handled, answer) = oneshot::channel();
    let delivery = Delivery {
        message: Inbound {
            transport: "jetstream",
            channel: channel.into(),
            headers: Vec::new(),
            content_type: Some("application/cloudevents+json".into()),
            body: serde_json::to_vec(event).unwrap(),
            shared: true,
            route: None,
        },
        handled,
    };
    (delivery, answer)
}

/// The subject `event`'s agent publishes it on.
pub(super) fn subject_of(event: &Value) -> String {
    format!(
        "scheduledevents.{}.{}",
        event["vmname"].as_str().unwrap_or_default(),
        event["type"]
            .as_str()
            .unwrap_or_default()
            .trim_start_matches("com.azure.scheduledevents.")
            .replace('.', "_")
    )
}

pub(super) trait NowOrNever {
    fn blocking_recv_or_now(self) -> Answer;
}

impl NowOrNever for oneshot::Receiver<Answer> {
    fn blocking_recv_or_now(mut self) -> Answer {
        self.try_recv()
            .expect("the engine answers before it returns")
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_fleet_is_known_after_a_day_and_only_evidence_or_an_operator_frees_a_place() {
    let mut world = start(tempfile::tempdir().unwrap());
    let vms: Vec<String> = (0..6)
        .map(|i| format!("web-{i}"))
        .chain((0..6).map(|i| format!("db-{i}")))
        .collect();
    let booted = t0() - minutes(60);
    // Every agent's first document, then nothing but heartbeats for 25 hours; db-4 and
    // db-5 are deleted at hour 20 without notice (a scale-in).
    for vm in &vms {
        for event in published(vm, None, &document(1, &[])) {
            world.deliver(&event, t0());
        }
    }
    let mut now = t0();
    while now < t0() + minutes(25 * 60) {
        for vm in &vms {
            let deleted = (vm == "db-4" || vm == "db-5") && now >= t0() + minutes(20 * 60);
            if !deleted {
                world.beat(vm, now, booted, &[]);
            }
        }
        world.engine.tick(now);
        now += minutes(5);
    }
    world.engine.tick(now);
    // Nobody forgot the quiet VMs: web is six VMs, db six (two of them silent, so down).
    let web = world.group("web");
    assert_eq!(
        (web["known"].as_u64(), web["limit"].as_u64()),
        (Some(6), Some(1)),
        "{web}"
    );
    let db = world.group("db");
    assert_eq!(db["known"], 6, "{db}");
    assert_eq!(db["limit"], 3, "{db}");
    assert_eq!(db["silent"], serde_json::json!(["db-4", "db-5"]), "{db}");
    assert_eq!(db["down"], serde_json::json!(["db-4", "db-5"]), "{db}");

    // A wave: db-0's Reboot fits (2 + 1 of 3); db-1's must wait.
    for (vm, id) in [("db-0", "R0"), ("db-1", "R1")] {
        let d = document(2, &[(id, "Reboot", "Scheduled", &[vm], 30 * 3600, -1)]);
        for event in published(vm, Some(&document(1, &[])), &d) {
            world.deliver(&event, now);
        }
    }
    world.settle().await;
    assert_eq!(world.recorder.approved(), ["R0"]);

    // An operator releases the scaled-in VMs: they leave, and R1 goes.
    for vm in ["db-4", "db-5"] {
        let said = world
            .engine
            .admin(
                Admin::Release {
                    vm: vm.into(),
                    event: None,
                },
                now,
            )
            .unwrap();
        assert!(said.contains("left the inventory"), "{said}");
    }
    world.settle().await;
    assert_eq!(world.recorder.approved(), ["R0", "R1"]);
    assert_eq!(world.group("db")["known"], 4);

    // web-5's Reboot is approved and starts; the VM never comes back (its agent is silent).
    let d1 = document(
        2,
        &[("R5", "Reboot", "Scheduled", &["web-5"], 30 * 3600, -1)],
    );
    for event in published("web-5", Some(&document(1, &[])), &d1) {
        world.deliver(&event, now);
    }
    world.settle().await;
    assert!(world.recorder.approved().contains(&"R5".to_owned()));
    let d2 = document(3, &[("R5", "Reboot", "Started", &["web-5"], 30 * 3600, -1)]);
    for event in published("web-5", Some(&d1), &d2) {
        world.deliver(&event, now);
    }
    // web-0 has a Reboot too: it waits while web-5 is down, however long that lasts.
    let d0 = document(
        2,
        &[("W0", "Reboot", "Scheduled", &["web-0"], 80 * 3600, -1)],
    );
    for event in published("web-0", Some(&document(1, &[])), &d0) {
        world.deliver(&event, now);
    }
    let started = now;
    while now < started + minutes(26 * 60) {
        for vm in &vms {
            let listed: &[&str] = if vm == "web-0" { &["W0"] } else { &[] };
            if !["db-4", "db-5", "web-5"].contains(&vm.as_str()) {
                world.beat(vm, now, booted, listed);
            }
        }
        world.engine.tick(now);
        now += minutes(15);
    }
    world.settle().await;
    assert!(!world.recorder.approved().contains(&"W0".to_owned()));
    let web = world.group("web");
    assert_eq!(web["down"], serde_json::json!(["web-5"]), "{web}");
    assert_eq!(web["overdue"], serde_json::json!(["web-5"]), "{web}");
    assert_eq!(
        web["known"], 6,
        "a VM with a held event is never forgotten: {web}"
    );
    assert!(world.engine.fleet.events["R5"].overdue);

    // Paused: the release frees web-5, but nothing is approved until resumed.
    world
        .engine
        .admin(
            Admin::Pause {
                reason: "incident".into(),
            },
            now,
        )
        .unwrap();
    world
        .engine
        .admin(
            Admin::Release {
                vm: "web-5".into(),
                event: None,
            },
            now,
        )
        .unwrap();
    world.engine.tick(now);
    world.settle().await;
    assert!(!world.recorder.approved().contains(&"W0".to_owned()));
    world.engine.admin(Admin::Resume, now).unwrap();
    world.settle().await;
    assert!(
        world.recorder.approved().contains(&"W0".to_owned()),
        "{:?} {}",
        world.engine.fleet.events["W0"].verdict,
        world.group("web")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spot_evicted_vm_leaves_the_inventory_once_its_agent_is_silent_and_frees_its_place() {
    let mut world = start(tempfile::tempdir().unwrap());
    let booted = t0() - minutes(60);
    for vm in ["web-0", "web-1"] {
        for event in published(vm, None, &document(1, &[])) {
            world.deliver(&event, t0());
        }
        world.beat(vm, t0(), booted, &[]);
    }
    let d1 = document(2, &[("P0", "Preempt", "Scheduled", &["web-0"], 30, -1)]);
    let d2 = document(3, &[("P0", "Preempt", "Started", &["web-0"], 30, -1)]);
    for event in published("web-0", Some(&document(1, &[])), &d1)
        .into_iter()
        .chain(published("web-0", Some(&d1), &d2))
    {
        world.deliver(&event, t0());
    }
    let d = document(2, &[("R1", "Reboot", "Scheduled", &["web-1"], 7200, -1)]);
    for event in published("web-1", Some(&document(1, &[])), &d) {
        world.deliver(&event, t0());
    }
    world.settle().await;
    assert!(world.recorder.approved().is_empty(), "web-0 is down");
    // web-0 is gone; web-1 beats on. Three missed heartbeats later, web-0 has left.
    let mut now = t0();
    while now <= t0() + minutes(20) {
        world.beat("web-1", now, booted, &["R1"]);
        world.engine.tick(now);
        now += minutes(5);
    }
    world.settle().await;
    assert_eq!(world.group("web")["known"], 1);
    assert_eq!(world.recorder.approved(), ["R1"]);
}
