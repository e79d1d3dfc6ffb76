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

use serde_json::Value;

use crate::document::Document;

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
fn same_content(a: &Document, b: &Document) -> bool {
    let contains_all = |a: &Document, b: &Document| {
        a.events.iter().all(|event| {
            b.event(&event.id)
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
    a.events.len() == b.events.len()
        && contains_all(a, b)
        && contains_all(b, a)
        && others(a) == others(b)
}

#[cfg(test)]
mod tests {
    use super::*;
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

    #[test]
    fn ids_change_only_after_a_reset() {
        assert_eq!(incarnation_tag(7, 0), "7");
        assert_eq!(incarnation_tag(7, 2), "7~e2");
    }
}
