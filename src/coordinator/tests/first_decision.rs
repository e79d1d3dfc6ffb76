//! A coordinator that starts with reports waiting (a restart, a standby's takeover) decides
//! as soon as its input has read them, not at its next tick: in-process, on the real NATS.

use std::time::Duration;

use chrono::Utc;
use futures_util::StreamExt;
use sched_relay_core::document::Document;
use sched_relay_core::event::{Heartbeat, events_for_document};
use sched_relay_transport::Sink;
use sched_relay_transport::testing::{broker_available, unique};

const NATS_URL: &str = "nats://127.0.0.1:4222";

/// A document with one Scheduled Reboot of `vm`, ten minutes from now.
fn scheduled_reboot(vm: &str) -> Document {
    let not_before = (Utc::now() + chrono::Duration::minutes(10))
        .to_rfc2822()
        .replace("+0000", "GMT");
    let body = serde_json::json!({"DocumentIncarnation": 2, "Events": [{
        "EventId": "5E1A3C1B-0D4F-4B5E-8C2A-000000000001", "EventType": "Reboot",
        "EventStatus": "Scheduled", "ResourceType": "VirtualMachine", "Resources": [vm],
        "EventSource": "Platform", "DurationInSeconds": -1, "NotBefore": not_before,
        "Description": "", "EventStatusChanged": null}]});
    Document::parse(body.to_string().as_bytes())
        .unwrap()
        .document
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coordinator_started_with_a_report_waiting_decides_once_its_input_caught_up_not_at_its_next_tick()
 {
    if !broker_available(
        "NATS",
        "127.0.0.1:4222",
        "nats-server -a 127.0.0.1 -p 4222 -js",
    ) {
        return;
    }
    crate::install_crypto_provider();
    let dir = tempfile::tempdir().unwrap();
    let stream = unique("FIRSTDECISION");
    let prefix = unique("first-decision");
    let vm = "web-0";
    sched_relay_nats::testing::create_stream(NATS_URL, &stream, &format!("{prefix}.events.>"))
        .await;

    // What the VM's agent published before the coordinator started: its heartbeat and the
    // event, through the agent's own sink.
    let sink = sched_relay_nats::NatsSink::new(
        serde_json::from_value(serde_json::json!({
            "url": NATS_URL, "jetstream": true,
            "subject": format!("{prefix}.events.{{vmname}}.{{transition}}"),
        }))
        .unwrap(),
    );
    let factory = super::agent_factory(vm, None);
    let document = scheduled_reboot(vm);
    let now = Utc::now();
    let mut batch = events_for_document(&factory, None, &document, true, now);
    batch.push(factory.heartbeat(
        &Heartbeat {
            document: Some(&document),
            epoch: 0,
            interval: Duration::from_secs(300),
            started_at: now,
            agent_version: env!("CARGO_PKG_VERSION"),
        },
        now,
    ));
    sink.deliver(&batch).await.unwrap();

    let key_file = dir.path().join("coordinator.key");
    crate::approval::keys::write_new(&key_file).unwrap();
    let config_file = dir.path().join("coordinator.toml");
    std::fs::write(
        &config_file,
        format!(
            r#"[coordinator]
state_dir = "{state}"
listen = "127.0.0.1:0"
# The longest tick there is: a decision at a tick would come a minute after the start.
tick = "60s"

[input]
kind = "nats"
url = "{NATS_URL}"
stream = "{stream}"
subject = "{prefix}.events.>"
durable = "coordinator"

[approvals]
kind = "nats"
url = "{NATS_URL}"
subject = "{prefix}.approvals.{{vmname}}"

[signing]
key_file = "{key}"
key_id = "test"

[defaults]
max_down = 1
[defaults.actions]
Reboot = "approve"
"#,
            state = dir.path().join("state").display(),
            key = key_file.display(),
        ),
    )
    .unwrap();
    let (config, policy) =
        crate::coordinator::config::CoordinatorConfig::load_file_only(&config_file).unwrap();

    let client = async_nats::connect(NATS_URL).await.unwrap();
    let mut approvals = client
        .subscribe(format!("{prefix}.approvals.{vm}"))
        .await
        .unwrap();
    client.flush().await.unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let started = std::time::Instant::now();
    let coordinator = tokio::spawn(crate::coordinator::run(config, policy, async move {
        let _ = stopped.await;
    }));
    let approval = tokio::time::timeout(Duration::from_secs(20), approvals.next()).await;
    let took = started.elapsed();
    let _ = stop.send(());
    let ended = tokio::time::timeout(Duration::from_secs(15), coordinator).await;
    sched_relay_nats::testing::delete_stream(NATS_URL, &stream).await;
    assert!(
        matches!(approval, Ok(Some(_))),
        "no approval within 20 s of the start (after {took:?}): the first decision waited for a tick"
    );
    assert!(
        matches!(ended, Ok(Ok(Ok(())))),
        "the coordinator stopped with {ended:?}"
    );
}
