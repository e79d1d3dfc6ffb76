//! The fault-injection driver: random scenarios played by the simulator with random IMDS
//! faults, while the agent is killed with -9 and restarted at random moments and its brokers
//! become unreachable and come back (RabbitMQ and NATS behind a network-cutting proxy, a
//! private Kafka broker behind another). A checker compares what every sink received with the
//! scenario's ground truth: every transition present, in order per Azure event, none
//! invented, repeats only as identical ids.
//!
//! Approvals go through the same faults (`chaos_approvals`): signed requests over core NATS
//! for events that wait for approval, IMDS 503s for some of their POSTs; each must end with
//! exactly one accepted outcome, in every sink.
//!
//! CI runs one round with a fixed seed; `scripts/chaos --minutes N --seed S` runs rounds until
//! the time is up and prints the totals. CHAOS_SEED and CHAOS_MINUTES set both.

mod chaos_approvals;
mod common;

use std::collections::{BTreeMap, HashSet};
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use common::{AgentProcess, SimProcess};
use sched_relay_amqp::testing::{Topology, message_ids};
use sched_relay_kafka::testing::PrivateTansu;
use sched_relay_nats::testing::{create_stream, stored_ids};
use sched_relay_transport::testing::{CuttableProxy, broker_available, unique};

const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// One Azure event's planned life, and the transitions it must yield.
struct Planned {
    id: String,
    expected: Vec<&'static str>,
}

/// The failure edges a round adds beyond its short fault bursts.
#[derive(Debug, Default)]
struct Edges {
    /// An IMDS outage of over 30 s, and the moment (ms after the simulator started) it ends,
    /// when a Preempt with its 30 s notice appears.
    long_outage_end_ms: Option<u64>,
    /// DocumentIncarnation starts again from 1 at this moment, as after a redeploy or the
    /// 24 h disable: the same numbers come back with other content.
    incarnation_reset_ms: Option<u64>,
    /// `/metadata/instance/compute` fails at start and later: every event must still name
    /// the VM as instance metadata does.
    compute_failures: bool,
    /// The agent's state directory is on a small tmpfs that the driver fills for a few
    /// seconds at a time (never across a kill: a restart while it is full loses what was only
    /// in memory, as docs/src/guarantees.md says).
    full_disk: bool,
    /// Events only an approval starts, and the 503s planned for their POSTs.
    approvals: Vec<chaos_approvals::Planned>,
    post_faults: usize,
}

