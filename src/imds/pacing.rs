//! How often the agent may ask the metadata service, and how long it waits after an error.
//!
//! Two promises meet here. The service allows about 5 requests per second per VM, so every
//! request of this process (polls, StartRequests POSTs, identity) goes through one [`Pacer`]
//! that keeps them [`MIN_REQUEST_SPACING`] apart. And a Spot VM gets 30 s of notice, so an
//! outage must never be followed by a long wait: whatever the number of errors, the poller
//! retries at most [`MAX_ERROR_BACKOFF`] apart (a new event is seen within the poll interval +
//! 5 s of recovery). Only a throttled service (429) is given longer, as long as it asks with
//! `Retry-After` (up to [`MAX_THROTTLED_WAIT`]). A 410 is retried on the normal schedule; Azure
//! documents it as passing within 70 s, so only after [`GONE_GRACE`] is it an operator's
//! problem. Proved by `tests/imds_outages.rs` on the shipped defaults.

use std::time::Duration;

use tokio::time::Instant;

use super::ImdsError;
use crate::retry::Backoff;

/// The least time between two requests of this process to the metadata service: a little over
/// 200 ms, so that no second holds more than 5 even with the endpoints of a window counted.
pub const MIN_REQUEST_SPACING: Duration = Duration::from_millis(210);
/// The longest wait between two polls while the service fails (the `imds.max_backoff` bound).
pub const MAX_ERROR_BACKOFF: Duration = Duration::from_secs(5);
/// The longest wait a throttled service (429) can impose, however long its `Retry-After`:
/// a Preempt's whole notice is 30 s.
pub const MAX_THROTTLED_WAIT: Duration = Duration::from_secs(30);
/// The ceiling of the backoff for a 429 without `Retry-After`.
pub const THROTTLED_BACKOFF: Duration = Duration::from_secs(10);
/// How long a 429 without a usable `Retry-After` holds back every request of the client
/// (approval POSTs and identity too, not only the poll that backs off): one budget window.
pub const UNASKED_THROTTLE_HOLD: Duration = Duration::from_secs(1);
/// How long Azure says a 410 Gone may last; until then it is retried quietly.
pub const GONE_GRACE: Duration = Duration::from_secs(70);

/// The wait before the next poll after `failures` consecutive failed polls (1 for the
/// first), the last of which failed with `error`.
pub fn error_wait(
    error: &ImdsError,
    failures: u32,
    poll_interval: Duration,
    max_backoff: Duration,
) -> Duration {
    let attempt = failures.saturating_sub(1);
    let ceiling = max_backoff.min(MAX_ERROR_BACKOFF);
    let normal = Backoff::new(poll_interval.min(ceiling), ceiling).jittered(attempt);
    match error {
        ImdsError::Throttled {
            retry_after: Some(asked),
            ..
        } => (*asked).clamp(MIN_REQUEST_SPACING, MAX_THROTTLED_WAIT),
        ImdsError::Throttled { .. } => {
            Backoff::new(poll_interval.max(Duration::from_secs(1)), THROTTLED_BACKOFF)
                .jittered(attempt)
        }
        _ => normal,
    }
    .max(MIN_REQUEST_SPACING)
}

/// Keeps every request of one client at least [`MIN_REQUEST_SPACING`] apart, in about the
/// order they asked: at most 5 requests in any second, polls, approvals and identity together.
///
/// Nothing is held while a request waits. The poll has a runtime of its own and the approval
/// POSTs share the main one: a request whose runtime stops driving it (a stalled task, a
/// runtime shutting down) must not keep the other runtime's requests waiting. Each request
/// takes a slot a spacing behind the latest slot of those waiting and sleeps until it; when
/// it wakes it is granted its turn only if the last grant is a spacing behind and no 429
/// holds requests back, else it sleeps again. A waiter that is never woken delays those
/// after it only until its slot has passed.
///
/// Spacing counts from the grant: a request that connects after its turn (a new connection)
/// goes out that much later, closer to the next one.
#[derive(Debug, Default)]
pub struct Pacer {
    schedule: std::sync::Mutex<Schedule>,
}

