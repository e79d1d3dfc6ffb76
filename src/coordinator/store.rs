//! The coordinator's durable state: one redb file under `state_dir`. Every change is
//! committed (fsync'd) before the message that caused it is acknowledged to the broker and
//! before the drain or approval it records is started, so a kill -9 loses nothing: an
//! unacknowledged message is delivered again (and de-duplicated), and a recorded approval
//! without a confirmed publication is published again with the same request id.

use std::path::Path;

use chrono::DateTime;
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};

pub use super::changes::Changes;
use super::fleet::{Fleet, Maintenance, Vm};

const EVENTS: TableDefinition<&str, &[u8]> = TableDefinition::new("events");
const VMS: TableDefinition<&str, &[u8]> = TableDefinition::new("vms");
/// `source \n id` -> when it was applied (Unix seconds).
const SEEN: TableDefinition<&str, i64> = TableDefinition::new("seen");
/// The operator's switches: `paused` -> [`super::fleet::Pause`] as JSON.
const CONTROL: TableDefinition<&str, &[u8]> = TableDefinition::new("control");

/// Where the state is kept: the embedded file (one instance), or NATS JetStream KV (a
/// standby can take over; see [`super::ha`]).
pub enum Store {
    Redb(Database),
    #[cfg(feature = "nats")]
    Kv(Box<super::ha::KvState>),
}

fn seen_key(source: &str, id: &str) -> String {
    format!("{source}\n{id}")
}

/// The state file's page cache: redb's default is 1 GiB, which a coordinator of 10,000
/// VMs filled past 500 MiB of resident memory with the ids of the messages it handled.
const STORE_CACHE: usize = 32 << 20;

impl Store {
    pub fn open(dir: &Path) -> Result<Store, String> {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("state directory {}: {e}", dir.display()))?;
        let path = dir.join("coordinator.redb");
        let db = redb::Builder::new()
            .set_cache_size(STORE_CACHE)
            .create(&path)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        let store = Store::Redb(db);
        store.write(&Changes::default())?;
        Ok(store)
    }

    /// Everything stored.
    pub fn load(&self) -> Result<Fleet, String> {
        super::offload::blocking(|| self.load_now())
    }

    // Without NATS the store has one kind, and the match one arm.
    #[cfg_attr(not(feature = "nats"), allow(clippy::infallible_destructuring_match))]
    fn load_now(&self) -> Result<Fleet, String> {
        let db = match self {
            Store::Redb(db) => db,
            #[cfg(feature = "nats")]
            Store::Kv(kv) => return kv.load(),
        };
        let txn = db.begin_read().map_err(|e| e.to_string())?;
        let mut fleet = Fleet::default();
        let events = txn.open_table(EVENTS).map_err(|e| e.to_string())?;
        for row in events.iter().map_err(|e| e.to_string())? {
            let (key, value) = row.map_err(|e| e.to_string())?;
            let m: Maintenance = serde_json::from_slice(value.value())
                .map_err(|e| format!("stored event {}: {e}", key.value()))?;
            fleet.events.insert(key.value().to_owned(), m);
        }
        let vms = txn.open_table(VMS).map_err(|e| e.to_string())?;
        for row in vms.iter().map_err(|e| e.to_string())? {
            let (key, value) = row.map_err(|e| e.to_string())?;
            let vm: Vm = serde_json::from_slice(value.value())
                .map_err(|e| format!("stored VM {}: {e}", key.value()))?;
            fleet.insert_vm(key.value().to_owned(), vm);
        }
        let seen = txn.open_table(SEEN).map_err(|e| e.to_string())?;
        for row in seen.iter().map_err(|e| e.to_string())? {
            let (key, at) = row.map_err(|e| e.to_string())?;
            let (source, id) = key.value().split_once('\n').unwrap_or((key.value(), ""));
            let at = DateTime::from_timestamp(at.value(), 0).unwrap_or_default();
            fleet.seen.insert((source.to_owned(), id.to_owned()), at);
        }
        let control = txn.open_table(CONTROL).map_err(|e| e.to_string())?;
        if let Some(pause) = control.get("paused").map_err(|e| e.to_string())? {
            fleet.paused = Some(
                serde_json::from_slice(pause.value())
                    .map_err(|e| format!("stored pause switch: {e}"))?,
            );
        }
        Ok(fleet)
    }

    /// Commits `changes` durably, all or nothing (the KV store: key by key, fenced).
    pub fn write(&self, changes: &Changes) -> Result<(), String> {
        super::offload::blocking(|| self.write_now(changes))
    }

    // Without NATS the store has one kind, and the match one arm.
    #[cfg_attr(not(feature = "nats"), allow(clippy::infallible_destructuring_match))]
    fn write_now(&self, changes: &Changes) -> Result<(), String> {
        let db = match self {
            Store::Redb(db) => db,
            #[cfg(feature = "nats")]
            Store::Kv(_) if changes.is_empty() => return Ok(()),
            #[cfg(feature = "nats")]
            Store::Kv(kv) => return kv.write(changes),
        };
        let txn = db.begin_write().map_err(|e| e.to_string())?;
        {
            let mut events = txn.open_table(EVENTS).map_err(|e| e.to_string())?;
            for (key, m) in &changes.events {
                match m {
                    Some(m) => {
                        let json = serde_json::to_vec(m).map_err(|e| e.to_string())?;
                        events
                            .insert(key.as_str(), json.as_slice())
                            .map_err(|e| e.to_string())?;
                    }
                    None => {
                        events.remove(key.as_str()).map_err(|e| e.to_string())?;
                    }
                }
            }
            let mut vms = txn.open_table(VMS).map_err(|e| e.to_string())?;
            for (name, vm) in &changes.vms {
                let json = serde_json::to_vec(vm).map_err(|e| e.to_string())?;
                vms.insert(name.as_str(), json.as_slice())
                    .map_err(|e| e.to_string())?;
            }
            for name in &changes.vms_removed {
                vms.remove(name.as_str()).map_err(|e| e.to_string())?;
            }
            let mut seen = txn.open_table(SEEN).map_err(|e| e.to_string())?;
            for ((source, id), at) in &changes.seen {
                seen.insert(seen_key(source, id).as_str(), at.timestamp())
                    .map_err(|e| e.to_string())?;
            }
            for (source, id) in &changes.unseen {
                seen.remove(seen_key(source, id).as_str())
                    .map_err(|e| e.to_string())?;
            }
            let mut control = txn.open_table(CONTROL).map_err(|e| e.to_string())?;
            match &changes.paused {
                Some(Some(pause)) => {
                    let json = serde_json::to_vec(pause).map_err(|e| e.to_string())?;
                    control
                        .insert("paused", json.as_slice())
                        .map_err(|e| e.to_string())?;
                }
                Some(None) => {
                    control.remove("paused").map_err(|e| e.to_string())?;
                }
                None => {}
            }
        }
        txn.commit().map_err(|e| e.to_string())
    }
}
