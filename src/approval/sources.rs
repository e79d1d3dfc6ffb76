//! Starting remote approvals: the HTTP listener (which also serves metrics, health and the
//! events view), the checker task and every configured broker source, each fed into one
//! channel; and stopping them in order when the agent stops.

use std::net::SocketAddr;
use std::sync::Arc;

use super::Approver;
use super::config::ApprovalsConfig;
use crate::sinks::SinkEntry;

/// Why remote approvals could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(
        "cannot listen on telemetry.listen {address}: {error} (is another process using the port?)"
    )]
    Listen {
        address: SocketAddr,
        error: std::io::Error,
    },
    #[error("approvals: {0}")]
    Approvals(String),
}

/// The running remote-approval machinery: the checker task and its sources.
pub struct RemoteApprovals {
    approver: Option<tokio::task::JoinHandle<()>>,
    sources: Vec<tokio::task::JoinHandle<()>>,
    /// Says why, should the checker ever end by a panic.
    checker_died: Option<tokio::sync::oneshot::Receiver<String>>,
}

impl RemoteApprovals {
    /// Completes if the approval checker dies (a panic): every source would then read its
    /// closed channel as the agent stopping, and remote approvals would be silently dead.
    /// The agent stops with an error instead, so its supervisor restarts it. Never completes
    /// otherwise.
    pub fn checker_failed(&mut self) -> impl std::future::Future<Output = String> + use<> {
        let died = self.checker_died.take();
        async move {
            match died {
                Some(died) => match died.await {
                    Ok(why) => why,
                    Err(_) => std::future::pending().await,
                },
                None => std::future::pending().await,
            }
        }
    }

    /// Lets every source finish the message it is handling, all at once, then lets the
    /// checker finish; whatever is still running at `deadline` is aborted (a source stuck on
    /// a broker, a POST that hangs). An aborted source's message was not acknowledged, so its
    /// broker delivers it again after the restart; approving is idempotent.
    pub async fn stop(self, deadline: tokio::time::Instant) {
        let mut sources = self.sources;
        // They all saw the stop signal at once; this only waits for the last of them.
        let stopped = tokio::time::timeout_at(deadline, async {
            for source in sources.iter_mut() {
                let _ = source.await;
            }
        })
        .await;
        if stopped.is_err() {
            let running = sources.iter().filter(|s| !s.is_finished()).count();
            tracing::warn!(
                still_running = running,
                "Approval sources did not stop by the shutdown deadline; aborting them"
            );
            for source in &sources {
                source.abort();
            }
            for source in sources {
                let _ = source.await;
            }
        }
        if let Some(mut approver) = self.approver
            && tokio::time::timeout_at(deadline, &mut approver)
                .await
                .is_err()
        {
            tracing::warn!(
                "The approval checker did not finish by the shutdown deadline; aborting it"
            );
            approver.abort();
        }
    }
}

