//! Local policy approvals, as in Azure's own sample: every Scheduled event that
//! `sched_relay_core::policy` approves is POSTed to the metadata service, and each decision is
//! published as an outcome event.
//!
//! It runs as its own task, fed by the poller with each processed document, so a slow or
//! failing POST never holds back polling (a Preempt's whole notice is 30 s). The faults it
//! survives, each proved by a test in `tests/local_policy.rs`:
//! - a restart, or a policy switched on later: every still-Scheduled event of the first
//!   document after start is judged, not only those of a new incarnation;
//! - an IMDS blip: a failed POST is retried with backoff (at most [`MAX_ERROR_BACKOFF`]
//!   apart) until [`GIVE_UP_BEFORE_NOT_BEFORE`] before the event's NotBefore (or for
//!   [`RETRY_WITHOUT_NOT_BEFORE`] when it has none); only then is `approval.failed` published
//!   and the event left to start at its NotBefore;
//! - one bad EventId: a combined POST refused with 400 is tried again one EventId at a time.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use cloudevents::AttributesReader;
use sched_relay_core::document::{Document, EventStatus, ScheduledEvent};
use sched_relay_core::event::{ApprovalOutcome, EventFactory, Outcome};
use sched_relay_core::policy::{self, Decision, PolicyConfig};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::fanout::Publisher;
use crate::imds::pacing::MAX_ERROR_BACKOFF;
use crate::imds::{ImdsClient, ImdsError};
use crate::retry::Backoff;

/// Retries stop this long before NotBefore: the event starts by itself then anyway.
pub const GIVE_UP_BEFORE_NOT_BEFORE: Duration = Duration::from_secs(5);
/// How long a failing approval of an event without a NotBefore is retried.
pub const RETRY_WITHOUT_NOT_BEFORE: Duration = Duration::from_secs(300);
/// The first retry waits this long, doubling up to [`MAX_ERROR_BACKOFF`].
const FIRST_RETRY: Duration = Duration::from_secs(1);

/// Where the agent stands with a local-policy approval of one EventId.
#[derive(Debug, Clone)]
enum Approval {
    /// Accepted, or given up for good: not tried again while the event is in the document.
    Done,
    /// A POST failed; try again at `next`, unless that is past `give_up_at`.
    Retry {
        attempts: u32,
        next: Instant,
        give_up_at: Instant,
        reason: String,
        last_error: String,
    },
}

/// The local-policy task: judges each document the poller hands it and POSTs approvals.
pub(super) struct LocalPolicy {
    policy: PolicyConfig,
    client: Arc<ImdsClient>,
    factory: EventFactory,
    publisher: Publisher,
    dry_run: bool,
    approvals: HashMap<String, Approval>,
    /// Outcome events the state store did not take (a full disk): stored with the next ones,
    /// or on their own at least every [`OUTCOME_RETRY`].
    unpublished: Vec<sched_relay_core::Event>,
}

/// How often outcome events the state store refused are offered to it again.
const OUTCOME_RETRY: Duration = Duration::from_secs(1);

impl LocalPolicy {
    pub(super) fn new(
        policy: PolicyConfig,
        client: Arc<ImdsClient>,
        factory: EventFactory,
        publisher: Publisher,
        dry_run: bool,
    ) -> LocalPolicy {
        LocalPolicy {
            policy,
            client,
            factory,
            publisher,
            dry_run,
            approvals: HashMap::new(),
            unpublished: Vec::new(),
        }
    }

    /// Runs until the poller drops its end of `documents`. Every document received is judged
    /// in full (the poller sends the first one after start and each new one after that);
    /// between documents only failed approvals whose retry time has come are tried again.
    pub(super) async fn run(mut self, mut documents: watch::Receiver<Option<Arc<Document>>>) {
        loop {
            let next_retry = self
                .approvals
                .values()
                .filter_map(|approval| match approval {
                    Approval::Retry { next, .. } => Some(*next),
                    Approval::Done => None,
                })
                .min();
            let next_retry = match self.unpublished.is_empty() {
                true => next_retry,
                false => Some(next_retry.map_or(Instant::now() + OUTCOME_RETRY, |at| {
                    at.min(Instant::now() + OUTCOME_RETRY)
                })),
            };
            let judge_all = tokio::select! {
                changed = documents.changed() => {
                    if changed.is_err() {
                        self.stop().await;
                        return;
                    }
                    true
                }
                _ = tokio::time::sleep_until(next_retry.unwrap_or_else(Instant::now)), if next_retry.is_some() => false,
            };
            let document = documents.borrow_and_update().clone();
            if let Some(document) = document {
                self.judge(&document, judge_all).await;
            }
        }
    }

