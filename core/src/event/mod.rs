//! Turns transitions and documents into CloudEvents 1.0, exactly as product.md lays them out:
//! deterministic ids, the Azure EventId as `subject`, lower-case extensions, and `data` holding
//! the Azure event exactly as received. Pure: the observation time is passed in. The agent's
//! heartbeat is [`Heartbeat`].

use std::time::Duration;

use chrono::{DateTime, Utc};
use cloudevents::{EventBuilder, EventBuilderV10};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::continuity::{Continuity, incarnation_tag};
use crate::diff::{Observation, Transition, diff_observed};
use crate::document::Document;

mod decode;
mod heartbeat;
mod kind;

pub use heartbeat::{HEARTBEAT_SUBJECT, Heartbeat};
pub use kind::{Event, EventKind};

/// Who this VM is, as the metadata service (or the configuration) says.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize)]
pub struct Identity {
    /// The VM name that appears in an event's `Resources`.
    pub name: String,
    /// The VM's unique id (`vmId`).
    pub vm_id: Option<String>,
    /// The Azure resource id, `/subscriptions/.../virtualMachines/<name>`.
    pub resource_id: Option<String>,
}

/// The default prefix of every `type`.
pub const DEFAULT_TYPE_PREFIX: &str = "com.azure.scheduledevents";

/// What the `partitionkey` extension (and so the Kafka key) of a transition is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PartitionKey {
    /// All transitions of one Azure event stay in order in one partition.
    #[default]
    EventId,
    /// All events of one VM stay in order in one partition.
    VmName,
}

/// `[events]`: the shape of the published CloudEvents.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct EventsConfig {
    #[serde(default = "default_type_prefix")]
    pub type_prefix: String,
    #[serde(default = "default_true")]
    pub document_events: bool,
    #[serde(default)]
    pub partition_key: PartitionKey,
    /// How often the agent publishes a `heartbeat` event (the first once its first document
    /// is processed); `0s` publishes none. Otherwise 1s..1h.
    #[serde(default = "default_heartbeat_interval", with = "humantime_serde")]
    pub heartbeat_interval: Duration,
}

impl Default for EventsConfig {
    fn default() -> Self {
        EventsConfig {
            type_prefix: default_type_prefix(),
            document_events: true,
            partition_key: PartitionKey::default(),
            heartbeat_interval: default_heartbeat_interval(),
        }
    }
}

impl EventsConfig {
    /// Problems, as (key under `events`, message).
    pub fn validate(&self) -> Vec<(String, String)> {
        let mut problems = Vec::new();
        if self.type_prefix.is_empty() || self.type_prefix.contains(char::is_whitespace) {
            problems.push((
                "type_prefix".into(),
                format!(
                    "{:?} must be a non-empty reverse-DNS name without spaces",
                    self.type_prefix
                ),
            ));
        }
        let interval = self.heartbeat_interval;
        if !interval.is_zero() && !HEARTBEAT_INTERVALS.contains(&interval) {
            problems.push((
                "heartbeat_interval".into(),
                format!(
                    "{} is outside 1s..1h; expected a duration such as \"5m\", or \"0s\" for no heartbeats",
                    humantime::format_duration(interval)
                ),
            ));
        }
        problems
    }
}

/// The heartbeat intervals allowed besides 0 (off): more often than every second would be
/// noise on every broker, less often than hourly no inventory.
pub const HEARTBEAT_INTERVALS: std::ops::RangeInclusive<Duration> =
    Duration::from_secs(1)..=Duration::from_secs(3600);

fn default_heartbeat_interval() -> Duration {
    Duration::from_secs(300)
}

fn default_type_prefix() -> String {
    DEFAULT_TYPE_PREFIX.into()
}

fn default_true() -> bool {
    true
}

/// Builds the CloudEvents of one VM.
#[derive(Debug, Clone)]
pub struct EventFactory {
    pub type_prefix: String,
    /// The CloudEvents `source`: the resource id, else `urn:sched-relay:vm:<name>`, unless set.
    pub source: String,
    pub vm: Identity,
    pub partition_key: PartitionKey,
}

