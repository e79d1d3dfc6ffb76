//! The virtual agents: one process speaking for N VMs' agents on the real broker, in the
//! agents' own wire format. Every CloudEvent is made by the agent's own code
//! (`sched_relay_core`: the diff engine over each VM's documents, the event factory, the
//! heartbeat) and published by the agent's own NATS sink (JetStream, awaiting every ack);
//! every approval is parsed and its Ed25519 signature checked by the agent's own parser and
//! verifier, and answered with the outcome event the agent publishes. What it does not do is
//! poll a metadata service: a VM's document changes when the script says so.
//!
//! It also keeps the record the decision latencies are taken from ([`Record`]), from what it
//! saw itself: when it published each report, when each drain webhook call and each approval
//! arrived, and when it published each VM's return.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use futures_util::StreamExt;
use sched_relay_core::Event;
use sched_relay_core::approval::request::{self, Limits};
use sched_relay_core::approval::verify::{Key, canonical, decode_base64};
use sched_relay_core::document::Document;
use sched_relay_core::event::{
    ApprovalOutcome, DEFAULT_TYPE_PREFIX, EventFactory, Heartbeat, Identity, Outcome, PartitionKey,
    events_for_document,
};
use sched_relay_core::inbound::Inbound;
use sched_relay_nats::{NatsSink, NatsSinkConfig};
use sched_relay_transport::Sink;
use serde_json::{Value, json};
use tokio::sync::oneshot;

/// The agents' heartbeat interval: the shipped default.
pub const HEARTBEAT: Duration = Duration::from_secs(300);
/// From an approval to the agent's poll that sees the event Started.
pub const POLL: Duration = Duration::from_secs(1);

/// One VM as its agent knows it.
struct Vm {
    factory: EventFactory,
    document: Document,
    started_at: DateTime<Utc>,
    group: usize,
}

/// The decision record, from the virtual agents' own observations (never the
/// coordinator's): a decision is the first action on an event, a drain webhook call or an
/// approval.
#[derive(Default)]
pub struct Record {
    budget: usize,
    groups: Vec<Group>,
    events: HashMap<String, Tracked>,
    /// An event reported while its group had room and nothing waiting: from the report's
    /// publication to the first action on it.
    pub on_report: Vec<f64>,
    /// An event that waited, acted on after another VM of its full group came back: from the
    /// publication of that return (the report that freed the place) to the action.
    pub on_return: Vec<f64>,
    /// The slowest decision on a report or a return: (seconds, EventId).
    pub slowest: (f64, String),
    /// Waiting events acted on with no return to pair with (the record's view of the group
    /// was behind the coordinator's, an action in flight): not timed.
    pub unpaired: usize,
    /// Every action on an event after its first (a drain's approval).
    pub actions: usize,
    /// Events whose VM is back.
    pub returned: usize,
    /// Approvals whose signature did not verify, or that did not parse.
    pub bad_approvals: usize,
    /// Approval messages, repeats included.
    pub approval_messages: usize,
    /// Publications that failed (each is tried again).
    pub publish_failures: usize,
}

#[derive(Default)]
struct Group {
    /// Events acted on whose VM is not back.
    held: BTreeSet<String>,
    /// Events reported and not acted on yet.
    waiting: BTreeSet<String>,
    /// Returns that freed a place of the full group while events waited, not yet paired
    /// with the action they allowed.
    returns: VecDeque<Instant>,
}

struct Tracked {
    group: usize,
    reported: Instant,
    room_at_report: bool,
    first_action: Option<Instant>,
}

impl Record {
    fn reported(&mut self, id: &str, group: usize, at: Instant) {
        let g = &mut self.groups[group];
        let room_at_report = g.held.len() < self.budget && g.waiting.is_empty();
        g.waiting.insert(id.to_owned());
        self.events.insert(
            id.to_owned(),
            Tracked {
                group,
                reported: at,
                room_at_report,
                first_action: None,
            },
        );
    }

