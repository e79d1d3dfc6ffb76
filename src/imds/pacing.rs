//! How often the agent may ask the metadata service, and how long it waits after an error.
//!
//! Two promises meet here. The service allows about 5 requests per second per VM, so every
//! request of this process (polls, StartRequests POSTs, identity) goes through one [`Pacer`]
//! that keeps at most [`BUDGET`] of them in any [`BUDGET_WINDOW`] (after a 429, also
//! [`MIN_REQUEST_SPACING`] apart for a while). And a Spot VM gets 30 s of notice, so an
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

/// How many requests of this process may go to the metadata service within [`BUDGET_WINDOW`]:
/// the service allows 5 a second per VM.
pub const BUDGET: usize = 5;
/// The window the budget is counted over: a little over a second (the margin covers a request
/// that reaches the service later than its turn, a new connection say, and the endpoints of a
/// window counted by the service).
pub const BUDGET_WINDOW: Duration = Duration::from_millis(1050);
/// The least time between two requests for a while after a 429 (and the shortest error wait):
/// a little over 200 ms, so that no second holds more than 5 whatever limiter the service
/// uses, even with the endpoints of a window counted.
pub const MIN_REQUEST_SPACING: Duration = Duration::from_millis(210);
/// How long after a 429 requests are also kept [`MIN_REQUEST_SPACING`] apart: the service has
/// shown it counts otherwise than the window, so bursts within the window stop for a while.
pub const SPACED_AFTER_THROTTLE: Duration = Duration::from_secs(600);
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
        // Never sooner than the hold the pacer sets for it: the wait logged is the wait.
        ImdsError::Throttled { .. } => {
            Backoff::new(poll_interval.max(Duration::from_secs(1)), THROTTLED_BACKOFF)
                .jittered(attempt)
                .max(UNASKED_THROTTLE_HOLD)
        }
        _ => normal,
    }
    .max(MIN_REQUEST_SPACING)
}

/// Keeps the requests of one client within the service's budget, in about the order they
/// asked: at most [`BUDGET`] in any [`BUDGET_WINDOW`] (a sliding window a little over a second),
/// polls, approvals and identity together. Within the budget a request goes at once: an
/// approval's GET and POST right after a poll do not wait. Once the service has answered 429
/// (it counts otherwise than the window does), requests are also kept [`MIN_REQUEST_SPACING`]
/// apart, which stays within any limiter that averages 5 a second, for
/// [`SPACED_AFTER_THROTTLE`].
///
/// Nothing is held while a request waits. The poll has a runtime of its own and the approval
/// POSTs share the main one: a request whose runtime stops driving it (a stalled task, a
/// runtime shutting down) must not keep the other runtime's requests waiting. Each request
/// takes the earliest slot the budget allows behind the last grants and the slots of those
/// waiting ahead of it, and sleeps until it. When it wakes, every waiting slot is worked out
/// again, in the order they came, from the grants as they are now (a 429's hold, a grant
/// nobody expected): a slot only ever moves later, and the request is granted its turn once
/// its slot has come. A slot more than [`MIN_REQUEST_SPACING`] past belongs to a waiter whose
/// runtime no longer polls it: it delays nobody from then on. A wait that is given up leaves
/// the queue; those already queued behind it keep their slots. Order is kept between slots,
/// not within one: waiters given the same slot (the window opens for both) go in the order
/// their runtimes wake them.
///
/// The budget counts grants: a request that connects after its turn (a new connection) goes
/// out that much later, which the window's margin over a second covers.
#[derive(Debug, Default)]
pub struct Pacer {
    schedule: std::sync::Mutex<Schedule>,
}

#[derive(Debug, Default)]
struct Schedule {
    /// When the last [`BUDGET`] requests were granted their turns, oldest first.
    granted: std::collections::VecDeque<Instant>,
    /// A throttled service's `Retry-After`: no request of this client goes out before it
    /// (polls, approval POSTs and identity alike).
    throttled_until: Option<Instant>,
    /// Until then (a while after a 429) requests are also kept a spacing apart.
    spaced_until: Option<Instant>,
    /// The requests waiting for their turn, each with the slot it sleeps until. A new one
    /// queues behind the latest; a wait given up leaves it, so later requests do not keep
    /// its place (those already queued behind it keep theirs).
    waiting: Vec<(u64, Instant)>,
    /// Names the next waiter.
    next_waiter: u64,
}

