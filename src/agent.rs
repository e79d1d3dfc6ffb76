//! The agent's main loop: poll the metadata service, diff each new incarnation against the
//! previous one, publish the CloudEvents, and approve what local policy allows.
//!
//! The data path reads top to bottom: `imds` fetch -> `diff` -> `event` -> `fanout`. IMDS
//! errors never produce transitions: a failed or malformed fetch leaves the previous document
//! in place, so the next good document is diffed against the last good one.

use std::collections::HashMap;
use std::future::Future;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use cloudevents::AttributesReader;

use crate::approval::{Approver, Snapshot};
use crate::config::Config;
use crate::fanout::Fanout;
use crate::imds::{ImdsClient, ImdsError, discover_endpoint};
use crate::sinks::SinkEntry;
use crate::store::{Outbox, StoreError};
use sched_relay_core::EventKind;
use sched_relay_core::document::{Document, EventStatus};
use sched_relay_core::event::{
    ApprovalOutcome, EventFactory, Identity, Outcome, events_for_document,
};
use sched_relay_core::policy::{self, Decision};

/// After this long without a good answer, an operator has to look: log at ERROR.
const IMDS_FAILING_ALERT: Duration = Duration::from_secs(30);
/// Approval POSTs by local policy are tried this often before `approval.failed` is published.
const POLICY_APPROVAL_ATTEMPTS: u32 = 3;

/// Why the agent could not start.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(
        "cannot create the state directory {path}: {error} (set state.dir to a writable directory)"
    )]
    StateDir { path: String, error: std::io::Error },
    #[error(transparent)]
    Imds(#[from] ImdsError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(
        "cannot listen on telemetry.listen {address}: {error} (is another process using the port?)"
    )]
    Listen {
        address: std::net::SocketAddr,
        error: std::io::Error,
    },
    #[error("approvals: {0}")]
    Approvals(String),
}

/// How `run` starts, beyond the configuration.
#[derive(Debug, Clone, Copy, Default)]
pub struct RunOptions {
    /// Move an existing (say, damaged) state store aside and start afresh.
    pub fresh_state: bool,
    /// Check approvals (remote and by policy) and publish their outcomes, but POST nothing.
    pub dry_run: bool,
}

