//! The agent's heartbeat (`sched_relay_core::event::Heartbeat`): the first as soon as the VM's
//! identity is known and the first document after start is processed, so that a VM back from
//! a reboot announces itself at once, then one every `events.heartbeat_interval` (`0s`: none),
//! each with the last processed document's state at that moment, also while the metadata
//! service fails (the agent is alive; the document it reports is the last good one).
//!
//! Made on the poll thread between commits, and only while nothing derived is waiting to be
//! stored, so a heartbeat never reports a document whose transitions the sinks may not get
//! before it. Stored off the poll loop, as the other small writes are (a disk that hangs must
//! not stop the polls), and the next commit of transitions waits for it, so the outbox keeps
//! the order they were made in. The fan-out coalesces them per sink (`fanout::heartbeat`).

use std::time::Duration;

use chrono::{DateTime, Utc};
use cloudevents::AttributesReader;
use sched_relay_core::event::Heartbeat;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::poller::Poller;

/// When heartbeats are due, and the one being stored.
pub(super) struct Heartbeats {
    interval: Duration,
    /// When this agent started: every heartbeat says so.
    started_at: DateTime<Utc>,
    /// Set once a document is processed after start: no heartbeat before.
    armed: bool,
    /// When the next one is due; `None` until the first is made.
    next: Option<Instant>,
    /// The heartbeat being stored, if any.
    storing: Option<JoinHandle<()>>,
}

impl Heartbeats {
    /// Heartbeats every `interval`, or `None` at 0 (off).
    pub(super) fn new(interval: Duration, started_at: DateTime<Utc>) -> Option<Heartbeats> {
        (!interval.is_zero()).then_some(Heartbeats {
            interval,
            started_at,
            armed: false,
            next: None,
            storing: None,
        })
    }

    /// A document was processed (stored, or found unchanged): heartbeats may begin.
    pub(super) fn arm(&mut self) {
        self.armed = true;
    }

    /// Waits until the heartbeat being stored is, stored or not, so that what is committed
    /// next comes after it in every sink's queue.
    pub(super) async fn stored(&mut self) {
        if let Some(storing) = self.storing.take() {
            // A panic in it is no reason not to store transitions.
            let _ = storing.await;
        }
    }
}

impl Poller {
    /// Makes and hands over a heartbeat if one is due and the last processed document is
    /// what the outbox holds as processed; never waits for the store.
    pub(super) fn heartbeat_if_due(&mut self) {
        let Some(heartbeats) = self.heartbeats.as_mut() else {
            return;
        };
        let now = Instant::now();
        if !heartbeats.armed
            || heartbeats.next.is_some_and(|next| now < next)
            || heartbeats
                .storing
                .as_ref()
                .is_some_and(|s| !s.is_finished())
            || !self.unstored.is_empty()
            || !self.previous_stored
        {
            return;
        }
        let Some(document) = self.previous.as_deref() else {
            return;
        };
        let first = heartbeats.next.is_none();
        heartbeats.next = Some(now + heartbeats.interval);
        let state = Heartbeat {
            document: Some(document),
            epoch: self.epoch,
            interval: heartbeats.interval,
            started_at: heartbeats.started_at,
            agent_version: env!("CARGO_PKG_VERSION"),
        };
        let event = self.factory.heartbeat(&state, Utc::now());
        let publisher = self.fanout.publisher();
        let interval = heartbeats.interval;
        heartbeats.storing = Some(tokio::spawn(async move {
            let id = event.id().to_owned();
            match publisher.publish_heartbeat(event).await {
                Ok(0) => {
                    tracing::debug!(id, "Heartbeat not stored: every sink still holds one")
                }
                Ok(sinks) => {
                    metrics::counter!("sched_relay_heartbeats_total").increment(1);
                    if first {
                        tracing::info!(id, sinks, every = ?interval, "Heartbeat: this VM announces itself to the sinks now and at every interval");
                    } else {
                        tracing::debug!(id, sinks, "Heartbeat stored");
                    }
                }
                // The store says so itself (at ERROR, and in /readyz); the next one comes
                // at the next interval.
                Err(error) => tracing::debug!(id, error = %error, "Heartbeat not stored"),
            }
        }));
    }
}