impl Schedule {
    /// The earliest a request may go out behind `before` (the times of the requests ahead of
    /// it, oldest first: the last grants, then the slots of those waiting ahead), as the
    /// schedule stands at `now`; `None` when nothing holds it back. Not `now` itself: a
    /// waiter's slot that has come stays where it is, so it still goes stale if never polled.
    fn earliest(&self, before: &[Instant], now: Instant) -> Option<Instant> {
        let last = before.last().copied();
        let spaced = self.spaced_until.is_some_and(|until| now < until);
        let window = before
            .len()
            .checked_sub(BUDGET)
            .map(|oldest| before[oldest] + BUDGET_WINDOW);
        [
            self.throttled_until,
            last,
            window,
            last.filter(|_| spaced).map(|at| at + MIN_REQUEST_SPACING),
        ]
        .into_iter()
        .flatten()
        .max()
    }

    /// A waiter's slot counts while it may still be polled: until a spacing after it.
    fn stale(slot: Instant, now: Instant) -> bool {
        slot + MIN_REQUEST_SPACING < now
    }

    fn leave(&mut self, waiter: u64) {
        self.waiting.retain(|(id, _)| *id != waiter);
    }

    /// Works the waiting requests' slots out again at `now`, in the order they came, from
    /// the grants as they are: each no earlier than it was. Stale slots (waiters no longer
    /// polled) are left where they are and count for nobody, unless it is `waiter`'s own:
    /// polled late, it keeps its place ahead of those that came after it.
    fn respace(&mut self, now: Instant, waiter: u64) {
        let mut before: Vec<Instant> = self.granted.iter().copied().collect();
        for index in 0..self.waiting.len() {
            let (id, slot) = self.waiting[index];
            if Schedule::stale(slot, now) && id != waiter {
                continue;
            }
            // Another waiter whose slot has come keeps it: it counts (it may be about to go)
            // until it goes stale, and is not carried forward by others' wakes (a waiter no
            // longer polled would then stay live, and cost a place in the budget, for ever).
            if slot <= now && id != waiter {
                before.push(slot);
                continue;
            }
            let slot = self.earliest(&before, now).map_or(slot, |at| at.max(slot));
            self.waiting[index].1 = slot;
            before.push(slot);
        }
    }

    fn slot_of(&self, waiter: u64) -> Option<Instant> {
        self.waiting
            .iter()
            .find(|(id, _)| *id == waiter)
            .map(|(_, slot)| *slot)
    }

    fn grant(&mut self, now: Instant, waiter: u64) {
        self.leave(waiter);
        self.granted.push_back(now);
        while self.granted.len() > BUDGET {
            self.granted.pop_front();
        }
    }
}

/// One request's place among the waiting; given up if its wait is dropped before its turn.
struct Waiting<'a> {
    pacer: &'a Pacer,
    id: u64,
    granted: bool,
}

impl Waiting<'_> {
    /// Its turn came (and it has left the schedule already).
    fn grant(mut self) {
        self.granted = true;
    }
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
    /// (for the budget, or for an earlier `Retry-After`) holds this one back too: the wait is
    /// checked again when it ends.
    pub async fn turn(&self) {
        let place = {
            let mut schedule = self.schedule();
            let now = Instant::now();
            let before: Vec<Instant> = schedule
                .granted
                .iter()
                .copied()
                .chain(
                    schedule
                        .waiting
                        .iter()
                        .map(|(_, slot)| *slot)
                        .filter(|slot| !Schedule::stale(*slot, now)),
                )
                .collect();
            let slot = schedule
                .earliest(&before, now)
                .map_or(now, |at| at.max(now));
            let id = schedule.next_waiter;
            schedule.next_waiter += 1;
            schedule.waiting.push((id, slot));
            Waiting {
                pacer: self,
                id,
                granted: false,
            }
        };
        loop {
            // Granted only once this waiter's slot has come, as the schedule has it now: a
            // 429 (or a waiter ahead that went late) may have moved it while this one slept.
            let slot = {
                let mut schedule = self.schedule();
                let now = Instant::now();
                schedule.respace(now, place.id);
                match schedule.slot_of(place.id).filter(|slot| *slot > now) {
                    Some(slot) => slot,
                    None => {
                        schedule.grant(now, place.id);
                        place.grant();
                        return;
                    }
                }
            };
            tokio::time::sleep_until(slot).await;
        }
    }

    /// The service answered 429 and asked for `retry_after` (at most [`MAX_THROTTLED_WAIT`]).
    /// Those waiting are moved behind the hold by the first of them to wake, and requests are
    /// kept a spacing apart for [`SPACED_AFTER_THROTTLE`].
    pub fn throttled(&self, retry_after: Duration) {
        let now = Instant::now();
        let until = now + retry_after.min(MAX_THROTTLED_WAIT);
        let mut schedule = self.schedule();
        schedule.throttled_until = schedule.throttled_until.max(Some(until));
        schedule.spaced_until = Some(now + SPACED_AFTER_THROTTLE);
    }
}

#[cfg(test)]
mod tests;
