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
use sched_relay_transport::{Event, Sink};
use serde::{Deserialize, Serialize};
use tokio::sync::{Notify, watch};
use tokio::task::JoinSet;

use crate::store::{Outbox, Placement, Processed, StoreError};
use dead_letter::DeadLetter;
use sched_relay_core::document::Document;
use tail::{Tail, Ticket};
use worker::Worker;

mod dead_letter;
mod heartbeat;
mod settle;
mod tail;
mod worker;

/// The longest `Retry-After` a destination can impose.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(3600);
/// At most this much of the shutdown deadline is kept for making the last removals durable.
const FLUSH_AT_STOP: Duration = Duration::from_millis(200);
/// How long a task waits before reading the outbox again after a store error.
const STORE_RETRY: Duration = Duration::from_secs(1);

/// `[delivery]`: queues, batches and retries of the fan-out, for every sink.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DeliveryConfig {
    #[serde(default = "default_queue_capacity")]
    pub queue_capacity: usize,
    #[serde(default = "default_batch_size")]
    pub batch_size: usize,
    #[serde(default = "default_retry_initial", with = "humantime_serde")]
    pub retry_initial: Duration,
    #[serde(default = "default_retry_max", with = "humantime_serde")]
    pub retry_max: Duration,
    #[serde(default = "default_shutdown_timeout", with = "humantime_serde")]
    pub shutdown_timeout: Duration,
}

impl Default for DeliveryConfig {
    fn default() -> Self {
        DeliveryConfig {
            queue_capacity: default_queue_capacity(),
            batch_size: default_batch_size(),
            retry_initial: default_retry_initial(),
            retry_max: default_retry_max(),
            shutdown_timeout: default_shutdown_timeout(),
        }
    }
}

fn default_queue_capacity() -> usize {
    10_000
}
fn default_batch_size() -> usize {
    100
}
fn default_retry_initial() -> Duration {
    Duration::from_millis(200)
}
fn default_retry_max() -> Duration {
    Duration::from_secs(30)
}
fn default_shutdown_timeout() -> Duration {
    Duration::from_secs(10)
}