/// Starts the HTTP listener (when configured: metrics, health, events, approvals), the
/// approval checker and every configured approval source. Sources stop when `stop` turns true.
// Without any broker feature only the HTTP source exists.
#[cfg_attr(
    not(any(feature = "nats", feature = "amqp", feature = "kafka")),
    allow(unused_variables)
)]
pub async fn start_listener_and_sources(
    approvals: &ApprovalsConfig,
    sinks: &[SinkEntry],
    listen: Option<SocketAddr>,
    limits: crate::http::Limits,
    telemetry: Arc<crate::telemetry::Telemetry>,
    approver: Approver,
    stop: tokio::sync::watch::Receiver<bool>,
) -> Result<RemoteApprovals, StartError> {
    let dry_run = approver.dry_run();
    let vm_name = approver.vm_name().to_owned();
    let (deliveries, inbox) = tokio::sync::mpsc::channel(64);
    let mut sources = Vec::new();
    let mut started = false;
    if let Some(listen) = listen {
        let endpoint = match &approvals.http {
            Some(http) if http.enabled => {
                let token = sched_relay_transport::secret::resolve(
                    http.token.as_ref(),
                    http.token_file.as_deref(),
                    "approvals.http.token",
                )
                .map_err(StartError::Approvals)?;
                Some(crate::http::ApprovalEndpoint {
                    deliveries: deliveries.clone(),
                    token: token.map(|token| {
                        Arc::new(crate::http::BearerToken::new(
                            token,
                            http.token_file.clone(),
                        ))
                    }),
                })
            }
            _ => None,
        };
        started |= endpoint.is_some();
        let mut stopped = stop.clone();
        let (bound, task) = crate::http::serve(
            listen,
            telemetry,
            endpoint,
            approvals.max_message_bytes * 2 + 1024,
            limits,
            async move {
                let _ = stopped.wait_for(|stop| *stop).await;
            },
        )
        .await
        .map_err(|error| StartError::Listen {
            address: listen,
            error,
        })?;
        if started {
            tracing::info!(address = %bound, "Approval source ready (HTTP POST /approvals)");
        } else {
            tracing::info!(address = %bound, "HTTP listener ready");
        }
        sources.push(task);
    }
    #[cfg(feature = "nats")]
    if let Some(nats) = &approvals.nats {
        use crate::approval::config::{BrokerSource, for_vm};
        let spec = sched_relay_nats::source::NatsSourceSpec {
            connection: nats.resolve(sinks).map_err(StartError::Approvals)?,
            subject: for_vm(&nats.subject, &vm_name),
            fleet_subject: nats.fleet_subject.as_ref().map(|s| for_vm(s, &vm_name)),
            jetstream: nats
                .stream
                .as_ref()
                .map(|stream| sched_relay_nats::source::JetStreamSpec {
                    stream: stream.clone(),
                    durable: for_vm(&nats.durable, &vm_name),
                    create_with: nats
                        .stream_subjects()
                        .iter()
                        .map(|subject| for_vm(subject, &vm_name))
                        .collect(),
                    // Requests are small and few; an expired one is refused anyway.
                    max_age: std::time::Duration::ZERO,
                }),
            from_start: false,
            ack_wait: std::time::Duration::from_secs(60),
            pull: None,
            role: sched_relay_transport::inbound::SourceRole::Approvals,
        };
        sources.push(tokio::spawn(sched_relay_nats::source::run(
            spec,
            deliveries.clone(),
            None,
            stop.clone(),
        )));
        started = true;
    }
    #[cfg(feature = "amqp")]
    if let Some(amqp) = &approvals.amqp {
        use crate::approval::config::{BrokerSource, for_vm};
        let spec = sched_relay_amqp::source::AmqpSourceSpec {
            connection: amqp.resolve(sinks).map_err(StartError::Approvals)?,
            queue: for_vm(&amqp.queue, &vm_name),
            declare: amqp.declare,
            exchange: amqp.exchange.clone(),
            routing_key: for_vm(&amqp.routing_key, &vm_name),
            fleet_routing_key: amqp.fleet_routing_key.clone(),
            prefetch: amqp.prefetch,
            exclusive: false,
            role: sched_relay_transport::inbound::SourceRole::Approvals,
        };
        sources.push(tokio::spawn(sched_relay_amqp::source::run(
            spec,
            deliveries.clone(),
            None,
            stop.clone(),
        )));
        started = true;
    }
    #[cfg(feature = "kafka")]
    if let Some(kafka) = &approvals.kafka {
        use crate::approval::config::{BrokerSource, KafkaPartitions, for_vm};
        let spec = sched_relay_kafka::source::KafkaSourceSpec {
            connection: kafka.resolve(sinks).map_err(StartError::Approvals)?,
            topic: kafka.topic.clone(),
            vm_name: vm_name.clone(),
            by_key: kafka.partitions == KafkaPartitions::Key,
            group_id: for_vm(&kafka.group_id, &vm_name),
            max_age: approvals.max_age,
            role: sched_relay_transport::inbound::SourceRole::Approvals,
        };
        sources.push(tokio::spawn(sched_relay_kafka::source::run(
            spec,
            deliveries.clone(),
            None,
            stop.clone(),
        )));
        started = true;
    }
    drop(deliveries);
    let (died, checker_died) = tokio::sync::oneshot::channel();
    let approver = started.then(|| {
        tracing::info!(
            dry_run,
            keys = approvals.keys.len(),
            allow_unsigned = approvals.allow_unsigned,
            allow_fleet = approvals.allow_fleet,
            "Remote approvals enabled"
        );
        tokio::spawn(async move {
            use futures_util::FutureExt;
            if let Err(panic) = std::panic::AssertUnwindSafe(approver.run(inbox))
                .catch_unwind()
                .await
            {
                let why = panic
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a panic".to_owned());
                let _ = died.send(why);
            }
        })
    });
    Ok(RemoteApprovals {
        approver,
        sources,
        checker_died: Some(checker_died),
    })
}
