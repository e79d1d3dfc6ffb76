//! Helpers for tests that consume what the AMQP sink published: an exchange with a queue
//! bound to it, drained and removed by the test.

use std::time::Duration;

use lapin::options::{
    BasicGetOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};
use sched_relay_transport::testing::unique;

/// An exchange and a queue bound to it with `#`, both removed when the test ends.
pub struct Topology {
    pub channel: Channel,
    pub exchange: String,
    pub queue: String,
}

impl Topology {
    pub async fn new(url: &str) -> Topology {
        let connection = Connection::connect(url, ConnectionProperties::default())
            .await
            .unwrap();
        let channel = connection.create_channel().await.unwrap();
        let exchange = unique("sr-test-x-");
        let queue = unique("sr-test-q-");
        channel
            .exchange_declare(
                exchange.as_str().into(),
                ExchangeKind::Topic,
                ExchangeDeclareOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        channel
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        channel
            .queue_bind(
                queue.as_str().into(),
                exchange.as_str().into(),
                "#".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        Topology {
            channel,
            exchange,
            queue,
        }
    }

    /// Takes every message now in the queue.
    pub async fn drain(&self, expected: usize) -> Vec<lapin::message::BasicGetMessage> {
        let mut messages = Vec::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while messages.len() < expected && tokio::time::Instant::now() < deadline {
            match self
                .channel
                .basic_get(self.queue.as_str().into(), BasicGetOptions { no_ack: true })
                .await
                .unwrap()
            {
                Some(message) => messages.push(message),
                None => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
        messages
    }

    pub async fn remove(self) {
        let _ = self
            .channel
            .queue_delete(self.queue.as_str().into(), QueueDeleteOptions::default())
            .await;
        let _ = self
            .channel
            .exchange_delete(
                self.exchange.as_str().into(),
                ExchangeDeleteOptions::default(),
            )
            .await;
    }
}

/// The `message_id` (the CloudEvents id) of each message, in order.
pub fn message_ids(messages: &[lapin::message::BasicGetMessage]) -> Vec<String> {
    messages
        .iter()
        .map(|m| {
            m.delivery
                .properties
                .message_id()
                .as_ref()
                .map(|id| id.to_string())
                .unwrap_or_default()
        })
        .collect()
}
