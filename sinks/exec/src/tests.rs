use super::*;
use sched_relay_transport::testing::live_migration_events;

fn sink(script: &str, extra: &str) -> ExecSink {
    let timeout = if extra.contains("timeout") {
        ""
    } else {
        "timeout = \"2s\""
    };
    let config: ExecSinkConfig = toml::from_str(&format!(
        "command = [\"/bin/sh\", \"-c\", {script:?}]\n{timeout}\n{extra}"
    ))
    .unwrap();
    assert!(config.validate().is_empty());
    ExecSink::new(config)
}

#[tokio::test]
async fn the_command_sees_the_event_on_stdin_and_its_facts_in_the_environment() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let script = format!(
        "printf '%s|%s|%s|%s|%s|%s\\n' \"$EVENT_ID\" \"$EVENT_TYPE\" \"$EVENT_STATUS\" \"$NOT_BEFORE\" \"$TRANSITION\" \"$(cat | head -c 20)\" >> {}",
        out.display()
    );
    let events = live_migration_events("WestNO_0");
    sink(&script, "transitions = [\"scheduled\", \"completed\"]")
        .deliver(&events)
        .await
        .unwrap();
    let lines: Vec<String> = std::fs::read_to_string(&out)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect();
    assert_eq!(
        lines,
        [
            "C7061BAC-AFDC-4513-B24B-AA5F13A16123|Freeze|Scheduled|Mon, 11 Apr 2022 22:26:58 GMT|scheduled|{\"specversion\":\"1.0\"",
            "C7061BAC-AFDC-4513-B24B-AA5F13A16123|Freeze|Started||completed|{\"specversion\":\"1.0\"",
        ]
    );
}

#[tokio::test]
async fn exit_statuses_decide_delivered_retry_or_dead_letter() {
    let one = &live_migration_events("vm")[1..2];
    sink("exit 0", "").deliver(one).await.unwrap();
    let retry = sink("echo busy >&2; exit 75", "")
        .deliver(one)
        .await
        .unwrap_err();
    assert!(
        retry.is_retriable() && retry.to_string().contains("busy"),
        "{retry}"
    );
    let refused = sink("echo broken >&2; exit 3", "")
        .deliver(one)
        .await
        .unwrap_err();
    assert!(
        !refused.is_retriable() && refused.to_string().contains("broken"),
        "{refused}"
    );
    let slow = sink("sleep 10", "timeout = \"200ms\"")
        .deliver(one)
        .await
        .unwrap_err();
    assert!(
        slow.is_retriable() && slow.to_string().contains("killed"),
        "{slow}"
    );
}

#[tokio::test]
async fn the_command_sees_only_path_its_event_and_the_allowed_variables() {
    // SAFETY: set once before any command runs; no other test reads these names.
    unsafe {
        std::env::set_var("SCHED_RELAY_SINKS__0__PASSWORD", "agent-S3CRET");
        std::env::set_var("EXEC_TEST_BROKER_TOKEN", "agent-T0KEN");
        std::env::set_var("EXEC_TEST_PASSED", "passed-on");
        std::env::set_var("EXEC_TEST_FROM_ENV", "from-agent-env");
    }
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("env");
    let extra = r#"
        pass_env = ["EXEC_TEST_PASSED", "EXEC_TEST_UNSET"]
        env = { DRAIN_GRACE = "30", DRAIN_TOKEN = "${EXEC_TEST_FROM_ENV}" }
    "#;
    sink(&format!("env > {}", out.display()), extra)
        .deliver(&live_migration_events("vm")[..1])
        .await
        .unwrap();
    let seen = std::fs::read_to_string(&out).unwrap();
    let mut names: Vec<&str> = seen.lines().filter_map(|l| l.split('=').next()).collect();
    names.sort();
    // sh adds PWD, SHLVL and `_` of its own; nothing else may come from the agent.
    names.retain(|name| !matches!(*name, "PWD" | "SHLVL" | "_" | "OLDPWD"));
    assert_eq!(
        names,
        [
            "AFFECTS_VM",
            "CE_ID",
            "CE_TYPE",
            "DRAIN_GRACE",
            "DRAIN_TOKEN",
            "EVENT_ID",
            "EVENT_STATUS",
            "EVENT_TYPE",
            "EXEC_TEST_PASSED",
            "INCARNATION",
            "NOT_BEFORE",
            "PATH",
            "TRANSITION",
            "VM_NAME",
        ],
        "{seen}"
    );
    assert!(seen.contains("EXEC_TEST_PASSED=passed-on"), "{seen}");
    assert!(seen.contains("DRAIN_TOKEN=from-agent-env"), "{seen}");
    assert!(
        !seen.contains("S3CRET") && !seen.contains("T0KEN"),
        "{seen}"
    );
}

#[test]
fn env_values_never_print() {
    let config: ExecSinkConfig =
        toml::from_str("command = [\"/bin/true\"]\nenv = { API_TOKEN = \"T0KEN\" }").unwrap();
    assert!(!format!("{config:?}").contains("T0KEN"));
    assert!(!toml::to_string(&config).unwrap().contains("T0KEN"));
}

/// Whether a process is still running (a zombie waiting for init to reap it is not).
fn running(pid: &str) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        !stat
            .rsplit(')')
            .next()
            .unwrap_or("")
            .trim_start()
            .starts_with('Z')
    })
}

