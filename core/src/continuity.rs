//! Where a fetched document stands against the last processed one, and the incarnation epoch
//! that keeps incarnation-derived ids unique when Azure restarts its numbering.
//!
//! DocumentIncarnation increases whenever the Events array changes, but a redeploy, a
//! deallocate/start (new host) or the service's 24 h disable can restart it, even on the very
//! number the agent stored. So a document is skipped only when its incarnation and its
//! content both equal the last processed one ([`Continuity::Unchanged`]); a lower incarnation,
//! or the same one with other content, is a [`Continuity::Reset`]: it is diffed like any other
//! document, and starts a new epoch.
//!
//! The epoch counts the resets the agent has seen (0 until the first). Ids derived from an
//! incarnation, `document:<n>` and `<EventId>:updated:<n>`, carry it as `<n>~e<epoch>` when it
//! is not 0 ([`incarnation_tag`]), so ids never change in the normal case and never repeat with
//! other content after a reset. `~` is in no GUID, number or `:`-separated segment, and is
//! unreserved in URIs and legal in every binding's headers, so the id keeps its
//! `<kind>:<incarnation>` shape. Per-EventId ids (`<EventId>:scheduled`, `:started`,
//! `:completed`, `:cancelled`) need no epoch: an EventId is a GUID, and each of those
//! transitions happens at most once in its life whatever the numbering does; keeping them
//! stable lets consumers de-duplicate one Azure event across a reset.
//!
//! The agent stores the epoch with the document in one transaction, so re-deriving a document
//! after a failed commit or a crash gives the same epoch and so the same ids.

use std::cmp::Ordering;
use std::collections::BTreeMap;

use serde_json::Value;

use crate::document::{Document, ScheduledEvent};

/// How a fetched document relates to the last processed one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Continuity {
    /// The first document, or a higher incarnation: the normal case.
    Next,
    /// The same incarnation with the same content: Azure promises nothing changed.
    Unchanged,
    /// The incarnation went backwards, or stayed the same with other content: Azure
    /// restarted its numbering.
    Reset,
}

impl Continuity {
    /// Compares `current` with `previous` (None: nothing processed yet).
    pub fn of(previous: Option<&Document>, current: &Document) -> Continuity {
        let Some(previous) = previous else {
            return Continuity::Next;
        };
        match current.incarnation.cmp(&previous.incarnation) {
            Ordering::Greater => Continuity::Next,
            Ordering::Less => Continuity::Reset,
            Ordering::Equal if same_content(previous, current) => Continuity::Unchanged,
            Ordering::Equal => Continuity::Reset,
        }
    }

    /// The epoch of the current document, given the epoch of the previous one.
    pub fn epoch_after(self, epoch: u64) -> u64 {
        match self {
            Continuity::Reset => epoch.saturating_add(1),
            Continuity::Next | Continuity::Unchanged => epoch,
        }
    }
}

/// The incarnation part of an id: `<incarnation>` in epoch 0, else `<incarnation>~e<epoch>`.
pub fn incarnation_tag(incarnation: u64, epoch: u64) -> String {
    if epoch == 0 {
        incarnation.to_string()
    } else {
        format!("{incarnation}~e{epoch}")
    }
}

