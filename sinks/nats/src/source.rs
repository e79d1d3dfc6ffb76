//! Approvals from NATS: core subscriptions (a request-reply caller gets the outcome as the
//! reply), or a JetStream durable pull consumer whose messages are acknowledged only after
//! the agent has handled them. The fleet coordinator reads the agents' events through the
//! same consumer. A JetStream source makes sure of its stream each time it connects
//! ([`crate::stream::ensure`]): created when missing, refused when it does not capture the
//! source's subjects.

use std::time::Duration;

use async_nats::jetstream::AckKind;
use async_nats::jetstream::{self, consumer::pull};
use futures_util::StreamExt;
use sched_relay_transport::inbound::{
    Backlog, Deliveries, Handover, Inbound, NOT_HANDLED_RETRY, Progress, Reply, SourceRole,
    hand_in, hand_over, keep_consuming,
};
use tokio::sync::watch;

use crate::NatsSinkConfig;
use crate::sink::{Connected, Outdated, connect_watched};

mod batches;
mod in_flight;
mod position;

use position::{CONFIRM_ACK, at_end};

/// How often a connected source checks its credentials and certificate files, and whether
/// the server refused its login: a rotation is taken up within this (and the source's
/// retry pause), not at the next restart.
const WATCH_EVERY: Duration = Duration::from_secs(5);

/// Ends a connection made with files that have changed since (once a connection with the
/// new files is known to get in: until then the old one goes on), or whose login the server
/// refused, so the source connects again with what the files hold now.
async fn recheck(connected: &mut Connected, config: &NatsSinkConfig) -> Result<(), String> {
    match connected.outdated(config) {
        None => Ok(()),
        Some(Outdated::FilesChanged) if connected.still_works() => {
            if !connected.may_try_new_files() {
                return Ok(());
            }
            match connect_watched(config).await {
                Ok(_probe) => Err(
                    "the credentials or certificate files changed and a connection with them gets in; connecting again with them".into(),
                ),
                Err(error) => {
                    tracing::warn!(error = %error, "A connection with the changed credentials or certificate files failed; the old connection goes on meanwhile");
                    Ok(())
                }
            }
        }
        Some(why) => Err(format!("{}; connecting again", why.describe())),
    }
}

/// What woke a source's loop.
enum Woken<T> {
    Message(T),
    /// Time to look at the files again.
    Watch,
    /// Time to look at the consumer's position again.
    Position,
}

/// A JetStream source's turn: what woke it, a stop, or the answer to a message handed over.
/// (One at a time, on the loop's stack: its size is no cost worth a box per message.)
#[allow(clippy::large_enum_variant)]
enum Turn<T> {
    Woken(Woken<T>),
    Stop,
    Answered(jetstream::Message, Handover),
    /// Time to say that the messages handed are in progress.
    InProgress,
}

/// What to consume.
#[derive(Debug, Clone)]
pub struct NatsSourceSpec {
    pub connection: NatsSinkConfig,
    /// This VM's subject (no other VM's requests arrive on it).
    pub subject: String,
    /// A subject shared by the fleet, if any.
    pub fleet_subject: Option<String>,
    /// A JetStream durable consumer; core subscriptions otherwise.
    pub jetstream: Option<JetStreamSpec>,
    /// A durable consumer created now starts at the stream's first message (the fleet
    /// coordinator, which must learn what was scheduled before it first ran), not at the
    /// next one (approvals: an old request is expired anyway).
    pub from_start: bool,
    /// A message not acknowledged this long after delivery is delivered again (a consumer
    /// that died with it, say): the approval sources wait a minute, the coordinator, whose
    /// standby must not wait that long after a failover, less.
    pub ack_wait: Duration,
    /// The pull requests of a JetStream source; `None`: async-nats's (200 messages, 30 s).
    pub pull: Option<Pull>,
    /// Who reads it (the agent's approvals, the coordinator's input, `watch`), for the logs.
    pub role: SourceRole,
}

/// The shape of a JetStream source's pull requests. A request stays open on the server
/// until it is filled or expires, and the server hands it new messages even when the
/// process that sent it has stalled: each such message waits `ack_wait` to be delivered to
/// another instance. A short expiry and a small batch bound what a stalled instance holds.
#[derive(Debug, Clone, Copy)]
pub struct Pull {
    /// Messages asked for at a time.
    pub batch: usize,
    /// How long a request waits for them.
    pub expires: Duration,
    /// Messages handed to the reader before the first of them is answered (at least one):
    /// a reader that commits a group of messages at once gets groups.
    pub in_flight: usize,
}

