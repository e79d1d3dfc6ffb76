//! Who this VM is, when `/metadata/instance/compute` fails: on a scale set the hostname
//! (`vmss000001`) is not the name in Resources (`vmss_1`), so the agent never guesses. It
//! waits for instance metadata (events wait too, and nothing is lost), says so in `/readyz`,
//! keeps the answer in the state store for a restart during which metadata fails, and uses
//! the hostname only with `identity.hostname_fallback = true`. Run on the shipped [imds]
//! defaults.

mod common;

use std::time::{Duration, Instant};

use common::{AgentProcess, SimProcess, ids};
use serde_json::Value;

const FIRST: &str = "a0000000-0000-4000-8000-000000000001";
const SECOND: &str = "a0000000-0000-4000-8000-000000000002";
const NAME: &str = "vmss_1";
const RESOURCE_ID: &str = "/subscriptions/00000000-0000-0000-0000-000000000000/resourceGroups/rg/providers/Microsoft.Compute/virtualMachineScaleSets/vmss/virtualMachines/1";

/// A scale-set instance with a Freeze at once and, with `second`, another 10 s later;
/// `faults` is appended (compute faults).
fn scenario(dir: &std::path::Path, faults: &str) -> SimProcess {
    let text = format!(
        r#"
[vm]
name = "{NAME}"
vm_id = "11111111-2222-4333-8444-555555555555"
resource_id = "{RESOURCE_ID}"

[[events]]
id = "{FIRST}"
type = "Freeze"
resources = ["{NAME}"]
duration_in_seconds = 5
notice = "1h"
started_for = "1h"

[[events]]
id = "{SECOND}"
type = "Reboot"
resources = ["{NAME}"]
appear_after = "12s"
notice = "1h"
started_for = "1h"
{faults}
"#
    );
    let path = dir.join("scaleset.toml");
    std::fs::write(&path, text).unwrap();
    SimProcess::start(path.to_str().unwrap(), 1.0)
}

/// `count` failures (500) of `/metadata/instance/compute` from `after` on.
fn compute_fails(after: &str, count: u32) -> String {
    format!(
        "[[faults]]\nkind = \"status\"\nstatus = 500\nendpoint = \"compute\"\nafter = \"{after}\"\ncount = {count}\n"
    )
}

/// The agent on the shipped [imds] and [identity] defaults, with the listener on `port`.
fn agent(sim: &SimProcess, port: u16, extra: &str) -> AgentProcess {
    AgentProcess::start_with_env(
        &sim.url,
        &format!("[telemetry]\nlisten = \"127.0.0.1:{port}\"\n{extra}"),
        &[
            ("SCHED_RELAY_IMDS__POLL_INTERVAL", "1s"),
            ("SCHED_RELAY_IMDS__MAX_BACKOFF", "5s"),
            ("SCHED_RELAY_IMDS__REQUEST_TIMEOUT", "10s"),
            ("SCHED_RELAY_IMDS__FIRST_CALL_TIMEOUT", "150s"),
        ],
    )
}

/// `/readyz` as (status, body), or `None` while nothing listens.
fn readyz(port: u16) -> Option<(u16, String)> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    sched_relay::install_crypto_provider();
    runtime.block_on(async {
        let client = reqwest::Client::builder().no_proxy().build().unwrap();
        let response = client
            .get(format!("http://127.0.0.1:{port}/readyz"))
            .send()
            .await
            .ok()?;
        let status = response.status().as_u16();
        Some((status, response.text().await.ok()?))
    })
}

