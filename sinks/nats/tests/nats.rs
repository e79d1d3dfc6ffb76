//! The NATS sink against a real nats-server: the shared one on 127.0.0.1:4222 (NATS_URL), and
//! private ones this test starts and stops itself (NATS_SERVER_BIN, default nats-server).

use std::time::Duration;

use cloudevents::{AttributesReader, Event};
use futures_util::StreamExt;
use sched_relay_nats::testing::{PrivateNats, create_stream, delete_stream, stored_ids};
use sched_relay_nats::{NatsSink, NatsSinkConfig};
use sched_relay_transport::Sink;
use sched_relay_transport::binding::ContentMode;
use sched_relay_transport::testing::{
    assert_same_events, broker_available, deliver_until_accepted, live_migration_events, unique,
};

const HOW: &str = "start it with: nats-server -a 127.0.0.1 -p 4222 -js -sd /tmp/nats";

fn shared_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

fn address(url: &str) -> String {
    url.trim_start_matches("nats://").to_owned()
}

fn config(url: &str, subject: &str, jetstream: bool, mode: ContentMode) -> NatsSinkConfig {
    let mut config: NatsSinkConfig = toml::from_str(&format!("url = \"{url}\"")).unwrap();
    config.subject = subject.to_owned();
    config.jetstream = jetstream;
    config.content_mode = mode;
    config.timeout = Duration::from_secs(1);
    config
}

/// Decodes a NATS message with the CloudEvents SDK's HTTP reader: the NATS binding uses the
/// same `ce-` header names, so nobody here wrote the decoder.
fn decode(headers: Option<&async_nats::HeaderMap>, payload: &[u8]) -> Event {
    let mut http_headers = http::HeaderMap::new();
    if let Some(headers) = headers {
        for (name, values) in headers.iter() {
            let name = http::HeaderName::try_from(name.to_string()).unwrap();
            http_headers.insert(name, values[0].as_str().parse().unwrap());
        }
    }
    cloudevents::binding::http::to_event(&http_headers, payload.to_vec()).unwrap()
}

async fn receive(
    subscriber: &mut async_nats::Subscriber,
    count: usize,
) -> Vec<async_nats::Message> {
    let mut messages = Vec::new();
    while messages.len() < count {
        let message = tokio::time::timeout(Duration::from_secs(5), subscriber.next())
            .await
            .expect("messages arrive within 5 s")
            .unwrap();
        messages.push(message);
    }
    messages
}

/// A subscription, registered with the server, to every subject under a new prefix.
async fn subscribe_to_fresh_subjects(
    url: &str,
) -> (String, async_nats::Client, async_nats::Subscriber) {
    let prefix = unique("srtest");
    let client = async_nats::connect(url).await.unwrap();
    let subscriber = client.subscribe(format!("{prefix}.>")).await.unwrap();
    client.flush().await.unwrap();
    (prefix, client, subscriber)
}

#[tokio::test]
async fn core_nats_delivers_the_live_migration_in_order_with_binding_headers() {
    let url = shared_url();
    if !broker_available("NATS", &address(&url), HOW) {
        return;
    }
    let (prefix, _client, mut subscriber) = subscribe_to_fresh_subjects(&url).await;

    let sink = NatsSink::new(config(
        &url,
        &format!("{prefix}.{{vmname}}.{{transition}}"),
        false,
        ContentMode::Binary,
    ));
    sink.health_check().await.unwrap();
    let events = live_migration_events("WestNO_0");
    sink.deliver(&events).await.unwrap();

    let messages = receive(&mut subscriber, events.len()).await;
    let subjects: Vec<String> = messages.iter().map(|m| m.subject.to_string()).collect();
    assert_eq!(subjects[1], format!("{prefix}.WestNO_0.scheduled"));
    assert_eq!(subjects[0], format!("{prefix}.WestNO_0.document"));
    let headers = messages[1].headers.as_ref().unwrap();
    for name in [
        "ce-specversion",
        "ce-id",
        "ce-source",
        "ce-type",
        "ce-subject",
        "ce-time",
        "ce-incarnation",
        "ce-vmname",
        "content-type",
    ] {
        assert!(headers.get(name).is_some(), "{name} missing");
    }
    assert_eq!(
        headers.get("ce-id").unwrap().as_str(),
        "C7061BAC-AFDC-4513-B24B-AA5F13A16123:scheduled"
    );
    let received: Vec<Event> = messages
        .iter()
        .map(|m| decode(m.headers.as_ref(), &m.payload))
        .collect();
    assert_same_events(&received, &events);
}