/// How long sources get to finish the message they are handling when the agent stops.
const SOURCE_STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// Runs the agent until `shutdown` completes, then drains the sinks and returns.
pub async fn run(
    config: Config,
    options: RunOptions,
    shutdown: impl Future<Output = ()>,
) -> Result<(), AgentError> {
    check_state_dir(&config.state.dir).map_err(|error| AgentError::StateDir {
        path: config.state.dir.display().to_string(),
        error,
    })?;
    let client = Arc::new(ImdsClient::new(
        resolve_endpoint(&config),
        &config.imds.api_version,
        config.imds.request_timeout,
        config.imds.first_call_timeout,
    )?);
    let identity = resolve_identity(&config, &client).await;
    let factory = EventFactory::new(
        &config.events.type_prefix,
        config.identity.source.as_deref(),
        identity,
        config.events.partition_key,
    );
    tracing::info!(
        endpoint = %client.base(),
        api_version = %config.imds.api_version,
        poll_interval = ?config.imds.poll_interval,
        vm_name = %factory.vm.name,
        source = %factory.source,
        sinks = config.sinks.len(),
        "Agent starting"
    );

    // Health checks run in each sink's own task (see fanout): a broker that is slow to answer
    // must not hold back the first poll, since a Preempt notice can be 30 s.
    let sinks = config.sinks.iter().map(SinkEntry::named).collect();
    let outbox = Outbox::open(
        &config.state.dir,
        config.delivery.queue_capacity,
        options.fresh_state,
    )?;
    // Restart recovery: the first document fetched is compared with the last one processed,
    // so whatever changed while the agent was down still yields its transitions.
    let previous = match outbox.last_document()? {
        None => None,
        Some(raw) => match Document::from_value(raw) {
            Ok(parsed) => {
                tracing::info!(
                    incarnation = parsed.document.incarnation,
                    "Resuming after the last processed document"
                );
                Some(parsed.document)
            }
            Err(error) => {
                return Err(StoreError::Corrupt {
                    path: config
                        .state
                        .dir
                        .join(crate::store::FILE_NAME)
                        .display()
                        .to_string(),
                    what: "last document",
                    reason: error.to_string(),
                }
                .into());
            }
        },
    };
    let outbox = Arc::new(outbox);
    let fanout = Fanout::start(sinks, &config.delivery, &config.state.dir, outbox.clone());
    let dry_run = options.dry_run || config.approvals.dry_run;
    if dry_run {
        tracing::warn!(
            "Dry run: approvals are checked and their outcomes published, but nothing is POSTed to the metadata service"
        );
    }
    let (latest, latest_rx) = tokio::sync::watch::channel(None);
    let (stop, stop_rx) = tokio::sync::watch::channel(false);
    if config.telemetry.listen.is_some() {
        crate::telemetry::prometheus();
    }
    let telemetry = Arc::new(crate::telemetry::Telemetry {
        first_poll_done: false.into(),
        sinks: fanout.health(),
        outbox: outbox.clone(),
        latest: latest_rx.clone(),
    });
    let remote = start_listener_and_sources(
        &config,
        telemetry.clone(),
        dry_run,
        Approver {
            config: config.approvals.clone(),
            dry_run,
            limits: sched_relay_core::approval::Limits {
                request_type: format!("{}.approval.requested", factory.type_prefix),
                max_message_bytes: config.approvals.max_message_bytes,
                max_event_ids: config.approvals.max_event_ids,
            },
            keys: crate::approval::keys::load_all(&config.approvals)
                .map_err(AgentError::Approvals)?,
            factory: factory.clone(),
            client: client.clone(),
            latest: latest_rx,
            poll_interval: config.imds.poll_interval,
            outbox: outbox.clone(),
            publisher: fanout.publisher(),
        },
        stop_rx,
    )
    .await?;

    let mut poller = Poller {
        client,
        factory,
        fanout,
        config: config.clone(),
        previous,
        approvals: HashMap::new(),
        latest,
        dry_run,
        telemetry,
        document_gauges: Vec::new(),
    };
    poller.poll_until(shutdown).await;
    let _ = stop.send(true);
    remote.stop().await;
    tracing::info!(timeout = ?config.delivery.shutdown_timeout, "Shutting down, draining sinks");
    poller
        .fanout
        .shutdown(config.delivery.shutdown_timeout)
        .await;
    tracing::info!("Agent stopped");
    Ok(())
}

fn resolve_endpoint(config: &Config) -> url::Url {
    let fallback = || url::Url::parse("http://169.254.169.254").expect("a valid URL");
    if config.imds.endpoint != "discover" {
        return url::Url::parse(&config.imds.endpoint).expect("validated by Config::validate");
    }
    match discover_endpoint(&config.imds.lease_paths) {
        Some((address, lease)) => {
            tracing::info!(address = %address, lease = %lease.display(), "Discovered the metadata endpoint from DHCP option 245");
            url::Url::parse(&format!("http://{address}")).unwrap_or_else(|_| fallback())
        }
        None => {
            tracing::warn!(searched = ?config.imds.lease_paths, "No DHCP lease with option 245 found; using 169.254.169.254");
            fallback()
        }
    }
}

