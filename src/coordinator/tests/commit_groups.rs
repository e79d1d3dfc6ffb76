//! Messages the input hands over together are applied in turn and committed once: what is
//! stored is what the last of them left each event and VM, and each is answered (so
//! acknowledged) only after that commit.

use serde_json::Value;

use super::quiet_day::{NowOrNever, delivery, start, subject_of};
use super::{document, published, t0};
use sched_relay_transport::inbound::Answer;

/// The events (but their verdicts, which decisions write in words) and VMs the engine
/// holds, as JSON.
fn held(world: &super::quiet_day::World) -> (Value, Value) {
    let mut events = serde_json::to_value(&world.engine.fleet.events).unwrap();
    for event in events.as_object_mut().unwrap().values_mut() {
        event.as_object_mut().unwrap().remove("verdict");
    }
    (
        events,
        serde_json::to_value(world.engine.fleet.vms()).unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_committed_together_are_stored_as_the_last_of_them_left_each_event_and_vm() {
    let mut world = start(tempfile::tempdir().unwrap());
    let first = document(1, &[]);
    for vm in ["web-0", "web-1"] {
        for event in published(vm, None, &first) {
            world.deliver(&event, t0());
        }
    }
    // web-0's Reboot appears and starts, web-1's Freeze appears, and a copy of the first
    // message comes again (redelivered): one group, as a wave brings them.
    let scheduled = document(2, &[("ev-1", "Reboot", "Scheduled", &["web-0"], 600, -1)]);
    let started = document(3, &[("ev-1", "Reboot", "Started", &["web-0"], 0, -1)]);
    let frozen = document(2, &[("ev-2", "Freeze", "Scheduled", &["web-1"], 600, 5)]);
    let mut messages = published("web-0", Some(&first), &scheduled);
    messages.extend(published("web-0", Some(&scheduled), &started));
    messages.extend(published("web-1", Some(&first), &frozen));
    messages.push(messages[0].clone());
    let (deliveries, answers): (Vec<_>, Vec<_>) = messages
        .iter()
        .map(|event| delivery(event, &subject_of(event)))
        .unzip();
    assert!(deliveries.len() >= 7, "{}", deliveries.len());
    world.engine.deliver_group_with(deliveries, t0(), false);
    for (answer, event) in answers.into_iter().zip(&messages) {
        match answer.blocking_recv_or_now() {
            Answer::Handled(_) => {}
            other => panic!("{other:?} for {event}"),
        }
    }
    let shown = held(&world);
    assert!(
        shown.0["EV-1"]["started_at"].is_string() && shown.0["EV-2"].is_object(),
        "{}",
        shown.0
    );
    // Read back from the store: the last state of each, not the first.
    world.engine.reload();
    assert_eq!(held(&world), shown);
}
