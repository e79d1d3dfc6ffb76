//! Approvals from a Kafka topic keyed by VM name. The agent never joins a consumer group (a
//! join takes seconds, and 10,000 members would rebalance constantly): it assigns itself the
//! partition its own name hashes to, as Java clients and librdkafka's `murmur2_random` place
//! keys, reads from its committed offset (or, the first time, from `max_age` ago), skips
//! other VMs' records in that partition, and commits each offset after handling.

use std::time::Duration;

use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{Offset, TopicPartitionList};
use sched_relay_transport::inbound::{
    Backlog, Deliveries, Handover, Inbound, Progress, SourceRole, hand_over, keep_consuming,
    pause_after_not_handled,
};
use tokio::sync::watch;

use crate::KafkaSinkConfig;
use crate::sink::client_config;

/// What to consume.
#[derive(Debug, Clone)]
pub struct KafkaSourceSpec {
    pub connection: KafkaSinkConfig,
    pub topic: String,
    /// This VM's name: the key of its records. `by_key` reads only its partition.
    pub vm_name: String,
    pub by_key: bool,
    pub group_id: String,
    /// Without a committed offset, start this far back (older requests are expired anyway).
    pub max_age: Duration,
    /// Who reads it (the agent's approvals, the coordinator's input, `watch`), for the logs.
    pub role: SourceRole,
}

const METADATA_TIMEOUT: Duration = Duration::from_secs(10);

/// The partition a key goes to with Kafka's default partitioner (murmur2, positive, modulo).
pub fn partition_for(key: &str, partitions: i32) -> i32 {
    let hash = murmur2::murmur2(key.as_bytes(), murmur2::KAFKA_SEED) & 0x7fff_ffff;
    (hash % partitions.max(1) as u32) as i32
}

/// Consumes until `stop` turns true. Broker problems are logged and retried. `progress`
/// hears how far the source is through its partitions up to their end offsets when it
/// first connected.
pub async fn run(
    spec: KafkaSourceSpec,
    deliveries: Deliveries,
    progress: Progress,
    stop: watch::Receiver<bool>,
) {
    let what = format!("Kafka topic {}", spec.topic);
    let backlog = Backlog::new(progress);
    let (spec, deliveries, backlog) = (&spec, &deliveries, &backlog);
    keep_consuming(spec.role, &what, stop, |mut stop| async move {
        consume(spec, deliveries, backlog, &mut stop).await
    })
    .await
}

/// Per partition, the end offset at the start and where reading starts: the records
/// between them are the backlog.
/// A partition whose end cannot be read fails the connection (tried again), rather than
/// being left out of the catch-up.
fn ends(
    consumer: &StreamConsumer,
    spec: &KafkaSourceSpec,
    start: &TopicPartitionList,
) -> Result<std::collections::BTreeMap<i32, (i64, i64)>, String> {
    start
        .elements()
        .iter()
        .map(|p| {
            let (low, high) = consumer
                .fetch_watermarks(&spec.topic, p.partition(), METADATA_TIMEOUT)
                .map_err(|e| {
                    format!(
                        "cannot read the end offset of {}/{}: {e}",
                        spec.topic,
                        p.partition()
                    )
                })?;
            let from = match p.offset() {
                Offset::Offset(offset) => offset.max(low),
                _ => high,
            };
            Ok((p.partition(), (from, high)))
        })
        .collect()
}

/// How long the broker may hold an empty fetch of the approvals topic (`fetch.wait.max.ms`,
/// unless `options` sets it).
pub const FETCH_WAIT_MS: &str = "500";

/// The consumer's settings: the connection's, then the source's own.
fn consumer_config(spec: &KafkaSourceSpec) -> Result<rdkafka::ClientConfig, String> {
    let mut client = client_config(&spec.connection)?;
    client
        .set("group.id", &spec.group_id)
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "latest");
    if !spec.connection.options.contains_key("fetch.wait.max.ms") {
        // A broker answers a waiting fetch as soon as a record arrives: the wait bounds
        // approval latency only on a broker that sits on a fetch until it ends. Each empty
        // fetch wakes the consumer's threads: 100 ms cost an idle agent 10 fetches a second
        // (0.9 ms of CPU, 15 context switches; BENCHMARKS.md, profiling section 22).
        client.set("fetch.wait.max.ms", FETCH_WAIT_MS);
    }
    Ok(client)
}

