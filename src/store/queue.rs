//! Each sink's queue in the outbox's events table: numbering a commit's events for every
//! sink (within `delivery.queue_capacity`), reading a sink's events in order, removing what its
//! task delivered, and the per-sink counters that spare a scan of the table per document.

use cloudevents::AttributesReader;
use redb::{Database, ReadableDatabase, ReadableTable};
use sched_relay_core::Event;

use super::payloads::{PAYLOADS, QUEUE};
use super::{Access, EPOCH, LAST_DOCUMENT, META, Outbox, PendingId, Processed, StoreError, Stored};

/// Where one sink's queue stands.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Counter {
    pub(super) next: u64,
    pub(super) depth: usize,
    /// Read again from the table before use (after a reopen); `next` then stays a floor, so
    /// a sequence number is never handed out twice in one process (a sink's task may have
    /// moved its cursor past the numbers of a commit that failed).
    pub(super) stale: bool,
}

/// Where one commit put a sink's events: the first `stored` events of the commit, numbered
/// from `first_seq` (a sink at capacity gets fewer, or none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    /// The sink's index in the `sinks` given to [`Outbox::commit_placing`].
    pub sink: usize,
    pub first_seq: u64,
    pub stored: usize,
}

impl Outbox {
    /// Stores `events` for each of `sinks` and, when given, `document` (with its epoch) as
    /// the last processed one, in one durable transaction. A sink already holding `capacity`
    /// events gets none of them; they are returned as (sink, event) for the dead-letter file.
    pub fn commit(
        &self,
        sinks: &[String],
        events: &[Event],
        document: Option<Processed>,
    ) -> Result<Vec<(String, Event)>, StoreError> {
        self.commit_placing(sinks, events, document, |_| {})
    }

    /// As [`Outbox::commit`], and tells `placed` where each sink's events go once their
    /// sequence numbers are known, before the durable commit: the fan-out hands them to the
    /// sinks in memory while the commit is written (they send them once it is durable). Numbers are handed out in commit
    /// order and never twice in one process, even when the commit fails (a failed commit
    /// leaves a gap).
    pub fn commit_placing(
        &self,
        sinks: &[String],
        events: &[Event],
        document: Option<Processed>,
        placed: impl FnOnce(&[Placement]),
    ) -> Result<Vec<(String, Event)>, StoreError> {
        self.reopen_if_due();
        let mut counters = self.lock_counters();
        // Numbered before the transaction, so that a commit that fails half-way still uses
        // its numbers up (below).
        let mut placements = Vec::with_capacity(sinks.len());
        let mut overflow = Vec::new();
        self.with_db(Access::Read, |db| {
            for (index, sink) in sinks.iter().enumerate() {
                let counter = self.counter(db, &mut counters, sink)?;
                let stored = events
                    .len()
                    .min(self.capacity.saturating_sub(counter.depth));
                overflow.extend(events[stored..].iter().map(|e| (sink.clone(), e.clone())));
                placements.push(Placement {
                    sink: index,
                    first_seq: counter.next,
                    stored,
                });
            }
            Ok(())
        })?;
        for placement in &placements {
            let counter = counters.entry(sinks[placement.sink].clone()).or_default();
            counter.next = placement.first_seq + placement.stored as u64;
            self.note_issued(counter.next);
        }
        placed(&placements);
        // Encoded once the sinks have the events: for a burst this is milliseconds.
        let encoded: Vec<Vec<u8>> = events
            .iter()
            .map(|e| {
                serde_json::to_vec(e)
                    .map_err(|error| self.io(format!("cannot encode {}: {error}", e.id())))
            })
            .collect::<Result<_, _>>()?;
        let document = document
            .map(|processed| {
                serde_json::to_vec(processed.document).map(|bytes| (bytes, processed.epoch_bytes()))
            })
            .transpose()
            .map_err(|e| self.io(e))?;
        self.with_db(Access::Events, |db| {
            let txn = self.write(db)?;
            {
                // Each event once; each sink's queue names the copies of its first `stored`.
                let widest = placements.iter().map(|p| p.stored).max().unwrap_or(0);
                let first_copy = self.store_copies(&txn, &encoded[..widest], |index| {
                    placements.iter().filter(|p| p.stored > index).count() as u32
                })?;
                let mut queue = txn.open_table(QUEUE).map_err(|e| self.io(e))?;
                for placement in &placements {
                    let sink = sinks[placement.sink].as_str();
                    for (seq, copy) in (placement.first_seq..)
                        .zip(first_copy..first_copy + placement.stored as u64)
                    {
                        queue.insert((sink, seq), copy).map_err(|e| self.io(e))?;
                    }
                }
                if let Some((bytes, epoch)) = &document {
                    let mut meta = txn.open_table(META).map_err(|e| self.io(e))?;
                    meta.insert(LAST_DOCUMENT, bytes.as_slice())
                        .map_err(|e| self.io(e))?;
                    meta.insert(EPOCH, epoch.as_slice())
                        .map_err(|e| self.io(e))?;
                }
            }
            txn.commit().map_err(|e| self.io(e))?;
            Ok(())
        })?;
        if let Some((bytes, epoch)) = document {
            self.remember_processed(bytes, epoch);
        }
        for placement in &placements {
            if let Some(counter) = counters.get_mut(&sinks[placement.sink]) {
                counter.depth += placement.stored;
            }
        }
        Ok(overflow)
    }

