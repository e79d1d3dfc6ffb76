//! Host-level events: one event, one approval, several VMs. Which reports it waits for,
//! and which VMs are drained before the approval that takes them all down.

use super::ceiling::{beat, minutes, waits};
use super::{document, feed, policy, published, rules, t0};
use crate::coordinator::fleet::{Drain, Fleet};
use crate::coordinator::policy::{Action, Budget, Policy, Step, Wait, decide, usage};

/// Groups web and db, one VM down at most each, Reboots drained then approved.
fn drain_then_approve() -> Policy {
    let mut policy = policy(
        vec![
            ("web", "web-*", Budget::Count(1)),
            ("db", "db-*", Budget::Count(1)),
        ],
        Budget::Count(5),
    );
    for group in &mut policy.groups {
        group
            .rules
            .extend(rules(&[("Reboot", Action::DrainThenApprove)]));
    }
    policy
}

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
    let policy = drain_then_approve();
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

/// The fault: the event comes to list another VM after its drain (an update of its
/// Resources, or a later report). Its one approval would take that VM down too: it is
/// drained first, alone, and the approval waits for it.
#[test]
fn a_vm_an_event_comes_to_list_after_its_drain_is_drained_before_the_approval() {
    let mut fleet = Fleet::default();
    let h = document(1, &[("H1", "Reboot", "Scheduled", &["web-1"], 900, -1)]);
    feed(&mut fleet, &published("web-1", None, &h));
    let policy = drain_then_approve();
    let drain = |vms: &[&str]| Step::Drain {
        key: "H1".into(),
        vms: vms.iter().map(|vm| vm.to_string()).collect(),
    };
    assert_eq!(decide(&fleet, &policy, t0()).steps, [drain(&["web-1"])]);
    fleet.events.get_mut("H1").unwrap().drain = Some(Drain {
        started_at: t0(),
        deadline: t0() + minutes(10),
        vms: [("web-1".to_owned(), "done".to_owned())].into(),
        finished_at: Some(t0()),
        deadline_missed: false,
    });
    let h2 = document(
        2,
        &[("H1", "Reboot", "Scheduled", &["web-1", "db-1"], 900, -1)],
    );
    feed(&mut fleet, &published("web-1", Some(&h), &h2));
    feed(&mut fleet, &published("db-1", None, &h2));
    assert_eq!(decide(&fleet, &policy, t0()).steps, [drain(&["db-1"])]);
}

/// A VM that left the inventory (scaled in, evicted) while a host-level event listed it, and
/// has not come back, is gone: nothing to drain (a hook would fail on it and leave the
/// others drained until NotBefore), no report to wait for.
#[test]
fn a_listed_vm_that_left_is_neither_drained_nor_waited_for() {
    let mut fleet = Fleet::default();
    beat(&mut fleet, "db-1", t0(), t0() - minutes(600), &[]);
    let h = document(
        1,
        &[("H1", "Reboot", "Scheduled", &["web-1", "db-1"], 900, -1)],
    );
    feed(&mut fleet, &published("web-1", None, &h));
    let mut back_again = fleet.clone();
    fleet.leave("db-1", t0());
    assert_eq!(
        decide(&fleet, &drain_then_approve(), t0()).steps,
        [Step::Drain {
            key: "H1".into(),
            vms: vec!["web-1".into()]
        }]
    );
    // Left is judged from silence: a VM whose agent speaks again is there to drain.
    back_again.leave("db-1", t0());
    beat(&mut back_again, "db-1", t0(), t0() - minutes(600), &[]);
    feed(&mut back_again, &published("db-1", None, &h));
    assert_eq!(
        decide(&back_again, &drain_then_approve(), t0()).steps,
        [Step::Drain {
            key: "H1".into(),
            vms: vec!["web-1".into(), "db-1".into()]
        }]
    );
}