/// The same information: the same events (each exactly as received, in any order) and the
/// same other top-level fields. JSON objects compare by key, so key order does not matter.
/// (Documents with a repeated EventId, which the parser refuses, can only be built by hand:
/// two such documents are the same if their events are equal in the same order, and may
/// also be when not, as `[x, x, y]` and `[x, y, y]` are.)
///
/// Linear in the document's size, give or take a logarithm: an unchanged document is compared
/// twice a poll, and after a burst it can hold a thousand events (searching the other
/// document for each event cost 6 ms a poll at 1000; `benches/profiling.md`, section 11).
fn same_content(a: &Document, b: &Document) -> bool {
    let contains_all = |a: &Document, b: &Document| {
        let b = by_id(&b.events);
        a.events.iter().all(|event| {
            b.get(event.id.as_str())
                .is_some_and(|other| other.raw == event.raw)
        })
    };
    fn others(document: &Document) -> Vec<(&String, &Value)> {
        let mut fields: Vec<_> = document
            .raw
            .as_object()
            .into_iter()
            .flatten()
            .filter(|(key, _)| *key != "DocumentIncarnation" && *key != "Events")
            .collect();
        fields.sort_by_key(|(key, _)| *key);
        fields
    }
    // What the service sends again it sends in the same order: one pass, no index.
    let same_events = a.events == b.events
        || (a.events.len() == b.events.len() && contains_all(a, b) && contains_all(b, a));
    same_events && others(a) == others(b)
}

