//! What one commit of the coordinator's state writes, whichever store keeps it (the redb
//! file, or NATS KV with a standby): shared by both, so that neither names the other.

use chrono::{DateTime, Utc};

use super::fleet::{Maintenance, Pause, Vm};

/// What one commit writes.
#[derive(Debug, Default)]
pub struct Changes {
    pub events: Vec<(String, Option<Maintenance>)>,
    pub vms: Vec<(String, Vm)>,
    pub vms_removed: Vec<String>,
    pub seen: Vec<((String, String), DateTime<Utc>)>,
    pub unseen: Vec<(String, String)>,
    /// `Some` when the pause switch changed: paused (`Some(Some)`) or resumed.
    pub paused: Option<Option<Pause>>,
}

impl Changes {
    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
            && self.vms.is_empty()
            && self.vms_removed.is_empty()
            && self.seen.is_empty()
            && self.unseen.is_empty()
            && self.paused.is_none()
    }

    /// Adds what a later message changed: written after what this holds.
    pub fn extend(&mut self, later: Changes) {
        self.events.extend(later.events);
        self.vms.extend(later.vms);
        self.vms_removed.extend(later.vms_removed);
        self.seen.extend(later.seen);
        self.unseen.extend(later.unseen);
        if later.paused.is_some() {
            self.paused = later.paused;
        }
    }

    /// Keeps each key's last write only (a group of messages about one VM writes it once),
    /// in the order of those last writes.
    pub fn keep_last(&mut self) {
        keep_last_by(&mut self.events, |(key, _)| key.clone());
        keep_last_by(&mut self.vms, |(name, _)| name.clone());
        keep_last_by(&mut self.vms_removed, Clone::clone);
        keep_last_by(&mut self.seen, |(key, _)| key.clone());
        keep_last_by(&mut self.unseen, Clone::clone);
    }
}

/// Drops every entry whose key comes again later.
fn keep_last_by<T, K: std::hash::Hash + Eq>(entries: &mut Vec<T>, key: impl Fn(&T) -> K) {
    if entries.len() < 2 {
        return;
    }
    let mut later = std::collections::HashSet::with_capacity(entries.len());
    let mut kept: Vec<T> = Vec::with_capacity(entries.len());
    for entry in entries.drain(..).rev() {
        if later.insert(key(&entry)) {
            kept.push(entry);
        }
    }
    kept.reverse();
    *entries = kept;
}
