//! Lists every group's Azure source every `[azure] refresh` (and soon after the engine
//! asks: an agent spoke for a VM the inventory lacks) and hands the engine the whole
//! inventory. Reads are batched: a resource group is listed once a round however many
//! sources it holds, and the power states of a subscription's standalone VMs come from one
//! listing of the subscription (`statusOnly=true`). A source whose listing fails keeps its
//! last whole listing, and says why.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::sync::{Notify, mpsc, watch};

use super::AzureConfig;
use super::client::Arm;
use super::inventory::{
    AutoApprove, Listed, Snapshot, SourceStatus, merge, read_states, read_vm, with_states,
};
use super::source::Source;

/// A listing asked for by the engine waits at least this long after the last one.
const NUDGE_GAP: Duration = Duration::from_secs(5);

/// Starts the refresher: the first round at once, then every `refresh`.
pub fn start(
    config: &AzureConfig,
    sources: Vec<(usize, Source)>,
    out: mpsc::Sender<Snapshot>,
    nudge: Arc<Notify>,
    mut stop: watch::Receiver<bool>,
) -> Result<tokio::task::JoinHandle<()>, String> {
    let mut refresher = Refresher {
        arm: Arm::new(config)?,
        api_version: config.compute_api_version.clone(),
        sources,
        last: HashMap::new(),
        errors: HashMap::new(),
    };
    let every = config.refresh;
    Ok(tokio::spawn(async move {
        loop {
            let snapshot = tokio::select! {
                snapshot = refresher.round() => snapshot,
                _ = stop.changed() => return,
            };
            if out.send(snapshot).await.is_err() {
                return;
            }
            let next = tokio::time::sleep(every);
            tokio::pin!(next);
            tokio::select! {
                _ = &mut next => {}
                _ = nudge.notified() => tokio::time::sleep(NUDGE_GAP).await,
                _ = stop.changed() => return,
            }
        }
    }))
}

struct Refresher {
    arm: Arm,
    api_version: String,
    sources: Vec<(usize, Source)>,
    /// Per group, its source's last whole listing and when it was made.
    last: HashMap<usize, (Vec<Listed>, DateTime<Utc>)>,
    /// Per group, why its source's last listing failed.
    errors: HashMap<usize, String>,
}

impl Refresher {
    async fn round(&mut self) -> Snapshot {
        let now = Utc::now();
        let api = ("api-version", self.api_version.as_str());
        let mut groups: HashMap<(String, String), Result<Vec<Listed>, String>> = HashMap::new();
        let mut states = HashMap::new();
        for (index, source) in &self.sources {
            let listed = match source {
                Source::ScaleSet { .. } => {
                    let query = [api, ("$expand", "instanceView")];
                    let vms: Result<Vec<Listed>, String> = self
                        .arm
                        .list(&source.list_path(), &query)
                        .await
                        .and_then(|items| items.iter().map(read_vm).collect());
                    // The scale set's own policy says what Azure approves by itself.
                    match (vms, self.arm.resource(&source.to_string(), &[api]).await) {
                        (Ok(_), Ok(set))
                            if set["properties"]["orchestrationMode"]
                                .as_str()
                                .is_some_and(|mode| mode.eq_ignore_ascii_case("Flexible")) =>
                        {
                            Err(format!(
                                "{source} is a Flexible scale set, whose VMs ARM lists with its resource group: name the resource group as the source"
                            ))
                        }
                        (Ok(mut vms), Ok(set)) => {
                            let policy =
                                AutoApprove::read(&set["properties"]["scheduledEventsPolicy"]);
                            vms.iter_mut().for_each(|vm| vm.auto_approve = policy);
                            Ok(vms)
                        }
                        (Err(error), _) | (_, Err(error)) => Err(error),
                    }
                }
                Source::ResourceGroup { .. } | Source::AvailabilitySet { .. } => {
                    let key = (
                        source.subscription().to_ascii_lowercase(),
                        source.resource_group().to_ascii_lowercase(),
                    );
                    if !groups.contains_key(&key) {
                        let listed = self
                            .arm
                            .list(&source.list_path(), &[api])
                            .await
                            .and_then(|items| items.iter().map(read_vm).collect());
                        groups.insert(key.clone(), listed);
                    }
                    if !states.contains_key(&key.0) {
                        let path = format!(
                            "/subscriptions/{}/providers/Microsoft.Compute/virtualMachines",
                            source.subscription()
                        );
                        let listed = self
                            .arm
                            .list(&path, &[api, ("statusOnly", "true")])
                            .await
                            .map(|items| read_states(&items));
                        states.insert(key.0.clone(), listed);
                    }
                    match (&groups[&key], &states[&key.0]) {
                        (Ok(vms), Ok(known)) => {
                            let set = source.availability_set_id();
                            let mut vms: Vec<Listed> = vms
                                .iter()
                                .filter(|vm| {
                                    set.as_ref().is_none_or(|set| {
                                        vm.availability_set
                                            .as_ref()
                                            .is_some_and(|id| id.eq_ignore_ascii_case(set))
                                    })
                                })
                                .cloned()
                                .collect();
                            with_states(&mut vms, known);
                            Ok(vms)
                        }
                        (Err(error), _) | (_, Err(error)) => Err(error.clone()),
                    }
                }
            };
            match listed {
                Ok(vms) => {
                    if !self.last.contains_key(index) {
                        tracing::info!(source = %source, vms = vms.len(), "Azure inventory listed");
                    }
                    self.last.insert(*index, (vms, now));
                    self.errors.remove(index);
                }
                Err(error) => {
                    tracing::warn!(source = %source, error = %error, "Cannot list an Azure source; its last listing stands");
                    self.errors.insert(*index, error);
                }
            }
        }
        self.snapshot()
    }

    fn snapshot(&self) -> Snapshot {
        let per_group: Vec<(usize, Vec<Listed>)> = self
            .sources
            .iter()
            .filter_map(|(index, _)| Some((*index, self.last.get(index)?.0.clone())))
            .collect();
        let (vms, clashes) = merge(&per_group);
        let clash = |index: &usize| clashes.iter().find(|(g, _)| g == index).map(|(_, why)| why);
        let sources = self
            .sources
            .iter()
            .map(|(index, source)| SourceStatus {
                group: *index,
                source: source.to_string(),
                // A listing that clashes with another is not used: as if never listed.
                listed_at: self
                    .last
                    .get(index)
                    .filter(|_| clash(index).is_none())
                    .map(|(_, at)| *at),
                vms: self.last.get(index).map_or(0, |(vms, _)| vms.len()),
                error: clash(index).or(self.errors.get(index)).cloned(),
                auto_approve: self
                    .last
                    .get(index)
                    .map_or_else(AutoApprove::default, |(vms, _)| {
                        vms.iter()
                            .fold(AutoApprove::default(), |all, vm| all.or(vm.auto_approve))
                    }),
            })
            .collect();
        Snapshot { vms, sources }
    }
}
