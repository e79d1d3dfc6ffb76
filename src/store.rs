//! The durable outbox, in one redb file under `state.dir`: for every sink, the events it has
//! not yet confirmed, in order; and the last document the agent processed, with its
//! incarnation epoch ([`epoch`]).
//!
//! A document's events are written for every sink, and the document marked processed, in one
//! fsync'd transaction before any sink sees them. So a crash at any moment loses nothing that
//! was derived from a fetched document: either the transaction committed (the events will be
//! delivered, after a restart if need be) or it did not (the document was not processed, and
//! the next poll derives the same events again). An event leaves the outbox only when its
//! sink confirmed it, or was dead-lettered.

mod meta;

pub use meta::IDENTITY;

use std::path::{Path, PathBuf};

use cloudevents::AttributesReader;
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use sched_relay_core::Event;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// (sink name, sequence number) -> the structured CloudEvent as JSON.
const EVENTS: TableDefinition<(&str, u64), &[u8]> = TableDefinition::new("events");
/// Small named values: the last processed document, and those of [`meta`].
const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");
const LAST_DOCUMENT: &str = "last_document";
/// The incarnation epoch of the last document (u64, big-endian); see [`epoch`].
const EPOCH: &str = "epoch";
/// Approval request ids already handled -> Unix seconds after which the id may be forgotten
/// (its request is then too old to pass the freshness check anyway).
const SEEN_REQUESTS: TableDefinition<&str, i64> = TableDefinition::new("seen_requests");

mod epoch;
pub use epoch::Processed;

/// The file inside `state.dir`.
pub const FILE_NAME: &str = "outbox.redb";

/// `[state]`: where the agent keeps what must survive it.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct StateConfig {
    #[serde(default = "default_state_dir")]
    pub dir: PathBuf,
}

impl Default for StateConfig {
    fn default() -> Self {
        StateConfig {
            dir: default_state_dir(),
        }
    }
}

fn default_state_dir() -> PathBuf {
    PathBuf::from("/var/lib/sched-relay")
}

impl StateConfig {
    /// Problems, as (key under `state`, message).
    pub fn validate(&self) -> Vec<(String, String)> {
        if self.dir.as_os_str().is_empty() {
            return vec![("dir".into(), "must name a directory".into())];
        }
        Vec::new()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(
        "the state store {path} cannot be opened: {reason}. If it is damaged, start with \
         --fresh-state to move it aside and begin afresh (what it holds is then not delivered)"
    )]
    Open { path: String, reason: String },
    #[error("the state store {path} failed: {reason} (is the disk full or read-only?)")]
    Io { path: String, reason: String },
    #[error(
        "the state store {path} holds an unreadable {what}: {reason}. Start with --fresh-state \
         to move it aside and begin afresh"
    )]
    Corrupt {
        path: String,
        what: &'static str,
        reason: String,
    },
}

/// An undelivered event's id and observation time.
pub type PendingId = (String, Option<chrono::DateTime<chrono::Utc>>);

/// One stored event: its sequence number, and the event (or why it cannot be read).
pub struct Stored {
    pub seq: u64,
    pub event: Result<Event, String>,
}

pub struct Outbox {
    db: Database,
    path: PathBuf,
    capacity: usize,
    /// Per sink: the next sequence number and how many events are stored. Read from the
    /// table once per sink, then kept up to date by every write, under this lock (redb runs
    /// one write transaction at a time anyway). Without it each new document scanned every
    /// sink's whole backlog.
    counters: std::sync::Mutex<std::collections::HashMap<String, Counter>>,
}

/// Where one sink's queue stands.
#[derive(Debug, Clone, Copy, Default)]
struct Counter {
    next: u64,
    depth: usize,
}

