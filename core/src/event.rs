//! Turns transitions and documents into CloudEvents 1.0, exactly as product.md lays them out:
//! deterministic ids, the Azure EventId as `subject`, lower-case extensions, and `data` holding
//! the Azure event exactly as received. Pure: the observation time is passed in.

use std::ops::Deref;

use chrono::{DateTime, Utc};
use cloudevents::{AttributesReader, EventBuilder, EventBuilderV10};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::diff::{Transition, TransitionKind, diff};
use crate::document::Document;

/// Who this VM is, as the metadata service (or the configuration) says.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize)]
pub struct Identity {
    /// The VM name that appears in an event's `Resources`.
    pub name: String,
    /// The VM's unique id (`vmId`).
    pub vm_id: Option<String>,
    /// The Azure resource id, `/subscriptions/.../virtualMachines/<name>`.
    pub resource_id: Option<String>,
}

/// What a relayed CloudEvent reports. Known when the event is made, and read back from the
/// `type` in exactly one place ([`EventKind::from_type`]) when an event returns from storage,
/// so sinks, templates and logs never parse the `type` string themselves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventKind {
    /// A change of one Azure event: `<prefix>.scheduled`, `.started`, ...
    Transition(TransitionKind),
    /// The whole document: `<prefix>.document`.
    Document,
    /// The outcome of an approval request: `<prefix>.approval.accepted|rejected|failed`.
    Approval(ApprovalOutcome),
    /// An approval request itself (`<prefix>.approval.requested`), as orchestrators send.
    ApprovalRequest,
    /// A `type` sched-relay does not make.
    Other,
}

impl EventKind {
    /// Every kind sched-relay makes, for tests and documentation.
    pub const ALL: [EventKind; 10] = [
        EventKind::Transition(TransitionKind::Scheduled),
        EventKind::Transition(TransitionKind::Started),
        EventKind::Transition(TransitionKind::Completed),
        EventKind::Transition(TransitionKind::Cancelled),
        EventKind::Transition(TransitionKind::Updated),
        EventKind::Document,
        EventKind::Approval(ApprovalOutcome::Accepted),
        EventKind::Approval(ApprovalOutcome::Rejected),
        EventKind::Approval(ApprovalOutcome::Failed),
        EventKind::ApprovalRequest,
    ];

    /// The name after the type prefix: `scheduled`, `document`, `approval.accepted`, ...
    /// This is `{transition}` in templates and `SCHED_RELAY_TRANSITION` for the exec sink.
    /// `None` for [`EventKind::Other`].
    pub fn suffix(self) -> Option<&'static str> {
        Some(match self {
            EventKind::Transition(kind) => kind.as_str(),
            EventKind::Document => "document",
            EventKind::Approval(ApprovalOutcome::Accepted) => "approval.accepted",
            EventKind::Approval(ApprovalOutcome::Rejected) => "approval.rejected",
            EventKind::Approval(ApprovalOutcome::Failed) => "approval.failed",
            EventKind::ApprovalRequest => "approval.requested",
            EventKind::Other => return None,
        })
    }

    /// The kind of a `type` made with any prefix: the longest known suffix after a `.`.
    pub fn from_type(ty: &str) -> EventKind {
        EventKind::ALL
            .into_iter()
            .filter(|kind| {
                let suffix = kind.suffix().expect("ALL has no Other");
                ty.strip_suffix(suffix)
                    .is_some_and(|prefix| prefix.ends_with('.'))
            })
            .max_by_key(|kind| kind.suffix().map(str::len))
            .unwrap_or(EventKind::Other)
    }
}

/// A CloudEvent as sched-relay relays it: the event itself plus what it reports, so nobody
/// downstream parses the `type` back. Serializes as the plain CloudEvent (structured JSON).
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    kind: EventKind,
    cloud: cloudevents::Event,
}

impl Event {
    /// Wraps an event whose kind is known.
    pub fn new(kind: EventKind, cloud: cloudevents::Event) -> Event {
        Event { kind, cloud }
    }

    pub fn kind(&self) -> EventKind {
        self.kind
    }

