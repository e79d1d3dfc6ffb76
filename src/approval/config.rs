//! `[approvals]`: which channels carry StartRequests, which keys may sign them, and how
//! strict the checks are. Every source is optional; several can run at once.

use std::path::PathBuf;
use std::time::Duration;

use sched_relay_amqp::AmqpSinkConfig;
use sched_relay_kafka::KafkaSinkConfig;
use sched_relay_nats::NatsSinkConfig;
use sched_relay_transport::secret::Secret;
use serde::{Deserialize, Serialize};

use crate::sinks::{SinkEntry, SinkKind};

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ApprovalsConfig {
    /// Run every check and publish the outcomes (marked `dryrun`), but POST nothing to the
    /// metadata service. Also `sched-relay run --dry-run`. Applies to local policy too.
    #[serde(default)]
    pub dry_run: bool,
    /// Accept requests without a signature: unsigned CloudEvents and the bare Azure body
    /// `{"StartRequests":[...]}`. Anyone who can write to a source can then start events.
    #[serde(default)]
    pub allow_unsigned: bool,
    /// Accept requests whose `vmname` is `"*"` (the whole fleet).
    #[serde(default)]
    pub allow_fleet: bool,
    /// How old a request's `time` may be.
    #[serde(default = "default_max_age", with = "humantime_serde")]
    pub max_age: Duration,
    /// How far a request's `time` may be ahead of this VM's clock.
    #[serde(default = "default_clock_skew", with = "humantime_serde")]
    pub clock_skew: Duration,
    /// Larger messages are rejected unread.
    #[serde(default = "default_max_message_bytes")]
    pub max_message_bytes: usize,
    /// At most this many EventIds in one request.
    #[serde(default = "default_max_event_ids")]
    pub max_event_ids: usize,
    /// POSTs to the metadata service are tried this often (on 5xx and timeouts) before the
    /// outcome is `failed`.
    #[serde(default = "default_imds_attempts")]
    pub imds_attempts: u32,
    /// Keys that may sign requests.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub keys: Vec<KeyConfig>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http: Option<HttpSourceConfig>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nats: Option<NatsSourceConfig>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub amqp: Option<AmqpSourceConfig>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kafka: Option<KafkaSourceConfig>,
}

impl Default for ApprovalsConfig {
    fn default() -> Self {
        ApprovalsConfig {
            dry_run: false,
            allow_unsigned: false,
            allow_fleet: false,
            max_age: default_max_age(),
            clock_skew: default_clock_skew(),
            max_message_bytes: default_max_message_bytes(),
            max_event_ids: default_max_event_ids(),
            imds_attempts: default_imds_attempts(),
            keys: Vec::new(),
            http: None,
            nats: None,
            amqp: None,
            kafka: None,
        }
    }
}

fn default_max_age() -> Duration {
    Duration::from_secs(300)
}
fn default_clock_skew() -> Duration {
    Duration::from_secs(30)
}
fn default_max_message_bytes() -> usize {
    64 * 1024
}
fn default_max_event_ids() -> usize {
    100
}
fn default_imds_attempts() -> u32 {
    3
}

/// One trusted key. Two keys can be valid at once (by id) while a key is rotated.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct KeyConfig {
    /// The `keyid` a request names.
    pub id: String,
    /// `hmac-sha256` (shared secret) or `ed25519` (public key; the VM cannot sign).
    pub algorithm: KeyAlgorithm,
    /// HMAC: the shared secret (UTF-8 text as given). Also `${ENV}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<Secret>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_file: Option<PathBuf>,
    /// Ed25519: the 32-byte public key, base64.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub public_key: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub public_key_file: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq)]
pub enum KeyAlgorithm {
    #[serde(rename = "hmac-sha256")]
    HmacSha256,
    #[serde(rename = "ed25519")]
    Ed25519,
}

/// `POST /approvals` on the `[telemetry]` listener.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct HttpSourceConfig {
    #[serde(default = "enabled")]
    pub enabled: bool,
    /// Callers must send `Authorization: Bearer <token>`. Required unless the listener is on
    /// loopback.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<Secret>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_file: Option<PathBuf>,
}

fn enabled() -> bool {
    true
}

/// Where a broker source connects: the connection of a `[[sinks]]` entry of the same kind
/// (`sink = "bus"`), or its own (`connection = { url = ... }`, the keys of that sink kind).
pub trait BrokerSource {
    type Connection: Clone;
    fn kind(&self) -> &'static str;
    fn sink(&self) -> Option<&str>;
    fn connection(&self) -> Option<&Self::Connection>;
    fn from_sink(kind: &SinkKind) -> Option<&Self::Connection>;