/// A random scenario (TOML) whose phase changes for one event are at least `GAP` apart, so
/// that an agent down for a kill and restart, or behind a burst of IMDS faults, still sees
/// every phase.
fn random_scenario(rng: &mut fastrand::Rng, round: u64) -> (String, Vec<Planned>, usize, Edges) {
    const GAP: f64 = 2.5;
    let mut toml = String::from("description = \"chaos\"\n[vm]\nname = \"WestNO_0\"\n");
    let mut planned = Vec::new();
    let types = ["Freeze", "Reboot", "Redeploy", "Preempt", "Terminate"];
    let count = rng.usize(3..7);
    let mut end: f64 = 0.0;
    // One round in three: instance metadata (who this VM is) fails at start, and again
    // later, when kills restart the agent. Events wait until the VM is named, so they begin
    // once the first failure is over and the agent's retry (at most 5 s) has come.
    let compute_failure = rng.u8(0..3) == 0;
    let mut offset = 0.0;
    if compute_failure {
        let first = rng.u64(2_000..4_000);
        offset = (first as f64) / 1000.0 + 5.0;
        let _ = write!(
            toml,
            "\n[[faults]]\nkind = \"status\"\nstatus = 500\nendpoint = \"compute\"\nlasting = \"{first}ms\"\n\n[[faults]]\nkind = \"status\"\nstatus = 503\nendpoint = \"compute\"\nafter = \"{}ms\"\nlasting = \"20s\"\n",
            first + 6_000
        );
    }
    // One round in three: the service fails for over 30 s, and a Spot eviction appears the
    // moment it recovers; its 30 s notice must still be seen as `scheduled`. The other
    // events come after the outage: nobody can see an event that lives and dies inside one.
    let mut long_outage_end_ms = None;
    let mut long_outage_from_ms = 0;
    if rng.u8(0..3) == 0 {
        let from = ((offset + 1.0 + rng.f64() * 4.0) * 1000.0) as u64;
        let lasting = rng.u64(31_000..40_000);
        let end = from + lasting;
        let id = format!("chaos-{round}-spot");
        let _ = write!(
            toml,
            "\n[[faults]]\nkind = \"status\"\nstatus = 503\nafter = \"{from}ms\"\nlasting = \"{lasting}ms\"\n\n[[events]]\nid = \"{id}\"\ntype = \"Preempt\"\nresources = [\"WestNO_0\"]\nappear_after = \"{end}ms\"\nnotice = \"30s\"\nstarted_for = \"{}ms\"\n",
            (GAP * 1000.0) as u64
        );
        planned.push(Planned {
            id,
            expected: vec!["scheduled", "started", "completed"],
        });
        long_outage_end_ms = Some(end);
        long_outage_from_ms = from;
        offset = end as f64 / 1000.0 + 1.0;
    }
    for index in 0..count {
        let id = format!("chaos-{round}-{index}");
        let appear = offset + 1.0 + rng.f64() * 6.0;
        let host_failure = rng.u8(0..5) == 0;
        let cancelled = !host_failure && rng.u8(0..4) == 0;
        let updates = if host_failure { 0 } else { rng.usize(0..3) };
        let resources = if rng.bool() {
            "[\"WestNO_0\", \"WestNO_1\"]"
        } else {
            "[\"WestNO_2\"]"
        };
        let _ = write!(
            toml,
            "\n[[events]]\nid = \"{id}\"\ntype = \"{}\"\nresources = {resources}\nappear_after = \"{}ms\"\nduration_in_seconds = 5\n",
            types[rng.usize(0..types.len())],
            (appear * 1000.0) as u64
        );
        let mut expected = Vec::new();
        let mut last = appear;
        // Keys of the event first: after a [[events.updates]] table, keys belong to the update.
        let mut update_tables = String::new();
        if host_failure {
            expected.push("started");
            let _ = writeln!(
                toml,
                "status = \"Started\"\nstarted_for = \"{}ms\"",
                (GAP * 1000.0) as u64
            );
            last += GAP;
            expected.push("completed");
        } else {
            expected.push("scheduled");
            for update in 1..=updates {
                let _ = write!(
                    update_tables,
                    "[[events.updates]]\nafter = \"{}ms\"\nduration_in_seconds = {}\n",
                    (GAP * update as f64 * 1000.0) as u64,
                    5 + update
                );
                expected.push("updated");
            }
            let phase = GAP * (updates as f64 + 1.0);
            if cancelled {
                let _ = writeln!(
                    toml,
                    "notice = \"1h\"\ncancel_after = \"{}ms\"",
                    (phase * 1000.0) as u64
                );
                expected.push("cancelled");
                last += phase;
            } else {
                let _ = writeln!(
                    toml,
                    "notice = \"{}ms\"\nstarted_for = \"{}ms\"",
                    (phase * 1000.0) as u64,
                    (GAP * 1000.0) as u64
                );
                expected.push("started");
                expected.push("completed");
                last += phase + GAP;
            }
        }
        toml.push_str(&update_tables);
        end = end.max(last);
        planned.push(Planned { id, expected });
    }
    let (approvals, post_faults) = chaos_approvals::plan(rng, round, offset, &mut toml);
    for approval in &approvals {
        planned.push(Planned {
            id: approval.event_id.clone(),
            expected: vec!["scheduled", "started", "completed"],
        });
        end = end.max(approval.at.as_secs_f64() + GAP);
    }
    let mut edges = Edges {
        compute_failures: compute_failure,
        long_outage_end_ms,
        full_disk: rng.u8(0..3) == 0,
        approvals,
        post_faults,
        ..Edges::default()
    };
    // One round in three: Azure's numbering starts again from 1 part-way through.
    if rng.u8(0..3) == 0 {
        let at = (2.0 + rng.f64() * (end - 2.0).max(1.0)) * 1000.0;
        toml = format!("incarnation_reset_after = \"{}ms\"\n{toml}", at as u64);
        edges.incarnation_reset_ms = Some(at as u64);
    }
    // A few short fault bursts, spread over the scenario; in a long-outage round, before the
    // outage: right after it the backoff is still long (up to 5 s), and bursts then would
    // hide 2.5 s phases from any agent that keeps the service's 5 requests/s.
    let burst_window_ms = match long_outage_end_ms {
        Some(_) => long_outage_from_ms,
        None => (end * 1000.0) as u64,
    };
    let faults = rng.usize(1..4);
    for _ in 0..faults {
        let after = (rng.f64() * burst_window_ms as f64) as u64;
        match rng.u8(0..3) {
            0 => {
                let _ = write!(
                    toml,
                    "\n[[faults]]\nkind = \"status\"\nstatus = 503\nafter = \"{after}ms\"\ncount = {}\n",
                    rng.u8(1..3)
                );
            }
            1 => {
                let _ = write!(
                    toml,
                    "\n[[faults]]\nkind = \"malformed\"\nafter = \"{after}ms\"\n"
                );
            }
            _ => {
                let _ = write!(
                    toml,
                    "\n[[faults]]\nkind = \"delay\"\ndelay = \"300ms\"\nafter = \"{after}ms\"\n"
                );
            }
        }
    }
    (toml, planned, faults, edges)
}

