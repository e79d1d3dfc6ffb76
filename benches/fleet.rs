//! The fleet coordinator on a simulated fleet: N agents (500 by default), each against its
//! own simulated VM and on the shipped `[imds]` defaults, a private broker, and
//! `sched-relay coordinate`, through a scripted maintenance wave with faults. Run by
//! `scripts/fleet`, which writes the report to benches/fleet.md or benches/fleet-amqp.md
//! (included in BENCHMARKS.md).
//! Nothing is asserted: it measures and reports, from the simulators' own records.
//!
//! The wave (real seconds; Azure's 15-minute notice time-scaled to 180 s, Spot's 30 s to 6 s):
//! every VM gets a Reboot or a Redeploy (drain, then approve) appearing over the first 60 s;
//! every 10th VM a 5 s Freeze (approve); every 25th a Spot eviction (Preempt: drain, then
//! approve); every 20th a Redeploy that Azure cancels after 15 s; every 30th a host-level
//! Reboot that lists it and the next two VMs (three groups; drain all three, then one
//! approval releases them). Ten groups by name, each at most 10 % down. One simulator
//! process serves every VM, each on its own port, so that a shared event is one event.
//! Faults: every 50th agent killed with SIGKILL and restarted, the NATS server restarted,
//! the coordinator killed with SIGKILL and restarted.
//!
//! And what every fleet meets (issue 36), judged from the simulators' own record of who was
//! down when: a quiet fleet (the coordinator starts after the agents' documents have left a
//! stream that keeps 40 s, or, through RabbitMQ, after they went to no queue: it knows the
//! VMs from their heartbeats, every 20 s); a scale-in of group g9 with Terminate notices
//! (never approved; each VM deleted when its Terminate starts); a Reboot whose VM never
//! comes back (g3-13: its agent dies once it started); and every 100th agent (n = 77) in
//! dry run. The wave starts `WAVE_START` after the simulators.
//!
//! The broker is a private NATS JetStream server (`--broker nats`, the default) or a private
//! RabbitMQ node (`--broker amqp`: events to a topic exchange and the coordinator's durable
//! queue, approvals to each agent's own queue); either is restarted half-way. Private, so
//! that restarting it touches nothing else on the machine.
//!
//! With `--ha` (NATS), two coordinators share their state in NATS KV, and instead of the
//! SIGKILL the active one is stopped (SIGSTOP) as soon as a drain starts, woken only once the
//! standby has taken over and approved that event: it must write nothing and exit.
//!
//! With `--arm`, every group is also listed by the simulator's Azure Resource Manager
//! stand-in (one resource group per group) and approves `agent_then_arm`, and a third of
//! the VMs (n % 3 == 2, but the dry-run and scaled-in ones) run no agent: their events
//! reach the coordinator through the document of the agent before them (as Azure lists a
//! set's events in each of its VMs' documents), and are acknowledged through ARM.
//!
//!   cargo bench --profile dist --features nats,amqp,azure --bench fleet -- [--vms N] [--broker nats|amqp] [--ha] [--arm]

#[path = "../tests/common/mod.rs"]
mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::fleet::{Coordinator, Downtime, downtimes, over_budget, posts, quantile};
use common::{AgentProcess, SimProcess};
use sched_relay_amqp::testing::PrivateRabbit;
use sched_relay_core::approval::SigningKey;
use sched_relay_nats::testing::PrivateNats;
use sched_relay_transport::testing::free_port;

const GROUPS: usize = 10;
const PERCENT: usize = 10;
const NOTICE: u64 = 180;
const SPOT_NOTICE: u64 = 6;
const DOWN_FOR: Duration = Duration::from_secs(4);
const SPREAD: f64 = 60.0;
/// The wave's first event, after the simulators start: the agents are up and their first
/// documents have left the stream before the coordinator starts.
const WAVE_START: f64 = 120.0;
/// The coordinator's expected outage for every approvable type: the simulated outage and a
/// second for the agents' polls.
const OUTAGE: Duration = Duration::from_secs(5);
/// The scale-in: these VMs of g9 get a Terminate, and are deleted when it starts.
fn scaled_in(n: usize) -> bool {
    n % GROUPS == 9 && n < 50
}
/// The Reboot whose VM never comes back.
const NEVER_BACK: usize = 13;
/// The EventId of NEVER_BACK's Reboot (or Redeploy).
fn never_back_id() -> String {
    format!("f1ee7000-0000-4000-8000-01{NEVER_BACK:010}")
}
/// Agents in dry run: they answer `accepted` with `dryRun` and POST nothing.
fn dry_run(n: usize) -> bool {
    n % 100 == 77
}

/// The subscription of `--arm` runs.
const SUBSCRIPTION: &str = "0b1f6471-1bf0-4dda-aec3-777788889999";
/// With `--arm`: VM `n` runs no agent.
fn agentless(arm: bool, n: usize) -> bool {
    arm && n % 3 == 2 && !dry_run(n) && !scaled_in(n)
}
/// The VM whose agent reports the events of agentless VM `n`: the nearest before it with
/// an agent that lives through the wave.
fn reporter(arm: bool, n: usize) -> usize {
    (0..n)
        .rev()
        .find(|&m| !agentless(arm, m) && !scaled_in(m) && m != NEVER_BACK)
        .expect("VM 0 has an agent")
}

