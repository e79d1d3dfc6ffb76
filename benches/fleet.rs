//! The fleet coordinator on a simulated fleet: N agents (500 by default), each against its
//! own simulated IMDS and on the shipped `[imds]` defaults, a private NATS JetStream server,
//! and `sched-relay coordinate`, through a scripted maintenance wave with faults. Run by
//! `scripts/fleet`, which writes the report to benches/fleet.md (included in BENCHMARKS.md).
//! Nothing is asserted: it measures and reports, from the simulators' own records.
//!
//! The wave (real seconds; Azure's 15-minute notice time-scaled to 180 s, Spot's 30 s to 6 s):
//! every VM gets a Reboot or a Redeploy (drain, then approve) appearing over the first 60 s;
//! every 10th VM a 5 s Freeze (approve); every 25th a Spot eviction (Preempt: drain, then
//! approve); every 20th a Redeploy that Azure cancels after 15 s. Ten groups by name, each
//! at most 10 % down. Faults: every 50th agent killed with SIGKILL and restarted, the NATS
//! server restarted, the coordinator killed with SIGKILL and restarted.
//!
//!   cargo bench --bench fleet -- [--vms N]

#[path = "../tests/common/mod.rs"]
mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::fleet::{Coordinator, posts};
use common::{AgentProcess, SimProcess};
use sched_relay_core::approval::SigningKey;
use sched_relay_nats::testing::PrivateNats;
use sched_relay_transport::testing::free_port;

const GROUPS: usize = 10;
const PERCENT: usize = 10;
const NOTICE: u64 = 180;
const SPOT_NOTICE: u64 = 6;
const DOWN_FOR: Duration = Duration::from_secs(4);
const SPREAD: f64 = 60.0;

/// One scripted event: (EventId, type, appears after s, notice s, duration, cancel after s).
struct Planned {
    id: String,
    ty: &'static str,
    appear: f64,
    notice: u64,
    duration: i64,
    cancel_after: Option<u64>,
}

fn plan(n: usize, vms: usize) -> Vec<Planned> {
    let appear = SPREAD * n as f64 / vms as f64;
    let id = |kind: u8| format!("f1ee7000-0000-4000-8000-{kind:02}{n:010}");
    let mut events = vec![Planned {
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
        });
    }
    events
}

