//! `coordinator.toml`: where the fleet's events come from, where approvals go, the signing
//! key, the drain hook and the groups with their budgets and actions. Loaded like the agent's
//! configuration (a TOML file, then `SCHED_RELAY_COORDINATOR_<SECTION>__<KEY>` overrides)
//! and validated in one pass that reports every problem with its key path.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use figment::Figment;
use figment::providers::{Env, Format, Toml};
use serde::{Deserialize, Serialize};

use super::policy::{Action, Budget, Group, Matcher, Policy, Rule};
use crate::config::{ConfigErrors, ConfigProblem};
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

impl CoordinatorConfig {
    /// Loads `path`, applies `SCHED_RELAY_COORDINATOR_*` overrides and validates.
    pub fn load(path: &Path) -> Result<(CoordinatorConfig, Policy), ConfigErrors> {
        Self::load_with(path, Env::prefixed(ENV_PREFIX))
    }

    pub(super) fn load_with(
        path: &Path,
        env: Env,
    ) -> Result<(CoordinatorConfig, Policy), ConfigErrors> {
        if !path.is_file() {
            return Err(ConfigErrors(vec![problem(
                "--config",
                format!("{} does not exist or is not a file", path.display()),
            )]));
        }
        let config: CoordinatorConfig = Figment::new()
            .merge(Toml::file_exact(path))
            .merge(env.split("__"))
            .extract()
            .map_err(|errors| {
                ConfigErrors(
                    errors
                        .into_iter()
                        .map(|e| {
                            let path = if e.path.is_empty() {
                                "config".to_owned()
                            } else {
                                e.path.join(".")
                            };
                            problem(path, e.kind.to_string())
                        })
                        .collect(),
                )
            })?;
        let policy = config.policy()?;
        Ok((config, policy))
    }

