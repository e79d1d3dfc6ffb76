//! Whether the state store can be written, and when to reopen it. redb latches the first
//! I/O error of a database (`PreviousIo`): every later transaction fails, even once the disk
//! has room again. So after an I/O error the outbox closes the database and opens the file
//! anew (redb repairs it from the last durable commit), with backoff, until a commit
//! succeeds: one of events, if one of those failed (a small commit reuses pages, which a full
//! disk allows: see [`Health::wrote`]). Meanwhile `/readyz` and `sched_relay_state_store_writable` say why it cannot be
//! written.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use std::sync::atomic::Ordering;

use redb::{Database, ReadableDatabase, ReadableTable};

use super::payloads::{HOLDERS, PAYLOADS, QUEUE, convert_legacy_events};
use super::{DiskFaults, EPOCH, LAST_DOCUMENT, META, Outbox, SEEN_REQUESTS, lineage, requests};
use crate::retry::Backoff;

/// Waits between attempts to reopen: the first at once, then 250 ms doubling to 1 s, so space
/// that comes back is used within a second (what the poller keeps in memory until then is lost
/// by a restart; the chaos driver found a kill 1-5 s after the disk freed losing it) while a
/// disk that stays full costs one open a second.
const REOPEN: Backoff = Backoff::new(Duration::from_millis(250), Duration::from_secs(1));

/// The store's writability, shared by every user of the outbox.
#[derive(Debug, Default)]
pub(super) struct Health {
    state: Mutex<Option<Unwritable>>,
}

#[derive(Debug)]
struct Unwritable {
    since: chrono::DateTime<chrono::Utc>,
    reason: String,
    reopen_attempts: u32,
    next_reopen: Instant,
    /// A commit of events failed: only such a commit ends it (a full disk still takes small
    /// commits, which reuse pages). Until then (a read, another commit failed) any durable
    /// commit does.
    events_failed: bool,
}

impl Health {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Unwritable>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// An operation failed with an I/O error (`events`: a commit of events): the database is
    /// latched until reopened.
    pub(super) fn failed(&self, path: &str, reason: &str, events: bool) {
        metrics::counter!("sched_relay_state_store_errors_total").increment(1);
        let mut state = self.lock();
        match state.as_mut() {
            // Keep the first reason (say ENOSPC): later ones are mostly redb's "previous I/O
            // error", which says less.
            Some(unwritable) => unwritable.events_failed |= events,
            None => {
                tracing::error!(path, error = %reason, "The state store cannot be written; new transitions are kept in memory and stored once it can (reopening it with backoff)");
                metrics::gauge!("sched_relay_state_store_writable").set(0.0);
                *state = Some(Unwritable {
                    since: chrono::Utc::now(),
                    reason: reason.to_owned(),
                    reopen_attempts: 0,
                    next_reopen: Instant::now(),
                    events_failed: events,
                });
            }
        }
    }

    /// Whether the database should be closed and opened again now.
    pub(super) fn reopen_due(&self) -> bool {
        self.lock()
            .as_ref()
            .is_some_and(|unwritable| Instant::now() >= unwritable.next_reopen)
    }

    /// A reopen was tried (`Err`: why it failed); the next one waits longer.
    pub(super) fn reopen_tried(&self, path: &str, result: Result<(), String>) {
        let mut state = self.lock();
        let Some(unwritable) = state.as_mut() else {
            return;
        };
        let wait = REOPEN.ceiling(unwritable.reopen_attempts);
        unwritable.reopen_attempts = unwritable.reopen_attempts.saturating_add(1);
        unwritable.next_reopen = Instant::now() + wait;
        // While the disk stays full this runs once a second: said once, then at DEBUG (the
        // ERROR when it began and the INFO when it ends bracket the outage).
        let first = unwritable.reopen_attempts == 1;
        match result {
            Ok(()) if first => {
                tracing::info!(path, "Reopened the state store after an I/O error");
            }
            Ok(()) => {
                tracing::debug!(
                    path,
                    attempt = unwritable.reopen_attempts,
                    "Reopened the state store after an I/O error"
                );
            }
            Err(reason) => {
                if first {
                    tracing::warn!(path, retry_in = ?wait, error = %reason, "Cannot reopen the state store yet (retried every second, logged at DEBUG from now on)");
                } else {
                    tracing::debug!(path, attempt = unwritable.reopen_attempts, error = %reason, "Cannot reopen the state store yet");
                }
                unwritable.reason = reason;
            }
        }
    }

