//! The poll loop: fetch the document, diff each new incarnation against the previous one,
//! store and publish its CloudEvents, then hand it to local policy (its own task, so that an
//! approval POST never delays the next poll).
//!
//! After an IMDS error the next poll comes at most 5 s later however long the outage lasts
//! (`imds::pacing`), so a Preempt that appears as the service recovers is seen within the
//! poll interval + 5 s (`tests/imds_outages.rs`, on the shipped defaults).

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use cloudevents::AttributesReader;
use sched_relay_core::continuity::Continuity;
use sched_relay_core::diff::Observation;
use sched_relay_core::document::Document;
use sched_relay_core::event::{EventFactory, events_observed};

use self::fetched::{LastBody, Read};
use super::poll_timer::PollTimer;
use super::transitions;
use crate::config::Config;
use crate::fanout::Fanout;
use crate::imds::pacing::{self, GONE_GRACE};
use crate::imds::{ImdsClient, ImdsError, MIN_POLL_INTERVAL, Snapshot};

mod beats;
mod fetched;

/// After this long without a good answer, an operator has to look: log at ERROR.
const IMDS_FAILING_ALERT: Duration = Duration::from_secs(30);
/// After this long of refused documents (an event without EventId, a duplicate EventId), an
/// operator has to look: log at ERROR.
const REFUSED_DOCUMENT_ALERT: Duration = Duration::from_secs(60);

pub(super) struct Poller {
    pub(super) client: Arc<ImdsClient>,
    pub(super) factory: EventFactory,
    pub(super) fanout: Fanout,
    pub(super) config: Config,
    /// Shared, not copied, with the approval checks' snapshot and local policy: a document of
    /// a thousand events is megabytes in memory (`benches/profiling.md`, section 18).
    pub(super) previous: Option<Arc<Document>>,
    /// Local policy's feed: the first processed document after start, then each new one.
    pub(super) policy: Option<tokio::sync::watch::Sender<Option<Arc<Document>>>>,
    /// The incarnation epoch of `previous` (stored with it): resets seen so far.
    pub(super) epoch: u64,
    /// The latest document, for the remote-approval checks.
    pub(super) latest: tokio::sync::watch::Sender<Option<Snapshot>>,
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
    /// Counts the documents `previous` has been: local policy is fed each one once.
    pub(super) generation: u64,
    /// Small writes to the store, off the loop (the approved EventIds, the probe).
    pub(super) chores: Arc<super::chores::Chores>,
    /// Whether `previous` is the document the store holds as processed (false after its
    /// commit failed, even with no transitions to keep).
    pub(super) previous_stored: bool,
    /// The last body that parsed: the same bytes again are the same document as `previous`
    /// and the shared snapshot, and are not parsed and compared again.
    pub(super) last_body: Option<LastBody>,
    /// When heartbeats are due (`None`: off), and the one being stored.
    pub(super) heartbeats: Option<super::heartbeat::Heartbeats>,
}

impl Poller {
    /// A poller that resumes after `previous` (the last document processed before a restart,
    /// if any, with its incarnation epoch) and publishes each fetched document to `latest`.
    pub(super) fn new(
        config: Config,
        client: Arc<ImdsClient>,
        factory: EventFactory,
        fanout: Fanout,
        telemetry: Arc<crate::telemetry::Telemetry>,
        latest: tokio::sync::watch::Sender<Option<Snapshot>>,
        (previous, epoch): (Option<Document>, u64),
    ) -> Poller {
        Poller {
            client,
            factory,
            fanout,
            config,
            previous: previous.map(Arc::new),
            policy: None,
            epoch,
            latest,
            telemetry,
            document_gauges: Vec::new(),
            warned: None,
            unstored: Vec::new(),
            generation: 0,
            chores: Default::default(),
            previous_stored: true,
            last_body: None,
            heartbeats: None,
        }
    }

    /// Hands each processed document to local policy through `documents`.
    pub(super) fn with_policy(
        mut self,
        documents: Option<tokio::sync::watch::Sender<Option<Arc<Document>>>>,
    ) -> Poller {
        self.policy = documents;
        self
    }

