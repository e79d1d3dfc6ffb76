//! The durable outbox, in one redb file under `state.dir`: for every sink, the events it has
//! not yet confirmed, in order (each event stored once, named by every sink's queue that
//! holds it: [`payloads`]); and the last document the agent processed, with its incarnation
//! epoch ([`epoch`]).
//!
//! A document's events are written for every sink, and the document marked processed, in one
//! fsync'd transaction. So a crash at any moment loses nothing that was derived from a
//! fetched document: either the transaction committed (the events will be delivered, after a
//! restart if need be) or it did not (the document was not processed: the poller keeps its
//! events for the next commit, and after a crash the document is fetched and diffed again,
//! yielding the same ids). The fan-out's tails get the events while that transaction is
//! written (handed over by [`Outbox::commit_placing`] once they are numbered), but no sink
//! sends one before the transaction is durable: a sink never holds a transition of a
//! document the agent did not process. A commit that reports a failure may still have
//! reached the disk (a failed fsync), so its events can come back after a reopen and be
//! stored again: delivered twice with the same ids, never lost. An event leaves the outbox only when its sink confirmed it (or it was dead-lettered) and its
//! commit is durable; removals are made durable in batches ([`Outbox::remove_below`],
//! [`Outbox::flush`]): a crash in between delivers them again.
//!
//! Faults it survives, and the test that proves each:
//! - a crash between any two writes: the transaction above; `tests/recovery.rs`
//!   (`kill_minus_9_at_random_moments_loses_and_invents_nothing`);
//! - a commit that fails at its fsync, and one the disk is slow to make durable (nothing is
//!   sent before it is): `fanout::tests_handover`;
//! - a damaged file: opening fails with the path and `--fresh-state` moves it aside
//!   (`a_damaged_store_is_reported_and_fresh_state_moves_it_aside`);
//! - a full disk, or any I/O error, that later clears: redb then fails every transaction
//!   (`PreviousIo`) until the database is opened anew, so the outbox closes it and reopens the
//!   file with backoff (`recovery`), inside the running process; `/readyz` and
//!   `sched_relay_state_store_writable` say it cannot be written meanwhile. Callers keep
//!   what they could not store and retry: the poller keeps the transitions it derived, a
//!   sink's task retries removing what it delivered, an approval fails retriably (its
//!   source offers the message again). Proved with the in-process fault injector
//!   ([`DiskFaults`]):
//!   `a_full_disk_fails_commits_and_once_freed_the_same_process_commits_again_losing_nothing`,
//!   `a_delivered_batch_that_cannot_be_removed_is_not_delivered_again_while_the_disk_is_full`
//!   (fanout), `a_request_that_cannot_be_recorded_fails_retriably_and_is_not_called_a_replay`
//!   (approval) and, end to end, in `tests/full_disk.rs`:
//!   `an_event_seen_while_the_state_disk_is_full_is_delivered_once_it_frees_without_a_restart`;
//!   and on a real full tmpfs with the binary,
//!   `on_a_real_full_tmpfs_the_agent_keeps_what_it_saw_and_delivers_it_once_space_returns`.
//!
//! Not survived: a restart while the disk is still full loses the transitions kept in memory
//! (the next document is then diffed against the last one stored, as after any restart).
//! Nor is the file's removal (or replacement) while the agent runs: the agent goes on with
//! the open, unlinked file (delivering what it holds), and notices nothing until an I/O
//! error makes it reopen the path; a restart before then loses what the file held. The
//! reopen makes a removed file (and directory) anew, beside the path and linked into place
//! (a disk still full leaves nothing redb cannot open), with the last processed document;
//! makes missing tables; and numbers new events above every number a sink's task may stand
//! at: `a_state_file_removed_while_the_disk_is_full_is_made_anew_once_it_frees`,
//! `a_state_dir_removed_while_the_agent_runs_comes_back_with_the_last_document`,
//! `a_file_made_anew_numbers_above_every_event_a_sink_has_passed`,
//! `a_replaced_state_file_numbers_above_every_event_a_sink_has_passed`,
//! `an_emptied_state_file_is_made_anew_at_the_next_reopen`. A replacement that is another
//! store's file (each file carries a random store id; [`lineage`]) has its events numbered
//! again above every number a sink's task may stand at, in order
//! (`another_stores_events_put_back_while_the_agent_runs_are_delivered_after_what_it_passed`,
//! `a_backup_from_before_the_file_was_made_anew_is_numbered_again`); a copy of this very
//! store keeps its numbers, every one below a task's position having been delivered
//! (`a_backup_of_this_store_put_back_keeps_its_numbers`). The state directory's lock is taken
//! again when it was removed (`the_state_directory_is_locked_again_once_it_is_made_anew`).