/// Identity from configuration first, then `/metadata/instance/compute`, then the hostname.
async fn resolve_identity(config: &Config, client: &ImdsClient) -> Identity {
    let configured = &config.identity;
    let mut identity = Identity {
        name: configured.vm_name.clone().unwrap_or_default(),
        vm_id: configured.vm_id.clone(),
        resource_id: configured.resource_id.clone(),
    };
    let complete =
        !identity.name.is_empty() && identity.vm_id.is_some() && identity.resource_id.is_some();
    if configured.from_metadata && !complete {
        match client.identity().await {
            Ok(found) => {
                if identity.name.is_empty() {
                    identity.name = found.name;
                }
                identity.vm_id = identity.vm_id.or(found.vm_id);
                identity.resource_id = identity.resource_id.or(found.resource_id);
            }
            Err(error) => {
                tracing::warn!(error = %error, "Cannot read the VM identity from instance metadata")
            }
        }
    }
    if identity.name.is_empty() {
        identity.name = hostname();
        tracing::warn!(vm_name = %identity.name, "Using the hostname as the VM name; set identity.vm_name if it differs from the name in Resources");
    }
    identity
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .map(|name| name.trim().to_owned())
        .ok()
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "unknown".to_owned())
}

/// Where the agent stands with a local-policy approval of one EventId.
#[derive(Debug, Clone)]
enum ApprovalState {
    Done,
    Retry { attempts: u32, not_before: Instant },
}

struct Poller {
    client: Arc<ImdsClient>,
    factory: EventFactory,
    fanout: Fanout,
    config: Config,
    previous: Option<Document>,
    approvals: HashMap<String, ApprovalState>,
    /// The latest document, for the remote-approval checks.
    latest: tokio::sync::watch::Sender<Option<Snapshot>>,
    dry_run: bool,
    telemetry: Arc<crate::telemetry::Telemetry>,
    /// The (EventType, EventStatus) label pairs of the `sched_relay_document_events` gauge
    /// set for the last document, so they go back to 0 when events leave.
    document_gauges: Vec<(String, String)>,
}

impl Poller {
    async fn poll_until(&mut self, shutdown: impl Future<Output = ()>) {
        tokio::pin!(shutdown);
        let interval = self.config.imds.poll_interval;
        let mut failures: u32 = 0;
        let mut failing_since: Option<Instant> = None;
        let mut alerted = false;
        loop {
            let started = Instant::now();
            let fetched = tokio::select! {
                _ = &mut shutdown => return,
                fetched = self.client.fetch() => fetched,
            };
            metrics::counter!("sched_relay_imds_polls_total").increment(1);
            metrics::histogram!("sched_relay_imds_poll_duration_seconds")
                .record(started.elapsed().as_secs_f64());
            let wait = match fetched {
                Ok(parsed) => {
                    if failures > 0 {
                        tracing::info!(failures, "Metadata service answers again");
                    }
                    failures = 0;
                    failing_since = None;
                    alerted = false;
                    for warning in &parsed.warnings {
                        tracing::warn!(incarnation = parsed.document.incarnation, warning = %warning, "Tolerated an odd field in the document");
                    }
                    self.share(&parsed.document);
                    metrics::gauge!("sched_relay_imds_last_success_timestamp_seconds")
                        .set(Utc::now().timestamp() as f64);
                    let incarnation = parsed.document.incarnation;
                    let new_document = self.on_document(parsed.document).await;
                    // Ready once a fetched document is processed (its events stored).
                    if self
                        .previous
                        .as_ref()
                        .is_some_and(|previous| previous.incarnation == incarnation)
                    {
                        self.telemetry
                            .first_poll_done
                            .store(true, std::sync::atomic::Ordering::Relaxed);
                    }
                    self.apply_policy(new_document).await;
                    interval
                }
                Err(error) => {
                    failures += 1;
                    let since = *failing_since.get_or_insert(started);
                    metrics::counter!("sched_relay_imds_errors_total", "kind" => error.kind())
                        .increment(1);
                    let wait = crate::fanout::backoff(
                        failures - 1,
                        interval,
                        self.config.imds.max_backoff,
                    )
                    .max(interval);
                    if !alerted && since.elapsed() >= IMDS_FAILING_ALERT {
                        alerted = true;
                        tracing::error!(kind = error.kind(), failures, error = %error, "Metadata service failing for over 30 s; no events can be seen");
                    } else {
                        tracing::warn!(kind = error.kind(), failures, retry_in = ?wait, error = %error, "Metadata service request failed");
                    }
                    wait
                }
            };
            tokio::select! {
                _ = &mut shutdown => return,
                _ = tokio::time::sleep_until((started + wait).into()) => {}
            }
        }
    }

