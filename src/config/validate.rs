//! Validation of a whole configuration, without touching the network: each section checks
//! itself (its owner's `validate`), and the checks that span sections live here. Every
//! problem is reported at once, with its key path.

use super::{Config, ConfigProblem, problem};

/// The first api-version whose events carry `EventSource`.
const EVENT_SOURCE_SINCE: &str = "2019-08-01";
/// The first api-version whose events carry `DurationInSeconds`.
const DURATION_SINCE: &str = "2020-07-01";

impl Config {
    /// Every problem with an extracted configuration, in the order of the sections.
    pub fn validate(&self) -> Vec<ConfigProblem> {
        let mut problems = Vec::new();
        let mut section = |name: &str, found: Vec<(String, String)>| {
            for (key, message) in found {
                problems.push(problem(format!("{name}.{key}"), message));
            }
        };
        section("imds", self.imds.validate());
        section("identity", self.identity.validate());
        section("events", self.events.validate());
        section("state", self.state.validate());
        section("policy", self.policy.validate());
        section("delivery", self.delivery.validate());
        section("log", self.log.validate());
        section("approvals", self.approvals.validate(&self.sinks));
        problems.extend(self.http_approvals_problems());
        problems.extend(self.telemetry_problems());
        problems.extend(self.sinks_problems());
        problems
    }

    /// What the agent accepts but an operator should know, one line per key: said by
    /// `check-config` and logged at WARN when the agent starts. These are not refused, so that
    /// a configuration that ran before an upgrade keeps the agent relaying events after it.
    pub fn warnings(&self) -> Vec<ConfigProblem> {
        let mut warnings = self.policy_api_version_warnings();
        if self.imds.max_backoff > crate::imds::pacing::MAX_ERROR_BACKOFF {
            warnings.push(problem(
                "imds.max_backoff",
                format!(
                    "{} is above 5s, the most the agent waits between polls while the metadata service fails (a Spot VM's eviction notice is 30 s): 5s is used; set it to 5s or less",
                    humantime::format_duration(self.imds.max_backoff)
                ),
            ));
        }
        let identity = &self.identity;
        if !identity.from_metadata && identity.vm_name.is_none() && !identity.hostname_fallback {
            warnings.push(problem(
                "identity.vm_name",
                "is not set and from_metadata = false: the hostname names this VM, which on a scale set is not the name in Resources (vmss000001, not vmss_1); set vm_name, or hostname_fallback = true to say the hostname is right",
            ));
        }
        warnings
    }

    /// A policy rule that reads a field the configured api-version does not return would
    /// silently never fire: say so, naming the version that has the field.
    fn policy_api_version_warnings(&self) -> Vec<ConfigProblem> {
        let version = self.imds.api_version.as_str();
        // A malformed version is reported by [imds] itself.
        if !crate::imds::is_api_version(version) {
            return Vec::new();
        }
        let rules = [
            (
                self.policy.approve_user_initiated,
                "approve_user_initiated",
                "EventSource",
                EVENT_SOURCE_SINCE,
            ),
            (
                self.policy.approve_freeze_max_seconds.is_some(),
                "approve_freeze_max_seconds",
                "DurationInSeconds",
                DURATION_SINCE,
            ),
        ];
        rules
            .into_iter()
            .filter(|(enabled, _, _, since)| *enabled && version < *since)
            .map(|(_, key, field, since)| {
                problem(
                    format!("policy.{key}"),
                    format!(
                        "needs {field}, which imds.api_version {version} does not return, so the rule never fires; set imds.api_version to {since} or later, or remove policy.{key}"
                    ),
                )
            })
            .collect()
    }

    /// The listener's limits must let it serve at all.
    fn telemetry_problems(&self) -> Vec<ConfigProblem> {
        let mut problems = Vec::new();
        if self.telemetry.max_connections == 0 {
            problems.push(problem(
                "telemetry.max_connections",
                "0 would refuse every connection; expected at least 1 (default 256)",
            ));
        }
        if self.telemetry.request_timeout.is_zero() {
            problems.push(problem(
                "telemetry.request_timeout",
                "0s would close every connection before its request; expected a duration such as \"10s\"",
            ));
        }
        if let Err(error) = crate::http::tls_acceptor(&self.telemetry) {
            problems.push(problem("telemetry.tls_cert_file", error));
        }
        problems
    }

    /// `POST /approvals` is served by the `[telemetry]` listener, and off loopback it needs a
    /// bearer token.
    fn http_approvals_problems(&self) -> Vec<ConfigProblem> {
        let Some(http) = self.approvals.http.as_ref().filter(|http| http.enabled) else {
            return Vec::new();
        };
        match self.telemetry.listen {
            None => vec![problem(
                "approvals.http",
                "POST /approvals needs the listener: set telemetry.listen (e.g. \"127.0.0.1:9464\")",
            )],
            Some(listen)
                if !listen.ip().is_loopback()
                    && http.token.is_none()
                    && http.token_file.is_none() =>
            {
                vec![problem(
                    "approvals.http.token",
                    format!(
                        "telemetry.listen {listen} is not loopback, so POST /approvals needs a bearer token (token or token_file)"
                    ),
                )]
            }
            Some(_) => Vec::new(),
        }
    }

    /// At least one sink, unique valid names, and each sink's own settings.
    fn sinks_problems(&self) -> Vec<ConfigProblem> {
        let mut problems = Vec::new();
        if self.sinks.is_empty() {
            problems.push(problem(
                "sinks",
                "is empty; add at least one [[sinks]] entry",
            ));
        }
        for (index, sink) in self.sinks.iter().enumerate() {
            let path = format!("sinks[{index}]");
            let valid_name = !sink.name.is_empty()
                && sink
                    .name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
            if !valid_name {
                problems.push(problem(
                    format!("{path}.name"),
                    format!(
                        "{:?} must be non-empty letters, digits, '-' or '_'",
                        sink.name
                    ),
                ));
            }
            if self.sinks[..index]
                .iter()
                .any(|other| other.name == sink.name)
            {
                problems.push(problem(
                    format!("{path}.name"),
                    format!(
                        "{:?} is used by an earlier sink; names must be unique",
                        sink.name
                    ),
                ));
            }
            for (key, message) in sink.kind.validate() {
                problems.push(problem(format!("{path}.{key}"), message));
            }
        }
        problems
    }
}
