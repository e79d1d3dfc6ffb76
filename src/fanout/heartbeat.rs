//! Heartbeats through the fan-out: stored and handed over like every other event (durable
//! before any sink sends one, in order with the transitions around it), but coalesced. A sink
//! that still holds an undelivered heartbeat gets no new one, and a sink whose queue is full
//! skips it rather than dead-letter it. So a sink that is down for days holds one heartbeat,
//! not 288 a day, and heartbeats never take the room of a transition beyond that one. What a
//! sink holds is remembered per process: each restart while a sink stays down can add one
//! more (`tests::a_sink_that_is_down_holds_one_undelivered_heartbeat`).

use std::sync::Arc;

use sched_relay_transport::Event;

use super::{Overflow, Publisher};
use crate::store::StoreError;

impl Publisher {
    /// Stores `heartbeat` for every sink that holds no undelivered heartbeat and has room;
    /// returns for how many sinks. An error is the store's: nothing was stored.
    pub async fn publish_heartbeat(&self, heartbeat: Event) -> Result<usize, StoreError> {
        let publisher = self.clone();
        let events: Arc<[Event]> = Arc::new([heartbeat]);
        let stored = tokio::task::spawn_blocking(move || {
            let mut held = publisher
                .heartbeats
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let mut targets = Vec::with_capacity(held.len());
            for (index, seq) in held.iter().enumerate() {
                let sink = publisher.names[index].as_str();
                let waiting = match seq {
                    Some(seq) => publisher.outbox.holds(sink, *seq)?,
                    None => false,
                };
                if waiting {
                    tracing::debug!(
                        sink,
                        "The sink has not taken the last heartbeat yet; no new one for it"
                    );
                } else {
                    targets.push(index);
                }
            }
            if targets.is_empty() {
                return Ok(0);
            }
            let placements = publisher.store(&events, None, &targets, Overflow::Skip)?;
            let mut stored = 0;
            for placement in placements {
                if placement.stored == 0 {
                    let sink = publisher.names[placement.sink].as_str();
                    tracing::debug!(sink, "The sink's outbox is full; no heartbeat for it");
                    continue;
                }
                held[placement.sink] = Some(placement.first_seq);
                stored += 1;
            }
            Ok::<_, StoreError>(stored)
        })
        .await
        .map_err(|e| StoreError::Io {
            path: "outbox".into(),
            reason: format!("store task failed: {e}"),
        })??;
        for wake in self.wakers.iter() {
            wake.notify_one();
        }
        Ok(stored)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use cloudevents::AttributesReader;
    use sched_relay_core::event::{EventFactory, Heartbeat, Identity, PartitionKey};
    use sched_relay_transport::{RecordingSink, SinkError};

    use super::*;
    use crate::fanout::{DeliveryConfig, Fanout, NamedSink};
    use crate::store::Outbox;

    fn heartbeat(n: i64) -> Event {
        let factory = EventFactory::new(
            "com.azure.scheduledevents",
            None,
            Identity {
                name: "vm".into(),
                ..Identity::default()
            },
            PartitionKey::EventId,
        );
        let state = Heartbeat {
            document: None,
            epoch: 0,
            interval: Duration::from_secs(1),
            started_at: chrono::Utc::now(),
            agent_version: "test",
        };
        let at = chrono::DateTime::from_timestamp_millis(1_700_000_000_000 + n).unwrap();
        factory.heartbeat(&state, at)
    }

    fn ids(outbox: &Outbox, sink: &str) -> Vec<String> {
        outbox
            .pending(sink, 100)
            .unwrap()
            .into_iter()
            .map(|stored| stored.event.unwrap().id().to_owned())
            .collect()
    }

    #[tokio::test]
    async fn a_sink_that_is_down_holds_one_undelivered_heartbeat() {
        let dir = tempfile::tempdir().unwrap();
        let outbox = Arc::new(Outbox::open(dir.path(), 100, false).unwrap());
        let up = RecordingSink::new();
        let down = RecordingSink::new();
        down.fail_next((0..10_000).map(|_| SinkError::Retriable("down".into())));
        let delivery = DeliveryConfig {
            retry_initial: Duration::from_millis(10),
            retry_max: Duration::from_millis(20),
            ..DeliveryConfig::default()
        };
        let fanout = Fanout::start(
            vec![
                NamedSink {
                    name: "up".into(),
                    sink: Box::new(up.clone()),
                },
                NamedSink {
                    name: "down".into(),
                    sink: Box::new(down),
                },
            ],
            &delivery,
            dir.path(),
            outbox.clone(),
        );
        let publisher = fanout.publisher();
        for n in 0..5 {
            publisher.publish_heartbeat(heartbeat(n)).await.unwrap();
            // The sink that is up takes each one (and it leaves the outbox) before the next is
            // made, as it does in the minutes between two.
            let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
            while up.delivered().len() <= n as usize || outbox.depth("up").unwrap() > 0 {
                assert!(tokio::time::Instant::now() < deadline, "not delivered");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        assert_eq!(
            up.delivered().len(),
            5,
            "every one reached the sink that is up"
        );
        assert_eq!(
            ids(&outbox, "down"),
            ["heartbeat:1700000000000"],
            "the sink that is down holds the first, and nothing more"
        );
        fanout.shutdown(Duration::from_millis(100)).await;
    }

    #[tokio::test]
    async fn a_full_queue_skips_the_heartbeat_rather_than_dead_letter_it() {
        let dir = tempfile::tempdir().unwrap();
        let outbox = Arc::new(Outbox::open(dir.path(), 1, false).unwrap());
        let down = RecordingSink::new();
        down.fail_next((0..10_000).map(|_| SinkError::Retriable("down".into())));
        let fanout = Fanout::start(
            vec![NamedSink {
                name: "down".into(),
                sink: Box::new(down),
            }],
            &DeliveryConfig::default(),
            dir.path(),
            outbox.clone(),
        );
        let transition = heartbeat(0).with_id("E1:scheduled");
        fanout.publish(&[transition], None).await.unwrap();
        let stored = fanout.publisher().publish_heartbeat(heartbeat(1)).await;
        assert_eq!(stored.unwrap(), 0);
        assert_eq!(ids(&outbox, "down"), ["E1:scheduled"]);
        assert!(
            !dir.path().join("dead-letter").join("down.jsonl").exists(),
            "no heartbeat in the dead-letter file"
        );
        fanout.shutdown(Duration::from_millis(100)).await;
    }
}
