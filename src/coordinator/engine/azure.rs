//! The Azure inventory in the loop: each refresh replaces the VMs Azure lists (the fleet's
//! `azure`), nothing is decided before every source has been listed whole once (a group's
//! size and who of it is down are not known before), and an agent that speaks for a VM the
//! inventory lacks asks for a listing soon (a scale-out).

use std::sync::Arc;
use std::time::Instant;

use chrono::{DateTime, Utc};
use tokio::sync::Notify;

use super::Engine;
use crate::coordinator::azure::{Snapshot, SourceStatus};
use crate::coordinator::policy::Action;

/// A listing stamped further than this ahead of the decision's clock is not trusted.
const CLOCK_SKEW: chrono::Duration = chrono::Duration::seconds(60);
/// While the first listing is missing, how often the coordinator says so.
const WAITING_LOG_EVERY: std::time::Duration = std::time::Duration::from_secs(30);

/// What the loop knows of the Azure inventory besides its VMs.
pub struct AzureView {
    /// Every source has been listed whole at least once.
    pub complete: bool,
    pub sources: Vec<SourceStatus>,
    /// Wakes the refresher for a listing soon.
    pub nudge: Arc<Notify>,
    /// When it was last logged that nothing is decided for want of the inventory.
    logged: Option<Instant>,
    /// When it was last logged that old sources hold some groups.
    logged_held: Option<Instant>,
    /// Where Azure approves by itself what a group's rule drains first.
    pub warnings: Vec<String>,
    /// `[azure] max_age`: an older listing holds the decisions that count its VMs.
    max_age: chrono::Duration,
    /// For each event acknowledged through ARM and not yet seen started: when ARM first
    /// took it, and its VMs Azure listed running then (in memory: after a restart, reports
    /// alone show it).
    pub(super) up_at_ack: std::collections::HashMap<String, (DateTime<Utc>, Vec<String>)>,
}

impl AzureView {
    pub fn new(nudge: Arc<Notify>, max_age: std::time::Duration) -> AzureView {
        AzureView {
            complete: false,
            sources: Vec::new(),
            nudge,
            logged: None,
            logged_held: None,
            warnings: Vec::new(),
            max_age: chrono::Duration::from_std(max_age).unwrap_or(chrono::Duration::MAX),
            up_at_ack: Default::default(),
        }
    }
}

impl Engine {
    /// Tests: the decision policy.
    #[cfg(all(test, feature = "azure"))]
    pub(crate) fn policy(&self) -> &crate::coordinator::policy::Policy {
        &self.policy
    }

    /// A refresh of the Azure inventory.
    pub fn azure_listed(&mut self, snapshot: Snapshot, now: DateTime<Utc>) {
        let Some(view) = self.azure.as_mut() else {
            return;
        };
        let complete = snapshot.complete();
        if complete && !view.complete {
            tracing::info!(
                vms = snapshot.vms.len(),
                sources = snapshot.sources.len(),
                "Azure inventory complete; deciding"
            );
        }
        view.complete = complete;
        // Azure approves some events by itself (scheduledEventsPolicy): where a group's rule
        // says to drain first, such an event would start without the drain.
        let mut warnings = Vec::new();
        for source in &snapshot.sources {
            let group = &self.policy.groups[source.group];
            for ty in source.auto_approve.user_initiated() {
                if group.rule(ty).action == Action::DrainThenApprove {
                    warnings.push(format!(
                        "Azure approves user-initiated {ty}s of {} by itself (its scheduledEventsPolicy): they start without group {}'s drain",
                        source.source, group.name
                    ));
                }
            }
        }
        for warning in warnings.iter().filter(|w| !view.warnings.contains(w)) {
            tracing::warn!(warning = %warning, "Azure's own approvals bypass a drain");
        }
        view.warnings = warnings;
        let mut listed_at = std::collections::BTreeMap::new();
        for source in &snapshot.sources {
            if let Some(at) = source.listed_at {
                let oldest = listed_at.entry(source.group).or_insert(at);
                *oldest = (*oldest).min(at);
            }
        }
        self.fleet.azure_sources.listed_at = listed_at;
        view.sources = snapshot.sources;
        self.fleet.set_azure(snapshot.vms);
        self.dirty = true;
        if self.ready && complete {
            self.owe(Instant::now(), now, false);
        }
    }

