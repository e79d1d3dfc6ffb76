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

pub mod config;
pub mod keys;
mod publish;

pub use publish::publish_to;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use sched_relay_transport::inbound::{Delivery, Inbound, Reply};
use tokio::sync::{mpsc, watch};

use crate::fanout::Publisher;
use crate::imds::ImdsClient;
use crate::store::Outbox;
use config::ApprovalsConfig;
use sched_relay_core::approval::{
    FLEET_TARGET, Key, Limits, Reason, Rejection, Request, canonical, decode_base64, parse,
};
use sched_relay_core::document::{Document, EventStatus};
use sched_relay_core::event::{ApprovalOutcome, EventFactory, Outcome};

/// Requests that arrive together are forwarded in one POST, up to this many.
const MAX_BATCH: usize = 32;
/// The first wait between POST attempts; it doubles.
const IMDS_RETRY: Duration = Duration::from_millis(250);

/// The latest document the poller fetched, and when.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub document: Arc<Document>,
    pub fetched: Instant,
}

/// The verdict on one request before anything is sent.
#[derive(Debug)]
enum Verdict {
    /// On a shared channel, for another VM: no outcome.
    Skip(String),
    Reject(Rejection),
    Valid,
}

/// One request on its way through the checks.
struct Pending {
    delivery: Delivery,
    request_id: String,
    event_ids: Vec<String>,
    verdict: Verdict,
}

/// Checks requests and forwards the valid ones. One task runs it; sources feed it.
pub struct Approver {
    pub config: ApprovalsConfig,
    pub dry_run: bool,
    pub limits: Limits,
    pub keys: HashMap<String, Key>,
    pub factory: EventFactory,
    pub client: Arc<ImdsClient>,
    pub latest: watch::Receiver<Option<Snapshot>>,
    pub poll_interval: Duration,
    pub outbox: Arc<Outbox>,
    pub publisher: Publisher,
}

