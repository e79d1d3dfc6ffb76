//! End to end: the real binary as simulator and as agent, for every shipped scenario and for
//! IMDS faults. Each test asserts the exact sequence of CloudEvents the file sink received.

mod common;

use std::time::Duration;

use common::{AgentProcess, SimProcess, blocking_get, fixed_imds, ids, play};
use serde_json::Value;

const FREEZE: &str = "C7061BAC-AFDC-4513-B24B-AA5F13A16123";
const TYPE: &str = "com.azure.scheduledevents";

fn event<'a>(events: &'a [Value], id: &str) -> &'a Value {
    events
        .iter()
        .find(|e| e["id"] == id)
        .unwrap_or_else(|| panic!("no {id} in {:?}", ids(events)))
}

/// The full cycle of one event: scheduled -> started -> completed, each with its snapshot.
fn scheduled_started_completed(event_id: &str) -> Vec<String> {
    [
        "document:1".to_owned(),
        format!("{event_id}:scheduled"),
        "document:2".to_owned(),
        format!("{event_id}:started"),
        "document:3".to_owned(),
        format!("{event_id}:completed"),
        "document:4".to_owned(),
    ]
    .to_vec()
}

/// Plays a scenario of one Azure event with no policy and checks the full cycle:
/// document:1, scheduled, document:2, started, document:3, completed, document:4.
fn play_full_cycle(scenario: &str, scale: f64, id: &str) -> Vec<Value> {
    let (_sim, agent, events) = play(scenario, scale, "");
    assert_eq!(
        ids(&events),
        scheduled_started_completed(id),
        "{}",
        agent.log()
    );
    events
}

fn assert_common_attributes(events: &[Value], source: &str) {
    for event in events {
        assert_eq!(event["specversion"], "1.0", "{event}");
        assert_eq!(event["source"], source, "{event}");
        assert_eq!(event["datacontenttype"], "application/json", "{event}");
        assert!(
            event["time"]
                .as_str()
                .is_some_and(|t| chrono::DateTime::parse_from_rfc3339(t).is_ok()),
            "{event}"
        );
        let id = event["id"].as_str().unwrap();
        let transition = id.split(':').nth(1).unwrap_or_default();
        if !id.starts_with("document:") && !id.starts_with("policy:") {
            assert_eq!(event["type"], format!("{TYPE}.{transition}"), "{event}");
            assert_eq!(event["subject"], id.split(':').next().unwrap(), "{event}");
            assert_eq!(event["partitionkey"], event["subject"], "{event}");
        }
    }
}

#[test]
fn live_migration_yields_scheduled_started_completed_with_document_snapshots() {
    let (sim, agent, events) = play("live-migration", 0.01, "");
    assert_eq!(
        ids(&events),
        scheduled_started_completed(FREEZE),
        "{}",
        agent.log()
    );
    let resource_id = "/subscriptions/00000000-0000-0000-0000-000000000000/resourceGroups/westno/providers/Microsoft.Compute/virtualMachines/WestNO_0";
    assert_common_attributes(&events, resource_id);

    let scheduled = event(&events, &format!("{FREEZE}:scheduled"));
    assert_eq!(scheduled["eventtype"], "Freeze");
    assert_eq!(scheduled["eventstatus"], "Scheduled");
    assert_eq!(scheduled["eventsource"], "Platform");
    assert_eq!(scheduled["vmname"], "WestNO_0");
    assert_eq!(scheduled["affectsvm"], true);
    assert_eq!(scheduled["incarnation"], 2);
    assert_eq!(
        scheduled["data"]["vm"]["id"],
        "02aab8a4-74ef-476e-8182-f6d2ba4166a6"
    );
    assert_eq!(scheduled["data"]["vm"]["resourceId"], resource_id);
    assert_eq!(scheduled["data"]["event"]["DurationInSeconds"], 5);
    assert_eq!(scheduled["data"]["previousStatus"], Value::Null);

    let started = event(&events, &format!("{FREEZE}:started"));
    assert_eq!(started["data"]["previousStatus"], "Scheduled");
    assert_eq!(started["data"]["event"]["NotBefore"], "");
    let completed = event(&events, &format!("{FREEZE}:completed"));
    assert_eq!(completed["data"]["previousStatus"], "Started");
    assert_eq!(
        event(&events, "document:4")["data"]["Events"],
        serde_json::json!([])
    );

    // Without a policy nothing was approved: the Freeze started by its NotBefore.
    assert!(sim.requests().iter().all(|r| r["method"] == "GET"));
}

