//! The typed kind every relayed event carries, and [`Event`], the CloudEvent wrapped with
//! it: what sinks, templates and logs read instead of parsing the `type` string.

use std::fmt;
use std::ops::Deref;
use std::sync::{Arc, OnceLock};

use cloudevents::AttributesReader;
use cloudevents::event::{Data, ExtensionValue};
use serde::{Deserialize, Serialize};

use super::ApprovalOutcome;
use crate::binding::EncodeError;
use crate::diff::TransitionKind;

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
    /// The agent's periodic sign of life: `<prefix>.heartbeat` (see [`super::Heartbeat`]).
    Heartbeat,
    /// A `type` sched-relay does not make.
    Other,
}

impl EventKind {
    /// Every kind sched-relay makes, for tests and documentation.
    pub const ALL: [EventKind; 11] = [
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
        EventKind::Heartbeat,
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
            EventKind::Heartbeat => "heartbeat",
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
///
/// Its encodings (the structured JSON the outbox stores and the file and webhook sinks send,
/// the `data` bytes and header values of binary mode) are made once, by whoever asks first,
/// and shared by every clone: one event fanned out to four sinks is encoded once, not once
/// per sink. An event cannot change once made ([`Event::with_id`] makes another).
#[derive(Clone)]
pub struct Event {
    kind: EventKind,
    cloud: cloudevents::Event,
    encoded: Arc<Encodings>,
}

/// What an event's encodings cost, paid once (see [`Event`]).
#[derive(Default)]
struct Encodings {
    structured: OnceLock<Result<Vec<u8>, EncodeError>>,
    binary: OnceLock<Result<BinaryParts, EncodeError>>,
}

/// An event's binary-mode parts, before any protocol's header prefix or escaping.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BinaryParts {
    /// Each context attribute but `datacontenttype`, then each extension: (name, value).
    pub attributes: Vec<(String, String)>,
    /// `datacontenttype`, or `application/json` when the event has none.
    pub content_type: String,
    /// The event's `data` (empty when it has none).
    pub body: Vec<u8>,
}

impl Event {
    /// Wraps an event whose kind is known.
    pub fn new(kind: EventKind, cloud: cloudevents::Event) -> Event {
        Event {
            kind,
            cloud,
            encoded: Arc::default(),
        }
    }

    /// The event as one structured-mode JSON document, encoded once for every clone.
    pub fn structured_json(&self) -> Result<&[u8], EncodeError> {
        self.encoded
            .structured
            .get_or_init(|| {
                serde_json::to_vec(&self.cloud).map_err(|e| {
                    EncodeError(format!(
                        "event {} cannot be encoded as JSON: {e}",
                        self.cloud.id()
                    ))
                })
            })
            .as_deref()
            .map_err(Clone::clone)
    }

    /// The event's binary-mode parts, made once for every clone.
    pub fn binary_parts(&self) -> Result<&BinaryParts, EncodeError> {
        self.encoded
            .binary
            .get_or_init(|| binary_parts(&self.cloud))
            .as_ref()
            .map_err(Clone::clone)
    }

    /// Takes `bytes` as this event's structured JSON, unless it has one: for an event decoded
    /// from exactly these bytes, which this process's own [`Event::structured_json`] wrote.
    pub(super) fn keep_structured_json(&self, bytes: &[u8]) {
        let _ = self.encoded.structured.set(Ok(bytes.to_vec()));
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

    /// An id for the message that carries this event, unique across the fleet: its `source`
    /// and `id`, joined by a space (which a URI-reference `source` cannot hold). A CloudEvents
    /// id is unique only within its source: two VMs report the same Azure event (one that
    /// lists both) and their document of the same incarnation under the same `id`. Where a
    /// transport de-duplicates by message id across everything it carries (JetStream's
    /// `Nats-Msg-Id`, a Standard Webhooks receiver's `webhook-id`), the `id` alone would drop
    /// the second VM's event as a copy of the first's.
    pub fn message_id(&self) -> String {
        format!("{} {}", self.cloud.source(), self.cloud.id())
    }

    /// The same event under another id (backlogs in benchmarks and tests); the kind stays.
    pub fn with_id(mut self, id: impl Into<String>) -> Event {
        cloudevents::event::AttributesWriter::set_id(&mut self.cloud, id.into());
        // Another event: the old one's encodings name the old id.
        self.encoded = Arc::default();
        self
    }

    pub fn into_cloud(self) -> cloudevents::Event {
        self.cloud
    }
}

fn binary_parts(cloud: &cloudevents::Event) -> Result<BinaryParts, EncodeError> {
    let mut attributes = Vec::new();
    let mut content_type = "application/json".to_owned();
    for (name, value) in cloud.iter_attributes() {
        if name == "datacontenttype" {
            content_type = value.to_string();
            continue;
        }
        attributes.push((name.to_owned(), value.to_string()));
    }
    for (name, value) in cloud.iter_extensions() {
        attributes.push((name.to_owned(), ExtensionValue::to_string(value)));
    }
    let body = match cloud.data() {
        None => Vec::new(),
        Some(Data::Binary(bytes)) => bytes.clone(),
        Some(Data::String(text)) => text.clone().into_bytes(),
        Some(Data::Json(value)) => serde_json::to_vec(value)
            .map_err(|e| EncodeError(format!("data of {} cannot be encoded: {e}", cloud.id())))?,
    };
    Ok(BinaryParts {
        attributes,
        content_type,
        body,
    })
}

impl From<cloudevents::Event> for Event {
    /// Reads the kind from the `type` (events from storage, or made elsewhere).
    fn from(cloud: cloudevents::Event) -> Event {
        Event::new(EventKind::from_type(cloud.ty()), cloud)
    }
}

/// Two events are equal when their kinds and CloudEvents are: encodings made or not are not
/// part of the event.
impl PartialEq for Event {
    fn eq(&self, other: &Event) -> bool {
        self.kind == other.kind && self.cloud == other.cloud
    }
}

impl fmt::Debug for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Event")
            .field("kind", &self.kind)
            .field("cloud", &self.cloud)
            .finish()
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