impl Outbox {
    /// Opens (or creates) the store in `dir`. With `fresh`, an existing store is first moved
    /// aside to `outbox.redb.set-aside-<unix time>`, never deleted.
    pub fn open(dir: &Path, capacity: usize, fresh: bool) -> Result<Outbox, StoreError> {
        let path = dir.join(FILE_NAME);
        let shown = path.display().to_string();
        if fresh && path.exists() {
            let stamp = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or_default();
            let aside = dir.join(format!("{FILE_NAME}.set-aside-{stamp}"));
            std::fs::rename(&path, &aside).map_err(|e| StoreError::Open {
                path: shown.clone(),
                reason: format!("cannot move it aside to {}: {e}", aside.display()),
            })?;
            tracing::warn!(path = %shown, moved_to = %aside.display(), "Starting with a fresh state store as asked; the old one was moved aside");
        }
        let db = Database::create(&path).map_err(|e| StoreError::Open {
            path: shown.clone(),
            reason: e.to_string(),
        })?;
        let outbox = Outbox {
            db,
            path,
            capacity,
            counters: Default::default(),
        };
        // Create the tables, and read what a restart needs, so damage shows at start.
        let txn = outbox.write()?;
        txn.open_table(EVENTS).map_err(|e| outbox.io(e))?;
        txn.open_table(META).map_err(|e| outbox.io(e))?;
        txn.open_table(SEEN_REQUESTS).map_err(|e| outbox.io(e))?;
        txn.commit().map_err(|e| outbox.io(e))?;
        outbox.last_document()?;
        Ok(outbox)
    }

    fn io(&self, error: impl std::fmt::Display) -> StoreError {
        StoreError::Io {
            path: self.path.display().to_string(),
            reason: error.to_string(),
        }
    }

    fn write(&self) -> Result<redb::WriteTransaction, StoreError> {
        self.db.begin_write().map_err(|e| self.io(e))
    }

    /// The last document the agent processed, as received.
    pub fn last_document(&self) -> Result<Option<Value>, StoreError> {
        let txn = self.db.begin_read().map_err(|e| self.io(e))?;
        let meta = txn.open_table(META).map_err(|e| self.io(e))?;
        let Some(bytes) = meta.get(LAST_DOCUMENT).map_err(|e| self.io(e))? else {
            return Ok(None);
        };
        serde_json::from_slice(bytes.value())
            .map(Some)
            .map_err(|e| StoreError::Corrupt {
                path: self.path.display().to_string(),
                what: "last document",
                reason: e.to_string(),
            })
    }

    /// Stores `events` for each of `sinks` and, when given, `document` (with its epoch) as
    /// the last processed one, in one durable transaction. A sink already holding `capacity`
    /// events gets none of them; they are returned as (sink, event) for the dead-letter file.
    pub fn commit(
        &self,
        sinks: &[String],
        events: &[Event],
        document: Option<Processed>,
    ) -> Result<Vec<(String, Event)>, StoreError> {
        let mut overflow = Vec::new();
        let encoded: Vec<Vec<u8>> = events
            .iter()
            .map(|e| {
                serde_json::to_vec(e)
                    .map_err(|error| self.io(format!("cannot encode {}: {error}", e.id())))
            })
            .collect::<Result<_, _>>()?;
        let mut counters = self.lock_counters();
        let mut updated = Vec::with_capacity(sinks.len());
        let txn = self.write()?;
        {
            let mut table = txn.open_table(EVENTS).map_err(|e| self.io(e))?;
            for sink in sinks {
                let Counter {
                    mut next,
                    mut depth,
                } = match counters.get(sink) {
                    Some(counter) => *counter,
                    None => self.count(&table, sink)?,
                };
                for (event, bytes) in events.iter().zip(&encoded) {
                    if depth >= self.capacity {
                        overflow.push((sink.clone(), event.clone()));
                        continue;
                    }
                    table
                        .insert((sink.as_str(), next), bytes.as_slice())
                        .map_err(|e| self.io(e))?;
                    next += 1;
                    depth += 1;
                }
                updated.push((sink.clone(), Counter { next, depth }));
            }
            if let Some(document) = document {
                let mut meta = txn.open_table(META).map_err(|e| self.io(e))?;
                let bytes = serde_json::to_vec(document.document).map_err(|e| self.io(e))?;
                meta.insert(LAST_DOCUMENT, bytes.as_slice())
                    .map_err(|e| self.io(e))?;
                meta.insert(EPOCH, document.epoch_bytes().as_slice())
                    .map_err(|e| self.io(e))?;
            }
        }
        txn.commit().map_err(|e| self.io(e))?;
        counters.extend(updated);
        Ok(overflow)
    }

    /// Up to `max` of `sink`'s oldest events, in order.
    pub fn pending(&self, sink: &str, max: usize) -> Result<Vec<Stored>, StoreError> {
        let txn = self.db.begin_read().map_err(|e| self.io(e))?;
        let table = txn.open_table(EVENTS).map_err(|e| self.io(e))?;
        let range = table
            .range((sink, 0)..=(sink, u64::MAX))
            .map_err(|e| self.io(e))?;
        let mut stored = Vec::new();
        for entry in range.take(max) {
            let (key, value) = entry.map_err(|e| self.io(e))?;
            let event = serde_json::from_slice(value.value()).map_err(|e| {
                format!(
                    "{e}; stored bytes: {}",
                    String::from_utf8_lossy(value.value())
                )
            });
            stored.push(Stored {
                seq: key.value().1,
                event,
            });
        }
        Ok(stored)
    }

