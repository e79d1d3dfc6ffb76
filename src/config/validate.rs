//! Validation of a whole configuration, without touching the network: each section checks
//! itself (its owner's `validate`), and the checks that span sections live here. Every
//! problem is reported at once, with its key path.

use super::{Config, ConfigProblem, problem};

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
        problems.extend(self.sinks_problems());
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
