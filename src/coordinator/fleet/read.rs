//! Reading what an agent published: a transition, an approval outcome or a document, as a
//! structured CloudEvent. Anything that fails the contract is refused with the reason.

use serde_json::Value;

use sched_relay_core::EventKind;
use sched_relay_core::diff::TransitionKind;

use super::{Heartbeat, Stage, key_of};

/// What a delivered message says, once read.
#[derive(Debug, Clone, PartialEq)]
pub enum Incoming {
    Transition {
        source: String,
        id: String,
        vm: String,
        resource_id: Option<String>,
        stage: Stage,
        /// `updated`: a change of fields, ordered by incarnation.
        update: bool,
        incarnation: u64,
        /// The epoch an `updated` id carries (`<EventId>:updated:<n>~e<epoch>`), else 0.
        epoch: u64,
        affects: bool,
        /// The Azure event object exactly as the agent received it.
        event: Value,
    },
    Outcome {
        source: String,
        id: String,
        vm: String,
        /// The VM's resource id, as the outcome says it (`data.vm.resourceId`, or `source`).
        resource_id: Option<String>,
        request_id: String,
        outcome: String,
        reason: String,
        event_ids: Vec<String>,
        /// The agent runs in dry run: it POSTed nothing.
        dry_run: bool,
    },
    /// The agent is alive; what its last document lists.
    Heartbeat {
        source: String,
        id: String,
        vm: String,
        resource_id: Option<String>,
        beat: Heartbeat,
    },
    /// A whole document: the VM has an agent (the first thing an agent publishes).
    Document {
        source: String,
        id: String,
        vm: String,
    },
    /// Part of the stream but not for the coordinator (approval requests).
    Ignored(&'static str),
}

impl Incoming {
    /// The VM the message speaks for (none for what is not an agent's).
    pub fn vm(&self) -> Option<&str> {
        match self {
            Incoming::Transition { vm, .. }
            | Incoming::Outcome { vm, .. }
            | Incoming::Heartbeat { vm, .. }
            | Incoming::Document { vm, .. } => Some(vm),
            Incoming::Ignored(_) => None,
        }
    }

