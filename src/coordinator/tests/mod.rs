//! The coordinator's pure parts on the agents' real events (made by the core's own event
//! factory from documents): the fleet state under redelivery and reordering, and the
//! decisions under budgets, including a property test that no decision ever takes a group
//! over its budget.

use std::{collections::BTreeMap, time::Duration};

use chrono::{DateTime, TimeZone, Utc};
use proptest::prelude::*;
use sched_relay_core::document::Document;
use sched_relay_core::event::{EventFactory, Identity, PartitionKey, events_for_document};
use serde_json::{Value, json};

#[cfg(feature = "azure")]
mod arm;
#[cfg(feature = "azure")]
mod azure;
mod ceiling;
mod commit_groups;
mod config;
mod contradictions;
mod controls;
mod endpoints;
mod evidence;
#[cfg(feature = "nats")]
mod first_decision;
mod fleet_parts;
mod fleet_state;
#[cfg(feature = "azure")]
mod fleet_view;
mod groups;
mod host_level;
mod model;
mod pacing;
mod placement;
pub(crate) mod quiet_day;
mod trust;

use super::fleet::{Applied, Approval, Fleet, Stage, Via, read};
use super::policy::{
    Action, Budget, Group, Matcher, Policy, Rule, Step, Wait, decide, glob, usage,
};

pub(crate) fn t0() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2026, 11, 23, 10, 0, 0).unwrap()
}

/// `(EventId, EventType, EventStatus, Resources, NotBefore in seconds from t0, duration)`.
pub(crate) type Ev<'a> = (&'a str, &'a str, &'a str, &'a [&'a str], i64, i64);

pub(crate) fn document(incarnation: u64, events: &[Ev]) -> Document {
    let events: Vec<Value> = events
        .iter()
        .map(|(id, ty, status, resources, not_before, duration)| {
            json!({"EventId": id, "EventType": ty, "EventStatus": status, "ResourceType": "VirtualMachine",
                   "Resources": resources, "EventSource": "Platform", "DurationInSeconds": duration,
                   "NotBefore": (t0() + chrono::Duration::seconds(*not_before)).to_rfc2822().replace("+0000", "GMT"),
                   "Description": "", "EventStatusChanged": null})
        })
        .collect();
    let body = json!({"DocumentIncarnation": incarnation, "Events": events}).to_string();
    Document::parse(body.as_bytes()).unwrap().document
}

/// What `vm`'s agent publishes when its document goes from `before` to `after`.
pub(crate) fn published(vm: &str, before: Option<&Document>, after: &Document) -> Vec<Value> {
    let resource_id = format!(
        "/subscriptions/s/resourceGroups/rg-{}/providers/Microsoft.Compute/virtualMachines/{vm}",
        vm.split('-').next().unwrap()
    );
    published_as(vm, &resource_id, before, after, t0())
}

/// The event factory of `vm`'s agent, as it is configured by default, reporting
/// `resource_id` (none: an agent that does not know it).
pub(crate) fn agent_factory(vm: &str, resource_id: Option<&str>) -> EventFactory {
    EventFactory::new(
        "com.azure.scheduledevents",
        None,
        Identity {
            name: vm.into(),
            vm_id: None,
            resource_id: resource_id.map(Into::into),
        },
        PartitionKey::EventId,
    )
}

/// [`published`] by an agent that reports `resource_id`, at `at`.
pub(crate) fn published_as(
    vm: &str,
    resource_id: &str,
    before: Option<&Document>,
    after: &Document,
    at: DateTime<Utc>,
) -> Vec<Value> {
    let factory = agent_factory(vm, Some(resource_id));
    events_for_document(&factory, before, after, true, at)
        .into_iter()
        .map(|e| serde_json::to_value(e).unwrap())
        .collect()
}

fn feed(fleet: &mut Fleet, events: &[Value]) -> Vec<Applied> {
    events
        .iter()
        .map(|e| fleet.apply(read(e).unwrap(), t0()))
        .collect()
}

fn rules(pairs: &[(&str, Action)]) -> BTreeMap<String, Rule> {
    pairs
        .iter()
        .map(|(ty, action)| {
            (
                ty.to_ascii_lowercase(),
                Rule {
                    action: *action,
                    max_duration: None,
                },
            )
        })
        .collect()
}

