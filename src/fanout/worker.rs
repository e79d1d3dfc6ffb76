//! One sink's delivery task: delivers the sink's events in order, in batches, from its tail
//! in memory when it is caught up and from the outbox when it is behind (after an outage, a
//! restart); retries what may succeed later, dead-letters what never will, and removes events
//! from the outbox only once the sink confirmed them and their commit is durable.
//!
//! Removals are not fsync'd one by one: the task makes them durable when it has nothing left
//! to deliver, and at least every [`FLUSH_EVERY`] while it drains a backlog. A crash in
//! between delivers those events once more (at least once), where an fsync per batch would cap
//! a backlog's drain at the disk's fsync rate.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cloudevents::AttributesReader;
use sched_relay_transport::{Event, Sink, SinkError};
use tokio::sync::{Notify, watch};

use super::dead_letter::DeadLetter;
use super::tail::{Next, Tail};
use super::{DeliveryConfig, MAX_RETRY_AFTER, Mode, STORE_RETRY, SinkHealth};
use crate::retry::Backoff;
use crate::store::{Outbox, StoreError};

/// The longest a drain goes on with removals that are not durable yet.
const FLUSH_EVERY: Duration = Duration::from_secs(1);

pub(super) struct Worker {
    pub(super) name: String,
    pub(super) sink: Box<dyn Sink>,
    pub(super) outbox: Arc<Outbox>,
    pub(super) tail: Arc<Tail>,
    pub(super) wake: Arc<Notify>,
    pub(super) delivery: DeliveryConfig,
    pub(super) dead_letter: DeadLetter,
    pub(super) mode: watch::Receiver<Mode>,
    pub(super) health: Arc<SinkHealth>,
    /// The first outbox number this task has not delivered (nor dead-lettered).
    pub(super) cursor: u64,
    /// Everything below this number has left the outbox (in the store generation
    /// `removed_in`: a reopen brings back what was not durable yet).
    pub(super) removed_below: u64,
    pub(super) removed_in: u64,
    /// Since when removals are not durable.
    pub(super) volatile_since: Option<Instant>,
    /// Events were read back from the outbox since the task last had nothing to deliver.
    pub(super) read_back: bool,
}

/// A batch of one sink's events and their outbox numbers.
struct Batch {
    events: Events,
    seqs: Vec<u64>,
}

enum Events {
    Memory(Arc<[Event]>, std::ops::Range<usize>),
    Read(Vec<Event>),
}

impl Batch {
    fn events(&self) -> &[Event] {
        match &self.events {
            Events::Memory(events, range) => &events[range.clone()],
            Events::Read(events) => events,
        }
    }
}

