//! What operators rely on: /metrics, /healthz, /readyz and GET /events on the telemetry
//! listener, `sched-relay watch`, and dashboards and alerts that only use metrics that exist.

mod common;

use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, Instant};

use common::{AgentProcess, SimProcess, blocking_get};
use sched_relay::telemetry::METRICS;
use serde_json::Value;

/// (status, body), or None while nothing listens.
fn try_get(url: &str) -> Option<(u16, String)> {
    sched_relay::install_crypto_provider();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let client = reqwest::Client::builder().no_proxy().build().unwrap();
        let response = client.get(url).send().await.ok()?;
        let status = response.status().as_u16();
        Some((status, response.text().await.ok()?))
    })
}

fn get_json(url: &str) -> (u16, Value) {
    let (status, body) = blocking_get(url, &[]);
    (
        status,
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("{url}: {e}: {body}")),
    )
}

/// Polls `url` until `check` accepts the answer.
fn wait_until(url: &str, what: &str, check: impl Fn(u16, &str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let answer = try_get(url);
        if let Some((status, body)) = &answer
            && check(*status, body)
        {
            return body.clone();
        }
        assert!(
            Instant::now() < deadline,
            "{what}: {url} answered {answer:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn metrics_health_and_readiness_follow_the_agent() {
    let sim = SimProcess::start("live-migration", 0.02);
    let port = sched_relay_transport::testing::free_port();
    let base = format!("http://127.0.0.1:{port}");
    let agent = AgentProcess::start(
        &sim.url,
        &format!("[telemetry]\nlisten = \"127.0.0.1:{port}\"\n"),
    );
    wait_until(&format!("{base}/healthz"), "alive", |status, _| {
        status == 200
    });
    wait_until(
        &format!("{base}/readyz"),
        "ready after the first poll",
        |status, body| status == 200 && body.contains("\"ready\":true"),
    );
    let last = sim.wait_finished(Duration::from_secs(60));
    agent.wait_for_id(&format!("document:{last}"), Duration::from_secs(10));
    let metrics = blocking_get(&format!("{base}/metrics"), &[]).1;
    for expected in [
        "sched_relay_build_info{version=",
        "sched_relay_imds_polls_total ",
        "sched_relay_imds_poll_duration_seconds_bucket{le=",
        &format!("sched_relay_incarnation {last}"),
        "sched_relay_transitions_total{transition=\"completed\"} 1",
        "sched_relay_sink_delivered_total{sink=\"file\"}",
        "sched_relay_sink_up{sink=\"file\"} 1",
        "sched_relay_outbox_depth{sink=\"file\"} 0",
        "sched_relay_outbox_oldest_age_seconds{sink=\"file\"} 0",
        "sched_relay_document_events{",
        "sched_relay_state_store_commit_seconds_bucket{le=\"0.0001\"}",
        "# HELP sched_relay_imds_polls_total",
    ] {
        assert!(
            metrics.contains(expected),
            "no {expected:?} in /metrics:\n{metrics}"
        );
    }
}

/// GET /events and the approval checks use the poller's document while it is fresher than a
/// poll interval: a document that stays the same is still one just fetched (else every
/// approval would cost a GET of its own, and the view would look stale). Shipped defaults.
#[test]
fn an_unchanged_document_shows_as_just_fetched_in_the_events_view() {
    let sim = SimProcess::start("live-migration", 0.02);
    let port = sched_relay_transport::testing::free_port();
    let base = format!("http://127.0.0.1:{port}");
    let agent = AgentProcess::start_on_defaults(
        &sim.url,
        &format!("[telemetry]\nlisten = \"127.0.0.1:{port}\"\n"),
    );
    let last = sim.wait_finished(Duration::from_secs(60));
    agent.wait_for_id(&format!("document:{last}"), Duration::from_secs(10));
    // Four polls of the same document.
    std::thread::sleep(Duration::from_secs(4));
    let (status, view) = get_json(&format!("{base}/events"));
    assert_eq!(status, 200);
    assert_eq!(view["incarnation"], last, "{view}");
    let ago = view["fetchedSecondsAgo"].as_f64().unwrap();
    assert!(ago < 2.5, "fetched {ago} s ago, with 1 s polls: {view}");
}

/// A sink that cannot deliver makes the agent unready, says why, and GET /events shows
/// which transitions it still owes.
#[cfg(feature = "webhook")]
#[test]
fn a_failing_sink_makes_the_agent_unready_and_events_show_what_it_owes() {
    let sim = SimProcess::start("user-reboot", 0.01);
    let port = sched_relay_transport::testing::free_port();
    let closed = sched_relay_transport::testing::free_port();
    let base = format!("http://127.0.0.1:{port}");
    let _agent = AgentProcess::start(
        &sim.url,
        &format!(
            "[telemetry]\nlisten = \"127.0.0.1:{port}\"\n\n[[sinks]]\nname = \"hook\"\nkind = \"webhook\"\nurl = \"http://127.0.0.1:{closed}/events\"\n"
        ),
    );
    let body = wait_until(&format!("{base}/readyz"), "unready", |status, body| {
        status == 503 && body.contains("sink hook is failing")
    });
    assert!(body.contains("\"ready\":false"), "{body}");
    let event_id = "5a4e3e9a-6c7f-4a32-9d8e-1d2b3c4d5e01";
    wait_until(
        &format!("{base}/events"),
        "the event in the view",
        |_, body| body.contains(event_id),
    );
    let (status, view) = get_json(&format!("{base}/events"));
    assert_eq!(status, 200);
    let event = view["events"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["EventId"] == event_id)
        .unwrap_or_else(|| panic!("{view}"));
    assert_eq!(event["delivery"]["file"]["state"], "delivered", "{view}");
    assert_eq!(event["delivery"]["hook"]["state"], "pending", "{view}");
    assert!(
        event["delivery"]["hook"]["undelivered"]
            .as_array()
            .unwrap()
            .contains(&Value::String(format!("{event_id}:scheduled"))),
        "{view}"
    );
    assert_eq!(view["sinks"]["hook"]["healthy"], false);
    assert!(view["sinks"]["hook"]["undelivered"].as_u64().unwrap() >= 1);
}

/// `watch --once` on a file sink prints the fleet table as it stands.
#[test]
fn watch_shows_the_fleet_from_a_file_sink() {
    let (_sim, agent, _events) = common::play(
        "live-migration",
        0.01,
        "[policy]\napprove_freeze_max_seconds = 9\n",
    );
    let table = common::stdout_of(
        std::process::Command::new(common::BINARY)
            .args(["watch", "--once", "--settle", "1s", "--from"])
            .arg(&agent.events_file),
    );
    let row = table
        .lines()
        .find(|line| line.contains("C7061BAC-AFDC-4513-B24B-AA5F13A16123"))
        .unwrap_or_else(|| panic!("no row for the Freeze:\n{table}"));
    for cell in ["WestNO_0", "Freeze", "Completed", "accepted", "completed"] {
        assert!(row.contains(cell), "no {cell} in {row:?}\n{table}");
    }
    assert!(table.starts_with("VM"), "{table}");
}

/// `watch` on NATS sees the events another agent publishes while it runs.
#[cfg(feature = "nats")]
#[test]
fn watch_follows_the_fleet_on_nats() {
    if !sched_relay_transport::testing::broker_available(
        "NATS",
        "127.0.0.1:4222",
        "nats-server -js",
    ) {
        return;
    }
    let prefix = sched_relay_transport::testing::unique("watch");
    let watcher = std::process::Command::new(common::BINARY)
        .args(["watch", "--from"])
        .arg(format!("nats://127.0.0.1:4222?subject={prefix}.>"))
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(1));
    let (_sim, _agent, _events) = common::play(
        "live-migration",
        0.01,
        &format!(
            "[[sinks]]\nname = \"bus\"\nkind = \"nats\"\nurl = \"nats://127.0.0.1:4222\"\nsubject = \"{prefix}.{{vmname}}.{{transition}}\"\n"
        ),
    );
    std::thread::sleep(Duration::from_secs(1));
    // Ctrl-C: the view prints the final table and exits 0.
    let stopped = std::process::Command::new("kill")
        .args(["-INT", &watcher.id().to_string()])
        .status()
        .unwrap();
    assert!(stopped.success());
    let output = watcher.wait_with_output().unwrap();
    assert!(output.status.success());
    let all = String::from_utf8_lossy(&output.stdout);
    // Refreshed every second: the last table is the final state.
    let table = &all[all.rfind("VM ").unwrap_or(0)..];
    let row = table
        .lines()
        .find(|line| line.contains("C7061BAC-AFDC-4513-B24B-AA5F13A16123"))
        .unwrap_or_else(|| panic!("no row for the Freeze:\n{table}"));
    assert!(
        row.contains("WestNO_0") && row.contains("Completed"),
        "{row}"
    );
}

/// Every file under `dir` whose name ends in `.extension`, at any depth.
fn files(dir: &Path, extension: &str) -> Vec<std::path::PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == extension) {
                found.push(path);
            }
        }
    }
    found
}

