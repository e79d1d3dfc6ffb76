//! The messages a JetStream source has handed to the agent (or the coordinator) and that
//! are not answered yet, oldest first: up to [`Pull::in_flight`](super::Pull) at once, so
//! that a reader that commits what a group of messages changed in one write gets groups.
//! Each is acknowledged when its answer comes, in order; until then the source says each is
//! in progress every half ack wait ([`InFlight::say_in_progress`]), so that a slow reader
//! is no stall.

use std::collections::VecDeque;

use async_nats::jetstream::{AckKind, Message};
use sched_relay_transport::inbound::{Answer, Handover, handover};
use tokio::sync::oneshot;

pub(super) struct InFlight {
    messages: VecDeque<Message>,
    answers: VecDeque<oneshot::Receiver<Answer>>,
    depth: usize,
}

impl InFlight {
    /// At most `depth` (at least one) handed at once.
    pub(super) fn new(depth: usize) -> InFlight {
        InFlight {
            messages: VecDeque::new(),
            answers: VecDeque::new(),
            depth: depth.max(1),
        }
    }

    pub(super) fn has_room(&self) -> bool {
        self.messages.len() < self.depth
    }

    pub(super) fn is_empty(&self) -> bool {
        self.messages.is_empty()
    }

    /// `message` was handed over; its answer comes on `answer`.
    pub(super) fn push(&mut self, message: Message, answer: oneshot::Receiver<Answer>) {
        self.messages.push_back(message);
        self.answers.push_back(answer);
    }

    /// The oldest message once it is answered (never, while nothing is handed).
    /// Cancel-safe: a message leaves only with its answer.
    pub(super) async fn answered(&mut self) -> (Message, Handover) {
        let Some(first) = self.answers.front_mut() else {
            return std::future::pending().await;
        };
        let answer = first.await;
        self.answers.pop_front();
        let message = self
            .messages
            .pop_front()
            .expect("a message for each answer");
        (message, handover(answer))
    }

    /// Tells the server that every message handed is still being handled.
    pub(super) async fn say_in_progress(&self) {
        for message in &self.messages {
            let _ = message.ack_with(AckKind::Progress).await;
        }
    }
}
