//! The agent's wiring: [`run`] opens the state store, starts the fan-out, resolves who this
//! VM is ([`identity`]; events wait for it), starts the listener and the approval sources,
//! then hands over to the poller until shutdown, and drains.
//!
//! The data path reads top to bottom: `imds` fetch -> `diff` -> `event` -> `store` ->
//! `fanout` -> sinks ([`poller`]); local approvals are in [`local_policy`], remote ones in
//! `crate::approval`. IMDS errors never produce transitions: a failed or malformed fetch
//! leaves the previous document in place, so the next good document is diffed against the
//! last good one.

mod chores;
mod heartbeat;
mod identity;
mod local_policy;
mod poll_timer;
mod poller;
mod transitions;

use std::future::Future;
use std::sync::Arc;

use sched_relay_core::document::Document;
use sched_relay_core::event::EventFactory;

use crate::approval::{self, Approver};
use crate::config::Config;
use crate::fanout::Fanout;
use crate::imds::{ImdsClient, ImdsError};
use crate::sinks::registry;
use crate::store::{DiskFaults, Outbox, StoreError};
use heartbeat::Heartbeats;
use local_policy::LocalPolicy;
use poller::Poller;

/// How long the metadata service stays enabled after a request, with a margin (Azure: 24 h).
const IMDS_ENABLED_FOR: i64 = 23 * 3600;

/// How long a local-policy POST under way at shutdown may take to finish.
const POLICY_STOP_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

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
    #[error(transparent)]
    Sources(#[from] approval::sources::StartError),
    #[error("approvals: {0}")]
    Approvals(String),
    #[error(
        "the approval checker died ({0}); stopping, so that the supervisor starts the agent afresh with remote approvals working"
    )]
    CheckerDied(String),
    #[error("the poller stopped: {0}; stopping, so that the supervisor starts the agent afresh")]
    PollerDied(String),
}

/// How `run` starts, beyond the configuration.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Move an existing (say, damaged) state store aside and start afresh.
    pub fresh_state: bool,
    /// Check approvals (remote and by policy) and publish their outcomes, but POST nothing.
    pub dry_run: bool,
    /// Tests only: open the state store through this in-process fault injector (a disk that
    /// a test fills and frees).
    pub disk_faults: Option<Arc<DiskFaults>>,
}

