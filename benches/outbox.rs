//! What storing one more document costs once the outbox holds a backlog: the poller pays this
//! on every new document while a sink is down. `cargo bench --bench outbox -- N` prints the
//! mean over 50 documents with N events stored per sink (4 sinks), then what reading one
//! sink's backlog back costs (in batches of 100, as its task reads it), and what decoding one
//! stored event costs, by cloudevents-sdk's `Deserialize` and by `Event::from_json_slice`
//! (the outbox's). For instruction counts:
//!   cargo bench --profile dev --bench outbox --no-run
//!   valgrind --tool=callgrind --toggle-collect='*Outbox*commit*' target/debug/deps/outbox-* 20000

use std::time::Instant;

use sched_relay::store::Outbox;

fn main() {
    let backlog: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(20_000);
    let dir = tempfile::tempdir().unwrap();
    let sinks: Vec<String> = ["nats", "amqp", "kafka", "webhook"]
        .map(String::from)
        .to_vec();
    let outbox = Outbox::open(dir.path(), backlog + 1_000, false).unwrap();
    let template = sched_relay_transport::testing::live_migration_events("WestNO_0");
    let event = |i: usize| {
        template[i % template.len()]
            .clone()
            .with_id(format!("backlog-{i}"))
    };
    let fill = Instant::now();
    for start in (0..backlog).step_by(1_000) {
        let chunk: Vec<_> = (start..(start + 1_000).min(backlog)).map(event).collect();
        outbox.commit(&sinks, &chunk, None).unwrap();
    }
    let fill = fill.elapsed();
    let documents = 50;
    let started = Instant::now();
    for i in 0..documents {
        let events: Vec<_> = (0..3).map(|j| event(backlog + i * 3 + j)).collect();
        outbox.commit(&sinks, &events, None).unwrap();
    }
    let per_document = started.elapsed() / documents as u32;
    println!(
        "backlog {backlog} per sink: filled in {fill:.2?}; one 3-event document stored in {per_document:.2?} (mean of {documents})"
    );
    let started = Instant::now();
    let (mut from, mut read) = (0, 0);
    loop {
        let batch = outbox.pending_between("nats", from, None, 100).unwrap();
        let Some(last) = batch.last() else { break };
        from = last.seq + 1;
        read += batch.len();
    }
    let elapsed = started.elapsed();
    println!(
        "read back one sink's {read} events in batches of 100: {elapsed:.2?} ({:.0} events/s)",
        read as f64 / elapsed.as_secs_f64()
    );
    let stored: Vec<Vec<u8>> = template
        .iter()
        .map(|e| serde_json::to_vec(e).unwrap())
        .collect();
    let rounds = 20_000;
    let time = |decode: &dyn Fn(&[u8])| {
        let started = Instant::now();
        for _ in 0..rounds {
            for bytes in &stored {
                decode(bytes);
            }
        }
        started.elapsed() / (rounds * stored.len()) as u32
    };
    let sdk = |bytes: &[u8]| {
        std::hint::black_box(serde_json::from_slice::<sched_relay_core::Event>(bytes).unwrap());
    };
    let fast = |bytes: &[u8]| {
        std::hint::black_box(sched_relay_core::Event::from_json_slice(bytes).unwrap());
    };
    // Each measured twice, alternately; the second rounds are reported (the first warm up).
    let (_, _) = (time(&sdk), time(&fast));
    let (sdk, fast) = (time(&sdk), time(&fast));
    println!(
        "decoding one stored event ({} bytes on average): cloudevents-sdk {sdk:.2?}, Event::from_json_slice {fast:.2?}",
        stored.iter().map(Vec::len).sum::<usize>() / stored.len()
    );
}
