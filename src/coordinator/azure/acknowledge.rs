//! Acknowledging a scheduled event through Azure Resource Manager
//! (`POST {scope}/providers/Microsoft.Maintenance/scheduledevents/{id}/acknowledge`): each
//! answer judged once, never tried again here (the engine does, on its tick). ARM's write
//! limit is per subscription: after a 429 no acknowledgement is sent until its
//! `Retry-After` has passed. A failure every event would share (a server error, a timeout,
//! no token, no connection) holds every acknowledgement back too, for a wait that doubles
//! with each failure in a row (2 s to 64 s), so an outage of ARM or of the identity
//! endpoint is not met by one write every 2 s per event, which would spend the
//! subscription's write limit (1,200 an hour, shared with everything else that writes
//! there) as soon as it ends.

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use super::AzureConfig;
use super::client::{Answer, Arm, arm_error, throttle_wait};
use super::{Acked, Acknowledge};

/// The wait after a first shared failure; it doubles with each one in a row, up to
/// [`FAILED_WAIT_MAX`].
pub const FAILED_WAIT_FIRST: Duration = Duration::from_secs(2);
/// The longest wait after failures in a row: an outage's end is noticed within it.
pub const FAILED_WAIT_MAX: Duration = Duration::from_secs(64);

pub struct Acknowledger {
    arm: Arm,
    api_version: String,
    hold: Mutex<Hold>,
}

/// What holds every acknowledgement back.
#[derive(Default)]
struct Hold {
    /// Nothing is sent before this, and why.
    until: Option<(Instant, HeldBy)>,
    /// Shared failures in a row; an answer from ARM (accepted or refused) ends the row.
    failures: u32,
    /// When the last failure counted was sent: one sent before it failed in the same
    /// outage (several events are acknowledged at once) and is not counted again.
    counted_sent_at: Option<Instant>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HeldBy {
    /// A 429's `Retry-After`.
    Throttled,
    /// The wait after shared failures in a row.
    Failing,
}

impl Hold {
    /// How long the next acknowledgement waits after `failures` in a row.
    fn wait(failures: u32) -> Duration {
        FAILED_WAIT_FIRST
            .saturating_mul(1 << failures.saturating_sub(1).min(16))
            .min(FAILED_WAIT_MAX)
    }

    /// A shared failure of a request sent at `sent_at`, seen at `now`.
    fn failed(&mut self, sent_at: Instant, now: Instant) -> Option<Duration> {
        if self
            .counted_sent_at
            .is_some_and(|counted| sent_at < counted)
        {
            return None;
        }
        self.failures += 1;
        self.counted_sent_at = Some(now);
        let wait = Hold::wait(self.failures);
        let until = now + wait;
        // A 429's longer wait stands.
        if self.until.is_none_or(|(held, _)| held < until) {
            self.until = Some((until, HeldBy::Failing));
        }
        Some(wait)
    }
}

impl Acknowledger {
    pub fn new(config: &AzureConfig) -> Result<Acknowledger, String> {
        Ok(Acknowledger {
            arm: Arm::new(config)?,
            api_version: config.maintenance_api_version.clone(),
            hold: Mutex::new(Hold::default()),
        })
    }

