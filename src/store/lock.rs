//! The state directory's lock: one process at a time writes a state directory. The agent
//! holds it for its whole life, taken before anything in the directory is moved or opened
//! (`--fresh-state` included); each `outbox` command holds it while it runs. The lock is
//! the kernel's (`flock`, on `<state.dir>/lock`): it goes with its holder, however that
//! process ends, so a crash never leaves the directory locked.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, Write};
use std::path::Path;

use super::StoreError;

/// The lock file's name, in the state directory. It holds who locked it, for the message
/// another process gets.
pub const LOCK_FILE: &str = "lock";

/// The state directory's lock; released when dropped (or when the process ends).
#[derive(Debug)]
pub struct StateLock {
    file: File,
}

impl StateLock {
    /// Takes the lock of the state directory `dir` (made when missing), or says which process
    /// holds it.
    pub fn take(dir: &Path) -> Result<StateLock, StoreError> {
        let path = dir.join(LOCK_FILE);
        let failed = |reason: String| StoreError::Open {
            path: path.display().to_string(),
            reason,
        };
        std::fs::create_dir_all(dir)
            .map_err(|e| failed(format!("cannot create {}: {e}", dir.display())))?;
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| failed(format!("cannot open the state directory's lock: {e}")))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                let holder = holder.trim();
                return Err(StoreError::Locked {
                    dir: dir.display().to_string(),
                    holder: if holder.is_empty() {
                        "a process that has not said who it is yet".into()
                    } else {
                        holder.chars().take(200).collect()
                    },
                });
            }
            Err(TryLockError::Error(e)) => {
                return Err(failed(format!("cannot lock the state directory: {e}")));
            }
        }
        // Who holds it, for the next process that tries: written only by the holder. A failed
        // write (a full disk) leaves the lock held and the message vaguer.
        let command: Vec<String> = std::env::args().take(2).collect();
        let said = format!(
            "pid {} (`{}`, since {})\n",
            std::process::id(),
            command.join(" "),
            chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
        );
        let _ = file
            .set_len(0)
            .and_then(|()| file.rewind())
            .and_then(|()| file.write_all(said.as_bytes()));
        Ok(StateLock { file })
    }

    /// Whether the locked file is still `<dir>/lock` (not removed with its directory, or
    /// replaced): a lock on a file no longer there keeps nobody out.
    pub fn still_at(&self, dir: &Path) -> bool {
        use std::os::unix::fs::MetadataExt;
        match (self.file.metadata(), std::fs::metadata(dir.join(LOCK_FILE))) {
            (Ok(held), Ok(there)) => held.dev() == there.dev() && held.ino() == there.ino(),
            _ => false,
        }
    }
}
