//! The other direction: approval messages arriving from a broker or over HTTP. A source hands
//! each message to the agent as an [`Inbound`] and waits for the agent's [`Reply`] before it
//! acknowledges the message to its broker (JetStream ack, AMQP basic.ack, Kafka offset commit).
//! So a message the agent has not fully handled (checked, forwarded, outcome stored) is
//! delivered again after a crash, never lost. A message the agent could not handle (its
//! outcome could not be stored) is offered again after a pause while the source keeps
//! consuming: only the stop signal stops a source.
//!
//! The broker sources are shared: the agent's approval sources, the fleet coordinator's input
//! (the agents' events) and `sched-relay watch` all read through them, and say which they
//! are in their logs ([`SourceRole`]).

use std::future::Future;
use std::time::Duration;

pub use sched_relay_core::inbound::Inbound;
use tokio::sync::{mpsc, oneshot, watch};

/// Who reads a source, for its log lines: an operator must be able to tell the coordinator's
/// input failing from an agent's approvals failing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceRole {
    /// The agent's remote approvals.
    Approvals,
    /// `sched-relay coordinate`'s input: the agents' events.
    CoordinatorInput,
    /// `sched-relay watch`.
    Watch,
}

impl SourceRole {
    /// What the source is called in log lines: `Approval source`, `Coordinator input`,
    /// `Watch source`.
    pub fn name(self) -> &'static str {
        match self {
            SourceRole::Approvals => "Approval source",
            SourceRole::CoordinatorInput => "Coordinator input",
            SourceRole::Watch => "Watch source",
        }
    }

    /// What one of its messages is called in log lines.
    pub fn message(self) -> &'static str {
        match self {
            SourceRole::Approvals => "An approval",
            SourceRole::CoordinatorInput => "An event",
            SourceRole::Watch => "A message",
        }
    }
}

/// What the agent made of a message.
#[derive(Debug, Clone, PartialEq)]
pub struct Reply {
    /// `accepted`, `rejected`, `failed` or `skipped` (not for this VM).
    pub outcome: &'static str,
    /// The outcome as JSON (request id, reason, detail), for synchronous callers.
    pub body: serde_json::Value,
}

/// The agent's answer to a message.
#[derive(Debug, Clone, PartialEq)]
pub enum Answer {
    /// Fully handled: the outcome is stored (and published). Acknowledge the message.
    Handled(Reply),
    /// Not handled, for a reason that may pass (the outcome could not be stored: the state
    /// disk is full, say). Offer the message again after [`NOT_HANDLED_RETRY`] (JetStream nak
    /// with a delay, AMQP requeue after a pause, Kafka: read it again), or tell the requester
    /// to retry, and keep consuming. Never a reason to stop.
    NotHandled(String),
}

impl Reply {
    /// The answer to a synchronous requester whose request could not be handled: no
    /// outcome, send the same request again.
    pub fn not_handled(why: &str) -> Reply {
        Reply {
            outcome: "not_handled",
            body: serde_json::json!({
                "outcome": "not_handled",
                "retriable": true,
                "detail": format!("no outcome yet, send the same request again: {why}"),
            }),
        }
    }
}

/// A message with the means to answer it.
#[derive(Debug)]
pub struct Delivery {
    pub message: Inbound,
    /// Answered once the request is handled, or could not be; dropped only if the agent
    /// stops first (the source must then not acknowledge the message).
    pub handled: oneshot::Sender<Answer>,
}

/// Where sources send what they receive.
pub type Deliveries = mpsc::Sender<Delivery>;

/// What became of a message handed over.
#[derive(Debug, Clone, PartialEq)]
pub enum Handover {
    Handled(Reply),
    /// See [`Answer::NotHandled`]: offer it again later and keep consuming.
    NotHandled(String),
    /// The agent is stopping: leave the message unacknowledged so the broker delivers it
    /// again, and stop.
    Stopping,
}

/// Hands `message` to the agent and waits until it is handled, or could not be.
pub async fn hand_over(deliveries: &Deliveries, message: Inbound) -> Handover {
    match hand_in(deliveries, message).await {
        Some(answer) => handover(answer.await),
        None => Handover::Stopping,
    }
}