#[derive(Debug, Default)]
struct Schedule {
    /// When the last request was granted its turn.
    granted: Option<Instant>,
    /// A throttled service's `Retry-After`: no request of this client goes out before it
    /// (polls, approval POSTs and identity alike).
    throttled_until: Option<Instant>,
    /// The requests waiting for their turn, each with the slot it sleeps until. A new one
    /// queues behind the latest; a wait given up leaves it, so later requests do not keep
    /// its place (those already queued behind it keep theirs).
    waiting: Vec<(u64, Instant)>,
    /// Names the next waiter.
    next_waiter: u64,
}

impl Schedule {
    /// The earliest a request may go out, from what has gone out and what the service asked.
    fn allowed(&self) -> Option<Instant> {
        self.granted
            .map(|at| at + MIN_REQUEST_SPACING)
            .max(self.throttled_until)
    }

    fn leave(&mut self, waiter: u64) {
        self.waiting.retain(|(id, _)| *id != waiter);
    }
}

/// One request's place among the waiting; given up if its wait is dropped before its turn.
struct Waiting<'a> {
    pacer: &'a Pacer,
    id: u64,
    granted: bool,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if !self.granted {
            self.pacer.schedule().leave(self.id);
        }
    }
}

impl Pacer {
    pub fn new() -> Pacer {
        Pacer::default()
    }

    fn schedule(&self) -> std::sync::MutexGuard<'_, Schedule> {
        self.schedule.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits for this request's turn. A 429 that another request gets while this one waits
    /// (for its spacing, or for an earlier `Retry-After`) holds this one back too: the wait is
    /// checked again when it ends.
    pub async fn turn(&self) {
        let (mut slot, mut place) = {
            let mut schedule = self.schedule();
            let behind = schedule
                .waiting
                .iter()
                .map(|(_, at)| *at + MIN_REQUEST_SPACING)
                .max();
            let slot = [schedule.allowed(), behind]
                .into_iter()
                .flatten()
                .fold(Instant::now(), Instant::max);
            let id = schedule.next_waiter;
            schedule.next_waiter += 1;
            schedule.waiting.push((id, slot));
            let place = Waiting {
                pacer: self,
                id,
                granted: false,
            };
            (slot, place)
        };
        loop {
            // No timer for a turn that is free at once: the idle poll's usual case.
            if slot > Instant::now() {
                tokio::time::sleep_until(slot).await;
            }
            let mut schedule = self.schedule();
            let now = Instant::now();
            match schedule.allowed() {
                Some(at) if at > now => {
                    slot = at;
                    if let Some(entry) = schedule.waiting.iter_mut().find(|(id, _)| *id == place.id)
                    {
                        entry.1 = at;
                    }
                }
                _ => {
                    schedule.granted = Some(now);
                    schedule.leave(place.id);
                    place.granted = true;
                    return;
                }
            }
        }
    }

