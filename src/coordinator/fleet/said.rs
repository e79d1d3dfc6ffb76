//! What each VM's agent said of an event (Resources, NotBefore, DurationInSeconds), kept
//! apart per VM, and the event's fields taken from all of them together.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{Maintenance, Stage};

/// One VM's document's fields of an event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Said {
    #[serde(default)]
    pub resources: Vec<String>,
    #[serde(default)]
    pub not_before: Option<DateTime<Utc>>,
    #[serde(default)]
    pub duration_seconds: Option<i64>,
}

/// Copies the Azure event's type and source (as received) into the record.
pub(super) fn fields(entry: &mut Maintenance, event: &Value) {
    if let Some(ty) = event["EventType"].as_str() {
        entry.event_type = ty.to_owned();
    }
    entry.event_source = event["EventSource"].as_str().map(str::to_owned);
}

/// What one VM's document says of the event's Resources, NotBefore and duration.
pub(super) fn said(event: &Value) -> Said {
    let mut resources: Vec<String> = Vec::new();
    for vm in event["Resources"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
    {
        if !resources.iter().any(|r| r == vm) {
            resources.push(vm.to_owned());
        }
    }
    Said {
        resources,
        not_before: event["NotBefore"]
            .as_str()
            .filter(|t| !t.is_empty())
            .and_then(|t| DateTime::parse_from_rfc2822(t).ok())
            .map(|t| t.with_timezone(&Utc)),
        duration_seconds: event["DurationInSeconds"].as_i64(),
    }
}

/// The event's Resources, NotBefore and duration from what every VM said, each way that
/// counts more VMs down for longer: one VM's report (a lagging document, or a forged one)
/// can add to the others' word, never take from it.
///
/// - Resources: every VM any report listed (what a VM's agent says of itself frees it, as
///   for every event: its report that the event is over).
/// - NotBefore: the earliest that a report of a still-Scheduled event gives (Azure may
///   start it then); kept when none gives one (a Started event's is empty), since
///   `max_hold` counts from it.
/// - DurationInSeconds: the longest, and unknown (negative) if any says so.
pub(super) fn together(entry: &mut Maintenance) {
    let mut resources: Vec<String> = Vec::new();
    let mut legacy = false;
    let mut not_before: Option<DateTime<Utc>> = None;
    let mut duration: Option<i64> = None;
    for report in entry.reports.values() {
        let Some(said) = &report.said else {
            legacy = true;
            continue;
        };
        for vm in &said.resources {
            if !resources.contains(vm) {
                resources.push(vm.clone());
            }
        }
        if report.stage == Stage::Scheduled {
            if let Some(at) = said.not_before {
                not_before = Some(not_before.map_or(at, |earliest| earliest.min(at)));
            }
            if let Some(d) = said.duration_seconds {
                duration = Some(match duration {
                    Some(known) if known < 0 || d < 0 => -1,
                    Some(known) => known.max(d),
                    None => d,
                });
            }
        }
    }
    // A record from before each VM's word was kept: what it had stays.
    if legacy {
        for vm in std::mem::take(&mut entry.resources) {
            if !resources.contains(&vm) {
                resources.push(vm);
            }
        }
    }
    entry.resources = resources;
    if not_before.is_some() {
        entry.not_before = not_before;
    }
    if duration.is_some() {
        entry.duration_seconds = duration;
    }
}