impl Worker {
    pub(super) async fn run(mut self) {
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
                if error.is_authentication() {
                    metrics::counter!("sched_relay_sink_authentication_failed_total", "sink" => self.name.clone()).increment(1);
                }
                tracing::error!(sink = %self.name, error = %error, "Sink health check failed; its events will be retried or dead-lettered")
            }
            None => return,
        }
        loop {
            if *self.mode.borrow() == Mode::Stop {
                return;
            }
            // Delivered (or dead-lettered), and its commit durable: it leaves the outbox. If the
            // store fails, before anything else is read, while the cursor keeps it from being
            // delivered again (a restart meanwhile delivers it once more: at least once).
            if !self.remove_passed().await {
                tokio::select! {
                    _ = tokio::time::sleep(STORE_RETRY) => continue,
                    _ = self.stopped() => return,
                }
            }
            // Register for a wake-up before reading, so an event stored in between is not missed.
            let wake = self.wake.clone();
            let woken = wake.notified();
            tokio::pin!(woken);
            let batch = match self.next_batch().await {
                Ok(batch) => batch,
                Err(error) => {
                    // A store that cannot be written has said so once (at ERROR) and is in
                    // /readyz; its reads fail too until it is reopened.
                    if self.outbox.unwritable().is_some() {
                        tracing::debug!(sink = %self.name, error = %error, "Cannot read the outbox while the state store recovers; will try again");
                    } else {
                        tracing::error!(sink = %self.name, error = %error, "Cannot read the outbox; will try again");
                    }
                    tokio::select! {
                        _ = tokio::time::sleep(STORE_RETRY) => continue,
                        _ = self.stopped() => return,
                    }
                }
            };
            let Some(batch) = batch else {
                // Nothing left: what was delivered leaves the outbox, durably, now rather than
                // at the next document (a commit that hangs is given up at a stop).
                let stopped = self.stopped();
                let removed = tokio::select! {
                    removed = self.remove_passed() => removed,
                    _ = stopped => return,
                };
                if !removed {
                    continue;
                }
                self.flush().await;
                if std::mem::take(&mut self.read_back) {
                    // A backlog is drained: what reading it back left free in malloc's
                    // arenas goes back to the kernel now, rather than stay with the agent
                    // for as long as it idles.
                    let _ = tokio::task::spawn_blocking(|| crate::arenas::give_back(true)).await;
                }
                if *self.mode.borrow() == Mode::Drain {
                    // Events stored while the read ran (just before the drain began) woke
                    // us: drain them too rather than leave them for the next start.
                    if woken.as_mut().enable() {
                        continue;
                    }
                    return;
                }
                let mut mode = self.mode.clone();
                tokio::select! {
                    _ = woken => {}
                    _ = mode.changed() => {}
                }
                continue;
            };
            if !self.deliver(&batch).await {
                return; // stopped: the unconfirmed rest stays in the outbox
            }
            if self
                .volatile_since
                .is_some_and(|since| since.elapsed() >= FLUSH_EVERY)
            {
                self.flush().await;
            }
        }
    }

    /// The next events to deliver, from the tail when they are there, else from the outbox;
    /// `None` when there is nothing to deliver.
    async fn next_batch(&mut self) -> Result<Option<Batch>, StoreError> {
        let max = self.delivery.batch_size;
        loop {
            let until = match self.tail.next(self.cursor, max) {
                Next::Memory(fresh) => {
                    // Nothing goes out before the commit that stored it is durable: a crash
                    // in between would leave the sink with transitions of a document the
                    // agent never processed, and the next start would derive others from a
                    // later one (a Freeze reported started, then cancelled: it completed).
                    if !fresh.ticket.is_settled() {
                        tokio::select! {
                            _ = fresh.ticket.durable() => {}
                            _ = self.stopped() => return Ok(None),
                        }
                    }
                    if !fresh.ticket.is_durable() {
                        // Stored nowhere: the poller stores the events again, with new numbers.
                        self.tail.discard(&fresh.ticket);
                        continue;
                    }
                    let seqs = (fresh.first_seq..).take(fresh.range.len()).collect();
                    return Ok(Some(Batch {
                        events: Events::Memory(fresh.events, fresh.range),
                        seqs,
                    }));
                }
                Next::Outbox { until } => until,
            };
            let outbox = self.outbox.clone();
            let name = self.name.clone();
            let from = self.cursor;
            let stored = tokio::task::spawn_blocking(move || {
                let stored = outbox.pending_between(&name, from, until, max);
                if stored.as_ref().is_ok_and(|stored| !stored.is_empty()) {
                    // A backlog read back: what the batches before this one freed (decoded
                    // events, the store's pages) goes back to the kernel now and then.
                    crate::arenas::give_back(false);
                }
                stored
            })
            .await
            .map_err(|e| StoreError::Io {
                path: "outbox".into(),
                reason: format!("store task failed: {e}"),
            })??;
            if stored.is_empty() {
                match until {
                    // Nothing is stored before the tail begins (a failed commit's gap).
                    Some(first) => {
                        if self.removed() {
                            self.removed_below = first;
                        }
                        self.cursor = first;
                        continue;
                    }
                    None => return Ok(None),
                }
            }
            let mut events = Vec::with_capacity(stored.len());
            let mut seqs = Vec::with_capacity(stored.len());
            for stored in stored {
                match stored.event {
                    Ok(event) => {
                        events.push(event);
                        seqs.push(stored.seq);
                    }
                    // An unreadable event ends the batch before it; first in one, it is logged
                    // whole and passed (it leaves the outbox with the next removal).
                    Err(_) if !events.is_empty() => break,
                    Err(reason) => {
                        tracing::error!(sink = %self.name, seq = stored.seq, reason = %reason, "An unreadable event in the outbox; dropped from it and logged here in full");
                        self.cursor = stored.seq + 1;
                    }
                }
            }
            if !events.is_empty() {
                self.read_back = true;
                return Ok(Some(Batch {
                    events: Events::Read(events),
                    seqs,
                }));
            }
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

    /// Delivers one batch, retrying while retrying can help, and passes each event (see
    /// [`Worker::passed`]) as soon as the sink confirmed it or it was dead-lettered, so a
    /// retry never sends a confirmed event again. An event the sink refuses for good is
    /// dead-lettered alone and the rest goes on, in order; a refusal of the rest as a whole
    /// (one request for the batch) is retried event by event first. Returns false when told
    /// to stop before the whole batch was settled.
    async fn deliver(&mut self, whole: &Batch) -> bool {
        let (batch, seqs) = (whole.events(), &whole.seqs);
        let mut attempt: u32 = 0;
        let mut start = 0;
        let mut one_by_one = false;
        while start < batch.len() {
            let end = if one_by_one { start + 1 } else { batch.len() };
            let part = &batch[start..end];
            // At the shutdown deadline an attempt in flight is abandoned; its events stay in
            // the outbox (they may also have arrived: at least once).
            let result = tokio::select! {
                result = self.sink.deliver(part) => result,
                _ = self.stopped() => return false,
            };
            self.health.set(
                &self.name,
                result.as_ref().map_err(|e| e.to_string()).copied(),
            );
            let error = match result {
                Ok(()) => {
                    if attempt > 0 {
                        tracing::info!(sink = %self.name, attempts = attempt + 1, "Sink recovered, batch delivered");
                    }
                    self.confirmed(part);
                    self.passed(seqs[end - 1] + 1).await;
                    start = end;
                    attempt = 0;
                    continue;
                }
                Err(error) => error,
            };
            metrics::counter!("sched_relay_sink_failed_total", "sink" => self.name.clone())
                .increment(1);
            let confirmed = error.confirmed.min(part.len());
            if confirmed > 0 {
                self.confirmed(&part[..confirmed]);
                self.passed(seqs[start + confirmed - 1] + 1).await;
                start += confirmed;
                attempt = 0;
            }
            let rest = end - start;
            if rest == 0 {
                continue; // a sink that confirmed everything and still failed: nothing left
            }
            if error.is_retriable() {
                // A destination that says when to come back is believed, within an hour.
                let wait = error
                    .retry_after()
                    .map(|after| after.min(MAX_RETRY_AFTER))
                    .unwrap_or_else(|| {
                        Backoff::new(self.delivery.retry_initial, self.delivery.retry_max)
                            .jittered(attempt)
                    });
                metrics::counter!("sched_relay_sink_retried_total", "sink" => self.name.clone())
                    .increment(1);
                if error.error.is_authentication() {
                    // Retried, since a rotation is fixed on the server's side, but an operator
                    // must know: nothing reaches this sink until then.
                    metrics::counter!("sched_relay_sink_authentication_failed_total", "sink" => self.name.clone()).increment(1);
                    tracing::error!(sink = %self.name, attempt = attempt + 1, retry_in = ?wait, error = %error, "The destination refused the sink's credentials or permissions; will retry");
                } else {
                    tracing::warn!(sink = %self.name, attempt = attempt + 1, retry_in = ?wait, error = %error, "Delivery failed, will retry");
                }
                attempt = attempt.saturating_add(1);
                // What was confirmed leaves the outbox before the wait, not after the batch.
                let stopped = self.stopped();
                tokio::select! {
                    _ = async {
                        self.remove_passed().await;
                        tokio::time::sleep(wait).await;
                    } => {}
                    _ = stopped => return false,
                }
            } else if error.names_event || rest == 1 {
                let refused = batch[start].clone();
                let event_id = refused.id().to_owned();
                // The event leaves the outbox only once its dead letter is on disk (fsync'd,
                // off the async threads): on a full disk it waits there, not nowhere.
                let reason = error.to_string();
                let mut said = false;
                // What was confirmed before it leaves the outbox now, whatever the dead
                // letter's write does.
                let stopped = self.stopped();
                tokio::select! {
                    _ = self.remove_passed() => {}
                    _ = stopped => return false,
                }
                loop {
                    let file = self.dead_letter.clone();
                    let (refused, reason) = (refused.clone(), reason.clone());
                    let written = tokio::task::spawn_blocking(move || {
                        file.try_write(&[Ok(refused)], &reason)
                    })
                    .await
                    .unwrap_or_else(|panic| Err(SinkError::Retriable(panic.to_string())));
                    let Err(write_error) = written else { break };
                    if !said {
                        said = true;
                        tracing::error!(sink = %self.name, event_id = %event_id, path = %self.dead_letter.path.display(), error = %write_error, "Cannot write the dead-letter file; the refused event stays in the outbox and the write is tried again every second");
                    }
                    tokio::select! {
                        _ = tokio::time::sleep(STORE_RETRY) => {}
                        _ = self.stopped() => return false,
                    }
                }
                metrics::counter!("sched_relay_sink_dead_lettered_total", "sink" => self.name.clone())
                    .increment(1);
                tracing::error!(sink = %self.name, event_id = %event_id, error = %error, "Delivery refused, event written to the dead-letter file; the events after it go on");
                self.passed(seqs[start] + 1).await;
                start += 1;
                attempt = 0;
            } else {
                // The destination refused several events at once without saying which one it
                // objects to: find out by sending them one at a time.
                tracing::warn!(sink = %self.name, events = rest, error = %error, "Delivery of a batch refused; retrying its events one by one to find the refused ones");
                one_by_one = true;
            }
        }
        true
    }

    /// Counts confirmed events and records the agent's own part of their latency: from the
    /// poller's observation of their document (the event's `time`, taken once the answer was
    /// read, parsed and found changed) to the destination's confirmation.
    fn confirmed(&self, events: &[Event]) {
        metrics::counter!("sched_relay_sink_delivered_total", "sink" => self.name.clone())
            .increment(events.len() as u64);
        let now = chrono::Utc::now();
        for event in events {
            let latency = event
                .time()
                .map(|observed| (now - *observed).num_microseconds().unwrap_or(i64::MAX))
                .unwrap_or_default();
            metrics::histogram!("sched_relay_sink_delivery_latency_seconds", "sink" => self.name.clone())
                .record(latency as f64 / 1e6);
            tracing::debug!(sink = %self.name, event_id = %event.id(), latency_us = latency, "Delivered");
        }
    }
}