    /// `sched_relay_document_events{event_type, status}`: how many events of each kind the
    /// current document holds (kinds that left go back to 0).
    fn set_document_gauges(&mut self, document: &Document) {
        let mut counts: HashMap<(String, String), f64> = self
            .document_gauges
            .drain(..)
            .map(|labels| (labels, 0.0))
            .collect();
        for event in &document.events {
            let event_type = event
                .raw
                .get("EventType")
                .and_then(|t| t.as_str())
                .unwrap_or("unknown")
                .to_owned();
            *counts
                .entry((event_type, event.status.as_str().to_owned()))
                .or_default() += 1.0;
        }
        for ((event_type, status), count) in counts {
            metrics::gauge!("sched_relay_document_events", "event_type" => event_type.clone(), "status" => status.clone()).set(count);
            if count > 0.0 {
                self.document_gauges.push((event_type, status));
            }
        }
    }

    /// Tells the approval checks about the latest document (a copy only when it changed).
    fn share(&self, document: &Document) {
        self.latest.send_modify(|latest| match latest {
            Some(snapshot) if snapshot.document.incarnation == document.incarnation => {
                snapshot.fetched = Instant::now();
            }
            _ => {
                *latest = Some(Snapshot {
                    document: Arc::new(document.clone()),
                    fetched: Instant::now(),
                })
            }
        });
    }

    /// Diffs a fetched document against the previous one and publishes what changed.
    /// Returns whether the document was new (a new incarnation) and is now processed: its
    /// events are durable in the outbox.
    async fn on_document(&mut self, document: Document) -> bool {
        if let Some(previous) = &self.previous {
            if previous.incarnation == document.incarnation {
                return false;
            }
            if document.incarnation < previous.incarnation {
                tracing::warn!(
                    previous = previous.incarnation,
                    current = document.incarnation,
                    "DocumentIncarnation went backwards (service re-enabled?); diffing against the last document anyway"
                );
            }
        }
        let events = events_for_document(
            &self.factory,
            self.previous.as_ref(),
            &document,
            self.config.events.document_events,
            Utc::now(),
        );
        if let Err(error) = self.fanout.publish(&events, Some(&document.raw)).await {
            // Not processed: the next poll derives the same transitions again.
            tracing::error!(incarnation = document.incarnation, error = %error, "Cannot store the transitions of a new document; it will be processed again");
            return false;
        }
        for event in &events {
            let EventKind::Transition(kind) = event.kind() else {
                continue;
            };
            let transition = kind.as_str();
            let extension = |name| {
                event
                    .extension(name)
                    .map(|v| v.to_string())
                    .unwrap_or_default()
            };
            tracing::info!(
                event_id = event.subject().unwrap_or_default(),
                transition,
                incarnation = document.incarnation,
                event_type = %extension("eventtype"),
                status = %extension("eventstatus"),
                affects_vm = %extension("affectsvm"),
                id = %event.id(),
                "Transition"
            );
            metrics::counter!("sched_relay_transitions_total", "transition" => transition.to_owned()).increment(1);
        }
        metrics::gauge!("sched_relay_incarnation").set(document.incarnation as f64);
        self.set_document_gauges(&document);
        self.approvals.retain(|id, _| document.event(id).is_some());
        self.previous = Some(document);
        true
    }

