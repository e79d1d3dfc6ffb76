//! `/fleet`'s parts are kept written between refreshes, each beside a copy of what it was
//! written from (benches/profiling.md, section 30): whatever changed, a refresh says what
//! writing every part again from the same state says, and writes only what changed.

use super::quiet_day::start_with;
use super::{document, published, t0};
use crate::coordinator::fleet::{Back, Maintenance, Vm};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fleet_json_shows_every_change_since_the_last_refresh_and_writes_only_those() {
    let mut world = start_with(tempfile::tempdir().unwrap(), "");
    let reboot = document(2, &[("E1", "Reboot", "Scheduled", &["batch-0"], 3600, -1)]);
    for event in published("batch-0", Some(&document(1, &[])), &reboot) {
        world.deliver(&event, t0());
    }
    for vm in ["batch-0", "batch-2", "batch-4"] {
        world.beat(vm, t0(), t0(), &[]);
    }
    world.engine.tick(t0());
    world.settle().await;
    // A VM and an event that nothing changes: their parts are kept, and must still be
    // what a rewrite says. (A VM whose agent sends no heartbeat is never silent.)
    world.engine.fleet.insert_vm(
        "batch-1".into(),
        Vm {
            resource_id: Some("/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachines/batch-1".into()),
            last_seen: t0(),
            heartbeat: None,
            first_seen: None,
        },
    );
    world
        .engine
        .fleet
        .events
        .insert("E2".into(), Maintenance::new("E2".into(), t0()));
    world.engine.publish_snapshot(t0());
    let before = world.engine.fleet_json();
    assert_eq!(before["vms"]["batch-0"]["silent"], false, "{before}");

    // A heartbeat, a VM that came, one that left, an event's evidence, an event added
    // before it; batch-0 goes silent with time alone.
    let later = t0() + chrono::Duration::hours(2);
    world.beat("batch-2", later, later, &[]);
    world.beat("batch-3", later, later, &[]);
    world.engine.fleet.remove_vm("batch-4");
    world
        .engine
        .fleet
        .events
        .get_mut("E1")
        .unwrap()
        .back
        .insert("batch-0".into(), Back::new("completed", later));
    world
        .engine
        .fleet
        .events
        .insert("E0".into(), Maintenance::new("E0".into(), later));
    world.engine.publish_snapshot(later);
    assert_eq!(
        world.engine.last_writes(),
        (3, 2),
        "batch-0 (silent), batch-2 and batch-3 written; E0 and E1; batch-1 and E2 kept"
    );
    let kept = world.engine.snapshot.read().unwrap().clone();
    world.engine.forget_written();
    world.engine.publish_snapshot(later);
    let rewritten = world.engine.snapshot.read().unwrap().clone();
    assert_eq!(
        std::str::from_utf8(&kept).unwrap(),
        std::str::from_utf8(&rewritten).unwrap()
    );
    // The changes are there to compare.
    let shown = world.engine.fleet_json();
    assert_eq!(shown["vms"]["batch-0"]["silent"], true, "{shown}");
    assert_ne!(shown["vms"]["batch-2"], before["vms"]["batch-2"], "{shown}");
    assert!(shown["vms"]["batch-3"].is_object(), "{shown}");
    assert!(shown["vms"].get("batch-4").is_none(), "{shown}");
    assert_eq!(shown["vms"]["batch-1"], before["vms"]["batch-1"], "{shown}");
    assert_eq!(shown["events"][0]["event_id"], "E0", "{shown}");
    assert_eq!(
        shown["events"][1]["back"]["batch-0"]["by"], "completed",
        "{shown}"
    );
    assert_eq!(shown["events"][2], before["events"][1], "{shown}");
}