    /// Decisions wait for the Azure inventory: without it a group's size, and who of it is
    /// down, are not known. Nothing is decided (true) while two names clash, until every
    /// source has been listed whole once, or, with a `[fleet]` budget (which counts every
    /// group), while any source is old. Otherwise the old sources are left in
    /// `AzureSources::held` for the decision to hold every group that may count their VMs
    /// (`policy::decide`). Says so every little while.
    pub(super) fn azure_missing(&mut self, now: DateTime<Utc>) -> bool {
        let clash = self.fleet.azure_clash();
        let fleet_budget = self.policy.fleet_budget.is_some();
        self.fleet.azure_sources.held.clear();
        let Some(view) = self.azure.as_mut() else {
            return false;
        };
        let max_age = view.max_age;
        // A listing stamped in the future (the clock stepped back) is not known fresh.
        let old = |s: &&SourceStatus| {
            s.listed_at
                .is_none_or(|at| now - at > max_age || at - now > CLOCK_SKEW)
        };
        let failing: Vec<String> = view
            .sources
            .iter()
            .filter(old)
            .map(|s| match &s.error {
                Some(error) => format!("{}: {error}", s.source),
                None => s.source.clone(),
            })
            .collect();
        let why = match clash {
            Some(clash) => format!("an agent and a VM Azure lists share a name: {clash}"),
            None if failing.is_empty() && view.complete => return false,
            None if view.complete && !fleet_budget => {
                for source in view.sources.iter().filter(old) {
                    self.fleet
                        .azure_sources
                        .held
                        .entry(source.group)
                        .or_default()
                        .push(source.source.clone());
                }
                if view
                    .logged_held
                    .is_none_or(|at| at.elapsed() >= WAITING_LOG_EVERY)
                {
                    view.logged_held = Some(Instant::now());
                    tracing::error!(why = ?failing, "Sources not listed within [azure] max_age: the events of every group that may count their VMs wait until they are listed again (Azure starts them at NotBefore meanwhile); the other groups decide on");
                }
                return false;
            }
            None => format!("a source not listed within [azure] max_age: {failing:?}"),
        };
        if view
            .logged
            .is_none_or(|at| at.elapsed() >= WAITING_LOG_EVERY)
        {
            view.logged = Some(Instant::now());
            tracing::error!(why = %why, "Nothing is decided until the Azure inventory is whole and fresh (Azure starts events at NotBefore meanwhile)");
        }
        true
    }

    /// An agent spoke for `vm`, new to the fleet: a VM the Azure inventory lacks (a
    /// scale-out since the last listing) asks for a listing soon.
    pub(super) fn azure_new_agent(&mut self, vm: &str) {
        if let Some(view) = &self.azure
            && self.fleet.azure_vm(vm).is_none()
        {
            view.nudge.notify_one();
        }
    }

    /// `/fleet`'s `azure`.
    pub(super) fn azure_view(&self, now: DateTime<Utc>) -> Option<AzureJson<'_>> {
        let view = self.azure.as_ref()?;
        for source in &view.sources {
            let age = source
                .listed_at
                .map_or(-1.0, |at| (now - at).num_milliseconds() as f64 / 1000.0);
            let group = self.policy.groups[source.group].name.clone();
            metrics::gauge!("sched_relay_coordinator_azure_listing_age_seconds", "group" => group)
                .set(age);
        }
        Some(AzureJson {
            clash: self.fleet.azure_clash(),
            complete: view.complete,
            sources: &view.sources,
            vms: self.fleet.azure(),
            warnings: &view.warnings,
        })
    }
}

/// `/fleet`'s `azure`: the view and the VMs it lists.
#[derive(serde::Serialize)]
pub(super) struct AzureJson<'e> {
    clash: Option<String>,
    complete: bool,
    sources: &'e [SourceStatus],
    vms: &'e std::collections::BTreeMap<String, crate::coordinator::azure::AzureVm>,
    warnings: &'e [String],
}
