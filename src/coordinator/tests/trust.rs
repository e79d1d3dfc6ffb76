//! Reports the coordinator can trust (issue 37, item 1): a message that contradicts who a
//! VM is, or whose VM name or EventId could not be Azure's, is refused and counted as a
//! conflict, and never frees a place.

use serde_json::json;

use super::{document, feed, published, t0};
use crate::coordinator::fleet::{Applied, Fleet, Stage, read};

#[test]
fn a_report_without_a_resource_id_for_a_vm_known_with_one_is_refused() {
    let mut fleet = Fleet::default();
    let d1 = document(1, &[("E1", "Reboot", "Started", &["web-1"], 0, -1)]);
    feed(&mut fleet, &published("web-1", None, &d1));
    // A forged "completed" that does not say which resource it comes from.
    let mut forged = published("web-1", Some(&d1), &document(2, &[])).remove(0);
    forged["source"] = json!("urn:sched-relay:vm:web-1");
    forged["data"]["vm"]["resourceId"] = json!(null);
    forged["id"] = json!("E1:completed:forged");
    let applied = fleet.apply(read(&forged).unwrap(), t0());
    assert!(
        matches!(&applied, Applied::Conflict(why) if why.contains("does not say which resource")),
        "{applied:?}"
    );
    assert_eq!(fleet.events["E1"].reports["web-1"].stage, Stage::Started);
    assert!(fleet.conflicts.contains_key("web-1"));
    // So is an outcome of our request that names another resource.
    let outcome = json!({"specversion": "1.0", "type": "com.azure.scheduledevents.approval.accepted",
        "source": "/subscriptions/x/resourceGroups/rg-other/providers/Microsoft.Compute/virtualMachines/web-1",
        "id": "r1:accepted", "vmname": "web-1", "requestid": "r1", "subject": "E1",
        "data": {"eventIds": ["E1"], "reason": "imds_accepted"}});
    assert!(matches!(
        fleet.apply(read(&outcome).unwrap(), t0()),
        Applied::Conflict(_)
    ));
}

#[test]
fn two_vms_whose_names_differ_only_by_dot_and_underscore_cannot_share_an_approvals_subject() {
    let mut fleet = Fleet::default();
    feed(&mut fleet, &published("db_1", None, &document(1, &[])));
    let mut other = published("db.1", None, &document(1, &[])).remove(0);
    other["source"] = json!(
        "/subscriptions/s/resourceGroups/rg-db/providers/Microsoft.Compute/virtualMachines/db.1"
    );
    let applied = fleet.apply(read(&other).unwrap(), t0());
    assert!(
        matches!(&applied, Applied::Conflict(why) if why.contains("share the subject")),
        "{applied:?}"
    );
    assert!(!fleet.vms().contains_key("db.1"));
}

