//! Remote approvals: StartRequests that arrive on a broker or over HTTP are checked, in order,
//! and only then forwarded to the metadata service. The first failing check decides:
//!
//! 1. format: readable, not too large, a JSON content type;
//! 2. authenticity: signed by a trusted key (unless `allow_unsigned`);
//! 3. freshness: `time` within `max_age` (and not ahead by more than `clock_skew`), and the
//!    request id never seen before (the record survives restarts: it is in the state store);
//! 4. targeting: the request names this VM, or the fleet when `allow_fleet`; a request that
//!    names no VM must concern events whose Resources include this VM;
//! 5. state: every EventId is in the latest document and still Scheduled.
//!
//! Each request gets exactly one outcome event (accepted, rejected with the reason, failed),
//! published through the sinks before the message is acknowledged to its source.

mod checks;
pub mod config;
pub mod fault;
pub mod keys;
mod posted;
mod publish;
pub mod sources;
mod validate;

pub use publish::publish_to;

use posted::PostedHere;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use cloudevents::AttributesReader;
use sched_relay_transport::inbound::{Answer, Delivery, Reply};
use tokio::sync::{mpsc, watch};

use crate::fanout::Publisher;
use crate::imds::{ImdsClient, Snapshot};
use crate::retry::Backoff;
use crate::store::{Outbox, StoredOutcome};
use config::ApprovalsConfig;
use sched_relay_core::approval::{Key, Limits, Reason, Rejection};
use sched_relay_core::event::{ApprovalOutcome, EventFactory, Outcome};

/// Requests that arrive together are forwarded in one POST, up to this many.
const MAX_BATCH: usize = 32;
/// Waits between StartRequests POST attempts: 250 ms, doubling; `imds_attempts` bounds how
/// many (the default 3 wait 0.75 s in all).
const IMDS_RETRY: Backoff = Backoff::new(Duration::from_millis(250), Duration::MAX);

/// The verdict on one request before anything is sent.
#[derive(Debug)]
enum Verdict {
    /// On a shared channel, for another VM: no outcome.
    Skip(String),
    Reject(Rejection),
    /// Could not be checked (the state store cannot be written, no document yet): a
    /// retriable failure, with its reason code.
    Fail(&'static str, String),
    /// Forwarded and accepted before a restart; the outcome was never published.
    Posted,
    /// Handled before, with this outcome: answered with it; nothing sent or published.
    Answered(StoredOutcome),
    /// The same request id as the batch's request at this index: answered as that one is.
    Duplicate(usize),
    Valid,
}

/// One request on its way through the checks.
struct Pending {
    delivery: Delivery,
    request_id: String,
    event_ids: Vec<String>,
    verdict: Verdict,
    /// The id is recorded in flight: finish the record with the outcome.
    recorded: bool,
    /// What the request says (`checks::content_of`), for the posted requests kept in memory.
    content: Option<String>,
}

/// Checks requests and forwards the valid ones. One task runs it; sources feed it.
pub struct Approver {
    config: ApprovalsConfig,
    dry_run: bool,
    limits: Limits,
    keys: HashMap<String, Key>,
    factory: EventFactory,
    client: Arc<ImdsClient>,
    latest: watch::Receiver<Option<Snapshot>>,
    poll_interval: Duration,
    outbox: Arc<Outbox>,
    publisher: Publisher,
    /// Requests this process saw accepted, kept beside their records' `posted` mark.
    posted: PostedHere,
}

impl Approver {
    /// An approver for this VM (`factory`), with the configured keys loaded (a dry run when
    /// `config.dry_run`). `latest` is the
    /// poller's latest document; when it is older than `poll_interval`, the checks fetch a
    /// fresh one. Outcomes go out through `publisher`, whose store also keeps the replay
    /// records.
    pub fn new(
        config: &ApprovalsConfig,
        factory: EventFactory,
        client: Arc<ImdsClient>,
        latest: watch::Receiver<Option<Snapshot>>,
        poll_interval: Duration,
        publisher: Publisher,
    ) -> Result<Approver, String> {
        Ok(Approver {
            limits: Limits {
                request_type: format!("{}.approval.requested", factory.type_prefix),
                max_message_bytes: config.max_message_bytes,
                max_event_ids: config.max_event_ids,
            },
            keys: keys::load_all(config)?,
            config: config.clone(),
            dry_run: config.dry_run,
            factory,
            client,
            latest,
            poll_interval,
            outbox: publisher.outbox().clone(),
            publisher,
            posted: PostedHere::default(),
        })
    }

