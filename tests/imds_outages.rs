//! The metadata service fails, and the agent must still see what Azure shows in time: on the
//! shipped `[imds]` defaults (1 s polls, 5 s backoff ceiling), against the simulator.
//!
//! - an outage of any length is followed by a poll within 5 s of recovery, so a Preempt that
//!   appears as the service recovers is seen well inside its 30 s notice (503 and 410 alike);
//! - a throttled service (429) is given the time it asks for in `Retry-After`;
//! - `/readyz` says "not ready" once the service has failed for `imds.unready_after` (10 s),
//!   and ready again when it answers;
//! - through all of it, no second holds more than the service's 5 requests.

mod common;

use std::time::{Duration, Instant};

use common::{
    AgentProcess, SimProcess, assert_within_imds_budget, blocking_get, first_good_get_after,
};

/// The detection goal after an outage: the poll interval (1 s) + 5 s.
const DETECTION_GOAL_MS: u64 = 6_000;

/// A 40 s outage answering `status`, then a Spot eviction with its 30 s notice.
fn preempt_after_outage(status: u16) {
    let dir = tempfile::tempdir().unwrap();
    let path = common::scenario_file(
        dir.path(),
        &format!(
            r#"
[[faults]]
kind = "status"
status = {status}
lasting = "40s"

[[events]]
id = "spot"
type = "Preempt"
resources = ["WestNO_0"]
appear_after = "40s"
notice = "30s"
"#
        ),
    );
    let sim = SimProcess::start(&path, 1.0);
    let agent = AgentProcess::start_on_defaults(&sim.url, "");
    let events = agent.wait_for_id("spot:scheduled", Duration::from_secs(75));
    let requests = sim.requests();
    let seen_at = first_good_get_after(&requests, 40_000).expect("a good poll after the outage");
    let delay = seen_at - 40_000;
    eprintln!("{status} outage of 40 s: the Preempt was seen {delay} ms after recovery");
    assert!(
        delay <= DETECTION_GOAL_MS,
        "seen {delay} ms after recovery, goal {DETECTION_GOAL_MS} ms: {:?}",
        requests
            .iter()
            .map(|r| (&r["at_ms"], &r["status"]))
            .collect::<Vec<_>>()
    );
    let scheduled = events.iter().find(|e| e["id"] == "spot:scheduled").unwrap();
    assert_eq!(
        scheduled["eventstatus"], "Scheduled",
        "seen before NotBefore"
    );
    let errors = requests.iter().filter(|r| r["status"] == status).count();
    assert!(
        errors >= 8,
        "the outage was retried, not waited out: {errors} polls"
    );
    assert_within_imds_budget(&requests);
}

#[test]
fn a_spot_eviction_right_after_a_forty_second_outage_is_seen_within_six_seconds() {
    preempt_after_outage(503);
}

#[test]
fn a_410_gone_is_retried_on_the_normal_schedule_and_costs_no_eviction() {
    preempt_after_outage(410);
}

#[test]
fn a_throttled_service_gets_the_wait_it_asks_for() {
    let dir = tempfile::tempdir().unwrap();
    let path = common::scenario_file(
        dir.path(),
        r#"
[[faults]]
kind = "status"
status = 429
retry_after = 4
after = "2s"
count = 2
"#,
    );
    let sim = SimProcess::start(&path, 1.0);
    let agent = AgentProcess::start_on_defaults(&sim.url, "");
    let deadline = Instant::now() + Duration::from_secs(30);
    let requests = loop {
        let requests = sim.requests();
        let after_throttles = requests
            .iter()
            .skip_while(|r| r["status"] != 429)
            .filter(|r| r["status"] == 200)
            .count();
        if after_throttles >= 2 {
            break requests;
        }
        assert!(Instant::now() < deadline, "{requests:?}\n{}", agent.log());
        std::thread::sleep(Duration::from_millis(200));
    };
    let at: Vec<(u64, u64)> = requests
        .iter()
        .map(|r| {
            (
                r["at_ms"].as_u64().unwrap(),
                r["status"].as_u64().unwrap_or(0),
            )
        })
        .collect();
    for pair in at.windows(2) {
        if pair[0].1 == 429 {
            assert!(
                pair[1].0 - pair[0].0 >= 3_900,
                "asked to wait 4 s after a 429, came back sooner: {at:?}"
            );
        }
    }
    assert!(agent.log().contains("throttled"), "{}", agent.log());
}

