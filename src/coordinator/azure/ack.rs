//! What acknowledges a scheduled event through Azure Resource Manager, as the engine sees
//! it (the `azure` feature's client, [`super::acknowledge`], implements it).

/// What ARM answered an acknowledgement.
#[derive(Debug, Clone, PartialEq)]
pub enum Acked {
    /// 200: Azure approved the event.
    Approved,
    /// Refused for good (a 4xx other than 429): `reason` is a short label (`unknown_event`
    /// for a 404, which a new attempt may mend), `message` ARM's own words.
    Refused { reason: String, message: String },
    /// Not answered, throttled (429) or a server error: tried again.
    Failed(String),
    /// Not sent: the subscription's acknowledgements are held back (after a 429, or
    /// failures in a row): tried again, and no failure of its own.
    Held(String),
}

/// Acknowledges scheduled events through ARM (the `azure` feature's client; a test's
/// stand-in).
#[async_trait::async_trait]
pub trait Acknowledge: Send + Sync {
    /// Acknowledges `event_id` at `scope` (an ARM resource id), the call carrying
    /// `request_id` as its client request id.
    async fn acknowledge(&self, scope: &str, event_id: &str, request_id: &str) -> Acked;
}
