//! Shutdown keeps its deadline: SIGTERM ends the agent within `delivery.shutdown_timeout`
//! (10 s by default) whatever hangs, so a supervisor's stop timeout never ends in SIGKILL,
//! and what was not delivered stays in the outbox for the next start; a poll that hangs does
//! not hold it back at all.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{AgentProcess, BINARY, SimProcess};

const EVENT: &str = "f0000000-0000-4000-8000-0000000000aa";

/// A Freeze waiting an hour for approval, and a metadata service whose POSTs hang for a
/// minute: an approval under way keeps the checker busy for its whole retry budget
/// (3 attempts of 10 s on the shipped defaults).
const SCENARIO: &str = r#"
[[events]]
id = "f0000000-0000-4000-8000-0000000000aa"
type = "Freeze"
resources = ["WestNO_0"]
notice = "1h"

[[faults]]
kind = "delay"
delay = "60s"
method = "POST"
lasting = "10m"
"#;

#[test]
fn sigterm_ends_the_agent_within_the_shutdown_timeout_while_an_approval_hangs() {
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("orchestrator.key");
    std::fs::write(&key, "hmac-sha256:shutdown-test-secret-0001").unwrap();
    let sim = SimProcess::start(&common::scenario_file(dir.path(), SCENARIO), 1.0);
    let port = sched_relay_transport::testing::free_port();
    let mut agent = AgentProcess::start_on_defaults(
        &sim.url,
        &format!(
            "[telemetry]\nlisten = \"127.0.0.1:{port}\"\n[approvals.http]\n[[approvals.keys]]\nid = \"k\"\nalgorithm = \"hmac-sha256\"\nsecret = \"shutdown-test-secret-0001\"\n"
        ),
    );
    agent.wait_for_id(&format!("{EVENT}:scheduled"), Duration::from_secs(15));
    // The orchestrator's request: its POST /approvals waits for the outcome, which waits
    // for the metadata service, which hangs.
    let mut request = Command::new(BINARY)
        .args(["sign-approval", "--key"])
        .arg(&key)
        .args(["--key-id", "k", "--vm", "WestNO_0", "--event-id", EVENT])
        .args(["--to", &format!("http://127.0.0.1:{port}/approvals")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !sim.requests().iter().any(|r| r["method"] == "POST") {
        assert!(
            Instant::now() < deadline,
            "the approval never reached the metadata service"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let stopping = Instant::now();
    agent.signal("TERM");
    let status = agent.wait(Duration::from_secs(90));
    let took = stopping.elapsed();
    let _ = request.kill();
    let _ = request.wait();
    assert!(status.success(), "exit {status}:\n{}", agent.log());
    assert!(
        took <= Duration::from_secs(13),
        "shutdown took {took:?}, past delivery.shutdown_timeout (10 s):\n{}",
        agent.log()
    );
}

/// A metadata service that takes the poll's GET and never answers, from 2 s on.
const HANGING_GET: &str = r#"
[[events]]
id = "f0000000-0000-4000-8000-0000000000bb"
type = "Reboot"
resources = ["WestNO_0"]
notice = "1h"

[[faults]]
kind = "delay"
delay = "120s"
method = "GET"
after = "2s"
lasting = "10m"
"#;

#[test]
fn sigterm_ends_the_agent_at_once_while_a_poll_hangs() {
    let dir = tempfile::tempdir().unwrap();
    let started = Instant::now();
    let sim = SimProcess::start(&common::scenario_file(dir.path(), HANGING_GET), 1.0);
    let mut agent = AgentProcess::start_on_defaults(&sim.url, "");
    agent.wait_for_id(
        "f0000000-0000-4000-8000-0000000000bb:scheduled",
        Duration::from_secs(15),
    );
    // Polls from 2 s on hang for their whole request timeout (5 s on the shipped defaults):
    // at 4.5 s one is under way, with 2.5 s or more to go.
    std::thread::sleep(Duration::from_millis(4500).saturating_sub(started.elapsed()));
    let stopping = Instant::now();
    agent.signal("TERM");
    let status = agent.wait(Duration::from_secs(30));
    let took = stopping.elapsed();
    assert!(status.success(), "exit {status}:\n{}", agent.log());
    assert!(
        took <= Duration::from_secs(2),
        "shutdown took {took:?}: it waited for the hanging poll:\n{}",
        agent.log()
    );
}
