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
//! - the same incarnation twice yields nothing: Azure promises the same information.
//!
//! Order: events of the current document in document order, then disappeared events in the
//! order of the previous document. Each EventId yields at most one transition per document,
//! so per-EventId order is the document order.

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
}

impl Transition {
    /// The deterministic CloudEvents id: `<EventId>:<transition>`, or
    /// `<EventId>:updated:<incarnation>` since one event can be updated many times.
    pub fn id(&self) -> String {
        match self.kind {
            TransitionKind::Updated => format!("{}:updated:{}", self.event.id, self.incarnation),
            kind => format!("{}:{}", self.event.id, kind.as_str()),
        }
    }
}

/// The transitions from `previous` (None: the first document the agent sees) to `current`.
pub fn diff(previous: Option<&Document>, current: &Document) -> Vec<Transition> {
    let previous_events: &[ScheduledEvent] = match previous {
        Some(previous) if previous.incarnation == current.incarnation => return Vec::new(),
        Some(previous) => &previous.events,
        None => &[],
    };
    let find_previous = |id: &str| previous_events.iter().find(|event| event.id == id);
    let transition = |kind, event: &ScheduledEvent, previous_status| Transition {
        kind,
        event: event.clone(),
        previous_status,
        incarnation: current.incarnation,
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
        if current.event(&before.id).is_none() {
            let kind = if before.status == EventStatus::Started {
                TransitionKind::Completed
            } else {
                TransitionKind::Cancelled
            };
            transitions.push(transition(kind, before, Some(before.status.clone())));
        }
    }
    transitions
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;
    use std::collections::HashMap;

    fn document(incarnation: u64, events: &[(&str, &str, &str)]) -> Document {
        let events: Vec<_> = events
            .iter()
            .map(|(id, status, not_before)| {
                json!({"EventId": id, "EventStatus": status, "EventType": "Reboot",
                       "Resources": ["vm0"], "NotBefore": not_before})
            })
            .collect();
        Document::from_value(json!({"DocumentIncarnation": incarnation, "Events": events}))
            .unwrap()
            .document
    }

    fn kinds(transitions: &[Transition]) -> Vec<(String, TransitionKind)> {
        transitions
            .iter()
            .map(|t| (t.event.id.clone(), t.kind))
            .collect()
    }

    #[test]
    fn event_seen_first_as_started_yields_started_only() {
        let transitions = diff(None, &document(10, &[("hw", "Started", "")]));
        assert_eq!(
            kinds(&transitions),
            [("hw".into(), TransitionKind::Started)]
        );
        assert_eq!(transitions[0].previous_status, None);
    }

    #[test]
    fn start_with_a_cleared_not_before_is_started_not_updated() {
        let before = document(2, &[("e", "Scheduled", "Mon, 11 Apr 2022 22:26:58 GMT")]);
        let after = document(3, &[("e", "Started", "")]);
        let transitions = diff(Some(&before), &after);
        assert_eq!(kinds(&transitions), [("e".into(), TransitionKind::Started)]);
        assert_eq!(transitions[0].previous_status, Some(EventStatus::Scheduled));
    }

    #[test]
    fn disappearance_is_completed_after_started_and_cancelled_before() {
        let before = document(5, &[("a", "Started", ""), ("b", "Scheduled", "x")]);
        let transitions = diff(Some(&before), &document(6, &[]));
        assert_eq!(
            kinds(&transitions),
            [
                ("a".into(), TransitionKind::Completed),
                ("b".into(), TransitionKind::Cancelled)
            ]
        );
        assert_eq!(transitions[0].id(), "a:completed");
    }

    #[test]
    fn updated_ids_carry_the_incarnation() {
        let before = document(8, &[("e", "Scheduled", "Mon, 19 Sep 2016 18:29:47 GMT")]);
        let after = document(9, &[("e", "Scheduled", "Mon, 19 Sep 2016 18:45:00 GMT")]);
        let transitions = diff(Some(&before), &after);
        assert_eq!(transitions[0].id(), "e:updated:9");
    }

    #[test]
    fn same_incarnation_yields_nothing_even_if_content_differs() {
        let before = document(4, &[("e", "Scheduled", "x")]);
        let after = document(4, &[("e", "Started", "")]);
        assert!(diff(Some(&before), &after).is_empty());
    }

    // --- properties -------------------------------------------------------------------

    /// Where one Azure event is in its documented life cycle at one incarnation.
    #[derive(Debug, Clone, Copy, PartialEq)]
    enum Phase {
        Absent,
        Scheduled(u8),
        Started(u8),
        Gone,
    }

    /// Random sequences of documents in which every event follows Azure's life cycle:
    /// absent -> (Scheduled, possibly with NotBefore updates) -> Started -> gone, with the
    /// scheduled phase skippable (host failure) and the started phase skippable (cancelled).
    fn lifecycle_documents() -> impl Strategy<Value = Vec<Document>> {
        (1usize..5, 1usize..12)
            .prop_flat_map(|(event_count, steps)| {
                proptest::collection::vec(proptest::collection::vec(0u8..5, event_count), steps)
            })
            .prop_map(|moves| {
                let events = moves[0].len();
                let mut phases = vec![Phase::Absent; events];
                let mut documents = Vec::new();
                for (step, choices) in moves.iter().enumerate() {
                    for (phase, choice) in phases.iter_mut().zip(choices) {
                        *phase = match (*phase, choice) {
                            (Phase::Absent, 1) => Phase::Scheduled(0),
                            (Phase::Absent, 2) => Phase::Started(0),
                            (Phase::Scheduled(n), 1) => Phase::Scheduled(n + 1),
                            (Phase::Scheduled(_), 2) => Phase::Started(0),
                            (Phase::Scheduled(_), 3) | (Phase::Started(_), 3) => Phase::Gone,
                            (Phase::Started(n), 4) => Phase::Started(n + 1),
                            (phase, _) => phase,
                        }
                    }
                    let items: Vec<_> = phases
                        .iter()
                        .enumerate()
                        .filter_map(|(i, phase)| {
                            let (status, detail) = match phase {
                                Phase::Scheduled(n) => ("Scheduled", *n),
                                Phase::Started(n) => ("Started", *n),
                                _ => return None,
                            };
                            Some(json!({"EventId": format!("E{i}"), "EventStatus": status,
                                        "DurationInSeconds": detail}))
                        })
                        .collect();
                    let raw = json!({"DocumentIncarnation": step + 1, "Events": items});
                    documents.push(Document::from_value(raw).unwrap().document);
                }
                documents
            })
    }

    fn run(documents: &[Document]) -> Vec<Transition> {
        let mut previous: Option<&Document> = None;
        let mut all = Vec::new();
        for document in documents {
            all.extend(diff(previous, document));
            previous = Some(document);
        }
        all
    }

    /// A legal path: scheduled (updated)* [started (updated)* [completed]] | scheduled
    /// (updated)* cancelled | started (updated)* [completed].
    fn is_legal_path(kinds: &[TransitionKind]) -> bool {
        use TransitionKind::*;
        let mut state = "new";
        for kind in kinds {
            state = match (state, kind) {
                ("new", Scheduled) => "scheduled",
                ("new", Started) | ("scheduled", Started) => "started",
                ("scheduled", Updated) => "scheduled",
                ("started", Updated) => "started",
                ("scheduled", Cancelled) | ("started", Completed) => "ended",
                _ => return false,
            }
        }
        true
    }

    proptest! {
        #[test]
        fn every_event_id_follows_a_legal_path(documents in lifecycle_documents()) {
            let mut paths: HashMap<String, Vec<TransitionKind>> = HashMap::new();
            for transition in run(&documents) {
                paths.entry(transition.event.id.clone()).or_default().push(transition.kind);
            }
            for (id, path) in paths {
                prop_assert!(is_legal_path(&path), "{id}: {path:?}");
            }
        }

        #[test]
        fn the_same_document_twice_yields_nothing(documents in lifecycle_documents()) {
            for document in &documents {
                prop_assert!(diff(Some(document), document).is_empty());
            }
        }

        #[test]
        fn ids_are_deterministic_and_unique(documents in lifecycle_documents()) {
            let first: Vec<String> = run(&documents).iter().map(Transition::id).collect();
            let second: Vec<String> = run(&documents).iter().map(Transition::id).collect();
            prop_assert_eq!(&first, &second);
            let unique: std::collections::HashSet<_> = first.iter().collect();
            prop_assert_eq!(unique.len(), first.len(), "an id was reused: {:?}", first);
        }

        #[test]
        fn every_event_change_is_reported_and_nothing_else(documents in lifecycle_documents()) {
            // Replaying the transitions over an empty view must rebuild each document exactly:
            // nothing missed, nothing invented.
            let mut view: HashMap<String, ScheduledEvent> = HashMap::new();
            let mut previous: Option<&Document> = None;
            for document in &documents {
                for transition in diff(previous, document) {
                    match transition.kind {
                        TransitionKind::Completed | TransitionKind::Cancelled => {
                            prop_assert!(view.remove(&transition.event.id).is_some());
                        }
                        _ => { view.insert(transition.event.id.clone(), transition.event); }
                    }
                }
                prop_assert_eq!(view.len(), document.events.len());
                for event in &document.events {
                    prop_assert_eq!(view.get(&event.id), Some(event));
                }
                previous = Some(document);
            }
        }

        #[test]
        fn arbitrary_documents_never_panic_and_respect_order(
            statuses in proptest::collection::vec(
                proptest::collection::vec((0u8..6, 0u8..4), 0..6), 1..8)
        ) {
            let names = ["Scheduled", "Started", "Paused"];
            let documents: Vec<Document> = statuses.iter().enumerate().map(|(step, events)| {
                let mut seen = std::collections::HashSet::new();
                let items: Vec<_> = events.iter()
                    .filter(|(id, _)| seen.insert(*id))
                    .map(|(id, status)| json!({"EventId": format!("E{id}"),
                        "EventStatus": names[*status as usize % 3], "Extra": status}))
                    .collect();
                Document::from_value(json!({"DocumentIncarnation": step, "Events": items}))
                    .unwrap().document
            }).collect();
            let transitions = run(&documents);
            for pair in transitions.windows(2) {
                prop_assert!(pair[0].incarnation <= pair[1].incarnation);
            }
        }
    }
}
