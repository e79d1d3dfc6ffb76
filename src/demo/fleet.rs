//! `sched-relay demo --fleet`: the fleet coordinator at work on one machine in about a
//! minute. Twelve simulated VMs in three groups (one simulator process, so that an event
//! listing two VMs is one event), an agent for each (`crate::agent::run`, in this process),
//! publishing to NATS JetStream and taking approvals signed with a key made for the run, and
//! the coordinator (`crate::coordinator::run`) draining through a webhook of the demo's
//! own. Every configuration is written as TOML and loaded by the loaders users' files go
//! through, without the environment's `SCHED_RELAY_*` overrides (a shell set up for a real
//! agent or coordinator must not redirect the demo's). The coordinator's decisions are printed as they change in its `/fleet`; the
//! summary is judged from the simulators' records ([`super::summary`]).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tokio::signal::unix::{Signal, SignalKind, signal};
use tokio::sync::{mpsc, watch};

use super::feed::{self, Feed};
use super::nats::{self, NatsError, Server};
use super::plan::{self, CoordinatorPlaces, GROUPS, Names, Planned};
use super::summary::{self, Summary, VmRecord};
use crate::simulator::{Phase, Scenario, Simulator};

/// The run takes about 40 s; past this something is wrong.
const DEADLINE: Duration = Duration::from_secs(120);
/// After the last event is over, how long the coordinator may take to hear of it.
const LAST_REPORTS: Duration = Duration::from_secs(5);
/// How long the agents and the coordinator may take to stop.
const STOPPING: Duration = Duration::from_secs(15);

