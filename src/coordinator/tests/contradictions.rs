//! What a hostile review found, as tests: contradicting reports, events without a
//! NotBefore, approvals by someone else, VMs that never report their end, outcomes of old
//! requests.

use serde_json::json;

use super::{document, feed, policy, published, t0};
use crate::coordinator::fleet::{Applied, Approval, Fleet, Stage, Via, read};
use crate::coordinator::policy::{Budget, decide, usage};

/// web-1's resource id, as `published` and its agent's outcomes say it.
const RG_WEB_1: &str =
    "/subscriptions/s/resourceGroups/rg-web/providers/Microsoft.Compute/virtualMachines/web-1";

#[test]
fn a_report_of_another_type_leaves_the_event_to_azure_and_one_of_another_identity_is_not_applied() {
    let mut fleet = Fleet::default();
    let terminate = document(1, &[("T1", "Terminate", "Scheduled", &["web-1"], 900, -1)]);
    feed(&mut fleet, &published("web-1", None, &terminate));
    // Another publisher says T1 is a short Freeze: refused, the type stays.
    let freeze = document(1, &[("T1", "Freeze", "Scheduled", &["web-1"], 900, 5)]);
    let applied = feed(&mut fleet, &published("web-2", None, &freeze));
    assert!(
        matches!(&applied[0], Applied::Conflict(why) if why.contains("Terminate")),
        "{applied:?}"
    );
    assert_eq!(fleet.events["T1"].event_type, "Terminate");
    assert_eq!(fleet.events["T1"].duration_seconds, Some(-1));
    // Which of the two is right is unknown: both reports are kept (web-2's Started would
    // count), and the event is never approved.
    assert!(fleet.events["T1"].reports.contains_key("web-2"));
    let decisions = decide(&fleet, &policy(vec![], Budget::Count(5)), t0());
    assert!(decisions.steps.is_empty());
    assert!(
        decisions.waits.iter().any(|(key, wait)| key == "T1"
            && matches!(wait, crate::coordinator::policy::Wait::Never(why) if why.contains("disagree"))),
        "{:?}",
        decisions.waits
    );
    // A second VM by the same name with another resource id: refused.
    let mut other = published("web-1", Some(&terminate), &document(2, &[]))[0].clone();
    other["source"] = json!(
        "/subscriptions/other/resourceGroups/rg-x/providers/Microsoft.Compute/virtualMachines/web-1"
    );
    other["data"]["vm"]["resourceId"] = other["source"].clone();
    let applied = fleet.apply(read(&other).unwrap(), t0());
    assert!(
        matches!(&applied, Applied::Conflict(why) if why.contains("share a name")),
        "{applied:?}"
    );
    assert_eq!(fleet.events["T1"].reports["web-1"].stage, Stage::Scheduled);
}

#[test]
fn a_scheduled_event_without_a_readable_not_before_is_refused() {
    let d1 = document(1, &[("E1", "Reboot", "Scheduled", &["web-1"], 900, -1)]);
    let mut event = published("web-1", None, &d1).remove(0);
    event["data"]["event"]["NotBefore"] = json!("");
    assert!(read(&event).unwrap_err().contains("NotBefore"));
    event["data"]["event"]["NotBefore"] = json!("tomorrow");
    assert!(read(&event).unwrap_err().contains("NotBefore"));
}

#[test]
fn an_event_approved_by_someone_else_counts_against_the_budget_at_once() {
    let mut fleet = Fleet::default();
    for (vm, id) in [("web-1", "E1"), ("web-2", "E2")] {
        let d = document(1, &[(id, "Reboot", "Scheduled", &[vm], 900, -1)]);
        feed(&mut fleet, &published(vm, None, &d));
    }
    // web-1's agent approved E1 by its local policy: accepted, a request id not ours.
    let outcome = json!({"specversion": "1.0", "type": "com.azure.scheduledevents.approval.accepted",
        "source": "urn:sched-relay:vm:web-1", "id": "policy:E1:accepted", "vmname": "web-1",
        "requestid": "policy:E1", "subject": "E1", "data": {"eventIds": ["E1"], "reason": "policy",
        "vm": {"name": "web-1", "resourceId": RG_WEB_1}}});
    assert_eq!(
        fleet.apply(read(&outcome).unwrap(), t0()),
        Applied::ApprovedElsewhere(vec!["E1".into()])
    );
    let policy = policy(vec![("web", "web-*", Budget::Count(1))], Budget::Count(1));
    let decisions = decide(&fleet, &policy, t0());
    assert!(decisions.steps.is_empty(), "{:?}", decisions.steps);
    assert_eq!(usage(&fleet, &policy, t0()).groups[0].down.len(), 1);
}

