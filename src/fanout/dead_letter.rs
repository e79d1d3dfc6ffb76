//! The dead-letter file of each sink (`<state.dir>/dead-letter/<sink>.jsonl`): what a sink
//! refused for good, or an outbox full for it, one JSON line per event with the reason,
//! fsync'd before the event may leave the outbox.

use std::path::{Path, PathBuf};

use sched_relay_transport::{Event, SinkError};

/// The dead-letter file of one sink.
#[derive(Clone)]
pub(super) struct DeadLetter {
    pub(super) path: PathBuf,
}

impl DeadLetter {
    pub(super) fn new(dir: &Path, sink: &str) -> Self {
        DeadLetter {
            path: dir.join(format!("{sink}.jsonl")),
        }
    }

    /// Appends one line per event: `{"sink", "reason", "at", "event"}`. If even that fails,
    /// the event is logged in full so an operator can still recover it from the logs.
    pub(super) fn write(&self, events: &[Event], reason: &str) {
        let entries: Vec<Result<Event, String>> = events.iter().cloned().map(Ok).collect();
        if let Err(error) = self.try_write(&entries, reason) {
            let lost = self.lines(&entries, reason);
            tracing::error!(path = %self.path.display(), error = %error, lost = %String::from_utf8_lossy(&lost), "Cannot write the dead-letter file");
        }
    }

    /// Appends and fsyncs one line per entry; an entry that could not be read from the
    /// outbox is kept as `{"sink", "reason", "at", "unreadable"}` with what was stored.
    pub(super) fn try_write(
        &self,
        entries: &[Result<Event, String>],
        reason: &str,
    ) -> Result<(), SinkError> {
        sched_relay_file::append(&self.path, &self.lines(entries, reason), true)
    }

    fn lines(&self, entries: &[Result<Event, String>], reason: &str) -> Vec<u8> {
        let sink = self
            .path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let at = chrono::Utc::now().to_rfc3339();
        // Dead-letter files are read by people and shipped to log stores: no credentials.
        let reason = sched_relay_transport::redact::text(reason);
        let mut lines = Vec::new();
        for entry in entries {
            let record = match entry {
                Ok(event) => {
                    serde_json::json!({"sink": sink, "reason": reason, "at": at, "event": event})
                }
                Err(unreadable) => {
                    serde_json::json!({"sink": sink, "reason": reason, "at": at, "unreadable": unreadable})
                }
            };
            lines.extend_from_slice(record.to_string().as_bytes());
            lines.push(b'\n');
        }
        lines
    }
}