/// The stream and durable consumer of a JetStream source.
#[derive(Debug, Clone)]
pub struct JetStreamSpec {
    pub stream: String,
    /// The durable consumer (and `<durable>-fleet` for the fleet subject).
    pub durable: String,
    /// The subjects to create the stream with when it is missing (they must capture the
    /// source's subjects); empty: it must exist.
    pub create_with: Vec<String>,
    /// How long a stream created here keeps its messages (zero: no limit).
    pub max_age: std::time::Duration,
}

/// Consumes until `stop` turns true. Broker problems are logged and retried. `progress`
/// hears how far the source is through what its JetStream consumer held when it first
/// connected (core NATS holds nothing: caught up at once).
pub async fn run(
    spec: NatsSourceSpec,
    deliveries: Deliveries,
    progress: Progress,
    stop: watch::Receiver<bool>,
) {
    let what = format!("NATS subject {}", spec.subject);
    let backlog = Backlog::new(progress);
    let (spec, deliveries, backlog) = (&spec, &deliveries, &backlog);
    keep_consuming(spec.role, &what, stop, |mut stop| async move {
        consume(spec, deliveries, backlog, &mut stop).await
    })
    .await
}

fn inbound(transport: &'static str, message: &async_nats::Message, shared: bool) -> Inbound {
    let headers = message
        .headers
        .iter()
        .flat_map(|headers| headers.iter())
        .filter_map(|(name, values)| {
            values
                .first()
                .map(|value| (name.to_string(), value.as_str().to_owned()))
        })
        .collect();
    Inbound {
        transport,
        channel: message.subject.to_string(),
        headers,
        content_type: None,
        body: message.payload.to_vec(),
        shared,
        route: None,
    }
}