    /// Checks everything and builds the decision policy, or says every problem.
    pub fn policy(&self) -> Result<Policy, ConfigErrors> {
        let mut problems = Vec::new();
        for (key, message) in self.approvals.validate() {
            problems.push(problem(format!("approvals.{key}"), message));
        }
        if matches!(self.approvals, SinkKind::File(_) | SinkKind::Stdout(_))
            && !self.coordinator.dry_run
        {
            problems.push(problem(
                "approvals.kind",
                "no agent reads approvals from a file or stdout; use nats, amqp, kafka or webhook (or dry_run = true)",
            ));
        }
        let general = &self.coordinator;
        let hour = Duration::from_secs(3600);
        let day = 24 * hour;
        for (key, value, low, high) in [
            (
                "tick",
                general.tick,
                Duration::from_millis(50),
                Duration::from_secs(60),
            ),
            (
                "outcome_timeout",
                general.outcome_timeout,
                Duration::from_secs(1),
                hour,
            ),
            ("min_lead", general.min_lead, Duration::ZERO, hour),
            ("forget_after", general.forget_after, hour, 30 * day),
            (
                "max_hold",
                general.max_hold,
                Duration::from_secs(60),
                7 * day,
            ),
        ] {
            if value < low || value > high {
                problems.push(problem(
                    format!("coordinator.{key}"),
                    format!(
                        "{} is outside {}..{}",
                        humantime::format_duration(value),
                        humantime::format_duration(low),
                        humantime::format_duration(high)
                    ),
                ));
            }
        }
        if general.max_attempts == 0 {
            problems.push(problem("coordinator.max_attempts", "must be at least 1"));
        }
        let routed_by_name = match &self.approvals {
            SinkKind::Nats(nats) => Some(("subject", nats.subject.contains("{vmname}"))),
            SinkKind::Amqp(amqp) => Some(("routing_key", amqp.routing_key.contains("{vmname}"))),
            _ => None,
        };
        if let Some((key, false)) = routed_by_name {
            problems.push(problem(
                format!("approvals.{key}"),
                "must contain {vmname}: each VM's agent reads only its own approvals (scheduledevents.approvals.{vmname})",
            ));
        }
        if self.signing.key_id.trim().is_empty() {
            problems.push(problem(
                "signing.key_id",
                "must name the key as the agents' [[approvals.keys]] entry does",
            ));
        }
        if let Some(drain) = &self.drain {
            match (&drain.command, &drain.url) {
                (Some(_), Some(_)) => problems.push(problem(
                    "drain",
                    "set command or url, not both",
                )),
                (None, None) => problems.push(problem(
                    "drain",
                    "set command = [\"/usr/local/bin/drain\", \"{vmname}\"] or url = \"https://...\"",
                )),
                (Some(command), None) if command.is_empty() => {
                    problems.push(problem("drain.command", "must name a program"))
                }
                _ if drain.margin > Duration::from_secs(24 * 3600) => {
                    problems.push(problem("drain.margin", "must be at most a day"))
                }
                (None, Some(url)) if url::Url::parse(url).is_err() => {
                    problems.push(problem("drain.url", format!("{url:?} is not a URL")))
                }
                _ => {}
            }
        }
        let actions = |table: &BTreeMap<String, RuleConfig>,
                       at: &str,
                       problems: &mut Vec<ConfigProblem>|
         -> BTreeMap<String, Rule> {
            let mut rules = BTreeMap::new();
            for (event_type, rule) in table {
                let rule = match rule {
                    RuleConfig::Action(action) => Rule {
                        action: *action,
                        max_duration: None,
                    },
                    RuleConfig::Rule {
                        action,
                        max_duration,
                    } => Rule {
                        action: *action,
                        max_duration: *max_duration,
                    },
                };
                if rule.action == Action::DrainThenApprove && self.drain.is_none() {
                    problems.push(problem(
                        format!("{at}.{event_type}"),
                        "drain_then_approve needs a [drain] section (a command or a url)",
                    ));
                }
                if rules
                    .insert(event_type.to_ascii_lowercase(), rule)
                    .is_some()
                {
                    problems.push(problem(
                        format!("{at}.{event_type}"),
                        "names an EventType already given (types compare ignoring case)",
                    ));
                }
            }
            rules
        };
        let budget = |max_down: Option<u32>,
                      percent: Option<u32>,
                      at: &str,
                      problems: &mut Vec<ConfigProblem>| {
            match (max_down, percent) {
                (Some(_), Some(_)) => {
                    problems.push(problem(at, "set max_down or max_down_percent, not both"));
                    None
                }
                (Some(count), None) => Some(Budget::Count(count)),
                (None, Some(percent)) if percent > 100 => {
                    problems.push(problem(
                        format!("{at}.max_down_percent"),
                        format!("{percent} is not a percentage (0 to 100)"),
                    ));
                    None
                }
                (None, Some(percent)) => Some(Budget::Percent(percent)),
                (None, None) => None,
            }
        };
        // A type no group and no default names is never approved: NotBefore decides.
        let default_actions = actions(&self.defaults.actions, "defaults.actions", &mut problems);
        let default_budget = budget(
            self.defaults.max_down,
            self.defaults.max_down_percent,
            "defaults",
            &mut problems,
        )
        .unwrap_or(Budget::Count(1));
        let mut groups = Vec::new();
        for (index, group) in self.groups.iter().enumerate() {
            let at = format!("groups[{index}]");
            if group.name.trim().is_empty() || group.name == super::policy::DEFAULT_GROUP {
                problems.push(problem(
                    format!("{at}.name"),
                    format!("{:?}: give each group a name of its own (\"{}\" is the group of VMs no group matches)", group.name, super::policy::DEFAULT_GROUP),
                ));
            }
            if self.groups[..index].iter().any(|g| g.name == group.name) {
                problems.push(problem(
                    format!("{at}.name"),
                    format!("{:?} is the name of an earlier group too", group.name),
                ));
            }
            let matcher = Matcher {
                vm_name: group.vm_name.clone(),
                resource_group: group.resource_group.clone(),
                scale_set: group.scale_set.clone(),
            };
            if matcher.is_empty() {
                problems.push(problem(
                    at.clone(),
                    "matches nothing: set vm_name, resource_group or scale_set",
                ));
            }
            let mut rules = default_actions.clone();
            rules.extend(actions(
                &group.actions,
                &format!("{at}.actions"),
                &mut problems,
            ));
            groups.push(Group {
                name: group.name.clone(),
                matcher,
                budget: budget(group.max_down, group.max_down_percent, &at, &mut problems)
                    .unwrap_or(default_budget),
                rules,
            });
        }
        groups.push(Group {
            name: super::policy::DEFAULT_GROUP.into(),
            matcher: Matcher::default(),
            budget: default_budget,
            rules: default_actions,
        });
        if problems.is_empty() {
            let duration = |d: Duration| chrono::Duration::from_std(d).expect("bounded above");
            Ok(Policy {
                groups,
                min_lead: duration(self.coordinator.min_lead),
                max_hold: duration(self.coordinator.max_hold),
            })
        } else {
            Err(ConfigErrors(problems))
        }
    }
}

fn problem(path: impl Into<String>, message: impl Into<String>) -> ConfigProblem {
    ConfigProblem {
        path: path.into(),
        message: message.into(),
    }
}
