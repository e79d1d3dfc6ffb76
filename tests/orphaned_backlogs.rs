//! A sink that was renamed or removed leaves its undelivered events in the outbox, keyed by
//! its old name: the agent reports them at start (log, metric, `/events`), and
//! `sched-relay outbox` lists them and dead-letters or moves them while the agent is stopped.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use cloudevents::{AttributesReader, EventBuilder, EventBuilderV10};
use common::{AgentProcess, BINARY, SimProcess, blocking_get};
use sched_relay::store::Outbox;
use sched_relay_core::Event;

fn event(id: &str) -> Event {
    EventBuilderV10::new()
        .id(id)
        .source("urn:sched-relay:vm:test")
        .ty("com.azure.scheduledevents.scheduled")
        .build()
        .unwrap()
        .into()
}

/// Stores events named `<sink>-<n>` for each (sink, count), as an earlier agent would have.
fn store(state: &Path, backlogs: &[(&str, usize)]) {
    std::fs::create_dir_all(state).unwrap();
    let outbox = Outbox::open(state, 10_000, false).unwrap();
    for (sink, count) in backlogs {
        let events: Vec<Event> = (1..=*count)
            .map(|n| event(&format!("{sink}-{n}")))
            .collect();
        outbox.commit(&[sink.to_string()], &events, None).unwrap();
    }
}

fn stored_ids(state: &Path, sink: &str) -> Vec<String> {
    Outbox::open(state, 10_000, false)
        .unwrap()
        .pending(sink, 100)
        .unwrap()
        .into_iter()
        .map(|stored| stored.event.unwrap().id().to_owned())
        .collect()
}

#[test]
fn a_backlog_of_a_sink_no_longer_configured_is_reported_at_start() {
    let sim = SimProcess::start("live-migration", 0.01);
    let port = sched_relay_transport::testing::free_port();
    let mut agent = AgentProcess::start(
        &sim.url,
        &format!("[telemetry]\nlisten = \"127.0.0.1:{port}\"\n"),
    );
    // Its first run, then a backlog left by a sink called "audit" that has since been renamed.
    agent.wait_for_id("document:1", Duration::from_secs(20));
    agent.stop_cleanly();
    store(&agent.dir.path().join("state"), &[("audit", 3)]);
    agent.spawn(&[]);

    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let line = loop {
        if let Some(line) = agent
            .log()
            .lines()
            .find(|line| line.contains("no longer configured"))
        {
            break line.to_owned();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no report of the orphaned backlog:\n{}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(line.contains("WARN"), "{line}");
    assert!(
        line.contains("sink=audit") && line.contains("undelivered=3"),
        "{line}"
    );
    assert!(
        line.contains("sched-relay outbox"),
        "says what to do: {line}"
    );

    let (_, events) = blocking_get(&format!("http://127.0.0.1:{port}/events"), &[]);
    let events: serde_json::Value = serde_json::from_str(&events).unwrap();
    assert_eq!(
        events["orphanedSinks"],
        serde_json::json!([{"sink": "audit", "undelivered": 3}]),
        "{events}"
    );
    let (_, metrics) = blocking_get(&format!("http://127.0.0.1:{port}/metrics"), &[]);
    assert!(
        metrics.contains("sched_relay_outbox_orphaned_events{sink=\"audit\"} 3"),
        "{metrics}"
    );
    agent.stop_cleanly();
}

/// `sched-relay outbox <args>` with a configuration whose only sink is `file`.
fn outbox(config: &Path, args: &[&str]) -> (bool, String, String) {
    let output = Command::new(BINARY)
        .args(["outbox", "--config"])
        .arg(config)
        .args(args)
        .env_remove("SCHED_RELAY_CONFIG")
        .output()
        .unwrap();
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[test]
fn outbox_commands_list_move_and_dead_letter_backlogs_of_sinks_no_longer_configured() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    store(&state, &[("file", 1), ("audit", 3), ("old", 2)]);
    let config = dir.path().join("agent.toml");
    std::fs::write(
        &config,
        format!(
            "[state]\ndir = \"{}\"\n\n[[sinks]]\nname = \"file\"\nkind = \"file\"\npath = \"{}\"\n",
            state.display(),
            dir.path().join("events.jsonl").display()
        ),
    )
    .unwrap();

    let (ok, listed, error) = outbox(&config, &["list"]);
    assert!(ok, "{error}");
    let row = |sink: &str| {
        listed
            .lines()
            .find(|line| line.split_whitespace().next() == Some(sink))
            .unwrap_or_else(|| panic!("no row for {sink}:\n{listed}"))
            .to_owned()
    };
    assert!(row("audit").contains(" 3 ") && row("audit").contains("not configured"));
    assert!(row("file").contains(" 1 ") && row("file").contains("  configured"));

    // A renamed sink: its backlog joins the new name's queue, after what is there, in order.
    let (ok, out, error) = outbox(&config, &["move", "audit", "file"]);
    assert!(ok, "{error}");
    assert!(out.contains("moved 3"), "{out}");
    assert_eq!(
        stored_ids(&state, "file"),
        ["file-1", "audit-1", "audit-2", "audit-3"]
    );
    assert!(stored_ids(&state, "audit").is_empty());

    // A removed sink: its backlog goes to its dead-letter file, in the usual format.
    let (ok, out, error) = outbox(&config, &["dead-letter", "old"]);
    assert!(ok, "{error}");
    assert!(out.contains("wrote 2"), "{out}");
    let dead = std::fs::read_to_string(state.join("dead-letter/old.jsonl")).unwrap();
    let ids: Vec<String> = dead
        .lines()
        .map(|line| {
            let record: serde_json::Value = serde_json::from_str(line).unwrap();
            assert_eq!(record["sink"], "old");
            assert!(
                record["reason"]
                    .as_str()
                    .unwrap()
                    .contains("outbox dead-letter")
            );
            record["event"]["id"].as_str().unwrap().to_owned()
        })
        .collect();
    assert_eq!(ids, ["old-1", "old-2"]);
    assert!(stored_ids(&state, "old").is_empty());

    // Mistakes are refused with the reason, and change nothing.
    let (ok, _, error) = outbox(&config, &["move", "file", "nowhere"]);
    assert!(!ok && error.contains("not configured"), "{error}");
    let (ok, _, error) = outbox(&config, &["dead-letter", "nothing"]);
    assert!(!ok && error.contains("no events stored"), "{error}");
    let held = Outbox::open(&state, 10_000, false).unwrap();
    let (ok, _, error) = outbox(&config, &["list"]);
    assert!(!ok && error.contains("stop the agent first"), "{error}");
    drop(held);
    assert_eq!(stored_ids(&state, "file").len(), 4);
}
