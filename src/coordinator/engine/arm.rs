//! Approvals through Azure Resource Manager (`[groups.azure] approve_via`): the event is
//! acknowledged at the scope of a VM Azure lists, no agent needed. It is the same approval
//! as an agent's (same budget, drains, records and metrics); what differs is its outcome: ARM
//! answers 200 for an event Azure will start, so the approval counts as accepted once a
//! report shows the event started, or Azure's inventory shows one of its VMs down, after
//! the acknowledgement. Until then it is acknowledged again every `outcome_timeout`, up to
//! `max_attempts`.

use std::time::Instant;

use chrono::{DateTime, Utc};

use super::{Done, Engine, NOT_RUN};
use crate::coordinator::azure::{Acked, acknowledge_scope};
use crate::coordinator::fleet::{Outcome, Stage, Via};
use crate::coordinator::store::Changes;

impl Engine {
    /// Acknowledges the event's newest request through ARM ([`Engine::publish`]'s ARM
    /// half).
    pub(super) fn acknowledge(&mut self, key: &str) {
        let Some(m) = self.fleet.events.get(key) else {
            return;
        };
        let Some(approval) = m.approval.as_ref() else {
            return;
        };
        let Some(sent) = approval.sent.last() else {
            return;
        };
        // The scope comes from Azure's own listing, by the name Azure gives the VM (the
        // name in Resources), never from the resource id an agent reports.
        let scope = self
            .fleet
            .azure()
            .get(&approval.approver)
            .and_then(|vm| acknowledge_scope(&vm.resource_id));
        // Refusals, not failures: neither mends itself by waiting. A VM no longer listed
        // is `unknown_event` (a new attempt picks the approver again, within
        // `max_attempts`); no client at all is an alert.
        let why_not = match (&self.acknowledger, &scope) {
            (None, _) => Some(Acked::Refused {
                reason: "no_arm_client".into(),
                message: "this coordinator has no Azure Resource Manager client ([azure], the azure feature)".into(),
            }),
            (_, None) => Some(Acked::Refused {
                reason: "unknown_event".into(),
                message: format!("{} is not a VM in Azure's inventory any more", approval.approver),
            }),
            _ => None,
        };
        self.publishing
            .insert(key.to_owned(), (true, Instant::now()));
        let (acknowledger, done, gate) = (
            self.acknowledger.clone(),
            self.done.clone(),
            self.gate.clone(),
        );
        let (key, request_id, event_id) =
            (key.to_owned(), sent.request_id.clone(), m.event_id.clone());
        tokio::spawn(async move {
            let result = match (why_not, acknowledger, scope) {
                _ if gate.as_ref().is_some_and(|may_act| !may_act()) => {
                    Acked::Failed(NOT_RUN.to_owned())
                }
                (None, Some(acknowledger), Some(scope)) => {
                    acknowledger
                        .acknowledge(&scope, &event_id, &request_id)
                        .await
                }
                (Some(refused), ..) => refused,
                (None, ..) => Acked::Failed("no client or no scope".into()),
            };
            let _ = done.send(Done::Acknowledged {
                key,
                request_id,
                result,
            });
        });
    }

