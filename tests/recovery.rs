//! Nothing lost, nothing invented: the real binary killed with -9, stopped with a sink down,
//! restarted on a damaged store, stopped twice; the file sink (and a sink that was down) must
//! still get every transition, in order per Azure event, repeated only as identical ids.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use common::{AgentProcess, SimProcess, ids, read_events};
use serde_json::Value;

const FREEZE: &str = "C7061BAC-AFDC-4513-B24B-AA5F13A16123";

/// Each Azure event's transitions in order of first arrival (documents left out); a repeat is
/// allowed only as an identical id, which consumers de-duplicate.
fn transitions_by_event(events: &[Value]) -> BTreeMap<String, Vec<String>> {
    let mut seen = std::collections::HashSet::new();
    let mut by_event: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for event in events {
        let id = event["id"].as_str().unwrap();
        if id.starts_with("document:") || !seen.insert(id.to_owned()) {
            continue;
        }
        let subject = event["subject"].as_str().unwrap().to_owned();
        by_event.entry(subject).or_default().push(id.to_owned());
    }
    by_event
}

fn wait_until_all_gone(sim: &SimProcess, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        let state = sim.state();
        let phases = state["phases"].as_array().unwrap();
        if phases.iter().all(|p| p[1] == "gone") {
            return;
        }
        assert!(Instant::now() < deadline, "scenario not over: {state}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// An exec sink that asks for a retry (exit 75) until `flag` exists, then appends each event
/// to `out`: a sink that is down, then back, with no broker involved.
fn flaky_exec_sink(flag: &Path, out: &Path) -> String {
    format!(
        "[[sinks]]\nname = \"flaky\"\nkind = \"exec\"\ncommand = [\"/bin/sh\", \"-c\", \"test -f {} || exit 75; cat >> {}; echo >> {}\"]\n",
        flag.display(),
        out.display(),
        out.display()
    )
}

/// Waits until the sink that was down has received everything the file sink has, stops the
/// agent, and returns the file sink's ids.
fn wait_for_backlog(agent: &mut AgentProcess, out: &Path) -> Vec<String> {
    let expected = ids(&agent.events());
    let deadline = Instant::now() + Duration::from_secs(20);
    while read_events(out).len() < expected.len() {
        assert!(
            Instant::now() < deadline,
            "the backlog was not delivered:\n{}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    agent.stop_cleanly();
    expected
}

#[test]
fn an_event_that_finished_while_the_agent_was_down_still_yields_completed() {
    let sim = SimProcess::start("live-migration", 0.01);
    let mut agent = AgentProcess::start(&sim.url, "");
    agent.wait_for_id(&format!("{FREEZE}:started"), Duration::from_secs(30));
    agent.kill9();
    wait_until_all_gone(&sim, Duration::from_secs(30));

    agent.spawn(&[]);
    agent.wait_for_id(&format!("{FREEZE}:completed"), Duration::from_secs(10));
    agent.stop_cleanly();
    assert!(
        agent
            .log()
            .contains("Resuming after the last processed document"),
        "{}",
        agent.log()
    );
    let by_event = transitions_by_event(&agent.events());
    assert_eq!(
        by_event[FREEZE],
        [
            format!("{FREEZE}:scheduled"),
            format!("{FREEZE}:started"),
            format!("{FREEZE}:completed")
        ]
    );
}

#[test]
fn kill_minus_9_at_random_moments_loses_and_invents_nothing() {
    let seed = std::env::var("CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(7);
    let mut rng = fastrand::Rng::with_seed(seed);
    let sim = SimProcess::start("multi-vm", 0.02);
    let mut agent = AgentProcess::start(&sim.url, "");
    let mut kills = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        std::thread::sleep(Duration::from_millis(rng.u64(200..1500)));
        let state = sim.state();
        if state["phases"]
            .as_array()
            .unwrap()
            .iter()
            .all(|p| p[1] == "gone")
            || Instant::now() > deadline
        {
            break;
        }
        agent.kill9();
        agent.spawn(&[]);
        kills += 1;
    }
    let last = sim.wait_finished(Duration::from_secs(30));
    agent.wait_for_id(&format!("document:{last}"), Duration::from_secs(10));
    agent.stop_cleanly();
    assert!(kills >= 5, "only {kills} kills (seed {seed})");

    let [freeze, reboot, redeploy] =
        ["1", "2", "3"].map(|n| format!("aaaaaaaa-0000-4000-8000-00000000000{n}"));
    let lifecycle = |id: &str| {
        vec![
            format!("{id}:scheduled"),
            format!("{id}:started"),
            format!("{id}:completed"),
        ]
    };
    let by_event = transitions_by_event(&agent.events());
    assert_eq!(
        by_event.len(),
        3,
        "nothing invented (seed {seed}, {kills} kills): {by_event:?}"
    );
    assert_eq!(
        by_event[&freeze],
        lifecycle(&freeze),
        "seed {seed}, {kills} kills"
    );
    assert_eq!(
        by_event[&reboot],
        lifecycle(&reboot),
        "seed {seed}, {kills} kills"
    );
    assert_eq!(
        by_event[&redeploy],
        lifecycle(&redeploy),
        "seed {seed}, {kills} kills"
    );
}

#[test]
fn sigterm_keeps_what_a_down_sink_missed_and_the_next_start_delivers_it_in_order() {
    let work = tempfile::tempdir().unwrap();
    let flag = work.path().join("sink-is-up");
    let out = work.path().join("flaky.jsonl");
    let sim = SimProcess::start("live-migration", 0.005);
    let extra = format!(
        "{}\n[delivery]\nshutdown_timeout = \"1s\"\nretry_max = \"200ms\"\n",
        flaky_exec_sink(&flag, &out)
    );
    let mut agent = AgentProcess::start(&sim.url, &extra);
    let last = sim.wait_finished(Duration::from_secs(60));
    agent.wait_for_id(&format!("document:{last}"), Duration::from_secs(10));
    assert!(
        agent.stop().success(),
        "SIGTERM exits 0 even with a sink down:\n{}",
        agent.log()
    );
    assert!(
        agent.log().contains("stay in the outbox"),
        "{}",
        agent.log()
    );
    assert!(
        !agent
            .dir
            .path()
            .join("state/dead-letter/flaky.jsonl")
            .exists(),
        "kept, not dead-lettered"
    );

    std::fs::write(&flag, "").unwrap();
    agent.spawn(&[]);
    let expected = wait_for_backlog(&mut agent, &out);
    assert_eq!(
        ids(&read_events(&out)),
        expected,
        "the sink that was down got everything, in order"
    );
}

#[test]
fn a_damaged_state_store_stops_the_agent_unless_told_to_start_fresh() {
    let sim = SimProcess::start("live-migration", 1.0);
    let mut agent = AgentProcess::start(&sim.url, "");
    agent.wait_for_id("document:1", Duration::from_secs(10));
    agent.stop_cleanly();
    let store = agent.dir.path().join("state/outbox.redb");
    std::fs::write(
        &store,
        b"garbage where the outbox was; the disk had a bad day",
    )
    .unwrap();

    agent.spawn(&[]);
    let status = agent.wait(Duration::from_secs(10));
    assert_eq!(status.code(), Some(1), "{}", agent.log());
    assert!(
        agent.log().contains("--fresh-state"),
        "the error says what to do:\n{}",
        agent.log()
    );

    agent.spawn(&["--fresh-state"]);
    std::thread::sleep(Duration::from_millis(800));
    agent.stop_cleanly();
    let set_aside = std::fs::read_dir(agent.dir.path().join("state"))
        .unwrap()
        .filter_map(|e| e.ok())
        .any(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with("outbox.redb.set-aside-")
        });
    assert!(
        set_aside,
        "the damaged store is kept for inspection, not deleted"
    );
}

#[test]
fn a_second_signal_exits_at_once_and_loses_nothing_already_stored() {
    let work = tempfile::tempdir().unwrap();
    let flag = work.path().join("sink-is-up");
    let out = work.path().join("flaky.jsonl");
    let sim = SimProcess::start("live-migration", 0.005);
    let extra = format!(
        "{}\n[delivery]\nshutdown_timeout = \"60s\"\n",
        flaky_exec_sink(&flag, &out)
    );
    let mut agent = AgentProcess::start(&sim.url, &extra);
    let last = sim.wait_finished(Duration::from_secs(60));
    agent.wait_for_id(&format!("document:{last}"), Duration::from_secs(10));

    agent.signal("TERM");
    std::thread::sleep(Duration::from_millis(300));
    agent.signal("TERM");
    let status = agent.wait(Duration::from_secs(3));
    assert_eq!(status.code(), Some(130), "{}", agent.log());

    std::fs::write(&flag, "").unwrap();
    agent.spawn(&[]);
    let expected = wait_for_backlog(&mut agent, &out);
    assert_eq!(ids(&read_events(&out)), expected);
}

/// Azure restarts DocumentIncarnation (redeploy, deallocate/start, re-enabled after 24 h):
/// incarnation 2 holds one event, then numbering restarts at 1 and the very next change
/// (a second event appearing) is served again as incarnation 2.
const RESET_SCENARIO: &str = r#"
start_incarnation = 1
incarnation_reset_after = "6s"
[[events]]
id = "before-reset"
type = "Freeze"
resources = ["WestNO_0"]
appear_after = "1s"
notice = "10m"
[[events]]
id = "after-reset"
type = "Reboot"
resources = ["WestNO_0"]
appear_after = "6s"
notice = "10m"
"#;

/// The shipped default polling (the agent helper polls faster).
const DEFAULT_POLLING: [(&str, &str); 2] = [
    ("SCHED_RELAY_IMDS__POLL_INTERVAL", "1s"),
    ("SCHED_RELAY_IMDS__MAX_BACKOFF", "5s"),
];

fn reset_simulator(dir: &Path) -> (SimProcess, Instant) {
    let scenario = dir.join("reset.toml");
    std::fs::write(&scenario, RESET_SCENARIO).unwrap();
    let sim = SimProcess::start(scenario.to_str().unwrap(), 1.0);
    (sim, Instant::now())
}

/// Every id names one content: a consumer de-duplicating on (source, id) drops only repeats.
fn assert_ids_name_one_content(events: &[Value], log: &str) {
    let mut seen: BTreeMap<String, Value> = BTreeMap::new();
    for event in events {
        let id = event["id"].as_str().unwrap().to_owned();
        if let Some(before) = seen.insert(id.clone(), event["data"].clone()) {
            assert_eq!(
                before, event["data"],
                "{id} was reused for other content\n{log}"
            );
        }
    }
}

#[test]
fn a_reset_incarnation_with_new_content_is_diffed_not_skipped() {
    let work = tempfile::tempdir().unwrap();
    let (sim, _) = reset_simulator(work.path());
    let mut agent = AgentProcess::start_with_env(&sim.url, "", &DEFAULT_POLLING);
    agent.wait_for_id("before-reset:scheduled", Duration::from_secs(15));
    let events = agent.wait_for_id("after-reset:scheduled", Duration::from_secs(15));
    agent.stop_cleanly();
    assert_ids_name_one_content(&events, &agent.log());
    let ids = ids(&events);
    assert!(ids.contains(&"document:2".into()), "{ids:?}");
    assert!(
        ids.contains(&"document:2~e1".into()),
        "the new numbering's epoch: {ids:?}"
    );
    assert!(
        agent.log().contains("DocumentIncarnation reset"),
        "the reset is logged:\n{}",
        agent.log()
    );
}

#[test]
fn a_reset_incarnation_seen_first_after_a_restart_is_diffed_not_skipped() {
    let work = tempfile::tempdir().unwrap();
    let (sim, started) = reset_simulator(work.path());
    let mut agent = AgentProcess::start_with_env(&sim.url, "", &DEFAULT_POLLING);
    agent.wait_for_id("before-reset:scheduled", Duration::from_secs(15));
    agent.stop_cleanly();
    // Down while Azure restarts its numbering and the next change reuses incarnation 2.
    let after_reset = started + Duration::from_secs(7);
    std::thread::sleep(after_reset.saturating_duration_since(Instant::now()));
    agent.spawn(&[]);
    let events = agent.wait_for_id("after-reset:scheduled", Duration::from_secs(15));
    agent.stop_cleanly();
    assert_ids_name_one_content(&events, &agent.log());
    let ids = ids(&events);
    assert!(ids.contains(&"document:2".into()), "{ids:?}");
    assert!(
        ids.contains(&"document:2~e1".into()),
        "the new numbering's epoch: {ids:?}"
    );
}