/// Runs the agent until `shutdown` completes, then drains the sinks and returns.
pub async fn run(
    config: Config,
    options: RunOptions,
    shutdown: impl Future<Output = ()>,
) -> Result<(), AgentError> {
    // What every heartbeat says as `startedAt`: this agent process began here.
    let started_at = chrono::Utc::now();
    for warning in config.warnings() {
        tracing::warn!(key = %warning.path, "Configuration: {}", warning.message);
    }
    crate::store::check_state_dir(&config.state.dir).map_err(|error| AgentError::StateDir {
        path: config.state.dir.display().to_string(),
        error,
    })?;
    let client = Arc::new(ImdsClient::new(
        crate::imds::resolve_endpoint(&config.imds),
        &config.imds.api_version,
        config.imds.request_timeout,
        config.imds.first_call_timeout,
    )?);
    // Health checks run in each sink's own task (see fanout): a broker that is slow to answer
    // must not hold back the first poll, since a Preempt notice can be 30 s.
    let sinks = config.sinks.iter().map(registry::named).collect();
    let outbox = match options.disk_faults.clone() {
        None => Outbox::open(
            &config.state.dir,
            config.delivery.queue_capacity,
            options.fresh_state,
        )?,
        Some(faults) => {
            Outbox::open_with_faults(&config.state.dir, config.delivery.queue_capacity, faults)?
        }
    };
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
    let previous = (previous, outbox.last_epoch()?);
    // The service stays enabled for a day after a request: if it answered this agent within
    // that day, the first poll after a restart needs no long first-call timeout.
    let answered_at = outbox
        .meta(crate::store::IMDS_ANSWERED)
        .ok()
        .flatten()
        .and_then(|value| value.as_i64());
    if answered_at.is_some_and(|at| chrono::Utc::now().timestamp() - at < IMDS_ENABLED_FOR) {
        client.assume_enabled();
    }
    // What this agent approved before a restart still counts when such an event turns out
    // gone (it probably ran while the agent was down, say because this VM rebooted).
    let accepted: Vec<String> = outbox
        .meta(crate::store::ACCEPTED_EVENT_IDS)
        .ok()
        .flatten()
        .and_then(|value| serde_json::from_value(value).ok())
        .unwrap_or_default();
    client.restore_accepted(&accepted);
    // A renamed or removed sink leaves a backlog nothing delivers: say so, once.
    let configured: Vec<String> = config.sinks.iter().map(|s| s.name.clone()).collect();
    let orphaned = crate::orphans::find(&outbox, &configured)?;
    let outbox = Arc::new(outbox);
    let fanout = Fanout::start(sinks, &config.delivery, &config.state.dir, outbox.clone());
    // `--dry-run` overrides the file: from here on the configuration is the one truth.
    let mut config = config;
    config.approvals.dry_run |= options.dry_run;
    if config.approvals.dry_run {
        tracing::warn!(
            "Dry run: approvals are checked and their outcomes published, but nothing is POSTed to the metadata service"
        );
    }
    let (latest, latest_rx) = tokio::sync::watch::channel(None);
    let (stop, stop_rx) = tokio::sync::watch::channel(false);
    if config.telemetry.listen.is_some() {
        crate::telemetry::prometheus();
    }
    crate::orphans::report(&orphaned);
    let mut telemetry =
        crate::telemetry::Telemetry::new(fanout.health(), outbox.clone(), latest_rx.clone())
            .with_imds_unready_after(config.imds.unready_after);
    telemetry.orphaned = orphaned;
    let telemetry = Arc::new(telemetry);
    // Nothing is derived before the VM is named: the name decides affectsvm, policy,
    // approval targeting and the source (see `identity`).
    tokio::pin!(shutdown);
    let resolved =
        identity::resolve(&config, &client, &outbox, &telemetry, shutdown.as_mut()).await?;
    let Some(identity) = resolved else {
        tracing::info!("Stopped before the VM identity was known; draining sinks");
        fanout.shutdown(config.delivery.shutdown_timeout).await;
        return Ok(());
    };
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
    let approver = Approver::new(
        &config.approvals,
        factory.clone(),
        client.clone(),
        latest_rx,
        config.imds.poll_interval,
        fanout.publisher(),
    )
    .map_err(AgentError::Approvals)?;
    let mut remote = approval::sources::start_listener_and_sources(
        &config.approvals,
        &config.sinks,
        config.telemetry.listen,
        (&config.telemetry).into(),
        telemetry.clone(),
        approver,
        stop_rx,
    )
    .await?;

    // Local policy runs beside the poller, so its POSTs never delay a poll.
    let (policy, policy_task) = if config.policy.is_enabled() {
        let (documents, documents_rx) = tokio::sync::watch::channel(None);
        let task = LocalPolicy::new(
            config.policy.clone(),
            client.clone(),
            factory.clone(),
            fanout.publisher(),
            config.approvals.dry_run,
        )
        .run(documents_rx);
        (Some(documents), Some(tokio::spawn(task)))
    } else {
        (None, None)
    };
    let shutdown_timeout = config.delivery.shutdown_timeout;
    let heartbeats = Heartbeats::new(config.events.heartbeat_interval, started_at);
    let poller = Poller::new(config, client, factory, fanout, telemetry, latest, previous)
        .with_policy(policy)
        .with_heartbeats(heartbeats);
    let checker_failed = remote.checker_failed();
    let mut checker_died = None;
    let (stop_polling, polling_stopped) = tokio::sync::watch::channel(false);
    let polling = poller.poll_on_own_thread(polling_stopped);
    tokio::pin!(polling);
    let polled = tokio::select! {
        () = shutdown => None,
        why = checker_failed => {
            tracing::error!(why = %why, "The approval checker died; stopping the agent so that its supervisor restarts it");
            checker_died = Some(why);
            None
        }
        polled = &mut polling => Some(polled),
    };
    let _ = stop_polling.send(true);
    let mut poller = match polled {
        Some(polled) => polled,
        None => polling.await,
    }
    .map_err(AgentError::PollerDied)?;
    // Transitions seen while the store could not be written live only in memory: one last
    // try, then name each one, so a restart to "fix" a full disk never loses them silently.
    // One deadline for everything that stops, taken when the stop begins, so the agent exits
    // within delivery.shutdown_timeout (systemd's stop timeout must only be longer).
    let deadline = tokio::time::Instant::now() + shutdown_timeout;
    poller.store_unstored_at_exit(deadline).await;
    tracing::info!(timeout = ?shutdown_timeout, "Shutting down: stopping approvals, draining sinks");
    let _ = stop.send(true);
    poller.policy = None;
    if let Some(mut task) = policy_task {
        // A POST under way may finish (its outcome is then stored); one that hangs is given up:
        // approving is idempotent, and an unapproved event starts at its NotBefore.
        let grace = deadline.min(tokio::time::Instant::now() + POLICY_STOP_GRACE);
        if tokio::time::timeout_at(grace, &mut task).await.is_err() {
            task.abort();
        }
    }
    // Approvals get at most half the time: a POST that hangs must leave the sinks time to
    // deliver what is left (the last events before a Spot eviction).
    let now = tokio::time::Instant::now();
    let half = now + deadline.saturating_duration_since(now) / 2;
    remote.stop(half).await;
    poller.fanout.shutdown_by(deadline).await;
    tracing::info!("Agent stopped");
    match checker_died {
        Some(why) => Err(AgentError::CheckerDied(why)),
        None => Ok(()),
    }
}
