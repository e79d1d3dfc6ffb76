//! Each stored event once, whatever the number of sinks: a sink's queue holds (sink,
//! sequence number) -> the id of the event's stored copy, and a copy that several queues
//! hold counts them. A 1000-event document with four sinks wrote 4000 copies of about 1 kB
//! before; now 1000 copies and 4000 queue rows of a (sink, number) key and an 8-byte id
//! (`benches/profiling.md`, section 19). The copy leaves with the last queue row that names
//! it.
//!
//! Stores written before this format (the `events` table: (sink, sequence number) -> the
//! event) are converted when opened ([`convert_legacy_events`]), in batches.

use redb::{
    Database, ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition, TableHandle,
    WriteTransaction,
};

use super::{Outbox, StoreError};

/// The stores written before the queues named shared copies: (sink, sequence number) -> the
/// event. Only read, to convert it (then deleted).
const LEGACY_EVENTS: TableDefinition<(&str, u64), &[u8]> = TableDefinition::new("events");
/// (sink name, sequence number) -> the id of the event's copy in [`PAYLOADS`].
pub(super) const QUEUE: TableDefinition<(&str, u64), u64> = TableDefinition::new("event_queue");
/// Copy id -> the structured CloudEvent as JSON.
pub(super) const PAYLOADS: TableDefinition<u64, &[u8]> = TableDefinition::new("event_payloads");
/// Copy id -> how many queue rows name it, for a copy that more than one names: a copy
/// without a count has one holder (most stores have one sink: no count is written, and none
/// is found and deleted as each copy goes). The copy goes with the last holder. Stores
/// written before hold a count of 1 for such copies, read the same way.
pub(super) const HOLDERS: TableDefinition<u64, u32> = TableDefinition::new("event_holders");

/// Events converted per transaction (3 in tests, so that a small store takes several).
const CONVERT_BATCH: usize = if cfg!(test) { 3 } else { 10_000 };

/// The first free copy id: above every copy the file holds. An id is used again only once no
/// queue row names it (nothing in memory keeps copy ids), so this is read in the writing
/// transaction and kept nowhere else.
fn first_free(
    payloads: &impl ReadableTable<u64, &'static [u8]>,
) -> Result<u64, redb::StorageError> {
    Ok(match payloads.last()? {
        Some((id, _)) => id.value() + 1,
        None => 0,
    })
}

impl Outbox {
    /// Stores `encoded` once, each event for as many queues as `holders(i)` says (events
    /// no queue takes are not stored), and returns the id of the first copy (the others
    /// follow in order).
    pub(super) fn store_copies(
        &self,
        txn: &WriteTransaction,
        encoded: &[Vec<u8>],
        holders: impl Fn(usize) -> u32,
    ) -> Result<u64, StoreError> {
        let mut payloads = txn.open_table(PAYLOADS).map_err(|e| self.io(e))?;
        let mut counts = txn.open_table(HOLDERS).map_err(|e| self.io(e))?;
        let first = first_free(&payloads).map_err(|e| self.io(e))?;
        for (index, bytes) in encoded.iter().enumerate() {
            let holders = holders(index);
            if holders == 0 {
                continue;
            }
            let id = first + index as u64;
            payloads
                .insert(id, bytes.as_slice())
                .map_err(|e| self.io(e))?;
            if holders > 1 {
                counts.insert(id, holders).map_err(|e| self.io(e))?;
            } else {
                // No count means one holder: none may be left at a reused id.
                counts.remove(id).map_err(|e| self.io(e))?;
            }
        }
        Ok(first)
    }

    /// One queue row naming each of `ids` left: the copies no row names any more go.
    pub(super) fn release_copies(
        &self,
        txn: &WriteTransaction,
        ids: &[u64],
    ) -> Result<(), StoreError> {
        if ids.is_empty() {
            return Ok(());
        }
        let mut payloads = txn.open_table(PAYLOADS).map_err(|e| self.io(e))?;
        let mut counts = txn.open_table(HOLDERS).map_err(|e| self.io(e))?;
        for &id in ids {
            // No count: this row was its only holder.
            let held = counts
                .remove(id)
                .map_err(|e| self.io(e))?
                .map_or(1, |count| count.value());
            match held {
                0 | 1 => {
                    payloads.remove(id).map_err(|e| self.io(e))?;
                }
                // One holder left, which no count says.
                2 => {}
                _ => {
                    counts.insert(id, held - 1).map_err(|e| self.io(e))?;
                }
            }
        }
        Ok(())
    }
}

/// Whether the file holds events in the format before shared copies.
pub(super) fn has_legacy_events(db: &Database) -> Result<bool, redb::Error> {
    Ok(lists_legacy(db.begin_read()?.list_tables()?))
}

/// Whether `tables` (a transaction's) include the table of the format before shared copies.
fn lists_legacy(mut tables: impl Iterator<Item = impl TableHandle>) -> bool {
    tables.any(|table| table.name() == LEGACY_EVENTS.name())
}

/// Converts a store written before the queues named shared copies, in transactions of
/// [`CONVERT_BATCH`] events, each moving them from the old table to the new ones: a crash
/// leaves every event in one of them, and the next open goes on. An event keeps its sink and
/// sequence number, unless its sink's queue already holds that number or a higher one (a store
/// converted, then written by an earlier version, then opened here again) or the number is
/// below `floor` (converted in a running agent, whose sinks' tasks may stand that high): it
/// then goes after the sink's last, so nothing is overwritten or passed over, and what the
/// queue held first goes out first. Returns how many events it converted.
pub(super) fn convert_legacy_events(db: &Database, floor: u64) -> Result<usize, redb::Error> {
    let mut converted = 0;
    while let Some(batch) = convert_legacy_batch(db, floor)? {
        converted += batch;
    }
    Ok(converted)
}

