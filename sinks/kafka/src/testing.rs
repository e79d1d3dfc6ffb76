//! Helpers for tests that consume what the Kafka sink produced: topics, a reader that
//! assigns partitions (a consumer-group join takes seconds), and tansu instances a test owns.

use std::process::{Child, Command};
use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};
use sched_relay_transport::testing::unique;

/// How to get the broker the tests expect.
pub const HOW: &str = "start it with: scripts/kafka-broker start";

pub async fn create_topic(brokers: &str, topic: &str, partitions: i32) {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .unwrap();
    let results = admin
        .create_topics(
            &[NewTopic::new(topic, partitions, TopicReplication::Fixed(1))],
            &AdminOptions::new(),
        )
        .await
        .unwrap();
    for result in results {
        result.unwrap();
    }
}

/// One consumed record, with its headers as text.
pub struct Record {
    pub key: String,
    pub partition: i32,
    pub headers: Vec<(String, String)>,
    pub value: Vec<u8>,
}

/// Reads every record of the topic from the beginning, by assigning the partitions directly
/// (a consumer-group join would take seconds).
pub fn read_all(brokers: &str, topic: &str, partitions: i32, expected: usize) -> Vec<Record> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", unique("sr-test-"))
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    let mut assignment = TopicPartitionList::new();
    for partition in 0..partitions {
        assignment
            .add_partition_offset(topic, partition, Offset::Beginning)
            .unwrap();
    }
    consumer.assign(&assignment).unwrap();
    let mut records = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    // Until the expected count, then a moment more for repeats of a retried batch.
    let mut settle: Option<std::time::Instant> = None;
    while std::time::Instant::now() < deadline
        && settle.is_none_or(|until| std::time::Instant::now() < until)
    {
        if records.len() >= expected && settle.is_none() {
            settle = Some(std::time::Instant::now() + Duration::from_millis(500));
        }
        let Some(message) = consumer.poll(Duration::from_millis(100)) else {
            continue;
        };
        let message = message.unwrap();
        let headers = crate::source::headers_as_text(&message);
        records.push(Record {
            key: String::from_utf8(message.key().unwrap_or_default().to_vec()).unwrap(),
            partition: message.partition(),
            headers,
            value: message.payload().unwrap_or_default().to_vec(),
        });
    }
    records
}

/// A tansu this test owns, listening on one port and advertising another (a proxy's).
pub struct PrivateTansu {
    child: Child,
}

impl PrivateTansu {
    pub fn start(listen: u16, advertise: &str) -> Option<PrivateTansu> {
        PrivateTansu::start_with(listen, advertise, &[])
    }

    pub fn start_with(listen: u16, advertise: &str, extra: &[&str]) -> Option<PrivateTansu> {
        let binary = std::env::var("TANSU_BIN").unwrap_or_else(|_| {
            format!(
                "{}/../../target/tools/tansu-0.6.0",
                env!("CARGO_MANIFEST_DIR")
            )
        });
        let mut command = Command::new(&binary);
        command
            .args([
                "broker",
                "--listener-url",
                &format!("tcp://127.0.0.1:{listen}"),
            ])
            .args(["--advertised-listener-url", &format!("tcp://{advertise}")])
            .args(["--storage-engine", "memory://tansu/"])
            .args(extra);
        let child = sched_relay_transport::testing::spawn_or_skip(
            &mut command,
            &format!("{binary} ({HOW})"),
        )?;
        // In its guard first: a tansu that never listens is still killed.
        let tansu = PrivateTansu { child };
        sched_relay_transport::testing::wait_for_port(listen, "the private tansu");
        Some(tansu)
    }
}

impl Drop for PrivateTansu {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
