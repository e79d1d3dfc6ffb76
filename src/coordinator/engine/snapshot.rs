//! `/fleet` and the budget gauges, refreshed from what the engine holds. Each VM's and each
//! event's part of the document is kept, written, beside a copy of what it was written
//! from, and written again only when that changed: at 10,000 VMs, writing every part on
//! every refresh held the loop (and every decision behind it) for 25-44 ms each half
//! second, against about 24 ms now (benches/profiling.md, sections 29 and 30).

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::value::RawValue;

use super::Engine;
use crate::coordinator::fleet::{Maintenance, Vm};
use crate::coordinator::policy;

/// The parts of `/fleet` kept written between refreshes.
#[derive(Default)]
pub(super) struct Written {
    /// Each VM by name, with whether it was silent.
    vms: Parts<(Vm, bool)>,
    /// Each event by key.
    events: Parts<Maintenance>,
    /// The length of the last document written.
    size: usize,
}

/// JSON parts in key order, each beside a copy of what it was written from.
struct Parts<T> {
    parts: Vec<Part<T>>,
    /// How many parts the last refresh wrote.
    writes: usize,
}

impl<T> Default for Parts<T> {
    fn default() -> Self {
        Parts {
            parts: Vec::new(),
            writes: 0,
        }
    }
}

struct Part<T> {
    key: String,
    from: T,
    json: Box<RawValue>,
}

impl<T> Parts<T> {
    /// Brings the parts to `items`, given in ascending key order (a `BTreeMap`'s): an
    /// item that is `same` as what its part was written from keeps the part; any other is
    /// written again and `kept`. Parts of keys no longer given are dropped.
    fn refresh<'i, I: Serialize>(
        &mut self,
        items: impl Iterator<Item = (&'i String, I)>,
        same: impl Fn(&T, &I) -> bool,
        mut kept: impl FnMut(&I) -> T,
    ) -> serde_json::Result<()> {
        let capacity = self.parts.len();
        let last = std::mem::replace(&mut self.parts, Vec::with_capacity(capacity));
        let mut old = last.into_iter().peekable();
        self.writes = 0;
        for (key, item) in items {
            while old.next_if(|part| part.key < *key).is_some() {}
            let key = match old.next_if(|part| part.key == *key) {
                Some(part) if same(&part.from, &item) => {
                    self.parts.push(part);
                    continue;
                }
                Some(part) => part.key,
                None => key.clone(),
            };
            self.writes += 1;
            self.parts.push(Part {
                json: serde_json::value::to_raw_value(&item)?,
                from: kept(&item),
                key,
            });
        }
        Ok(())
    }

    /// The parts as a JSON list.
    fn list(&self) -> impl Serialize + '_ {
        Seq(self)
    }

    /// The parts as a JSON object, by key.
    fn by_key(&self) -> impl Serialize + '_ {
        Map(self)
    }
}

struct Seq<'p, T>(&'p Parts<T>);

impl<T> Serialize for Seq<'_, T> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.0.parts.iter().map(|part| &*part.json))
    }
}

struct Map<'p, T>(&'p Parts<T>);

impl<T> Serialize for Map<'_, T> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(self.0.parts.iter().map(|part| (&part.key, &*part.json)))
    }
}

/// A VM as `/fleet` shows it: with whether it is silent now.
#[derive(Serialize)]
struct VmView<'e> {
    #[serde(flatten)]
    vm: &'e Vm,
    silent: bool,
}

/// `/fleet`, serialized as it is read. Its fields are in alphabetical order, as they were
/// while it was a tree of JSON values.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct View<'e, E: Serialize, V: Serialize> {
    azure: Option<super::azure::AzureJson<'e>>,
    caught_up: bool,
    conflicts: &'e std::collections::BTreeMap<String, String>,
    dry_run: bool,
    events: E,
    fleet: &'e Option<policy::Usage>,
    groups: &'e [policy::Usage],
    paused: &'e Option<crate::coordinator::fleet::Pause>,
    time: String,
    vms: V,
}

impl Engine {
    /// Tests: `/fleet` as last refreshed.
    #[cfg(test)]
    pub(crate) fn fleet_json(&self) -> serde_json::Value {
        let body = self.snapshot.read().unwrap_or_else(|e| e.into_inner());
        serde_json::from_slice(&body).expect("/fleet is JSON")
    }

    /// Tests: forgets the parts kept written (the next refresh writes every part).
    #[cfg(test)]
    pub(crate) fn forget_written(&mut self) {
        self.written = Written::default();
    }

    /// Tests: how many VMs' and events' parts the last refresh wrote.
    #[cfg(test)]
    pub(crate) fn last_writes(&self) -> (usize, usize) {
        (self.written.vms.writes, self.written.events.writes)
    }

