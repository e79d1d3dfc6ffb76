//! What the coordinator did about an event: the requests it signed, the agents' answers,
//! and the drains it ran.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

/// A request the coordinator signed for an event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sent {
    pub request_id: String,
    /// The signed `time` (whole seconds count).
    pub signed_at: DateTime<Utc>,
    /// When the broker confirmed it (through ARM: when ARM answered); `None` while it is
    /// being published.
    pub published_at: Option<DateTime<Utc>>,
    /// How it went: to an agent, or to Azure Resource Manager.
    #[serde(default)]
    pub via: Via,
}

/// How an approval reaches Azure.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Via {
    /// A signed StartRequest to the approver's agent, which POSTs it to its metadata service.
    #[default]
    Agent,
    /// `Microsoft.Maintenance/scheduledevents/{id}/acknowledge` on Azure Resource Manager,
    /// at the approver's scope (its scale set's, for a scale set's VM).
    Arm,
}

/// An agent's answer to one of our requests (through ARM: ARM's refusal, or the evidence
/// that the acknowledged event started).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Outcome {
    /// `accepted`, `rejected` or `failed`.
    pub outcome: String,
    pub reason: String,
    pub request_id: String,
    pub at: DateTime<Utc>,
}

/// The coordinator approved (or, in a dry run, would approve) an event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Approval {
    /// The VM whose agent the request goes to (the first in Resources with an agent), or,
    /// through ARM, the VM at whose scope the event is acknowledged.
    pub approver: String,
    /// How the newest request goes.
    #[serde(default)]
    pub via: Via,
    pub decided_at: DateTime<Utc>,
    pub dry_run: bool,
    /// Every request signed for it, oldest first.
    pub sent: Vec<Sent>,
    pub outcome: Option<Outcome>,
    /// Gave up after `max_attempts` (alerted).
    pub abandoned: bool,
    /// Answers `accepted` with `dryRun: true`: the agent runs in dry run and POSTed
    /// nothing, so they approve nothing (the request is renewed after `outcome_timeout`).
    #[serde(default)]
    pub dry_run_answers: u32,
}

/// A drain of each VM the event takes down, by name (with an agent, listed by Azure, or
/// neither yet); VMs it comes to list later are added before its approval.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Drain {
    pub started_at: DateTime<Utc>,
    pub deadline: DateTime<Utc>,
    /// Per VM: `running`, `done` or `failed: <why>`.
    pub vms: BTreeMap<String, String>,
    pub finished_at: Option<DateTime<Utc>>,
    pub deadline_missed: bool,
}

impl Drain {
    pub fn all_done(&self) -> bool {
        self.vms.values().all(|state| state == "done")
    }
    pub fn any_failed(&self) -> bool {
        self.vms.values().any(|state| state.starts_with("failed"))
    }
    pub fn running(&self) -> bool {
        self.vms.values().any(|state| state == "running")
    }
}