/// Each Azure event's transition kinds in order of first arrival of each id.
fn kinds_by_event(ids: &[String]) -> BTreeMap<String, Vec<String>> {
    let mut seen = HashSet::new();
    let mut by_event: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for id in ids {
        if id.starts_with("document:") || !seen.insert(id.clone()) {
            continue;
        }
        let mut parts = id.splitn(3, ':');
        let event = parts.next().unwrap_or_default().to_owned();
        let kind = parts.next().unwrap_or_default().to_owned();
        by_event.entry(event).or_default().push(kind);
    }
    by_event
}

#[derive(Default, Debug)]
struct Totals {
    rounds: u64,
    documents: usize,
    transitions: usize,
    imds_faults: usize,
    agent_kills: usize,
    broker_cuts: usize,
    long_outages: usize,
    incarnation_resets: usize,
    compute_failures: usize,
    disk_fills: usize,
    /// Events approved over NATS, the requests (ids) and sends it took, the IMDS 503s
    /// planned for their POSTs, and the events that ended with one accepted outcome.
    approval_events: usize,
    approval_requests: usize,
    approval_sends: usize,
    approval_post_faults: usize,
    approvals_accepted: usize,
    /// The longest time from a long outage's end to the agent's first good poll.
    worst_detection_ms: u64,
    lost: usize,
    invented: usize,
}

