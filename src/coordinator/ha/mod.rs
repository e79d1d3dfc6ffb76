//! High availability with NATS JetStream KV, no consensus of our own: at most one active
//! coordinator, by a lease, and the fleet's state in a KV bucket that every instance reads.
//!
//! - The lease is the key `leader` in the bucket `<bucket>-lease`, whose `max_age` is the
//!   lease period: a key not written again for a period disappears. An instance becomes
//!   active by creating the key (which fails while another holds it), and keeps it by
//!   updating it every quarter of a period with the revision it last wrote (which fails if
//!   anyone else wrote it since).
//! - The active instance acts (decides, drains, publishes) only while its last renewal is
//!   younger than two thirds of a period: one that stalls stops acting before its key can
//!   expire, so two instances never act at once. A failed renewal ends the process (its
//!   supervisor starts it again, as a standby).
//! - The lease's clock is CLOCK_BOOTTIME, which goes on while the machine sleeps: an
//!   instance whose VM was suspended knows its renewal is old when it wakes. A renewal whose
//!   answer was lost (the server wrote it) is recognised by reading the key back, and is no
//!   reason to stop.
//! - State: each event and agent is a key of `<bucket>` (hex-encoded names), handled message
//!   ids keys of `<bucket>-seen` (which expire after `forget_after`), written before the
//!   message is acknowledged or the action started, as with the embedded store, and read
//!   in bulk at takeover. Every state write is fenced ([`state`]): it expects the bucket's
//!   stream to end where this instance last saw it, so a stalled instance woken after a
//!   standby took over cannot overwrite anything; it stops. Keys are written one by one,
//!   not atomically: a crash between two keys leaves a message unacknowledged and applied
//!   again, which the fleet's rules make harmless (a report never moves backwards).

mod state;

pub use state::KvState;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use async_nats::jetstream::{self, kv};

use super::config::{HaConfig, LEASE_RANGE, default_lease};

/// The connection, the buckets and the lease's state.
pub struct Ha {
    state: kv::Store,
    /// Handled message ids, which expire by themselves after `forget_after`.
    seen: kv::Store,
    lease: kv::Store,
    js: jetstream::Context,
    /// The state bucket's name (its stream is `KV_<bucket>`).
    bucket: String,
    name: String,
    /// What this process writes in the lease: its name and a random token, so that another
    /// process given the same name (one configuration on two hosts) is never taken for it.
    holder: String,
    period: Duration,
    /// CLOCK_BOOTTIME milliseconds of the last successful renewal's sending.
    renewed: AtomicU64,
    /// The lease key's revision this instance last wrote (0: none).
    revision: AtomicU64,
    pub active: AtomicBool,
}

