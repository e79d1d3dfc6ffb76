//! Approvals through Azure Resource Manager, against the simulator's ARM stand-in over real
//! TCP (a managed-identity token from its token endpoint, the refresher's listings, the
//! acknowledge call), on the shipped defaults, judged from the simulated VMs' own record:
//! which event started, approved, when.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::json;

use super::published_as;
use super::quiet_day::{World, start_with};
use crate::coordinator::azure::acknowledge::Acknowledger;
use crate::coordinator::azure::{AzureConfig, refresh};
use crate::coordinator::engine::AzureView;
use crate::simulator::{ArmOptions, ArmRequest, ArmStandIn, Phase, Scenario, Simulator};
use sched_relay_core::document::Document;

const SUB: &str = "0b1f6471-1bf0-4dda-aec3-444455556666";

fn set_id() -> String {
    format!(
        "/subscriptions/{SUB}/resourceGroups/rg-web/providers/Microsoft.Compute/virtualMachineScaleSets/web"
    )
}

fn vm_id(n: usize) -> String {
    format!("{}/virtualMachines/{n}", set_id())
}

/// Scale set `web`: web_0, web_1 and web_2, each simulated with `events[n]` (TOML
/// `[[events]]` tables), and the ARM stand-in over them.
async fn scale_set(events: [&str; 3]) -> (Vec<Simulator>, ArmStandIn) {
    let scenarios = events
        .iter()
        .enumerate()
        .map(|(n, events)| {
            let text = format!(
                "[vm]\nname = 'web_{n}'\nresource_id = '{}'\n{events}",
                vm_id(n)
            );
            Scenario::from_toml(&text).unwrap()
        })
        .collect();
    let listen = "127.0.0.1:0".parse().unwrap();
    let vms = Simulator::start_fleet(scenarios, listen).await.unwrap();
    let handles: Vec<&Simulator> = vms.iter().collect();
    let arm = ArmStandIn::start(&handles, listen, ArmOptions::default())
        .await
        .unwrap();
    (vms, arm)
}

/// A Reboot of `resources`, an hour's notice (the simulated VM's own copy of the event).
fn reboot(id: &str, resources: &[&str]) -> String {
    format!(
        "[[events]]\nid = '{id}'\ntype = 'Reboot'\nresources = {resources:?}\nnotice = '1h'\nstarted_for = '1h'\n"
    )
}

/// The coordinator on the shipped defaults with group `ss` (the scale set, `max_down = 1`,
/// approved `via`), its refresher's first listing handed to the engine.
async fn world(arm: &ArmStandIn, via: &str) -> (World, AzureConfig) {
    world_with(arm, via, "").await
}

/// [`world`] with `keys` added to group `ss` (after its `[groups.azure]`), or top-level
/// tables.
async fn world_with(arm: &ArmStandIn, via: &str, keys: &str) -> (World, AzureConfig) {
    let azure = format!(
        "resource_manager = '{url}'\nmanaged_identity_endpoint = '{url}'\naudience = 'https://management.azure.com'\n",
        url = arm.url()
    );
    let extra = format!(
        "[azure]\n{azure}\n[[groups]]\nname = 'ss'\nmax_down = 1\n[groups.azure]\nsource = '{}'\napprove_via = '{via}'\n{keys}",
        set_id()
    );
    let mut world = start_with(tempfile::tempdir().unwrap(), &extra);
    let config: AzureConfig = toml::from_str(&azure).unwrap();
    world.engine.azure = Some(AzureView::new(
        Arc::new(tokio::sync::Notify::new()),
        config.max_age,
    ));
    world.engine.acknowledger = Some(Arc::new(Acknowledger::new(&config).unwrap()));
    list(&mut world, &config).await;
    (world, config)
}

/// One listing of every source by the refresher, handed to the engine.
async fn list(world: &mut World, config: &AzureConfig) {
    let (tx, mut rx) = tokio::sync::mpsc::channel(1);
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let task = refresh::start(
        config,
        vec![(
            2,
            crate::coordinator::azure::Source::parse(&set_id()).unwrap(),
        )],
        tx,
        Arc::new(tokio::sync::Notify::new()),
        stop,
    )
    .unwrap();
    let snapshot = tokio::time::timeout(Duration::from_secs(30), rx.recv())
        .await
        .unwrap()
        .unwrap();
    let _ = stop_tx.send(true);
    task.await.unwrap();
    assert!(snapshot.complete(), "{:?}", snapshot.sources);
    world.engine.azure_listed(snapshot, Utc::now());
}

/// A document of `vm`'s own: each event Scheduled, NotBefore an hour from `at`.
fn document(incarnation: u64, events: &[(&str, &[&str])], at: DateTime<Utc>) -> Document {
    let events: Vec<serde_json::Value> = events
        .iter()
        .map(|(id, resources)| {
            json!({"EventId": id, "EventType": "Reboot", "EventStatus": "Scheduled",
                "ResourceType": "VirtualMachine", "Resources": resources, "EventSource": "Platform",
                "DurationInSeconds": -1, "Description": "",
                "NotBefore": (at + chrono::Duration::hours(1)).to_rfc2822().replace("+0000", "GMT")})
        })
        .collect();
    let body = json!({"DocumentIncarnation": incarnation, "Events": events}).to_string();
    Document::parse(body.as_bytes()).unwrap().document
}

