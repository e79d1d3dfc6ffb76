//! Remote approvals at their failure edges, against the real brokers (NATS with JetStream on
//! 127.0.0.1:4222, RabbitMQ on 127.0.0.1:5672, and with the `kafka` feature Kafka on
//! 127.0.0.1:9092):
//!
//! - an outcome that cannot be stored (the state disk is full, made so by the in-process fault
//!   injector `store::DiskFaults`, since no broker can produce it) leaves the message "not
//!   handled": JetStream naks it with a delay, RabbitMQ requeues it after a pause, Kafka
//!   reads the record again without committing, a core NATS requester gets a retriable
//!   error; every source keeps consuming, and once the disk frees the same message is
//!   handled;
//! - a kill -9 at each step of handling a request (after the POST, after the outcome is
//!   stored) loses no approval: the redelivery is accepted, or answered with the stored
//!   outcome, never refused as a replay.
//!
//! Without a broker the test says so and is skipped, except under `CI`, where it fails.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::read_events;
use sched_relay::approval::publish_to;
use sched_relay::simulator::{Scenario, Simulator};
use sched_relay::store::DiskFaults;
use sched_relay_core::approval::{Draft, SigningKey};
use sched_relay_transport::testing::{broker_available, unique};
use serde_json::Value;

const NATS: &str = "127.0.0.1:4222";
const NATS_URL: &str = "nats://127.0.0.1:4222";
const RABBITMQ: &str = "127.0.0.1:5672";
const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
const TYPE: &str = "com.azure.scheduledevents";
const SECRET: &str = "orchestrator-shared-secret-0001";

/// Two Freezes for this VM, waiting for approval (an hour of notice).
const FIRST: &str = "a0000000-0000-4000-8000-000000000001";
const SECOND: &str = "a0000000-0000-4000-8000-000000000002";

const SCENARIO: &str = r#"
[vm]
name = "WestNO_0"

[[events]]
id = "a0000000-0000-4000-8000-000000000001"
type = "Freeze"
resources = ["WestNO_0"]
appear_after = "0s"
notice = "1h"
started_for = "1h"

[[events]]
id = "a0000000-0000-4000-8000-000000000002"
type = "Freeze"
resources = ["WestNO_0"]
appear_after = "0s"
notice = "1h"
started_for = "1h"
"#;

fn signed(event_id: &str) -> (Draft, sched_relay_core::Event) {
    let key = SigningKey::parse(&format!("hmac-sha256:{SECRET}")).unwrap();
    let draft = Draft::new(
        "urn:orchestrator:test",
        Some("WestNO_0"),
        vec![event_id.into()],
    );
    let event = draft.event(Some(("orchestrator", &key)));
    (draft, event)
}

/// The agent's configuration: shipped defaults, a file sink, the HMAC key and `sources`.
fn config(endpoint: &str, dir: &Path, sources: &str) -> String {
    format!(
        r#"
[imds]
endpoint = "{endpoint}"

[state]
dir = "{state}"

[identity]
vm_name = "WestNO_0"

[[sinks]]
name = "file"
kind = "file"
path = "{events}"

[[approvals.keys]]
id = "orchestrator"
algorithm = "hmac-sha256"
secret = "{SECRET}"

{sources}
"#,
        state = dir.join("state").display(),
        events = dir.join("events.jsonl").display(),
    )
}

/// The approval outcomes in the file sink.
fn outcomes(dir: &Path) -> Vec<Value> {
    read_events(&dir.join("events.jsonl"))
        .into_iter()
        .filter(|e| {
            e["type"]
                .as_str()
                .unwrap_or_default()
                .contains(".approval.")
        })
        .collect()
}