impl Ha {
    /// Connects (retrying while NATS is unreachable: a broker outage at start must not use
    /// up the supervisor's restarts) and opens or creates the buckets.
    pub async fn connect(config: &HaConfig, forget_after: Duration) -> Result<Arc<Ha>, String> {
        let connection = serde_json::from_value(serde_json::json!({
            "url": config.url, "credentials_file": config.credentials_file,
        }))
        .map_err(|e| format!("ha: {e}"))?;
        let client = loop {
            match sched_relay_nats::connect(&connection).await {
                Ok(client) => break client,
                Err(error) => {
                    tracing::warn!(error = %error, retry_in = "2s", "ha: cannot reach NATS for the lease");
                    tokio::time::sleep(Duration::from_secs(2)).await;
                }
            }
        };
        let js = jetstream::new(client);
        let replicas = config.replicas;
        // `max_age`: what the bucket must keep keys for; `None`: what it keeps them for where
        // it exists, the default lease where this instance makes it. Returns the store and
        // its keys' age as the server has it.
        let bucket = |name: String, max_age: Option<Duration>| {
            let js = js.clone();
            async move {
                // The bucket's stream as the KV design (ADR-8) lays it out, made only where
                // the server says there is none (a 404; any other error fails the start),
                // directly: the client's create_key_value first asks for account information
                // in a form NATS servers before 2.10 do not answer. One that exists is
                // returned as it is.
                let made = max_age.unwrap_or_else(default_lease);
                let stream = js
                    .get_or_create_stream(jetstream::stream::Config {
                        name: format!("KV_{name}"),
                        subjects: vec![format!("$KV.{name}.>")],
                        max_messages_per_subject: 1,
                        max_age: made,
                        storage: jetstream::stream::StorageType::File,
                        discard: jetstream::stream::DiscardPolicy::New,
                        allow_rollup: true,
                        deny_delete: true,
                        // Replicas answering reads directly could answer from behind.
                        allow_direct: replicas == 1,
                        num_replicas: replicas,
                        duplicate_window: if made.is_zero() {
                            Duration::from_secs(120)
                        } else {
                            made.min(Duration::from_secs(120))
                        },
                        ..Default::default()
                    })
                    .await
                    .map_err(|e| format!("ha: KV bucket {name:?}: {e}"))?;
                // A lease bucket made with another period expires keys at that period,
                // whatever this instance believes.
                let found = stream.cached_info().config.max_age;
                if let Some(max_age) = max_age
                    && found != max_age
                {
                    return Err(format!(
                        "ha: KV bucket {name:?} keeps keys for {}, this instance expects {}: give every instance the same lease and forget_after (to change them, delete the stream KV_{name} while no coordinator runs)",
                        humantime::format_duration(found),
                        humantime::format_duration(max_age)
                    ));
                }
                let store = js
                    .get_key_value(&name)
                    .await
                    .map_err(|e| format!("ha: KV bucket {name:?}: {e}"))?;
                Ok((store, found))
            }
        };
        let (state, _) = bucket(config.bucket.clone(), Some(Duration::ZERO)).await?;
        let (seen, _) = bucket(format!("{}-seen", config.bucket), Some(forget_after)).await?;
        // Unset, the lease is the bucket's: instances started with another default (an
        // upgrade, one at a time) share the period of the bucket they found.
        let (lease, period) = bucket(format!("{}-lease", config.bucket), config.lease).await?;
        // One made by hand (`nats kv add` without a TTL keeps keys for ever) would never let
        // a standby in.
        if !LEASE_RANGE.contains(&period) {
            return Err(format!(
                "ha: KV bucket \"{}-lease\" keeps keys for {}, outside the 2s..5m a lease may be: delete the stream KV_{}-lease while no coordinator runs, and let a coordinator make it",
                config.bucket,
                humantime::format_duration(period),
                config.bucket
            ));
        }
        if config.lease.is_none() {
            tracing::info!(lease = %humantime::format_duration(period), "ha: the lease bucket's period");
        }
        let name = config.instance.clone().unwrap_or_else(|| {
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|h| h.trim().to_owned())
                .unwrap_or_else(|_| "coordinator".into());
            format!("{host}-{}", std::process::id())
        });
        Ok(Arc::new(Ha {
            state,
            seen,
            lease,
            js,
            bucket: config.bucket.clone(),
            holder: format!("{name}#{:016x}", fastrand::u64(..)),
            name,
            period,
            renewed: AtomicU64::new(0),
            revision: AtomicU64::new(0),
            active: AtomicBool::new(false),
        }))
    }

    /// Waits until this instance holds the lease, trying every [`standby_poll`]; returns the
    /// revision it wrote.
    pub async fn acquire(&self) -> u64 {
        let mut logged = false;
        loop {
            let sent = now();
            match self
                .lease
                .create("leader", self.holder.clone().into())
                .await
            {
                Ok(revision) => {
                    self.renewed.store(sent, Ordering::SeqCst);
                    self.revision.store(revision, Ordering::SeqCst);
                    self.active.store(true, Ordering::SeqCst);
                    tracing::info!(instance = %self.name, "Lease acquired: this coordinator is active");
                    return revision;
                }
                Err(error) => {
                    if !logged {
                        let holder = self
                            .lease
                            .get("leader")
                            .await
                            .ok()
                            .flatten()
                            .map(|v| String::from_utf8_lossy(&v).into_owned());
                        tracing::info!(instance = %self.name, holder = ?holder, error = %error, "Standby: another coordinator holds the lease");
                        logged = true;
                    }
                    tokio::time::sleep(standby_poll(self.period)).await;
                }
            }
        }
    }

    /// Renews every [`renew_every`] from the last renewal's sending, on a task of its own
    /// (the engine's work never delays it). A renewal counts from when it was sent, so a
    /// slow answer only shortens the time this instance may act. A failed renewal whose write the server made anyway (the
    /// answer was lost) is recognised by reading the key back: still ours, at a later
    /// revision. Another failure is tried again while the last renewal is fresh (a NATS
    /// blip); when it is not, or another instance wrote the key, returns why.
    pub async fn keep(self: Arc<Self>, mut revision: u64) -> String {
        // Each renewal a quarter of a period after the one before was sent, however long its
        // answer took: a slow answer does not push the next one back.
        let mut next = tokio::time::Instant::now() + renew_every(self.period);
        loop {
            tokio::time::sleep_until(next).await;
            next = tokio::time::Instant::now() + renew_every(self.period);
            let sent = now();
            let error = match self
                .lease
                .update("leader", self.holder.clone().into(), revision)
                .await
            {
                Ok(next) => {
                    revision = next;
                    self.revision.store(next, Ordering::SeqCst);
                    self.renewed.store(sent, Ordering::SeqCst);
                    continue;
                }
                Err(error) => error,
            };
            match self.lease.entry("leader").await {
                // Our own write, whose answer was lost: the key is ours and fresh.
                Ok(Some(entry))
                    if entry.value.as_ref() == self.holder.as_bytes()
                        && entry.revision > revision
                        && entry.operation == kv::Operation::Put =>
                {
                    tracing::warn!(error = %error, "ha: a lease renewal's answer was lost; the server had written it");
                    revision = entry.revision;
                    self.revision.store(revision, Ordering::SeqCst);
                    self.renewed.store(sent, Ordering::SeqCst);
                }
                Ok(Some(entry))
                    if entry.value.as_ref() != self.holder.as_bytes()
                        && entry.operation == kv::Operation::Put =>
                {
                    self.active.store(false, Ordering::SeqCst);
                    return format!(
                        "the lease is held by {}; another coordinator is active",
                        String::from_utf8_lossy(&entry.value)
                    );
                }
                _ if self.may_act() => {
                    tracing::warn!(error = %error, "ha: the lease could not be renewed; trying again");
                }
                _ => {
                    self.active.store(false, Ordering::SeqCst);
                    return format!(
                        "the lease could not be renewed ({error}); another coordinator may be active"
                    );
                }
            }
        }
    }

    /// Gives the lease up at a planned stop, so that a standby takes over at once: only
    /// the revision this instance wrote (a lease another took meanwhile stays theirs).
    pub async fn release(&self) {
        if self.may_act() {
            self.active.store(false, Ordering::SeqCst);
            let revision = self.revision.load(Ordering::SeqCst);
            if let Err(error) = self
                .lease
                .delete_expect_revision("leader", Some(revision))
                .await
            {
                tracing::warn!(error = %error, "ha: cannot release the lease (or it is not ours any more); a standby takes over when it expires");
            }
        }
    }

    /// This instance may act: it holds the lease and sent its last successful renewal less
    /// than two thirds of a period ago (the key lives a period from when the server wrote
    /// it, which is after the renewal was sent).
    pub fn may_act(&self) -> bool {
        let since = now().saturating_sub(self.renewed.load(Ordering::SeqCst));
        self.active.load(Ordering::SeqCst) && since < (self.period * 2 / 3).as_millis() as u64
    }

    /// The state in the buckets, fenced by the state stream's sequence, and written only
    /// while this instance's lease is fresh (checked before every key).
    pub fn state(self: &Arc<Self>) -> KvState {
        let ha = self.clone();
        KvState::new(
            self.state.clone(),
            self.seen.clone(),
            self.js.clone(),
            self.bucket.clone(),
            Some(Arc::new(move || ha.may_act())),
        )
    }

    /// The state without the lease check: the fence alone (tests).
    #[cfg(test)]
    fn state_without_lease(&self) -> KvState {
        KvState::new(
            self.state.clone(),
            self.seen.clone(),
            self.js.clone(),
            self.bucket.clone(),
            None,
        )
    }
}