#[test]
fn a_held_event_past_max_hold_is_alerted_on_and_keeps_its_place_until_evidence() {
    let mut fleet = Fleet::default();
    let d1 = document(1, &[("P1", "Reboot", "Scheduled", &["web-1"], 30, -1)]);
    let d2 = document(2, &[("P1", "Reboot", "Started", &["web-1"], 30, -1)]);
    feed(&mut fleet, &published("web-1", None, &d1));
    feed(&mut fleet, &published("web-1", Some(&d1), &d2));
    // The Started report carries no NotBefore: the one it was scheduled for is kept.
    assert_eq!(
        fleet.events["P1"].not_before,
        Some(t0() + chrono::Duration::seconds(30))
    );
    // The VM never comes back: an hour past NotBefore it is overdue, and still down.
    let policy = policy(vec![("web", "web-*", Budget::Count(1))], Budget::Count(1));
    let at =
        |fleet: &Fleet, minutes| usage(fleet, &policy, t0() + chrono::Duration::minutes(minutes));
    let web = &at(&fleet, 30).groups[0];
    assert_eq!((web.down.len(), web.overdue.len()), (1, 0));
    let web = &at(&fleet, 62).groups[0];
    assert_eq!((web.down.len(), web.overdue.len()), (1, 1), "{web:?}");
    let web = &at(&fleet, 60 * 24 * 30).groups[0];
    assert_eq!(web.down.len(), 1, "time alone never frees a place");
    // An operator releases it by hand.
    fleet.release("web-1", None, "operator", t0());
    assert!(at(&fleet, 62).groups[0].down.is_empty());
}

#[test]
fn only_the_newest_request_s_failure_counts_and_an_acceptance_of_any_is_final() {
    let mut fleet = Fleet::default();
    let d = document(1, &[("E1", "Reboot", "Scheduled", &["web-1"], 900, -1)]);
    feed(&mut fleet, &published("web-1", None, &d));
    let sent = |id: &str| crate::coordinator::fleet::Sent {
        request_id: id.into(),
        signed_at: t0(),
        published_at: Some(t0()),
        via: Via::Agent,
    };
    fleet.events.get_mut("E1").unwrap().approval = Some(Approval {
        approver: "web-1".into(),
        via: Via::Agent,
        decided_at: t0(),
        dry_run: false,
        sent: vec![sent("r1"), sent("r2")],
        outcome: None,
        abandoned: false,
        dry_run_answers: 0,
    });
    let outcome = |request: &str, kind: &str, n: u32| {
        json!({"specversion": "1.0",
        "type": format!("com.azure.scheduledevents.approval.{kind}"), "source": "urn:sched-relay:vm:web-1",
        "id": format!("{request}:{kind}:{n}"), "vmname": "web-1", "requestid": request, "subject": "E1",
        "data": {"eventIds": ["E1"], "reason": if kind == "failed" { "imds_error" } else { "imds_accepted" },
            "vm": {"name": "web-1", "resourceId": RG_WEB_1}}})
    };
    fleet.apply(read(&outcome("r1", "failed", 1)).unwrap(), t0());
    assert!(
        fleet.events["E1"]
            .approval
            .as_ref()
            .unwrap()
            .outcome
            .is_none(),
        "an older request's failure"
    );
    fleet.apply(read(&outcome("r1", "accepted", 2)).unwrap(), t0());
    fleet.apply(read(&outcome("r2", "failed", 3)).unwrap(), t0());
    let outcome = fleet.events["E1"]
        .approval
        .as_ref()
        .unwrap()
        .outcome
        .clone()
        .unwrap();
    assert_eq!(
        (outcome.outcome.as_str(), outcome.request_id.as_str()),
        ("accepted", "r1")
    );
}
