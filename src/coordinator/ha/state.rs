//! The fleet's state in NATS KV, fenced.
//!
//! Every write to the state bucket expects the bucket's stream to end at the sequence this
//! instance last saw (`Nats-Expected-Last-Sequence`): the stream's sequence is the fencing
//! token. An instance stalled after its lease check, woken after a standby took over and
//! wrote, has its next write refused ([`FENCED`]), so it cannot overwrite a newer record or
//! record a decision the active instance does not know (it stores before it acts, so it
//! acts on nothing either). A write of the stalled one that lands between the standby's
//! load and its first write makes that first write fail instead: the standby reads the
//! state again before it decides, and so knows it.
//!
//! Loads read each bucket in one pass (the last value of every key), not one round trip
//! per key. Handled message ids go to `<bucket>-seen`, whose keys expire after
//! `forget_after` by themselves (not fenced: a duplicate id written twice is harmless).

use std::sync::Mutex;

use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::{self, kv};
use chrono::{DateTime, Utc};
use futures_util::StreamExt;

use crate::coordinator::changes::Changes;
use crate::coordinator::fleet::{Fleet, Maintenance, Vm};

/// How a write refused by the fence starts: the engine stops rather than act on it.
pub const FENCED: &str = "fenced";

/// The fleet's state in the KV buckets.
pub struct KvState {
    store: kv::Store,
    seen: kv::Store,
    js: jetstream::Context,
    bucket: String,
    /// The state stream's last sequence as this instance knows it: every write expects it.
    last: Mutex<u64>,
    /// Whether this instance may write now (its lease is fresh); `None`: always.
    gate: Option<Gate>,
}

/// Whether this instance holds a fresh lease.
pub type Gate = std::sync::Arc<dyn Fn() -> bool + Send + Sync>;

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

/// Runs `future` to its end from the engine's synchronous code, the runtime's other tasks
/// going on meanwhile (`offload::blocking`).
fn wait<T>(future: impl std::future::Future<Output = T>) -> T {
    crate::coordinator::offload::blocking(|| tokio::runtime::Handle::current().block_on(future))
}

/// The bucket's stream, as it is now: its last sequence and how many messages it holds
/// (the store's own status is what it was when the bucket was opened).
async fn stream_state(js: &jetstream::Context, bucket: &str) -> Result<(u64, u64), String> {
    let mut stream = js
        .get_stream(format!("KV_{bucket}"))
        .await
        .map_err(|e| e.to_string())?;
    let state = stream
        .info()
        .await
        .map_err(|e| e.to_string())?
        .state
        .clone();
    Ok((state.last_sequence, state.messages))
}

/// Every live key of a bucket with its value, in one pass over the bucket's stream (the
/// last value of each key); `messages`: what the stream holds (none: nothing to read).
async fn entries(store: &kv::Store, messages: u64) -> Result<Vec<(String, Vec<u8>)>, String> {
    if messages == 0 {
        return Ok(Vec::new());
    }
    let mut watch = store
        .watch_with_history(">")
        .await
        .map_err(|e| e.to_string())?;
    let mut entries = Vec::new();
    // A read that stalls (keys expiring under it, a server that stops answering) fails,
    // rather than holding the lease without deciding.
    let read_one = std::time::Duration::from_secs(30);
    while let Some(entry) = tokio::time::timeout(read_one, watch.next())
        .await
        .map_err(|_| format!("no answer from the KV bucket for {read_one:?} while reading it"))?
    {
        let entry = entry.map_err(|e| e.to_string())?;
        if entry.operation == kv::Operation::Put {
            entries.push((entry.key, entry.value.to_vec()));
        }
        if entry.delta == 0 {
            break;
        }
    }
    Ok(entries)
}

impl KvState {
    pub(super) fn new(
        store: kv::Store,
        seen: kv::Store,
        js: jetstream::Context,
        bucket: String,
        gate: Option<Gate>,
    ) -> KvState {
        KvState {
            store,
            seen,
            js,
            bucket,
            last: Mutex::new(0),
            gate,
        }
    }

