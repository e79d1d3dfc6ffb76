//! `max_down` as a ceiling (issue 36), one test per way it broke: the inventory of quiet
//! VMs, Azure's own starts inside an approval's outage window, places freed only by
//! evidence, host-level events, dry-run answers, updates after an incarnation reset, and
//! the operator's controls. Each test failed before the change it names.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use sched_relay_core::diff::Observation;
use sched_relay_core::event::events_observed;
use serde_json::{Value, json};

use super::{approve, document, feed, policy, published, t0};
use crate::coordinator::fleet::{Applied, Drain, Fleet, Via, read, read_at};
use crate::coordinator::policy::{
    Action, Budget, Matcher, Outage, Rule, Step, Wait, decide, usage,
};

pub(super) fn minutes(n: i64) -> chrono::Duration {
    chrono::Duration::minutes(n)
}

fn resource_id(vm: &str) -> String {
    format!(
        "/subscriptions/s/resourceGroups/rg-{}/providers/Microsoft.Compute/virtualMachines/{vm}",
        vm.split('-').next().unwrap()
    )
}

/// A heartbeat as the agent publishes it (docs/src/events.md, "Heartbeats").
pub(super) fn heartbeat(
    vm: &str,
    at: DateTime<Utc>,
    started_at: DateTime<Utc>,
    events: &[&str],
) -> Value {
    let events: Vec<Value> = events
        .iter()
        .map(|id| json!({"EventId": id, "EventStatus": "Scheduled"}))
        .collect();
    json!({"specversion": "1.0", "type": "com.azure.scheduledevents.heartbeat",
        "source": resource_id(vm), "id": format!("heartbeat:{}", at.timestamp_millis()),
        "subject": "heartbeat", "time": at.to_rfc3339(), "vmname": vm, "partitionkey": vm,
        "incarnation": 1,
        "data": {"vm": {"name": vm, "id": null, "resourceId": resource_id(vm)}, "incarnation": 1,
            "epoch": 0, "agentVersion": "0.1.0", "intervalSeconds": 300,
            "startedAt": started_at.to_rfc3339(), "events": events}})
}

pub(super) fn beat(
    fleet: &mut Fleet,
    vm: &str,
    at: DateTime<Utc>,
    started_at: DateTime<Utc>,
    events: &[&str],
) -> Applied {
    fleet.apply(
        read_at(&heartbeat(vm, at, started_at, events), at, true).unwrap(),
        at,
    )
}

pub(super) fn waits(decisions: &crate::coordinator::policy::Decisions) -> BTreeMap<String, Wait> {
    decisions.waits.iter().cloned().collect()
}

#[test]
fn a_quiet_vm_that_only_heartbeats_is_in_its_group_and_a_percentage_counts_it() {
    let mut fleet = Fleet::default();
    // Ten web VMs, quiet for a day: nothing but heartbeats.
    for i in 0..10 {
        beat(
            &mut fleet,
            &format!("web-{i}"),
            t0(),
            t0() - minutes(600),
            &[],
        );
    }
    let mut policy = policy(
        vec![("web", "web-*", Budget::Percent(20))],
        Budget::Count(1),
    );
    let web = &usage(&fleet, &policy, t0()).groups[0];
    assert_eq!((web.known, web.size, web.limit), (10, 10, 2));
    // The operator's expected size wins when it is larger (a scale set of 20 with ten
    // agents installed so far).
    policy.groups[0].expected_size = Some(20);
    let web = &usage(&fleet, &policy, t0()).groups[0];
    assert_eq!((web.known, web.size, web.limit), (10, 20, 4));
    // Two events at once in a group of ten at 20 %: both approved. Counted over the one
    // VM that reported (the old behaviour), the limit would be 1.
    policy.groups[0].expected_size = None;
    for (vm, id) in [("web-1", "E1"), ("web-2", "E2")] {
        let d = document(2, &[(id, "Reboot", "Scheduled", &[vm], 900, -1)]);
        feed(&mut fleet, &published(vm, None, &d));
    }
    assert_eq!(decide(&fleet, &policy, t0()).steps.len(), 2);
}

