//! `coordinator.toml`: where the fleet's events come from, where approvals go, the signing
//! key, the drain hook and the groups with their budgets and actions. Loaded like the agent's
//! configuration (a TOML file, then `SCHED_RELAY_COORDINATOR_<SECTION>__<KEY>` overrides)
//! and validated in one pass that reports every problem with its key path.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::policy::Action;
pub(super) use crate::config::problem;

mod checks;
use crate::sinks::SinkKind;

/// The prefix of environment overrides of the coordinator's configuration.
pub const ENV_PREFIX: &str = "SCHED_RELAY_COORDINATOR_";

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CoordinatorConfig {
    pub coordinator: General,
    /// Where the agents publish their events (and approval outcomes).
    pub input: Input,
    /// Where each VM's agent reads its approvals: a sink whose subject, routing key or
    /// Kafka key names the VM (`{vmname}`).
    pub approvals: SinkKind,
    pub signing: Signing,
    #[serde(default)]
    pub drain: Option<Drain>,
    #[serde(default)]
    pub defaults: GroupDefaults,
    #[serde(default)]
    pub groups: Vec<GroupConfig>,
    /// A standby: the lease and the state in NATS JetStream KV instead of `state_dir`.
    #[serde(default)]
    pub ha: Option<HaConfig>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct General {
    /// The `source` of every approval this coordinator signs.
    #[serde(default = "default_source")]
    pub source: String,
    #[serde(default = "default_state_dir")]
    pub state_dir: PathBuf,
    /// `/metrics`, `/fleet`, `/healthz`.
    #[serde(default = "default_listen")]
    pub listen: SocketAddr,
    /// Decide and log, but sign, publish and drain nothing.
    #[serde(default)]
    pub dry_run: bool,
    /// How often decisions, deadlines and unanswered approvals are looked at again (each
    /// event is also decided as soon as it arrives).
    #[serde(default = "default_tick", with = "humantime_serde")]
    pub tick: Duration,
    /// An approval without an outcome after this long is published again (the same request
    /// while it is fresh: the agent answers a repeated id with its stored outcome).
    #[serde(default = "default_outcome_timeout", with = "humantime_serde")]
    pub outcome_timeout: Duration,
    /// Approvals sent for one event before the coordinator gives up and alerts.
    #[serde(default = "default_max_attempts")]
    pub max_attempts: u32,
    /// Never approve an event whose NotBefore is closer than this: Azure starts it anyway.
    #[serde(default = "default_min_lead", with = "humantime_serde")]
    pub min_lead: Duration,
    /// An event no agent has reported on for this long is forgotten, and so is an agent
    /// silent that long (it leaves its group's size). At least an hour.
    #[serde(default = "default_forget_after", with = "humantime_serde")]
    pub forget_after: Duration,
    /// A held or started event stops counting against its budget this long after its
    /// NotBefore and its last report: a Spot-evicted or deleted VM never reports the end.
    #[serde(default = "default_max_hold", with = "humantime_serde")]
    pub max_hold: Duration,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum Input {
    /// A JetStream durable consumer (the stream must capture `subject`).
    Nats {
        url: String,
        #[serde(default = "default_subject")]
        subject: String,
        stream: String,
        #[serde(default = "default_durable")]
        durable: String,
        #[serde(default)]
        credentials_file: Option<PathBuf>,
    },
    /// A durable queue bound to the agents' exchange.
    Amqp {
        url: String,
        #[serde(default = "default_exchange")]
        exchange: String,
        #[serde(default = "default_queue")]
        queue: String,
        #[serde(default = "default_binding_key")]
        binding_key: String,
    },
    /// Every partition of the agents' topic, offsets committed under `group_id`.
    Kafka {
        brokers: String,
        #[serde(default = "default_topic")]
        topic: String,
        #[serde(default = "default_durable")]
        group_id: String,
        /// Without a committed offset, start this far back.
        #[serde(default = "default_since", with = "humantime_serde")]
        since: Duration,
    },
}

/// `[ha]`: the lease and the state in NATS JetStream KV.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct HaConfig {
    pub url: String,
    #[serde(default)]
    pub credentials_file: Option<std::path::PathBuf>,
    /// The state bucket; the lease lives in `<bucket>-lease`.
    #[serde(default = "default_bucket")]
    pub bucket: String,
    /// A standby takes over at most this long after the active instance died.
    #[serde(default = "default_lease", with = "humantime_serde")]
    pub lease: Duration,
    /// This instance's name in the lease (default: host name and process id).
    #[serde(default)]
    pub instance: Option<String>,
    /// Replicas of the buckets' streams (a clustered NATS); 1 keeps them on one server.
    #[serde(default = "default_replicas")]
    pub replicas: usize,
}

fn default_bucket() -> String {
    "sched-relay-coordinator".into()
}
fn default_replicas() -> usize {
    1
}
fn default_lease() -> Duration {
    Duration::from_secs(10)
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Signing {
    /// `ed25519:<base64 seed>` (`sched-relay gen-approval-key`); HMAC keys are refused: the
    /// agents would have to hold the same secret.
    pub key_file: PathBuf,
    pub key_id: String,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Drain {
    /// A command run once per VM (`{vmname}`, `{eventid}`, `{eventtype}` expanded in each
    /// argument); exit 0 means drained.
    #[serde(default)]
    pub command: Option<Vec<String>>,
    /// Or a URL that gets `POST {"vmName", "eventId", "eventType", "notBefore", "deadline"}`;
    /// 2xx means drained.
    #[serde(default)]
    pub url: Option<String>,
    /// The drain must finish this long before NotBefore.
    #[serde(default = "default_margin", with = "humantime_serde")]
    pub margin: Duration,
    /// What to do when the hook fails or its deadline passes: `wait` (let NotBefore come;
    /// the VM stays counted as down) or `approve` anyway.
    #[serde(default)]
    pub on_failure: OnFailure,
}

#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum OnFailure {
    #[default]
    Wait,
    Approve,
}

/// An event type's action: `"approve"`, or `{ action = "approve", max_duration = "30s" }`.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(untagged)]
pub enum RuleConfig {
    Action(Action),
    Rule {
        action: Action,
        #[serde(default, with = "humantime_serde")]
        max_duration: Option<Duration>,
    },
}

#[derive(Debug, Clone, Deserialize, Serialize, Default)]
#[serde(deny_unknown_fields)]
pub struct GroupDefaults {
    #[serde(default)]
    pub max_down: Option<u32>,
    #[serde(default)]
    pub max_down_percent: Option<u32>,
    #[serde(default)]
    pub actions: BTreeMap<String, RuleConfig>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct GroupConfig {
    pub name: String,
    /// A VM-name pattern (`*` any run of characters, `?` one).
    #[serde(default)]
    pub vm_name: Option<String>,
    /// Parts of the VM's Azure resource id (as its agent reports it).
    #[serde(default)]
    pub resource_group: Option<String>,
    /// A uniform scale set (its VMs' ids name it; a flexible scale set's VMs have plain
    /// VM ids: group those by name).
    #[serde(default)]
    pub scale_set: Option<String>,
    #[serde(default)]
    pub max_down: Option<u32>,
    #[serde(default)]
    pub max_down_percent: Option<u32>,
    /// Per EventType; types not listed take `[defaults.actions]`, then `never`.
    #[serde(default)]
    pub actions: BTreeMap<String, RuleConfig>,
}

fn default_source() -> String {
    "urn:sched-relay:coordinator".into()
}
fn default_state_dir() -> PathBuf {
    "/var/lib/sched-relay-coordinator".into()
}
fn default_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9465))
}
fn default_tick() -> Duration {
    Duration::from_millis(500)
}
fn default_outcome_timeout() -> Duration {
    Duration::from_secs(20)
}
fn default_max_attempts() -> u32 {
    5
}
fn default_min_lead() -> Duration {
    Duration::from_secs(2)
}
fn default_max_hold() -> Duration {
    Duration::from_secs(3600)
}
fn default_forget_after() -> Duration {
    Duration::from_secs(24 * 3600)
}
fn default_subject() -> String {
    "scheduledevents.>".into()
}
fn default_durable() -> String {
    "sched-relay-coordinator".into()
}
fn default_exchange() -> String {
    "scheduledevents".into()
}
fn default_queue() -> String {
    "sched-relay.coordinator".into()
}
fn default_binding_key() -> String {
    "#".into()
}
fn default_topic() -> String {
    "scheduledevents".into()
}
fn default_since() -> Duration {
    Duration::from_secs(24 * 3600)
}
fn default_margin() -> Duration {
    Duration::from_secs(60)
}