    /// ARM's answer to an acknowledgement, on the request it was for; `false` when nothing
    /// is to be stored (a failure, tried again on the tick).
    pub(super) fn acknowledged(
        &mut self,
        key: &str,
        request_id: &str,
        result: Acked,
        now: DateTime<Utc>,
    ) -> bool {
        // The VMs Azure lists running as it takes the first acknowledgement: one of them
        // listed powered otherwise later shows the event started.
        let up: Vec<String> = self.fleet.events.get(key).map_or_else(Vec::new, |m| {
            m.affected()
                .into_iter()
                .filter(|vm| {
                    self.fleet
                        .azure()
                        .get(vm)
                        .is_some_and(|listed| listed.down(false).is_none())
                })
                .collect()
        });
        let Some(m) = self.fleet.events.get_mut(key) else {
            return false;
        };
        let event_id = m.event_id.clone();
        let Some(approval) = m.approval.as_mut() else {
            return false;
        };
        let Some(sent) = approval
            .sent
            .iter_mut()
            .find(|s| s.request_id == request_id)
        else {
            return false;
        };
        let label = match &result {
            Acked::Approved => "approved",
            Acked::Refused { .. } => "refused",
            Acked::Failed(_) => "failed",
            Acked::Held(_) => "held",
        };
        metrics::counter!("sched_relay_coordinator_arm_acknowledgements_total", "result" => label)
            .increment(1);
        match result {
            Acked::Approved => {
                sent.published_at.get_or_insert(now);
                if let Some(view) = self.azure.as_mut() {
                    view.up_at_ack.entry(key.to_owned()).or_insert((now, up));
                }
                metrics::counter!("sched_relay_coordinator_approvals_sent_total").increment(1);
                tracing::info!(event_id = %event_id, approver = %approval.approver, request_id, "Acknowledged through Azure Resource Manager; accepted once the event is seen started");
                true
            }
            Acked::Refused { reason, message } => {
                sent.published_at.get_or_insert(now);
                tracing::warn!(event_id = %event_id, approver = %approval.approver, request_id, reason = %reason, error = %message, "Azure Resource Manager refused the acknowledgement");
                approval.outcome = Some(Outcome {
                    outcome: "rejected".into(),
                    reason,
                    request_id: request_id.to_owned(),
                    at: now,
                });
                true
            }
            Acked::Held(why) => {
                tracing::debug!(event_id = %event_id, why = %why, retry_in = ?super::PUBLISH_RETRY, "An acknowledgement through Azure Resource Manager held back");
                false
            }
            Acked::Failed(why) => {
                metrics::counter!("sched_relay_coordinator_publish_failures_total").increment(1);
                tracing::warn!(event_id = %event_id, error = %why, retry_in = ?super::PUBLISH_RETRY, "Cannot acknowledge an event through Azure Resource Manager; it will be tried again");
                false
            }
        }
    }

    /// Acknowledgements ARM took (200) count as accepted once the event is seen started: a
    /// report of it started or completed, or one of its VMs that Azure listed up at the
    /// acknowledgement listed down since. Returns the events accepted so (their outcome is
    /// said once stored).
    pub(super) fn arm_evidence(
        &mut self,
        changes: &mut Changes,
        now: DateTime<Utc>,
    ) -> Vec<String> {
        let Some(view) = self.azure.as_ref() else {
            return Vec::new();
        };
        // When each group's source was last listed whole, as the budget's count reads it.
        let listed_at = |group: usize| self.fleet.azure_sources.listed_at.get(&group).copied();
        let mut accepted = Vec::new();
        for (key, m) in &self.fleet.events {
            let Some(approval) = m
                .approval
                .as_ref()
                .filter(|a| a.via == Via::Arm && a.outcome.is_none() && !a.dry_run && !a.abandoned)
            else {
                continue;
            };
            let Some(sent) = approval
                .sent
                .iter()
                .rev()
                .find(|s| s.via == Via::Arm && s.published_at.is_some())
            else {
                continue;
            };
            let started = m
                .reports
                .values()
                .any(|r| matches!(r.stage, Stage::Started | Stage::Completed));
            // Only the power state counts: a provisioning state of `updating` is as likely
            // an extension or a model update.
            let shown_down = || {
                let (acked_at, up) = view.up_at_ack.get(key)?;
                up.iter().find_map(|vm| {
                    let listed = self.fleet.azure().get(vm)?;
                    let power = listed.power.as_deref().filter(|p| *p != "running")?;
                    (listed_at(listed.group)? > *acked_at)
                        .then(|| format!("{vm}: Azure lists its power {power}"))
                })
            };
            let evidence = if started {
                Some("a report shows it started".to_owned())
            } else {
                shown_down()
            };
            if let Some(evidence) = evidence {
                accepted.push((key.clone(), sent.request_id.clone(), evidence));
            }
        }
        let mut keys = Vec::new();
        for (key, request_id, evidence) in accepted {
            if let Some(view) = self.azure.as_mut() {
                view.up_at_ack.remove(&key);
            }
            let m = self.fleet.events.get_mut(&key).expect("listed above");
            let approval = m.approval.as_mut().expect("listed above");
            tracing::info!(event_id = %m.event_id, evidence = %evidence, "The acknowledgement through Azure Resource Manager took effect");
            approval.outcome = Some(Outcome {
                outcome: "accepted".into(),
                reason: "started".into(),
                request_id,
                at: now,
            });
            changes.events.push((key.clone(), Some(m.clone())));
            keys.push(key);
        }
        keys
    }
}
