//! The AMQP sink against the real RabbitMQ on 127.0.0.1:5672 (AMQP_URL).

use std::time::Duration;

use cloudevents::{AttributesReader, Event, EventBuilder, EventBuilderV10};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use sched_relay_amqp::testing::Topology;
use sched_relay_amqp::{AmqpSink, AmqpSinkConfig, HeaderStyle};
use sched_relay_transport::Sink;
use sched_relay_transport::binding::ContentMode;
use sched_relay_transport::testing::deliver_across_an_outage;
use sched_relay_transport::testing::{
    CuttableProxy, assert_same_events, broker_available, live_migration_events, unique,
};

const HOW: &str = "start it with: RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 rabbitmq-server -detached";

fn url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

fn address() -> String {
    let url = url::Url::parse(&url()).unwrap();
    format!("{}:{}", url.host_str().unwrap(), url.port().unwrap_or(5672))
}

fn config(url: &str, exchange: &str) -> AmqpSinkConfig {
    let mut config: AmqpSinkConfig = toml::from_str(&format!("url = \"{url}\"")).unwrap();
    config.exchange = exchange.to_owned();
    config.timeout = Duration::from_secs(2);
    config
}

fn header_text(properties: &BasicProperties, name: &str) -> Option<String> {
    let headers = properties.headers().as_ref()?;
    match headers.inner().get(name)? {
        AMQPValue::LongString(value) => Some(value.to_string()),
        AMQPValue::ShortString(value) => Some(value.to_string()),
        other => Some(format!("{other:?}")),
    }
}

/// A binary-mode decoder written from the RabbitMQ binding's text: every `<prefix><name>`
/// header is a context attribute (the required ones by name, the rest extensions), the
/// `content_type` property is `datacontenttype`, and the body is `data`.
fn decode_binary(message: &lapin::message::BasicGetMessage, prefix: &str) -> Event {
    let properties = &message.delivery.properties;
    let attribute = |name: &str| {
        header_text(properties, &format!("{prefix}{name}"))
            .unwrap_or_else(|| panic!("{prefix}{name} missing"))
    };
    assert_eq!(attribute("specversion"), "1.0");
    let mut builder = EventBuilderV10::new()
        .id(attribute("id"))
        .source(attribute("source"))
        .ty(attribute("type"))
        .subject(attribute("subject"))
        .time(attribute("time"));
    let headers = properties.headers().as_ref().unwrap();
    for name in headers.inner().keys() {
        let name = name.as_str();
        let Some(extension) = name.strip_prefix(prefix) else {
            continue;
        };
        if !["specversion", "id", "source", "type", "subject", "time"].contains(&extension) {
            builder = builder.extension(extension, header_text(properties, name).unwrap());
        }
    }
    let content_type = properties.content_type().as_ref().unwrap().to_string();
    let data: serde_json::Value = serde_json::from_slice(&message.delivery.data).unwrap();
    builder.data(content_type, data).build().unwrap()
}

#[tokio::test]
async fn binary_mode_publishes_persistent_confirmed_messages_with_ce_headers() {
    if !broker_available("RabbitMQ", &address(), HOW) {
        return;
    }
    let topology = Topology::new(&url()).await;
    let sink = AmqpSink::new(config(&url(), &topology.exchange));
    sink.health_check().await.unwrap();
    let events = live_migration_events("WestNO_0");
    sink.deliver(&events).await.unwrap();

    let messages = topology.drain(events.len()).await;
    let routing_keys: Vec<String> = messages
        .iter()
        .map(|m| m.delivery.routing_key.to_string())
        .collect();
    assert_eq!(
        routing_keys[..2],
        ["WestNO_0.document", "WestNO_0.scheduled"]
    );
    let properties = &messages[1].delivery.properties;
    assert_eq!(
        properties.message_id().as_ref().unwrap().as_str(),
        "C7061BAC-AFDC-4513-B24B-AA5F13A16123:scheduled"
    );
    assert_eq!(*properties.delivery_mode(), Some(2), "persistent");
    assert_eq!(
        properties.content_type().as_ref().unwrap().as_str(),
        "application/json"
    );
    let received: Vec<Event> = messages.iter().map(|m| decode_binary(m, "ce-")).collect();
    assert_same_events(&received, &events);
    topology.remove().await;
}

