//! What the agent says about each transition once it is stored: an INFO line, the audit
//! trail an operator reads first, and `sched_relay_transitions_total`.

use cloudevents::AttributesReader;
use sched_relay_core::{Event, EventKind};

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
        tracing::info!(
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
