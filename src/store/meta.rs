//! Small named JSON values in the META table, beside the last processed document: what the
//! agent learned once and must still know after a restart when its source fails (the VM
//! identity from instance metadata).

use redb::{ReadableDatabase, ReadableTable};
use serde_json::Value;

use super::{Access, META, Outbox, StoreError};

/// The VM identity instance metadata last answered.
pub const IDENTITY: &str = "identity";
/// When the metadata service last answered (Unix seconds, written once per start): it stays
/// enabled for a day after a request, so a restart within that day needs no long first call.
pub const IMDS_ANSWERED: &str = "imds_answered";
/// The EventIds this agent approved that are still in the document (see
/// `ImdsClient::accepted`), so that they survive a restart.
pub const ACCEPTED_EVENT_IDS: &str = "accepted_event_ids";

impl Outbox {
    /// The value kept under `key`, if any.
    pub fn meta(&self, key: &str) -> Result<Option<Value>, StoreError> {
        self.reopen_if_due();
        let stored = self.with_db(Access::Read, |db| {
            let txn = db.begin_read().map_err(|e| self.io(e))?;
            let meta = txn.open_table(META).map_err(|e| self.io(e))?;
            Ok(meta
                .get(key)
                .map_err(|e| self.io(e))?
                .map(|bytes| bytes.value().to_vec()))
        })?;
        let Some(bytes) = stored else {
            return Ok(None);
        };
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| StoreError::Corrupt {
                path: self.path.display().to_string(),
                what: "meta value",
                reason: format!("{key}: {e}"),
            })
    }

    /// While the store is known not to be writable, writes `processed` (the last document
    /// processed) again, with no events, if the store still holds it as the last one: a
    /// commit that changes nothing (a newer document committed meanwhile is left alone) and
    /// whose success ends that state; a store that holds no document (its file was made anew)
    /// takes this one. For a caller with nothing of its own to store (the
    /// poller, when no document changed), so that a commit of events nobody makes again (an
    /// approval's outcome) does not leave `/readyz` failing once the disk is fine. It is
    /// about a document's size, not a burst's: a disk with room for it and not for a burst
    /// is found out by the next commit of that burst.
    pub fn probe(&self, processed: super::Processed) {
        if self.unwritable().is_none() {
            return;
        }
        let Ok(bytes) = serde_json::to_vec(processed.document) else {
            return;
        };
        let epoch = processed.epoch_bytes();
        self.reopen_if_due();
        // Reported as a read: only a commit that was made says the store can be written.
        let probed = self.with_db(Access::Read, |db| {
            let txn = self.write(db)?;
            {
                let mut meta = txn.open_table(META).map_err(|e| self.io(e))?;
                let held = |key: &str| -> Result<Option<Vec<u8>>, StoreError> {
                    Ok(meta
                        .get(key)
                        .map_err(|e| self.io(e))?
                        .map(|value| value.value().to_vec()))
                };
                // No last document at all: the file was made anew while the agent ran
                // (`recovery`); the caller's document is the one it should hold.
                if let Some(held_document) = held(super::LAST_DOCUMENT)?
                    && (held_document != bytes
                        // A store written before epochs has none: epoch 0.
                        || held(super::EPOCH)?.unwrap_or_else(|| 0u64.to_be_bytes().to_vec())
                            != epoch.as_slice())
                {
                    return Ok(false);
                }
                meta.insert(super::LAST_DOCUMENT, bytes.as_slice())
                    .map_err(|e| self.io(e))?;
                meta.insert(super::EPOCH, epoch.as_slice())
                    .map_err(|e| self.io(e))?;
            }
            txn.commit().map_err(|e| self.io(e))?;
            Ok(true)
        });
        match probed {
            Ok(true) => {
                // What the file held already (kept at open or commit), unless it held no
                // document: a commit meanwhile may have remembered a newer one.
                self.remember_processed_if_none(bytes, epoch);
                self.health.wrote(&self.path.display().to_string(), true)
            }
            Ok(false) => tracing::debug!("No probe of the state store: its last document moved on"),
            Err(error) => {
                tracing::debug!(error = %error, "The state store still cannot be written")
            }
        }
    }

    /// Keeps `value` under `key`, durably.
    pub fn set_meta(&self, key: &str, value: &Value) -> Result<(), StoreError> {
        let bytes = serde_json::to_vec(value).map_err(|e| self.io(e))?;
        self.reopen_if_due();
        self.with_db(Access::Upkeep, |db| {
            let txn = self.write(db)?;
            {
                let mut meta = txn.open_table(META).map_err(|e| self.io(e))?;
                meta.insert(key, bytes.as_slice()).map_err(|e| self.io(e))?;
            }
            txn.commit().map_err(|e| self.io(e))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_meta_value_survives_reopening_and_is_replaced_by_the_next() {
        let dir = tempfile::tempdir().unwrap();
        let outbox = Outbox::open(dir.path(), 10, false).unwrap();
        assert_eq!(outbox.meta(IDENTITY).unwrap(), None);
        outbox
            .set_meta(IDENTITY, &serde_json::json!({"name": "vmss_1"}))
            .unwrap();
        outbox
            .set_meta(IDENTITY, &serde_json::json!({"name": "vmss_2"}))
            .unwrap();
        drop(outbox);
        let outbox = Outbox::open(dir.path(), 10, false).unwrap();
        assert_eq!(
            outbox.meta(IDENTITY).unwrap(),
            Some(serde_json::json!({"name": "vmss_2"}))
        );
        assert_eq!(outbox.last_document().unwrap(), None);
    }
}
