//! The poller's small writes to the state store, off the poll loop: the approved EventIds,
//! that the metadata service answers, and, while the store cannot be written and the poller
//! has nothing of its own to store, a probe that finds out when it can again. Each runs on
//! the blocking pool, at most one of a kind at a time, and is never awaited: a disk that
//! hangs must not stop the polls (nor a stop).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use chrono::Utc;
use sched_relay_core::document::Document;

use crate::store::Outbox;

#[derive(Debug, Default)]
pub(super) struct Chores {
    /// The approved EventIds the store holds (as far as this process wrote them).
    accepted: Mutex<Option<Vec<String>>>,
    accepting: AtomicBool,
    probing: AtomicBool,
}

/// Clears a chore's in-flight flag when its task ends, however it ends.
struct Done<'a>(&'a AtomicBool);

impl Drop for Done<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

impl Chores {
    /// Keeps `accepted` in the store when it differs from what the store is known to hold;
    /// a write that failed is tried again at the next call.
    pub(super) fn persist_accepted(self: &Arc<Self>, outbox: &Arc<Outbox>, accepted: Vec<String>) {
        let stored = self.accepted.lock().unwrap_or_else(|p| p.into_inner());
        if stored.as_ref() == Some(&accepted) {
            return;
        }
        drop(stored);
        if self.accepting.swap(true, Ordering::AcqRel) {
            return;
        }
        let (chores, outbox) = (self.clone(), outbox.clone());
        tokio::task::spawn_blocking(move || {
            let _done = Done(&chores.accepting);
            match outbox.set_meta(
                crate::store::ACCEPTED_EVENT_IDS,
                &serde_json::json!(accepted),
            ) {
                Ok(()) => {
                    *chores.accepted.lock().unwrap_or_else(|p| p.into_inner()) = Some(accepted)
                }
                Err(error) => {
                    tracing::debug!(error = %error, "Cannot keep the approved EventIds in the state store yet")
                }
            }
        });
    }

    /// Remembers in the store that the service answers (see `run`).
    pub(super) fn record_answer(outbox: &Arc<Outbox>) {
        let outbox = outbox.clone();
        tokio::task::spawn_blocking(move || {
            let now = serde_json::json!(Utc::now().timestamp());
            if let Err(error) = outbox.set_meta(crate::store::IMDS_ANSWERED, &now) {
                tracing::debug!(error = %error, "Cannot note that the metadata service answers");
            }
        });
    }

    /// While the store cannot be written: commits the last processed document (with its
    /// `epoch`) again, which the store holds already, so that its success ends the state
    /// (see [`Outbox::probe`]).
    pub(super) fn probe(
        self: &Arc<Self>,
        outbox: &Arc<Outbox>,
        document: &Arc<Document>,
        epoch: u64,
    ) {
        if outbox.unwritable().is_none() || self.probing.swap(true, Ordering::AcqRel) {
            return;
        }
        let (chores, outbox, document) = (self.clone(), outbox.clone(), document.clone());
        tokio::task::spawn_blocking(move || {
            let _done = Done(&chores.probing);
            outbox.probe(crate::store::Processed {
                document: &document.raw,
                epoch,
            });
        });
    }
}
