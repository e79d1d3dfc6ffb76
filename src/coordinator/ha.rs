//! High availability with NATS JetStream KV, no consensus of our own: at most one active
//! coordinator, by a lease, and the fleet's state in a KV bucket that every instance reads.
//!
//! - The lease is the key `leader` in the bucket `<bucket>-lease`, whose `max_age` is the
//!   lease period: a key not written again for a period disappears. An instance becomes
//!   active by creating the key (which fails while another holds it), and keeps it by
//!   updating it every third of a period with the revision it last wrote (which fails if
//!   anyone else wrote it since).
//! - The active instance acts (decides, drains, publishes) only while its last renewal is
//!   younger than two thirds of a period: one that stalls stops acting before its key can
//!   expire, so two instances never act at once. A failed renewal ends the process (its
//!   supervisor starts it again, as a standby).
//! - State: each event, agent and handled message id is a key of `<bucket>` (hex-encoded
//!   names), written before the message is acknowledged or the action started, as with the
//!   embedded store. Keys are written one by one, not atomically: a crash between two keys
//!   leaves a message unacknowledged and applied again, which the fleet's rules make
//!   harmless (a report never moves backwards).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, kv};
use chrono::{DateTime, Utc};
use futures_util::StreamExt;

use super::config::HaConfig;
use super::fleet::{Fleet, Maintenance, Vm};
use super::store::Changes;