    pub fn key(&self) -> Option<(String, String)> {
        match self {
            Incoming::Transition { source, id, .. }
            | Incoming::Outcome { source, id, .. }
            | Incoming::Document { source, id, .. } => Some((source.clone(), id.clone())),
            // Heartbeats are not de-duplicated by id (the newest wins, whatever comes
            // twice): keeping their ids would grow the seen set by one every few minutes
            // per VM.
            Incoming::Heartbeat { .. } | Incoming::Ignored(_) => None,
        }
    }
}

/// The most events a heartbeat may list.
pub const MAX_HEARTBEAT_EVENTS: usize = 256;

/// The most VMs an event's Resources may list (Azure lists those of one host or update
/// domain; an availability set holds at most 200).
pub const MAX_RESOURCES: usize = 1000;

/// The longest `id`, `source`, `vmname`, `subject` or `requestid` accepted (an Azure
/// resource id is under 300 bytes).
pub const MAX_ATTRIBUTE_BYTES: usize = 512;

/// Reads a structured CloudEvent that an agent published, received at `now`; `live`: the
/// input has caught up, so a heartbeat shows its VM alive now (while a stream is replayed,
/// as of its own `time`, capped at `now`). Errors say what is wrong.
pub fn read_at(
    event: &Value,
    now: chrono::DateTime<chrono::Utc>,
    live: bool,
) -> Result<Incoming, String> {
    if EventKind::from_type(event["type"].as_str().unwrap_or_default()) == EventKind::Heartbeat {
        return heartbeat(event, now, live);
    }
    read(event)
}

/// Reads a structured CloudEvent that an agent published. Errors say what is wrong.
pub fn read(event: &Value) -> Result<Incoming, String> {
    let text = |name: &str| attribute(event, name);
    let ty = text("type")?;
    let kind = EventKind::from_type(&ty);
    let stage = match kind {
        EventKind::Transition(TransitionKind::Scheduled | TransitionKind::Updated) => {
            Stage::Scheduled
        }
        EventKind::Transition(TransitionKind::Started) => Stage::Started,
        EventKind::Transition(TransitionKind::Completed) => Stage::Completed,
        EventKind::Transition(TransitionKind::Cancelled) => Stage::Cancelled,
        EventKind::Approval(_) => {
            let request_id = text("requestid")?;
            let data = event.get("data").cloned().unwrap_or(Value::Null);
            let event_ids = data["eventIds"]
                .as_array()
                .map(|ids| {
                    ids.iter()
                        .filter_map(|id| id.as_str().filter(|id| valid_event_id(id)))
                        .map(str::to_owned)
                        .collect()
                })
                .unwrap_or_default();
            return Ok(Incoming::Outcome {
                source: text("source")?,
                id: text("id")?,
                vm: vm_name(event)?,
                resource_id: data["vm"]["resourceId"]
                    .as_str()
                    .map(str::to_owned)
                    .or_else(|| resource_id(event)),
                request_id,
                outcome: kind
                    .suffix()
                    .unwrap_or_default()
                    .trim_start_matches("approval.")
                    .to_owned(),
                reason: data["reason"].as_str().unwrap_or_default().to_owned(),
                event_ids,
                dry_run: data["dryRun"].as_bool().unwrap_or(false)
                    || matches!(&event["dryrun"], Value::Bool(true))
                    || event["dryrun"] == "true",
            });
        }
        EventKind::Document => {
            return Ok(Incoming::Document {
                source: text("source")?,
                id: text("id")?,
                vm: vm_name(event)?,
            });
        }
        EventKind::ApprovalRequest => return Ok(Incoming::Ignored("approval request")),
        EventKind::Heartbeat => return heartbeat(event, chrono::Utc::now(), false),
        EventKind::Other => {
            return Err(format!(
                "type {ty:?} is not a Scheduled Events transition or approval outcome"
            ));
        }
    };
    let data = event
        .get("data")
        .filter(|data| data.is_object())
        .ok_or("data is missing or not an object")?;
    let azure = data
        .get("event")
        .filter(|azure| azure.is_object())
        .ok_or("data.event (the Azure event) is missing")?;
    let subject = text("subject")?;
    match azure.get("EventId").and_then(Value::as_str) {
        Some(id) if !valid_event_id(id) => {
            return Err(format!(
                "data.event.EventId {id:?} is not an EventId (letters, digits and '-', at most 64)"
            ));
        }
        Some(id) if id.eq_ignore_ascii_case(&subject) => {}
        other => {
            return Err(format!(
                "data.event.EventId {other:?} is not the subject {subject:?}"
            ));
        }
    }
    let incarnation = match event.get("incarnation") {
        Some(Value::Number(n)) => n.as_u64(),
        Some(Value::String(s)) => s.parse().ok(),
        _ => None,
    }
    .or_else(|| data["incarnation"].as_u64())
    .ok_or("incarnation is missing or not a whole number")?;
    // A Scheduled event without a NotBefore could not be timed: no deadline, no "too late".
    if stage == Stage::Scheduled {
        let not_before = azure
            .get("NotBefore")
            .and_then(Value::as_str)
            .unwrap_or_default();
        if chrono::DateTime::parse_from_rfc2822(not_before).is_err() {
            return Err(format!(
                "data.event.NotBefore {not_before:?} of a Scheduled event is not a date like \"Mon, 19 Sep 2016 18:29:47 GMT\""
            ));
        }
    }
    // The VMs an event holds, kept with the state: names like a vmname, a bounded list.
    match azure.get("Resources") {
        None | Some(Value::Null) => {}
        Some(Value::Array(list)) if list.len() > MAX_RESOURCES => {
            return Err(format!(
                "data.event.Resources lists {} VMs, more than {MAX_RESOURCES}",
                list.len()
            ));
        }
        Some(Value::Array(list)) => {
            if let Some(bad) = list.iter().find(|r| !r.as_str().is_some_and(valid_vm_name)) {
                return Err(format!(
                    "data.event.Resources has {}, which is not an Azure VM name (letters, digits, '_', '.' and '-', at most 64)",
                    crate::watch::printable(&bad.to_string())
                ));
            }
        }
        Some(other) => {
            return Err(format!(
                "data.event.Resources is {other}, expected a list of VM names"
            ));
        }
    }
    let affects = match event.get("affectsvm") {
        Some(Value::Bool(b)) => *b,
        Some(Value::String(s)) => s == "true",
        _ => data["affectsVm"].as_bool().unwrap_or(false),
    };
    let id = text("id")?;
    Ok(Incoming::Transition {
        source: text("source")?,
        epoch: epoch_of(&id),
        vm: vm_name(event)?,
        resource_id: data["vm"]["resourceId"]
            .as_str()
            .map(str::to_owned)
            .or_else(|| resource_id(event)),
        id,
        stage,
        update: kind == EventKind::Transition(TransitionKind::Updated),
        incarnation,
        affects,
        event: azure.clone(),
    })
}

/// The agent's `source` when it is the VM's Azure resource id (the default).
fn resource_id(event: &Value) -> Option<String> {
    event["source"]
        .as_str()
        .filter(|s| s.starts_with("/subscriptions/"))
        .map(str::to_owned)
}

/// The `vmname` attribute, checked against Azure's rules for VM names (letters, digits,
/// `_`, `.` and `-`, at most 64, starting with a letter, a digit or `_`, not ending with
/// `.` or `-`): it becomes part of subjects, routing keys and drain commands' arguments.
/// An Azure VM name (or a scale set instance's): letters, digits, `_`, `.` and `-`, at most
/// 64, not starting with `.` or `-` nor ending with either (the 2017-03-01 api-version's
/// leading `_` is allowed).
pub fn valid_vm_name(name: &str) -> bool {
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-');
    let first = name
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
    let last = !name.ends_with(['.', '-']);
    name.len() <= 64 && name.chars().all(allowed) && first && last
}

fn vm_name(event: &Value) -> Result<String, String> {
    let name = attribute(event, "vmname")?;
    if valid_vm_name(&name) {
        Ok(name)
    } else {
        Err(format!(
            "attribute \"vmname\" {:?} is not an Azure VM name (letters, digits, '_', '.' and '-', at most 64)",
            crate::watch::printable(&name)
        ))
    }
}

/// An Azure EventId: a GUID in practice; letters, digits and `-`, at most 64.
pub fn valid_event_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 64 && id.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
}

