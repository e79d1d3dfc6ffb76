//! The AMQP 0-9-1 sink (RabbitMQ): publishes each CloudEvent to an exchange with a routing
//! key built from a template, persistent, `mandatory` (a message no queue takes is an error,
//! not a silent drop), and counts it delivered only on the broker's publisher confirm.
//!
//! Binary mode follows the RabbitMQ binding of Knative's eventing-rabbitmq and the CloudEvents
//! SDKs: attributes in `ce-` headers, `datacontenttype` as the `content_type` property, data
//! as the body; `header_style = "amqp1"` switches to the AMQP 1.0 binding's `cloudEvents_`
//! names. `message_id` is the CloudEvents id in both modes.
//!
//! The configuration always compiles; the client needs the `client` feature.

use std::path::PathBuf;
use std::time::Duration;

use sched_relay_transport::binding::{ContentMode, unknown_template_fields};
use sched_relay_transport::secret::Secret;
use serde::{Deserialize, Serialize};

#[cfg(feature = "client")]
mod confirms;
#[cfg(feature = "client")]
mod frame;
#[cfg(feature = "client")]
mod sink;
#[cfg(feature = "client")]
pub mod source;
#[cfg(feature = "client")]
pub use frame::{CONSUMER_FRAME_CEILING, CONSUMER_FRAME_MAX, FRAME_MAX, Frame};
#[cfg(feature = "client")]
pub use sink::{AmqpFault, AmqpSink, fault};
#[cfg(feature = "testing")]
pub mod testing;

/// Which header names binary mode uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum HeaderStyle {
    /// `ce-id`, `ce-type`, ...: the RabbitMQ binding (Knative eventing-rabbitmq, SDKs).
    #[default]
    Rabbitmq,
    /// `cloudEvents_id`, `cloudEvents_type`, ...: the AMQP 1.0 binding's names.
    Amqp1,
}

/// `kind = "amqp"`.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AmqpSinkConfig {
    /// `amqp://user:password@host:5672/vhost` or `amqps://...` (TLS). The default vhost is
    /// `%2f`. The password may instead come from `password` or `password_file`.
    pub url: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password: Option<Secret>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password_file: Option<PathBuf>,
    /// The exchange to publish to.
    #[serde(default = "default_exchange")]
    pub exchange: String,
    /// Routing-key template: `{vmname}`, `{transition}`, `{eventtype}`, `{eventid}`, `{type}`.
    #[serde(default = "default_routing_key")]
    pub routing_key: String,
    /// Declare the exchange (durable) at start, and the queue below with its binding.
    /// Off: the health check only verifies that the exchange exists.
    #[serde(default)]
    pub declare: bool,
    /// Exchange type used when declaring: `topic` (default), `direct`, `fanout`, `headers`.
    #[serde(default = "default_exchange_type")]
    pub exchange_type: String,
    /// A durable queue to declare and bind when `declare = true`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<String>,
    /// The binding key of that queue.
    #[serde(default = "default_binding_key")]
    pub binding_key: String,
    #[serde(default)]
    pub content_mode: ContentMode,
    #[serde(default)]
    pub header_style: HeaderStyle,
    /// A PEM file of CA certificates for `amqps://` (default: the system's roots).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<PathBuf>,
    /// A PEM certificate (with its chain) to present to servers that require client
    /// certificates (mutual TLS); with `client_key_file`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_cert_file: Option<PathBuf>,
    /// The PEM private key of `client_cert_file`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_key_file: Option<PathBuf>,
    /// Connect and publisher-confirm timeout.
    #[serde(default = "default_timeout", with = "humantime_serde")]
    pub timeout: Duration,
}

fn default_exchange() -> String {
    "scheduledevents".into()
}
fn default_routing_key() -> String {
    "{vmname}.{transition}".into()
}
fn default_exchange_type() -> String {
    "topic".into()
}
fn default_binding_key() -> String {
    "#".into()
}
fn default_timeout() -> Duration {
    Duration::from_secs(5)
}

impl AmqpSinkConfig {
    /// The files a connection reads its password and certificates from: a connection made
    /// before one of them changed is made again ([`sched_relay_transport::files`]).
    pub fn watched_files(&self) -> Vec<&std::path::Path> {
        sched_relay_transport::files::given([
            &self.password_file,
            &self.ca_file,
            &self.client_cert_file,
            &self.client_key_file,
        ])
    }

    /// Problems, as (key, message), without touching the network.
    pub fn validate(&self) -> Vec<(&'static str, String)> {
        let mut problems = Vec::new();
        match url::Url::parse(&self.url) {
            Ok(url) if matches!(url.scheme(), "amqp" | "amqps") && url.has_host() => {}
            _ => problems.push((
                "url",
                "expected an AMQP URI such as \"amqp://guest:guest@127.0.0.1:5672/%2f\"".to_owned(),
            )),
        }
        if self.password.is_some() && self.password_file.is_some() {
            problems.push(("password", "set password or password_file, not both".into()));
        }
        let unknown = unknown_template_fields(&self.routing_key);
        if !unknown.is_empty() {
            problems.push((
                "routing_key",
                format!("{:?}: unknown placeholders {unknown:?}", self.routing_key),
            ));
        }
        if !matches!(
            self.exchange_type.as_str(),
            "topic" | "direct" | "fanout" | "headers"
        ) {
            problems.push((
                "exchange_type",
                format!(
                    "{:?}: expected topic, direct, fanout or headers",
                    self.exchange_type
                ),
            ));
        }
        if self.queue.is_some() && !self.declare {
            problems.push(("queue", "is only used with declare = true".into()));
        }
        if self.timeout.is_zero() {
            problems.push(("timeout", "must be more than 0s".into()));
        }
        // A CA or client certificate on a connection that would not use TLS is refused.
        let tls = url::Url::parse(&self.url).is_ok_and(|url| url.scheme() == "amqps");
        problems.extend(sched_relay_transport::tls::check(
            (!tls).then_some("use an amqps:// URL"),
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
    fn defaults_follow_the_product_contract() {
        let config: AmqpSinkConfig =
            toml::from_str("url = \"amqp://guest:guest@127.0.0.1:5672/%2f\"").unwrap();
        assert_eq!(config.exchange, "scheduledevents");
        assert_eq!(config.routing_key, "{vmname}.{transition}");
        assert_eq!(config.header_style, HeaderStyle::Rabbitmq);
        assert!(config.validate().is_empty());
    }

    #[test]
    fn bad_settings_are_reported_by_key() {
        let config: AmqpSinkConfig = toml::from_str(
            "url = \"http://x\"\nrouting_key = \"{nope}\"\nexchange_type = \"weird\"\nqueue = \"q\"",
        )
        .unwrap();
        let keys: Vec<&str> = config.validate().iter().map(|(k, _)| *k).collect();
        assert_eq!(keys, ["url", "routing_key", "exchange_type", "queue"]);
    }
}