/// Hands `message` to the agent without waiting for it to be handled: its answer comes on
/// the receiver ([`handover`] reads it). `None`: the agent is stopping.
pub async fn hand_in(
    deliveries: &Deliveries,
    message: Inbound,
) -> Option<oneshot::Receiver<Answer>> {
    let (handled, answer) = oneshot::channel();
    deliveries.send(Delivery { message, handled }).await.ok()?;
    Some(answer)
}

/// What an answer received from [`hand_in`] says became of the message.
pub fn handover(answer: Result<Answer, oneshot::error::RecvError>) -> Handover {
    match answer {
        Ok(Answer::Handled(reply)) => Handover::Handled(reply),
        Ok(Answer::NotHandled(why)) => Handover::NotHandled(why),
        Err(_) => Handover::Stopping,
    }
}

/// How long a message that could not be handled waits before it is offered again.
pub const NOT_HANDLED_RETRY: Duration = Duration::from_secs(2);

/// Waits [`NOT_HANDLED_RETRY`] after a message was not handled (logged with `what`).
/// Returns false when `stop` turned true meanwhile: leave the message unacknowledged and stop.
pub async fn pause_after_not_handled(
    role: SourceRole,
    what: &str,
    why: &str,
    stop: &mut watch::Receiver<bool>,
) -> bool {
    tracing::warn!(source = what, error = %why, retry_in = ?NOT_HANDLED_RETRY, "{} could not be handled; it will be offered again", role.message());
    tokio::select! {
        _ = stop.wait_for(|stop| *stop) => false,
        _ = tokio::time::sleep(NOT_HANDLED_RETRY) => true,
    }
}

/// How long a source waits before connecting again after a failure.
pub const SOURCE_RETRY: Duration = Duration::from_secs(2);

/// Runs a source's `consume` until it returns `Ok` (asked to stop) or `stop` turns true; a
/// failure (broker down, queue missing) is logged with `what` and retried after
/// [`SOURCE_RETRY`], so a broken broker never stops the agent.
pub async fn keep_consuming<F, Fut>(
    role: SourceRole,
    what: &str,
    mut stop: watch::Receiver<bool>,
    mut consume: F,
) where
    F: FnMut(watch::Receiver<bool>) -> Fut,
    Fut: Future<Output = Result<(), String>>,
{
    loop {
        match consume(stop.clone()).await {
            Ok(()) => return,
            Err(error) => {
                tracing::error!(source = what, error = %error, retry_in = ?SOURCE_RETRY, "{} failed", role.name());
                tokio::select! {
                    _ = stop.wait_for(|stop| *stop) => return,
                    _ = tokio::time::sleep(SOURCE_RETRY) => {}
                }
            }
        }
    }
}

/// How far a source is through what its input held when it first connected. The fleet
/// coordinator decides nothing until all of that has been handled: catch-up by position,
/// however long it takes, not by a quiet second (a fleet's heartbeats never leave one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CatchUp {
    /// Not connected yet: the backlog is not known.
    #[default]
    Unknown,
    /// About this many messages of the backlog are still to be handled.
    Behind(u64),
    /// Everything the input held when the source first connected has been handled.
    CaughtUp,
}

/// Where a source reports its [`CatchUp`]; `None` where nobody waits on it (the agent's
/// approval sources, `watch`).
pub type Progress = Option<watch::Sender<CatchUp>>;

/// Counts the messages handled against the backlog a source found when it first connected
/// (a JetStream consumer's pending and unacknowledged messages, a queue's depth at declare,
/// a partition's end offset). Later connections change nothing: once caught up, a source
/// stays so. Shared by reference across a source's reconnections.
pub struct Backlog {
    progress: Progress,
    left: std::sync::Mutex<Option<u64>>,
    /// Only [`Backlog::reached_end`] says caught up (the count is shown, not trusted).
    by_position: std::sync::atomic::AtomicBool,
}