fn policy(groups: Vec<(&str, &str, Budget)>, default: Budget) -> Policy {
    let approve_all = rules(&[
        ("Reboot", Action::Approve),
        ("Redeploy", Action::Approve),
        ("Freeze", Action::Approve),
    ]);
    let mut list: Vec<Group> = groups
        .into_iter()
        .map(|(name, pattern, budget)| Group {
            name: name.into(),
            matcher: Matcher {
                vm_name: Some(pattern.into()),
                ..Matcher::default()
            },
            budget,
            expected_size: None,
            rules: approve_all.clone(),
            outages: BTreeMap::new(),
            windows: Vec::new(),
            gated: false,
            azure: false,
            approve_via: Default::default(),
        })
        .collect();
    list.push(Group {
        name: "default".into(),
        matcher: Matcher::default(),
        budget: default,
        expected_size: None,
        rules: approve_all,
        outages: BTreeMap::new(),
        windows: Vec::new(),
        gated: false,
        azure: false,
        approve_via: Default::default(),
    });
    Policy {
        groups: list,
        fleet_budget: None,
        min_lead: chrono::Duration::seconds(2),
        max_hold: chrono::Duration::hours(1),
        silent_after: 3,
        report_wait: chrono::Duration::seconds(5),
        approve_failed_drains: false,
        memo: Default::default(),
    }
}

/// Marks what `decide` chose as approved, as the engine records it.
fn approve(fleet: &mut Fleet, steps: &[Step]) {
    for step in steps {
        let (Step::Approve { key, .. } | Step::Drain { key, .. }) = step;
        fleet.events.get_mut(key).unwrap().approval = Some(Approval {
            approver: String::new(),
            via: Via::Agent,
            decided_at: t0(),
            dry_run: false,
            sent: Vec::new(),
            outcome: None,
            abandoned: false,
            dry_run_answers: 0,
        });
    }
}

#[test]
fn events_that_fail_the_contract_are_refused_with_the_reason() {
    let d1 = document(1, &[("E1", "Reboot", "Scheduled", &["web-1"], 900, -1)]);
    let good = published("web-1", None, &d1).remove(0);
    let mut no_vm = good.clone();
    no_vm.as_object_mut().unwrap().remove("vmname");
    assert!(read(&no_vm).unwrap_err().contains("\"vmname\" is missing"));
    let mut wrong_subject = good.clone();
    wrong_subject["subject"] = json!("E2");
    assert!(
        read(&wrong_subject)
            .unwrap_err()
            .contains("is not the subject")
    );
    let mut no_data = good.clone();
    no_data["data"] = json!("x");
    assert!(read(&no_data).unwrap_err().contains("data"));
    let mut other = good;
    other["type"] = json!("com.example.thing");
    assert!(read(&other).unwrap_err().contains("not a Scheduled Events"));
}

#[test]
fn a_budget_of_one_approves_the_earliest_not_before_first_and_then_waits() {
    let mut fleet = Fleet::default();
    for (vm, id, at) in [
        ("web-1", "E1", 900),
        ("web-2", "E2", 300),
        ("web-3", "E3", 600),
    ] {
        let d = document(1, &[(id, "Reboot", "Scheduled", &[vm], at, -1)]);
        feed(&mut fleet, &published(vm, None, &d));
    }
    let policy = policy(vec![("web", "web-*", Budget::Count(1))], Budget::Count(1));
    let first = decide(&fleet, &policy, t0());
    assert_eq!(
        first.steps,
        [Step::Approve {
            key: "E2".into(),
            approver: "web-2".into(),
            via: Via::Agent,
        }]
    );
    assert!(
        first
            .waits
            .iter()
            .all(|(_, w)| matches!(w, Wait::Budget { group, down: 1, adds: 1, limit: 1, .. } if group == "web"))
    );
    approve(&mut fleet, &first.steps);
    assert!(decide(&fleet, &policy, t0()).steps.is_empty());
    // E2 completes on web-2: the next earliest (E3) may go.
    let d1 = document(1, &[("E2", "Reboot", "Scheduled", &["web-2"], 300, -1)]);
    feed(
        &mut fleet,
        &published("web-2", Some(&d1), &document(2, &[])),
    );
    let next = decide(&fleet, &policy, t0());
    assert_eq!(next.steps.len(), 1);
    assert!(matches!(&next.steps[0], Step::Approve { key, .. } if key == "E3"));
}