/// What the run did.
#[derive(Debug)]
pub struct FleetReport {
    pub summary: Summary,
    pub took: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    #[error(transparent)]
    Nats(#[from] NatsError),
    #[error("cannot set up the demo: {0}")]
    Setup(String),
    #[error("the agent of {vm} stopped: {error}")]
    Agent { vm: String, error: String },
    #[error("the coordinator stopped: {0}")]
    Coordinator(String),
    #[error("the run did not finish within {} s; still missing:\n{missing}", DEADLINE.as_secs())]
    Timeout { missing: String },
    #[error("interrupted; everything the demo started is stopped")]
    Interrupted,
    #[error("the simulators' record shows:\n  {}", .0.join("\n  "))]
    Judged(Vec<String>),
}

/// SIGINT and SIGTERM, taken before anything is started, so that the first stops the run
/// and everything it started.
struct Signals {
    interrupt: Signal,
    terminate: Signal,
}

impl Signals {
    async fn first(&mut self) {
        tokio::select! {
            _ = self.interrupt.recv() => {}
            _ = self.terminate.recv() => {}
        }
    }
}

/// From now on, a signal kills the NATS server the demo started, removes the run's
/// directory and exits at once (130): the run is stopping, and whoever sends another one does
/// not want to wait for it.
fn next_signal_exits(server: Option<Server>, dir: PathBuf) {
    let (Ok(mut interrupt), Ok(mut terminate)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) else {
        return;
    };
    tokio::spawn(async move {
        tokio::select! {
            _ = interrupt.recv() => {}
            _ = terminate.recv() => {}
        }
        if let Some(server) = server {
            server.kill();
        }
        let _ = std::fs::remove_dir_all(&dir);
        eprintln!("second signal: exiting now");
        crate::logging::exit_now(130);
    });
}

/// Runs the fleet demo to its summary. `Err` says what went wrong; every process and
/// stream the demo made is gone by then (and its directory).
pub async fn run() -> Result<FleetReport, FleetError> {
    let started = Instant::now();
    let mut signals = Signals {
        interrupt: signal(SignalKind::interrupt()).map_err(|e| FleetError::Setup(e.to_string()))?,
        terminate: signal(SignalKind::terminate()).map_err(|e| FleetError::Setup(e.to_string()))?,
    };
    let run = format!(
        "{}-{:x}",
        std::process::id(),
        chrono::Utc::now().timestamp_subsec_micros()
    );
    let dir = Scratch(std::env::temp_dir().join(format!("sched-relay-demo-fleet-{run}")));
    std::fs::create_dir_all(&dir.0)
        .map_err(|e| FleetError::Setup(format!("cannot create {}: {e}", dir.0.display())))?;
    on_nats(&dir.0, &run, started, &mut signals).await
}

/// The run's directory (configurations, state, key, the NATS server's store), removed
/// however the run ends.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

async fn on_nats(
    dir: &Path,
    run: &str,
    started: Instant,
    signals: &mut Signals,
) -> Result<FleetReport, FleetError> {
    let nats = nats::find_or_start(std::env::var("NATS_URL").ok(), dir).await?;
    let names = Names::new(&nats.url, run);
    let streams = [
        (names.events_stream.clone(), names.events_subjects()),
        (names.approvals_stream.clone(), names.approvals_subjects()),
    ];
    let jetstream = nats::streams(&nats.url, &streams).await?;
    println!(
        "sched-relay demo --fleet: {} simulated VMs in {} groups, an agent on each, and the fleet coordinator, on NATS JetStream",
        plan::vms().len(),
        GROUPS.len()
    );
    match &nats.server {
        Some(server) => println!(
            "  NATS:      nats-server (pid {}) on {}, started for this run and stopped at its end",
            server.0.pid, nats.url
        ),
        None => println!(
            "  NATS:      NATS_URL={}; streams {} and {} made for this run, deleted at its end",
            sched_relay_transport::redact::text(&nats.url),
            names.events_stream,
            names.approvals_stream
        ),
    }
    let result = with_streams(dir, &names, started, signals, &nats).await;
    if nats.server.is_none() {
        let left = nats::delete(&jetstream, &[&names.events_stream, &names.approvals_stream]).await;
        if !left.is_empty() {
            eprintln!(
                "warning: could not delete the demo's stream(s) {} on {}: their messages expire within an hour, the streams stay until removed (nats stream rm <name>)",
                left.join(", "),
                sched_relay_transport::redact::text(&nats.url)
            );
        }
    }
    // `nats` drops here: the server the demo started is killed.
    drop(nats);
    result
}

/// The run's tasks: each sends its name and how it ended.
type Ended = mpsc::UnboundedSender<(String, Result<(), String>)>;

async fn with_streams(
    dir: &Path,
    names: &Names,
    started: Instant,
    signals: &mut Signals,
    nats: &nats::Nats,
) -> Result<FleetReport, FleetError> {
    let planned = plan::events();
    let vms = plan::vms();
    let mut scenarios = Vec::new();
    for vm in &vms {
        let text = plan::scenario(vm, &planned);
        scenarios.push(Scenario::from_toml(&text).map_err(|e| setup("a scenario", e))?);
    }
    let simulators = Simulator::start_fleet(scenarios, ([127, 0, 0, 1], 0).into())
        .await
        .map_err(|e| setup("the simulators", e))?;
    let drains = feed::Drains::default();
    let (drain_url, drain_task) = feed::drain_hook(started, drains.clone())
        .await
        .map_err(|e| setup("the drain hook", e))?;
    let key_file = dir.join("coordinator.key");
    let public_key =
        crate::approval::keys::write_new(&key_file).map_err(|e| setup("the signing key", e))?;
    let listen = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| setup("a port for the coordinator", e))?;
    let text = |path: &Path| path.to_string_lossy().into_owned();
    let coordinator_file = dir.join("coordinator.toml");
    let places = CoordinatorPlaces {
        state_dir: &text(&dir.join("coordinator")),
        listen,
        key_file: &text(&key_file),
        drain_url: &drain_url,
    };
    write(&coordinator_file, &plan::coordinator(names, &places))?;
    let (coordinator_config, policy) =
        crate::coordinator::config::CoordinatorConfig::load_file_only(&coordinator_file).map_err(
            |e| {
                setup(
                    format!(
                        "the coordinator's configuration {}",
                        coordinator_file.display()
                    ),
                    e,
                )
            },
        )?;
    let mut agents = Vec::new();
    for (vm, simulator) in vms.iter().zip(&simulators) {
        let path = dir.join(format!("agent-{vm}.toml"));
        let state = text(&dir.join("agents").join(vm));
        write(
            &path,
            &plan::agent(names, &simulator.url(), &state, &public_key),
        )?;
        let config = crate::config::Config::load_file_only(&path)
            .map_err(|e| setup(format!("the agent configuration {}", path.display()), e))?;
        agents.push((vm.clone(), config));
    }
    print_plan(&drain_url);

