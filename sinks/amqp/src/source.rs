//! Approvals from an AMQP queue: a per-VM queue bound to the approvals exchange by a per-VM
//! routing key (and optionally a fleet key), consumed with manual acknowledgement. A message
//! is acknowledged only once the agent has handled it; if the agent stops first, the broker
//! delivers it again.

use std::sync::atomic::{AtomicU32, Ordering};

use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions,
    ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, ExchangeKind};
use sched_relay_transport::inbound::{
    Backlog, Deliveries, Handover, Inbound, Progress, SourceRole, hand_over, keep_consuming,
    pause_after_not_handled,
};
use tokio::sync::watch;

use crate::sink::close_in_background;
use crate::{AmqpSink, AmqpSinkConfig, CONSUMER_FRAME_CEILING, CONSUMER_FRAME_MAX, Frame};

/// What to consume.
#[derive(Debug, Clone)]
pub struct AmqpSourceSpec {
    pub connection: AmqpSinkConfig,
    pub queue: String,
    /// Declare the exchange, the queue and the bindings below.
    pub declare: bool,
    pub exchange: String,
    pub routing_key: String,
    pub fleet_routing_key: Option<String>,
    pub prefetch: u16,
    /// A private queue that disappears with the connection (for `sched-relay watch`); the
    /// exchange must already exist.
    pub exclusive: bool,
    /// Who reads it (the agent's approvals, the coordinator's input, `watch`), for the logs.
    pub role: SourceRole,
}

/// Consumes until `stop` turns true. Broker problems are logged and retried. `progress`
/// hears how far the source is through the messages its queue held when it first
/// connected.
/// How often a connected source checks its password and certificate files: a rotation is
/// taken up within this (and the source's retry pause), not at the next restart.
const WATCH_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

pub async fn run(
    spec: AmqpSourceSpec,
    deliveries: Deliveries,
    progress: Progress,
    stop: watch::Receiver<bool>,
) {
    let what = format!("AMQP queue {}", spec.queue);
    let backlog = Backlog::new(progress);
    // The frame proposed: raised for the source's life once a message outgrew it (0: not).
    let raised = AtomicU32::new(0);
    let (spec, deliveries, backlog, raised) = (&spec, &deliveries, &backlog, &raised);
    keep_consuming(spec.role, &what, stop, |mut stop| async move {
        consume(spec, deliveries, backlog, raised, &mut stop).await
    })
    .await
}