#[tokio::test]
async fn structured_mode_and_amqp_1_0_header_names_decode_too() {
    if !broker_available("RabbitMQ", &address(), HOW) {
        return;
    }
    let topology = Topology::new(&url()).await;
    let events = live_migration_events("WestNO_0");

    let mut structured = config(&url(), &topology.exchange);
    structured.content_mode = ContentMode::Structured;
    AmqpSink::new(structured).deliver(&events).await.unwrap();
    let messages = topology.drain(events.len()).await;
    assert!(
        messages[0]
            .delivery
            .properties
            .content_type()
            .as_ref()
            .unwrap()
            .as_str()
            .starts_with("application/cloudevents+json")
    );
    let received: Vec<Event> = messages
        .iter()
        .map(|m| serde_json::from_slice(&m.delivery.data).unwrap())
        .collect();
    assert_eq!(received, events);

    let mut amqp1 = config(&url(), &topology.exchange);
    amqp1.header_style = HeaderStyle::Amqp1;
    AmqpSink::new(amqp1).deliver(&events).await.unwrap();
    let messages = topology.drain(events.len()).await;
    let received: Vec<Event> = messages
        .iter()
        .map(|m| decode_binary(m, "cloudEvents_"))
        .collect();
    assert_same_events(&received, &events);
    topology.remove().await;
}