    /// The name after the type prefix (`scheduled`, `approval.accepted`, ...), or for a type
    /// sched-relay does not make, its last segment.
    pub fn transition(&self) -> &str {
        match self.kind.suffix() {
            Some(suffix) => suffix,
            None => self.cloud.ty().rsplit('.').next().unwrap_or_default(),
        }
    }

    /// The same event under another id (backlogs in benchmarks and tests); the kind stays.
    pub fn with_id(mut self, id: impl Into<String>) -> Event {
        cloudevents::event::AttributesWriter::set_id(&mut self.cloud, id.into());
        self
    }

    pub fn into_cloud(self) -> cloudevents::Event {
        self.cloud
    }
}

impl From<cloudevents::Event> for Event {
    /// Reads the kind from the `type` (events from storage, or made elsewhere).
    fn from(cloud: cloudevents::Event) -> Event {
        Event {
            kind: EventKind::from_type(cloud.ty()),
            cloud,
        }
    }
}

/// An event decoded from a protocol equals the relayed event it carries.
impl PartialEq<cloudevents::Event> for Event {
    fn eq(&self, other: &cloudevents::Event) -> bool {
        self.cloud == *other
    }
}

impl PartialEq<Event> for cloudevents::Event {
    fn eq(&self, other: &Event) -> bool {
        *self == other.cloud
    }
}

impl Default for Event {
    fn default() -> Event {
        cloudevents::Event::default().into()
    }
}

impl Deref for Event {
    type Target = cloudevents::Event;
    fn deref(&self) -> &cloudevents::Event {
        &self.cloud
    }
}

impl Serialize for Event {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.cloud.serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Event {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Event, D::Error> {
        cloudevents::Event::deserialize(deserializer).map(Event::from)
    }
}

/// The default prefix of every `type`.
pub const DEFAULT_TYPE_PREFIX: &str = "com.azure.scheduledevents";

/// What the `partitionkey` extension (and so the Kafka key) of a transition is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PartitionKey {
    /// All transitions of one Azure event stay in order in one partition.
    #[default]
    EventId,
    /// All events of one VM stay in order in one partition.
    VmName,
}

/// `[events]`: the shape of the published CloudEvents.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct EventsConfig {
    #[serde(default = "default_type_prefix")]
    pub type_prefix: String,
    #[serde(default = "default_true")]
    pub document_events: bool,
    #[serde(default)]
    pub partition_key: PartitionKey,
}

impl Default for EventsConfig {
    fn default() -> Self {
        EventsConfig {
            type_prefix: default_type_prefix(),
            document_events: true,
            partition_key: PartitionKey::default(),
        }
    }
}

fn default_type_prefix() -> String {
    DEFAULT_TYPE_PREFIX.into()
}

fn default_true() -> bool {
    true
}

/// Builds the CloudEvents of one VM.
#[derive(Debug, Clone)]
pub struct EventFactory {
    pub type_prefix: String,
    /// The CloudEvents `source`: the resource id, else `urn:sched-relay:vm:<name>`, unless set.
    pub source: String,
    pub vm: Identity,
    pub partition_key: PartitionKey,
}

/// How an approval request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ApprovalOutcome {
    /// The metadata service answered 200 (or, in a dry run, would have been asked).
    Accepted,
    /// A check failed; nothing was sent.
    Rejected,
    /// The metadata service kept failing.
    Failed,
}

impl ApprovalOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            ApprovalOutcome::Accepted => "accepted",
            ApprovalOutcome::Rejected => "rejected",
            ApprovalOutcome::Failed => "failed",
        }
    }
}

/// Everything an outcome event says about one request.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    pub outcome: ApprovalOutcome,
    /// The request's CloudEvents id (`policy:<EventId>` for local policy).
    pub request_id: String,
    pub event_ids: Vec<String>,
    /// Machine-readable: a rejection reason (`bad_signature`, ...), `imds_accepted`,
    /// `imds_error`, `dry_run` or `policy`.
    pub reason: String,
    /// A sentence for people.
    pub detail: String,
    /// Where the request came from: `policy`, `nats:<subject>`, `http:POST /approvals`, ...
    pub channel: String,
    pub dry_run: bool,
    /// Makes the outcome id unique where one request id can be refused many times (replays).
    pub nonce: Option<String>,
}