    /// Everything stored. The fence is set where the stream ended before the read: a write
    /// landing during it makes this instance's first write fail, and the state read again.
    pub fn load(&self) -> Result<Fleet, String> {
        wait(async {
            let (last, messages) = stream_state(&self.js, &self.bucket).await?;
            let mut fleet = Fleet::default();
            for (key, value) in entries(&self.store, messages).await? {
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
                        fleet.insert_vm(name, vm);
                    }
                    "c" if name == "paused" => {
                        fleet.paused = Some(
                            serde_json::from_slice(&value)
                                .map_err(|e| format!("KV pause switch: {e}"))?,
                        );
                    }
                    // Handled ids an earlier version kept here: `<bucket>-seen` has them now.
                    _ => {}
                }
            }
            let (_, seen) = stream_state(&self.js, &format!("{}-seen", self.bucket)).await?;
            for (key, value) in entries(&self.seen, seen).await? {
                let name = key.strip_prefix("s.").and_then(unhex).unwrap_or_default();
                let (source, id) = name.split_once('\n').unwrap_or((&name, ""));
                let at: i64 = String::from_utf8_lossy(&value).parse().unwrap_or(0);
                fleet.seen.insert(
                    (source.to_owned(), id.to_owned()),
                    DateTime::<Utc>::from_timestamp(at, 0).unwrap_or_default(),
                );
            }
            *self.last.lock().unwrap_or_else(|e| e.into_inner()) = last;
            Ok(fleet)
        })
    }

    /// One fenced write (or delete, `None`) of a state key. The engine writes from one task
    /// at a time, so the fence is read, used and moved without holding a lock across the
    /// wait.
    async fn put(&self, key: &str, value: Option<Vec<u8>>) -> Result<(), String> {
        // The lease may have gone stale in the middle of a round of writes (a stall):
        // nothing more is written then, whether or not a standby has written yet.
        if self.gate.as_ref().is_some_and(|may_act| !may_act()) {
            return Err(format!(
                "{FENCED}: this coordinator's lease is not fresh; another may be active"
            ));
        }
        let expected = *self.last.lock().unwrap_or_else(|e| e.into_inner());
        let deleted = value.is_none();
        let message = match value {
            Some(value) => PublishMessage::build().payload(value.into()),
            None => PublishMessage::build().header("KV-Operation", "DEL"),
        }
        .expected_last_sequence(expected);
        let subject = format!("$KV.{}.{key}", self.bucket);
        let subject_for_purge = subject.clone();
        let ack = async { self.js.send_publish(subject, message).await?.await }.await;
        match ack {
            Ok(ack) => {
                *self.last.lock().unwrap_or_else(|e| e.into_inner()) = ack.sequence;
                if deleted {
                    // A delete marker would stay for ever (one per forgotten key) and every
                    // takeover would read it: remove the key's messages, the marker too.
                    // Best effort: the key is deleted either way. Only up to the marker, so
                    // that a write made since (by a coordinator that took over while this
                    // one stalled here) is never removed.
                    if let Ok(stream) = self.js.get_stream(format!("KV_{}", self.bucket)).await
                        && let Err(error) = stream
                            .purge()
                            .filter(&subject_for_purge)
                            .sequence(ack.sequence + 1)
                            .await
                    {
                        tracing::warn!(error = %error, key, "Cannot purge a deleted key's marker (takeovers read it; does the coordinator's NATS user have $JS.API.STREAM.PURGE?)");
                    }
                }
                Ok(())
            }
            Err(error) if error.kind() == PublishErrorKind::WrongLastSequence => Err(format!(
                "{FENCED}: the state was written by another coordinator since this one read it (expected sequence {expected})"
            )),
            Err(error) => Err(error.to_string()),
        }
    }

    /// Writes the changes key by key: events and agents first, the ids of the messages that
    /// caused them last (so that a crash in between applies them again). Every state key
    /// is fenced; a refusal starts with [`FENCED`].
    pub fn write(&self, changes: &Changes) -> Result<(), String> {
        wait(async {
            for (key, m) in &changes.events {
                let value = match m {
                    Some(m) => Some(serde_json::to_vec(m).map_err(|e| e.to_string())?),
                    None => None,
                };
                self.put(&format!("e.{}", hex(key)), value).await?;
            }
            for (name, vm) in &changes.vms {
                let json = serde_json::to_vec(vm).map_err(|e| e.to_string())?;
                self.put(&format!("v.{}", hex(name)), Some(json)).await?;
            }
            for name in &changes.vms_removed {
                self.put(&format!("v.{}", hex(name)), None).await?;
            }
            match &changes.paused {
                Some(Some(pause)) => {
                    let json = serde_json::to_vec(pause).map_err(|e| e.to_string())?;
                    self.put(&format!("c.{}", hex("paused")), Some(json))
                        .await?;
                }
                Some(None) => self.put(&format!("c.{}", hex("paused")), None).await?,
                None => {}
            }
            for ((source, id), at) in &changes.seen {
                self.seen
                    .put(
                        format!("s.{}", hex(&format!("{source}\n{id}"))),
                        at.timestamp().to_string().into(),
                    )
                    .await
                    .map_err(|e| e.to_string())?;
            }
            for (source, id) in &changes.unseen {
                self.seen
                    .delete(format!("s.{}", hex(&format!("{source}\n{id}"))))
                    .await
                    .map_err(|e| e.to_string())?;
            }
            Ok(())
        })
    }
}