#[tokio::test]
async fn a_timeout_kills_what_the_command_started_too() {
    let dir = tempfile::tempdir().unwrap();
    let pid_file = dir.path().join("grandchild");
    let script = format!("sleep 30 & echo $! > {}; wait", pid_file.display());
    let error = sink(&script, "timeout = \"500ms\"")
        .deliver(&live_migration_events("vm")[..1])
        .await
        .unwrap_err();
    assert!(error.is_retriable(), "{error}");
    let pid = std::fs::read_to_string(&pid_file).unwrap();
    let pid = pid.trim();
    let deadline = std::time::Instant::now() + Duration::from_secs(3);
    while running(pid) && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        !running(pid),
        "the grandchild sleep {pid} outlived the timeout"
    );
}

#[tokio::test]
async fn a_command_that_never_reads_a_large_event_is_killed_on_time() {
    use cloudevents::EventBuilder;
    let big = "x".repeat(4 << 20); // far more than a pipe holds
    let event: Event = cloudevents::EventBuilderV10::new()
        .id("big:scheduled")
        .source("urn:x")
        .ty("com.azure.scheduledevents.scheduled")
        .data("application/json", serde_json::json!({ "padding": big }))
        .build()
        .unwrap()
        .into();
    let started = std::time::Instant::now();
    let error = tokio::time::timeout(
        Duration::from_secs(10),
        sink("sleep 30", "timeout = \"500ms\"").deliver(std::slice::from_ref(&event)),
    )
    .await
    .expect("the stdin write is bounded by the sink's timeout")
    .unwrap_err();
    assert!(
        error.is_retriable() && error.to_string().contains("killed"),
        "{error}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn a_missing_program_is_reported_by_the_health_check_and_holds_the_events() {
    let config: ExecSinkConfig = toml::from_str("command = [\"/nonexistent/drain\"]").unwrap();
    let sink = ExecSink::new(config);
    assert!(
        sink.health_check()
            .await
            .unwrap_err()
            .to_string()
            .contains("does not exist")
    );
    // Missing during a deploy, say: the events wait for it rather than go to the dead-letter
    // file (the health check, /readyz and the outbox metrics say why they wait).
    assert!(
        sink.deliver(&live_migration_events("vm")[..1])
            .await
            .unwrap_err()
            .is_retriable()
    );
}

#[test]
fn a_transition_filter_that_can_never_match_is_refused() {
    let config: ExecSinkConfig = toml::from_str(
        "command = [\"/bin/true\"]\ntransitions = [\"scheduled\", \"accepted\", \"approval.failed\"]",
    )
    .unwrap();
    let problems = config.validate();
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert_eq!(problems[0].0, "transitions");
    assert!(problems[0].1.contains("\"accepted\""), "{problems:?}");
    assert!(problems[0].1.contains("approval.accepted"), "{problems:?}");
}

#[test]
fn the_transition_is_the_same_whatever_the_type_prefix() {
    for prefix in ["com.azure.scheduledevents", "com.contoso.maintenance"] {
        use cloudevents::EventBuilder;
        let event: Event = cloudevents::EventBuilderV10::new()
            .id("r:accepted")
            .source("urn:x")
            .ty(format!("{prefix}.approval.accepted"))
            .build()
            .unwrap()
            .into();
        let environment = ExecSink::environment(&event);
        let transition = environment
            .iter()
            .find(|(k, _)| *k == "TRANSITION")
            .unwrap();
        assert_eq!(transition.1, "approval.accepted", "{prefix}");
    }
}

#[tokio::test]
async fn a_script_being_replaced_is_retried_not_dead_lettered() {
    use std::io::Write;
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("drain");
    // Configuration management rewriting the script in place: still open for writing now,
    // so starting it fails with ETXTBSY.
    let mut file = std::fs::File::create(&path).unwrap();
    file.write_all(b"#!/bin/sh\nexit 0\n").unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    let config: ExecSinkConfig =
        toml::from_str(&format!("command = [{:?}]", path.display().to_string())).unwrap();
    let sink = ExecSink::new(config);
    let one = &live_migration_events("vm")[..1];
    let error = sink.deliver(one).await.unwrap_err();
    assert!(error.is_retriable(), "{error}");
    // Once written, a later attempt runs it. (Not necessarily the very next: a command
    // another test forks at this moment briefly holds a copy of the write descriptor until
    // its exec, which is ETXTBSY again; the fan-out retries just so.)
    drop(file);
    let mut attempts = 0;
    while let Err(error) = sink.deliver(one).await {
        attempts += 1;
        assert!(error.is_retriable() && attempts < 50, "{error}");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn heartbeats_run_the_command_only_when_its_transitions_name_them() {
    use cloudevents::EventBuilder;
    let heartbeat: Event = cloudevents::EventBuilderV10::new()
        .id("heartbeat:1714557900000")
        .source("urn:x")
        .ty("com.azure.scheduledevents.heartbeat")
        .subject("heartbeat")
        .build()
        .unwrap()
        .into();
    let scheduled = live_migration_events("vm")
        .into_iter()
        .find(|event| event.transition() == "scheduled")
        .unwrap();
    let batch = [heartbeat, scheduled];
    let dir = tempfile::tempdir().unwrap();
    let ran = |name: &str| {
        let out = dir.path().join(name);
        let script = format!("echo \"$TRANSITION\" >> {}", out.display());
        (out, script)
    };
    // Empty: every event but heartbeats, so a drain script does not run every 5 minutes.
    let (out, script) = ran("every");
    sink(&script, "").deliver(&batch).await.unwrap();
    assert_eq!(std::fs::read_to_string(&out).unwrap(), "scheduled\n");
    let (out, script) = ran("listed");
    sink(&script, "transitions = [\"heartbeat\"]")
        .deliver(&batch)
        .await
        .unwrap();
    assert_eq!(std::fs::read_to_string(&out).unwrap(), "heartbeat\n");
}