    /// A durable commit succeeded (`events`: a commit of events): the store is writable
    /// (again), unless this was another commit and one of events had failed.
    pub(super) fn wrote(&self, path: &str, events: bool) {
        let mut state = self.lock();
        if !events && state.as_ref().is_some_and(|u| u.events_failed) {
            return;
        }
        if let Some(unwritable) = state.take() {
            let seconds = (chrono::Utc::now() - unwritable.since).num_seconds();
            tracing::info!(
                path,
                unwritable_for_s = seconds,
                "The state store can be written again"
            );
        }
        metrics::gauge!("sched_relay_state_store_writable").set(1.0);
    }

    /// Why the store cannot be written, and since when, while it cannot.
    pub(super) fn describe(&self) -> Option<String> {
        self.lock().as_ref().map(|unwritable| {
            format!(
                "{} (since {}, {} reopen attempt(s))",
                unwritable.reason,
                unwritable
                    .since
                    .to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                unwritable.reopen_attempts
            )
        })
    }
}

/// Opens the redb file (`create`: or creates it), through the fault injector when a test
/// gave one.
pub(super) fn open_database(
    path: &Path,
    faults: Option<&Arc<DiskFaults>>,
    create: bool,
) -> Result<Database, redb::DatabaseError> {
    open_database_with(builder(), path, faults, create)
}

/// How much of the file redb keeps in memory (its own cache, beside the kernel's page cache).
/// Its default is 1 GiB, which a backlog of 100,000 events fills to 130 MiB of resident
/// memory; reads past the cache come from the page cache (BENCHMARKS.md, issue 39).
pub(super) const STORE_CACHE: usize = 16 << 20;

/// The settings every open of the state file uses: [`STORE_CACHE`].
pub(super) fn builder() -> redb::Builder {
    let mut builder = redb::Builder::new();
    builder.set_cache_size(STORE_CACHE);
    builder
}

/// As [`open_database`], with the builder's settings (its cache size).
pub(super) fn open_database_with(
    builder: redb::Builder,
    path: &Path,
    faults: Option<&Arc<DiskFaults>>,
    create: bool,
) -> Result<Database, redb::DatabaseError> {
    match faults {
        None if create => builder.create(path),
        None => builder.open(path),
        Some(faults) => builder.create_with_backend(super::faults::FaultInjectingBackend::open(
            path,
            faults.clone(),
            create,
        )?),
    }
}

impl Outbox {
    /// After an I/O error, closes the latched database and opens the file again, when the
    /// backoff allows. Every public operation calls it first, holding no lock, so whichever
    /// user comes next (the poller, a sink's task, an approval, `/metrics`) brings the store
    /// back once the disk allows.
    pub(super) fn reopen_if_due(&self) {
        if !self.health.reopen_due() {
            return;
        }
        let mut counters = self.lock_counters();
        let mut db = self.db.write().unwrap_or_else(|p| p.into_inner());
        if !self.health.reopen_due() {
            return; // another thread just did
        }
        // The old handle must be gone first: it holds the file's lock.
        *db = None;
        let shown = self.path.display().to_string();
        let result = self.reopen_file().map(|reopened| {
            *db = Some(reopened);
            // The file holds what its last durable commit held (or nothing, made anew): count
            // again, numbering above every number a sink's task may stand at (`issued`; a
            // gap in a sink's numbers is passed over).
            for counter in counters.values_mut() {
                counter.stale = true;
            }
            self.generation.fetch_add(1, Ordering::SeqCst);
        });
        self.health.reopen_tried(&shown, result);
    }

    /// Opens the file again; makes it anew if it is gone, and its tables if they are.
    fn reopen_file(&self) -> Result<Database, String> {
        let reopened = self.reopen_path();
        self.relock();
        reopened
    }

