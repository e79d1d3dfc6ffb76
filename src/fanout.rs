//! Fan-out: every event goes to every sink, each through its own bounded queue and its own
//! task, so a slow or broken sink never delays the others. The task batches what is queued,
//! retries retriable failures with exponential backoff and full jitter, and writes what can
//! never be delivered to a dead-letter file (`<state.dir>/dead-letter/<sink>.jsonl`), with the
//! reason, instead of dropping it.
//!
//! Queues live in memory: what is queued when the process dies is lost. The durable outbox
//! (issue 5) replaces them. Until then, a full queue and an expired shutdown drain both write
//! to the dead-letter file, so nothing vanishes silently.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use cloudevents::AttributesReader;
use sink_core::{Event, Sink, SinkError};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;

use crate::config::DeliveryConfig;

/// The longest `Retry-After` a destination can impose.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(3600);

/// A sink with its name, ready to be driven by the fan-out.
pub struct NamedSink {
    pub name: String,
    pub sink: Box<dyn Sink>,
}

/// The running fan-out.
pub struct Fanout {
    queues: Vec<(String, mpsc::Sender<Arc<Event>>)>,
    dead_letter_dir: PathBuf,
    give_up: watch::Sender<bool>,
    tasks: JoinSet<()>,
}

impl Fanout {
    /// Starts one delivery task per sink.
    pub fn start(sinks: Vec<NamedSink>, delivery: &DeliveryConfig, state_dir: &Path) -> Fanout {
        let dead_letter_dir = state_dir.join("dead-letter");
        let (give_up, give_up_rx) = watch::channel(false);
        let mut tasks = JoinSet::new();
        let mut queues = Vec::new();
        for NamedSink { name, sink } in sinks {
            let (tx, rx) = mpsc::channel(delivery.queue_capacity);
            let worker = Worker {
                dead_letter: DeadLetter::new(&dead_letter_dir, &name),
                name: name.clone(),
                sink,
                queue: rx,
                delivery: delivery.clone(),
                give_up: give_up_rx.clone(),
            };
            tasks.spawn(worker.run());
            queues.push((name, tx));
        }
        Fanout {
            queues,
            dead_letter_dir,
            give_up,
            tasks,
        }
    }

    /// Queues events for every sink, in order. Never waits for a sink: a full queue sends the
    /// event to that sink's dead-letter file and says so loudly.
    pub fn publish(&self, events: &[Event]) {
        for event in events {
            let event = Arc::new(event.clone());
            for (name, queue) in &self.queues {
                if let Err(error) = queue.try_send(event.clone()) {
                    let reason = match error {
                        mpsc::error::TrySendError::Full(_) => {
                            "queue full (raise delivery.queue_capacity or fix the sink)"
                        }
                        mpsc::error::TrySendError::Closed(_) => "sink task stopped",
                    };
                    tracing::error!(sink = %name, event_id = %event.id(), reason, "Event not queued, written to the dead-letter file");
                    metrics::counter!("sched_relay_sink_dead_lettered_total", "sink" => name.clone()).increment(1);
                    DeadLetter::new(&self.dead_letter_dir, name)
                        .write(std::slice::from_ref(&event), reason);
                }
            }
        }
    }

    /// Stops taking events, lets every sink drain for at most `timeout`, then makes the
    /// stragglers dead-letter what they still hold and waits for them.
    pub async fn shutdown(mut self, timeout: Duration) {
        self.queues.clear();
        let drained = tokio::time::timeout(timeout, async {
            while self.tasks.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            tracing::warn!(timeout = ?timeout, "Sinks did not drain in time; undelivered events go to the dead-letter files");
            let _ = self.give_up.send(true);
            while self.tasks.join_next().await.is_some() {}
        }
    }
}

struct Worker {
    name: String,
    sink: Box<dyn Sink>,
    queue: mpsc::Receiver<Arc<Event>>,
    delivery: DeliveryConfig,
    dead_letter: DeadLetter,
    give_up: watch::Receiver<bool>,
}

impl Worker {
    async fn run(mut self) {
        // Checked here, concurrently with the other sinks and with polling; events queue
        // meanwhile. A failed check is reported, and delivery is tried all the same: the
        // retry and dead-letter rules decide what happens to the events.
        let checked = tokio::select! {
            result = self.sink.health_check() => Some(result),
            _ = self.give_up.changed() => None,
        };
        match checked {
            Some(Ok(())) => tracing::info!(sink = %self.name, "Sink ready"),
            Some(Err(error)) => {
                tracing::error!(sink = %self.name, error = %error, "Sink health check failed; its events will be retried or dead-lettered")
            }
            None => {}
        }
        let mut batch: Vec<Event> = Vec::with_capacity(self.delivery.batch_size);
        while let Some(first) = self.queue.recv().await {
            batch.push((*first).clone());
            while batch.len() < self.delivery.batch_size {
                match self.queue.try_recv() {
                    Ok(next) => batch.push((*next).clone()),
                    Err(_) => break,
                }
            }
            if !self.deliver(&batch).await {
                self.dead_letter.write(&batch, "shutdown before delivery");
                while let Ok(rest) = self.queue.try_recv() {
                    self.dead_letter
                        .write(std::slice::from_ref(&rest), "shutdown before delivery");
                }
                return;
            }
            batch.clear();
        }
    }