impl EventFactory {
    pub fn new(
        type_prefix: &str,
        source: Option<&str>,
        vm: Identity,
        partition_key: PartitionKey,
    ) -> Self {
        let source = source
            .map(str::to_owned)
            .or_else(|| vm.resource_id.clone())
            .unwrap_or_else(|| format!("urn:sched-relay:vm:{}", vm.name));
        EventFactory {
            type_prefix: type_prefix.trim_end_matches('.').to_owned(),
            source,
            vm,
            partition_key,
        }
    }

    fn vm_json(&self) -> Value {
        json!({"name": self.vm.name, "id": self.vm.vm_id, "resourceId": self.vm.resource_id})
    }

    /// The CloudEvent of one transition.
    pub fn transition(&self, transition: &Transition, observed: DateTime<Utc>) -> Event {
        Event::new(
            EventKind::Transition(transition.kind),
            self.transition_event(transition, observed),
        )
    }

    fn transition_event(
        &self,
        transition: &Transition,
        observed: DateTime<Utc>,
    ) -> cloudevents::Event {
        let event = &transition.event;
        let affects = event.affects(&self.vm.name);
        let previous_status = transition.previous_status.as_ref().map(|s| s.as_str());
        let data = json!({
            "incarnation": transition.incarnation,
            "vm": self.vm_json(),
            "affectsVm": affects,
            "previousStatus": previous_status,
            "event": event.raw,
        });
        let partition_key = match self.partition_key {
            PartitionKey::EventId => event.id.clone(),
            PartitionKey::VmName => self.vm.name.clone(),
        };
        let mut builder = EventBuilderV10::new()
            .id(transition.id())
            .source(self.source.clone())
            .ty(format!("{}.{}", self.type_prefix, transition.kind.as_str()))
            .subject(event.id.clone())
            .time(observed)
            .extension("incarnation", incarnation_value(transition.incarnation))
            .extension("eventstatus", event.status.as_str())
            .extension("vmname", self.vm.name.as_str())
            .extension("affectsvm", affects)
            .extension("partitionkey", partition_key)
            .data("application/json", data);
        if let Some(event_type) = &event.event_type {
            builder = builder.extension("eventtype", event_type.as_str());
        }
        if let Some(source) = &event.source {
            builder = builder.extension("eventsource", source.as_str());
        }
        builder
            .build()
            .expect("every required attribute is set above")
    }

    /// The `document` CloudEvent: the whole document, once per incarnation.
    pub fn document(&self, document: &Document, observed: DateTime<Utc>) -> Event {
        let cloud = EventBuilderV10::new()
            .id(format!("document:{}", document.incarnation))
            .source(self.source.clone())
            .ty(format!("{}.document", self.type_prefix))
            .subject(document.incarnation.to_string())
            .time(observed)
            .extension("incarnation", incarnation_value(document.incarnation))
            .extension("vmname", self.vm.name.as_str())
            .extension("partitionkey", self.vm.name.as_str())
            .data("application/json", document.raw.clone())
            .build()
            .expect("every required attribute is set above");
        Event::new(EventKind::Document, cloud)
    }

