//! Fan-out: every event goes to every sink through the durable outbox (see `store`). Each sink
//! has its own task that reads its part of the outbox in order, delivers in batches, and
//! removes events only once the sink confirmed them, so a slow or broken sink never delays
//! the others and a crash or restart loses nothing. Retriable failures are retried with
//! exponential backoff and full jitter (or the wait the destination asked for); what can never
//! be delivered goes to a dead-letter file (`<state.dir>/dead-letter/<sink>.jsonl`) with the
//! reason.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use cloudevents::AttributesReader;
use sched_relay_transport::{Event, Sink, SinkError};
use serde_json::Value;
use tokio::sync::{Notify, watch};
use tokio::task::JoinSet;

use crate::config::DeliveryConfig;
use crate::store::{Outbox, StoreError};

/// The longest `Retry-After` a destination can impose.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(3600);
/// How long a task waits before reading the outbox again after a store error.
const STORE_RETRY: Duration = Duration::from_secs(1);

/// A sink with its name, ready to be driven by the fan-out.
pub struct NamedSink {
    pub name: String,
    pub sink: Box<dyn Sink>,
}

/// What the delivery tasks are asked to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Deliver, and wait for more.
    Run,
    /// Deliver what is stored, then stop.
    Drain,
    /// Stop now; what is undelivered stays in the outbox for the next start.
    Stop,
}

/// What a sink's task last learned about its destination, for `/readyz` and `/events`.
#[derive(Debug, Default)]
pub struct SinkHealth {
    healthy: std::sync::atomic::AtomicBool,
    last_error: std::sync::Mutex<Option<String>>,
}

impl SinkHealth {
    fn set(&self, sink: &str, result: Result<(), String>) {
        let healthy = result.is_ok();
        self.healthy
            .store(healthy, std::sync::atomic::Ordering::Relaxed);
        *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = result.err();
        metrics::gauge!("sched_relay_sink_up", "sink" => sink.to_owned()).set(if healthy {
            1.0
        } else {
            0.0
        });
    }