    /// The service answered 429 and asked for `retry_after` (at most [`MAX_THROTTLED_WAIT`]).
    pub fn throttled(&self, retry_after: Duration) {
        let until = Instant::now() + retry_after.min(MAX_THROTTLED_WAIT);
        let mut schedule = self.schedule();
        schedule.throttled_until = schedule.throttled_until.max(Some(until));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::future::Future;

    fn status(status: u16) -> ImdsError {
        ImdsError::Status {
            url: "u".into(),
            status,
            body: String::new(),
        }
    }

    fn throttled(retry_after: Option<u64>) -> ImdsError {
        ImdsError::Throttled {
            url: "u".into(),
            retry_after: retry_after.map(Duration::from_secs),
        }
    }

    #[test]
    fn the_shipped_defaults_retry_an_outage_within_five_seconds_however_long_it_lasts() {
        let defaults = crate::imds::ImdsConfig::default();
        for failures in 1..10_000 {
            let wait = error_wait(
                &status(503),
                failures,
                defaults.poll_interval,
                defaults.max_backoff,
            );
            assert!(wait <= MAX_ERROR_BACKOFF, "{failures}: {wait:?}");
        }
    }

    #[test]
    fn a_throttled_service_is_given_the_time_it_asks_for_up_to_a_preempt_notice() {
        let second = Duration::from_secs(1);
        let wait = |e| error_wait(&e, 1, second, MAX_ERROR_BACKOFF);
        assert_eq!(wait(throttled(Some(12))), Duration::from_secs(12));
        assert_eq!(wait(throttled(Some(600))), MAX_THROTTLED_WAIT);
        assert_eq!(wait(throttled(Some(0))), MIN_REQUEST_SPACING);
        let unasked = error_wait(&throttled(None), 30, second, MAX_ERROR_BACKOFF);
        assert!(unasked > MAX_ERROR_BACKOFF / 2 && unasked <= THROTTLED_BACKOFF);
    }

    proptest! {
        /// Any error, any count, any valid configuration: never faster than the service's
        /// budget, never slower than 5 s unless the service throttles.
        #[test]
        fn error_waits_stay_between_the_budget_and_the_ceiling(
            failures in 1u32..100_000,
            poll_ms in 200u64..=60_000,
            max_ms in 200u64..=5_000,
            code in prop::sample::select(vec![400u16, 404, 410, 500, 502, 503, 504]),
        ) {
            let wait = error_wait(
                &status(code),
                failures,
                Duration::from_millis(poll_ms),
                Duration::from_millis(max_ms),
            );
            prop_assert!(wait >= MIN_REQUEST_SPACING);
            prop_assert!(wait <= MAX_ERROR_BACKOFF);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_retry_after_holds_back_every_request_of_the_client() {
        let pacer = Pacer::new();
        pacer.turn().await;
        let start = Instant::now();
        pacer.throttled(Duration::from_secs(4));
        pacer.turn().await;
        assert!(Instant::now() - start >= Duration::from_secs(4));
        pacer.throttled(Duration::from_secs(600));
        let start = Instant::now();
        pacer.turn().await;
        assert_eq!(Instant::now() - start, MAX_THROTTLED_WAIT);
    }

    #[tokio::test(start_paused = true)]
    async fn a_retry_after_that_comes_while_a_request_waits_for_its_turn_holds_it_back() {
        let pacer = std::sync::Arc::new(Pacer::new());
        let start = Instant::now();
        pacer.turn().await;
        // Waits for its spacing behind the request that just went out...
        let waiting = tokio::spawn({
            let pacer = pacer.clone();
            async move {
                pacer.turn().await;
                Instant::now()
            }
        });
        // ...whose answer, a 429, comes before that wait ends.
        tokio::time::sleep(Duration::from_millis(100)).await;
        pacer.throttled(Duration::from_secs(4));
        let went = waiting.await.unwrap();
        assert!(
            went - start >= Duration::from_millis(4_100),
            "went out {:?} after the first request, inside the Retry-After",
            went - start
        );
    }

    /// The poll has a runtime of its own; approval POSTs share the main one. A request whose
    /// runtime stops driving it while it waits for its turn must not stop the other's.
    #[test]
    fn a_request_whose_runtime_stalls_while_it_waits_does_not_hold_back_another_runtimes() {
        let pacer = std::sync::Arc::new(Pacer::new());
        let start = std::time::Instant::now();
        let stalled = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        stalled.block_on(async {
            pacer.turn().await;
            // Waits for its spacing behind the request that just went out; then its runtime
            // is driven no more (a current-thread runtime runs only inside `block_on`).
            tokio::spawn({
                let pacer = pacer.clone();
                async move { pacer.turn().await }
            });
            tokio::task::yield_now().await;
        });
        let other = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let went = other
            .block_on(async { tokio::time::timeout(Duration::from_secs(5), pacer.turn()).await });
        assert!(
            went.is_ok(),
            "the other runtime's request never got its turn"
        );
        // It still keeps its distance from the first request and the slot the stalled one took.
        assert!(
            start.elapsed() >= 2 * MIN_REQUEST_SPACING,
            "{:?}",
            start.elapsed()
        );
        drop(stalled);
    }

    #[tokio::test(start_paused = true)]
    async fn requests_a_429_holds_back_together_go_out_one_spacing_apart_after_it() {
        let pacer = std::sync::Arc::new(Pacer::new());
        let start = Instant::now();
        pacer.turn().await;
        // Four requests queue behind it, each with a slot of its own...
        let waiting: Vec<_> = (0..4)
            .map(|_| {
                let pacer = pacer.clone();
                tokio::spawn(async move {
                    pacer.turn().await;
                    Instant::now() - start
                })
            })
            .collect();
        // ...until a 429 moves them all to the same moment.
        tokio::time::sleep(Duration::from_millis(100)).await;
        pacer.throttled(Duration::from_secs(2));
        let mut went = Vec::new();
        for task in waiting {
            went.push(task.await.unwrap());
        }
        went.sort();
        assert!(went[0] >= Duration::from_millis(2_100), "{went:?}");
        for pair in went.windows(2) {
            assert!(pair[1] - pair[0] >= MIN_REQUEST_SPACING, "{went:?}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn requests_that_gave_up_waiting_do_not_delay_the_next() {
        let pacer = std::sync::Arc::new(Pacer::new());
        let start = Instant::now();
        pacer.turn().await;
        let given_up: Vec<_> = (0..3)
            .map(|_| {
                let pacer = pacer.clone();
                tokio::spawn(async move { pacer.turn().await })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(50)).await;
        for task in &given_up {
            task.abort();
        }
        for task in given_up {
            assert!(task.await.unwrap_err().is_cancelled());
        }
        pacer.turn().await;
        assert_eq!(Instant::now() - start, MIN_REQUEST_SPACING);
    }

    /// A waiter whose task is never polled again (its runtime stalled) must not cost every
    /// later poll a spacing: once its slot has passed, it delays nobody.
    #[tokio::test(start_paused = true)]
    async fn waiters_that_are_never_woken_stop_delaying_others_once_their_slots_pass() {
        let pacer = Pacer::new();
        pacer.turn().await;
        let mut stalled: Vec<_> = (0..25).map(|_| Box::pin(pacer.turn())).collect();
        let mut idle = std::task::Context::from_waker(std::task::Waker::noop());
        for waiter in &mut stalled {
            assert!(waiter.as_mut().poll(&mut idle).is_pending());
        }
        tokio::time::sleep(Duration::from_secs(6)).await;
        for _ in 0..3 {
            let start = Instant::now();
            pacer.turn().await;
            assert_eq!(Instant::now() - start, Duration::ZERO);
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        drop(stalled);
    }

    #[tokio::test(start_paused = true)]
    async fn requests_are_spaced_so_no_second_holds_more_than_five() {
        let pacer = Pacer::new();
        let start = Instant::now();
        let mut at = Vec::new();
        for _ in 0..20 {
            pacer.turn().await;
            at.push(Instant::now() - start);
        }
        for pair in at.windows(2) {
            assert!(pair[1] - pair[0] >= MIN_REQUEST_SPACING, "{at:?}");
        }
        for (i, first) in at.iter().enumerate() {
            let within = at[i..]
                .iter()
                .take_while(|t| **t <= *first + Duration::from_secs(1))
                .count();
            assert!(
                within <= 5,
                "{within} requests within a second of {first:?}"
            );
        }
    }
}