    let (stop, stopped) = watch::channel(false);
    let (ended, mut ended_rx) = mpsc::unbounded_channel();
    let until_stopped = |mut stopped: watch::Receiver<bool>| async move {
        let _ = stopped.wait_for(|stop| *stop).await;
    };
    spawn(&ended, "coordinator", {
        let stop = until_stopped(stopped.clone());
        async move { crate::coordinator::run(coordinator_config, policy, stop).await }
    });
    for (vm, config) in agents {
        let stop = until_stopped(stopped.clone());
        spawn(&ended, &vm, async move {
            crate::agent::run(config, crate::agent::RunOptions::default(), stop)
                .await
                .map_err(|e| e.to_string())
        });
    }
    let tasks = vms.len() + 1;

    let watched = watch_run(
        started,
        &planned,
        &simulators,
        &format!("http://{listen}/fleet"),
        signals,
        &mut ended_rx,
    )
    .await;
    let records: Vec<VmRecord> = vms
        .iter()
        .zip(&simulators)
        .map(|(vm, simulator)| VmRecord {
            vm: vm.clone(),
            snapshot: simulator.snapshot(),
            requests: simulator.requests(),
        })
        .collect();

    // Stop everything, whatever happened; a signal now exits at once.
    next_signal_exits(
        nats.server.as_ref().map(|guard| guard.0.clone()),
        dir.to_path_buf(),
    );
    let _ = stop.send(true);
    let mut ended_count = usize::from(
        watched
            .as_ref()
            .err()
            .is_some_and(|e| matches!(e, FleetError::Agent { .. } | FleetError::Coordinator(_))),
    );
    let stopping = tokio::time::sleep(STOPPING);
    tokio::pin!(stopping);
    while ended_count < tasks {
        tokio::select! {
            Some(_) = ended_rx.recv() => ended_count += 1,
            _ = &mut stopping => {
                eprintln!(
                    "warning: {} of the {tasks} agents and coordinator did not stop within {} s",
                    tasks - ended_count,
                    STOPPING.as_secs()
                );
                break;
            }
        }
    }
    for simulator in simulators {
        simulator.stop().await;
    }
    drain_task.abort();
    watched?;

    let drained = drains
        .lock()
        .expect("the drain record is never poisoned")
        .clone();
    let summary = summary::judge(
        &records,
        &planned,
        &drained,
        chrono::Utc::now().timestamp_micros(),
    );
    println!();
    for line in summary.lines() {
        println!("{line}");
    }
    let took = started.elapsed();
    if !summary.problems.is_empty() {
        return Err(FleetError::Judged(summary.problems));
    }
    println!();
    println!(
        "Done in {:.1} s. The same by hand, step by step: the fleet coordinator tutorial (docs/src/coordinator.md).",
        took.as_secs_f64()
    );
    Ok(FleetReport { summary, took })
}

fn setup(what: impl std::fmt::Display, error: impl std::fmt::Display) -> FleetError {
    FleetError::Setup(format!("{what}: {error}"))
}

fn write(path: &Path, text: &str) -> Result<(), FleetError> {
    std::fs::write(path, text)
        .map_err(|e| FleetError::Setup(format!("cannot write {}: {e}", path.display())))
}

/// Runs `task`, and says on `ended` when and how it ended.
fn spawn(
    ended: &Ended,
    name: &str,
    task: impl std::future::Future<Output = Result<(), String>> + Send + 'static,
) {
    let (ended, name) = (ended.clone(), name.to_owned());
    tokio::spawn(async move {
        let result = task.await;
        let _ = ended.send((name, result));
    });
}

