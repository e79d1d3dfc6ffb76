//! The closed set of sink kinds a configuration can name (`[[sinks]]` entries: plain data,
//! with their checks), and the [`registry`] that turns an entry into a running sink. Adding
//! a sink is one crate, one variant here and one arm in [`registry::build`].

pub mod registry;

use sched_relay_amqp::AmqpSinkConfig;
use sched_relay_exec::ExecSinkConfig;
use sched_relay_file::{FileSinkConfig, StdoutSinkConfig};
use sched_relay_kafka::KafkaSinkConfig;
use sched_relay_nats::NatsSinkConfig;
use sched_relay_webhook::WebhookSinkConfig;
use serde::{Deserialize, Serialize};

/// One `[[sinks]]` entry: a unique name plus the kind-specific settings.
#[derive(Debug, Clone, PartialEq)]
pub struct SinkEntry {
    /// Names the sink in logs, metrics and the dead-letter file.
    pub name: String,
    pub kind: SinkKind,
}

/// The sink kinds, tagged by `kind` in the configuration.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum SinkKind {
    /// JSON Lines of structured CloudEvents, fsync'd per batch.
    File(FileSinkConfig),
    /// Standard output: JSON Lines, pretty JSON or a one-line summary.
    Stdout(StdoutSinkConfig),
    /// NATS, core or JetStream (cargo feature `nats`).
    Nats(NatsSinkConfig),
    /// AMQP 0-9-1 / RabbitMQ with publisher confirms (cargo feature `amqp`).
    Amqp(AmqpSinkConfig),
    /// HTTP POST, one request per event or per batch (cargo feature `webhook`).
    Webhook(WebhookSinkConfig),
    /// A local command per event (drain scripts).
    Exec(ExecSinkConfig),
    /// Kafka, idempotent acks=all producer (cargo feature `kafka`).
    Kafka(KafkaSinkConfig),
}

impl SinkKind {
    /// The `kind` value, for logs.
    pub fn label(&self) -> &'static str {
        match self {
            SinkKind::File(_) => "file",
            SinkKind::Stdout(_) => "stdout",
            SinkKind::Nats(_) => "nats",
            SinkKind::Amqp(_) => "amqp",
            SinkKind::Webhook(_) => "webhook",
            SinkKind::Exec(_) => "exec",
            SinkKind::Kafka(_) => "kafka",
        }
    }

    /// The cargo feature a kind needs, and whether this binary has it.
    fn feature(&self) -> Option<(&'static str, bool)> {
        match self {
            SinkKind::File(_) | SinkKind::Stdout(_) | SinkKind::Exec(_) => None,
            SinkKind::Nats(_) => Some(("nats", cfg!(feature = "nats"))),
            SinkKind::Amqp(_) => Some(("amqp", cfg!(feature = "amqp"))),
            SinkKind::Webhook(_) => Some(("webhook", cfg!(feature = "webhook"))),
            SinkKind::Kafka(_) => Some(("kafka", cfg!(feature = "kafka"))),
        }
    }

    /// Problems with this sink's settings, as (key under the sink, message).
    pub fn validate(&self) -> Vec<(&'static str, String)> {
        if let Some((feature, false)) = self.feature() {
            return vec![(
                "kind",
                format!(
                    "this sched-relay was built without {} support; rebuild with `cargo build --profile dist --features {feature}`",
                    self.label()
                ),
            )];
        }
        match self {
            SinkKind::File(file) if file.path.as_os_str().is_empty() => vec![(
                "path",
                "must name a file, e.g. \"/var/log/sched-relay/events.jsonl\"".into(),
            )],
            SinkKind::Nats(nats) => nats.validate(),
            SinkKind::Amqp(amqp) => amqp.validate(),
            SinkKind::Webhook(webhook) => webhook.validate(),
            SinkKind::Exec(exec) => exec.validate(),
            SinkKind::Kafka(kafka) => kafka.validate(),
            _ => Vec::new(),
        }
    }
}

impl<'de> Deserialize<'de> for SinkEntry {
    // `name` is common to every kind; the rest goes to the kind's own strict struct, so an
    // unknown key is still refused (serde's deny_unknown_fields does not mix with flatten).
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        let mut table = serde_json::Map::deserialize(deserializer)?;
        let name = match table.remove("name") {
            Some(serde_json::Value::String(name)) => name,
            Some(other) => {
                return Err(D::Error::custom(format!(
                    "name: expected a string, found {other}"
                )));
            }
            None => {
                return Err(D::Error::custom(
                    "missing `name`: every sink needs a unique name",
                ));
            }
        };
        let kind = SinkKind::deserialize(serde_json::Value::Object(table))
            .map_err(|e| D::Error::custom(format!("sink {name:?}: {e}")))?;
        Ok(SinkEntry { name, kind })
    }
}

impl Serialize for SinkEntry {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::Error;
        let mut table = match serde_json::to_value(&self.kind).map_err(S::Error::custom)? {
            serde_json::Value::Object(table) => table,
            _ => return Err(S::Error::custom("a sink serializes to a table")),
        };
        table.insert("name".into(), self.name.clone().into());
        table.serialize(serializer)
    }
}