    /// Forgets `sink`'s events with these sequence numbers (delivered or dead-lettered).
    pub fn remove(&self, sink: &str, seqs: &[u64]) -> Result<(), StoreError> {
        let mut counters = self.lock_counters();
        let txn = self.write()?;
        let mut removed = 0;
        {
            let mut table = txn.open_table(EVENTS).map_err(|e| self.io(e))?;
            for seq in seqs {
                if table
                    .remove((sink, *seq))
                    .map_err(|e| self.io(e))?
                    .is_some()
                {
                    removed += 1;
                }
            }
        }
        txn.commit().map_err(|e| self.io(e))?;
        if let Some(counter) = counters.get_mut(sink) {
            counter.depth = counter.depth.saturating_sub(removed);
        }
        Ok(())
    }

    fn lock_counters(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, Counter>> {
        self.counters.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reads a sink's queue position from the table (once per sink and process).
    fn count(
        &self,
        table: &impl ReadableTable<(&'static str, u64), &'static [u8]>,
        sink: &str,
    ) -> Result<Counter, StoreError> {
        let mut range = table
            .range((sink, 0)..=(sink, u64::MAX))
            .map_err(|e| self.io(e))?;
        let next = match range.next_back() {
            Some(last) => last.map_err(|e| self.io(e))?.0.value().1 + 1,
            None => 0,
        };
        let depth = table
            .range((sink, 0)..=(sink, u64::MAX))
            .map_err(|e| self.io(e))?
            .count();
        Ok(Counter { next, depth })
    }

    /// Records an approval request id as seen, durably, until `keep_until` (Unix seconds).
    /// Returns false when the id was already seen (a replay). Ids whose time has passed are
    /// forgotten in the same transaction, so the table stays as small as the window allows.
    pub fn remember_request(
        &self,
        id: &str,
        keep_until: i64,
        now: i64,
    ) -> Result<bool, StoreError> {
        let txn = self.write()?;
        let new = {
            let mut table = txn.open_table(SEEN_REQUESTS).map_err(|e| self.io(e))?;
            let seen = table.get(id).map_err(|e| self.io(e))?.is_some();
            if !seen {
                table.insert(id, keep_until).map_err(|e| self.io(e))?;
            }
            table
                .retain(|_, until| until >= now)
                .map_err(|e| self.io(e))?;
            !seen
        };
        txn.commit().map_err(|e| self.io(e))?;
        Ok(new)
    }

    /// How many undelivered events each sink may hold.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The CloudEvents ids `sink` has not confirmed yet, oldest first, with each event's
    /// `time` (when it was observed).
    pub fn pending_ids(&self, sink: &str, max: usize) -> Result<Vec<PendingId>, StoreError> {
        Ok(self
            .pending(sink, max)?
            .into_iter()
            .filter_map(|stored| stored.event.ok())
            .map(|event| (event.id().to_owned(), event.time().copied()))
            .collect())
    }

    /// How many events `sink` has not confirmed yet.
    pub fn depth(&self, sink: &str) -> Result<usize, StoreError> {
        let mut counters = self.lock_counters();
        if let Some(counter) = counters.get(sink) {
            return Ok(counter.depth);
        }
        let txn = self.db.begin_read().map_err(|e| self.io(e))?;
        let table = txn.open_table(EVENTS).map_err(|e| self.io(e))?;
        let counter = self.count(&table, sink)?;
        counters.insert(sink.to_owned(), counter);
        Ok(counter.depth)
    }
}

/// The state directory must exist and be writable before anything is promised.
pub fn check_state_dir(dir: &Path) -> Result<(), std::io::Error> {
    std::fs::create_dir_all(dir)?;
    let probe = dir.join(".write-test");
    std::fs::write(&probe, b"")?;
    std::fs::remove_file(probe)
}

#[cfg(test)]
mod tests {
    use super::*;
    use cloudevents::{EventBuilder, EventBuilderV10};

    #[test]
    fn a_request_id_is_seen_once_across_reopening_until_it_expires() {
        let dir = tempfile::tempdir().unwrap();
        {
            let outbox = Outbox::open(dir.path(), 10, false).unwrap();
            assert!(outbox.remember_request("r1", 100, 50).unwrap());
            assert!(!outbox.remember_request("r1", 100, 60).unwrap());
        }
        let outbox = Outbox::open(dir.path(), 10, false).unwrap();
        assert!(
            !outbox.remember_request("r1", 100, 70).unwrap(),
            "survives a restart"
        );
        // After its keep-until time the id is forgotten (the freshness check covers it).
        assert!(outbox.remember_request("r2", 300, 200).unwrap());
        assert!(outbox.remember_request("r1", 400, 201).unwrap());
    }

    fn event(id: &str) -> Event {
        EventBuilderV10::new()
            .id(id)
            .source("urn:t")
            .ty("t")
            .build()
            .unwrap()
            .into()
    }

    fn ids(stored: &[Stored]) -> Vec<String> {
        stored
            .iter()
            .map(|s| s.event.as_ref().unwrap().id().to_owned())
            .collect()
    }

    fn processed(document: &Value) -> Processed<'_> {
        Processed { document, epoch: 0 }
    }

    fn sinks(names: &[&str]) -> Vec<String> {
        names.iter().map(|n| n.to_string()).collect()
    }

    #[test]
    fn events_wait_per_sink_in_order_until_removed_and_survive_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let document = serde_json::json!({"DocumentIncarnation": 3, "Events": []});
        {
            let outbox = Outbox::open(dir.path(), 100, false).unwrap();
            assert_eq!(outbox.last_document().unwrap(), None);
            outbox
                .commit(&sinks(&["a", "b"]), &[event("1"), event("2")], None)
                .unwrap();
            outbox
                .commit(
                    &sinks(&["a", "b"]),
                    &[event("3")],
                    Some(processed(&document)),
                )
                .unwrap();
            let a = outbox.pending("a", 2).unwrap();
            assert_eq!(ids(&a), ["1", "2"]);
            outbox.remove("a", &[a[0].seq, a[1].seq]).unwrap();
        }
        let outbox = Outbox::open(dir.path(), 100, false).unwrap();
        assert_eq!(ids(&outbox.pending("a", 10).unwrap()), ["3"]);
        assert_eq!(ids(&outbox.pending("b", 10).unwrap()), ["1", "2", "3"]);
        assert_eq!(outbox.last_document().unwrap(), Some(document));
        assert_eq!(outbox.depth("b").unwrap(), 3);
    }

    #[test]
    fn a_full_sink_overflows_alone() {
        let dir = tempfile::tempdir().unwrap();
        let outbox = Outbox::open(dir.path(), 2, false).unwrap();
        outbox
            .commit(&sinks(&["slow"]), &[event("1"), event("2")], None)
            .unwrap();
        let overflow = outbox
            .commit(&sinks(&["slow", "fast"]), &[event("3")], None)
            .unwrap();
        assert_eq!(overflow.len(), 1);
        assert_eq!(overflow[0].0, "slow");
        assert_eq!(ids(&outbox.pending("fast", 10).unwrap()), ["3"]);
    }

    #[test]
    fn a_sink_that_emptied_takes_new_events_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let outbox = Outbox::open(dir.path(), 10, false).unwrap();
        outbox.commit(&sinks(&["s"]), &[event("1")], None).unwrap();
        let first = outbox.pending("s", 1).unwrap()[0].seq;
        outbox.remove("s", &[first]).unwrap();
        outbox.commit(&sinks(&["s"]), &[event("2")], None).unwrap();
        // Numbering starts again from 0 in an empty sink: no key can collide.
        assert_eq!(ids(&outbox.pending("s", 10).unwrap()), ["2"]);
    }

    #[test]
    fn a_damaged_store_is_reported_and_fresh_state_moves_it_aside() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join(FILE_NAME),
            b"this is not a redb file at all, not even close",
        )
        .unwrap();
        let error = Outbox::open(dir.path(), 10, false)
            .err()
            .unwrap()
            .to_string();
        assert!(error.contains("--fresh-state"), "{error}");
        let outbox = Outbox::open(dir.path(), 10, true).unwrap();
        assert_eq!(outbox.last_document().unwrap(), None);
        let moved: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().contains("set-aside"))
            .collect();
        assert_eq!(moved.len(), 1, "the damaged file is kept, not deleted");
    }
}
