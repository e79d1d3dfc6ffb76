//! Floors (issue 39): what a bare client written with the same crate pays for the same work
//! on the same machine, measured in the same run as the agent, so that a figure is a ratio
//! that travels to another machine rather than a time that says more about this one.
//!
//! The backlog drain runs the agent itself (the shipped release build) on a state directory
//! that a child process filled, one sink at a time and all four at once; each floor is a
//! child process publishing the same CloudEvents (the same encoding, headers and batches) to
//! the same broker with the same durability. CPU is whole processes' (`/proc/<pid>/stat`,
//! threads that ended included), connecting included on both sides.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use cloudevents::AttributesReader;
use sched_relay_core::binding;
use sched_relay_core::event::Event;
use serde_json::Value;

use super::common;
use super::{AMQP_URL, KAFKA, NATS_URL};

/// The events numbered `numbers` of a backlog: the agent's own transitions of a live
/// migration, each with an id of its own (`<tag>-<number>`).
pub fn backlog_events(numbers: std::ops::Range<usize>, tag: &str) -> Vec<Event> {
    let template = sched_relay_transport::testing::live_migration_events("WestNO_0");
    numbers
        .map(|i| {
            template[i % template.len()]
                .clone()
                .with_id(format!("{tag}-{i}"))
        })
        .collect()
}

/// The child modes of the benchmark binary: `--fill-child` and `--floor-child`. Each prints
/// one JSON line and exits; returns when `args` asks for neither.
pub fn child(args: &[String]) {
    let at = |flag: &str| args.iter().position(|a| a == flag);
    if let Some(i) = at("--fill-child") {
        let (dir, count, sinks) = (&args[i + 1], &args[i + 2], &args[i + 3]);
        fill(dir.as_ref(), count.parse().unwrap(), sinks);
        std::process::exit(0);
    }
    if let Some(i) = at("--floor-child") {
        let (kind, target) = (&args[i + 1], &args[i + 2]);
        let (count, batch) = (args[i + 3].parse().unwrap(), args[i + 4].parse().unwrap());
        let runtime = tokio::runtime::Runtime::new().unwrap();
        // `--events FILE`: the events a file sink of the agent wrote (JSON Lines), the same
        // CloudEvents; else `count` generated ones.
        let events = match at("--events") {
            Some(file) => std::fs::read_to_string(&args[file + 1])
                .unwrap()
                .lines()
                .map(|line| serde_json::from_str::<Event>(line).unwrap())
                .collect(),
            None => backlog_events(0..count, &format!("floor-{}", std::process::id())),
        };
        let mut meter = super::Meter::new(std::process::id());
        let started = Instant::now();
        let connected = runtime.block_on(publish(kind, target, &events, batch, &mut meter));
        meter.sample();
        let spent = meter.totals().0;
        println!(
            "{}",
            serde_json::json!({
                "cpu_ns": spent,
                "publishing_cpu_ns": spent - connected,
                "wall_s": started.elapsed().as_secs_f64(),
            })
        );
        std::process::exit(0);
    }
}

/// Fills the outbox in `dir` (the agent's `state.dir`) with `count` events for each sink of
/// `sinks` (comma-separated), as the agent stores a document's events (in commits of 1000).
fn fill(dir: &std::path::Path, count: usize, sinks: &str) {
    let names: Vec<String> = sinks.split(',').map(String::from).collect();
    let outbox = sched_relay::store::Outbox::open(dir, count + 10, false).unwrap();
    let rss_open = status_kib(std::process::id(), "VmRSS");
    // Made a commit's worth at a time: 100,000 events at once would be this process's own
    // memory, not the store's.
    let started = Instant::now();
    for start in (0..count).step_by(1_000) {
        let chunk = backlog_events(start..(start + 1_000).min(count), "backlog");
        outbox.commit(&names, &chunk, None).unwrap();
    }
    let fill_s = started.elapsed().as_secs_f64();
    // What a new document costs once the backlog is there (the poller pays it).
    let probe = Instant::now();
    outbox
        .commit(&names, &backlog_events(0..1, "probe"), None)
        .unwrap();
    let one_document_ms = probe.elapsed().as_secs_f64() * 1000.0;
    let pid = std::process::id();
    println!(
        "{}",
        serde_json::json!({
            "fill_s": fill_s,
            "one_document_ms": one_document_ms,
            "rss_open_kib": rss_open,
            "hwm_kib": status_kib(pid, "VmHWM"),
        })
    );
}

/// The headers the NATS sink sends with `event` (JetStream: with its message id).
fn nats_headers(event: &Event, encoded: &binding::Encoded) -> async_nats::HeaderMap {
    let mut headers = async_nats::HeaderMap::new();
    for (name, value) in &encoded.headers {
        headers.insert(name.as_str(), value.as_str());
    }
    headers.insert("content-type", encoded.content_type.as_str());
    headers.insert("Nats-Msg-Id", event.message_id());
    headers
}