    fn acted(&mut self, id: &str, at: Instant) {
        let Some(tracked) = self.events.get_mut(id) else {
            return;
        };
        if tracked.first_action.is_some() {
            self.actions += 1;
            return;
        }
        tracked.first_action = Some(at);
        let g = &mut self.groups[tracked.group];
        g.waiting.remove(id);
        g.held.insert(id.to_owned());
        let took = if tracked.room_at_report {
            at.duration_since(tracked.reported).as_secs_f64()
        } else if let Some(freed) = g.returns.pop_front() {
            at.duration_since(freed.max(tracked.reported)).as_secs_f64()
        } else {
            self.unpaired += 1;
            return;
        };
        if tracked.room_at_report {
            self.on_report.push(took);
        } else {
            self.on_return.push(took);
        }
        if took > self.slowest.0 {
            self.slowest = (took, id.to_owned());
        }
    }

    fn returned(&mut self, id: &str, at: Instant) {
        let Some(tracked) = self.events.get(id) else {
            return;
        };
        self.returned += 1;
        let budget = self.budget;
        let g = &mut self.groups[tracked.group];
        let was_full = g.held.len() >= budget;
        g.held.remove(id);
        if was_full && !g.waiting.is_empty() {
            g.returns.push_back(at);
        }
    }
}

/// An event of the script: one VM's.
#[derive(Clone)]
pub struct Planned {
    pub vm: usize,
    pub id: String,
    /// `Reboot` (drained, then approved; the VM restarts) or `Freeze` (approved).
    pub ty: &'static str,
    pub appear: Instant,
    /// How long the VM is down once it started.
    pub down_for: Duration,
}

/// Every virtual agent, the sink they share and what they recorded.
pub struct Agents {
    sink: NatsSink,
    vms: Vec<Mutex<Vm>>,
    names: HashMap<String, usize>,
    waiting: Mutex<HashMap<String, oneshot::Sender<()>>>,
    pub record: Mutex<Record>,
    key: Key,
    limits: Limits,
}

/// The Azure date format of `NotBefore`.
fn rfc1123(at: DateTime<Utc>) -> String {
    at.format("%a, %d %b %Y %H:%M:%S GMT").to_string()
}

fn document(incarnation: u64, events: Vec<Value>) -> Document {
    Document::from_value(json!({"DocumentIncarnation": incarnation, "Events": events}))
        .expect("a valid document")
        .document
}

impl Agents {
    /// `names[n]` is VM n, in group `groups[n]` (each group's budget is `budget`).
    pub fn new(
        url: &str,
        names: &[String],
        groups: &[usize],
        budget: usize,
        public_key: &str,
    ) -> Arc<Agents> {
        let config: NatsSinkConfig = serde_json::from_value(json!({
            "url": url,
            "jetstream": true,
            "subject": "scheduledevents.{vmname}.{transition}",
        }))
        .unwrap();
        let now = Utc::now();
        let vms = names
            .iter()
            .zip(groups)
            .map(|(name, &group)| {
                let identity = Identity {
                    name: name.clone(),
                    vm_id: Some(format!("{:032x}", fastrand::u128(..))),
                    resource_id: Some(format!(
                        "/subscriptions/00000000-0000-4000-8000-000000000000/resourceGroups/fleet/providers/Microsoft.Compute/virtualMachines/{name}"
                    )),
                };
                Mutex::new(Vm {
                    factory: EventFactory::new(
                        DEFAULT_TYPE_PREFIX,
                        None,
                        identity,
                        PartitionKey::EventId,
                    ),
                    document: document(1, Vec::new()),
                    started_at: now,
                    group,
                })
            })
            .collect();
        let record = Record {
            budget,
            groups: (0..=groups.iter().copied().max().unwrap_or(0))
                .map(|_| Group::default())
                .collect(),
            ..Record::default()
        };
        Arc::new(Agents {
            sink: NatsSink::new(config),
            vms,
            names: names
                .iter()
                .cloned()
                .enumerate()
                .map(|(n, v)| (v, n))
                .collect(),
            waiting: Mutex::new(HashMap::new()),
            record: Mutex::new(record),
            key: Key::ed25519(public_key).unwrap(),
            limits: Limits {
                request_type: format!("{DEFAULT_TYPE_PREFIX}.approval.requested"),
                max_message_bytes: 64 * 1024,
                max_event_ids: 100,
            },
        })
    }