async fn wait_until(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The simulator's StartRequests POSTs, as the EventIds of each.
fn posted(sim: &Simulator) -> Vec<String> {
    sim.requests()
        .into_iter()
        .filter(|r| r.method == "POST")
        .flat_map(|r| {
            let body: Value = serde_json::from_str(&r.body).unwrap_or_default();
            body["StartRequests"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|s| s["EventId"].as_str().map(str::to_owned))
                .collect::<Vec<_>>()
        })
        .collect()
}

/// The agent in this process on the state store's fault injector; stopped by the sender.
async fn start_agent(
    sim: &Simulator,
    dir: &Path,
    sources: &str,
) -> (
    std::sync::Arc<DiskFaults>,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<(), sched_relay::AgentError>>,
) {
    let path = dir.join("agent.toml");
    std::fs::write(&path, config(&sim.url(), dir, sources)).unwrap();
    let config = sched_relay::Config::load(Some(&path)).unwrap();
    let faults = DiskFaults::new();
    let options = sched_relay::RunOptions {
        disk_faults: Some(faults.clone()),
        ..Default::default()
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let agent = tokio::spawn(sched_relay::run(config, options, async {
        let _ = stopped.await;
    }));
    let events = dir.join("events.jsonl");
    wait_until("both Freezes scheduled", Duration::from_secs(20), || {
        let ids: Vec<String> = read_events(&events)
            .iter()
            .filter_map(|e| e["id"].as_str().map(str::to_owned))
            .collect();
        ids.contains(&format!("{FIRST}:scheduled")) && ids.contains(&format!("{SECOND}:scheduled"))
    })
    .await;
    (faults, stop, agent)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_and_rabbitmq_sources_keep_consuming_after_an_outcome_cannot_be_stored() {
    if !broker_available("NATS", NATS, "nats-server -a 127.0.0.1 -p 4222 -js")
        || !broker_available("RabbitMQ", RABBITMQ, "rabbitmq-server -detached")
    {
        return;
    }
    let sim = Simulator::start(
        Scenario::from_toml(SCENARIO).unwrap(),
        "127.0.0.1:0".parse().unwrap(),
    )
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let prefix = unique("approvals_full");
    let stream = unique("APPROVALS_FULL");
    sched_relay_nats::testing::create_stream(NATS_URL, &stream, &format!("{prefix}.>")).await;
    let exchange = unique("approvals_full");
    let sources = format!(
        "[approvals.nats]\nconnection = {{ url = \"{NATS_URL}\", subject = \"unused\" }}\n\
         subject = \"{prefix}.{{vmname}}\"\nstream = \"{stream}\"\n\n\
         [approvals.amqp]\nconnection = {{ url = \"{AMQP_URL}\" }}\nexchange = \"{exchange}\"\n\
         queue = \"{exchange}.{{vmname}}\"\n"
    );
    let (faults, stop, agent) = start_agent(&sim, dir.path(), &sources).await;
    // Both sources are consuming once the durable consumer exists and the queue is bound.
    let client = async_nats::connect(NATS_URL).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let handle = js.get_stream(&stream).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while handle
        .get_consumer::<async_nats::jetstream::consumer::pull::Config>("sched-relay-WestNO_0")
        .await
        .is_err()
    {
        assert!(Instant::now() < deadline, "no JetStream consumer");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let amqp_to = format!("{AMQP_URL}?exchange={exchange}&routing_key=approvals.WestNO_0");
    let (amqp_draft, amqp_event) = signed(SECOND);
    let (js_draft, js_event) = signed(FIRST);

    faults.fill();
    let deadline = Instant::now() + Duration::from_secs(20);
    // Routed only once the agent has bound its queue.
    while publish_to(&amqp_to, &amqp_event, None).await.is_err() {
        assert!(Instant::now() < deadline, "the AMQP queue was never bound");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    publish_to(
        &format!("{NATS_URL}?subject={prefix}.WestNO_0"),
        &js_event,
        None,
    )
    .await
    .unwrap();
    // Long enough for each message to be tried, not handled, and offered again.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(faults.refused() > 0, "the agent hit the full disk");
    assert!(outcomes(dir.path()).is_empty(), "nothing could be stored");

    faults.free();
    let path = dir.path().to_owned();
    wait_until(
        "both requests accepted after the disk freed",
        Duration::from_secs(30),
        || outcomes(&path).len() >= 2,
    )
    .await;
    // A little longer: a duplicate would show now.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let found = outcomes(dir.path());
    for draft in [&js_draft, &amqp_draft] {
        let mine: Vec<&Value> = found
            .iter()
            .filter(|e| e["requestid"] == draft.id.as_str())
            .collect();
        assert_eq!(mine.len(), 1, "one outcome for {}: {found:?}", draft.id);
        assert_eq!(
            mine[0]["type"],
            format!("{TYPE}.approval.accepted"),
            "{found:?}"
        );
    }
    let mut posted = posted(&sim);
    posted.sort();
    posted.dedup();
    assert_eq!(posted, [FIRST, SECOND]);

    let _ = stop.send(());
    agent.await.unwrap().unwrap();
    sim.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_core_nats_requester_gets_a_retriable_error_readyz_recovers_by_itself_and_the_source_keeps_answering()
 {
    if !broker_available("NATS", NATS, "nats-server -a 127.0.0.1 -p 4222 -js") {
        return;
    }
    let sim = Simulator::start(
        Scenario::from_toml(SCENARIO).unwrap(),
        "127.0.0.1:0".parse().unwrap(),
    )
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let prefix = unique("approvals_core");
    let port = sched_relay_transport::testing::free_port();
    let sources = format!(
        "[approvals.nats]\nconnection = {{ url = \"{NATS_URL}\", subject = \"unused\" }}\n\
         subject = \"{prefix}.{{vmname}}\"\n\n[telemetry]\nlisten = \"127.0.0.1:{port}\"\n"
    );
    let (faults, stop, agent) = start_agent(&sim, dir.path(), &sources).await;
    let incarnation = sim.snapshot().incarnation;
    let readyz = move || common::blocking_get(&format!("http://127.0.0.1:{port}/readyz"), &[]);
    let client = async_nats::connect(NATS_URL).await.unwrap();
    let subject = format!("{prefix}.WestNO_0");
    let (draft, event) = signed(FIRST);
    let body = serde_json::to_vec(&event).unwrap();
    let request = || {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("content-type", "application/cloudevents+json");
        client.request_with_headers(subject.clone(), headers, body.clone().into())
    };
    // Until the subscription is registered, nobody answers.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut answer = loop {
        faults.fill();
        match tokio::time::timeout(Duration::from_secs(5), request()).await {
            Ok(Ok(answer)) => break answer,
            _ => assert!(
                Instant::now() < deadline,
                "the core NATS source never answered"
            ),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let reply: Value = serde_json::from_slice(&answer.payload).unwrap();
    assert_eq!(reply["outcome"], "not_handled", "{reply}");
    assert_eq!(reply["retriable"], true, "{reply}");
    let (status, body) = tokio::task::spawn_blocking(readyz).await.unwrap();
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("state store cannot be written"), "{body}");

    faults.free();
    // The outcome that could not be stored is not committed again by anyone, and no new
    // document comes: `/readyz` must find out by itself (the poller probes).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (status, body) = tokio::task::spawn_blocking(readyz).await.unwrap();
        if status == 200 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "/readyz still failing 10 s after the disk freed: {body}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(
        sim.snapshot().incarnation,
        incarnation,
        "no new document came meanwhile"
    );
    // The same request again (the requester retries): the source still answers.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        answer = tokio::time::timeout(Duration::from_secs(10), request())
            .await
            .expect("the source answers")
            .expect("a reply");
        let reply: Value = serde_json::from_slice(&answer.payload).unwrap();
        if reply["outcome"] == "accepted" {
            assert_eq!(reply["requestId"], draft.id.as_str(), "{reply}");
            break;
        }
        assert!(Instant::now() < deadline, "never accepted: {reply}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert_eq!(posted(&sim), [FIRST]);

    let _ = stop.send(());
    agent.await.unwrap().unwrap();
    sim.stop().await;
}

/// The agent binary with a RabbitMQ source and the fault injector armed at `point`; a
/// signed request for FIRST is published, and the agent aborts there. Returns the agent
/// (not running), the request's id and the simulator.
fn killed_at(point: &str) -> Killed {
    let dir = tempfile::tempdir().unwrap();
    let sim = common::SimProcess::start(&common::scenario_file(dir.path(), SCENARIO), 1.0);
    let exchange = unique("approvals_kill");
    let sources = format!(
        "[identity]\nvm_name = \"WestNO_0\"\n\n[[approvals.keys]]\nid = \"orchestrator\"\n\
         algorithm = \"hmac-sha256\"\nsecret = \"{SECRET}\"\n\n\
         [approvals.amqp]\nconnection = {{ url = \"{AMQP_URL}\" }}\nexchange = \"{exchange}\"\n\
         queue = \"{exchange}.{{vmname}}\"\n"
    );
    let mut agent = common::AgentProcess::start_with_env(
        &sim.url,
        &sources,
        &[(sched_relay::approval::fault::ENV, point)],
    );
    agent.wait_for_id(&format!("{FIRST}:scheduled"), Duration::from_secs(20));
    let to = format!("{AMQP_URL}?exchange={exchange}&routing_key=approvals.WestNO_0");
    let (draft, event) = signed(FIRST);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    // Routed only once the agent has bound its queue.
    while runtime.block_on(publish_to(&to, &event, None)).is_err() {
        assert!(Instant::now() < deadline, "the AMQP queue was never bound");
        std::thread::sleep(Duration::from_millis(100));
    }
    let status = agent.wait(Duration::from_secs(20));
    assert!(!status.success(), "the injector aborts the agent");
    assert!(
        agent.log().contains(&format!(
            "aborting at {}",
            match point {
                "approval_after_post" => "AfterPost",
                "approval_after_post_mark" => "AfterPostMark",
                _ => "AfterOutcome",
            }
        )),
        "{}",
        agent.log()
    );
    Killed {
        _dir: dir,
        sim,
        agent,
        request_id: draft.id,
        to,
        event,
    }
}

struct Killed {
    _dir: tempfile::TempDir,
    sim: common::SimProcess,
    agent: common::AgentProcess,
    request_id: String,
    to: String,
    event: sched_relay_core::Event,
}

fn sim_posts(sim: &common::SimProcess) -> usize {
    sim.requests()
        .into_iter()
        .filter(|r| r["method"] == "POST")
        .count()
}

/// The outcome events of `request_id`, one per CloudEvents id: delivery is at least once,
/// so an event the sink took just before a kill may arrive again, with the same id.
fn outcomes_of(agent: &common::AgentProcess, request_id: &str) -> Vec<Value> {
    let mut seen = std::collections::HashSet::new();
    agent
        .events()
        .into_iter()
        .filter(|e| e["requestid"] == request_id)
        .filter(|e| seen.insert(e["id"].to_string()))
        .collect()
}

#[test]
fn an_agent_killed_after_the_post_approves_the_redelivered_request_instead_of_calling_it_a_replay()
{
    if !broker_available("RabbitMQ", RABBITMQ, "rabbitmq-server -detached") {
        return;
    }
    let Killed {
        sim,
        mut agent,
        request_id,
        ..
    } = killed_at("approval_after_post");
    assert_eq!(sim_posts(&sim), 1, "the POST went out before the abort");
    assert!(outcomes_of(&agent, &request_id).is_empty());

    agent.set_env(&[]);
    agent.spawn(&[]);
    // RabbitMQ delivers the unacknowledged message again; the agent forwards it again
    // (harmless: the event may have Started meanwhile) and accepts it.
    let id = format!("{request_id}:accepted");
    let found = agent.wait_for_id(&id, Duration::from_secs(30));
    std::thread::sleep(Duration::from_secs(2));
    let mine = outcomes_of(&agent, &request_id);
    assert_eq!(
        mine.len(),
        1,
        "exactly one outcome: {mine:?}\n{}",
        agent.log()
    );
    assert_eq!(
        mine[0]["type"],
        format!("{TYPE}.approval.accepted"),
        "{found:?}"
    );
    assert_eq!(mine[0]["data"]["reason"], "imds_accepted");
    assert_eq!(sim_posts(&sim), 2, "forwarded again after the restart");
    agent.wait_for_id(&format!("{FIRST}:started"), Duration::from_secs(10));
    agent.stop_cleanly();
}

#[test]
fn an_agent_killed_after_the_accepted_post_was_recorded_answers_accepted_without_a_second_post() {
    if !broker_available("RabbitMQ", RABBITMQ, "rabbitmq-server -detached") {
        return;
    }
    let Killed {
        sim,
        mut agent,
        request_id,
        ..
    } = killed_at("approval_after_post_mark");
    assert_eq!(sim_posts(&sim), 1, "the POST went out before the abort");
    assert!(outcomes_of(&agent, &request_id).is_empty());

    agent.set_env(&[]);
    agent.spawn(&[]);
    // The redelivery is answered from the record: accepted, whatever the event's state now
    // (it may have run and left the document), and not forwarded again.
    agent.wait_for_id(&format!("{request_id}:accepted"), Duration::from_secs(30));
    std::thread::sleep(Duration::from_secs(2));
    let mine = outcomes_of(&agent, &request_id);
    assert_eq!(mine.len(), 1, "exactly one outcome: {mine:?}");
    assert_eq!(mine[0]["data"]["reason"], "imds_accepted");
    assert_eq!(sim_posts(&sim), 1, "not forwarded again");
    agent.stop_cleanly();
}

#[test]
fn an_agent_killed_after_the_outcome_answers_the_redelivery_with_the_stored_outcome() {
    if !broker_available("RabbitMQ", RABBITMQ, "rabbitmq-server -detached") {
        return;
    }
    let Killed {
        sim,
        mut agent,
        request_id,
        to,
        event,
        ..
    } = killed_at("approval_after_outcome");
    assert_eq!(sim_posts(&sim), 1);

    agent.set_env(&[]);
    agent.spawn(&[]);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !agent.log().contains("answered with its stored outcome") {
        assert!(Instant::now() < deadline, "no redelivery:\n{}", agent.log());
        std::thread::sleep(Duration::from_millis(100));
    }
    agent.wait_for_id(&format!("{request_id}:accepted"), Duration::from_secs(10));
    // A replay of the same signed request later: the same answer, nothing sent.
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(publish_to(&to, &event, None)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while agent
        .log()
        .matches("answered with its stored outcome")
        .count()
        < 2
    {
        assert!(
            Instant::now() < deadline,
            "replay not answered:\n{}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_secs(2));
    let mine = outcomes_of(&agent, &request_id);
    assert_eq!(
        mine.len(),
        1,
        "exactly one outcome: {mine:?}\n{}",
        agent.log()
    );
    assert_eq!(mine[0]["type"], format!("{TYPE}.approval.accepted"));
    assert_eq!(sim_posts(&sim), 1, "never forwarded again");
    agent.stop_cleanly();
}

#[cfg(feature = "kafka")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kafka_source_reads_a_record_again_after_its_outcome_could_not_be_stored() {
    const KAFKA: &str = "127.0.0.1:9092";
    if !broker_available("Kafka", KAFKA, sched_relay_kafka::testing::HOW) {
        return;
    }
    let sim = Simulator::start(
        Scenario::from_toml(SCENARIO).unwrap(),
        "127.0.0.1:0".parse().unwrap(),
    )
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let topic = unique("approvals_full");
    sched_relay_kafka::testing::create_topic(KAFKA, &topic, 4).await;
    let sources = format!(
        "[approvals.kafka]\nconnection = {{ brokers = \"{KAFKA}\" }}\ntopic = \"{topic}\"\n"
    );
    let (faults, stop, agent) = start_agent(&sim, dir.path(), &sources).await;
    let (draft, event) = signed(FIRST);
    faults.fill();
    publish_to(&format!("kafka://{KAFKA}/{topic}"), &event, None)
        .await
        .unwrap();
    // The source reads from `max_age` ago, so the record is read however soon it started.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert!(faults.refused() > 0, "the agent hit the full disk");
    assert!(outcomes(dir.path()).is_empty(), "nothing could be stored");

    faults.free();
    let path = dir.path().to_owned();
    wait_until(
        "the request accepted after the disk freed",
        Duration::from_secs(30),
        || !outcomes(&path).is_empty(),
    )
    .await;
    // And the source is still consuming: a second request is handled too.
    let (second, event) = signed(SECOND);
    publish_to(&format!("kafka://{KAFKA}/{topic}"), &event, None)
        .await
        .unwrap();
    wait_until("the second request", Duration::from_secs(30), || {
        outcomes(&path).len() >= 2
    })
    .await;
    let found = outcomes(dir.path());
    for id in [&draft.id, &second.id] {
        let mine: Vec<&Value> = found
            .iter()
            .filter(|e| e["requestid"] == id.as_str())
            .collect();
        assert_eq!(mine.len(), 1, "{found:?}");
        assert_eq!(
            mine[0]["type"],
            format!("{TYPE}.approval.accepted"),
            "{found:?}"
        );
    }

    let _ = stop.send(());
    agent.await.unwrap().unwrap();
    sim.stop().await;
}

#[test]
fn an_agent_whose_approval_checker_dies_stops_with_an_error_instead_of_running_without_approvals() {
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("orchestrator.key");
    std::fs::write(&key, format!("hmac-sha256:{SECRET}")).unwrap();
    let sim = common::SimProcess::start(&common::scenario_file(dir.path(), SCENARIO), 1.0);
    let port = sched_relay_transport::testing::free_port();
    let mut agent = common::AgentProcess::start_with_env(
        &sim.url,
        &format!(
            "[telemetry]\nlisten = \"127.0.0.1:{port}\"\n[identity]\nvm_name = \"WestNO_0\"\n[approvals.http]\n[[approvals.keys]]\nid = \"orchestrator\"\nalgorithm = \"hmac-sha256\"\nsecret = \"{SECRET}\"\n"
        ),
        &[(sched_relay::approval::fault::ENV, "approval_checker_panic")],
    );
    agent.wait_for_id(&format!("{FIRST}:scheduled"), Duration::from_secs(20));
    // The request reaches the checker, which panics (the in-process fault injector).
    let _ = std::process::Command::new(common::BINARY)
        .args(["sign-approval", "--key"])
        .arg(&key)
        .args([
            "--key-id",
            "orchestrator",
            "--vm",
            "WestNO_0",
            "--event-id",
            FIRST,
        ])
        .args(["--to", &format!("http://127.0.0.1:{port}/approvals")])
        .output()
        .unwrap();
    let status = agent.wait(Duration::from_secs(20));
    assert!(
        !status.success(),
        "the agent must exit non-zero, so that systemd or Kubernetes restarts it:\n{}",
        agent.log()
    );
    assert!(
        agent.log().contains("approval checker died"),
        "{}",
        agent.log()
    );
}