/// The properties the AMQP sink sends with `event` (persistent).
fn amqp_properties(event: &Event, encoded: &binding::Encoded) -> lapin::BasicProperties {
    use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
    let mut headers = FieldTable::default();
    for (name, value) in &encoded.headers {
        headers.insert(
            ShortString::from(name.as_str()),
            AMQPValue::LongString(LongString::from(value.as_str())),
        );
    }
    lapin::BasicProperties::default()
        .with_content_type(encoded.content_type.as_str().into())
        .with_message_id(event.id().into())
        .with_delivery_mode(2)
        .with_timestamp(event.time().map_or(0, |t| t.timestamp().max(0) as u64))
        .with_app_id("sched-relay".into())
        .with_headers(headers)
}

/// The headers the Kafka sink sends.
fn kafka_headers(encoded: &binding::Encoded) -> rdkafka::message::OwnedHeaders {
    use rdkafka::message::{Header, OwnedHeaders};
    let mut headers = OwnedHeaders::new_with_capacity(encoded.headers.len() + 1);
    for (name, value) in &encoded.headers {
        headers = headers.insert(Header {
            key: name,
            value: Some(value.as_bytes()),
        });
    }
    headers.insert(Header {
        key: "content-type",
        value: Some(encoded.content_type.as_bytes()),
    })
}

/// A RabbitMQ channel with publisher confirms, on a connection of its own that stays open
/// for the process's life.
async fn confirm_channel() -> lapin::Channel {
    let connection = lapin::Connection::connect(AMQP_URL, lapin::ConnectionProperties::default())
        .await
        .unwrap();
    let channel = connection.create_channel().await.unwrap();
    channel
        .confirm_select(lapin::options::ConfirmSelectOptions::default())
        .await
        .unwrap();
    std::mem::forget(connection);
    channel
}

/// A Kafka producer as durable as the sink's: acks=all, idempotent, the sink's linger.
fn bare_producer() -> rdkafka::producer::FutureProducer {
    rdkafka::ClientConfig::new()
        .set("bootstrap.servers", KAFKA)
        .set("acks", "all")
        .set("enable.idempotence", "true")
        .set("linger.ms", "1")
        .create()
        .unwrap()
}