    /// Delivers one batch, retrying while retrying can help. Returns false when told to give
    /// up (shutdown timeout) before the batch was delivered or dead-lettered.
    async fn deliver(&mut self, batch: &[Event]) -> bool {
        let mut attempt: u32 = 0;
        loop {
            if *self.give_up.borrow_and_update() {
                return false;
            }
            // At the shutdown deadline an attempt in flight is abandoned: the batch goes to
            // the dead-letter file (it may also have arrived: at least once).
            let result = tokio::select! {
                result = self.sink.deliver(batch) => result,
                _ = self.give_up.changed() => return false,
            };
            match result {
                Ok(()) => {
                    metrics::counter!("sched_relay_sink_delivered_total", "sink" => self.name.clone())
                        .increment(batch.len() as u64);
                    if attempt > 0 {
                        tracing::info!(sink = %self.name, attempts = attempt + 1, "Sink recovered, batch delivered");
                    }
                    for event in batch {
                        tracing::debug!(sink = %self.name, event_id = %event.id(), "Delivered");
                    }
                    return true;
                }
                Err(error) if error.is_retriable() => {
                    // A destination that says when to come back is believed, within an hour.
                    let wait = error
                        .retry_after()
                        .map(|after| after.min(MAX_RETRY_AFTER))
                        .unwrap_or_else(|| {
                            backoff(
                                attempt,
                                self.delivery.retry_initial,
                                self.delivery.retry_max,
                            )
                        });
                    metrics::counter!("sched_relay_sink_retried_total", "sink" => self.name.clone()).increment(1);
                    tracing::warn!(sink = %self.name, attempt = attempt + 1, retry_in = ?wait, error = %error, "Delivery failed, will retry");
                    attempt = attempt.saturating_add(1);
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => {}
                        _ = self.give_up.changed() => return false,
                    }
                }
                Err(error) => {
                    metrics::counter!("sched_relay_sink_dead_lettered_total", "sink" => self.name.clone())
                        .increment(batch.len() as u64);
                    tracing::error!(sink = %self.name, events = batch.len(), error = %error, "Delivery refused, batch written to the dead-letter file");
                    self.dead_letter.write(batch, &error.to_string());
                    return true;
                }
            }
        }
    }
}

/// Exponential backoff with full jitter: a random wait in [d/2, d] where d doubles per
/// attempt up to `max`, so that a fleet of agents does not retry in lock-step.
pub fn backoff(attempt: u32, initial: Duration, max: Duration) -> Duration {
    let exponential = initial.saturating_mul(2u32.saturating_pow(attempt.min(20)));
    let ceiling = exponential.min(max);
    ceiling.mul_f64(0.5 + fastrand::f64() * 0.5)
}

/// The dead-letter file of one sink.
struct DeadLetter {
    path: PathBuf,
}

impl DeadLetter {
    fn new(dir: &Path, sink: &str) -> Self {
        DeadLetter {
            path: dir.join(format!("{sink}.jsonl")),
        }
    }

