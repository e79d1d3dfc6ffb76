//! The checks of `[approvals]` that need no network: limits, keys, and that each broker
//! source can find its connection and names only `{vmname}` in its templates.

use sched_relay_amqp::AmqpSinkConfig;
use sched_relay_kafka::KafkaSinkConfig;
use sched_relay_nats::NatsSinkConfig;

use super::config::{ApprovalsConfig, BrokerSource};
use crate::sinks::SinkEntry;

impl ApprovalsConfig {
    /// Whether any remote source is configured.
    pub fn has_sources(&self) -> bool {
        self.http.as_ref().is_some_and(|http| http.enabled)
            || self.nats.is_some()
            || self.amqp.is_some()
            || self.kafka.is_some()
    }

    /// Problems, as (key under `approvals`, message), without touching the network.
    pub fn validate(&self, sinks: &[SinkEntry]) -> Vec<(String, String)> {
        let mut problems: Vec<(String, String)> = Vec::new();
        let mut push = |key: &str, message: String| problems.push((key.to_owned(), message));
        if self.max_age.is_zero() {
            push("max_age", "must be more than 0s".into());
        }
        if self.max_message_bytes < 256 {
            push("max_message_bytes", "must be at least 256".into());
        }
        if self.max_event_ids == 0 {
            push("max_event_ids", "must be at least 1".into());
        }
        if self.imds_attempts == 0 {
            push("imds_attempts", "must be at least 1".into());
        }
        if self.has_sources() && self.keys.is_empty() && !self.allow_unsigned {
            push(
                "keys",
                "approval sources are configured but no [[approvals.keys]] can verify a request \
                 (add a key, or set allow_unsigned = true to accept unsigned requests)"
                    .into(),
            );
        }
        for (index, key) in self.keys.iter().enumerate() {
            if let Err(message) = super::keys::load(key) {
                push(&format!("keys[{index}]"), message);
            }
            if self.keys[..index].iter().any(|other| other.id == key.id) {
                push(
                    &format!("keys[{index}].id"),
                    format!("{:?} is used by an earlier key; ids must be unique", key.id),
                );
            }
        }
        if let Some(http) = &self.http
            && http.token.is_some()
            && http.token_file.is_some()
        {
            push("http.token", "set token or token_file, not both".into());
        }
        fn check<S: BrokerSource>(
            source: &Option<S>,
            sinks: &[SinkEntry],
            validate: impl Fn(&S::Connection) -> Vec<(&'static str, String)>,
            push: &mut dyn FnMut(&str, String),
        ) {
            let Some(source) = source else { return };
            match source.resolve(sinks) {
                Ok(connection) => {
                    if source.connection().is_some() {
                        for (key, message) in validate(&connection) {
                            push(&format!("{}.connection.{key}", source.kind()), message);
                        }
                    }
                }
                Err(message) => push(source.kind(), message),
            }
        }
        check(&self.nats, sinks, NatsSinkConfig::validate, &mut push);
        check(&self.amqp, sinks, AmqpSinkConfig::validate, &mut push);
        check(&self.kafka, sinks, KafkaSinkConfig::validate, &mut push);
        for (key, feature, present) in [
            (
                "nats",
                "nats",
                self.nats.is_some() && !cfg!(feature = "nats"),
            ),
            (
                "amqp",
                "amqp",
                self.amqp.is_some() && !cfg!(feature = "amqp"),
            ),
            (
                "kafka",
                "kafka",
                self.kafka.is_some() && !cfg!(feature = "kafka"),
            ),
        ] {
            if present {
                push(
                    key,
                    format!(
                        "this sched-relay was built without {key} support; rebuild with `cargo build --profile dist --features {feature}`"
                    ),
                );
            }
        }
        if let Some(nats) = &self.nats {
            for (key, subject) in [
                ("nats.subject", Some(&nats.subject)),
                ("nats.fleet_subject", nats.fleet_subject.as_ref()),
            ] {
                if let Some(subject) = subject
                    && (subject.is_empty()
                        || subject.contains(char::is_whitespace)
                        || unknown_vm_placeholder(subject))
                {
                    push(
                        key,
                        format!("{subject:?} is not a subject; only {{vmname}} can be replaced"),
                    );
                }
            }
        }
        if let Some(amqp) = &self.amqp {
            for (key, value) in [
                ("amqp.queue", &amqp.queue),
                ("amqp.routing_key", &amqp.routing_key),
                ("amqp.exchange", &amqp.exchange),
            ] {
                if value.is_empty() || unknown_vm_placeholder(value) {
                    push(
                        key,
                        format!("{value:?}: must be non-empty; only {{vmname}} can be replaced"),
                    );
                }
            }
            if amqp.prefetch == 0 {
                push("amqp.prefetch", "must be at least 1".into());
            }
        }
        if let Some(kafka) = &self.kafka
            && (kafka.topic.is_empty() || unknown_vm_placeholder(&kafka.group_id))
        {
            push(
                "kafka",
                "topic must be non-empty and group_id may only use {vmname}".into(),
            );
        }
        problems
    }
}

/// Whether a template uses a placeholder other than `{vmname}`.
fn unknown_vm_placeholder(template: &str) -> bool {
    template.replace("{vmname}", "").contains(['{', '}'])
}