    /// Approves, in one POST, every Scheduled event of the latest document that local policy
    /// allows and that has not been approved yet. Events are judged again on every new
    /// document (an update can bring this VM into Resources or shorten a Freeze); between
    /// documents only failed approvals whose retry time has come are tried again.
    async fn apply_policy(&mut self, new_document: bool) {
        let policy = &self.config.policy;
        let Some(document) = &self.previous else {
            return;
        };
        if !policy.is_enabled() {
            return;
        }
        let now = Instant::now();
        let mut approve: Vec<(String, String)> = Vec::new();
        for event in document
            .events
            .iter()
            .filter(|e| e.status == EventStatus::Scheduled)
        {
            match self.approvals.get(&event.id) {
                Some(ApprovalState::Done) => continue,
                Some(ApprovalState::Retry { not_before, .. }) if *not_before > now => continue,
                Some(ApprovalState::Retry { .. }) => {}
                None if !new_document => continue,
                None => {}
            }
            match policy::evaluate(policy, event, &self.factory.vm.name) {
                Decision::Approve(reason) => approve.push((event.id.clone(), reason)),
                Decision::Hold(reason) => {
                    tracing::debug!(event_id = %event.id, reason = %reason, "Not approved by local policy");
                }
            }
        }
        if approve.is_empty() {
            return;
        }
        let ids: Vec<String> = approve.iter().map(|(id, _)| id.clone()).collect();
        let result = if self.dry_run {
            Ok(())
        } else {
            self.client.start(&ids).await
        };
        let observed = Utc::now();
        let mut outcomes = Vec::new();
        for (event_id, reason) in approve {
            let outcome = |outcome, code: &str, detail: String| Outcome {
                outcome,
                request_id: format!("policy:{event_id}"),
                event_ids: vec![event_id.clone()],
                reason: code.to_owned(),
                detail,
                channel: "policy".to_owned(),
                dry_run: self.dry_run,
                nonce: None,
            };
            match &result {
                Ok(()) => {
                    metrics::counter!("sched_relay_approvals_total", "source" => "policy", "outcome" => "accepted", "reason" => "policy").increment(1);
                    self.approvals.insert(event_id.clone(), ApprovalState::Done);
                    let record = outcome(ApprovalOutcome::Accepted, "policy", reason.clone());
                    crate::approval::log_outcome(&record);
                    outcomes.push(self.factory.approval_outcome(&record, observed));
                }
                Err(error) => {
                    let attempts = match self.approvals.get(&event_id) {
                        Some(ApprovalState::Retry { attempts, .. }) => attempts + 1,
                        _ => 1,
                    };
                    if attempts >= POLICY_APPROVAL_ATTEMPTS || !error.is_retriable() {
                        tracing::error!(event_id = %event_id, attempts, error = %error, "Approval by local policy failed; the event will start at its NotBefore");
                        metrics::counter!("sched_relay_approvals_total", "source" => "policy", "outcome" => "failed", "reason" => "imds_error").increment(1);
                        self.approvals.insert(event_id.clone(), ApprovalState::Done);
                        let why =
                            format!("{reason}; the metadata service refused or failed: {error}");
                        let record = outcome(ApprovalOutcome::Failed, "imds_error", why);
                        outcomes.push(self.factory.approval_outcome(&record, observed));
                    } else {
                        let wait = crate::fanout::backoff(
                            attempts,
                            self.config.imds.poll_interval,
                            self.config.imds.max_backoff,
                        );
                        tracing::warn!(event_id = %event_id, attempts, retry_in = ?wait, error = %error, "Approval by local policy failed, will retry");
                        self.approvals.insert(
                            event_id.clone(),
                            ApprovalState::Retry {
                                attempts,
                                not_before: now + wait,
                            },
                        );
                    }
                }
            }
        }
        if let Err(error) = self.fanout.publish(&outcomes, None).await {
            tracing::error!(error = %error, "Cannot store the approval outcome events");
        }
    }
}

/// The state directory must exist and be writable before anything is promised.
pub fn check_state_dir(dir: &Path) -> Result<(), std::io::Error> {
    std::fs::create_dir_all(dir)?;
    let probe = dir.join(".write-test");
    std::fs::write(&probe, b"")?;
    std::fs::remove_file(probe)
}

/// The running remote-approval machinery: the checker task and its sources.
struct RemoteApprovals {
    approver: Option<tokio::task::JoinHandle<()>>,
    sources: Vec<tokio::task::JoinHandle<()>>,
}

