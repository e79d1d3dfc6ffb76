//! Approval request ids and their outcomes, so that no approval is lost in a crash and none
//! is forwarded twice on purpose.
//!
//! A request that passes the freshness check is recorded *in flight* (its id and until when
//! to keep it) before anything is sent; once its outcome is published, the record is
//! *finished* with that outcome. IMDS approval is idempotent (a second StartRequests POST of
//! the same EventId is harmless), so:
//! - once the metadata service accepted a request's POST, its record is marked *posted*
//!   before the outcome is published: a redelivery of a posted id (the agent was killed
//!   after the POST, before the outcome) is answered `accepted` without a second POST, even
//!   when its event has run and left the document since;
//! - a redelivery of an in-flight id that was not posted (killed before the POST, or in the
//!   milliseconds between the POST and its mark) is checked and forwarded again, and an event
//!   that has Started meanwhile counts as approved (this request may have started it);
//! - a redelivery of a finished id is answered with its stored outcome (the same outcome
//!   event id, so consumers de-duplicate), never forwarded again: replay protection;
//! - an id recorded by an older version in `seen_requests` (no outcome kept) is a replay;
//! - every record keeps what its request says (the signed content, EventIds included) and
//!   the EventIds its accepted POST named: a request that reuses a known id with other
//!   content is a replay, never answered with the record's outcome, and an answer from a
//!   record names the record's EventIds, not the arriving message's.
//!
//! A failed outcome (`imds_error`) leaves the record in flight: the same request may be sent
//! again. Records are kept a day past the point where their request is too old to pass the
//! freshness check, so that a redelivery after a long restart (a VM rebooting for the very
//! event it approved) is still answered with its outcome rather than refused as expired.

use redb::{ReadableDatabase, ReadableTable, TableDefinition};
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
    /// The metadata service accepted this request's StartRequests POST.
    #[serde(default)]
    posted: bool,
    /// What the request says (its signed content: id, source, time, VM, EventIds); a
    /// request with this id and other content is not this one. None in records written
    /// before the content was kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    content: Option<String>,
    /// The EventIds the accepted POST named (the document's spelling).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    posted_event_ids: Vec<String>,
}

impl Record {
    /// Whether this record is of a request with `content` (a record without one cannot say,
    /// and is taken to be).
    fn holds(&self, content: &str) -> bool {
        self.content.as_deref().is_none_or(|known| known == content)
    }

    fn seen(self, content: &str) -> Seen {
        if !self.holds(content) {
            return Seen::Altered;
        }
        match (self.outcome, self.posted) {
            (Some(outcome), _) => Seen::Finished(outcome),
            (None, true) => Seen::Posted {
                event_ids: self.posted_event_ids,
            },
            (None, false) => Seen::InFlight,
        }
    }
}

/// What the store knew of a request id when it was recorded.
#[derive(Debug, Clone, PartialEq)]
pub enum Seen {
    /// Never seen: now recorded in flight.
    New,
    /// In flight already: handled before, but its outcome was never recorded (a crash, or
    /// a failed POST): check and forward it again.
    InFlight,
    /// In flight, and the metadata service accepted its POST of these EventIds (empty in an
    /// earlier version's record): answer `accepted`, send nothing.
    Posted { event_ids: Vec<String> },
    /// Handled, with this outcome: answer with it, send nothing.
    Finished(StoredOutcome),
    /// Recorded by an older version, without its outcome: a replay.
    Replayed,
    /// Known with other content: another request reusing this one's id, never answered with
    /// this one's outcome (a replay).
    Altered,
}