    /// Whether outcomes are decided but nothing is POSTed.
    pub fn dry_run(&self) -> bool {
        self.dry_run
    }

    /// The VM this approver speaks for.
    pub fn vm_name(&self) -> &str {
        &self.factory.vm.name
    }

    /// Handles deliveries until every source has stopped (the channel closes).
    pub async fn run(self, mut deliveries: mpsc::Receiver<Delivery>) {
        while let Some(first) = deliveries.recv().await {
            let mut batch = vec![first];
            while batch.len() < MAX_BATCH {
                match deliveries.try_recv() {
                    Ok(next) => batch.push(next),
                    Err(_) => break,
                }
            }
            self.handle(batch).await;
        }
    }

    async fn handle(&self, batch: Vec<Delivery>) {
        fault::panic_if(fault::Point::CheckerPanic);
        let mut document = None;
        let mut pending = Vec::with_capacity(batch.len());
        for delivery in batch {
            let (request_id, event_ids, mut verdict, recorded, content) = self
                .check_with_content(&delivery.message, &mut document)
                .await;
            // The same request twice in one batch: the second is answered as the first.
            if recorded
                && let Some(first) = pending
                    .iter()
                    .position(|p: &Pending| p.recorded && p.request_id == request_id)
            {
                verdict = Verdict::Duplicate(first);
            }
            pending.push(Pending {
                delivery,
                request_id,
                event_ids,
                verdict,
                recorded,
                content,
            });
        }
        let valid: Vec<String> = pending
            .iter()
            .filter(|p| matches!(p.verdict, Verdict::Valid))
            .flat_map(|p| p.event_ids.iter().cloned())
            .collect();
        // One POST for everything valid; if the service refuses the batch, each request is
        // tried on its own so one bad request cannot sink the others.
        let mut results: Vec<Option<Result<(), String>>> = vec![None; pending.len()];
        if !valid.is_empty() && !self.dry_run {
            match self.post(&valid).await {
                Ok(()) => {
                    for (slot, p) in results.iter_mut().zip(&pending) {
                        if matches!(p.verdict, Verdict::Valid) {
                            *slot = Some(Ok(()));
                        }
                    }
                    let accepted: Vec<&Pending> = pending
                        .iter()
                        .filter(|p| matches!(p.verdict, Verdict::Valid))
                        .collect();
                    self.mark_posted(&accepted).await;
                }
                Err(error) => {
                    let several = pending
                        .iter()
                        .filter(|p| matches!(p.verdict, Verdict::Valid))
                        .count()
                        > 1;
                    for (slot, p) in results.iter_mut().zip(&pending) {
                        if matches!(p.verdict, Verdict::Valid) {
                            let result = if several {
                                self.post(&p.event_ids).await
                            } else {
                                Err(error.clone())
                            };
                            // Marked at once, not after the batch's other POSTs: a kill or a
                            // stop while they retry must not lose this one's acceptance.
                            if result.is_ok() {
                                self.mark_posted(&[p]).await;
                            }
                            *slot = Some(result);
                        }
                    }
                }
            }
        }
        if results.iter().any(|r| matches!(r, Some(Ok(())))) {
            fault::abort_if(fault::Point::AfterPostMark);
        }
        let observed = Utc::now();
        let mut outcomes = Vec::new();
        // Per request of the batch, in order: who to answer, and with what (None: as another).
        let mut replies: Vec<(tokio::sync::oneshot::Sender<Answer>, Option<Reply>)> = Vec::new();
        let mut duplicates = Vec::new();
        let mut finished = Vec::new();
        for (p, result) in pending.into_iter().zip(results) {
            let channel = format!(
                "{}:{}",
                p.delivery.message.transport, p.delivery.message.channel
            );
            let (outcome, reason, detail, nonce) = match (&p.verdict, result) {
                (Verdict::Skip(why), _) => {
                    tracing::debug!(request_id = %p.request_id, channel = %channel, why = %why, "Skipped a request for another VM");
                    metrics::counter!("sched_relay_approvals_skipped_total", "source" => p.delivery.message.transport).increment(1);
                    let body = serde_json::json!({"requestId": p.request_id, "outcome": "skipped", "detail": why});
                    replies.push((
                        p.delivery.handled,
                        Some(Reply {
                            outcome: "skipped",
                            body,
                        }),
                    ));
                    continue;
                }
                (Verdict::Answered(stored), _) => {
                    tracing::info!(request_id = %p.request_id, channel = %channel, outcome = %stored.outcome, outcome_id = %stored.event_id, "A request handled before: answered with its stored outcome, nothing sent");
                    metrics::counter!("sched_relay_approvals_redelivered_total", "source" => p.delivery.message.transport).increment(1);
                    let outcome = match stored.outcome.as_str() {
                        "accepted" => "accepted",
                        "failed" => "failed",
                        _ => "rejected",
                    };
                    replies.push((
                        p.delivery.handled,
                        Some(Reply {
                            outcome,
                            body: stored.body.clone(),
                        }),
                    ));
                    continue;
                }
                (Verdict::Duplicate(first), _) => {
                    duplicates.push((replies.len(), *first));
                    replies.push((p.delivery.handled, None));
                    continue;
                }
                (Verdict::Reject(rejection), _) => {
                    // Only a recorded request's outcome keeps a deterministic id (a redelivery
                    // is answered with it). Anything refused before (a bad signature, an expired
                    // or replayed request) gets a unique one: whoever knows a request id must
                    // not be able to take its outcome's id first.
                    let nonce = (!p.recorded || rejection.reason == Reason::Replayed)
                        .then(|| format!("{:016x}", fastrand::u64(..)));
                    (
                        ApprovalOutcome::Rejected,
                        rejection.reason.code(),
                        rejection.detail.clone(),
                        nonce,
                    )
                }
                // A failure is not final (the request may come again): each one is an
                // outcome of its own, with an id of its own.
                (Verdict::Fail(reason, detail), _) => (
                    ApprovalOutcome::Failed,
                    *reason,
                    detail.clone(),
                    Some(format!("{:016x}", fastrand::u64(..))),
                ),
                (Verdict::Posted, _) => (
                    ApprovalOutcome::Accepted,
                    "imds_accepted",
                    "the metadata service accepted the StartRequests when this request was first handled"
                        .to_owned(),
                    None,
                ),
                // Not final (forwarded once dry run is off): an id of its own, so the real
                // outcome later is not taken for a duplicate of it.
                (Verdict::Valid, None) => (
                    ApprovalOutcome::Accepted,
                    "dry_run",
                    "dry run: every check passed; nothing was sent to the metadata service"
                        .to_owned(),
                    Some(format!("dryrun{:010x}", fastrand::u64(..) >> 24)),
                ),
                (Verdict::Valid, Some(Ok(()))) => (
                    ApprovalOutcome::Accepted,
                    "imds_accepted",
                    "the metadata service accepted the StartRequests".to_owned(),
                    None,
                ),
                (Verdict::Valid, Some(Err(error))) => (
                    ApprovalOutcome::Failed,
                    "imds_error",
                    error,
                    Some(format!("{:016x}", fastrand::u64(..))),
                ),
            };
            let record = Outcome {
                outcome,
                request_id: p.request_id.clone(),
                event_ids: p.event_ids.clone(),
                reason: reason.to_owned(),
                // Published to every sink and answered to the caller: a metadata service
                // error quotes its URL, which must not carry credentials out.
                detail: sched_relay_transport::redact::text(&detail).into_owned(),
                channel: channel.clone(),
                dry_run: self.dry_run,
                nonce,
            };
            log_outcome(&record);
            metrics::counter!(
                "sched_relay_approvals_total",
                "source" => p.delivery.message.transport,
                "outcome" => outcome.as_str(),
                "reason" => reason
            )
            .increment(1);
            let event = self.factory.approval_outcome(&record, observed);
            let body = serde_json::json!({
                "requestId": record.request_id,
                "eventIds": record.event_ids,
                "outcome": outcome.as_str(),
                "reason": record.reason,
                "detail": record.detail,
                "dryRun": record.dry_run,
                "outcomeId": event.id(),
            });
            // A failed outcome leaves the record in flight: the request may be sent again. So
            // does a dry run's: once dry run is turned off, the same request is forwarded.
            let final_outcome = outcome != ApprovalOutcome::Failed
                && !(self.dry_run && matches!(p.verdict, Verdict::Valid));
            if p.recorded && final_outcome {
                finished.push((
                    p.request_id.clone(),
                    StoredOutcome {
                        outcome: outcome.as_str().to_owned(),
                        event_id: event.id().to_owned(),
                        body: body.clone(),
                    },
                ));
            }
            outcomes.push(event);
            replies.push((
                p.delivery.handled,
                Some(Reply {
                    outcome: outcome.as_str(),
                    body,
                }),
            ));
        }
        for (duplicate, first) in duplicates {
            replies[duplicate].1 = replies[first].1.clone();
        }
        if let Err(error) = self.publisher.publish(&outcomes, None).await {
            // The outcomes are not stored: each source offers its message again after a
            // pause (or tells its requester to retry) and keeps consuming.
            tracing::error!(error = %error, "Cannot store approval outcome events; the messages will be offered again");
            let why = format!("the outcome cannot be stored: {error}");
            for (handled, _) in replies {
                metrics::counter!("sched_relay_approvals_not_handled_total").increment(1);
                let _ = handled.send(Answer::NotHandled(why.clone()));
            }
            return;
        }
        // The outcomes are published: finish their records, so a redelivery is answered with
        // them. If that fails, a redelivery is checked and forwarded again (harmless: the
        // outcome event keeps its id, and consumers de-duplicate).
        let outbox = self.outbox.clone();
        let ids: Vec<String> = finished.iter().map(|(id, _)| id.clone()).collect();
        let recorded =
            match tokio::task::spawn_blocking(move || outbox.finish_requests(&finished)).await {
                Ok(result) => result.map_err(|e| e.to_string()),
                Err(error) => Err(error.to_string()),
            };
        match recorded {
            Ok(()) => self.posted.forget(ids.into_iter()),
            Err(error) => {
                tracing::warn!(error = %error, "Cannot record approval outcomes; a redelivery will be checked and forwarded again (or answered accepted, when this process saw its POST accepted)");
            }
        }
        fault::abort_if(fault::Point::AfterOutcome);
        for (handled, reply) in replies {
            if let Some(reply) = reply {
                let _ = handled.send(Answer::Handled(reply));
            }
        }
    }