    pub fn len(&self) -> usize {
        self.vms.len()
    }

    /// Publishes a batch as one agent's sink delivers it, trying again until it is stored.
    async fn publish(&self, batch: Vec<Event>) {
        loop {
            match self.sink.deliver(&batch).await {
                Ok(()) => return,
                Err(_) => {
                    self.record.lock().unwrap().publish_failures += 1;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
    }

    /// VM `n`'s agent starting: its first document, then its first heartbeat.
    pub async fn start(&self, n: usize) {
        let batch = {
            let vm = self.vms[n].lock().unwrap();
            let now = Utc::now();
            let mut batch = events_for_document(&vm.factory, None, &vm.document, true, now);
            batch.push(vm.heartbeat(now));
            batch
        };
        self.publish(batch).await;
    }

    /// VM `n`'s heartbeat, now.
    pub async fn heartbeat(&self, n: usize) {
        let beat = self.vms[n].lock().unwrap().heartbeat(Utc::now());
        self.publish(vec![beat]).await;
    }

    /// Heartbeats of VM `n` every [`HEARTBEAT`] from `first`, for ever.
    pub async fn keep_beating(self: Arc<Self>, n: usize, first: Instant) {
        let mut next = first;
        loop {
            tokio::time::sleep_until(next.into()).await;
            self.heartbeat(n).await;
            next += HEARTBEAT;
        }
    }

    /// VM `n`'s document changes to `events` (the next incarnation): publishes what its
    /// agent would, and calls `before` with the moment just before publishing.
    async fn change(
        &self,
        n: usize,
        events: Vec<Value>,
        restarted: bool,
        before: impl FnOnce(Instant),
    ) {
        let batch = {
            let mut vm = self.vms[n].lock().unwrap();
            let now = Utc::now();
            let next = document(vm.document.incarnation + 1, events);
            let mut batch = events_for_document(&vm.factory, Some(&vm.document), &next, true, now);
            vm.document = next;
            if restarted {
                // The VM rebooted: its agent started again, and says so in a heartbeat.
                vm.started_at = now;
                batch.push(vm.heartbeat(now));
            }
            batch
        };
        before(Instant::now());
        self.publish(batch).await;
    }

    /// One event's life: it appears Scheduled, waits for its approval, is seen Started at
    /// the next poll, and is gone when the VM is back.
    pub async fn live(self: Arc<Self>, event: Planned) {
        tokio::time::sleep_until(event.appear.into()).await;
        let (name, group) = {
            let vm = self.vms[event.vm].lock().unwrap();
            (vm.factory.vm.name.clone(), vm.group)
        };
        let not_before = Utc::now() + chrono::Duration::minutes(15);
        let duration = if event.ty == "Freeze" {
            event.down_for.as_secs() as i64
        } else {
            -1
        };
        let raw = |status: &str, not_before: String| {
            json!({
                "EventId": event.id, "EventStatus": status, "EventType": event.ty,
                "ResourceType": "VirtualMachine", "Resources": [name],
                "NotBefore": not_before, "Description": "Virtual machine is going to be restarted as requested by authorized user.",
                "EventSource": "Platform", "DurationInSeconds": duration,
            })
        };
        let (tx, approved) = oneshot::channel();
        self.waiting.lock().unwrap().insert(event.id.clone(), tx);
        self.change(
            event.vm,
            vec![raw("Scheduled", rfc1123(not_before))],
            false,
            |at| self.record.lock().unwrap().reported(&event.id, group, at),
        )
        .await;
        if approved.await.is_err() {
            return;
        }
        tokio::time::sleep(POLL).await;
        self.change(event.vm, vec![raw("Started", String::new())], false, |_| {})
            .await;
        tokio::time::sleep(event.down_for).await;
        self.change(event.vm, Vec::new(), event.ty != "Freeze", |at| {
            self.record.lock().unwrap().returned(&event.id, at)
        })
        .await;
    }

    /// When the first action on `event_id` (reported by [`Agents::live`]) arrived.
    pub fn first_action(&self, event_id: &str) -> Option<Instant> {
        self.record
            .lock()
            .unwrap()
            .events
            .get(event_id)?
            .first_action
    }

    /// A drain webhook call for `event_id` arrived.
    pub fn drain_called(&self, event_id: &str) {
        self.record.lock().unwrap().acted(event_id, Instant::now());
    }

    /// Reads every VM's approvals (one subscription for the whole fleet), checks each as
    /// the agent does, and answers each with its outcome; the first approval of an event
    /// lets its life go on.
    pub async fn answer_approvals(self: Arc<Self>, client: async_nats::Client) {
        let mut messages = client.subscribe("scheduledapprovals.>").await.unwrap();
        while let Some(message) = messages.next().await {
            let at = Instant::now();
            let headers = message
                .headers
                .iter()
                .flat_map(|h| h.iter())
                .filter_map(|(name, values)| {
                    values
                        .first()
                        .map(|v| (name.to_string(), v.as_str().to_owned()))
                })
                .collect();
            let inbound = Inbound {
                transport: "jetstream",
                channel: message.subject.to_string(),
                headers,
                content_type: None,
                body: message.payload.to_vec(),
                shared: false,
                route: None,
            };
            let Some((request_id, event_ids)) = self.check(&inbound) else {
                self.record.lock().unwrap().bad_approvals += 1;
                continue;
            };
            {
                let mut record = self.record.lock().unwrap();
                record.approval_messages += 1;
                for id in &event_ids {
                    record.acted(id, at);
                }
            }
            for id in &event_ids {
                if let Some(tx) = self.waiting.lock().unwrap().remove(id) {
                    let _ = tx.send(());
                }
            }
            let vm = message
                .subject
                .as_str()
                .rsplit('.')
                .next()
                .unwrap_or_default();
            let Some(&n) = self.names.get(vm) else {
                continue;
            };
            let outcome = Outcome {
                outcome: ApprovalOutcome::Accepted,
                request_id,
                event_ids,
                reason: "imds_accepted".into(),
                detail: "the metadata service accepted the StartRequests".into(),
                channel: inbound.channel.clone(),
                dry_run: false,
                nonce: None,
            };
            let event = self.vms[n]
                .lock()
                .unwrap()
                .factory
                .approval_outcome(&outcome, Utc::now());
            let agents = self.clone();
            tokio::spawn(async move { agents.publish(vec![event]).await });
        }
    }

    /// The request's id and EventIds when it parses and its signature verifies.
    fn check(&self, inbound: &Inbound) -> Option<(String, Vec<String>)> {
        let request = request::parse(inbound, &self.limits).ok()?;
        let attributes = request.cloud_event.as_ref()?;
        let signed = canonical(
            &attributes.id,
            &attributes.source,
            attributes.time.timestamp(),
            attributes.vm_name.as_deref(),
            &request.event_ids,
        );
        let signature = decode_base64(attributes.signature.as_deref()?)?;
        self.key
            .verify(signed.as_bytes(), &signature)
            .then(|| (attributes.id.clone(), request.event_ids.clone()))
    }
}

impl Vm {
    fn heartbeat(&self, at: DateTime<Utc>) -> Event {
        self.factory.heartbeat(
            &Heartbeat {
                document: Some(&self.document),
                epoch: 0,
                interval: HEARTBEAT,
                started_at: self.started_at,
                agent_version: env!("CARGO_PKG_VERSION"),
            },
            at,
        )
    }
}
