//! Scenario files for the simulator: timed events and faults, written in TOML.
//! Every offset is multiplied by `time_scale`, so a realistic 15-minute notice can be
//! rehearsed in seconds without editing the file.

use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

/// A whole scenario: the VM, its events and the faults the service shows.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// What the scenario shows, for people.
    #[serde(default)]
    pub description: String,
    #[serde(default)]
    pub vm: SimVm,
    /// Multiplies every offset and duration below (0.01 plays 15 minutes in 9 seconds).
    #[serde(default = "default_time_scale")]
    pub time_scale: f64,
    /// The incarnation of the first document.
    #[serde(default = "default_incarnation")]
    pub start_incarnation: u64,
    /// The first Scheduled Events request waits this long, as when the service is enabled.
    #[serde(default, with = "humantime_serde")]
    pub first_call_delay: Option<Duration>,
    /// At this moment DocumentIncarnation starts again from `start_incarnation`, as after the
    /// service was disabled (24 h without a request) and enabled again.
    #[serde(default, with = "humantime_serde")]
    pub incarnation_reset_after: Option<Duration>,
    #[serde(default)]
    pub events: Vec<SimEvent>,
    #[serde(default)]
    pub faults: Vec<Fault>,
}

/// The VM the simulator pretends to be (for `/metadata/instance/compute`).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SimVm {
    pub name: String,
    #[serde(default)]
    pub vm_id: Option<String>,
    #[serde(default)]
    pub resource_id: Option<String>,
    /// The availability set (same resource group) this standalone VM is in, for the ARM
    /// stand-in.
    #[serde(default)]
    pub availability_set: Option<String>,
    /// The power state ARM reports while no event holds the VM.
    #[serde(default)]
    pub power_state: SimPowerState,
    /// The provisioning state ARM reports while no event holds the VM.
    #[serde(default)]
    pub provisioning_state: SimProvisioningState,
    /// Azure's own auto-approval of this VM's events (for a scale-set VM: its scale set's).
    #[serde(default)]
    pub scheduled_events_policy: Option<SimEventsPolicy>,
}

/// A VM's power state as the scenario sets it (events change it for a while).
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum SimPowerState {
    #[default]
    Running,
    Stopped,
    Deallocated,
}

/// A VM's provisioning state as the scenario sets it.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum SimProvisioningState {
    #[default]
    Succeeded,
    Failed,
}

/// Azure's `scheduledEventsPolicy`: which events Azure approves by itself. A key left out is
/// left out of what ARM shows too.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct SimEventsPolicy {
    /// `userInitiatedReboot.automaticallyApprove`.
    #[serde(default)]
    pub user_initiated_reboot_auto_approve: Option<bool>,
    /// `userInitiatedRedeploy.automaticallyApprove`.
    #[serde(default)]
    pub user_initiated_redeploy_auto_approve: Option<bool>,
    /// `allInstancesDown.automaticallyApprove`.
    #[serde(default)]
    pub all_instances_down_auto_approve: Option<bool>,
}

impl Default for SimVm {
    fn default() -> Self {
        SimVm {
            name: "WestNO_0".into(),
            vm_id: Some("02aab8a4-74ef-476e-8182-f6d2ba4166a6".into()),
            resource_id: Some(
                "/subscriptions/00000000-0000-0000-0000-000000000000/resourceGroups/demo/providers/Microsoft.Compute/virtualMachines/WestNO_0".into(),
            ),
            availability_set: None,
            power_state: SimPowerState::default(),
            provisioning_state: SimProvisioningState::default(),
            scheduled_events_policy: None,
        }
    }
}

