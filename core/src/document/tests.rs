//! The parser's promises: strict where the diff needs it, tolerant elsewhere, never a panic.

use super::*;
use proptest::prelude::*;
use serde_json::json;

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        "[ -~]{0,12}".prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
            proptest::collection::btree_map(
                prop_oneof![
                    Just("DocumentIncarnation".to_owned()),
                    Just("Events".to_owned()),
                    Just("EventId".to_owned()),
                    Just("EventStatus".to_owned()),
                    Just("NotBefore".to_owned()),
                    Just("Resources".to_owned()),
                    Just("DurationInSeconds".to_owned()),
                    "[A-Za-z]{1,8}",
                ],
                inner,
                0..5
            )
            .prop_map(|map| Value::Object(map.into_iter().collect())),
        ]
    })
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic_the_parser(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = Document::parse(&bytes);
    }

    #[test]
    fn arbitrary_json_is_parsed_or_refused_with_a_path(value in json_value()) {
        match Document::from_value(value) {
            Ok(parsed) => {
                for event in &parsed.document.events {
                    prop_assert!(!event.id.is_empty());
                }
            }
            Err(DocumentError::Invalid { path, .. }) => prop_assert!(!path.is_empty()),
            Err(other) => prop_assert!(false, "unexpected error {other}"),
        }
    }

    #[test]
    fn valid_documents_keep_every_field_and_the_raw_event(
        incarnation in 0u64..1_000_000,
        as_string in any::<bool>(),
        events in proptest::collection::btree_map(
            "[a-f0-9-]{1,36}",
            (prop_oneof![Just("Scheduled".to_owned()), Just("Started".to_owned()), "[A-Z][a-z]{2,8}"],
             proptest::collection::vec("[A-Za-z0-9_]{1,12}", 0..4),
             -1i64..100_000,
             proptest::option::of(0i64..4_000_000_000)),
            0..5),
    ) {
        let items: Vec<Value> = events.iter().map(|(id, (status, resources, duration, not_before))| {
            let not_before = not_before
                .and_then(|secs| DateTime::from_timestamp(secs, 0))
                .map(|t| t.format("%a, %d %b %Y %H:%M:%S GMT").to_string())
                .unwrap_or_default();
            json!({"EventId": id, "EventStatus": status, "Resources": resources,
                   "DurationInSeconds": duration, "NotBefore": not_before})
        }).collect();
        let incarnation_value = if as_string { json!(incarnation.to_string()) } else { json!(incarnation) };
        let raw = json!({"DocumentIncarnation": incarnation_value, "Events": items});
        let parsed = Document::parse(raw.to_string().as_bytes()).unwrap();
        prop_assert!(parsed.warnings.is_empty(), "{:?}", parsed.warnings);
        prop_assert_eq!(parsed.document.incarnation, incarnation);
        for (event, item) in parsed.document.events.iter().zip(&items) {
            let (status, resources, duration, not_before) = &events[&event.id];
            prop_assert_eq!(event.status.as_str(), status.as_str());
            prop_assert_eq!(&event.resources, resources);
            prop_assert_eq!(event.duration_seconds, *duration);
            prop_assert_eq!(event.not_before.map(|t| t.timestamp()), *not_before);
            prop_assert_eq!(&Value::Object(event.raw.clone()), item);
        }
    }

    #[test]
    fn not_before_reads_both_documented_formats(secs in 0i64..4_000_000_000) {
        let time = DateTime::from_timestamp(secs, 0).unwrap();
        let rfc1123 = time.format("%a, %d %b %Y %H:%M:%S GMT").to_string();
        let iso = time.format("%Y-%m-%dT%H:%M:%SZ").to_string();
        prop_assert_eq!(parse_not_before(&rfc1123), Some(time));
        prop_assert_eq!(parse_not_before(&iso), Some(time));
    }
}

fn parse(value: Value) -> Result<Parsed, DocumentError> {
    Document::parse(value.to_string().as_bytes())
}

