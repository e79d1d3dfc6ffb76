//! The heartbeat: the agent's periodic CloudEvent saying that it is alive and what it last
//! saw, so that a fleet coordinator keeps every VM whose agent runs in its inventory on quiet
//! days too, when no document changes (a VM silent for a few intervals counts as down).
//!
//! It belongs to the VM, not to an Azure event: `subject` is `heartbeat`, `partitionkey` the
//! VM name, and its id, `heartbeat:<Unix milliseconds>`, is unique per VM (each one is a new
//! sign of life, not a retry of the last). Pure: the time, the agent's start and the last
//! processed document are passed in.

use std::time::Duration;

use chrono::{DateTime, SecondsFormat, Utc};
use cloudevents::{EventBuilder, EventBuilderV10};
use serde_json::{Value, json};

use super::{Event, EventFactory, EventKind, incarnation_value};
use crate::document::Document;

/// The `subject` of every heartbeat, and the start of its id.
pub const HEARTBEAT_SUBJECT: &str = "heartbeat";

/// The agent's state a heartbeat reports, at the moment it is made.
#[derive(Debug, Clone, Copy)]
pub struct Heartbeat<'a> {
    /// The last processed document; `None` before the first.
    pub document: Option<&'a Document>,
    /// The incarnation epoch of `document` ([`crate::continuity`]).
    pub epoch: u64,
    /// `[events] heartbeat_interval`: how long until the next one.
    pub interval: Duration,
    /// When this agent process started: a consumer sees a restart (a VM back from a reboot).
    pub started_at: DateTime<Utc>,
    /// The version of the agent that sends it.
    pub agent_version: &'a str,
}

impl EventFactory {
    /// The heartbeat made at `at`: `<prefix>.heartbeat`, id `heartbeat:<at as Unix
    /// milliseconds>`, `time` = `at` to the millisecond (so `time` and `id` name one instant).
    pub fn heartbeat(&self, heartbeat: &Heartbeat, at: DateTime<Utc>) -> Event {
        let millis = at.timestamp_millis();
        let at = DateTime::from_timestamp_millis(millis).unwrap_or(at);
        // Each event as the document lists it, in its order; the rest of it is in the
        // `document` events.
        let events: Vec<Value> = heartbeat
            .document
            .map(|document| {
                document
                    .events
                    .iter()
                    .map(|event| json!({"EventId": event.id, "EventStatus": event.status.as_str()}))
                    .collect()
            })
            .unwrap_or_default();
        let incarnation = heartbeat.document.map(|document| document.incarnation);
        let data = json!({
            "vm": self.vm_json(),
            "incarnation": incarnation,
            "epoch": heartbeat.epoch,
            "agentVersion": heartbeat.agent_version,
            "intervalSeconds": heartbeat.interval.as_secs(),
            "startedAt": heartbeat.started_at.to_rfc3339_opts(SecondsFormat::Millis, true),
            "events": events,
        });
        let mut builder = EventBuilderV10::new()
            .id(format!("{HEARTBEAT_SUBJECT}:{millis}"))
            .source(self.source.clone())
            .ty(format!("{}.{HEARTBEAT_SUBJECT}", self.type_prefix))
            .subject(HEARTBEAT_SUBJECT)
            .time(at)
            .extension("vmname", self.vm.name.as_str())
            .extension("partitionkey", self.vm.name.as_str())
            .data("application/json", data);
        if let Some(incarnation) = incarnation {
            builder = builder.extension("incarnation", incarnation_value(incarnation));
        }
        let cloud = builder
            .build()
            .expect("every required attribute is set above");
        Event::new(EventKind::Heartbeat, cloud)
    }
}

#[cfg(test)]
mod tests {
    use cloudevents::AttributesReader;

    use super::*;
    use crate::event::{DEFAULT_TYPE_PREFIX, EventsConfig, Identity, PartitionKey};

    fn factory(prefix: &str) -> EventFactory {
        EventFactory::new(
            prefix,
            None,
            Identity {
                name: "WestNO_0".into(),
                vm_id: Some("vm-id".into()),
                resource_id: Some("/subscriptions/s/virtualMachines/WestNO_0".into()),
            },
            // Heartbeats belong to the VM whatever transitions are keyed by.
            PartitionKey::EventId,
        )
    }

