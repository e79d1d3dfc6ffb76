//! The coordinator's input: the agents' events, from a JetStream durable consumer, a durable
//! RabbitMQ queue bound to the agents' exchange, or every partition of their Kafka topic. It
//! reads through the broker sources the agents' approvals use, and logs as the
//! `Coordinator input`.
//!
//! With NATS, the input stream is made sure of before the coordinator starts: created when
//! it is missing, with the configured subject, and refused (the coordinator does not start)
//! when it exists without capturing that subject. Its subjects are never changed: that could
//! only move messages out of a stream someone else reads. A server that cannot be reached
//! at start is no refusal: the input makes sure of its stream each time it connects, and
//! retries. The stream the approvals go to is the agents' (each creates it when it starts,
//! `[approvals.nats] stream`): the coordinator only warns when none captures its approvals
//! subject yet, since they wait for it (published again every 2 s). Tested below against
//! the real NATS, and with the shipped examples in `tests/shipped_layout.rs`.

use tokio::sync::watch;

use super::config::Input;
use crate::sinks::SinkKind;

/// How long an input stream the coordinator creates keeps its messages: a week of replay
/// after a long outage, while the agents' heartbeats (288 a day per VM at the default
/// interval) cannot fill the server.
#[cfg(feature = "nats")]
const INPUT_STREAM_MAX_AGE: std::time::Duration = std::time::Duration::from_secs(7 * 24 * 3600);

/// Starts the input; errors are those that must stop the coordinator's start.
// Without any broker feature, only the refusal uses nothing.
#[cfg_attr(
    not(any(feature = "nats", feature = "amqp", feature = "kafka")),
    allow(unused_variables)
)]
pub(super) async fn start(
    input: &Input,
    approvals: &SinkKind,
    deliveries: sched_relay_transport::inbound::Deliveries,
    progress: sched_relay_transport::inbound::Progress,
    stop: watch::Receiver<bool>,
) -> Result<tokio::task::JoinHandle<()>, String> {
    #[cfg(feature = "nats")]
    if let SinkKind::Nats(approvals) = approvals {
        warn_without_approvals_stream(approvals).await;
    }
    let role = sched_relay_transport::inbound::SourceRole::CoordinatorInput;
    match input {
        #[cfg(feature = "nats")]
        Input::Nats {
            url,
            subject,
            stream,
            durable,
            credentials_file,
            ..
        } => {
            let connection = serde_json::from_value(serde_json::json!({
                "url": url, "credentials_file": credentials_file,
            }))
            .map_err(|e| format!("input: {e}"))?;
            prepare_stream(&connection, stream, subject).await?;
            let spec = sched_relay_nats::source::NatsSourceSpec {
                connection,
                subject: subject.clone(),
                fleet_subject: None,
                jetstream: Some(sched_relay_nats::source::JetStreamSpec {
                    stream: stream.clone(),
                    durable: durable.clone(),
                    create_with: vec![subject.clone()],
                    max_age: INPUT_STREAM_MAX_AGE,
                }),
                from_start: true,
                ack_wait: std::time::Duration::from_secs(10),
                role,
            };
            Ok(tokio::spawn(sched_relay_nats::source::run(
                spec, deliveries, progress, stop,
            )))
        }
        #[cfg(feature = "amqp")]
        Input::Amqp {
            url,
            exchange,
            queue,
            binding_key,
            ..
        } => {
            let connection = serde_json::from_value(serde_json::json!({"url": url}))
                .map_err(|e| format!("input: {e}"))?;
            let spec = sched_relay_amqp::source::AmqpSourceSpec {
                connection,
                queue: queue.clone(),
                declare: true,
                exchange: exchange.clone(),
                routing_key: binding_key.clone(),
                fleet_routing_key: None,
                prefetch: 256,
                exclusive: false,
                role,
            };
            Ok(tokio::spawn(sched_relay_amqp::source::run(
                spec, deliveries, progress, stop,
            )))
        }
        #[cfg(feature = "kafka")]
        Input::Kafka {
            brokers,
            topic,
            group_id,
            since,
        } => {
            let connection = serde_json::from_value(serde_json::json!({"brokers": brokers}))
                .map_err(|e| format!("input: {e}"))?;
            let spec = sched_relay_kafka::source::KafkaSourceSpec {
                connection,
                topic: topic.clone(),
                vm_name: String::new(),
                by_key: false,
                group_id: group_id.clone(),
                max_age: *since,
                role,
            };
            Ok(tokio::spawn(sched_relay_kafka::source::run(
                spec, deliveries, progress, stop,
            )))
        }
        #[allow(unreachable_patterns)]
        _ => Err("input.kind: this sched-relay was built without support for it".into()),
    }
}