/// One scripted event: (EventId, type, appears after s, notice s, duration, cancel after s,
/// the VMs it lists when more than the one whose scenario has it).
#[derive(Clone)]
struct Planned {
    id: String,
    ty: &'static str,
    appear: f64,
    notice: u64,
    duration: i64,
    cancel_after: Option<u64>,
    resources: Vec<String>,
}

/// VM `n`'s own events.
fn plan(n: usize, vms: usize) -> Vec<Planned> {
    let appear = WAVE_START + SPREAD * n as f64 / vms as f64;
    let id = |kind: u8| format!("f1ee7000-0000-4000-8000-{kind:02}{n:010}");
    if scaled_in(n) {
        return vec![Planned {
            resources: Vec::new(),
            id: id(6),
            ty: "Terminate",
            appear: WAVE_START + 10.0,
            notice: 30,
            duration: -1,
            cancel_after: None,
        }];
    }
    let mut events = vec![Planned {
        resources: Vec::new(),
        id: id(1),
        ty: if n.is_multiple_of(2) {
            "Reboot"
        } else {
            "Redeploy"
        },
        appear,
        notice: NOTICE,
        duration: -1,
        cancel_after: None,
    }];
    if n % 10 == 3 {
        events.push(Planned {
            id: id(2),
            ty: "Freeze",
            appear: appear + 1.0,
            notice: NOTICE,
            duration: 5,
            cancel_after: None,
            resources: Vec::new(),
        });
    }
    if n % 25 == 7 {
        events.push(Planned {
            id: id(3),
            ty: "Preempt",
            appear: appear + 2.0,
            notice: SPOT_NOTICE,
            duration: -1,
            cancel_after: None,
            resources: Vec::new(),
        });
    }
    if n % 20 == 11 {
        events.push(Planned {
            id: id(4),
            ty: "Redeploy",
            appear: appear + 0.5,
            notice: NOTICE,
            duration: -1,
            cancel_after: Some(15),
            resources: Vec::new(),
        });
    }
    events
}

/// Host-level Reboots, each listing three consecutive VMs (so three groups), added to the
/// plans of all three.
fn plan_host_events(names: &[String], plans: &mut [Vec<Planned>]) {
    let vms = names.len();
    for n in (0..vms.saturating_sub(2)).filter(|n| n % 30 == 5) {
        if (n..n + 3).any(scaled_in) {
            continue;
        }
        let event = Planned {
            id: format!("f1ee7000-0000-4000-8000-05{n:010}"),
            ty: "Reboot",
            appear: WAVE_START + SPREAD * n as f64 / vms as f64 + 1.5,
            notice: NOTICE,
            duration: -1,
            cancel_after: None,
            resources: names[n..n + 3].to_vec(),
        };
        for plan in &mut plans[n..n + 3] {
            plan.push(event.clone());
        }
    }
}

fn scenario(vm: &str, events: &[Planned], arm: bool) -> String {
    let mut text = format!("[vm]\nname = \"{vm}\"\n");
    if arm {
        let group = vm.split('-').next().unwrap_or_default();
        text.push_str(&format!(
            "resource_id = \"/subscriptions/{SUBSCRIPTION}/resourceGroups/rg-{group}/providers/Microsoft.Compute/virtualMachines/{vm}\"\n"
        ));
    }
    for e in events {
        let resources = if e.resources.is_empty() {
            vec![vm.to_owned()]
        } else {
            e.resources.clone()
        };
        // A terminated VM is deleted, and NEVER_BACK's Reboot never ends: the simulator keeps
        // them Started for the rest of the run.
        let down_for = if e.ty == "Terminate" || e.id == never_back_id() {
            1000
        } else {
            DOWN_FOR.as_secs()
        };
        text.push_str(&format!(
            "\n[[events]]\nid = \"{}\"\ntype = \"{}\"\nresources = {resources:?}\nappear_after = \"{}ms\"\nnotice = \"{}s\"\nduration_in_seconds = {}\nstarted_for = \"{down_for}s\"\n",
            e.id, e.ty, (e.appear * 1000.0) as u64, e.notice, e.duration
        ));
        if let Some(after) = e.cancel_after {
            text.push_str(&format!("cancel_after = \"{after}s\"\n"));
        }
    }
    text
}

