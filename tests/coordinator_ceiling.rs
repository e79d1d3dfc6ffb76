//! `max_down` as a ceiling, end to end: 13 real agents (the shipped `[imds]` defaults,
//! heartbeats every second), one simulator process, the machine's NATS JetStream and the
//! real `sched-relay coordinate`, through what every fleet meets:
//!
//! - a quiet fleet: the coordinator starts after the agents' documents have left the
//!   events stream (it keeps 4 s), so it knows the VMs from their heartbeats alone, and
//!   its groups match by resource group (a VM it did not know would match none);
//! - a scale-in: two `app` VMs are deleted without notice; silent, they count as down
//!   until an operator releases one (`sched-relay coordinate release`), and `app`'s
//!   percentage stays of its `expected_size`;
//! - a `never` Terminate inside another approval's outage window: db-0 is terminated at its
//!   NotBefore; db-2's 30 s Reboot must not be approved before db-0 has left;
//! - a host-level Reboot of a quiet `app` VM and a `db` VM: drained on both, approved once;
//! - a Reboot whose VM never comes back (web-3): web-2's Reboot waits behind it;
//! - an agent in dry run: its `accepted` answers approve nothing and its requests are
//!   renewed, then given up.
//!
//! Judged from the simulators' own records of who was down when (and the test's record of
//! which VMs it deleted), never from the coordinator's view.

mod common;

use std::collections::BTreeMap;
use std::process::Command;
use std::time::{Duration, Instant};

use common::fleet::{Coordinator, Downtime, downtimes, over_budget, posts};
use common::{AgentProcess, BINARY, SimProcess};
use sched_relay_core::approval::SigningKey;
use sched_relay_transport::testing::{broker_available, free_port, unique};

const NATS: &str = "127.0.0.1:4222";
const NATS_URL: &str = "nats://127.0.0.1:4222";
/// Reboots' expected outage in the coordinator's configuration: no simulated Reboot lasts
/// longer, but web-3's, which never ends.
const REBOOT_OUTAGE: Duration = Duration::from_secs(45);

fn event_id(n: usize, kind: u8) -> String {
    format!("ce110000-0000-4000-8000-{kind:02}{n:010}")
}

/// One simulated event: (EventId, type, appears after s, notice s, stays started s,
/// resources when more than the VM itself).
type Planned<'a> = (String, &'a str, u64, u64, u64, Vec<&'a str>);

fn scenario(vm: &str, events: &[Planned]) -> String {
    let group = vm.split('-').next().unwrap();
    let mut text = format!(
        "[vm]\nname = \"{vm}\"\nresource_id = \"/subscriptions/s/resourceGroups/rg-{group}/providers/Microsoft.Compute/virtualMachines/{vm}\"\n"
    );
    for (id, ty, appear, notice, started_for, resources) in events {
        let resources = if resources.is_empty() {
            vec![vm]
        } else {
            resources.clone()
        };
        text.push_str(&format!(
            "\n[[events]]\nid = \"{id}\"\ntype = \"{ty}\"\nresources = {resources:?}\nappear_after = \"{appear}s\"\nnotice = \"{notice}s\"\nstarted_for = \"{started_for}s\"\n"
        ));
    }
    text
}