impl Outbox {
    /// Records request `id` in flight until `keep_until` (Unix seconds), durably, unless it
    /// is known; says what was known. Records whose time has passed are forgotten in the same
    /// transaction. An error means nothing could be recorded: the request must fail
    /// (retriably), not be called a replay.
    /// `content` is what the request says (compared with the record's).
    pub fn begin_request(
        &self,
        id: &str,
        content: &str,
        keep_until: i64,
        now: i64,
    ) -> Result<Seen, StoreError> {
        self.reopen_if_due();
        self.with_db(Access::Upkeep, |db| {
            let txn = self.write(db)?;
            let seen = {
                let mut legacy = txn.open_table(SEEN_REQUESTS).map_err(|e| self.io(e))?;
                let mut table = txn.open_table(APPROVAL_REQUESTS).map_err(|e| self.io(e))?;
                // A record past its time counts as forgotten, pruned below or not.
                let known = table
                    .get(id)
                    .map_err(|e| self.io(e))?
                    .map(|bytes| serde_json::from_slice::<Record>(bytes.value()))
                    .filter(|record| !matches!(record, Ok(r) if r.keep_until < now));
                let seen = match known {
                    Some(Ok(record)) => record.seen(content),
                    // Unreadable: safest is to treat it as handled without an answer.
                    Some(Err(_)) => Seen::Replayed,
                    None if legacy.get(id).map_err(|e| self.io(e))?.is_some() => Seen::Replayed,
                    None => {
                        let record = Record {
                            keep_until,
                            outcome: None,
                            posted: false,
                            content: Some(content.to_owned()),
                            posted_event_ids: Vec::new(),
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
        self.with_db(Access::Upkeep, |db| {
            let txn = self.write(db)?;
            {
                let mut table = txn.open_table(APPROVAL_REQUESTS).map_err(|e| self.io(e))?;
                for (id, outcome) in finished {
                    let known = table
                        .get(id.as_str())
                        .map_err(|e| self.io(e))?
                        .and_then(|bytes| serde_json::from_slice::<Record>(bytes.value()).ok());
                    // Forgotten meanwhile (too old): nothing left to protect.
                    let Some(known) = known else {
                        continue;
                    };
                    let record = Record {
                        outcome: Some(outcome.clone()),
                        ..known
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

    /// What the store knows of request `id` with `content` at `now` (Unix seconds), without
    /// recording anything: None when nothing, or only a record past its time.
    pub fn peek_request(
        &self,
        id: &str,
        content: &str,
        now: i64,
    ) -> Result<Option<Seen>, StoreError> {
        self.reopen_if_due();
        self.with_db(Access::Read, |db| {
            let txn = db.begin_read().map_err(|e| self.io(e))?;
            let table = match txn.open_table(APPROVAL_REQUESTS) {
                Ok(table) => table,
                Err(redb::TableError::TableDoesNotExist(_)) => return Ok(None),
                Err(error) => return Err(self.io(error)),
            };
            let known = table
                .get(id)
                .map_err(|e| self.io(e))?
                .map(|bytes| serde_json::from_slice::<Record>(bytes.value()))
                .filter(|record| !matches!(record, Ok(r) if r.keep_until < now));
            Ok(match known {
                Some(Ok(record)) => Some(record.seen(content)),
                Some(Err(_)) => Some(Seen::Replayed),
                None => None,
            })
        })
    }

    /// Marks in-flight records as posted (the metadata service accepted them), each with
    /// the EventIds its POST named, durably, before their outcome is published.
    pub fn mark_posted(&self, posted: &[(String, Vec<String>)]) -> Result<(), StoreError> {
        if posted.is_empty() {
            return Ok(());
        }
        self.reopen_if_due();
        self.with_db(Access::Upkeep, |db| {
            let txn = self.write(db)?;
            {
                let mut table = txn.open_table(APPROVAL_REQUESTS).map_err(|e| self.io(e))?;
                for (id, event_ids) in posted {
                    let known = table
                        .get(id.as_str())
                        .map_err(|e| self.io(e))?
                        .and_then(|bytes| serde_json::from_slice::<Record>(bytes.value()).ok());
                    let Some(known) = known else { continue };
                    let record = Record {
                        posted: true,
                        posted_event_ids: event_ids.clone(),
                        ..known
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
        Ok(self.begin_request(id, "", keep_until, now)? == Seen::New)
    }
}
