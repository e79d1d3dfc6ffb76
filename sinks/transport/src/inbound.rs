//! The other direction: approval messages arriving from a broker or over HTTP. A source hands
//! each message to the agent as an [`Inbound`] and waits for the agent's [`Reply`] before it
//! acknowledges the message to its broker (JetStream ack, AMQP basic.ack, Kafka offset commit).
//! So a message the agent has not fully handled (checked, forwarded, outcome stored) is
//! delivered again after a crash, never lost.

use std::future::Future;
use std::time::Duration;

pub use sched_relay_core::inbound::Inbound;
use tokio::sync::{mpsc, oneshot, watch};

/// What the agent made of a message.
#[derive(Debug, Clone, PartialEq)]
pub struct Reply {
    /// `accepted`, `rejected`, `failed` or `skipped` (not for this VM).
    pub outcome: &'static str,
    /// The outcome as JSON (request id, reason, detail), for synchronous callers.
    pub body: serde_json::Value,
}

/// A message with the means to answer it.
#[derive(Debug)]
pub struct Delivery {
    pub message: Inbound,
    /// Answered once the request is fully handled; dropped if the agent stops first (the
    /// source must then not acknowledge the message).
    pub handled: oneshot::Sender<Reply>,
}

/// Where sources send what they receive.
pub type Deliveries = mpsc::Sender<Delivery>;

/// Hands `message` to the agent and waits until it is fully handled. `None` means the agent
/// is stopping: leave the message unacknowledged so the broker delivers it again.
pub async fn hand_over(deliveries: &Deliveries, message: Inbound) -> Option<Reply> {
    let (handled, reply) = oneshot::channel();
    deliveries.send(Delivery { message, handled }).await.ok()?;
    reply.await.ok()
}

/// How long a source waits before connecting again after a failure.
pub const SOURCE_RETRY: Duration = Duration::from_secs(2);

/// Runs a source's `consume` until it returns `Ok` (asked to stop) or `stop` turns true; a
/// failure (broker down, queue missing) is logged with `what` and retried after
/// [`SOURCE_RETRY`], so a broken broker never stops the agent.
pub async fn keep_consuming<F, Fut>(what: &str, mut stop: watch::Receiver<bool>, mut consume: F)
where
    F: FnMut(watch::Receiver<bool>) -> Fut,
    Fut: Future<Output = Result<(), String>>,
{
    loop {
        match consume(stop.clone()).await {
            Ok(()) => return,
            Err(error) => {
                tracing::error!(source = what, error = %error, retry_in = ?SOURCE_RETRY, "Approval source failed");
                tokio::select! {
                    _ = stop.wait_for(|stop| *stop) => return,
                    _ = tokio::time::sleep(SOURCE_RETRY) => {}
                }
            }
        }
    }
}