/// Creates the consumer and works out where each of its partitions starts.
fn assign(spec: &KafkaSourceSpec) -> Result<(StreamConsumer, TopicPartitionList), String> {
    let consumer: StreamConsumer = consumer_config(spec)?
        .create()
        .map_err(|e| format!("cannot create the Kafka consumer: {e}"))?;
    let metadata = consumer
        .fetch_metadata(Some(&spec.topic), METADATA_TIMEOUT)
        .map_err(|e| {
            format!(
                "cannot read the metadata of topic {} from {}: {e}",
                spec.topic, spec.connection.brokers
            )
        })?;
    let count = metadata
        .topics()
        .iter()
        .find(|topic| topic.name() == spec.topic && topic.error().is_none())
        .map(|topic| topic.partitions().len() as i32)
        .filter(|count| *count > 0)
        .ok_or_else(|| {
            format!(
                "topic {} does not exist (create it; the agent does not)",
                spec.topic
            )
        })?;
    let partitions: Vec<i32> = if spec.by_key {
        vec![partition_for(&spec.vm_name, count)]
    } else {
        (0..count).collect()
    };
    let mut wanted = TopicPartitionList::new();
    for partition in &partitions {
        wanted.add_partition(&spec.topic, *partition);
    }
    let committed = consumer
        .committed_offsets(wanted.clone(), METADATA_TIMEOUT)
        .map_err(|e| {
            format!(
                "cannot read committed offsets of group {}: {e}",
                spec.group_id
            )
        })?;
    let since = chrono::Utc::now().timestamp_millis() - spec.max_age.as_millis() as i64;
    let mut by_time = TopicPartitionList::new();
    for partition in &partitions {
        by_time
            .add_partition_offset(&spec.topic, *partition, Offset::Offset(since))
            .map_err(|e| e.to_string())?;
    }
    let from_time = consumer.offsets_for_times(by_time, METADATA_TIMEOUT).ok();
    let mut start = TopicPartitionList::new();
    for partition in &partitions {
        let committed = committed
            .find_partition(&spec.topic, *partition)
            .map(|p| p.offset())
            .filter(|offset| matches!(offset, Offset::Offset(_)));
        let by_time = from_time
            .as_ref()
            .and_then(|list| list.find_partition(&spec.topic, *partition))
            .map(|p| p.offset())
            .filter(|offset| matches!(offset, Offset::Offset(_) | Offset::End));
        let offset = committed.or(by_time).unwrap_or(Offset::End);
        start
            .add_partition_offset(&spec.topic, *partition, offset)
            .map_err(|e| e.to_string())?;
    }
    consumer
        .assign(&start)
        .map_err(|e| format!("cannot assign {start:?}: {e}"))?;
    Ok((consumer, start))
}