/// The events by EventId; the first of each id, as [`Document::event`] finds it.
pub(crate) fn by_id(events: &[ScheduledEvent]) -> BTreeMap<&str, &ScheduledEvent> {
    let mut index = BTreeMap::new();
    for event in events {
        index.entry(event.id.as_str()).or_insert(event);
    }
    index
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::document::EventStatus;
    use serde_json::json;

    fn document(value: Value) -> Document {
        Document::from_value(value).unwrap().document
    }

    #[test]
    fn the_same_incarnation_and_content_is_unchanged_whatever_the_key_or_event_order() {
        let a = json!({"EventId": "a", "EventStatus": "Scheduled", "EventType": "Freeze"});
        let b = json!({"EventType": "Reboot", "EventStatus": "Started", "EventId": "b"});
        let before = document(json!({"DocumentIncarnation": 3, "Events": [a, b]}));
        let b_reordered = json!({"EventId": "b", "EventStatus": "Started", "EventType": "Reboot"});
        let a_reordered =
            json!({"EventType": "Freeze", "EventId": "a", "EventStatus": "Scheduled"});
        let after =
            document(json!({"Events": [b_reordered, a_reordered], "DocumentIncarnation": 3}));
        assert_eq!(Continuity::of(Some(&before), &after), Continuity::Unchanged);
        assert_eq!(Continuity::Unchanged.epoch_after(2), 2);
    }

    #[test]
    fn the_same_incarnation_with_other_content_or_a_lower_one_is_a_reset() {
        let empty = document(json!({"DocumentIncarnation": 1, "Events": []}));
        let one = document(json!({"DocumentIncarnation": 1, "Events": [
            {"EventId": "e", "EventStatus": "Scheduled"}]}));
        let extra_field = document(json!({"DocumentIncarnation": 1, "Events": [], "New": 1}));
        let later = document(json!({"DocumentIncarnation": 5, "Events": []}));
        assert_eq!(Continuity::of(Some(&empty), &one), Continuity::Reset);
        assert_eq!(
            Continuity::of(Some(&empty), &extra_field),
            Continuity::Reset
        );
        assert_eq!(Continuity::of(Some(&later), &empty), Continuity::Reset);
        assert_eq!(Continuity::of(Some(&empty), &later), Continuity::Next);
        assert_eq!(Continuity::of(None, &empty), Continuity::Next);
        assert_eq!(Continuity::Reset.epoch_after(0), 1);
        assert_eq!(Continuity::Next.epoch_after(1), 1);
    }

    /// The definition, one lookup per event: what the indexed comparison must agree with.
    fn same_content_by_search(a: &Document, b: &Document) -> bool {
        let contains_all = |a: &Document, b: &Document| {
            a.events.iter().all(|event| {
                b.event(&event.id)
                    .is_some_and(|other| other.raw == event.raw)
            })
        };
        fn others(d: &Document) -> Vec<(&String, &Value)> {
            let mut fields: Vec<_> = d.raw.as_object().unwrap().iter().collect();
            fields.retain(|(key, _)| *key != "DocumentIncarnation" && *key != "Events");
            fields.sort_by_key(|(key, _)| *key);
            fields
        }
        a.events.len() == b.events.len()
            && contains_all(a, b)
            && contains_all(b, a)
            && others(a) == others(b)
    }

    /// A document of the same incarnation built from a few ids, statuses and an extra field,
    /// so that pairs are often equal, often equal but for order, and often just different.
    fn small_document() -> impl proptest::strategy::Strategy<Value = (Vec<Value>, Option<u8>)> {
        use proptest::prelude::*;
        (
            proptest::collection::vec((0u8..5, any::<bool>(), 0u8..2, 0u8..2), 0..6),
            proptest::option::of(0u8..2),
        )
            .prop_map(|(events, extra)| {
                let mut seen = std::collections::HashSet::new();
                let events = events
                    .into_iter()
                    .filter(|(id, upper, ..)| seen.insert((*id, *upper)))
                    .map(|(id, upper, started, duration)| {
                        json!({"EventId": format!("{}{id}", if upper { "E" } else { "e" }),
                               "EventStatus": if started == 1 { "Started" } else { "Scheduled" },
                               "DurationInSeconds": duration})
                    })
                    .collect();
                (events, extra)
            })
    }

    fn assemble((events, extra): (Vec<Value>, Option<u8>), shuffle: &[usize]) -> Document {
        let mut events = events;
        for (i, j) in shuffle.iter().enumerate() {
            if !events.is_empty() {
                let len = events.len();
                events.swap(i % len, j % len);
            }
        }
        let mut raw = json!({"DocumentIncarnation": 4, "Events": events});
        if let Some(extra) = extra {
            raw["Extra"] = json!(extra);
        }
        document(raw)
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2048))]
        #[test]
        fn unchanged_means_the_same_events_in_any_order_and_the_same_other_fields(
            a in small_document(),
            b in small_document(),
            same in proptest::prelude::any::<bool>(),
            shuffle in proptest::collection::vec(0usize..6, 0..6),
        ) {
            let before = assemble(a.clone(), &[]);
            let after = assemble(if same { a } else { b }, &shuffle);
            let expected = if same_content_by_search(&before, &after) {
                Continuity::Unchanged
            } else {
                Continuity::Reset
            };
            proptest::prop_assert_eq!(Continuity::of(Some(&before), &after), expected);
            proptest::prop_assert_eq!(Continuity::of(Some(&after), &before), expected);
        }
    }

    #[test]
    fn a_document_built_by_hand_compares_by_its_events_not_only_its_raw_json() {
        let event = |status: &str| {
            let raw = json!({"EventId": "e", "EventStatus": status});
            let mut event = document(json!({"DocumentIncarnation": 3, "Events": [raw]}))
                .events
                .remove(0);
            event.status = EventStatus::parse(status);
            event
        };
        let by_hand = |status| Document {
            incarnation: 3,
            events: vec![event(status)],
            raw: json!({}),
        };
        assert_eq!(
            Continuity::of(Some(&by_hand("Scheduled")), &by_hand("Started")),
            Continuity::Reset
        );
    }

    #[test]
    fn identical_documents_built_by_hand_with_a_repeated_event_id_are_unchanged() {
        let event = |status: &str| {
            let raw = json!({"EventId": "x", "EventStatus": status});
            document(json!({"DocumentIncarnation": 3, "Events": [raw]}))
                .events
                .remove(0)
        };
        let repeated = Document {
            incarnation: 3,
            events: vec![event("Scheduled"), event("Started")],
            raw: json!({}),
        };
        assert_eq!(
            Continuity::of(Some(&repeated), &repeated.clone()),
            Continuity::Unchanged
        );
    }

    #[test]
    fn ids_change_only_after_a_reset() {
        assert_eq!(incarnation_tag(7, 0), "7");
        assert_eq!(incarnation_tag(7, 2), "7~e2");
    }
}