#[test]
fn an_event_listing_several_vms_costs_each_and_is_approved_once_by_the_first_with_an_agent() {
    let mut fleet = Fleet::default();
    let resources: &[&str] = &["web-0", "web-1", "web-2"];
    let d = document(1, &[("H1", "Redeploy", "Scheduled", resources, 900, -1)]);
    // web-0 has no agent; web-1 and web-2 both report the same event. Decided once
    // report_wait has passed without a word for web-0.
    feed(&mut fleet, &published("web-2", None, &d));
    feed(&mut fleet, &published("web-1", None, &d));
    let late = t0() + chrono::Duration::seconds(5);
    let tight = policy(vec![("web", "web-*", Budget::Count(2))], Budget::Count(1));
    let decisions = decide(&fleet, &tight, late);
    assert!(decisions.steps.is_empty());
    assert_eq!(
        decisions.waits[0].1,
        Wait::Budget {
            group: "web".into(),
            down: 0,
            adds: 3,
            forced: Vec::new(),
            limit: 2
        }
    );
    let enough = policy(vec![("web", "web-*", Budget::Count(3))], Budget::Count(1));
    let decisions = decide(&fleet, &enough, late);
    assert_eq!(
        decisions.steps,
        [Step::Approve {
            key: "H1".into(),
            approver: "web-1".into(),
            via: Via::Agent,
        }]
    );
    approve(&mut fleet, &decisions.steps);
    let web = &usage(&fleet, &enough, t0()).groups[0];
    assert_eq!(web.down.len(), 3);
}

#[test]
fn an_event_azure_is_about_to_start_by_itself_counts_against_the_budget() {
    let mut fleet = Fleet::default();
    // S1 is too close to its NotBefore to approve (a Spot eviction whose turn never came):
    // Azure starts it in a second, whatever the coordinator does. R1 has time.
    for (vm, id, at) in [("web-1", "S1", 1), ("web-2", "R1", 900)] {
        let d = document(1, &[(id, "Reboot", "Scheduled", &[vm], at, -1)]);
        feed(&mut fleet, &published(vm, None, &d));
    }
    let policy = policy(vec![("web", "web-*", Budget::Count(1))], Budget::Count(1));
    let decisions = decide(&fleet, &policy, t0());
    assert!(decisions.steps.is_empty(), "{:?}", decisions.steps);
    let waits: BTreeMap<String, Wait> = decisions.waits.into_iter().collect();
    assert_eq!(waits["S1"], Wait::TooLate);
    assert_eq!(
        waits["R1"],
        Wait::Budget {
            group: "web".into(),
            down: 1,
            adds: 1,
            forced: Vec::new(),
            limit: 1
        },
        "web-1 goes down at S1's NotBefore: approving R1 now would make two"
    );
    // Past its NotBefore, before web-1's agent has reported it Started: still down.
    let later = t0() + chrono::Duration::seconds(3);
    assert_eq!(usage(&fleet, &policy, later).groups[0].down.len(), 1);
    // Once web-1 reports it over, R1 may go.
    let d1 = document(1, &[("S1", "Reboot", "Scheduled", &["web-1"], 1, -1)]);
    feed(
        &mut fleet,
        &published("web-1", Some(&d1), &document(2, &[])),
    );
    assert_eq!(decide(&fleet, &policy, later).steps.len(), 1);
}

#[test]
fn another_event_of_a_vm_azure_is_about_to_take_down_still_waits_for_the_budget() {
    let mut fleet = Fleet::default();
    // web-2 is down (approved); web-1's S1 starts by itself in a second, and web-1 also has
    // R2 with time to spare. Approving R2 now takes web-1 down before Azure would: two
    // down where one may be.
    let d2 = document(1, &[("R9", "Reboot", "Scheduled", &["web-2"], 900, -1)]);
    feed(&mut fleet, &published("web-2", None, &d2));
    let policy = policy(vec![("web", "web-*", Budget::Count(1))], Budget::Count(1));
    let first = decide(&fleet, &policy, t0());
    approve(&mut fleet, &first.steps);
    let d1 = document(
        1,
        &[
            ("S1", "Reboot", "Scheduled", &["web-1"], 1, -1),
            ("R2", "Reboot", "Scheduled", &["web-1"], 900, -1),
        ],
    );
    feed(&mut fleet, &published("web-1", None, &d1));
    let decisions = decide(&fleet, &policy, t0());
    assert!(decisions.steps.is_empty(), "{:?}", decisions.steps);
    let waits: BTreeMap<String, Wait> = decisions.waits.into_iter().collect();
    assert!(
        matches!(&waits["R2"], Wait::Budget { group, .. } if group == "web"),
        "{waits:?}"
    );
}

