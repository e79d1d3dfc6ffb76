//! Why the state store failed, each case with what to do about it.

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(
        "the state store {path} cannot be opened: {reason}. If it is damaged, start with \
         --fresh-state to move it aside and begin afresh (what it holds is then not delivered)"
    )]
    Open { path: String, reason: String },
    #[error(
        "the state store {path} holds events of an earlier version that could not be \
         converted to this version's format: {reason}. Nothing is lost, and what was converted \
         stays converted: free space on its disk (a conversion takes room for 10,000 events \
         at a time) and start again, or go back to the earlier version"
    )]
    Convert { path: String, reason: String },
    #[error("the state store {path} is in use by another process (is the agent running?)")]
    InUse { path: String },
    #[error(
        "the state directory {dir} is in use by {holder}: one process at a time writes it \
         (a second agent would poll, approve and deliver beside the first); stop the agent first"
    )]
    Locked { dir: String, holder: String },
    #[error("the state store {path} failed: {reason} (is the disk full or read-only?)")]
    Io { path: String, reason: String },
    #[error(
        "the state store {path} holds an unreadable {what}: {reason}. Start with --fresh-state \
         to move it aside and begin afresh"
    )]
    Corrupt {
        path: String,
        what: &'static str,
        reason: String,
    },
}