/// A string attribute, present, non-empty and bounded.
fn attribute(event: &Value, name: &str) -> Result<String, String> {
    match event.get(name) {
        // Ids, VM names and sources become state keys: bounded like the agent's own.
        Some(Value::String(value)) if value.len() > MAX_ATTRIBUTE_BYTES => Err(format!(
            "attribute {name:?} is {} bytes, more than {MAX_ATTRIBUTE_BYTES}",
            value.len()
        )),
        Some(Value::String(value)) if !value.trim().is_empty() => Ok(value.clone()),
        Some(other) => Err(format!(
            "attribute {name:?} is {other}, expected a non-empty string"
        )),
        None => Err(format!("attribute {name:?} is missing")),
    }
}

/// The epoch an incarnation-derived id carries (`...:<n>~e<epoch>`), 0 without one.
fn epoch_of(id: &str) -> u64 {
    id.rsplit_once("~e")
        .and_then(|(_, epoch)| epoch.parse().ok())
        .unwrap_or(0)
}

/// A heartbeat (`<prefix>.heartbeat`): who the VM is, when, and its last document's events.
fn heartbeat(
    event: &Value,
    now: chrono::DateTime<chrono::Utc>,
    live: bool,
) -> Result<Incoming, String> {
    let text = |name: &str| attribute(event, name);
    let time = text("time")?;
    let sent = chrono::DateTime::parse_from_rfc3339(&time)
        .map_err(|e| format!("attribute \"time\" {time:?} is not an RFC 3339 time: {e}"))?
        .with_timezone(&chrono::Utc);
    let at = if live { now } else { sent.min(now) };
    let data = event
        .get("data")
        .filter(|data| data.is_object())
        .ok_or("data is missing or not an object")?;
    // The agent's own bounds (`events.heartbeat_interval`, 1s..1h): anything else is not an
    // agent's heartbeat, and silence is computed from it.
    let interval_seconds = data["intervalSeconds"]
        .as_u64()
        .filter(|s| (1..=3600).contains(s))
        .ok_or("data.intervalSeconds is missing or not a whole number of seconds from 1 to 3600")?;
    let events = match &data["events"] {
        // A document lists a handful of events; a heartbeat listing more is not an agent's.
        Value::Array(events) if events.len() > MAX_HEARTBEAT_EVENTS => {
            return Err(format!(
                "data.events lists {} events, more than {MAX_HEARTBEAT_EVENTS}",
                events.len()
            ));
        }
        Value::Array(events) => events
            .iter()
            .map(|e| {
                e["EventId"]
                    .as_str()
                    .filter(|id| !id.is_empty() && id.len() <= MAX_ATTRIBUTE_BYTES)
                    .map(key_of)
                    .ok_or_else(|| format!("data.events: {e} has no EventId"))
            })
            .collect::<Result<Vec<_>, _>>()?,
        Value::Null => Vec::new(),
        other => return Err(format!("data.events is {other}, expected an array")),
    };
    let started_at = data["startedAt"]
        .as_str()
        .and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok())
        .map(|t| t.with_timezone(&chrono::Utc));
    Ok(Incoming::Heartbeat {
        source: text("source")?,
        id: text("id")?,
        vm: vm_name(event)?,
        resource_id: data["vm"]["resourceId"]
            .as_str()
            .map(str::to_owned)
            .or_else(|| resource_id(event)),
        beat: Heartbeat {
            at,
            sent,
            interval_seconds,
            incarnation: data["incarnation"].as_u64(),
            epoch: data["epoch"].as_u64().unwrap_or(0),
            agent_version: data["agentVersion"]
                .as_str()
                .unwrap_or_default()
                .chars()
                .take(64)
                .collect(),
            started_at,
            events,
        },
    })
}
