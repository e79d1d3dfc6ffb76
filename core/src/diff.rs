//! The diff engine: a pure function from (previous document, current document) to the
//! transitions between them. No I/O, no clock: the same two documents always give the same
//! transitions, in the same order.
//!
//! Rules (product.md, "Events on the wire"):
//! - a new EventId is `Scheduled`, or `Started` when Azure skipped the notice (host failure);
//! - `Scheduled` -> `Started` is `Started`;
//! - a disappeared EventId is `Completed` if it was last seen `Started`, else `Cancelled`;
//! - any other change of a still-present event (NotBefore, Resources, Duration, an unusual
//!   status change such as `Started` -> `Scheduled`) is `Updated`;
//! - the same incarnation with the same content yields nothing: Azure promises the same
//!   information. The same incarnation with other content is a numbering reset
//!   ([`crate::continuity`]) and is diffed like any other document.
//!
//! A `Cancelled` event may in fact have run unobserved (this VM rebooted, or IMDS was
//! unreachable, while it started and finished). [`diff_observed`] marks it [`Unobserved`] when
//! it vanished after its NotBefore or after this agent's approval was accepted; what the agent
//! approved and when it looked come in as data ([`Observation`]), so the diff stays pure.
//!
//! Order: events of the current document in document order, then disappeared events in the
//! order of the previous document. Each EventId yields at most one transition per document,
//! so per-EventId order is the document order.

use chrono::{DateTime, Utc};

use crate::continuity::{Continuity, by_id, incarnation_tag};
use crate::document::{Document, EventStatus, ScheduledEvent};

/// What happened to one Azure event between two documents.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TransitionKind {
    Scheduled,
    Started,
    Completed,
    Cancelled,
    Updated,
}

impl TransitionKind {
    /// The last segment of the CloudEvents `type` and of the deterministic id.
    pub fn as_str(self) -> &'static str {
        match self {
            TransitionKind::Scheduled => "scheduled",
            TransitionKind::Started => "started",
            TransitionKind::Completed => "completed",
            TransitionKind::Cancelled => "cancelled",
            TransitionKind::Updated => "updated",
        }
    }
}

/// One transition. For `Completed` and `Cancelled` the event is its last known form.
#[derive(Debug, Clone, PartialEq)]
pub struct Transition {
    pub kind: TransitionKind,
    pub event: ScheduledEvent,
    /// The status in the previous document, `None` when the event is new.
    pub previous_status: Option<EventStatus>,
    /// The incarnation of the document in which the change was seen.
    pub incarnation: u64,
    /// The incarnation epoch of that document: 0 until Azure restarts its numbering.
    pub epoch: u64,
    /// For `Cancelled` only: why the event probably started unobserved instead.
    pub unobserved: Option<Unobserved>,
}

impl Transition {
    /// The deterministic CloudEvents id: `<EventId>:<transition>`, or
    /// `<EventId>:updated:<incarnation>` since one event can be updated many times (with
    /// `~e<epoch>` after a numbering reset, see [`crate::continuity`]).
    pub fn id(&self) -> String {
        match self.kind {
            TransitionKind::Updated => format!(
                "{}:updated:{}",
                self.event.id,
                incarnation_tag(self.incarnation, self.epoch)
            ),
            kind => format!("{}:{}", self.event.id, kind.as_str()),
        }
    }
}

/// Why an event that vanished while `Scheduled` probably started (and finished) unobserved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Unobserved {
    /// It vanished after its NotBefore, when Azure may start it by itself.
    NotBeforePassed,
    /// This agent's StartRequests for it was accepted by the metadata service.
    ApprovedByThisAgent,
}

impl Unobserved {
    /// The `unobservedreason` extension.
    pub fn as_str(self) -> &'static str {
        match self {
            Unobserved::NotBeforePassed => "notbefore",
            Unobserved::ApprovedByThisAgent => "approved",
        }
    }
}

/// What the agent knows besides the two documents, passed in as data.
#[derive(Debug, Clone, Copy)]
pub struct Observation<'a> {
    /// When the current document was fetched.
    pub at: DateTime<Utc>,
    /// The incarnation epoch of the current document ([`Continuity::epoch_after`]).
    pub epoch: u64,
    /// EventIds whose StartRequests this agent sent and the metadata service accepted.
    pub approved: &'a [String],
}

impl Observation<'_> {
    /// A document fetched at `at`, in epoch 0, with nothing approved.
    pub fn at(at: DateTime<Utc>) -> Observation<'static> {
        Observation {
            at,
            epoch: 0,
            approved: &[],
        }
    }
}

/// The transitions from `previous` (None: the first document the agent sees) to `current`,
/// in epoch 0 and without judging what was unobserved; see [`diff_observed`].
pub fn diff(previous: Option<&Document>, current: &Document) -> Vec<Transition> {
    transitions(previous, current, 0, None)
}

/// As [`diff`], in `observation`'s epoch, and marking each `Cancelled` event that probably
/// started unobserved.
pub fn diff_observed(
    previous: Option<&Document>,
    current: &Document,
    observation: &Observation,
) -> Vec<Transition> {
    transitions(previous, current, observation.epoch, Some(observation))
}

fn unobserved(event: &ScheduledEvent, observation: &Observation) -> Option<Unobserved> {
    let approved = observation.approved.iter();
    if approved
        .clone()
        .any(|id| id.eq_ignore_ascii_case(&event.id))
    {
        return Some(Unobserved::ApprovedByThisAgent);
    }
    event
        .not_before
        .filter(|not_before| observation.at >= *not_before)
        .map(|_| Unobserved::NotBeforePassed)
}

fn transitions(
    previous: Option<&Document>,
    current: &Document,
    epoch: u64,
    observation: Option<&Observation>,
) -> Vec<Transition> {
    if Continuity::of(previous, current) == Continuity::Unchanged {
        return Vec::new();
    }
    let previous_events: &[ScheduledEvent] = previous.map_or(&[], |p| &p.events);
    // Indexed, not searched: a document of a thousand events is diffed in linear time.
    let previous_by_id = by_id(previous_events);
    let current_by_id = by_id(&current.events);
    let find_previous = |id: &str| previous_by_id.get(id).copied();
    let transition = |kind, event: &ScheduledEvent, previous_status| Transition {
        kind,
        event: event.clone(),
        previous_status,
        incarnation: current.incarnation,
        epoch,
        unobserved: None,
    };

    let mut transitions = Vec::new();
    for event in &current.events {
        let kind = match find_previous(&event.id) {
            None if event.status == EventStatus::Started => Some(TransitionKind::Started),
            None => Some(TransitionKind::Scheduled),
            Some(before)
                if before.status == EventStatus::Scheduled
                    && event.status == EventStatus::Started =>
            {
                Some(TransitionKind::Started)
            }
            Some(before) if before.raw != event.raw => Some(TransitionKind::Updated),
            Some(_) => None,
        };
        if let Some(kind) = kind {
            let previous_status = find_previous(&event.id).map(|before| before.status.clone());
            transitions.push(transition(kind, event, previous_status));
        }
    }
    for before in previous_events {
        if !current_by_id.contains_key(before.id.as_str()) {
            let mut gone = transition(
                TransitionKind::Cancelled,
                before,
                Some(before.status.clone()),
            );
            if before.status == EventStatus::Started {
                gone.kind = TransitionKind::Completed;
            } else if let Some(observation) =
                observation.filter(|_| before.status == EventStatus::Scheduled)
            {
                gone.unobserved = unobserved(before, observation);
            }
            transitions.push(gone);
        }
    }
    transitions
}

#[cfg(test)]
mod tests;