mod config;
mod error;
mod faults;
mod lineage;
mod lock;
mod queue;
mod recovery;
mod requests;
mod sinks;

pub use config::{StateConfig, check_state_dir};
pub use error::StoreError;
pub use faults::DiskFaults;
pub use lock::{LOCK_FILE, StateLock};
use queue::Counter;
pub use queue::Placement;
use recovery::open_database_with;
pub use requests::{Seen, StoredOutcome};

mod meta;
mod payloads;

pub use meta::{ACCEPTED_EVENT_IDS, IDENTITY, IMDS_ANSWERED};

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use redb::{Database, ReadableDatabase, TableDefinition};
use sched_relay_core::Event;
use serde_json::Value;

/// Small named values: the last processed document, and those of [`meta`].
const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");
const LAST_DOCUMENT: &str = "last_document";
/// The incarnation epoch of the last document (u64, big-endian); see [`epoch`].
const EPOCH: &str = "epoch";
/// Approval request ids handled by versions before `approval_requests` ([`requests`]) -> Unix
/// seconds after which the id may be forgotten (its request is then too old to pass the
/// freshness check anyway). Only read, as replays, until they expire.
const SEEN_REQUESTS: TableDefinition<&str, i64> = TableDefinition::new("seen_requests");

mod epoch;
pub use epoch::Processed;

/// The cache of the database a store of an earlier version is converted through.
const CONVERSION_CACHE: usize = 16 << 20;

/// The file inside `state.dir`.
pub const FILE_NAME: &str = "outbox.redb";

/// An undelivered event's id and observation time.
pub type PendingId = (String, Option<chrono::DateTime<chrono::Utc>>);

/// One stored event: its sequence number, and the event (or why it cannot be read).
pub struct Stored {
    pub seq: u64,
    pub event: Result<Event, String>,
}

pub struct Outbox {
    /// The open database; `None` between closing it after an I/O error and a reopen that
    /// succeeded. Every operation holds the read lock for its transaction; a reopen takes the
    /// write lock, so it never pulls the file from under one.
    db: RwLock<Option<Database>>,
    path: PathBuf,
    capacity: usize,
    /// The in-process fault injector the file is opened through, in tests.
    faults: Option<Arc<DiskFaults>>,
    health: recovery::Health,
    /// Per sink: the next sequence number and how many events are stored. Read from the
    /// table once per sink, then kept up to date by every write, under this lock (redb runs
    /// one write transaction at a time anyway). Without it each new document scanned every
    /// sink's whole backlog. Emptied on a reopen: a commit that reported an error may still
    /// have reached the disk. Lock order: this, then `db`.
    counters: std::sync::Mutex<std::collections::HashMap<String, Counter>>,
    /// How many times the file was opened anew after an I/O error: what was not durable
    /// before a reopen (removals of delivered events) is back in the table after it.
    generation: std::sync::atomic::AtomicU64,
    /// One more than the highest sequence number handed out or read in this process, of any
    /// sink: after a reopen (the file may have been made anew, or replaced) every sink's
    /// numbers start at least here, so no sink's task (whose position is below it) takes a
    /// new event for one it already passed.
    issued: std::sync::atomic::AtomicU64,
    /// The last processed document this process stored or found (JSON, epoch): what a file
    /// made anew after a removal starts with (`recovery`).
    processed: std::sync::Mutex<Option<(Vec<u8>, [u8; 8])>>,
    /// Which store this is (`lineage`): a file found at the path with another id is taken
    /// in with its events numbered again. A new id whenever the file is made anew or
    /// another's is taken in: older copies of the store are then another store's too.
    store_id: std::sync::Mutex<[u8; 16]>,
    /// The state directory's lock, held as long as the store is open (taken again when the
    /// directory or the lock file was removed): declared last, so that it is released after
    /// the database is closed.
    lock: std::sync::Mutex<StateLock>,
}