    /// Takes the state directory's lock again when the locked file is gone (the directory
    /// removed and made anew, say): a lock on a removed file keeps no second agent out.
    fn relock(&self) {
        let dir = self.path.parent().unwrap_or(Path::new("."));
        let mut lock = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        if lock.still_at(dir) {
            return;
        }
        match super::StateLock::take(dir) {
            Ok(taken) => {
                *lock = taken;
                tracing::warn!(dir = %dir.display(), "The state directory's lock file was removed while the agent ran; locked it again");
            }
            Err(error) => {
                tracing::error!(dir = %dir.display(), error = %error, "The state directory's lock file was removed while the agent ran, and cannot be locked again: another process may be using this state directory");
            }
        }
    }

    /// Opens the path again (see [`Outbox::reopen_file`]).
    fn reopen_path(&self) -> Result<Database, String> {
        match std::fs::symlink_metadata(&self.path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => self.make_file_anew()?,
            // Emptied (`: > outbox.redb`): nothing in it to keep, and redb opens an empty
            // file only to create a store in it, in place.
            Ok(metadata) if metadata.is_file() && metadata.len() == 0 => {
                std::fs::remove_file(&self.path)
                    .map_err(|e| format!("cannot remove the emptied file: {e}"))?;
                self.make_file_anew()?;
            }
            _ => {}
        }
        // Never created here: a file made in place on a full disk is left all zeros (growing
        // a file takes no space; its header's write fails), which redb never opens again.
        let db =
            open_database(&self.path, self.faults.as_ref(), false).map_err(|e| e.to_string())?;
        // Asked before its tables are made (which would mark it this store's).
        let ours = lineage::is_ours(&db, self.store_id())
            .map_err(|e| format!("cannot read which store it is: {e}"))?;
        let missing = (|| -> Result<bool, redb::Error> {
            let txn = db.begin_read()?;
            let exists = |result: Result<(), redb::TableError>| match result {
                Ok(()) => Ok(true),
                Err(redb::TableError::TableDoesNotExist(_)) => Ok(false),
                Err(e) => Err(e),
            };
            Ok(!exists(txn.open_table(QUEUE).map(drop))?
                || !exists(txn.open_table(PAYLOADS).map(drop))?
                || !exists(txn.open_table(HOLDERS).map(drop))?
                || !exists(txn.open_table(META).map(drop))?)
        })()
        .map_err(|e| e.to_string())?;
        if missing {
            // Reads fail on a missing table (a write would make it).
            self.create_tables(&db)
                .map_err(|e| format!("cannot make its tables again: {e}"))?;
        }
        // Every number a sink's task may stand at is below this.
        let floor = self.issued.load(Ordering::SeqCst);
        // Another store's file (a backup of another one put back): its numbers are not
        // this store's, which the sinks' tasks stand in, so they are made again above them.
        let renumbered = if ours {
            0
        } else {
            // A new id: an older copy of this store (from before this file) is another
            // store's from now on, and numbered again too if it is put back.
            let renewed = lineage::new_id();
            let renumbered = lineage::take_in(&db, floor, renewed)
                .map_err(|e| format!("cannot number the events it holds again: {e}"))?;
            *self.store_id.lock().unwrap_or_else(|p| p.into_inner()) = renewed;
            renumbered
        };
        if renumbered > 0 {
            tracing::warn!(path = %self.path.display(), events = renumbered, "The state store file was replaced while the agent ran by another store's; its events are delivered after everything delivered before");
        }
        // A file of an earlier version put in place (or one whose conversion an I/O error
        // cut short): its events go after those, above the floor too.
        let converted = convert_legacy_events(&db, floor)
            .map_err(|e| format!("cannot convert the events it holds: {e}"))?;
        if converted > 0 {
            tracing::warn!(path = %self.path.display(), events = converted, "The state store file was replaced while the agent ran by one of an earlier version; converted the events it holds");
        } else if missing {
            tracing::warn!(path = %self.path.display(), "The state store file was replaced while the agent ran by one without its tables; made them. What the old file held (undelivered events, approval request records) is gone");
        }
        Ok(db)
    }

