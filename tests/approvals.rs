//! Remote approvals end to end: an orchestrator's signed StartRequest arrives through HTTP,
//! NATS (core and JetStream), RabbitMQ or Kafka, is checked by the agent, reaches the
//! simulator as a POST and the event becomes Started. Forged, stale, replayed, misdirected
//! and malformed requests never reach the simulator; each gets its `approval.rejected`
//! outcome with the right reason, and the agent keeps running.

mod common;

use std::time::{Duration, Instant};

use common::{AgentProcess, SimProcess};
use sched_relay::approval::publish_to;
use sched_relay_core::approval::{Draft, SigningKey};
use sched_relay_transport::testing::{broker_available, unique};
use serde_json::Value;

const NATS: &str = "127.0.0.1:4222";
const NATS_URL: &str = "nats://127.0.0.1:4222";
const RABBITMQ: &str = "127.0.0.1:5672";
const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
const TYPE: &str = "com.azure.scheduledevents";

/// Scheduled for this VM, waiting for approval (an hour of notice).
const FREEZE: &str = "f0000000-0000-4000-8000-000000000001";
/// Already Started (its notice ran out at once).
const STARTED: &str = "f0000000-0000-4000-8000-000000000002";
/// Scheduled, for another VM of the availability set only.
const OTHERS: &str = "f0000000-0000-4000-8000-000000000003";

const SCENARIO: &str = r#"
[vm]
name = "WestNO_0"

[[events]]
id = "f0000000-0000-4000-8000-000000000001"
type = "Freeze"
resources = ["WestNO_0"]
duration_in_seconds = 5
appear_after = "0s"
notice = "1h"
started_for = "1h"

[[events]]
id = "f0000000-0000-4000-8000-000000000002"
type = "Reboot"
resources = ["WestNO_0"]
appear_after = "0s"
notice = "1s"
started_for = "1h"

[[events]]
id = "f0000000-0000-4000-8000-000000000003"
type = "Redeploy"
resources = ["WestNO_1"]
appear_after = "0s"
notice = "1h"
started_for = "1h"
"#;

const HMAC_SECRET: &str = "orchestrator-shared-secret-0001";

/// The orchestrator's keys: an Ed25519 signing key (the agent holds only its public key) and
/// an HMAC secret shared with the agent.
struct Keys {
    ed25519: SigningKey,
    hmac: SigningKey,
}

impl Keys {
    fn new() -> Keys {
        Keys {
            ed25519: SigningKey::parse(&SigningKey::generate_ed25519().unwrap()).unwrap(),
            hmac: SigningKey::parse(&format!("hmac-sha256:{HMAC_SECRET}")).unwrap(),
        }
    }

    fn config(&self) -> String {
        format!(
            r#"
[identity]
vm_name = "WestNO_0"

[[approvals.keys]]
id = "orchestrator-ed"
algorithm = "ed25519"
public_key = "{}"

[[approvals.keys]]
id = "orchestrator-hmac"
algorithm = "hmac-sha256"
secret = "{HMAC_SECRET}"
"#,
            self.ed25519.public_key().unwrap()
        )
    }

    /// A valid request for `event_id` on WestNO_0, signed with Ed25519.
    fn signed(&self, event_id: &str) -> (Draft, sched_relay_core::Event) {
        let draft = Draft::new(
            "urn:orchestrator:test",
            Some("WestNO_0"),
            vec![event_id.into()],
        );
        let event = draft.event(Some(("orchestrator-ed", &self.ed25519)));
        (draft, event)
    }
}

/// The simulator with the scenario above, and an agent with `sources` configured.
fn start(keys: &Keys, sources: &str) -> (tempfile::TempDir, SimProcess, AgentProcess) {
    let dir = tempfile::tempdir().unwrap();
    let scenario = dir.path().join("awaiting-approval.toml");
    std::fs::write(&scenario, SCENARIO).unwrap();
    let sim = SimProcess::start(scenario.to_str().unwrap(), 1.0);
    let agent = AgentProcess::start(&sim.url, &format!("{}\n{sources}", keys.config()));
    agent.wait_for_id(&format!("{FREEZE}:scheduled"), Duration::from_secs(20));
    agent.wait_for_id(&format!("{STARTED}:started"), Duration::from_secs(20));
    wait_for_log(&agent, "Approval source ready");
    (dir, sim, agent)
}