/// What an operation does to the file, for the writability record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Access {
    Read,
    /// A commit of events and the processed document: what the store is for. Its success
    /// says the store can be written; its failure that only such a commit can say so again.
    Events,
    /// Any other durable commit (a meta value, an approval's record, removals, making them
    /// durable): small, so a full disk often lets it through (it reuses pages). Its success
    /// says the store can be written only if no commit of events failed.
    Upkeep,
    /// A commit that is not made durable (redb `Durability::None`): it may reach no disk, so
    /// its success says nothing.
    Volatile,
}

impl Outbox {
    /// Opens (or creates) the store in `dir`. With `fresh`, an existing store is first moved
    /// aside to `outbox.redb.set-aside-<unix time>`, never deleted.
    pub fn open(dir: &Path, capacity: usize, fresh: bool) -> Result<Outbox, StoreError> {
        Outbox::open_with(dir, capacity, fresh, None)
    }

    /// [`Outbox::open`] through the in-process fault injector (`faults`), for tests.
    pub fn open_with_faults(
        dir: &Path,
        capacity: usize,
        faults: Arc<DiskFaults>,
    ) -> Result<Outbox, StoreError> {
        Outbox::open_with(dir, capacity, false, Some(faults))
    }

    fn open_with(
        dir: &Path,
        capacity: usize,
        fresh: bool,
        faults: Option<Arc<DiskFaults>>,
    ) -> Result<Outbox, StoreError> {
        // Before anything in the directory is moved or opened: a second agent on the same
        // directory (`--fresh-state` while one runs, say) is refused here.
        let lock = StateLock::take(dir)?;
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
        let opened = |builder: redb::Builder| {
            open_database_with(builder, &path, faults.as_ref(), true).map_err(|e| match e {
                redb::DatabaseError::DatabaseAlreadyOpen => StoreError::InUse {
                    path: shown.clone(),
                },
                e => StoreError::Open {
                    path: shown.clone(),
                    reason: e.to_string(),
                },
            })
        };
        let mut db = opened(recovery::builder())?;
        let legacy = payloads::has_legacy_events(&db).map_err(|e| StoreError::Open {
            path: shown.clone(),
            reason: e.to_string(),
        })?;
        if legacy {
            // Converted through a small cache: redb keeps what it reads and writes in its
            // cache (up to 1 GiB by default), and the old table may be hundreds of MB.
            drop(db);
            let mut small = redb::Builder::new();
            small.set_cache_size(CONVERSION_CACHE);
            let converting = opened(small)?;
            let converted = payloads::convert_legacy_events(&converting, 0).map_err(|e| {
                StoreError::Convert {
                    path: shown.clone(),
                    reason: e.to_string(),
                }
            })?;
            drop(converting);
            if converted > 0 {
                tracing::info!(path = %shown, events = converted, "Converted the stored events to this version's format (each event stored once for all sinks)");
            }
            db = opened(recovery::builder())?;
        }
        let store_id = lineage::store_id(&db).map_err(|e| StoreError::Open {
            path: shown.clone(),
            reason: e.to_string(),
        })?;
        let outbox = Outbox {
            db: RwLock::new(Some(db)),
            path,
            capacity,
            faults,
            health: Default::default(),
            counters: Default::default(),
            generation: Default::default(),
            issued: Default::default(),
            processed: Default::default(),
            store_id: std::sync::Mutex::new(store_id),
            lock: std::sync::Mutex::new(lock),
        };
        // Create the tables, and read what a restart needs, so damage shows at start.
        outbox.with_db(Access::Upkeep, |db| {
            outbox.create_tables(db).map_err(|e| outbox.io(e))
        })?;
        if let Some(bytes) = outbox.last_document_bytes()? {
            outbox.parse_document(&bytes)?;
            // A damaged epoch is the agent's to report (at start); the CLI's rescue commands
            // open the store all the same.
            if let Ok(epoch) = outbox.last_epoch() {
                outbox.remember_processed(bytes, epoch.to_be_bytes());
            }
        }
        Ok(outbox)
    }

