//! Who this VM is: `[identity]` from the configuration first, then
//! `/metadata/instance/compute`, then the identity it answered on an earlier run (kept in the
//! state store), and the hostname only when `hostname_fallback` allows it.
//!
//! The name matters: it decides `affectsvm`, local policy, the targeting of remote approvals
//! and the Kafka approval partition, and the default `source` comes from the resource id. A
//! scale-set hostname (`vmss000001`) is not the name in `Resources` (`vmss_1`), so guessing
//! is worse than waiting: [`IdentityResolver`] says when it does not know yet, and the agent
//! retries (events wait; they are derived once the identity is known, from the last processed
//! document, so nothing is lost).

use std::time::Duration;

use sched_relay_core::event::Identity;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{ImdsClient, ImdsError};
use crate::retry::Backoff;

/// Waits between attempts while the identity is unknown: 1 s doubling to 5 s, jittered.
pub const IDENTITY_RETRY: Backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(5));
/// After this long without an identity the agent logs at ERROR, and `hostname_fallback`
/// applies.
pub const IDENTITY_ALERT: Duration = Duration::from_secs(30);

/// `[identity]`: who this VM is. Unset keys come from `/metadata/instance/compute` (or what
/// it answered on an earlier run); the hostname only with `hostname_fallback`.
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
    /// Use the hostname as the VM name when nothing else names the VM: `vm_name` unset, and
    /// instance metadata not asked (`from_metadata = false`) or failing for 30 s with no
    /// identity kept from an earlier run. Off: the agent waits for instance metadata.
    #[serde(default)]
    pub hostname_fallback: bool,
}

impl Default for IdentityConfig {
    fn default() -> Self {
        IdentityConfig {
            vm_name: None,
            vm_id: None,
            resource_id: None,
            source: None,
            from_metadata: true,
            hostname_fallback: false,
        }
    }
}

fn default_true() -> bool {
    true
}

impl IdentityConfig {
    /// Problems, as (key under `identity`, message).
    pub fn validate(&self) -> Vec<(String, String)> {
        let mut problems = Vec::new();
        for (key, value) in [("vm_name", &self.vm_name), ("source", &self.source)] {
            if value.as_deref().is_some_and(|v| v.trim().is_empty()) {
                problems.push((
                    key.to_owned(),
                    "is empty; remove the key to use the default".to_owned(),
                ));
            }
        }
        // from_metadata = false without vm_name names the VM by its hostname, as before
        // hostname_fallback existed: a warning (Config::warnings), not a refusal.
        problems
    }
}

/// Where the VM name came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    Configured,
    Metadata,
    /// `/metadata/instance/compute` failed; it answered this on an earlier run.
    Persisted,
    Hostname,
}

/// Works out who this VM is, one attempt at a time (the caller waits between attempts).
pub struct IdentityResolver {
    configured: IdentityConfig,
    /// What instance metadata answered on an earlier run (from the state store).
    stored: Option<Identity>,
    /// What instance metadata answered on this run.
    answered: Option<Identity>,
    started: std::time::Instant,
    failures: u32,
    alerted: bool,
}

impl IdentityResolver {
    pub fn new(configured: &IdentityConfig, stored: Option<Identity>) -> IdentityResolver {
        IdentityResolver {
            configured: configured.clone(),
            stored,
            answered: None,
            started: std::time::Instant::now(),
            failures: 0,
            alerted: false,
        }
    }

    /// The configured values; unset ones empty.
    fn configured_identity(&self) -> Identity {
        Identity {
            name: self.configured.vm_name.clone().unwrap_or_default(),
            vm_id: self.configured.vm_id.clone(),
            resource_id: self.configured.resource_id.clone(),
        }
    }

