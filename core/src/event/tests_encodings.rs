//! An event's encodings are made once and shared by its clones (every sink it fans out to),
//! and are exactly what encoding the event afresh gives.

use cloudevents::{AttributesReader, EventBuilder, EventBuilderV10};
use serde_json::json;

use super::Event;
use crate::binding::{self, ContentMode};

fn event(id: &str) -> Event {
    EventBuilderV10::new()
        .id(id)
        .source("/subscriptions/s/virtualMachines/WestNO_0")
        .ty("com.azure.scheduledevents.scheduled")
        .subject("E1")
        .time("2022-04-11T22:00:00Z")
        .extension("incarnation", 2i64)
        .extension("vmname", "WestNO_0")
        .data(
            "application/json",
            json!({"EventId": "E1", "Resources": ["WestNO_0"]}),
        )
        .build()
        .unwrap()
        .into()
}

#[test]
fn an_event_fanned_out_to_many_sinks_is_encoded_once() {
    let made = event("E1:scheduled");
    let for_sinks: Vec<Event> = (0..4).map(|_| made.clone()).collect();
    let json = made.structured_json().unwrap();
    let parts = made.binary_parts().unwrap();
    for clone in &for_sinks {
        assert!(std::ptr::eq(clone.structured_json().unwrap(), json));
        assert!(std::ptr::eq(clone.binary_parts().unwrap(), parts));
    }
}

#[test]
fn shared_encodings_are_what_encoding_the_event_afresh_gives() {
    let made = event("E1:scheduled");
    let clone = made.clone();
    clone.structured_json().unwrap();
    clone.binary_parts().unwrap();
    assert_eq!(
        made.structured_json().unwrap(),
        serde_json::to_vec(&*made).unwrap().as_slice()
    );
    for style in [
        binding::KAFKA,
        binding::NATS,
        binding::HTTP,
        binding::AMQP_1_0,
    ] {
        for mode in [ContentMode::Binary, ContentMode::Structured] {
            let fresh = binding::encode(&event("E1:scheduled"), mode, style).unwrap();
            let shared = binding::encode(&made, mode, style).unwrap();
            assert_eq!(fresh.content_type, shared.content_type);
            // Extensions come in the SDK's hash map's order, which differs between maps.
            let body = |bytes: &[u8]| serde_json::from_slice::<serde_json::Value>(bytes).unwrap();
            assert_eq!(body(&fresh.body), body(&shared.body));
            let mut fresh = fresh.headers;
            let mut shared = shared.headers;
            fresh.sort();
            shared.sort();
            assert_eq!(fresh, shared);
        }
    }
    let batch = binding::batch_json(&[made.clone(), event("E2:scheduled")]).unwrap();
    let decoded: Vec<Event> = serde_json::from_slice(&batch).unwrap();
    assert_eq!(decoded, [made, event("E2:scheduled")]);
}

#[test]
fn an_event_under_another_id_is_encoded_under_that_id() {
    let made = event("E1:scheduled");
    made.structured_json().unwrap();
    made.binary_parts().unwrap();
    let renamed = made.clone().with_id("E1:copy");
    let decoded: Event = serde_json::from_slice(renamed.structured_json().unwrap()).unwrap();
    assert_eq!(decoded.id(), "E1:copy");
    let headers = binding::encode(&renamed, ContentMode::Binary, binding::KAFKA)
        .unwrap()
        .headers;
    assert!(headers.contains(&("ce_id".to_owned(), "E1:copy".to_owned())));
    // The original keeps its own.
    let decoded: Event = serde_json::from_slice(made.structured_json().unwrap()).unwrap();
    assert_eq!(decoded.id(), "E1:scheduled");
}

#[test]
fn a_stored_event_read_back_sends_the_bytes_that_were_stored() {
    let stored = event("E1:scheduled").structured_json().unwrap().to_vec();
    let read = Event::from_own_json(&stored).unwrap();
    assert_eq!(read, event("E1:scheduled"));
    assert_eq!(read.structured_json().unwrap(), stored.as_slice());
    // Spaced out, so that encoding it afresh could not give these bytes back.
    let spaced = String::from_utf8(stored).unwrap().replace(",\"", ", \"");
    let read = Event::from_own_json(spaced.as_bytes()).unwrap();
    assert_eq!(read, event("E1:scheduled"));
    assert_eq!(read.structured_json().unwrap(), spaced.as_bytes());
    // Not of the common shape (a `dataschema`): decoded by the SDK, encoded afresh.
    let unusual = br#"{"specversion":"1.0","id":"1","source":"s","type":"t","dataschema":"http://x/y", "data":{"a":1}}"#;
    let read = Event::from_own_json(unusual).unwrap();
    assert_ne!(read.structured_json().unwrap(), unusual.as_slice());
    assert_eq!(
        read.structured_json().unwrap(),
        serde_json::to_vec(&*read).unwrap().as_slice()
    );
}