    /// A sink's counter, read from the table the first time (and after a reopen).
    fn counter(
        &self,
        db: &Database,
        counters: &mut std::collections::HashMap<String, Counter>,
        sink: &str,
    ) -> Result<Counter, StoreError> {
        if let Some(counter) = counters.get(sink).filter(|c| !c.stale) {
            return Ok(*counter);
        }
        let mut floor = counters.get(sink).map(|c| c.next).unwrap_or(0);
        if self.generation() > 0 {
            // Reopened: see `Outbox::issued`.
            floor = floor.max(self.issued.load(std::sync::atomic::Ordering::SeqCst));
        }
        let txn = db.begin_read().map_err(|e| self.io(e))?;
        let table = txn.open_table(QUEUE).map_err(|e| self.io(e))?;
        let mut counted = self.count(&table, sink)?;
        counted.next = counted.next.max(floor);
        counters.insert(sink.to_owned(), counted);
        Ok(counted)
    }

    /// Up to `max` of `sink`'s oldest events, in order.
    pub fn pending(&self, sink: &str, max: usize) -> Result<Vec<Stored>, StoreError> {
        self.pending_between(sink, 0, None, max)
    }

    /// Up to `max` of `sink`'s events numbered from `from` and below `until`, in order.
    pub fn pending_between(
        &self,
        sink: &str,
        from: u64,
        until: Option<u64>,
        max: usize,
    ) -> Result<Vec<Stored>, StoreError> {
        self.reopen_if_due();
        let until = until.unwrap_or(u64::MAX);
        if from >= until {
            return Ok(Vec::new());
        }
        self.with_db(Access::Read, |db| {
            let txn = db.begin_read().map_err(|e| self.io(e))?;
            let table = txn.open_table(QUEUE).map_err(|e| self.io(e))?;
            let payloads = txn.open_table(PAYLOADS).map_err(|e| self.io(e))?;
            let range = table
                .range((sink, from)..(sink, until))
                .map_err(|e| self.io(e))?;
            let mut stored = Vec::new();
            for entry in range.take(max) {
                let (key, copy) = entry.map_err(|e| self.io(e))?;
                let copy = copy.value();
                let event = match payloads.get(copy).map_err(|e| self.io(e))? {
                    Some(bytes) => decode(bytes.value()),
                    None => Err(format!("its stored copy ({copy}) is missing")),
                };
                stored.push(Stored {
                    seq: key.value().1,
                    event,
                });
            }
            if let Some(last) = stored.last() {
                self.note_issued(last.seq + 1);
            }
            Ok(stored)
        })
    }

    /// Forgets every event of `sink` numbered below `below` (its task delivered, or
    /// dead-lettered, everything before it). Not durable by itself: a crash before the next
    /// durable commit ([`Outbox::flush`], or any commit of events) delivers those events once
    /// more (at least once), and saves an fsync per delivered batch.
    pub fn remove_below(&self, sink: &str, below: u64) -> Result<(), StoreError> {
        self.reopen_if_due();
        let mut counters = self.lock_counters();
        let removed = self.with_db(Access::Volatile, |db| {
            // Counted before anything leaves: numbers after a removal must go on from the
            // highest ever stored (a sink's task is past the removed ones), not restart from
            // what is left (after a restart, the backlog is often delivered before anything
            // new is stored).
            self.counter(db, &mut counters, sink)?;
            let mut txn = self.write(db)?;
            txn.set_durability(redb::Durability::None)
                .map_err(|e| self.io(e))?;
            let mut copies = Vec::new();
            {
                let mut table = txn.open_table(QUEUE).map_err(|e| self.io(e))?;
                table
                    .retain_in((sink, 0)..(sink, below), |_, copy| {
                        copies.push(copy);
                        false
                    })
                    .map_err(|e| self.io(e))?;
            }
            self.release_copies(&txn, &copies)?;
            txn.commit().map_err(|e| self.io(e))?;
            Ok(copies.len())
        })?;
        if let Some(counter) = counters.get_mut(sink) {
            counter.depth = counter.depth.saturating_sub(removed);
        }
        Ok(())
    }

