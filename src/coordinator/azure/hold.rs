//! What holds a subscription's acknowledgements back ([`super::acknowledge`]): ARM's
//! limits are per subscription, and so is this.
//!
//! - A 429 holds every acknowledgement of the subscription until its `Retry-After` has
//!   passed; then one goes first, as after failures.
//! - A failure every event would share (a server error, a timeout, a 401, no token, no
//!   connection) holds them for a wait that doubles with each such failure in a row (2 s
//!   to 64 s). When the wait is over, one acknowledgement goes first (the probe) and the
//!   others wait for its answer: an outage costs ARM's write limit one write per wait,
//!   however many events wait (1,200 an hour per subscription, shared with everything
//!   else that writes there).
//! - An answer from ARM (accepted or refused) to a request sent since the last failure
//!   counted (or 429) ends the row, and a failure's wait with it.
//! - Requests in flight together when a failure is counted (several events are
//!   acknowledged at once) are not counted again when they fail too.
//!
//! Each request sent takes a ticket, in the order they were let through: "sent since" is
//! a comparison of tickets, not of clocks.

use std::time::Duration;

use tokio::time::Instant;

/// The wait after a first shared failure; it doubles with each one in a row, up to
/// [`FAILED_WAIT_MAX`].
pub const FAILED_WAIT_FIRST: Duration = Duration::from_secs(2);
/// The longest wait after failures in a row: an outage's end is noticed within it.
pub const FAILED_WAIT_MAX: Duration = Duration::from_secs(64);

/// One subscription's hold.
#[derive(Debug, Default)]
pub(super) struct Hold {
    /// Nothing is sent before this, and why.
    until: Option<(Instant, HeldBy)>,
    /// Shared failures in a row.
    failures: u32,
    /// The next request's ticket.
    next_ticket: u64,
    /// Tickets below this were let through before the last failure counted or 429: their
    /// answers say less of now than that did.
    counted_upto: u64,
    /// ARM throttled since the last current answer: the next request is a probe too.
    throttled: bool,
    /// The probe in flight after failures or a 429: its ticket and when it went (a probe
    /// whose answer never comes, its task gone, stops holding the others after the
    /// `patience` [`Hold::admit`] is given: longer than any call can take).
    probe: Option<(u64, Instant)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HeldBy {
    /// A 429's `Retry-After`.
    Throttled,
    /// The wait after shared failures in a row.
    Failing,
}

/// How an answer moves the hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Judged {
    /// ARM answered (accepted or refused): the service works.
    Answered,
    /// A failure every event of the subscription would share.
    SharedFailure,
    /// This event's own failure (a conflict): the others are not held back.
    OwnFailure,
}

impl Hold {
    /// How long the next acknowledgement waits after `failures` in a row.
    pub(super) fn wait(failures: u32) -> Duration {
        FAILED_WAIT_FIRST
            .saturating_mul(1 << failures.saturating_sub(1).min(16))
            .min(FAILED_WAIT_MAX)
    }

    /// Lets a request through at `now` (its ticket), or says why not; `patience`: how long
    /// a probe may take before another goes (longer than a call's timeout).
    pub(super) fn admit(&mut self, now: Instant, patience: Duration) -> Result<u64, String> {
        if let Some((until, why)) = self.until.filter(|(until, _)| *until > now) {
            let left = (until - now).as_secs() + 1;
            return Err(match why {
                HeldBy::Throttled => format!(
                    "not sent: Azure Resource Manager throttles this subscription's writes (429) for {left} s more"
                ),
                HeldBy::Failing => format!(
                    "not sent: acknowledgements through Azure Resource Manager failed {} times in a row; none is sent for {left} s more",
                    self.failures
                ),
            });
        }
        if self.failures > 0 || self.throttled {
            if self
                .probe
                .is_some_and(|(_, sent)| now.duration_since(sent) < patience)
            {
                return Err(
                    "not sent: another acknowledgement is trying whether Azure Resource Manager takes them again".into()
                );
            }
            self.probe = Some((self.next_ticket, now));
        }
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        Ok(ticket)
    }