/// How an approval request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ApprovalOutcome {
    /// The metadata service answered 200 (or, in a dry run, would have been asked).
    Accepted,
    /// A check failed; nothing was sent.
    Rejected,
    /// The metadata service kept failing.
    Failed,
}

impl ApprovalOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            ApprovalOutcome::Accepted => "accepted",
            ApprovalOutcome::Rejected => "rejected",
            ApprovalOutcome::Failed => "failed",
        }
    }
}

/// Everything an outcome event says about one request.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    pub outcome: ApprovalOutcome,
    /// The request's CloudEvents id (`policy:<EventId>` for local policy).
    pub request_id: String,
    pub event_ids: Vec<String>,
    /// Machine-readable: a rejection reason (`bad_signature`, ...), `imds_accepted`,
    /// `imds_error`, `dry_run` or `policy`.
    pub reason: String,
    /// A sentence for people.
    pub detail: String,
    /// Where the request came from: `policy`, `nats:<subject>`, `http:POST /approvals`, ...
    pub channel: String,
    pub dry_run: bool,
    /// Makes the outcome id unique where one request id can be refused many times (replays).
    pub nonce: Option<String>,
}

impl EventFactory {
    pub fn new(
        type_prefix: &str,
        source: Option<&str>,
        vm: Identity,
        partition_key: PartitionKey,
    ) -> Self {
        let source = source
            .map(str::to_owned)
            .or_else(|| vm.resource_id.clone())
            .unwrap_or_else(|| format!("urn:sched-relay:vm:{}", vm.name));
        EventFactory {
            type_prefix: type_prefix.trim_end_matches('.').to_owned(),
            source,
            vm,
            partition_key,
        }
    }

    fn vm_json(&self) -> Value {
        json!({"name": self.vm.name, "id": self.vm.vm_id, "resourceId": self.vm.resource_id})
    }

    /// The CloudEvent of one transition.
    pub fn transition(&self, transition: &Transition, observed: DateTime<Utc>) -> Event {
        self.transition_owned(transition.clone(), observed)
    }

    /// As [`EventFactory::transition`], taking the transition: the event's JSON moves into
    /// the data instead of being copied (`json!` serializes what it is given again).
    pub fn transition_owned(&self, transition: Transition, observed: DateTime<Utc>) -> Event {
        Event::new(
            EventKind::Transition(transition.kind),
            self.transition_event(transition, observed),
        )
    }

    fn transition_event(
        &self,
        mut transition: Transition,
        observed: DateTime<Utc>,
    ) -> cloudevents::Event {
        let raw = std::mem::take(&mut transition.event.raw);
        let event = &transition.event;
        let affects = event.affects(&self.vm.name);
        let previous_status = transition.previous_status.as_ref().map(|s| s.as_str());
        let mut data = json!({
            "incarnation": transition.incarnation,
            "vm": self.vm_json(),
            "affectsVm": affects,
            "previousStatus": previous_status,
        });
        data["event"] = Value::Object(raw);
        let partition_key = match self.partition_key {
            PartitionKey::EventId => event.id.clone(),
            PartitionKey::VmName => self.vm.name.clone(),
        };
        let mut builder = EventBuilderV10::new()
            .id(transition.id())
            .source(self.source.clone())
            .ty(format!("{}.{}", self.type_prefix, transition.kind.as_str()))
            .subject(event.id.clone())
            .time(observed)
            .extension("incarnation", incarnation_value(transition.incarnation))
            .extension("eventstatus", event.status.as_str())
            .extension("vmname", self.vm.name.as_str())
            .extension("affectsvm", affects)
            .extension("partitionkey", partition_key)
            .data("application/json", data);
        if let Some(event_type) = &event.event_type {
            builder = builder.extension("eventtype", event_type.as_str());
        }
        if let Some(source) = &event.source {
            builder = builder.extension("eventsource", source.as_str());
        }
        if let Some(unobserved) = transition.unobserved {
            // Still `cancelled` by the contract, but an audit must not read "nothing happened".
            builder = builder
                .extension("unobserved", "started")
                .extension("unobservedreason", unobserved.as_str());
        }
        builder
            .build()
            .expect("every required attribute is set above")
    }

