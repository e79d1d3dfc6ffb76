//! The count of who is down keeps each VM's place (its group, whether an agent speaks for
//! it) between counts while the inventory stays the same (`policy::Placement`, kept with the
//! policy): after each way the inventory changes, a count with what was kept places every
//! VM as a count from scratch does, and while nothing changes, what was kept is used. The
//! decision after it takes whether an agent is live from the count.

use chrono::{DateTime, Utc};

use super::ceiling::{beat, heartbeat, minutes};
use super::{document, feed, policy, published, t0};
use crate::coordinator::azure::AzureVm;
use crate::coordinator::fleet::{Fleet, Via, Vm, read_at};
use crate::coordinator::policy::{Budget, Matcher, Policy, Step, decide, down_now};

/// Every VM's group and agent, and every group's size, as a count over `fleet` finds them.
fn places(fleet: &Fleet, policy: &Policy, now: DateTime<Utc>) -> Vec<String> {
    let down = down_now(fleet, policy, now);
    let mut said: Vec<String> = fleet
        .vms()
        .keys()
        .chain(fleet.azure().keys())
        .chain(["web-9".to_owned(), "x-9".to_owned()].iter())
        .map(|vm| {
            format!(
                "{vm}: {}, agent {}",
                policy.groups[down.group_of(fleet, policy, vm)].name,
                down.has_agent(vm)
            )
        })
        .collect();
    for (g, group) in policy.groups.iter().enumerate() {
        said.push(format!("{}: {} VM(s)", group.name, down.members(g)));
    }
    said
}

/// A heartbeat of `vm` from the resource `resource_id`, or from an agent that says none.
fn beat_as(fleet: &mut Fleet, vm: &str, resource_id: Option<&str>, at: DateTime<Utc>) {
    let mut message = heartbeat(vm, at, at - minutes(60), &[]);
    message["source"] = resource_id.unwrap_or(vm).into();
    message["data"]["vm"]["resourceId"] = resource_id.into();
    fleet.apply(read_at(&message, at, true).unwrap(), at);
    assert!(fleet.vms().contains_key(vm), "{message}");
}

/// A change to the fleet, named, with what a count from scratch says after it.
type Change = (
    &'static str,
    Box<dyn Fn(&mut Fleet)>,
    &'static [&'static str],
);

fn in_db(vm: &str) -> String {
    format!(
        "/subscriptions/s/resourceGroups/rg-db/providers/Microsoft.Compute/virtualMachines/{vm}"
    )
}

