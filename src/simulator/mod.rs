//! A faithful IMDS Scheduled Events simulator, for tests, demos and rehearsals.
//!
//! It serves `GET`/`POST /metadata/scheduledevents` and `GET /metadata/instance/compute` as the
//! documentation describes them: `Metadata: true` is required (400 without it), the
//! api-version is required and checked (400 with `newest-versions` otherwise), fields are
//! filtered by api-version, an approved or overdue Scheduled event becomes Started and then
//! disappears, and every change of the Events array bumps DocumentIncarnation.
//!
//! Time is computed on each request, not by a ticker: the state at an instant depends only on
//! the scenario and the approvals received, which keeps runs reproducible.
//!
//! Test hooks (not part of IMDS): `GET /__sim/requests` lists every request received, and
//! `GET /__sim/state` tells the incarnation and each event's phase.
//!
//! Layout: `state` is the per-VM state machine and its fault injection, `server` the HTTP
//! route, `scenario` the TOML scenarios, `serve` the `simulate` command, `arm` the Azure Resource Manager stand-in that serves
//! every VM of a fleet from their live states; this module is the handle that starts,
//! inspects and stops a running simulator.

pub mod arm;
mod scenario;
mod serve;
mod server;
mod state;
#[cfg(test)]
mod tests;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde::Serialize;

pub use arm::{ArmError, ArmOptions, ArmRequest, ArmStandIn};
pub use scenario::{
    BUILTIN, Fault, FaultEndpoint, FaultKind, Scenario, SimEvent, SimEventsPolicy, SimPowerState,
    SimProvisioningState, SimUpdate, SimVm,
};
pub use serve::{ServeError, ServePlan, serve};
pub use state::{Phase, RecordedRequest};

use state::{State, lock};

/// A running simulator.
pub struct Simulator {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

/// What `/__sim/state` reports, and what tests and the demo wait on.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct Snapshot {
    pub incarnation: u64,
    pub last_served_incarnation: Option<u64>,
    pub phases: Vec<(String, Phase)>,
    /// Every event has come and gone, and the last document was served since.
    pub finished: bool,
    /// When the scenario's clock started, as Unix microseconds: offsets count from here.
    #[serde(default)]
    pub started_unix_us: i64,
    /// When each event that has started did (approved, or at NotBefore), Unix microseconds.
    #[serde(default)]
    pub started: Vec<(String, i64)>,
    /// Every event that took this VM down: when it started and ended (Unix microseconds;
    /// no end while it lasts) and whether a StartRequest started it (else its NotBefore,
    /// or it appeared Started). The record fleet tests judge budgets by.
    #[serde(default)]
    pub down: Vec<DownRecord>,
}

/// One stretch of time an event kept the simulated VM down.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct DownRecord {
    pub event_id: String,
    pub event_type: String,
    pub from_us: i64,
    pub until_us: Option<i64>,
    pub approved: bool,
    /// Its NotBefore when it started (Azure would have started it then).
    #[serde(default)]
    pub not_before_us: Option<i64>,
}

impl Simulator {
    /// Binds `listen` (port 0 picks a free one) and serves the scenario.
    pub async fn start(scenario: Scenario, listen: SocketAddr) -> std::io::Result<Simulator> {
        Simulator::serve(State::new(scenario), listen).await
    }

    /// Serves several VMs from one process, each on its own port: `listen`'s port and the
    /// ones after it, or each a free one when it is 0. An EventId found in several scenarios
    /// is one Azure event that lists several VMs: it must be the same in each, and a
    /// StartRequest from any of them starts it for all.
    pub async fn start_fleet(
        scenarios: Vec<Scenario>,
        listen: SocketAddr,
    ) -> Result<Vec<Simulator>, FleetError> {
        check_shared_events(&scenarios)?;
        let (started, started_wall) = (Instant::now(), chrono::Utc::now());
        let released = state::Released::default();
        let mut simulators = Vec::with_capacity(scenarios.len());
        for (index, scenario) in scenarios.into_iter().enumerate() {
            let mut address = listen;
            if listen.port() != 0 {
                let port = u16::try_from(usize::from(listen.port()) + index)
                    .map_err(|_| FleetError::Ports(listen))?;
                address.set_port(port);
            }
            let state = State::in_fleet(scenario, started, started_wall, released.clone());
            let simulator = Simulator::serve(state, address)
                .await
                .map_err(|error| FleetError::Listen(address, error))?;
            simulators.push(simulator);
        }
        Ok(simulators)
    }

