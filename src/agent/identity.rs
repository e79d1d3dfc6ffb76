//! Start-up: who this VM is, before any event is derived. While instance metadata cannot
//! name the VM the agent retries (every few seconds) and derives nothing: the first
//! document after that is diffed against the last processed one, so events are delayed,
//! never lost or sent under a wrong name. Meanwhile `/readyz` says why it is not ready,
//! from an interim listener that gives way to the real one.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use sched_relay_core::event::Identity;

use crate::config::Config;
use crate::imds::{IdentityResolver, ImdsClient, identity_from_json, identity_to_json};
use crate::store::{IDENTITY, Outbox, StoreError};
use crate::telemetry::Telemetry;

/// How long the interim listener gets to close its connections.
const INTERIM_STOP: std::time::Duration = std::time::Duration::from_secs(2);

/// The VM identity, or `None` when `shutdown` came first. An identity instance metadata
/// answered is kept in the state store for the runs where it fails.
pub(super) async fn resolve<S: Future<Output = ()>>(
    config: &Config,
    client: &ImdsClient,
    outbox: &Outbox,
    telemetry: &Arc<Telemetry>,
    mut shutdown: Pin<&mut S>,
) -> Result<Option<Identity>, StoreError> {
    let stored = match outbox.meta(IDENTITY)? {
        None => None,
        Some(value) => match identity_from_json(&value) {
            Ok(identity) => Some(identity),
            Err(error) => {
                tracing::warn!(error = %error, "The VM identity kept in the state store is unreadable; ignoring it");
                None
            }
        },
    };
    let mut resolver = IdentityResolver::new(&config.identity, stored.clone());
    let mut interim = None;
    let resolved = loop {
        if let Ok(found) = resolver.attempt(client).await {
            break Some(found);
        }
        telemetry.identity_pending.store(true, Ordering::Relaxed);
        if interim.is_none()
            && let Some(listen) = config.telemetry.listen
        {
            interim =
                Some(interim_listener(listen, telemetry.clone(), (&config.telemetry).into()).await);
        }
        tokio::select! {
            _ = &mut shutdown => break None,
            _ = tokio::time::sleep(resolver.next_wait()) => {}
        }
    };
    telemetry.identity_pending.store(false, Ordering::Relaxed);
    if let Some(Some((stop, mut task))) = interim {
        let _ = stop.send(());
        // The real listener binds the same address next; a client holding a connection
        // open must not keep it.
        if tokio::time::timeout(INTERIM_STOP, &mut task).await.is_err() {
            task.abort();
            let _ = task.await;
        }
    }
    let Some((identity, origin)) = resolved else {
        return Ok(None);
    };
    tracing::info!(vm_name = %identity.name, origin = ?origin, "VM identity resolved");
    if let Some(answered) = resolver.answered().map(identity_to_json)
        && stored.as_ref().map(identity_to_json) != Some(answered.clone())
    {
        // Not fatal: this run knows who it is; only a later run with failing metadata would
        // miss it, and that run asks again first.
        if let Err(error) = outbox.set_meta(IDENTITY, &answered) {
            tracing::warn!(error = %error, "Cannot keep the VM identity in the state store");
        }
    }
    Ok(Some(identity))
}

/// Serves `/healthz`, `/readyz`, `/metrics` and `/events` (no approvals) until stopped.
async fn interim_listener(
    listen: std::net::SocketAddr,
    telemetry: Arc<Telemetry>,
    limits: crate::http::Limits,
) -> Option<(
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
)> {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    match crate::http::serve(listen, telemetry, None, 0, limits, async move {
        let _ = stopped.await;
    })
    .await
    {
        Ok((_, task)) => Some((stop, task)),
        Err(error) => {
            tracing::warn!(address = %listen, error = %error, "Cannot listen while the VM identity is unresolved");
            None
        }
    }
}
