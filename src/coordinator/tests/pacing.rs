//! The coordinator's pacing: decisions on arrivals and ended drains wait for the gap the last
//! decision's cost set (`DECISION_GAP` at least, `DECISION_GAP_MAX` at most), and what is
//! owed in the meantime is decided when the gap ends, not lost. The world is the quiet-day
//! tests' (the engine's own store, a recording publisher, the test's clock).

use super::quiet_day::{World, start};
use super::{document, published};

/// The coordinator's loop decides at most once per `DECISION_GAP` on messages: a report
/// that comes within the gap after a decision is decided when the gap ends, not lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_within_the_decision_gap_is_decided_when_the_gap_ends() {
    let mut world = start(tempfile::tempdir().unwrap());
    let now = chrono::Utc::now();
    for vm in ["web-0", "db-0"] {
        for event in published(vm, None, &document(1, &[])) {
            world.deliver(&event, now);
        }
    }
    let report = |world: &mut World, vm: &str, id: &str| {
        // NotBefore a day from now (the documents count from t0, days ago).
        let not_before = (now - super::t0()).num_seconds() + 24 * 3600;
        let d = document(2, &[(id, "Reboot", "Scheduled", &[vm], not_before, -1)]);
        for event in published(vm, Some(&document(1, &[])), &d) {
            let subject = format!("scheduledevents.{vm}.scheduled");
            world.deliver_with(&event, now, &subject, true);
        }
    };
    // R0 is decided as it comes (no gap yet); then a gap of a minute, which a loaded
    // machine's commits cannot outlast before R1 comes.
    world.engine.decision_gap = std::time::Duration::ZERO;
    report(&mut world, "web-0", "R0");
    let gap = std::time::Duration::from_secs(60);
    world.engine.decision_gap = gap;
    // Within the gap after R0's decision: owed, not decided yet.
    report(&mut world, "db-0", "R1");
    let due = world.engine.owed_at().expect("R1's decision is owed");
    assert!(due <= std::time::Instant::now() + gap);
    // R0's publication finishes; its result is not handed back yet (that decides too).
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    assert_eq!(world.recorder.approved(), ["R0"]);
    world.engine.decide_owed(now);
    world.settle().await;
    assert_eq!(world.recorder.approved(), ["R0", "R1"]);
    assert_eq!(world.engine.owed_at(), None);
}

/// However large the fleet, decisions on arrivals leave most of the coordinator's loop to
/// its input: after a decision that cost 40 ms, the next one on arrivals waits 200 ms, not
/// the 20 ms that kept a 10,000-VM coordinator deciding all the time and reading its input
/// ever later; never more than a second; a cheap decision leaves the gap at `DECISION_GAP`.
#[tokio::test]
async fn the_gap_between_decisions_is_five_times_the_last_ones_cost_up_to_a_second() {
    use crate::coordinator::engine::{DECISION_GAP, DECISION_GAP_MAX};
    use std::time::Duration;
    let mut world = start(tempfile::tempdir().unwrap());
    assert_eq!(world.engine.gap(), DECISION_GAP);
    world.engine.last_decision_cost(Duration::from_millis(40));
    assert_eq!(world.engine.gap(), Duration::from_millis(200));
    world.engine.last_decision_cost(Duration::from_secs(8));
    assert_eq!(world.engine.gap(), DECISION_GAP_MAX);
    assert_eq!(DECISION_GAP_MAX, Duration::from_secs(1));
    world.engine.last_decision_cost(Duration::from_millis(1));
    assert_eq!(world.engine.gap(), DECISION_GAP);
    // A gap set to zero (tests that decide every message at once) stays zero.
    world.engine.decision_gap = Duration::ZERO;
    world.engine.last_decision_cost(Duration::from_millis(40));
    assert_eq!(world.engine.gap(), Duration::ZERO);
}

