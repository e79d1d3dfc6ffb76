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

/// A "broker" that accepts every connection and never says a word: each client waits for
/// a greeting (NATS's INFO, AMQP's Connection.Start) that never comes. Not a real broker:
/// none can be made to hold a connection open in silence.
fn silent_broker() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in listener.incoming().flatten() {
            held.push(stream);
        }
    });
    port
}

/// An approval source whose broker accepts the connection and never answers (for a minute:
/// its connection timeout, past the shutdown deadline): SIGTERM still ends the agent within
/// `delivery.shutdown_timeout`.
#[cfg(all(feature = "nats", feature = "amqp"))]
#[test]
fn sigterm_ends_the_agent_within_the_shutdown_timeout_while_an_approval_source_hangs() {
    let dir = tempfile::tempdir().unwrap();
    let sim = SimProcess::start(&common::scenario_file(dir.path(), HANGING_GET), 1.0);
    let nats = silent_broker();
    let amqp = silent_broker();
    let mut agent = AgentProcess::start_on_defaults(
        &sim.url,
        &format!(
            r#"[[sinks]]
name = "bus"
kind = "nats"
url = "nats://127.0.0.1:{nats}"
timeout = "60s"
[[sinks]]
name = "rabbit"
kind = "amqp"
url = "amqp://guest:guest@127.0.0.1:{amqp}/%2f"
timeout = "60s"
[approvals.nats]
sink = "bus"
[approvals.amqp]
sink = "rabbit"
[[approvals.keys]]
id = "k"
algorithm = "hmac-sha256"
secret = "shutdown-test-secret-0001"
"#
        ),
    );
    agent.wait_for_id(
        "f0000000-0000-4000-8000-0000000000bb:scheduled",
        Duration::from_secs(15),
    );
    // Long enough for the sources to be inside their first connection attempt.
    std::thread::sleep(Duration::from_secs(3));
    let stopping = Instant::now();
    agent.signal("TERM");
    let status = agent.wait(Duration::from_secs(90));
    let took = stopping.elapsed();
    assert!(
        took <= Duration::from_secs(13),
        "shutdown took {took:?}, past delivery.shutdown_timeout (10 s):\n{}",
        agent.log()
    );
    assert!(status.success(), "exit {status}:\n{}", agent.log());
}

/// A second SIGTERM while the sinks drain exits at once (130), and the log says so: the
/// lines still queued for stderr are written before the exit.
#[cfg(feature = "webhook")]
#[test]
fn a_second_sigterm_exits_at_once_and_its_log_lines_are_written() {
    let dir = tempfile::tempdir().unwrap();
    let sim = SimProcess::start(&common::scenario_file(dir.path(), HANGING_GET), 1.0);
    let receiver = silent_broker();
    let mut agent = AgentProcess::start_on_defaults(
        &sim.url,
        &format!(
            "[[sinks]]\nname = \"hook\"\nkind = \"webhook\"\nurl = \"http://127.0.0.1:{receiver}/events\"\n"
        ),
    );
    agent.wait_for_id(
        "f0000000-0000-4000-8000-0000000000bb:scheduled",
        Duration::from_secs(15),
    );
    agent.signal("TERM");
    // The webhook never answers: the sinks drain until the shutdown deadline (10 s).
    std::thread::sleep(Duration::from_secs(2));
    let stopping = Instant::now();
    agent.signal("TERM");
    let status = agent.wait(Duration::from_secs(30));
    assert!(
        stopping.elapsed() < Duration::from_secs(3),
        "the second signal did not end the agent at once:\n{}",
        agent.log()
    );
    assert_eq!(status.code(), Some(130), "{}", agent.log());
    let log = agent.log();
    let last = log.lines().last().unwrap_or_default();
    assert!(
        last.contains("WARN") && last.contains("Second signal: exiting now"),
        "the last log line is not the second signal's:\n{log}"
    );
}