/// `vm`'s agent reports its document going from empty to `after`.
fn report(world: &mut World, vm: usize, after: &Document, now: DateTime<Utc>) {
    let before = document(1, &[], now);
    for event in published_as(&format!("web_{vm}"), &vm_id(vm), Some(&before), after, now) {
        world.deliver(&event, now);
    }
}

/// The acknowledge calls the stand-in answered, as (path, status).
fn acknowledgements(arm: &ArmStandIn) -> Vec<(String, Option<u16>)> {
    arm.requests()
        .into_iter()
        .filter(|r| r.method == "POST" && r.path.ends_with("/acknowledge"))
        .map(|r| (r.path, r.status))
        .collect()
}

/// Ticks the engine (at `now`) until `done` holds, letting its calls finish.
async fn until(world: &mut World, now: DateTime<Utc>, done: impl Fn(&World) -> bool) {
    for _ in 0..250 {
        world.engine.tick(now);
        world.settle().await;
        if done(world) {
            return;
        }
    }
    panic!("never happened");
}

/// Asks the stand-in for the answers a test needs (`POST /__arm/<name>`).
async fn hook(arm: &ArmStandIn, name: &str, body: serde_json::Value) {
    let answer = reqwest::Client::new()
        .post(format!("{}/__arm/{name}", arm.url()))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    assert!(answer.status().is_success(), "{name}: {}", answer.status());
}

async fn stop(vms: Vec<Simulator>, arm: ArmStandIn) {
    for vm in vms {
        vm.stop().await;
    }
    arm.stop().await;
}