#[tokio::test]
async fn structured_mode_carries_the_whole_event_as_json() {
    let url = shared_url();
    if !broker_available("NATS", &address(&url), HOW) {
        return;
    }
    let (prefix, _client, mut subscriber) = subscribe_to_fresh_subjects(&url).await;
    let sink = NatsSink::new(config(
        &url,
        &format!("{prefix}.{{transition}}"),
        false,
        ContentMode::Structured,
    ));
    let events = live_migration_events("WestNO_0");
    sink.deliver(&events).await.unwrap();
    let messages = receive(&mut subscriber, events.len()).await;
    let content_type = messages[0]
        .headers
        .as_ref()
        .unwrap()
        .get("content-type")
        .unwrap()
        .as_str()
        .to_owned();
    assert!(
        content_type.starts_with("application/cloudevents+json"),
        "{content_type}"
    );
    let received: Vec<Event> = messages
        .iter()
        .map(|m| decode(m.headers.as_ref(), &m.payload))
        .collect();
    assert_eq!(received, events);
}

/// A stream of its own capturing `<prefix>.>`, and a JetStream sink publishing under it.
async fn jetstream_sink(url: &str) -> (String, async_nats::jetstream::stream::Stream, NatsSink) {
    let prefix = unique("srtest");
    let stream = create_stream(url, &prefix.to_uppercase(), &format!("{prefix}.>")).await;
    let sink = NatsSink::new(config(
        url,
        &format!("{prefix}.{{vmname}}.{{transition}}"),
        true,
        ContentMode::Binary,
    ));
    (prefix, stream, sink)
}

async fn remove_stream(
    url: &str,
    prefix: &str,
    stream: &mut async_nats::jetstream::stream::Stream,
) {
    stream.purge().await.unwrap();
    delete_stream(url, &prefix.to_uppercase()).await;
}

#[tokio::test]
async fn jetstream_acknowledges_each_event_and_a_retried_batch_is_not_stored_twice() {
    let url = shared_url();
    if !broker_available("NATS", &address(&url), HOW) {
        return;
    }
    let (prefix, mut stream, sink) = jetstream_sink(&url).await;
    sink.health_check().await.unwrap();
    let events = live_migration_events("WestNO_0");
    sink.deliver(&events).await.unwrap();
    sink.deliver(&events).await.unwrap(); // the fan-out retrying a batch
    let info = stream.info().await.unwrap();
    assert_eq!(
        info.state.messages,
        events.len() as u64,
        "Nats-Msg-Id de-duplicates the retry"
    );
    let expected: Vec<String> = events.iter().map(|e| e.id().to_owned()).collect();
    assert_eq!(stored_ids(&stream, events.len() as u64).await, expected);
    remove_stream(&url, &prefix, &mut stream).await;
}

#[tokio::test]
async fn jetstream_keeps_two_vms_reports_of_the_same_azure_event_and_incarnation() {
    let url = shared_url();
    if !broker_available("NATS", &address(&url), HOW) {
        return;
    }
    let (prefix, mut stream, sink) = jetstream_sink(&url).await;
    // The live migration lists WestNO_0 and WestNO_1: each VM's agent reports it, under the
    // same CloudEvents ids (unique per source), within the stream's duplicate window.
    let first = live_migration_events("WestNO_0");
    let second = live_migration_events("WestNO_1");
    assert_eq!(first[1].id(), second[1].id(), "the same ids, other sources");
    sink.deliver(&first).await.unwrap();
    sink.deliver(&second).await.unwrap();
    sink.deliver(&second).await.unwrap(); // a retry of the second VM's batch
    let info = stream.info().await.unwrap();
    assert_eq!(
        info.state.messages,
        (first.len() + second.len()) as u64,
        "every VM's events stored once, none dropped as another VM's copy"
    );
    remove_stream(&url, &prefix, &mut stream).await;
}

