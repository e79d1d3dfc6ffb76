//! What frees a VM's place besides its own report (issue 36, item 3): a heartbeat of its
//! restarted agent, judged by that agent's own clock, and a release by hand, which frees what
//! has happened and never an event still to come.

use super::ceiling::{beat, minutes, waits};
use super::{document, feed, policy, published, t0};
use crate::coordinator::fleet::{Applied, Fleet};
use crate::coordinator::policy::{Budget, Wait, decide, usage};

#[test]
fn a_vm_back_from_a_reboot_with_a_fresh_agent_is_freed_by_its_heartbeat_not_by_time() {
    let mut fleet = Fleet::default();
    let booted = t0() - minutes(600);
    beat(&mut fleet, "web-1", t0(), booted, &[]);
    let d1 = document(1, &[("R1", "Reboot", "Scheduled", &["web-1"], 30, -1)]);
    let d2 = document(2, &[("R1", "Reboot", "Started", &["web-1"], 30, -1)]);
    feed(&mut fleet, &published("web-1", None, &d1));
    beat(&mut fleet, "web-1", t0() + minutes(1), booted, &["R1"]);
    feed(&mut fleet, &published("web-1", Some(&d1), &d2));
    let policy = policy(vec![("web", "web-*", Budget::Count(1))], Budget::Count(1));
    let later = t0() + minutes(5);
    // A heartbeat of the same agent that no longer lists it is no evidence: its document
    // may be stale (an IMDS outage), and the agent reports the end itself.
    beat(&mut fleet, "web-1", later, booted, &[]);
    assert_eq!(usage(&fleet, &policy, later).groups[0].down.len(), 1);
    // The VM rebooted and its agent started with a fresh state: its first document still
    // lists R1 (Started): no evidence yet.
    let restarted = later + minutes(1);
    beat(&mut fleet, "web-1", restarted, restarted, &["R1"]);
    assert_eq!(usage(&fleet, &policy, later).groups[0].down.len(), 1);
    // A second restart, and R1 is gone from its first document: back.
    let again = restarted + minutes(2);
    let applied = beat(&mut fleet, "web-1", again, again, &[]);
    assert_eq!(applied, Applied::Heartbeat(vec!["R1".into()]));
    assert_eq!(fleet.events["R1"].back["web-1"].by, "heartbeat");
    assert!(usage(&fleet, &policy, later).groups[0].down.is_empty());
}

#[test]
fn a_restarted_agent_that_never_showed_an_event_frees_nothing() {
    let mut fleet = Fleet::default();
    let booted = t0() - minutes(600);
    // A host-level Reboot lists web-1 and db-1; db-1's agent restarts (an upgrade) before
    // its document has the event, and its clock runs ahead: no evidence for db-1.
    beat(&mut fleet, "db-1", t0(), booted, &[]);
    let h = document(1, &[("H1", "Reboot", "Started", &["web-1", "db-1"], 0, -1)]);
    feed(&mut fleet, &published("web-1", None, &h));
    let applied = beat(
        &mut fleet,
        "db-1",
        t0() + minutes(1),
        t0() + minutes(30),
        &[],
    );
    assert_eq!(applied, Applied::Heartbeat(Vec::new()));
    let policy = policy(vec![("db", "db-*", Budget::Count(1))], Budget::Count(1));
    assert_eq!(usage(&fleet, &policy, t0()).groups[0].down.len(), 1);
    // An older heartbeat arriving late changes nothing either.
    let late = beat(
        &mut fleet,
        "db-1",
        t0() - minutes(1),
        t0() + minutes(60),
        &[],
    );
    assert_eq!(late, Applied::Heartbeat(Vec::new()));
}

#[test]
fn a_release_by_hand_frees_what_happened_never_an_event_still_to_come() {
    let mut fleet = Fleet::default();
    let d = document(
        1,
        &[
            ("R1", "Reboot", "Started", &["web-1"], 0, -1),
            ("T2", "Terminate", "Scheduled", &["web-1"], 300, -1),
        ],
    );
    feed(&mut fleet, &published("web-1", None, &d));
    assert_eq!(fleet.release("web-1", None, "operator", t0()), ["R1"]);
    assert!(!fleet.events["T2"].back.contains_key("web-1"));
    // T2 (never approved) still counts as one of Azure's starts for an approval's window.
    let d2 = document(1, &[("R2", "Reboot", "Scheduled", &["web-2"], 3600, -1)]);
    feed(&mut fleet, &published("web-2", None, &d2));
    let policy = policy(vec![("web", "web-*", Budget::Count(1))], Budget::Count(1));
    let decisions = decide(&fleet, &policy, t0());
    assert!(
        matches!(&waits(&decisions)["R2"], Wait::Budget { forced, .. } if forced[0].0 == "T2"),
        "{:?}",
        decisions.waits
    );
}
