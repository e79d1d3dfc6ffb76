//! The Scheduled Events document: its model and a tolerant parser.
//!
//! Parsing is strict only about what the diff needs to stay truthful (`DocumentIncarnation`,
//! `Events`, each event's `EventId` and `EventStatus`): without them no transition can be
//! derived, so the whole document is refused and nothing is emitted. Every other field is
//! optional, because older api-versions simply leave fields out; a field of the wrong type is
//! ignored with a warning rather than hiding the event from the fleet. Unknown EventType,
//! EventStatus and EventSource values are carried through unchanged, and each event keeps the
//! exact JSON object it arrived as.

use std::fmt;

use chrono::{DateTime, NaiveDateTime, Utc};
use serde_json::{Map, Value};

/// Declares a string enum with the values Azure documents today, plus `Other` for values a
/// future api-version may add (they must be carried through, never rejected).
macro_rules! open_enum {
    ($(#[$doc:meta])* $name:ident { $($variant:ident),+ $(,)? }) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash)]
        pub enum $name {
            $($variant,)+
            /// A value this version of sched-relay does not know, exactly as received.
            Other(String),
        }

        impl $name {
            pub fn parse(text: &str) -> Self {
                match text {
                    $(stringify!($variant) => $name::$variant,)+
                    other => $name::Other(other.to_owned()),
                }
            }

            pub fn as_str(&self) -> &str {
                match self {
                    $($name::$variant => stringify!($variant),)+
                    $name::Other(other) => other,
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

open_enum!(
    /// What will happen to the VM.
    EventType { Freeze, Reboot, Redeploy, Preempt, Terminate }
);
open_enum!(
    /// Where the event is in its life: `Scheduled` until it starts, then `Started` until it
    /// disappears from the document (there is no `Completed` status).
    EventStatus { Scheduled, Started }
);
open_enum!(
    /// Who asked for it (api-version 2019-08-01 and later).
    EventSource { Platform, User }
);

/// One document as returned by `GET /metadata/scheduledevents`.
#[derive(Debug, Clone, PartialEq)]
pub struct Document {
    /// Increases whenever the Events array changes.
    pub incarnation: u64,
    pub events: Vec<ScheduledEvent>,
    /// The document exactly as received, for the `document` CloudEvent.
    pub raw: Value,
}

/// One event of a document.
#[derive(Debug, Clone, PartialEq)]
pub struct ScheduledEvent {
    pub id: String,
    pub event_type: Option<EventType>,
    pub status: EventStatus,
    pub source: Option<EventSource>,
    pub resources: Vec<String>,
    /// `None` when absent, empty (the event has started) or in a format nobody documented.
    pub not_before: Option<DateTime<Utc>>,
    pub description: Option<String>,
    /// Expected impact in seconds; `-1` (unknown) when the api-version predates the field.
    pub duration_seconds: i64,
    /// The event object exactly as received.
    pub raw: Map<String, Value>,
}

impl ScheduledEvent {
    /// Whether `vm_name` is among the event's Resources. Azure resource names are
    /// case-insensitive, and the 2017-03-01 preview prefixed them with an underscore.
    pub fn affects(&self, vm_name: &str) -> bool {
        self.resources.iter().any(|resource| {
            let resource = resource.strip_prefix('_').unwrap_or(resource);
            resource.eq_ignore_ascii_case(vm_name.strip_prefix('_').unwrap_or(vm_name))
        })
    }
}

/// Why a document was refused. Says where, what was found and what was expected.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DocumentError {
    #[error("the body is not JSON ({reason}); it starts with {start:?}")]
    NotJson { reason: String, start: String },
    #[error("{path}: expected {expected}, found {found}")]
    Invalid {
        path: String,
        expected: &'static str,
        found: String,
    },
}

/// A document that parsed, with the oddities that were tolerated on the way.
#[derive(Debug, Clone, PartialEq)]
pub struct Parsed {
    pub document: Document,
    /// Fields that had an unexpected type or format and were ignored, one line each.
    pub warnings: Vec<String>,
}

impl Document {
    /// Parses a response body. See the module docs for what is strict and what is tolerated.
    pub fn parse(body: &[u8]) -> Result<Parsed, DocumentError> {
        let raw: Value = serde_json::from_slice(body).map_err(|e| DocumentError::NotJson {
            reason: e.to_string(),
            start: String::from_utf8_lossy(&body[..body.len().min(60)]).into_owned(),
        })?;
        Document::from_value(raw)
    }

    /// Interprets already-decoded JSON (a stored document, a test vector).
    pub fn from_value(raw: Value) -> Result<Parsed, DocumentError> {
        let mut warnings = Vec::new();
        let root = raw
            .as_object()
            .ok_or_else(|| invalid("document", "a JSON object", &raw))?;
        let incarnation = root
            .get("DocumentIncarnation")
            .ok_or_else(|| missing("DocumentIncarnation", "an integer"))
            .and_then(|value| {
                parse_incarnation(value).ok_or_else(|| {
                    invalid(
                        "DocumentIncarnation",
                        "a non-negative integer (or one as a string)",
                        value,
                    )
                })
            })?;
        let items = root
            .get("Events")
            .ok_or_else(|| missing("Events", "an array of events"))?;
        let items = items
            .as_array()
            .ok_or_else(|| invalid("Events", "an array of events", items))?;
        let mut events = Vec::with_capacity(items.len());
        for (index, item) in items.iter().enumerate() {
            events.push(parse_event(index, item, &mut warnings)?);
        }
        for (index, event) in events.iter().enumerate() {
            if events[..index].iter().any(|earlier| earlier.id == event.id) {
                return Err(DocumentError::Invalid {
                    path: format!("Events[{index}].EventId"),
                    expected: "an EventId not used by another event of the document",
                    found: format!("{:?} twice", event.id),
                });
            }
        }
        Ok(Parsed {
            document: Document {
                incarnation,
                events,
                raw,
            },
            warnings,
        })
    }

    /// The event with this EventId, if the document has it.
    pub fn event(&self, id: &str) -> Option<&ScheduledEvent> {
        self.events.iter().find(|event| event.id == id)
    }
}

fn parse_incarnation(value: &Value) -> Option<u64> {
    match value {
        Value::Number(number) => number.as_u64(),
        Value::String(text) => text.trim().parse().ok(),
        _ => None,
    }
}

fn parse_event(
    index: usize,
    item: &Value,
    warnings: &mut Vec<String>,
) -> Result<ScheduledEvent, DocumentError> {
    let path = |field: &str| format!("Events[{index}].{field}");
    let object = item
        .as_object()
        .ok_or_else(|| invalid(&format!("Events[{index}]"), "an event object", item))?;
    let required_text = |field: &str| -> Result<String, DocumentError> {
        match object.get(field) {
            Some(Value::String(text)) if !text.is_empty() => Ok(text.clone()),
            Some(other) => Err(invalid(&path(field), "a non-empty string", other)),
            None => Err(missing(&path(field), "a non-empty string")),
        }
    };
    let id = required_text("EventId")?;
    let status = EventStatus::parse(&required_text("EventStatus")?);

    let mut optional_text = |field: &str| -> Option<String> {
        match object.get(field) {
            None | Some(Value::Null) => None,
            Some(Value::String(text)) => Some(text.clone()),
            Some(other) => {
                warnings.push(format!(
                    "{}: expected a string, found {}; ignored",
                    path(field),
                    describe(other)
                ));
                None
            }
        }
    };
    let event_type = optional_text("EventType").map(|t| EventType::parse(&t));
    let source = optional_text("EventSource").map(|s| EventSource::parse(&s));
    let description = optional_text("Description");
    let not_before_text = optional_text("NotBefore");

    let resources = match object.get("Resources") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) => items
            .iter()
            .filter_map(|item| item.as_str().map(str::to_owned))
            .collect(),
        Some(other) => {
            warnings.push(format!(
                "{}: expected an array of VM names, found {}; ignored",
                path("Resources"),
                describe(other)
            ));
            Vec::new()
        }
    };
    let duration_seconds = match object.get("DurationInSeconds") {
        None | Some(Value::Null) => -1,
        Some(value) => match value
            .as_i64()
            .or_else(|| value.as_str().and_then(|s| s.trim().parse().ok()))
        {
            Some(seconds) => seconds,
            None => {
                warnings.push(format!(
                    "{}: expected an integer, found {}; taken as -1 (unknown)",
                    path("DurationInSeconds"),
                    describe(value)
                ));
                -1
            }
        },
    };
    let not_before = match not_before_text.as_deref().map(str::trim) {
        None | Some("") => None,
        Some(text) => {
            let parsed = parse_not_before(text);
            if parsed.is_none() {
                warnings.push(format!(
                    "{}: {text:?} is neither RFC 1123 nor ISO 8601; kept as received",
                    path("NotBefore")
                ));
            }
            parsed
        }
    };
    Ok(ScheduledEvent {
        id,
        event_type,
        status,
        source,
        resources,
        not_before,
        description,
        duration_seconds,
        raw: object.clone(),
    })
}

/// Reads NotBefore as Azure has written it over the years: RFC 1123 (`Mon, 19 Sep 2016
/// 18:29:47 GMT`) or ISO 8601 (`2016-09-19T18:29:47Z`, with or without the zone).
pub fn parse_not_before(text: &str) -> Option<DateTime<Utc>> {
    DateTime::parse_from_rfc2822(text)
        .or_else(|_| DateTime::parse_from_rfc3339(text))
        .map(|time| time.with_timezone(&Utc))
        .ok()
        .or_else(|| {
            NaiveDateTime::parse_from_str(text, "%Y-%m-%dT%H:%M:%S%.f")
                .ok()
                .map(|naive| naive.and_utc())
        })
}

fn missing(path: &str, expected: &'static str) -> DocumentError {
    DocumentError::Invalid {
        path: path.to_owned(),
        expected,
        found: "nothing (the field is missing)".to_owned(),
    }
}

fn invalid(path: &str, expected: &'static str, found: &Value) -> DocumentError {
    DocumentError::Invalid {
        path: path.to_owned(),
        expected,
        found: describe(found),
    }
}

fn describe(value: &Value) -> String {
    let text = value.to_string();
    if text.chars().count() > 60 {
        format!("{}…", text.chars().take(60).collect::<String>())
    } else {
        text
    }
}

#[cfg(test)]
mod tests {
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
}
