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

/// A message handed to an instance that stalls (a SIGSTOP, a frozen VM) before it
/// acknowledged it goes to another instance this long after it was delivered. The source
/// says the messages in hand are in progress every half of it, so a slow engine is no
/// stall; what waits in its buffer, at most one of [`INPUT_PULL`]'s batches (it asks for
/// the next once the last is filled or expired), and what it handed the engine, at most
/// [`INPUT_PULL`]'s `in_flight`, is delivered again after it, and recognised as seen.
#[cfg(feature = "nats")]
const INPUT_ACK_WAIT: std::time::Duration = std::time::Duration::from_secs(4);

/// The input's pull requests: the server hands a stalled instance's last open request new
/// messages for at most 1 s more, and at most 4 of them. With [`INPUT_ACK_WAIT`], every
/// message a stalled instance took or would take is another's at most [`STALL_HOLDS_BACK`]
/// after the stall. Each request is answered in well under a millisecond on the same
/// network, and a coordinator handles each message in milliseconds: small batches cost it
/// nothing it could use. Up to 32 messages are handed to the engine before the first is
/// answered: it applies what waits together and commits it once (`engine::GROUP_MAX`), so
/// under a wave the messages share fsyncs instead of each waiting for its own.
#[cfg(feature = "nats")]
const INPUT_PULL: sched_relay_nats::source::Pull = sched_relay_nats::source::Pull {
    batch: 4,
    expires: std::time::Duration::from_secs(1),
    in_flight: 32,
};

/// The longest a stalled instance holds a message back: less than three quarters of the
/// default 8 s lease, the soonest a standby can take over after a stall (the active
/// instance renews every quarter of a period).
#[cfg(all(test, feature = "nats"))]
const STALL_HOLDS_BACK: std::time::Duration = std::time::Duration::from_secs(5);

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
                ack_wait: INPUT_ACK_WAIT,
                pull: Some(INPUT_PULL),
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
mod tests;
