//! A stalled output never freezes the agent: a stdout sink whose pipe nobody reads (a
//! blocking container log driver) and a stderr nobody drains cost only themselves. Polling,
//! the other sinks, the health endpoint and shutdown go on, on a one-CPU VM too (the agent is
//! pinned to one CPU here, so its runtime has a single worker thread to lose).

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{AgentProcess, SimProcess, blocking_get};

/// 150 Freezes at once: far more JSON than a pipe holds (64 KiB), so the stdout sink's
/// writes block; then one more event, 8 s later, that only an agent still polling sees.
fn scenario() -> String {
    let mut text = String::new();
    for n in 0..150 {
        text.push_str(&format!(
            "[[events]]\nid = \"a0000000-0000-4000-8000-{n:012}\"\ntype = \"Freeze\"\nresources = [\"WestNO_0\"]\nnotice = \"1h\"\ndescription = \"{}\"\n\n",
            "host maintenance ".repeat(8)
        ));
    }
    text.push_str(
        "[[events]]\nid = \"b0000000-0000-4000-8000-00000000000b\"\ntype = \"Reboot\"\nresources = [\"WestNO_0\"]\nnotice = \"1h\"\nappear_after = \"8s\"\n",
    );
    text
}

const LATE: &str = "b0000000-0000-4000-8000-00000000000b:scheduled";

#[test]
fn a_stdout_and_a_stderr_nobody_reads_do_not_stop_polling_other_sinks_health_or_shutdown() {
    if Command::new("taskset").arg("-V").output().is_err() {
        panic!("taskset (util-linux) is needed to pin the agent to one CPU");
    }
    let dir = tempfile::tempdir().unwrap();
    let sim = SimProcess::start(&common::scenario_file(dir.path(), &scenario()), 1.0);
    let port = sched_relay_transport::testing::free_port();
    let mut agent = AgentProcess::configure(
        &sim.url,
        &format!(
            "[telemetry]\nlisten = \"127.0.0.1:{port}\"\n\n[[sinks]]\nname = \"out\"\nkind = \"stdout\"\n"
        ),
    );
    // Both pipes are held open and never read; trace logging fills stderr's within a second.
    let _pipes = agent.spawn_with_stalled_output(&["taskset", "-c", "0"]);

    let started = Instant::now();
    agent.wait_for_id(LATE, Duration::from_secs(30));
    eprintln!(
        "the event that appeared 8 s in was delivered after {:?}",
        started.elapsed()
    );
    let (status, _) = blocking_get(&format!("http://127.0.0.1:{port}/healthz"), &[]);
    assert_eq!(status, 200, "/healthz stopped answering");

    let stopping = Instant::now();
    agent.signal("TERM");
    // Panics (and kills the agent) past the deadline: a write stuck on a full pipe must not
    // hold the exit.
    agent.wait(Duration::from_secs(13));
    eprintln!(
        "SIGTERM with a stalled stdout: exited after {:?}",
        stopping.elapsed()
    );
}