    /// Writes a store with its tables and the last processed document beside the file's
    /// path, then links it into place (never over a file put back meanwhile).
    fn make_file_anew(&self) -> Result<(), String> {
        let staged = self.path.with_extension("redb.new");
        // Never empty: `state.dir` is checked to name a directory.
        let dir = self.path.parent().unwrap_or(Path::new("."));
        let made = (|| -> Result<(), String> {
            // Only its owner reads what it holds (approval records, the VM's identity).
            std::os::unix::fs::DirBuilderExt::mode(
                std::fs::DirBuilder::new().recursive(true),
                0o700,
            )
            .create(dir)
            .map_err(|e| format!("cannot make {}: {e}", dir.display()))?;
            let _ = std::fs::remove_file(&staged);
            let db =
                open_database(&staged, self.faults.as_ref(), true).map_err(|e| e.to_string())?;
            // A new store (its id written by create_tables): a copy of the old file put back
            // later is another store's, its events numbered again, never skipped.
            *self.store_id.lock().unwrap_or_else(|p| p.into_inner()) = lineage::new_id();
            self.create_tables(&db).map_err(|e| e.to_string())?;
            drop(db);
            let placed = match std::fs::hard_link(&staged, &self.path) {
                // Put back meanwhile: that one is opened.
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => false,
                Ok(()) => true,
                // A file system without hard links (vfat, some network mounts).
                Err(_) => {
                    std::fs::rename(&staged, &self.path)
                        .map_err(|e| format!("cannot move {} into place: {e}", staged.display()))?;
                    true
                }
            };
            if placed {
                tracing::warn!(path = %self.path.display(), "The state store file was removed while the agent ran; made it anew with the last processed document. What the old file held (undelivered events, approval request records) is gone");
            }
            // The link is durable before anything is committed to the file.
            std::fs::File::open(dir)
                .and_then(|dir| dir.sync_all())
                .map_err(|e| format!("cannot sync {}: {e}", dir.display()))
        })();
        let _ = std::fs::remove_file(&staged);
        made.map_err(|error| format!("the file is gone and cannot be made anew: {error}"))
    }

    /// Makes every table the store reads (a read fails on a missing table; a write makes
    /// it), and writes the last processed document this process knows into a store that
    /// holds none (a file made anew: a restart diffs against it).
    pub(super) fn create_tables(&self, db: &Database) -> Result<(), redb::Error> {
        let txn = db.begin_write()?;
        txn.open_table(QUEUE)?;
        txn.open_table(PAYLOADS)?;
        txn.open_table(HOLDERS)?;
        {
            let mut meta = txn.open_table(META)?;
            // Set by `Outbox::open` from the file itself; here, a file made anew is this store.
            if meta.get(lineage::STORE_ID)?.is_none() {
                meta.insert(lineage::STORE_ID, self.store_id().as_slice())?;
            }
            let processed = self.processed.lock().unwrap_or_else(|p| p.into_inner());
            if let Some((document, epoch)) = processed.as_ref()
                && meta.get(LAST_DOCUMENT)?.is_none()
            {
                meta.insert(LAST_DOCUMENT, document.as_slice())?;
                meta.insert(EPOCH, epoch.as_slice())?;
            }
        }
        txn.open_table(SEEN_REQUESTS)?;
        txn.open_table(requests::APPROVAL_REQUESTS)?;
        txn.commit()?;
        Ok(())
    }

    /// Notes that numbers below `next` were handed out or read (see [`Outbox::issued`]).
    pub(super) fn note_issued(&self, next: u64) {
        self.issued.fetch_max(next, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_commit_on_a_full_disk_does_not_make_the_store_ready() {
        let health = Health::default();
        // The poller's commit of new events found the disk full ...
        health.failed("outbox.redb", "No space left on device", true);
        // ... and a sink's removal or a meta value, which reuse pages, still commit.
        health.wrote("outbox.redb", false);
        assert!(health.describe().is_some(), "still unwritable");
        health.wrote("outbox.redb", true);
        assert!(health.describe().is_none(), "a commit of events ends it");
    }

    #[test]
    fn a_failed_small_commit_is_over_once_another_commits() {
        let health = Health::default();
        health.failed("outbox.redb", "Input/output error", false);
        health.wrote("outbox.redb", false);
        assert!(health.describe().is_none());
        // A commit of events failing meanwhile makes small commits no proof again.
        health.failed("outbox.redb", "Input/output error", false);
        health.failed("outbox.redb", "No space left on device", true);
        health.wrote("outbox.redb", false);
        assert!(health.describe().is_some());
    }
}