    /// The outcome event of one approval request: `<prefix>.approval.<outcome>`, id
    /// `<requestid>:<outcome>`, the first EventId as subject.
    pub fn approval_outcome(&self, outcome: &Outcome, observed: DateTime<Utc>) -> Event {
        let kind = outcome.outcome.as_str();
        let data = json!({
            "requestId": outcome.request_id,
            "eventId": outcome.event_ids.first(),
            "eventIds": outcome.event_ids,
            "vm": self.vm_json(),
            "outcome": kind,
            "reason": outcome.reason,
            "detail": outcome.detail,
            "channel": outcome.channel,
            "dryRun": outcome.dry_run,
        });
        let mut id = format!("{}:{kind}", outcome.request_id);
        if let Some(nonce) = &outcome.nonce {
            id = format!("{id}:{nonce}");
        }
        let first = outcome.event_ids.first().map(String::as_str);
        let partition_key = match (self.partition_key, first) {
            (PartitionKey::EventId, Some(event_id)) => event_id,
            _ => self.vm.name.as_str(),
        };
        let mut builder = EventBuilderV10::new()
            .id(id)
            .source(self.source.clone())
            .ty(format!("{}.approval.{kind}", self.type_prefix))
            .time(observed)
            .extension("requestid", outcome.request_id.as_str())
            .extension("reason", outcome.reason.as_str())
            .extension("vmname", self.vm.name.as_str())
            .extension("partitionkey", partition_key)
            .data("application/json", data);
        if let Some(event_id) = first {
            builder = builder.subject(event_id);
        }
        if outcome.dry_run {
            builder = builder.extension("dryrun", true);
        }
        let cloud = builder
            .build()
            .expect("every required attribute is set above");
        Event::new(EventKind::Approval(outcome.outcome), cloud)
    }
}

/// Every CloudEvent one document yields after `previous`: one per transition, in diff order,
/// then the `document` snapshot when enabled. Nothing at all when the incarnation is the same.
pub fn events_for_document(
    factory: &EventFactory,
    previous: Option<&Document>,
    current: &Document,
    include_document: bool,
    observed: DateTime<Utc>,
) -> Vec<Event> {
    if previous.is_some_and(|previous| previous.incarnation == current.incarnation) {
        return Vec::new();
    }
    let mut events: Vec<_> = diff(previous, current)
        .iter()
        .map(|transition| factory.transition(transition, observed))
        .collect();
    if include_document {
        events.push(factory.document(current, observed));
    }
    events
}