#[tokio::test]
async fn an_unroutable_message_is_an_error_not_a_silent_drop() {
    if !broker_available("RabbitMQ", &address(), HOW) {
        return;
    }
    let topology = Topology::new(&url()).await;
    let mut config = config(&url(), &topology.exchange);
    config.routing_key = "{vmname}.{transition}".into();
    // Rebind the queue to something no event uses.
    topology
        .channel
        .queue_unbind(
            topology.queue.as_str().into(),
            topology.exchange.as_str().into(),
            "#".into(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let error = AmqpSink::new(config)
        .deliver(&live_migration_events("WestNO_0")[..1])
        .await
        .unwrap_err();
    assert!(!error.is_retriable(), "{error}");
    assert!(error.to_string().contains("unroutable"), "{error}");
    topology.remove().await;
}

/// Publisher confirms answer per message: an unroutable event in the middle of a batch is
/// named, and the events before it count as confirmed (the fan-out then goes on after it).
#[tokio::test]
async fn an_unroutable_event_mid_batch_is_named_and_the_events_before_it_are_confirmed() {
    if !broker_available("RabbitMQ", &address(), HOW) {
        return;
    }
    let topology = Topology::new(&url()).await;
    let mut config = config(&url(), &topology.exchange);
    config.routing_key = "{vmname}.{transition}".into();
    let (queue, exchange) = (topology.queue.as_str(), topology.exchange.as_str());
    let channel = &topology.channel;
    channel
        .queue_unbind(
            queue.into(),
            exchange.into(),
            "#".into(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    for key in ["*.scheduled", "*.started"] {
        let options = lapin::options::QueueBindOptions::default();
        channel
            .queue_bind(
                queue.into(),
                exchange.into(),
                key.into(),
                options,
                FieldTable::default(),
            )
            .await
            .unwrap();
    }
    // scheduled, document, started: the document has no queue.
    let events = live_migration_events("WestNO_0");
    let batch = [events[1].clone(), events[2].clone(), events[3].clone()];
    let error = AmqpSink::new(config).deliver(&batch).await.unwrap_err();
    assert!(!error.is_retriable(), "{error}");
    assert_eq!((error.confirmed, error.names_event), (1, true), "{error}");
    assert!(error.to_string().contains("unroutable"), "{error}");
    topology.remove().await;
}

#[tokio::test]
async fn a_missing_exchange_holds_the_events_is_reported_by_the_health_check_and_declare_creates_it()
 {
    if !broker_available("RabbitMQ", &address(), HOW) {
        return;
    }
    let exchange = unique("sr-test-missing-");
    let missing = AmqpSink::new(config(&url(), &exchange));
    let error = missing.health_check().await.unwrap_err();
    assert!(error.to_string().contains("set declare = true"), "{error}");
    // The exchange is the broker's state, the same for every event (being recreated, say):
    // the events wait in the outbox instead of all going to the dead-letter file.
    let error = missing
        .deliver(&live_migration_events("WestNO_0")[..1])
        .await
        .unwrap_err();
    assert!(error.is_retriable(), "{error}");
    assert!(error.to_string().contains("set declare = true"), "{error}");

    let queue = unique("sr-test-declared-");
    let mut declared = config(&url(), &exchange);
    declared.declare = true;
    declared.queue = Some(queue.clone());
    let sink = AmqpSink::new(declared);
    sink.health_check().await.unwrap();
    let events = live_migration_events("WestNO_0");
    sink.deliver(&events).await.unwrap();
    let topology = Topology {
        channel: Connection::connect(&url(), ConnectionProperties::default())
            .await
            .unwrap()
            .create_channel()
            .await
            .unwrap(),
        exchange,
        queue,
    };
    assert_eq!(topology.drain(events.len()).await.len(), events.len());
    topology.remove().await;
}

fn rabbitmqctl(args: &[&str]) {
    let status = std::process::Command::new("rabbitmqctl")
        .args(args)
        .stdout(std::process::Stdio::null())
        .status()
        .expect("rabbitmqctl runs");
    assert!(status.success(), "rabbitmqctl {args:?}");
}

/// A credential rotation: the broker's password changes after the agent's, and the agent
/// must deliver again as soon as they agree, not dead-letter everything meanwhile.
#[tokio::test]
async fn a_refused_password_is_retried_and_delivery_resumes_once_the_broker_accepts_it() {
    if !broker_available("RabbitMQ", &address(), HOW) {
        return;
    }
    if std::process::Command::new("rabbitmqctl")
        .arg("version")
        .output()
        .is_err()
    {
        assert!(
            std::env::var_os("CI").is_none(),
            "rabbitmqctl is needed under CI"
        );
        eprintln!("skipped: no rabbitmqctl to create a user with");
        return;
    }
    let user = unique("sr-rotated-");
    rabbitmqctl(&["add_user", &user, "old-password"]);
    rabbitmqctl(&["set_permissions", "-p", "/", &user, ".*", ".*", ".*"]);
    let topology = Topology::new(&url()).await;
    let broker = url::Url::parse(&url()).unwrap();
    let mut config = config(
        &format!(
            "amqp://{user}@{}:{}/%2f",
            broker.host_str().unwrap(),
            broker.port().unwrap_or(5672)
        ),
        &topology.exchange,
    );
    config.password = Some(sched_relay_transport::secret::Secret::new("new-password"));
    let sink = AmqpSink::new(config);
    let events = live_migration_events("WestNO_0");

    let error = sink.deliver(&events).await.unwrap_err();
    assert!(error.is_retriable(), "a refused login is retried: {error}");
    assert!(error.error.is_authentication(), "{error}");
    assert!(
        error.to_string().contains("check the user and password"),
        "{error}"
    );
    assert!(
        !error.to_string().contains("new-password"),
        "the password never appears: {error}"
    );
    let checked = sink.health_check().await.unwrap_err();
    assert!(
        checked.is_retriable() && checked.is_authentication(),
        "{checked}"
    );

    rabbitmqctl(&["change_password", &user, "new-password"]);
    sched_relay_transport::testing::deliver_until_accepted(&sink, &events, 20).await;
    assert_eq!(topology.drain(events.len()).await.len(), events.len());
    topology.remove().await;
    rabbitmqctl(&["delete_user", &user]);
}

#[tokio::test]
async fn delivery_resumes_after_the_network_to_the_broker_comes_back() {
    if !broker_available("RabbitMQ", &address(), HOW) {
        return;
    }
    let topology = Topology::new(&url()).await;
    let proxy = CuttableProxy::start(&address()).await;
    let proxied = url().replace(&address(), &proxy.address());
    let sink = AmqpSink::new(config(&proxied, &topology.exchange));
    let events = live_migration_events("WestNO_0");
    deliver_across_an_outage(&sink, &proxy, &events, 50).await;
    // At least once: every event arrives, in order of first arrival; a repeat can only be
    // an identical id of the batch that was in flight during the cut.
    let messages = topology.drain(events.len()).await;
    let mut seen: Vec<String> = Vec::new();
    for message in &messages {
        let id = message
            .delivery
            .properties
            .message_id()
            .as_ref()
            .unwrap()
            .to_string();
        if !seen.contains(&id) {
            seen.push(id);
        }
    }
    let expected: Vec<String> = events.iter().map(|e| e.id().to_owned()).collect();
    assert_eq!(seen, expected);
    topology.remove().await;
}
