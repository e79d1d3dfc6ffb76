//! An Azure source older than `[azure] max_age` holds the groups that may count its VMs
//! (its own, one that matches a VM of its listing by name first, one a VM made since
//! falls into, one an agent nobody can place falls into, one an event names an unknown VM
//! of), and every group under a `[fleet]` budget; the other groups decide on.

use chrono::Utc;
use sched_relay_core::event::events_for_document;

use super::super::quiet_day::World;
use super::super::{document, published, t0};
use super::{approved, azure_world, listed_at, reboot_of, reboot_of_batch_0};
use crate::coordinator::azure::{Snapshot, SourceStatus};

const BATCH: &str = super::BATCH;

/// Two Azure groups, batch and jobs, each with a Reboot of one of its VMs waiting.
const TWO_SOURCES: &str = r#"
[[groups]]
name = "jobs"
max_down = 1
[groups.azure]
source = "/subscriptions/s/resourceGroups/rg-jobs"
"#;

const JOBS: &str = "/subscriptions/s/resourceGroups/rg-jobs";

/// Both groups listed: batch at `batch_at` with batch-0, jobs at `jobs_at` with `jobs`.
fn two_listings(
    batch_at: chrono::DateTime<Utc>,
    jobs_at: chrono::DateTime<Utc>,
    jobs: &[&str],
) -> Snapshot {
    let mut snapshot = listed_at(&[("batch-0", "running")], batch_at);
    let jobs: Vec<(&str, &str)> = jobs.iter().map(|vm| (*vm, "running")).collect();
    let jobs = listed_at(&jobs, jobs_at);
    for (name, mut vm) in jobs.vms {
        vm.group = 3;
        vm.resource_id = vm.resource_id.replace("rg-batch", "rg-jobs");
        snapshot.vms.insert(name, vm);
    }
    snapshot
        .sources
        .extend(jobs.sources.into_iter().map(|s| SourceStatus {
            group: 3,
            source: JOBS.into(),
            error: Some("403 AuthorizationFailed".into()),
            ..s
        }));
    snapshot
}

/// A world with batch and jobs (and `extra`), jobs' listing (of `jobs`) ten minutes old,
/// batch's fresh, and a Reboot of batch-0 (E1) waiting.
fn jobs_listing_stale(extra: &str, jobs: &[&str]) -> World {
    let mut world = azure_world(&format!("{extra}{BATCH}{TWO_SOURCES}"));
    reboot_of_batch_0(&mut world);
    let ten_minutes_ago = t0() - chrono::Duration::minutes(10);
    world
        .engine
        .azure_listed(two_listings(t0(), ten_minutes_ago, jobs), t0());
    world
}

/// Event `id` as `/fleet` shows it now (null if it is not there).
fn event(world: &mut World, id: &str) -> serde_json::Value {
    world.engine.publish_snapshot(t0());
    world.engine.fleet_json()["events"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["event_id"] == id)
        .cloned()
        .unwrap_or_default()
}