/// Declares the exchange (if missing), the queue and its bindings; returns the messages the
/// queue holds.
async fn declare(
    spec: &AmqpSourceSpec,
    connection: &Connection,
    channel: &Channel,
    sink: &AmqpSink,
) -> Result<u32, String> {
    let what = |what: String| move |e| sink.classify(e, &what).to_string();
    // An exchange that exists is left alone: declaring it again needs the right to configure
    // it, which is also the right to delete it, and a VM restricted to its own queue
    // (docs/src/permissions.md) must not hold that over every VM's approvals. A passive
    // declare needs no right; when it fails, the broker closes the channel it was tried on,
    // so it gets a channel of its own.
    let exists = !spec.exclusive && {
        let probe = connection
            .create_channel()
            .await
            .map_err(what("cannot open a channel".into()))?;
        let found = probe
            .exchange_declare(
                spec.exchange.as_str().into(),
                ExchangeKind::Topic,
                ExchangeDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .is_ok();
        if found {
            let _ = probe.close(200, "OK".into()).await;
        }
        found
    };
    if !spec.exclusive && !exists {
        channel
            .exchange_declare(
                spec.exchange.as_str().into(),
                ExchangeKind::Topic,
                ExchangeDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(what(format!("cannot declare exchange {}", spec.exchange)))?;
    }
    let queue = channel
        .queue_declare(
            spec.queue.as_str().into(),
            QueueDeclareOptions {
                durable: !spec.exclusive,
                exclusive: spec.exclusive,
                auto_delete: spec.exclusive,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .map_err(what(format!("cannot declare queue {}", spec.queue)))?;
    for key in std::iter::once(&spec.routing_key).chain(&spec.fleet_routing_key) {
        channel
            .queue_bind(
                spec.queue.as_str().into(),
                spec.exchange.as_str().into(),
                key.as_str().into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(what(format!("cannot bind queue {} with {key}", spec.queue)))?;
    }
    Ok(queue.message_count())
}

/// Whether lapin ended the connection for a frame larger than the one negotiated (a
/// message's headers, which cannot be split, outgrew it): AMQP's frame error, 501.
fn too_large(error: &lapin::Error) -> bool {
    matches!(error.kind(), lapin::ErrorKind::ProtocolError(e) if e.get_id() == 501)
}

/// A message outgrew the frame `negotiated`: the next connections propose eight times it
/// (the broker takes the smaller of that and its own), up to [`CONSUMER_FRAME_CEILING`],
/// so that a message with headers as large as the broker's frame is not delivered, refused
/// and delivered again for ever, stopping the queue behind it. Once the broker took less
/// than a raised proposal, its frame is the largest there is: nothing more is proposed.
fn outgrown(spec: &AmqpSourceSpec, negotiated: u32, raised: &AtomicU32) {
    let proposed = raised.load(Ordering::Relaxed);
    let capped = proposed != 0 && negotiated < proposed;
    let next = negotiated.saturating_mul(8).min(CONSUMER_FRAME_CEILING);
    if capped || next <= negotiated {
        tracing::error!(queue = %spec.queue, frame = negotiated, "A message's headers are larger than the largest frame the source proposes; it will be delivered again at each connection, and the messages behind it wait (remove it from the queue)");
        return;
    }
    raised.fetch_max(next, Ordering::Relaxed);
    tracing::warn!(queue = %spec.queue, frame = negotiated, next, "A message's headers did not fit the frame this connection negotiated with the broker; connecting again proposing a larger one (set the broker's frame_max in the source's URL to start there)");
}

/// Stops between messages, never in the middle of one.
async fn consume(
    spec: &AmqpSourceSpec,
    deliveries: &Deliveries,
    backlog: &Backlog,
    raised: &AtomicU32,
    stop: &mut watch::Receiver<bool>,
) -> Result<(), String> {
    let sink = AmqpSink::new(spec.connection.clone());
    // Stamped before the files are read: a change while connecting shows as a change.
    let files = sink.files();
    let frame = match raised.load(Ordering::Relaxed) {
        0 => Frame::UnlessSet(CONSUMER_FRAME_MAX),
        size => Frame::Override(size),
    };
    let (connection, channel) = sink.open(false, frame).await.map_err(|e| e.to_string())?;
    let negotiated = connection.configuration().frame_max();
    let mut watch = tokio::time::interval(WATCH_EVERY);
    watch.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    if spec.declare {
        backlog.found(declare(spec, &connection, &channel, &sink).await?.into());
    } else if backlog.watched() {
        // What the queue holds, without declaring it.
        let queue = channel
            .queue_declare(
                spec.queue.as_str().into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(|e| {
                sink.classify(e, &format!("cannot find queue {}", spec.queue))
                    .to_string()
            })?;
        backlog.found(queue.message_count().into());
    }
    channel
        .basic_qos(spec.prefetch, BasicQosOptions::default())
        .await
        .map_err(|e| sink.classify(e, "cannot set the prefetch").to_string())?;
    let mut consumer = channel
        .basic_consume(
            spec.queue.as_str().into(),
            "sched-relay".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(|e| {
            sink.classify(
                e,
                &format!(
                    "cannot consume queue {} (declare = true creates it)",
                    spec.queue
                ),
            )
            .to_string()
        })?;
    tracing::info!(queue = %spec.queue, exchange = %spec.exchange, routing_key = %spec.routing_key, "{} ready (AMQP)", spec.role.name());
    loop {
        let delivery = tokio::select! {
            _ = stop.wait_for(|stop| *stop) => return Ok(()),
            _ = watch.tick() => None,
            delivery = consumer.next() => Some(delivery),
        };
        let Some(delivery) = delivery else {
            // A password or certificate file changed: once a connection with the new files
            // gets in, this one is closed (its unacknowledged deliveries go back to the
            // queue) and the source connects again; until then it goes on.
            if sink.files() != files && sink.may_try_new_files() {
                match sink.open(false, frame).await {
                    Ok((probe, _)) => {
                        close_in_background(probe, "probe");
                        close_in_background(connection, "credentials rotated");
                        return Err("the password or certificate files changed and a connection with them gets in; connecting again with them".into());
                    }
                    Err(error) => {
                        tracing::warn!(queue = %spec.queue, error = %error, "A connection with the changed password or certificate files failed; the old connection goes on meanwhile");
                    }
                }
            }
            continue;
        };
        let delivery = delivery.ok_or("the consumer was cancelled")?.map_err(|e| {
            if too_large(&e) {
                outgrown(spec, negotiated, raised);
            }
            sink.classify(e, "the consumer failed").to_string()
        })?;
        let shared = spec.fleet_routing_key.as_deref() == Some(delivery.routing_key.as_str());
        let message = inbound(&spec.queue, &delivery, shared);
        match hand_over(deliveries, message).await {
            Handover::Handled(_) => {
                if let Err(error) = delivery.ack(BasicAckOptions::default()).await {
                    tracing::warn!(error = %error, "Cannot acknowledge a handled message; the broker will deliver it again");
                }
                backlog.handled();
            }
            Handover::NotHandled(why) => {
                // Requeued after a pause (RabbitMQ redelivers a requeued message at once).
                if !pause_after_not_handled(spec.role, &spec.queue, &why, stop).await {
                    return Ok(());
                }
                let requeue = BasicNackOptions {
                    requeue: true,
                    ..Default::default()
                };
                delivery
                    .nack(requeue)
                    .await
                    .map_err(|e| sink.classify(e, "cannot requeue an approval").to_string())?;
            }
            Handover::Stopping => return Ok(()),
        }
    }
}

fn inbound(queue: &str, delivery: &Delivery, shared: bool) -> Inbound {
    let properties = &delivery.properties;
    let headers = properties
        .headers()
        .as_ref()
        .map(|table| {
            table
                .inner()
                .iter()
                .filter_map(|(name, value)| Some((name.to_string(), text(value)?)))
                .collect()
        })
        .unwrap_or_default();
    Inbound {
        transport: "amqp",
        channel: queue.to_owned(),
        headers,
        content_type: properties.content_type().as_ref().map(|ct| ct.to_string()),
        body: delivery.data.clone(),
        shared,
        route: Some(delivery.routing_key.to_string()),
    }
}

/// Header values as text: the CloudEvents AMQP bindings send strings.
fn text(value: &AMQPValue) -> Option<String> {
    match value {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.to_string()),
        AMQPValue::ByteArray(bytes) => Some(String::from_utf8_lossy(bytes.as_slice()).into_owned()),
        _ => None,
    }
}
