//! The agent's configuration: loaded with figment from a TOML file, then overridden by
//! `SCHED_RELAY_<SECTION>__<KEY>` environment variables, then validated in one pure step that
//! reports every problem at once with its key path. `config/reference.toml` documents each key.

use std::path::{Path, PathBuf};
use std::time::Duration;

use figment::Figment;
use figment::providers::{Env, Format, Toml};
use sched_relay_file::{StdoutFormat, StdoutSinkConfig};
use serde::{Deserialize, Serialize};

use crate::approval::config::ApprovalsConfig;
use crate::imds::DEFAULT_LEASE_PATHS;
use crate::sinks::{SinkEntry, SinkKind};
use sched_relay_core::event::EventsConfig;
use sched_relay_core::policy::PolicyConfig;

/// Where `run` and `check-config` look when no `--config` is given.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/sched-relay/config.toml";
/// The prefix of environment overrides.
pub const ENV_PREFIX: &str = "SCHED_RELAY_";
/// The metadata service allows about 5 requests per second per VM.
pub const MIN_POLL_INTERVAL: Duration = Duration::from_millis(200);

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub imds: ImdsConfig,
    #[serde(default)]
    pub identity: IdentityConfig,
    #[serde(default)]
    pub events: EventsConfig,
    #[serde(default)]
    pub state: StateConfig,
    #[serde(default)]
    pub policy: PolicyConfig,
    #[serde(default)]
    pub delivery: DeliveryConfig,
    #[serde(default)]
    pub log: LogConfig,
    #[serde(default)]
    pub telemetry: TelemetryConfig,
    #[serde(default)]
    pub approvals: ApprovalsConfig,
    /// Where events go. Without any entry, events are printed on stdout as JSON Lines.
    #[serde(default = "default_sinks")]
    pub sinks: Vec<SinkEntry>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            imds: ImdsConfig::default(),
            identity: IdentityConfig::default(),
            events: EventsConfig::default(),
            state: StateConfig::default(),
            policy: PolicyConfig::default(),
            delivery: DeliveryConfig::default(),
            log: LogConfig::default(),
            telemetry: TelemetryConfig::default(),
            approvals: ApprovalsConfig::default(),
            sinks: default_sinks(),
        }
    }
}

fn default_sinks() -> Vec<SinkEntry> {
    vec![SinkEntry {
        name: "stdout".into(),
        kind: SinkKind::Stdout(StdoutSinkConfig {
            format: StdoutFormat::Json,
        }),
    }]
}

/// `[imds]`: the metadata service and how it is polled.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ImdsConfig {
    /// Base URL of the metadata service, or `"discover"` for VMs outside a VNet.
    #[serde(default = "default_endpoint")]
    pub endpoint: String,
    #[serde(default = "default_api_version")]
    pub api_version: String,
    #[serde(default = "default_poll_interval", with = "humantime_serde")]
    pub poll_interval: Duration,
    #[serde(default = "default_request_timeout", with = "humantime_serde")]
    pub request_timeout: Duration,
    #[serde(default = "default_first_call_timeout", with = "humantime_serde")]
    pub first_call_timeout: Duration,
    #[serde(default = "default_max_backoff", with = "humantime_serde")]
    pub max_backoff: Duration,
    #[serde(default = "default_lease_paths")]
    pub lease_paths: Vec<PathBuf>,
}

impl Default for ImdsConfig {
    fn default() -> Self {
        ImdsConfig {
            endpoint: default_endpoint(),
            api_version: default_api_version(),
            poll_interval: default_poll_interval(),
            request_timeout: default_request_timeout(),
            first_call_timeout: default_first_call_timeout(),
            max_backoff: default_max_backoff(),
            lease_paths: default_lease_paths(),
        }
    }
}

fn default_endpoint() -> String {
    "http://169.254.169.254".into()
}
fn default_api_version() -> String {
    "2020-07-01".into()
}
fn default_poll_interval() -> Duration {
    Duration::from_secs(1)
}
fn default_request_timeout() -> Duration {
    Duration::from_secs(10)
}
fn default_first_call_timeout() -> Duration {
    Duration::from_secs(150)
}
fn default_max_backoff() -> Duration {
    Duration::from_secs(30)
}
fn default_lease_paths() -> Vec<PathBuf> {
    DEFAULT_LEASE_PATHS.iter().map(PathBuf::from).collect()
}

