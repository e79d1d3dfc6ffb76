//! Reading what an agent published: a transition, an approval outcome or a document, as a
//! structured CloudEvent. Anything that fails the contract is refused with the reason.

use serde_json::Value;

use sched_relay_core::EventKind;
use sched_relay_core::diff::TransitionKind;

use super::Stage;

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
        affects: bool,
        /// The Azure event object exactly as the agent received it.
        event: Value,
    },
    Outcome {
        source: String,
        id: String,
        vm: String,
        request_id: String,
        outcome: String,
        reason: String,
        event_ids: Vec<String>,
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
    pub fn key(&self) -> Option<(String, String)> {
        match self {
            Incoming::Transition { source, id, .. }
            | Incoming::Outcome { source, id, .. }
            | Incoming::Document { source, id, .. } => Some((source.clone(), id.clone())),
            Incoming::Ignored(_) => None,
        }
    }
}

/// The longest `id`, `source`, `vmname`, `subject` or `requestid` accepted (an Azure
/// resource id is under 300 bytes).
pub const MAX_ATTRIBUTE_BYTES: usize = 512;

/// Reads a structured CloudEvent that an agent published. Errors say what is wrong.
pub fn read(event: &Value) -> Result<Incoming, String> {
    let text = |name: &str| -> Result<String, String> {
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
    };
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
                        .filter_map(|id| id.as_str().map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default();
            return Ok(Incoming::Outcome {
                source: text("source")?,
                id: text("id")?,
                vm: text("vmname")?,
                request_id,
                outcome: kind
                    .suffix()
                    .unwrap_or_default()
                    .trim_start_matches("approval.")
                    .to_owned(),
                reason: data["reason"].as_str().unwrap_or_default().to_owned(),
                event_ids,
            });
        }
        EventKind::Document => {
            return Ok(Incoming::Document {
                source: text("source")?,
                id: text("id")?,
                vm: text("vmname")?,
            });
        }
        EventKind::ApprovalRequest => return Ok(Incoming::Ignored("approval request")),
        EventKind::Heartbeat => return Ok(Incoming::Ignored("heartbeat")),
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
    let affects = match event.get("affectsvm") {
        Some(Value::Bool(b)) => *b,
        Some(Value::String(s)) => s == "true",
        _ => data["affectsVm"].as_bool().unwrap_or(false),
    };
    Ok(Incoming::Transition {
        source: text("source")?,
        id: text("id")?,
        vm: text("vmname")?,
        resource_id: data["vm"]["resourceId"]
            .as_str()
            .map(str::to_owned)
            .or_else(|| resource_id(event)),
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