/// One transaction of [`convert_legacy_events`]: how many events it moved, or `None` once
/// the old table is gone.
pub(super) fn convert_legacy_batch(
    db: &Database,
    floor: u64,
) -> Result<Option<usize>, redb::Error> {
    let txn = db.begin_write()?;
    if !lists_legacy(txn.list_tables()?) {
        return Ok(None);
    }
    let moved = {
        let mut old = txn.open_table(LEGACY_EVENTS)?;
        let mut queue = txn.open_table(QUEUE)?;
        let mut payloads = txn.open_table(PAYLOADS)?;
        let before = old.len()?;
        let first = first_free(&payloads)?;
        let mut moved = Vec::with_capacity(CONVERT_BATCH);
        for (id, entry) in (first..).zip(old.iter()?.take(CONVERT_BATCH)) {
            let (key, value) = entry?;
            let (sink, seq) = key.value();
            let last = queue
                .range((sink, 0)..=(sink, u64::MAX))?
                .next_back()
                .transpose()?
                .map(|(key, _)| key.value().1);
            let number = match last {
                Some(last) if last >= seq => last + 1,
                _ => seq,
            }
            .max(floor);
            // One holder: no count.
            payloads.insert(id, value.value())?;
            queue.insert((sink, number), id)?;
            moved.push((sink.to_owned(), seq));
        }
        for (sink, seq) in &moved {
            old.remove((sink.as_str(), *seq))?;
        }
        // Each batch must shrink the old table, else this loop would never end.
        if old.len()? + moved.len() as u64 != before {
            return Err(redb::StorageError::Corrupted(format!(
                "converting the stored events: the old table held {before} events and {} after moving {}",
                old.len()?,
                moved.len()
            ))
            .into());
        }
        moved.len()
    };
    if moved < CONVERT_BATCH {
        txn.delete_table(LEGACY_EVENTS)?;
    }
    txn.commit()?;
    Ok(Some(moved))
}

#[cfg(test)]
impl Outbox {
    /// For each copy the file holds, how many holders its count says (1 without one), and
    /// how many queue rows name it.
    pub(super) fn holders_counted_and_named(
        &self,
    ) -> (
        std::collections::BTreeMap<u64, u32>,
        std::collections::BTreeMap<u64, u32>,
    ) {
        self.with_db(super::Access::Read, |db| {
            let txn = db.begin_read().map_err(|e| self.io(e))?;
            let payloads = txn.open_table(PAYLOADS).map_err(|e| self.io(e))?;
            let counts = txn.open_table(HOLDERS).map_err(|e| self.io(e))?;
            let queue = txn.open_table(QUEUE).map_err(|e| self.io(e))?;
            let mut counted = std::collections::BTreeMap::new();
            for entry in payloads.iter().map_err(|e| self.io(e))? {
                let id = entry.map_err(|e| self.io(e))?.0.value();
                let count = counts.get(id).map_err(|e| self.io(e))?;
                counted.insert(id, count.map_or(1, |count| count.value()));
            }
            let mut named = std::collections::BTreeMap::new();
            for entry in queue.iter().map_err(|e| self.io(e))? {
                *named
                    .entry(entry.map_err(|e| self.io(e))?.1.value())
                    .or_insert(0) += 1;
            }
            Ok((counted, named))
        })
        .unwrap()
    }

    /// How many event copies, and holder counts, the file holds.
    pub(super) fn copies_held(&self) -> (u64, u64) {
        self.with_db(super::Access::Read, |db| {
            let txn = db.begin_read().map_err(|e| self.io(e))?;
            let payloads = txn.open_table(PAYLOADS).map_err(|e| self.io(e))?;
            let counts = txn.open_table(HOLDERS).map_err(|e| self.io(e))?;
            Ok((
                payloads.len().map_err(|e| self.io(e))?,
                counts.len().map_err(|e| self.io(e))?,
            ))
        })
        .unwrap()
    }

    /// Writes a count of 1 for every copy without one, as the last release did (test
    /// fixture).
    pub(super) fn count_every_copy(db: &redb::Database) {
        let txn = db.begin_write().unwrap();
        {
            let payloads = txn.open_table(PAYLOADS).unwrap();
            let mut counts = txn.open_table(HOLDERS).unwrap();
            for entry in payloads.iter().unwrap() {
                let id = entry.unwrap().0.value();
                if counts.get(id).unwrap().is_none() {
                    counts.insert(id, 1).unwrap();
                }
            }
        }
        txn.commit().unwrap();
    }

    /// Writes a count for a copy id, whatever the file holds (test fixture).
    pub(super) fn write_count(db: &redb::Database, id: u64, count: u32) {
        let txn = db.begin_write().unwrap();
        txn.open_table(HOLDERS).unwrap().insert(id, count).unwrap();
        txn.commit().unwrap();
    }

    /// Writes `rows` as a store of the earlier format did (test fixture).
    pub(super) fn write_legacy_rows(db: &redb::Database, rows: &[(&str, u64, Vec<u8>)]) {
        let txn = db.begin_write().unwrap();
        {
            let mut table = txn.open_table(LEGACY_EVENTS).unwrap();
            for (sink, seq, bytes) in rows {
                table.insert((*sink, *seq), bytes.as_slice()).unwrap();
            }
        }
        txn.commit().unwrap();
    }
}
