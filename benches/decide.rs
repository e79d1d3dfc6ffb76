//! What one decision of the coordinator costs in the middle of a wave, and how it grows with
//! the fleet (issue 39, part 7): `policy::decide` over a fleet of N VMs in groups of 100
//! (each at most 5 % down), shaped as `benches/coordinator.rs` has it at the wave's peak:
//! every 5th VM has a Reboot, and per group 5 of those are over (their VMs back), 5 approved
//! and holding the budget, and 10 waiting for it, their NotBefores from 5 to 9.5 minutes
//! away (so Azure starts the earlier ones inside the later ones' 10-minute outage window,
//! and each budget check counts them). Beside it, the
//! engine's part after the decision (each waiting event's verdict put into words), and the
//! floor: one walk over the fleet's VMs and events that reads what a count of who is down
//! must read (each VM's heartbeat, each event's reports), in the same run. The count is
//! timed twice: as a wave has it (the inventory unchanged since the last count, each VM's
//! group kept), and after a change to the inventory (every VM placed in its group again).
//!
//!   cargo bench --profile dist --bench decide              (500, 2,000 and 10,000 VMs)
//!   cargo bench --profile dist --bench decide -- 10000     (one size, or a list: 500,2000)
//!
//! Nothing about time is asserted (only the fleet's shape): it measures and prints, one line
//! per fleet size.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use sched_relay::coordinator::config::CoordinatorConfig;
use sched_relay::coordinator::fleet::{
    Approval, Back, Fleet, Heartbeat, Maintenance, Report, Stage, Vm,
};
use sched_relay::coordinator::policy::{self, Policy};
use sched_relay_core::approval::SigningKey;

const GROUP: usize = 100;
const PERCENT: usize = 5;

fn main() {
    let sizes: Vec<usize> = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .map(|list| {
            list.split(',')
                .map(|n| n.parse().expect("fleet sizes, e.g. 500,2000,10000"))
                .collect()
        })
        .unwrap_or_else(|| vec![500, 2_000, 10_000]);
    println!(
        "| VMs | events | waiting | decide, median ms | of which the count of who is down, ms | the count after an inventory change, ms | verdicts, median ms | floor (one walk), median ms | decide / floor |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for vms in sizes {
        assert!(vms % GROUP == 0, "fleet sizes are multiples of {GROUP}");
        let now = Utc::now();
        let dir = tempfile::tempdir().unwrap();
        let policy = policy_for(vms, dir.path());
        let mut fleet = wave(vms, now);
        let decisions = policy::decide(&fleet, &policy, now);
        let waiting = decisions.waits.len();
        assert_eq!(
            decisions.steps.len(),
            0,
            "every group is at its budget: nothing is approved"
        );
        assert!(
            decisions.waits.iter().any(|(_, wait)| matches!(
                wait,
                policy::Wait::Budget { forced, .. } if !forced.is_empty()
            )),
            "some budget checks count the events Azure starts inside their window"
        );
        let rounds = (200_000 / vms).clamp(5, 200);
        let decide = median(rounds, || {
            std::hint::black_box(policy::decide(&fleet, &policy, now));
        });
        let count = median(rounds, || {
            std::hint::black_box(policy::down_now(&fleet, &policy, now));
        });
        // The same VM stored again: a new version of the inventory, nothing else changed.
        let (name, vm) = fleet
            .vms()
            .iter()
            .next()
            .map(|(n, v)| (n.clone(), v.clone()))
            .unwrap();
        let changed = median(rounds, || {
            fleet.insert_vm(name.clone(), vm.clone());
            std::hint::black_box(policy::down_now(&fleet, &policy, now));
        });
        let verdicts = median(rounds, || {
            for (_, wait) in &decisions.waits {
                std::hint::black_box(wait.to_string());
            }
        });
        let floor = median(rounds, || {
            std::hint::black_box(walk(&fleet, now));
        });
        println!(
            "| {vms} | {} | {waiting} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.1}x |",
            fleet.events.len(),
            ms(decide),
            ms(count),
            ms(changed),
            ms(verdicts),
            ms(floor),
            decide.as_secs_f64() / floor.as_secs_f64()
        );
    }
}