/// One Azure event's life in the scenario.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SimEvent {
    pub id: String,
    /// When the event appears, from the start of the simulator.
    #[serde(default, with = "humantime_serde")]
    pub appear_after: Duration,
    /// EventType: Freeze, Reboot, Redeploy, Preempt, Terminate (or anything else).
    #[serde(rename = "type")]
    pub event_type: String,
    pub resources: Vec<String>,
    #[serde(default)]
    pub description: Option<String>,
    /// EventSource: Platform or User.
    #[serde(default = "default_source")]
    pub source: String,
    /// DurationInSeconds as published (-1: unknown).
    #[serde(default = "default_duration")]
    pub duration_in_seconds: i64,
    /// NotBefore = appearance + notice; the event starts by itself then, unless approved.
    #[serde(default = "default_notice", with = "humantime_serde")]
    pub notice: Duration,
    /// `Scheduled`, or `Started` for a host failure that skips the notice.
    #[serde(default = "default_status")]
    pub status: String,
    /// How long the event stays Started before it disappears (completes).
    #[serde(default = "default_started_for", with = "humantime_serde")]
    pub started_for: Duration,
    /// Azure cancels the event this long after it appeared, if it has not started.
    #[serde(default, with = "humantime_serde")]
    pub cancel_after: Option<Duration>,
    #[serde(default)]
    pub updates: Vec<SimUpdate>,
}

/// A change of a still-present event (a new NotBefore, other Resources, ...).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SimUpdate {
    /// When, from the event's appearance.
    #[serde(with = "humantime_serde")]
    pub after: Duration,
    /// A new NotBefore, from the event's appearance.
    #[serde(default, with = "humantime_serde")]
    pub notice: Option<Duration>,
    #[serde(default)]
    pub resources: Option<Vec<String>>,
    #[serde(default)]
    pub duration_in_seconds: Option<i64>,
    #[serde(default)]
    pub description: Option<String>,
}

/// A fault of the service, applied to requests from `after` on, `count` times; or, with
/// `lasting`, to every request during that time (an outage), whatever their number.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Fault {
    pub kind: FaultKind,
    #[serde(default, with = "humantime_serde")]
    pub after: Duration,
    #[serde(default = "default_count")]
    pub count: u32,
    /// For `status`: the HTTP status to answer.
    #[serde(default)]
    pub status: Option<u16>,
    /// For `delay`: how long to wait before answering normally.
    #[serde(default, with = "humantime_serde")]
    pub delay: Option<Duration>,
    /// The fault applies to every request from `after` to `after + lasting` (`count` is then
    /// not used): an outage of a given length, however often the client retries.
    #[serde(default, with = "humantime_serde")]
    pub lasting: Option<Duration>,
    /// For `status` (429 or 503): the `Retry-After` header to send, in seconds.
    #[serde(default)]
    pub retry_after: Option<u64>,
    /// `GET` (default) or `POST`.
    #[serde(default = "default_method")]
    pub method: String,
    /// The path it hits: `scheduled_events` (default) or `compute`.
    #[serde(default)]
    pub endpoint: FaultEndpoint,
}

/// The path a fault hits.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum FaultEndpoint {
    /// `/metadata/scheduledevents`.
    #[default]
    ScheduledEvents,
    /// `/metadata/instance/compute`, where the agent learns who this VM is.
    Compute,
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    /// Answer `status` (e.g. 500, 503, 429) with a short error body.
    Status,
    /// Answer 200 with a body that is not a document.
    Malformed,
    /// Answer 400 as the service does when the Metadata header is missing.
    BadRequest,
    /// Wait `delay`, then answer normally (longer than the client timeout: a timeout).
    Delay,
}

fn default_time_scale() -> f64 {
    1.0
}
fn default_incarnation() -> u64 {
    1
}
fn default_source() -> String {
    "Platform".into()
}
fn default_duration() -> i64 {
    -1
}
fn default_notice() -> Duration {
    Duration::from_secs(15 * 60)
}
fn default_status() -> String {
    "Scheduled".into()
}
fn default_started_for() -> Duration {
    Duration::from_secs(10 * 60)
}
fn default_count() -> u32 {
    1
}
fn default_method() -> String {
    "GET".into()
}

