//! The typed kind every relayed event carries, and [`Event`], the CloudEvent wrapped with
//! it: what sinks, templates and logs read instead of parsing the `type` string.

use std::ops::Deref;

use cloudevents::AttributesReader;
use serde::{Deserialize, Serialize};

use super::ApprovalOutcome;
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