#[test]
fn never_too_long_too_late_and_agentless_events_are_left_to_azure() {
    let mut fleet = Fleet::default();
    let d = document(
        1,
        &[
            ("T1", "Terminate", "Scheduled", &["web-1"], 900, -1),
            ("F1", "Freeze", "Scheduled", &["web-1"], 900, 45),
            ("R1", "Reboot", "Scheduled", &["web-1"], 1, -1),
            ("R2", "Reboot", "Scheduled", &["db-9"], 900, -1),
        ],
    );
    feed(&mut fleet, &published("web-1", None, &d));
    let mut policy = policy(vec![], Budget::Count(10));
    policy.groups[0].rules.insert(
        "freeze".into(),
        Rule {
            action: Action::Approve,
            max_duration: Some(Duration::from_secs(30)),
        },
    );
    let decisions = decide(&fleet, &policy, t0());
    assert!(decisions.steps.is_empty(), "{:?}", decisions.steps);
    let waits: BTreeMap<String, Wait> = decisions.waits.into_iter().collect();
    assert!(matches!(&waits["T1"], Wait::Never(why) if why.contains("never")));
    assert!(matches!(&waits["F1"], Wait::Never(why) if why.contains("45 s")));
    assert_eq!(waits["R1"], Wait::TooLate);
    assert_eq!(waits["R2"], Wait::NoAgent);
}

#[test]
fn percentages_round_up_over_the_vms_known_in_the_group() {
    let mut fleet = Fleet::default();
    for i in 0..11 {
        let vm = format!("web-{i}");
        feed(&mut fleet, &published(&vm, None, &document(1, &[])));
    }
    let policy = policy(
        vec![("web", "web-*", Budget::Percent(10))],
        Budget::Count(0),
    );
    let web = &usage(&fleet, &policy, t0()).groups[0];
    assert_eq!((web.size, web.limit), (11, 2));
}

proptest! {
    /// VM names are matched as bytes when both sides are ASCII, as characters otherwise:
    /// the same answer either way (a non-ASCII letter after both forces the second).
    #[test]
    fn group_patterns_match_the_same_as_bytes_and_as_characters(
        pattern in "[ab*?-]{0,8}",
        name in "[ab-]{0,10}",
    ) {
        prop_assert_eq!(glob(&pattern, &name), glob(&format!("{pattern}é"), &format!("{name}é")));
    }

    /// Whatever the fleet looks like (events of every status, some already approved,
    /// several VMs per event, two groups), the approvals decided never take a group's
    /// down count over its limit, and never add to a group already over it.
    #[test]
    fn decisions_never_exceed_a_budget(
        events in prop::collection::vec(
            (prop::collection::vec(0usize..12, 1..4), 0u8..4, any::<bool>(), 0i64..1000),
            1..25,
        ),
        web_budget in 0u32..4,
        db_percent in 0u32..60,
    ) {
        let vms: Vec<String> = (0..12)
            .map(|i| if i % 2 == 0 { format!("web-{i}") } else { format!("db-{i}") })
            .collect();
        let mut fleet = Fleet::default();
        for (n, (members, status, approved, not_before)) in events.iter().enumerate() {
            let id = format!("E{n}");
            let resources: Vec<&str> = members.iter().map(|i| vms[*i].as_str()).collect();
            let status_text = if *status == 1 { "Started" } else { "Scheduled" };
            let d = document(1, &[(id.as_str(), "Reboot", status_text, &resources, *not_before, -1)]);
            let mut published = published(resources[0], None, &d);
            if *status == 3 {
                published.extend(self::published(resources[0], Some(&d), &document(2, &[])));
            }
            feed(&mut fleet, &published);
            if *approved && *status != 1 {
                approve(&mut fleet, &[Step::Approve { key: id, approver: String::new(), via: Via::Agent }]);
            }
        }
        let policy = policy(
            vec![("web", "web-*", Budget::Count(web_budget)), ("db", "db-*", Budget::Percent(db_percent))],
            Budget::Count(1),
        );
        let before = usage(&fleet, &policy, t0());
        let decisions = decide(&fleet, &policy, t0());
        approve(&mut fleet, &decisions.steps);
        let after = usage(&fleet, &policy, t0());
        for (b, a) in before.groups.iter().zip(&after.groups) {
            if a.down.len() > b.down.len() {
                prop_assert!(a.down.len() <= a.limit, "{} went from {} to {} of {}", a.group, b.down.len(), a.down.len(), a.limit);
            }
        }
    }
}
