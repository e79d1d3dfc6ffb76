//! The fleet coordinator end to end, on a small fleet: 20 real agents (the shipped `[imds]`
//! defaults), each against its own VM of one simulator process (which shares a host-level
//! Reboot between two VMs of different groups), publishing to the machine's real NATS
//! JetStream (and 8 through its RabbitMQ); the real `sched-relay coordinate` reading them,
//! draining through a command, and approving over each VM's own approval channel. Killed
//! with SIGKILL a third of the way (and not before the host-level Reboot's drain has
//! begun) and started again on the same state. The second VM of the host-level Reboot
//! starts its agent only once the coordinator drains it for that Reboot.
//!
//! What is checked comes from the simulators, not the coordinator: every approvable event
//! got exactly one accepted POST, before its NotBefore; the VMs physically down at once
//! (from an approval's POST until the event's end) never exceed a group's budget; an event
//! whose action is `never` got no POST; every VM was drained before its approval; the
//! event listing two VMs got one POST, through one of them, and started on both.

mod common;

use std::collections::BTreeMap;
use std::process::Command;
use std::time::{Duration, Instant};

use common::fleet::{Coordinator, most_at_once, posts};
use common::{AgentProcess, BINARY, SimProcess};
use sched_relay_core::approval::SigningKey;
use sched_relay_transport::testing::{broker_available, free_port, unique};

const NATS: &str = "127.0.0.1:4222";
const NATS_URL: &str = "nats://127.0.0.1:4222";
const RABBITMQ: &str = "127.0.0.1:5672";
const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
/// How long a Reboot stays Started once approved (the simulator's `started_for`).
const DOWN_FOR: Duration = Duration::from_secs(2);
/// The lease of the test with a standby.
const LEASE: Duration = Duration::from_secs(3);
/// The notice of every event: the wave must be done well within it.
const NOTICE: Duration = Duration::from_secs(120);

/// A VM's scenario: its own events, and those it shares with other VMs (`resources`).
fn scenario(vm: &str, events: &[(&str, &str, i64, &[&str])]) -> String {
    let mut text = format!(
        "[vm]\nname = \"{vm}\"\nresource_id = \"/subscriptions/s/resourceGroups/rg-{group}/providers/Microsoft.Compute/virtualMachines/{vm}\"\n",
        group = vm.split('-').next().unwrap()
    );
    for (id, ty, duration, resources) in events {
        let resources = if resources.is_empty() {
            vec![vm]
        } else {
            resources.to_vec()
        };
        text.push_str(&format!(
            "\n[[events]]\nid = \"{id}\"\ntype = \"{ty}\"\nresources = {resources:?}\nappear_after = \"1s\"\nnotice = \"{}s\"\nduration_in_seconds = {duration}\nstarted_for = \"{}s\"\n",
            NOTICE.as_secs(),
            DOWN_FOR.as_secs()
        ));
    }
    text
}

fn event_id(n: usize, kind: u8) -> String {
    format!("c0000000-0000-4000-8000-{kind:02}{n:010}")
}

/// Where the agents publish and the coordinator reads and approves.
enum Broker {
    /// JetStream: events and approvals in one stream.
    Nats,
    /// Events to a topic exchange, approvals to the agents' own queues.
    Rabbit,
}

#[test]
fn a_wave_of_reboots_is_drained_and_approved_within_each_groups_budget_across_a_coordinator_kill() {
    if broker_available("NATS", NATS, "nats-server -a 127.0.0.1 -p 4222 -js") {
        wave(Broker::Nats, 10, None);
    }
}

#[test]
fn the_same_wave_through_rabbitmq_queues_keeps_the_budgets() {
    if broker_available("RabbitMQ", RABBITMQ, "rabbitmq-server -detached") {
        wave(Broker::Rabbit, 4, None);
    }
}

#[test]
fn a_standby_takes_over_when_the_active_coordinator_stalls_in_a_drain_and_the_woken_one_writes_nothing_and_stops()
 {
    if broker_available("NATS", NATS, "nats-server -a 127.0.0.1 -p 4222 -js") {
        wave(Broker::Nats, 5, Some(Failover::Stall));
    }
}

#[test]
fn a_standby_takes_over_within_a_lease_when_the_active_coordinator_is_killed_with_sigkill() {
    if broker_available("NATS", NATS, "nats-server -a 127.0.0.1 -p 4222 -js") {
        wave(Broker::Nats, 5, Some(Failover::Kill));
    }
}