/// `[identity]`: who this VM is. Unset keys come from `/metadata/instance/compute`, then the
/// hostname.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct IdentityConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vm_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vm_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource_id: Option<String>,
    /// The CloudEvents `source`; default the resource id, else `urn:sched-relay:vm:<name>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    #[serde(default = "default_true")]
    pub from_metadata: bool,
}

impl Default for IdentityConfig {
    fn default() -> Self {
        IdentityConfig {
            vm_name: None,
            vm_id: None,
            resource_id: None,
            source: None,
            from_metadata: true,
        }
    }
}

fn default_true() -> bool {
    true
}

/// `[state]`: where the agent keeps what must survive it.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct StateConfig {
    #[serde(default = "default_state_dir")]
    pub dir: PathBuf,
}

impl Default for StateConfig {
    fn default() -> Self {
        StateConfig {
            dir: default_state_dir(),
        }
    }
}

fn default_state_dir() -> PathBuf {
    PathBuf::from("/var/lib/sched-relay")
}

/// `[delivery]`: queues, batches and retries of the fan-out, for every sink.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DeliveryConfig {
    #[serde(default = "default_queue_capacity")]
    pub queue_capacity: usize,
    #[serde(default = "default_batch_size")]
    pub batch_size: usize,
    #[serde(default = "default_retry_initial", with = "humantime_serde")]
    pub retry_initial: Duration,
    #[serde(default = "default_retry_max", with = "humantime_serde")]
    pub retry_max: Duration,
    #[serde(default = "default_shutdown_timeout", with = "humantime_serde")]
    pub shutdown_timeout: Duration,
}

impl Default for DeliveryConfig {
    fn default() -> Self {
        DeliveryConfig {
            queue_capacity: default_queue_capacity(),
            batch_size: default_batch_size(),
            retry_initial: default_retry_initial(),
            retry_max: default_retry_max(),
            shutdown_timeout: default_shutdown_timeout(),
        }
    }
}

fn default_queue_capacity() -> usize {
    10_000
}
fn default_batch_size() -> usize {
    100
}
fn default_retry_initial() -> Duration {
    Duration::from_millis(200)
}
fn default_retry_max() -> Duration {
    Duration::from_secs(30)
}
fn default_shutdown_timeout() -> Duration {
    Duration::from_secs(10)
}

/// `[log]`.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct LogConfig {
    /// A tracing filter (`info`, `sched_relay=debug,warn`); RUST_LOG wins when set.
    #[serde(default = "default_log_level")]
    pub level: String,
    #[serde(default)]
    pub format: LogFormat,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            level: default_log_level(),
            format: LogFormat::default(),
        }
    }
}

fn default_log_level() -> String {
    "info".into()
}

#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq, Default, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines on stderr.
    #[default]
    Pretty,
    /// One JSON object per line on stderr, for log shippers.
    Json,
}

/// `[telemetry]`: the agent's own HTTP listener (`/healthz`, `POST /approvals`). Off unless
/// `listen` is set; keep it on loopback unless something outside the VM must reach it.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TelemetryConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub listen: Option<std::net::SocketAddr>,
}

/// One thing wrong with a configuration: where, and what is expected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigProblem {
    pub path: String,
    pub message: String,
}

impl std::fmt::Display for ConfigProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

/// Every problem found while loading and validating.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{} configuration problem(s):\n{}", .0.len(), .0.iter().map(|p| format!("  {p}")).collect::<Vec<_>>().join("\n"))]
pub struct ConfigErrors(pub Vec<ConfigProblem>);

fn problem(path: impl Into<String>, message: impl Into<String>) -> ConfigProblem {
    ConfigProblem {
        path: path.into(),
        message: message.into(),
    }
}

impl Config {
    /// Loads `path` (or the default path when it exists), applies environment overrides and
    /// validates the result.
    pub fn load(path: Option<&Path>) -> Result<Config, ConfigErrors> {
        Config::load_with_env(path, Env::prefixed(ENV_PREFIX))
    }