/// [`start`] with a RabbitMQ approval source on a new exchange: the exchange, to publish to.
fn start_with_rabbitmq(keys: &Keys) -> (tempfile::TempDir, SimProcess, AgentProcess, String) {
    let exchange = unique("approvals");
    let (dir, sim, agent) = start(
        keys,
        &format!(
            "[approvals.amqp]\nconnection = {{ url = \"{AMQP_URL}\" }}\nexchange = \"{exchange}\"\nqueue = \"{exchange}.{{vmname}}\"\n"
        ),
    );
    (dir, sim, agent, exchange)
}

fn wait_for_log(agent: &AgentProcess, text: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !agent.log().contains(text) {
        assert!(
            Instant::now() < deadline,
            "no {text:?} in the agent log:\n{}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The outcome event of request `request_id`, once it is delivered.
fn outcome(agent: &AgentProcess, request_id: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(found) = agent.events().into_iter().find(|e| {
            e["requestid"] == request_id
                && e["type"]
                    .as_str()
                    .unwrap_or_default()
                    .contains(".approval.")
        }) {
            return found;
        }
        assert!(
            Instant::now() < deadline,
            "no outcome for {request_id}:\n{}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn posts(sim: &SimProcess) -> Vec<Value> {
    sim.requests()
        .into_iter()
        .filter(|r| r["method"] == "POST")
        .collect()
}

fn assert_accepted_and_started(sim: &SimProcess, agent: &AgentProcess, request_id: &str) {
    let found = outcome(agent, request_id);
    assert_eq!(
        found["type"],
        format!("{TYPE}.approval.accepted"),
        "{found}"
    );
    assert_eq!(found["subject"], FREEZE);
    assert_eq!(found["data"]["reason"], "imds_accepted");
    agent.wait_for_id(&format!("{FREEZE}:started"), Duration::from_secs(10));
    let posts = posts(sim);
    assert_eq!(posts.len(), 1, "exactly one POST: {posts:?}");
    assert_eq!(
        posts[0]["body"],
        serde_json::json!({"StartRequests": [{"EventId": FREEZE}]}).to_string()
    );
}

/// How long after `since` the simulator received the first POST. Informational (printed
/// with --nocapture); the benchmarks measure latency properly.
fn first_post_after(sim: &SimProcess, since: Instant, source: &str) {
    let deadline = since + Duration::from_secs(20);
    while posts(sim).is_empty() {
        assert!(
            Instant::now() < deadline,
            "no POST from the {source} approval"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    eprintln!(
        "{source}: approval published -> POST at the simulator in {:?}",
        since.elapsed()
    );
}

/// The `times`-th replay of `request_id` was answered with its stored outcome: one outcome
/// event in all (the first), one POST.
fn assert_replay_answered_with_the_stored_outcome(
    sim: &SimProcess,
    agent: &AgentProcess,
    request_id: &str,
    times: usize,
) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while agent
        .log()
        .matches("answered with its stored outcome")
        .count()
        < times
    {
        assert!(
            Instant::now() < deadline,
            "replay not answered:\n{}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(500));
    let outcomes: Vec<Value> = agent
        .events()
        .into_iter()
        .filter(|e| e["requestid"] == request_id)
        .collect();
    assert_eq!(outcomes.len(), 1, "one outcome event: {outcomes:?}");
    assert_eq!(posts(sim).len(), 1);
}

fn rejected_reason(agent: &AgentProcess, request_id: &str) -> String {
    let found = outcome(agent, request_id);
    assert_eq!(
        found["type"],
        format!("{TYPE}.approval.rejected"),
        "{found}"
    );
    found["data"]["reason"].as_str().unwrap().to_owned()
}

fn block_on<T>(future: impl std::future::Future<Output = T>) -> T {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(future)
}

fn nats_available() -> bool {
    broker_available("NATS", NATS, "nats-server -a 127.0.0.1 -p 4222 -js")
}

fn rabbitmq_available() -> bool {
    broker_available("RabbitMQ", RABBITMQ, "rabbitmq-server -detached")
}

const HTTP_SOURCE: &str = r#"
[telemetry]
listen = "127.0.0.1:{port}"

[approvals.http]
token = "let-me-approve"
"#;

/// POSTs raw bytes to the agent's /approvals: (status, body).
fn post_raw(port: u16, content_type: &str, token: &str, body: Vec<u8>) -> (u16, String) {
    sched_relay::install_crypto_provider();
    block_on(async {
        let response = reqwest::Client::builder()
            .no_proxy()
            .build()
            .unwrap()
            .post(format!("http://127.0.0.1:{port}/approvals"))
            .header("content-type", content_type)
            .bearer_auth(token)
            .body(body)
            .send()
            .await
            .unwrap();
        (response.status().as_u16(), response.text().await.unwrap())
    })
}

#[test]
fn signed_approval_over_http_starts_the_event_and_answers_with_the_outcome() {
    let keys = Keys::new();
    let port = sched_relay_transport::testing::free_port();
    let (_dir, sim, mut agent) = start(&keys, &HTTP_SOURCE.replace("{port}", &port.to_string()));
    let (draft, event) = keys.signed(FREEZE);

    // Without the bearer token the listener refuses before any check.
    let body = serde_json::to_vec(&event).unwrap();
    let (status, _) = post_raw(port, "application/cloudevents+json", "wrong", body.clone());
    assert_eq!(status, 401);
    assert!(posts(&sim).is_empty());

    let (status, answer) = post_raw(port, "application/cloudevents+json", "let-me-approve", body);
    assert_eq!(status, 200, "{answer}");
    assert!(answer.contains("\"outcome\":\"accepted\""), "{answer}");
    assert_accepted_and_started(&sim, &agent, &draft.id);
    assert!(agent.is_running());
}

#[test]
fn sign_approval_cli_posts_to_the_agent() {
    let keys = Keys::new();
    let port = sched_relay_transport::testing::free_port();
    let (dir, sim, _agent) = start(&keys, &HTTP_SOURCE.replace("{port}", &port.to_string()));
    let key_file = dir.path().join("orchestrator.key");
    std::fs::write(&key_file, format!("hmac-sha256:{HMAC_SECRET}\n")).unwrap();
    let mut command = std::process::Command::new(common::BINARY);
    command
        .args(["sign-approval", "--key"])
        .arg(&key_file)
        .args([
            "--key-id",
            "orchestrator-hmac",
            "--event-id",
            FREEZE,
            "--vm",
            "WestNO_0",
        ])
        .args(["--to", &format!("http://127.0.0.1:{port}/approvals")])
        .args(["--token", "let-me-approve"]);
    let stdout = common::stdout_of(&mut command);
    assert!(stdout.contains("\"outcome\":\"accepted\""), "{stdout}");
    assert_eq!(posts(&sim).len(), 1);
}

#[test]
fn signed_approval_over_core_nats_starts_the_event() {
    if !nats_available() {
        return;
    }
    let keys = Keys::new();
    let subject = unique("approvals.core");
    let (_dir, sim, agent) = start(
        &keys,
        &format!(
            "[approvals.nats]\nconnection = {{ url = \"{NATS_URL}\" }}\nsubject = \"{subject}.{{vmname}}\"\n"
        ),
    );
    let (draft, event) = keys.signed(FREEZE);
    let to = format!("{NATS_URL}?subject={subject}.WestNO_0");
    block_on(publish_to(&to, &event, None)).unwrap();
    first_post_after(&sim, Instant::now(), "NATS");
    assert_accepted_and_started(&sim, &agent, &draft.id);
}

#[test]
fn signed_approval_through_a_jetstream_durable_consumer_starts_the_event() {
    if !nats_available() {
        return;
    }
    let keys = Keys::new();
    let prefix = unique("approvals_js");
    let stream = unique("APPROVALS");
    block_on(sched_relay_nats::testing::create_stream(
        NATS_URL,
        &stream,
        &format!("{prefix}.>"),
    ));
    let (_dir, sim, agent) = start(
        &keys,
        &format!(
            "[[sinks]]\nname = \"bus\"\nkind = \"nats\"\nurl = \"{NATS_URL}\"\nsubject = \"{prefix}.events.{{transition}}\"\njetstream = true\n\n\
             [approvals.nats]\nsink = \"bus\"\nsubject = \"{prefix}.{{vmname}}\"\nstream = \"{stream}\"\n"
        ),
    );
    let (draft, event) = keys.signed(FREEZE);
    block_on(publish_to(
        &format!("{NATS_URL}?subject={prefix}.WestNO_0"),
        &event,
        None,
    ))
    .unwrap();
    first_post_after(&sim, Instant::now(), "JetStream");
    assert_accepted_and_started(&sim, &agent, &draft.id);
}

#[test]
fn signed_approval_through_a_rabbitmq_queue_starts_the_event() {
    if !rabbitmq_available() {
        return;
    }
    let keys = Keys::new();
    let (_dir, sim, agent, exchange) = start_with_rabbitmq(&keys);
    approve_through_rabbitmq(&keys, &sim, &agent, &exchange);
}

/// A signed request for the Freeze, published to `exchange`: posted and started.
fn approve_through_rabbitmq(keys: &Keys, sim: &SimProcess, agent: &AgentProcess, exchange: &str) {
    let (draft, event) = keys.signed(FREEZE);
    let to = format!("{AMQP_URL}?exchange={exchange}&routing_key=approvals.WestNO_0");
    block_on(publish_to(&to, &event, None)).unwrap();
    first_post_after(sim, Instant::now(), "RabbitMQ");
    assert_accepted_and_started(sim, agent, &draft.id);
}

/// Publishes to `exchange`, as any client of the broker may, a message that is not a request,
/// with 100 KiB of headers: its header frame is 100 KiB, under RabbitMQ's default frame.
fn publish_with_large_headers(exchange: &str) {
    block_on(async {
        use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
        use lapin::types::{AMQPValue, FieldTable};
        // The broker's own frame size: no frame_max proposed.
        let connection =
            lapin::Connection::connect(AMQP_URL, lapin::ConnectionProperties::default())
                .await
                .unwrap();
        let channel = connection.create_channel().await.unwrap();
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        let mut headers = FieldTable::default();
        headers.insert(
            "padding".into(),
            AMQPValue::LongString("x".repeat(100 * 1024).into()),
        );
        let confirm = channel
            .basic_publish(
                exchange.into(),
                "approvals.WestNO_0".into(),
                BasicPublishOptions::default(),
                b"{}",
                lapin::BasicProperties::default().with_headers(headers),
            )
            .await
            .unwrap()
            .await
            .unwrap();
        assert!(
            confirm.is_ack(),
            "the broker took the large message: {confirm:?}"
        );
    });
}

/// A message's headers go in one frame, which on a broker left at its defaults may be as
/// large as 128 KiB. A message with 100 KiB of headers on the approvals queue (not a request:
/// rejected) neither cuts the source off nor holds up the signed request behind it.
#[test]
fn a_message_with_headers_near_the_brokers_frame_size_does_not_stop_rabbitmq_approvals() {
    if !rabbitmq_available() {
        return;
    }
    let keys = Keys::new();
    let (_dir, sim, agent, exchange) = start_with_rabbitmq(&keys);
    publish_with_large_headers(&exchange);
    approve_through_rabbitmq(&keys, &sim, &agent, &exchange);
    assert!(
        !agent.log().contains("did not fit the frame"),
        "the source was disconnected by the large message:\n{}",
        agent.log()
    );
}

/// On a broker whose frame is larger than the source's (here the source's URL asks for 8
/// KiB), a message whose headers outgrow the source's frame ends its connection; the source
/// then proposes a larger frame, takes the message (rejected) and the signed request behind
/// it, rather than be handed the same message at every connection for ever.
#[test]
fn a_message_that_outgrows_the_rabbitmq_sources_frame_makes_it_propose_a_larger_one() {
    if !rabbitmq_available() {
        return;
    }
    let keys = Keys::new();
    let exchange = unique("approvals");
    let (_dir, sim, agent) = start(
        &keys,
        &format!(
            "[approvals.amqp]\nconnection = {{ url = \"{AMQP_URL}?frame_max=8192\" }}\nexchange = \"{exchange}\"\nqueue = \"{exchange}.{{vmname}}\"\n"
        ),
    );
    publish_with_large_headers(&exchange);
    approve_through_rabbitmq(&keys, &sim, &agent, &exchange);
    wait_for_log(&agent, "did not fit the frame");
}

#[cfg(feature = "kafka")]
mod kafka {
    use super::*;

    const KAFKA: &str = "127.0.0.1:9092";

    fn kafka_available() -> bool {
        broker_available("Kafka", KAFKA, sched_relay_kafka::testing::HOW)
    }

    #[test]
    fn signed_approval_on_the_vms_kafka_partition_starts_the_event() {
        if !kafka_available() {
            return;
        }
        let keys = Keys::new();
        let topic = unique("approvals");
        block_on(sched_relay_kafka::testing::create_topic(KAFKA, &topic, 8));
        let (_dir, sim, agent) = start(
            &keys,
            &format!(
                "[approvals.kafka]\nconnection = {{ brokers = \"{KAFKA}\" }}\ntopic = \"{topic}\"\n"
            ),
        );
        // Another VM's request lands in some partition; it is never an outcome here.
        let (_, other) = {
            let draft = Draft::new(
                "urn:orchestrator:test",
                Some("WestNO_7"),
                vec![OTHERS.into()],
            );
            let event = draft.event(Some(("orchestrator-ed", &keys.ed25519)));
            (draft, event)
        };
        block_on(publish_to(
            &format!("kafka://{KAFKA}/{topic}"),
            &other,
            None,
        ))
        .unwrap();
        let (draft, event) = keys.signed(FREEZE);
        block_on(publish_to(
            &format!("kafka://{KAFKA}/{topic}"),
            &event,
            None,
        ))
        .unwrap();
        first_post_after(&sim, Instant::now(), "Kafka");
        assert_accepted_and_started(&sim, &agent, &draft.id);
        assert!(
            !agent
                .events()
                .iter()
                .any(|e| e["data"]["eventId"] == OTHERS),
            "another VM's request produced an outcome"
        );
    }

    /// The agent reads only the partition its name hashes to; that must be where Kafka's
    /// default partitioner (Java clients, librdkafka murmur2_random) puts its records.
    #[test]
    fn the_partition_of_a_vm_name_is_where_the_murmur2_partitioner_puts_it() {
        if !kafka_available() {
            return;
        }
        let topic = unique("partitions");
        block_on(sched_relay_kafka::testing::create_topic(KAFKA, &topic, 12));
        let names: Vec<String> = (0..40).map(|i| format!("vm-{i:03}-WestEU")).collect();
        for name in &names {
            let draft = Draft::new("urn:test", Some(name), vec!["e".into()]);
            block_on(publish_to(
                &format!("kafka://{KAFKA}/{topic}"),
                &draft.event(None),
                None,
            ))
            .unwrap();
        }
        let records = sched_relay_kafka::testing::read_all(KAFKA, &topic, 12, names.len());
        for record in records {
            assert_eq!(
                record.partition,
                sched_relay_kafka::source::partition_for(&record.key, 12),
                "{}",
                record.key
            );
        }
    }
}

/// Every kind of bad request, through core NATS: none reaches the simulator, each gets its
/// rejection with the right reason, and a good request afterwards still works.
#[test]
fn forged_stale_replayed_misdirected_and_malformed_requests_are_rejected_over_nats() {
    if !nats_available() {
        return;
    }
    let keys = Keys::new();
    let subject = unique("approvals.bad");
    let (_dir, sim, mut agent) = start(
        &keys,
        &format!(
            "[approvals.nats]\nconnection = {{ url = \"{NATS_URL}\" }}\nsubject = \"{subject}.{{vmname}}\"\n"
        ),
    );
    let to = format!("{NATS_URL}?subject={subject}.WestNO_0");
    let send = |event: &sched_relay_core::Event| block_on(publish_to(&to, event, None)).unwrap();
    let send_raw = |id: &str, content_type: &str, body: Vec<u8>| {
        block_on(async {
            let client = async_nats::connect(NATS_URL).await.unwrap();
            let mut headers = async_nats::HeaderMap::new();
            headers.insert("content-type", content_type);
            headers.insert("x-test-id", id);
            client
                .publish_with_headers(format!("{subject}.WestNO_0"), headers, body.into())
                .await
                .unwrap();
            client.flush().await.unwrap();
        })
    };
    let mut expected: Vec<(String, &str)> = Vec::new();

    let unsigned = Draft::new("urn:o", Some("WestNO_0"), vec![FREEZE.into()]);
    send(&unsigned.event(None));
    expected.push((unsigned.id.clone(), "unsigned"));

    let (wrong_key, _) = keys.signed(FREEZE);
    let stranger = SigningKey::parse(&SigningKey::generate_ed25519().unwrap()).unwrap();
    send(&wrong_key.event(Some(("orchestrator-ed", &stranger))));
    expected.push((wrong_key.id.clone(), "bad_signature"));

    let unknown_key = Draft::new("urn:o", Some("WestNO_0"), vec![FREEZE.into()]);
    send(&unknown_key.event(Some(("retired-key", &keys.ed25519))));
    expected.push((unknown_key.id.clone(), "unknown_key"));

    // Signed for the other VM's event, then the EventId swapped on the way.
    let (tampered, event) = keys.signed(OTHERS);
    let mut json = serde_json::to_value(&event).unwrap();
    json["data"]["StartRequests"][0]["EventId"] = FREEZE.into();
    send_raw(
        &tampered.id,
        "application/cloudevents+json",
        serde_json::to_vec(&json).unwrap(),
    );
    expected.push((tampered.id.clone(), "bad_signature"));

    let mut stale = Draft::new("urn:o", Some("WestNO_0"), vec![FREEZE.into()]);
    stale.time -= chrono::Duration::minutes(6);
    send(&stale.event(Some(("orchestrator-hmac", &keys.hmac))));
    expected.push((stale.id.clone(), "expired"));

    let other_vm = Draft::new("urn:o", Some("WestNO_1"), vec![OTHERS.into()]);
    send(&other_vm.event(Some(("orchestrator-ed", &keys.ed25519))));
    expected.push((other_vm.id.clone(), "wrong_target"));

    let (unknown_event, event) = keys.signed("00000000-dead-4000-8000-000000000000");
    send(&event);
    expected.push((unknown_event.id.clone(), "unknown_event"));

    let (started, event) = keys.signed(STARTED);
    send(&event);
    expected.push((started.id.clone(), "event_started"));

    let (fleet, _) = keys.signed(FREEZE);
    let mut fleet = fleet;
    fleet.vm_name = Some("*".into());
    send(&fleet.event(Some(("orchestrator-ed", &keys.ed25519))));
    expected.push((fleet.id.clone(), "wrong_target"));

    for (request_id, reason) in &expected {
        assert_eq!(
            rejected_reason(&agent, request_id),
            *reason,
            "request {request_id}"
        );
    }

    // Messages without a readable id: their outcomes are found by reason.
    send_raw(
        "malformed",
        "application/json",
        b"{\"StartRequests\": [".to_vec(),
    );
    send_raw("content-type", "text/plain", b"approve please".to_vec());
    let mut huge = serde_json::to_value(keys.signed(FREEZE).1).unwrap();
    huge["data"]["padding"] = "x".repeat(70 * 1024).into();
    send_raw(
        "oversized",
        "application/cloudevents+json",
        serde_json::to_vec(&huge).unwrap(),
    );
    for reason in ["malformed", "unsupported_content_type", "too_large"] {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !agent.events().iter().any(|e| {
            e["type"] == format!("{TYPE}.approval.rejected") && e["data"]["reason"] == reason
        }) {
            assert!(
                Instant::now() < deadline,
                "no {reason} rejection:\n{}",
                agent.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    assert!(
        posts(&sim).is_empty(),
        "a bad request reached the simulator: {:?}",
        posts(&sim)
    );
    assert!(agent.is_running());

    // The agent still approves a good request, once: the replay is answered with the
    // stored outcome, and nothing is sent.
    let (good, event) = keys.signed(FREEZE);
    send(&event);
    assert_accepted_and_started(&sim, &agent, &good.id);
    send(&event);
    assert_replay_answered_with_the_stored_outcome(&sim, &agent, &good.id, 1);
    assert!(agent.is_running());
    agent.stop_cleanly();
}

/// A replay after the agent restarted is not forwarded either: the handled ids and their
/// outcomes are in the state store.
#[test]
fn a_request_replayed_after_a_restart_is_answered_from_the_store_over_rabbitmq() {
    if !rabbitmq_available() {
        return;
    }
    let keys = Keys::new();
    let (_dir, sim, mut agent, exchange) = start_with_rabbitmq(&keys);
    let to = format!("{AMQP_URL}?exchange={exchange}&routing_key=approvals.WestNO_0");
    let (draft, event) = keys.signed(FREEZE);
    block_on(publish_to(&to, &event, None)).unwrap();
    assert_accepted_and_started(&sim, &agent, &draft.id);

    agent.stop_cleanly();
    agent.spawn(&[]);
    wait_for_log(&agent, "Approval source ready");
    block_on(publish_to(&to, &event, None)).unwrap();
    assert_replay_answered_with_the_stored_outcome(&sim, &agent, &draft.id, 1);
    // A malformed message through RabbitMQ is rejected and acknowledged, not redelivered.
    assert!(agent.is_running());
}

/// In a dry run every check runs and the outcome says so, but nothing is POSTed.
#[test]
fn dry_run_publishes_the_outcome_without_posting() {
    let keys = Keys::new();
    let port = sched_relay_transport::testing::free_port();
    let (_dir, sim, agent) = start(
        &keys,
        &format!(
            "{}\n",
            HTTP_SOURCE.replace("{port}", &port.to_string()).replace(
                "[approvals.http]",
                "[approvals]\ndry_run = true\n\n[approvals.http]"
            )
        ),
    );
    let (draft, event) = keys.signed(FREEZE);
    let (status, answer) = post_raw(
        port,
        "application/cloudevents+json",
        "let-me-approve",
        serde_json::to_vec(&event).unwrap(),
    );
    assert_eq!(status, 200, "{answer}");
    let found = outcome(&agent, &draft.id);
    assert_eq!(found["type"], format!("{TYPE}.approval.accepted"));
    assert_eq!(found["dryrun"], true);
    assert_eq!(found["data"]["reason"], "dry_run");
    std::thread::sleep(Duration::from_millis(500));
    assert!(posts(&sim).is_empty());
}

/// With `allow_unsigned`, the bare Azure body is accepted, but only for events that list
/// this VM (it names no VM, so Resources decides).
#[test]
fn bare_azure_bodies_are_accepted_only_when_allowed_and_only_for_this_vms_events() {
    let keys = Keys::new();
    let port = sched_relay_transport::testing::free_port();
    let (_dir, sim, agent) = start(
        &keys,
        &HTTP_SOURCE.replace("{port}", &port.to_string()).replace(
            "[approvals.http]",
            "[approvals]\nallow_unsigned = true\n\n[approvals.http]",
        ),
    );
    let bare = |event_id: &str| {
        serde_json::to_vec(&serde_json::json!({"StartRequests": [{"EventId": event_id}]})).unwrap()
    };
    let (status, answer) = post_raw(port, "application/json", "let-me-approve", bare(OTHERS));
    assert_eq!(status, 409, "{answer}");
    assert!(answer.contains("not_affected"), "{answer}");
    assert!(posts(&sim).is_empty());

    let (status, answer) = post_raw(port, "application/json", "let-me-approve", bare(FREEZE));
    assert_eq!(status, 200, "{answer}");
    agent.wait_for_id(&format!("{FREEZE}:started"), Duration::from_secs(10));
    assert_eq!(posts(&sim).len(), 1);
}

/// A fleet subject carries every VM's requests: those for other VMs are skipped without an
/// outcome, `vmname = "*"` is accepted with `allow_fleet`.
#[test]
fn a_fleet_subject_skips_other_vms_requests_and_takes_fleet_wide_ones() {
    if !nats_available() {
        return;
    }
    let keys = Keys::new();
    let subject = unique("approvals.fleet");
    let (_dir, sim, agent) = start(
        &keys,
        &format!(
            "[approvals]\nallow_fleet = true\n\n[approvals.nats]\nconnection = {{ url = \"{NATS_URL}\" }}\n\
             subject = \"{subject}.{{vmname}}\"\nfleet_subject = \"{subject}.all\"\n"
        ),
    );
    let to = format!("{NATS_URL}?subject={subject}.all");
    let for_other = Draft::new("urn:o", Some("WestNO_1"), vec![OTHERS.into()]);
    block_on(publish_to(
        &to,
        &for_other.event(Some(("orchestrator-ed", &keys.ed25519))),
        None,
    ))
    .unwrap();
    let fleet = Draft::new("urn:o", Some("*"), vec![FREEZE.into()]);
    block_on(publish_to(
        &to,
        &fleet.event(Some(("orchestrator-ed", &keys.ed25519))),
        None,
    ))
    .unwrap();
    assert_accepted_and_started(&sim, &agent, &fleet.id);
    assert!(
        !agent
            .events()
            .iter()
            .any(|e| e["requestid"] == for_other.id.as_str()),
        "another VM's request on the fleet subject produced an outcome"
    );
}

/// An orchestrator that round-trips the GUID through .NET `Guid` sends it lower-cased; the
/// document spells it in upper case. The approval is matched case-insensitively and the POST
/// (and the outcome's subject and data) carry the document's own spelling.
#[test]
fn a_lower_cased_event_id_is_approved_and_reaches_imds_in_the_documents_spelling() {
    const UPPER: &str = "F0000000-0000-4000-8000-0000000000AA";
    let keys = Keys::new();
    let dir = tempfile::tempdir().unwrap();
    let scenario = dir.path().join("upper-case.toml");
    std::fs::write(
        &scenario,
        format!(
            "[vm]\nname = \"WestNO_0\"\n\n[[events]]\nid = \"{UPPER}\"\ntype = \"Freeze\"\n\
             resources = [\"WestNO_0\"]\nduration_in_seconds = 5\nnotice = \"1h\"\nstarted_for = \"1h\"\n"
        ),
    )
    .unwrap();
    let sim = SimProcess::start(scenario.to_str().unwrap(), 1.0);
    let port = sched_relay_transport::testing::free_port();
    let agent = AgentProcess::start(
        &sim.url,
        &format!(
            "{}\n{}",
            keys.config(),
            HTTP_SOURCE.replace("{port}", &port.to_string())
        ),
    );
    agent.wait_for_id(&format!("{UPPER}:scheduled"), Duration::from_secs(20));
    wait_for_log(&agent, "Approval source ready");

    let lower = UPPER.to_lowercase();
    let draft = Draft::new(
        "urn:orchestrator:test",
        Some("WestNO_0"),
        vec![lower.clone()],
    );
    let event = draft.event(Some(("orchestrator-ed", &keys.ed25519)));
    let (status, answer) = post_raw(
        port,
        "application/cloudevents+json",
        "let-me-approve",
        serde_json::to_vec(&event).unwrap(),
    );
    assert_eq!(status, 200, "{answer}");
    let found = outcome(&agent, &draft.id);
    assert_eq!(
        found["type"],
        format!("{TYPE}.approval.accepted"),
        "{found}"
    );
    assert_eq!(found["subject"], UPPER, "{found}");
    assert_eq!(
        found["data"]["eventIds"],
        serde_json::json!([UPPER]),
        "{found}"
    );
    assert_eq!(
        found["requestid"],
        draft.id.as_str(),
        "the request's own id"
    );
    agent.wait_for_id(&format!("{UPPER}:started"), Duration::from_secs(10));
    let posts = posts(&sim);
    assert_eq!(posts.len(), 1, "exactly one POST: {posts:?}");
    assert_eq!(
        posts[0]["body"],
        serde_json::json!({"StartRequests": [{"EventId": UPPER}]}).to_string()
    );
}
