//! The Kafka sink against a real Kafka-protocol broker: tansu 0.6.0 on 127.0.0.1:9092
//! (KAFKA_BROKERS; `scripts/kafka-broker start`), and private tansu instances this test starts
//! itself (TANSU_BIN, default target/tools/tansu-0.6.0).

use std::time::Duration;

use cloudevents::{AttributesReader, Event, EventBuilder, EventBuilderV10};
use sched_relay_kafka::testing::{HOW, PrivateTansu, Record, create_topic, read_all};
use sched_relay_kafka::{KafkaSink, KafkaSinkConfig};
use sched_relay_transport::Sink;
use sched_relay_transport::binding::ContentMode;
use sched_relay_transport::testing::deliver_across_an_outage;
use sched_relay_transport::testing::{
    CuttableProxy, assert_same_events, broker_available, live_migration_events, unique,
};

fn brokers() -> String {
    std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into())
}

fn config(brokers: &str, topic: &str) -> KafkaSinkConfig {
    let mut config: KafkaSinkConfig = toml::from_str(&format!("brokers = \"{brokers}\"")).unwrap();
    config.topic = topic.to_owned();
    config.timeout = Duration::from_secs(3);
    config
}

/// A binary-mode decoder written from the Kafka protocol binding's text: `ce_<name>` headers
/// are the context attributes (UTF-8 strings), `content-type` is `datacontenttype`, the value
/// is `data`.
fn decode_binary(record: &Record) -> Event {
    let header = |name: &str| {
        record
            .headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    };
    let attribute =
        |name: &str| header(&format!("ce_{name}")).unwrap_or_else(|| panic!("ce_{name} missing"));
    assert_eq!(attribute("specversion"), "1.0");
    let mut builder = EventBuilderV10::new()
        .id(attribute("id"))
        .source(attribute("source"))
        .ty(attribute("type"))
        .subject(attribute("subject"))
        .time(attribute("time"));
    for (name, value) in &record.headers {
        if let Some(extension) = name.strip_prefix("ce_")
            && !["specversion", "id", "source", "type", "subject", "time"].contains(&extension)
        {
            builder = builder.extension(extension, value.as_str());
        }
    }
    let data: serde_json::Value = serde_json::from_slice(&record.value).unwrap();
    builder
        .data(header("content-type").unwrap(), data)
        .build()
        .unwrap()
}

#[tokio::test]
async fn binary_mode_produces_ordered_keyed_records_with_ce_headers() {
    if !broker_available("Kafka", &brokers(), HOW) {
        return;
    }
    let topic = unique("sr-test-");
    create_topic(&brokers(), &topic, 1).await;
    let sink = KafkaSink::new(config(&brokers(), &topic));
    sink.health_check().await.unwrap();
    let events = live_migration_events("WestNO_0");
    sink.deliver(&events).await.unwrap();

    let records = tokio::task::spawn_blocking({
        let topic = topic.clone();
        move || read_all(&brokers(), &topic, 1, 7)
    })
    .await
    .unwrap();
    assert_eq!(records.len(), events.len());
    assert_eq!(
        records[1].key, "C7061BAC-AFDC-4513-B24B-AA5F13A16123",
        "key = the partitionkey extension"
    );
    assert_eq!(
        records[0].key, "WestNO_0",
        "document events are keyed by VM"
    );
    let names: Vec<&str> = records[1].headers.iter().map(|(k, _)| k.as_str()).collect();
    for expected in [
        "ce_specversion",
        "ce_id",
        "ce_source",
        "ce_type",
        "ce_subject",
        "ce_time",
        "ce_incarnation",
        "content-type",
    ] {
        assert!(
            names.contains(&expected),
            "{expected} missing from {names:?}"
        );
    }
    let received: Vec<Event> = records.iter().map(decode_binary).collect();
    assert_same_events(&received, &events);
}