/// How the active coordinator fails when a standby waits.
#[derive(Clone, Copy)]
enum Failover {
    /// SIGSTOP, then SIGCONT once the standby is active: the old one must not act again.
    Stall,
    /// SIGKILL.
    Kill,
}

/// When the drain script logged draining `vm` for `event_id` (Unix microseconds).
fn drained_at(log: &str, vm: &str, event_id: &str) -> i64 {
    log.lines()
        .find(|line| line.starts_with(&format!("{vm} ")) && line.contains(event_id))
        .unwrap_or_else(|| panic!("{vm} was never drained for {event_id}:\n{log}"))
        .rsplit(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

/// The standby becomes active within a lease period and its renewal rhythm of the active
/// one going away at `since` (`how`: "was killed", "stalled").
fn takes_over(standby: &Coordinator, since: Instant, how: &str) {
    wait_for_role(standby, "active");
    let took = since.elapsed();
    eprintln!("the standby took over {took:?} after the active one {how}");
    assert!(
        took < LEASE + LEASE / 4 + Duration::from_secs(2),
        "took over after {took:?}"
    );
}

/// Waits until the coordinator's /healthz says `role`.
fn wait_for_role(coordinator: &Coordinator, role: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        assert!(
            std::net::TcpStream::connect(("127.0.0.1", coordinator.port)).is_ok(),
            "the coordinator is not listening:\n{}",
            coordinator.log()
        );
        let (status, body) = common::blocking_get(
            &format!("http://127.0.0.1:{}/healthz", coordinator.port),
            &[],
        );
        if status == 200 && body.trim() == role {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "not {role} ({body:?}):\n{}",
            coordinator.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `per_group` VMs named web-N (at most 2 down) and as many db-N (at most 20 %). Every VM
/// gets a Reboot (drain, then approve); web-0 a 5 s Freeze too (approve); the last db VM a
/// Terminate (never). The coordinator is killed with SIGKILL after a third of the
/// approvals (and db-1's drain for the host-level Reboot) and started again on the same
/// state, or, with a `failover`, a second instance sharing the state in NATS KV takes over.
fn wave(broker: Broker, per_group: usize, failover: Option<Failover>) {
    let standby = failover.is_some();
    let dir = tempfile::tempdir().unwrap();
    let prefix = unique("coord");
    let (agent_config, input, output) = match broker {
        Broker::Nats => {
            let stream = unique("COORD");
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(sched_relay_nats::testing::create_stream(
                    NATS_URL,
                    &stream,
                    &format!("{prefix}.>"),
                ));
            (
                format!(
                    "[[sinks]]\nname = \"bus\"\nkind = \"nats\"\nurl = \"{NATS_URL}\"\nsubject = \"{prefix}.{{vmname}}.{{transition}}\"\njetstream = true\n\n\
                     [approvals.nats]\nsink = \"bus\"\nsubject = \"{prefix}.approvals.{{vmname}}\"\nstream = \"{stream}\"\n"
                ),
                format!(
                    "kind = \"nats\"\nurl = \"{NATS_URL}\"\nstream = \"{stream}\"\nsubject = \"{prefix}.>\"\ndurable = \"coordinator\""
                ),
                format!(
                    "kind = \"nats\"\nurl = \"{NATS_URL}\"\nsubject = \"{prefix}.approvals.{{vmname}}\"\njetstream = true"
                ),
            )
        }
        Broker::Rabbit => (
            format!(
                "[[sinks]]\nname = \"rabbit\"\nkind = \"amqp\"\nurl = \"{AMQP_URL}\"\nexchange = \"{prefix}\"\n\n\
                 [approvals.amqp]\nsink = \"rabbit\"\nexchange = \"{prefix}.approvals\"\nqueue = \"{prefix}.approvals.{{vmname}}\"\n"
            ),
            format!(
                "kind = \"amqp\"\nurl = \"{AMQP_URL}\"\nexchange = \"{prefix}\"\nqueue = \"{prefix}.coordinator\""
            ),
            format!(
                "kind = \"amqp\"\nurl = \"{AMQP_URL}\"\nexchange = \"{prefix}.approvals\"\nrouting_key = \"approvals.{{vmname}}\""
            ),
        ),
    };
    let key_file = dir.path().join("coordinator.key");
    let key = SigningKey::generate_ed25519().unwrap();
    std::fs::write(&key_file, &key).unwrap();
    let public_key = SigningKey::parse(&key).unwrap().public_key().unwrap();

    let vms: Vec<String> = (0..per_group)
        .map(|i| format!("web-{i}"))
        .chain((0..per_group).map(|i| format!("db-{i}")))
        .collect();
    let last_db = format!("db-{}", per_group - 1);
    // A host-level Reboot listing a VM of each group: one approval, through one of them,
    // releases both, and each counts against its own group.
    let host = event_id(999, 4);
    let host_vms = ["web-1", "db-1"];
    let approvable = 2 * per_group + 2;
    let mut paths = Vec::new();
    for (n, vm) in vms.iter().enumerate() {
        let reboot = event_id(n, 1);
        let mut events = vec![(reboot.as_str(), "Reboot", -1, &[][..])];
        let freeze = event_id(n, 2);
        let terminate = event_id(n, 3);
        if vm == "web-0" {
            events.push((freeze.as_str(), "Freeze", 5, &[]));
        }
        if *vm == last_db {
            events.push((terminate.as_str(), "Terminate", 0, &[]));
        }
        if host_vms.contains(&vm.as_str()) {
            events.push((host.as_str(), "Reboot", -1, &host_vms));
        }
        let path = dir.path().join(format!("{vm}.toml"));
        std::fs::write(&path, scenario(vm, &events)).unwrap();
        paths.push(path.to_str().unwrap().to_owned());
    }
    // One simulator process serves every VM, so that the shared event is one event.
    let paths: Vec<&str> = paths.iter().map(String::as_str).collect();
    let sims: BTreeMap<String, SimProcess> = vms
        .iter()
        .cloned()
        .zip(SimProcess::start_fleet(&paths, 1.0))
        .collect();
    let agent = |vm: &String| {
        AgentProcess::start_on_defaults(
            &sims[vm].url,
            &format!(
                "{agent_config}\n[[approvals.keys]]\nid = \"coordinator\"\nalgorithm = \"ed25519\"\npublic_key = \"{public_key}\"\n"
            ),
        )
    };
    // db-1's agent starts late: only once the coordinator has begun to drain db-1 for the
    // host-level Reboot it shares with web-1, so that it decides that Reboot without a word
    // from db-1 (an agent that starts after the coordinator, or reports after its peer),
    // once `report_wait` has passed. That drain lasts 3 s, so that the agent, started
    // then, sees the Reboot scheduled and reports it to its end.
    let late = host_vms[1];
    let mut agents: Vec<AgentProcess> = vms.iter().filter(|vm| *vm != late).map(agent).collect();

    let drains = dir.path().join("drains.log");
    let drain_script = dir.path().join("drain.sh");
    std::fs::write(
        &drain_script,
        format!(
            "echo \"$1 $2 $(date +%s%6N)\" >> {}\ncase \"$1 $2\" in \"{late} {host}\") sleep 3;; *) sleep {};; esac\n",
            drains.display(),
            // Long enough for the stalled coordinator to be stopped in the middle of one.
            if matches!(failover, Some(Failover::Stall)) {
                "1"
            } else {
                "0.2"
            }
        ),
    )
    .unwrap();
    let ha_bucket = unique("coordha");
    let configure = |name: &str, port: u16| {
        let ha = if standby {
            format!(
                "[ha]\nurl = \"{NATS_URL}\"\nbucket = \"{ha_bucket}\"\nlease = \"{}s\"\ninstance = \"{name}\"\n",
                LEASE.as_secs()
            )
        } else {
            String::new()
        };
        let config = dir.path().join(format!("{name}.toml"));
        std::fs::write(
            &config,
            format!(
                r#"
[coordinator]
source = "urn:sched-relay:coordinator:test"
state_dir = "{state}"
listen = "127.0.0.1:{port}"

[input]
{input}

[approvals]
{output}

[signing]
key_file = "{key}"
key_id = "coordinator"

[drain]
command = ["sh", "{script}", "{{vmname}}", "{{eventid}}"]
margin = "30s"

[defaults]
max_down = 1
[defaults.actions]
Reboot = "drain_then_approve"
Freeze = {{ action = "approve", max_duration = "10s" }}
Terminate = "never"
# A simulated Reboot keeps its VM down for {down_for} s.
[defaults.outage]
Reboot = "{outage}s"

[[groups]]
name = "web"
vm_name = "web-*"
max_down = 2

[[groups]]
name = "db"
vm_name = "db-*"
max_down_percent = 20

{ha}
"#,
                state = dir.path().join("state").display(),
                key = key_file.display(),
                script = drain_script.display(),
                down_for = DOWN_FOR.as_secs(),
                outage = DOWN_FOR.as_secs() + 1,
            ),
        )
        .unwrap();
        config
    };
    let started = Instant::now();
    let port = free_port();
    let mut coordinator =
        Coordinator::start(configure("first", port), dir.path().join("first.log"), port);
    wait_for_role(&coordinator, "active");
    // With a standby: a second instance on the same state, waiting for the lease.
    let mut second = standby.then(|| {
        let port = free_port();
        let second = Coordinator::start(
            configure("second", port),
            dir.path().join("second.log"),
            port,
        );
        wait_for_role(&second, "standby");
        // A standby has no fleet to show, and says so rather than show an empty one.
        let (status, body) = second.fleet_answer();
        assert_eq!(status, 503, "{body}");
        let body: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(body["role"], "standby", "{body}");
        let watched = Command::new(BINARY)
            .args(["watch", "--once", "--from"])
            .arg(format!("http://127.0.0.1:{port}"))
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&watched.stderr);
        assert!(
            !watched.status.success() && said.contains("503") && said.contains("holds no lease"),
            "{said}"
        );
        second
    });

    let deadline = Instant::now() + Duration::from_secs(60);
    while !std::fs::read_to_string(&drains)
        .unwrap_or_default()
        .contains(&format!("{late} {host} "))
    {
        assert!(
            Instant::now() < deadline,
            "{late} was not drained for the host-level Reboot before its agent started:\n{}\n{}",
            coordinator.fleet(),
            coordinator.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    agents.push(agent(&late.to_owned()));

    // Half-way through the wave: SIGKILL, and start again on the same state.
    let approvals_so_far = || -> usize { sims.values().map(|s| posts(s).len()).sum() };
    let deadline = Instant::now() + Duration::from_secs(60);
    while approvals_so_far() < approvable / 3 {
        assert!(
            Instant::now() < deadline,
            "no approvals:\n{}",
            coordinator.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    match second.take() {
        // The active one stalls (SIGSTOP): the standby takes over within a lease period
        // of its last renewal, and a quarter of a second. Woken again, the old one must not act: its lease is
        // stale, and its next renewal fails, so it exits.
        Some(standby) if matches!(failover, Some(Failover::Kill)) => {
            coordinator.kill9();
            takes_over(&standby, Instant::now(), "was killed");
            coordinator = standby;
        }
        Some(standby) => {
            // Stopped in the middle of a drain: the next drain to start.
            let drained_lines = || {
                std::fs::read_to_string(&drains)
                    .unwrap_or_default()
                    .lines()
                    .map(str::to_owned)
                    .collect::<Vec<_>>()
            };
            let before = drained_lines().len();
            let deadline = Instant::now() + Duration::from_secs(60);
            while drained_lines().len() == before {
                assert!(Instant::now() < deadline, "no drain started");
                std::thread::sleep(Duration::from_millis(20));
            }
            coordinator.signal("STOP");
            let line = drained_lines()[before].clone();
            let mut words = line.split(' ');
            let (vm, event) = (
                words.next().unwrap().to_owned(),
                words.next().unwrap().to_owned(),
            );
            eprintln!("stopped the active coordinator while it drained {vm} for {event}");
            takes_over(&standby, Instant::now(), "stalled");
            // The standby runs that drain again and approves the event; only then is the old
            // one woken, with the drain's result and its own decisions still to write. The
            // approval reaches IMDS through the event's approver, which need not be the VM
            // drained (an event of two VMs).
            let deadline = Instant::now() + Duration::from_secs(60);
            while !sims
                .values()
                .any(|sim| posts(sim).iter().any(|(body, _, _)| body.contains(&event)))
            {
                assert!(
                    Instant::now() < deadline,
                    "the standby did not approve {event}:\n{}",
                    standby.log()
                );
                std::thread::sleep(Duration::from_millis(50));
            }
            let said_before = coordinator.log().len();
            coordinator.signal("CONT");
            let status = coordinator.wait_exit(LEASE * 2);
            let said_after = coordinator.log()[said_before..].to_owned();
            for act in [
                "Approving",
                "Draining before approval",
                "Running a drain again",
            ] {
                assert!(
                    !said_after.contains(act),
                    "woken, the old coordinator acted ({act}):\n{said_after}"
                );
            }
            assert!(
                status.is_some_and(|s| !s.success()),
                "the stalled coordinator did not stop ({status:?}):\n{}",
                coordinator.log()
            );
            // Whichever it meets first: its renewal, or a write refused for its stale lease.
            assert!(
                coordinator.log().contains("Lease lost")
                    || coordinator.log().contains("another one is active; exiting"),
                "{}",
                coordinator.log()
            );
            coordinator = standby;
        }
        None => {
            coordinator.kill9();
            std::thread::sleep(Duration::from_millis(500));
            coordinator.spawn();
        }
    }

    // Every Reboot and the Freeze, each POSTed once.
    let deadline = Instant::now() + NOTICE - Duration::from_secs(20);
    while approvals_so_far() < approvable {
        assert!(
            Instant::now() < deadline,
            "{} of {approvable} events approved after {:?}:\n{}\n{}",
            approvals_so_far(),
            started.elapsed(),
            coordinator.fleet(),
            coordinator.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    std::thread::sleep(DOWN_FOR + Duration::from_secs(2));
    eprintln!("wave approved in {:?}", started.elapsed());

    let drained = std::fs::read_to_string(&drains).unwrap();
    let mut groups: BTreeMap<&str, Vec<(String, i64)>> = BTreeMap::new();
    for (index, vm) in vms.iter().enumerate() {
        let sim = &sims[vm];
        let posts = posts(sim);
        let state = sim.state();
        let not_before_us = state["started_unix_us"].as_i64().unwrap()
            + (Duration::from_secs(1) + NOTICE).as_micros() as i64;
        let mut expected = vec![event_id(index, 1)];
        if vm == "web-0" {
            expected.push(event_id(index, 2));
        }
        for id in &expected {
            let for_it: Vec<_> = posts
                .iter()
                .filter(|(body, _, _)| body.contains(id.as_str()))
                .collect();
            assert_eq!(for_it.len(), 1, "{vm}: one POST for {id}: {posts:?}");
            let (_, at, status) = for_it[0];
            assert_eq!(*status, 200, "{vm}: {posts:?}");
            assert!(*at < not_before_us, "{vm}: approved after NotBefore");
            groups
                .entry(if vm.starts_with("web") { "web" } else { "db" })
                .or_default()
                .push((vm.clone(), *at));
        }
        assert!(
            !posts
                .iter()
                .any(|(body, _, _)| body.contains(&event_id(index, 3))),
            "the Terminate (never) was approved: {posts:?}"
        );
        // Drained before its Reboot was approved.
        let reboot = event_id(index, 1);
        let drain_at = drained_at(&drained, vm, &reboot);
        let reboot_post = posts
            .iter()
            .find(|(body, _, _)| body.contains(&reboot))
            .unwrap()
            .1;
        assert!(
            drain_at < reboot_post,
            "{vm}: approved before it was drained"
        );
    }
    // The host-level Reboot: one POST in all, through a VM it lists, after both were
    // drained; both VMs down from then on, each in its own group.
    let host_posts: Vec<(String, String, i64, u64)> = sims
        .iter()
        .flat_map(|(vm, sim)| {
            posts(sim)
                .into_iter()
                .filter(|(body, _, _)| body.contains(&host))
                .map(|(body, at, status)| (vm.clone(), body, at, status))
        })
        .collect();
    assert_eq!(
        host_posts.len(),
        1,
        "one POST releases the event of several VMs: {host_posts:?}"
    );
    // Through a VM it lists: the first whose agent had reported it when it was decided.
    let (approver, _, host_at, status) = &host_posts[0];
    assert!(
        host_vms.contains(&approver.as_str()) && *status == 200,
        "{host_posts:?}"
    );
    for vm in host_vms {
        assert!(
            drained_at(&drained, vm, &host) < *host_at,
            "{vm}: released before it was drained"
        );
        // Started on this VM by that POST, not by Azure at NotBefore two minutes later.
        let state = sims[vm].state();
        let not_before_us = state["started_unix_us"].as_i64().unwrap()
            + (Duration::from_secs(1) + NOTICE).as_micros() as i64;
        assert!(*host_at < not_before_us, "{vm}: approved after NotBefore");
        let started_us = state["started"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p[0] == host.as_str())
            .and_then(|p| p[1].as_i64())
            .unwrap_or_else(|| panic!("{vm}: {host} never started: {state}"));
        assert!(
            (started_us - host_at).abs() < 500_000,
            "{vm}: the approval through {approver} at {host_at} did not start it (started at {started_us}): {state}"
        );
        groups
            .entry(if vm.starts_with("web") { "web" } else { "db" })
            .or_default()
            .push((vm.to_owned(), *host_at));
    }
    // Both VMs' agents reported the host-level Reboot to its end, under the same CloudEvents
    // ids (their sources differ): neither report was lost as a copy of the other. Their
    // last polls and publications may still be on the way: up to 20 s.
    let host_reports = |fleet: &serde_json::Value| {
        fleet["events"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["event_id"] == host.as_str())
            .map(|m| m["reports"].clone())
            .unwrap_or_default()
    };
    let both_completed = |reports: &serde_json::Value| {
        host_vms
            .iter()
            .all(|vm| reports[vm]["stage"] == "completed")
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut fleet = coordinator.fleet();
    while !both_completed(&host_reports(&fleet)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(250));
        fleet = coordinator.fleet();
    }
    let reports = host_reports(&fleet);
    for vm in host_vms {
        assert_eq!(
            reports[vm]["stage"], "completed",
            "{vm}'s report of {host}: {reports}"
        );
    }
    let budgets: BTreeMap<String, usize> = fleet["groups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| {
            (
                g["group"].as_str().unwrap().to_owned(),
                g["limit"].as_u64().unwrap() as usize,
            )
        })
        .collect();
    let db_limit = (per_group * 20).div_ceil(100);
    assert_eq!((budgets["web"], budgets["db"]), (2, db_limit));
    for (group, starts) in &groups {
        let most = most_at_once(starts, DOWN_FOR);
        eprintln!("group {group}: at most {most} VM(s) down at once");
        assert!(
            most <= budgets[*group],
            "group {group}: {most} VMs down at once (budget {})",
            budgets[*group]
        );
    }
    // `watch` reads the coordinator: a row per VM and event, and the budgets, back to 0
    // once the last completions (published at the agents' next polls) have reached it.
    let watch = || {
        common::stdout_of(Command::new(BINARY).args([
            "watch",
            "--from",
            &format!("http://127.0.0.1:{}", coordinator.port),
            "--once",
        ]))
    };
    let idle = format!("group web: 0 of 2 down ({per_group} VMs)");
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut table = watch();
    while !table.contains(&idle) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(500));
        table = watch();
    }
    assert!(table.contains(&idle), "{table}");
    let terminate = table
        .lines()
        .find(|line| line.contains(&event_id(vms.len() - 1, 3)))
        .unwrap_or_else(|| panic!("no row for the Terminate:\n{table}"));
    assert!(
        terminate.contains(&last_db) && terminate.contains("never"),
        "{terminate}"
    );
    let metrics = coordinator.metrics();
    assert!(
        metrics.contains("sched_relay_coordinator_budget_in_use{group=\"web\"}"),
        "{metrics}"
    );
}

#[test]
fn coordinate_check_prints_each_groups_budget_and_refuses_a_bad_file_with_exit_2() {
    let example = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/config/examples/coordinator.toml"
    );
    let printed = common::stdout_of(Command::new(BINARY).args([
        "coordinate",
        "--config",
        example,
        "--check",
    ]));
    assert!(
        printed.contains("group web: at most 20 % of its VMs down"),
        "{printed}"
    );
    assert!(
        printed.contains("group db: at most 1 VM(s) down; freeze approve up to 9 s"),
        "{printed}"
    );
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        "[coordinator]\n[input]\nkind = \"nats\"\nurl = \"nats://x\"\nstream = \"S\"\n\
         [approvals]\nkind = \"nats\"\nurl = \"nats://x\"\nsubject = \"a.b\"\n\
         [signing]\nkey_file = \"/k\"\nkey_id = \"k\"\n[defaults.actions]\nReboot = \"drain_then_approve\"\n",
    )
    .unwrap();
    let output = Command::new(BINARY)
        .args(["coordinate", "--config", bad.to_str().unwrap(), "--check"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("config error: approvals.subject: must contain {vmname}"),
        "{stderr}"
    );
    assert!(
        stderr.contains(
            "config error: defaults.actions.Reboot: drain_then_approve needs a [drain] section"
        ),
        "{stderr}"
    );
}
