//! Host-level events: one event, one approval, several VMs. Which reports it waits for,
//! and which VMs are drained before the approval that takes them all down.

use super::ceiling::{beat, minutes, waits};
use super::{document, feed, policy, published, t0};
use crate::coordinator::fleet::Fleet;
use crate::coordinator::policy::{Action, Budget, Rule, Step, Wait, decide};

/// The fault: db-1's agent has not spoken yet when web-1 reports the event (it started
/// after the coordinator, or is slower than its peer). Its report is waited for, since it
/// would place db-1 by its resource id; without it, the one approval through web-1 still
/// starts the event on db-1, so db-1 is drained by name like any VM the event lists.
#[test]
fn a_host_level_event_drains_a_listed_vm_that_no_agent_has_spoken_for_yet() {
    let mut fleet = Fleet::default();
    let h = document(
        1,
        &[("H1", "Reboot", "Scheduled", &["web-1", "db-1"], 900, -1)],
    );
    feed(&mut fleet, &published("web-1", None, &h));
    let mut policy = policy(
        vec![
            ("web", "web-*", Budget::Count(1)),
            ("db", "db-*", Budget::Count(1)),
        ],
        Budget::Count(5),
    );
    for group in &mut policy.groups {
        group.rules.insert(
            "reboot".into(),
            Rule {
                action: Action::DrainThenApprove,
                max_duration: None,
            },
        );
    }
    let decisions = decide(&fleet, &policy, t0());
    assert_eq!(waits(&decisions)["H1"], Wait::Reports(vec!["db-1".into()]));
    let late = t0() + chrono::Duration::seconds(5);
    assert_eq!(
        decide(&fleet, &policy, late).steps,
        [Step::Drain {
            key: "H1".into(),
            vms: vec!["web-1".into(), "db-1".into()]
        }]
    );
}

#[test]
fn a_host_level_event_waits_up_to_report_wait_for_live_agents_and_vms_nobody_spoke_for() {
    let mut fleet = Fleet::default();
    beat(&mut fleet, "db-1", t0(), t0() - minutes(600), &[]);
    let h = document(
        1,
        &[(
            "H1",
            "Reboot",
            "Scheduled",
            &["web-1", "db-1", "db-9"],
            900,
            -1,
        )],
    );
    feed(&mut fleet, &published("web-1", None, &h));
    let policy = policy(vec![], Budget::Count(5));
    // db-1 has a live agent and has not reported it; nobody has spoken for db-9 yet.
    let decisions = decide(&fleet, &policy, t0());
    assert_eq!(
        waits(&decisions)["H1"],
        Wait::Reports(vec!["db-1".into(), "db-9".into()])
    );
    // Their reports arrive: decided at once.
    feed(&mut fleet, &published("db-1", None, &h));
    feed(&mut fleet, &published("db-9", None, &h));
    assert_eq!(decide(&fleet, &policy, t0()).steps.len(), 1);
    // Or report_wait passes without them.
    let mut fleet2 = Fleet::default();
    beat(&mut fleet2, "db-1", t0(), t0() - minutes(600), &[]);
    feed(&mut fleet2, &published("web-1", None, &h));
    let late = t0() + chrono::Duration::seconds(5);
    assert_eq!(decide(&fleet2, &policy, late).steps.len(), 1);
    // A silent agent is not waited for (db-9 still is).
    let mut fleet3 = Fleet::default();
    beat(
        &mut fleet3,
        "db-1",
        t0() - minutes(20),
        t0() - minutes(600),
        &[],
    );
    feed(&mut fleet3, &published("web-1", None, &h));
    let decisions = decide(&fleet3, &policy, t0());
    assert_eq!(waits(&decisions)["H1"], Wait::Reports(vec!["db-9".into()]));
}
