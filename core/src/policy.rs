//! Local approval policy, as in Azure's own sample: approve user-initiated events at once,
//! approve short Freezes as no-impact, approve listed EventTypes, optionally only on the
//! leader VM (the first in `Resources`, since one approval starts the event for all of them).
//! Pure: the agent asks [`evaluate`] and does the I/O.

use serde::{Deserialize, Serialize};

use crate::document::{EventSource, EventStatus, EventType, ScheduledEvent, same_vm};

/// `[policy]`: off unless a rule is set.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PolicyConfig {
    /// Approve every `EventSource: User` event at once: an operator asked for it, and the
    /// notice would only delay their own action.
    #[serde(default)]
    pub approve_user_initiated: bool,
    /// Approve a Freeze whose DurationInSeconds is between 0 and this value (inclusive).
    /// Unset: Freezes wait for their NotBefore like any other event.
    #[serde(default)]
    pub approve_freeze_max_seconds: Option<i64>,
    /// EventTypes to approve at once whatever their duration, e.g. `["Preempt"]` where a Spot
    /// VM has nothing to drain.
    #[serde(default)]
    pub approve_event_types: Vec<String>,
    /// Only the first VM in `Resources` approves, so that one VM speaks for the group.
    #[serde(default)]
    pub leader_only: bool,
}

impl PolicyConfig {
    /// Problems, as (key under `policy`, message).
    pub fn validate(&self) -> Vec<(String, String)> {
        let mut problems = Vec::new();
        if self.approve_freeze_max_seconds.is_some_and(|max| max < 0) {
            problems.push((
                "approve_freeze_max_seconds".to_owned(),
                "must be 0 or more (seconds of Freeze to approve)".to_owned(),
            ));
        }
        for (index, event_type) in self.approve_event_types.iter().enumerate() {
            if event_type.trim().is_empty() {
                problems.push((
                    format!("approve_event_types[{index}]"),
                    "is empty; expected an EventType such as \"Preempt\"".to_owned(),
                ));
            }
        }
        problems
    }

    /// Whether any rule can approve anything.
    pub fn is_enabled(&self) -> bool {
        self.approve_user_initiated
            || self.approve_freeze_max_seconds.is_some()
            || !self.approve_event_types.is_empty()
    }
}

/// What the policy says of one event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Approve it now; the reason is logged and published.
    Approve(String),
    /// Leave it alone; the reason says why (for debug logs).
    Hold(String),
}

/// Decides whether this VM approves `event` now.
pub fn evaluate(policy: &PolicyConfig, event: &ScheduledEvent, vm_name: &str) -> Decision {
    if event.status != EventStatus::Scheduled {
        return Decision::Hold(format!("status is {}, not Scheduled", event.status));
    }
    if !event.affects(vm_name) {
        return Decision::Hold(format!("{vm_name} is not in Resources"));
    }
    if policy.leader_only {
        // Compared as `affects` compares: 2017-03-01 names carry a leading underscore.
        let leader = event.resources.first().map(String::as_str).unwrap_or("");
        if !same_vm(leader, vm_name) {
            return Decision::Hold(format!("leader_only: {leader} approves, not {vm_name}"));
        }
    }
    if policy.approve_user_initiated && event.source == Some(EventSource::User) {
        return Decision::Approve("user-initiated (EventSource User)".to_owned());
    }
    let event_type = event.event_type.as_ref();
    if let Some(max) = policy.approve_freeze_max_seconds
        && event_type == Some(&EventType::Freeze)
        && (0..=max).contains(&event.duration_seconds)
    {
        return Decision::Approve(format!(
            "Freeze of {} s is within approve_freeze_max_seconds = {max}",
            event.duration_seconds
        ));
    }
    if let Some(event_type) = event_type
        && policy
            .approve_event_types
            .iter()
            .any(|t| t.eq_ignore_ascii_case(event_type.as_str()))
    {
        return Decision::Approve(format!("{event_type} is in approve_event_types"));
    }
    Decision::Hold("no policy rule matches".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::document::Document;
    use serde_json::json;

    fn event(fields: serde_json::Value) -> ScheduledEvent {
        let mut object = json!({"EventId": "E", "EventStatus": "Scheduled",
            "Resources": ["vm0", "vm1"], "EventType": "Reboot"});
        object
            .as_object_mut()
            .unwrap()
            .extend(fields.as_object().unwrap().clone());
        Document::from_value(json!({"DocumentIncarnation": 1, "Events": [object]}))
            .unwrap()
            .document
            .events
            .remove(0)
    }

    fn approves(policy: &PolicyConfig, fields: serde_json::Value, vm: &str) -> bool {
        matches!(evaluate(policy, &event(fields), vm), Decision::Approve(_))
    }

    #[test]
    fn empty_policy_approves_nothing() {
        let policy = PolicyConfig::default();
        assert!(!policy.is_enabled());
        assert!(!approves(&policy, json!({"EventSource": "User"}), "vm0"));
    }

    #[test]
    fn user_initiated_events_are_approved_only_when_scheduled_and_ours() {
        let policy = PolicyConfig {
            approve_user_initiated: true,
            ..Default::default()
        };
        assert!(approves(&policy, json!({"EventSource": "User"}), "vm1"));
        assert!(!approves(
            &policy,
            json!({"EventSource": "Platform"}),
            "vm1"
        ));
        assert!(!approves(&policy, json!({"EventSource": "User"}), "vm9"));
        assert!(!approves(
            &policy,
            json!({"EventSource": "User", "EventStatus": "Started"}),
            "vm1"
        ));
    }

    #[test]
    fn short_freezes_are_approved_and_unknown_durations_are_not() {
        let policy = PolicyConfig {
            approve_freeze_max_seconds: Some(9),
            ..Default::default()
        };
        let freeze = |d: i64| json!({"EventType": "Freeze", "DurationInSeconds": d});
        assert!(approves(&policy, freeze(0), "vm0"));
        assert!(approves(&policy, freeze(9), "vm0"));
        assert!(!approves(&policy, freeze(10), "vm0"));
        assert!(!approves(&policy, freeze(-1), "vm0"));
        assert!(!approves(&policy, json!({"EventType": "Freeze"}), "vm0"));
        assert!(!approves(
            &policy,
            json!({"EventType": "Reboot", "DurationInSeconds": 1}),
            "vm0"
        ));
    }

    #[test]
    fn listed_event_types_are_approved_and_leader_only_limits_to_the_first_vm() {
        let policy = PolicyConfig {
            approve_event_types: vec!["preempt".into()],
            leader_only: true,
            ..Default::default()
        };
        assert!(approves(&policy, json!({"EventType": "Preempt"}), "vm0"));
        assert!(!approves(&policy, json!({"EventType": "Preempt"}), "vm1"));
        match evaluate(&policy, &event(json!({"EventType": "Preempt"})), "vm1") {
            Decision::Hold(reason) => assert!(reason.contains("leader_only"), "{reason}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_leader_is_recognised_in_2017_03_01_names_with_a_leading_underscore() {
        let policy = PolicyConfig {
            approve_event_types: vec!["Preempt".into()],
            leader_only: true,
            ..Default::default()
        };
        let fields = json!({"EventType": "Preempt", "Resources": ["_WestNO_0", "_WestNO_1"]});
        assert!(approves(&policy, fields.clone(), "WestNO_0"));
        assert!(approves(&policy, fields.clone(), "westno_0"));
        assert!(!approves(&policy, fields, "WestNO_1"));
    }
}
