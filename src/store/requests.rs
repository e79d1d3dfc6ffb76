//! Approval request ids and their outcomes, so that no approval is lost in a crash and none
//! is forwarded twice on purpose.
//!
//! A request that passes the freshness check is recorded *in flight* (its id and until when
//! to keep it) before anything is sent; once its outcome is published, the record is
//! *finished* with that outcome. IMDS approval is idempotent (a second StartRequests POST of
//! the same EventId is harmless), so:
//! - a redelivery of an in-flight id (the agent was killed after the POST, before the
//!   outcome) is checked and forwarded again, and an event that has Started meanwhile counts
//!   as approved (this request may have started it);
//! - a redelivery of a finished id is answered with its stored outcome (the same outcome
//!   event id, so consumers de-duplicate), never forwarded again: replay protection;
//! - an id recorded by an older version in `seen_requests` (no outcome kept) is a replay.
//!
//! A failed outcome (`imds_error`) leaves the record in flight: the same request may be sent
//! again. Records are forgotten once their request is too old to pass the freshness check.

use redb::{ReadableTable, TableDefinition};
use serde::{Deserialize, Serialize};

use super::{Access, Outbox, SEEN_REQUESTS, StoreError};

/// request id -> [`Record`] as JSON.
pub(super) const APPROVAL_REQUESTS: TableDefinition<&str, &[u8]> =
    TableDefinition::new("approval_requests");

/// An outcome as stored, to answer a redelivery with.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoredOutcome {
    /// `accepted` or `rejected`.
    pub outcome: String,
    /// The CloudEvents id of the outcome event that was published.
    pub event_id: String,
    /// The reply body the requester got.
    pub body: serde_json::Value,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Record {
    /// Unix seconds after which the id may be forgotten.
    keep_until: i64,
    /// None while in flight.
    outcome: Option<StoredOutcome>,
}

/// What the store knew of a request id when it was recorded.
#[derive(Debug, Clone, PartialEq)]
pub enum Seen {
    /// Never seen: now recorded in flight.
    New,
    /// In flight already: handled before, but its outcome was never recorded (a crash, or
    /// a failed POST). Check and forward it again.
    InFlight,
    /// Handled, with this outcome: answer with it, send nothing.
    Finished(StoredOutcome),
    /// Recorded by an older version, without its outcome: a replay.
    Replayed,
}

impl Outbox {
    /// Records request `id` in flight until `keep_until` (Unix seconds), durably, unless it
    /// is known; says what was known. Records whose time has passed are forgotten in the same
    /// transaction. An error means nothing could be recorded: the request must fail
    /// (retriably), not be called a replay.
    pub fn begin_request(&self, id: &str, keep_until: i64, now: i64) -> Result<Seen, StoreError> {
        self.reopen_if_due();
        self.with_db(Access::Write, |db| {
            let txn = self.write(db)?;
            let seen = {
                let mut legacy = txn.open_table(SEEN_REQUESTS).map_err(|e| self.io(e))?;
                let mut table = txn.open_table(APPROVAL_REQUESTS).map_err(|e| self.io(e))?;
                let known = table
                    .get(id)
                    .map_err(|e| self.io(e))?
                    .map(|bytes| serde_json::from_slice::<Record>(bytes.value()));
                let seen = match known {
                    Some(Ok(Record {
                        outcome: Some(outcome),
                        ..
                    })) => Seen::Finished(outcome),
                    Some(Ok(_)) => Seen::InFlight,
                    // Unreadable: safest is to treat it as handled without an answer.
                    Some(Err(_)) => Seen::Replayed,
                    None if legacy.get(id).map_err(|e| self.io(e))?.is_some() => Seen::Replayed,
                    None => {
                        let record = Record {
                            keep_until,
                            outcome: None,
                        };
                        let bytes = serde_json::to_vec(&record).map_err(|e| self.io(e))?;
                        table.insert(id, bytes.as_slice()).map_err(|e| self.io(e))?;
                        Seen::New
                    }
                };
                table
                    .retain(|_, bytes| {
                        serde_json::from_slice::<Record>(bytes)
                            .map(|record| record.keep_until >= now)
                            .unwrap_or(false)
                    })
                    .map_err(|e| self.io(e))?;
                legacy
                    .retain(|_, until| until >= now)
                    .map_err(|e| self.io(e))?;
                seen
            };
            txn.commit().map_err(|e| self.io(e))?;
            Ok(seen)
        })
    }

    /// Finishes in-flight records with their published outcomes, in one transaction.
    pub fn finish_requests(&self, finished: &[(String, StoredOutcome)]) -> Result<(), StoreError> {
        if finished.is_empty() {
            return Ok(());
        }
        self.reopen_if_due();
        self.with_db(Access::Write, |db| {
            let txn = self.write(db)?;
            {
                let mut table = txn.open_table(APPROVAL_REQUESTS).map_err(|e| self.io(e))?;
                for (id, outcome) in finished {
                    let keep_until = table
                        .get(id.as_str())
                        .map_err(|e| self.io(e))?
                        .and_then(|bytes| serde_json::from_slice::<Record>(bytes.value()).ok())
                        .map(|record| record.keep_until);
                    // Forgotten meanwhile (too old): nothing left to protect.
                    let Some(keep_until) = keep_until else {
                        continue;
                    };
                    let record = Record {
                        keep_until,
                        outcome: Some(outcome.clone()),
                    };
                    let bytes = serde_json::to_vec(&record).map_err(|e| self.io(e))?;
                    table
                        .insert(id.as_str(), bytes.as_slice())
                        .map_err(|e| self.io(e))?;
                }
            }
            txn.commit().map_err(|e| self.io(e))
        })
    }

    /// Records a request id as seen until `keep_until`; false when it was known already (in
    /// flight, finished or a replay). [`Outbox::begin_request`] says which.
    pub fn remember_request(
        &self,
        id: &str,
        keep_until: i64,
        now: i64,
    ) -> Result<bool, StoreError> {
        Ok(self.begin_request(id, keep_until, now)? == Seen::New)
    }
}