/// Every metric the code records is in the documented list, and every metric the Grafana
/// dashboard, the alert rules, the README and the book (docs/src) name exists. The list is
/// the table of docs/src/metrics.md.
#[test]
fn dashboards_alerts_and_docs_use_only_metrics_that_exist() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let known: BTreeSet<&str> = METRICS.iter().map(|(name, _, _)| *name).collect();
    let mut recorded = BTreeSet::new();
    for path in files(&root.join("src"), "rs") {
        let text = std::fs::read_to_string(&path).unwrap();
        for macro_name in ["counter!(", "gauge!(", "histogram!("] {
            for part in text.split(macro_name).skip(1) {
                if let Some(name) = part
                    .trim_start()
                    .strip_prefix('"')
                    .and_then(|p| p.split('"').next())
                    && name.starts_with("sched_relay_")
                {
                    recorded.insert(name.to_owned());
                }
            }
        }
    }
    for name in &recorded {
        assert!(
            known.contains(name.as_str()),
            "{name} is recorded but not in telemetry::METRICS"
        );
    }
    let table = std::fs::read_to_string(root.join("docs/src/metrics.md")).unwrap();
    for (name, kind, _) in METRICS {
        assert!(
            table.contains(&format!("| `{name}` | {kind} |")),
            "the metrics table of docs/src/metrics.md lacks {name}"
        );
    }
    // Each file's metric names, every one of which must exist.
    let uses = |file: &Path| -> usize {
        let text = std::fs::read_to_string(file).unwrap();
        let mut used = 0;
        for part in text.split("sched_relay_").skip(1) {
            let name: String = part
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                .collect();
            let name = format!("sched_relay_{name}");
            let base = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|suffix| name.strip_suffix(suffix))
                .unwrap_or(&name);
            if name == "sched_relay_" {
                continue;
            }
            assert!(
                known.contains(base),
                "{} uses {name}, which the agent does not export",
                file.strip_prefix(root).unwrap_or(file).display()
            );
            used += 1;
        }
        used
    };
    for file in [
        "deploy/grafana/sched-relay.json",
        "deploy/prometheus/alerts.yml",
    ] {
        assert!(uses(&root.join(file)) > 0, "{file} uses no metric");
    }
    let mut pages = files(&root.join("docs/src"), "md");
    pages.push(root.join("README.md"));
    let used: usize = pages.iter().map(|page| uses(page)).sum();
    assert!(used > 0, "no page of docs/src names a metric");
}
