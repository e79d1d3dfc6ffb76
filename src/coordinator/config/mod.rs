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

mod azure;
mod checks;
pub use crate::coordinator::azure::{AzureConfig, Credential, GroupAzure};
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
    /// A budget across every group.
    #[serde(default)]
    pub fleet: Option<FleetBudget>,
    /// A standby: the lease and the state in NATS JetStream KV instead of `state_dir`.
    #[serde(default)]
    pub ha: Option<HaConfig>,
    /// How Azure Resource Manager is reached, for the groups with an Azure source.
    #[serde(default)]
    pub azure: Option<AzureConfig>,
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
    /// An event no agent has reported on for this long is forgotten unless it still holds
    /// a VM's place, and an agent silent that long leaves the inventory (a scale-in without
    /// notice) unless an event still holds its VM. At least an hour.
    #[serde(default = "default_forget_after", with = "humantime_serde")]
    pub forget_after: Duration,
    /// A place held this long past its event's NotBefore (or approval, or start) without
    /// evidence that the VM is back is alerted on: logged, counted, shown. Never freed.
    #[serde(default = "default_max_hold", with = "humantime_serde")]
    pub max_hold: Duration,
    /// A VM whose agent missed this many heartbeats (at the interval the agent announces)
    /// counts as down.
    #[serde(default = "default_silent_after")]
    pub silent_after: u32,
    /// An event that lists several VMs waits this long, from its first report, for the
    /// report of each listed VM whose agent is alive or that nobody has spoken for yet,
    /// before it is decided.
    #[serde(default = "default_report_wait", with = "humantime_serde")]
    pub report_wait: Duration,
    /// A file holding the bearer token of `POST /pause`, `/resume` and `/release` (and of
    /// `sched-relay coordinate pause|resume|release`); without it they answer 403.
    #[serde(default)]
    pub admin_token_file: Option<PathBuf>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum Input {
    /// A JetStream durable consumer (the stream must capture `subject`).
    Nats {
        url: String,
        #[serde(default = "default_subject")]
        subject: String,
        /// The subject template the agents publish with: a message whose subject is not it,
        /// for the VM the message speaks for, is refused (with per-VM publish permissions,
        /// no agent can then speak for another VM). Default: `subject`'s root, then
        /// `{vmname}.{transition}` (`scheduledevents.{vmname}.{transition}`).
        #[serde(default)]
        agent_subject: Option<String>,
        /// The JetStream stream (created with `subject` when missing).
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
        /// The routing-key template the agents publish with; a message routed otherwise
        /// for the VM it speaks for is refused (see `agent_subject`).
        #[serde(default = "default_agent_routing_key")]
        agent_routing_key: String,
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
    /// A standby takes over at most this long after the active instance's last renewal.
    /// Unset: the lease bucket's own period where the bucket exists (every instance uses
    /// the same), `default_lease()` (8 s) where this instance makes it.
    #[serde(default, with = "humantime_serde")]
    pub lease: Option<Duration>,
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
/// The periods a lease may have (`ha.lease`, or the one a lease bucket was found with).
pub(crate) const LEASE_RANGE: std::ops::RangeInclusive<Duration> =
    Duration::from_secs(2)..=Duration::from_secs(300);

/// The lease of a bucket made by an instance whose configuration sets none. A bucket made
/// with the earlier default (10 s) keeps its own ([`HaConfig::lease`]).
#[cfg(feature = "nats")]
pub(crate) fn default_lease() -> Duration {
    Duration::from_secs(8)
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
    /// Per EventType: how long its VM is expected down once it starts: a duration,
    /// `"duration"` (the event's DurationInSeconds) or `"until_gone"` (until the VM leaves
    /// the inventory). Shipped: Reboot 10m, Redeploy 15m, Freeze duration, Preempt and
    /// Terminate until_gone, any other type 15m.
    #[serde(default)]
    pub outage: BTreeMap<String, String>,
    /// Maintenance windows for groups that set none (UTC); none: always open.
    #[serde(default)]
    pub windows: Vec<WindowConfig>,
    /// A health gate for groups that set none.
    #[serde(default)]
    pub health: Option<HealthConfig>,
}

/// `[fleet]`: a budget across every group (VMs down anywhere).
#[derive(Debug, Clone, Deserialize, Serialize, Default)]
#[serde(deny_unknown_fields)]
pub struct FleetBudget {
    #[serde(default)]
    pub max_down: Option<u32>,
    /// Of the sum of the groups' sizes.
    #[serde(default)]
    pub max_down_percent: Option<u32>,
}

/// A maintenance window: `days` (`mon`..`sun`, ranges like `mon-fri`; empty: every day),
/// `from` and `to` as `HH:MM` UTC (`to` before `from` runs past midnight).
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct WindowConfig {
    #[serde(default)]
    pub days: Vec<String>,
    pub from: String,
    pub to: String,
}

/// A health gate: after an event is over for a VM, this must pass before the VM's place
/// is freed (like kured waiting for the node to be Ready and uncordoned).
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct HealthConfig {
    /// A command (`{vmname}`, `{eventid}`, `{eventtype}` expanded); exit 0 = healthy.
    #[serde(default)]
    pub command: Option<Vec<String>>,
    /// Or a URL that gets `POST {"vmName", "eventId", "eventType"}`; 2xx = healthy.
    #[serde(default)]
    pub url: Option<String>,
    /// A failed check is tried again after this.
    #[serde(default = "default_health_interval", with = "humantime_serde")]
    pub interval: Duration,
    /// One check may take this long.
    #[serde(default = "default_health_timeout", with = "humantime_serde")]
    pub timeout: Duration,
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
    /// How many VMs the group has, as the operator knows it (a scale set's capacity): a
    /// percentage is of the larger of this and the VMs whose agents are known.
    #[serde(default)]
    pub expected_size: Option<u32>,
    /// Per EventType; types not listed take `[defaults.actions]`, then `never`.
    #[serde(default)]
    pub actions: BTreeMap<String, RuleConfig>,
    /// Per EventType, overriding `[defaults.outage]`.
    #[serde(default)]
    pub outage: BTreeMap<String, String>,
    /// Overrides `[defaults] windows`.
    #[serde(default)]
    pub windows: Option<Vec<WindowConfig>>,
    /// Overrides `[defaults.health]`.
    #[serde(default)]
    pub health: Option<HealthConfig>,
    /// The group's VMs as Azure Resource Manager lists them (`[azure]` says how).
    #[serde(default)]
    pub azure: Option<GroupAzure>,
}

impl Input {
    /// The template (`{vmname}`, `{transition}`, ...) a message's subject or routing key
    /// must match for the VM it speaks for; `None` where the channel cannot name the VM
    /// (Kafka's key is the EventId by default, and its ACLs are per topic).
    pub fn channel_template(&self) -> Option<String> {
        match self {
            Input::Nats {
                subject,
                agent_subject,
                ..
            } => agent_subject.clone().or_else(|| {
                subject
                    .strip_suffix(".>")
                    .map(|root| format!("{root}.{{vmname}}.{{transition}}"))
            }),
            Input::Amqp {
                agent_routing_key, ..
            } => Some(agent_routing_key.clone()),
            Input::Kafka { .. } => None,
        }
    }
}

impl CoordinatorConfig {
    /// The health gate of the policy's group `index` (the last is `default`).
    pub fn health(&self, index: usize) -> Option<&HealthConfig> {
        self.groups
            .get(index)
            .and_then(|g| g.health.as_ref())
            .or(self.defaults.health.as_ref())
    }
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
fn default_silent_after() -> u32 {
    3
}
fn default_report_wait() -> Duration {
    Duration::from_secs(5)
}
fn default_health_interval() -> Duration {
    Duration::from_secs(10)
}
fn default_health_timeout() -> Duration {
    Duration::from_secs(30)
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
fn default_agent_routing_key() -> String {
    "{vmname}.{transition}".into()
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