impl Approver {
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
        let mut document = None;
        let mut pending = Vec::with_capacity(batch.len());
        for delivery in batch {
            let (request_id, event_ids, verdict) =
                self.check(&delivery.message, &mut document).await;
            pending.push(Pending {
                delivery,
                request_id,
                event_ids,
                verdict,
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
                }
                Err(error) => {
                    let several = pending
                        .iter()
                        .filter(|p| matches!(p.verdict, Verdict::Valid))
                        .count()
                        > 1;
                    for (slot, p) in results.iter_mut().zip(&pending) {
                        if matches!(p.verdict, Verdict::Valid) {
                            *slot = Some(if several {
                                self.post(&p.event_ids).await
                            } else {
                                Err(error.clone())
                            });
                        }
                    }
                }
            }
        }
        let observed = Utc::now();
        let mut outcomes = Vec::new();
        let mut replies = Vec::new();
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
                        Reply {
                            outcome: "skipped",
                            body,
                        },
                    ));
                    continue;
                }
                (Verdict::Reject(rejection), _) => {
                    let nonce = (rejection.reason == Reason::Replayed)
                        .then(|| format!("{:016x}", fastrand::u64(..)));
                    (
                        ApprovalOutcome::Rejected,
                        rejection.reason.code(),
                        rejection.detail.clone(),
                        nonce,
                    )
                }
                (Verdict::Valid, None) => (
                    ApprovalOutcome::Accepted,
                    "dry_run",
                    "dry run: every check passed; nothing was sent to the metadata service"
                        .to_owned(),
                    None,
                ),
                (Verdict::Valid, Some(Ok(()))) => (
                    ApprovalOutcome::Accepted,
                    "imds_accepted",
                    "the metadata service accepted the StartRequests".to_owned(),
                    None,
                ),
                (Verdict::Valid, Some(Err(error))) => {
                    (ApprovalOutcome::Failed, "imds_error", error, None)
                }
            };
            let record = Outcome {
                outcome,
                request_id: p.request_id.clone(),
                event_ids: p.event_ids.clone(),
                reason: reason.to_owned(),
                detail,
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
            let body = serde_json::json!({
                "requestId": record.request_id,
                "eventIds": record.event_ids,
                "outcome": outcome.as_str(),
                "reason": record.reason,
                "detail": record.detail,
                "dryRun": record.dry_run,
            });
            outcomes.push(self.factory.approval_outcome(&record, observed));
            replies.push((
                p.delivery.handled,
                Reply {
                    outcome: outcome.as_str(),
                    body,
                },
            ));
        }
        if let Err(error) = self.publisher.publish(&outcomes, None).await {
            // The outcomes are not stored: leave the messages unacknowledged so the brokers
            // deliver them again (they will then be refused as replays, which is safe).
            tracing::error!(error = %error, "Cannot store approval outcome events; the messages stay unacknowledged");
            return;
        }
        for (handled, reply) in replies {
            let _ = handled.send(reply);
        }
    }

    /// Runs the checks on one message. Returns the request id (or a made-up one for
    /// messages without a readable id), its EventIds and the verdict.
    async fn check(
        &self,
        message: &Inbound,
        document: &mut Option<Arc<Document>>,
    ) -> (String, Vec<String>, Verdict) {
        let made_up = || {
            format!(
                "unidentified:{}:{:016x}",
                message.transport,
                fastrand::u64(..)
            )
        };
        let request = match parse(message, &self.limits) {
            Ok(request) => request,
            Err((rejection, id)) => {
                return (
                    id.unwrap_or_else(made_up),
                    Vec::new(),
                    Verdict::Reject(rejection),
                );
            }
        };
        let request_id = request.id().map(str::to_owned).unwrap_or_else(made_up);
        let event_ids = request.event_ids.clone();
        if message.shared
            && let Some(target) = request.vm_name()
            && target != FLEET_TARGET
            && !target.eq_ignore_ascii_case(&self.factory.vm.name)
        {
            return (
                request_id,
                event_ids,
                Verdict::Skip(format!("addressed to {target}")),
            );
        }
        let verdict = match self.checks(&request, document).await {
            Ok(()) => Verdict::Valid,
            Err(rejection) => Verdict::Reject(rejection),
        };
        (request_id, event_ids, verdict)
    }

    async fn checks(
        &self,
        request: &Request,
        document: &mut Option<Arc<Document>>,
    ) -> Result<(), Rejection> {
        self.authenticity(request)?;
        self.freshness(request).await?;
        self.targeting(request)?;
        let document = match document {
            Some(document) => document.clone(),
            None => document.insert(self.latest_document().await?).clone(),
        };
        self.state(request, &document)
    }

    fn authenticity(&self, request: &Request) -> Result<(), Rejection> {
        let unsigned = |what: &str| {
            Rejection::new(
                Reason::Unsigned,
                format!(
                    "{what}; unsigned requests are accepted only with approvals.allow_unsigned = true"
                ),
            )
        };
        let Some(attributes) = &request.cloud_event else {
            return if self.config.allow_unsigned {
                Ok(())
            } else {
                Err(unsigned("a bare StartRequests body carries no signature"))
            };
        };
        let Some(signature) = &attributes.signature else {
            return if self.config.allow_unsigned {
                Ok(())
            } else {
                Err(unsigned("the request has no signature extension"))
            };
        };
        let key_id = attributes.key_id.as_deref().ok_or_else(|| {
            Rejection::new(
                Reason::UnknownKey,
                "the request is signed but names no keyid",
            )
        })?;
        let key = self.keys.get(key_id).ok_or_else(|| {
            Rejection::new(
                Reason::UnknownKey,
                format!("keyid {key_id:?} is not one of approvals.keys"),
            )
        })?;
        let signature = decode_base64(signature)
            .ok_or_else(|| Rejection::new(Reason::BadSignature, "the signature is not base64"))?;
        let canonical = canonical(
            &attributes.id,
            &attributes.source,
            attributes.time.timestamp(),
            attributes.vm_name.as_deref(),
            &request.event_ids,
        );
        if key.verify(canonical.as_bytes(), &signature) {
            Ok(())
        } else {
            Err(Rejection::new(
                Reason::BadSignature,
                format!(
                    "the signature does not match the request with key {key_id:?} (was anything changed on the way, or signed with another key?)"
                ),
            ))
        }
    }

    async fn freshness(&self, request: &Request) -> Result<(), Rejection> {
        // A bare body has neither time nor id: only allow_unsigned lets it this far.
        let Some(attributes) = &request.cloud_event else {
            return Ok(());
        };
        let now = Utc::now();
        let age = now.signed_duration_since(attributes.time);
        let max_age =
            chrono::Duration::from_std(self.config.max_age).unwrap_or(chrono::Duration::MAX);
        let skew =
            chrono::Duration::from_std(self.config.clock_skew).unwrap_or(chrono::Duration::MAX);
        if age > max_age {
            return Err(Rejection::new(
                Reason::Expired,
                format!(
                    "time {} is {}s old; at most {}s (approvals.max_age)",
                    attributes.time,
                    age.num_seconds(),
                    max_age.num_seconds()
                ),
            ));
        }
        if -age > skew {
            return Err(Rejection::new(
                Reason::FromTheFuture,
                format!(
                    "time {} is {}s ahead of this VM's clock; at most {}s (approvals.clock_skew)",
                    attributes.time,
                    (-age).num_seconds(),
                    skew.num_seconds()
                ),
            ));
        }
        let keep_until = (attributes.time + max_age).timestamp() + 1;
        let outbox = self.outbox.clone();
        let id = attributes.id.clone();
        let now = now.timestamp();
        let new =
            tokio::task::spawn_blocking(move || outbox.remember_request(&id, keep_until, now))
                .await
                .map_err(|e| e.to_string())
                .and_then(|result| result.map_err(|e| e.to_string()));
        match new {
            Ok(true) => Ok(()),
            Ok(false) => Err(Rejection::new(
                Reason::Replayed,
                format!("request id {:?} was already handled", attributes.id),
            )),
            // Without a durable record a replay could not be recognised later: refuse.
            Err(error) => Err(Rejection::new(
                Reason::Replayed,
                format!("cannot record the request id, so it is refused: {error}"),
            )),
        }
    }

    fn targeting(&self, request: &Request) -> Result<(), Rejection> {
        let me = &self.factory.vm.name;
        match request.vm_name() {
            None => Ok(()),
            Some(target) if target.eq_ignore_ascii_case(me) => Ok(()),
            Some(FLEET_TARGET) if self.config.allow_fleet => Ok(()),
            Some(FLEET_TARGET) => Err(Rejection::new(
                Reason::WrongTarget,
                "the request is for the whole fleet (vmname \"*\"); that needs approvals.allow_fleet = true",
            )),
            Some(target) => Err(Rejection::new(
                Reason::WrongTarget,
                format!("the request is for VM {target:?}, and this is {me:?}"),
            )),
        }
    }

    fn state(&self, request: &Request, document: &Document) -> Result<(), Rejection> {
        for event_id in &request.event_ids {
            let Some(event) = document.event(event_id) else {
                return Err(Rejection::new(
                    Reason::UnknownEvent,
                    format!(
                        "EventId {event_id} is not in the current document (incarnation {}): unknown, or already over",
                        document.incarnation
                    ),
                ));
            };
            match &event.status {
                EventStatus::Scheduled => {}
                EventStatus::Started => {
                    return Err(Rejection::new(
                        Reason::EventStarted,
                        format!("EventId {event_id} has already Started"),
                    ));
                }
                other => {
                    return Err(Rejection::new(
                        Reason::EventNotScheduled,
                        format!("EventId {event_id} is {}, not Scheduled", other.as_str()),
                    ));
                }
            }
            if request.vm_name().is_none() && !event.affects(&self.factory.vm.name) {
                return Err(Rejection::new(
                    Reason::NotAffected,
                    format!(
                        "the request names no VM, and EventId {event_id} does not list this VM in Resources"
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The poller's document when it is fresher than one poll interval; else a new fetch.
    async fn latest_document(&self) -> Result<Arc<Document>, Rejection> {
        let cached = self.latest.borrow().clone();
        if let Some(snapshot) = &cached
            && snapshot.fetched.elapsed() <= self.poll_interval
        {
            return Ok(snapshot.document.clone());
        }
        match self.client.fetch().await {
            Ok(parsed) => Ok(Arc::new(parsed.document)),
            Err(error) => match cached {
                Some(snapshot) => {
                    tracing::warn!(error = %error, "Cannot fetch a fresh document for an approval; checking against the last one");
                    Ok(snapshot.document)
                }
                None => Err(Rejection::new(
                    Reason::UnknownEvent,
                    format!("no document from the metadata service yet: {error}"),
                )),
            },
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
                    let wait = IMDS_RETRY * 2u32.saturating_pow(attempt - 1);
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