fn print_plan(drain_url: &str) {
    let groups: Vec<String> = GROUPS
        .iter()
        .map(|g| {
            format!(
                "{name}-1..{name}-{size} at most {max} down",
                name = g.name,
                size = g.size,
                max = g.max_down
            )
        })
        .collect();
    println!("  groups:    {}", groups.join("; "));
    println!(
        "  events:    a Reboot or a Redeploy on each VM, drained then approved; web-6 and db-3 share a host: one Reboot lists both;"
    );
    println!(
        "             a 5 s Freeze on cache-2, which the coordinator leaves to its NotBefore (its action for Freeze: never)"
    );
    println!(
        "  approvals: signed with an Ed25519 key made for this run (as gen-approval-key makes one), checked by each agent"
    );
    println!(
        "  drain:     a webhook this demo serves on {drain_url}: it says what it drains and takes {} s",
        plan::DRAIN_TAKES.as_secs()
    );
    println!(
        "  logs:      WARN and above on stderr; --log-level info shows the coordinator and the agents narrating"
    );
    println!();
    println!("{:>6}  {:<12} {:<9} what", "time", "who", "type");
}

/// Prints the coordinator's decisions until every simulated event is over and the
/// coordinator has heard so, a task stops, a signal comes, or the deadline passes.
async fn watch_run(
    started: Instant,
    planned: &[Planned],
    simulators: &[Simulator],
    fleet_url: &str,
    signals: &mut Signals,
    ended: &mut mpsc::UnboundedReceiver<(String, Result<(), String>)>,
) -> Result<(), FleetError> {
    crate::install_crypto_provider();
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(2))
        .build()
        .map_err(|e| FleetError::Setup(e.to_string()))?;
    let mut feed = Feed::new(started, planned);
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    let mut finished_at: Option<Instant> = None;
    loop {
        tokio::select! {
            _ = signals.first() => return Err(FleetError::Interrupted),
            Some((name, result)) = ended.recv() => {
                let error = result.err().unwrap_or_else(|| "it stopped by itself".into());
                return Err(if name == "coordinator" {
                    FleetError::Coordinator(error)
                } else {
                    FleetError::Agent { vm: name, error }
                });
            }
            _ = tick.tick() => {}
        }
        if let Ok(snapshot) = crate::watch::coordinator::fetch(&http, fleet_url).await {
            for line in feed.apply(&snapshot) {
                println!("{line}");
            }
        }
        if finished_at.is_none() && simulators.iter().all(|s| s.snapshot().finished) {
            finished_at = Some(Instant::now());
        }
        if finished_at.is_some_and(|at| feed.all_over() || at.elapsed() > LAST_REPORTS) {
            return Ok(());
        }
        if started.elapsed() > DEADLINE {
            return Err(FleetError::Timeout {
                missing: missing(planned, simulators, &feed),
            });
        }
    }
}

/// Every planned event not over on some VM it lists, with the coordinator's last word.
fn missing(planned: &[Planned], simulators: &[Simulator], feed: &Feed) -> String {
    let vms = plan::vms();
    let mut lines = Vec::new();
    for event in planned {
        let phases: Vec<String> = event
            .vms
            .iter()
            .filter_map(|vm| {
                let index = vms.iter().position(|v| v == vm)?;
                let snapshot = simulators[index].snapshot();
                let phase = snapshot
                    .phases
                    .iter()
                    .find(|(id, _)| *id == event.id)
                    .map(|(_, phase)| *phase)?;
                (phase != Phase::Gone).then(|| format!("{phase:?} on {vm}").to_lowercase())
            })
            .collect();
        if phases.is_empty() {
            continue;
        }
        let said = feed
            .verdict(&event.id)
            .map_or("the coordinator has not decided it".to_owned(), |v| {
                format!("the coordinator's last word: {v}")
            });
        lines.push(format!(
            "  {} {} {}: {}; {said}",
            event.who(),
            event.event_type,
            event.short_id(),
            phases.join(", ")
        ));
    }
    if lines.is_empty() {
        "  the coordinator never heard that every event was over".into()
    } else {
        lines.join("\n")
    }
}
