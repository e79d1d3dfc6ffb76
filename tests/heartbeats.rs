//! The agent's heartbeat on the wire, with the real binary against the simulator: one as
//! soon as the first document is processed, then every `events.heartbeat_interval`, each
//! with the last processed document's incarnation and events, on a file sink and a real
//! NATS subject; never run by an exec sink whose `transitions` do not name it.

mod common;

use std::time::{Duration, Instant};

use common::{AgentProcess, SimProcess, is_heartbeat, read_all_events, read_events};
use futures_util::StreamExt;
use sched_relay_transport::testing::{broker_available, unique};
use serde_json::{Value, json};

const NATS: &str = "127.0.0.1:4222";
const FREEZE: &str = "f0000000-0000-4000-8000-00000000000a";
const REBOOT: &str = "f0000000-0000-4000-8000-00000000000b";

/// A Freeze that stays Scheduled, and a Reboot that starts after a second and stays Started:
/// after that second the document no longer changes.
const SCENARIO: &str = r#"
[vm]
name = "WestNO_0"
resource_id = "/subscriptions/s/resourceGroups/g/providers/Microsoft.Compute/virtualMachines/WestNO_0"

[[events]]
id = "f0000000-0000-4000-8000-00000000000a"
type = "Freeze"
resources = ["WestNO_0"]
appear_after = "0s"
notice = "1h"

[[events]]
id = "f0000000-0000-4000-8000-00000000000b"
type = "Reboot"
resources = ["WestNO_0"]
appear_after = "0s"
notice = "1s"
started_for = "1h"
"#;