    /// Approves, in one POST, every Scheduled event of `document` that the policy allows and
    /// that is not approved yet (with `judge_all`), or whose retry time has come.
    async fn judge(&mut self, document: &Document, judge_all: bool) {
        let mut outcomes = self.forget_events_that_moved_on(document);
        let now = Instant::now();
        let mut due: Vec<(&ScheduledEvent, String)> = Vec::new();
        for event in document
            .events
            .iter()
            .filter(|e| e.status == EventStatus::Scheduled)
        {
            match self.approvals.get(&event.id) {
                Some(Approval::Done) => {}
                Some(Approval::Retry { next, reason, .. }) => {
                    if *next <= now {
                        due.push((event, reason.clone()));
                    }
                }
                None if !judge_all => {}
                None => match policy::evaluate(&self.policy, event, &self.factory.vm.name) {
                    Decision::Approve(reason) => due.push((event, reason)),
                    Decision::Hold(reason) => {
                        tracing::debug!(event_id = %event.id, reason = %reason, "Not approved by local policy");
                    }
                },
            }
        }
        if !due.is_empty() {
            let ids: Vec<String> = due.iter().map(|(event, _)| event.id.clone()).collect();
            let result = self.post(&ids).await;
            // One EventId the service refuses must not cost the others their approval.
            if let Err(error) = &result
                && !error.is_retriable()
                && due.len() > 1
            {
                tracing::warn!(error = %error, count = due.len(), "A combined approval POST was refused; trying each EventId alone");
                for (event, reason) in due {
                    let result = self.post(std::slice::from_ref(&event.id)).await;
                    outcomes.extend(self.record(event, reason, failure(&result)));
                }
            } else {
                for (event, reason) in due {
                    outcomes.extend(self.record(event, reason, failure(&result)));
                }
            }
        }
        let mut outcomes = std::mem::take(&mut self.unpublished)
            .into_iter()
            .chain(outcomes)
            .collect::<Vec<_>>();
        if outcomes.is_empty() {
            return;
        }
        if let Err(error) = self.publisher.publish(&outcomes, None).await {
            tracing::warn!(error = %error, count = outcomes.len(), "Cannot store the outcome events of local-policy approvals yet; keeping them to store once the state store takes them");
            self.unpublished.append(&mut outcomes);
        }
    }

    /// At exit: outcomes the store never took get one more try, then are logged whole.
    async fn stop(&mut self) {
        if self.unpublished.is_empty() {
            return;
        }
        if let Err(error) = self.publisher.publish(&self.unpublished, None).await {
            for event in self.unpublished.drain(..) {
                let text = serde_json::to_string(&event).unwrap_or_default();
                tracing::error!(id = %event.id(), event = %text, error = %error, "Stopping with an approval outcome the state store never took; it is not delivered");
            }
        }
    }

    async fn post(&self, ids: &[String]) -> Result<(), ImdsError> {
        if self.dry_run {
            return Ok(());
        }
        self.client.start(ids).await
    }

    /// Forgets events that left the document or stopped being Scheduled. One whose approval
    /// was still being retried gets its `approval.failed` now: it started (or ended) without it.
    fn forget_events_that_moved_on(&mut self, document: &Document) -> Vec<sched_relay_core::Event> {
        let mut outcomes = Vec::new();
        let mut gone = Vec::new();
        for (id, approval) in &self.approvals {
            let scheduled = document
                .event(id)
                .is_some_and(|e| e.status == EventStatus::Scheduled);
            if scheduled {
                continue;
            }
            if let Approval::Retry {
                reason, last_error, ..
            } = approval
            {
                let why = format!(
                    "{reason}; the event left Scheduled before the metadata service accepted the approval (last error: {last_error})"
                );
                tracing::error!(event_id = %id, "Approval by local policy never succeeded; the event went ahead without it");
                outcomes.push(self.outcome(id, ApprovalOutcome::Failed, "imds_error", why));
            }
            gone.push(id.clone());
        }
        for id in gone {
            self.approvals.remove(&id);
        }
        outcomes
    }

