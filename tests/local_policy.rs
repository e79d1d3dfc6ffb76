//! Local-policy approvals at their failure edges, on the shipped `[imds]` defaults, against
//! the simulator: a restart, a slow or failing metadata service, one refused EventId.

mod common;

use std::time::{Duration, Instant};

use common::{AgentProcess, SimProcess, assert_within_imds_budget};
use serde_json::Value;

const USER_REBOOTS: &str = r#"
[[events]]
id = "R1"
type = "Reboot"
source = "User"
resources = ["WestNO_0"]
notice = "15m"

[[events]]
id = "R2"
type = "Reboot"
source = "User"
resources = ["WestNO_0"]
notice = "15m"
"#;

const APPROVE_USER: &str = "[policy]\napprove_user_initiated = true\n";

fn posts(sim: &SimProcess) -> Vec<Value> {
    sim.requests()
        .into_iter()
        .filter(|r| r["method"] == "POST")
        .collect()
}

fn posted_ids(post: &Value) -> Vec<String> {
    let body: Value = serde_json::from_str(post["body"].as_str().unwrap()).unwrap();
    body["StartRequests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["EventId"].as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn a_user_reboot_stored_before_a_restart_is_approved_after_it() {
    let dir = tempfile::tempdir().unwrap();
    let sim = SimProcess::start(&common::scenario_file(dir.path(), USER_REBOOTS), 1.0);
    // First run without policy: the events are seen and stored, nothing is approved.
    let mut agent = AgentProcess::start_on_defaults(&sim.url, "");
    agent.wait_for_id("R2:scheduled", Duration::from_secs(10));
    agent.stop_cleanly();
    assert!(posts(&sim).is_empty());
    // The operator switches the policy on and restarts: the first document after start has
    // the stored incarnation, and its still-Scheduled events are judged all the same.
    agent.edit_config(|config| format!("{config}\n{APPROVE_USER}"));
    agent.spawn(&[]);
    agent.wait_for_id("policy:R1:accepted", Duration::from_secs(10));
    agent.wait_for_id("policy:R2:accepted", Duration::from_secs(10));
    agent.wait_for_id("R1:started", Duration::from_secs(10));
    let posted: Vec<Vec<String>> = posts(&sim).iter().map(posted_ids).collect();
    assert_eq!(posted, [["R1", "R2"]], "one combined POST");
}

#[test]
fn a_combined_approval_refused_with_400_is_retried_one_event_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    let toml = format!(
        "{USER_REBOOTS}\n[[faults]]\nkind = \"bad_request\"\nmethod = \"POST\"\ncount = 1\n"
    );
    let sim = SimProcess::start(&common::scenario_file(dir.path(), &toml), 1.0);
    let agent = AgentProcess::start_on_defaults(&sim.url, APPROVE_USER);
    agent.wait_for_id("policy:R1:accepted", Duration::from_secs(10));
    agent.wait_for_id("policy:R2:accepted", Duration::from_secs(10));
    let posts = posts(&sim);
    let posted: Vec<Vec<String>> = posts.iter().map(posted_ids).collect();
    assert_eq!(posted, [vec!["R1", "R2"], vec!["R1"], vec!["R2"]]);
    let statuses: Vec<&Value> = posts.iter().map(|p| &p["status"]).collect();
    assert_eq!(statuses, [400, 200, 200]);
}

#[test]
fn a_failing_approval_post_is_retried_until_the_service_accepts_it() {
    let dir = tempfile::tempdir().unwrap();
    // The service fails every POST for 15 s: an IMDS blip must not cost the user's early start
    // while 15 minutes of notice remain.
    let toml = r#"
[[events]]
id = "R1"
type = "Reboot"
source = "User"
resources = ["WestNO_0"]
notice = "15m"

[[faults]]
kind = "status"
status = 503
method = "POST"
lasting = "15s"
"#;
    let sim = SimProcess::start(&common::scenario_file(dir.path(), toml), 1.0);
    let agent = AgentProcess::start_on_defaults(&sim.url, APPROVE_USER);
    let events = agent.wait_for_id("policy:R1:accepted", Duration::from_secs(40));
    assert!(
        !events.iter().any(|e| e["id"] == "policy:R1:failed"),
        "{events:?}"
    );
    let posts = posts(&sim);
    let failed = posts.iter().filter(|p| p["status"] == 503).count();
    assert!(failed > 3, "retried past three attempts: {failed}");
    agent.wait_for_id("R1:started", Duration::from_secs(10));
    assert_within_imds_budget(&sim.requests());
}

#[test]
fn a_failing_approval_gives_up_shortly_before_not_before_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let toml = r#"
[[events]]
id = "spot"
type = "Preempt"
resources = ["WestNO_0"]
notice = "20s"

[[faults]]
kind = "status"
status = 503
method = "POST"
lasting = "60s"
"#;
    let sim = SimProcess::start(&common::scenario_file(dir.path(), toml), 1.0);
    let agent = AgentProcess::start_on_defaults(
        &sim.url,
        "[policy]\napprove_event_types = [\"Preempt\"]\n",
    );
    let started = Instant::now();
    let events = agent.wait_for_id("policy:spot:failed", Duration::from_secs(25));
    let gave_up_after = started.elapsed();
    // Retried until 5 s before NotBefore (at 20 s), give or take one backoff step.
    assert!(
        gave_up_after >= Duration::from_secs(9) && gave_up_after <= Duration::from_secs(20),
        "gave up after {gave_up_after:?}"
    );
    let failed = events
        .iter()
        .find(|e| e["id"] == "policy:spot:failed")
        .unwrap();
    assert!(
        failed["data"]["detail"].as_str().unwrap().contains("503"),
        "{failed}"
    );
    agent.wait_for_id("spot:started", Duration::from_secs(15));
    assert!(posts(&sim).len() > 3);
}

#[test]
fn a_hanging_approval_post_does_not_stop_polling() {
    let dir = tempfile::tempdir().unwrap();
    // The POST hangs past the 10 s request timeout; meanwhile a Preempt appears.
    let toml = r#"
[[events]]
id = "R1"
type = "Reboot"
source = "User"
resources = ["WestNO_0"]
notice = "15m"

[[events]]
id = "spot"
type = "Preempt"
resources = ["WestNO_0"]
appear_after = "3s"
notice = "30s"

[[faults]]
kind = "delay"
delay = "30s"
method = "POST"
count = 1
"#;
    let sim = SimProcess::start(&common::scenario_file(dir.path(), toml), 1.0);
    let agent = AgentProcess::start_on_defaults(&sim.url, APPROVE_USER);
    // Seen at the next poll, while the approval POST still waits for its answer.
    agent.wait_for_id("spot:scheduled", Duration::from_secs(10));
    let requests = sim.requests();
    let post_at = requests
        .iter()
        .find(|r| r["method"] == "POST")
        .map(|r| r["at_ms"].as_u64().unwrap())
        .expect("the approval was POSTed");
    // While the POST hangs (its 5 s timeout), polling goes on at 1 Hz.
    let polls_during_post = requests
        .iter()
        .filter(|r| r["method"] == "GET")
        .map(|r| r["at_ms"].as_u64().unwrap())
        .filter(|at| *at > post_at && *at < post_at + 4_000)
        .count();
    assert!(polls_during_post >= 2, "{requests:?}");
    // The hung POST times out and is retried.
    agent.wait_for_id("policy:R1:accepted", Duration::from_secs(20));
}