/// A drain that ends within the gap after a decision is approved when the gap ends (the
/// coordinator's loop sleeps until `owed_at`), not at once: a wave ends hundreds of drains
/// a second. The gap is the one the last decision's cost set (150 ms: 750 ms).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_that_ends_within_the_gap_is_approved_when_the_gap_ends() {
    use crate::coordinator::engine::Done;
    use crate::coordinator::fleet::Drain;
    use std::time::{Duration, Instant};
    let mut world = start(tempfile::tempdir().unwrap());
    let now = chrono::Utc::now();
    for event in published("web-0", None, &document(1, &[])) {
        world.deliver(&event, now);
    }
    // R1 comes within a long gap: owed, not decided.
    world.engine.decision_gap = Duration::from_secs(60);
    let not_before = (now - super::t0()).num_seconds() + 24 * 3600;
    let d = document(
        2,
        &[("R1", "Reboot", "Scheduled", &["web-0"], not_before, -1)],
    );
    for event in published("web-0", Some(&document(1, &[])), &d) {
        world.deliver_with(&event, now, "scheduledevents.web-0.scheduled", true);
    }
    assert!(world.engine.owed_at().is_some());
    // As if that decision had drained web-0 for R1, and the decision had cost 40 ms.
    world.engine.fleet.events.get_mut("R1").unwrap().drain = Some(Drain {
        started_at: now,
        deadline: now + chrono::Duration::minutes(10),
        vms: [("web-0".to_owned(), "running".to_owned())].into(),
        finished_at: None,
        deadline_missed: false,
    });
    world.engine.decision_gap = crate::coordinator::engine::DECISION_GAP;
    world.engine.decide_owed(now);
    assert!(world.recorder.approved().is_empty(), "the drain runs");
    world.engine.last_decision_cost(Duration::from_millis(150));
    world.engine.finished_paced(Done::Drained {
        key: "R1".into(),
        vm: "web-0".into(),
        result: Ok(()),
        took: Duration::from_millis(500),
    });
    world.settle().await;
    assert!(world.recorder.approved().is_empty(), "approved at once");
    let due = world.engine.owed_at().expect("its approval is owed");
    // 750 ms after the decision; a loaded machine may take some of it to get here.
    assert!(
        due > Instant::now() + Duration::from_millis(400),
        "the gap is 750 ms"
    );
    world.engine.decide_owed(now);
    world.settle().await;
    assert_eq!(world.recorder.approved(), ["R1"]);
}

/// A verdict is put into words again only when its wait changed; but whatever else wrote over
/// it, the event shows what the last decision found, and a changed wait shows at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_events_verdict_follows_its_wait_whatever_wrote_over_it() {
    use crate::coordinator::engine::Admin;
    let mut world = start(tempfile::tempdir().unwrap());
    let now = chrono::Utc::now();
    world.engine.decision_gap = std::time::Duration::ZERO;
    // NotBefore a day from now (the documents count from t0, days ago).
    let not_before = (now - super::t0()).num_seconds() + 24 * 3600;
    for (vm, id) in [("web-0", "R0"), ("web-1", "R1")] {
        for event in published(vm, None, &document(1, &[])) {
            world.deliver(&event, now);
        }
        let d = document(2, &[(id, "Reboot", "Scheduled", &[vm], not_before, -1)]);
        for event in published(vm, Some(&document(1, &[])), &d) {
            world.deliver(&event, now);
        }
    }
    world.settle().await;
    assert_eq!(world.recorder.approved(), ["R0"]);
    let verdict = |world: &World| world.engine.fleet.events["R1"].verdict.clone();
    let waiting = verdict(&world);
    assert!(waiting.starts_with("waiting for budget"), "{waiting}");
    world.engine.fleet.events.get_mut("R1").unwrap().verdict = "written over".into();
    world.engine.decide(now);
    assert_eq!(verdict(&world), waiting);
    world
        .engine
        .admin(
            Admin::Pause {
                reason: "incident".into(),
            },
            now,
        )
        .unwrap();
    world.engine.decide(now);
    assert_eq!(verdict(&world), "paused by an operator: incident");
}
