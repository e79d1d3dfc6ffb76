//! The operator's controls (issue 36, item 7): maintenance windows, a fleet-wide budget,
//! the pause switch, and a health gate before a place is freed.

use super::{document, feed, policy, published, t0};
use crate::coordinator::fleet::Fleet;
use crate::coordinator::policy::{Budget, Wait, Window, decide, usage};

fn minutes(n: i64) -> chrono::Duration {
    chrono::Duration::minutes(n)
}

fn waits(
    decisions: &crate::coordinator::policy::Decisions,
) -> std::collections::BTreeMap<String, Wait> {
    decisions.waits.iter().cloned().collect()
}

#[test]
fn outside_a_maintenance_window_nothing_is_drained_or_approved_early() {
    let mut fleet = Fleet::default();
    let d = document(1, &[("E1", "Reboot", "Scheduled", &["web-1"], 86_400, -1)]);
    feed(&mut fleet, &published("web-1", None, &d));
    let mut policy = policy(vec![("web", "web-*", Budget::Count(1))], Budget::Count(1));
    // t0 is a Monday at 10:00 UTC; the window is weekday nights.
    policy.groups[0].windows = vec![Window::parse(&["mon-fri".into()], "22:00", "04:00").unwrap()];
    let decisions = decide(&fleet, &policy, t0());
    assert_eq!(waits(&decisions)["E1"], Wait::Window("web".into()));
    assert_eq!(
        decide(&fleet, &policy, t0() + minutes(12 * 60)).steps.len(),
        1
    );
}

#[test]
fn a_fleet_wide_budget_caps_every_group_together() {
    let mut fleet = Fleet::default();
    for (vm, id) in [("web-1", "E1"), ("db-1", "E2"), ("app-1", "E3")] {
        let d = document(1, &[(id, "Reboot", "Scheduled", &[vm], 900, -1)]);
        feed(&mut fleet, &published(vm, None, &d));
    }
    let mut policy = policy(
        vec![
            ("web", "web-*", Budget::Count(1)),
            ("db", "db-*", Budget::Count(1)),
        ],
        Budget::Count(1),
    );
    assert_eq!(decide(&fleet, &policy, t0()).steps.len(), 3);
    policy.fleet_budget = Some(Budget::Count(2));
    let decisions = decide(&fleet, &policy, t0());
    assert_eq!(decisions.steps.len(), 2);
    assert!(matches!(&decisions.waits[0].1, Wait::Budget { group, .. } if group == "fleet"));
}

#[test]
fn a_paused_coordinator_drains_and_approves_nothing() {
    let mut fleet = Fleet::default();
    let d = document(1, &[("E1", "Reboot", "Scheduled", &["web-1"], 900, -1)]);
    feed(&mut fleet, &published("web-1", None, &d));
    let policy = policy(vec![], Budget::Count(1));
    fleet.paused = Some(crate::coordinator::fleet::Pause {
        at: t0(),
        reason: "incident 42".into(),
    });
    let decisions = decide(&fleet, &policy, t0());
    assert_eq!(waits(&decisions)["E1"], Wait::Paused("incident 42".into()));
    fleet.paused = None;
    assert_eq!(decide(&fleet, &policy, t0()).steps.len(), 1);
}

#[test]
fn a_gated_group_keeps_a_vm_down_after_its_event_until_the_health_gate_passes() {
    let mut fleet = Fleet::default();
    let d1 = document(1, &[("R1", "Reboot", "Started", &["web-1"], 0, -1)]);
    feed(&mut fleet, &published("web-1", None, &d1));
    feed(
        &mut fleet,
        &published("web-1", Some(&d1), &document(2, &[])),
    );
    let mut policy = policy(vec![("web", "web-*", Budget::Count(1))], Budget::Count(1));
    assert!(usage(&fleet, &policy, t0()).groups[0].down.is_empty());
    policy.groups[0].gated = true;
    assert_eq!(usage(&fleet, &policy, t0()).groups[0].down.len(), 1);
    fleet
        .events
        .get_mut("R1")
        .unwrap()
        .back
        .get_mut("web-1")
        .unwrap()
        .healthy_at = Some(t0());
    assert!(usage(&fleet, &policy, t0()).groups[0].down.is_empty());
}