    /// The connection settings to use, or why there are none.
    fn resolve(&self, sinks: &[SinkEntry]) -> Result<Self::Connection, String> {
        match (self.sink(), self.connection()) {
            (Some(_), Some(_)) => Err("set sink or connection, not both".into()),
            (None, None) => Err(format!(
                "needs sink = \"<name of a {} sink>\" or connection = {{ url = ... }}",
                self.kind()
            )),
            (None, Some(connection)) => Ok(connection.clone()),
            (Some(name), None) => {
                let entry = sinks
                    .iter()
                    .find(|entry| entry.name == name)
                    .ok_or_else(|| format!("sink = {name:?}: no [[sinks]] entry has that name"))?;
                Self::from_sink(&entry.kind).cloned().ok_or_else(|| {
                    format!(
                        "sink = {name:?} is a {} sink; the {} source needs a sink of kind \"{}\"",
                        entry.kind.label(),
                        self.kind(),
                        self.kind()
                    )
                })
            }
        }
    }
}

macro_rules! broker_source {
    ($config:ident, $connection:ty, $variant:ident, $kind:literal) => {
        impl BrokerSource for $config {
            type Connection = $connection;
            fn kind(&self) -> &'static str {
                $kind
            }
            fn sink(&self) -> Option<&str> {
                self.sink.as_deref()
            }
            fn connection(&self) -> Option<&$connection> {
                self.connection.as_ref()
            }
            fn from_sink(kind: &SinkKind) -> Option<&$connection> {
                match kind {
                    SinkKind::$variant(config) => Some(config),
                    _ => None,
                }
            }
        }
    };
}

/// `[approvals.nats]`: core NATS subscriptions, or a JetStream durable consumer.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct NatsSourceConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sink: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connection: Option<NatsSinkConfig>,
    /// This VM's subject; `{vmname}` is replaced.
    #[serde(default = "default_nats_subject")]
    pub subject: String,
    /// A subject every VM listens on (needs `allow_fleet` for `vmname = "*"` requests).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fleet_subject: Option<String>,
    /// Consume through a JetStream durable consumer (acknowledged after handling) on this
    /// stream, instead of core subscriptions. The stream must capture the subjects; when it
    /// is missing, the agent creates it with the subject's root (`scheduledapprovals.>`, see
    /// [`NatsSourceConfig::stream_subjects`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<String>,
    /// The durable consumer's name; `{vmname}` is replaced.
    #[serde(default = "default_durable")]
    pub durable: String,
}

// A root of its own: under the events' root (`scheduledevents.<vm>.<transition>`) a VM named
// `approvals` would publish its events into the approvals, and NATS refuses a second stream
// whose subjects overlap the events stream's.
fn default_nats_subject() -> String {
    "scheduledapprovals.{vmname}".into()
}
fn default_durable() -> String {
    "sched-relay-{vmname}".into()
}

broker_source!(NatsSourceConfig, NatsSinkConfig, Nats, "nats");

impl NatsSourceConfig {
    /// The subjects the agent creates its missing `stream` with: the subject's tokens before
    /// the one naming `{vmname}`, then `>`, so that one stream serves every VM
    /// (`scheduledapprovals.{vmname}` gives `scheduledapprovals.>`), plus `fleet_subject`
    /// when that does not capture it. Empty when the subject starts with `{vmname}`: no
    /// subject then captures every VM's and nothing else, so the stream must exist.
    pub fn stream_subjects(&self) -> Vec<String> {
        let tokens: Vec<&str> = self.subject.split('.').collect();
        let root = match tokens.iter().position(|token| token.contains("{vmname}")) {
            Some(0) => return Vec::new(),
            Some(at) => format!("{}.>", tokens[..at].join(".")),
            None => self.subject.clone(),
        };
        let mut subjects = vec![root];
        if let Some(fleet) = &self.fleet_subject
            && !sched_relay_nats::stream::captures(&subjects[0], fleet)
        {
            subjects.push(fleet.clone());
        }
        subjects
    }
}

/// `[approvals.amqp]`: a per-VM queue, bound to an exchange by a per-VM routing key.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AmqpSourceConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sink: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connection: Option<AmqpSinkConfig>,
    /// The queue to consume; `{vmname}` is replaced.
    #[serde(default = "default_amqp_queue")]
    pub queue: String,
    /// Declare the exchange (topic, durable), the queue (durable) and the bindings at start.
    #[serde(default = "enabled")]
    pub declare: bool,
    /// The exchange orchestrators publish approvals to.
    #[serde(default = "default_amqp_exchange")]
    pub exchange: String,
    /// The binding of this VM's queue; `{vmname}` is replaced.
    #[serde(default = "default_amqp_routing_key")]
    pub routing_key: String,
    /// A second binding every VM's queue gets, for fleet-wide requests.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fleet_routing_key: Option<String>,
    /// Unacknowledged messages the broker may hand over at once.
    #[serde(default = "default_prefetch")]
    pub prefetch: u16,
}