/// Milliseconds of CLOCK_BOOTTIME: monotonic, and going on while the machine is suspended
/// (CLOCK_MONOTONIC, behind `Instant`, stops then: a VM that slept would believe its
/// renewal fresh).
fn now() -> u64 {
    #[cfg(target_os = "linux")]
    {
        let t = rustix::time::clock_gettime(rustix::time::ClockId::Boottime);
        (t.tv_sec as u64) * 1000 + (t.tv_nsec as u64) / 1_000_000
    }
    #[cfg(not(target_os = "linux"))]
    {
        use std::sync::OnceLock;
        static ORIGIN: OnceLock<std::time::Instant> = OnceLock::new();
        ORIGIN
            .get_or_init(std::time::Instant::now)
            .elapsed()
            .as_millis() as u64
    }
}

#[cfg(test)]
mod tests;

/// How often the active instance renews its lease: a quarter of a period. It acts while
/// its last renewal is younger than two thirds, so a NATS stall of up to 5/12 of a period
/// (3.3 s of the default 8 s) never pauses it, and a stall of the instance itself lets a
/// standby in no sooner than three quarters of a period after it (6 s).
pub(crate) fn renew_every(period: Duration) -> Duration {
    period / 4
}

/// How often a standby tries to take the lease: a twelfth of a period, at most 250 ms, so
/// that it takes over within a quarter of a second of the lease's expiry (a create, which
/// the server refuses while the lease is held, then a read of the key: eight requests a
/// second).
fn standby_poll(period: Duration) -> Duration {
    (period / 12).min(Duration::from_millis(250))
}