#[test]
fn newest_version_document_parses_every_field() {
    let parsed = parse(json!({
        "DocumentIncarnation": 2,
        "Events": [{
            "EventId": "C7061BAC-AFDC-4513-B24B-AA5F13A16123",
            "EventStatus": "Scheduled",
            "EventType": "Freeze",
            "ResourceType": "VirtualMachine",
            "Resources": ["WestNO_0", "WestNO_1"],
            "NotBefore": "Mon, 11 Apr 2022 22:26:58 GMT",
            "Description": "Live Migration",
            "EventSource": "Platform",
            "DurationInSeconds": 5
        }]
    }))
    .unwrap();
    assert!(parsed.warnings.is_empty());
    let event = &parsed.document.events[0];
    assert_eq!(parsed.document.incarnation, 2);
    assert_eq!(event.event_type, Some(EventType::Freeze));
    assert_eq!(event.status, EventStatus::Scheduled);
    assert_eq!(event.source, Some(EventSource::Platform));
    assert_eq!(event.duration_seconds, 5);
    assert_eq!(
        event.not_before.unwrap().to_rfc3339(),
        "2022-04-11T22:26:58+00:00"
    );
    assert!(event.affects("westno_1"));
    assert!(!event.affects("WestNO_2"));
}

#[test]
fn oldest_version_document_parses_with_defaults() {
    let parsed = parse(json!({
        "DocumentIncarnation": "7",
        "Events": [{
            "EventId": "602d9444-d2cd-49c7-8624-8643e7171297",
            "EventType": "Reboot",
            "ResourceType": "VirtualMachine",
            "Resources": ["_FrontEnd_IN_0"],
            "EventStatus": "Scheduled",
            "NotBefore": "2016-09-19T18:29:47Z"
        }]
    }))
    .unwrap();
    let event = &parsed.document.events[0];
    assert_eq!(parsed.document.incarnation, 7);
    assert_eq!(event.duration_seconds, -1);
    assert_eq!(event.source, None);
    assert!(event.not_before.is_some());
    assert!(
        event.affects("FrontEnd_IN_0"),
        "preview names carry a leading underscore"
    );
}

#[test]
fn unknown_enum_values_are_carried_through() {
    let parsed = parse(json!({"DocumentIncarnation": 1, "Events": [{
        "EventId": "x", "EventStatus": "Paused", "EventType": "Hibernate", "EventSource": "Robot"
    }]}))
    .unwrap();
    let event = &parsed.document.events[0];
    assert_eq!(event.status.as_str(), "Paused");
    assert_eq!(event.event_type.as_ref().unwrap().as_str(), "Hibernate");
    assert_eq!(event.source.as_ref().unwrap().as_str(), "Robot");
}

#[test]
fn empty_not_before_means_started() {
    let parsed = parse(json!({"DocumentIncarnation": 3, "Events": [{
        "EventId": "x", "EventStatus": "Started", "NotBefore": ""
    }]}))
    .unwrap();
    assert_eq!(parsed.document.events[0].not_before, None);
    assert!(parsed.warnings.is_empty());
}

#[test]
fn odd_optional_fields_are_ignored_with_a_warning_not_refused() {
    let parsed = parse(json!({"DocumentIncarnation": 3, "Events": [{
        "EventId": "x", "EventStatus": "Scheduled", "NotBefore": "tomorrow",
        "DurationInSeconds": "soon", "Resources": "vm1"
    }]}))
    .unwrap();
    assert_eq!(parsed.warnings.len(), 3, "{:?}", parsed.warnings);
    assert!(parsed.warnings[0].contains("Events[0].Resources"));
}

#[test]
fn malformed_documents_are_refused_with_the_path_and_what_was_expected() {
    let cases = [
        (json!([]), "document: expected a JSON object"),
        (
            json!({"Events": []}),
            "DocumentIncarnation: expected an integer",
        ),
        (
            json!({"DocumentIncarnation": -1, "Events": []}),
            "DocumentIncarnation: expected a non-negative",
        ),
        (
            json!({"DocumentIncarnation": 1}),
            "Events: expected an array",
        ),
        (
            json!({"DocumentIncarnation": 1, "Events": {}}),
            "Events: expected an array",
        ),
        (
            json!({"DocumentIncarnation": 1, "Events": [{"EventStatus": "Scheduled"}]}),
            "Events[0].EventId",
        ),
        (
            json!({"DocumentIncarnation": 1, "Events": [{"EventId": "a"}]}),
            "Events[0].EventStatus",
        ),
        (
            json!({"DocumentIncarnation": 1, "Events": [
                {"EventId": "a", "EventStatus": "Scheduled"}, {"EventId": "a", "EventStatus": "Started"}
            ]}),
            "Events[1].EventId: expected an EventId not used",
        ),
    ];
    for (document, expected) in cases {
        let error = parse(document.clone()).unwrap_err().to_string();
        assert!(error.starts_with(expected), "{document}: {error}");
    }
    let error = Document::parse(b"<html>oops</html>")
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("not JSON") && error.contains("<html>"),
        "{error}"
    );
}