#[test]
fn readiness_fails_after_ten_seconds_of_imds_errors_and_recovers() {
    let dir = tempfile::tempdir().unwrap();
    let path = common::scenario_file(
        dir.path(),
        r#"
[[faults]]
kind = "status"
status = 503
after = "4s"
lasting = "18s"
"#,
    );
    let sim = SimProcess::start(&path, 1.0);
    let port = sched_relay_transport::testing::free_port();
    let agent = AgentProcess::start_on_defaults(
        &sim.url,
        &format!("[telemetry]\nlisten = \"127.0.0.1:{port}\"\n"),
    );
    let readyz = format!("http://127.0.0.1:{port}/readyz");
    let ready = |want: u16, within: Duration| -> String {
        let deadline = Instant::now() + within;
        loop {
            let answer = std::panic::catch_unwind(|| blocking_get(&readyz, &[]));
            if let Ok((status, body)) = answer
                && status == want
            {
                return body;
            }
            assert!(
                Instant::now() < deadline,
                "/readyz never answered {want} within {within:?}\n{}",
                agent.log()
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    };
    ready(200, Duration::from_secs(4));
    let started = Instant::now();
    let reasons = ready(503, Duration::from_secs(20));
    assert!(reasons.contains("metadata service has failed"), "{reasons}");
    // Ready for the first ~10 s of the outage (a blip is no reason to pull the agent), not
    // ready after; 503 comes between 10 s and ~16 s after the outage began at 4 s.
    assert!(
        started.elapsed() >= Duration::from_secs(8),
        "unready too early: {:?}",
        started.elapsed()
    );
    ready(200, Duration::from_secs(20));
    assert_within_imds_budget(&sim.requests());
}

/// One event without an EventId makes the whole document unusable (see docs/src/operations.md,
/// "Refused documents"): the agent keeps the last good one, and says so once per reason, in a
/// metric every poll, at ERROR after a minute, and in `/readyz`.
#[test]
fn a_refused_document_is_reported_once_counted_every_poll_and_named_in_readyz() {
    let (url, served) = common::fixed_imds(
        r#"{"DocumentIncarnation": 2, "Events": [
            {"EventId": "E1", "EventStatus": "Scheduled", "EventType": "Reboot", "Resources": ["vm1"]},
            {"EventStatus": "Scheduled", "EventType": "Freeze", "Resources": ["vm1"]}]}"#,
    );
    let port = sched_relay_transport::testing::free_port();
    let agent = AgentProcess::start_on_defaults(
        &url,
        &format!(
            "[telemetry]\nlisten = \"127.0.0.1:{port}\"\n[identity]\nvm_name = \"vm1\"\nfrom_metadata = false\n"
        ),
    );
    let readyz = format!("http://127.0.0.1:{port}/readyz");
    let deadline = Instant::now() + Duration::from_secs(75);
    loop {
        std::thread::sleep(Duration::from_millis(500));
        // The listener may not be up yet.
        let Ok((_, body)) = std::panic::catch_unwind(|| blocking_get(&readyz, &[])) else {
            continue;
        };
        let log = agent.log();
        if body.contains("refused") && log.contains("ERROR") {
            assert!(body.contains("Events[1].EventId"), "{body}");
            break;
        }
        assert!(Instant::now() < deadline, "{body}\n{log}");
    }
    let log = agent.log();
    let warnings = log.matches("Document refused whole").count();
    let polls = served.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(warnings, 1, "{polls} polls:\n{log}");
    assert!(polls >= 12, "retried at most 5 s apart: {polls} polls");
    assert!(log.contains("Documents refused for over a minute"), "{log}");
    assert!(
        agent.events().is_empty(),
        "nothing invented from a refused document"
    );
    let (_, metrics) = blocking_get(&format!("http://127.0.0.1:{port}/metrics"), &[]);
    let counted = metrics
        .lines()
        .find(|l| l.starts_with("sched_relay_documents_refused_total"))
        .and_then(|l| l.split_whitespace().last()?.parse::<f64>().ok())
        .unwrap_or_default();
    assert!(counted >= 12.0, "{metrics}");
}

/// A metadata service that hangs instead of failing (requests accepted, never answered),
/// with the agent killed and restarted in the middle: the restart must not fall back to the
/// 150 s first-call timeout, and a poll hung across the recovery costs at most
/// `imds.request_timeout` (5 s), so a Preempt that appears then is still seen in time.
#[test]
fn a_hanging_service_across_a_restart_is_noticed_within_six_seconds_of_recovery() {
    let dir = tempfile::tempdir().unwrap();
    let path = common::scenario_file(
        dir.path(),
        r#"
[[faults]]
kind = "delay"
delay = "120s"
after = "4s"
lasting = "30s"

[[events]]
id = "spot"
type = "Preempt"
resources = ["WestNO_0"]
appear_after = "34s"
notice = "30s"
"#,
    );
    let sim = SimProcess::start(&path, 1.0);
    let mut agent = AgentProcess::start_on_defaults(&sim.url, "");
    agent.wait_for_document(1, Duration::from_secs(5));
    std::thread::sleep(Duration::from_secs(8));
    agent.kill9();
    agent.spawn(&[]);
    let events = agent.wait_for_id("spot:scheduled", Duration::from_secs(60));
    let requests = sim.requests();
    let seen_at = first_good_get_after(&requests, 34_000).expect("a good poll after the hang");
    let delay = seen_at - 34_000;
    eprintln!("hang of 30 s with a restart: the Preempt was seen {delay} ms after recovery");
    assert!(
        delay <= DETECTION_GOAL_MS,
        "seen {delay} ms after recovery, goal {DETECTION_GOAL_MS} ms:\n{}",
        agent.log()
    );
    let scheduled = events.iter().find(|e| e["id"] == "spot:scheduled").unwrap();
    assert_eq!(scheduled["eventstatus"], "Scheduled");
}
