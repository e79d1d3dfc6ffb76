//! Which store a file is: each store file carries a random id (`store_id` in META), made when
//! the file is and kept by every copy of it. When the agent reopens its path while it runs
//! (after an I/O error) and finds another store's file there (a backup of another VM's
//! state, of a state moved aside, of a version before ids were kept, or of this store from
//! before its file was made anew), that file's numbers mean nothing to the sinks' tasks,
//! whose positions are in this store's numbering: a task past them would skip its events and
//! remove them undelivered. So every event of such a file is numbered again, in order, above
//! every number a task may stand at, and the store takes a new id. A file made anew gets a
//! new id too. A copy of this very store (same id: nothing was made anew or taken in since
//! it was taken) keeps its numbers: every number below a task's position in it was
//! delivered.

use redb::{Database, ReadableTable};

use super::META;
use super::payloads::QUEUE;

/// The META key of the store's id (16 random bytes).
pub(super) const STORE_ID: &str = "store_id";

/// A new store id.
pub(super) fn new_id() -> [u8; 16] {
    fastrand::u128(..).to_be_bytes()
}

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
                let id = new_id();
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
        // One transaction per sink: its events move all at once, so a crash part-way never
        // leaves some of them above the others (the next reopen moves them all again, in
        // order, since the file does not have this store's id until every sink is done).
        let txn = db.begin_write()?;
        {
            let mut queue = txn.open_table(QUEUE)?;
            let rows: Vec<(u64, u64)> = queue
                .range((sink.as_str(), 0)..=(sink.as_str(), u64::MAX))?
                .map(|entry| entry.map(|(key, copy)| (key.value().1, copy.value())))
                .collect::<Result<_, _>>()?;
            // Above the highest of the file and every number a task may stand at.
            let first_new = rows.last().map_or(0, |(last, _)| last + 1).max(floor);
            for (number, _) in &rows {
                queue.remove((sink.as_str(), *number))?;
            }
            for ((_, copy), new) in rows.iter().zip(first_new..) {
                queue.insert((sink.as_str(), new), *copy)?;
            }
            renumbered += rows.len();
        }
        txn.commit()?;
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