/// Waits until `/readyz` answers 503 naming the unresolved identity.
fn wait_readyz_says_identity_unresolved(port: u16, agent: &AgentProcess) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        if let Some((503, body)) = readyz(port)
            && body.contains("VM identity not resolved yet")
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "/readyz never said the identity is unresolved: {:?}\n{}",
            readyz(port),
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn wait_for_log(agent: &AgentProcess, text: &str, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    while !agent.log().contains(text) {
        assert!(
            Instant::now() < deadline,
            "no {text:?} in the agent log:\n{}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn event<'a>(events: &'a [Value], id: &str) -> &'a Value {
    events
        .iter()
        .find(|e| e["id"] == id)
        .unwrap_or_else(|| panic!("no {id} in {:?}", ids(events)))
}

/// The transition names the VM as Resources does, says it is affected, and has the stable
/// source (the resource id).
fn assert_real_identity(events: &[Value], id: &str) {
    let found = event(events, id);
    assert_eq!(found["vmname"], NAME, "{found}");
    assert_eq!(found["affectsvm"], true, "{found}");
    assert_eq!(found["source"], RESOURCE_ID, "{found}");
}

fn compute_requests(sim: &SimProcess) -> Vec<Option<u64>> {
    sim.requests()
        .iter()
        .filter(|r| r["path"] == "/metadata/instance/compute")
        .map(|r| r["status"].as_u64())
        .collect()
}

#[test]
fn compute_failing_at_start_delays_events_which_then_carry_the_real_name() {
    let dir = tempfile::tempdir().unwrap();
    let sim = scenario(dir.path(), &compute_fails("0s", 4));
    let port = sched_relay_transport::testing::free_port();
    let mut agent = agent(&sim, port, "");
    wait_readyz_says_identity_unresolved(port, &agent);
    assert!(
        agent.events().is_empty(),
        "nothing is derived before the VM is named: {:?}",
        ids(&agent.events())
    );
    let events = agent.wait_for_id(&format!("{FIRST}:scheduled"), Duration::from_secs(40));
    assert_real_identity(&events, &format!("{FIRST}:scheduled"));
    assert_eq!(
        compute_requests(&sim)[..5],
        [Some(500), Some(500), Some(500), Some(500), Some(200)],
        "retried until it answered"
    );
    let log = agent.log();
    assert_eq!(
        log.matches("Cannot read the VM identity from instance metadata; events wait")
            .count(),
        4,
        "one WARN per failure:\n{log}"
    );
    assert!(!log.contains("Using the hostname"), "{log}");
    let deadline = Instant::now() + Duration::from_secs(20);
    while readyz(port).map(|(status, _)| status) != Some(200) {
        assert!(Instant::now() < deadline, "never ready: {:?}", readyz(port));
        std::thread::sleep(Duration::from_millis(100));
    }
    agent.stop_cleanly();
}

#[test]
fn across_a_restart_with_compute_failing_the_identity_kept_from_the_last_run_is_used() {
    let dir = tempfile::tempdir().unwrap();
    // Compute answers the first run, then fails for good from 6 s on.
    let sim = scenario(dir.path(), &compute_fails("6s", 100_000));
    let started = Instant::now();
    let port = sched_relay_transport::testing::free_port();
    let mut agent = agent(&sim, port, "");
    let events = agent.wait_for_id(&format!("{FIRST}:scheduled"), Duration::from_secs(20));
    assert_real_identity(&events, &format!("{FIRST}:scheduled"));
    agent.stop_cleanly();

    std::thread::sleep(Duration::from_secs(7).saturating_sub(started.elapsed()));
    agent.spawn(&[]);
    let events = agent.wait_for_id(&format!("{SECOND}:scheduled"), Duration::from_secs(30));
    assert_real_identity(&events, &format!("{SECOND}:scheduled"));
    assert_eq!(
        compute_requests(&sim).last(),
        Some(&Some(500)),
        "the restart asked instance metadata, which failed"
    );
    let log = agent.log();
    assert!(
        log.contains("using the one it gave on an earlier run"),
        "the log says the kept identity is used:\n{log}"
    );
    assert!(!log.contains("Using the hostname"), "{log}");
    agent.stop_cleanly();
}

#[test]
fn without_hostname_fallback_the_hostname_is_never_used_however_long_compute_fails() {
    let dir = tempfile::tempdir().unwrap();
    let sim = scenario(dir.path(), &compute_fails("0s", 100_000));
    let port = sched_relay_transport::testing::free_port();
    let mut agent = agent(&sim, port, "");
    wait_readyz_says_identity_unresolved(port, &agent);
    wait_for_log(
        &agent,
        "No VM identity for over 30 s",
        Duration::from_secs(45),
    );
    let log = agent.log();
    assert_eq!(
        log.matches("No VM identity for over 30 s").count(),
        1,
        "{log}"
    );
    assert!(!log.contains("Using the hostname"), "{log}");
    assert!(agent.events().is_empty(), "{:?}", ids(&agent.events()));
    let attempts = compute_requests(&sim).len();
    assert!(
        (7..=40).contains(&attempts),
        "retried every few seconds, not minutes: {attempts} attempts in 30 s"
    );
    wait_readyz_says_identity_unresolved(port, &agent);
    // Stopping while it waits is clean.
    agent.stop_cleanly();
}

#[test]
fn with_hostname_fallback_the_hostname_names_the_vm_after_30_s_of_failing_compute() {
    let dir = tempfile::tempdir().unwrap();
    let sim = scenario(dir.path(), &compute_fails("0s", 100_000));
    let port = sched_relay_transport::testing::free_port();
    let mut agent = agent(&sim, port, "[identity]\nhostname_fallback = true\n");
    let started = Instant::now();
    let events = agent.wait_for_id(&format!("{FIRST}:scheduled"), Duration::from_secs(50));
    assert!(
        started.elapsed() >= Duration::from_secs(25),
        "instance metadata gets its 30 s first"
    );
    let found = event(&events, &format!("{FIRST}:scheduled"));
    let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    assert_eq!(found["vmname"], hostname.trim(), "{found}");
    assert!(agent.log().contains("Using the hostname"));
    agent.stop_cleanly();
}
