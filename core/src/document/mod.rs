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
        self.resources
            .iter()
            .any(|resource| same_vm(resource, vm_name))
    }
}

/// Whether a name in `Resources` and a VM name are the same VM: ignoring case, and the
/// leading underscore of the 2017-03-01 preview.
pub fn same_vm(resource: &str, vm_name: &str) -> bool {
    fn unprefixed(name: &str) -> &str {
        name.strip_prefix('_').unwrap_or(name)
    }
    unprefixed(resource).eq_ignore_ascii_case(unprefixed(vm_name))
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
        // A set, not a search of the events before each one: this runs on every poll.
        let mut ids = std::collections::BTreeSet::new();
        for (index, event) in events.iter().enumerate() {
            if !ids.insert(event.id.as_str()) {
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
mod tests;