    /// Whether the last health check or delivery succeeded.
    pub fn healthy(&self) -> bool {
        self.healthy.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The error of the last failed check or delivery, while it has not succeeded since.
    pub fn last_error(&self) -> Option<String> {
        self.last_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// The running fan-out.
pub struct Fanout {
    publisher: Publisher,
    health: Vec<(String, Arc<SinkHealth>)>,
    outbox: Arc<Outbox>,
    names: Vec<String>,
    mode: watch::Sender<Mode>,
    tasks: JoinSet<()>,
}

/// Stores events for every sink and wakes their tasks; cheap to clone, so the poller and
/// the approval handler can both publish.
#[derive(Clone)]
pub struct Publisher {
    outbox: Arc<Outbox>,
    names: Arc<[String]>,
    wakers: Arc<[Arc<Notify>]>,
    dead_letter_dir: PathBuf,
}

impl Fanout {
    /// Starts one delivery task per sink. Events already in the outbox (from before a
    /// restart) are delivered first.
    pub fn start(
        sinks: Vec<NamedSink>,
        delivery: &DeliveryConfig,
        state_dir: &Path,
        outbox: Arc<Outbox>,
    ) -> Fanout {
        let dead_letter_dir = state_dir.join("dead-letter");
        let (mode, mode_rx) = watch::channel(Mode::Run);
        let mut tasks = JoinSet::new();
        let mut names = Vec::new();
        let mut wakers = Vec::new();
        let mut health = Vec::new();
        for NamedSink { name, sink } in sinks {
            let wake = Arc::new(Notify::new());
            let status = Arc::new(SinkHealth::default());
            health.push((name.clone(), status.clone()));
            let worker = Worker {
                health: status,
                dead_letter: DeadLetter::new(&dead_letter_dir, &name),
                name: name.clone(),
                sink,
                outbox: outbox.clone(),
                wake: wake.clone(),
                delivery: delivery.clone(),
                mode: mode_rx.clone(),
            };
            tasks.spawn(worker.run());
            names.push(name);
            wakers.push(wake);
        }
        Fanout {
            publisher: Publisher {
                outbox: outbox.clone(),
                names: names.clone().into(),
                wakers: wakers.into(),
                dead_letter_dir,
            },
            health,
            outbox,
            names,
            mode,
            tasks,
        }
    }

    /// Each sink's name and health, in configuration order.
    pub fn health(&self) -> Vec<(String, Arc<SinkHealth>)> {
        self.health.clone()
    }

    /// A handle that publishes into this fan-out.
    pub fn publisher(&self) -> Publisher {
        self.publisher.clone()
    }

    /// See [`Publisher::publish`].
    pub async fn publish(
        &self,
        events: &[Event],
        document: Option<&Value>,
    ) -> Result<(), StoreError> {
        self.publisher.publish(events, document).await
    }

    /// Lets every sink deliver what is stored for at most `timeout`, then stops them. What is
    /// still undelivered stays in the outbox and goes out after the next start.
    pub async fn shutdown(mut self, timeout: Duration) {
        let _ = self.mode.send(Mode::Drain);
        let drained = tokio::time::timeout(timeout, async {
            while self.tasks.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            let _ = self.mode.send(Mode::Stop);
            while self.tasks.join_next().await.is_some() {}
            for name in &self.names {
                let depth = self.outbox.depth(name).unwrap_or_default();
                if depth > 0 {
                    tracing::warn!(sink = %name, undelivered = depth, "Sink not drained in time; its events stay in the outbox for the next start");
                }
            }
        }
    }
}

impl Publisher {
    /// Stores events for every sink (with the document they came from, which is then
    /// processed) durably, and wakes the sinks. Never waits for a sink. When this returns an
    /// error nothing was stored: the caller must not treat the document as processed.
    pub async fn publish(
        &self,
        events: &[Event],
        document: Option<&Value>,
    ) -> Result<(), StoreError> {
        let outbox = self.outbox.clone();
        let names = self.names.to_vec();
        let events_owned = events.to_vec();
        let document = document.cloned();
        let overflow = tokio::task::spawn_blocking(move || {
            outbox.commit(&names, &events_owned, document.as_ref())
        })
        .await
        .map_err(|e| StoreError::Io {
            path: "outbox".into(),
            reason: format!("store task failed: {e}"),
        })??;
        for (sink, event) in overflow {
            let reason =
                "outbox full for this sink (raise delivery.queue_capacity or fix the sink)";
            tracing::error!(sink = %sink, event_id = %event.id(), reason, "Event not stored for this sink, written to its dead-letter file");
            metrics::counter!("sched_relay_sink_dead_lettered_total", "sink" => sink.clone())
                .increment(1);
            DeadLetter::new(&self.dead_letter_dir, &sink)
                .write(std::slice::from_ref(&event), reason);
        }
        for wake in self.wakers.iter() {
            wake.notify_one();
        }
        Ok(())
    }
}

struct Worker {
    name: String,
    sink: Box<dyn Sink>,
    outbox: Arc<Outbox>,
    wake: Arc<Notify>,
    delivery: DeliveryConfig,
    dead_letter: DeadLetter,
    mode: watch::Receiver<Mode>,
    health: Arc<SinkHealth>,
}

impl Worker {
    async fn run(mut self) {
        // Checked here, concurrently with the other sinks and with polling. A failed check is
        // reported, and delivery is tried all the same: the retry rules decide.
        let checked = tokio::select! {
            result = self.sink.health_check() => Some(result),
            _ = self.stopped() => None,
        };
        if let Some(result) = &checked {
            self.health.set(
                &self.name,
                result.as_ref().map_err(|e| e.to_string()).copied(),
            );
        }
        match checked {
            Some(Ok(())) => tracing::info!(sink = %self.name, "Sink ready"),
            Some(Err(error)) => {
                tracing::error!(sink = %self.name, error = %error, "Sink health check failed; its events will be retried or dead-lettered")
            }
            None => return,
        }
        loop {
            if *self.mode.borrow() == Mode::Stop {
                return;
            }
            // Register for a wake-up before reading, so an event stored in between is not missed.
            let wake = self.wake.clone();
            let woken = wake.notified();
            let pending = match self.read().await {
                Ok(pending) => pending,
                Err(error) => {
                    tracing::error!(sink = %self.name, error = %error, "Cannot read the outbox; will try again");
                    tokio::select! {
                        _ = tokio::time::sleep(STORE_RETRY) => continue,
                        _ = self.stopped() => return,
                    }
                }
            };
            if pending.is_empty() {
                if *self.mode.borrow() == Mode::Drain {
                    return;
                }
                let mut mode = self.mode.clone();
                tokio::select! {
                    _ = woken => {}
                    _ = mode.changed() => {}
                }
                continue;
            }
            let mut batch = Vec::with_capacity(pending.len());
            let mut seqs = Vec::with_capacity(pending.len());
            for stored in pending {
                match stored.event {
                    Ok(event) => {
                        batch.push(event);
                        seqs.push(stored.seq);
                    }
                    Err(reason) => {
                        tracing::error!(sink = %self.name, seq = stored.seq, reason = %reason, "An unreadable event in the outbox; dropped from it and logged here in full");
                        self.forget(&[stored.seq]).await;
                    }
                }
            }
            if batch.is_empty() {
                continue;
            }
            if !self.deliver(&batch).await {
                return; // stopped: the batch stays in the outbox
            }
            self.forget(&seqs).await;
        }
    }

    async fn read(&self) -> Result<Vec<crate::store::Stored>, StoreError> {
        let outbox = self.outbox.clone();
        let name = self.name.clone();
        let max = self.delivery.batch_size;
        tokio::task::spawn_blocking(move || outbox.pending(&name, max))
            .await
            .map_err(|e| StoreError::Io {
                path: "outbox".into(),
                reason: format!("store task failed: {e}"),
            })?
    }

    /// Removes delivered (or dead-lettered) events. If that fails they are delivered again
    /// later: at least once, with the same ids.
    async fn forget(&self, seqs: &[u64]) {
        let outbox = self.outbox.clone();
        let name = self.name.clone();
        let seqs = seqs.to_vec();
        let removed = tokio::task::spawn_blocking(move || outbox.remove(&name, &seqs)).await;
        if let Ok(Err(error)) | Err(error) = removed.map_err(|e| StoreError::Io {
            path: "outbox".into(),
            reason: e.to_string(),
        }) {
            tracing::error!(sink = %self.name, error = %error, "Cannot remove delivered events from the outbox; they will be sent again");
        }
    }

    /// Completes when the fan-out is told to stop now.
    fn stopped(&self) -> impl std::future::Future<Output = ()> + 'static {
        let mut mode = self.mode.clone();
        async move {
            while *mode.borrow_and_update() != Mode::Stop {
                if mode.changed().await.is_err() {
                    return;
                }
            }
        }
    }

    /// Delivers one batch, retrying while retrying can help. Returns false when told to stop
    /// before the batch was delivered or dead-lettered.
    async fn deliver(&mut self, batch: &[Event]) -> bool {
        let mut attempt: u32 = 0;
        loop {
            // At the shutdown deadline an attempt in flight is abandoned; the batch stays in
            // the outbox (it may also have arrived: at least once).
            let result = tokio::select! {
                result = self.sink.deliver(batch) => result,
                _ = self.stopped() => return false,
            };
            self.health.set(
                &self.name,
                result.as_ref().map_err(|e| e.to_string()).copied(),
            );
            if result.is_err() {
                metrics::counter!("sched_relay_sink_failed_total", "sink" => self.name.clone())
                    .increment(1);
            }
            match result {
                Ok(()) => {
                    metrics::counter!("sched_relay_sink_delivered_total", "sink" => self.name.clone())
                        .increment(batch.len() as u64);
                    if attempt > 0 {
                        tracing::info!(sink = %self.name, attempts = attempt + 1, "Sink recovered, batch delivered");
                    }
                    // The agent's own part of the latency: from the document's arrival (the
                    // event's `time`) to the destination's confirmation.
                    let now = chrono::Utc::now();
                    for event in batch {
                        let latency = event
                            .time()
                            .map(|observed| {
                                (now - *observed).num_microseconds().unwrap_or(i64::MAX)
                            })
                            .unwrap_or_default();
                        metrics::histogram!("sched_relay_sink_delivery_latency_seconds", "sink" => self.name.clone())
                            .record(latency as f64 / 1e6);
                        tracing::debug!(sink = %self.name, event_id = %event.id(), latency_us = latency, "Delivered");
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
                        _ = self.stopped() => return false,
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
        if let Err(error) = sched_relay_file::append(&self.path, &lines, true) {
            let error: SinkError = error;
            tracing::error!(path = %self.path.display(), error = %error, lost = %String::from_utf8_lossy(&lines), "Cannot write the dead-letter file");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cloudevents::{EventBuilder, EventBuilderV10};
    use sched_relay_transport::RecordingSink;

    fn event(id: &str) -> Event {
        EventBuilderV10::new()
            .id(id)
            .source("urn:test")
            .ty("t")
            .build()
            .unwrap()
            .into()
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

    fn start(dir: &Path, sinks: Vec<(&str, RecordingSink)>, delivery: &DeliveryConfig) -> Fanout {
        let outbox = Arc::new(Outbox::open(dir, delivery.queue_capacity, false).unwrap());
        let sinks = sinks
            .into_iter()
            .map(|(name, sink)| NamedSink {
                name: name.into(),
                sink: Box::new(sink),
            })
            .collect();
        Fanout::start(sinks, delivery, dir, outbox)
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
        let fanout = start(
            dir.path(),
            vec![("flaky", flaky.clone()), ("healthy", healthy.clone())],
            &fast_delivery(),
        );
        fanout
            .publish(&[event("1"), event("2")], None)
            .await
            .unwrap();
        fanout.publish(&[event("3")], None).await.unwrap();
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
        let fanout = start(dir.path(), vec![("hook", sink.clone())], &fast_delivery());
        fanout.publish(&[event("1")], None).await.unwrap();
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
        let fanout = start(dir.path(), vec![("picky", sink.clone())], &fast_delivery());
        fanout.publish(&[event("1")], None).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        fanout.publish(&[event("2")], None).await.unwrap();
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
    async fn what_a_dead_sink_could_not_take_is_kept_and_delivered_after_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let down = RecordingSink::new();
        down.fail_next((0..10_000).map(|_| SinkError::Retriable("down".into())));
        let healthy = RecordingSink::new();
        let fanout = start(
            dir.path(),
            vec![("down", down.clone()), ("healthy", healthy.clone())],
            &fast_delivery(),
        );
        fanout
            .publish(&[event("1"), event("2")], None)
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(
            ids(&healthy.delivered()),
            ["1", "2"],
            "the healthy sink is not held back"
        );
        fanout.shutdown(Duration::from_millis(100)).await;
        assert!(down.delivered().is_empty());
        assert!(
            !dir.path().join("dead-letter/down.jsonl").exists(),
            "kept, not dead-lettered"
        );

        // The next start: the sink is back, and gets what it missed, in order; the healthy
        // sink gets nothing twice.
        let back = RecordingSink::new();
        let healthy_again = RecordingSink::new();
        let fanout = start(
            dir.path(),
            vec![("down", back.clone()), ("healthy", healthy_again.clone())],
            &fast_delivery(),
        );
        fanout.shutdown(Duration::from_secs(5)).await;
        assert_eq!(ids(&back.delivered()), ["1", "2"]);
        assert!(healthy_again.delivered().is_empty());
    }

    #[tokio::test]
    async fn a_full_outbox_dead_letters_instead_of_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let down = RecordingSink::new();
        down.fail_next((0..10_000).map(|_| SinkError::Retriable("down".into())));
        let delivery = DeliveryConfig {
            queue_capacity: 2,
            batch_size: 1,
            ..fast_delivery()
        };
        let fanout = start(dir.path(), vec![("down", down.clone())], &delivery);
        fanout
            .publish(&[event("1"), event("2"), event("3")], None)
            .await
            .unwrap();
        let dead = std::fs::read_to_string(dir.path().join("dead-letter/down.jsonl")).unwrap();
        assert!(
            dead.contains("\"id\":\"3\"") && dead.contains("outbox full"),
            "{dead}"
        );
        assert!(!dead.contains("\"id\":\"1\""));
        fanout.shutdown(Duration::from_millis(50)).await;
    }
}
