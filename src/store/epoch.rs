//! The incarnation epoch of the last processed document (see
//! `sched_relay_core::continuity`): how many times Azure restarted DocumentIncarnation, as
//! far as this agent has seen. It is written in the same transaction as the document and its
//! events ([`Outbox::commit`]), so a crash between the two can neither re-use nor skip an
//! epoch, and a document derived again after a failed commit or a restart gets the same ids.

use redb::ReadableDatabase;
use serde_json::Value;

use super::{Access, EPOCH, META, Outbox, StoreError};

/// A processed document and its incarnation epoch, stored together as the last processed one.
#[derive(Debug, Clone, Copy)]
pub struct Processed<'a> {
    pub document: &'a Value,
    pub epoch: u64,
}

impl Processed<'_> {
    pub(super) fn epoch_bytes(&self) -> [u8; 8] {
        self.epoch.to_be_bytes()
    }
}

impl Outbox {
    /// The epoch of the last processed document; 0 when none was stored (a store written
    /// before epochs existed had seen no reset).
    pub fn last_epoch(&self) -> Result<u64, StoreError> {
        self.reopen_if_due();
        let stored = self.with_db(Access::Read, |db| {
            let txn = db.begin_read().map_err(|e| self.io(e))?;
            let meta = txn.open_table(META).map_err(|e| self.io(e))?;
            Ok(meta
                .get(EPOCH)
                .map_err(|e| self.io(e))?
                .map(|bytes| bytes.value().to_vec()))
        })?;
        let Some(bytes) = stored else {
            return Ok(0);
        };
        let bytes: [u8; 8] = bytes
            .as_slice()
            .try_into()
            .map_err(|_| StoreError::Corrupt {
                path: self.path.display().to_string(),
                what: "incarnation epoch",
                reason: format!("expected 8 bytes, found {}", bytes.len()),
            })?;
        Ok(u64::from_be_bytes(bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_epoch_is_stored_with_the_document_and_survives_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let document = serde_json::json!({"DocumentIncarnation": 1, "Events": []});
        {
            let outbox = Outbox::open(dir.path(), 10, false).unwrap();
            assert_eq!(outbox.last_epoch().unwrap(), 0, "no reset seen yet");
            let processed = Processed {
                document: &document,
                epoch: 2,
            };
            outbox.commit(&["s".into()], &[], Some(processed)).unwrap();
            // Events without a document (approval outcomes) leave the epoch alone.
            outbox.commit(&["s".into()], &[], None).unwrap();
        }
        let outbox = Outbox::open(dir.path(), 10, false).unwrap();
        assert_eq!(outbox.last_epoch().unwrap(), 2);
        assert_eq!(outbox.last_document().unwrap(), Some(document));
    }
}
