//! What happens to events a sink's task has delivered (or dead-lettered): they are passed
//! (the cursor moves past them), leave the outbox once their commit is durable, and those
//! removals are made durable in batches. Events the sink got from memory before their commit
//! failed are remembered, so that the same events stored again are not sent twice.

use std::sync::Arc;
use std::time::Instant;

use cloudevents::AttributesReader;
use sched_relay_transport::Event;

use super::tail::Ticket;
use super::worker::{SENT_UNSTORED_KEPT, Worker};
use crate::store::StoreError;

impl Worker {
    /// Passes an event numbered `seq` without delivering it: the sink got it from memory
    /// before its commit failed, and this is the same event stored again.
    pub(super) fn pass_sent_unstored(&mut self, seq: u64, event: &Event) {
        tracing::debug!(sink = %self.name, event_id = %event.id(), "Not delivered again: the sink got it before its first commit failed");
        self.sent_unstored.remove(event.id());
        self.cursor = self.cursor.max(seq + 1);
    }

    /// Whether everything below the cursor has left the outbox of the store as it is now.
    pub(super) fn removed(&self) -> bool {
        self.removed_below >= self.cursor && self.removed_in == self.outbox.generation()
    }

    /// Events up to `next` (excluded) are confirmed or dead-lettered: they are passed (never
    /// delivered again by this task), and leave the outbox at once if their commit is durable
    /// (so a restart does not deliver them again), else as soon as it is (see
    /// [`Worker::remove_passed`]). A removal the store refuses is tried again before the next
    /// read.
    pub(super) async fn passed(
        &mut self,
        next: u64,
        events: &[Event],
        ticket: Option<&Arc<Ticket>>,
    ) {
        self.cursor = self.cursor.max(next);
        if let Some(ticket) = ticket {
            let ids = events.iter().map(|e| e.id().to_owned());
            match self
                .committing
                .iter_mut()
                .find(|(t, _)| Arc::ptr_eq(t, ticket))
            {
                Some((_, sent)) => sent.extend(ids),
                None => self.committing.push((ticket.clone(), ids.collect())),
            }
        }
        self.remove_passed(false).await;
    }

    /// Removes what was passed once nothing passed is still being committed: while a
    /// document's commit is written its other events keep going out from memory, and the
    /// removal (which would wait for the commit) comes after. With `wait`, waits for those
    /// commits first. False when the store failed (the caller tries again before reading).
    pub(super) async fn remove_passed(&mut self, wait: bool) -> bool {
        if wait {
            for (ticket, _) in &self.committing {
                ticket.durable().await;
            }
        }
        // A failed commit stored nothing to remove; what the sink got of it is remembered, so
        // that the poller's next commit of the same events does not send them again.
        for (ticket, sent) in &mut self.committing {
            if ticket.is_settled() && !ticket.is_durable() {
                self.sent_unstored.extend(sent.drain(..));
            }
        }
        self.committing.retain(|(ticket, _)| !ticket.is_settled());
        while self.sent_unstored.len() > SENT_UNSTORED_KEPT {
            let Some(oldest) = self.sent_unstored.iter().next().cloned() else {
                break;
            };
            self.sent_unstored.remove(&oldest);
        }
        if self.removed() || !self.committing.is_empty() {
            return true;
        }
        self.remove().await
    }

    /// Removes everything below the cursor from the outbox (not durable yet); false when the
    /// store failed (the caller tries again before reading).
    pub(super) async fn remove(&mut self) -> bool {
        let outbox = self.outbox.clone();
        let name = self.name.clone();
        let below = self.cursor;
        let generation = outbox.generation();
        let removed = tokio::task::spawn_blocking(move || outbox.remove_below(&name, below)).await;
        if let Ok(Err(error)) | Err(error) = removed.map_err(|e| StoreError::Io {
            path: "outbox".into(),
            reason: e.to_string(),
        }) {
            tracing::warn!(sink = %self.name, error = %error, "Cannot remove delivered events from the outbox yet; will try again before reading more");
            return false;
        }
        self.removed_below = below;
        self.removed_in = generation;
        self.volatile_since.get_or_insert_with(Instant::now);
        true
    }

    /// Makes the removals durable; a failure leaves them for the next try.
    pub(super) async fn flush(&mut self) {
        if self.volatile_since.is_none() {
            return;
        }
        let outbox = self.outbox.clone();
        match tokio::task::spawn_blocking(move || outbox.flush()).await {
            Ok(Ok(())) => self.volatile_since = None,
            Ok(Err(error)) => {
                tracing::debug!(sink = %self.name, error = %error, "Cannot make the removals of delivered events durable yet")
            }
            Err(error) => {
                tracing::debug!(sink = %self.name, error = %error, "Cannot make the removals of delivered events durable yet")
            }
        }
    }
}
