//! What the agent tells operators about itself: Prometheus metrics, readiness, and a JSON view
//! of the current document with each event's delivery state per sink. Served by
//! [`crate::http`] on `[telemetry] listen`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use chrono::Utc;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::sync::watch;

use crate::fanout::SinkHealth;
use crate::imds::Snapshot;
use crate::store::Outbox;

/// Seconds buckets for request latencies: IMDS answers in about a millisecond on a VM, the
/// first call can take minutes.
const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0,
];

/// Seconds buckets for the state store's commit: an fsync takes 0.1-2 ms on a good disk.
const COMMIT_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.1, 0.5, 2.5, 10.0,
];

/// `[telemetry]`: the agent's own HTTP listener (`/healthz`, `POST /approvals`). Off unless
/// `listen` is set; keep it on loopback unless something outside the VM must reach it.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TelemetryConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub listen: Option<std::net::SocketAddr>,
    /// Connections served at once; beyond them a connection gets `503` (or `200` for
    /// `GET /healthz`) and is closed.
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    /// How long a client may take to send a request's headers, and its body; a connection
    /// idle in either is closed.
    #[serde(default = "default_request_timeout", with = "humantime_serde")]
    pub request_timeout: std::time::Duration,
    /// Serve HTTPS with this certificate chain (PEM), and `tls_key_file`'s key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_cert_file: Option<std::path::PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_key_file: Option<std::path::PathBuf>,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        TelemetryConfig {
            listen: None,
            max_connections: default_max_connections(),
            request_timeout: default_request_timeout(),
            tls_cert_file: None,
            tls_key_file: None,
        }
    }
}

fn default_max_connections() -> usize {
    256
}

fn default_request_timeout() -> std::time::Duration {
    std::time::Duration::from_secs(10)
}

mod catalogue;
pub use catalogue::METRICS;

/// The process-wide Prometheus recorder, installed on first use (a process has one).
pub fn prometheus() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        let handle = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS)
            .expect("the buckets are not empty")
            // A full match wins over the suffix.
            .set_buckets_for_metric(
                Matcher::Full("sched_relay_state_store_commit_seconds".into()),
                COMMIT_BUCKETS,
            )
            .expect("the buckets are not empty")
            .install_recorder()
            .expect("no other metrics recorder is installed");
        for (name, kind, help) in METRICS {
            match *kind {
                "counter" => metrics::describe_counter!(*name, *help),
                "histogram" => metrics::describe_histogram!(*name, metrics::Unit::Seconds, *help),
                _ => metrics::describe_gauge!(*name, *help),
            }
        }
        metrics::gauge!("sched_relay_build_info", "version" => env!("CARGO_PKG_VERSION")).set(1.0);
        handle
    })
}

/// Whether the metadata service answers, as the poller last found: `/readyz` turns 503 once
/// it has failed for longer than `imds.unready_after`, since no event can be seen meanwhile.
#[derive(Debug, Default)]
pub struct ImdsHealth {
    unready_after: std::time::Duration,
    /// Since when the service fails, and the last error; `None` while it answers.
    failing: std::sync::Mutex<Option<(std::time::Instant, String)>>,
}

impl ImdsHealth {
    /// The service answered: the failure window ends.
    pub fn answered(&self) {
        *self.lock() = None;
    }

    /// A request failed; the service has been failing since `since`.
    pub fn failed(&self, since: std::time::Instant, error: &crate::imds::ImdsError) {
        let what = match error {
            crate::imds::ImdsError::Malformed { .. } => "its documents are refused",
            _ => "it fails",
        };
        let error = sched_relay_transport::redact::text(&error.to_string()).into_owned();
        *self.lock() = Some((since, format!("{what}: {error}")));
    }

