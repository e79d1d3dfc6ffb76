//! The poller's transitions between their derivation and their commit, and what the agent
//! says about each once it is stored: an INFO line, the audit trail an operator reads first,
//! and `sched_relay_transitions_total`.

use std::sync::Arc;

use cloudevents::AttributesReader;
use sched_relay_core::{Event, EventKind};

/// Transitions handed to the outbox: they go back to the poller's `unstored` when the commit
/// fails, so the next poll stores them, and also when this is dropped unsettled. The commit
/// runs on a blocking thread that a drop does not stop, so a future dropped after its first
/// poll may store them twice (at least once, as when they stayed in `unstored` throughout):
/// the poll loop never drops it, it awaits the commit outside its `select!`s.
pub(super) struct Pending<'a> {
    unstored: &'a mut Vec<Event>,
    events: Option<Arc<[Event]>>,
}

impl<'a> Pending<'a> {
    pub(super) fn new(unstored: &'a mut Vec<Event>, events: Arc<[Event]>) -> Pending<'a> {
        Pending {
            unstored,
            events: Some(events),
        }
    }

    /// Stored: nothing goes back.
    pub(super) fn settle(mut self, stored: bool) {
        if stored {
            self.events = None;
        }
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if let Some(events) = self.events.take() {
            // First, before anything already there.
            self.unstored.splice(0..0, events.iter().cloned());
        }
    }
}

/// Reports the transitions among `events`, which the outbox holds (the `document` snapshot
/// and anything else is not a transition).
pub(super) fn stored(events: &[Event]) {
    for event in events {
        let EventKind::Transition(kind) = event.kind() else {
            continue;
        };
        let transition = kind.as_str();
        let extension = |name| {
            event
                .extension(name)
                .map(|v| v.to_string())
                .unwrap_or_default()
        };
        // The target it always had, for operators' log filters.
        tracing::info!(
            target: "sched_relay::agent::poller",
            event_id = event.subject().unwrap_or_default(),
            transition,
            incarnation = %extension("incarnation"),
            event_type = %extension("eventtype"),
            status = %extension("eventstatus"),
            affects_vm = %extension("affectsvm"),
            unobserved = %extension("unobserved"),
            id = %event.id(),
            "Transition"
        );
        metrics::counter!("sched_relay_transitions_total", "transition" => transition.to_owned())
            .increment(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cloudevents::{EventBuilder, EventBuilderV10};

    fn events(ids: &[&str]) -> Vec<Event> {
        ids.iter()
            .map(|id| {
                EventBuilderV10::new()
                    .id(*id)
                    .source("urn:test")
                    .ty("t")
                    .build()
                    .unwrap()
                    .into()
            })
            .collect()
    }

    fn ids(events: &[Event]) -> Vec<&str> {
        events.iter().map(|event| event.id()).collect()
    }

    #[test]
    fn transitions_whose_commit_failed_or_was_dropped_unsettled_are_kept_in_order() {
        for abandoned in [false, true] {
            let mut unstored = Vec::new();
            let pending = Pending::new(&mut unstored, events(&["a", "b"]).into());
            if abandoned {
                drop(pending);
            } else {
                pending.settle(false);
            }
            assert_eq!(ids(&unstored), ["a", "b"]);
        }
    }

    #[test]
    fn stored_transitions_are_not_kept() {
        let mut unstored = Vec::new();
        Pending::new(&mut unstored, events(&["a"]).into()).settle(true);
        assert!(unstored.is_empty());
    }
}