    /// Makes every earlier commit durable (the removals of [`Outbox::remove_below`]).
    pub fn flush(&self) -> Result<(), StoreError> {
        self.reopen_if_due();
        self.with_db(Access::Upkeep, |db| {
            self.write(db)?.commit().map_err(|e| self.io(e))
        })
    }

    /// Forgets `sink`'s events with these sequence numbers (delivered or dead-lettered).
    pub fn remove(&self, sink: &str, seqs: &[u64]) -> Result<(), StoreError> {
        self.reopen_if_due();
        let mut counters = self.lock_counters();
        let removed = self.with_db(Access::Upkeep, |db| {
            self.counter(db, &mut counters, sink)?;
            let txn = self.write(db)?;
            let mut copies = Vec::new();
            {
                let mut table = txn.open_table(QUEUE).map_err(|e| self.io(e))?;
                for seq in seqs {
                    if let Some(copy) = table.remove((sink, *seq)).map_err(|e| self.io(e))? {
                        copies.push(copy.value());
                    }
                }
            }
            self.release_copies(&txn, &copies)?;
            txn.commit().map_err(|e| self.io(e))?;
            Ok(copies.len())
        })?;
        if let Some(counter) = counters.get_mut(sink) {
            counter.depth = counter.depth.saturating_sub(removed);
        }
        Ok(())
    }

    pub(super) fn lock_counters(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, Counter>> {
        self.counters.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reads a sink's queue position from the table (once per sink and process).
    pub(super) fn count(
        &self,
        table: &impl ReadableTable<(&'static str, u64), u64>,
        sink: &str,
    ) -> Result<Counter, StoreError> {
        let mut range = table
            .range((sink, 0)..=(sink, u64::MAX))
            .map_err(|e| self.io(e))?;
        let next = match range.next_back() {
            Some(last) => last.map_err(|e| self.io(e))?.0.value().1 + 1,
            None => 0,
        };
        let depth = count_until_error(
            table
                .range((sink, 0)..=(sink, u64::MAX))
                .map_err(|e| self.io(e))?,
        )
        .map_err(|e| self.io(e))?;
        Ok(Counter {
            next,
            depth,
            stale: false,
        })
    }

    /// Whether `sink` still holds the event it numbered `seq` (not delivered, or delivered
    /// and not removed yet).
    pub fn holds(&self, sink: &str, seq: u64) -> Result<bool, StoreError> {
        self.reopen_if_due();
        self.with_db(Access::Read, |db| {
            let txn = db.begin_read().map_err(|e| self.io(e))?;
            let table = txn.open_table(QUEUE).map_err(|e| self.io(e))?;
            Ok(table.get((sink, seq)).map_err(|e| self.io(e))?.is_some())
        })
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
        self.reopen_if_due();
        let mut counters = self.lock_counters();
        if let Some(counter) = counters.get(sink).filter(|c| !c.stale) {
            return Ok(counter.depth);
        }
        let counter = self.with_db(Access::Read, |db| self.counter(db, &mut counters, sink))?;
        Ok(counter.depth)
    }
}

/// How many entries a range holds, or its first error. Not `Iterator::count`: once a read
/// fails (a database whose handle failed reads `PreviousIo` from every page it has not
/// cached) a redb range yields that error for ever, and counting the errors never ends. The
/// agent hung so on a full disk, in a sink's recount holding the store's lock.
fn count_until_error<T, E>(entries: impl Iterator<Item = Result<T, E>>) -> Result<usize, E> {
    let mut count = 0;
    for entry in entries {
        entry?;
        count += 1;
    }
    Ok(count)
}

/// A stored event, or why it cannot be read (with what was stored, for the log).
fn decode(bytes: &[u8]) -> Result<Event, String> {
    Event::from_json_slice(bytes)
        .map_err(|e| format!("{e}; stored bytes: {}", String::from_utf8_lossy(bytes)))
}

#[cfg(test)]
mod tests {
    use super::count_until_error;

    #[test]
    fn a_range_that_fails_for_ever_is_counted_to_its_first_error() {
        // What a redb range does once a read fails: that error, again and again.
        let failing = (0..).map(|i| if i < 3 { Ok(i) } else { Err("PreviousIo") });
        assert_eq!(count_until_error(failing), Err("PreviousIo"));
        assert_eq!(count_until_error((0..5).map(Ok::<_, ()>)), Ok(5));
    }
}