impl DeliveryConfig {
    /// Problems, as (key under `delivery`, message).
    pub fn validate(&self) -> Vec<(String, String)> {
        let mut problems: Vec<(String, String)> = Vec::new();
        if self.queue_capacity == 0 {
            problems.push(("queue_capacity".into(), "must be at least 1".into()));
        }
        if self.batch_size == 0 {
            problems.push(("batch_size".into(), "must be at least 1".into()));
        }
        if self.retry_initial.is_zero() || self.retry_max < self.retry_initial {
            problems.push((
                "retry_max".into(),
                "expected 0 < delivery.retry_initial <= delivery.retry_max".into(),
            ));
        }
        problems
    }
}

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
        // Shown on /readyz and /events: credentials in a URL of the error are masked.
        *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = result
            .err()
            .map(|error| sched_relay_transport::redact::text(&error).into_owned());
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
    tails: Arc<[Arc<Tail>]>,
    wakers: Arc<[Arc<Notify>]>,
    dead_letter_dir: PathBuf,
    /// Per sink, the outbox number of the last heartbeat stored for it (see [`heartbeat`]).
    heartbeats: Arc<std::sync::Mutex<Vec<Option<u64>>>>,
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
        let mut tails = Vec::new();
        let mut wakers = Vec::new();
        let mut health = Vec::new();
        for NamedSink { name, sink } in sinks {
            let wake = Arc::new(Notify::new());
            let tail = Arc::new(Tail::default());
            let status = Arc::new(SinkHealth::default());
            health.push((name.clone(), status.clone()));
            let worker = Worker {
                health: status,
                dead_letter: DeadLetter::new(&dead_letter_dir, &name),
                name: name.clone(),
                sink,
                outbox: outbox.clone(),
                tail: tail.clone(),
                wake: wake.clone(),
                delivery: delivery.clone(),
                mode: mode_rx.clone(),
                cursor: 0,
                removed_below: 0,
                removed_in: outbox.generation(),
                volatile_since: None,
                read_back: false,
            };
            tasks.spawn(worker.run());
            names.push(name);
            tails.push(tail);
            wakers.push(wake);
        }
        Fanout {
            publisher: Publisher {
                outbox: outbox.clone(),
                names: names.clone().into(),
                tails: tails.into(),
                wakers: wakers.into(),
                dead_letter_dir,
                heartbeats: Arc::new(std::sync::Mutex::new(vec![None; names.len()])),
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
        document: Option<ProcessedDocument>,
    ) -> Result<(), StoreError> {
        self.publisher.publish(events, document).await
    }

    /// See [`Publisher::publish_shared`].
    pub async fn publish_shared(
        &self,
        events: Arc<[Event]>,
        document: Option<ProcessedDocument>,
    ) -> Result<(), StoreError> {
        self.publisher.publish_shared(events, document).await
    }

    /// Lets every sink deliver what is stored for at most `timeout`, then stops them. What is
    /// still undelivered stays in the outbox and goes out after the next start.
    pub async fn shutdown(self, timeout: Duration) {
        self.shutdown_by(tokio::time::Instant::now() + timeout)
            .await;
    }

    /// Lets every sink deliver what is stored until `deadline`, then stops them at once: a
    /// task still inside a delivery (a broker that hangs) is aborted, not waited for, so the
    /// agent exits within its stop timeout. Nothing is lost: an event leaves the outbox only
    /// once its sink confirmed it.
    pub async fn shutdown_by(mut self, deadline: tokio::time::Instant) {
        let _ = self.mode.send(Mode::Drain);
        // The last slice of the time is kept for making the last removals durable.
        let now = tokio::time::Instant::now();
        let reserve = FLUSH_AT_STOP.min(deadline.saturating_duration_since(now) / 2);
        let drained = tokio::time::timeout_at(deadline - reserve, async {
            while self.tasks.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            let _ = self.mode.send(Mode::Stop);
            self.tasks.abort_all();
            while self.tasks.join_next().await.is_some() {}
            for name in &self.names {
                let depth = self.outbox.depth(name).unwrap_or_default();
                if depth > 0 {
                    tracing::warn!(sink = %name, undelivered = depth, "Sink not drained in time; its events stay in the outbox for the next start");
                }
            }
        }
        // What the tasks removed last becomes durable, so the next start does not deliver it
        // again (within the deadline: a disk that hangs is not waited for).
        let outbox = self.outbox.clone();
        let flushed = tokio::task::spawn_blocking(move || outbox.flush());
        if let Ok(Ok(Err(error))) = tokio::time::timeout_at(deadline, flushed).await {
            tracing::debug!(error = %error, "Cannot make the last removals durable; their events are delivered again after the restart");
        }
    }
}

/// The document a commit stores as the last processed one, with its incarnation epoch:
/// shared with the poller, not copied (a document of a thousand events is megabytes in
/// memory; `benches/profiling.md`, section 18).
#[derive(Debug, Clone)]
pub struct ProcessedDocument {
    pub document: Arc<Document>,
    pub epoch: u64,
}

impl Publisher {
    /// The durable store the publisher writes to.
    pub fn outbox(&self) -> &Arc<Outbox> {
        &self.outbox
    }

    /// Stores events for every sink (with the document they came from and its epoch, which
    /// is then processed) durably, and hands them to the sinks (see [`tail`]): as soon as
    /// they are numbered, while the commit is written; a sink sends them once the commit is
    /// durable. Never waits for a sink. When this
    /// returns an error the caller must not treat the document as processed and must publish
    /// its events again, with the same ids (a failed fsync may still have stored them: then
    /// they are delivered twice, with the same ids).
    pub async fn publish(
        &self,
        events: &[Event],
        document: Option<ProcessedDocument>,
    ) -> Result<(), StoreError> {
        self.publish_shared(events.into(), document).await
    }

    /// As [`Publisher::publish`], with events the caller shares rather than lends: they reach
    /// the sinks without a copy (a thousand events' copy was a quarter of a burst's handling
    /// before the first sink had one; `benches/profiling.md`, section 11).
    pub async fn publish_shared(
        &self,
        events: Arc<[Event]>,
        document: Option<ProcessedDocument>,
    ) -> Result<(), StoreError> {
        let publisher = self.clone();
        // The commit and the dead-letter writes of what did not fit both fsync: off the
        // async threads.
        tokio::task::spawn_blocking(move || {
            let every: Vec<usize> = (0..publisher.names.len()).collect();
            publisher
                .store(&events, document.as_ref(), &every, Overflow::DeadLetter)
                .map(drop)
        })
        .await
        .map_err(|e| StoreError::Io {
            path: "outbox".into(),
            reason: format!("store task failed: {e}"),
        })??;
        // Sinks that are behind read the outbox: now it holds these too.
        for wake in self.wakers.iter() {
            wake.notify_one();
        }
        Ok(())
    }

    /// Stores `events` (with `document`, then processed) for the sinks numbered `targets`,
    /// in one durable commit, and hands them to those sinks' tails meanwhile; returns where
    /// each target's events went, by the sink's index in the fan-out. Blocking (it fsyncs).
    fn store(
        &self,
        events: &Arc<[Event]>,
        document: Option<&ProcessedDocument>,
        targets: &[usize],
        overflow: Overflow,
    ) -> Result<Vec<Placement>, StoreError> {
        let document = document.map(|processed| Processed {
            document: &processed.document.raw,
            epoch: processed.epoch,
        });
        // `targets` are distinct indices in order: all of them are the fan-out's own list.
        let subset: Vec<String>;
        let names: &[String] = if targets.len() == self.names.len() {
            &self.names
        } else {
            subset = targets.iter().map(|&i| self.names[i].clone()).collect();
            &subset
        };
        let ticket = Ticket::new();
        let _settled = tail::SettledAtDrop(ticket.clone());
        let began = std::time::Instant::now();
        let mut placed = Vec::with_capacity(targets.len());
        let committed = self
            .outbox
            .commit_placing(names, events, document, |placements| {
                placed.extend(placements.iter().map(|placement| Placement {
                    sink: targets[placement.sink],
                    ..*placement
                }));
                // While the store cannot be written, its commits are expected to fail:
                // nothing is handed over (one that succeeds wakes the sinks below, and
                // they read it back from the outbox).
                if self.outbox.unwritable().is_some() {
                    return;
                }
                for placement in &placed {
                    self.tails[placement.sink].push(
                        placement.first_seq,
                        events,
                        placement.stored,
                        &ticket,
                    );
                    self.wakers[placement.sink].notify_one();
                }
            });
        ticket.settle(committed.is_ok());
        if committed.is_ok() {
            // The fsync every sink waits for: on a slow disk, the agent's own latency.
            let took = began.elapsed();
            metrics::histogram!("sched_relay_state_store_commit_seconds")
                .record(took.as_secs_f64());
            tracing::debug!(
                events = events.len(),
                commit_us = took.as_micros() as u64,
                "Stored"
            );
        }
        let full = match committed {
            Ok(full) => full,
            Err(error) => {
                for tail in self.tails.iter() {
                    tail.discard(&ticket);
                }
                return Err(error);
            }
        };
        if overflow == Overflow::DeadLetter {
            for (sink, event) in full {
                let reason =
                    "outbox full for this sink (raise delivery.queue_capacity or fix the sink)";
                tracing::error!(sink = %sink, event_id = %event.id(), reason, "Event not stored for this sink, written to its dead-letter file");
                metrics::counter!("sched_relay_sink_dead_lettered_total", "sink" => sink.clone())
                    .increment(1);
                DeadLetter::new(&self.dead_letter_dir, &sink)
                    .write(std::slice::from_ref(&event), reason);
            }
        }
        Ok(placed)
    }
}

/// What becomes of events a sink's full queue cannot take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Overflow {
    /// Written to the sink's dead-letter file, with an ERROR: a transition is never dropped.
    DeadLetter,
    /// Left out for that sink: the next heartbeat says the same, newer.
    Skip,
}

/// Appends entries (events, or what could not be read of them) to `sink`'s dead-letter file
/// under `state_dir`, fsync'd, in the usual format; returns the file's path.
pub fn dead_letter(
    state_dir: &Path,
    sink: &str,
    entries: &[Result<Event, String>],
    reason: &str,
) -> Result<PathBuf, sched_relay_transport::SinkError> {
    let file = DeadLetter::new(&state_dir.join("dead-letter"), sink);
    file.try_write(entries, reason)?;
    Ok(file.path)
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_handover;
