//! Loading `coordinator.toml` and checking it whole: every problem with its key path, then
//! the decision policy built from the groups.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use figment::Figment;
use figment::providers::{Env, Format, Toml};

use super::{CoordinatorConfig, ENV_PREFIX, HealthConfig, RuleConfig, WindowConfig, problem};
use crate::config::{ConfigErrors, ConfigProblem};
use crate::coordinator::policy::{Action, Budget, Group, Matcher, Outage, Policy, Rule, Window};
use crate::sinks::SinkKind;

impl CoordinatorConfig {
    /// Loads `path`, applies `SCHED_RELAY_COORDINATOR_*` overrides and validates.
    pub fn load(path: &Path) -> Result<(CoordinatorConfig, Policy), ConfigErrors> {
        Self::load_with(path, Env::prefixed(ENV_PREFIX))
    }

    /// Loads and validates `path` alone, with no environment overrides (the fleet demo's
    /// file, which a shell's `SCHED_RELAY_COORDINATOR_*` settings must not change).
    pub fn load_file_only(path: &Path) -> Result<(CoordinatorConfig, Policy), ConfigErrors> {
        Self::load_with(path, Env::prefixed(ENV_PREFIX).filter(|_| false))
    }

    pub(in crate::coordinator) fn load_with(
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
            (
                "report_wait",
                general.report_wait,
                Duration::ZERO,
                Duration::from_secs(300),
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
        if let Some(ha) = &self.ha {
            if !cfg!(feature = "nats") {
                problems.push(problem(
                    "ha",
                    "this sched-relay was built without NATS support",
                ));
            }
            if let Some(lease) = ha.lease
                && !super::LEASE_RANGE.contains(&lease)
            {
                problems.push(problem(
                    "ha.lease",
                    format!("{} is outside 2s..5m", humantime::format_duration(lease)),
                ));
            }
            if ha.bucket.is_empty()
                || !ha
                    .bucket
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
            {
                problems.push(problem(
                    "ha.bucket",
                    format!("{:?}: letters, digits, - and _ only", ha.bucket),
                ));
            }
        }
        if general.max_attempts == 0 {
            problems.push(problem("coordinator.max_attempts", "must be at least 1"));
        }
        if !(1..=100).contains(&general.silent_after) {
            problems.push(problem(
                "coordinator.silent_after",
                format!("{} heartbeats is outside 1..100", general.silent_after),
            ));
        }
        let routed_by_name = match &self.approvals {
            SinkKind::Nats(nats) => Some(("subject", nats.subject.contains("{vmname}"))),
            SinkKind::Amqp(amqp) => Some(("routing_key", amqp.routing_key.contains("{vmname}"))),
            _ => None,
        };
        if let Some((key, false)) = routed_by_name {
            problems.push(problem(
                format!("approvals.{key}"),
                "must contain {vmname}: each VM's agent reads only its own approvals (scheduledapprovals.{vmname})",
            ));
        }
        if let Some(template) = self.input.channel_template()
            && !template.contains("{vmname}")
        {
            problems.push(problem(
                match self.input {
                    super::Input::Amqp { .. } => "input.agent_routing_key",
                    _ => "input.agent_subject",
                },
                format!("{template:?} must contain {{vmname}}: the channel must name the VM a message speaks for"),
            ));
        }
        // The NATS sink's default subject is the events' one: approvals sent there reach no
        // agent (they read scheduledapprovals.<vm>).
        if let SinkKind::Nats(nats) = &self.approvals
            && nats.subject.contains("{transition}")
        {
            problems.push(problem(
                "approvals.subject",
                format!(
                    "{:?} is an events subject; set the subject the agents read their approvals on (scheduledapprovals.{{vmname}})",
                    nats.subject
                ),
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
        let outages = |table: &BTreeMap<String, String>,
                       at: &str,
                       problems: &mut Vec<ConfigProblem>|
         -> BTreeMap<String, Outage> {
            let mut outages = BTreeMap::new();
            for (event_type, text) in table {
                let outage = match text.as_str() {
                    "duration" => Outage::EventDuration,
                    "until_gone" => Outage::UntilGone,
                    other => match humantime::parse_duration(other) {
                        Ok(duration) if duration > Duration::ZERO => Outage::For(duration),
                        _ => {
                            problems.push(problem(
                                format!("{at}.{event_type}"),
                                format!("{other:?}: expected a duration (\"10m\"), \"duration\" (the event's DurationInSeconds) or \"until_gone\""),
                            ));
                            continue;
                        }
                    },
                };
                if outages
                    .insert(event_type.to_ascii_lowercase(), outage)
                    .is_some()
                {
                    problems.push(problem(
                        format!("{at}.{event_type}"),
                        "names an EventType already given (types compare ignoring case)",
                    ));
                }
            }
            outages
        };
        let windows =
            |list: &[WindowConfig], at: &str, problems: &mut Vec<ConfigProblem>| -> Vec<Window> {
                list.iter()
                    .enumerate()
                    .filter_map(|(i, w)| {
                        Window::parse(&w.days, &w.from, &w.to)
                            .map_err(|why| problems.push(problem(format!("{at}[{i}]"), why)))
                            .ok()
                    })
                    .collect()
            };
        let health = |gate: &Option<HealthConfig>, at: &str, problems: &mut Vec<ConfigProblem>| {
            let Some(gate) = gate else { return };
            match (&gate.command, &gate.url) {
                (Some(_), Some(_)) => problems.push(problem(at, "set command or url, not both")),
                (None, None) => problems.push(problem(
                    at,
                    "set command = [\"/usr/local/bin/healthy\", \"{vmname}\"] or url = \"https://...\"",
                )),
                (Some(command), None) if command.is_empty() => {
                    problems.push(problem(format!("{at}.command"), "must name a program"))
                }
                (None, Some(url)) if url::Url::parse(url).is_err() => problems.push(problem(
                    format!("{at}.url"),
                    format!("{url:?} is not a URL"),
                )),
                _ => {}
            }
            for (key, value) in [("interval", gate.interval), ("timeout", gate.timeout)] {
                if value < Duration::from_secs(1) || value > Duration::from_secs(3600) {
                    problems.push(problem(
                        format!("{at}.{key}"),
                        format!("{} is outside 1s..1h", humantime::format_duration(value)),
                    ));
                }
            }
        };
        let default_outages = outages(&self.defaults.outage, "defaults.outage", &mut problems);
        let default_windows = windows(&self.defaults.windows, "defaults.windows", &mut problems);
        health(&self.defaults.health, "defaults.health", &mut problems);
        let fleet_budget = match &self.fleet {
            Some(fleet) => {
                let budget = budget(
                    fleet.max_down,
                    fleet.max_down_percent,
                    "fleet",
                    &mut problems,
                );
                if budget.is_none() {
                    problems.push(problem("fleet", "set max_down or max_down_percent"));
                }
                budget
            }
            None => None,
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
            if group.name.trim().is_empty()
                || group.name == crate::coordinator::policy::DEFAULT_GROUP
            {
                problems.push(problem(
                    format!("{at}.name"),
                    format!("{:?}: give each group a name of its own (\"{}\" is the group of VMs no group matches)", group.name, crate::coordinator::policy::DEFAULT_GROUP),
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
            if matcher.is_empty() && group.azure.is_none() {
                problems.push(problem(
                    at.clone(),
                    "matches nothing: set vm_name, resource_group, scale_set or azure.source",
                ));
            }
            let mut rules = default_actions.clone();
            rules.extend(actions(
                &group.actions,
                &format!("{at}.actions"),
                &mut problems,
            ));
            let mut group_outages = default_outages.clone();
            group_outages.extend(outages(
                &group.outage,
                &format!("{at}.outage"),
                &mut problems,
            ));
            health(&group.health, &format!("{at}.health"), &mut problems);
            groups.push(Group {
                name: group.name.clone(),
                matcher,
                budget: budget(group.max_down, group.max_down_percent, &at, &mut problems)
                    .unwrap_or(default_budget),
                expected_size: group.expected_size,
                rules,
                outages: group_outages,
                windows: match &group.windows {
                    Some(list) => windows(list, &format!("{at}.windows"), &mut problems),
                    None => default_windows.clone(),
                },
                gated: group.health.is_some() || self.defaults.health.is_some(),
                azure: group.azure.is_some(),
                approve_via: group
                    .azure
                    .as_ref()
                    .map(|a| a.approve_via)
                    .unwrap_or_default(),
            });
        }
        self.check_azure(&mut problems);
        groups.push(Group {
            name: crate::coordinator::policy::DEFAULT_GROUP.into(),
            matcher: Matcher::default(),
            budget: default_budget,
            expected_size: None,
            rules: default_actions,
            outages: default_outages,
            windows: default_windows,
            gated: self.defaults.health.is_some(),
            azure: false,
            approve_via: Default::default(),
        });
        if problems.is_empty() {
            let duration = |d: Duration| chrono::Duration::from_std(d).expect("bounded above");
            Ok(Policy {
                groups,
                fleet_budget,
                min_lead: duration(self.coordinator.min_lead),
                max_hold: duration(self.coordinator.max_hold),
                silent_after: self.coordinator.silent_after,
                report_wait: duration(self.coordinator.report_wait),
                memo: Default::default(),
                approve_failed_drains: self
                    .drain
                    .as_ref()
                    .is_some_and(|d| d.on_failure == super::OnFailure::Approve),
            })
        } else {
            Err(ConfigErrors(problems))
        }
    }
}