    /// Why the agent is not ready because of the service, if it is not.
    fn unready_reason(&self) -> Option<String> {
        let (since, error) = self.lock().clone()?;
        let failing_for = since.elapsed();
        (failing_for >= self.unready_after).then(|| {
            format!(
                "the metadata service has failed for {} s (imds.unready_after = {}); no events can be seen, {error}",
                failing_for.as_secs(),
                humantime::format_duration(self.unready_after)
            )
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<(std::time::Instant, String)>> {
        self.failing.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The agent's state, as the listener sees it.
pub struct Telemetry {
    /// Set once the first document was fetched and processed.
    pub first_poll_done: AtomicBool,
    /// Set while the VM's identity is unknown (events wait for it).
    pub identity_pending: AtomicBool,
    pub sinks: Vec<(String, Arc<SinkHealth>)>,
    pub outbox: Arc<Outbox>,
    pub latest: watch::Receiver<Option<Snapshot>>,
    /// The poller's view of the metadata service.
    pub imds: ImdsHealth,
    /// Sinks found at start with events stored but no longer configured, with their depth.
    pub orphaned: Vec<(String, usize)>,
}

impl Telemetry {
    /// Readiness and views over the sinks' health, the outbox and the latest document;
    /// not ready until the poller reports the first document processed.
    pub fn new(
        sinks: Vec<(String, Arc<SinkHealth>)>,
        outbox: Arc<Outbox>,
        latest: watch::Receiver<Option<Snapshot>>,
    ) -> Telemetry {
        Telemetry {
            first_poll_done: false.into(),
            identity_pending: false.into(),
            sinks,
            outbox,
            latest,
            imds: ImdsHealth::default(),
            orphaned: Vec::new(),
        }
    }

    /// `/readyz` fails once the metadata service has failed for `window`.
    pub fn with_imds_unready_after(mut self, window: std::time::Duration) -> Telemetry {
        self.imds.unready_after = window;
        self
    }

    /// Refreshes the gauges read from the store (outbox depth and oldest age per sink), then
    /// renders every metric in the Prometheus text format.
    pub fn render_metrics(&self) -> String {
        for (sink, _) in &self.sinks {
            let depth = self.outbox.depth(sink).unwrap_or_default();
            metrics::gauge!("sched_relay_outbox_depth", "sink" => sink.clone()).set(depth as f64);
            metrics::gauge!("sched_relay_outbox_oldest_age_seconds", "sink" => sink.clone())
                .set(self.oldest_age(sink).unwrap_or_default());
        }
        metrics::counter!("sched_relay_log_lines_dropped_total")
            .absolute(crate::logging::dropped_lines() as u64);
        prometheus().render()
    }

    fn oldest_age(&self, sink: &str) -> Option<f64> {
        let (_, time) = self.outbox.pending_ids(sink, 1).ok()?.into_iter().next()?;
        let age = Utc::now().signed_duration_since(time?);
        Some(age.num_milliseconds().max(0) as f64 / 1000.0)
    }

    /// Ready: the first poll is done, every sink's last check or delivery succeeded, and no
    /// sink's outbox is full. Otherwise the reasons.
    pub fn readiness(&self) -> Result<Value, Value> {
        let mut reasons = Vec::new();
        if !self.first_poll_done.load(Ordering::Relaxed) {
            reasons.push("no document processed yet (the first call to the metadata service can take minutes)".to_owned());
        }
        reasons.extend(self.imds.unready_reason());
        if self.identity_pending.load(Ordering::Relaxed) {
            reasons.push("VM identity not resolved yet: /metadata/instance/compute has not answered, so events wait (set identity.vm_name to start without it)".to_owned());
        }
        if let Some(why) = self.outbox.unwritable() {
            reasons.push(format!(
                "state store cannot be written: {why}; new transitions are kept in memory until it can"
            ));
        }
        for (sink, health) in &self.sinks {
            if !health.healthy() {
                let error = health
                    .last_error()
                    .unwrap_or_else(|| "not checked yet".into());
                reasons.push(format!("sink {sink} is failing: {error}"));
            }
            let depth = self.outbox.depth(sink).unwrap_or_default();
            if depth >= self.outbox.capacity() {
                reasons.push(format!(
                    "sink {sink}: outbox full ({depth} events); new events go to its dead-letter file"
                ));
            }
        }
        if reasons.is_empty() {
            Ok(json!({"ready": true}))
        } else {
            Err(json!({"ready": false, "reasons": reasons}))
        }
    }

    /// The current document, and for each of its events the transitions each sink has not
    /// confirmed yet.
    pub fn events_view(&self) -> Value {
        let snapshot = self.latest.borrow().clone();
        let mut pending: Vec<(String, Vec<String>)> = Vec::new();
        let mut sinks = serde_json::Map::new();
        for (sink, health) in &self.sinks {
            let ids: Vec<String> = self
                .outbox
                .pending_ids(sink, self.outbox.capacity())
                .unwrap_or_default()
                .into_iter()
                .map(|(id, _)| id)
                .collect();
            sinks.insert(
                sink.clone(),
                json!({
                    "healthy": health.healthy(),
                    "lastError": health.last_error(),
                    "undelivered": ids.len(),
                    "oldestAgeSeconds": self.oldest_age(sink),
                }),
            );
            pending.push((sink.clone(), ids));
        }
        // Backlogs of sinks no longer configured, found at start: nothing delivers them.
        let orphaned: Vec<Value> = self
            .orphaned
            .iter()
            .map(|(sink, depth)| json!({"sink": sink, "undelivered": depth}))
            .collect();
        let Some(snapshot) = snapshot else {
            return json!({"document": null, "events": [], "sinks": sinks, "orphanedSinks": orphaned});
        };
        let document = &snapshot.document;
        let events: Vec<Value> = document
            .events
            .iter()
            .map(|event| {
                let prefix = format!("{}:", event.id);
                let delivery: serde_json::Map<String, Value> = pending
                    .iter()
                    .map(|(sink, ids)| {
                        let waiting: Vec<&String> =
                            ids.iter().filter(|id| id.starts_with(&prefix)).collect();
                        let state = if waiting.is_empty() {
                            "delivered"
                        } else {
                            "pending"
                        };
                        (
                            sink.clone(),
                            json!({"state": state, "undelivered": waiting}),
                        )
                    })
                    .collect();
                json!({
                    "EventId": event.id,
                    "EventType": event.raw.get("EventType"),
                    "EventStatus": event.status.as_str(),
                    "NotBefore": event.raw.get("NotBefore"),
                    "Resources": event.raw.get("Resources"),
                    "delivery": delivery,
                })
            })
            .collect();
        json!({
            "incarnation": document.incarnation,
            "fetchedSecondsAgo": snapshot.fetched.elapsed().as_secs_f64(),
            "document": document.raw,
            "events": events,
            "sinks": sinks,
            "orphanedSinks": orphaned,
        })
    }
}