#[test]
fn a_host_level_event_counts_a_quiet_peer_in_its_own_group_and_drains_it() {
    let mut fleet = Fleet::default();
    // Groups by resource group: a VM unknown to the coordinator would match none of them.
    let mut policy = policy(
        vec![
            ("web", "*", Budget::Count(1)),
            ("db", "*", Budget::Count(1)),
        ],
        Budget::Count(5),
    );
    for (g, rg) in [(0, "rg-web"), (1, "rg-db")] {
        policy.groups[g].matcher = Matcher {
            resource_group: Some(rg.into()),
            ..Matcher::default()
        };
        policy.groups[g].rules.insert(
            "reboot".into(),
            Rule {
                action: Action::DrainThenApprove,
                max_duration: None,
            },
        );
    }
    // db-2 is down (its Reboot started); db-1 is quiet (heartbeats only).
    beat(&mut fleet, "db-1", t0(), t0() - minutes(600), &[]);
    let d = document(1, &[("R2", "Reboot", "Started", &["db-2"], 0, -1)]);
    feed(&mut fleet, &published("db-2", None, &d));
    // A host-level Reboot lists web-1 and db-1; only web-1's agent has reported it.
    let h = document(
        1,
        &[("H1", "Reboot", "Scheduled", &["web-1", "db-1"], 900, -1)],
    );
    feed(&mut fleet, &published("web-1", None, &h));
    let later = t0() + chrono::Duration::seconds(10);
    let decisions = decide(&fleet, &policy, later);
    assert!(decisions.steps.is_empty(), "{:?}", decisions.steps);
    assert!(
        matches!(&waits(&decisions)["H1"], Wait::Budget { group, .. } if group == "db"),
        "db-1 counts in db, which has db-2 down: {:?}",
        decisions.waits
    );
    // Once db-2 is back, H1 drains both VMs, the quiet one included.
    let d2 = document(2, &[]);
    feed(&mut fleet, &published("db-2", Some(&d), &d2));
    let decisions = decide(&fleet, &policy, later);
    assert_eq!(
        decisions.steps,
        [Step::Drain {
            key: "H1".into(),
            vms: vec!["web-1".into(), "db-1".into()]
        }]
    );
}

#[test]
fn a_vm_whose_agent_missed_three_heartbeats_counts_as_down_until_it_beats_again() {
    let mut fleet = Fleet::default();
    beat(&mut fleet, "web-1", t0(), t0() - minutes(600), &[]);
    beat(&mut fleet, "web-2", t0(), t0() - minutes(600), &[]);
    let d = document(1, &[("E2", "Reboot", "Scheduled", &["web-2"], 3600, -1)]);
    feed(&mut fleet, &published("web-2", None, &d));
    let policy = policy(vec![("web", "web-*", Budget::Count(1))], Budget::Count(1));
    // 3 x 5 min: not yet.
    let at = t0() + minutes(15);
    assert!(usage(&fleet, &policy, at).groups[0].silent.is_empty());
    // Just past: web-1 is silent, so down, and E2 waits for the budget.
    beat(&mut fleet, "web-2", at, t0() - minutes(600), &["E2"]);
    let at = t0() + minutes(16);
    let web = &usage(&fleet, &policy, at).groups[0];
    assert_eq!(web.silent.iter().collect::<Vec<_>>(), ["web-1"]);
    assert_eq!(web.down.iter().collect::<Vec<_>>(), ["web-1"]);
    assert!(decide(&fleet, &policy, at).steps.is_empty());
    // It beats again: up, and E2 may go.
    beat(&mut fleet, "web-1", at, t0() - minutes(600), &[]);
    assert!(usage(&fleet, &policy, at).groups[0].down.is_empty());
    assert_eq!(decide(&fleet, &policy, at).steps.len(), 1);
}

/// Issue 36's run on an independent stand-in: db-045's 30 s Freeze cannot be approved
/// (Freeze up to 9 s), so Azure starts it at its NotBefore; db-056's Reboot, drained and
/// approved just before, was down at the same moment.
fn freeze_and_reboot() -> (Fleet, crate::coordinator::policy::Policy) {
    let mut fleet = Fleet::default();
    let f = document(1, &[("F45", "Freeze", "Scheduled", &["db-045"], 60, 30)]);
    feed(&mut fleet, &published("db-045", None, &f));
    let r = document(1, &[("R56", "Reboot", "Scheduled", &["db-056"], 900, -1)]);
    feed(&mut fleet, &published("db-056", None, &r));
    let mut policy = policy(vec![("db", "db-*", Budget::Count(1))], Budget::Count(1));
    policy.groups[0].rules.insert(
        "freeze".into(),
        Rule {
            action: Action::Approve,
            max_duration: Some(std::time::Duration::from_secs(9)),
        },
    );
    (fleet, policy)
}