    /// Records what a POST did for one event; returns its outcome event once it is final.
    fn record(
        &mut self,
        event: &ScheduledEvent,
        reason: String,
        result: Result<(), (String, bool)>,
    ) -> Option<sched_relay_core::Event> {
        let event_id = &event.id;
        let (error, retriable) = match result {
            Ok(()) => {
                metrics::counter!("sched_relay_approvals_total", "source" => "policy", "outcome" => "accepted", "reason" => "policy").increment(1);
                self.approvals.insert(event_id.clone(), Approval::Done);
                let record =
                    self.outcome_record(event_id, ApprovalOutcome::Accepted, "policy", reason);
                crate::approval::log_outcome(&record);
                return Some(self.factory.approval_outcome(&record, Utc::now()));
            }
            Err(failure) => failure,
        };
        let now = Instant::now();
        let (attempts, give_up_at) = match self.approvals.get(event_id) {
            Some(Approval::Retry {
                attempts,
                give_up_at,
                ..
            }) => (attempts + 1, *give_up_at),
            _ => (1, give_up_time(event, now)),
        };
        let wait = Backoff::new(FIRST_RETRY, MAX_ERROR_BACKOFF).jittered(attempts - 1);
        if retriable && now + wait < give_up_at {
            tracing::warn!(event_id = %event_id, attempts, retry_in = ?wait, error = %error, "Approval by local policy failed, will retry");
            self.approvals.insert(
                event_id.clone(),
                Approval::Retry {
                    attempts,
                    next: now + wait,
                    give_up_at,
                    reason,
                    last_error: error,
                },
            );
            return None;
        }
        tracing::error!(event_id = %event_id, attempts, error = %error, "Approval by local policy failed; the event will start at its NotBefore");
        self.approvals.insert(event_id.clone(), Approval::Done);
        let why = format!(
            "{reason}; the metadata service refused or failed after {attempts} attempt(s): {error}"
        );
        Some(self.outcome(event_id, ApprovalOutcome::Failed, "imds_error", why))
    }

    fn outcome(
        &self,
        event_id: &str,
        outcome: ApprovalOutcome,
        reason: &str,
        detail: String,
    ) -> sched_relay_core::Event {
        if outcome == ApprovalOutcome::Failed {
            metrics::counter!("sched_relay_approvals_total", "source" => "policy", "outcome" => "failed", "reason" => "imds_error").increment(1);
        }
        let record = self.outcome_record(event_id, outcome, reason, detail);
        self.factory.approval_outcome(&record, Utc::now())
    }

    fn outcome_record(
        &self,
        event_id: &str,
        outcome: ApprovalOutcome,
        reason: &str,
        detail: String,
    ) -> Outcome {
        Outcome {
            outcome,
            request_id: format!("policy:{event_id}"),
            event_ids: vec![event_id.to_owned()],
            reason: reason.to_owned(),
            detail,
            channel: "policy".to_owned(),
            dry_run: self.dry_run,
            nonce: None,
        }
    }
}

/// When retries of `event`'s approval stop: shortly before its NotBefore, when it starts by
/// itself anyway.
fn give_up_time(event: &ScheduledEvent, now: Instant) -> Instant {
    match event.not_before {
        Some(not_before) => {
            let left = (not_before - Utc::now()).to_std().unwrap_or_default();
            now + left.saturating_sub(GIVE_UP_BEFORE_NOT_BEFORE)
        }
        None => now + RETRY_WITHOUT_NOT_BEFORE,
    }
}

/// A POST's result as [`LocalPolicy::record`] takes it: the error's text and whether
/// retrying can help.
fn failure(result: &Result<(), ImdsError>) -> Result<(), (String, bool)> {
    result
        .as_ref()
        .map(|_| ())
        .map_err(|error| (error.to_string(), error.is_retriable()))
}