impl Backlog {
    pub fn new(progress: Progress) -> Backlog {
        Backlog {
            progress,
            left: std::sync::Mutex::new(None),
            by_position: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Whether anyone waits on it (a source may skip counting otherwise).
    pub fn watched(&self) -> bool {
        self.progress.is_some()
    }

    /// Whether someone waits and the backlog is not handled yet: a source that can see its
    /// position (a consumer with nothing pending) says so with [`Backlog::reached_end`].
    pub fn waiting(&self) -> bool {
        self.watched()
            && self
                .left
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_some_and(|left| left > 0)
    }

    /// Whether the count says the backlog may just have been handled: someone waits, and a
    /// source that can see its position has counted down to its floor (a message that
    /// arrived since the start may have been counted instead of one still to come, so only
    /// the position can say it is the end). Such a source looks at its position at once.
    pub fn may_be_at_end(&self) -> bool {
        self.watched()
            && self.by_position.load(std::sync::atomic::Ordering::SeqCst)
            && *self.left.lock().unwrap_or_else(|e| e.into_inner()) == Some(1)
    }

    /// The source saw that nothing of its input is left to deliver or acknowledge (by it or
    /// by an instance before it): caught up, whatever the count says.
    pub fn reached_end(&self) {
        self.by_position
            .store(false, std::sync::atomic::Ordering::SeqCst);
        self.handled_up_to(|_| 0);
    }

    /// As [`Backlog::found`], for a source that can see its position: the count only says
    /// how far it is, and a message that arrived since the start (counted as handled while
    /// one of the backlog is still to come again, say) cannot end the catch-up early.
    pub fn found_by_position(&self, messages: u64) {
        self.by_position
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.found(messages);
    }

    /// The backlog found on connecting; only the first connection's counts.
    pub fn found(&self, messages: u64) {
        let mut left = self.left.lock().unwrap_or_else(|e| e.into_inner());
        if left.is_none() {
            *left = Some(messages);
            self.report(messages);
        }
    }

    /// One message of the input handled (answered; acknowledged or committed, or about to
    /// be: a source that counts by position says it is at the end only once it is).
    pub fn handled(&self) {
        self.handled_up_to(|left| left.saturating_sub(1));
    }

    /// Sets what is left (a source that knows its position better than a count).
    pub fn handled_up_to(&self, next: impl FnOnce(u64) -> u64) {
        let mut left = self.left.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(count) = left.as_mut()
            && *count > 0
        {
            let by_position = self.by_position.load(std::sync::atomic::Ordering::SeqCst);
            // Counted down, but not to the end: only the position says that.
            *count = next(*count).max(u64::from(by_position));
            if *count == 0 || *count % 1000 == 0 || (by_position && *count == 1) {
                self.report(*count);
            }
        }
    }

    fn report(&self, left: u64) {
        if let Some(progress) = &self.progress {
            let state = if left == 0 {
                CatchUp::CaughtUp
            } else {
                CatchUp::Behind(left)
            };
            progress.send_if_modified(|current| {
                let changed = *current != state && *current != CatchUp::CaughtUp;
                if changed {
                    *current = state;
                }
                changed
            });
        }
    }
}

#[cfg(test)]
mod backlog_tests {
    use super::*;

    #[test]
    fn a_backlog_is_caught_up_once_every_message_found_at_the_first_connection_is_handled() {
        let (tx, rx) = watch::channel(CatchUp::Unknown);
        let backlog = Backlog::new(Some(tx));
        backlog.handled();
        assert_eq!(
            *rx.borrow(),
            CatchUp::Unknown,
            "nothing known before connecting"
        );
        backlog.found(2);
        assert_eq!(*rx.borrow(), CatchUp::Behind(2));
        backlog.found(100);
        backlog.handled();
        assert_ne!(*rx.borrow(), CatchUp::CaughtUp);
        backlog.handled();
        assert_eq!(*rx.borrow(), CatchUp::CaughtUp);
        let (tx, rx) = watch::channel(CatchUp::Unknown);
        Backlog::new(Some(tx)).found(0);
        assert_eq!(*rx.borrow(), CatchUp::CaughtUp, "an empty input");
    }

    #[test]
    fn a_source_that_sees_its_position_is_caught_up_only_when_it_says_it_reached_the_end() {
        let (tx, rx) = watch::channel(CatchUp::Unknown);
        let backlog = Backlog::new(Some(tx));
        backlog.found_by_position(2);
        // Two handled, but one was a message that arrived since the start while one of the
        // backlog waits to be delivered again: the count is not the end.
        backlog.handled();
        backlog.handled();
        backlog.handled();
        assert_eq!(*rx.borrow(), CatchUp::Behind(1));
        assert!(backlog.waiting());
        backlog.reached_end();
        assert_eq!(*rx.borrow(), CatchUp::CaughtUp);
        assert!(!backlog.waiting());
    }
}
