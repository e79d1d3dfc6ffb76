//! The agent with all four broker sinks at once (NATS JetStream, RabbitMQ, Kafka, webhook)
//! against the real brokers and the simulator: every transition of every shipped scenario
//! reaches every broker, in order; a broker that is down delays no other sink and catches up
//! when it returns.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::HeaderMap;
use common::{AgentProcess, SimProcess, ids, play};
use sched_relay_amqp::testing::{Topology, message_ids};
use sched_relay_nats::testing::{PrivateNats, create_stream, stored_ids};
use sched_relay_transport::testing::{broker_available, unique};

const NATS: &str = "127.0.0.1:4222";
const RABBITMQ: &str = "127.0.0.1:5672";
const KAFKA: &str = "127.0.0.1:9092";
const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

fn brokers_available() -> bool {
    broker_available("NATS", NATS, "nats-server -a 127.0.0.1 -p 4222 -js")
        && broker_available("RabbitMQ", RABBITMQ, "rabbitmq-server -detached")
        && broker_available("Kafka", KAFKA, sched_relay_kafka::testing::HOW)
}

/// An HTTP endpoint that keeps the `ce-id` of every request, in arrival order.
struct WebhookCollector {
    url: String,
    ids: Arc<Mutex<Vec<String>>>,
}