    /// The answer to the request of `ticket`, seen at `now`: the wait it starts after a
    /// shared failure counted.
    pub(super) fn judged(&mut self, ticket: u64, judged: Judged, now: Instant) -> Option<Duration> {
        if self.probe.is_some_and(|(probe, _)| probe == ticket) {
            self.probe = None;
        }
        // Sent before the last failure was counted: that failure says more of now.
        let current = ticket >= self.counted_upto;
        match judged {
            Judged::Answered if current => {
                self.failures = 0;
                self.throttled = false;
                self.probe = None;
                if matches!(self.until, Some((_, HeldBy::Failing))) {
                    self.until = None;
                }
                None
            }
            Judged::SharedFailure if current => {
                self.failures += 1;
                self.counted_upto = self.next_ticket;
                let wait = Hold::wait(self.failures);
                let until = now + wait;
                // A 429's longer wait stands.
                if self.until.is_none_or(|(held, _)| held < until) {
                    self.until = Some((until, HeldBy::Failing));
                }
                Some(wait)
            }
            Judged::Answered | Judged::SharedFailure | Judged::OwnFailure => None,
        }
    }

    /// A 429 seen at `now`: nothing is sent for `wait`, then a probe. Whatever the ticket
    /// of the request it answered: ARM's word of now, so that answers to requests let
    /// through before it (a probe's included) are stale.
    pub(super) fn throttled(&mut self, wait: Duration, now: Instant) {
        self.throttled = true;
        self.counted_upto = self.next_ticket;
        let until = now + wait;
        if self.until.is_none_or(|(held, _)| held < until) {
            self.until = Some((until, HeldBy::Throttled));
        }
    }

    pub(super) fn failures(&self) -> u32 {
        self.failures
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PATIENCE: Duration = Duration::from_secs(90);

    /// A hold after one shared failure at `t0`.
    fn failed_once(t0: Instant) -> Hold {
        let mut hold = Hold::default();
        let first = hold.admit(t0, PATIENCE).unwrap();
        hold.judged(first, Judged::SharedFailure, t0);
        hold
    }

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
        // Three events sent at once as an outage starts: one failure, a 2 s wait.
        let tickets: Vec<u64> = (0..3).map(|_| hold.admit(t0, PATIENCE).unwrap()).collect();
        let at = t0 + Duration::from_millis(100);
        assert_eq!(
            hold.judged(tickets[0], Judged::SharedFailure, at),
            Some(FAILED_WAIT_FIRST)
        );
        assert_eq!(hold.judged(tickets[1], Judged::SharedFailure, at), None);
        assert_eq!(hold.judged(tickets[2], Judged::SharedFailure, at), None);
        assert_eq!(hold.failures(), 1);
        assert!(
            hold.admit(at + Duration::from_millis(1900), PATIENCE)
                .is_err()
        );
        // The next one, sent after that wait, fails: the wait doubles.
        let again = at + FAILED_WAIT_FIRST;
        let probe = hold.admit(again, PATIENCE).unwrap();
        assert_eq!(
            hold.judged(probe, Judged::SharedFailure, again),
            Some(FAILED_WAIT_FIRST * 2)
        );
        assert!(
            hold.admit(again + Duration::from_millis(3900), PATIENCE)
                .is_err()
        );
    }

    #[test]
    fn after_a_wait_one_probe_goes_and_the_others_wait_for_its_answer() {
        let t0 = Instant::now();
        let mut hold = failed_once(t0);
        let after = t0 + FAILED_WAIT_FIRST;
        let probe = hold.admit(after, PATIENCE).unwrap();
        // Every other event, however many, waits for the probe's answer.
        for n in 0..100 {
            let why = hold
                .admit(after + Duration::from_millis(n), PATIENCE)
                .unwrap_err();
            assert!(why.contains("another acknowledgement is trying"), "{why}");
        }
        // ARM answers: the row ends, everything goes.
        assert_eq!(hold.judged(probe, Judged::Answered, after), None);
        assert_eq!(hold.failures(), 0);
        for _ in 0..3 {
            hold.admit(after, PATIENCE).unwrap();
        }
    }

