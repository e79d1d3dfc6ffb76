//! The Azure inventory in the engine (on the shipped defaults, a recording publisher, the
//! test's clock): its VMs count in their group's size and budget with or without an agent,
//! Azure's word that one is not serving counts it down, nothing is decided before every
//! source was listed; and `[azure]` is checked with its key paths.

use std::collections::BTreeMap;
use std::sync::Arc;

use chrono::Utc;

use super::quiet_day::{World, start_with};
use super::{document, published, t0};
use crate::coordinator::azure::inventory::AutoApprove;
use crate::coordinator::azure::{AzureVm, Snapshot, SourceStatus};
use crate::coordinator::engine::AzureView;

mod stale_sources;

pub(super) const BATCH: &str = r#"
[azure]
resource_manager = "http://127.0.0.1:9"
[[groups]]
name = "batch"
max_down = 1
[groups.azure]
source = "/subscriptions/s/resourceGroups/rg-batch"
"#;

pub(super) fn listed(vms: &[(&str, &str)]) -> Snapshot {
    listed_at(vms, t0())
}

/// [`listed`], listed whole at `at`.
fn listed_at(vms: &[(&str, &str)], at: chrono::DateTime<Utc>) -> Snapshot {
    let vms: BTreeMap<String, AzureVm> = vms
        .iter()
        .map(|(name, power)| {
            let vm = AzureVm {
                resource_id: format!("/subscriptions/s/resourceGroups/rg-batch/providers/Microsoft.Compute/virtualMachines/{name}"),
                group: 2,
                provisioning: Some("succeeded".into()),
                power: Some((*power).into()),
            };
            ((*name).to_owned(), vm)
        })
        .collect();
    Snapshot {
        sources: vec![SourceStatus {
            group: 2,
            source: "/subscriptions/s/resourceGroups/rg-batch".into(),
            listed_at: Some(at),
            vms: vms.len(),
            error: None,
            auto_approve: Default::default(),
        }],
        vms,
    }
}

/// What the engine approved, once its publications are done: each runs on a task of its
/// own, which a loaded machine may run late.
async fn approved(world: &mut World) -> Vec<String> {
    for _ in 0..100 {
        world.settle().await;
        if !world.recorder.approved().is_empty() {
            break;
        }
    }
    world.recorder.approved()
}

/// A world on `config` whose engine has an Azure view (the shipped `max_age`, 5 min) and
/// no listing yet.
pub(super) fn azure_world(config: &str) -> World {
    let mut world = start_with(tempfile::tempdir().unwrap(), config);
    world.engine.azure = Some(AzureView::new(
        Arc::new(tokio::sync::Notify::new()),
        std::time::Duration::from_secs(300),
    ));
    world
}

