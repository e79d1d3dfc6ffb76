//! Turns transitions and documents into CloudEvents 1.0, exactly as product.md lays them out:
//! deterministic ids, the Azure EventId as `subject`, lower-case extensions, and `data` holding
//! the Azure event exactly as received. Pure: the observation time is passed in.

use chrono::{DateTime, Utc};
use cloudevents::{Event, EventBuilder, EventBuilderV10};
use serde_json::{Value, json};

use crate::diff::Transition;
use crate::imds::{Document, Identity};

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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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
        EventBuilderV10::new()
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
            .expect("every required attribute is set above")
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
        builder
            .build()
            .expect("every required attribute is set above")
    }
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
    use crate::diff::diff;
    use cloudevents::AttributesReader;

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
}
