//! The outbox seen by sink name, for backlogs whose sink is gone: which sinks hold events
//! (whatever the configuration says now), and moving one sink's backlog to another.

use std::ops::Bound;

use redb::{ReadableDatabase, ReadableTable};

use super::payloads::QUEUE;
use super::{Access, Outbox, StoreError};

impl Outbox {
    /// Every sink name that has events stored, with how many, in name order. Reads each
    /// sink's keys once: meant for start-up and the `outbox` command, not for every poll.
    pub fn stored_sinks(&self) -> Result<Vec<(String, usize)>, StoreError> {
        self.reopen_if_due();
        self.with_db(Access::Read, |db| {
            let txn = db.begin_read().map_err(|e| self.io(e))?;
            let table = txn.open_table(QUEUE).map_err(|e| self.io(e))?;
            let mut sinks = Vec::new();
            let mut after: Option<String> = None;
            loop {
                // The first key past the previous sink's last possible key is the next sink.
                let next = match &after {
                    None => table.first().map_err(|e| self.io(e))?,
                    Some(previous) => table
                        .range::<(&str, u64)>((
                            Bound::Excluded((previous.as_str(), u64::MAX)),
                            Bound::Unbounded,
                        ))
                        .map_err(|e| self.io(e))?
                        .next()
                        .transpose()
                        .map_err(|e| self.io(e))?,
                };
                let Some((key, _)) = next else {
                    return Ok(sinks);
                };
                let sink = key.value().0.to_owned();
                let depth = self.count(&table, &sink)?.depth;
                sinks.push((sink.clone(), depth));
                after = Some(sink);
            }
        })
    }

    /// Moves every event stored for `from` to the end of `to`'s queue, in order, in one
    /// transaction; returns how many. For a renamed sink, while the agent is stopped.
    pub fn move_sink(&self, from: &str, to: &str) -> Result<usize, StoreError> {
        if from == to {
            return Ok(0);
        }
        self.reopen_if_due();
        let mut counters = self.lock_counters();
        let moved = self.with_db(Access::Upkeep, |db| {
            let txn = self.write(db)?;
            let moved = {
                let mut table = txn.open_table(QUEUE).map_err(|e| self.io(e))?;
                let first = self.count(&table, to)?.next;
                // The rows move; the copies they name stay where they are.
                let taken: Vec<(u64, u64)> = table
                    .range((from, 0)..=(from, u64::MAX))
                    .map_err(|e| self.io(e))?
                    .map(|entry| {
                        entry
                            .map(|(key, copy)| (key.value().1, copy.value()))
                            .map_err(|e| self.io(e))
                    })
                    .collect::<Result<_, _>>()?;
                for (next, (seq, copy)) in (first..).zip(&taken) {
                    table.remove((from, *seq)).map_err(|e| self.io(e))?;
                    table.insert((to, next), *copy).map_err(|e| self.io(e))?;
                }
                taken.len()
            };
            txn.commit().map_err(|e| self.io(e))?;
            Ok(moved)
        })?;
        counters.remove(from);
        counters.remove(to);
        Ok(moved)
    }
}
