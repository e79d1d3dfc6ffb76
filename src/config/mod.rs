//! The agent's configuration: loaded with figment from a TOML file, then overridden by
//! `SCHED_RELAY_<SECTION>__<KEY>` environment variables ([`load`]), then validated in one
//! pure step that reports every problem at once with its key path ([`validate`]); printed
//! with every secret masked ([`redact`]). `config/reference.toml` documents each key.
//!
//! Each section's type lives with the code that owns it (`imds::ImdsConfig`,
//! `fanout::DeliveryConfig`, `approval::config::ApprovalsConfig`, ...); this module only
//! assembles them, and nothing it imports imports it back.

mod load;
mod redact;
mod validate;

use std::path::Path;

use sched_relay_core::event::EventsConfig;
use sched_relay_core::policy::PolicyConfig;
use sched_relay_file::{StdoutFormat, StdoutSinkConfig};
use serde::{Deserialize, Serialize};

use crate::approval::config::ApprovalsConfig;
use crate::fanout::DeliveryConfig;
use crate::imds::{IdentityConfig, ImdsConfig};
use crate::logging::LogConfig;
use crate::sinks::{SinkEntry, SinkKind};
use crate::store::StateConfig;
use crate::telemetry::TelemetryConfig;

/// Where `run` and `check-config` look when no `--config` is given.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/sched-relay/config.toml";
/// The prefix of environment overrides.
pub const ENV_PREFIX: &str = "SCHED_RELAY_";

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

/// A problem at `path` (also the fleet coordinator's file).
pub(crate) fn problem(path: impl Into<String>, message: impl Into<String>) -> ConfigProblem {
    ConfigProblem {
        path: path.into(),
        message: message.into(),
    }
}

impl Config {
    /// Loads `path` (or the default path when it exists), applies environment overrides and
    /// validates the result.
    pub fn load(path: Option<&Path>) -> Result<Config, ConfigErrors> {
        load::load(path, figment::providers::Env::prefixed(ENV_PREFIX))
    }

    /// Loads and validates `path` alone, with no environment overrides: the fleet demo's own
    /// files, which a shell's `SCHED_RELAY_*` settings must not change.
    pub fn load_file_only(path: &Path) -> Result<Config, ConfigErrors> {
        load::load(
            Some(path),
            figment::providers::Env::prefixed(ENV_PREFIX).filter(|_| false),
        )
    }

    /// The effective configuration as TOML, with every secret replaced by `<redacted>`.
    pub fn to_redacted_toml(&self) -> String {
        let mut value = toml::Value::try_from(self).expect("the configuration serializes");
        redact::redact(&mut value);
        toml::to_string_pretty(&value).expect("a TOML value prints")
    }
}

#[cfg(test)]
mod tests;
