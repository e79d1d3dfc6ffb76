//! The orchestrator's side: build an approval request and sign it, as `sched-relay
//! sign-approval` does. Publishing it is I/O and lives in the agent.

use chrono::{DateTime, SubsecRound, Utc};
use cloudevents::{EventBuilder, EventBuilderV10};
use serde_json::json;

use super::verify::{SigningKey, canonical};
use crate::Event;

/// What to approve, and for whom.
#[derive(Debug, Clone)]
pub struct Draft {
    pub id: String,
    pub source: String,
    pub time: DateTime<Utc>,
    /// The VM (or `*` for the fleet, or none: any VM whose events list it in Resources).
    pub vm_name: Option<String>,
    pub event_ids: Vec<String>,
    /// `<type_prefix>.approval.requested`.
    pub request_type: String,
}

impl Draft {
    /// A request with a random id, from `source`, timed now.
    pub fn new(source: &str, vm_name: Option<&str>, event_ids: Vec<String>) -> Draft {
        Draft {
            id: format!("{:032x}", fastrand::u128(..)),
            source: source.to_owned(),
            time: Utc::now().trunc_subsecs(3),
            vm_name: vm_name.map(str::to_owned),
            event_ids,
            request_type: format!("{}.approval.requested", crate::event::DEFAULT_TYPE_PREFIX),
        }
    }

    /// The text a key signs (see [`super::verify`]).
    pub fn canonical(&self) -> String {
        canonical(
            &self.id,
            &self.source,
            self.time.timestamp(),
            self.vm_name.as_deref(),
            &self.event_ids,
        )
    }

    /// The request as a CloudEvent, signed with `key` named `key_id` when given.
    pub fn event(&self, signer: Option<(&str, &SigningKey)>) -> Event {
        let requests: Vec<_> = self
            .event_ids
            .iter()
            .map(|id| json!({ "EventId": id }))
            .collect();
        let mut builder = EventBuilderV10::new()
            .id(self.id.clone())
            .source(self.source.clone())
            .ty(self.request_type.clone())
            .time(self.time)
            .data("application/json", json!({ "StartRequests": requests }));
        if let Some(vm) = &self.vm_name {
            // Also the Kafka record key, which routes the request to the VM's partition.
            builder = builder
                .extension("vmname", vm.as_str())
                .extension("partitionkey", vm.as_str());
        }
        if let Some((key_id, key)) = signer {
            builder = builder
                .extension("keyid", key_id)
                .extension("signature", key.sign(self.canonical().as_bytes()));
        }
        builder
            .build()
            .expect("every required attribute is set above")
            .into()
    }
}
