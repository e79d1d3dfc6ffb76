//! The specification's test vectors (copied from shared/spec/vectors into tests/vectors):
//! each document sequence must yield exactly the CloudEvents the vector lists.

use cloudevents::AttributesReader;
use sched_relay_core::Event;
use sched_relay_core::document::Document;
use sched_relay_core::event::{
    DEFAULT_TYPE_PREFIX, EventFactory, Identity, PartitionKey, events_for_document,
};
use serde_json::Value;

fn check_vector(name: &str) {
    let path = format!("{}/tests/vectors/{name}", env!("CARGO_MANIFEST_DIR"));
    let vector: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let vm = vector["vm"].as_str().unwrap();
    let factory = EventFactory::new(
        DEFAULT_TYPE_PREFIX,
        None,
        Identity {
            name: vm.into(),
            ..Identity::default()
        },
        PartitionKey::EventId,
    );
    let mut previous: Option<Document> = None;
    for (index, step) in vector["steps"].as_array().unwrap().iter().enumerate() {
        let body = step["document"].to_string();
        let document = Document::parse(body.as_bytes()).unwrap().document;
        let events = events_for_document(
            &factory,
            previous.as_ref(),
            &document,
            true,
            chrono::Utc::now(),
        );
        let same_incarnation = previous
            .as_ref()
            .is_some_and(|p| p.incarnation == document.incarnation);
        let expected = step["transitions"].as_array().unwrap();
        let (transitions, snapshots): (Vec<&Event>, Vec<&Event>) =
            events.iter().partition(|e| !e.ty().ends_with(".document"));

        assert_eq!(
            transitions.len(),
            expected.len(),
            "{name} step {index}: {events:#?}"
        );
        for (event, want) in transitions.iter().zip(expected) {
            let context = format!("{name} step {index}, {}", event.id());
            assert_eq!(event.ty(), want["type"], "{context}");
            assert_eq!(event.id(), want["id"], "{context}");
            assert_eq!(event.subject(), want["subject"].as_str(), "{context}");
            let data = match event.data() {
                Some(cloudevents::Data::Json(data)) => data.clone(),
                other => panic!("{context}: data is not JSON: {other:?}"),
            };
            assert_eq!(data["previousStatus"], want["previousStatus"], "{context}");
            assert_eq!(data["affectsVm"], want["affectsvm"], "{context}");
            assert_eq!(data["incarnation"], want["incarnation"], "{context}");
            let extension = |n: &str| event.extension(n).map(|v| v.to_string());
            assert_eq!(
                extension("affectsvm"),
                Some(want["affectsvm"].to_string()),
                "{context}"
            );
            assert_eq!(
                extension("incarnation"),
                Some(want["incarnation"].to_string()),
                "{context}"
            );
            let subject = want["subject"].as_str().unwrap();
            let raw_event = step["document"]["Events"]
                .as_array()
                .unwrap()
                .iter()
                .chain(
                    previous
                        .iter()
                        .flat_map(|p| p.raw["Events"].as_array().unwrap()),
                )
                .find(|e| e["EventId"] == subject)
                .unwrap();
            assert_eq!(
                &data["event"], raw_event,
                "{context}: the Azure event travels as received"
            );
        }
        if same_incarnation {
            assert!(
                snapshots.is_empty(),
                "{name} step {index}: same incarnation, no document event"
            );
        } else {
            assert_eq!(snapshots.len(), 1, "{name} step {index}");
            assert_eq!(
                snapshots[0].id(),
                format!("document:{}", document.incarnation)
            );
            assert_eq!(
                snapshots[0].subject(),
                Some(document.incarnation.to_string().as_str())
            );
        }
        previous = Some(document);
    }
}

#[test]
fn live_migration_vector_yields_scheduled_started_completed() {
    check_vector("live-migration.json");
}

#[test]
fn edge_cases_vector_yields_cancelled_updated_and_started_only_events() {
    check_vector("edge-cases.json");
}