#[test]
fn a_count_after_any_change_to_the_inventory_places_every_vm_as_a_count_from_scratch() {
    // web by name, db by resource group, and the default group.
    let mut policy = policy(vec![("web", "web-*", Budget::Count(1))], Budget::Count(1));
    let mut db = policy.groups[0].clone();
    db.name = "db".into();
    db.matcher = Matcher {
        resource_group: Some("rg-db".into()),
        ..Matcher::default()
    };
    policy.groups.insert(1, db);
    let mut fleet = Fleet::default();
    beat(&mut fleet, "web-1", t0(), t0() - minutes(60), &[]);
    beat(&mut fleet, "web-2", t0(), t0() - minutes(60), &[]);
    // An agent that has not said which resource it is yet: the default group's.
    fleet.insert_vm(
        "x-1".into(),
        Vm {
            resource_id: None,
            last_seen: t0(),
            heartbeat: None,
            first_seen: None,
        },
    );
    let mut now = t0();
    // Each change, with what a count from scratch says after it (a clone of the policy
    // keeps nothing); the same count with what the policy kept must say the same.
    let mut check = |fleet: &Fleet, what: &str, expected: &[&str]| {
        now += chrono::Duration::seconds(1);
        let kept = places(fleet, &policy, now);
        let scratch = places(fleet, &policy.clone(), now);
        assert_eq!(kept, scratch, "after {what}");
        for line in expected {
            assert!(
                scratch.iter().any(|l| l == line),
                "after {what}: {scratch:?}"
            );
        }
    };
    check(
        &fleet,
        "the first count",
        &["x-1: default, agent true", "db: 0 VM(s)"],
    );

    // Nothing that places a VM changes with a heartbeat from a known VM: what was kept is
    // used.
    let version = fleet.inventory_version();
    beat(
        &mut fleet,
        "web-1",
        t0() + minutes(1),
        t0() - minutes(60),
        &[],
    );
    assert_eq!(
        fleet.inventory_version(),
        version,
        "a heartbeat changes no place"
    );
    check(&fleet, "a heartbeat", &["web: 2 VM(s)"]);

    // The ways the inventory changes, each of which takes a new version.
    let mut changes: Vec<Change> = vec![
        (
            "an agent's resource id learned",
            Box::new(|f| beat_as(f, "x-1", Some(&in_db("x-1")), t0() + minutes(2))),
            &["x-1: db, agent true", "db: 1 VM(s)", "default: 0 VM(s)"],
        ),
        (
            "a VM that came",
            Box::new(|f| beat_as(f, "x-2", Some(&in_db("x-2")), t0() + minutes(2))),
            &["x-2: db, agent true", "db: 2 VM(s)"],
        ),
        (
            "a VM that came saying no resource id",
            Box::new(|f| beat_as(f, "z-1", None, t0() + minutes(2))),
            &["z-1: default, agent true", "default: 1 VM(s)"],
        ),
        (
            "a VM that left",
            Box::new(|f| {
                f.leave("web-2", t0() + minutes(3));
            }),
            &["web: 1 VM(s)"],
        ),
        (
            "an operator's release forgetting a resource id",
            Box::new(|f| {
                f.forget_resource_id("x-1");
            }),
            &["x-1: default, agent true", "db: 1 VM(s)"],
        ),
        (
            "a VM stored",
            Box::new(|f| {
                let vm = Vm {
                    resource_id: Some(in_db("web-9")),
                    last_seen: t0(),
                    heartbeat: None,
                    first_seen: None,
                };
                f.insert_vm("web-9".into(), vm);
            }),
            &["web-9: web, agent true", "web: 2 VM(s)"],
        ),
        (
            "a VM removed",
            Box::new(|f| {
                f.remove_vm("x-2");
            }),
            &["db: 0 VM(s)"],
        ),
        (
            "a listing from Azure",
            Box::new(|f| {
                let listed = AzureVm {
                    resource_id: in_db("y-1"),
                    group: 1,
                    provisioning: Some("succeeded".into()),
                    power: Some("running".into()),
                };
                f.set_azure([("y-1".to_owned(), listed)].into());
            }),
            &["y-1: db, agent false", "db: 1 VM(s)"],
        ),
        (
            "the state read back after a failed write",
            Box::new(|f| {
                let mut stored = Fleet::default();
                stored.insert_vm(
                    "x-9".into(),
                    Vm {
                        resource_id: Some(in_db("x-9")),
                        last_seen: t0(),
                        heartbeat: None,
                        first_seen: None,
                    },
                );
                f.reloaded(stored);
            }),
            &["x-9: db, agent true", "web: 0 VM(s)", "default: 0 VM(s)"],
        ),
    ];
    for (what, change, expected) in changes.drain(..) {
        let version = fleet.inventory_version();
        change(&mut fleet);
        assert_ne!(fleet.inventory_version(), version, "{what}");
        check(&fleet, what, expected);
    }
}

/// The approval goes to an agent the count finds live: of two VMs an event lists, both of
/// which reported it, the first, whose agent has since gone silent, is passed over.
#[test]
fn an_approval_goes_to_an_agent_the_count_finds_live_never_a_silent_one() {
    let policy = policy(vec![("web", "web-*", Budget::Count(2))], Budget::Count(1));
    let mut fleet = Fleet::default();
    let reboot = document(
        1,
        &[("E1", "Reboot", "Scheduled", &["web-1", "web-2"], 3600, 0)],
    );
    for vm in ["web-1", "web-2"] {
        feed(&mut fleet, &published(vm, None, &reboot));
        beat(&mut fleet, vm, t0(), t0() - minutes(60), &["E1"]);
    }
    // web-2's agent beats on; web-1's missed three 300 s heartbeats.
    let now = t0() + minutes(20);
    beat(&mut fleet, "web-2", now, t0() - minutes(60), &["E1"]);
    let decisions = decide(&fleet, &policy, now);
    assert_eq!(
        decisions.steps,
        [Step::Approve {
            key: "E1".into(),
            approver: "web-2".into(),
            via: Via::Agent,
        }],
        "{:?}",
        decisions.waits
    );
}