    fn load_with_env(path: Option<&Path>, env: Env) -> Result<Config, ConfigErrors> {
        let mut figment = Figment::new();
        match path {
            Some(path) if !path.is_file() => {
                return Err(ConfigErrors(vec![problem(
                    "--config",
                    format!("{} does not exist or is not a file", path.display()),
                )]));
            }
            Some(path) => figment = figment.merge(Toml::file_exact(path)),
            None if Path::new(DEFAULT_CONFIG_PATH).is_file() => {
                figment = figment.merge(Toml::file_exact(DEFAULT_CONFIG_PATH))
            }
            None => {}
        }
        // SCHED_RELAY_CONFIG names the file itself (clap reads it); it is not a key.
        let figment = figment.merge(env.split("__").ignore(&["config"]));
        let config = extract_all(&figment)?;
        let problems = config.validate();
        if problems.is_empty() {
            Ok(config)
        } else {
            Err(ConfigErrors(problems))
        }
    }

    /// Every problem with an extracted configuration, without touching the network.
    pub fn validate(&self) -> Vec<ConfigProblem> {
        let mut problems = Vec::new();
        let imds = &self.imds;
        if imds.endpoint != "discover" {
            match url::Url::parse(&imds.endpoint) {
                Ok(url) if matches!(url.scheme(), "http" | "https") && url.has_host() => {}
                _ => problems.push(problem(
                    "imds.endpoint",
                    format!(
                        "{:?} is not an http(s) URL; expected e.g. \"http://169.254.169.254\" or \"discover\"",
                        imds.endpoint
                    ),
                )),
            }
        }
        if !is_api_version(&imds.api_version) {
            problems.push(problem(
                "imds.api_version",
                format!(
                    "{:?} is not an api-version; expected a date from 2017-03-01 on, e.g. \"2020-07-01\"",
                    imds.api_version
                ),
            ));
        }
        if imds.poll_interval < MIN_POLL_INTERVAL || imds.poll_interval > Duration::from_secs(60) {
            problems.push(problem(
                "imds.poll_interval",
                format!(
                    "{} is outside 200ms..60s (the service allows ~5 requests/s, and Preempt notices are 30 s)",
                    humantime::format_duration(imds.poll_interval)
                ),
            ));
        }
        if imds.request_timeout.is_zero() {
            problems.push(problem("imds.request_timeout", "must be more than 0s"));
        }
        if imds.first_call_timeout < imds.request_timeout {
            problems.push(problem(
                "imds.first_call_timeout",
                "must be at least imds.request_timeout (the first call may take up to 2 minutes)",
            ));
        }
        if imds.max_backoff < imds.poll_interval {
            problems.push(problem(
                "imds.max_backoff",
                "must be at least imds.poll_interval",
            ));
        }
        for (key, value) in [
            ("identity.vm_name", &self.identity.vm_name),
            ("identity.source", &self.identity.source),
        ] {
            if value.as_deref().is_some_and(|v| v.trim().is_empty()) {
                problems.push(problem(key, "is empty; remove the key to use the default"));
            }
        }
        if self.events.type_prefix.is_empty()
            || self.events.type_prefix.contains(char::is_whitespace)
        {
            problems.push(problem(
                "events.type_prefix",
                format!(
                    "{:?} must be a non-empty reverse-DNS name without spaces",
                    self.events.type_prefix
                ),
            ));
        }
        if self.state.dir.as_os_str().is_empty() {
            problems.push(problem("state.dir", "must name a directory"));
        }
        if self
            .policy
            .approve_freeze_max_seconds
            .is_some_and(|max| max < 0)
        {
            problems.push(problem(
                "policy.approve_freeze_max_seconds",
                "must be 0 or more (seconds of Freeze to approve)",
            ));
        }
        for (index, event_type) in self.policy.approve_event_types.iter().enumerate() {
            if event_type.trim().is_empty() {
                problems.push(problem(
                    format!("policy.approve_event_types[{index}]"),
                    "is empty; expected an EventType such as \"Preempt\"",
                ));
            }
        }
        let delivery = &self.delivery;
        if delivery.queue_capacity == 0 {
            problems.push(problem("delivery.queue_capacity", "must be at least 1"));
        }
        if delivery.batch_size == 0 {
            problems.push(problem("delivery.batch_size", "must be at least 1"));
        }
        if delivery.retry_initial.is_zero() || delivery.retry_max < delivery.retry_initial {
            problems.push(problem(
                "delivery.retry_max",
                "expected 0 < delivery.retry_initial <= delivery.retry_max",
            ));
        }
        if tracing_subscriber::EnvFilter::try_new(&self.log.level).is_err() {
            problems.push(problem(
                "log.level",
                format!("{:?} is not a log filter; expected e.g. \"info\" or \"sched_relay=debug,warn\"", self.log.level),
            ));
        }
        for (key, message) in self.approvals.validate(&self.sinks) {
            problems.push(problem(format!("approvals.{key}"), message));
        }
        if let Some(http) = &self.approvals.http
            && http.enabled
        {
            match self.telemetry.listen {
                None => problems.push(problem(
                    "approvals.http",
                    "POST /approvals needs the listener: set telemetry.listen (e.g. \"127.0.0.1:9464\")",
                )),
                Some(listen)
                    if !listen.ip().is_loopback()
                        && http.token.is_none()
                        && http.token_file.is_none() =>
                {
                    problems.push(problem(
                        "approvals.http.token",
                        format!("telemetry.listen {listen} is not loopback, so POST /approvals needs a bearer token (token or token_file)"),
                    ))
                }
                Some(_) => {}
            }
        }
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

    /// The effective configuration as TOML, with every secret replaced by `<redacted>`.
    pub fn to_redacted_toml(&self) -> String {
        let mut value = toml::Value::try_from(self).expect("the configuration serializes");
        redact(&mut value);
        toml::to_string_pretty(&value).expect("a TOML value prints")
    }
}

fn is_api_version(version: &str) -> bool {
    chrono::NaiveDate::parse_from_str(version, "%Y-%m-%d").is_ok()
        && version.len() == 10
        && version >= "2017-03-01"
}

/// Extracts section by section and sink by sink, so that one bad key does not hide the
/// problems of the others (serde stops at the first error of a struct).
fn extract_all(figment: &Figment) -> Result<Config, ConfigErrors> {
    use figment::value::{Dict, Value};
    let mut problems = Vec::new();
    let root: Dict = figment
        .extract()
        .map_err(|errors| ConfigErrors(errors.into_iter().map(figment_problem).collect()))?;
    const SECTIONS: [&str; 10] = [
        "imds",
        "identity",
        "events",
        "state",
        "policy",
        "delivery",
        "log",
        "telemetry",
        "approvals",
        "sinks",
    ];
    for key in root.keys().filter(|key| !SECTIONS.contains(&key.as_str())) {
        let variable = std::env::vars().map(|(name, _)| name).find(|name| {
            name.strip_prefix(ENV_PREFIX).is_some_and(|rest| {
                rest.to_ascii_lowercase().split("__").next() == Some(key.as_str())
            })
        });
        let origin = match variable {
            Some(name) => format!(" (from the environment variable {name})"),
            None => String::new(),
        };
        problems.push(problem(
            key.clone(),
            format!(
                "unknown section{origin}; expected one of {}",
                SECTIONS.join(", ")
            ),
        ));
    }
    fn section<T: serde::de::DeserializeOwned + Default>(
        figment: &Figment,
        root: &Dict,
        key: &str,
        problems: &mut Vec<ConfigProblem>,
    ) -> T {
        if !root.contains_key(key) {
            return T::default();
        }
        figment
            .extract_inner(key)
            .unwrap_or_else(|errors: figment::Error| {
                problems.extend(errors.into_iter().map(|error| section_problem(key, error)));
                T::default()
            })
    }
    let mut config = Config {
        imds: section(figment, &root, "imds", &mut problems),
        identity: section(figment, &root, "identity", &mut problems),
        events: section(figment, &root, "events", &mut problems),
        state: section(figment, &root, "state", &mut problems),
        policy: section(figment, &root, "policy", &mut problems),
        delivery: section(figment, &root, "delivery", &mut problems),
        log: section(figment, &root, "log", &mut problems),
        telemetry: section(figment, &root, "telemetry", &mut problems),
        approvals: section(figment, &root, "approvals", &mut problems),
        sinks: default_sinks(),
    };
    if root.contains_key("sinks") {
        match figment.extract_inner::<Vec<Value>>("sinks") {
            Ok(entries) => {
                config.sinks = Vec::with_capacity(entries.len());
                for (index, entry) in entries.into_iter().enumerate() {
                    match entry.deserialize::<SinkEntry>() {
                        Ok(sink) => config.sinks.push(sink),
                        Err(error) => problems
                            .push(problem(format!("sinks[{index}]"), error.kind.to_string())),
                    }
                }
            }
            Err(errors) => problems.extend(
                errors
                    .into_iter()
                    .map(|error| section_problem("sinks", error)),
            ),
        }
    }
    if problems.is_empty() {
        Ok(config)
    } else {
        Err(ConfigErrors(problems))
    }
}

/// A problem inside `section`: figment reports paths relative to the extracted value.
fn section_problem(section: &str, mut error: figment::Error) -> ConfigProblem {
    error.path.retain(|part| part != section);
    error.path.insert(0, section.to_owned());
    figment_problem(error)
}

fn figment_problem(error: figment::Error) -> ConfigProblem {
    let path = if error.path.is_empty() {
        "config".to_owned()
    } else {
        error.path.join(".")
    };
    let source = error
        .metadata
        .as_ref()
        .map(|metadata| match &metadata.source {
            Some(source) => format!(" (in {source})"),
            None => format!(" (from {})", metadata.name),
        })
        .unwrap_or_default();
    problem(path, format!("{}{source}", error.kind))
}

/// Keys whose values are secrets wherever they appear.
const SECRET_KEYS: &[&str] = &[
    "password",
    "token",
    "secret",
    "hmac_key",
    "private_key",
    "sasl_password",
];

fn redact(value: &mut toml::Value) {
    match value {
        toml::Value::Table(table) => {
            for (key, value) in table.iter_mut() {
                let secret = SECRET_KEYS
                    .iter()
                    .any(|s| key == s || key.ends_with(&format!("_{s}")));
                if secret && !key.ends_with("_file") {
                    *value = toml::Value::String("<redacted>".into());
                } else {
                    redact(value);
                }
            }
        }
        toml::Value::Array(items) => items.iter_mut().for_each(redact),
        toml::Value::String(text) => {
            if let Ok(mut url) = url::Url::parse(text)
                && url.password().is_some()
                && url.set_password(Some("redacted")).is_ok()
            {
                *text = url.to_string();
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(toml: &str, env: &[(&str, &str)]) -> Result<Config, ConfigErrors> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.toml");
        std::fs::write(&path, toml).unwrap();
        let _guards: Vec<_> = env.iter().map(|(k, v)| EnvGuard::set(k, v)).collect();
        // Each test sees only its own variables, so tests running in parallel cannot leak
        // overrides into each other; the provider is otherwise the real one.
        let keys: Vec<String> = env
            .iter()
            .map(|(k, _)| k.trim_start_matches(ENV_PREFIX).to_ascii_lowercase())
            .collect();
        let provider = Env::prefixed(ENV_PREFIX)
            .filter(move |key| keys.iter().any(|k| key.as_str().eq_ignore_ascii_case(k)));
        Config::load_with_env(Some(&path), provider)
    }

    struct EnvGuard(String);
    impl EnvGuard {
        fn set(key: &str, value: &str) -> Self {
            // SAFETY: only this module's tests touch SCHED_RELAY_* variables, each with
            // names no other test reads.
            unsafe { std::env::set_var(key, value) };
            EnvGuard(key.to_owned())
        }
    }
    impl Drop for EnvGuard {
        fn drop(&mut self) {
            unsafe { std::env::remove_var(&self.0) };
        }
    }

    #[test]
    fn the_product_contract_example_loads() {
        let config = load(
            r#"
            [imds]
            endpoint = "http://169.254.169.254"
            api_version = "2020-07-01"
            poll_interval = "1s"
            [identity]
            vm_name = "WestNO_0"
            [state]
            dir = "/var/lib/sched-relay"
            [policy]
            approve_user_initiated = true
            approve_freeze_max_seconds = 9
            [[sinks]]
            name = "audit"
            kind = "file"
            path = "/var/log/sched-relay/events.jsonl"
            "#,
            &[],
        )
        .unwrap();
        assert_eq!(config.imds.poll_interval, Duration::from_secs(1));
        assert_eq!(config.policy.approve_freeze_max_seconds, Some(9));
        assert_eq!(config.sinks[0].name, "audit");
        assert_eq!(config.sinks[0].kind.label(), "file");
    }

    #[test]
    fn defaults_poll_every_second_and_print_to_stdout() {
        let config = load("", &[]).unwrap();
        // The Default impls and serde's defaults must agree: the demo and tests build
        // configurations in code, users write files.
        assert_eq!(config, Config::default());
        assert!(config.identity.from_metadata && config.events.document_events);
        assert_eq!(config.sinks[0].kind.label(), "stdout");
    }

    #[test]
    fn environment_overrides_the_file() {
        let config = load(
            "[imds]\npoll_interval = \"1s\"\n",
            &[
                ("SCHED_RELAY_IMDS__POLL_INTERVAL", "250ms"),
                ("SCHED_RELAY_POLICY__APPROVE_USER_INITIATED", "true"),
            ],
        )
        .unwrap();
        assert_eq!(config.imds.poll_interval, Duration::from_millis(250));
        assert!(config.policy.approve_user_initiated);
    }

    #[test]
    fn every_problem_is_reported_at_once_with_its_key_path() {
        let errors = load(
            r#"
            [imds]
            endpoint = "ftp://x"
            api_version = "latest"
            poll_interval = "50ms"
            [policy]
            approve_freeze_max_seconds = -1
            [[sinks]]
            name = "a"
            kind = "stdout"
            [[sinks]]
            name = "a"
            kind = "file"
            path = ""
            "#,
            &[],
        )
        .unwrap_err();
        let paths: Vec<&str> = errors.0.iter().map(|p| p.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "imds.endpoint",
                "imds.api_version",
                "imds.poll_interval",
                "policy.approve_freeze_max_seconds",
                "sinks[1].name",
                "sinks[1].path"
            ],
            "{errors}"
        );
    }

    #[test]
    fn unknown_keys_and_bad_types_are_refused_with_their_path() {
        let errors = load("[imds]\npoll_intervall = \"1s\"\n", &[]).unwrap_err();
        assert_eq!(errors.0[0].path, "imds.poll_intervall");
        assert!(errors.0[0].message.contains("poll_interval"), "{errors}");

        let errors = load("[imds]\npoll_interval = \"soon\"\n", &[]).unwrap_err();
        assert_eq!(errors.0[0].path, "imds.poll_interval", "{errors}");

        let errors = load(
            "[imds]\npoll_intervall = \"1s\"\n[log]\nformat = \"xml\"\n[[sinks]]\nname = \"k\"\nkind = \"carrier-pigeon\"\n[telemetri]\n",
            &[],
        )
        .unwrap_err();
        let paths: Vec<&str> = errors.0.iter().map(|p| p.path.as_str()).collect();
        assert_eq!(
            paths,
            ["telemetri", "imds.poll_intervall", "log.format", "sinks[0]"],
            "{errors}"
        );

        let errors = load("[[sinks]]\nname = \"k\"\nkind = \"carrier-pigeon\"\n", &[]).unwrap_err();
        assert!(errors.0[0].message.contains("carrier-pigeon"), "{errors}");
        assert!(errors.0[0].message.contains("sink \"k\""), "{errors}");

        let errors = load(
            "[[sinks]]\nname = \"f\"\nkind = \"file\"\npth = \"x\"\n",
            &[],
        )
        .unwrap_err();
        assert!(errors.0[0].message.contains("pth"), "{errors}");
    }

    #[test]
    fn a_missing_config_file_is_an_error_not_a_silent_default() {
        let errors = Config::load(Some(Path::new("/nonexistent/sched-relay.toml"))).unwrap_err();
        assert_eq!(errors.0[0].path, "--config");
    }

    #[test]
    fn secrets_never_appear_in_the_printed_configuration() {
        let mut value: toml::Value = toml::from_str(
            r#"
            url = "amqp://guest:hunter2@127.0.0.1:5672/%2f"
            [auth]
            password = "hunter2"
            bearer_token = "hunter2"
            password_file = "/run/secrets/pw"
            "#,
        )
        .unwrap();
        redact(&mut value);
        let printed = toml::to_string(&value).unwrap();
        assert!(!printed.contains("hunter2"), "{printed}");
        assert!(printed.contains("/run/secrets/pw"), "{printed}");
    }
}