    #[test]
    fn a_probe_whose_answer_never_comes_stops_holding_the_others() {
        let t0 = Instant::now();
        let mut hold = failed_once(t0);
        let after = t0 + FAILED_WAIT_FIRST;
        hold.admit(after, PATIENCE).unwrap();
        assert!(hold.admit(after + PATIENCE / 2, PATIENCE).is_err());
        hold.admit(after + PATIENCE, PATIENCE).unwrap();
    }

    #[test]
    fn an_events_own_failure_holds_no_other() {
        let mut hold = Hold::default();
        let t0 = Instant::now();
        let conflict = hold.admit(t0, PATIENCE).unwrap();
        assert_eq!(hold.judged(conflict, Judged::OwnFailure, t0), None);
        assert_eq!(hold.failures(), 0);
        hold.admit(t0, PATIENCE).unwrap();
    }

    #[test]
    fn only_an_answer_sent_since_the_last_failure_ends_the_row() {
        let mut hold = Hold::default();
        let t0 = Instant::now();
        let (early, failed) = (
            hold.admit(t0, PATIENCE).unwrap(),
            hold.admit(t0, PATIENCE).unwrap(),
        );
        hold.judged(failed, Judged::SharedFailure, t0);
        // An answer to a request sent before that failure was counted says less of now.
        hold.judged(early, Judged::Answered, t0);
        assert_eq!(hold.failures(), 1);
        assert!(hold.admit(t0 + Duration::from_secs(1), PATIENCE).is_err());
        // The probe's answer does end it, the wait with it.
        let probe = hold.admit(t0 + FAILED_WAIT_FIRST, PATIENCE).unwrap();
        hold.judged(probe, Judged::Answered, t0 + FAILED_WAIT_FIRST);
        assert_eq!(hold.failures(), 0);
        hold.admit(t0 + FAILED_WAIT_FIRST, PATIENCE).unwrap();
    }

    #[test]
    fn a_throttles_longer_wait_stands_after_an_answer_and_a_failure() {
        let mut hold = Hold::default();
        let t0 = Instant::now();
        let (answered, failed) = (
            hold.admit(t0, PATIENCE).unwrap(),
            hold.admit(t0, PATIENCE).unwrap(),
        );
        hold.throttled(Duration::from_secs(300), t0);
        // Requests let through before the 429 neither end its wait nor shorten it.
        hold.judged(answered, Judged::Answered, t0);
        hold.judged(failed, Judged::SharedFailure, t0);
        let why = hold
            .admit(t0 + Duration::from_secs(299), PATIENCE)
            .unwrap_err();
        assert!(why.contains("429"), "{why}");
        hold.admit(t0 + Duration::from_secs(300), PATIENCE).unwrap();
    }

    #[test]
    fn after_a_429s_wait_one_goes_first_and_its_answer_lets_the_others_go() {
        let mut hold = Hold::default();
        let t0 = Instant::now();
        let ticket = hold.admit(t0, PATIENCE).unwrap();
        hold.throttled(Duration::from_secs(10), t0);
        hold.judged(ticket, Judged::OwnFailure, t0);
        let after = t0 + Duration::from_secs(10);
        let probe = hold.admit(after, PATIENCE).unwrap();
        assert!(hold.admit(after, PATIENCE).is_err(), "the others wait");
        hold.judged(probe, Judged::Answered, after);
        hold.admit(after, PATIENCE).unwrap();
        hold.admit(after, PATIENCE).unwrap();
    }
}
