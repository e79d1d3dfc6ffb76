//! The poll loop: fetch the document, diff each new incarnation against the previous one,
//! store and publish its CloudEvents, then let local policy look at it.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use cloudevents::AttributesReader;
use sched_relay_core::EventKind;
use sched_relay_core::document::Document;
use sched_relay_core::event::{EventFactory, events_for_document};

use super::local_policy::ApprovalState;
use crate::config::Config;
use crate::fanout::Fanout;
use crate::imds::{ImdsClient, MIN_POLL_INTERVAL, Snapshot};
use crate::retry::Backoff;

/// After this long without a good answer, an operator has to look: log at ERROR.
const IMDS_FAILING_ALERT: Duration = Duration::from_secs(30);

pub(super) struct Poller {
    pub(super) client: Arc<ImdsClient>,
    pub(super) factory: EventFactory,
    pub(super) fanout: Fanout,
    pub(super) config: Config,
    pub(super) previous: Option<Document>,
    pub(super) approvals: HashMap<String, ApprovalState>,
    /// The latest document, for the remote-approval checks.
    pub(super) latest: tokio::sync::watch::Sender<Option<Snapshot>>,
    pub(super) dry_run: bool,
    pub(super) telemetry: Arc<crate::telemetry::Telemetry>,
    /// The (EventType, EventStatus) label pairs of the `sched_relay_document_events` gauge
    /// set for the last document, so they go back to 0 when events leave.
    pub(super) document_gauges: Vec<(String, String)>,
    /// The incarnation and odd fields last warned about: an unchanged document is fetched
    /// every poll, and its oddities are logged once, not 3,600 times an hour.
    pub(super) warned: Option<(u64, Vec<String>)>,
    /// Transitions derived from documents whose commit failed (the state store could not be
    /// written), oldest first. `previous` has moved on to the document they came from, so
    /// each document seen meanwhile is diffed once, against the one before it; every poll
    /// tries to store them again, and the first commit that succeeds carries them all, with
    /// the ids they were derived with.
    pub(super) unstored: Vec<sched_relay_core::Event>,
}

impl Poller {
    /// A poller that resumes after `previous` (the last document processed before a restart,
    /// if any) and publishes each fetched document to `latest`.
    pub(super) fn new(
        config: Config,
        client: Arc<ImdsClient>,
        factory: EventFactory,
        fanout: Fanout,
        telemetry: Arc<crate::telemetry::Telemetry>,
        latest: tokio::sync::watch::Sender<Option<Snapshot>>,
        previous: Option<Document>,
    ) -> Poller {
        Poller {
            dry_run: config.approvals.dry_run,
            client,
            factory,
            fanout,
            config,
            previous,
            approvals: HashMap::new(),
            latest,
            telemetry,
            document_gauges: Vec::new(),
            warned: None,
            unstored: Vec::new(),
        }
    }

    pub(super) async fn poll_until(&mut self, shutdown: impl Future<Output = ()>) {
        tokio::pin!(shutdown);
        let interval = self.config.imds.poll_interval;
        let mut failures: u32 = 0;
        let mut failing_since: Option<Instant> = None;
        let mut alerted = false;
        loop {
            let started = Instant::now();
            let fetched = tokio::select! {
                _ = &mut shutdown => return,
                fetched = self.client.fetch() => fetched,
            };
            metrics::counter!("sched_relay_imds_polls_total").increment(1);
            metrics::histogram!("sched_relay_imds_poll_duration_seconds")
                .record(started.elapsed().as_secs_f64());
            let wait = match fetched {
                Ok(parsed) => {
                    if failures > 0 {
                        tracing::info!(failures, "Metadata service answers again");
                    }
                    failures = 0;
                    failing_since = None;
                    alerted = false;
                    self.note_odd_fields(parsed.document.incarnation, &parsed.warnings);
                    self.share(&parsed.document);
                    metrics::gauge!("sched_relay_imds_last_success_timestamp_seconds")
                        .set(Utc::now().timestamp() as f64);
                    let incarnation = parsed.document.incarnation;
                    let new_document = self.on_document(parsed.document).await;
                    // Ready once a fetched document is processed (its events stored).
                    if self
                        .previous
                        .as_ref()
                        .is_some_and(|previous| previous.incarnation == incarnation)
                    {
                        self.telemetry
                            .first_poll_done
                            .store(true, std::sync::atomic::Ordering::Relaxed);
                    }
                    self.apply_policy(new_document).await;
                    interval
                }
                Err(error) => {
                    failures += 1;
                    let since = *failing_since.get_or_insert(started);
                    metrics::counter!("sched_relay_imds_errors_total", "kind" => error.kind())
                        .increment(1);
                    let wait = Backoff::new(interval, self.config.imds.max_backoff)
                        .jittered(failures - 1)
                        .max(interval);
                    if !alerted && since.elapsed() >= IMDS_FAILING_ALERT {
                        alerted = true;
                        tracing::error!(kind = error.kind(), failures, error = %error, "Metadata service failing for over 30 s; no events can be seen");
                    } else {
                        tracing::warn!(kind = error.kind(), failures, retry_in = ?wait, error = %error, "Metadata service request failed");
                    }
                    wait
                }
            };
            tokio::select! {
                _ = &mut shutdown => return,
                _ = tokio::time::sleep_until((started + wait).into()) => {}
                // An approval was accepted: the event is about to start, so look again now
                // (still at most one request per MIN_POLL_INTERVAL, within the IMDS budget).
                _ = self.client.posted().notified() => {
                    tokio::select! {
                        _ = &mut shutdown => return,
                        _ = tokio::time::sleep_until((started + MIN_POLL_INTERVAL).into()) => {}
                    }
                }
            }
        }
    }