/// The policy of `benches/coordinator.rs` (Reboots drained, then approved), through the
/// shipped config loader: groups `g0`.. of 100 VMs each.
fn policy_for(vms: usize, dir: &std::path::Path) -> Policy {
    let key_file = dir.join("coordinator.key");
    std::fs::write(&key_file, SigningKey::generate_ed25519().unwrap()).unwrap();
    let mut text = format!(
        "[coordinator]\nstate_dir = \"{state}\"\n\n\
         [input]\nkind = \"nats\"\nurl = \"nats://127.0.0.1:4222\"\nstream = \"SCHEDULEDEVENTS\"\nsubject = \"scheduledevents.>\"\n\n\
         [approvals]\nkind = \"nats\"\nurl = \"nats://127.0.0.1:4222\"\nsubject = \"scheduledapprovals.{{vmname}}\"\njetstream = true\n\n\
         [signing]\nkey_file = \"{key}\"\nkey_id = \"coordinator\"\n\n\
         [drain]\nurl = \"http://127.0.0.1:9/drain\"\n\n\
         [defaults]\nmax_down = 1\n[defaults.actions]\nReboot = \"drain_then_approve\"\nFreeze = {{ action = \"approve\", max_duration = \"30s\" }}\n",
        state = dir.join("state").display(),
        key = key_file.display(),
    );
    for g in 0..vms / GROUP {
        text.push_str(&format!(
            "\n[[groups]]\nname = \"g{g}\"\nvm_name = \"g{g}-*\"\nmax_down_percent = {PERCENT}\n"
        ));
    }
    let path = dir.join("coordinator.toml");
    std::fs::write(&path, text).unwrap();
    CoordinatorConfig::load_file_only(&path)
        .unwrap_or_else(|e| panic!("the bench's config: {e}"))
        .1
}

fn vm_name(vm: usize) -> String {
    format!("g{}-{:02}", vm / GROUP, vm % GROUP)
}

/// The fleet at the wave's peak (see the module's comment).
fn wave(vms: usize, now: DateTime<Utc>) -> Fleet {
    let mut fleet = Fleet::default();
    for vm in 0..vms {
        let name = vm_name(vm);
        let resource_id = format!(
            "/subscriptions/00000000-0000-0000-0000-000000000000/resourceGroups/fleet/providers/Microsoft.Compute/virtualMachines/{name}"
        );
        fleet.insert_vm(
            name,
            Vm {
                resource_id: Some(resource_id),
                last_seen: now,
                heartbeat: Some(Heartbeat {
                    at: now - chrono::Duration::seconds((vm % 300) as i64),
                    sent: now,
                    interval_seconds: 300,
                    incarnation: Some(1),
                    epoch: 0,
                    agent_version: "bench".into(),
                    started_at: Some(now - chrono::Duration::hours(1)),
                    events: Vec::new(),
                }),
                first_seen: Some(now - chrono::Duration::hours(1)),
            },
        );
    }
    for vm in (0..vms).step_by(5) {
        let name = vm_name(vm);
        let index = (vm % GROUP) / 5;
        let event_id = format!("{:08X}-0000-4000-8000-{:012X}", vm, vm);
        // The waiting ones (10 to 19) 5 to 9.5 minutes away, inside one another's 10-minute
        // outage window: each checks the earlier ones that Azure starts by itself.
        let not_before = now + chrono::Duration::seconds(300 + 30 * (index % 10) as i64);
        let reported = now - chrono::Duration::seconds(60);
        let mut m = Maintenance {
            event_type: "Reboot".into(),
            event_source: Some("Platform".into()),
            duration_seconds: Some(-1),
            not_before: Some(not_before),
            resources: vec![name.clone()],
            reports: BTreeMap::from([(
                name.clone(),
                Report {
                    stage: Stage::Scheduled,
                    incarnation: 2,
                    epoch: 0,
                    affects: true,
                    at: reported,
                    said: None,
                },
            )]),
            ..Maintenance::new(event_id.clone(), reported)
        };
        match index {
            0..5 => {
                m.reports.get_mut(&name).unwrap().stage = Stage::Completed;
                m.started_at = Some(now - chrono::Duration::seconds(50));
                m.approval = Some(approval(&name, now));
                m.back.insert(
                    name.clone(),
                    Back::new("completed", now - chrono::Duration::seconds(20)),
                );
            }
            5..10 => m.approval = Some(approval(&name, now)),
            _ => {}
        }
        fleet.events.insert(event_id.to_ascii_uppercase(), m);
    }
    fleet
}

fn approval(vm: &str, now: DateTime<Utc>) -> Approval {
    Approval {
        approver: vm.to_owned(),
        via: Default::default(),
        decided_at: now - chrono::Duration::seconds(55),
        dry_run: false,
        sent: Vec::new(),
        outcome: None,
        abandoned: false,
        dry_run_answers: 0,
    }
}

/// The floor: what any count of who is down must read, once (each VM's heartbeat, each
/// event's reports and evidence), and nothing more.
fn walk(fleet: &Fleet, now: DateTime<Utc>) -> usize {
    let silent = fleet.vms().values().filter(|vm| vm.silent(now, 3)).count();
    let live = fleet
        .events
        .values()
        .filter(|m| m.reports.values().any(|r| r.stage == Stage::Scheduled) && m.back.is_empty())
        .count();
    silent + live
}

fn median(rounds: usize, mut f: impl FnMut()) -> Duration {
    f();
    let mut times: Vec<Duration> = (0..rounds)
        .map(|_| {
            let started = Instant::now();
            f();
            started.elapsed()
        })
        .collect();
    times.sort();
    times[times.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