impl RemoteApprovals {
    /// Lets each source finish the message it is handling, then lets the checker finish.
    async fn stop(self) {
        for source in self.sources {
            if tokio::time::timeout(SOURCE_STOP_TIMEOUT, source)
                .await
                .is_err()
            {
                tracing::warn!("An approval source did not stop in time");
            }
        }
        if let Some(approver) = self.approver {
            let _ = approver.await;
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
async fn start_listener_and_sources(
    config: &Config,
    telemetry: Arc<crate::telemetry::Telemetry>,
    dry_run: bool,
    approver: Approver,
    stop: tokio::sync::watch::Receiver<bool>,
) -> Result<RemoteApprovals, AgentError> {
    let approvals = &config.approvals;
    let vm_name = approver.factory.vm.name.clone();
    let (deliveries, inbox) = tokio::sync::mpsc::channel(64);
    let mut sources = Vec::new();
    let mut started = false;
    if let Some(listen) = config.telemetry.listen {
        let endpoint = match &approvals.http {
            Some(http) if http.enabled => {
                let token = sched_relay_transport::secret::resolve(
                    http.token.as_ref(),
                    http.token_file.as_deref(),
                    "approvals.http.token",
                )
                .map_err(AgentError::Approvals)?;
                Some(crate::http::ApprovalEndpoint {
                    deliveries: deliveries.clone(),
                    token,
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
            async move {
                let _ = stopped.wait_for(|stop| *stop).await;
            },
        )
        .await
        .map_err(|error| AgentError::Listen {
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
            connection: nats.resolve(&config.sinks).map_err(AgentError::Approvals)?,
            subject: for_vm(&nats.subject, &vm_name),
            fleet_subject: nats.fleet_subject.as_ref().map(|s| for_vm(s, &vm_name)),
            jetstream: nats
                .stream
                .as_ref()
                .map(|stream| (stream.clone(), for_vm(&nats.durable, &vm_name))),
        };
        sources.push(tokio::spawn(sched_relay_nats::source::run(
            spec,
            deliveries.clone(),
            stop.clone(),
        )));
        started = true;
    }
    #[cfg(feature = "amqp")]
    if let Some(amqp) = &approvals.amqp {
        use crate::approval::config::{BrokerSource, for_vm};
        let spec = sched_relay_amqp::source::AmqpSourceSpec {
            connection: amqp.resolve(&config.sinks).map_err(AgentError::Approvals)?,
            queue: for_vm(&amqp.queue, &vm_name),
            declare: amqp.declare,
            exchange: amqp.exchange.clone(),
            routing_key: for_vm(&amqp.routing_key, &vm_name),
            fleet_routing_key: amqp.fleet_routing_key.clone(),
            prefetch: amqp.prefetch,
            exclusive: false,
        };
        sources.push(tokio::spawn(sched_relay_amqp::source::run(
            spec,
            deliveries.clone(),
            stop.clone(),
        )));
        started = true;
    }
    #[cfg(feature = "kafka")]
    if let Some(kafka) = &approvals.kafka {
        use crate::approval::config::{BrokerSource, KafkaPartitions, for_vm};
        let spec = sched_relay_kafka::source::KafkaSourceSpec {
            connection: kafka
                .resolve(&config.sinks)
                .map_err(AgentError::Approvals)?,
            topic: kafka.topic.clone(),
            vm_name: vm_name.clone(),
            by_key: kafka.partitions == KafkaPartitions::Key,
            group_id: for_vm(&kafka.group_id, &vm_name),
            max_age: approvals.max_age,
        };
        sources.push(tokio::spawn(sched_relay_kafka::source::run(
            spec,
            deliveries.clone(),
            stop.clone(),
        )));
        started = true;
    }
    drop(deliveries);
    let approver = started.then(|| {
        tracing::info!(
            dry_run,
            keys = approvals.keys.len(),
            allow_unsigned = approvals.allow_unsigned,
            allow_fleet = approvals.allow_fleet,
            "Remote approvals enabled"
        );
        tokio::spawn(approver.run(inbox))
    });
    Ok(RemoteApprovals { approver, sources })
}