fn started(vm: &Simulator, event: &str) -> bool {
    vm.snapshot()
        .down
        .iter()
        .any(|d| d.event_id == event && d.approved)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_of_vms_without_an_agent_are_approved_through_arm_within_the_budget() {
    // Only web_0 has an agent; its document, like every VM's of the set, lists the
    // Reboots of web_1 (E1) and web_2 (E2). The group allows one VM down.
    let both = format!("{}{}", reboot("E1", &["web_1"]), reboot("E2", &["web_2"]));
    let (vms, arm) = scale_set([&both, &both, &both]).await;
    let (mut world, config) = world(&arm, "arm").await;
    let now = Utc::now();
    report(
        &mut world,
        0,
        &document(2, &[("E1", &["web_1"]), ("E2", &["web_2"])], now),
        now,
    );
    until(&mut world, now, |_| started(&vms[1], "E1")).await;
    assert!(
        world.recorder.approved().is_empty(),
        "nothing went to an agent"
    );
    let calls = acknowledgements(&arm);
    assert_eq!(
        calls,
        [(
            format!(
                "{}/providers/Microsoft.Maintenance/scheduledevents/E1/acknowledge",
                set_id()
            ),
            Some(200)
        )],
        "one acknowledgement, at the scale set's scope"
    );
    // The simulated VMs' own record: web_1's Reboot started on our approval, web_2's waits
    // for the place web_1 holds.
    assert_eq!(
        vms[1]
            .snapshot()
            .phases
            .iter()
            .find(|(id, _)| id == "E1")
            .map(|(_, phase)| *phase),
        Some(Phase::Started)
    );
    assert!(!started(&vms[2], "E2"), "web_2 taken down past the budget");
    let e2 = world.engine.fleet.events["E2"].verdict.clone();
    assert!(e2.starts_with("waiting for budget"), "{e2}");

    // ARM's 200 alone does not make it accepted; Azure's next listing, showing web_1
    // rebooting, does.
    world.engine.tick(Utc::now());
    let approval = world.engine.fleet.events["E1"].approval.clone().unwrap();
    assert_eq!(
        approval.outcome, None,
        "accepted before it was seen started"
    );
    list(&mut world, &config).await;
    let later = Utc::now();
    world.engine.tick(later);
    let approval = world.engine.fleet.events["E1"].approval.clone().unwrap();
    let outcome = approval.outcome.expect("accepted on Azure's evidence");
    assert_eq!(
        (outcome.outcome.as_str(), outcome.reason.as_str()),
        ("accepted", "started")
    );
    assert_eq!(acknowledgements(&arm).len(), 1, "not acknowledged again");
    assert!(!started(&vms[2], "E2"));
    stop(vms, arm).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_no_agent_answers_within_outcome_timeout_goes_through_arm() {
    let e1 = reboot("E1", &["web_1"]);
    let (vms, arm) = scale_set([&e1, &e1, &e1]).await;
    let (mut world, _) = world(&arm, "agent_then_arm").await;
    // web_1's agent reports its Reboot and is sent the approval, but never answers.
    let now = Utc::now();
    report(&mut world, 1, &document(2, &[("E1", &["web_1"])], now), now);
    until(&mut world, now, |world| {
        world.recorder.approved() == ["E1".to_owned()]
    })
    .await;
    assert!(acknowledgements(&arm).is_empty(), "the agent goes first");
    assert!(!started(&vms[1], "E1"));
    // The shipped outcome_timeout (20 s) passes without an answer: not before.
    tokio::time::sleep(Duration::from_secs(21)).await;
    for _ in 0..5 {
        world.engine.tick(now + chrono::Duration::seconds(19));
        world.settle().await;
    }
    assert!(
        acknowledgements(&arm).is_empty(),
        "fell back before outcome_timeout"
    );
    until(&mut world, now + chrono::Duration::seconds(21), |_| {
        started(&vms[1], "E1")
    })
    .await;
    assert_eq!(
        acknowledgements(&arm),
        [(
            format!(
                "{}/providers/Microsoft.Maintenance/scheduledevents/E1/acknowledge",
                set_id()
            ),
            Some(200)
        )]
    );
    let approval = world.engine.fleet.events["E1"].approval.clone().unwrap();
    assert_eq!(approval.via, crate::coordinator::fleet::Via::Arm);
    let ways: Vec<_> = approval.sent.iter().map(|s| s.via).collect();
    assert_eq!(
        ways,
        [
            crate::coordinator::fleet::Via::Agent,
            crate::coordinator::fleet::Via::Arm
        ],
        "each request recorded with its way"
    );
    assert_eq!(
        world.recorder.approved(),
        ["E1".to_owned()],
        "no second request to the silent agent"
    );
    stop(vms, arm).await;
}

/// E1 of web_1 approved through ARM after the stand-in was asked for the answers of
/// `hook` (`POST /__arm/<name>`): every acknowledgement ARM received, with its status.
async fn acknowledged_after(name: &str, body: serde_json::Value) -> Vec<ArmRequest> {
    let e1 = reboot("E1", &["web_1"]);
    let (vms, arm) = scale_set([&e1, &e1, &e1]).await;
    let (mut world, _) = world(&arm, "arm").await;
    hook(&arm, name, body).await;
    let now = Utc::now();
    report(&mut world, 0, &document(2, &[("E1", &["web_1"])], now), now);
    // The engine tries a failed acknowledgement again every 2 s (`until` may not last).
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !started(&vms[1], "E1") {
        assert!(std::time::Instant::now() < deadline, "never approved");
        world.engine.tick(now);
        world.settle().await;
    }
    let calls = arm
        .requests()
        .into_iter()
        .filter(|r| r.path.ends_with("/acknowledge"))
        .collect();
    stop(vms, arm).await;
    calls
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_throttled_acknowledgement_is_sent_again_only_after_arms_retry_after() {
    let calls = acknowledged_after("throttle", json!({"count": 1, "retry_after": 4})).await;
    let statuses: Vec<_> = calls.iter().map(|r| r.status).collect();
    assert_eq!(statuses, [Some(429), Some(200)], "{calls:?}");
    let waited = calls[1].at_ms - calls[0].at_ms;
    assert!(
        waited >= 4000,
        "sent again {waited} ms after a Retry-After of 4 s"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledgements_wait_longer_after_each_arm_server_error_in_a_row() {
    // An outage of ARM: its next two calls answer 503.
    let calls = acknowledged_after("fail", json!({"count": 2, "status": 503})).await;
    let statuses: Vec<_> = calls.iter().map(|r| r.status).collect();
    assert_eq!(statuses, [Some(503), Some(503), Some(200)], "{calls:?}");
    let waits: Vec<u64> = calls.windows(2).map(|w| w[1].at_ms - w[0].at_ms).collect();
    assert!(
        waits[0] >= 2000 && waits[1] >= 4000,
        "sent again {waits:?} ms after each failure: the wait doubles"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_of_vms_without_an_agent_is_drained_by_name_then_approved_through_arm() {
    let e1 = reboot("E1", &["web_1"]);
    let (vms, arm) = scale_set([&e1, &e1, &e1]).await;
    let dir = tempfile::tempdir().unwrap();
    let drained = dir.path().join("drained");
    let drain = format!(
        "[groups.actions]\nReboot = 'drain_then_approve'\n[drain]\ncommand = ['sh', '-c', 'echo \"$0\" >> {}', '{{vmname}}']\n",
        drained.display()
    );
    let (mut world, _) = world_with(&arm, "arm", &drain).await;
    let now = Utc::now();
    report(&mut world, 0, &document(2, &[("E1", &["web_1"])], now), now);
    until(&mut world, now, |_| started(&vms[1], "E1")).await;
    // The drain hook ran for web_1, which has no agent, before ARM was asked.
    assert_eq!(std::fs::read_to_string(&drained).unwrap(), "web_1\n");
    let m = &world.engine.fleet.events["E1"];
    let drain = m.drain.as_ref().expect("drained first");
    assert_eq!(drain.vms.get("web_1").map(String::as_str), Some("done"));
    assert_eq!(acknowledgements(&arm).len(), 1);
    stop(vms, arm).await;
}