/// The connection, the buckets and the lease's state.
pub struct Ha {
    state: kv::Store,
    /// Handled message ids, which expire by themselves after `forget_after`.
    seen: kv::Store,
    lease: kv::Store,
    js: jetstream::Context,
    name: String,
    period: Duration,
    origin: Instant,
    /// Milliseconds since `origin` of the last successful renewal.
    renewed: AtomicU64,
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
        let bucket = |name: String, max_age: Duration| {
            let js = js.clone();
            async move {
                if let Ok(store) = js.get_key_value(&name).await {
                    // A lease bucket made with another period would expire keys at that
                    // period, whatever this instance believes.
                    let mut stream = js
                        .get_stream(format!("KV_{name}"))
                        .await
                        .map_err(|e| format!("ha: KV bucket {name:?}: {e}"))?;
                    let found = stream
                        .info()
                        .await
                        .map_err(|e| format!("ha: KV bucket {name:?}: {e}"))?
                        .config
                        .max_age;
                    if found != max_age {
                        return Err(format!(
                            "ha: KV bucket {name:?} keeps keys for {}, this instance expects {}: give every instance the same lease and forget_after (to change them, delete the stream KV_{name} while no coordinator runs)",
                            humantime::format_duration(found),
                            humantime::format_duration(max_age)
                        ));
                    }
                    return Ok(store);
                }
                // The bucket's stream as the KV design (ADR-8) lays it out, created directly:
                // the client's create_key_value first asks for account information in a form
                // NATS servers before 2.10 do not answer.
                js.get_or_create_stream(jetstream::stream::Config {
                    name: format!("KV_{name}"),
                    subjects: vec![format!("$KV.{name}.>")],
                    max_messages_per_subject: 1,
                    max_age,
                    storage: jetstream::stream::StorageType::File,
                    discard: jetstream::stream::DiscardPolicy::New,
                    allow_rollup: true,
                    deny_delete: true,
                    // Replicas answering reads directly could answer from behind.
                    allow_direct: replicas == 1,
                    num_replicas: replicas,
                    duplicate_window: if max_age.is_zero() {
                        Duration::from_secs(120)
                    } else {
                        max_age.min(Duration::from_secs(120))
                    },
                    ..Default::default()
                })
                .await
                .map_err(|e| format!("ha: KV bucket {name:?}: {e}"))?;
                js.get_key_value(&name)
                    .await
                    .map_err(|e| format!("ha: KV bucket {name:?}: {e}"))
            }
        };
        let state = bucket(config.bucket.clone(), Duration::ZERO).await?;
        let seen = bucket(format!("{}-seen", config.bucket), forget_after).await?;
        let lease = bucket(format!("{}-lease", config.bucket), config.lease).await?;
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
            name,
            period: config.lease,
            origin: Instant::now(),
            renewed: AtomicU64::new(0),
            active: AtomicBool::new(false),
        }))
    }

    /// Waits until this instance holds the lease; returns the revision it wrote.
    pub async fn acquire(&self) -> u64 {
        let mut logged = false;
        loop {
            let sent = self.now();
            match self.lease.create("leader", self.name.clone().into()).await {
                Ok(revision) => {
                    self.renewed.store(sent, Ordering::SeqCst);
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
                    tokio::time::sleep(self.period / 3).await;
                }
            }
        }
    }

    /// Renews every third of a period, on a task of its own (the engine's work never delays
    /// it). A renewal counts from when it was sent, so a slow answer only shortens the time
    /// this instance may act. A failure is tried again while the last renewal is fresh
    /// (a NATS blip); when it is not, or another instance wrote the key, returns why.
    pub async fn keep(self: Arc<Self>, mut revision: u64) -> String {
        loop {
            tokio::time::sleep(self.period / 3).await;
            let sent = self.now();
            match self
                .lease
                .update("leader", self.name.clone().into(), revision)
                .await
            {
                Ok(next) => {
                    revision = next;
                    self.renewed.store(sent, Ordering::SeqCst);
                }
                Err(error) if self.may_act() && self.holder().await.is_none() => {
                    tracing::warn!(error = %error, "ha: the lease could not be renewed; trying again");
                }
                Err(error) => {
                    self.active.store(false, Ordering::SeqCst);
                    return format!(
                        "the lease could not be renewed ({error}); another coordinator may be active"
                    );
                }
            }
        }
    }

    /// Who holds the lease, if the key can be read and someone else does.
    async fn holder(&self) -> Option<String> {
        let value = self.lease.get("leader").await.ok().flatten()?;
        let holder = String::from_utf8_lossy(&value).into_owned();
        (holder != self.name).then_some(holder)
    }

    /// Gives the lease up at a planned stop, so that a standby takes over at once.
    pub async fn release(&self) {
        if self.may_act() {
            self.active.store(false, Ordering::SeqCst);
            if let Err(error) = self.lease.delete("leader").await {
                tracing::warn!(error = %error, "ha: cannot release the lease; a standby takes over when it expires");
            }
        }
    }

    fn now(&self) -> u64 {
        self.origin.elapsed().as_millis() as u64
    }

    /// This instance may act: it holds the lease and sent its last successful renewal less
    /// than two thirds of a period ago (the key lives a period from when the server wrote
    /// it, which is after the renewal was sent).
    pub fn may_act(&self) -> bool {
        let since = self
            .now()
            .saturating_sub(self.renewed.load(Ordering::SeqCst));
        self.active.load(Ordering::SeqCst) && since < (self.period * 2 / 3).as_millis() as u64
    }

    pub fn state(&self) -> KvState {
        let _ = &self.js;
        KvState {
            store: self.state.clone(),
            seen: self.seen.clone(),
        }
    }
}

/// The fleet's state in the KV bucket.
pub struct KvState {
    store: kv::Store,
    seen: kv::Store,
}

