//! One agent per state directory: while an agent runs, every command that would write its
//! state (a second `run`, `run --fresh-state`, `outbox dead-letter`, `outbox move`) is
//! refused with exit 2 and the holder's pid, and nothing in the directory is moved; the
//! running agent goes on as if nothing had been tried.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::{AgentProcess, BINARY, SimProcess};

/// Runs `sched-relay <before> --config <config> <after>` for at most 15 s (a second agent
/// that was not refused would run on): its exit code (None: killed) and stderr.
fn sched_relay(config: &Path, before: &[&str], after: &[&str]) -> (Option<i32>, String) {
    let stderr = tempfile::NamedTempFile::new().unwrap();
    let mut child = Command::new(BINARY)
        .args(before)
        .arg("--config")
        .arg(config)
        .args(after)
        .env_remove("SCHED_RELAY_CONFIG")
        .stdout(std::process::Stdio::null())
        .stderr(stderr.reopen().unwrap())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    let code = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status.code();
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    (code, std::fs::read_to_string(stderr.path()).unwrap())
}

fn wait_for_any_event(agent: &AgentProcess) {
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while agent.events().is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "no event:\n{}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn state_files(state: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(state)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn a_second_agent_or_outbox_command_on_a_running_agents_state_is_refused_with_its_pid() {
    let sim = SimProcess::start("live-migration", 0.01);
    let mut agent = AgentProcess::start_on_defaults(&sim.url, "");
    wait_for_any_event(&agent);
    let state = agent.dir.path().join("state");
    let before = state_files(&state);
    assert!(before.contains(&"outbox.redb".to_owned()), "{before:?}");
    let pid = format!("pid {}", agent.pid());

    for args in [
        &["run", "--fresh-state"][..],
        &["run"][..],
        &["outbox", "dead-letter", "file"][..],
        &["outbox", "move", "file", "file"][..],
        &["outbox", "list"][..],
    ] {
        let (code, stderr) = sched_relay(&agent.config_path, &args[..1], &args[1..]);
        assert_eq!(code, Some(2), "{args:?}: {stderr}");
        assert!(
            stderr.contains("is in use by") && stderr.contains(&pid),
            "{args:?} does not name the holder ({pid}): {stderr}"
        );
        assert_eq!(
            state_files(&state),
            before,
            "{args:?} changed the state directory"
        );
    }

    // The first agent goes on: its events still flow, and it stops cleanly.
    let last = sim.wait_finished(Duration::from_secs(60));
    agent.wait_for_document(last, Duration::from_secs(15));
    agent.stop_cleanly();

    // Once it is gone the state is free again, whatever way it ended.
    let (code, stderr) = sched_relay(&agent.config_path, &["outbox"], &["list"]);
    assert_eq!(code, Some(0), "{stderr}");
}

#[test]
fn a_killed_agent_leaves_its_state_free_for_the_next_start() {
    let sim = SimProcess::start("live-migration", 0.01);
    let mut agent = AgentProcess::start_on_defaults(&sim.url, "");
    wait_for_any_event(&agent);
    agent.kill9();
    agent.spawn(&[]);
    let last = sim.wait_finished(Duration::from_secs(60));
    agent.wait_for_document(last, Duration::from_secs(15));
    agent.stop_cleanly();
}