    fn hold(&self) -> std::sync::MutexGuard<'_, Hold> {
        self.hold.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The answer judged, the hold moved by it: a shared failure lengthens it, an answer
    /// from ARM ends the row of failures.
    fn judged(&self, acked: Acked, shared_failure: bool, sent_at: Instant) -> Acked {
        let mut hold = self.hold();
        match &acked {
            Acked::Failed(why) if shared_failure => {
                if let Some(wait) = hold.failed(sent_at, Instant::now()) {
                    tracing::warn!(
                        failures = hold.failures,
                        wait_s = wait.as_secs(),
                        error = %why,
                        "Acknowledgements through Azure Resource Manager fail; none is sent for a while"
                    );
                }
            }
            Acked::Failed(_) => {}
            Acked::Approved | Acked::Refused { .. } => {
                hold.failures = 0;
                hold.counted_sent_at = None;
            }
        }
        acked
    }
}

/// An EventId is a GUID: anything else is not put into a URL path.
fn plain_event_id(event_id: &str) -> bool {
    !event_id.is_empty()
        && event_id.len() <= 64
        && event_id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-')
}

#[async_trait::async_trait]
impl Acknowledge for Acknowledger {
    async fn acknowledge(&self, scope: &str, event_id: &str, request_id: &str) -> Acked {
        let (until, failures) = {
            let hold = self.hold();
            (hold.until, hold.failures)
        };
        if let Some((until, why)) = until.filter(|(until, _)| *until > Instant::now()) {
            let left = (until - Instant::now()).as_secs() + 1;
            return Acked::Failed(match why {
                HeldBy::Throttled => format!(
                    "Azure Resource Manager throttles this subscription's writes (429) for {left} s more"
                ),
                HeldBy::Failing => format!(
                    "not sent: acknowledgements through Azure Resource Manager failed {failures} times in a row, none is sent for {left} s more"
                ),
            });
        }
        if !plain_event_id(event_id) {
            return Acked::Refused {
                reason: "not_an_event_id".into(),
                message: format!("{event_id:?} is not an Azure EventId (a GUID)"),
            };
        }
        let path = format!(
            "{scope}/providers/Microsoft.Maintenance/scheduledevents/{event_id}/acknowledge"
        );
        let sent_at = Instant::now();
        let answer = self
            .arm
            .post(&path, &[("api-version", &self.api_version)], request_id)
            .await;
        let Answer {
            status,
            retry_after,
            body,
        } = match answer {
            Ok(answer) => answer,
            // No token, no connection, no answer in time: every event's would fail alike.
            Err(why) => return self.judged(Acked::Failed(why), true, sent_at),
        };
        let said = || format!("POST {path}: {status} {}", arm_error(&body));
        let (acked, shared) = match status.as_u16() {
            200..=299 => (Acked::Approved, false),
            429 => {
                let wait = throttle_wait(retry_after);
                let until = Instant::now() + wait;
                let mut hold = self.hold();
                if hold.until.is_none_or(|(held, _)| held < until) {
                    hold.until = Some((until, HeldBy::Throttled));
                }
                drop(hold);
                tracing::warn!(
                    wait_s = wait.as_secs(),
                    "Azure Resource Manager throttles the coordinator's acknowledgements (429); waiting as it asks"
                );
                return Acked::Failed(said());
            }
            // The token may have expired between its fetch and its use (the next attempt
            // gets another), or be refused a while; a timeout may pass: shared.
            401 | 408 => (Acked::Failed(said()), true),
            // A conflict is this event's own (another operation on it): tried again on
            // the engine's tick, the others not held back.
            409 => (Acked::Failed(said()), false),
            403 => (
                Acked::Refused {
                    reason: "forbidden".into(),
                    message: said(),
                },
                false,
            ),
            404 => (
                Acked::Refused {
                    reason: "unknown_event".into(),
                    message: said(),
                },
                false,
            ),
            code @ 400..=499 => (
                Acked::Refused {
                    reason: format!("arm_{code}"),
                    message: said(),
                },
                false,
            ),
            // A server error: ARM's, or its gateway's.
            _ => (Acked::Failed(said()), true),
        };
        self.judged(acked, shared, sent_at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wait_after_failures_in_a_row_doubles_up_to_its_ceiling() {
        let waits: Vec<u64> = (1..=8).map(|n| Hold::wait(n).as_secs()).collect();
        assert_eq!(waits, [2, 4, 8, 16, 32, 64, 64, 64]);
        assert_eq!(Hold::wait(u32::MAX), FAILED_WAIT_MAX);
    }

    #[test]
    fn acknowledgements_failing_together_count_as_one_failure() {
        let mut hold = Hold::default();
        let t0 = Instant::now();
        // Three events sent at once in an outage: one failure, a 2 s wait.
        let at = t0 + Duration::from_millis(100);
        assert_eq!(hold.failed(t0, at), Some(FAILED_WAIT_FIRST));
        assert_eq!(hold.failed(t0, at + Duration::from_millis(1)), None);
        assert_eq!(hold.failed(t0, at + Duration::from_millis(2)), None);
        assert_eq!(hold.failures, 1);
        // The next one, sent after that wait, fails: the wait doubles.
        let again = at + FAILED_WAIT_FIRST;
        assert_eq!(hold.failed(again, again), Some(FAILED_WAIT_FIRST * 2));
        assert_eq!(
            hold.until,
            Some((again + FAILED_WAIT_FIRST * 2, HeldBy::Failing))
        );
    }

    #[test]
    fn a_throttles_longer_wait_stands_after_a_failure() {
        let t0 = Instant::now();
        let retry_after = t0 + Duration::from_secs(300);
        let mut hold = Hold {
            until: Some((retry_after, HeldBy::Throttled)),
            ..Hold::default()
        };
        hold.failed(t0, t0);
        assert_eq!(hold.until, Some((retry_after, HeldBy::Throttled)));
    }
}