#[test]
fn vm_names_and_event_ids_that_are_not_azures_are_refused_before_they_reach_a_subject() {
    let d = document(1, &[("E1", "Reboot", "Scheduled", &["web-1"], 900, -1)]);
    let good = published("web-1", None, &d).remove(0);
    for name in [
        "web.*.>",
        "web 1",
        "-web",
        "web.",
        "a/b",
        "$(reboot)",
        &"x".repeat(65),
    ] {
        let mut bad = good.clone();
        bad["vmname"] = json!(name);
        assert!(
            read(&bad).unwrap_err().contains("not an Azure VM name"),
            "{name:?}"
        );
    }
    let mut bad = good.clone();
    bad["subject"] = json!("E1;rm");
    bad["data"]["event"]["EventId"] = json!("E1;rm");
    assert!(read(&bad).unwrap_err().contains("is not an EventId"));
    for name in ["vmss_3", "web-1", "WestNO_0", "a.b"] {
        let mut fine = good.clone();
        fine["vmname"] = json!(name);
        assert!(read(&fine).is_ok(), "{name:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_whose_subject_names_another_vm_than_it_speaks_for_is_refused() {
    let mut world = super::quiet_day::start(tempfile::tempdir().unwrap());
    let d1 = document(1, &[("E1", "Reboot", "Started", &["web-2"], 0, -1)]);
    for event in published("web-2", None, &d1) {
        world.deliver(&event, t0());
    }
    // web-1's agent, allowed to publish only under scheduledevents.web-1, says web-2's
    // Reboot completed: refused, whatever the message says.
    let forged = published("web-2", Some(&d1), &document(2, &[])).remove(0);
    world.deliver_on(&forged, t0(), "scheduledevents.web-1.completed");
    let m = &world.engine.fleet.events["E1"];
    assert_eq!(m.reports["web-2"].stage, Stage::Started);
    assert!(world.engine.fleet.conflicts["web-2"].contains("scheduledevents.web-1.completed"));
    // On its own subject the same message is applied.
    world.deliver_on(&forged, t0(), "scheduledevents.web-2.completed");
    assert_eq!(
        world.engine.fleet.events["E1"].reports["web-2"].stage,
        Stage::Completed
    );
}

#[test]
fn a_report_that_lists_fewer_vms_does_not_stop_the_others_counting_as_down() {
    let mut fleet = Fleet::default();
    let both: &[&str] = &["web-1", "web-2"];
    let d1 = document(1, &[("H1", "Redeploy", "Scheduled", both, 900, -1)]);
    feed(&mut fleet, &published("web-2", None, &d1));
    feed(&mut fleet, &published("web-1", None, &d1));
    let policy = super::policy(vec![], super::Budget::Count(5));
    let decisions = super::decide(&fleet, &policy, t0() + chrono::Duration::seconds(10));
    super::approve(&mut fleet, &decisions.steps);
    let down = |fleet: &Fleet| super::usage(fleet, &policy, t0()).groups[0].down.clone();
    assert_eq!(down(&fleet).len(), 2);
    // web-1's agent (or whoever holds its credentials) now says H1 lists web-1 alone.
    let d2 = document(2, &[("H1", "Redeploy", "Scheduled", &["web-1"], 900, -1)]);
    let update = published("web-1", Some(&d1), &d2);
    assert!(!update.is_empty());
    feed(&mut fleet, &update);
    assert_eq!(fleet.events["H1"].reports["web-1"].incarnation, 2);
    assert!(down(&fleet).contains("web-2"), "{:?}", down(&fleet));
}

#[test]
fn only_the_agent_of_a_vm_an_event_concerns_can_say_someone_else_approved_it() {
    let mut fleet = Fleet::default();
    let d = document(1, &[("E1", "Reboot", "Scheduled", &["web-1"], 900, -1)]);
    feed(&mut fleet, &published("web-1", None, &d));
    feed(&mut fleet, &published("db-1", None, &document(1, &[])));
    let outcome = |vm: &str| {
        json!({"specversion": "1.0", "type": "com.azure.scheduledevents.approval.accepted",
            "source": format!("/subscriptions/s/resourceGroups/rg-{}/providers/Microsoft.Compute/virtualMachines/{vm}",
                vm.split('-').next().unwrap()),
            "id": format!("other-{vm}:accepted"), "vmname": vm, "requestid": format!("other-{vm}"),
            "subject": "E1", "data": {"eventIds": ["E1"], "reason": "imds_accepted"}})
    };
    // db-1 has nothing to do with E1: its word would hold web-1's place.
    assert_eq!(
        fleet.apply(read(&outcome("db-1")).unwrap(), t0()),
        Applied::Foreign
    );
    assert!(!fleet.events["E1"].approved_elsewhere);
    // web-1's own agent accepted someone else's approval: E1 is starting.
    assert_eq!(
        fleet.apply(read(&outcome("web-1")).unwrap(), t0()),
        Applied::ApprovedElsewhere(vec!["E1".into()])
    );
}

#[test]
fn one_vm_saying_an_event_starts_later_or_lasts_less_moves_nothing_but_all_of_them_do() {
    let mut fleet = Fleet::default();
    let both: &[&str] = &["web-1", "web-2"];
    let d1 = document(1, &[("F1", "Freeze", "Scheduled", both, 900, 30)]);
    feed(&mut fleet, &published("web-2", None, &d1));
    feed(&mut fleet, &published("web-1", None, &d1));
    let at = |seconds: i64| Some(t0() + chrono::Duration::seconds(seconds));
    // web-1 says F1 is an hour later and lasts 5 s: web-2 still says otherwise.
    let d2 = document(2, &[("F1", "Freeze", "Scheduled", both, 3600, 5)]);
    let update = published("web-1", Some(&d1), &d2);
    assert!(!update.is_empty());
    feed(&mut fleet, &update);
    assert_eq!(fleet.events["F1"].not_before, at(900));
    assert_eq!(fleet.events["F1"].duration_seconds, Some(30));
    // Earlier, or longer, from one VM is taken at once.
    let d3 = document(3, &[("F1", "Freeze", "Scheduled", both, 600, 60)]);
    feed(&mut fleet, &published("web-1", Some(&d2), &d3));
    assert_eq!(fleet.events["F1"].not_before, at(600));
    assert_eq!(fleet.events["F1"].duration_seconds, Some(60));
    // Azure postponed it: once every VM says so, it moves.
    let d4 = document(4, &[("F1", "Freeze", "Scheduled", both, 3600, 5)]);
    feed(&mut fleet, &published("web-2", Some(&d1), &d2));
    feed(&mut fleet, &published("web-1", Some(&d3), &d4));
    assert_eq!(fleet.events["F1"].not_before, at(3600));
    assert_eq!(fleet.events["F1"].duration_seconds, Some(5));
}

#[test]
fn resources_that_are_not_vm_names_or_too_many_are_refused_before_they_reach_the_state() {
    let d = document(1, &[("E1", "Reboot", "Scheduled", &["web-1"], 900, -1)]);
    let good = published("web-1", None, &d).remove(0);
    assert!(read(&good).is_ok());
    let mut bad = good.clone();
    bad["data"]["event"]["Resources"] = json!(["web-1", "$(reboot)"]);
    assert!(
        read(&bad).unwrap_err().contains("not an Azure VM name"),
        "{bad}"
    );
    let many: Vec<String> = (0..=crate::coordinator::fleet::MAX_RESOURCES)
        .map(|n| format!("vm-{n}"))
        .collect();
    bad["data"]["event"]["Resources"] = json!(many);
    assert!(read(&bad).unwrap_err().contains("more than"));
    bad["data"]["event"]["Resources"] = json!("web-1");
    assert!(read(&bad).unwrap_err().contains("expected a list"));
}
