//! A stand-in for Azure Resource Manager over the simulated VMs of one process: the calls a
//! fleet coordinator makes to learn a fleet (scale-set, resource-group and subscription
//! listings, one VM, scale set or availability set, their `scheduledEventsPolicy`) and to
//! approve an event without reaching the VM (`Microsoft.Maintenance/scheduledevents/{id}/
//! acknowledge`), plus the IMDS managed-identity token endpoint that issues the bearer tokens
//! it checks. One listener serves every VM.
//!
//! It holds no copy of a VM: each answer is computed from the same `State` the VM's IMDS
//! server uses, advanced to the request's instant, so ARM and IMDS never disagree, and an
//! acknowledge approves through `State::approve`, the StartRequest's own path.
//!
//! Azure's semantics it keeps: a bearer token is required and checked (401 with
//! `WWW-Authenticate`, told apart: missing, never issued, expired, other audience), the
//! api-version is required, ARM path segments and names compare case-insensitively, lists
//! are paged with an absolute `nextLink`, per-subscription read and write limits answer 429
//! with `Retry-After`. Test hooks (not Azure): `GET /__arm/requests`, `POST /__arm/throttle`,
//! `POST /__arm/fail`.
//!
//! Layout: `inventory` turns the scenarios' `[vm]` tables into ARM resources and maps a VM's
//! simulated life to its power and provisioning state; `render` writes Azure's JSON shapes;
//! `gate` issues tokens and applies authentication and rate limits; `server` answers the
//! token endpoint and the hooks and puts every ARM call through the gate; `routes` serves
//! what passes.

mod gate;
mod inventory;
mod render;
mod routes;
mod server;
#[cfg(test)]
mod tests;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::Simulator;
use super::state::lock;
use gate::Gate;
use inventory::Inventory;

/// How the stand-in pages, issues tokens and limits requests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArmOptions {
    /// Items per page of a list; more come through `nextLink` (Azure: varies, often 1000 for
    /// VMs; small values exercise paging).
    pub page_size: usize,
    /// How long an issued token is accepted (Azure's managed identity: about 24 h; 1 h here
    /// so that refreshing is exercised; `azure_identity` refreshes 5 minutes before expiry).
    pub token_lifetime: Duration,
    /// GET requests per subscription over a sliding hour (ARM's classic limit: 12,000).
    pub read_limit_per_hour: u32,
    /// POST requests per subscription over a sliding hour (ARM's classic limit: 1,200).
    pub write_limit_per_hour: u32,
}

impl Default for ArmOptions {
    fn default() -> Self {
        ArmOptions {
            page_size: 100,
            token_lifetime: Duration::from_secs(3600),
            read_limit_per_hour: 12_000,
            write_limit_per_hour: 1_200,
        }
    }
}

/// One request as the stand-in received it (`GET /__arm/requests`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ArmRequest {
    /// Milliseconds since the stand-in started.
    pub at_ms: u64,
    pub method: String,
    pub path: String,
    /// The raw query string, if any.
    pub query: Option<String>,
    /// Whether the request's bearer token was one this stand-in issued and still valid;
    /// `None` for requests that need none (the token endpoint).
    pub bearer_valid: Option<bool>,
    /// The status answered; `None` while in flight.
    pub status: Option<u16>,
}

/// Why the stand-in could not start.
#[derive(Debug, thiserror::Error)]
pub enum ArmError {
    #[error(
        "VM {vm}: resource_id {resource_id:?} is neither /subscriptions/S/resourceGroups/RG/providers/Microsoft.Compute/virtualMachines/NAME nor .../virtualMachineScaleSets/SS/virtualMachines/ID"
    )]
    ResourceId { vm: String, resource_id: String },
    #[error("VMs {first} and {second} have the same resource_id {resource_id}")]
    SameResource {
        resource_id: String,
        first: String,
        second: String,
    },
    #[error(
        "VM {vm} is in scale set {scale_set} and names availability_set {availability_set}: a scale-set VM cannot be in an availability set"
    )]
    AvailabilitySetInScaleSet {
        vm: String,
        scale_set: String,
        availability_set: String,
    },
    #[error(
        "scale set {scale_set}: VMs {first} and {second} have different scheduled_events_policy tables; a scale set has one policy, give each of its VMs the same"
    )]
    PoliciesDiffer {
        scale_set: String,
        first: String,
        second: String,
    },
    #[error("cannot listen on {0}: {1}")]
    Listen(SocketAddr, std::io::Error),
}

/// What the listener's handlers share.
struct Arm {
    inventory: Inventory,
    gate: Mutex<Gate>,
    requests: Mutex<Vec<ArmRequest>>,
    started: Instant,
    addr: SocketAddr,
    options: ArmOptions,
}

/// A running ARM stand-in.
pub struct ArmStandIn {
    addr: SocketAddr,
    arm: Arc<Arm>,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl ArmStandIn {
    /// Serves ARM for `vms` (those whose scenario has a `resource_id`) on `listen` (port 0
    /// picks a free one). Refused when a resource id is not a VM's, two VMs share one, or a
    /// scale set's VMs disagree on its policy.
    pub async fn start(
        vms: &[&Simulator],
        listen: SocketAddr,
        options: ArmOptions,
    ) -> Result<ArmStandIn, ArmError> {
        let inventory = Inventory::of(vms)?;
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .map_err(|error| ArmError::Listen(listen, error))?;
        let addr = listener
            .local_addr()
            .map_err(|error| ArmError::Listen(listen, error))?;
        let arm = Arc::new(Arm {
            inventory,
            gate: Mutex::new(Gate::default()),
            requests: Mutex::new(Vec::new()),
            started: Instant::now(),
            addr,
            options,
        });
        let app = axum::Router::new()
            .fallback(server::handle)
            .with_state(arm.clone());
        let (stop, task) = super::spawn_serving(listener, app, "ARM stand-in");
        Ok(ArmStandIn {
            addr,
            arm,
            stop,
            task,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The base URL to use as the ARM endpoint (`https://management.azure.com` in Azure).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The managed-identity token endpoint (`http://169.254.169.254/metadata/identity/
    /// oauth2/token` in Azure).
    pub fn token_url(&self) -> String {
        format!("{}{}", self.url(), server::TOKEN_PATH)
    }

    /// Every request received so far, as `GET /__arm/requests` lists them.
    pub fn requests(&self) -> Vec<ArmRequest> {
        lock(&self.arm.requests).clone()
    }

    pub async fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.task.await;
    }
}
