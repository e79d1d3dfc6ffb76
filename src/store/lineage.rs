//! Which store a file is: each store file carries a random id (`store_id` in META), made when
//! the file is and kept by every copy of it. When the agent reopens its path while it runs
//! (after an I/O error) and finds another store's file there (a backup of another VM's
//! state, of a state moved aside, or of a version before ids were kept), that file's
//! numbers mean nothing to the sinks' tasks, whose positions are in this store's numbering:
//! a task past them would skip its events and remove them undelivered. So every event of
//! such a file is numbered again, in order, above every number a task may stand at, as the
//! conversion of an earlier version's file is. A copy of this very store (a backup of it,
//! put back) keeps its numbers: every number below a task's position was delivered.

use redb::{Database, ReadableTable};

use super::META;
use super::payloads::QUEUE;

/// The META key of the store's id (16 random bytes).
pub(super) const STORE_ID: &str = "store_id";

/// Events renumbered per transaction: a crash part-way leaves the rest for the next reopen
/// (and the order intact: the lowest are moved first, each above the sink's highest).
const RENUMBER_BATCH: usize = if cfg!(test) { 3 } else { 10_000 };

/// The file's store id, made and written if it has none.
pub(super) fn store_id(db: &Database) -> Result<[u8; 16], redb::Error> {
    let txn = db.begin_write()?;
    let id = {
        let mut meta = txn.open_table(META)?;
        let known = meta
            .get(STORE_ID)?
            .and_then(|bytes| <[u8; 16]>::try_from(bytes.value()).ok());
        match known {
            Some(id) => id,
            None => {
                let id = fastrand::u128(..).to_be_bytes();
                meta.insert(STORE_ID, id.as_slice())?;
                id
            }
        }
    };
    txn.commit()?;
    Ok(id)
}

/// Writes `id` as the file's store id (a file made anew, or another store's file taken in).
pub(super) fn set_store_id(txn: &redb::WriteTransaction, id: [u8; 16]) -> Result<(), redb::Error> {
    txn.open_table(META)?.insert(STORE_ID, id.as_slice())?;
    Ok(())
}

/// Whether the file is the store `ours` (or a copy of it).
pub(super) fn is_ours(db: &Database, ours: [u8; 16]) -> Result<bool, redb::Error> {
    let txn = redb::ReadableDatabase::begin_read(db)?;
    let meta = match txn.open_table(META) {
        Ok(meta) => meta,
        Err(redb::TableError::TableDoesNotExist(_)) => return Ok(false),
        Err(error) => return Err(error.into()),
    };
    Ok(meta
        .get(STORE_ID)?
        .is_some_and(|bytes| bytes.value() == ours.as_slice()))
}

/// Numbers every event of another store's file again, per sink and in order, from
/// `floor` up (above its highest number if that is higher), then makes the file this
/// store's (`ours`). Returns how many events were renumbered.
pub(super) fn take_in(db: &Database, floor: u64, ours: [u8; 16]) -> Result<usize, redb::Error> {
    let mut renumbered = 0;
    for sink in sinks(db)? {
        // The first new number: every event numbered below it is moved above the highest.
        let first_new = last_number(db, &sink)?
            .map_or(0, |last| last + 1)
            .max(floor);
        loop {
            let txn = db.begin_write()?;
            let moved = {
                let mut queue = txn.open_table(QUEUE)?;
                let rows: Vec<(u64, u64)> = queue
                    .range((sink.as_str(), 0)..(sink.as_str(), first_new))?
                    .take(RENUMBER_BATCH)
                    .map(|entry| entry.map(|(key, copy)| (key.value().1, copy.value())))
                    .collect::<Result<_, _>>()?;
                let next = queue
                    .range((sink.as_str(), 0)..=(sink.as_str(), u64::MAX))?
                    .next_back()
                    .transpose()?
                    .map_or(0, |(key, _)| key.value().1 + 1)
                    .max(first_new);
                for ((number, copy), new) in rows.iter().zip(next..) {
                    queue.remove((sink.as_str(), *number))?;
                    queue.insert((sink.as_str(), new), *copy)?;
                }
                rows.len()
            };
            txn.commit()?;
            renumbered += moved;
            if moved < RENUMBER_BATCH {
                break;
            }
        }
    }
    let txn = db.begin_write()?;
    set_store_id(&txn, ours)?;
    txn.commit()?;
    Ok(renumbered)
}

/// The sinks with events in the file.
fn sinks(db: &Database) -> Result<Vec<String>, redb::Error> {
    let txn = redb::ReadableDatabase::begin_read(db)?;
    let queue = match txn.open_table(QUEUE) {
        Ok(queue) => queue,
        Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
        Err(error) => return Err(error.into()),
    };
    let mut sinks: Vec<String> = Vec::new();
    for entry in queue.iter()? {
        let (key, _) = entry?;
        let sink = key.value().0;
        if sinks.last().is_none_or(|last| last != sink) {
            sinks.push(sink.to_owned());
        }
    }
    Ok(sinks)
}

fn last_number(db: &Database, sink: &str) -> Result<Option<u64>, redb::Error> {
    let txn = redb::ReadableDatabase::begin_read(db)?;
    let queue = txn.open_table(QUEUE)?;
    Ok(queue
        .range((sink, 0)..=(sink, u64::MAX))?
        .next_back()
        .transpose()?
        .map(|(key, _)| key.value().1))
}
