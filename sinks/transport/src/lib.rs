//! What every sched-relay connection shares, both ways. Outbound: the [`Sink`] trait, the
//! [`SinkError`] that tells the fan-out whether retrying can help, the [`DeliveryError`] that
//! says how far a batch got (so one refused event costs only itself), and a [`RecordingSink`]
//! that tests use to see exactly what reached a sink. Inbound ([`inbound`]): how approval
//! sources hand messages to the agent and learn when to acknowledge them. And [`secret`]:
//! credentials in configurations, never printed, with [`redact`], the one helper that masks
//! credentials in URLs wherever a text leaves the agent.
//!
//! Retry policy lives in one place (the agent's fan-out), so a sink never retries on its own:
//! it reports each failure once, classified, and the fan-out decides.

pub mod files;
pub mod inbound;
pub mod redact;
pub mod secret;
pub mod testing;
pub mod tls;

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use cloudevents::AttributesReader;
/// The protocol bindings are pure and live in the core; sinks reach them from here.
pub use sched_relay_core::binding;
/// A relayed CloudEvent with its typed kind.
pub use sched_relay_core::{Event, EventKind};

/// A destination for CloudEvents. One task of the fan-out owns each sink and calls it with
/// batches in order; a sink never sees two batches at once.
#[async_trait]
pub trait Sink: Send + Sync {
    /// Delivers a batch, in order. `Ok` means every event of the batch is confirmed by the
    /// destination (written and fsync'd, acknowledged by the broker, answered 2xx). An error
    /// says how far the delivery got ([`DeliveryError`]), so that one event the destination
    /// refuses costs only that event, never the events around it.
    async fn deliver(&self, batch: &[Event]) -> Result<(), DeliveryError>;

    /// Checks, once at start-up and on demand, that the destination can be reached and used.
    async fn health_check(&self) -> Result<(), SinkError> {
        Ok(())
    }
}

/// Why a delivery failed, and whether trying the same batch again can succeed.
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    /// The destination is down, slow or overloaded; the same batch may succeed later.
    #[error("{0} (will retry)")]
    Retriable(String),
    /// As `Retriable`, and the destination said when to come back (HTTP `Retry-After`).
    #[error("{message} (will retry in {after:?}, as asked)")]
    RetryAfter {
        message: String,
        after: std::time::Duration,
    },
    /// The destination refused our credentials or permissions, or TLS failed between us (a
    /// server certificate the sink does not trust, a client certificate the server refused).
    /// Retried (loudly: an ERROR log and `sched_relay_sink_authentication_failed_total`),
    /// because credentials are rotated, permissions granted and certificates renewed on the
    /// destination's side without touching the agent: that must not dead-letter every event
    /// meanwhile.
    #[error("{0} (will retry: credentials, permissions and certificates can change on the server)")]
    Authentication(String),
    /// The destination refused the batch for a reason retrying cannot change (bad
    /// configuration, message rejected); the batch goes to the dead-letter file.
    #[error("{0} (not retriable)")]
    Permanent(String),
}

/// How far a failed delivery got: the first `confirmed` events of the batch are confirmed by
/// the destination; `error` is why the rest is not. With `names_event`, the error belongs to
/// the event right after the confirmed prefix (`batch[confirmed]`) and says nothing about the
/// events after it; without, the destination refused the rest as a whole and cannot tell which
/// event it objected to (one HTTP request for a batch), so the fan-out retries it event by
/// event before it dead-letters anything.
#[derive(Debug, thiserror::Error)]
#[error("{error}")]
pub struct DeliveryError {
    pub confirmed: usize,
    pub names_event: bool,
    #[source]
    pub error: SinkError,
}

impl DeliveryError {
    /// The event `batch[confirmed]` failed; every event before it is confirmed.
    pub fn at(confirmed: usize, error: SinkError) -> DeliveryError {
        DeliveryError {
            confirmed,
            names_event: true,
            error,
        }
    }

    /// Whether retrying the unconfirmed rest can help.
    pub fn is_retriable(&self) -> bool {
        self.error.is_retriable()
    }

    /// How long the destination asked us to wait, if it said.
    pub fn retry_after(&self) -> Option<std::time::Duration> {
        self.error.retry_after()
    }
}

impl From<SinkError> for DeliveryError {
    /// A failure of the batch as a whole: nothing confirmed, no event named.
    fn from(error: SinkError) -> DeliveryError {
        DeliveryError {
            confirmed: 0,
            names_event: false,
            error,
        }
    }
}

impl From<binding::EncodeError> for DeliveryError {
    fn from(error: binding::EncodeError) -> DeliveryError {
        SinkError::from(error).into()
    }
}

/// An error with every cause behind it, `outer: inner: root`: clients such as reqwest put the
/// useful part (a refused connection, a TLS failure) in the causes, not in the top message.
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text = format!("{text}: {cause}");
        source = cause.source();
    }
    text
}

/// An HTTP `Retry-After` value, as seconds (`120`) or as an HTTP date: what a webhook or the
/// metadata service asks a client to wait.
pub fn parse_retry_after(value: &str) -> Option<std::time::Duration> {
    if let Ok(seconds) = value.trim().parse::<u64>() {
        return Some(std::time::Duration::from_secs(seconds));
    }
    let date = chrono::DateTime::parse_from_rfc2822(value.trim()).ok()?;
    let wait = date.with_timezone(&chrono::Utc) - chrono::Utc::now();
    Some(wait.to_std().unwrap_or_default())
}

