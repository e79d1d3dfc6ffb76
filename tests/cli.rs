//! The command line as a user meets it: `demo`, `check-config`, `events`, `approve`.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{BINARY, SimProcess};

const FREEZE: &str = "C7061BAC-AFDC-4513-B24B-AA5F13A16123";

/// `sched-relay check-config --config <path>`, run to the end.
fn check_config(path: &std::path::Path) -> std::process::Output {
    Command::new(BINARY)
        .args(["check-config", "--config"])
        .arg(path)
        .output()
        .unwrap()
}

#[test]
fn demo_prints_the_live_migration_in_order_and_exits_zero() {
    let started = Instant::now();
    let output = Command::new(BINARY)
        .arg("demo")
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    // The summary alone on a terminal: the agent's log stays at WARN unless asked.
    assert!(stdout.contains("--log-level info"), "{stdout}");
    assert!(
        !stderr.contains("INFO") && !stderr.contains("Transition"),
        "the demo interleaves the agent's INFO log with its summary:\n{stderr}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(45),
        "demo took {:?}",
        started.elapsed()
    );

    // Summary lines: time, type, id, extensions.
    let position = |ty: &str, id: &str| {
        stdout
            .lines()
            .position(|line| {
                let words: Vec<&str> = line.split_whitespace().collect();
                words.get(1) == Some(&ty) && words.get(2) == Some(&id)
            })
            .unwrap_or_else(|| panic!("no {ty} {id} line in the demo output:\n{stdout}"))
    };
    let prefix = "com.azure.scheduledevents";
    let order = [
        (format!("{prefix}.document"), "document:1".to_owned()),
        (format!("{prefix}.scheduled"), format!("{FREEZE}:scheduled")),
        (
            format!("{prefix}.approval.accepted"),
            format!("policy:{FREEZE}:accepted"),
        ),
        (format!("{prefix}.started"), format!("{FREEZE}:started")),
        (format!("{prefix}.completed"), format!("{FREEZE}:completed")),
    ];
    let positions: Vec<usize> = order.iter().map(|(ty, id)| position(ty, id)).collect();
    assert!(
        positions.windows(2).all(|w| w[0] < w[1]),
        "out of order:\n{stdout}"
    );
    // The user-initiated reboot follows, approved by policy too.
    assert!(
        stdout.contains("5a4e3e9a-6c7f-4a32-9d8e-1d2b3c4d5e01:completed"),
        "{stdout}"
    );
    assert!(stdout.contains("2 approvals POSTed"), "{stdout}");
}

#[test]
fn check_config_prints_the_effective_configuration_with_secrets_redacted() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.toml");
    std::fs::write(
        &path,
        "[identity]\nvm_name = \"WestNO_0\"\nsource = \"amqp://user:hunter2@example/\"\n[[sinks]]\nname = \"audit\"\nkind = \"file\"\npath = \"/tmp/x.jsonl\"\n",
    )
    .unwrap();
    let output = check_config(&path);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        stdout.contains("poll_interval = \"1s\""),
        "defaults are shown:\n{stdout}"
    );
    assert!(stdout.contains("vm_name = \"WestNO_0\""), "{stdout}");
    assert!(!stdout.contains("hunter2"), "{stdout}");
}

#[test]
fn tls_files_that_cannot_work_are_check_config_errors_naming_the_sink_key_and_file() {
    let dir = tempfile::tempdir().unwrap();
    let not_pem = dir.path().join("not-pem.txt");
    std::fs::write(&not_pem, "hello").unwrap();
    let path = dir.path().join("config.toml");
    std::fs::write(
        &path,
        format!(
            "[[sinks]]\nname = \"bus\"\nkind = \"nats\"\nurl = \"tls://127.0.0.1:4222\"\n\
             ca_file = \"/nonexistent/ca.pem\"\nclient_cert_file = {not_pem:?}\n\n\
             [[sinks]]\nname = \"hook\"\nkind = \"webhook\"\nurl = \"https://example.invalid/\"\n\
             client_cert_file = {not_pem:?}\nclient_key_file = {not_pem:?}\n\n\
             [[sinks]]\nname = \"rabbit\"\nkind = \"amqp\"\nurl = \"amqp://127.0.0.1:5672/%2f\"\n\
             ca_file = {not_pem:?}\n"
        ),
    )
    .unwrap();
    let output = check_config(&path);
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    let expected = [
        "sinks[0].ca_file: ca_file /nonexistent/ca.pem: No such file",
        "sinks[0].client_key_file: client_cert_file needs client_key_file",
        "sinks[1].client_cert_file: client_cert_file ",
        "sinks[1].client_key_file: client_key_file ",
        // A CA for a plain connection: nobody may believe it is verified.
        "sinks[2].ca_file: is set, but the connection would not use TLS: use an amqps:// URL",
        "sinks[2].ca_file: ca_file ",
    ];
    for line in expected {
        assert!(
            stderr.contains(&format!("config error: {line}")),
            "missing {line:?} in:\n{stderr}"
        );
    }
    assert!(stderr.contains("holds no PEM certificate"), "{stderr}");
    assert!(stderr.contains("holds no PEM private key"), "{stderr}");
}

