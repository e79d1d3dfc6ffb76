//! The one retry policy of the agent: exponential backoff from an initial wait, doubling per
//! attempt up to a ceiling. Used by the fan-out (sink deliveries), the poller (IMDS errors),
//! local policy (failed approval POSTs) and remote approvals (StartRequests POSTs), each with
//! its own initial wait and ceiling.

use std::time::Duration;

/// Waits that double per attempt, from `initial` up to `max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    pub initial: Duration,
    pub max: Duration,
}

impl Backoff {
    pub const fn new(initial: Duration, max: Duration) -> Backoff {
        Backoff { initial, max }
    }

    /// The wait before retry number `attempt` (0 for the first retry): `initial * 2^attempt`,
    /// at most `max`.
    pub fn ceiling(&self, attempt: u32) -> Duration {
        let exponential = self
            .initial
            .saturating_mul(2u32.saturating_pow(attempt.min(20)));
        exponential.min(self.max)
    }

    /// [`Backoff::ceiling`] with full jitter: a random wait in `[ceiling/2, ceiling]`, so that a
    /// fleet of agents does not retry in lock-step.
    pub fn jittered(&self, attempt: u32) -> Duration {
        self.ceiling(attempt).mul_f64(0.5 + fastrand::f64() * 0.5)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_the_ceiling_with_jitter() {
        let initial = Duration::from_millis(100);
        let max = Duration::from_secs(1);
        let backoff = Backoff::new(initial, max);
        for attempt in 0..30 {
            let wait = backoff.jittered(attempt);
            let ceiling = (initial * 2u32.pow(attempt.min(10))).min(max);
            assert_eq!(backoff.ceiling(attempt), ceiling);
            assert!(
                wait >= ceiling / 2 && wait <= ceiling,
                "{attempt}: {wait:?}"
            );
        }
    }
}
