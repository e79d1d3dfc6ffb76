//! What storing one more document costs once the outbox holds a backlog: the poller pays this
//! on every new document while a sink is down. `cargo bench --bench outbox -- N` prints the
//! mean over 50 documents with N events stored per sink (4 sinks). For instruction counts:
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
}