impl WebhookCollector {
    async fn start() -> WebhookCollector {
        let ids: Arc<Mutex<Vec<String>>> = Arc::default();
        let received = ids.clone();
        let app = axum::Router::new().fallback(move |headers: HeaderMap| {
            let received = received.clone();
            async move {
                let id = headers
                    .get("ce-id")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("?")
                    .to_owned();
                received.lock().unwrap().push(id);
                axum::http::StatusCode::NO_CONTENT
            }
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/events", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        WebhookCollector { url, ids }
    }

    fn ids(&self) -> Vec<String> {
        self.ids.lock().unwrap().clone()
    }
}

/// One consumer per broker, each on names no other test uses.
struct Consumers {
    prefix: String,
    stream: async_nats::jetstream::stream::Stream,
    amqp: Topology,
    topic: String,
    webhook: WebhookCollector,
}

impl Consumers {
    async fn new(nats_url: &str) -> Consumers {
        let prefix = unique("e2e");
        let stream = create_stream(nats_url, &prefix.to_uppercase(), &format!("{prefix}.>")).await;
        let amqp = Topology::new(AMQP_URL).await;
        let topic = unique("sr-e2e-");
        sched_relay_kafka::testing::create_topic(KAFKA, &topic, 1).await;
        let webhook = WebhookCollector::start().await;
        Consumers {
            prefix,
            stream,
            amqp,
            topic,
            webhook,
        }
    }

    /// Heartbeats off: each broker's messages are compared with the file sink's, waiting for
    /// their count, and the file sink's list leaves heartbeats out (`tests/heartbeats.rs`
    /// checks them on the wire).
    fn sinks_toml(&self, nats_url: &str) -> String {
        format!(
            r#"
[events]
heartbeat_interval = "0s"

[delivery]
retry_initial = "100ms"
retry_max = "500ms"

[[sinks]]
name = "bus"
kind = "nats"
url = "{nats_url}"
jetstream = true
subject = "{prefix}.{{vmname}}.{{transition}}"
timeout = "1s"

[[sinks]]
name = "rabbit"
kind = "amqp"
url = "{AMQP_URL}"
exchange = "{exchange}"

[[sinks]]
name = "kafka"
kind = "kafka"
brokers = "{KAFKA}"
topic = "{topic}"

[[sinks]]
name = "orchestrator"
kind = "webhook"
url = "{webhook}"
"#,
            prefix = self.prefix,
            exchange = self.amqp.exchange,
            topic = self.topic,
            webhook = self.webhook.url,
        )
    }

    async fn nats_ids(&mut self, expected: usize) -> Vec<String> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let stored = self.stream.info().await.unwrap().state.messages;
            if stored as usize >= expected || Instant::now() > deadline {
                return stored_ids(&self.stream, stored).await;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn amqp_ids(&self, expected: usize) -> Vec<String> {
        message_ids(&self.amqp.drain(expected).await)
    }

    async fn kafka_ids(&self, expected: usize) -> Vec<String> {
        let topic = self.topic.clone();
        let records = tokio::task::spawn_blocking(move || {
            sched_relay_kafka::testing::read_all(KAFKA, &topic, 1, expected)
        })
        .await
        .unwrap();
        records
            .iter()
            .map(|r| {
                r.headers
                    .iter()
                    .find(|(k, _)| k == "ce_id")
                    .map(|(_, v)| v.clone())
                    .unwrap_or_default()
            })
            .collect()
    }
}

async fn every_transition_reaches_all_four(scenario: &'static str, scale: f64) {
    if !brokers_available() {
        return;
    }
    let nats_url = format!("nats://{NATS}");
    let mut consumers = Consumers::new(&nats_url).await;
    let sinks = consumers.sinks_toml(&nats_url);
    let (_sim, agent, events) = tokio::task::spawn_blocking(move || play(scenario, scale, &sinks))
        .await
        .unwrap();
    let expected = ids(&events);
    assert!(
        expected.len() >= 5,
        "{scenario}: the agent saw too little of the scenario (did it start late?): {expected:?}\n{}",
        agent.log()
    );
    let log = agent.log();
    assert_eq!(
        consumers.nats_ids(expected.len()).await,
        expected,
        "NATS JetStream, {scenario}\n{log}"
    );
    assert_eq!(
        consumers.amqp_ids(expected.len()).await,
        expected,
        "RabbitMQ, {scenario}\n{log}"
    );
    assert_eq!(
        consumers.kafka_ids(expected.len()).await,
        expected,
        "Kafka, {scenario}\n{log}"
    );
    assert_eq!(
        consumers.webhook.ids(),
        expected,
        "webhook, {scenario}\n{log}"
    );
    consumers.amqp.remove().await;
}

macro_rules! scenario_tests {
    ($($name:ident: $scenario:literal at $scale:literal;)+) => {$(
        #[tokio::test(flavor = "multi_thread")]
        async fn $name() {
            every_transition_reaches_all_four($scenario, $scale).await;
        }
    )+};
}

// The simulator's clock starts before the agent: a scenario whose first event appears 2
// minutes in leaves the agent 1.2 s at 0.01 to start and see the empty document first (0.6 s
// at 0.005 was once too little, on a loaded machine, for the host failure).
scenario_tests! {
    live_migration_reaches_all_four_brokers: "live-migration" at 0.01;
    user_reboot_reaches_all_four_brokers: "user-reboot" at 0.01;
    redeploy_reaches_all_four_brokers: "redeploy" at 0.01;
    spot_preempt_reaches_all_four_brokers: "spot-preempt" at 0.05;
    scaleset_terminate_reaches_all_four_brokers: "scaleset-terminate" at 0.01;
    host_failure_reaches_all_four_brokers: "host-failure" at 0.01;
    cancelled_maintenance_reaches_all_four_brokers: "cancelled-maintenance" at 0.01;
    multi_vm_reaches_all_four_brokers: "multi-vm" at 0.01;
    imds_faults_scenario_reaches_all_four_brokers: "imds-faults" at 0.005;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_broker_that_is_down_delays_no_other_sink_and_catches_up_when_it_returns() {
    if !brokers_available() {
        return;
    }
    // NATS for this test is a private server that is not running yet.
    let port = sched_relay_transport::testing::free_port();
    let down_url = format!("nats://127.0.0.1:{port}");
    let shared_nats = format!("nats://{NATS}");
    let consumers = Consumers::new(&shared_nats).await;
    let sinks = consumers.sinks_toml(&down_url);

    let sim = SimProcess::start("live-migration", 0.005);
    let mut agent = AgentProcess::start(&sim.url, &sinks);
    let final_incarnation =
        tokio::task::block_in_place(|| sim.wait_finished(Duration::from_secs(60)));
    let events = tokio::task::block_in_place(|| {
        agent.wait_for_id(
            &format!("document:{final_incarnation}"),
            Duration::from_secs(10),
        )
    });
    let expected = ids(&events);

    // The healthy sinks have everything already: the dead one held nothing back.
    assert_eq!(
        consumers.amqp_ids(expected.len()).await,
        expected,
        "RabbitMQ\n{}",
        agent.log()
    );
    assert_eq!(
        consumers.kafka_ids(expected.len()).await,
        expected,
        "Kafka\n{}",
        agent.log()
    );
    assert_eq!(
        consumers.webhook.ids(),
        expected,
        "webhook\n{}",
        agent.log()
    );
    assert!(
        agent.log().contains("sink=bus"),
        "the NATS failures are logged:\n{}",
        agent.log()
    );

    // NATS comes up; the agent delivers the backlog, in order.
    let Some(_server) = PrivateNats::start_on(port, &[]) else {
        return;
    };
    let mut stream = create_stream(
        &down_url,
        &consumers.prefix.to_uppercase(),
        &format!("{}.>", consumers.prefix),
    )
    .await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while (stream.info().await.unwrap().state.messages as usize) < expected.len() {
        assert!(
            Instant::now() < deadline,
            "NATS did not catch up:\n{}",
            agent.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(stored_ids(&stream, expected.len() as u64).await, expected);
    agent.stop_cleanly();
    consumers.amqp.remove().await;
}