/// CPU nanoseconds of every thread of `pid` so far, and its RSS and PSS in KiB.
fn footprint(pid: u32) -> (u64, u64, u64) {
    let mut cpu = 0;
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for task in tasks.flatten() {
            let stat = std::fs::read_to_string(task.path().join("schedstat")).unwrap_or_default();
            cpu += stat
                .split_whitespace()
                .next()
                .and_then(|n| n.parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    let (rss, pss, _) = common::memory(pid);
    (cpu, rss, pss)
}

/// [`footprint`] of every agent; zeros for one not running (killed, or never started:
/// the VMs without an agent of `--arm`).
fn footprints(agents: &mut [AgentProcess]) -> Vec<(u64, u64, u64)> {
    agents
        .iter_mut()
        .map(|a| {
            if a.is_running() {
                footprint(a.pid())
            } else {
                (0, 0, 0)
            }
        })
        .collect()
}

/// The private broker of the run.
enum Bus {
    Nats(PrivateNats),
    Rabbit(PrivateRabbit),
}

impl Bus {
    /// The broker's URL.
    fn url(&self) -> String {
        match self {
            Bus::Nats(nats) => nats.url(),
            Bus::Rabbit(rabbit) => rabbit.url(),
        }
    }

    /// The agents' sink and approval source, the coordinator's `[input]` and `[approvals]`.
    fn configs(&self) -> (String, String, String) {
        match self {
            Bus::Nats(nats) => {
                let url = nats.url();
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap()
                    .block_on(async {
                        // Kept 40 s: the coordinator, started later, sees no agent's first
                        // document, as after a quiet day (heartbeats make the inventory).
                        let client = async_nats::connect(&url).await.unwrap();
                        async_nats::jetstream::new(client)
                            .create_stream(async_nats::jetstream::stream::Config {
                                name: "FLEET".into(),
                                subjects: vec!["fleet.>".into()],
                                max_age: Duration::from_secs(40),
                                ..Default::default()
                            })
                            .await
                            .unwrap();
                    });
                (
                    format!(
                        "[[sinks]]\nname = \"bus\"\nkind = \"nats\"\nurl = \"{url}\"\nsubject = \"fleet.{{vmname}}.{{transition}}\"\njetstream = true\n\n\
                         [approvals.nats]\nsink = \"bus\"\nsubject = \"fleet.approvals.{{vmname}}\"\nstream = \"FLEET\"\n"
                    ),
                    format!(
                        "kind = \"nats\"\nurl = \"{url}\"\nstream = \"FLEET\"\nsubject = \"fleet.>\""
                    ),
                    format!(
                        "kind = \"nats\"\nurl = \"{url}\"\nsubject = \"fleet.approvals.{{vmname}}\"\njetstream = true"
                    ),
                )
            }
            Bus::Rabbit(rabbit) => {
                let url = rabbit.url();
                (
                    format!(
                        "[[sinks]]\nname = \"bus\"\nkind = \"amqp\"\nurl = \"{url}\"\nexchange = \"fleet\"\n\n\
                         [approvals.amqp]\nsink = \"bus\"\nexchange = \"fleet.approvals\"\nqueue = \"fleet.approvals.{{vmname}}\"\n"
                    ),
                    format!(
                        "kind = \"amqp\"\nurl = \"{url}\"\nexchange = \"fleet\"\nqueue = \"fleet.coordinator\""
                    ),
                    format!(
                        "kind = \"amqp\"\nurl = \"{url}\"\nexchange = \"fleet.approvals\"\nrouting_key = \"approvals.{{vmname}}\""
                    ),
                )
            }
        }
    }

    /// Down for `outage`, then up again on the same data.
    fn restart(&mut self, outage: Duration) {
        match self {
            Bus::Nats(nats) => {
                nats.stop();
                std::thread::sleep(outage);
                nats.restart();
            }
            Bus::Rabbit(rabbit) => {
                rabbit.stop();
                std::thread::sleep(outage);
                assert!(
                    rabbit.restart(),
                    "the private RabbitMQ node did not start again"
                );
            }
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let vms: usize = args
        .iter()
        .position(|a| a == "--vms")
        .and_then(|i| args.get(i + 1))
        .and_then(|n| n.parse().ok())
        .unwrap_or(500);
    let broker = args
        .iter()
        .position(|a| a == "--broker")
        .and_then(|i| args.get(i + 1))
        .map_or("nats", String::as_str);
    // Two coordinators sharing their state in NATS KV; the active one is stopped (SIGSTOP) in
    // the middle of a drain instead of killed, and woken once the standby took over.
    let ha = args.iter().any(|a| a == "--ha");
    // A third of the VMs without an agent, approved through ARM.
    let arm = args.iter().any(|a| a == "--arm");
    assert!(!ha || broker == "nats", "--ha needs --broker nats");
    let dir = tempfile::tempdir().unwrap();
    let mut bus = match broker {
        "nats" => {
            Bus::Nats(PrivateNats::start(&[]).expect("nats-server is installed (scripts/brokers)"))
        }
        "amqp" => Bus::Rabbit(
            PrivateRabbit::start().expect("rabbitmq-server is installed (scripts/brokers)"),
        ),
        other => panic!("--broker {other}: expected nats or amqp"),
    };
    let (agent_bus, input, output) = bus.configs();
    let key = SigningKey::generate_ed25519().unwrap();
    let key_file = dir.path().join("coordinator.key");
    std::fs::write(&key_file, &key).unwrap();
    let public_key = SigningKey::parse(&key).unwrap().public_key().unwrap();

    eprintln!("starting {vms} simulators and agents");
    let started = Instant::now();
    let names: Vec<String> = (0..vms).map(|n| format!("g{}-{n}", n % GROUPS)).collect();
    let mut plans: Vec<Vec<Planned>> = (0..vms).map(|n| plan(n, vms)).collect();
    // An agentless VM's events, listing it alone, are in its reporter's document too.
    for n in (0..vms).filter(|&n| agentless(arm, n)) {
        let own: Vec<Planned> = plans[n]
            .iter_mut()
            .map(|e| {
                e.resources = vec![names[n].clone()];
                e.clone()
            })
            .collect();
        plans[reporter(arm, n)].extend(own);
    }
    plan_host_events(&names, &mut plans);
    // Which VMs each event takes down (a document holds the events of other VMs too).
    let takes_down: BTreeMap<String, Vec<String>> = names
        .iter()
        .zip(&plans)
        .flat_map(|(vm, plan)| {
            plan.iter().map(move |e| {
                let vms = if e.resources.is_empty() {
                    vec![vm.clone()]
                } else {
                    e.resources.clone()
                };
                (e.id.clone(), vms)
            })
        })
        .collect();
    let paths: Vec<String> = names
        .iter()
        .zip(&plans)
        .map(|(vm, plan)| {
            let path = dir.path().join(format!("{vm}.toml"));
            std::fs::write(&path, scenario(vm, plan, arm)).unwrap();
            path.to_str().unwrap().to_owned()
        })
        .collect();
    let paths: Vec<&str> = paths.iter().map(String::as_str).collect();
    let (sims, arm_url) = if arm {
        let (sims, url) = SimProcess::start_fleet_with_arm(&paths, 1.0);
        (sims, Some(url))
    } else {
        (SimProcess::start_fleet(&paths, 1.0), None)
    };
    let origin = Instant::now();
    let mut agents = Vec::new();
    for (n, sim) in sims.iter().enumerate() {
        let mut agent = AgentProcess::configure_on_defaults(
            &sim.url,
            &format!(
                "[events]\nheartbeat_interval = \"20s\"\n\n{agent_bus}\n\
                 [[approvals.keys]]\nid = \"coordinator\"\nalgorithm = \"ed25519\"\npublic_key = \"{public_key}\"\n"
            ),
        );
        agent.set_env(&[("SCHED_RELAY_LOG__LEVEL", "warn")]);
        if !agentless(arm, n) {
            agent.spawn(if dry_run(n) { &["--dry-run"] } else { &[] });
        }
        agents.push(agent);
    }
    std::thread::sleep(Duration::from_secs(3));
    for (_, agent) in agents
        .iter_mut()
        .enumerate()
        .filter(|(n, _)| !agentless(arm, *n))
    {
        assert!(
            agent.is_running(),
            "an agent exited at start:\n{}",
            agent.log()
        );
    }
    eprintln!("fleet started in {:?}", started.elapsed());
    let drain = dir.path().join("drain.sh");
    let drains = dir.path().join("drains.log");
    std::fs::write(
        &drain,
        format!("echo \"$1 $2\" >> {}\nsleep 0.5\n", drains.display()),
    )
    .unwrap();
    let port = free_port();
    let mut groups = String::new();
    for g in 0..GROUPS {
        groups.push_str(&format!(
            "\n[[groups]]\nname = \"g{g}\"\nvm_name = \"g{g}-*\"\nmax_down_percent = {PERCENT}\n"
        ));
        if arm {
            groups.push_str(&format!(
                "[groups.azure]\nsource = \"/subscriptions/{SUBSCRIPTION}/resourceGroups/rg-g{g}\"\napprove_via = \"agent_then_arm\"\n"
            ));
        }
    }
    // The stand-in, as the coordinator reaches Azure Resource Manager.
    let azure_section = arm_url.as_ref().map_or(String::new(), |url| {
        format!(
            "[azure]\nresource_manager = \"{url}\"\nmanaged_identity_endpoint = \"{url}\"\naudience = \"https://management.azure.com\"\n"
        )
    });
    let config = dir.path().join("coordinator.toml");
    std::fs::write(
        &config,
        format!(
            "[coordinator]\nstate_dir = \"{state}\"\nlisten = \"127.0.0.1:{port}\"\n\n\
             [input]\n{input}\n\n\
             [approvals]\n{output}\n\n\
             [signing]\nkey_file = \"{key}\"\nkey_id = \"coordinator\"\n\n\
             [drain]\ncommand = [\"sh\", \"{drain}\", \"{{vmname}}\", \"{{eventid}}\"]\nmargin = \"30s\"\n\n\
             [defaults]\nmax_down = 1\n[defaults.actions]\nReboot = \"drain_then_approve\"\nRedeploy = \"drain_then_approve\"\nPreempt = \"drain_then_approve\"\nFreeze = {{ action = \"approve\", max_duration = \"10s\" }}\nTerminate = \"never\"\n\
             [defaults.outage]\nReboot = \"{outage}s\"\nRedeploy = \"{outage}s\"\n{groups}\n{ha_section}\n{azure_section}",
            ha_section = if ha {
                format!("[ha]\nurl = \"{}\"\nbucket = \"fleet-ha\"\nlease = \"5s\"\n", bus.url())
            } else {
                String::new()
            },
            state = dir.path().join("state").display(),
            key = key_file.display(),
            drain = drain.display(),
            outage = OUTAGE.as_secs(),
        ),
    )
    .unwrap();
    // The quiet fleet: every first document has left the stream (40 s) when it starts.
    std::thread::sleep(Duration::from_secs(45).saturating_sub(origin.elapsed()));
    let before = footprints(&mut agents);
    let mut coordinator =
        Coordinator::start(config.clone(), dir.path().join("coordinator.log"), port);
    let coordinator_cpu_before = footprint(coordinator.pid().unwrap()).0;
    // The standby: the same file, another listener and name.
    let mut standby = ha.then(|| coordinator.standby(dir.path()));

    // VMs the test deletes when their event starts (the scale-in's Terminates) or whose agent
    // dies then (the Reboot that never comes back), watched while waiting.
    let name_of = |n: usize| names[n].clone();
    let mut watched: Vec<usize> = (0..vms)
        .filter(|n| scaled_in(*n) || *n == NEVER_BACK)
        .collect();
    let mut deleted: BTreeMap<String, i64> = BTreeMap::new();
    let mut wait_until = |when: Instant, agents: &mut Vec<AgentProcess>| {
        while Instant::now() < when {
            watched.retain(|&n| {
                let started = sims[n].state()["down"]
                    .as_array()
                    .is_some_and(|d| !d.is_empty());
                if started {
                    agents[n].kill9();
                    if scaled_in(n) {
                        deleted.insert(name_of(n), chrono::Utc::now().timestamp_micros());
                    }
                }
                !started
            });
            std::thread::sleep(Duration::from_millis(500).min(when - Instant::now().min(when)));
        }
    };
    let wave = origin + Duration::from_secs_f64(WAVE_START);
    wait_until(wave, &mut agents);
    let known_at_wave = coordinator.fleet()["vms"]
        .as_object()
        .map_or(0, |vms| vms.len());

    // Faults, at fixed moments of the wave.
    let at = |s: u64| wave + Duration::from_secs(s);
    wait_until(at(25), &mut agents);
    let killed: Vec<usize> = (0..vms)
        .step_by(50)
        .filter(|&n| !agentless(arm, n))
        .collect();
    for &n in &killed {
        agents[n].kill9();
    }
    std::thread::sleep(Duration::from_secs(3));
    for &n in &killed {
        agents[n].spawn(&[]);
    }
    eprintln!("{} agents killed and restarted", killed.len());
    wait_until(at(40), &mut agents);
    bus.restart(Duration::from_secs(2));
    eprintln!("{broker} restarted");
    wait_until(at(55), &mut agents);
    // With a standby, the broker's restart can outlast the active one's lease: it exits and
    // the standby takes over. Whoever exited is started again (as the standby), and the
    // active one is the one stalled next.
    let mut lease_lost = 0;
    if let Some(second) = standby.as_mut() {
        for c in [&mut coordinator, &mut *second] {
            if c.wait_exit(Duration::from_millis(100)).is_some() {
                lease_lost += 1;
                c.spawn();
            }
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        while coordinator.role() != "active" && second.role() != "active" {
            assert!(Instant::now() < deadline, "no active coordinator");
            std::thread::sleep(Duration::from_millis(50));
        }
        if second.role() == "active" {
            std::mem::swap(&mut coordinator, second);
        }
    }
    let coordinator_cpu_first = footprint(coordinator.pid().unwrap())
        .0
        .saturating_sub(coordinator_cpu_before);
    let mut failover = None;
    match standby.take() {
        None => {
            coordinator.kill9();
            std::thread::sleep(Duration::from_secs(2));
            coordinator.spawn();
            eprintln!("coordinator killed and restarted");
        }
        Some(standby) => {
            failover = Some(stall_in_a_drain(
                &mut coordinator,
                &standby,
                &drains,
                &names,
                &sims,
            ));
            coordinator = standby;
            eprintln!("the active coordinator stalled in a drain; the standby took over");
        }
    }
    let coordinator_cpu_second = footprint(coordinator.pid().unwrap()).0;

    // Until every event has had its NotBefore and its end.
    wait_until(
        at(SPREAD as u64 + NOTICE + DOWN_FOR.as_secs() + 10),
        &mut agents,
    );
    let elapsed = wave.elapsed();
    let after = footprints(&mut agents);
    let (coordinator_cpu_end, coordinator_rss, coordinator_pss) =
        footprint(coordinator.pid().unwrap());
    // One process serves every VM.
    let (_, sim_rss, sim_pss) = footprint(sims[0].pid());
    let fleet = coordinator.fleet();
    let metrics = coordinator.metrics();
    // For a post-mortem: what the coordinator knew at the end, its log, and every VM's POSTs.
    let kept = std::path::Path::new("target").join(format!("fleet-{broker}"));
    std::fs::create_dir_all(&kept).unwrap();
    std::fs::write(kept.join("fleet.json"), fleet.to_string()).unwrap();
    std::fs::write(kept.join("coordinator.log"), coordinator.log()).unwrap();
    let all_posts: Vec<serde_json::Value> = names
        .iter()
        .zip(&sims)
        .flat_map(|(vm, sim)| {
            posts(sim).into_iter().map(move |(body, at, status)| {
                serde_json::json!({"vm": vm, "body": body, "unix_us": at, "status": status})
            })
        })
        .collect();
    std::fs::write(
        kept.join("posts.json"),
        serde_json::Value::from(all_posts).to_string(),
    )
    .unwrap();
    eprintln!(
        "the coordinator's state, log and every POST: {}",
        kept.display()
    );

    // What the simulators say.
    let limit = (vms / GROUPS * PERCENT).div_ceil(100);
    let (
        mut approvable,
        mut approved,
        mut after_not_before,
        mut duplicates,
        mut left_to_azure,
        mut cancelled,
    ) = (0, 0, 0, 0, 0, 0);
    let (mut shared, mut shared_released) = (0, 0);
    let mut lost = Vec::new();
    // Every accepted POST of the fleet: an event listing several VMs is approved through one
    // of them and releases all.
    let accepted: Vec<(String, i64)> = sims
        .iter()
        .flat_map(posts)
        .filter(|(_, _, status)| *status == 200)
        .map(|(body, at, _)| (body, at))
        .collect();
    // Every acknowledgement through ARM the stand-in took (200), by EventId; and its calls.
    let arm_calls: Vec<serde_json::Value> = arm_url.as_ref().map_or(Vec::new(), |url| {
        let (_, body) = common::blocking_get(&format!("{url}/__arm/requests"), &[]);
        serde_json::from_str(&body).unwrap()
    });
    let mut acked: BTreeMap<String, usize> = BTreeMap::new();
    for call in &arm_calls {
        let path = call["path"].as_str().unwrap_or_default();
        if let Some(rest) = path.strip_suffix("/acknowledge")
            && call["status"] == 200
        {
            let id = rest.rsplit('/').next().unwrap_or_default();
            *acked.entry(id.to_ascii_lowercase()).or_default() += 1;
        }
    }
    let (mut approved_arm, mut acknowledgements) = (0, 0);
    let mut counted = std::collections::HashSet::new();
    for (n, vm) in names.iter().enumerate() {
        let origin_us = sims[n].state()["started_unix_us"].as_i64().unwrap();
        for e in &plans[n] {
            let for_it: Vec<i64> = accepted
                .iter()
                .filter(|(body, _)| body.contains(&e.id))
                .map(|(_, at)| *at)
                .collect();
            // Counted once per Azure event.
            let first = counted.insert(e.id.clone());
            let not_before = origin_us + ((e.appear + e.notice as f64) * 1e6) as i64;
            // Through ARM: approved when the simulator started it on that approval.
            let acks = acked.get(&e.id.to_ascii_lowercase()).copied().unwrap_or(0);
            let through_arm = (acks > 0)
                .then(|| {
                    sims[n].state()["down"]
                        .as_array()?
                        .iter()
                        .find(|d| d["event_id"] == e.id.as_str() && d["approved"] == true)?["from_us"]
                        .as_i64()
                })
                .flatten();
            // An acknowledgement of an event already started is a 200 too: not an approval.
            if first && through_arm.is_some() {
                approved_arm += 1;
            }
            if first {
                acknowledgements += acks;
            }
            if e.cancel_after.is_some() && for_it.is_empty() && acks == 0 {
                cancelled += usize::from(first);
            } else if e.ty != "Terminate" {
                approvable += usize::from(first);
                match for_it.iter().min().copied().or(through_arm) {
                    None => left_to_azure += usize::from(first),
                    Some(at) if first => {
                        approved += 1;
                        after_not_before += usize::from(at > not_before);
                    }
                    Some(_) => {}
                }
            }
            if first {
                duplicates += usize::from(for_it.len() > 1);
                if e.resources.len() > 1 {
                    shared += 1;
                    // Released on every VM it lists by that one POST: each one's
                    // simulator started it then (within half a second), not at NotBefore.
                    let released = for_it.len() == 1
                        && e.resources.iter().all(|listed| {
                            let i = names.iter().position(|name| name == listed).unwrap();
                            sims[i].state()["started"]
                                .as_array()
                                .unwrap()
                                .iter()
                                .find(|p| p[0] == e.id.as_str())
                                .and_then(|p| p[1].as_i64())
                                .is_some_and(|at| (at - for_it[0]).abs() < 500_000)
                        });
                    shared_released += usize::from(released);
                }
            }
            // Lost: the coordinator never heard of it from this VM, or not of its end (but
            // from the VMs that were deleted or never came back).
            if scaled_in(n) || n == NEVER_BACK || agentless(arm, n) {
                continue;
            }
            let known = fleet["events"]
                .as_array()
                .unwrap()
                .iter()
                .find(|m| m["event_id"] == e.id.as_str());
            let ended = known
                .and_then(|m| m["reports"][vm.as_str()]["stage"].as_str())
                .is_some_and(|s| s == "completed" || s == "cancelled");
            if !ended {
                lost.push(format!("{vm}/{}", e.id));
            }
        }
    }
    // The ceiling, from the simulators' record of who was down when (every VM deleted gone
    // from then on): an approval's VM down, within its expected outage, while its group had
    // more VMs down than its budget.
    let mut record: Vec<Downtime> = downtimes(names.iter().zip(&sims));
    // A VM's simulator records every event of its document; only those listing it took it
    // down.
    record.retain(|d| {
        takes_down
            .get(&d.event_id)
            .is_none_or(|listed| listed.contains(&d.vm))
    });
    for d in &mut record {
        if let Some(gone) = deleted.get(&d.vm) {
            d.until_us = Some(d.until_us.map_or(*gone, |u| u.min(*gone)));
        }
    }
    let group_of = |vm: &str| vm.split('-').next().unwrap_or_default().to_owned();
    let limits: BTreeMap<String, usize> = (0..GROUPS).map(|g| (format!("g{g}"), limit)).collect();
    let outage_us = OUTAGE.as_micros() as i64;
    let violations = over_budget(&record, group_of, &limits, |_| Some(outage_us));
    // The most VMs down at once per group, Azure's own starts included.
    let mut most = vec![0usize; GROUPS];
    for d in &record {
        let g = group_of(&d.vm);
        let down: std::collections::BTreeSet<&str> = record
            .iter()
            .filter(|o| {
                group_of(&o.vm) == g
                    && o.from_us <= d.from_us
                    && d.from_us < o.until_us.unwrap_or(i64::MAX)
            })
            .map(|o| o.vm.as_str())
            .collect();
        let index: usize = g[1..].parse().unwrap_or(0);
        most[index] = most[index].max(down.len());
    }
    let dry_vms: Vec<usize> = (0..vms).filter(|n| dry_run(*n)).collect();
    let dry_posts: usize = dry_vms.iter().map(|n| posts(&sims[*n]).len()).sum();
    let dry_answers: u64 = fleet["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["approval"]["dry_run_answers"].as_u64())
        .sum();
    let left = metrics
        .lines()
        .find(|l| l.starts_with("sched_relay_coordinator_vms_left_total"))
        .and_then(|l| l.rsplit(' ').next())
        .unwrap_or("0")
        .to_owned();
    let never_back_down = fleet["groups"].as_array().unwrap().iter().any(|g| {
        g["down"]
            .as_array()
            .is_some_and(|d| d.iter().any(|v| *v == names[NEVER_BACK].as_str()))
    });
    let agent_cpu: Vec<f64> = before
        .iter()
        .zip(&after)
        .map(|(b, a)| a.0.saturating_sub(b.0) as f64 / 1e6)
        .collect();
    let agent_cpu_total: f64 = agent_cpu.iter().sum();
    let agent_rss: u64 = after.iter().map(|a| a.1).sum();
    let agent_pss: u64 = after.iter().map(|a| a.2).sum();
    let coordinator_cpu =
        (coordinator_cpu_first + coordinator_cpu_end.saturating_sub(coordinator_cpu_second)) as f64
            / 1e6;
    let p50 = quantile(&metrics, "sched_relay_coordinator_decision_seconds", 0.5);
    let p99 = quantile(&metrics, "sched_relay_coordinator_decision_seconds", 0.99);
    let ms = |v: Option<f64>| v.map_or("-".into(), |v| format!("<= {:.1} ms", v * 1000.0));

    if let Some(f) = failover.as_mut() {
        f.requests = kv_requests(&bus, &f.event);
        f.posts = names
            .iter()
            .zip(&sims)
            .flat_map(|(_, sim)| posts(sim))
            .filter(|(body, _, status)| body.contains(&f.event) && *status == 200)
            .count();
    }
    let ha_flag = format!(
        "{}{}",
        if ha { " --ha" } else { "" },
        if arm { " --arm" } else { "" }
    );
    let features = if arm { "nats,amqp,azure" } else { "nats,amqp" };
    let broker_name = if broker == "amqp" {
        "RabbitMQ"
    } else {
        "NATS JetStream"
    };
    println!(
        "## Fleet coordinator: a simulated fleet of {vms} VMs, through {broker_name}{}{}\n",
        if ha { ", with a standby" } else { "" },
        if arm {
            ", a third of them without an agent, approved through Azure Resource Manager"
        } else {
            ""
        }
    );
    println!(
        "`scripts/fleet --vms {vms} --broker {broker}{ha_flag}` (`cargo bench --profile dist --features {features} --bench fleet -- --vms {vms} --broker {broker}{ha_flag}`), on {} CPU(s); the wave and its faults are described in `benches/fleet.rs`. Figures from the simulators' own records.\n",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!("| measure | result | goal |\n|---|---|---|");
    println!(
        "| events scripted (approvable / cancelled by Azure first) | {approvable} / {cancelled} | |"
    );
    println!("| approved by the coordinator (one POST each) | {approved} | |");
    println!(
        "| host-level events listing 3 VMs (one per group) / released on all 3 by one POST | {shared} / {shared_released} | all |"
    );
    if arm {
        let without = (0..vms).filter(|&n| agentless(arm, n)).count();
        let count = |method: &str, status: Option<u64>| {
            arm_calls
                .iter()
                .filter(|c| {
                    c["method"] == method
                        && c["path"]
                            .as_str()
                            .is_some_and(|p| p.starts_with("/subscriptions/"))
                        && status.is_none_or(|s| c["status"] == s)
                })
                .count()
        };
        println!(
            "| VMs without an agent (their events reported by a neighbour's agent) / events approved through ARM / acknowledgements ARM took (200) | {without} of {vms} / {approved_arm} / {acknowledgements} | / all of theirs / |"
        );
        println!(
            "| ARM calls over the run: reads (GET) / writes (POST) / answered 429 | {} / {} / {} | |",
            count("GET", None),
            count("POST", None),
            arm_calls.iter().filter(|c| c["status"] == 429).count()
        );
    }
    println!("| left to NotBefore (never approved) | {left_to_azure} | |");
    println!(
        "| moments an approval's VM was down while its group was over budget ({limit} of {} VMs), from the simulators' record / most VMs down at once per group, Azure's own starts included | {} / {most:?} | 0 |",
        vms / GROUPS,
        violations.len()
    );
    println!(
        "| quiet fleet: VMs the coordinator knew when the wave began (from heartbeats alone) | {known_at_wave} of {} | all |",
        (0..vms).filter(|&n| !agentless(arm, n)).count()
    );
    println!(
        "| scale-in of g9 ({} VMs, Terminate then deleted): left the inventory | {left} | {} |",
        deleted.len(),
        deleted.len()
    );
    println!(
        "| the Reboot whose VM never came back ({}): still counted as down at the end | {never_back_down} | true |",
        names[NEVER_BACK]
    );
    println!(
        "| agents in dry run ({}): their POSTs / dry-run answers to the coordinator's requests | {dry_posts} / {dry_answers} | 0 / |",
        dry_vms.len()
    );
    println!("| approvals after NotBefore | {after_not_before} | 0 |");
    println!(
        "| events lost between agents and coordinator | {} | 0 |",
        lost.len()
    );
    println!("| events with more than one accepted POST | {duplicates} | 0 |");
    println!(
        "| decision latency (message to signed approval or drain start), p50 / p99 | {} / {} | p99 < 50 ms |",
        ms(p50),
        ms(p99)
    );
    println!(
        "| agents: CPU over the wave ({:.0} s), total / per agent | {:.1} s / {:.1} ms | |",
        elapsed.as_secs_f64(),
        agent_cpu_total / 1000.0,
        agent_cpu_total / (0..vms).filter(|&n| !agentless(arm, n)).count() as f64
    );
    println!(
        "| agents: RSS / PSS, total | {:.0} MiB / {:.0} MiB | |",
        agent_rss as f64 / 1024.0,
        agent_pss as f64 / 1024.0
    );
    println!(
        "| simulator (one process serving every VM): RSS / PSS | {:.0} MiB / {:.0} MiB | |",
        sim_rss as f64 / 1024.0,
        sim_pss as f64 / 1024.0
    );
    println!(
        "| coordinator: CPU over the wave / RSS / PSS | {:.2} s / {:.1} MiB / {:.1} MiB | |",
        coordinator_cpu / 1000.0,
        coordinator_rss as f64 / 1024.0,
        coordinator_pss as f64 / 1024.0
    );
    let coordinator_fault = match &failover {
        None => "coordinator SIGKILLed and restarted".to_owned(),
        Some(f) => format!(
            "the active coordinator stopped (SIGSTOP) while draining {} for {}, woken after the standby took over ({:.1} s) and approved it",
            f.vm, f.event, f.took_over
        ),
    };
    println!(
        "| faults | {} agents SIGKILLed and restarted; the {broker_name} server restarted (down 2 s); {coordinator_fault} | |",
        killed.len()
    );
    if let Some(f) = &failover {
        println!(
            "| failover: POSTs for the event drained at the stall / requests in its KV record / the woken instance exited / acted after waking | {} / {} / {} / {} | 1 / 1 / true / false |",
            f.posts, f.requests, f.exited, f.acted
        );
        println!(
            "| coordinators that lost the lease to the broker's restart (exited, started again as the standby) | {lease_lost} | (a 2 s outage against a 5 s lease) |"
        );
    }
    for violation in &violations {
        println!("\n{violation}");
    }
    if !lost.is_empty() {
        println!(
            "\nNot known to have ended: {}",
            lost.iter().take(20).cloned().collect::<Vec<_>>().join(", ")
        );
    }
    let abandoned = metrics
        .lines()
        .find(|l| l.starts_with("sched_relay_coordinator_approvals_abandoned_total"))
        .unwrap_or("sched_relay_coordinator_approvals_abandoned_total 0");
    println!("\n`{abandoned}`");
}

/// What became of the failover of an `--ha` run.
struct Failover {
    vm: String,
    event: String,
    took_over: f64,
    exited: bool,
    acted: bool,
    posts: usize,
    requests: usize,
}

/// Stops the active coordinator (SIGSTOP) as soon as a drain starts, waits until the standby
/// is active and has approved that event, then wakes the old one and waits for it to exit.
fn stall_in_a_drain(
    active: &mut Coordinator,
    standby: &Coordinator,
    drains: &std::path::Path,
    names: &[String],
    sims: &[SimProcess],
) -> Failover {
    let lines = || {
        std::fs::read_to_string(drains)
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    let before = lines().len();
    let deadline = Instant::now() + Duration::from_secs(120);
    while lines().len() == before && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    active.signal("STOP");
    let stopped = Instant::now();
    let line = lines().get(before).cloned().unwrap_or_default();
    let mut words = line.split(' ');
    let vm = words.next().unwrap_or_default().to_owned();
    let event = words.next().unwrap_or_default().to_owned();
    while standby.role() != "active" && stopped.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let took_over = stopped.elapsed().as_secs_f64();
    let sim = names.iter().position(|n| *n == vm).map(|i| &sims[i]);
    while sim.is_some_and(|sim| !posts(sim).iter().any(|(body, _, _)| body.contains(&event)))
        && stopped.elapsed() < Duration::from_secs(120)
    {
        std::thread::sleep(Duration::from_millis(50));
    }
    let said = active.log().len();
    active.signal("CONT");
    let exited = active.wait_exit(Duration::from_secs(15)).is_some();
    let after = active.log()[said..].to_owned();
    let acted = [
        "Approving",
        "Draining before approval",
        "Running a drain again",
    ]
    .iter()
    .any(|act| after.contains(act));
    Failover {
        vm,
        event,
        took_over,
        exited,
        acted,
        posts: 0,
        requests: 0,
    }
}

/// The requests the event's record in the coordinators' KV state holds.
fn kv_requests(bus: &Bus, event: &str) -> usize {
    let Bus::Nats(nats) = bus else { return 0 };
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(async {
            let js = async_nats::jetstream::new(async_nats::connect(nats.url()).await.unwrap());
            let store = js.get_key_value("fleet-ha").await.unwrap();
            let key: String = event
                .to_ascii_uppercase()
                .bytes()
                .map(|b| format!("{b:02x}"))
                .collect();
            let value = store.get(format!("e.{key}")).await.ok().flatten();
            value
                .and_then(|v| serde_json::from_slice::<serde_json::Value>(&v).ok())
                .and_then(|m| m["approval"]["sent"].as_array().map(Vec::len))
                .unwrap_or(0)
        })
}
