//! One sink's delivery task: reads the sink's part of the outbox in order, delivers in
//! batches, retries what may succeed later, dead-letters what never will, and removes events
//! only once the sink confirmed them.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use cloudevents::AttributesReader;
use sched_relay_transport::{Event, Sink, SinkError};
use tokio::sync::{Notify, watch};

use super::{DeliveryConfig, MAX_RETRY_AFTER, Mode, STORE_RETRY, SinkHealth};
use crate::retry::Backoff;
use crate::store::{Outbox, StoreError};

pub(super) struct Worker {
    pub(super) name: String,
    pub(super) sink: Box<dyn Sink>,
    pub(super) outbox: Arc<Outbox>,
    pub(super) wake: Arc<Notify>,
    pub(super) delivery: DeliveryConfig,
    pub(super) dead_letter: DeadLetter,
    pub(super) mode: watch::Receiver<Mode>,
    pub(super) health: Arc<SinkHealth>,
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
        // Delivered (or dead-lettered) but not yet removed, because the store failed: removed
        // before anything is read again, so a full disk does not deliver the batch over and
        // over (a restart meanwhile delivers it once more: at least once).
        let mut unremoved: Vec<u64> = Vec::new();
        loop {
            if *self.mode.borrow() == Mode::Stop {
                return;
            }
            if !unremoved.is_empty() {
                if self.forget(&unremoved).await {
                    unremoved.clear();
                } else {
                    tokio::select! {
                        _ = tokio::time::sleep(STORE_RETRY) => continue,
                        _ = self.stopped() => return,
                    }
                }
            }
            // Register for a wake-up before reading, so an event stored in between is not missed.
            let wake = self.wake.clone();
            let woken = wake.notified();
            tokio::pin!(woken);
            let pending = match self.read().await {
                Ok(pending) => pending,
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
            if pending.is_empty() {
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
                        if !self.forget(&[stored.seq]).await {
                            unremoved.push(stored.seq);
                        }
                    }
                }
            }
            if batch.is_empty() {
                continue;
            }
            if !self.deliver(&batch, &seqs, &mut unremoved).await {
                return; // stopped: the unconfirmed rest stays in the outbox
            }
        }
    }

    /// Removes delivered (or dead-lettered) events now, or before the next read if the store
    /// fails.
    async fn settle(&self, seqs: &[u64], unremoved: &mut Vec<u64>) {
        if !self.forget(seqs).await {
            unremoved.extend_from_slice(seqs);
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

    /// Removes delivered (or dead-lettered) events; false when the store failed (the caller
    /// tries again before reading).
    async fn forget(&self, seqs: &[u64]) -> bool {
        let outbox = self.outbox.clone();
        let name = self.name.clone();
        let seqs = seqs.to_vec();
        let removed = tokio::task::spawn_blocking(move || outbox.remove(&name, &seqs)).await;
        if let Ok(Err(error)) | Err(error) = removed.map_err(|e| StoreError::Io {
            path: "outbox".into(),
            reason: e.to_string(),
        }) {
            tracing::warn!(sink = %self.name, error = %error, "Cannot remove delivered events from the outbox yet; will try again before reading more");
            return false;
        }
        true
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

    /// Delivers one batch (`seqs` are its events' outbox sequence numbers), retrying while
    /// retrying can help, and removes each event from the outbox as soon as the sink confirmed
    /// it or it was dead-lettered, so a retry never sends a confirmed event again. An event the
    /// sink refuses for good is dead-lettered alone and the rest goes on, in order; a refusal
    /// of the rest as a whole (one request for the batch) is retried event by event first.
    /// Returns false when told to stop before the whole batch was settled.
    async fn deliver(&mut self, batch: &[Event], seqs: &[u64], unremoved: &mut Vec<u64>) -> bool {
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
                    self.settle(&seqs[start..end], unremoved).await;
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
                self.settle(&seqs[start..start + confirmed], unremoved)
                    .await;
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
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = self.stopped() => return false,
                }
            } else if error.names_event || rest == 1 {
                let refused = batch[start].clone();
                let event_id = refused.id().to_owned();
                // The event leaves the outbox only once its dead letter is on disk (fsync'd,
                // off the async threads): on a full disk it waits there, not nowhere.
                let reason = error.to_string();
                let mut said = false;
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
                self.settle(&seqs[start..start + 1], unremoved).await;
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
    /// document's arrival (the event's `time`) to the destination's confirmation.
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

/// The dead-letter file of one sink.
#[derive(Clone)]
pub(super) struct DeadLetter {
    pub(super) path: PathBuf,
}

impl DeadLetter {
    pub(super) fn new(dir: &Path, sink: &str) -> Self {
        DeadLetter {
            path: dir.join(format!("{sink}.jsonl")),
        }
    }

    /// Appends one line per event: `{"sink", "reason", "at", "event"}`. If even that fails,
    /// the event is logged in full so an operator can still recover it from the logs.
    pub(super) fn write(&self, events: &[Event], reason: &str) {
        let entries: Vec<Result<Event, String>> = events.iter().cloned().map(Ok).collect();
        if let Err(error) = self.try_write(&entries, reason) {
            let lost = self.lines(&entries, reason);
            tracing::error!(path = %self.path.display(), error = %error, lost = %String::from_utf8_lossy(&lost), "Cannot write the dead-letter file");
        }
    }

    /// Appends and fsyncs one line per entry; an entry that could not be read from the
    /// outbox is kept as `{"sink", "reason", "at", "unreadable"}` with what was stored.
    pub(super) fn try_write(
        &self,
        entries: &[Result<Event, String>],
        reason: &str,
    ) -> Result<(), SinkError> {
        sched_relay_file::append(&self.path, &self.lines(entries, reason), true)
    }

    fn lines(&self, entries: &[Result<Event, String>], reason: &str) -> Vec<u8> {
        let sink = self
            .path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let at = chrono::Utc::now().to_rfc3339();
        // Dead-letter files are read by people and shipped to log stores: no credentials.
        let reason = sched_relay_transport::redact::text(reason);
        let mut lines = Vec::new();
        for entry in entries {
            let record = match entry {
                Ok(event) => {
                    serde_json::json!({"sink": sink, "reason": reason, "at": at, "event": event})
                }
                Err(unreadable) => {
                    serde_json::json!({"sink": sink, "reason": reason, "at": at, "unreadable": unreadable})
                }
            };
            lines.extend_from_slice(record.to_string().as_bytes());
            lines.push(b'\n');
        }
        lines
    }
}
