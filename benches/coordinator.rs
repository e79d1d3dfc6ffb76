//! The coordinator at fleet scale (issue 39, part 7): `sched-relay coordinate` (the shipped
//! build) on a private NATS JetStream server, against one process that speaks for N agents
//! (benches/coordinator/agents.rs: the agents' own code makes, publishes and checks every
//! message). Run by `scripts/coordinator-load`, which writes benches/coordinator-load.md
//! (included in BENCHMARKS.md). Nothing is asserted: it measures and reports.
//!
//! Each run, at N VMs in groups of 100 (each at most 5 % down, so 5 VMs; every 5th VM has
//! an event, so 20 per group and half of them must wait), plus a `probe` group of 20 VMs
//! the measurements use:
//! 1. Inventory: every agent starts (its first document and heartbeat) over 10 s, then
//!    beats every 300 s (the shipped interval); timed until the coordinator's groups hold
//!    all N VMs.
//! 2. The wave: N/5 events (2,000 at 10,000 VMs) appear over 30 s, interleaved across the
//!    groups, each with Azure's 15-minute notice: 3 in 4 a Reboot (drained through a
//!    webhook the load generator serves, 500 ms, then approved; the VM is down 10 s and its
//!    agent restarts), 1 in 4 a 5 s Freeze (approved). The coordinator's CPU (schedstat) and
//!    peak RSS (VmHWM) are taken over the wave.
//! 3. Decision latency, from the load generator's own record, never the coordinator's: for
//!    an event reported while its group had room and nothing waiting, from the report's
//!    publication to the first action on it (the drain webhook call, or the approval's
//!    arrival); for an event that waited, from the publication of the return that freed a
//!    place of its full group to that action. The coordinator's own histogram is shown
//!    beside it.
//! 4. Restart: the coordinator is killed (SIGKILL) after the wave; while it is down, every
//!    VM's heartbeat is published (the backlog of a 5-minute outage); it is started again
//!    and a probe event is reported at once: timed from the start to that event's
//!    approval, which comes only after the state is loaded and the backlog read.
//!    With `--ha` instead: two coordinators share their state in NATS KV (the shipped
//!    8 s lease, or `--lease`'s); the active one is stopped (SIGSTOP) right after it
//!    renewed its lease, the phase after which a standby waits longest, and a probe event
//!    is reported at once: timed from the stop to the standby's approval of it.
//!
//!   cargo bench --profile dist --all-features --bench coordinator -- [--vms 500,2000,10000] [--ha [--lease 8s]]

#[path = "coordinator/agents.rs"]
mod agents;
#[path = "../tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use agents::{Agents, Planned};
use common::fleet::{Coordinator, quantile};
use sched_relay_core::approval::SigningKey;
use sched_relay_nats::testing::PrivateNats;
use sched_relay_transport::testing::free_port;

const GROUP: usize = 100;
const PERCENT: usize = 5;
const PROBES: usize = 20;
const START_SPREAD: Duration = Duration::from_secs(10);
const WAVE_SPREAD: Duration = Duration::from_secs(30);
const REBOOT_DOWN: Duration = Duration::from_secs(10);
const FREEZE_DOWN: Duration = Duration::from_secs(5);
const DRAIN: Duration = Duration::from_millis(500);

/// What one run measured.
struct Run {
    vms: usize,
    events: usize,
    ha: bool,
    inventory: f64,
    on_report: Vec<f64>,
    on_return: Vec<f64>,
    unpaired: usize,
    never_acted: usize,
    own_p50: Option<f64>,
    own_p99: Option<f64>,
    wave_seconds: f64,
    returned: usize,
    cpu: f64,
    peak_rss_kib: u64,
    rss_after_kib: u64,
    load: f64,
    restart: f64,
    bad: usize,
    generator_cpu: f64,
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let scales: Vec<usize> = args
        .iter()
        .position(|a| a == "--vms")
        .and_then(|i| args.get(i + 1))
        .map(|list| {
            list.split(',')
                .map(|n| n.parse().expect("--vms N[,N...]"))
                .collect()
        })
        .unwrap_or_else(|| vec![500, 2000, 10000]);
    let ha = args.iter().any(|a| a == "--ha");
    let lease = args
        .iter()
        .position(|a| a == "--lease")
        .and_then(|i| args.get(i + 1))
        .cloned();
    let runs: Vec<Run> = scales
        .iter()
        .map(|&vms| run(vms, ha, lease.as_deref()))
        .collect();
    report(&runs, &scales, ha, lease.as_deref());
}