    /// `sched_relay_document_events{event_type, status}`: how many events of each kind the
    /// current document holds (kinds that left go back to 0).
    fn set_document_gauges(&mut self, document: &Document) {
        let mut counts: HashMap<(String, String), f64> = self
            .document_gauges
            .drain(..)
            .map(|labels| (labels, 0.0))
            .collect();
        for event in &document.events {
            let event_type = event
                .raw
                .get("EventType")
                .and_then(|t| t.as_str())
                .unwrap_or("unknown")
                .to_owned();
            *counts
                .entry((event_type, event.status.as_str().to_owned()))
                .or_default() += 1.0;
        }
        for ((event_type, status), count) in counts {
            metrics::gauge!("sched_relay_document_events", "event_type" => event_type.clone(), "status" => status.clone()).set(count);
            if count > 0.0 {
                self.document_gauges.push((event_type, status));
            }
        }
    }

    /// Counts every odd field of every fetch, and logs them once per incarnation (again if
    /// the same incarnation comes back with other oddities).
    fn note_odd_fields(&mut self, incarnation: u64, warnings: &[String]) {
        if warnings.is_empty() {
            return;
        }
        metrics::counter!("sched_relay_document_odd_fields_total").increment(warnings.len() as u64);
        if self
            .warned
            .as_ref()
            .is_some_and(|(seen, said)| *seen == incarnation && said == warnings)
        {
            return;
        }
        for warning in warnings {
            tracing::warn!(incarnation, warning = %warning, "Tolerated an odd field in the document (logged once per incarnation; sched_relay_document_odd_fields_total counts every fetch)");
        }
        self.warned = Some((incarnation, warnings.to_vec()));
    }

    /// Tells the approval checks about the latest document (a copy only when it changed).
    fn share(&self, document: &Document) {
        self.latest.send_modify(|latest| match latest {
            Some(snapshot) if snapshot.document.incarnation == document.incarnation => {
                snapshot.fetched = Instant::now();
            }
            _ => {
                *latest = Some(Snapshot {
                    document: Arc::new(document.clone()),
                    fetched: Instant::now(),
                })
            }
        });
    }

    /// Diffs a fetched document against the previous one and publishes what changed.
    /// Returns whether the document was new (a new incarnation) and is now processed: its
    /// events, and those of any document seen while the store could not be written, are
    /// durable in the outbox.
    async fn on_document(&mut self, document: Document) -> bool {
        let unchanged = self
            .previous
            .as_ref()
            .is_some_and(|previous| previous.incarnation == document.incarnation);
        if unchanged && self.unstored.is_empty() {
            return false;
        }
        if !unchanged {
            if let Some(previous) = &self.previous
                && document.incarnation < previous.incarnation
            {
                tracing::warn!(
                    previous = previous.incarnation,
                    current = document.incarnation,
                    "DocumentIncarnation went backwards (service re-enabled?); diffing against the last document anyway"
                );
            }
            let events = events_for_document(
                &self.factory,
                self.previous.as_ref(),
                &document,
                self.config.events.document_events,
                Utc::now(),
            );
            self.unstored.extend(events);
            self.approvals.retain(|id, _| document.event(id).is_some());
            self.previous = Some(document.clone());
        }
        if let Err(error) = self
            .fanout
            .publish(&self.unstored, Some(&document.raw))
            .await
        {
            // Kept in memory: the next poll tries again, and the next document is diffed
            // against this one, so no transition seen meanwhile is lost (a restart before
            // then diffs the next document against the last stored one).
            // Said once per document, not on every poll while the disk stays full.
            if unchanged {
                tracing::debug!(incarnation = document.incarnation, unstored = self.unstored.len(), error = %error, "Still cannot store the transitions seen");
            } else {
                tracing::warn!(incarnation = document.incarnation, unstored = self.unstored.len(), error = %error, "Cannot store the transitions seen; keeping them to store on the next poll");
            }
            return false;
        }
        for event in std::mem::take(&mut self.unstored) {
            let EventKind::Transition(kind) = event.kind() else {
                continue;
            };
            let transition = kind.as_str();
            let extension = |name| {
                event
                    .extension(name)
                    .map(|v| v.to_string())
                    .unwrap_or_default()
            };
            tracing::info!(
                event_id = event.subject().unwrap_or_default(),
                transition,
                incarnation = %extension("incarnation"),
                event_type = %extension("eventtype"),
                status = %extension("eventstatus"),
                affects_vm = %extension("affectsvm"),
                id = %event.id(),
                "Transition"
            );
            metrics::counter!("sched_relay_transitions_total", "transition" => transition.to_owned()).increment(1);
        }
        metrics::gauge!("sched_relay_incarnation").set(document.incarnation as f64);
        self.set_document_gauges(&document);
        true
    }
}