/// Stops between messages, never in the middle of one: a message being handled is answered
/// and acknowledged first.
async fn consume(
    spec: &NatsSourceSpec,
    deliveries: &Deliveries,
    backlog: &Backlog,
    stop: &mut watch::Receiver<bool>,
) -> Result<(), String> {
    let mut connected = connect_watched(&spec.connection)
        .await
        .map_err(|e| e.to_string())?;
    let client = connected.client.clone();
    let mut watch = tokio::time::interval(WATCH_EVERY);
    watch.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let is_shared = |subject: &str| spec.fleet_subject.as_deref() == Some(subject);
    match &spec.jetstream {
        None => {
            let mut subscriptions = vec![
                client
                    .subscribe(spec.subject.clone())
                    .await
                    .map_err(|e| e.to_string())?,
            ];
            if let Some(fleet) = &spec.fleet_subject {
                subscriptions.push(
                    client
                        .subscribe(fleet.clone())
                        .await
                        .map_err(|e| e.to_string())?,
                );
            }
            // Subscriptions are registered once the server has seen them.
            client.flush().await.map_err(|e| e.to_string())?;
            backlog.found(0);
            tracing::info!(subject = %spec.subject, fleet_subject = ?spec.fleet_subject, "{} ready (NATS)", spec.role.name());
            let mut messages = futures_util::stream::select_all(subscriptions);
            loop {
                let woken = tokio::select! {
                    _ = stop.wait_for(|stop| *stop) => return Ok(()),
                    _ = watch.tick() => Woken::Watch,
                    message = messages.next() => Woken::Message(message),
                };
                let message = match woken {
                    Woken::Message(message) => message,
                    _ => {
                        recheck(&mut connected, &spec.connection).await?;
                        continue;
                    }
                };
                let Some(message) = message else { break };
                let shared = is_shared(message.subject.as_str());
                // Core NATS never delivers a message again: a requester that is not answered
                // with an outcome is told to retry; one that did not ask for a reply cannot be.
                let reply = match hand_over(deliveries, inbound("nats", &message, shared)).await {
                    Handover::Handled(reply) => reply,
                    Handover::NotHandled(why) => {
                        tracing::warn!(error = %why, subject = %message.subject, requester = message.reply.is_some(), "{} could not be handled; the requester is told to retry", spec.role.message());
                        Reply::not_handled(&why)
                    }
                    Handover::Stopping => return Ok(()),
                };
                if let Some(reply_to) = message.reply.clone() {
                    answer(&client, reply_to, &reply).await;
                }
            }
            Err("the subscription ended (connection closed)".into())
        }
        Some(JetStreamSpec {
            stream,
            durable,
            create_with,
            max_age,
        }) => {
            let context = jetstream::new(client.clone());
            let subjects: Vec<String> = std::iter::once(&spec.subject)
                .chain(&spec.fleet_subject)
                .cloned()
                .collect();
            let (stream_handle, created) =
                crate::stream::ensure(&context, stream, &subjects, create_with, *max_age)
                    .await
                    .map_err(|e| e.to_string())?;
            if created {
                tracing::info!(stream = %stream, subjects = ?create_with, "Created the JetStream stream, which was missing");
            }
            // One durable consumer per subject: servers before 2.10 filter on one subject.
            let mut subjects = vec![(spec.subject.clone(), durable.clone())];
            if let Some(fleet) = &spec.fleet_subject {
                subjects.push((fleet.clone(), format!("{durable}-fleet")));
            }
            let mut streams = Vec::new();
            let mut consumers = Vec::new();
            let mut pending = 0;
            let mut ack_wait = spec.ack_wait;
            for (subject, name) in subjects {
                let consumer = stream_handle
                    .get_or_create_consumer(
                        &name,
                        pull::Config {
                            durable_name: Some(name.clone()),
                            filter_subject: subject,
                            ack_policy: jetstream::consumer::AckPolicy::Explicit,
                            deliver_policy: if spec.from_start {
                                jetstream::consumer::DeliverPolicy::All
                            } else {
                                jetstream::consumer::DeliverPolicy::New
                            },
                            ack_wait: spec.ack_wait,
                            ..Default::default()
                        },
                    )
                    .await
                    .map_err(|e| format!("durable consumer {name:?} on stream {stream:?}: {e}"))?;
                let mut consumer = consumer;
                // A source with a pull shape of its own (the coordinator's input) bounds what
                // a stalled instance holds back with its ack wait: a durable made with
                // another (by an earlier version) is changed to it. Not one with several
                // filters or a back-off, which a copy of its settings would not keep.
                let made_with = consumer.cached_info().config.clone();
                if spec.pull.is_some()
                    && made_with.ack_wait != spec.ack_wait
                    && !made_with.filter_subject.is_empty()
                    && made_with.backoff.is_empty()
                    && let Ok(kept) = <pull::Config as jetstream::consumer::FromConsumer>::try_from_consumer_config(made_with.clone())
                {
                    let updated = pull::Config {
                        ack_wait: spec.ack_wait,
                        ..kept
                    };
                    // Create or update: everything else as the durable was made.
                    match stream_handle.create_consumer(updated).await {
                        Ok(changed) => {
                            tracing::info!(durable = %name, from = ?made_with.ack_wait, to = ?spec.ack_wait, "Changed the durable consumer's ack wait");
                            consumer = changed;
                        }
                        Err(error) => {
                            tracing::warn!(durable = %name, error = %error, ack_wait = ?made_with.ack_wait, "Cannot change the durable consumer's ack wait; it keeps its own");
                        }
                    }
                }
                // Not yet delivered, and delivered but not acknowledged (to an instance that
                // died with them: delivered again after ack_wait).
                let info = consumer.cached_info();
                pending += info.num_pending + info.num_ack_pending as u64;
                let messages = match spec.pull {
                    None => consumer
                        .messages()
                        .await
                        .map_err(|e| e.to_string())?
                        .boxed(),
                    Some(pull) => {
                        // Within the durable's own limits, as async-nats's defaults are.
                        let limits = &info.config;
                        let batch = match limits.max_batch {
                            max if max > 0 => pull.batch.min(max as usize),
                            _ => pull.batch,
                        };
                        let expires = match limits.max_expires {
                            max if !max.is_zero() => pull.expires.min(max),
                            _ => pull.expires,
                        };
                        batches::one_request_at_a_time(consumer.clone(), batch, expires)
                    }
                };
                streams.push(messages);
                // What the server will wait: the durable's own, whatever the spec says.
                let waits = consumer.cached_info().config.ack_wait;
                if !waits.is_zero() {
                    ack_wait = ack_wait.min(waits);
                }
                consumers.push(consumer);
            }
            backlog.found_by_position(pending);
            // A count can end too early (a message that arrived since the start, counted while
            // one of the backlog waits to be delivered again after ack_wait) or never (one the
            // instance before acknowledged as it died). The consumer's own state is the
            // position: nothing pending and nothing unacknowledged is the end of what was
            // there.
            let mut position = tokio::time::interval(Duration::from_secs(1));
            position.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut messages = futures_util::stream::select_all(streams);
            tracing::info!(stream = %stream, durable = %durable, subject = %spec.subject, "{} ready (JetStream)", spec.role.name());
            // Never more than the reader's channel holds: a send that waited would stop the
            // loop from saying that the messages handed are in progress.
            let depth = spec.pull.map_or(1, |pull| pull.in_flight);
            let mut handed = in_flight::InFlight::new(depth.min(deliveries.max_capacity()));
            let half = (ack_wait / 2).max(Duration::from_millis(1));
            let mut in_progress = tokio::time::interval(half);
            in_progress.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            // Why the source ends (a stop, a broken stream, changed credentials), once it
            // does: it takes no new message, and ends once those handed are answered and
            // acknowledged (or the reader is gone), so that none is handled twice.
            let mut ending: Option<Result<(), String>> = None;
            loop {
                if ending.is_some() && handed.is_empty() {
                    return ending.unwrap_or(Ok(()));
                }
                let running = ending.is_none();
                let room = running && handed.has_room();
                let woken = tokio::select! {
                    _ = stop.wait_for(|stop| *stop), if running => Turn::Stop,
                    _ = watch.tick(), if running => Turn::Woken(Woken::Watch),
                    _ = position.tick(), if running && backlog.waiting() => Turn::Woken(Woken::Position),
                    message = messages.next(), if room => Turn::Woken(Woken::Message(message)),
                    (message, handover) = handed.answered() => Turn::Answered(message, handover),
                    _ = in_progress.tick(), if !handed.is_empty() => Turn::InProgress,
                };
                let message = match woken {
                    Turn::Stop => {
                        ending = Some(Ok(()));
                        continue;
                    }
                    Turn::InProgress => {
                        handed.say_in_progress().await;
                        continue;
                    }
                    Turn::Answered(message, handover) => {
                        match handover {
                            Handover::Handled(reply) => {
                                backlog.handled();
                                // Perhaps the backlog's last message, with nothing else in
                                // hand: its acknowledgement is confirmed, so that the
                                // consumer's state has it, and the position looked at now
                                // rather than at the next second's look (a coordinator
                                // taking over decides that much sooner). Each wait is at
                                // most CONFIRM_ACK, and the next look a second after this
                                // one, so a message the server sent meanwhile is handed
                                // over well within half an ack wait.
                                if handed.is_empty() && backlog.may_be_at_end() {
                                    let confirmed =
                                        tokio::time::timeout(CONFIRM_ACK, message.double_ack())
                                            .await
                                            .unwrap_or_else(|_| Err("no confirmation".into()));
                                    match confirmed {
                                        Ok(()) => {
                                            if at_end(&mut consumers).await {
                                                backlog.reached_end();
                                            }
                                            position.reset();
                                        }
                                        Err(error) => {
                                            tracing::warn!(error = %error, reply = reply.outcome, "No confirmation of a handled message's acknowledgement; JetStream delivers it again if it did not get it");
                                        }
                                    }
                                } else if let Err(error) = message.ack().await {
                                    tracing::warn!(error = %error, reply = reply.outcome, "Cannot acknowledge a handled message; JetStream will deliver it again");
                                }
                            }
                            Handover::NotHandled(why) => {
                                tracing::warn!(error = %why, retry_in = ?NOT_HANDLED_RETRY, "{} could not be handled; JetStream will deliver it again", spec.role.message());
                                if let Err(error) = message
                                    .ack_with(AckKind::Nak(Some(NOT_HANDLED_RETRY)))
                                    .await
                                {
                                    tracing::warn!(error = %error, "Cannot nak a message; JetStream will deliver it again after ack_wait");
                                }
                            }
                            Handover::Stopping => return Ok(()),
                        }
                        continue;
                    }
                    Turn::Woken(Woken::Message(message)) => Some(message),
                    Turn::Woken(Woken::Watch) => {
                        if let Err(error) = recheck(&mut connected, &spec.connection).await {
                            ending = Some(Err(error));
                        }
                        continue;
                    }
                    Turn::Woken(Woken::Position) => None,
                };
                let Some(message) = message else {
                    if at_end(&mut consumers).await {
                        backlog.reached_end();
                    }
                    continue;
                };
                let message = match message {
                    Some(Ok(message)) => message,
                    Some(Err(error)) => {
                        ending = Some(Err(error.to_string()));
                        continue;
                    }
                    None => {
                        ending = Some(Err("the consumer's message stream ended".into()));
                        continue;
                    }
                };
                let shared = is_shared(message.subject.as_str());
                match hand_in(deliveries, inbound("jetstream", &message, shared)).await {
                    Some(answer) => {
                        if handed.is_empty() {
                            // The first word is due half an ack wait after the oldest handover.
                            in_progress.reset();
                        }
                        handed.push(message, answer);
                    }
                    // The reader is stopping: this one is offered again soon, and the
                    // answers to those handed before it are still acted on.
                    None => {
                        let _ = message
                            .ack_with(AckKind::Nak(Some(NOT_HANDLED_RETRY)))
                            .await;
                        ending.get_or_insert(Ok(()));
                    }
                }
            }
        }
    }
}

async fn answer(client: &async_nats::Client, reply_to: async_nats::Subject, reply: &Reply) {
    let body = reply.body.to_string();
    if let Err(error) = client.publish(reply_to, body.into()).await {
        tracing::warn!(error = %error, "Cannot send the outcome to the requester");
    }
}