#[test]
fn check_config_exits_2_with_one_line_per_problem() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.toml");
    std::fs::write(&path, "[imds]\napi_version = \"latest\"\npoll_interval = \"10ms\"\n[policy]\napprove_freeze_max_seconds = -3\n").unwrap();
    let output = check_config(&path);
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 3, "{stderr}");
    assert!(
        lines[0].starts_with("config error: imds.api_version: \"latest\""),
        "{stderr}"
    );
    assert!(
        lines[1].starts_with("config error: imds.poll_interval: 10ms"),
        "{stderr}"
    );
    assert!(
        lines[2].starts_with("config error: policy.approve_freeze_max_seconds"),
        "{stderr}"
    );

    let missing = Command::new(BINARY)
        .args(["run", "--config", "/nonexistent.toml"])
        .output()
        .unwrap();
    assert_eq!(missing.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("/nonexistent.toml does not exist"));
}

#[test]
fn events_prints_the_document_and_approve_starts_an_event() {
    // At this scale the Freeze appears after 600 ms, would start by itself 4.5 s later, and
    // once approved stays Started for 600 ms: room for a process start on a loaded machine
    // (at 0.0005 it stayed Started for 60 ms, and the check below lost that race under load).
    let sim = SimProcess::start("live-migration", 0.005);
    std::thread::sleep(Duration::from_millis(900));
    let output = Command::new(BINARY)
        .args(["events", "--endpoint", &sim.url])
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let document: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(document["Events"][0]["EventId"], FREEZE);
    assert_eq!(document["Events"][0]["EventStatus"], "Scheduled");

    let output = Command::new(BINARY)
        .args(["approve", FREEZE, "--endpoint", &sim.url])
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let output = Command::new(BINARY)
        .args(["events", "--endpoint", &sim.url])
        .output()
        .unwrap();
    let document: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(document["Events"][0]["EventStatus"], "Started");

    let refused = Command::new(BINARY)
        .args(["approve", "no-such-event", "--endpoint", &sim.url])
        .output()
        .unwrap();
    assert_eq!(refused.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("400 Bad Request"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
}

#[test]
fn demo_narrates_with_the_agent_log_when_asked() {
    let output = Command::new(BINARY)
        .args(["demo", "--log-level", "sched_relay=info"])
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(stderr.contains("Transition"), "{stderr}");
}

/// A scale-set VM of scale set `web` for `simulate --arm-listen`, with `more` TOML.
fn arm_scenario(dir: &std::path::Path, n: usize, more: &str) -> String {
    let path = dir.join(format!("web_{n}.toml"));
    std::fs::write(
        &path,
        format!(
            "[vm]\nname = 'web_{n}'\nresource_id = '/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachineScaleSets/web/virtualMachines/{n}'\n{more}"
        ),
    )
    .unwrap();
    path.display().to_string()
}

/// A child process killed when the test ends, however it ends.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn simulator_with_arm_listen_prints_where_arm_listens_and_serves_the_scale_set() {
    use std::io::BufRead as _;
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (
        arm_scenario(dir.path(), 0, ""),
        arm_scenario(dir.path(), 1, ""),
    );
    let mut child = Killed(
        Command::new(BINARY)
            .args([
                "simulate",
                "--listen",
                "127.0.0.1:0",
                "--arm-listen",
                "127.0.0.1:0",
            ])
            .args(["--arm-page-size", "1", "--scenario", &a, "--scenario", &b])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let mut stdout = std::io::BufReader::new(child.0.stdout.take().unwrap());
    let mut lines = Vec::new();
    for _ in 0..3 {
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        lines.push(line.trim().to_owned());
    }
    let arm = lines[2]
        .strip_prefix("sched-relay simulator ARM listening on ")
        .unwrap_or_else(|| panic!("{lines:?}"))
        .to_owned();
    assert!(
        lines[..2]
            .iter()
            .all(|l| l.starts_with("sched-relay simulator listening on "))
    );
    let (status, body) = common::blocking_get(
        &format!(
            "{arm}/metadata/identity/oauth2/token?api-version=2019-08-01&resource=https://management.azure.com/"
        ),
        &[("Metadata", "true")],
    );
    assert_eq!(status, 200, "{body}");
    let token: serde_json::Value = serde_json::from_str(&body).unwrap();
    let bearer = format!("Bearer {}", token["access_token"].as_str().unwrap());
    let (status, body) = common::blocking_get(
        &format!(
            "{arm}/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachineScaleSets/web/virtualMachines?api-version=2024-07-01"
        ),
        &[("Authorization", &bearer)],
    );
    drop(child);
    assert_eq!(status, 200, "{body}");
    let page: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(page["value"].as_array().unwrap().len(), 1, "{page}");
    assert!(page["nextLink"].as_str().unwrap().starts_with(&arm));

    // A scale set whose VMs disagree on its policy: exit 2, naming both.
    let policy = "[vm.scheduled_events_policy]\nall_instances_down_auto_approve = true\n";
    let b = arm_scenario(dir.path(), 1, policy);
    let output = Command::new(BINARY)
        .args([
            "simulate",
            "--listen",
            "127.0.0.1:0",
            "--arm-listen",
            "127.0.0.1:0",
        ])
        .args(["--scenario", &a, "--scenario", &b])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("web_0") && stderr.contains("web_1"),
        "{stderr}"
    );
}