/// The scenarios shipped in `config/scenarios/`, built into the binary.
pub const BUILTIN: &[(&str, &str)] = &[
    (
        "live-migration",
        include_str!("../../config/scenarios/live-migration.toml"),
    ),
    (
        "user-reboot",
        include_str!("../../config/scenarios/user-reboot.toml"),
    ),
    (
        "redeploy",
        include_str!("../../config/scenarios/redeploy.toml"),
    ),
    (
        "spot-preempt",
        include_str!("../../config/scenarios/spot-preempt.toml"),
    ),
    (
        "scaleset-terminate",
        include_str!("../../config/scenarios/scaleset-terminate.toml"),
    ),
    (
        "host-failure",
        include_str!("../../config/scenarios/host-failure.toml"),
    ),
    (
        "cancelled-maintenance",
        include_str!("../../config/scenarios/cancelled-maintenance.toml"),
    ),
    (
        "multi-vm",
        include_str!("../../config/scenarios/multi-vm.toml"),
    ),
    (
        "imds-faults",
        include_str!("../../config/scenarios/imds-faults.toml"),
    ),
    ("demo", include_str!("../../config/scenarios/demo.toml")),
];

impl Scenario {
    /// Parses and checks a scenario.
    pub fn from_toml(text: &str) -> Result<Scenario, String> {
        let scenario: Scenario = toml::from_str(text).map_err(|e| e.to_string())?;
        scenario.check()?;
        Ok(scenario)
    }

    /// Reads a scenario file, or a built-in scenario by name (`live-migration`, ...).
    pub fn load(path_or_name: &str) -> Result<Scenario, String> {
        if let Some((_, text)) = BUILTIN.iter().find(|(name, _)| *name == path_or_name) {
            return Scenario::from_toml(text)
                .map_err(|e| format!("built-in scenario {path_or_name}: {e}"));
        }
        let path = Path::new(path_or_name);
        let text = std::fs::read_to_string(path).map_err(|e| {
            let names: Vec<&str> = BUILTIN.iter().map(|(n, _)| *n).collect();
            format!(
                "cannot read scenario {}: {e} (built-in scenarios: {})",
                path.display(),
                names.join(", ")
            )
        })?;
        Scenario::from_toml(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    fn check(&self) -> Result<(), String> {
        if !(self.time_scale > 0.0 && self.time_scale.is_finite()) {
            return Err(format!(
                "time_scale: {} must be a positive number",
                self.time_scale
            ));
        }
        for (index, event) in self.events.iter().enumerate() {
            if self.events[..index]
                .iter()
                .any(|other| other.id == event.id)
            {
                return Err(format!("events[{index}].id: {:?} is used twice", event.id));
            }
            if !matches!(event.status.as_str(), "Scheduled" | "Started") {
                return Err(format!(
                    "events[{index}].status: {:?}; expected \"Scheduled\" or \"Started\"",
                    event.status
                ));
            }
        }
        for (index, fault) in self.faults.iter().enumerate() {
            match fault.kind {
                FaultKind::Status if fault.status.is_none() => {
                    return Err(format!(
                        "faults[{index}].status: a `status` fault needs an HTTP status"
                    ));
                }
                FaultKind::Delay if fault.delay.is_none() => {
                    return Err(format!(
                        "faults[{index}].delay: a `delay` fault needs a delay"
                    ));
                }
                _ => {}
            }
            if !matches!(fault.method.as_str(), "GET" | "POST") {
                return Err(format!(
                    "faults[{index}].method: expected \"GET\" or \"POST\""
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_builtin_scenario_parses() {
        for (name, text) in BUILTIN {
            Scenario::from_toml(text).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
    }

    #[test]
    fn scenario_mistakes_are_reported_with_their_place() {
        let error =
            Scenario::from_toml("[[events]]\nid='a'\ntype='Reboot'\nresources=[]\nstatus='Done'\n")
                .unwrap_err();
        assert!(error.starts_with("events[0].status"), "{error}");
        let error = Scenario::from_toml("[[faults]]\nkind='status'\n").unwrap_err();
        assert!(error.starts_with("faults[0].status"), "{error}");
        let error = Scenario::from_toml("tyme_scale = 2\n").unwrap_err();
        assert!(error.contains("tyme_scale"), "{error}");
    }
}
