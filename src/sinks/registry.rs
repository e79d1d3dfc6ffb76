//! The registry: the one place that turns a `[[sinks]]` entry into a running sink. It
//! depends on the configuration data, never the other way round.

use async_trait::async_trait;
use sched_relay_exec::ExecSink;
use sched_relay_file::{FileSink, StdoutSink};
use sched_relay_transport::{DeliveryError, Event, Sink, SinkError};

use super::{SinkEntry, SinkKind};
use crate::fanout::NamedSink;

/// The running sink of an entry, with its name, ready for the fan-out.
pub fn named(entry: &SinkEntry) -> NamedSink {
    NamedSink {
        name: entry.name.clone(),
        sink: build(&entry.kind),
    }
}

/// Builds the sink. Network access (for broker sinks) happens here, never in validation.
pub fn build(kind: &SinkKind) -> Box<dyn Sink> {
    match kind {
        SinkKind::File(config) => Box::new(FileSink::new(config.clone())),
        SinkKind::Stdout(config) => Box::new(StdoutSink::new(config.clone())),
        #[cfg(feature = "nats")]
        SinkKind::Nats(config) => Box::new(sched_relay_nats::NatsSink::new(config.clone())),
        #[cfg(feature = "amqp")]
        SinkKind::Amqp(config) => Box::new(sched_relay_amqp::AmqpSink::new(config.clone())),
        #[cfg(feature = "webhook")]
        SinkKind::Webhook(config) => {
            Box::new(sched_relay_webhook::WebhookSink::new(config.clone()))
        }
        SinkKind::Exec(config) => Box::new(ExecSink::new(config.clone())),
        #[cfg(feature = "kafka")]
        SinkKind::Kafka(config) => Box::new(sched_relay_kafka::KafkaSink::new(config.clone())),
        #[allow(unreachable_patterns)]
        other => Box::new(NotCompiledIn(other.label())),
    }
}

/// Stands in for a sink whose cargo feature is off. Validation refuses such configurations
/// before anything runs, so this only ever reports the same, clearly.
struct NotCompiledIn(&'static str);

#[async_trait]
impl Sink for NotCompiledIn {
    async fn deliver(&self, _batch: &[Event]) -> Result<(), DeliveryError> {
        Err(self.health_check().await.unwrap_err().into())
    }

    async fn health_check(&self) -> Result<(), SinkError> {
        Err(SinkError::Permanent(format!(
            "this sched-relay was built without {} support",
            self.0
        )))
    }
}