fn default_amqp_queue() -> String {
    "sched-relay.approvals.{vmname}".into()
}
fn default_amqp_exchange() -> String {
    "scheduledevents.approvals".into()
}
fn default_amqp_routing_key() -> String {
    "approvals.{vmname}".into()
}
fn default_prefetch() -> u16 {
    16
}

broker_source!(AmqpSourceConfig, AmqpSinkConfig, Amqp, "amqp");

/// `[approvals.kafka]`: a topic keyed by VM name. The agent assigns itself the one partition
/// its name hashes to (no consumer-group join, so no rebalance delay) and commits offsets
/// after handling.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct KafkaSourceConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sink: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connection: Option<KafkaSinkConfig>,
    #[serde(default = "default_kafka_topic")]
    pub topic: String,
    /// `key`: read only the partition of this VM's name (murmur2, as Java clients and
    /// librdkafka's `murmur2_random` place keys). `all`: read every partition (small fleets,
    /// fleet-wide requests).
    #[serde(default)]
    pub partitions: KafkaPartitions,
    /// Offsets are committed under this group (never joined); `{vmname}` is replaced.
    #[serde(default = "default_durable")]
    pub group_id: String,
}

#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum KafkaPartitions {
    #[default]
    Key,
    All,
}

fn default_kafka_topic() -> String {
    "scheduledevents.approvals".into()
}

broker_source!(KafkaSourceConfig, KafkaSinkConfig, Kafka, "kafka");

/// Replaces `{vmname}` in a source's subject, queue or group template, the name written as
/// every template writes it (`.` becomes `_`: a VM named `a.b` reads
/// `scheduledapprovals.a_b`, where the coordinator and `sign-approval` publish).
pub fn for_vm(template: &str, vm_name: &str) -> String {
    template.replace(
        "{vmname}",
        &sched_relay_core::binding::template_value(vm_name),
    )
}

#[cfg(test)]
mod tests {
    use super::{NatsSourceConfig, for_vm};

    #[test]
    fn a_vm_name_with_a_dot_reads_one_level_where_the_coordinator_and_sign_approval_publish() {
        assert_eq!(
            for_vm("scheduledapprovals.{vmname}", "db.prod"),
            "scheduledapprovals.db_prod"
        );
        assert_eq!(
            for_vm("sched-relay-{vmname}", "db.prod"),
            "sched-relay-db_prod"
        );
        assert_eq!(
            for_vm("scheduledapprovals.{vmname}", "web-1"),
            "scheduledapprovals.web-1"
        );
        // The coordinator's and sign-approval's publishers write `{vmname}` through the
        // sinks' templates.
        let draft = sched_relay_core::approval::Draft::new("urn:test", Some("db.prod"), vec![]);
        assert_eq!(
            sched_relay_core::binding::expand_template(
                "scheduledapprovals.{vmname}",
                &draft.event(None)
            ),
            for_vm("scheduledapprovals.{vmname}", "db.prod")
        );
    }

    fn nats(text: &str) -> NatsSourceConfig {
        toml::from_str(text).unwrap()
    }

    #[test]
    fn a_missing_approvals_stream_is_created_on_the_root_of_every_vms_subject() {
        // The default: a root of its own, beside the events' scheduledevents.>.
        assert_eq!(nats("").subject, "scheduledapprovals.{vmname}");
        assert_eq!(nats("").stream_subjects(), ["scheduledapprovals.>"]);
        assert_eq!(
            nats("subject = \"fleet.approvals.{vmname}.requests\"").stream_subjects(),
            ["fleet.approvals.>"]
        );
        // A fleet subject under the root adds nothing; one elsewhere is added.
        let fleet =
            |subject: &str| nats(&format!("fleet_subject = \"{subject}\"")).stream_subjects();
        assert_eq!(fleet("scheduledapprovals.fleet"), ["scheduledapprovals.>"]);
        assert_eq!(
            fleet("fleetapprovals"),
            ["scheduledapprovals.>", "fleetapprovals"]
        );
        // No root that captures every VM's subject and nothing else: it must exist.
        assert!(
            nats("subject = \"{vmname}.approvals\"")
                .stream_subjects()
                .is_empty()
        );
    }
}