    async fn serve(state: State, listen: SocketAddr) -> std::io::Result<Simulator> {
        let listener = tokio::net::TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(Mutex::new(state));
        let app = axum::Router::new()
            .fallback(server::handle)
            .with_state(state.clone());
        let (stop, task) = spawn_serving(listener, app, "Simulator");
        Ok(Simulator {
            addr,
            state,
            stop,
            task,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The base URL to configure as `imds.endpoint`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn snapshot(&self) -> Snapshot {
        let mut state = lock(&self.state);
        state.advance(Instant::now());
        snapshot(&state)
    }

    pub fn requests(&self) -> Vec<RecordedRequest> {
        lock(&self.state).requests.clone()
    }

    pub async fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.task.await;
    }
}

/// Why a fleet of simulated VMs could not start.
#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    #[error(
        "event {id} is in the scenarios of {first} and {second}, differently: an event that lists several VMs must be the same in each of their scenarios (type, times, resources, updates, time_scale)"
    )]
    SharedEventDiffers {
        id: String,
        first: String,
        second: String,
    },
    #[error("cannot listen on {0}: {1}")]
    Listen(SocketAddr, std::io::Error),
    #[error("not enough ports after {0} for every VM (use port 0 for free ones)")]
    Ports(SocketAddr),
}

/// Every event found in several scenarios is the same in each.
/// Serves `app` on `listener` until the returned sender is used (or dropped), on a task of
/// its own; `what` names it in the log if serving fails.
fn spawn_serving(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    what: &'static str,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
) {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let served = axum::serve(listener, app).with_graceful_shutdown(async {
            let _ = stopped.await;
        });
        if let Err(error) = served.await {
            tracing::error!(error = %error, "{what} stopped serving");
        }
    });
    (stop, task)
}

fn check_shared_events(scenarios: &[Scenario]) -> Result<(), FleetError> {
    let mut seen: std::collections::HashMap<&str, (&SimEvent, &str, f64)> = Default::default();
    for scenario in scenarios {
        for event in &scenario.events {
            let vm = scenario.vm.name.as_str();
            match seen.get(event.id.as_str()) {
                // The same offsets at another time scale are other instants.
                Some((first, first_vm, scale))
                    if *first != event || *scale != scenario.time_scale =>
                {
                    return Err(FleetError::SharedEventDiffers {
                        id: event.id.clone(),
                        first: (*first_vm).to_owned(),
                        second: vm.to_owned(),
                    });
                }
                Some(_) => {}
                None => {
                    seen.insert(&event.id, (event, vm, scenario.time_scale));
                }
            }
        }
    }
    Ok(())
}

fn snapshot(state: &State) -> Snapshot {
    let phases: Vec<(String, Phase)> = state
        .events
        .iter()
        .map(|e| (e.spec.id.clone(), e.phase))
        .collect();
    let finished = phases.iter().all(|(_, phase)| *phase == Phase::Gone)
        && state.last_served_incarnation == Some(state.incarnation);
    Snapshot {
        incarnation: state.incarnation,
        last_served_incarnation: state.last_served_incarnation,
        phases,
        finished,
        started_unix_us: state.started_wall.timestamp_micros(),
        started: state
            .events
            .iter()
            .filter_map(|e| {
                let at = e.started_at?;
                Some((e.spec.id.clone(), state.wall(at).timestamp_micros()))
            })
            .collect(),
        down: state
            .events
            .iter()
            .filter_map(|e| {
                let at = e.started_at?;
                Some(DownRecord {
                    event_id: e.spec.id.clone(),
                    event_type: e.spec.event_type.clone(),
                    from_us: state.wall(at).timestamp_micros(),
                    until_us: e.ended_at.map(|end| state.wall(end).timestamp_micros()),
                    approved: e.approved_at.is_some_and(|approved| approved <= at),
                    not_before_us: e.not_before.map(|nb| state.wall(nb).timestamp_micros()),
                })
            })
            .collect(),
    }
}