async fn round(rng: &mut fastrand::Rng, number: u64, totals: &mut Totals) {
    let (scenario_text, planned, faults, mut edges) = random_scenario(rng, number);
    let work = tempfile::tempdir().unwrap();
    let scenario = common::scenario_file(work.path(), &scenario_text);

    // Brokers, each behind something the driver can take away.
    let nats_proxy = CuttableProxy::start("127.0.0.1:4222").await;
    let prefix = unique("chaos");
    let mut stream = create_stream(
        "nats://127.0.0.1:4222",
        &prefix.to_uppercase(),
        &format!("{prefix}.>"),
    )
    .await;
    let rabbit_proxy = CuttableProxy::start("127.0.0.1:5672").await;
    let topology = Topology::new(AMQP_URL).await;
    let kafka_port = sched_relay_transport::testing::free_port();
    let kafka_proxy = CuttableProxy::start(&format!("127.0.0.1:{kafka_port}")).await;
    let Some(_kafka) = PrivateTansu::start(kafka_port, &kafka_proxy.address()) else {
        return;
    };
    sched_relay_kafka::testing::create_topic(&kafka_proxy.address(), "chaos", 1).await;

    // Heartbeats off: every broker's ids are compared with the file sink's, waiting for
    // their count, and the file sink's list leaves heartbeats out (`tests/heartbeats.rs`
    // checks them on the wire).
    let sinks = format!(
        r#"
[events]
heartbeat_interval = "0s"

[delivery]
retry_initial = "100ms"
retry_max = "500ms"

[[sinks]]
name = "bus"
kind = "nats"
url = "nats://{nats}"
jetstream = true
subject = "{prefix}.{{vmname}}.{{transition}}"
timeout = "1s"

[[sinks]]
name = "rabbit"
kind = "amqp"
url = "amqp://guest:guest@{rabbit}/%2f"
exchange = "{exchange}"
timeout = "1s"

[[sinks]]
name = "kafka"
kind = "kafka"
brokers = "{kafka}"
topic = "chaos"
timeout = "2s"
{approvals}
"#,
        approvals = chaos_approvals::config(&format!("approvals-{prefix}")),
        nats = nats_proxy.address(),
        rabbit = rabbit_proxy.address(),
        exchange = topology.exchange,
        kafka = kafka_proxy.address(),
    );
    let disk = match edges.full_disk.then(|| common::Tmpfs::mount("64m")) {
        None => None,
        Some(Ok(disk)) => Some(disk),
        Some(Err(why)) if std::env::var_os("CI").is_some() => {
            panic!("the full-disk fault needs to mount a tmpfs (run as root): {why}")
        }
        Some(Err(why)) => {
            eprintln!("chaos: no full-disk fault this round (mounting a tmpfs needs root): {why}");
            None
        }
    };
    let state_dir = disk
        .as_ref()
        .map(|disk| disk.path().join("state").display().to_string());
    // The shipped backoff ceiling (5 s) where it is what is measured, a long outage's end;
    // elsewhere the fast one, so that 2.5 s phases survive fault bursts and kills.
    let mut env = Vec::new();
    if edges.long_outage_end_ms.is_some() {
        env.push(("SCHED_RELAY_IMDS__MAX_BACKOFF", "5s"));
    }
    if let Some(dir) = &state_dir {
        env.push(("SCHED_RELAY_STATE__DIR", dir.as_str()));
    }
    let started = Instant::now();
    let sim = SimProcess::start(&scenario, 1.0);
    // Fast polls, so that 2.5 s phases survive kills, but the shipped backoff ceiling, which
    // is what decides how soon a long outage's end is noticed.
    let mut agent = AgentProcess::start_with_env(&sim.url, &sinks, &env);
    let proxies = [&nats_proxy, &rabbit_proxy, &kafka_proxy];
    let deadline = Instant::now() + Duration::from_secs(120);
    let approvals = std::mem::take(&mut edges.approvals);
    let approval_events: Vec<String> = approvals.iter().map(|a| a.event_id.clone()).collect();
    let orchestrator = tokio::spawn(chaos_approvals::orchestrate(
        approvals,
        format!("approvals-{prefix}"),
        started,
        deadline + Duration::from_secs(30),
    ));
    loop {
        tokio::time::sleep(Duration::from_millis(rng.u64(300..1500))).await;
        let state = tokio::task::block_in_place(|| sim.state());
        let over = state["phases"]
            .as_array()
            .unwrap()
            .iter()
            .all(|p| p[1] == "gone");
        if over || Instant::now() > deadline {
            break;
        }
        if let Some(disk) = disk.as_ref().filter(|_| rng.u8(0..3) == 0) {
            // The state disk fills up for a while, then frees: the agent keeps what it sees
            // in memory and stores it once it can, without a restart.
            let filler = disk.path().join("filler");
            tokio::task::block_in_place(|| common::fill(&filler));
            tokio::time::sleep(Duration::from_millis(rng.u64(1000..4000))).await;
            std::fs::remove_file(&filler).unwrap();
            // The store notices within a second (its reopen backoff); a kill before then
            // would lose what was only in memory, the documented limit of a full disk.
            tokio::time::sleep(Duration::from_millis(2500)).await;
            totals.disk_fills += 1;
        } else if rng.bool() {
            tokio::task::block_in_place(|| {
                agent.kill9();
                agent.spawn(&[]);
            });
            totals.agent_kills += 1;
        } else {
            let proxy = proxies[rng.usize(0..proxies.len())];
            proxy.cut();
            tokio::time::sleep(Duration::from_millis(rng.u64(500..3000))).await;
            proxy.restore().await;
            totals.broker_cuts += 1;
        }
    }
    let last = tokio::task::block_in_place(|| {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let state = sim.state();
            if state["finished"] == true {
                break state["incarnation"].as_u64().unwrap();
            }
            assert!(
                Instant::now() < deadline,
                "round {number}: the scenario did not finish: {state}\n{scenario_text}\nagent log:\n{}",
                agent.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    let sent = orchestrator.await.unwrap();
    let file_events =
        tokio::task::block_in_place(|| agent.wait_for_document(last, Duration::from_secs(10)));
    let file_ids = common::ids(&file_events);
    let expected_count = file_ids.iter().collect::<HashSet<_>>().len();

    // Every broker catches up with everything the agent stored.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut nats_ids = Vec::new();
    while Instant::now() < deadline {
        // A request that times out on a loaded machine is asked again, until the deadline.
        let Ok(stored) = stream.info().await.map(|info| info.state.messages) else {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        };
        nats_ids = stored_ids(&stream, stored).await;
        if nats_ids.iter().collect::<HashSet<_>>().len() >= expected_count {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut amqp_ids = Vec::new();
    while Instant::now() < deadline
        && amqp_ids.iter().collect::<HashSet<_>>().len() < expected_count
    {
        amqp_ids.extend(message_ids(&topology.drain(expected_count).await));
    }
    let address = kafka_proxy.address();
    let kafka_records = tokio::task::spawn_blocking(move || {
        sched_relay_kafka::testing::read_all(&address, "chaos", 1, expected_count)
    })
    .await
    .unwrap();
    let kafka_ids: Vec<String> = kafka_records
        .iter()
        .map(|r| {
            r.headers
                .iter()
                .find(|(k, _)| k == "ce_id")
                .map(|(_, v)| v.clone())
                .unwrap_or_default()
        })
        .collect();
    assert!(
        tokio::task::block_in_place(|| agent.stop()).success(),
        "{}",
        agent.log()
    );

    let truth: BTreeMap<String, Vec<String>> = planned
        .iter()
        .map(|p| {
            (
                p.id.clone(),
                p.expected.iter().map(|k| k.to_string()).collect(),
            )
        })
        .collect();
    let context = format!(
        "round {number}\n{scenario_text}\nagent log:\n{}",
        agent.log()
    );
    for (sink, received) in [
        ("file", &file_ids),
        ("nats", &nats_ids),
        ("amqp", &amqp_ids),
        ("kafka", &kafka_ids),
    ] {
        let (approvals_lost, approvals_invented) =
            chaos_approvals::check(&approval_events, &sent, received);
        totals.lost += approvals_lost;
        totals.invented += approvals_invented;
        assert_eq!(
            (approvals_lost, approvals_invented),
            (0, 0),
            "{sink}: approvals lost or invented: {sent:?}\n{context}"
        );
        let received: Vec<String> = received
            .iter()
            .filter(|id| !chaos_approvals::is_outcome(&sent, id))
            .cloned()
            .collect();
        let got = kinds_by_event(&received);
        let lost: usize = truth
            .iter()
            .map(|(id, kinds)| {
                kinds
                    .len()
                    .saturating_sub(got.get(id).map_or(0, |g| g.len()))
            })
            .sum();
        let invented: usize = got
            .iter()
            .map(|(id, kinds)| {
                let planned = truth.get(id).map_or(0, Vec::len);
                kinds.len().saturating_sub(planned)
            })
            .sum();
        totals.lost += lost;
        totals.invented += invented;
        assert_eq!(
            got, truth,
            "{sink} differs from the ground truth ({lost} lost, {invented} invented)\n{context}"
        );
    }
    if let Some(end) = edges.long_outage_end_ms {
        let requests = tokio::task::block_in_place(|| sim.requests());
        let seen = common::first_good_get_after(&requests, end).unwrap_or(u64::MAX);
        let delay = seen.saturating_sub(end);
        assert!(
            delay <= 6_000,
            "a long outage's end was noticed {delay} ms late\n{context}"
        );
        totals.long_outages += 1;
        totals.worst_detection_ms = totals.worst_detection_ms.max(delay);
    }
    if edges.incarnation_reset_ms.is_some() {
        totals.incarnation_resets += 1;
    }
    if edges.compute_failures {
        totals.compute_failures += 1;
    }
    // Whatever instance metadata did, every event names the VM as it does, never a guess.
    for event in &file_events {
        assert_eq!(event["vmname"], "WestNO_0", "{event}\n{context}");
    }
    totals.approval_events += approval_events.len();
    totals.approval_requests += sent.requests.values().map(Vec::len).sum::<usize>();
    totals.approval_sends += sent.sends;
    totals.approval_post_faults += edges.post_faults;
    totals.approvals_accepted += sent.accepted.len();
    totals.rounds += 1;
    totals.imds_faults += faults;
    totals.documents += file_ids
        .iter()
        .filter(|id| id.starts_with("document:"))
        .collect::<HashSet<_>>()
        .len();
    totals.transitions += truth.values().map(Vec::len).sum::<usize>();
    topology.remove().await;
    let _ = stream.purge().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_faults_kills_and_outages_lose_and_invent_nothing() {
    if !(broker_available(
        "NATS",
        "127.0.0.1:4222",
        "nats-server -a 127.0.0.1 -p 4222 -js",
    ) && broker_available("RabbitMQ", "127.0.0.1:5672", "rabbitmq-server -detached"))
    {
        return;
    }
    let seed: u64 = std::env::var("CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2026);
    let minutes: f64 = std::env::var("CHAOS_MINUTES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0.0);
    let mut rng = fastrand::Rng::with_seed(seed);
    let until = Instant::now() + Duration::from_secs_f64(minutes * 60.0);
    let mut totals = Totals::default();
    let mut number = 0;
    loop {
        round(&mut rng, number, &mut totals).await;
        number += 1;
        if Instant::now() >= until {
            break;
        }
    }
    println!(
        "chaos: seed {seed}: {} rounds, {} documents, {} transitions, {} IMDS fault bursts, {} IMDS outages over 30 s (worst detection after recovery {} ms), {} incarnation resets, {} rounds with failing compute metadata, {} state-disk fills, {} agent kills (-9), {} broker outages, approvals: {} events, {} requests, {} sends, {} IMDS POST 503s, {} accepted, lost = {}, invented = {}",
        totals.rounds,
        totals.documents,
        totals.transitions,
        totals.imds_faults,
        totals.long_outages,
        totals.worst_detection_ms,
        totals.incarnation_resets,
        totals.compute_failures,
        totals.disk_fills,
        totals.agent_kills,
        totals.broker_cuts,
        totals.approval_events,
        totals.approval_requests,
        totals.approval_sends,
        totals.approval_post_faults,
        totals.approvals_accepted,
        totals.lost,
        totals.invented
    );
    assert_eq!((totals.lost, totals.invented), (0, 0));
}