#[tokio::test]
async fn jetstream_health_check_says_when_no_stream_captures_the_subject() {
    let url = shared_url();
    if !broker_available("NATS", &address(&url), HOW) {
        return;
    }
    let sink = NatsSink::new(config(
        &url,
        &format!("{}.{{vmname}}", unique("nostream")),
        true,
        ContentMode::Binary,
    ));
    let error = sink.health_check().await.unwrap_err().to_string();
    assert!(error.contains("no JetStream stream captures"), "{error}");
    let error = sink
        .deliver(&live_migration_events("vm")[..1])
        .await
        .unwrap_err();
    assert!(
        error.is_retriable(),
        "nothing is dropped while the stream is missing: {error}"
    );
}

#[tokio::test]
async fn delivery_resumes_after_the_server_restarts_and_nothing_is_lost_or_doubled() {
    let Some(mut server) = PrivateNats::start(&[]) else {
        return;
    };
    let stream = create_stream(&server.url(), "RESTART", "restart.>").await;
    let sink = NatsSink::new(config(
        &server.url(),
        "restart.{transition}",
        true,
        ContentMode::Binary,
    ));
    let events = live_migration_events("WestNO_0");
    sink.deliver(&events[..2]).await.unwrap();

    server.stop();
    let error = sink.deliver(&events[2..]).await.unwrap_err();
    assert!(error.is_retriable(), "{error}");

    assert!(server.restart());
    // What the fan-out does: retry the same batch with backoff until it is acknowledged.
    deliver_until_accepted(&sink, &events[2..], 50).await;
    let expected: Vec<String> = events.iter().map(|e| e.id().to_owned()).collect();
    let mut stream = stream;
    assert_eq!(
        stream.info().await.unwrap().state.messages,
        events.len() as u64
    );
    assert_eq!(stored_ids(&stream, events.len() as u64).await, expected);
}

#[tokio::test]
async fn a_refused_login_is_a_clear_error_retried_as_an_authentication_failure() {
    let Some(server) = PrivateNats::start(&["--user", "relay", "--pass", "right"]) else {
        return;
    };
    let mut config = config(
        &server.url(),
        "auth.{transition}",
        false,
        ContentMode::Binary,
    );
    config.user = Some("relay".into());
    config.password = Some(sched_relay_transport::secret::Secret::new("wrong"));
    let sink = NatsSink::new(config);
    let error = sink.health_check().await.unwrap_err();
    assert!(error.is_retriable() && error.is_authentication(), "{error}");
    assert!(error.to_string().contains("check user/password"), "{error}");

    let mut good = self::config(
        &server.url(),
        "auth.{transition}",
        false,
        ContentMode::Binary,
    );
    good.user = Some("relay".into());
    good.password = Some(sched_relay_transport::secret::Secret::new("right"));
    NatsSink::new(good).health_check().await.unwrap();
}

