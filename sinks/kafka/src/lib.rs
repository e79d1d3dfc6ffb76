//! The Kafka sink: an idempotent producer (`acks=all`, `enable.idempotence=true`) that counts
//! an event delivered only on its delivery report. Binary mode follows the CloudEvents Kafka
//! binding (`ce_` headers, `content-type`, data as the value); the record key is the
//! `partitionkey` extension (the EventId by default, so all transitions of one Azure event
//! stay ordered in one partition; the VM name with `events.partition_key = "vm_name"`).
//!
//! The configuration always compiles; the client (librdkafka) needs the `client` feature.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use sched_relay_transport::binding::ContentMode;
use sched_relay_transport::secret::Secret;
use serde::{Deserialize, Serialize};

#[cfg(feature = "client")]
mod sink;
#[cfg(feature = "client")]
pub mod source;
#[cfg(feature = "client")]
pub use sink::{KafkaFault, KafkaSink, client_config, fault};
#[cfg(feature = "testing")]
pub mod testing;

/// `kind = "kafka"`.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct KafkaSinkConfig {
    /// Bootstrap servers, comma-separated: `kafka-1:9092,kafka-2:9092`.
    pub brokers: String,
    #[serde(default = "default_topic")]
    pub topic: String,
    #[serde(default)]
    pub content_mode: ContentMode,
    /// `plaintext` (default), `ssl`, `sasl_plaintext` or `sasl_ssl`.
    #[serde(default = "default_security_protocol")]
    pub security_protocol: String,
    /// `PLAIN`, `SCRAM-SHA-256` or `SCRAM-SHA-512`, with `sasl_*` protocols.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sasl_mechanism: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sasl_username: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sasl_password: Option<Secret>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sasl_password_file: Option<PathBuf>,
    /// A PEM file of CA certificates for `ssl` and `sasl_ssl`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<PathBuf>,
    /// A PEM certificate (with its chain) to present to servers that require client
    /// certificates (mutual TLS); with `client_key_file`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_cert_file: Option<PathBuf>,
    /// The PEM private key of `client_cert_file`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_key_file: Option<PathBuf>,
    /// Delivery timeout of one message (librdkafka's `message.timeout.ms`).
    #[serde(default = "default_timeout", with = "humantime_serde")]
    pub timeout: Duration,
    /// Further librdkafka producer settings, for what the keys above do not cover
    /// (e.g. `"compression.type" = "zstd"`). Idempotence and acks cannot be weakened here.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub options: BTreeMap<String, String>,
}

fn default_topic() -> String {
    "scheduledevents".into()
}
fn default_security_protocol() -> String {
    "plaintext".into()
}
fn default_timeout() -> Duration {
    Duration::from_secs(10)
}

/// librdkafka settings a user may not override: they are what makes delivery reliable.
pub const PROTECTED_OPTIONS: &[&str] = &[
    "acks",
    "enable.idempotence",
    "bootstrap.servers",
    "message.timeout.ms",
];

impl KafkaSinkConfig {
    /// Problems, as (key, message), without touching the network.
    pub fn validate(&self) -> Vec<(&'static str, String)> {
        let mut problems = Vec::new();
        if self.brokers.split(',').any(|b| !b.trim().contains(':')) {
            problems.push((
                "brokers",
                format!("{:?}: expected host:port[,host:port]", self.brokers),
            ));
        }
        let legal_topic = !self.topic.is_empty()
            && self.topic.len() <= 249
            && self
                .topic
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c));
        if !legal_topic {
            problems.push((
                "topic",
                format!("{:?} is not a legal Kafka topic name", self.topic),
            ));
        }
        let protocol = self.security_protocol.as_str();
        if !["plaintext", "ssl", "sasl_plaintext", "sasl_ssl"].contains(&protocol) {
            problems.push((
                "security_protocol",
                format!("{protocol:?}: expected plaintext, ssl, sasl_plaintext or sasl_ssl"),
            ));
        }
        let sasl = protocol.starts_with("sasl_");
        match (&self.sasl_mechanism, sasl) {
            (Some(mechanism), true)
                if !["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"].contains(&mechanism.as_str()) =>
            {
                problems.push((
                    "sasl_mechanism",
                    format!("{mechanism:?}: expected PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512"),
                ))
            }
            (None, true) => problems.push((
                "sasl_mechanism",
                "is required with a sasl_* security_protocol".into(),
            )),
            (Some(_), false) => problems.push((
                "sasl_mechanism",
                "is only used with a sasl_* security_protocol".into(),
            )),
            _ => {}
        }
        if sasl && self.sasl_username.is_none() {
            problems.push((
                "sasl_username",
                "is required with a sasl_* security_protocol".into(),
            ));
        }
        if self.sasl_password.is_some() && self.sasl_password_file.is_some() {
            problems.push((
                "sasl_password",
                "set sasl_password or sasl_password_file, not both".into(),
            ));
        }
        for key in self.options.keys() {
            if PROTECTED_OPTIONS.contains(&key.as_str())
                || key.starts_with("sasl.")
                || key.starts_with("ssl.")
            {
                problems.push((
                    "options",
                    format!("{key:?} cannot be set here; use the sink's own keys"),
                ));
            }
        }
        if self.timeout < Duration::from_secs(1) {
            problems.push(("timeout", "must be at least 1s".into()));
        }
        // A CA or client certificate on a connection that would not use TLS is refused.
        let tls = matches!(protocol, "ssl" | "sasl_ssl");
        problems.extend(sched_relay_transport::tls::check(
            (!tls).then_some("set security_protocol = \"ssl\" or \"sasl_ssl\""),
            self.ca_file.as_deref(),
            self.client_cert_file.as_deref(),
            self.client_key_file.as_deref(),
        ));
        problems
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_validation() {
        let config: KafkaSinkConfig = toml::from_str("brokers = \"127.0.0.1:9092\"").unwrap();
        assert_eq!(config.topic, "scheduledevents");
        assert!(config.validate().is_empty(), "{:?}", config.validate());
        let bad: KafkaSinkConfig = toml::from_str(
            "brokers = \"nohost\"\ntopic = \"bad topic\"\nsecurity_protocol = \"sasl_ssl\"\n[options]\nacks = \"1\"",
        )
        .unwrap();
        let keys: Vec<&str> = bad.validate().iter().map(|(k, _)| *k).collect();
        assert_eq!(
            keys,
            [
                "brokers",
                "topic",
                "sasl_mechanism",
                "sasl_username",
                "options"
            ]
        );
    }
}
