//! Acknowledging a scheduled event through Azure Resource Manager
//! (`POST {scope}/providers/Microsoft.Maintenance/scheduledevents/{id}/acknowledge`): each
//! answer judged once, never tried again here (the engine does, on its tick). ARM's write
//! limit is per subscription: after a 429 no acknowledgement is sent until its
//! `Retry-After` has passed.

use std::sync::Mutex;

use tokio::time::Instant;

use super::AzureConfig;
use super::client::{Answer, Arm, arm_error, throttle_wait};
use super::{Acked, Acknowledge};

pub struct Acknowledger {
    arm: Arm,
    api_version: String,
    /// After a 429: nothing is sent before this.
    throttled_until: Mutex<Option<Instant>>,
}

impl Acknowledger {
    pub fn new(config: &AzureConfig) -> Result<Acknowledger, String> {
        Ok(Acknowledger {
            arm: Arm::new(config)?,
            api_version: config.maintenance_api_version.clone(),
            throttled_until: Mutex::new(None),
        })
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
        let until = *self
            .throttled_until
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(until) = until.filter(|until| *until > Instant::now()) {
            return Acked::Failed(format!(
                "Azure Resource Manager throttles this subscription's writes (429) for {} s more",
                (until - Instant::now()).as_secs() + 1
            ));
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
            Err(why) => return Acked::Failed(why),
        };
        let said = || format!("POST {path}: {status} {}", arm_error(&body));
        match status.as_u16() {
            200..=299 => Acked::Approved,
            429 => {
                let wait = throttle_wait(retry_after);
                *self
                    .throttled_until
                    .lock()
                    .unwrap_or_else(|e| e.into_inner()) = Some(Instant::now() + wait);
                tracing::warn!(
                    wait_s = wait.as_secs(),
                    "Azure Resource Manager throttles the coordinator's acknowledgements (429); waiting as it asks"
                );
                Acked::Failed(said())
            }
            // The token may have expired between its fetch and its use (the next attempt
            // gets another); a timeout or a conflict may pass.
            401 | 408 | 409 => Acked::Failed(said()),
            403 => Acked::Refused {
                reason: "forbidden".into(),
                message: said(),
            },
            404 => Acked::Refused {
                reason: "unknown_event".into(),
                message: said(),
            },
            code @ 400..=499 => Acked::Refused {
                reason: format!("arm_{code}"),
                message: said(),
            },
            _ => Acked::Failed(said()),
        }
    }
}