fn hex(text: &str) -> String {
    text.bytes().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<String> {
    let bytes: Option<Vec<u8>> = (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect();
    String::from_utf8(bytes?).ok()
}

/// Runs `future` to its end from the engine's synchronous code (the multi-thread runtime
/// lets this worker block while others run).
fn wait<T>(future: impl std::future::Future<Output = T>) -> T {
    tokio::task::block_in_place(|| tokio::runtime::Handle::current().block_on(future))
}

/// Every live key of a bucket with its value.
async fn entries(store: &kv::Store) -> Result<Vec<(String, Vec<u8>)>, String> {
    let mut keys = store.keys().await.map_err(|e| e.to_string())?;
    let mut names = Vec::new();
    while let Some(key) = keys.next().await {
        names.push(key.map_err(|e| e.to_string())?);
    }
    let mut entries = Vec::with_capacity(names.len());
    for key in names {
        if let Some(value) = store.get(&key).await.map_err(|e| e.to_string())? {
            entries.push((key, value.to_vec()));
        }
    }
    Ok(entries)
}

impl KvState {
    pub fn load(&self) -> Result<Fleet, String> {
        wait(async {
            let mut fleet = Fleet::default();
            for (key, value) in entries(&self.store).await? {
                let (kind, name) = key.split_once('.').unwrap_or(("", ""));
                let name = unhex(name).ok_or(format!("KV key {key:?} is not ours"))?;
                match kind {
                    "e" => {
                        let m: Maintenance = serde_json::from_slice(&value)
                            .map_err(|e| format!("KV event {name}: {e}"))?;
                        fleet.events.insert(name, m);
                    }
                    "v" => {
                        let vm: Vm = serde_json::from_slice(&value)
                            .map_err(|e| format!("KV VM {name}: {e}"))?;
                        fleet.vms.insert(name, vm);
                    }
                    "c" if name == "paused" => {
                        fleet.paused = Some(
                            serde_json::from_slice(&value)
                                .map_err(|e| format!("KV pause switch: {e}"))?,
                        );
                    }
                    _ => {}
                }
            }
            for (key, value) in entries(&self.seen).await? {
                let name = key.strip_prefix("s.").and_then(unhex).unwrap_or_default();
                let (source, id) = name.split_once('\n').unwrap_or((&name, ""));
                let at: i64 = String::from_utf8_lossy(&value).parse().unwrap_or(0);
                fleet.seen.insert(
                    (source.to_owned(), id.to_owned()),
                    DateTime::<Utc>::from_timestamp(at, 0).unwrap_or_default(),
                );
            }
            Ok(fleet)
        })
    }

    /// Writes the changes key by key: events and agents first, the ids of the messages
    /// that caused them last (so that a crash in between applies them again).
    pub fn write(&self, changes: &Changes) -> Result<(), String> {
        wait(async {
            for (key, m) in &changes.events {
                let key = format!("e.{}", hex(key));
                match m {
                    Some(m) => {
                        let json = serde_json::to_vec(m).map_err(|e| e.to_string())?;
                        self.store
                            .put(&key, json.into())
                            .await
                            .map_err(|e| e.to_string())?;
                    }
                    None => self.store.delete(&key).await.map_err(|e| e.to_string())?,
                }
            }
            for (name, vm) in &changes.vms {
                let json = serde_json::to_vec(vm).map_err(|e| e.to_string())?;
                self.store
                    .put(format!("v.{}", hex(name)), json.into())
                    .await
                    .map_err(|e| e.to_string())?;
            }
            for name in &changes.vms_removed {
                self.store
                    .delete(format!("v.{}", hex(name)))
                    .await
                    .map_err(|e| e.to_string())?;
            }
            match &changes.paused {
                Some(Some(pause)) => {
                    let json = serde_json::to_vec(pause).map_err(|e| e.to_string())?;
                    self.store
                        .put(format!("c.{}", hex("paused")), json.into())
                        .await
                        .map_err(|e| e.to_string())?;
                }
                Some(None) => self
                    .store
                    .delete(format!("c.{}", hex("paused")))
                    .await
                    .map_err(|e| e.to_string())?,
                None => {}
            }
            for ((source, id), at) in &changes.seen {
                self.store
                    .put(
                        format!("s.{}", hex(&format!("{source}\n{id}"))),
                        at.timestamp().to_string().into(),
                    )
                    .await
                    .map_err(|e| e.to_string())?;
            }
            for (source, id) in &changes.unseen {
                self.store
                    .delete(format!("s.{}", hex(&format!("{source}\n{id}"))))
                    .await
                    .map_err(|e| e.to_string())?;
            }
            Ok(())
        })
    }
}