#[test]
fn an_approval_leaves_room_for_a_start_azure_makes_inside_its_outage_window() {
    let (fleet, policy) = freeze_and_reboot();
    // Reboot's shipped outage is 10 minutes: F45 starts 60 s from now, inside it.
    let decisions = decide(&fleet, &policy, t0());
    assert!(decisions.steps.is_empty(), "{:?}", decisions.steps);
    let waits = waits(&decisions);
    match &waits["R56"] {
        Wait::Budget {
            group,
            down: 0,
            adds: 1,
            forced,
            limit: 1,
        } => {
            assert_eq!(group, "db");
            assert_eq!(forced[0].0, "F45");
            assert!(waits["R56"].to_string().contains("Azure starts 1 more"));
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(&waits["F45"], Wait::Never(why) if why.contains("30 s")));
    // With an outage that ends before F45's NotBefore (the group says Reboot takes 30 s
    // here), the Reboot fits.
    let mut short = policy.clone();
    short.groups[0].outages.insert(
        "reboot".into(),
        Outage::For(std::time::Duration::from_secs(30)),
    );
    assert_eq!(decide(&fleet, &short, t0()).steps.len(), 1);
}

#[test]
fn a_drained_event_is_checked_again_before_its_approval() {
    let mut fleet = Fleet::default();
    let r = document(1, &[("R56", "Reboot", "Scheduled", &["db-056"], 900, -1)]);
    feed(&mut fleet, &published("db-056", None, &r));
    let (_, policy) = freeze_and_reboot();
    // Nothing else in the window: drained (the place is held from the drain's start)...
    let drain = |fleet: &mut Fleet, done: bool| {
        fleet.events.get_mut("R56").unwrap().drain = Some(Drain {
            started_at: t0(),
            deadline: t0() + minutes(10),
            vms: [(
                "db-056".to_owned(),
                if done { "done" } else { "running" }.to_owned(),
            )]
            .into(),
            finished_at: done.then(t0),
            deadline_missed: false,
        });
    };
    drain(&mut fleet, false);
    assert_eq!(usage(&fleet, &policy, t0()).groups[0].down.len(), 1);
    assert!(
        decide(&fleet, &policy, t0()).steps.is_empty(),
        "drain running"
    );
    // ... and while it ran, Azure scheduled db-045's Freeze a minute ahead.
    let f = document(1, &[("F45", "Freeze", "Scheduled", &["db-045"], 60, 30)]);
    feed(&mut fleet, &published("db-045", None, &f));
    drain(&mut fleet, true);
    let decisions = decide(&fleet, &policy, t0());
    assert!(decisions.steps.is_empty(), "{:?}", decisions.steps);
    assert!(
        matches!(&waits(&decisions)["R56"], Wait::Budget { adds: 1, forced, .. } if forced.len() == 1)
    );
    // Without the Freeze, the drained Reboot is approved.
    let mut alone = fleet.clone();
    alone.events.remove("F45");
    assert_eq!(
        decide(&alone, &policy, t0()).steps,
        [Step::Approve {
            key: "R56".into(),
            approver: "db-056".into(),
            via: Via::Agent,
        }]
    );
}

#[test]
fn a_dry_run_answer_approves_nothing_and_counts_nothing_as_approved_elsewhere() {
    let mut fleet = Fleet::default();
    for (vm, id) in [("web-1", "E1"), ("web-2", "E2")] {
        let d = document(1, &[(id, "Reboot", "Scheduled", &[vm], 900, -1)]);
        feed(&mut fleet, &published(vm, None, &d));
    }
    let policy = policy(vec![("web", "web-*", Budget::Count(1))], Budget::Count(1));
    let steps = decide(&fleet, &policy, t0()).steps;
    approve(&mut fleet, &steps);
    let ours = match &steps[0] {
        Step::Approve { key, .. } => key.clone(),
        other => panic!("{other:?}"),
    };
    let other = if ours == "E1" { "E2" } else { "E1" };
    fleet
        .events
        .get_mut(&ours)
        .unwrap()
        .approval
        .as_mut()
        .unwrap()
        .sent = vec![crate::coordinator::fleet::Sent {
        request_id: "r1".into(),
        signed_at: t0(),
        published_at: Some(t0()),
        via: Via::Agent,
    }];
    let answer = |request: &str, id: &str, event: &str| {
        json!({"specversion": "1.0", "type": "com.azure.scheduledevents.approval.accepted",
            "source": "urn:sched-relay:vm:x", "id": id, "vmname": "web-1", "requestid": request,
            "subject": event, "dryrun": true,
            "data": {"eventIds": [event], "reason": "dry_run", "dryRun": true,
                "vm": {"name": "web-1", "resourceId": resource_id("web-1")}}})
    };
    let applied = fleet.apply(read(&answer("r1", "a1", &ours)).unwrap(), t0());
    assert_eq!(applied, Applied::DryRun(Some(ours.clone())));
    let approval = fleet.events[&ours].approval.as_ref().unwrap();
    assert_eq!(
        (approval.outcome.is_none(), approval.dry_run_answers),
        (true, 1)
    );
    // Someone else's request, answered in dry run: the other event is not starting.
    let applied = fleet.apply(read(&answer("theirs", "a2", other)).unwrap(), t0());
    assert_eq!(applied, Applied::DryRun(None));
    assert!(!fleet.events[other].approved_elsewhere);
}

#[test]
fn an_update_after_an_incarnation_reset_is_applied_by_its_epoch() {
    let factory = super::agent_factory("web-1", Some(&resource_id("web-1")));
    let observed = |before: Option<&sched_relay_core::document::Document>,
                    after: &sched_relay_core::document::Document,
                    epoch: u64| {
        let observation = Observation {
            epoch,
            ..Observation::at(t0())
        };
        events_observed(&factory, before, after, false, &observation)
            .into_iter()
            .map(|e| serde_json::to_value(e).unwrap())
            .collect::<Vec<_>>()
    };
    let mut fleet = Fleet::default();
    let d1 = document(50, &[("E1", "Reboot", "Scheduled", &["web-1"], 900, -1)]);
    feed(&mut fleet, &observed(None, &d1, 0));
    // Azure restarted the numbering; the same event moves to a later NotBefore.
    let d2 = document(3, &[("E1", "Reboot", "Scheduled", &["web-1"], 1800, -1)]);
    let update = observed(Some(&d1), &d2, 1);
    assert!(
        update[0]["id"].as_str().unwrap().ends_with("~e1"),
        "{update:?}"
    );
    assert_eq!(feed(&mut fleet, &update), [Applied::Changed("E1".into())]);
    assert_eq!(
        fleet.events["E1"].not_before,
        Some(t0() + chrono::Duration::seconds(1800))
    );
}

#[test]
fn an_approval_is_charged_only_until_its_own_not_before_when_azure_would_start_it_anyway() {
    // Two Redeploys with Azure's 10-minute notice, a minute apart, and the shipped 15-minute
    // outage: approving the first now adds downtime only until its NotBefore, before the
    // second is due. Charged its whole outage, neither would ever be approved early.
    let mut fleet = Fleet::default();
    for (vm, id, at) in [("web-1", "A", 600), ("web-2", "B", 660)] {
        let d = document(1, &[(id, "Redeploy", "Scheduled", &[vm], at, -1)]);
        feed(&mut fleet, &published(vm, None, &d));
    }
    let policy = policy(vec![("web", "web-*", Budget::Count(1))], Budget::Count(1));
    let decisions = decide(&fleet, &policy, t0());
    assert_eq!(
        decisions.steps,
        [Step::Approve {
            key: "A".into(),
            approver: "web-1".into(),
            via: Via::Agent,
        }]
    );
}

#[test]
fn heartbeats_and_events_with_absurd_numbers_are_refused_or_bounded_never_a_panic() {
    let mut beat = heartbeat("web-1", t0(), t0(), &[]);
    for interval in [
        json!(0),
        json!(10_000_000_000_000_000u64),
        json!(-1),
        json!(3601),
    ] {
        beat["data"]["intervalSeconds"] = interval.clone();
        let error = read_at(&beat, t0(), true).unwrap_err();
        assert!(error.contains("intervalSeconds"), "{interval}: {error}");
    }
    beat["data"]["intervalSeconds"] = json!(300);
    beat["data"]["events"] = json!(vec![json!({"EventId": "E"}); 257]);
    assert!(
        read_at(&beat, t0(), true)
            .unwrap_err()
            .contains("more than 256")
    );
    // A Freeze "lasting" longer than a date can count, with no max_duration: decided, no
    // panic (its window is until its NotBefore).
    let mut fleet = Fleet::default();
    let d = document(
        1,
        &[(
            "F1",
            "Freeze",
            "Scheduled",
            &["web-1"],
            900,
            9_000_000_000_000_000,
        )],
    );
    feed(&mut fleet, &published("web-1", None, &d));
    let policy = policy(vec![], Budget::Count(1));
    assert_eq!(decide(&fleet, &policy, t0()).steps.len(), 1);
}