/// CloudEvents integers are signed 32-bit; an incarnation beyond that (never seen, but the
/// field is unbounded) is carried as a string rather than wrapped.
fn incarnation_value(incarnation: u64) -> cloudevents::event::ExtensionValue {
    match i32::try_from(incarnation) {
        Ok(small) => i64::from(small).into(),
        Err(_) => incarnation.to_string().into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn factory() -> EventFactory {
        EventFactory::new(
            DEFAULT_TYPE_PREFIX,
            None,
            Identity {
                name: "WestNO_0".into(),
                vm_id: Some("vm-id".into()),
                resource_id: None,
            },
            PartitionKey::EventId,
        )
    }

    fn document(value: Value) -> Document {
        Document::from_value(value).unwrap().document
    }

    #[test]
    fn transition_event_has_every_attribute_of_the_contract() {
        let raw_event = json!({"EventId": "E1", "EventStatus": "Scheduled", "EventType": "Freeze",
            "Resources": ["WestNO_0"], "EventSource": "Platform", "DurationInSeconds": 5,
            "NotBefore": "Mon, 11 Apr 2022 22:26:58 GMT", "Unknown": {"kept": true}});
        let current = document(json!({"DocumentIncarnation": 2, "Events": [raw_event.clone()]}));
        let transition = &diff(None, &current)[0];
        let observed = "2022-04-11T22:00:00Z".parse().unwrap();
        let event = factory().transition(transition, observed);

        assert_eq!(event.id(), "E1:scheduled");
        assert_eq!(event.ty(), "com.azure.scheduledevents.scheduled");
        assert_eq!(event.source(), "urn:sched-relay:vm:WestNO_0");
        assert_eq!(event.subject(), Some("E1"));
        assert_eq!(event.time(), Some(&observed));
        assert_eq!(event.datacontenttype(), Some("application/json"));
        let ext = |name| event.extension(name).unwrap().to_string();
        assert_eq!(ext("incarnation"), "2");
        assert_eq!(ext("eventtype"), "Freeze");
        assert_eq!(ext("eventstatus"), "Scheduled");
        assert_eq!(ext("eventsource"), "Platform");
        assert_eq!(ext("vmname"), "WestNO_0");
        assert_eq!(ext("affectsvm"), "true");
        assert_eq!(ext("partitionkey"), "E1");

        let structured = serde_json::to_value(&event).unwrap();
        assert_eq!(structured["specversion"], "1.0");
        assert_eq!(structured["incarnation"], 2);
        assert_eq!(structured["affectsvm"], true);
        let data = &structured["data"];
        assert_eq!(data["incarnation"], 2);
        assert_eq!(
            data["vm"],
            json!({"name": "WestNO_0", "id": "vm-id", "resourceId": null})
        );
        assert_eq!(data["affectsVm"], true);
        assert_eq!(data["previousStatus"], Value::Null);
        assert_eq!(
            data["event"], raw_event,
            "the Azure event travels exactly as received"
        );
    }

    #[test]
    fn source_prefers_configuration_then_resource_id() {
        let mut vm = factory().vm;
        vm.resource_id = Some("/subscriptions/s/virtualMachines/WestNO_0".into());
        let from_resource = EventFactory::new("p", None, vm.clone(), PartitionKey::EventId);
        assert_eq!(
            from_resource.source,
            "/subscriptions/s/virtualMachines/WestNO_0"
        );
        let configured = EventFactory::new("p", Some("urn:x"), vm, PartitionKey::EventId);
        assert_eq!(configured.source, "urn:x");
    }

    #[test]
    fn document_event_carries_the_whole_document() {
        let raw = json!({"DocumentIncarnation": "7", "Events": []});
        let event = factory().document(&document(raw.clone()), Utc::now());
        assert_eq!(event.id(), "document:7");
        assert_eq!(event.subject(), Some("7"));
        assert_eq!(event.ty(), "com.azure.scheduledevents.document");
        assert_eq!(serde_json::to_value(&event).unwrap()["data"], raw);
    }

    #[test]
    fn partition_key_can_be_the_vm_name() {
        let mut factory = factory();
        factory.partition_key = PartitionKey::VmName;
        let current = document(json!({"DocumentIncarnation": 1, "Events": [
            {"EventId": "E1", "EventStatus": "Started"}]}));
        let event = factory.transition(&diff(None, &current)[0], Utc::now());
        assert_eq!(
            event.extension("partitionkey").unwrap().to_string(),
            "WestNO_0"
        );
        assert!(
            event.extension("eventsource").is_none(),
            "absent fields add no extension"
        );
    }

    #[test]
    fn every_kind_reads_back_from_its_type_with_any_prefix() {
        for prefix in [DEFAULT_TYPE_PREFIX, "com.contoso.maintenance", "x"] {
            for kind in EventKind::ALL {
                let ty = format!("{prefix}.{}", kind.suffix().unwrap());
                assert_eq!(EventKind::from_type(&ty), kind, "{ty}");
            }
        }
        // A bare suffix, or a type sched-relay does not make, is `Other`.
        assert_eq!(EventKind::from_type("scheduled"), EventKind::Other);
        assert_eq!(EventKind::from_type("com.x.rescheduled"), EventKind::Other);
        let other: Event = cloudevents::Event::default().into();
        assert_eq!(other.kind(), EventKind::Other);
    }

    #[test]
    fn events_made_here_carry_the_kind_their_type_reads_back_as() {
        let factory = EventFactory::new(
            "com.contoso.maint",
            None,
            factory().vm,
            PartitionKey::EventId,
        );
        let current = document(json!({"DocumentIncarnation": 3, "Events": [
            {"EventId": "E1", "EventStatus": "Scheduled"}]}));
        let outcome = Outcome {
            outcome: ApprovalOutcome::Rejected,
            request_id: "r".into(),
            event_ids: vec!["E1".into()],
            reason: "bad_signature".into(),
            detail: String::new(),
            channel: "http".into(),
            dry_run: false,
            nonce: None,
        };
        let made = [
            factory.transition(&diff(None, &current)[0], Utc::now()),
            factory.document(&current, Utc::now()),
            factory.approval_outcome(&outcome, Utc::now()),
        ];
        let names: Vec<&str> = made.iter().map(Event::transition).collect();
        assert_eq!(names, ["scheduled", "document", "approval.rejected"]);
        for event in made {
            let stored = serde_json::to_string(&event).unwrap();
            let read: Event = serde_json::from_str(&stored).unwrap();
            assert_eq!(read.kind(), event.kind(), "{stored}");
            assert_eq!(read, event);
        }
    }
}