#[test]
fn policy_approves_a_short_freeze_and_publishes_the_outcome() {
    let (sim, agent, events) = play(
        "live-migration",
        0.01,
        "[policy]\napprove_freeze_max_seconds = 9\n",
    );
    let accepted = format!("policy:{FREEZE}:accepted");
    let mut expected = scheduled_started_completed(FREEZE);
    expected.insert(3, accepted.clone());
    assert_eq!(ids(&events), expected, "{}", agent.log());
    let outcome = event(&events, &accepted);
    assert_eq!(outcome["type"], format!("{TYPE}.approval.accepted"));
    assert_eq!(outcome["requestid"], format!("policy:{FREEZE}"));
    assert_eq!(outcome["data"]["reason"], "policy");
    assert!(
        outcome["data"]["detail"]
            .as_str()
            .unwrap()
            .contains("approve_freeze_max_seconds")
    );

    let posts: Vec<Value> = sim
        .requests()
        .into_iter()
        .filter(|r| r["method"] == "POST")
        .collect();
    assert_eq!(posts.len(), 1, "one approval, not one per poll: {posts:?}");
    assert_eq!(posts[0]["status"], 200);
    let body: Value = serde_json::from_str(posts[0]["body"].as_str().unwrap()).unwrap();
    assert_eq!(
        body,
        serde_json::json!({"StartRequests": [{"EventId": FREEZE}]})
    );
    // Approved at once: started long before its 15-minute notice (9 s at this scale).
    let started_at = chrono::DateTime::parse_from_rfc3339(
        event(&events, &format!("{FREEZE}:started"))["time"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    let scheduled_at = chrono::DateTime::parse_from_rfc3339(
        event(&events, &format!("{FREEZE}:scheduled"))["time"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert!(
        started_at - scheduled_at < chrono::Duration::seconds(5),
        "{scheduled_at} -> {started_at}"
    );
}

#[test]
fn user_initiated_reboot_is_approved_at_once_by_policy() {
    let (_sim, agent, events) = play(
        "user-reboot",
        0.005,
        "[policy]\napprove_user_initiated = true\n",
    );
    let id = "5a4e3e9a-6c7f-4a32-9d8e-1d2b3c4d5e01";
    // The policy's POST runs on a task of its own, beside the polls: the event can start,
    // and a poll publish that, before the POST's answer is recorded (seen under load).
    let outcome = format!("policy:{id}:accepted");
    let seen = ids(&events);
    let transitions: Vec<String> = seen.iter().filter(|i| **i != outcome).cloned().collect();
    assert_eq!(
        transitions,
        scheduled_started_completed(id),
        "{}",
        agent.log()
    );
    let at = |what: &str| seen.iter().position(|i| i == what);
    assert!(
        at(&outcome).is_some_and(|n| at(&format!("{id}:scheduled")).unwrap() < n
            && n < at(&format!("{id}:completed")).unwrap()),
        "the policy's approval between the event's scheduled and completed: {seen:?}\n{}",
        agent.log()
    );
    assert_eq!(
        event(&events, &format!("{id}:scheduled"))["eventsource"],
        "User"
    );
    assert!(agent.log().contains("Approval accepted"), "{}", agent.log());
}

#[test]
fn redeploy_starts_at_not_before_without_approval() {
    let id = "8e6a4b2c-1d3f-4e5a-9b7c-0d1e2f3a4b02";
    let events = play_full_cycle("redeploy", 0.01, id);
    assert_eq!(
        event(&events, &format!("{id}:scheduled"))["eventtype"],
        "Redeploy"
    );
}

#[test]
fn spot_preempt_with_thirty_seconds_notice_is_seen_before_it_starts() {
    let id = "c1a2b3d4-e5f6-4a7b-8c9d-0e1f2a3b4c03";
    let events = play_full_cycle("spot-preempt", 0.05, id);
    let scheduled = event(&events, &format!("{id}:scheduled"));
    assert_eq!(scheduled["eventtype"], "Preempt");
    assert_eq!(
        scheduled["vmname"], "spot_vm_7",
        "identity comes from instance metadata"
    );
    assert_eq!(scheduled["affectsvm"], true);
    assert_common_attributes(&events, "urn:sched-relay:vm:spot_vm_7");
}

#[test]
fn scale_set_terminate_is_reported_for_the_instance() {
    let id = "d9e8f7a6-b5c4-4d3e-8f2a-1b0c9d8e7f04";
    let events = play_full_cycle("scaleset-terminate", 0.01, id);
    assert_eq!(
        event(&events, &format!("{id}:scheduled"))["eventtype"],
        "Terminate"
    );
    assert_common_attributes(
        &events,
        "/subscriptions/00000000-0000-0000-0000-000000000000/resourceGroups/vmss/providers/Microsoft.Compute/virtualMachineScaleSets/myscaleset/virtualMachines/3",
    );
}

#[test]
fn host_failure_appearing_as_started_yields_started_then_completed_only() {
    let (_sim, agent, events) = play("host-failure", 0.01, "");
    let id = "f0e1d2c3-b4a5-4968-8776-655443322105";
    assert_eq!(
        ids(&events),
        [
            "document:1",
            &format!("{id}:started"),
            "document:2",
            &format!("{id}:completed"),
            "document:3"
        ],
        "{}",
        agent.log()
    );
    assert_eq!(
        event(&events, &format!("{id}:started"))["data"]["previousStatus"],
        Value::Null
    );
}

#[test]
fn cancelled_maintenance_yields_scheduled_updated_cancelled() {
    let (_sim, agent, events) = play("cancelled-maintenance", 0.01, "");
    let id = "3a2b1c00-0000-4000-8000-00000000c0de";
    assert_eq!(
        ids(&events),
        [
            "document:1",
            &format!("{id}:scheduled"),
            "document:2",
            &format!("{id}:updated:3"),
            "document:3",
            &format!("{id}:cancelled"),
            "document:4"
        ],
        "{}",
        agent.log()
    );
    let updated = event(&events, &format!("{id}:updated:3"));
    let scheduled = event(&events, &format!("{id}:scheduled"));
    assert_ne!(
        updated["data"]["event"]["NotBefore"],
        scheduled["data"]["event"]["NotBefore"]
    );
    assert_eq!(
        event(&events, &format!("{id}:cancelled"))["data"]["previousStatus"],
        "Scheduled"
    );
}

#[test]
fn several_events_for_several_vms_keep_per_event_order_and_affectsvm() {
    let (_sim, agent, events) = play("multi-vm", 0.01, "");
    let [freeze, reboot, redeploy] =
        ["1", "2", "3"].map(|n| format!("aaaaaaaa-0000-4000-8000-00000000000{n}"));
    assert_eq!(
        ids(&events),
        [
            "document:1".to_owned(),
            format!("{freeze}:scheduled"),
            format!("{reboot}:scheduled"),
            format!("{redeploy}:scheduled"),
            "document:2".to_owned(),
            format!("{redeploy}:started"),
            "document:3".to_owned(),
            format!("{redeploy}:completed"),
            "document:4".to_owned(),
            format!("{freeze}:started"),
            format!("{reboot}:started"),
            "document:5".to_owned(),
            format!("{freeze}:completed"),
            "document:6".to_owned(),
            format!("{reboot}:completed"),
            "document:7".to_owned(),
        ],
        "{}",
        agent.log()
    );
    assert_eq!(
        event(&events, &format!("{reboot}:scheduled"))["affectsvm"],
        false
    );
    assert_eq!(
        event(&events, &format!("{freeze}:scheduled"))["affectsvm"],
        true
    );
    assert_eq!(
        event(&events, "document:2")["data"]["Events"]
            .as_array()
            .unwrap()
            .len(),
        3
    );
}

#[test]
fn imds_faults_are_survived_without_bogus_transitions() {
    let (sim, agent, events) = play("imds-faults", 0.005, "");
    assert_eq!(
        ids(&events),
        scheduled_started_completed(FREEZE),
        "{}",
        agent.log()
    );
    let requests = sim.requests();
    let polls: Vec<&Value> = requests
        .iter()
        .filter(|r| r["path"] == "/metadata/scheduledevents")
        .collect();
    let statuses: Vec<Option<u64>> = polls.iter().map(|r| r["status"].as_u64()).collect();
    // The slow first call is waited for (first_call_timeout); the later slow answer is a
    // timeout, which the simulator sees as a request nobody waited for (no status).
    assert_eq!(
        statuses[..7],
        [
            Some(503),
            Some(503),
            Some(200),
            Some(200),
            Some(400),
            Some(500),
            None
        ],
        "{polls:?}"
    );
    assert!(
        polls[0]["at_ms"].as_u64().unwrap() < 1000,
        "first poll at once: {polls:?}"
    );
    assert!(
        requests.iter().all(|r| r["metadata"] == "true"),
        "every request carries Metadata: true"
    );
    let log = agent.log();
    for kind in ["server_error", "malformed", "bad_request", "timeout"] {
        assert!(
            log.contains(&format!("kind=\"{kind}\"")) || log.contains(&format!("kind={kind}")),
            "no {kind} error logged:\n{log}"
        );
    }
}

#[test]
fn older_api_versions_are_polled_and_their_missing_fields_are_tolerated() {
    let sim = SimProcess::start("live-migration", 0.005);
    let mut agent = AgentProcess::start_with_env(
        &sim.url,
        "",
        &[("SCHED_RELAY_IMDS__API_VERSION", "2017-08-01")],
    );
    let last = sim.wait_finished(Duration::from_secs(60));
    let events = agent.wait_for_id(&format!("document:{last}"), Duration::from_secs(10));
    agent.stop_cleanly();
    assert_eq!(
        ids(&events),
        scheduled_started_completed(FREEZE),
        "{}",
        agent.log()
    );
    let scheduled = event(&events, &format!("{FREEZE}:scheduled"));
    assert!(
        scheduled["data"]["event"]
            .get("DurationInSeconds")
            .is_none()
    );
    assert!(
        scheduled.get("eventsource").is_none(),
        "no EventSource before 2019-08-01"
    );
    let polls: Vec<Value> = sim
        .requests()
        .into_iter()
        .filter(|r| r["path"] == "/metadata/scheduledevents")
        .collect();
    assert!(
        polls.iter().all(|r| r["api_version"] == "2017-08-01"),
        "{polls:?}"
    );
}

#[test]
fn an_api_version_the_service_refuses_is_reported_with_the_versions_it_offers() {
    let sim = SimProcess::start("live-migration", 0.005);
    let mut agent = AgentProcess::start_with_env(
        &sim.url,
        "",
        &[("SCHED_RELAY_IMDS__API_VERSION", "2021-12-01")],
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !agent
        .log()
        .contains("does not accept api-version 2021-12-01")
    {
        assert!(
            std::time::Instant::now() < deadline,
            "no clear error:\n{}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        agent.log().contains("2020-07-01"),
        "the newest versions are named:\n{}",
        agent.log()
    );
    assert!(
        agent.is_running(),
        "a refused version is retried, not fatal"
    );
    agent.stop_cleanly();
    assert!(
        agent.events().is_empty(),
        "no document, no transition: {:?}",
        ids(&agent.events())
    );
}

#[test]
fn the_simulator_refuses_requests_without_metadata_header_or_api_version() {
    let sim = SimProcess::start("live-migration", 1.0);
    let url = format!(
        "{}/metadata/scheduledevents?api-version=2020-07-01",
        sim.url
    );
    let (status, body) = blocking_get(&url, &[]);
    assert_eq!(status, 400);
    assert!(body.contains("metadata header"), "{body}");
    let (status, body) = blocking_get(&url, &[("Metadata", "true")]);
    assert_eq!(status, 200, "{body}");
    let (status, body) = blocking_get(
        &format!("{}/metadata/scheduledevents", sim.url),
        &[("Metadata", "true")],
    );
    assert_eq!(status, 400);
    assert!(body.contains("newest-versions"), "{body}");
}

#[test]
fn policy_judges_an_event_again_when_an_update_brings_this_vm_into_resources() {
    let dir = tempfile::tempdir().unwrap();
    let scenario = dir.path().join("moved.toml");
    std::fs::write(
        &scenario,
        r#"
        [vm]
        name = "WestNO_0"
        [[events]]
        id = "moved-1"
        type = "Reboot"
        source = "User"
        resources = ["WestNO_1"]
        appear_after = "2m"
        notice = "15m"
        started_for = "1m"
        [[events.updates]]
        after = "2m"
        resources = ["WestNO_1", "WestNO_0"]
        "#,
    )
    .unwrap();
    let (_sim, agent, events) = play(
        scenario.to_str().unwrap(),
        0.005,
        "[policy]\napprove_user_initiated = true\n",
    );
    assert_eq!(
        ids(&events),
        [
            "document:1",
            "moved-1:scheduled",
            "document:2",
            "moved-1:updated:3",
            "document:3",
            "policy:moved-1:accepted",
            "moved-1:started",
            "document:4",
            "moved-1:completed",
            "document:5"
        ],
        "{}",
        agent.log()
    );
    assert_eq!(event(&events, "moved-1:scheduled")["affectsvm"], false);
    assert_eq!(event(&events, "moved-1:updated:3")["affectsvm"], true);
}

#[cfg(feature = "nats")]
#[test]
fn a_broker_that_hangs_does_not_delay_polling() {
    // A "broker" that accepts connections and never says a word: the NATS client waits out
    // its whole connect timeout (30 s here). Polling must not wait behind it.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = silent.local_addr().unwrap();
    let _hold = std::thread::spawn(move || {
        let mut held = Vec::new();
        while let Ok((stream, _)) = silent.accept() {
            held.push(stream);
        }
    });
    let sim = SimProcess::start("live-migration", 0.005);
    let started = std::time::Instant::now();
    let mut agent = AgentProcess::start(
        &sim.url,
        &format!(
            "[[sinks]]\nname = \"bus\"\nkind = \"nats\"\nurl = \"nats://{address}\"\ntimeout = \"30s\"\n"
        ),
    );
    agent.wait_for_id("document:1", Duration::from_secs(15));
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "the first document waited for the broker"
    );
    // Nor does it hold back shutdown beyond delivery.shutdown_timeout (10 s).
    agent.stop_cleanly();
}

#[test]
fn an_incarnation_that_goes_backwards_is_survived_and_invents_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let scenario = dir.path().join("reset.toml");
    std::fs::write(
        &scenario,
        r#"
        incarnation_reset_after = "3m"
        [[events]]
        id = "reset-1"
        type = "Reboot"
        resources = ["WestNO_0"]
        appear_after = "2m"
        notice = "4m"
        started_for = "2m"
        "#,
    )
    .unwrap();
    let (_sim, agent, events) = play(scenario.to_str().unwrap(), 0.005, "");
    let transitions: Vec<String> = ids(&events)
        .into_iter()
        .filter(|id| !id.starts_with("document:"))
        .collect();
    assert_eq!(
        transitions,
        ["reset-1:scheduled", "reset-1:started", "reset-1:completed"],
        "{}",
        agent.log()
    );
    assert!(
        agent.log().contains("DocumentIncarnation reset"),
        "{}",
        agent.log()
    );
    // The document ids of the new numbering carry the epoch, so none repeats an old one.
    assert!(
        ids(&events).iter().any(|id| id.ends_with("~e1")),
        "{:?}",
        ids(&events)
    );
}

/// At the shipped 1 s poll interval an unchanged document with an unparsable NotBefore
/// is fetched again and again; the WARN says so once, the metric counts every fetch.
#[test]
fn an_odd_field_is_logged_once_per_incarnation_and_counted_every_poll() {
    let (url, served) = fixed_imds(
        r#"{"DocumentIncarnation": 1, "Events": [{"EventId": "E1", "EventStatus": "Scheduled",
        "EventType": "Freeze", "Resources": ["vm1"], "NotBefore": "next Tuesday",
        "DurationInSeconds": 5}]}"#,
    );
    let port = sched_relay_transport::testing::free_port();
    let agent = AgentProcess::start_with_env(
        &url,
        &format!("[telemetry]\nlisten = \"127.0.0.1:{port}\"\n"),
        &[
            // The shipped [imds] defaults, over the fast ones of the test config.
            ("SCHED_RELAY_IMDS__POLL_INTERVAL", "1s"),
            ("SCHED_RELAY_IMDS__MAX_BACKOFF", "5s"),
            ("SCHED_RELAY_IMDS__REQUEST_TIMEOUT", "10s"),
            ("SCHED_RELAY_IMDS__FIRST_CALL_TIMEOUT", "150s"),
            ("SCHED_RELAY_IDENTITY__VM_NAME", "vm1"),
            ("SCHED_RELAY_IDENTITY__FROM_METADATA", "false"),
        ],
    );
    agent.wait_for_id("E1:scheduled", Duration::from_secs(10));
    let start = served.load(std::sync::atomic::Ordering::Relaxed);
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while served.load(std::sync::atomic::Ordering::Relaxed) < start + 4 {
        assert!(
            std::time::Instant::now() < deadline,
            "the agent stopped polling"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let warnings = agent.log().matches("Tolerated an odd field").count();
    assert_eq!(warnings, 1, "{}", agent.log());
    let metrics = blocking_get(&format!("http://127.0.0.1:{port}/metrics"), &[]).1;
    let counted: u64 = metrics
        .lines()
        .find_map(|line| line.strip_prefix("sched_relay_document_odd_fields_total "))
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or_else(|| panic!("no odd-field counter in /metrics:\n{metrics}"));
    assert!(counted >= 5, "{counted} odd fields counted over 5 fetches");
}

/// After an approval it made is accepted, the agent looks again at once, so fleet tooling
/// sees `started` when the VM goes down, not a poll interval later (here a minute).
#[test]
fn started_is_reported_right_after_an_accepted_approval_not_a_poll_later() {
    const REBOOT: &str = "5a4e3e9a-6c7f-4a32-9d8e-1d2b3c4d5e01";
    // At this scale the user's Reboot appears after 1.2 s and would start by itself 9 s later.
    let sim = SimProcess::start("user-reboot", 0.01);
    let document = format!(
        "{}/metadata/scheduledevents?api-version=2020-07-01",
        sim.url
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !blocking_get(&document, &[("Metadata", "true")])
        .1
        .contains(REBOOT)
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the Reboot never appeared"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let agent = AgentProcess::start_with_env(
        &sim.url,
        "[policy]\napprove_user_initiated = true\n",
        &[
            ("SCHED_RELAY_IMDS__POLL_INTERVAL", "60s"),
            ("SCHED_RELAY_IMDS__MAX_BACKOFF", "5s"),
        ],
    );
    // The first poll sees it Scheduled and approves it; the next poll is a minute away.
    let events = agent.wait_for_id(&format!("{REBOOT}:started"), Duration::from_secs(6));
    let accepted = format!("policy:{REBOOT}:accepted");
    assert!(ids(&events).contains(&accepted), "{:?}", ids(&events));
}

/// A user reboot this agent approves by policy starts and is over within 50 ms, between two
/// polls at the shipped 1 s interval: the agent never sees it `Started`. It vanished while
/// last seen `Scheduled`, so it is `cancelled` by the contract, but it says it probably ran.
#[test]
fn an_approved_event_that_vanishes_unseen_is_cancelled_marked_unobserved_started() {
    let dir = tempfile::tempdir().unwrap();
    let scenario = dir.path().join("unseen.toml");
    std::fs::write(
        &scenario,
        r#"
        [[events]]
        id = "unseen-reboot"
        type = "Reboot"
        source = "User"
        resources = ["WestNO_0"]
        appear_after = "1s"
        notice = "15m"
        started_for = "50ms"
        "#,
    )
    .unwrap();
    let sim = SimProcess::start(scenario.to_str().unwrap(), 1.0);
    let mut agent = AgentProcess::start_with_env(
        &sim.url,
        "[policy]\napprove_user_initiated = true\n",
        &[
            ("SCHED_RELAY_IMDS__POLL_INTERVAL", "1s"),
            ("SCHED_RELAY_IMDS__MAX_BACKOFF", "5s"),
        ],
    );
    let events = agent.wait_for_id("unseen-reboot:cancelled", Duration::from_secs(15));
    agent.stop_cleanly();
    let cancelled = event(&events, "unseen-reboot:cancelled");
    assert_eq!(cancelled["unobserved"], "started", "{cancelled}");
    assert_eq!(cancelled["unobservedreason"], "approved", "{cancelled}");
}