fn run(vms: usize, ha: bool, lease: Option<&str>) -> Run {
    eprintln!(
        "coordinator at {vms} VMs{}",
        if ha { " with a standby" } else { "" }
    );
    let nats = PrivateNats::start(&[]).expect("nats-server is installed (scripts/brokers)");
    let url = nats.url();
    let dir = tempfile::tempdir().unwrap();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        // The approvals' stream, as the agents create it.
        let client = async_nats::connect(&url).await.unwrap();
        async_nats::jetstream::new(client)
            .create_stream(async_nats::jetstream::stream::Config {
                name: "SCHEDULEDAPPROVALS".into(),
                subjects: vec!["scheduledapprovals.>".into()],
                max_age: Duration::from_secs(24 * 3600),
                ..Default::default()
            })
            .await
            .unwrap();
    });
    let key = SigningKey::generate_ed25519().unwrap();
    let key_file = dir.path().join("coordinator.key");
    std::fs::write(&key_file, &key).unwrap();
    let public_key = SigningKey::parse(&key).unwrap().public_key().unwrap();

    assert!(
        vms.is_multiple_of(GROUP),
        "--vms: a multiple of {GROUP} (groups of {GROUP})"
    );
    let groups = vms / GROUP;
    let mut names: Vec<String> = (0..vms).map(|n| format!("g{}-{n}", n / GROUP)).collect();
    let mut group_of: Vec<usize> = (0..vms).map(|n| n / GROUP).collect();
    names.extend((0..PROBES).map(|n| format!("probe-{n}")));
    group_of.extend(std::iter::repeat_n(groups, PROBES));
    let agents = Agents::new(&url, &names, &group_of, GROUP * PERCENT / 100, &public_key);

    // The drain webhook.
    let drain_port = free_port();
    {
        let agents = agents.clone();
        runtime.spawn(async move {
            let app = axum::Router::new().route(
                "/drain",
                axum::routing::post(move |body: axum::Json<serde_json::Value>| {
                    let agents = agents.clone();
                    async move {
                        agents.drain_called(body["eventId"].as_str().unwrap_or_default());
                        tokio::time::sleep(DRAIN).await;
                        "drained"
                    }
                }),
            );
            let listener = tokio::net::TcpListener::bind(("127.0.0.1", drain_port))
                .await
                .unwrap();
            axum::serve(listener, app).await.unwrap();
        });
    }

    let port = free_port();
    let mut group_text = String::new();
    for g in 0..groups {
        group_text.push_str(&format!(
            "\n[[groups]]\nname = \"g{g}\"\nvm_name = \"g{g}-*\"\nmax_down_percent = {PERCENT}\n"
        ));
    }
    group_text.push_str("\n[[groups]]\nname = \"probe\"\nvm_name = \"probe-*\"\nmax_down = 10\n");
    let config = dir.path().join("coordinator.toml");
    std::fs::write(
        &config,
        format!(
            "[coordinator]\nstate_dir = \"{state}\"\nlisten = \"127.0.0.1:{port}\"\n\n\
             [input]\nkind = \"nats\"\nurl = \"{url}\"\nstream = \"SCHEDULEDEVENTS\"\nsubject = \"scheduledevents.>\"\n\n\
             [approvals]\nkind = \"nats\"\nurl = \"{url}\"\nsubject = \"scheduledapprovals.{{vmname}}\"\njetstream = true\n\n\
             [signing]\nkey_file = \"{key}\"\nkey_id = \"coordinator\"\n\n\
             [drain]\nurl = \"http://127.0.0.1:{drain_port}/drain\"\n\n\
             [defaults]\nmax_down = 1\n[defaults.actions]\nReboot = \"drain_then_approve\"\nFreeze = {{ action = \"approve\", max_duration = \"30s\" }}\n\
             {group_text}\n{ha_section}",
            state = dir.path().join("state").display(),
            key = key_file.display(),
            ha_section = if ha {
                match lease {
                    Some(lease) => format!("[ha]\nurl = \"{url}\"\nlease = \"{lease}\"\n"),
                    None => format!("[ha]\nurl = \"{url}\"\n"),
                }
            } else {
                String::new()
            },
        ),
    )
    .unwrap();
    let mut coordinator =
        Coordinator::start(config.clone(), dir.path().join("coordinator.log"), port);
    let mut standby = ha.then(|| coordinator.standby(dir.path()));
    if let Some(second) = standby.as_mut() {
        // The active one is whoever took the lease first.
        let deadline = Instant::now() + Duration::from_secs(60);
        while coordinator.role() != "active" {
            if second.role() == "active" {
                std::mem::swap(&mut coordinator, second);
                break;
            }
            assert!(Instant::now() < deadline, "no active coordinator");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    let generator_cpu_before = cpu_seconds(std::process::id());

    // 1. Inventory.
    let listener = runtime.block_on(async_nats::connect(&url)).unwrap();
    runtime.spawn(agents.clone().answer_approvals(listener));
    let began = Instant::now();
    for n in 0..agents.len() {
        let agents = agents.clone();
        let first = began + START_SPREAD.mul_f64(n as f64 / agents.len() as f64);
        runtime.spawn(async move {
            tokio::time::sleep_until(first.into()).await;
            agents.start(n).await;
            agents.keep_beating(n, first + agents::HEARTBEAT).await;
        });
    }
    let deadline = Instant::now() + Duration::from_secs(600);
    let mut said = Instant::now();
    loop {
        let known = known(&coordinator);
        if known >= agents.len() {
            break;
        }
        if said.elapsed() > Duration::from_secs(10) {
            said = Instant::now();
            let input = coordinator
                .metrics()
                .lines()
                .filter(|l| l.starts_with("sched_relay_coordinator_input_total"))
                .collect::<Vec<_>>()
                .join(", ");
            eprintln!(
                "  {known} VMs known after {:.0} s; publish failures {}; {input}",
                began.elapsed().as_secs_f64(),
                agents.record.lock().unwrap().publish_failures
            );
        }
        assert!(
            Instant::now() < deadline,
            "the inventory never filled:\n{}",
            coordinator.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let inventory = began.elapsed().as_secs_f64();
    eprintln!("inventory of {} VMs in {inventory:.1} s", agents.len());

    // 2. The wave.
    let pid = coordinator.pid().unwrap();
    let cpu_before = cpu_seconds(pid);
    let wave = Instant::now() + Duration::from_secs(1);
    let planned: Vec<Planned> = wave_plan(vms, wave);
    let events = planned.len();
    let planned_ids: Vec<String> = planned.iter().map(|p| p.id.clone()).collect();
    for event in planned {
        runtime.spawn(agents.clone().live(event));
    }
    let deadline = wave + Duration::from_secs(600);
    let mut peak_rss_kib = 0;
    while agents.record.lock().unwrap().returned < events && Instant::now() < deadline {
        peak_rss_kib = peak_rss_kib.max(hwm_kib(pid));
        std::thread::sleep(Duration::from_millis(500));
    }
    let wave_seconds = wave.elapsed().as_secs_f64();
    let cpu = cpu_seconds(pid) - cpu_before;
    peak_rss_kib = peak_rss_kib.max(hwm_kib(pid));
    let rss_after_kib = common::memory(pid).0;
    let metrics = coordinator.metrics();
    let own_p50 = quantile(&metrics, "sched_relay_coordinator_decision_seconds", 0.5);
    let own_p99 = quantile(&metrics, "sched_relay_coordinator_decision_seconds", 0.99);
    eprintln!("wave of {events} events over in {wave_seconds:.1} s");
    let never_acted = planned_ids
        .iter()
        .filter(|id| agents.first_action(id).is_none())
        .count();
    let (on_report, on_return, unpaired, returned, bad) = {
        let record = agents.record.lock().unwrap();
        eprintln!("slowest decision: {:?}", record.slowest);
        (
            record.on_report.clone(),
            record.on_return.clone(),
            record.unpaired,
            record.returned,
            record.bad_approvals,
        )
    };

    // 3. Restart, or failover.
    let probe = |k: usize| Planned {
        vm: vms + k,
        id: format!("0be00000-0000-4000-8000-{k:012}"),
        ty: "Freeze",
        appear: Instant::now(),
        down_for: FREEZE_DOWN,
    };
    let (load, restart) = match standby.as_mut() {
        None => {
            coordinator.kill9();
            // A 5-minute outage's heartbeats: one from every VM.
            runtime.block_on(async {
                futures_util::stream::iter(0..agents.len())
                    .map(|n| {
                        let agents = agents.clone();
                        async move { agents.heartbeat(n).await }
                    })
                    .buffer_unordered(256)
                    .collect::<Vec<()>>()
                    .await
            });
            let started = Instant::now();
            coordinator.spawn();
            let id = probe(0).id;
            runtime.spawn(agents.clone().live(probe(0)));
            // /healthz says `starting` until the state is loaded.
            while coordinator.role() != "active" && started.elapsed() < Duration::from_secs(300) {
                std::thread::sleep(Duration::from_millis(20));
            }
            let load = started.elapsed().as_secs_f64();
            let approved = wait_first_action(&agents, &id);
            (load, approved.duration_since(started).as_secs_f64())
        }
        Some(second) => {
            // Stopped just after a renewal: the lease then lives a whole period on, the
            // longest a standby can have to wait (stopped at a random moment, it waits
            // between two thirds of a period and one).
            runtime.block_on(renewed(&url));
            coordinator.signal("STOP");
            let stopped = Instant::now();
            let id = probe(0).id;
            runtime.spawn(agents.clone().live(probe(0)));
            // The standby's /healthz says `active` once it holds the lease and its state.
            while second.role() != "active" && stopped.elapsed() < Duration::from_secs(300) {
                std::thread::sleep(Duration::from_millis(20));
            }
            let active = stopped.elapsed().as_secs_f64();
            let approved = wait_first_action(&agents, &id);
            let took_over = approved.duration_since(stopped).as_secs_f64();
            coordinator.signal("CONT");
            let _ = coordinator.wait_exit(Duration::from_secs(15));
            std::mem::swap(&mut coordinator, second);
            (active, took_over)
        }
    };
    eprintln!("restart or takeover: {restart:.2} s");
    if std::env::var_os("BENCH_KEEP").is_some() {
        eprintln!("kept: {}", dir.keep().display());
    }
    let generator_cpu = cpu_seconds(std::process::id()) - generator_cpu_before;
    let bad = bad.max(agents.record.lock().unwrap().bad_approvals);
    let result = Run {
        vms,
        events,
        ha,
        inventory,
        on_report,
        on_return,
        unpaired,
        never_acted,
        own_p50,
        own_p99,
        wave_seconds,
        returned,
        cpu,
        peak_rss_kib,
        rss_after_kib,
        load,
        restart,
        bad,
        generator_cpu,
    };
    drop(coordinator);
    drop(standby);
    runtime.shutdown_background();
    drop(nats);
    result
}

use futures_util::StreamExt;

/// The wave's events: every 5th VM, interleaved across the groups over [`WAVE_SPREAD`].
fn wave_plan(vms: usize, wave: Instant) -> Vec<Planned> {
    let mut chosen: Vec<usize> = (0..vms).filter(|n| n % 5 == 0).collect();
    // By place in its group first, so each group's events are spread over the whole wave.
    chosen.sort_by_key(|n| (n % GROUP, n / GROUP));
    let total = chosen.len();
    chosen
        .into_iter()
        .enumerate()
        .map(|(k, n)| {
            let freeze = (n / 5) % 4 == 3;
            Planned {
                vm: n,
                id: format!("f1ee7000-0000-4000-8000-{n:012}"),
                ty: if freeze { "Freeze" } else { "Reboot" },
                appear: wave + WAVE_SPREAD.mul_f64(k as f64 / total as f64),
                down_for: if freeze { FREEZE_DOWN } else { REBOOT_DOWN },
            }
        })
        .collect()
}

/// When the first action on the event `id` arrived, waiting for it.
fn wait_first_action(agents: &Agents, id: &str) -> Instant {
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        if let Some(at) = agents.first_action(id) {
            return at;
        }
        assert!(
            Instant::now() < deadline,
            "the probe event {id} was never approved"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The VMs the coordinator's groups hold, from its metrics.
fn known(coordinator: &Coordinator) -> usize {
    coordinator
        .metrics()
        .lines()
        .filter(|l| l.starts_with("sched_relay_coordinator_group_size{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as usize
}

/// CPU seconds of `pid` so far, user and system, threads that exited included
/// (`/proc/<pid>/stat`, in clock ticks of 1/100 s).
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // After the command name, which is in parentheses and may hold spaces.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or("", |(_, rest)| rest)
        .split_whitespace()
        .collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name.
    (ticks(11) + ticks(12)) as f64 / 100.0
}

/// Peak resident memory of `pid` so far, in KiB.
fn hwm_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0)
}

/// The `q` quantile of `samples`, in milliseconds.
fn ms(samples: &[f64], q: f64) -> String {
    if samples.is_empty() {
        return "-".into();
    }
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    let index = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len()) - 1;
    format!("{:.1}", sorted[index] * 1000.0)
}

/// Returns once the active coordinator renewed its lease (the `leader` key of the shipped
/// bucket's lease bucket written again; a KV watch delivers new writes only).
async fn renewed(url: &str) {
    use futures_util::StreamExt;
    let client = async_nats::connect(url).await.unwrap();
    let lease = async_nats::jetstream::new(client)
        .get_key_value("sched-relay-coordinator-lease")
        .await
        .unwrap();
    let mut watch = lease.watch("leader").await.unwrap();
    let renewal = async {
        while let Some(entry) = watch.next().await {
            if entry.unwrap().operation == async_nats::jetstream::kv::Operation::Put {
                return;
            }
        }
        panic!("the lease's watch ended");
    };
    tokio::time::timeout(Duration::from_secs(60), renewal)
        .await
        .expect("the active coordinator renews its lease within a minute");
}

fn report(runs: &[Run], scales: &[usize], ha: bool, lease: Option<&str>) {
    let list = scales
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(",");
    println!(
        "## The coordinator at fleet scale{}\n",
        if ha { ", with a standby" } else { "" }
    );
    println!(
        "`cargo bench --profile dist --all-features --bench coordinator -- --vms {list}{}{}` (`scripts/coordinator-load`), on {} CPU(s); the load and how each figure is taken are described in `benches/coordinator.rs`. Latencies are from the load generator's own record: its publication of a report, the arrival of the drain call or approval it caused.\n",
        if ha { " --ha" } else { "" },
        lease.map(|l| format!(" --lease {l}")).unwrap_or_default(),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
    );
    let header: Vec<String> = runs.iter().map(|r| format!("{} VMs", r.vms)).collect();
    println!("| measure | {} | goal |", header.join(" | "));
    println!("|---|{}---|", "---|".repeat(runs.len()));
    let row = |name: &str, cells: Vec<String>, goal: &str| {
        println!("| {name} | {} | {goal} |", cells.join(" | "));
    };
    row(
        "events in the wave / back at the end",
        runs.iter()
            .map(|r| format!("{} / {}", r.events, r.returned))
            .collect(),
        "all",
    );
    row(
        "inventory: every agent's first heartbeat (over 10 s) to all VMs in the coordinator's groups, s",
        runs.iter().map(|r| format!("{:.1}", r.inventory)).collect(),
        "",
    );
    row(
        "decision on a report (room in the group), p50 / p99 / max ms (samples)",
        runs.iter()
            .map(|r| {
                format!(
                    "{} / {} / {} ({})",
                    ms(&r.on_report, 0.5),
                    ms(&r.on_report, 0.99),
                    ms(&r.on_report, 1.0),
                    r.on_report.len()
                )
            })
            .collect(),
        "p99 ≤ 50",
    );
    row(
        "decision on a return (a place freed in a full group), p50 / p99 / max ms (samples)",
        runs.iter()
            .map(|r| {
                format!(
                    "{} / {} / {} ({})",
                    ms(&r.on_return, 0.5),
                    ms(&r.on_return, 0.99),
                    ms(&r.on_return, 1.0),
                    r.on_return.len()
                )
            })
            .collect(),
        "p99 ≤ 50",
    );
    row(
        "waiting events acted on with no return to pair (not timed) / never acted on",
        runs.iter()
            .map(|r| format!("{} / {}", r.unpaired, r.never_acted))
            .collect(),
        "0 / 0",
    );
    row(
        "the coordinator's own histogram (message to action), p50 / p99 ms, bucket bounds",
        runs.iter()
            .map(|r| {
                format!(
                    "≤ {} / ≤ {}",
                    r.own_p50.map_or("-".into(), |v| format!("{}", v * 1000.0)),
                    r.own_p99.map_or("-".into(), |v| format!("{}", v * 1000.0))
                )
            })
            .collect(),
        "",
    );
    row(
        "wave: first event to every VM back, s",
        runs.iter()
            .map(|r| format!("{:.1}", r.wave_seconds))
            .collect(),
        "",
    );
    row(
        "coordinator CPU (user + system) over the wave, s (per event of the wave, ms, all its messages included)",
        runs.iter()
            .map(|r| {
                format!(
                    "{:.2} ({:.2})",
                    r.cpu,
                    r.cpu * 1000.0 / r.events.max(1) as f64
                )
            })
            .collect(),
        "",
    );
    row(
        "coordinator peak RSS since its start (VmHWM) / RSS after the wave, MiB",
        runs.iter()
            .map(|r| {
                format!(
                    "{:.1} / {:.1}",
                    r.peak_rss_kib as f64 / 1024.0,
                    r.rss_after_kib as f64 / 1024.0
                )
            })
            .collect(),
        "≤ 256",
    );
    if ha {
        row(
            &format!(
                "takeover: the active one stopped right after a renewal to the standby active (/healthz), s (lease {})",
                lease.unwrap_or("8s")
            ),
            runs.iter().map(|r| format!("{:.2}", r.load)).collect(),
            "",
        );
        row(
            "takeover: the active one stopped right after a renewal to the standby's approval of a probe event reported then, s",
            runs.iter().map(|r| format!("{:.2}", r.restart)).collect(),
            "≤ 10",
        );
    } else {
        row(
            "restart after SIGKILL, a heartbeat from every VM waiting: start to its state loaded (/healthz active), s",
            runs.iter().map(|r| format!("{:.2}", r.load)).collect(),
            "",
        );
        row(
            "restart: start to the approval of a probe event reported at the start (state loaded, backlog read), s",
            runs.iter().map(|r| format!("{:.2}", r.restart)).collect(),
            "≤ 10",
        );
    }
    row(
        "approvals that failed the agents' checks",
        runs.iter().map(|r| r.bad.to_string()).collect(),
        "0",
    );
    row(
        "load generator CPU over the run, s",
        runs.iter()
            .map(|r| format!("{:.1}", r.generator_cpu))
            .collect(),
        "",
    );
    let _ = runs.iter().all(|r| r.ha == ha);
}