    /// Marks requests posted (the metadata service accepted them), before anything else:
    /// a redelivery after a crash from here on is answered `accepted`, even once the event
    /// has run and left the document. The crash fault point `AfterPost` is just before.
    async fn mark_posted(&self, accepted: &[&Pending]) {
        fault::abort_if(fault::Point::AfterPost);
        let posted: Vec<(String, Vec<String>)> = accepted
            .iter()
            .filter(|p| p.recorded)
            .map(|p| (p.request_id.clone(), p.event_ids.clone()))
            .collect();
        for p in accepted.iter().filter(|p| p.recorded) {
            if let Some(content) = &p.content {
                self.posted.insert(&p.request_id, content, &p.event_ids);
            }
        }
        let outbox = self.outbox.clone();
        let marked = tokio::task::spawn_blocking(move || outbox.mark_posted(&posted))
            .await
            .map_err(|e| e.to_string())
            .and_then(|result| result.map_err(|e| e.to_string()));
        if let Err(error) = marked {
            tracing::warn!(error = %error, "Cannot mark forwarded approvals in the state store; a redelivery after a crash is checked and forwarded again");
        }
    }

    /// POSTs StartRequests, retrying 5xx and timeouts.
    async fn post(&self, event_ids: &[String]) -> Result<(), String> {
        let mut unique = Vec::new();
        for id in event_ids {
            if !unique.contains(id) {
                unique.push(id.clone());
            }
        }
        let mut attempt = 0;
        loop {
            attempt += 1;
            match self.client.start(&unique).await {
                Ok(()) => return Ok(()),
                Err(error) if error.is_retriable() && attempt < self.config.imds_attempts => {
                    let wait = IMDS_RETRY.ceiling(attempt - 1);
                    tracing::warn!(attempt, retry_in = ?wait, error = %error, "StartRequests POST failed, will retry");
                    tokio::time::sleep(wait).await;
                }
                Err(error) => {
                    return Err(format!(
                        "the metadata service refused or failed after {attempt} attempt(s): {error}"
                    ));
                }
            }
        }
    }
}

/// One log line per outcome, with the ids an operator searches for.
pub fn log_outcome(outcome: &Outcome) {
    let event_ids = outcome.event_ids.join(",");
    match outcome.outcome {
        ApprovalOutcome::Accepted => {
            tracing::info!(request_id = %outcome.request_id, event_ids = %event_ids, channel = %outcome.channel, reason = %outcome.reason, dry_run = outcome.dry_run, "Approval accepted")
        }
        ApprovalOutcome::Rejected => {
            tracing::warn!(request_id = %outcome.request_id, event_ids = %event_ids, channel = %outcome.channel, reason = %outcome.reason, detail = %outcome.detail, "Approval rejected")
        }
        ApprovalOutcome::Failed => {
            tracing::error!(request_id = %outcome.request_id, event_ids = %event_ids, channel = %outcome.channel, reason = %outcome.reason, detail = %outcome.detail, "Approval failed")
        }
    }
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_records;