/// Waits until the file sink holds `count` heartbeats made after the Reboot started.
fn wait_for_heartbeats(agent: &AgentProcess, count: usize) -> Vec<Value> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let all = read_all_events(&agent.events_file);
        let started = all
            .iter()
            .position(|event| event["id"] == format!("{REBOOT}:started"));
        let after = started.map_or(0, |at| all[at..].iter().filter(|e| is_heartbeat(e)).count());
        if after >= count {
            return all;
        }
        assert!(
            Instant::now() < deadline,
            "{after} heartbeats after the Reboot started: {all:#?}\n{}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The Unix milliseconds of a heartbeat's id.
fn millis(heartbeat: &Value) -> i64 {
    let id = heartbeat["id"].as_str().unwrap();
    id.strip_prefix("heartbeat:").unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn heartbeats_carry_the_last_documents_incarnation_and_events_to_a_file_and_a_nats_subject() {
    if !broker_available("NATS", NATS, "nats-server -a 127.0.0.1 -p 4222 -js") {
        return;
    }
    let prefix = unique("hb");
    let client = async_nats::connect(NATS).await.unwrap();
    let mut subscriber = client
        .subscribe(format!("{prefix}.WestNO_0.heartbeat"))
        .await
        .unwrap();
    client.flush().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let sim = SimProcess::start(&common::scenario_file(dir.path(), SCENARIO), 1.0);
    let agent = AgentProcess::start(
        &sim.url,
        &format!(
            "[events]\nheartbeat_interval = \"1s\"\n\n[[sinks]]\nname = \"bus\"\nkind = \"nats\"\n\
             url = \"nats://{NATS}\"\njetstream = false\nsubject = \"{prefix}.{{vmname}}.{{transition}}\"\n"
        ),
    );
    let all = tokio::task::block_in_place(|| wait_for_heartbeats(&agent, 2));
    let log = agent.log();

    // The first comes at once after the first document, before anything else happens.
    let first_document = all
        .iter()
        .position(|event| event["type"] == "com.azure.scheduledevents.document")
        .unwrap_or_else(|| panic!("no document: {all:#?}"));
    let first = &all[first_document + 1];
    assert!(
        is_heartbeat(first),
        "not right after the first document: {all:#?}\n{log}"
    );
    assert_eq!(first["incarnation"], all[first_document]["incarnation"]);

    // Each carries the document processed last when it was made: once the Reboot started,
    // both events as that document lists them.
    let heartbeats: Vec<&Value> = all.iter().filter(|event| is_heartbeat(event)).collect();
    let last = *heartbeats.last().unwrap();
    let last_document = read_events(&agent.events_file)
        .into_iter()
        .rfind(|event| event["type"] == "com.azure.scheduledevents.document")
        .unwrap();
    assert_eq!(last["type"], "com.azure.scheduledevents.heartbeat");
    assert_eq!(last["subject"], "heartbeat");
    assert_eq!(last["source"], last_document["source"]);
    assert_eq!(last["vmname"], "WestNO_0");
    assert_eq!(last["partitionkey"], "WestNO_0");
    assert_eq!(last["incarnation"], last_document["incarnation"], "{log}");
    let data = &last["data"];
    assert_eq!(data["incarnation"], last_document["incarnation"]);
    assert_eq!(data["epoch"], 0);
    assert_eq!(data["intervalSeconds"], 1);
    assert_eq!(data["agentVersion"], env!("CARGO_PKG_VERSION"));
    assert_eq!(data["vm"]["name"], "WestNO_0");
    assert!(
        chrono::DateTime::parse_from_rfc3339(data["startedAt"].as_str().unwrap()).is_ok(),
        "{data}"
    );
    assert_eq!(
        data["events"],
        json!([
            {"EventId": FREEZE, "EventStatus": "Scheduled"},
            {"EventId": REBOOT, "EventStatus": "Started"},
        ])
    );
    // Every interval, not every poll (200 ms): each one a new id.
    for pair in heartbeats.windows(2) {
        let apart = millis(pair[1]) - millis(pair[0]);
        assert!(apart >= 900, "{apart} ms apart: {heartbeats:#?}");
        assert_eq!(pair[1]["data"]["startedAt"], pair[0]["data"]["startedAt"]);
    }

    // The same on the wire: subject `<prefix>.<vm>.heartbeat`, the document's state inside.
    let message = loop {
        let message = tokio::time::timeout(Duration::from_secs(10), subscriber.next())
            .await
            .expect("a heartbeat on NATS within 10 s")
            .unwrap();
        let body: Value = serde_json::from_slice(&message.payload).unwrap();
        if body["incarnation"] == last_document["incarnation"] {
            break message;
        }
    };
    assert_eq!(
        message.subject.as_str(),
        format!("{prefix}.WestNO_0.heartbeat")
    );
    let headers = message.headers.clone().unwrap();
    let header = |name: &str| headers.get(name).map(|v| v.as_str().to_owned());
    assert_eq!(
        header("ce-type").as_deref(),
        Some("com.azure.scheduledevents.heartbeat")
    );
    assert_eq!(header("ce-subject").as_deref(), Some("heartbeat"));
    assert!(header("ce-id").unwrap().starts_with("heartbeat:"));
    let body: Value = serde_json::from_slice(&message.payload).unwrap();
    assert_eq!(body["events"], data["events"]);
}

#[test]
fn an_exec_sink_runs_for_heartbeats_only_when_its_transitions_name_them() {
    let dir = tempfile::tempdir().unwrap();
    let every = dir.path().join("every.txt");
    let listed = dir.path().join("listed.txt");
    let exec = |name: &str, out: &std::path::Path, transitions: &str| {
        format!(
            "[[sinks]]\nname = \"{name}\"\nkind = \"exec\"\n\
             command = [\"/bin/sh\", \"-c\", \"echo \\\"$TRANSITION $CE_ID\\\" >> {}\"]\n{transitions}\n",
            out.display()
        )
    };
    let sim = SimProcess::start(&common::scenario_file(dir.path(), SCENARIO), 1.0);
    let mut agent = AgentProcess::start(
        &sim.url,
        &format!(
            "[events]\nheartbeat_interval = \"1s\"\n\n{}\n{}",
            exec("drain", &every, ""),
            exec("alive", &listed, "transitions = [\"heartbeat\"]"),
        ),
    );
    wait_for_heartbeats(&agent, 3);
    // What the file sink has, the exec sinks have had time to run for (they run in order).
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::fs::read_to_string(&listed)
        .unwrap_or_default()
        .lines()
        .count()
        < 3
    {
        assert!(Instant::now() < deadline, "{}", agent.log());
        std::thread::sleep(Duration::from_millis(100));
    }
    agent.stop_cleanly();

    let ran = |path: &std::path::Path| std::fs::read_to_string(path).unwrap_or_default();
    let every = ran(&every);
    assert!(
        every.contains(&format!("started {REBOOT}:started")),
        "an empty filter runs for the transitions:\n{every}"
    );
    assert!(
        !every.contains("heartbeat"),
        "an empty filter never runs for a heartbeat:\n{every}"
    );
    let listed = ran(&listed);
    assert!(
        listed
            .lines()
            .all(|line| line.starts_with("heartbeat heartbeat:")),
        "{listed}"
    );
}