/// Publishes `events` in batches of `batch` with the bare client of `kind`, as durably as the
/// agent's sink does: JetStream publish awaiting every ack, RabbitMQ persistent publish with
/// publisher confirms, Kafka with acks=all and idempotence, webhook POSTs of each batch.
///
/// Returns the CPU `meter` counted once connected: what the publishing alone then costs is
/// the total less that.
async fn publish(
    kind: &str,
    target: &str,
    events: &[Event],
    batch: usize,
    meter: &mut super::Meter,
) -> u64 {
    let mut connected = || {
        meter.sample();
        meter.totals().0
    };
    match kind {
        "nats" => {
            let config: sched_relay_nats::NatsSinkConfig = serde_json::from_value(
                serde_json::json!({"url": NATS_URL, "subject": target, "jetstream": true}),
            )
            .unwrap();
            let client = async_nats::connect(NATS_URL).await.unwrap();
            let context = async_nats::jetstream::new(client);
            let at = connected();
            for chunk in events.chunks(batch) {
                let mut acks = Vec::with_capacity(chunk.len());
                for event in chunk {
                    let encoded =
                        binding::encode(event, config.content_mode, binding::NATS).unwrap();
                    let headers = nats_headers(event, &encoded);
                    let subject = binding::expand_template(target, event);
                    let ack = context
                        .publish_with_headers(subject, headers, encoded.body.into())
                        .await
                        .unwrap();
                    acks.push(ack);
                }
                for ack in acks {
                    ack.await.unwrap();
                }
            }
            at
        }
        "amqp" => {
            use lapin::options::BasicPublishOptions;
            let config: sched_relay_amqp::AmqpSinkConfig =
                serde_json::from_value(serde_json::json!({"url": AMQP_URL, "exchange": target}))
                    .unwrap();
            let channel = confirm_channel().await;
            let options = BasicPublishOptions {
                mandatory: true,
                ..BasicPublishOptions::default()
            };
            let at = connected();
            for chunk in events.chunks(batch) {
                let mut confirms = Vec::with_capacity(chunk.len());
                for event in chunk {
                    let encoded =
                        binding::encode(event, config.content_mode, binding::AMQP_RABBITMQ)
                            .unwrap();
                    let properties = amqp_properties(event, &encoded);
                    let routing_key = binding::expand_template(&config.routing_key, event);
                    let confirm = channel
                        .basic_publish(
                            target.into(),
                            routing_key.as_str().into(),
                            options,
                            &encoded.body,
                            properties,
                        )
                        .await
                        .unwrap();
                    confirms.push(confirm);
                }
                for confirm in confirms {
                    assert!(confirm.await.unwrap().is_ack());
                }
            }
            at
        }
        "kafka" => {
            use rdkafka::producer::FutureRecord;
            let config: sched_relay_kafka::KafkaSinkConfig =
                serde_json::from_value(serde_json::json!({"brokers": KAFKA, "topic": target}))
                    .unwrap();
            let producer = bare_producer();
            // librdkafka connects on its own threads: wait for the topic's metadata.
            rdkafka::producer::Producer::client(&producer)
                .fetch_metadata(Some(target), Duration::from_secs(10))
                .unwrap();
            let at = connected();
            for chunk in events.chunks(batch) {
                let mut deliveries = Vec::with_capacity(chunk.len());
                for event in chunk {
                    let encoded =
                        binding::encode(event, config.content_mode, binding::KAFKA).unwrap();
                    let headers = kafka_headers(&encoded);
                    let key = event.subject().unwrap_or(event.id()).to_owned();
                    let record = FutureRecord::to(target)
                        .key(&key)
                        .payload(&encoded.body)
                        .headers(headers);
                    deliveries.push(producer.send_result(record).map_err(|(e, _)| e).unwrap());
                }
                for delivery in deliveries {
                    delivery.await.unwrap().map_err(|(e, _)| e).unwrap();
                }
            }
            at
        }
        "webhook" => {
            sched_relay::install_crypto_provider();
            let client = reqwest::Client::builder().no_proxy().build().unwrap();
            let at = connected();
            for chunk in events.chunks(batch) {
                let body = binding::batch_json(chunk).unwrap();
                let response = client
                    .post(target)
                    .header("content-type", "application/cloudevents-batch+json")
                    .body(body)
                    .send()
                    .await
                    .unwrap();
                assert!(response.status().is_success(), "{}", response.status());
            }
            at
        }
        "file" => {
            use std::io::Write as _;
            let mut file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(target)
                .unwrap();
            let at = connected();
            for chunk in events.chunks(batch) {
                let mut bytes = Vec::new();
                for event in chunk {
                    serde_json::to_writer(&mut bytes, event).unwrap();
                    bytes.push(b'\n');
                }
                file.write_all(&bytes).unwrap();
                file.sync_data().unwrap();
            }
            at
        }
        other => panic!("no floor for {other}"),
    }
}

/// A field of `/proc/<pid>/status` in KiB (`VmRSS`, `VmHWM`).
pub fn status_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Runs this benchmark binary in a child mode and returns the JSON line it printed.
fn run_child(args: &[&str]) -> Value {
    let output = Command::new(std::env::current_exe().unwrap())
        .args(args)
        .stderr(Stdio::inherit())
        .output()
        .unwrap();
    assert!(output.status.success(), "{args:?} failed");
    let stdout = String::from_utf8_lossy(&output.stdout);
    serde_json::from_str(stdout.lines().last().unwrap_or_default())
        .unwrap_or_else(|e| panic!("{args:?} printed {stdout:?}: {e}"))
}