    /// Appends one line per event: `{"sink", "reason", "at", "event"}`. If even that fails,
    /// the event is logged in full so an operator can still recover it from the logs.
    fn write(&self, events: &[Event], reason: &str) {
        let sink = self
            .path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let at = chrono::Utc::now().to_rfc3339();
        let mut lines = Vec::new();
        for event in events {
            let record =
                serde_json::json!({"sink": sink, "reason": reason, "at": at, "event": event});
            lines.extend_from_slice(record.to_string().as_bytes());
            lines.push(b'\n');
        }
        if let Err(error) = sink_file::append(&self.path, &lines, true) {
            let error: SinkError = error;
            tracing::error!(path = %self.path.display(), error = %error, lost = %String::from_utf8_lossy(&lines), "Cannot write the dead-letter file");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cloudevents::{EventBuilder, EventBuilderV10};
    use sink_core::RecordingSink;

    fn event(id: &str) -> Event {
        EventBuilderV10::new()
            .id(id)
            .source("urn:test")
            .ty("t")
            .build()
            .unwrap()
    }

    fn fast_delivery() -> DeliveryConfig {
        DeliveryConfig {
            retry_initial: Duration::from_millis(1),
            retry_max: Duration::from_millis(5),
            ..DeliveryConfig::default()
        }
    }

    fn ids(events: &[Event]) -> Vec<String> {
        events.iter().map(|e| e.id().to_owned()).collect()
    }

    #[test]
    fn backoff_doubles_up_to_the_ceiling_with_jitter() {
        let initial = Duration::from_millis(100);
        let max = Duration::from_secs(1);
        for attempt in 0..30 {
            let wait = backoff(attempt, initial, max);
            let ceiling = (initial * 2u32.pow(attempt.min(10))).min(max);
            assert!(
                wait >= ceiling / 2 && wait <= ceiling,
                "{attempt}: {wait:?}"
            );
        }
    }

    #[tokio::test]
    async fn retriable_failures_are_retried_in_order_until_delivered() {
        let dir = tempfile::tempdir().unwrap();
        let flaky = RecordingSink::new();
        flaky.fail_next((0..3).map(|_| SinkError::Retriable("broker down".into())));
        let healthy = RecordingSink::new();
        let fanout = Fanout::start(
            vec![
                NamedSink {
                    name: "flaky".into(),
                    sink: Box::new(flaky.clone()),
                },
                NamedSink {
                    name: "healthy".into(),
                    sink: Box::new(healthy.clone()),
                },
            ],
            &fast_delivery(),
            dir.path(),
        );
        fanout.publish(&[event("1"), event("2")]);
        fanout.publish(&[event("3")]);
        fanout.shutdown(Duration::from_secs(5)).await;
        assert_eq!(ids(&flaky.delivered()), ["1", "2", "3"]);
        assert_eq!(ids(&healthy.delivered()), ["1", "2", "3"]);
        assert!(flaky.attempts() >= 4);
    }

    #[tokio::test(start_paused = true)]
    async fn a_retry_after_from_the_destination_is_honoured_over_the_backoff() {
        let dir = tempfile::tempdir().unwrap();
        let sink = RecordingSink::new();
        sink.fail_next([SinkError::RetryAfter {
            message: "429".into(),
            after: Duration::from_secs(120),
        }]);
        let fanout = Fanout::start(
            vec![NamedSink {
                name: "hook".into(),
                sink: Box::new(sink.clone()),
            }],
            &fast_delivery(),
            dir.path(),
        );
        fanout.publish(&[event("1")]);
        tokio::time::sleep(Duration::from_secs(119)).await;
        assert!(sink.delivered().is_empty(), "retried before Retry-After");
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(ids(&sink.delivered()), ["1"]);
        fanout.shutdown(Duration::from_secs(1)).await;
    }

    #[tokio::test]
    async fn a_refused_batch_goes_to_the_dead_letter_file_and_delivery_continues() {
        let dir = tempfile::tempdir().unwrap();
        let sink = RecordingSink::new();
        sink.fail_next([SinkError::Permanent("schema rejected".into())]);
        let fanout = Fanout::start(
            vec![NamedSink {
                name: "picky".into(),
                sink: Box::new(sink.clone()),
            }],
            &fast_delivery(),
            dir.path(),
        );
        fanout.publish(&[event("1")]);
        tokio::time::sleep(Duration::from_millis(50)).await;
        fanout.publish(&[event("2")]);
        fanout.shutdown(Duration::from_secs(5)).await;
        assert_eq!(ids(&sink.delivered()), ["2"]);
        let dead = std::fs::read_to_string(dir.path().join("dead-letter/picky.jsonl")).unwrap();
        let record: serde_json::Value = serde_json::from_str(dead.lines().next().unwrap()).unwrap();
        assert_eq!(record["event"]["id"], "1");
        assert!(
            record["reason"]
                .as_str()
                .unwrap()
                .contains("schema rejected")
        );
    }

    #[tokio::test]
    async fn a_sink_that_never_recovers_is_dead_lettered_at_shutdown_and_does_not_block_others() {
        let dir = tempfile::tempdir().unwrap();
        let down = RecordingSink::new();
        down.fail_next((0..10_000).map(|_| SinkError::Retriable("down".into())));
        let healthy = RecordingSink::new();
        let fanout = Fanout::start(
            vec![
                NamedSink {
                    name: "down".into(),
                    sink: Box::new(down.clone()),
                },
                NamedSink {
                    name: "healthy".into(),
                    sink: Box::new(healthy.clone()),
                },
            ],
            &fast_delivery(),
            dir.path(),
        );
        fanout.publish(&[event("1"), event("2")]);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(
            ids(&healthy.delivered()),
            ["1", "2"],
            "the healthy sink is not held back"
        );
        fanout.shutdown(Duration::from_millis(100)).await;
        let dead = std::fs::read_to_string(dir.path().join("dead-letter/down.jsonl")).unwrap();
        assert_eq!(dead.lines().count(), 2);
        assert!(down.delivered().is_empty());
    }

    #[tokio::test]
    async fn a_full_queue_dead_letters_instead_of_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let down = RecordingSink::new();
        down.fail_next((0..10_000).map(|_| SinkError::Retriable("down".into())));
        let delivery = DeliveryConfig {
            queue_capacity: 1,
            batch_size: 1,
            ..fast_delivery()
        };
        let fanout = Fanout::start(
            vec![NamedSink {
                name: "down".into(),
                sink: Box::new(down.clone()),
            }],
            &delivery,
            dir.path(),
        );
        fanout.publish(&[event("1")]);
        tokio::time::sleep(Duration::from_millis(20)).await; // the worker holds "1"
        fanout.publish(&[event("2"), event("3")]); // "2" fills the queue, "3" overflows
        let dead = std::fs::read_to_string(dir.path().join("dead-letter/down.jsonl")).unwrap();
        assert!(
            dead.contains("\"id\":\"3\"") && dead.contains("queue full"),
            "{dead}"
        );
        fanout.shutdown(Duration::from_millis(50)).await;
    }
}