/// Creates the input stream when it is missing; an error only when it is refused.
#[cfg(feature = "nats")]
async fn prepare_stream(
    connection: &sched_relay_nats::NatsSinkConfig,
    stream: &str,
    subject: &str,
) -> Result<(), String> {
    use sched_relay_nats::stream::{StreamProblem, ensure};
    let client = match sched_relay_nats::connect(connection).await {
        Ok(client) => client,
        Err(error) => {
            tracing::warn!(error = %error, stream, "Cannot reach NATS at start; the coordinator input makes sure of its stream when it connects");
            return Ok(());
        }
    };
    let subjects = [subject.to_owned()];
    match ensure(
        &async_nats::jetstream::new(client),
        stream,
        &subjects,
        &subjects,
        INPUT_STREAM_MAX_AGE,
    )
    .await
    {
        Ok((_, true)) => {
            tracing::info!(
                stream,
                subject,
                "Created the coordinator's input stream, which was missing"
            );
            Ok(())
        }
        Ok((_, false)) => Ok(()),
        Err(StreamProblem::Refused(why)) => Err(format!("input.stream: {why}")),
        Err(StreamProblem::Unavailable(why)) => {
            tracing::warn!(error = %why, stream, "Cannot make sure of the input stream at start; the coordinator input tries again when it connects");
            Ok(())
        }
    }
}

/// Warns when approvals published through JetStream have no stream to go to yet.
#[cfg(feature = "nats")]
async fn warn_without_approvals_stream(approvals: &sched_relay_nats::NatsSinkConfig) {
    use async_nats::jetstream::context::GetStreamByNameErrorKind;
    if !approvals.jetstream {
        return;
    }
    // Every VM's subject: a placeholder's token stands for any token.
    let subject = approvals
        .subject
        .split('.')
        .map(|token| if token.contains('{') { "*" } else { token })
        .collect::<Vec<_>>()
        .join(".");
    // The publisher reports an unreachable server itself.
    let Ok(client) = sched_relay_nats::connect(approvals).await else {
        return;
    };
    let found = async_nats::jetstream::new(client)
        .stream_by_subject(subject.clone())
        .await;
    if let Err(error) = found
        && error.kind() == GetStreamByNameErrorKind::NotFound
    {
        tracing::warn!(subject = %subject, "No JetStream stream captures the approvals subject yet: each agent creates its stream ([approvals.nats] stream) when it starts, and approvals are published again every 2 s until one has (docs: \"The NATS layout\", docs/src/nats-layout.md)");
    }
}

#[cfg(all(test, feature = "nats"))]
mod tests {
    use sched_relay_transport::testing::{broker_available, unique};

    use super::prepare_stream;

    const NATS: &str = "127.0.0.1:4222";
    const NATS_URL: &str = "nats://127.0.0.1:4222";

    fn connection() -> sched_relay_nats::NatsSinkConfig {
        serde_json::from_value(serde_json::json!({ "url": NATS_URL })).unwrap()
    }

    async fn subjects_of(stream: &str) -> Vec<String> {
        let client = async_nats::connect(NATS_URL).await.unwrap();
        let mut stream = async_nats::jetstream::new(client)
            .get_stream(stream)
            .await
            .unwrap();
        stream.info().await.unwrap().config.subjects.clone()
    }

    #[tokio::test]
    async fn a_missing_input_stream_is_created_with_the_configured_subject_and_kept_a_week() {
        if !broker_available("NATS", NATS, "nats-server -a 127.0.0.1 -p 4222 -js") {
            return;
        }
        let stream = unique("INPUT");
        let subject = format!("{}.>", unique("input"));
        prepare_stream(&connection(), &stream, &subject)
            .await
            .unwrap();
        assert_eq!(subjects_of(&stream).await, std::slice::from_ref(&subject));
        // Kept a week: heartbeats cannot fill the server.
        let client = async_nats::connect(NATS_URL).await.unwrap();
        let mut created = async_nats::jetstream::new(client)
            .get_stream(&stream)
            .await
            .unwrap();
        assert_eq!(
            created.info().await.unwrap().config.max_age,
            super::INPUT_STREAM_MAX_AGE
        );
        // Found as it is the next time.
        prepare_stream(&connection(), &stream, &subject)
            .await
            .unwrap();
        sched_relay_nats::testing::delete_stream(NATS_URL, &stream).await;
    }

