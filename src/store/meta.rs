//! Small named JSON values in the META table, beside the last processed document: what the
//! agent learned once and must still know after a restart when its source fails (the VM
//! identity from instance metadata).

use redb::ReadableDatabase;
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

    /// Keeps `value` under `key`, durably.
    pub fn set_meta(&self, key: &str, value: &Value) -> Result<(), StoreError> {
        let bytes = serde_json::to_vec(value).map_err(|e| self.io(e))?;
        self.reopen_if_due();
        self.with_db(Access::Write, |db| {
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
