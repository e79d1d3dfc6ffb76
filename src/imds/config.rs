//! `[imds]`: where the metadata service is and how it is polled, with the checks that need
//! no network.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::DEFAULT_LEASE_PATHS;

/// The metadata service allows about 5 requests per second per VM.
pub const MIN_POLL_INTERVAL: Duration = Duration::from_millis(200);

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
    /// The longest wait between polls while the service fails (at most 5 s: a Preempt's
    /// notice is 30 s). Only a 429 with `Retry-After` waits longer.
    #[serde(default = "default_max_backoff", with = "humantime_serde")]
    pub max_backoff: Duration,
    /// `/readyz` answers 503 once the service has failed for this long.
    #[serde(default = "default_unready_after", with = "humantime_serde")]
    pub unready_after: Duration,
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
            unready_after: default_unready_after(),
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
/// A poll that hangs across the service's recovery costs at most this (the retry follows at
/// once), so it is part of the detection delay after an outage: poll interval + 5 s.
fn default_request_timeout() -> Duration {
    Duration::from_secs(5)
}
fn default_first_call_timeout() -> Duration {
    Duration::from_secs(150)
}
fn default_max_backoff() -> Duration {
    super::pacing::MAX_ERROR_BACKOFF
}
fn default_unready_after() -> Duration {
    Duration::from_secs(10)
}
fn default_lease_paths() -> Vec<PathBuf> {
    DEFAULT_LEASE_PATHS.iter().map(PathBuf::from).collect()
}

impl ImdsConfig {
    /// Problems, as (key under `imds`, message).
    pub fn validate(&self) -> Vec<(String, String)> {
        let mut problems: Vec<(String, String)> = Vec::new();
        let mut push = |key: &str, message: String| problems.push((key.to_owned(), message));
        if self.endpoint != "discover" {
            match url::Url::parse(&self.endpoint) {
                Ok(url) if matches!(url.scheme(), "http" | "https") && url.has_host() => {}
                _ => push(
                    "endpoint",
                    format!(
                        "{:?} is not an http(s) URL; expected e.g. \"http://169.254.169.254\" or \"discover\"",
                        self.endpoint
                    ),
                ),
            }
        }
        if !is_api_version(&self.api_version) {
            push(
                "api_version",
                format!(
                    "{:?} is not an api-version; expected a date from 2017-03-01 on, e.g. \"2020-07-01\"",
                    self.api_version
                ),
            );
        }
        if self.poll_interval < MIN_POLL_INTERVAL || self.poll_interval > Duration::from_secs(60) {
            push(
                "poll_interval",
                format!(
                    "{} is outside 200ms..60s (the service allows ~5 requests/s, and Preempt notices are 30 s)",
                    humantime::format_duration(self.poll_interval)
                ),
            );
        }
        if self.request_timeout.is_zero() {
            push("request_timeout", "must be more than 0s".into());
        }
        if self.first_call_timeout < self.request_timeout {
            push(
                "first_call_timeout",
                "must be at least imds.request_timeout (the first call may take up to 2 minutes)"
                    .into(),
            );
        }
        // Above 5 s it is clamped with a warning (Config::warnings), so that a configuration
        // written for an older release still runs.
        if self.max_backoff < MIN_POLL_INTERVAL {
            push(
                "max_backoff",
                format!(
                    "{} is below 200ms, faster than the service's 5 requests/s",
                    humantime::format_duration(self.max_backoff)
                ),
            );
        }
        if self.unready_after.is_zero() {
            push(
                "unready_after",
                "must be more than 0s (how long the service may fail before /readyz says so)"
                    .into(),
            );
        }
        problems
    }
}

/// Whether `version` is a date-shaped api-version no older than the first one (2017-03-01).
pub fn is_api_version(version: &str) -> bool {
    chrono::NaiveDate::parse_from_str(version, "%Y-%m-%d").is_ok()
        && version.len() == 10
        && version >= "2017-03-01"
}