    /// Polls on a thread of its own, with a single-threaded runtime, until `stop` is true;
    /// then gives the poller back (for what is left of the shutdown).
    ///
    /// Why a thread: on the agent's multi-threaded runtime every wake-up of the poll loop
    /// also woke an idle sibling worker to look for work to steal, which made most of what
    /// an idle poll cost (BENCHMARKS.md, "Idle polls"). Here an idle poll is the timer's wake,
    /// one request and the answer's wake; the runtime shared with the sinks and approval
    /// sources sleeps through it, and still has every core for a burst.
    pub(super) fn poll_on_own_thread(
        mut self,
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) -> impl Future<Output = Result<Poller, String>> {
        let (done, polled) = tokio::sync::oneshot::channel();
        let spawned = std::thread::Builder::new()
            .name("sched-relay-poll".into())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(runtime) => runtime,
                    Err(error) => {
                        let _ = done.send(Err(format!("cannot start its runtime: {error}")));
                        return;
                    }
                };
                // A task, not the `block_on` future itself: a task woken while it runs (by
                // hyper's own hand-overs inside a request) is queued on this thread, where the
                // `block_on` future is woken through the reactor (a write and another wait).
                let polled = runtime.block_on(runtime.spawn(async move {
                    self.poll_until(async move {
                        let _ = stop.wait_for(|stopped| *stopped).await;
                    })
                    .await;
                    self
                }));
                // Blocking work it started (noting what the service answered, say) may finish;
                // none of it is waited for longer than this.
                runtime.shutdown_timeout(Duration::from_secs(1));
                // A panic in the poll loop drops `done`: the agent stops (see `run`).
                if let Ok(poller) = polled {
                    let _ = done.send(Ok(poller));
                }
            });
        async move {
            spawned.map_err(|error| format!("cannot start the poll thread: {error}"))?;
            polled
                .await
                .map_err(|_| "the poll thread died (see the error logged before)".to_owned())?
        }
    }

    pub(super) async fn poll_until(&mut self, shutdown: impl Future<Output = ()>) {
        tokio::pin!(shutdown);
        let interval = self.config.imds.poll_interval;
        let max_backoff = self.config.imds.max_backoff;
        let mut failures: u32 = 0;
        let mut failing_since: Option<Instant> = None;
        let mut alerted = false;
        let mut policy_fed = false;
        let mut policy_generation = self.generation;
        let mut answer_recorded = false;
        // The last refused document's reason: said once at WARN, not once per poll.
        let mut refusal: Option<String> = None;
        let mut timer = PollTimer::new();
        let mut connection = self.client.poll_connection();
        loop {
            let started = Instant::now();
            // The stop first: the fetch blocks this thread a slice at a time when polled.
            let fetched = tokio::select! {
                biased;
                _ = &mut shutdown => return,
                fetched = async {
                    match &mut connection {
                        Some(connection) => self.client.fetch_body_on(connection).await,
                        None => self.client.fetch_body().await,
                    }
                } => fetched,
            };
            let fetched = fetched.and_then(|body| self.read(body));
            metrics::counter!("sched_relay_imds_polls_total").increment(1);
            metrics::histogram!("sched_relay_imds_poll_duration_seconds")
                .record(started.elapsed().as_secs_f64());
            let wait = match fetched {
                Ok(read) => {
                    if failures > 0 {
                        tracing::info!(failures, "Metadata service answers again");
                    }
                    failures = 0;
                    failing_since = None;
                    alerted = false;
                    refusal = None;
                    self.telemetry.imds.answered();
                    if !answer_recorded {
                        answer_recorded = true;
                        super::chores::Chores::record_answer(self.fanout.publisher().outbox());
                    }
                    metrics::gauge!("sched_relay_imds_last_success_timestamp_seconds")
                        .set(Utc::now().timestamp() as f64);
                    let processed = match read {
                        Read::Same => {
                            self.note_odd_fields_again();
                            self.renew_shared();
                            self.on_unchanged().await
                        }
                        Read::New(parsed) => {
                            self.note_odd_fields(parsed.document.incarnation, &parsed.warnings);
                            let document = Arc::new(parsed.document);
                            self.share(&document);
                            self.on_document(document).await
                        }
                    };
                    // Ready once a fetched document is processed (its events stored): not when
                    // its commit failed, even if the stored one has the same incarnation.
                    if processed.is_some() {
                        self.telemetry
                            .first_poll_done
                            .store(true, std::sync::atomic::Ordering::Relaxed);
                        if let Some(heartbeats) = &mut self.heartbeats {
                            heartbeats.arm();
                        }
                    }
                    self.chores
                        .persist_accepted(self.fanout.publisher().outbox(), self.client.accepted());
                    // Local policy judges the first document after start in full (an event
                    // stored before a restart is approved too), then each new one, stored or
                    // not: an approval needs the metadata service, not the state store, and a
                    // full disk must not cost a user's early start.
                    if (self.generation != policy_generation || !policy_fed)
                        && let Some(previous) = &self.previous
                    {
                        policy_fed = true;
                        policy_generation = self.generation;
                        if let Some(policy) = &self.policy {
                            policy.send_replace(Some(previous.clone()));
                        }
                    }
                    interval
                }
                Err(error) => {
                    failures = failures.saturating_add(1);
                    let since = *failing_since.get_or_insert(started);
                    self.telemetry.imds.failed(since, &error);
                    metrics::counter!("sched_relay_imds_errors_total", "kind" => error.kind())
                        .increment(1);
                    let wait = pacing::error_wait(&error, failures, interval, max_backoff);
                    let refused = matches!(error, ImdsError::Malformed { .. });
                    if refused {
                        metrics::counter!("sched_relay_documents_refused_total").increment(1);
                    }
                    // Azure documents a 410 as passing within 70 s: until then it is expected.
                    let alert_after = match error.kind() {
                        "gone" => GONE_GRACE,
                        "malformed" => REFUSED_DOCUMENT_ALERT,
                        _ => IMDS_FAILING_ALERT,
                    };
                    if !alerted && since.elapsed() >= alert_after {
                        alerted = true;
                        if refused {
                            tracing::error!(failures, error = %error, refused_for = ?since.elapsed(), "Documents refused for over a minute; no event in them is seen until the service sends a valid one (the last good document is kept)");
                        } else {
                            tracing::error!(kind = error.kind(), failures, error = %error, failing_for = ?since.elapsed(), "Metadata service failing; no events can be seen");
                        }
                    } else if refused && refusal.as_deref() == Some(error.to_string().as_str()) {
                        tracing::debug!(error = %error, "The same document refused again");
                    } else if refused {
                        refusal = Some(error.to_string());
                        tracing::warn!(kind = error.kind(), error = %error, retry_in = ?wait, "Document refused whole, its other events included (logged once per reason; sched_relay_documents_refused_total counts every poll)");
                    } else {
                        tracing::warn!(kind = error.kind(), failures, retry_in = ?wait, error = %error, "Metadata service request failed");
                    }
                    wait
                }
            };
            // Also while the service fails: the agent is alive, its last document stands.
            self.heartbeat_if_due();
            let posted = tokio::select! {
                _ = &mut shutdown => return,
                _ = timer.sleep_until(started + wait) => false,
                // An approval was accepted: the event is about to start, so look again now
                // (still at most one request per MIN_POLL_INTERVAL, within the IMDS budget).
                _ = self.client.posted().notified() => true,
            };
            if posted {
                tokio::select! {
                    _ = &mut shutdown => return,
                    _ = timer.sleep_until(started + MIN_POLL_INTERVAL) => {}
                }
            }
        }
    }

    /// At exit: stores what is still held in memory if the store takes it now, else logs every
    /// such event whole at ERROR (the next start diffs against the last stored document, so
    /// their net effect is reported again, but not each step).
    pub(super) async fn store_unstored_at_exit(&mut self, deadline: tokio::time::Instant) {
        if self.unstored.is_empty() {
            return;
        }
        let processed = self
            .previous
            .as_ref()
            .map(|document| crate::fanout::ProcessedDocument {
                document: document.clone(),
                epoch: self.epoch,
            });
        let heartbeat = self.heartbeats.as_mut();
        let publish = async {
            if let Some(heartbeats) = heartbeat {
                heartbeats.stored().await;
            }
            self.fanout.publish(&self.unstored, processed).await
        };
        let stored = tokio::time::timeout_at(deadline, publish)
            .await
            .unwrap_or_else(|_| {
                Err(crate::store::StoreError::Io {
                    path: "outbox".into(),
                    reason: "the state store did not answer by the shutdown deadline".into(),
                })
            });
        match stored {
            Ok(()) => self.unstored.clear(),
            Err(error) => {
                for event in self.unstored.drain(..) {
                    let text = serde_json::to_string(&event).unwrap_or_default();
                    tracing::error!(id = %event.id(), event = %text, error = %error, "Stopping with a transition the state store may not have taken; if it did not, it is not delivered (the next start reports the net change)");
                }
            }
        }
    }

    /// `sched_relay_document_events{event_type, status}`: how many events of each kind the
    /// current document holds (kinds that left go back to 0); `gauges` are the label pairs
    /// set before.
    fn set_document_gauges(gauges: &mut Vec<(String, String)>, document: &Document) {
        let mut counts: HashMap<(String, String), f64> =
            gauges.drain(..).map(|labels| (labels, 0.0)).collect();
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
                gauges.push((event_type, status));
            }
        }
    }

    /// Diffs a fetched document against the previous one and publishes what changed.
    /// `Some(new)` once the document is processed (it is `previous`, and its events, its epoch
    /// and those of any document seen while the store could not be written are durable in the
    /// outbox): `new` when something was stored. `None` while the store cannot be written:
    /// the transitions stay in memory (`unstored`) and the next poll stores them.
    async fn on_document(&mut self, document: Arc<Document>) -> Option<bool> {
        let continuity = Continuity::of(self.previous.as_deref(), &document);
        if continuity == Continuity::Unchanged {
            return self.on_unchanged().await;
        }
        // The epoch moves with `previous`, stored or not: a document derived again after
        // a failed commit keeps its ids, and a restart starts from the stored pair.
        let epoch = continuity.epoch_after(self.epoch);
        if continuity == Continuity::Reset {
            tracing::warn!(
                previous = self.previous.as_ref().map(|p| p.incarnation),
                current = document.incarnation,
                epoch,
                "DocumentIncarnation reset (it went backwards, or repeated with other content): Azure restarted its numbering; diffed against the last document, incarnation ids now end in ~e<epoch>"
            );
            metrics::counter!("sched_relay_incarnation_resets_total").increment(1);
        }
        let approved = self.client.accepted();
        let observation = Observation {
            at: Utc::now(),
            epoch,
            approved: &approved,
        };
        let events = events_observed(
            &self.factory,
            self.previous.as_deref(),
            &document,
            self.config.events.document_events,
            &observation,
        );
        self.unstored.extend(events);
        let present = |id: &str| {
            document
                .events
                .iter()
                .any(|e| e.id.eq_ignore_ascii_case(id))
        };
        self.client.forget_accepted(present);
        self.epoch = epoch;
        self.previous = Some(document);
        self.generation += 1;
        self.commit(false).await
    }

    /// `previous` was fetched again: stores what an earlier commit could not, if anything.
    async fn on_unchanged(&mut self) -> Option<bool> {
        if self.unstored.is_empty() && self.previous_stored {
            // Nothing of its own to store: whether the store can be written again is found
            // by a probe (the commit of what it kept does that otherwise).
            if let Some(previous) = &self.previous {
                self.chores
                    .probe(self.fanout.publisher().outbox(), previous, self.epoch);
            }
            return Some(false);
        }
        self.commit(true).await
    }

    /// Stores `unstored` with `previous` as the processed document (see `on_document`).
    async fn commit(&mut self, unchanged: bool) -> Option<bool> {
        let Some(document) = self.previous.as_ref() else {
            // Nothing was ever derived without a document to derive it from.
            return Some(false);
        };
        let processed = crate::fanout::ProcessedDocument {
            document: document.clone(),
            epoch: self.epoch,
        };
        // Shared with the sinks, not copied; back in `unstored` unless the commit succeeded
        // (see `Pending` for a drop midway).
        // After the heartbeat made before them, in every sink's queue.
        if let Some(heartbeats) = &mut self.heartbeats {
            heartbeats.stored().await;
        }
        let events: Arc<[sched_relay_core::Event]> = std::mem::take(&mut self.unstored).into();
        let pending = transitions::Pending::new(&mut self.unstored, events.clone());
        let committed = self
            .fanout
            .publish_shared(events.clone(), Some(processed))
            .await;
        pending.settle(committed.is_ok());
        self.previous_stored = committed.is_ok();
        if let Err(error) = committed {
            // Kept in memory: the next poll tries again, and the next document is diffed
            // against this one, so no transition seen meanwhile is lost (a restart before
            // then diffs the next document against the last stored one).
            // Said once per document, not on every poll while the disk stays full.
            if unchanged {
                tracing::debug!(incarnation = document.incarnation, unstored = self.unstored.len(), error = %error, "Still cannot store the transitions seen");
            } else {
                tracing::warn!(incarnation = document.incarnation, unstored = self.unstored.len(), error = %error, "Cannot store the transitions seen; keeping them to store on the next poll");
            }
            return None;
        }
        transitions::stored(&events);
        metrics::gauge!("sched_relay_incarnation").set(document.incarnation as f64);
        Self::set_document_gauges(&mut self.document_gauges, document);
        Some(true)
    }
}
