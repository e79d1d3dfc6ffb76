//! The fleet state the agents' events build: an event from Scheduled to Completed, and
//! never moved backwards by redelivered or reordered messages.

use super::{Applied, Fleet, Stage, document, feed, published, t0};

#[test]
fn an_agents_events_build_the_event_from_scheduled_to_completed() {
    let mut fleet = Fleet::default();
    let d1 = document(1, &[("E1", "Reboot", "Scheduled", &["web-1"], 900, -1)]);
    let d2 = document(2, &[("E1", "Reboot", "Started", &["web-1"], 900, -1)]);
    let d3 = document(3, &[]);
    let applied = feed(&mut fleet, &published("web-1", None, &d1));
    assert_eq!(applied[0], Applied::Changed("E1".into()));
    assert_eq!(applied[1], Applied::Agent);
    let m = &fleet.events["E1"];
    assert_eq!(m.event_type, "Reboot");
    assert_eq!(m.resources, ["web-1"]);
    assert_eq!(m.not_before, Some(t0() + chrono::Duration::seconds(900)));
    assert_eq!(m.reports["web-1"].stage, Stage::Scheduled);
    assert!(
        fleet.vms()["web-1"]
            .resource_id
            .as_deref()
            .unwrap()
            .contains("rg-web")
    );
    feed(&mut fleet, &published("web-1", Some(&d1), &d2));
    assert_eq!(fleet.events["E1"].reports["web-1"].stage, Stage::Started);
    feed(&mut fleet, &published("web-1", Some(&d2), &d3));
    assert!(fleet.events["E1"].over());
}

#[test]
fn redelivered_and_reordered_messages_never_move_an_event_backwards() {
    let d1 = document(1, &[("E1", "Reboot", "Scheduled", &["web-1"], 900, -1)]);
    let d2 = document(2, &[("E1", "Reboot", "Started", &["web-1"], 900, -1)]);
    let d3 = document(3, &[]);
    let scheduled = published("web-1", None, &d1).remove(0);
    let started = published("web-1", Some(&d1), &d2).remove(0);
    let completed = published("web-1", Some(&d2), &d3).remove(0);
    let mut fleet = Fleet::default();
    // Completed arrives first, then the older two, then everything again.
    let applied = feed(
        &mut fleet,
        &[completed.clone(), scheduled.clone(), started.clone()],
    );
    assert_eq!(
        applied,
        [
            Applied::Changed("E1".into()),
            Applied::Stale,
            Applied::Stale
        ]
    );
    assert_eq!(fleet.events["E1"].reports["web-1"].stage, Stage::Completed);
    let again = feed(&mut fleet, &[scheduled, started, completed]);
    assert_eq!(
        again,
        [Applied::Duplicate, Applied::Duplicate, Applied::Duplicate]
    );
    assert_eq!(fleet.events["E1"].reports["web-1"].stage, Stage::Completed);
}
