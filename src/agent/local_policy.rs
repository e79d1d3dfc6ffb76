//! Local policy approvals, as in Azure's own sample: every Scheduled event that
//! `sched_relay_core::policy` approves is POSTed to the metadata service, failed POSTs are
//! retried with backoff, and each decision is published as an outcome event.

use std::time::Instant;

use chrono::Utc;
use sched_relay_core::document::EventStatus;
use sched_relay_core::event::{ApprovalOutcome, Outcome};
use sched_relay_core::policy::{self, Decision};

use super::poller::Poller;
use crate::retry::Backoff;

/// Approval POSTs by local policy are tried this often before `approval.failed` is published.
const POLICY_APPROVAL_ATTEMPTS: u32 = 3;

/// Where the agent stands with a local-policy approval of one EventId.
#[derive(Debug, Clone)]
pub(super) enum ApprovalState {
    Done,
    Retry { attempts: u32, not_before: Instant },
}

impl Poller {
    /// Approves, in one POST, every Scheduled event of the latest document that local policy
    /// allows and that has not been approved yet. Events are judged again on every new
    /// document (an update can bring this VM into Resources or shorten a Freeze); between
    /// documents only failed approvals whose retry time has come are tried again.
    pub(super) async fn apply_policy(&mut self, new_document: bool) {
        let policy = &self.config.policy;
        let Some(document) = &self.previous else {
            return;
        };
        if !policy.is_enabled() {
            return;
        }
        let now = Instant::now();
        let mut approve: Vec<(String, String)> = Vec::new();
        for event in document
            .events
            .iter()
            .filter(|e| e.status == EventStatus::Scheduled)
        {
            match self.approvals.get(&event.id) {
                Some(ApprovalState::Done) => continue,
                Some(ApprovalState::Retry { not_before, .. }) if *not_before > now => continue,
                Some(ApprovalState::Retry { .. }) => {}
                None if !new_document => continue,
                None => {}
            }
            match policy::evaluate(policy, event, &self.factory.vm.name) {
                Decision::Approve(reason) => approve.push((event.id.clone(), reason)),
                Decision::Hold(reason) => {
                    tracing::debug!(event_id = %event.id, reason = %reason, "Not approved by local policy");
                }
            }
        }
        if approve.is_empty() {
            return;
        }
        let ids: Vec<String> = approve.iter().map(|(id, _)| id.clone()).collect();
        let result = if self.dry_run {
            Ok(())
        } else {
            self.client.start(&ids).await
        };
        let observed = Utc::now();
        let mut outcomes = Vec::new();
        for (event_id, reason) in approve {
            let outcome = |outcome, code: &str, detail: String| Outcome {
                outcome,
                request_id: format!("policy:{event_id}"),
                event_ids: vec![event_id.clone()],
                reason: code.to_owned(),
                detail,
                channel: "policy".to_owned(),
                dry_run: self.dry_run,
                nonce: None,
            };
            match &result {
                Ok(()) => {
                    metrics::counter!("sched_relay_approvals_total", "source" => "policy", "outcome" => "accepted", "reason" => "policy").increment(1);
                    self.approvals.insert(event_id.clone(), ApprovalState::Done);
                    let record = outcome(ApprovalOutcome::Accepted, "policy", reason.clone());
                    crate::approval::log_outcome(&record);
                    outcomes.push(self.factory.approval_outcome(&record, observed));
                }
                Err(error) => {
                    let attempts = match self.approvals.get(&event_id) {
                        Some(ApprovalState::Retry { attempts, .. }) => attempts + 1,
                        _ => 1,
                    };
                    if attempts >= POLICY_APPROVAL_ATTEMPTS || !error.is_retriable() {
                        tracing::error!(event_id = %event_id, attempts, error = %error, "Approval by local policy failed; the event will start at its NotBefore");
                        metrics::counter!("sched_relay_approvals_total", "source" => "policy", "outcome" => "failed", "reason" => "imds_error").increment(1);
                        self.approvals.insert(event_id.clone(), ApprovalState::Done);
                        let why =
                            format!("{reason}; the metadata service refused or failed: {error}");
                        let record = outcome(ApprovalOutcome::Failed, "imds_error", why);
                        outcomes.push(self.factory.approval_outcome(&record, observed));
                    } else {
                        let wait = Backoff::new(
                            self.config.imds.poll_interval,
                            self.config.imds.max_backoff,
                        )
                        .jittered(attempts);
                        tracing::warn!(event_id = %event_id, attempts, retry_in = ?wait, error = %error, "Approval by local policy failed, will retry");
                        self.approvals.insert(
                            event_id.clone(),
                            ApprovalState::Retry {
                                attempts,
                                not_before: now + wait,
                            },
                        );
                    }
                }
            }
        }
        if let Err(error) = self.fanout.publish(&outcomes, None).await {
            tracing::error!(error = %error, "Cannot store the approval outcome events");
        }
    }
}
