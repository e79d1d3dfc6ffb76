//! `[state]`: where the agent keeps what must survive it, and the check that it can.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// `[state]`: where the agent keeps what must survive it.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct StateConfig {
    #[serde(default = "default_state_dir")]
    pub dir: PathBuf,
}

impl Default for StateConfig {
    fn default() -> Self {
        StateConfig {
            dir: default_state_dir(),
        }
    }
}

fn default_state_dir() -> PathBuf {
    PathBuf::from("/var/lib/sched-relay")
}

impl StateConfig {
    /// Problems, as (key under `state`, message).
    pub fn validate(&self) -> Vec<(String, String)> {
        if self.dir.as_os_str().is_empty() {
            return vec![("dir".into(), "must name a directory".into())];
        }
        Vec::new()
    }
}

/// The state directory must exist and be writable before anything is promised.
pub fn check_state_dir(dir: &Path) -> Result<(), std::io::Error> {
    std::fs::create_dir_all(dir)?;
    let probe = dir.join(".write-test");
    std::fs::write(&probe, b"")?;
    std::fs::remove_file(probe)
}