    /// One attempt. `Ok` with the identity and where its name came from, or `Err` with what
    /// instance metadata said when the VM cannot be named yet: wait [`Self::next_wait`] and
    /// try again.
    pub async fn attempt(&mut self, client: &ImdsClient) -> Result<(Identity, Origin), ImdsError> {
        let configured = self.configured_identity();
        let complete = !configured.name.is_empty()
            && configured.vm_id.is_some()
            && configured.resource_id.is_some();
        if !self.configured.from_metadata || complete {
            return Ok(self.or_hostname(configured, Origin::Configured));
        }
        let error = match client.identity().await {
            Ok(found) => {
                self.answered = Some(found.clone());
                return Ok((fill(configured, found), Origin::Metadata));
            }
            Err(error) => error,
        };
        self.failures += 1;
        // An identity kept from another name than the configured one is not this VM's.
        if let Some(stored) = self.stored.clone().filter(|stored| {
            configured.name.is_empty() || stored.name.eq_ignore_ascii_case(&configured.name)
        }) {
            tracing::warn!(error = %error, vm_name = %stored.name, "Cannot read the VM identity from instance metadata; using the one it gave on an earlier run (kept in the state store)");
            return Ok((fill(configured, stored), Origin::Persisted));
        }
        if !configured.name.is_empty() {
            tracing::warn!(error = %error, vm_name = %configured.name, "Cannot read vmId and resourceId from instance metadata; going on with the configured identity.vm_name (set identity.source to keep the CloudEvents source stable)");
            return Ok((configured, Origin::Configured));
        }
        let failing_for = self.started.elapsed();
        if self.configured.hostname_fallback && failing_for >= IDENTITY_ALERT {
            return Ok(self.or_hostname(configured, Origin::Configured));
        }
        if !self.alerted && failing_for >= IDENTITY_ALERT {
            self.alerted = true;
            tracing::error!(failures = self.failures, error = %error, "No VM identity for over 30 s: instance metadata keeps failing, so no events are derived yet (they wait, nothing is lost). Set identity.vm_name to the name in Resources to start without it");
        } else {
            tracing::warn!(failures = self.failures, error = %error, "Cannot read the VM identity from instance metadata; events wait until it answers");
        }
        Err(error)
    }

    /// What instance metadata answered on this run, if it did: the identity worth keeping
    /// for later runs (configured values left out, so that they can change).
    pub fn answered(&self) -> Option<&Identity> {
        self.answered.as_ref()
    }

    /// How long to wait before the next attempt.
    pub fn next_wait(&self) -> Duration {
        IDENTITY_RETRY.jittered(self.failures.saturating_sub(1))
    }

    /// `identity`, named by the hostname if it has no name yet (only reached when allowed:
    /// `hostname_fallback`, or `from_metadata = false` without `vm_name`, which
    /// `Config::warnings` points out).
    fn or_hostname(&self, mut identity: Identity, origin: Origin) -> (Identity, Origin) {
        if !identity.name.is_empty() {
            return (identity, origin);
        }
        identity.name = hostname();
        tracing::warn!(vm_name = %identity.name, "Using the hostname as the VM name (identity.hostname_fallback); set identity.vm_name if it differs from the name in Resources");
        (identity, Origin::Hostname)
    }
}

/// The configured values, completed by `found` where unset.
fn fill(configured: Identity, found: Identity) -> Identity {
    Identity {
        name: if configured.name.is_empty() {
            found.name
        } else {
            configured.name
        },
        vm_id: configured.vm_id.or(found.vm_id),
        resource_id: configured.resource_id.or(found.resource_id),
    }
}

/// The identity as kept in the state store.
pub fn identity_to_json(identity: &Identity) -> Value {
    serde_json::json!({"name": identity.name, "vm_id": identity.vm_id, "resource_id": identity.resource_id})
}

/// The identity kept in the state store, or why it cannot be read.
pub fn identity_from_json(value: &Value) -> Result<Identity, String> {
    let text = |field: &str| value.get(field).and_then(Value::as_str).map(str::to_owned);
    let name = text("name")
        .filter(|name| !name.is_empty())
        .ok_or("expected an object with a non-empty \"name\"")?;
    Ok(Identity {
        name,
        vm_id: text("vm_id"),
        resource_id: text("resource_id"),
    })
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .map(|name| name.trim().to_owned())
        .ok()
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "unknown".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn the_kept_identity_reads_back_as_it_was_written(
            name in "[A-Za-z0-9_-]{1,20}",
            vm_id in proptest::option::of("[a-f0-9-]{1,36}"),
            resource_id in proptest::option::of("/[ -~]{0,60}"),
        ) {
            let identity = Identity { name, vm_id, resource_id };
            prop_assert_eq!(identity_from_json(&identity_to_json(&identity)), Ok(identity));
        }
    }

    #[test]
    fn a_kept_identity_without_a_name_is_refused() {
        let error = identity_from_json(&serde_json::json!({"vm_id": "x"})).unwrap_err();
        assert!(error.contains("name"), "{error}");
    }
}
