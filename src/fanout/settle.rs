//! What happens to events a sink's task has delivered (or dead-lettered): they are passed
//! (the cursor moves past them) and leave the outbox (their commit is durable: nothing is
//! delivered before it is), and those removals are made durable in batches.

use std::time::Instant;

use super::worker::Worker;
use crate::store::StoreError;

impl Worker {
    /// Whether everything below the cursor has left the outbox of the store as it is now.
    pub(super) fn removed(&self) -> bool {
        self.removed_below >= self.cursor && self.removed_in == self.outbox.generation()
    }

    /// Events up to `next` (excluded) are confirmed or dead-lettered: they are passed (never
    /// delivered again by this task) and leave the outbox at once, so a restart does not
    /// deliver them again. A removal the store refuses is tried again before the next read.
    pub(super) async fn passed(&mut self, next: u64) {
        self.cursor = self.cursor.max(next);
        self.remove_passed().await;
    }

    /// Removes what was passed, unless it is gone already. False when the store failed (the
    /// caller tries again before reading).
    pub(super) async fn remove_passed(&mut self) -> bool {
        if self.removed() {
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