#[tokio::test]
async fn all_transitions_of_one_event_land_in_one_partition_in_order() {
    if !broker_available("Kafka", &brokers(), HOW) {
        return;
    }
    let topic = unique("sr-test-");
    create_topic(&brokers(), &topic, 3).await;
    let mut structured = config(&brokers(), &topic);
    structured.content_mode = ContentMode::Structured;
    let events = live_migration_events("WestNO_0");
    KafkaSink::new(structured).deliver(&events).await.unwrap();
    let records = tokio::task::spawn_blocking({
        let topic = topic.clone();
        move || read_all(&brokers(), &topic, 3, 7)
    })
    .await
    .unwrap();
    assert_eq!(records.len(), events.len());
    let transitions: Vec<&Record> = records
        .iter()
        .filter(|r| r.key.starts_with("C7061BAC"))
        .collect();
    assert!(
        transitions
            .windows(2)
            .all(|w| w[0].partition == w[1].partition)
    );
    let order: Vec<Event> = transitions
        .iter()
        .map(|r| serde_json::from_slice(&r.value).unwrap())
        .collect();
    let ids: Vec<&str> = order.iter().map(|e| e.id()).collect();
    assert_eq!(
        ids,
        [
            "C7061BAC-AFDC-4513-B24B-AA5F13A16123:scheduled",
            "C7061BAC-AFDC-4513-B24B-AA5F13A16123:started",
            "C7061BAC-AFDC-4513-B24B-AA5F13A16123:completed"
        ]
    );
    let content_type = records[0]
        .headers
        .iter()
        .find(|(k, _)| k == "content-type")
        .unwrap()
        .1
        .clone();
    assert!(
        content_type.starts_with("application/cloudevents+json"),
        "{content_type}"
    );
}

#[tokio::test]
async fn a_missing_topic_is_reported_by_the_health_check() {
    if !broker_available("Kafka", &brokers(), HOW) {
        return;
    }
    let error = KafkaSink::new(config(&brokers(), &unique("sr-missing-")))
        .health_check()
        .await
        .unwrap_err();
    assert!(error.to_string().contains("does not exist"), "{error}");
}

#[tokio::test]
async fn delivery_resumes_after_the_network_to_the_broker_comes_back() {
    let listen = sched_relay_transport::testing::free_port();
    let proxy = CuttableProxy::start(&format!("127.0.0.1:{listen}")).await;
    let Some(_broker) = PrivateTansu::start(listen, &proxy.address()) else {
        return;
    };
    let topic = "restart";
    create_topic(&proxy.address(), topic, 1).await;
    let sink = KafkaSink::new(config(&proxy.address(), topic));
    let events = live_migration_events("WestNO_0");
    deliver_across_an_outage(&sink, &proxy, &events, 30).await;
    let address = proxy.address();
    let records = tokio::task::spawn_blocking(move || read_all(&address, topic, 1, 7))
        .await
        .unwrap();
    let mut seen: Vec<String> = Vec::new();
    for record in &records {
        let id = decode_binary(record).id().to_owned();
        if !seen.contains(&id) {
            seen.push(id);
        }
    }
    let expected: Vec<String> = events.iter().map(|e| e.id().to_owned()).collect();
    assert_eq!(
        seen, expected,
        "every event, in order; repeats only as identical ids"
    );
}

/// tansu 0.6 with --authentication offers no SASL mechanism at all, so what can be shown here
/// is a broker that refuses the login: the error must say so, and is retried as an
/// authentication failure (a credential rotation must not dead-letter every event meanwhile).
#[tokio::test]
async fn a_broker_that_refuses_the_login_gives_a_clear_error_retried_as_an_authentication_failure()
{
    let listen = sched_relay_transport::testing::free_port();
    let address = format!("127.0.0.1:{listen}");
    let Some(_broker) = PrivateTansu::start_with(listen, &address, &["--authentication"]) else {
        return;
    };
    let mut config = config(&address, "secured");
    config.security_protocol = "sasl_plaintext".into();
    config.sasl_mechanism = Some("PLAIN".into());
    config.sasl_username = Some("relay".into());
    config.sasl_password = Some(sched_relay_transport::secret::Secret::new("wrong"));
    let sink = KafkaSink::new(config);
    let error = sink.health_check().await.unwrap_err();
    assert!(error.is_retriable() && error.is_authentication(), "{error}");
    assert!(
        error
            .to_string()
            .contains("SASL PLAIN mechanism handshake failed"),
        "{error}"
    );
    assert!(
        error.to_string().contains("check security_protocol"),
        "{error}"
    );
    assert!(
        !error.to_string().contains("wrong"),
        "the password never appears: {error}"
    );
    let refused = sink
        .deliver(&live_migration_events("vm")[..1])
        .await
        .unwrap_err();
    assert!(refused.is_retriable(), "{refused}");
}