/// Event `id`'s verdict in `/fleet`.
fn verdict(world: &mut World, id: &str) -> String {
    event(world, id)["verdict"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_source_holds_only_its_own_groups_events_and_says_why() {
    let mut world = jobs_listing_stale("", &["jobs-0"]);
    reboot_of(&mut world, "jobs-0", "E2");
    world.engine.tick(t0());
    // batch's own listing is fresh: its Reboot is approved; jobs' waits, and says why.
    assert_eq!(approved(&mut world).await, vec!["E1".to_owned()]);
    let e2 = verdict(&mut world, "E2");
    assert!(
        e2.contains(&format!("list {JOBS} again")) && e2.contains("group jobs"),
        "{e2}"
    );
    // Listed again: jobs decides too.
    world
        .engine
        .azure_listed(two_listings(t0(), t0(), &["jobs-0"]), t0());
    world.engine.tick(t0());
    assert_eq!(both_approved(&mut world).await, ["E1", "E2"]);
}

/// A VM of the stale listing that another group counts (web matches it by name first):
/// that group waits too, since the VM may be down unseen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_sources_vm_counted_by_another_group_holds_that_group_too() {
    let mut world = jobs_listing_stale("", &["jobs-0", "web-3"]);
    reboot_of(&mut world, "web-1", "E3");
    world.engine.tick(t0());
    assert_eq!(approved(&mut world).await, vec!["E1".to_owned()]);
    let e3 = verdict(&mut world, "E3");
    assert!(e3.contains("group web may count"), "{e3}");
}

/// A VM made since the stale listing (its agent's resource id in the source's resource
/// group, no listing has it) is placed in the default group until listed: that group's
/// decisions wait, not only jobs'.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vm_made_since_a_stale_listing_holds_the_group_it_falls_into() {
    let mut world = jobs_listing_stale("", &["jobs-0"]);
    reboot_of(&mut world, "jobs-5", "E4");
    world.engine.tick(t0());
    assert_eq!(approved(&mut world).await, vec!["E1".to_owned()]);
    let e4 = verdict(&mut world, "E4");
    assert!(e4.contains("group default may count"), "{e4}");
}

/// An agent that reports no resource id (an older one, or one whose `source` is not its
/// Azure id), which no listing has: which VM it is nobody can tell, so while any source is
/// old the group it falls into (default) waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_without_a_resource_id_no_listing_has_holds_the_group_it_falls_into() {
    let mut world = jobs_listing_stale("", &["jobs-0"]);
    let factory = crate::coordinator::tests::agent_factory("jobs-6", None);
    let reboot = document(2, &[("E6", "Reboot", "Scheduled", &["jobs-6"], 3600, -1)]);
    for event in events_for_document(&factory, Some(&document(1, &[])), &reboot, true, t0()) {
        world.deliver(&serde_json::to_value(event).unwrap(), t0());
    }
    world.engine.tick(t0());
    assert_eq!(approved(&mut world).await, vec!["E1".to_owned()]);
    let e6 = verdict(&mut world, "E6");
    assert!(e6.contains("group default may count"), "{e6}");
}

/// An event whose Resources name a VM that neither an agent nor a listing knows (one made
/// since the old listing, under Azure's name) waits while a source is old, though its
/// other VM's group is fresh.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_naming_a_vm_nobody_knows_waits_while_a_source_is_old() {
    let mut world = jobs_listing_stale("", &["jobs-0"]);
    let reboot = document(
        2,
        &[("E7", "Reboot", "Scheduled", &["web-1", "jobs-7"], 3600, -1)],
    );
    for event in published("web-1", Some(&document(1, &[])), &reboot) {
        world.deliver(&event, t0());
    }
    world.engine.tick(t0());
    assert_eq!(approved(&mut world).await, vec!["E1".to_owned()]);
    let e7 = verdict(&mut world, "E7");
    assert!(e7.contains(&format!("list {JOBS} again")), "{e7}");
}

/// What the engine approved, once it approved two (or a while passed).
async fn both_approved(world: &mut World) -> Vec<String> {
    for _ in 0..100 {
        world.settle().await;
        if world.recorder.approved().len() >= 2 {
            break;
        }
    }
    let mut approved = world.recorder.approved();
    approved.sort();
    approved
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_fleet_budget_a_stale_source_holds_every_groups_events() {
    // The fleet's budget counts every group, the stale one's VMs down too.
    let mut world = jobs_listing_stale("[fleet]\nmax_down = 10\n", &["jobs-0"]);
    reboot_of(&mut world, "jobs-0", "E2");
    world.engine.tick(t0());
    // (An approval is recorded in the fleet when it is decided; its publication follows.)
    for id in ["E1", "E2"] {
        let approval = event(&mut world, id)["approval"].clone();
        assert!(approval.is_null(), "{id} approved: {approval}");
    }
    world
        .engine
        .azure_listed(two_listings(t0(), t0(), &["jobs-0"]), t0());
    world.engine.tick(t0());
    assert_eq!(both_approved(&mut world).await, ["E1", "E2"]);
}