    /// Refreshes `/fleet` and the budget gauges.
    pub(crate) fn publish_snapshot(&mut self, now: DateTime<Utc>) {
        let started = std::time::Instant::now();
        self.dirty = false;
        self.snapshot_at = Some(now);
        let budgets = policy::usage(&self.fleet, &self.policy, now);
        for u in budgets.groups.iter().chain(&budgets.fleet) {
            let group = u.group.clone();
            metrics::gauge!("sched_relay_coordinator_budget_in_use", "group" => group.clone())
                .set(u.down.len() as f64);
            metrics::gauge!("sched_relay_coordinator_budget_limit", "group" => group.clone())
                .set(u.limit as f64);
            metrics::gauge!("sched_relay_coordinator_group_size", "group" => group.clone())
                .set(u.size as f64);
            metrics::gauge!("sched_relay_coordinator_silent_vms", "group" => group.clone())
                .set(u.silent.len() as f64);
            metrics::gauge!("sched_relay_coordinator_holds_overdue", "group" => group.clone())
                .set(u.overdue.len() as f64);
            metrics::gauge!("sched_relay_coordinator_vms_without_agent", "group" => group)
                .set(u.without_agent.len() as f64);
        }
        metrics::gauge!("sched_relay_coordinator_conflicting_vms")
            .set(self.fleet.conflicts.len() as f64);
        metrics::gauge!("sched_relay_coordinator_paused").set(if self.fleet.paused.is_some() {
            1.0
        } else {
            0.0
        });
        let silent_after = self.policy.silent_after;
        let written = self
            .written
            .vms
            .refresh(
                self.fleet.vms().iter().map(|(name, vm)| {
                    let silent = vm.silent(now, silent_after);
                    (name, VmView { vm, silent })
                }),
                |(vm, silent), view| *silent == view.silent && vm == view.vm,
                |view| (view.vm.clone(), view.silent),
            )
            .and_then(|()| {
                self.written.events.refresh(
                    self.fleet.events.iter(),
                    |kept, event| kept == *event,
                    |event| (*event).clone(),
                )
            });
        let view = View {
            azure: self.azure_view(now),
            caught_up: self.ready,
            conflicts: &self.fleet.conflicts,
            dry_run: self.config.coordinator.dry_run,
            events: self.written.events.list(),
            fleet: &budgets.fleet,
            groups: &budgets.groups,
            paused: &self.fleet.paused,
            time: now.to_rfc3339(),
            vms: self.written.vms.by_key(),
        };
        // Sized from the last document, so that it is not copied as it grows, and trimmed
        // once written: `Bytes` keeps the whole allocation (glibc trims a block in place, or
        // remaps a large one, without a copy).
        let mut buffer = Vec::with_capacity(self.written.size + self.written.size / 8);
        let snapshot = match written.and_then(|()| serde_json::to_writer(&mut buffer, &view)) {
            Ok(()) => {
                self.written.size = buffer.len();
                buffer.shrink_to_fit();
                bytes::Bytes::from(buffer)
            }
            Err(error) => {
                // (Nothing in the fleet fails to serialize; /fleet keeps the last one if so.)
                tracing::error!(error = %error, "Cannot write /fleet");
                return;
            }
        };
        // The last snapshot is one buffer: dropped under the lock at no cost.
        *self.snapshot.write().unwrap_or_else(|e| e.into_inner()) = snapshot;
        self.snapshot_cost = Some((std::time::Instant::now(), started.elapsed()));
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::Parts;

    proptest! {
        /// Whatever changes between refreshes (keys added, removed, values changed or
        /// not), the parts kept say what writing every part again would.
        #[test]
        fn parts_kept_between_refreshes_say_what_a_full_rewrite_says(
            states in proptest::collection::vec(
                proptest::collection::btree_map("[a-e]{1,2}", 0u8..4, 0..12),
                1..8,
            )
        ) {
            let mut parts = Parts::default();
            for state in &states {
                parts
                    .refresh(state.iter(), |kept, value| kept == *value, |value| **value)
                    .unwrap();
                let list: Vec<&u8> = state.values().collect();
                prop_assert_eq!(
                    serde_json::to_string(&parts.by_key()).unwrap(),
                    serde_json::to_string(state).unwrap()
                );
                prop_assert_eq!(
                    serde_json::to_string(&parts.list()).unwrap(),
                    serde_json::to_string(&list).unwrap()
                );
            }
        }
    }

    /// A part is written again only when what it was written from changed.
    #[test]
    fn parts_are_written_again_only_when_their_value_changes() {
        let mut parts = Parts::default();
        let mut writes = 0;
        let mut refresh = |parts: &mut Parts<u8>, state: &BTreeMap<String, u8>| {
            parts
                .refresh(
                    state.iter(),
                    |kept, value| kept == *value,
                    |value| {
                        writes += 1;
                        **value
                    },
                )
                .unwrap();
        };
        let mut state = BTreeMap::from([("a".to_owned(), 1), ("b".to_owned(), 2)]);
        refresh(&mut parts, &state);
        state.insert("b".to_owned(), 3);
        refresh(&mut parts, &state);
        refresh(&mut parts, &state);
        state.remove("a");
        refresh(&mut parts, &state);
        assert_eq!(writes, 3, "a and b once, b again once, then nothing");
    }
}
