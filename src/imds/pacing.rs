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

/// Keeps every request of one client at least [`MIN_REQUEST_SPACING`] apart, in about the
/// order they asked: at most 5 requests in any second, polls, approvals and identity together.
///
/// Nothing is held while a request waits. The poll has a runtime of its own and the approval
/// POSTs share the main one: a request whose runtime stops driving it (a stalled task, a
/// runtime shutting down) must not keep the other runtime's requests waiting. Each request
/// takes a slot a spacing behind the latest slot of those waiting and sleeps until it; when
/// it wakes it is granted its turn only if its slot (which may have moved) has come, the last
/// grant is a spacing behind and no 429 holds requests back; else it moves the slots of those
/// waiting behind that hold, in the order they came, and sleeps until its own: after a 429,
/// the first waiter to wake puts the queue behind it, newcomers included. A waiter that is no
/// longer polled (its runtime stalled) delays those after it only until a spacing after its
/// slot. A wait that is given up leaves the queue; those already queued behind it keep their
/// slots.
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

    /// Moves the waiting requests' slots to `from` or later, a spacing apart, in the order
    /// they came (the list's order), when `waiter` woke before `from` (a 429's hold, or the
    /// last grant's spacing): they go out one by one in that order instead of waking
    /// together. A slot more than a spacing past belongs to a waiter whose runtime no longer
    /// polls it, and is left where it is (else it would hold every later request back by a
    /// spacing each time), unless it is `waiter`'s own.
    fn respace(&mut self, from: Instant, now: Instant, waiter: u64) {
        let mut next = from;
        for (id, slot) in &mut self.waiting {
            if *slot + MIN_REQUEST_SPACING < now && *id != waiter {
                continue;
            }
            *slot = (*slot).max(next);
            next = *slot + MIN_REQUEST_SPACING;
        }
    }

    fn slot_of(&self, waiter: u64) -> Option<Instant> {
        self.waiting
            .iter()
            .find(|(id, _)| *id == waiter)
            .map(|(_, slot)| *slot)
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
    /// (for its spacing, or for an earlier `Retry-After`) holds this one back too: the wait is
    /// checked again when it ends.
    pub async fn turn(&self) {
        let place = {
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
            Waiting {
                pacer: self,
                id,
                granted: false,
            }
        };
        loop {
            // Granted only once no grant or 429 holds requests back and this waiter's slot
            // has come, as the schedule has it now: a 429 (or a waiter ahead that woke early)
            // may have moved it while this one slept on the old one.
            let slot = {
                let mut schedule = self.schedule();
                let now = Instant::now();
                let allowed = schedule.allowed().filter(|at| *at > now);
                if let Some(at) = allowed {
                    schedule.respace(at, now, place.id);
                }
                let mine = schedule.slot_of(place.id).filter(|slot| *slot > now);
                match mine.or(allowed) {
                    Some(slot) => slot,
                    None => {
                        schedule.granted = Some(now);
                        schedule.leave(place.id);
                        place.grant();
                        return;
                    }
                }
            };
            tokio::time::sleep_until(slot).await;
        }
    }

    /// The service answered 429 and asked for `retry_after` (at most [`MAX_THROTTLED_WAIT`]).
    /// Those waiting are moved behind the hold by the first of them to wake.
    pub fn throttled(&self, retry_after: Duration) {
        let until = Instant::now() + retry_after.min(MAX_THROTTLED_WAIT);
        let mut schedule = self.schedule();
        schedule.throttled_until = schedule.throttled_until.max(Some(until));
    }
}

#[cfg(test)]
mod tests;