fn scenario(vm: &str, events: &[Planned]) -> String {
    let mut text = format!("[vm]\nname = \"{vm}\"\n");
    for e in events {
        text.push_str(&format!(
            "\n[[events]]\nid = \"{}\"\ntype = \"{}\"\nresources = [\"{vm}\"]\nappear_after = \"{}ms\"\nnotice = \"{}s\"\nduration_in_seconds = {}\nstarted_for = \"{}s\"\n",
            e.id, e.ty, (e.appear * 1000.0) as u64, e.notice, e.duration, DOWN_FOR.as_secs()
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

/// The `q` quantile of a Prometheus histogram, as the upper bound of its bucket.
fn quantile(metrics: &str, name: &str, q: f64) -> Option<f64> {
    let buckets: Vec<(f64, f64)> = metrics
        .lines()
        .filter(|l| l.starts_with(&format!("{name}_bucket{{")))
        .filter_map(|l| {
            let le = l.split("le=\"").nth(1)?.split('"').next()?;
            let count: f64 = l.rsplit(' ').next()?.parse().ok()?;
            Some((
                if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().ok()?
                },
                count,
            ))
        })
        .collect();
    let total = buckets.last()?.1;
    (total > 0.0).then(|| {
        buckets
            .iter()
            .find(|(_, c)| *c >= q * total)
            .map(|(le, _)| *le)
    })?
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let vms: usize = args
        .iter()
        .position(|a| a == "--vms")
        .and_then(|i| args.get(i + 1))
        .and_then(|n| n.parse().ok())
        .unwrap_or(500);
    let dir = tempfile::tempdir().unwrap();
    let mut nats = PrivateNats::start(&[]).expect("nats-server is installed (scripts/brokers)");
    let nats_url = nats.url();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(sched_relay_nats::testing::create_stream(
        &nats_url, "FLEET", "fleet.>",
    ));
    let key = SigningKey::generate_ed25519().unwrap();
    let key_file = dir.path().join("coordinator.key");
    std::fs::write(&key_file, &key).unwrap();
    let public_key = SigningKey::parse(&key).unwrap().public_key().unwrap();

    eprintln!("starting {vms} simulators and agents");
    let started = Instant::now();
    let names: Vec<String> = (0..vms).map(|n| format!("g{}-{n}", n % GROUPS)).collect();
    let plans: Vec<Vec<Planned>> = (0..vms).map(|n| plan(n, vms)).collect();
    let mut sims = Vec::new();
    let mut agents = Vec::new();
    for (n, vm) in names.iter().enumerate() {
        let path = dir.path().join(format!("{vm}.toml"));
        std::fs::write(&path, scenario(vm, &plans[n])).unwrap();
        sims.push(SimProcess::start(path.to_str().unwrap(), 1.0));
        agents.push(AgentProcess::start_on_defaults_with_env(
            &sims[n].url,
            &format!(
                "[[sinks]]\nname = \"bus\"\nkind = \"nats\"\nurl = \"{nats_url}\"\nsubject = \"fleet.{{vmname}}.{{transition}}\"\njetstream = true\n\n\
                 [approvals.nats]\nsink = \"bus\"\nsubject = \"fleet.approvals.{{vmname}}\"\nstream = \"FLEET\"\n\n\
                 [[approvals.keys]]\nid = \"coordinator\"\nalgorithm = \"ed25519\"\npublic_key = \"{public_key}\"\n"
            ),
            &[("SCHED_RELAY_LOG__LEVEL", "warn")],
        ));
    }
    std::thread::sleep(Duration::from_secs(3));
    for agent in agents.iter_mut() {
        assert!(
            agent.is_running(),
            "an agent exited at start:\n{}",
            agent.log()
        );
    }
    eprintln!("fleet started in {:?}", started.elapsed());
    let drain = dir.path().join("drain.sh");
    std::fs::write(&drain, "sleep 0.2\n").unwrap();
    let port = free_port();
    let mut groups = String::new();
    for g in 0..GROUPS {
        groups.push_str(&format!(
            "\n[[groups]]\nname = \"g{g}\"\nvm_name = \"g{g}-*\"\nmax_down_percent = {PERCENT}\n"
        ));
    }
    let config = dir.path().join("coordinator.toml");
    std::fs::write(
        &config,
        format!(
            "[coordinator]\nstate_dir = \"{state}\"\nlisten = \"127.0.0.1:{port}\"\n\n\
             [input]\nkind = \"nats\"\nurl = \"{nats_url}\"\nstream = \"FLEET\"\nsubject = \"fleet.>\"\n\n\
             [approvals]\nkind = \"nats\"\nurl = \"{nats_url}\"\nsubject = \"fleet.approvals.{{vmname}}\"\njetstream = true\n\n\
             [signing]\nkey_file = \"{key}\"\nkey_id = \"coordinator\"\n\n\
             [drain]\ncommand = [\"sh\", \"{drain}\"]\nmargin = \"30s\"\n\n\
             [defaults]\nmax_down = 1\n[defaults.actions]\nReboot = \"drain_then_approve\"\nRedeploy = \"drain_then_approve\"\nPreempt = \"drain_then_approve\"\nFreeze = {{ action = \"approve\", max_duration = \"10s\" }}\n{groups}",
            state = dir.path().join("state").display(),
            key = key_file.display(),
            drain = drain.display(),
        ),
    )
    .unwrap();
    let wave = Instant::now();
    let before: Vec<(u64, u64, u64)> = agents.iter().map(|a| footprint(a.pid())).collect();
    let mut coordinator = Coordinator::start(config, dir.path().join("coordinator.log"), port);
    let coordinator_cpu_before = footprint(coordinator.pid().unwrap()).0;

    // Faults, at fixed moments of the wave.
    let at = |s: u64| wave + Duration::from_secs(s);
    let wait_until =
        |when: Instant| std::thread::sleep(when.saturating_duration_since(Instant::now()));
    wait_until(at(25));
    let killed: Vec<usize> = (0..vms).step_by(50).collect();
    for &n in &killed {
        agents[n].kill9();
    }
    std::thread::sleep(Duration::from_secs(3));
    for &n in &killed {
        agents[n].spawn(&[]);
    }
    eprintln!("{} agents killed and restarted", killed.len());
    wait_until(at(40));
    nats.stop();
    std::thread::sleep(Duration::from_secs(2));
    nats.restart();
    eprintln!("NATS restarted");
    wait_until(at(55));
    let coordinator_cpu_first = footprint(coordinator.pid().unwrap()).0 - coordinator_cpu_before;
    coordinator.kill9();
    std::thread::sleep(Duration::from_secs(2));
    coordinator.spawn();
    let coordinator_cpu_second = footprint(coordinator.pid().unwrap()).0;
    eprintln!("coordinator killed and restarted");

    // Until every event has had its NotBefore and its end.
    wait_until(at(SPREAD as u64 + NOTICE + DOWN_FOR.as_secs() + 10));
    let elapsed = wave.elapsed();
    let after: Vec<(u64, u64, u64)> = agents.iter().map(|a| footprint(a.pid())).collect();
    let (coordinator_cpu_end, coordinator_rss, coordinator_pss) =
        footprint(coordinator.pid().unwrap());
    let sim_mem: Vec<(u64, u64, u64)> = sims.iter().map(|s| footprint(s.pid())).collect();
    let fleet = coordinator.fleet();
    let metrics = coordinator.metrics();

    // What the simulators say.
    let limit = (vms / GROUPS * PERCENT).div_ceil(100);
    // Per group, each VM's time down: (VM, from, until, approved by the coordinator).
    let mut downs: BTreeMap<usize, Vec<(String, i64, i64, bool)>> = BTreeMap::new();
    let down_us = DOWN_FOR.as_micros() as i64;
    let (
        mut approvable,
        mut approved,
        mut after_not_before,
        mut duplicates,
        mut left_to_azure,
        mut cancelled,
    ) = (0, 0, 0, 0, 0, 0);
    let mut lost = Vec::new();
    for (n, vm) in names.iter().enumerate() {
        let sim_posts = posts(&sims[n]);
        let origin = sims[n].state()["started_unix_us"].as_i64().unwrap();
        for e in &plans[n] {
            let for_it: Vec<_> = sim_posts
                .iter()
                .filter(|(body, _, status)| body.contains(&e.id) && *status == 200)
                .collect();
            let not_before = origin + ((e.appear + e.notice as f64) * 1e6) as i64;
            if e.cancel_after.is_some() && for_it.is_empty() {
                cancelled += 1;
            } else {
                approvable += 1;
                match for_it.first() {
                    None => {
                        // Azure starts it at NotBefore: down too, by Azure's decision.
                        left_to_azure += 1;
                        downs.entry(n % GROUPS).or_default().push((
                            vm.clone(),
                            not_before,
                            not_before + down_us,
                            false,
                        ));
                    }
                    Some((_, at, _)) => {
                        approved += 1;
                        if *at > not_before {
                            after_not_before += 1;
                        }
                        downs.entry(n % GROUPS).or_default().push((
                            vm.clone(),
                            *at,
                            *at + down_us,
                            true,
                        ));
                    }
                }
            }
            if for_it.len() > 1 {
                duplicates += 1;
            }
            // Lost: the coordinator never heard of it from this VM, or not of its end.
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
    // A violation: the coordinator's approval took a VM down (one not down already) while
    // its group, counting every VM down for any reason, was then over the budget.
    let down_at =
        |intervals: &[(String, i64, i64, bool)], t: i64| -> std::collections::BTreeSet<String> {
            intervals
                .iter()
                .filter(|(_, from, until, _)| *from <= t && t < *until)
                .map(|(vm, ..)| vm.clone())
                .collect()
        };
    let mut most = vec![0; GROUPS];
    let mut violations = Vec::new();
    for (g, intervals) in &downs {
        for (vm, t, _, by_coordinator) in intervals {
            let now_down = down_at(intervals, *t);
            most[*g] = most[*g].max(now_down.len());
            let already = intervals
                .iter()
                .any(|(other, from, until, _)| other == vm && from < t && t < until);
            if *by_coordinator && !already && now_down.len() > limit {
                violations.push((*g, vm.clone(), *t, now_down));
            }
        }
    }
    let agent_cpu: Vec<f64> = before
        .iter()
        .zip(&after)
        .map(|(b, a)| a.0.saturating_sub(b.0) as f64 / 1e6)
        .collect();
    let agent_cpu_total: f64 = agent_cpu.iter().sum();
    let agent_rss: u64 = after.iter().map(|a| a.1).sum();
    let agent_pss: u64 = after.iter().map(|a| a.2).sum();
    let sim_pss: u64 = sim_mem.iter().map(|s| s.2).sum();
    let coordinator_cpu =
        (coordinator_cpu_first + coordinator_cpu_end.saturating_sub(coordinator_cpu_second)) as f64
            / 1e6;
    let p50 = quantile(&metrics, "sched_relay_coordinator_decision_seconds", 0.5);
    let p99 = quantile(&metrics, "sched_relay_coordinator_decision_seconds", 0.99);
    let ms = |v: Option<f64>| v.map_or("-".into(), |v| format!("<= {:.1} ms", v * 1000.0));

    println!("## Fleet coordinator: a simulated fleet of {vms} VMs\n");
    println!(
        "`scripts/fleet` (`cargo bench --features nats --bench fleet -- --vms {vms}`), on {} CPU(s); the wave and its faults are described in `benches/fleet.rs`. Figures from the simulators' own records.\n",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!("| measure | result | goal |\n|---|---|---|");
    println!(
        "| events scripted (approvable / cancelled by Azure first) | {approvable} / {cancelled} | |"
    );
    println!("| approved by the coordinator (one POST each) | {approved} | |");
    println!("| left to NotBefore (never approved) | {left_to_azure} | |");
    println!(
        "| approvals that took a group over its budget ({limit} of {} VMs) / most VMs down at once per group, Azure's own starts included | {} / {most:?} | 0 |",
        vms / GROUPS,
        violations.len()
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
        agent_cpu_total / vms as f64
    );
    println!(
        "| agents: RSS / PSS, total | {:.0} MiB / {:.0} MiB | |",
        agent_rss as f64 / 1024.0,
        agent_pss as f64 / 1024.0
    );
    println!(
        "| simulators: PSS, total | {:.0} MiB | |",
        sim_pss as f64 / 1024.0
    );
    println!(
        "| coordinator: CPU over the wave / RSS / PSS | {:.2} s / {:.1} MiB / {:.1} MiB | |",
        coordinator_cpu / 1000.0,
        coordinator_rss as f64 / 1024.0,
        coordinator_pss as f64 / 1024.0
    );
    println!(
        "| faults | {} agents SIGKILLed and restarted; NATS restarted; coordinator SIGKILLed and restarted | |",
        killed.len()
    );
    for (g, vm, t, now_down) in &violations {
        println!(
            "\nGroup g{g}: {vm} approved at {t} (Unix µs) with {} down: {now_down:?}",
            now_down.len()
        );
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
