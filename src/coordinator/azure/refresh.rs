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
    AutoApprove, Listed, Snapshot, SourceStatus, States, merge, read_states, read_vm, with_states,
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

/// A scale set's VMs with their instance view, and what its own policy says Azure
/// approves by itself.
async fn scale_set(arm: &Arm, api: (&str, &str), source: &Source) -> Result<Vec<Listed>, String> {
    let items = arm
        .list(&source.list_path(), &[api, ("$expand", "instanceView")])
        .await?;
    let vms = items
        .iter()
        .map(read_vm)
        .collect::<Result<Vec<Listed>, String>>()?;
    let set = arm.resource(&source.to_string(), &[api]).await?;
    let properties = &set["properties"];
    if properties["orchestrationMode"]
        .as_str()
        .is_some_and(|mode| mode.eq_ignore_ascii_case("Flexible"))
    {
        return Err(format!(
            "{source} is a Flexible scale set, whose VMs ARM lists with its resource group: name the resource group as the source"
        ));
    }
    let policy = AutoApprove::read(&properties["scheduledEventsPolicy"]);
    Ok(vms
        .into_iter()
        .map(|vm| Listed {
            auto_approve: policy,
            ..vm
        })
        .collect())
}

/// The listings of one round that several sources share, each read once: a resource
/// group's VMs, and a subscription's power states.
#[derive(Default)]
struct Batch {
    groups: HashMap<(String, String), Result<Vec<Listed>, String>>,
    states: HashMap<String, Result<States, String>>,
}

/// The standalone VMs of a resource group (or of an availability set in it), with the
/// power states of the subscription's listing.
async fn in_resource_group(
    arm: &Arm,
    api: (&str, &str),
    source: &Source,
    batch: &mut Batch,
) -> Result<Vec<Listed>, String> {
    let group = (
        source.subscription().to_ascii_lowercase(),
        source.resource_group().to_ascii_lowercase(),
    );
    if !batch.groups.contains_key(&group) {
        let listed = arm
            .list(&source.list_path(), &[api])
            .await
            .and_then(|items| items.iter().map(read_vm).collect());
        batch.groups.insert(group.clone(), listed);
    }
    if !batch.states.contains_key(&group.0) {
        let path = format!(
            "/subscriptions/{}/providers/Microsoft.Compute/virtualMachines",
            source.subscription()
        );
        let listed = arm
            .list(&path, &[api, ("statusOnly", "true")])
            .await
            .map(|items| read_states(&items));
        batch.states.insert(group.0.clone(), listed);
    }
    let vms = batch.groups[&group].as_ref().map_err(Clone::clone)?;
    let known = batch.states[&group.0].as_ref().map_err(Clone::clone)?;
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
        let mut batch = Batch::default();
        for (index, source) in &self.sources {
            let listed = match source {
                Source::ScaleSet { .. } => scale_set(&self.arm, api, source).await,
                Source::ResourceGroup { .. } | Source::AvailabilitySet { .. } => {
                    in_resource_group(&self.arm, api, source, &mut batch).await
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
