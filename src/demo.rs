//! `sched-relay demo`: the whole agent on a fresh machine, with no broker and no Azure VM.
//! Starts the simulator on a free loopback port with the built-in demo scenario (the
//! documentation's live migration, then a user-initiated reboot), runs the agent against it
//! with the stdout and file sinks and the documentation's sample policy, and stops once the
//! last event has come and gone.
//!
//! `sched-relay demo --fleet` ([`fleet`]) is the fleet coordinator's demo: twelve simulated
//! VMs, their agents and the coordinator on NATS JetStream.

#[cfg(feature = "nats")]
mod feed;
#[cfg(feature = "nats")]
pub mod fleet;
#[cfg(feature = "nats")]
mod nats;
#[cfg(feature = "nats")]
mod plan;
#[cfg(feature = "nats")]
mod summary;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::config::Config;
use crate::simulator::{Scenario, Simulator};
use crate::sinks::{SinkEntry, SinkKind};
use sched_relay_core::policy::PolicyConfig;
use sched_relay_file::{FileSinkConfig, StdoutFormat, StdoutSinkConfig};

/// The demo should finish in about 15 s; past this something is wrong.
const DEMO_DEADLINE: Duration = Duration::from_secs(60);

/// What the demo did, for its closing lines and for tests.
#[derive(Debug)]
pub struct DemoReport {
    pub events_file: PathBuf,
    pub events_written: usize,
    pub approvals_posted: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error("cannot start the simulator on 127.0.0.1: {0}")]
    Simulator(std::io::Error),
    #[error("cannot prepare the demo directory {path}: {error}")]
    Directory { path: String, error: std::io::Error },
    #[error("the agent failed: {0}")]
    Agent(#[from] crate::AgentError),
    #[error("the scenario did not finish within {0:?}; the logs above say what the agent saw")]
    Timeout(Duration),
}

/// Runs the demo, printing each CloudEvent as a summary line on stdout.
pub async fn run() -> Result<DemoReport, DemoError> {
    let scenario = Scenario::load("demo").expect("the built-in demo scenario is valid");
    let simulator = Simulator::start(scenario, "127.0.0.1:0".parse().expect("an address"))
        .await
        .map_err(DemoError::Simulator)?;
    let dir = std::env::temp_dir().join(format!("sched-relay-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|error| DemoError::Directory {
        path: dir.display().to_string(),
        error,
    })?;
    let events_file = dir.join("events.jsonl");
    let _ = std::fs::remove_file(&events_file);

    let mut config = Config::default();
    config.imds.endpoint = simulator.url();
    config.imds.poll_interval = Duration::from_millis(250);
    config.imds.request_timeout = Duration::from_secs(2);
    config.imds.first_call_timeout = Duration::from_secs(5);
    config.imds.max_backoff = Duration::from_secs(1);
    config.state.dir = dir.join("state");
    config.policy = PolicyConfig {
        approve_user_initiated: true,
        approve_freeze_max_seconds: Some(9),
        ..PolicyConfig::default()
    };
    config.sinks = vec![
        SinkEntry {
            name: "stdout".into(),
            kind: SinkKind::Stdout(StdoutSinkConfig {
                format: StdoutFormat::Summary,
            }),
        },
        SinkEntry {
            name: "file".into(),
            kind: SinkKind::File(FileSinkConfig {
                path: events_file.clone(),
                fsync: true,
            }),
        },
    ];

    println!("sched-relay demo: IMDS simulator on {}", simulator.url());
    println!(
        "  playing: a live-migration Freeze (approved by policy: 5 s <= 9 s), then a user-initiated Reboot (approved by policy)"
    );
    println!(
        "  sinks:   stdout (summary below) and {}",
        events_file.display()
    );
    println!(
        "  logs:    the agent's own log shows warnings only; add --log-level info (or set RUST_LOG=sched_relay=info) to see it narrate each step on stderr"
    );
    println!();

    let started = Instant::now();
    let mut timed_out = false;
    let finished = async {
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            if simulator.snapshot().finished {
                return;
            }
            if started.elapsed() > DEMO_DEADLINE {
                timed_out = true;
                return;
            }
        }
    };
    crate::agent::run(config, crate::agent::RunOptions::default(), finished).await?;
    if timed_out {
        return Err(DemoError::Timeout(DEMO_DEADLINE));
    }
    let approvals_posted = simulator
        .requests()
        .iter()
        .filter(|r| r.method == "POST" && r.status == Some(200))
        .count();
    simulator.stop().await;
    let events_written = std::fs::read_to_string(&events_file)
        .map(|text| text.lines().count())
        .unwrap_or(0);
    println!();
    println!(
        "Done in {:.1} s: {events_written} CloudEvents written to {} (one structured CloudEvent per line), {approvals_posted} approvals POSTed.",
        started.elapsed().as_secs_f64(),
        events_file.display()
    );
    println!(
        "Look at one: head -n 2 {} | python3 -m json.tool --json-lines",
        events_file.display()
    );
    Ok(DemoReport {
        events_file,
        events_written,
        approvals_posted,
    })
}

/// `sched-relay demo --fleet`: exit 0, 1 on a failure (said on stderr), 130 when
/// interrupted, 2 in a build without NATS.
pub async fn fleet_command() -> std::process::ExitCode {
    use std::process::ExitCode;
    #[cfg(feature = "nats")]
    match fleet::run().await {
        Ok(_) => ExitCode::SUCCESS,
        Err(error @ fleet::FleetError::Interrupted) => {
            eprintln!("demo stopped: {error}");
            ExitCode::from(130)
        }
        Err(error) => {
            eprintln!("demo failed: {error}");
            ExitCode::FAILURE
        }
    }
    #[cfg(not(feature = "nats"))]
    {
        eprintln!(
            "error: demo --fleet runs on NATS, and this sched-relay was built without it (build it with the default features)"
        );
        ExitCode::from(2)
    }
}