impl From<binding::EncodeError> for SinkError {
    /// An event that cannot be encoded never will be.
    fn from(error: binding::EncodeError) -> SinkError {
        SinkError::Permanent(error.0)
    }
}

impl SinkError {
    /// Whether retrying the same batch can help.
    pub fn is_retriable(&self) -> bool {
        matches!(
            self,
            SinkError::Retriable(_) | SinkError::RetryAfter { .. } | SinkError::Authentication(_)
        )
    }

    /// Whether the destination refused our credentials or permissions.
    pub fn is_authentication(&self) -> bool {
        matches!(self, SinkError::Authentication(_))
    }

    /// How long the destination asked us to wait before the next try, if it said.
    pub fn retry_after(&self) -> Option<std::time::Duration> {
        match self {
            SinkError::RetryAfter { after, .. } => Some(*after),
            _ => None,
        }
    }

    /// Classifies a local I/O error (writing a file, starting a command): always retriable.
    /// None of them is about the event: a full disk, a file system remounted read-only, a file
    /// logrotate recreated with another owner, a script being replaced (`ETXTBSY`) or missing
    /// during a deploy, a fork refused under memory pressure are the destination's state, and
    /// dead-lettering every event while it lasts would empty the outbox into the dead-letter
    /// file. The events wait in the outbox (retried with backoff, logged, and shown by
    /// `/readyz` and the outbox metrics) until the destination is fixed.
    pub fn from_io(context: &str, error: &std::io::Error) -> SinkError {
        SinkError::Retriable(format!("{context}: {error}"))
    }
}

/// A sink that keeps every delivered event in memory, for tests. Failures can be scripted
/// to exercise the fan-out's retry and dead-letter paths without a real broker.
#[derive(Clone, Default)]
pub struct RecordingSink {
    inner: Arc<Mutex<Recording>>,
}

#[derive(Default)]
struct Recording {
    delivered: Vec<Event>,
    attempts: usize,
    scripted_failures: std::collections::VecDeque<SinkError>,
    refused: Option<Refusal>,
}

/// Events a [`RecordingSink`] refuses for good, as a destination refuses a poison event.
type Refusal = Box<dyn Fn(&Event) -> bool + Send>;

impl RecordingSink {
    pub fn new() -> Self {
        Self::default()
    }

    /// The next deliveries fail with these errors, one per attempt, before succeeding again.
    pub fn fail_next(&self, errors: impl IntoIterator<Item = SinkError>) {
        self.lock().scripted_failures.extend(errors);
    }

    /// From now on, every event that `refuse` picks is refused permanently (and named), like
    /// a webhook answering 400 to one kind of event; the events before it in its batch are
    /// delivered.
    pub fn refuse(&self, refuse: impl Fn(&Event) -> bool + Send + 'static) {
        self.lock().refused = Some(Box::new(refuse));
    }

    /// Every event delivered so far, in delivery order.
    pub fn delivered(&self) -> Vec<Event> {
        self.lock().delivered.clone()
    }

    /// How many times `deliver` was called, failed attempts included.
    pub fn attempts(&self) -> usize {
        self.lock().attempts
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Recording> {
        // A panic in a test thread must not hide what was recorded before it.
        self.inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

#[async_trait]
impl Sink for RecordingSink {
    async fn deliver(&self, batch: &[Event]) -> Result<(), DeliveryError> {
        let mut recording = self.lock();
        recording.attempts += 1;
        if let Some(error) = recording.scripted_failures.pop_front() {
            return Err(error.into());
        }
        for (index, event) in batch.iter().enumerate() {
            if recording
                .refused
                .as_ref()
                .is_some_and(|refuse| refuse(event))
            {
                let refused = format!("{} refused", event.id());
                return Err(DeliveryError::at(index, SinkError::Permanent(refused)));
            }
            recording.delivered.push(event.clone());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_io_errors_hold_events_whatever_their_kind() {
        use std::io::ErrorKind::*;
        for kind in [
            StorageFull,
            PermissionDenied,
            ReadOnlyFilesystem,
            NotFound,
            ExecutableFileBusy,
            OutOfMemory,
        ] {
            let error = std::io::Error::from(kind);
            assert!(
                SinkError::from_io("open", &error).is_retriable(),
                "{kind:?}"
            );
        }
    }

    #[tokio::test]
    async fn recording_sink_fails_as_scripted_then_records() {
        let sink = RecordingSink::new();
        sink.fail_next([SinkError::Retriable("down".into())]);
        let event = Event::default();
        assert!(sink.deliver(std::slice::from_ref(&event)).await.is_err());
        assert!(sink.delivered().is_empty());
        sink.deliver(std::slice::from_ref(&event)).await.unwrap();
        assert_eq!(sink.delivered().len(), 1);
        assert_eq!(sink.attempts(), 2);
    }

    #[test]
    fn retry_after_reads_seconds_and_http_dates() {
        assert_eq!(
            parse_retry_after("120"),
            Some(std::time::Duration::from_secs(120))
        );
        let soon = (chrono::Utc::now() + chrono::Duration::seconds(60)).to_rfc2822();
        let wait = parse_retry_after(&soon).unwrap();
        assert!(
            wait <= std::time::Duration::from_secs(60)
                && wait >= std::time::Duration::from_secs(55),
            "{wait:?}"
        );
        assert_eq!(parse_retry_after("soon"), None);
    }
}