#[test]
fn a_quiet_fleet_a_scale_in_a_forced_start_a_vm_that_never_returns_and_a_dry_run_agent_keep_every_budget()
 {
    if !broker_available("NATS", NATS, "nats-server -a 127.0.0.1 -p 4222 -js") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let prefix = unique("ceil");
    let (events_stream, approvals_stream) = (unique("CEILEV"), unique("CEILAP"));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let js = async_nats::jetstream::new(async_nats::connect(NATS_URL).await.unwrap());
        // The events stream keeps 4 s: by the time the coordinator starts, every document
        // the agents published at their start is gone, as after a quiet day.
        js.create_stream(async_nats::jetstream::stream::Config {
            name: events_stream.clone(),
            subjects: vec![format!("{prefix}.ev.>")],
            max_age: Duration::from_secs(4),
            ..Default::default()
        })
        .await
        .unwrap();
        js.create_stream(async_nats::jetstream::stream::Config {
            name: approvals_stream.clone(),
            subjects: vec![format!("{prefix}.ap.>")],
            ..Default::default()
        })
        .await
        .unwrap();
    });
    let key_file = dir.path().join("coordinator.key");
    let key = SigningKey::generate_ed25519().unwrap();
    std::fs::write(&key_file, &key).unwrap();
    let public_key = SigningKey::parse(&key).unwrap().public_key().unwrap();
    let token_file = dir.path().join("admin.token");
    std::fs::write(&token_file, "a-test-admin-token-0123456789\n").unwrap();

    let vms: Vec<String> = ["web", "db", "app"]
        .iter()
        .flat_map(|g| (0..4).map(move |i| format!("{g}-{i}")))
        .chain(["dry-0".to_owned()])
        .collect();
    let host = event_id(99, 9);
    let mut plans: BTreeMap<&str, Vec<Planned>> = BTreeMap::new();
    let mut add =
        |vm: &'static str, planned: Planned<'static>| plans.entry(vm).or_default().push(planned);
    // The coordinator starts at 6 s and decides once its input has caught up: with every
    // agent heartbeating it is never quiet for a second, so at most 30 s later. The wave
    // comes after that.
    add("web-3", (event_id(3, 1), "Reboot", 40, 60, 600, vec![]));
    add("web-2", (event_id(2, 1), "Reboot", 44, 100, 2, vec![]));
    add("db-0", (event_id(4, 3), "Terminate", 40, 30, 600, vec![]));
    add("db-2", (event_id(5, 1), "Reboot", 45, 120, 30, vec![]));
    add("app-0", (event_id(10, 1), "Reboot", 42, 100, 2, vec![]));
    add("dry-0", (event_id(20, 1), "Reboot", 42, 100, 2, vec![]));
    for vm in ["app-1", "db-1"] {
        add(
            vm,
            (host.clone(), "Reboot", 40, 120, 2, vec!["app-1", "db-1"]),
        );
    }
    let paths: Vec<String> = vms
        .iter()
        .map(|vm| {
            let path = dir.path().join(format!("{vm}.toml"));
            let planned = plans.get(vm.as_str()).cloned().unwrap_or_default();
            std::fs::write(&path, scenario(vm, &planned)).unwrap();
            path.to_str().unwrap().to_owned()
        })
        .collect();
    let paths: Vec<&str> = paths.iter().map(String::as_str).collect();
    let sims: BTreeMap<String, SimProcess> = vms
        .iter()
        .cloned()
        .zip(SimProcess::start_fleet(&paths, 1.0))
        .collect();
    let started = Instant::now();
    let agent_config = format!(
        "[events]\nheartbeat_interval = \"1s\"\n\n\
         [[sinks]]\nname = \"bus\"\nkind = \"nats\"\nurl = \"{NATS_URL}\"\nsubject = \"{prefix}.ev.{{vmname}}.{{transition}}\"\njetstream = true\n\n\
         [approvals.nats]\nsink = \"bus\"\nsubject = \"{prefix}.ap.{{vmname}}\"\nstream = \"{approvals_stream}\"\n\
         [[approvals.keys]]\nid = \"coordinator\"\nalgorithm = \"ed25519\"\npublic_key = \"{public_key}\"\n"
    );
    let mut agents: BTreeMap<String, AgentProcess> = vms
        .iter()
        .map(|vm| {
            let mut agent = AgentProcess::configure_on_defaults(&sims[vm].url, &agent_config);
            agent.spawn(if vm == "dry-0" { &["--dry-run"] } else { &[] });
            (vm.clone(), agent)
        })
        .collect();
    // When the test deleted a VM (its agent killed): down no more, whatever its simulator
    // still shows.
    let mut deleted: BTreeMap<String, i64> = BTreeMap::new();
    let now_us = || chrono::Utc::now().timestamp_micros();

    std::thread::sleep(Duration::from_secs(6));
    let drains = dir.path().join("drains.log");
    let drain_script = dir.path().join("drain.sh");
    std::fs::write(
        &drain_script,
        format!("echo \"$1 $2 $(date +%s%6N)\" >> {}\n", drains.display()),
    )
    .unwrap();
    let port = free_port();
    let config = dir.path().join("coordinator.toml");
    std::fs::write(
        &config,
        format!(
            r#"
[coordinator]
source = "urn:sched-relay:coordinator:ceiling"
state_dir = "{state}"
listen = "127.0.0.1:{port}"
outcome_timeout = "3s"
max_attempts = 2
admin_token_file = "{token}"

[input]
kind = "nats"
url = "{NATS_URL}"
stream = "{events_stream}"
subject = "{prefix}.ev.>"
durable = "coordinator"

[approvals]
kind = "nats"
url = "{NATS_URL}"
subject = "{prefix}.ap.{{vmname}}"
jetstream = true

[signing]
key_file = "{key}"
key_id = "coordinator"

[drain]
command = ["sh", "{script}", "{{vmname}}", "{{eventid}}"]
margin = "10s"

[defaults]
max_down = 1
[defaults.actions]
Reboot = "drain_then_approve"
Terminate = "never"
[defaults.outage]
Reboot = "{outage}s"

[[groups]]
name = "web"
resource_group = "rg-web"
max_down = 1

[[groups]]
name = "db"
resource_group = "rg-db"
max_down = 1

[[groups]]
name = "app"
resource_group = "rg-app"
max_down_percent = 50
expected_size = 4

[[groups]]
name = "dry"
resource_group = "rg-dry"
max_down = 1
[groups.actions]
Reboot = "approve"
"#,
            state = dir.path().join("state").display(),
            token = token_file.display(),
            key = key_file.display(),
            script = drain_script.display(),
            outage = REBOOT_OUTAGE.as_secs(),
        ),
    )
    .unwrap();
    let coordinator = Coordinator::start(config.clone(), dir.path().join("coordinator.log"), port);
    let group_of = |vm: &str| vm.split('-').next().unwrap().to_owned();
    let fleet_group = |fleet: &serde_json::Value, name: &str| {
        fleet["groups"]
            .as_array()
            .unwrap()
            .iter()
            .find(|g| g["group"] == name)
            .cloned()
            .unwrap_or_default()
    };
    let wait_for = |what: &str, until: Duration, mut ok: Box<dyn FnMut() -> bool + '_>| {
        let deadline = started + until;
        while !ok() {
            assert!(
                Instant::now() < deadline,
                "{what} by {until:?}:\n{}\n{}",
                coordinator.fleet(),
                coordinator.log()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    };
    // The quiet fleet: every VM known from its heartbeats alone, in its own group.
    wait_for(
        "every VM known",
        Duration::from_secs(15),
        Box::new(|| {
            let fleet = coordinator.fleet();
            ["web", "db", "app"]
                .iter()
                .all(|g| fleet_group(&fleet, g)["known"] == 4)
                && fleet_group(&fleet, "dry")["known"] == 1
        }),
    );
    assert!(
        !coordinator.log().contains("Approval source"),
        "the coordinator's input is not an approval source:\n{}",
        coordinator.log()
    );
    // The scale-in: app-2 and app-3 are deleted without notice.
    for vm in ["app-2", "app-3"] {
        agents.get_mut(vm).unwrap().kill9();
        deleted.insert(vm.into(), now_us());
    }
    wait_for(
        "the deleted app VMs counted as down",
        Duration::from_secs(20),
        Box::new(|| {
            fleet_group(&coordinator.fleet(), "app")["silent"]
                .as_array()
                .map(Vec::len)
                == Some(2)
        }),
    );
    // Until an operator releases one, app-0's Reboot waits: 2 of 2 down.
    std::thread::sleep(Duration::from_secs(46).saturating_sub(started.elapsed()));
    assert!(
        posts(&sims["app-0"]).is_empty(),
        "app-0 approved with 2 of 2 down"
    );
    let released = Command::new(BINARY)
        .args(["coordinate", "--config"])
        .arg(&config)
        .args(["release", "app-3"])
        .output()
        .unwrap();
    assert!(
        released.status.success(),
        "{}{}",
        String::from_utf8_lossy(&released.stdout),
        String::from_utf8_lossy(&released.stderr)
    );
    assert!(String::from_utf8_lossy(&released.stdout).contains("left the inventory"));
    // A wrong token is refused.
    std::fs::write(
        dir.path().join("wrong.token"),
        "not-the-token-at-all-000000\n",
    )
    .unwrap();
    let wrong = dir.path().join("wrong.toml");
    std::fs::write(
        &wrong,
        std::fs::read_to_string(&config)
            .unwrap()
            .replace("admin.token", "wrong.token"),
    )
    .unwrap();
    let refused = Command::new(BINARY)
        .args(["coordinate", "--config"])
        .arg(&wrong)
        .args(["pause", "--reason", "forged"])
        .output()
        .unwrap();
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("401"));
    wait_for(
        "app-0 approved once app-3 was released",
        Duration::from_secs(60),
        Box::new(|| !posts(&sims["app-0"]).is_empty()),
    );
    let app = fleet_group(&coordinator.fleet(), "app");
    assert_eq!(
        (app["size"].as_u64(), app["limit"].as_u64()),
        (Some(4), Some(2)),
        "{app}"
    );

    // web-3 never comes back: its agent dies once its Reboot has started.
    wait_for(
        "web-3 approved and started",
        Duration::from_secs(60),
        Box::new(|| {
            sims["web-3"].state()["down"]
                .as_array()
                .is_some_and(|d| !d.is_empty())
        }),
    );
    agents.get_mut("web-3").unwrap().kill9();
    // db-0's Terminate starts at its NotBefore; the VM is deleted.
    wait_for(
        "db-0 terminated",
        Duration::from_secs(80),
        Box::new(|| {
            sims["db-0"].state()["down"]
                .as_array()
                .is_some_and(|d| !d.is_empty())
        }),
    );
    agents.get_mut("db-0").unwrap().kill9();
    deleted.insert("db-0".into(), now_us());
    // db-2 is approved only after db-0 has left, and the host-level Reboot too.
    wait_for(
        "db-2 approved",
        Duration::from_secs(110),
        Box::new(|| !posts(&sims["db-2"]).is_empty()),
    );
    // The judge: the simulators' records, every VM the test deleted gone from then on,
    // each approval's downtime counted as ours for its expected outage.
    let mut record: Vec<Downtime> = downtimes(sims.iter());
    for d in &mut record {
        if let Some(gone) = deleted.get(&d.vm) {
            d.until_us = Some(d.until_us.map_or(*gone, |u| u.min(*gone)));
        }
    }
    let limits: BTreeMap<String, usize> = [("web", 1), ("db", 1), ("app", 2), ("dry", 1)]
        .into_iter()
        .map(|(g, l)| (g.to_owned(), l))
        .collect();
    let outage = REBOOT_OUTAGE.as_micros() as i64;
    let violations = over_budget(&record, group_of, &limits, |_| Some(outage));
    assert!(violations.is_empty(), "{violations:#?}\n{record:#?}");
    let host_posts: Vec<_> = ["app-1", "db-1"]
        .iter()
        .flat_map(|vm| posts(&sims[*vm]))
        .filter(|(body, _, _)| body.contains(&host))
        .collect();
    assert_eq!(
        host_posts.len(),
        1,
        "one POST for the host-level Reboot: {host_posts:?}"
    );
    let drained = std::fs::read_to_string(&drains).unwrap();
    for vm in ["app-1", "db-1"] {
        assert!(
            drained
                .lines()
                .any(|l| l.starts_with(&format!("{vm} {host}"))),
            "{vm} drained for {host}:\n{drained}"
        );
    }
    let db0_gone = deleted["db-0"];
    let (_, db2_at, _) = posts(&sims["db-2"])[0].clone();
    assert!(
        db2_at > db0_gone,
        "db-2 approved while db-0's Terminate was starting"
    );

    // web-2 waits behind web-3, which never came back.
    let fleet = coordinator.fleet();
    assert!(
        posts(&sims["web-2"]).is_empty(),
        "web-2 approved while web-3 is down: {:?}\n{fleet}\n{}",
        posts(&sims["web-2"]),
        coordinator.log()
    );
    let web = fleet_group(&fleet, "web");
    assert!(
        web["down"].as_array().unwrap().iter().any(|v| v == "web-3"),
        "{web}"
    );
    // The dry-run agent: answered, renewed with a new request, never POSTed, given up.
    let dry = fleet["events"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["event_id"] == event_id(20, 1).as_str())
        .cloned()
        .unwrap();
    assert!(posts(&sims["dry-0"]).is_empty());
    assert_eq!(dry["approved_elsewhere"], false, "{dry}");
    let approval = &dry["approval"];
    assert!(approval["dry_run_answers"].as_u64().unwrap() >= 1, "{dry}");
    assert!(approval["sent"].as_array().unwrap().len() >= 2, "{dry}");
    assert!(approval["outcome"].is_null(), "{dry}");

    eprintln!(
        "judged {} downtimes in {:?}",
        record.len(),
        started.elapsed()
    );
}