/// The same fault through the engine: the update comes while db-1's drain runs. When it
/// ends, db-2 is drained too, the drain's record keeps both, and only then is the event
/// approved (a drain record replaced rather than added to would drain the two in turn for
/// ever).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_drains_a_vm_an_event_comes_to_list_while_it_drains_before_approving_it() {
    use super::quiet_day::start_with;
    let out = tempfile::tempdir().unwrap();
    let drained = out.path().join("drained");
    let extra = format!(
        "[groups.actions]\nReboot = 'drain_then_approve'\n[drain]\ncommand = ['sh', '-c', 'echo \"$0\" >> {}; sleep 0.5', '{{vmname}}']\n",
        drained.display()
    );
    let mut world = start_with(tempfile::tempdir().unwrap(), &extra);
    let now = chrono::Utc::now();
    // Six db VMs at 34 %: two may be down.
    for n in 1..=6 {
        world.beat(&format!("db-{n}"), now, now - minutes(600), &[]);
    }
    let not_before = (now - t0()).num_seconds() + 24 * 3600;
    let h = document(
        1,
        &[("H1", "Reboot", "Scheduled", &["db-1"], not_before, -1)],
    );
    for event in published("db-1", None, &h) {
        world.deliver(&event, now);
    }
    assert!(
        world.engine.fleet.events["H1"].drain.is_some(),
        "db-1 drains"
    );
    let h2 = document(
        2,
        &[(
            "H1",
            "Reboot",
            "Scheduled",
            &["db-1", "db-2"],
            not_before,
            -1,
        )],
    );
    for event in published("db-1", Some(&h), &h2)
        .into_iter()
        .chain(published("db-2", None, &h2))
    {
        world.deliver(&event, now);
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while world.recorder.approved().is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "not approved; drained: {:?}",
            std::fs::read_to_string(&drained)
        );
        world.settle().await;
    }
    assert_eq!(std::fs::read_to_string(&drained).unwrap(), "db-1\ndb-2\n");
    let drain = world.engine.fleet.events["H1"].drain.clone().unwrap();
    assert_eq!(
        drain.vms,
        [("db-1", "done"), ("db-2", "done")]
            .map(|(vm, state)| (vm.to_owned(), state.to_owned()))
            .into()
    );
    assert_eq!(world.recorder.approved(), ["H1"]);
}

/// The fault: db-1 had no agent while a host-level Reboot listing it ran; web-1's report
/// that it completed freed db-1's place. db-1's agent first speaks after that (installed
/// or started later): it never reports an event gone before it started, and its place was
/// held again for good. An agent that spoke before the end, or whose own document still
/// lists the event, still needs its own evidence.
#[test]
fn a_vm_whose_agent_first_speaks_after_its_event_ended_keeps_its_place_free() {
    let mut fleet = Fleet::default();
    let h = document(
        1,
        &[("H1", "Reboot", "Scheduled", &["web-1", "db-1"], 900, -1)],
    );
    let started = document(2, &[("H1", "Reboot", "Started", &["web-1", "db-1"], 0, -1)]);
    feed(&mut fleet, &published("web-1", None, &h));
    let mut spoke_before = fleet.clone();
    beat(
        &mut spoke_before,
        "db-1",
        t0() - minutes(1),
        t0() - minutes(600),
        &[],
    );
    for fleet in [&mut fleet, &mut spoke_before] {
        feed(fleet, &published("web-1", Some(&h), &started));
        feed(
            fleet,
            &published("web-1", Some(&started), &document(3, &[])),
        );
    }
    let policy = drain_then_approve();
    let db_down = |fleet: &Fleet, at| usage(fleet, &policy, at).groups[1].down.clone();
    assert!(db_down(&fleet, t0()).is_empty(), "freed by web-1's report");
    let later = t0() + minutes(1);
    // Its first heartbeat still lists H1 (its own document has it): held until it does not.
    let mut listing = fleet.clone();
    beat(&mut listing, "db-1", later, later - minutes(1), &["H1"]);
    assert_eq!(db_down(&listing, later).len(), 1, "its document lists H1");
    beat(&mut fleet, "db-1", later, later - minutes(1), &[]);
    assert!(
        db_down(&fleet, later).is_empty(),
        "its agent spoke after the end"
    );
    beat(&mut spoke_before, "db-1", later, t0() - minutes(600), &[]);
    assert_eq!(
        db_down(&spoke_before, later)
            .into_iter()
            .collect::<Vec<_>>(),
        ["db-1"],
        "an agent of db-1 before the end, which has not said it is back"
    );
}
