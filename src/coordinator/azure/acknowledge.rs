//! Acknowledging a scheduled event through Azure Resource Manager
//! (`POST {scope}/providers/Microsoft.Maintenance/scheduledevents/{id}/acknowledge`): each
//! answer judged once, never tried again here (the engine does, on its tick). What ARM
//! answers moves its subscription's [`Hold`]: after a 429, or after failures every event
//! would share, the subscription's acknowledgements are held back (`Acked::Held`, nothing
//! sent), so that an outage of ARM or of the identity endpoint does not spend its write
//! limit.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use super::AzureConfig;
use super::client::{Answer, Arm, arm_error, throttle_wait};
use super::hold::{Hold, Judged};
use super::{Acked, Acknowledge};

pub struct Acknowledger {
    arm: Arm,
    api_version: String,
    /// How long a probe may take before another goes: longer than a call can (its
    /// timeout, and a token's fetch with azure_core's retries).
    patience: Duration,
    /// Per subscription (lower case), what holds its acknowledgements back.
    holds: Mutex<HashMap<String, Hold>>,
}

impl Acknowledger {
    pub fn new(config: &AzureConfig) -> Result<Acknowledger, String> {
        Ok(Acknowledger {
            arm: Arm::new(config)?,
            api_version: config.maintenance_api_version.clone(),
            patience: config.timeout * 2 + Duration::from_secs(60),
            holds: Mutex::new(HashMap::new()),
        })
    }

    /// The hold of `subscription`, locked.
    fn hold<T>(&self, subscription: &str, with: impl FnOnce(&mut Hold) -> T) -> T {
        let mut holds = self.holds.lock().unwrap_or_else(|e| e.into_inner());
        with(holds.entry(subscription.to_owned()).or_default())
    }

    /// The answer to the request of `ticket`, the subscription's hold moved by it.
    fn judged(&self, subscription: &str, ticket: u64, acked: Acked, judged: Judged) -> Acked {
        let wait = self.hold(subscription, |hold| {
            hold.judged(ticket, judged, Instant::now())
                .map(|wait| (wait, hold.failures()))
        });
        if let (Some((wait, failures)), Acked::Failed(why)) = (wait, &acked) {
            tracing::warn!(
                subscription,
                failures,
                wait_s = wait.as_secs(),
                error = %why,
                "Acknowledgements through Azure Resource Manager fail; the subscription's are held back, then one goes first"
            );
        }
        acked
    }
}

/// The subscription of an ARM resource id (`/subscriptions/{id}/...`), lower case.
fn subscription_of(scope: &str) -> String {
    scope
        .split('/')
        .filter(|segment| !segment.is_empty())
        .nth(1)
        .unwrap_or_default()
        .to_ascii_lowercase()
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
        if !plain_event_id(event_id) {
            return Acked::Refused {
                reason: "not_an_event_id".into(),
                message: format!("{event_id:?} is not an Azure EventId (a GUID)"),
            };
        }
        let subscription = subscription_of(scope);
        let ticket = match self.hold(&subscription, |hold| {
            hold.admit(Instant::now(), self.patience)
        }) {
            Ok(ticket) => ticket,
            Err(why) => return Acked::Held(why),
        };
        let path = format!(
            "{scope}/providers/Microsoft.Maintenance/scheduledevents/{event_id}/acknowledge"
        );
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
            Err(why) => {
                return self.judged(
                    &subscription,
                    ticket,
                    Acked::Failed(why),
                    Judged::SharedFailure,
                );
            }
        };
        let said = || format!("POST {path}: {status} {}", arm_error(&body));
        let (acked, judged) = match status.as_u16() {
            200..=299 => (Acked::Approved, Judged::Answered),
            429 => {
                let wait = throttle_wait(retry_after);
                self.hold(&subscription, |hold| hold.throttled(wait, Instant::now()));
                tracing::warn!(
                    subscription,
                    wait_s = wait.as_secs(),
                    "Azure Resource Manager throttles the coordinator's acknowledgements (429); waiting as it asks"
                );
                // Throttled is an answer too: it ends a probe, and the wait is ARM's own.
                (Acked::Failed(said()), Judged::OwnFailure)
            }
            // The token may have expired between its fetch and its use (the next attempt
            // gets another), or be refused a while; a timeout may pass: shared.
            401 | 408 => (Acked::Failed(said()), Judged::SharedFailure),
            // A conflict is this event's own (another operation on it): tried again on
            // the engine's tick, the others not held back.
            409 => (Acked::Failed(said()), Judged::OwnFailure),
            403 => (
                Acked::Refused {
                    reason: "forbidden".into(),
                    message: said(),
                },
                Judged::Answered,
            ),
            404 => (
                Acked::Refused {
                    reason: "unknown_event".into(),
                    message: said(),
                },
                Judged::Answered,
            ),
            code @ 400..=499 => (
                Acked::Refused {
                    reason: format!("arm_{code}"),
                    message: said(),
                },
                Judged::Answered,
            ),
            // A server error: ARM's, or its gateway's. A redirect (never followed) comes
            // from what stands before ARM (a proxy, a wrong `resource_manager`), and
            // answers every call the same.
            300..=399 | 500..=599 => (Acked::Failed(said()), Judged::SharedFailure),
            // Anything else (a 1xx) is this call's own.
            _ => (Acked::Failed(said()), Judged::OwnFailure),
        };
        self.judged(&subscription, ticket, acked, judged)
    }
}

#[cfg(test)]
mod tests {
    use super::subscription_of;

    #[test]
    fn a_scopes_subscription_is_its_second_segment_in_lower_case() {
        assert_eq!(
            subscription_of("/subscriptions/0B1F6471-1BF0/resourceGroups/rg/providers/x"),
            "0b1f6471-1bf0"
        );
        assert_eq!(subscription_of("nonsense"), "");
    }
}