fn batch_world() -> World {
    azure_world(BATCH)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vms_azure_lists_count_in_their_group_with_or_without_an_agent_and_nothing_is_decided_before_the_listing()
 {
    let mut world = batch_world();
    // batch-0's agent reports a Reboot an hour away; Reboot is approved by default.
    let reboot = document(2, &[("E1", "Reboot", "Scheduled", &["batch-0"], 3600, -1)]);
    for event in published("batch-0", Some(&document(1, &[])), &reboot) {
        world.deliver(&event, t0());
    }
    world.engine.tick(t0());
    world.engine.publish_snapshot(t0());
    world.settle().await;
    assert!(
        world.recorder.approved().is_empty(),
        "approved before Azure listed the group"
    );
    let snapshot = world.engine.fleet_json();
    assert_eq!(snapshot["azure"]["complete"], false, "{snapshot}");

    // Azure lists three VMs: batch-1 and batch-2 have no agent, batch-2 is deallocated:
    // the group (max_down 1) is full.
    world.engine.azure_listed(
        listed(&[
            ("batch-0", "running"),
            ("batch-1", "running"),
            ("batch-2", "deallocated"),
        ]),
        t0(),
    );
    world.engine.tick(t0());
    world.engine.publish_snapshot(t0());
    world.settle().await;
    assert!(
        world.recorder.approved().is_empty(),
        "approved past the budget"
    );
    let batch = world.group("batch");
    assert_eq!(batch["known"], 3, "{batch}");
    assert_eq!(batch["size"], 3, "{batch}");
    assert_eq!(
        batch["without_agent"],
        serde_json::json!(["batch-1", "batch-2"]),
        "{batch}"
    );
    assert_eq!(batch["down"], serde_json::json!(["batch-2"]), "{batch}");
    assert_eq!(
        batch["why"]["batch-2"],
        serde_json::json!(["Azure: power deallocated"]),
        "{batch}"
    );

    // batch-2 is running again: there is room, and the Reboot is approved.
    world.engine.azure_listed(
        listed(&[
            ("batch-0", "running"),
            ("batch-1", "running"),
            ("batch-2", "running"),
        ]),
        t0(),
    );
    world.engine.tick(t0());
    world.engine.publish_snapshot(t0());
    assert_eq!(approved(&mut world).await, vec!["E1".to_owned()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vm_azure_shows_updating_counts_down_while_its_agent_still_speaks() {
    let mut world = batch_world();
    for vm in ["batch-0", "batch-1"] {
        for event in published(vm, None, &document(1, &[])) {
            world.deliver(&event, t0());
        }
    }
    let mut snapshot = listed(&[("batch-0", "running"), ("batch-1", "starting")]);
    snapshot.vms.get_mut("batch-1").unwrap().provisioning = Some("updating".into());
    world.engine.azure_listed(snapshot, t0());
    world.engine.tick(t0());
    world.engine.publish_snapshot(t0());
    let batch = world.group("batch");
    assert_eq!(batch["without_agent"], serde_json::json!([]), "{batch}");
    assert_eq!(batch["down"], serde_json::json!(["batch-1"]), "{batch}");
    assert_eq!(
        batch["why"]["batch-1"],
        serde_json::json!(["Azure: provisioning updating"]),
        "{batch}"
    );
}

/// batch-0's Reboot, an hour away, reported by its agent.
fn reboot_of_batch_0(world: &mut World) {
    reboot_of(world, "batch-0", "E1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_inventory_survives_a_failed_write_and_the_budget_still_counts_it() {
    let mut world = batch_world();
    reboot_of_batch_0(&mut world);
    world.engine.azure_listed(
        listed(&[("batch-0", "running"), ("batch-1", "deallocated")]),
        t0(),
    );
    // What a failed write does: the state is read back from the store.
    world.engine.reload();
    world.engine.tick(t0());
    world.engine.publish_snapshot(t0());
    world.settle().await;
    assert!(
        world.recorder.approved().is_empty(),
        "approved past the budget after a reload"
    );
    let batch = world.group("batch");
    assert_eq!(batch["known"], 2, "{batch}");
    assert_eq!(batch["down"], serde_json::json!(["batch-1"]), "{batch}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_older_than_max_age_stops_the_decisions_until_a_fresh_one() {
    let mut world = batch_world();
    reboot_of_batch_0(&mut world);
    // Room for the Reboot, but the listing is ten minutes old (max_age 5 min): a VM
    // deallocated since would not be counted.
    let ten_minutes_ago = t0() - chrono::Duration::minutes(10);
    world
        .engine
        .azure_listed(listed_at(&[("batch-0", "running")], ten_minutes_ago), t0());
    world.engine.tick(t0());
    world.settle().await;
    assert!(
        world.recorder.approved().is_empty(),
        "approved on a stale listing"
    );
    world
        .engine
        .azure_listed(listed_at(&[("batch-0", "running")], t0()), t0());
    world.engine.tick(t0());
    assert_eq!(approved(&mut world).await, vec!["E1".to_owned()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_azure_lists_under_another_name_is_joined_by_its_resource_id_not_counted_twice() {
    let mut world = batch_world();
    for event in published("batch-0", None, &document(1, &[])) {
        world.deliver(&event, t0());
    }
    // ARM names it in capitals (a resource id is case-insensitive).
    let mut snapshot = listed(&[("BATCH-0", "running"), ("batch-1", "running")]);
    let vm = snapshot.vms.get_mut("BATCH-0").unwrap();
    vm.resource_id = vm.resource_id.to_ascii_uppercase();
    world.engine.azure_listed(snapshot, t0());
    world.engine.tick(t0());
    world.engine.publish_snapshot(t0());
    let batch = world.group("batch");
    assert_eq!(batch["known"], 2, "{batch}");
    assert_eq!(
        batch["without_agent"],
        serde_json::json!(["batch-1"]),
        "{batch}"
    );
    let default = world.group("default");
    assert_eq!(default["known"], 0, "{default}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_and_a_listed_vm_of_one_name_but_two_ids_stop_the_decisions() {
    let mut world = batch_world();
    reboot_of_batch_0(&mut world);
    // Azure lists another batch-0 (another resource group) than the one whose agent speaks.
    let mut snapshot = listed(&[("batch-0", "deallocated")]);
    let vm = snapshot.vms.get_mut("batch-0").unwrap();
    vm.resource_id = vm.resource_id.replace("rg-batch", "rg-other");
    world.engine.azure_listed(snapshot, t0());
    world.engine.tick(t0());
    world.engine.publish_snapshot(t0());
    world.settle().await;
    assert!(
        world.recorder.approved().is_empty(),
        "approved with two VMs of one name"
    );
    let fleet = world.engine.fleet_json();
    assert!(
        fleet["azure"]["clash"]
            .as_str()
            .unwrap_or_default()
            .contains("rg-other"),
        "{fleet}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_stamped_in_the_future_is_not_trusted() {
    let mut world = batch_world();
    reboot_of_batch_0(&mut world);
    // The clock stepped back ten minutes since the listing.
    let ahead = t0() + chrono::Duration::minutes(10);
    world
        .engine
        .azure_listed(listed_at(&[("batch-0", "running")], ahead), t0());
    world.engine.tick(t0());
    world.settle().await;
    assert!(
        world.recorder.approved().is_empty(),
        "approved on a listing from the future"
    );
}

#[test]
fn a_drain_azure_would_bypass_by_approving_by_itself_is_warned_about_in_fleet() {
    let extra = BATCH.replace(
        "max_down = 1\n",
        "max_down = 1\n[groups.actions]\nReboot = \"drain_then_approve\"\n",
    );
    let mut world = azure_world(&format!("[drain]\ncommand = [\"true\"]\n{extra}"));
    let mut snapshot = listed(&[("batch-0", "running")]);
    snapshot.sources[0].auto_approve = AutoApprove {
        user_initiated_reboot: true,
        user_initiated_redeploy: true,
        all_instances_down: true,
    };
    world.engine.azure_listed(snapshot, t0());
    world.engine.tick(t0());
    world.engine.publish_snapshot(t0());
    let fleet = world.engine.fleet_json();
    assert_eq!(
        fleet["azure"]["warnings"],
        serde_json::json!([
            "Azure approves user-initiated Reboots of /subscriptions/s/resourceGroups/rg-batch by itself (its scheduledEventsPolicy): they start without group batch's drain"
        ]),
        "{fleet}"
    );
}

mod config {
    use crate::coordinator::tests::config::load;

    fn problems(extra: &str) -> String {
        match load(&format!(
            "{}{extra}",
            crate::coordinator::tests::config::BASE
        )) {
            Ok(_) => String::new(),
            Err(errors) => errors.to_string(),
        }
    }

    #[test]
    fn azure_settings_are_checked_with_their_key_paths() {
        let errors = problems(
            "[[groups]]\nname = \"web\"\nmax_down = 1\n[groups.azure]\nsource = \"/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachines/vm1\"\n",
        );
        for expected in [
            "groups[0].azure.source: \"/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachines/vm1\" is not a scale set",
            "azure: a group has an Azure source ([groups.azure]) but there is no [azure] section",
        ] {
            assert!(errors.contains(expected), "{expected:?} not in:\n{errors}");
        }
        let errors = problems(
            "[azure]\ncredential = \"client_secret\"\nclient_id = \"x\"\nrefresh = \"0s\"\nresource_manager = \"management.azure.com\"\n",
        );
        for expected in [
            "azure.client_id: names a user-assigned managed identity",
            "azure.refresh: must be between 1s and 1h",
            "azure.resource_manager: \"management.azure.com\" is not an http(s) URL",
        ] {
            assert!(errors.contains(expected), "{expected:?} not in:\n{errors}");
        }
        let errors =
            problems("[azure]\nresource_manager = \"http://arm.example.com\"\nmax_age = \"90s\"\n");
        for expected in [
            "azure.resource_manager: \"http://arm.example.com\": plain http would send the bearer token in clear",
            "azure.max_age: must be at least twice refresh",
        ] {
            assert!(errors.contains(expected), "{expected:?} not in:\n{errors}");
        }
        let errors = problems("[azure]\ncredential = \"certificate\"\n");
        assert!(errors.contains("azure.credential"), "{errors}");
        assert_eq!(
            problems(
                "[azure]\n[[groups]]\nname = \"web\"\nmax_down = 1\n[groups.azure]\nsource = \"/subscriptions/s/resourceGroups/rg\"\n"
            ),
            ""
        );
    }
}

/// A listing taken during a Reboot shows the VM restarting until the next one, a `refresh`
/// later: once its agent said the Reboot completed, that older listing no longer holds its
/// place. A listing taken after the agent's word still counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_older_than_a_vms_return_does_not_hold_its_place_and_a_newer_one_does() {
    let at = |s: i64| t0() + chrono::Duration::seconds(s);
    let restarting = |when: chrono::DateTime<Utc>| {
        let mut snapshot = listed_at(&[("batch-0", "starting"), ("batch-1", "running")], when);
        snapshot.vms.get_mut("batch-0").unwrap().provisioning = Some("updating".into());
        snapshot
    };
    let mut world = batch_world();
    // batch-0's Reboot was approved and has started; Azure lists it restarting at +30 s.
    let scheduled = document(2, &[("E1", "Reboot", "Scheduled", &["batch-0"], 3600, -1)]);
    let started = document(3, &[("E1", "Reboot", "Started", &["batch-0"], 3600, -1)]);
    for event in published("batch-0", Some(&document(1, &[])), &scheduled) {
        world.deliver(&event, at(0));
    }
    world.engine.azure_listed(restarting(at(30)), at(30));
    for event in published("batch-0", Some(&scheduled), &started) {
        world.deliver(&event, at(31));
    }
    // At +60 s its agent says the Reboot completed; batch-1's agent reports a Reboot.
    for event in published("batch-0", Some(&started), &document(4, &[])) {
        world.deliver(&event, at(60));
    }
    let e2 = document(2, &[("E2", "Reboot", "Scheduled", &["batch-1"], 3600, -1)]);
    for event in published("batch-1", Some(&document(1, &[])), &e2) {
        world.deliver(&event, at(61));
    }
    world.engine.tick(at(61));
    assert!(
        approved(&mut world).await.contains(&"E2".to_owned()),
        "batch-0's place still held by a listing older than its return"
    );
    // A listing taken after the agent's word that still shows batch-0 restarting counts.
    world.engine.azure_listed(restarting(at(90)), at(90));
    world.engine.publish_snapshot(at(90));
    let batch = world.group("batch");
    assert_eq!(
        batch["why"]["batch-0"],
        serde_json::json!(["Azure: provisioning updating"]),
        "{batch}"
    );
}

/// `vm`'s agent reports a Reboot (`id`) an hour away, with the resource id of a VM of
/// `rg-<prefix of its name>`.
fn reboot_of(world: &mut World, vm: &str, id: &str) {
    let reboot = document(2, &[(id, "Reboot", "Scheduled", &[vm], 3600, -1)]);
    for event in published(vm, Some(&document(1, &[])), &reboot) {
        world.deliver(&event, t0());
    }
}