    fn state(document: Option<&Document>) -> Heartbeat<'_> {
        Heartbeat {
            document,
            epoch: 2,
            interval: Duration::from_secs(300),
            started_at: "2024-05-01T10:00:00.250Z".parse().unwrap(),
            agent_version: "9.8.7",
        }
    }

    #[test]
    fn a_heartbeat_reports_the_vm_and_every_event_of_the_last_processed_document() {
        let document = Document::from_value(json!({"DocumentIncarnation": 7, "Events": [
            {"EventId": "E2", "EventStatus": "Started", "EventType": "Reboot"},
            {"EventId": "E1", "EventStatus": "Scheduled", "EventType": "Freeze",
             "NotBefore": "Mon, 11 Apr 2022 22:26:58 GMT"}]}))
        .unwrap()
        .document;
        let at: DateTime<Utc> = "2024-05-01T10:05:00.123456Z".parse().unwrap();
        let event = factory(DEFAULT_TYPE_PREFIX).heartbeat(&state(Some(&document)), at);

        assert_eq!(event.kind(), EventKind::Heartbeat);
        assert_eq!(event.transition(), "heartbeat");
        assert_eq!(event.ty(), "com.azure.scheduledevents.heartbeat");
        assert_eq!(event.id(), format!("heartbeat:{}", 1_714_557_900_123_i64));
        assert_eq!(event.subject(), Some("heartbeat"));
        assert_eq!(event.source(), "/subscriptions/s/virtualMachines/WestNO_0");
        assert_eq!(
            event.time(),
            Some(&"2024-05-01T10:05:00.123Z".parse().unwrap()),
            "to the millisecond, as the id"
        );
        assert_eq!(event.datacontenttype(), Some("application/json"));
        let ext = |name| event.extension(name).map(|v| v.to_string());
        assert_eq!(ext("vmname").as_deref(), Some("WestNO_0"));
        assert_eq!(ext("partitionkey").as_deref(), Some("WestNO_0"));
        assert_eq!(ext("incarnation").as_deref(), Some("7"));
        for absent in ["eventtype", "eventstatus", "affectsvm"] {
            assert_eq!(
                ext(absent),
                None,
                "{absent}: a heartbeat is no Azure event's"
            );
        }

        let structured = serde_json::to_value(&event).unwrap();
        assert_eq!(structured["incarnation"], 7);
        assert_eq!(
            structured["data"],
            json!({
                "vm": {"name": "WestNO_0", "id": "vm-id",
                       "resourceId": "/subscriptions/s/virtualMachines/WestNO_0"},
                "incarnation": 7,
                "epoch": 2,
                "agentVersion": "9.8.7",
                "intervalSeconds": 300,
                "startedAt": "2024-05-01T10:00:00.250Z",
                "events": [
                    {"EventId": "E2", "EventStatus": "Started"},
                    {"EventId": "E1", "EventStatus": "Scheduled"},
                ],
            })
        );
        let read: Event = serde_json::from_value(structured).unwrap();
        assert_eq!(read.kind(), EventKind::Heartbeat, "it reads back as one");
    }

    #[test]
    fn a_heartbeat_before_any_document_has_no_incarnation() {
        let event = factory(DEFAULT_TYPE_PREFIX).heartbeat(&state(None), Utc::now());
        assert!(event.extension("incarnation").is_none());
        let data = &serde_json::to_value(&event).unwrap()["data"];
        assert_eq!(data["incarnation"], Value::Null);
        assert_eq!(data["events"], json!([]));
    }

    #[test]
    fn heartbeats_made_a_millisecond_apart_have_different_ids() {
        let factory = factory(DEFAULT_TYPE_PREFIX);
        let at: DateTime<Utc> = "2024-05-01T10:05:00.001Z".parse().unwrap();
        let first = factory.heartbeat(&state(None), at);
        let next = factory.heartbeat(&state(None), at + chrono::Duration::milliseconds(1));
        assert_eq!(first.id(), "heartbeat:1714557900001");
        assert_ne!(first.id(), next.id());
    }

    #[test]
    fn a_heartbeat_takes_the_configured_type_prefix() {
        let event = factory("com.contoso.maint.").heartbeat(&state(None), Utc::now());
        assert_eq!(event.ty(), "com.contoso.maint.heartbeat");
        assert_eq!(EventKind::from_type(event.ty()), EventKind::Heartbeat);
    }

    #[test]
    fn the_heartbeat_interval_is_off_at_zero_else_within_a_second_and_an_hour() {
        let problems = |interval: &str| {
            let config: EventsConfig =
                serde_json::from_value(json!({"heartbeat_interval": interval})).unwrap();
            config.validate()
        };
        assert_eq!(
            EventsConfig::default().heartbeat_interval,
            Duration::from_secs(300)
        );
        for fine in ["0s", "1s", "5m", "1h"] {
            assert_eq!(problems(fine), [], "{fine}");
        }
        for wrong in ["500ms", "61m", "1day"] {
            let found = problems(wrong);
            assert_eq!(found.len(), 1, "{wrong}: {found:?}");
            assert_eq!(found[0].0, "heartbeat_interval");
            assert!(found[0].1.contains("1s..1h"), "{}", found[0].1);
        }
    }
}