/// One drain of a backlog by the agent: its CPU and peak memory, and the fill's.
struct Drain {
    sinks: Vec<&'static str>,
    events: usize,
    wall: Duration,
    cpu_ns: u64,
    /// The agent's peak resident set (start, connecting, draining), KiB.
    hwm_kib: u64,
    /// Its resident set two seconds after the drain, idle, KiB.
    idle_after_kib: u64,
    /// The filling process's: its resident set once the store was open, and its peak.
    fill_open_kib: u64,
    fill_hwm_kib: u64,
    fill_s: f64,
    one_document_ms: f64,
    /// CPU ns of each broker process over the drain.
    brokers: Vec<(&'static str, u64)>,
}

/// The agent drains a backlog of `count` events for each of `sinks` against the real
/// brokers, on the shipped delivery defaults (`batch_size` 100), logging at info.
fn drain(
    sim: &common::SimProcess,
    topology: &super::Topology,
    collector: &super::Collector,
    sinks: &[&'static str],
    count: usize,
) -> Drain {
    let port = sched_relay_transport::testing::free_port();
    let extra = format!(
        "{}\n[telemetry]\nlisten = \"127.0.0.1:{port}\"\n",
        topology.only(sinks, &collector.url, "batch = true")
    );
    let mut agent =
        common::AgentProcess::configure_with_env(&sim.url, &extra, &super::agent_env("1s", "info"));
    let state = agent.dir.path().join("state");
    std::fs::create_dir_all(&state).unwrap();
    let filled = run_child(&[
        "--fill-child",
        state.to_str().unwrap(),
        &count.to_string(),
        &sinks.join(","),
    ]);
    let brokers: Vec<(&str, u32, u64)> = super::broker_pids(true)
        .into_iter()
        .map(|(who, pid)| (who, pid, super::process_cpu_ns(pid)))
        .collect();
    let started = Instant::now();
    agent.spawn_binary(&super::every_feature_binary(), &[]);
    let pid = agent.pid();
    let mut hwm = 0;
    let (wall, cpu_ns) = loop {
        // Read before the depths: the figures are those of a drain that is over.
        let cpu = super::process_cpu_ns(pid);
        hwm = hwm.max(status_kib(pid, "VmHWM"));
        let wall = started.elapsed();
        let text = metrics_page(port);
        let left: Vec<u64> = sinks.iter().filter_map(|sink| depth(&text, sink)).collect();
        if left.len() == sinks.len() && left.iter().all(|d| *d == 0) {
            break (wall, cpu);
        }
        assert!(
            started.elapsed() < Duration::from_secs(900),
            "the agent did not drain {sinks:?} within 900 s: depths {left:?}\n{}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let brokers = super::spent_since(&brokers);
    // What the agent keeps once it idles again (the brokers' CPU above is the drain's only).
    std::thread::sleep(Duration::from_secs(2));
    let idle_after_kib = status_kib(pid, "VmRSS");
    agent.stop();
    Drain {
        sinks: sinks.to_vec(),
        events: count,
        wall,
        cpu_ns,
        hwm_kib: hwm,
        idle_after_kib,
        fill_open_kib: filled["rss_open_kib"].as_u64().unwrap(),
        fill_hwm_kib: filled["hwm_kib"].as_u64().unwrap(),
        fill_s: filled["fill_s"].as_f64().unwrap(),
        one_document_ms: filled["one_document_ms"].as_f64().unwrap(),
        brokers,
    }
}

/// The agent's metrics page, or nothing while it is not listening yet.
fn metrics_page(port: u16) -> String {
    use std::io::{Read, Write};
    let Ok(mut stream) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return String::new();
    };
    let mut page = String::new();
    let asked = stream.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n");
    if asked.is_ok() {
        let _ = stream.read_to_string(&mut page);
    }
    page
}

/// `sched_relay_outbox_depth{sink="NAME"} N` from a Prometheus text page.
fn depth(metrics: &str, sink: &str) -> Option<u64> {
    let prefix = format!("sched_relay_outbox_depth{{sink=\"{sink}\"}} ");
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(&prefix)?.trim().parse::<f64>().ok())
        .map(|d| d as u64)
}

/// The bare client's CPU for `count` events of `sink`, in batches of 100 (the shipped
/// `batch_size`), to the same destination as the agent's sink.
fn floor(
    sink: &str,
    topology: &super::Topology,
    collector: &super::Collector,
    count: usize,
) -> u64 {
    let target = match sink {
        "nats" => format!("{}.{{vmname}}.{{transition}}", topology.prefix),
        "amqp" => topology.exchange.clone(),
        "kafka" => topology.topic.clone(),
        _ => collector.url.clone(),
    };
    let answer = run_child(&["--floor-child", sink, &target, &count.to_string(), "100"]);
    answer["cpu_ns"].as_u64().unwrap()
}

/// 4a, against its floor (issue 39.6): the agent's CPU for one document of `count` events,
/// logging at info as in production, against the bare clients publishing the same events
/// (read back from the agent's file sink) in the same batches.
pub fn burst(report: &mut super::Report, count: usize, topology: &super::Topology) {
    let dir = tempfile::tempdir().unwrap();
    let appears_after = Duration::from_secs(6);
    let (path, _) = super::scenario(dir.path(), "burst", count, appears_after, Duration::ZERO);
    let sim = common::SimProcess::start(&path, 1.0);
    let appears = Instant::now() + appears_after;
    let sinks = ["nats", "amqp", "kafka"];
    let port = sched_relay_transport::testing::free_port();
    let extra = format!(
        "{}\n[telemetry]\nlisten = \"127.0.0.1:{port}\"\n",
        topology.only(&sinks, "http://127.0.0.1:9/unused", "")
    );
    let mut agent =
        common::AgentProcess::configure_with_env(&sim.url, &extra, &super::agent_env("1s", "info"));
    agent.spawn_binary(&super::every_feature_binary(), &[]);
    let pid = agent.pid();
    std::thread::sleep(appears.saturating_duration_since(Instant::now()) - Duration::from_secs(2));
    // The agent's idle rate over the second before, taken off the burst's (threads'
    // schedstat: nanoseconds, not 10 ms ticks).
    let mut meter = super::Meter::new(pid);
    let idle_from = meter.totals().0;
    std::thread::sleep(Duration::from_secs(1));
    meter.sample();
    let from = meter.totals().0;
    let idle_rate = (from - idle_from) as f64;
    let started = Instant::now();
    let all = ["file", "nats", "amqp", "kafka"];
    let mut seen_burst = false;
    loop {
        meter.sample();
        let text = metrics_page(port);
        let depths: Vec<u64> = all.iter().filter_map(|sink| depth(&text, sink)).collect();
        let delivered = std::fs::read_to_string(&agent.events_file)
            .map(|f| f.lines().filter(|l| l.contains(".scheduled\"")).count())
            .unwrap_or(0);
        seen_burst |= delivered >= count;
        if seen_burst && depths.len() == all.len() && depths.iter().all(|d| *d == 0) {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the burst was not delivered within 120 s: depths {depths:?}\n{}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let window = started.elapsed().as_secs_f64();
    meter.sample();
    let spent = meter.totals().0 - from;
    let agent_ns = (spent as f64 - idle_rate * window).max(0.0);
    agent.stop();
    // The same CloudEvents the agent sent, from its file sink.
    let events = dir.path().join("burst-events.jsonl");
    let sent: String = std::fs::read_to_string(&agent.events_file)
        .unwrap()
        .lines()
        .filter(|line| !line.contains(".heartbeat"))
        .map(|line| format!("{line}\n"))
        .collect();
    let sent_count = sent.lines().count();
    std::fs::write(&events, sent).unwrap();
    let mut floors = Vec::new();
    for sink in all {
        let target = match sink {
            "nats" => format!("{}.{{vmname}}.{{transition}}", topology.prefix),
            "amqp" => topology.exchange.clone(),
            "kafka" => topology.topic.clone(),
            _ => dir.path().join("floor.jsonl").display().to_string(),
        };
        let answer = run_child(&[
            "--floor-child",
            sink,
            &target,
            "0",
            "100",
            "--events",
            events.to_str().unwrap(),
        ]);
        // The agent was connected before the burst: the floor's publishing alone.
        floors.push((sink, answer["publishing_cpu_ns"].as_u64().unwrap()));
    }
    let floor_ns: u64 = floors.iter().map(|(_, ns)| ns).sum();
    let ratio = agent_ns / floor_ns as f64;
    report.add(format!(
        "## Burst against its floor: one document with {count} events\n\n\
         The agent (the shipped release build, logging at info) with a file sink and NATS JetStream, RabbitMQ and Kafka sinks gets one document of {count} Freezes; its CPU from the document's arrival until every sink's outbox is empty, less its idle rate over the second before, against the floor: bare clients (the `--only delivery` floor's) publishing the same {sent_count} CloudEvents the agent sent (its file sink's copy: every transition and the document event) in batches of 100 to the same destinations, and a bare file writer appending and fsyncing them in the same batches; each floor's CPU once it is connected (the agent was connected before the document came). CPU from the threads' `schedstat`.\n\n\
         | agent CPU ms | floor CPU ms ({}) | agent / floor | goal (1.5x) |\n|---|---|---|---|\n| {:.1} | {:.1} | {ratio:.2}x | {} |\n\n\
         Reproduce: `scripts/bench --only burst`.",
        floors
            .iter()
            .map(|(sink, ns)| format!("{sink} {:.1}", *ns as f64 / 1e6))
            .collect::<Vec<_>>()
            .join(", "),
        agent_ns / 1e6,
        floor_ns as f64 / 1e6,
        if ratio <= 1.5 { "met" } else { "not met" },
    ));
}

/// 5a/1. Delivery CPU per event against the floor, and memory while a backlog fills and
/// drains: one sink at a time, then all four at once.
pub fn delivery(
    report: &mut super::Report,
    count: usize,
    topology: &super::Topology,
    collector: &super::Collector,
) {
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = super::scenario(dir.path(), "quiet", 0, Duration::ZERO, Duration::ZERO);
    let sim = common::SimProcess::start(&path, 1.0);
    let all: [&'static str; 4] = ["nats", "amqp", "kafka", "webhook"];
    let mut floors = Vec::new();
    let mut rows = String::new();
    let mut memory = String::new();
    let mut runs: Vec<Vec<&'static str>> = all.iter().map(|sink| vec![*sink]).collect();
    runs.push(all.to_vec());
    for sinks in runs {
        // The floor of each sink, measured just before the agent's run that uses it.
        for sink in &sinks {
            if !floors.iter().any(|(s, _)| s == sink) {
                floors.push((*sink, floor(sink, topology, collector, count)));
            }
        }
        let drained = drain(&sim, topology, collector, &sinks, count);
        let delivered = drained.events * drained.sinks.len();
        let floor_ns: u64 = floors
            .iter()
            .filter(|(sink, _)| drained.sinks.contains(sink))
            .map(|(_, ns)| ns)
            .sum();
        let ours = drained.cpu_ns as f64 / 1e3 / delivered as f64;
        let bare = floor_ns as f64 / 1e3 / delivered as f64;
        let ratio = ours / bare;
        let brokers: Vec<String> = drained
            .brokers
            .iter()
            .filter(|(_, ns)| *ns > 0)
            .map(|(who, ns)| format!("{who} {:.0}", *ns as f64 / 1e3 / delivered as f64))
            .collect();
        rows.push_str(&format!(
            "| {} | {delivered} | {:.1} | {:.0} | {ours:.1} | {bare:.1} | {ratio:.2}x | {} | {} |\n",
            drained.sinks.join(" + "),
            drained.wall.as_secs_f64(),
            delivered as f64 / drained.wall.as_secs_f64(),
            if ratio <= 1.5 { "met" } else { "not met" },
            brokers.join(", "),
        ));
        memory.push_str(&format!(
            "| {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} | {:.2} | {} |\n",
            drained.sinks.join(" + "),
            drained.hwm_kib as f64 / 1024.0,
            drained.idle_after_kib as f64 / 1024.0,
            drained.fill_open_kib as f64 / 1024.0,
            drained.fill_hwm_kib as f64 / 1024.0,
            drained.fill_s,
            drained.one_document_ms,
            if drained.hwm_kib <= 48 * 1024
                && drained.fill_hwm_kib - drained.fill_open_kib <= 48 * 1024
            {
                "met"
            } else {
                "not met"
            },
        ));
    }
    report.add(format!(
        "## Delivery CPU per event against a bare client: a backlog of {count} events per sink\n\n\
         The agent (the shipped release build, delivery defaults: `batch_size` 100, the webhook with `batch = true`, logging at info) starts on a state directory that holds {count} stored events for each of its sinks, and drains them against the real brokers, one sink at a time, then all four at once. The *floor* is a bare client of the same crate, in a process of its own, publishing the same CloudEvents (the same encoding, headers and batches of 100) to the same destination as durably: async-nats JetStream publish awaiting every ack; lapin persistent publish with publisher confirms; rdkafka with acks=all and idempotence; reqwest POSTing each batch. CPU is each whole process's (`/proc/<pid>/stat` for the agent, its threads' `schedstat` for the floor), connecting included on both sides; the agent's also includes its start, its idle polls and the metrics page read every 100 ms to see the depths. Goal: at most 1.5x the floor.\n\n\
         | sinks | events delivered | drained in s | events/s | agent CPU µs per event | floor CPU µs per event | agent / floor | goal (1.5x) | brokers' CPU µs per event |\n|---|---|---|---|---|---|---|---|---|\n{rows}\n\
         Memory (goal: the agent at most 48 MiB resident while it drains, and the store's growth while a backlog fills at most as much): the agent's peak resident set over its start and the drain, and its resident set idle 2 s after the drain (what it keeps until the next backlog); the process that filled the store (this benchmark's binary, with the agent's store code): its resident set once the store was open, and its peak while it stored the events (1000 per commit, as the agent stores a document's); and what storing one more document into the full backlog took.\n\n\
         | sinks | agent peak RSS MiB | agent RSS 2 s after MiB | filling: RSS at open MiB | filling: peak RSS MiB | fill s | one more document ms | goal (48 MiB) |\n|---|---|---|---|---|---|---|---|\n{memory}\n\
         Reproduce: `scripts/bench --only delivery`."
    ));
}

/// The floor of an approval's round trip (issue 39.3): the bare transport from the
/// orchestrator's publish to a bare receiver in this process (a NATS core subscriber, a
/// RabbitMQ consumer on the agent's approvals exchange, a Kafka consumer fetching as the
/// agent's source does, an HTTP server), plus one fsync'd 4 KiB write on the disk the agent's
/// state is on (the agent records each request durably before it POSTs).
pub struct ApprovalFloor {
    nats: (sched_relay_nats::NatsSink, async_nats::Subscriber),
    amqp: (sched_relay_amqp::AmqpSink, lapin::Consumer),
    kafka: (
        sched_relay_kafka::KafkaSink,
        rdkafka::consumer::StreamConsumer,
    ),
    http: reqwest::Client,
    disk: tempfile::NamedTempFile,
}

impl ApprovalFloor {
    pub async fn new(topology: &super::Topology) -> ApprovalFloor {
        use lapin::options::{BasicConsumeOptions, QueueBindOptions, QueueDeclareOptions};
        use rdkafka::consumer::Consumer as _;
        let subject = format!("{}-floor.WestNO_0", topology.prefix);
        let client = async_nats::connect(NATS_URL).await.unwrap();
        let subscriber = client.subscribe(subject.clone()).await.unwrap();
        client.flush().await.unwrap();
        let nats = sched_relay_nats::NatsSink::new(
            serde_json::from_value(serde_json::json!({"url": NATS_URL, "subject": subject}))
                .unwrap(),
        );
        let exchange = format!("{}-approvals", topology.exchange);
        let connection =
            lapin::Connection::connect(AMQP_URL, lapin::ConnectionProperties::default())
                .await
                .unwrap();
        let channel = connection.create_channel().await.unwrap();
        let queue = channel
            .queue_declare(
                "".into(),
                QueueDeclareOptions {
                    exclusive: true,
                    auto_delete: true,
                    ..QueueDeclareOptions::default()
                },
                Default::default(),
            )
            .await
            .unwrap();
        channel
            .queue_bind(
                queue.name().clone(),
                exchange.as_str().into(),
                "floor.WestNO_0".into(),
                QueueBindOptions::default(),
                Default::default(),
            )
            .await
            .unwrap();
        let consumer = channel
            .basic_consume(
                queue.name().clone(),
                "floor".into(),
                BasicConsumeOptions {
                    no_ack: true,
                    ..BasicConsumeOptions::default()
                },
                Default::default(),
            )
            .await
            .unwrap();
        // Kept open for as long as the consumer is.
        std::mem::forget(connection);
        let amqp = sched_relay_amqp::AmqpSink::new(
            serde_json::from_value(serde_json::json!({"url": AMQP_URL, "exchange": exchange, "routing_key": "floor.WestNO_0"}))
                .unwrap(),
        );
        let topic = sched_relay_transport::testing::unique("bench-floor-");
        sched_relay_kafka::testing::create_topic(KAFKA, &topic, 1).await;
        let consumer_kafka: rdkafka::consumer::StreamConsumer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", KAFKA)
            .set(
                "group.id",
                sched_relay_transport::testing::unique("bench-floor-"),
            )
            .set("enable.auto.commit", "false")
            // As the agent's approval source fetches.
            .set(
                "fetch.wait.max.ms",
                sched_relay_kafka::source::FETCH_WAIT_MS,
            )
            .create()
            .unwrap();
        let mut partitions = rdkafka::TopicPartitionList::new();
        partitions
            .add_partition_offset(&topic, 0, rdkafka::Offset::End)
            .unwrap();
        consumer_kafka.assign(&partitions).unwrap();
        let kafka = sched_relay_kafka::KafkaSink::new(
            serde_json::from_value(serde_json::json!({"brokers": KAFKA, "topic": topic})).unwrap(),
        );
        ApprovalFloor {
            nats: (nats, subscriber),
            amqp: (amqp, consumer),
            kafka: (kafka, consumer_kafka),
            http: reqwest::Client::builder().no_proxy().build().unwrap(),
            disk: tempfile::NamedTempFile::new().unwrap(),
        }
    }

    /// One floor sample for `source`, in ms: `event` published and received, plus one fsync.
    pub async fn sample(
        &mut self,
        source: &str,
        event: &Event,
        collector: &super::Collector,
    ) -> f64 {
        use futures_util::StreamExt as _;
        use sched_relay_transport::Sink as _;
        let deadline = Duration::from_secs(20);
        let sent = Instant::now();
        let received = match source {
            "nats" => {
                self.nats
                    .0
                    .deliver(std::slice::from_ref(event))
                    .await
                    .unwrap();
                tokio::time::timeout(deadline, self.nats.1.next())
                    .await
                    .unwrap()
                    .unwrap();
                sent.elapsed()
            }
            "amqp" => {
                self.amqp
                    .0
                    .deliver(std::slice::from_ref(event))
                    .await
                    .unwrap();
                tokio::time::timeout(deadline, self.amqp.1.next())
                    .await
                    .unwrap()
                    .unwrap()
                    .unwrap();
                sent.elapsed()
            }
            "kafka" => {
                let (sink, consumer) = &self.kafka;
                let (_, got) = tokio::join!(
                    async { sink.deliver(std::slice::from_ref(event)).await.unwrap() },
                    async {
                        tokio::time::timeout(deadline, consumer.recv())
                            .await
                            .unwrap()
                            .unwrap();
                        sent.elapsed()
                    }
                );
                got
            }
            _ => {
                let unix = chrono::Utc::now().timestamp_micros();
                let response = self
                    .http
                    .post(&collector.url)
                    .header("ce-id", event.id())
                    .header("content-type", "application/cloudevents+json")
                    .body(serde_json::to_vec(event).unwrap())
                    .send()
                    .await
                    .unwrap();
                assert!(response.status().is_success());
                let arrived = collector.arrival(event.id()).unwrap();
                Duration::from_micros((arrived - unix).max(0) as u64)
            }
        };
        let synced = Instant::now();
        {
            use std::io::{Seek, Write};
            let file = self.disk.as_file_mut();
            file.seek(std::io::SeekFrom::Start(0)).unwrap();
            file.write_all(&[0x5a; 4096]).unwrap();
            file.sync_data().unwrap();
        }
        (received + synced.elapsed()).as_secs_f64() * 1000.0
    }
}

/// The floor of the agent's part of detection to delivery (issue 39.2): one fsync'd 4 KiB
/// write on the state disk (the commit every sink waits for) plus the bare client's
/// publish-to-confirm round trip of one event, as durable as the sink's, to the same
/// destination.
pub struct DeliveryFloor {
    nats: (async_nats::jetstream::Context, String),
    amqp: (lapin::Channel, String),
    kafka: (rdkafka::producer::FutureProducer, String),
    http: (reqwest::Client, String),
    disk: tempfile::NamedTempFile,
    template: Event,
}

impl DeliveryFloor {
    pub async fn new(topology: &super::Topology, collector: &super::Collector) -> DeliveryFloor {
        let client = async_nats::connect(NATS_URL).await.unwrap();
        let channel = confirm_channel().await;
        let producer = bare_producer();
        sched_relay::install_crypto_provider();
        DeliveryFloor {
            nats: (
                async_nats::jetstream::new(client),
                format!("{}.WestNO_0.scheduled", topology.prefix),
            ),
            amqp: (channel, topology.exchange.clone()),
            kafka: (producer, topology.topic.clone()),
            http: (
                reqwest::Client::builder().no_proxy().build().unwrap(),
                collector.url.clone(),
            ),
            disk: tempfile::NamedTempFile::new().unwrap(),
            template: sched_relay_transport::testing::live_migration_events("WestNO_0")[0].clone(),
        }
    }

    /// One sample for `sink`, in µs: one fsync'd 4 KiB write, then one event published and
    /// confirmed.
    pub async fn sample(&mut self, sink: &str) -> i64 {
        use lapin::options::BasicPublishOptions;
        let event = self
            .template
            .clone()
            .with_id(sched_relay_transport::testing::unique("floor-"));
        let started = Instant::now();
        {
            use std::io::{Seek, Write};
            let file = self.disk.as_file_mut();
            file.seek(std::io::SeekFrom::Start(0)).unwrap();
            file.write_all(&[0x5a; 4096]).unwrap();
            file.sync_data().unwrap();
        }
        match sink {
            "nats" => {
                let encoded = binding::encode(&event, Default::default(), binding::NATS).unwrap();
                let headers = nats_headers(&event, &encoded);
                let (context, subject) = &self.nats;
                context
                    .publish_with_headers(subject.clone(), headers, encoded.body.into())
                    .await
                    .unwrap()
                    .await
                    .unwrap();
            }
            "amqp" => {
                let encoded =
                    binding::encode(&event, Default::default(), binding::AMQP_RABBITMQ).unwrap();
                let (channel, exchange) = &self.amqp;
                let properties = amqp_properties(&event, &encoded);
                let confirm = channel
                    .basic_publish(
                        exchange.as_str().into(),
                        "WestNO_0.scheduled".into(),
                        BasicPublishOptions {
                            mandatory: true,
                            ..BasicPublishOptions::default()
                        },
                        &encoded.body,
                        properties,
                    )
                    .await
                    .unwrap();
                confirm.await.unwrap();
            }
            "kafka" => {
                let encoded = binding::encode(&event, Default::default(), binding::KAFKA).unwrap();
                let (producer, topic) = &self.kafka;
                let record = rdkafka::producer::FutureRecord::to(topic)
                    .key("WestNO_0")
                    .payload(&encoded.body)
                    .headers(kafka_headers(&encoded));
                producer
                    .send(record, Duration::from_secs(10))
                    .await
                    .map_err(|(e, _)| e)
                    .unwrap();
            }
            _ => {
                let (client, url) = &self.http;
                let response = client
                    .post(url)
                    .header("ce-id", format!("floor:{}", event.id()))
                    .header("content-type", "application/cloudevents+json")
                    .body(serde_json::to_vec(&event).unwrap())
                    .send()
                    .await
                    .unwrap();
                assert!(response.status().is_success());
            }
        }
        started.elapsed().as_micros() as i64
    }
}
