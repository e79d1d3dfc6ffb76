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
use sched_relay_core::document::Document;
use sched_relay_core::event::{Event, EventFactory, Heartbeat};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::fanout::Publisher;

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

impl Heartbeats {
    /// Makes a heartbeat if one is due: the first document after start was processed
    /// (`armed`), the last one is what the outbox holds as processed (`settled`), and the
    /// one before has been stored. `document` is the last processed document.
    pub(super) fn due(
        &mut self,
        settled: bool,
        document: Option<&Document>,
        epoch: u64,
        factory: &EventFactory,
    ) -> Option<Event> {
        let now = Instant::now();
        if !self.armed
            || !settled
            || self.next.is_some_and(|next| now < next)
            || self.storing.as_ref().is_some_and(|s| !s.is_finished())
        {
            return None;
        }
        let document = document?;
        self.next = Some(now + self.interval);
        let state = Heartbeat {
            document: Some(document),
            epoch,
            interval: self.interval,
            started_at: self.started_at,
            agent_version: env!("CARGO_PKG_VERSION"),
        };
        Some(factory.heartbeat(&state, Utc::now()))
    }

    /// Hands `event` to the fan-out off the poll loop; `stored` waits for it.
    pub(super) fn store(&mut self, event: Event, publisher: Publisher) {
        let first = self.storing.is_none();
        let interval = self.interval;
        self.storing = Some(tokio::spawn(async move {
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