/// Stops between messages, never in the middle of one.
async fn consume(
    spec: &KafkaSourceSpec,
    deliveries: &Deliveries,
    backlog: &Backlog,
    stop: &mut watch::Receiver<bool>,
) -> Result<(), String> {
    let setup = spec.clone();
    let watched = backlog.watched();
    let (consumer, start, mut behind) = tokio::task::spawn_blocking(move || {
        let (consumer, start) = assign(&setup)?;
        let ends = if watched {
            ends(&consumer, &setup, &start)?
        } else {
            Default::default()
        };
        Ok::<_, String>((consumer, start, ends))
    })
    .await
    .map_err(|e| e.to_string())??;
    behind.retain(|_, (from, high)| from < high);
    let left = |behind: &std::collections::BTreeMap<i32, (i64, i64)>| -> u64 {
        behind
            .values()
            .map(|(from, high)| (high - from).max(0) as u64)
            .sum()
    };
    backlog.found(left(&behind));
    let assigned: Vec<String> = start
        .elements()
        .iter()
        .map(|p| format!("{}@{:?}", p.partition(), p.offset()))
        .collect();
    tracing::info!(topic = %spec.topic, partitions = ?assigned, group_id = %spec.group_id, "{} ready (Kafka)", spec.role.name());
    loop {
        let message = tokio::select! {
            _ = stop.wait_for(|stop| *stop) => return Ok(()),
            message = consumer.recv() => message,
        };
        let message = message.map_err(|e| format!("cannot read topic {}: {e}", spec.topic))?;
        let key = message
            .key()
            .map(|k| String::from_utf8_lossy(k).into_owned());
        let channel = format!(
            "{}/{}@{}",
            message.topic(),
            message.partition(),
            message.offset()
        );
        let for_me = key
            .as_deref()
            .is_none_or(|key| key.eq_ignore_ascii_case(&spec.vm_name) || key == "*");
        if spec.by_key && !for_me {
            // Another VM whose name hashes to the same partition.
            tracing::trace!(channel = %channel, key = ?key, "Skipped another VM's record");
        } else {
            let headers = headers_as_text(&message);
            let inbound = Inbound {
                transport: "kafka",
                channel,
                headers,
                content_type: None,
                body: message.payload().unwrap_or_default().to_vec(),
                shared: !spec.by_key,
                route: key.clone(),
            };
            // A record not handled is handed over again after a pause, its offset
            // uncommitted, so nothing after it is committed before it is handled.
            loop {
                match hand_over(deliveries, inbound.clone()).await {
                    Handover::Handled(_) => break,
                    Handover::NotHandled(why) => {
                        if !pause_after_not_handled(spec.role, &spec.topic, &why, stop).await {
                            return Ok(());
                        }
                    }
                    Handover::Stopping => return Ok(()),
                }
            }
        }
        let mut done = TopicPartitionList::new();
        done.add_partition_offset(
            message.topic(),
            message.partition(),
            Offset::Offset(message.offset() + 1),
        )
        .map_err(|e| e.to_string())?;
        if let Err(error) = consumer.commit(&done, CommitMode::Async) {
            tracing::warn!(error = %error, "Cannot commit the offset of a handled message; it may be read again after a restart");
        }
        if let Some((from, high)) = behind.get_mut(&message.partition()) {
            *from = message.offset() + 1;
            if *from >= *high {
                behind.remove(&message.partition());
            }
            let now_left = left(&behind);
            backlog.handled_up_to(|_| now_left);
        }
    }
}

/// A record's headers as (name, text) pairs; values that are not UTF-8 are replaced
/// lossily (the CloudEvents Kafka binding sends strings).
pub fn headers_as_text(message: &impl Message) -> Vec<(String, String)> {
    message
        .headers()
        .map(|headers| {
            headers
                .iter()
                .map(|h| {
                    let value = h.value.map(|v| String::from_utf8_lossy(v).into_owned());
                    (h.key.to_owned(), value.unwrap_or_default())
                })
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn spec(options: &[(&str, &str)]) -> KafkaSourceSpec {
        let options: BTreeMap<String, String> = options
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        KafkaSourceSpec {
            connection: serde_json::from_value(serde_json::json!({
                "brokers": "127.0.0.1:9092", "topic": "t", "options": options
            }))
            .unwrap(),
            topic: "t".into(),
            vm_name: "vm".into(),
            by_key: true,
            group_id: "g".into(),
            max_age: Duration::from_secs(60),
            role: SourceRole::Approvals,
        }
    }

    #[test]
    fn an_idle_source_fetches_twice_a_second_unless_options_say_otherwise() {
        let shipped = consumer_config(&spec(&[])).unwrap();
        assert_eq!(shipped.get("fetch.wait.max.ms"), Some(FETCH_WAIT_MS));
        let asked = consumer_config(&spec(&[("fetch.wait.max.ms", "100")])).unwrap();
        assert_eq!(asked.get("fetch.wait.max.ms"), Some("100"));
    }
}