    /// This store's id now (see [`lineage`]).
    fn store_id(&self) -> [u8; 16] {
        *self.store_id.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn io(&self, error: impl std::fmt::Display) -> StoreError {
        StoreError::Io {
            path: self.path.display().to_string(),
            reason: error.to_string(),
        }
    }

    fn write(&self, db: &Database) -> Result<redb::WriteTransaction, StoreError> {
        db.begin_write().map_err(|e| self.io(e))
    }

    /// Runs `operation` on the open database. An I/O error marks the store unwritable (it is
    /// then reopened by [`Outbox::reopen_if_due`]); a write that commits marks it writable.
    fn with_db<T>(
        &self,
        access: Access,
        operation: impl FnOnce(&Database) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let guard = self.db.read().unwrap_or_else(|p| p.into_inner());
        let Some(db) = guard.as_ref() else {
            let why = self.health.describe().unwrap_or_default();
            return Err(self.io(format!(
                "closed after an I/O error, not reopened yet: {why}"
            )));
        };
        let result = operation(db);
        drop(guard);
        let shown = self.path.display().to_string();
        match &result {
            Err(StoreError::Io { reason, .. }) => {
                self.health.failed(&shown, reason, access == Access::Events)
            }
            Ok(_) if access == Access::Events => self.health.wrote(&shown, true),
            Ok(_) if access == Access::Upkeep => self.health.wrote(&shown, false),
            _ => {}
        }
        result
    }

    /// Keeps the last processed document durably stored (see [`Outbox::processed`]).
    fn remember_processed(&self, document: Vec<u8>, epoch: [u8; 8]) {
        *self.processed.lock().unwrap_or_else(|p| p.into_inner()) = Some((document, epoch));
    }

    /// As [`Outbox::remember_processed`], when no document is kept yet.
    fn remember_processed_if_none(&self, document: Vec<u8>, epoch: [u8; 8]) {
        self.processed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert((document, epoch));
    }

    /// Counts the reopens after an I/O error (see [`Outbox::remove_below`]).
    pub fn generation(&self) -> u64 {
        self.generation.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Why the store cannot be written (and since when), while it cannot.
    pub fn unwritable(&self) -> Option<String> {
        self.health.describe()
    }

    /// The last document the agent processed, as received.
    pub fn last_document(&self) -> Result<Option<Value>, StoreError> {
        self.last_document_bytes()?
            .map(|bytes| self.parse_document(&bytes))
            .transpose()
    }

    /// The last processed document as stored (JSON).
    fn last_document_bytes(&self) -> Result<Option<Vec<u8>>, StoreError> {
        self.reopen_if_due();
        self.with_db(Access::Read, |db| {
            let txn = db.begin_read().map_err(|e| self.io(e))?;
            let meta = txn.open_table(META).map_err(|e| self.io(e))?;
            Ok(meta
                .get(LAST_DOCUMENT)
                .map_err(|e| self.io(e))?
                .map(|bytes| bytes.value().to_vec()))
        })
    }

    fn parse_document(&self, bytes: &[u8]) -> Result<Value, StoreError> {
        serde_json::from_slice(bytes).map_err(|e| StoreError::Corrupt {
            path: self.path.display().to_string(),
            what: "last document",
            reason: e.to_string(),
        })
    }
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_copies;
#[cfg(test)]
mod tests_lineage;