/// A credential rotation: the server's password changes, and the sink must deliver again as
/// soon as its own password is accepted, not dead-letter everything meanwhile.
#[tokio::test]
async fn a_refused_password_is_retried_and_delivery_resumes_once_the_server_accepts_it() {
    let Some(mut server) = PrivateNats::start(&["--user", "relay", "--pass", "rotated"]) else {
        return;
    };
    let mut config = config(
        &server.url(),
        "rotation.{transition}",
        false,
        ContentMode::Binary,
    );
    config.user = Some("relay".into());
    config.password = Some(sched_relay_transport::secret::Secret::new("current"));
    let sink = NatsSink::new(config);
    let events = live_migration_events("WestNO_0");
    let error = sink.deliver(&events).await.unwrap_err();
    assert!(
        error.is_retriable() && error.error.is_authentication(),
        "{error}"
    );
    assert!(
        !error.to_string().contains("current"),
        "the password never appears: {error}"
    );

    let port = server.url().rsplit(':').next().unwrap().parse().unwrap();
    server.stop();
    let Some(server) = PrivateNats::start_on(port, &["--user", "relay", "--pass", "current"])
    else {
        panic!("the private nats-server did not start again");
    };
    let client =
        async_nats::ConnectOptions::with_user_and_password("relay".into(), "current".into())
            .connect(server.url())
            .await
            .unwrap();
    let mut subscriber = client.subscribe("rotation.>").await.unwrap();
    client.flush().await.unwrap();
    deliver_until_accepted(&sink, &events, 20).await;
    for _ in &events {
        tokio::time::timeout(Duration::from_secs(5), subscriber.next())
            .await
            .expect("every event arrives")
            .unwrap();
    }
}

/// JetStream acknowledges each message: a failure in the middle of a batch names its event
/// and the events before it count as confirmed, so a retry never sends them again.
#[tokio::test]
async fn a_jetstream_failure_mid_batch_names_its_event_and_keeps_the_confirmed_prefix() {
    let url = shared_url();
    if !broker_available("NATS", &address(&url), HOW) {
        return;
    }
    let prefix = unique("midbatch");
    let mut stream = create_stream(&url, &prefix, &format!("{prefix}.scheduled")).await;
    let sink = NatsSink::new(config(
        &url,
        &format!("{prefix}.{{transition}}"),
        true,
        ContentMode::Binary,
    ));
    // scheduled (captured by the stream), then document (no stream).
    let events = live_migration_events("vm");
    let error = sink.deliver(&events[1..3]).await.unwrap_err();
    assert!(error.is_retriable(), "{error}");
    assert_eq!((error.confirmed, error.names_event), (1, true), "{error}");
    assert_eq!(stream.info().await.unwrap().state.messages, 1);
}

/// `events` with, second, an event whose data is larger than the server's `max_payload`
/// (1 MiB by default).
fn with_an_oversized_event(
    events: &[sched_relay_transport::Event],
) -> Vec<sched_relay_transport::Event> {
    use cloudevents::{EventBuilder, EventBuilderV10};
    let huge: sched_relay_transport::Event = EventBuilderV10::new()
        .id("document:99")
        .source("urn:sched-relay:vm:vm")
        .ty("com.azure.scheduledevents.document")
        .data(
            "application/json",
            serde_json::json!({"Padding": "x".repeat(2 << 20)}),
        )
        .build()
        .unwrap()
        .into();
    vec![events[1].clone(), huge, events[2].clone()]
}

#[tokio::test]
async fn an_event_larger_than_max_payload_is_refused_alone_not_retried_forever() {
    let url = shared_url();
    if !broker_available("NATS", &address(&url), HOW) {
        return;
    }
    let events = with_an_oversized_event(&live_migration_events("vm"));
    // Core NATS.
    let sink = NatsSink::new(config(
        &url,
        &unique("oversized"),
        false,
        ContentMode::Binary,
    ));
    let error = sink.deliver(&events).await.unwrap_err();
    assert!(!error.is_retriable(), "{error}");
    assert_eq!((error.confirmed, error.names_event), (1, true), "{error}");
    // JetStream.
    let prefix = unique("oversizedjs");
    let _stream = create_stream(&url, &prefix, &format!("{prefix}.>")).await;
    let sink = NatsSink::new(config(
        &url,
        &format!("{prefix}.{{transition}}"),
        true,
        ContentMode::Binary,
    ));
    let error = sink.deliver(&events).await.unwrap_err();
    assert!(!error.is_retriable(), "{error}");
    assert_eq!((error.confirmed, error.names_event), (1, true), "{error}");
}