    /// The `document` CloudEvent: the whole document, once per incarnation (and epoch).
    pub fn document(&self, document: &Document, epoch: u64, observed: DateTime<Utc>) -> Event {
        let cloud = EventBuilderV10::new()
            .id(format!(
                "document:{}",
                incarnation_tag(document.incarnation, epoch)
            ))
            .source(self.source.clone())
            .ty(format!("{}.document", self.type_prefix))
            .subject(document.incarnation.to_string())
            .time(observed)
            .extension("incarnation", incarnation_value(document.incarnation))
            .extension("vmname", self.vm.name.as_str())
            .extension("partitionkey", self.vm.name.as_str())
            .data("application/json", document.raw.clone())
            .build()
            .expect("every required attribute is set above");
        Event::new(EventKind::Document, cloud)
    }

    /// The outcome event of one approval request: `<prefix>.approval.<outcome>`, id
    /// `<requestid>:<outcome>`, the first EventId as subject.
    pub fn approval_outcome(&self, outcome: &Outcome, observed: DateTime<Utc>) -> Event {
        let kind = outcome.outcome.as_str();
        let data = json!({
            "requestId": outcome.request_id,
            "eventId": outcome.event_ids.first(),
            "eventIds": outcome.event_ids,
            "vm": self.vm_json(),
            "outcome": kind,
            "reason": outcome.reason,
            "detail": outcome.detail,
            "channel": outcome.channel,
            "dryRun": outcome.dry_run,
        });
        let mut id = format!("{}:{kind}", outcome.request_id);
        if let Some(nonce) = &outcome.nonce {
            id = format!("{id}:{nonce}");
        }
        let first = outcome.event_ids.first().map(String::as_str);
        let partition_key = match (self.partition_key, first) {
            (PartitionKey::EventId, Some(event_id)) => event_id,
            _ => self.vm.name.as_str(),
        };
        let mut builder = EventBuilderV10::new()
            .id(id)
            .source(self.source.clone())
            .ty(format!("{}.approval.{kind}", self.type_prefix))
            .time(observed)
            .extension("requestid", outcome.request_id.as_str())
            .extension("reason", outcome.reason.as_str())
            .extension("vmname", self.vm.name.as_str())
            .extension("partitionkey", partition_key)
            .data("application/json", data);
        if let Some(event_id) = first {
            builder = builder.subject(event_id);
        }
        if outcome.dry_run {
            builder = builder.extension("dryrun", true);
        }
        let cloud = builder
            .build()
            .expect("every required attribute is set above");
        Event::new(EventKind::Approval(outcome.outcome), cloud)
    }
}

/// Every CloudEvent one document yields after `previous`, observed at `observed` in epoch 0
/// with nothing approved: see [`events_observed`].
pub fn events_for_document(
    factory: &EventFactory,
    previous: Option<&Document>,
    current: &Document,
    include_document: bool,
    observed: DateTime<Utc>,
) -> Vec<Event> {
    let observation = Observation::at(observed);
    events_observed(factory, previous, current, include_document, &observation)
}

/// Every CloudEvent one document yields after `previous`: one per transition, in diff order,
/// then the `document` snapshot when enabled. Nothing at all when the incarnation and the
/// content are the same ([`Continuity::Unchanged`]).
pub fn events_observed(
    factory: &EventFactory,
    previous: Option<&Document>,
    current: &Document,
    include_document: bool,
    observation: &Observation,
) -> Vec<Event> {
    if Continuity::of(previous, current) == Continuity::Unchanged {
        return Vec::new();
    }
    let mut events: Vec<_> = diff_observed(previous, current, observation)
        .into_iter()
        .map(|transition| factory.transition_owned(transition, observation.at))
        .collect();
    if include_document {
        events.push(factory.document(current, observation.epoch, observation.at));
    }
    events
}

/// CloudEvents integers are signed 32-bit; an incarnation beyond that (never seen, but the
/// field is unbounded) is carried as a string rather than wrapped.
fn incarnation_value(incarnation: u64) -> cloudevents::event::ExtensionValue {
    match i32::try_from(incarnation) {
        Ok(small) => i64::from(small).into(),
        Err(_) => incarnation.to_string().into(),
    }
}

#[cfg(test)]
mod tests;