    #[tokio::test]
    async fn an_input_stream_that_does_not_capture_the_subject_is_refused_and_left_as_it_is() {
        if !broker_available("NATS", NATS, "nats-server -a 127.0.0.1 -p 4222 -js") {
            return;
        }
        let stream = unique("INPUT");
        let prefix = unique("input");
        let narrow = format!("{prefix}.*.scheduled");
        sched_relay_nats::testing::create_stream(NATS_URL, &stream, &narrow).await;
        let error = prepare_stream(&connection(), &stream, &format!("{prefix}.>"))
            .await
            .unwrap_err();
        assert!(
            error.starts_with(&format!(
                "input.stream: stream {stream} exists with subjects"
            )) && error.contains(&format!("do not capture {prefix}.>"))
                && error.contains("never changes"),
            "{error}"
        );
        assert_eq!(subjects_of(&stream).await, [narrow]);
        sched_relay_nats::testing::delete_stream(NATS_URL, &stream).await;
    }

    #[tokio::test]
    async fn an_input_stream_that_would_overlap_another_says_which_stream_holds_the_subject() {
        if !broker_available("NATS", NATS, "nats-server -a 127.0.0.1 -p 4222 -js") {
            return;
        }
        // The events stream of an earlier documented layout, and the coordinator configured with another
        // name for it.
        let (old, new) = (unique("SCHEDULED_EVENTS"), unique("SCHEDULEDEVENTS"));
        let subject = format!("{}.>", unique("events"));
        sched_relay_nats::testing::create_stream(NATS_URL, &old, &subject).await;
        let error = prepare_stream(&connection(), &new, &subject)
            .await
            .unwrap_err();
        assert!(
            error.contains(&format!("stream {old} already captures {subject}")),
            "{error}"
        );
        sched_relay_nats::testing::delete_stream(NATS_URL, &old).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_input_is_caught_up_once_it_has_handled_what_its_stream_held_however_slowly() {
        use sched_relay_transport::inbound::{Answer, CatchUp, Reply};
        if !broker_available("NATS", NATS, "nats-server -a 127.0.0.1 -p 4222 -js") {
            return;
        }
        let stream = unique("CATCHUP");
        let prefix = unique("catchup");
        let client = async_nats::connect(NATS_URL).await.unwrap();
        let js = async_nats::jetstream::new(client);
        js.create_stream(async_nats::jetstream::stream::Config {
            name: stream.clone(),
            subjects: vec![format!("{prefix}.>")],
            ..Default::default()
        })
        .await
        .unwrap();
        for n in 0..5 {
            js.publish(format!("{prefix}.vm-{n}.heartbeat"), "{}".into())
                .await
                .unwrap()
                .await
                .unwrap();
        }
        let input: super::Input = serde_json::from_value(serde_json::json!({
            "kind": "nats", "url": NATS_URL, "stream": stream, "subject": format!("{prefix}.>"),
            "durable": "coordinator",
        }))
        .unwrap();
        let approvals = serde_json::from_value(serde_json::json!({
            "kind": "nats", "url": NATS_URL, "subject": format!("{prefix}x.{{vmname}}"),
        }))
        .unwrap();
        let (deliveries, mut delivered) = tokio::sync::mpsc::channel(1);
        let (progress, mut caught_up) = tokio::sync::watch::channel(CatchUp::Unknown);
        let (stop_tx, stop) = tokio::sync::watch::channel(false);
        let task = super::start(&input, &approvals, deliveries, Some(progress), stop)
            .await
            .unwrap();
        // A slow engine: every message waits; the input is behind until the fifth is handled,
        // however long that takes (no quiet second decides it).
        caught_up
            .wait_for(|state| *state != CatchUp::Unknown)
            .await
            .unwrap();
        assert_eq!(*caught_up.borrow(), CatchUp::Behind(5));
        for n in 0..5 {
            tokio::time::sleep(std::time::Duration::from_millis(1200)).await;
            assert_ne!(*caught_up.borrow(), CatchUp::CaughtUp, "after {n} of 5");
            let delivery = delivered.recv().await.unwrap();
            let _ = delivery.handled.send(Answer::Handled(Reply {
                outcome: "accepted",
                body: serde_json::Value::Null,
            }));
        }
        tokio::time::timeout(
            std::time::Duration::from_secs(5),
            caught_up.wait_for(|state| *state == CatchUp::CaughtUp),
        )
        .await
        .unwrap()
        .unwrap();
        let _ = stop_tx.send(true);
        let _ = task.await;
        sched_relay_nats::testing::delete_stream(NATS_URL, &stream).await;
    }
}
