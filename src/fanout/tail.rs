//! The newest events of each sink, in memory: what a sink's task delivers without reading it
//! back from the outbox.
//!
//! A new document's events are handed to every sink's tail as soon as the outbox has numbered
//! them, while its durable commit is still being written, so that the sink's task has them
//! the moment the commit is durable ([`Ticket`]), without a read back. It delivers none of
//! them before: a transition a sink has seen must come from a document the agent processed,
//! or a crash before the commit makes the next start derive other transitions from a later
//! document (an event reported started, then cancelled, when it completed). A commit that
//! fails is taken out of the tails; the poller stores its events again. A sink that falls
//! behind reads the outbox instead: a tail keeps at most [`TAIL_EVENTS`] events whose commit
//! is durable.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use sched_relay_transport::Event;
use tokio::sync::watch;

/// How many committed events a tail keeps for a sink that is behind; older ones are read from
/// the outbox when their turn comes.
pub(super) const TAIL_EVENTS: usize = 4096;

/// The fate of one commit: pending, then durable (`true`) or failed (`false`).
#[derive(Debug)]
pub(super) struct Ticket {
    settled: watch::Sender<Option<bool>>,
}

impl Ticket {
    pub(super) fn new() -> Arc<Ticket> {
        Arc::new(Ticket {
            settled: watch::Sender::new(None),
        })
    }

    pub(super) fn settle(&self, durable: bool) {
        self.settled.send_replace(Some(durable));
    }

    /// Whether the commit is durable, once it is settled.
    pub(super) async fn durable(&self) -> bool {
        let mut settled = self.settled.subscribe();
        let outcome = settled.wait_for(Option::is_some).await;
        // The sender lives in `self`: it cannot close while we wait.
        outcome.map(|o| o.unwrap_or(false)).unwrap_or(false)
    }

    pub(super) fn is_durable(&self) -> bool {
        *self.settled.borrow() == Some(true)
    }

    pub(super) fn is_settled(&self) -> bool {
        self.settled.borrow().is_some()
    }
}

/// Settles its ticket as failed if it is dropped before the commit settled it (a commit that
/// panicked): a sink's task waiting for the ticket must not wait for ever.
pub(super) struct SettledAtDrop(pub(super) Arc<Ticket>);

impl Drop for SettledAtDrop {
    fn drop(&mut self) {
        if !self.0.is_settled() {
            self.0.settle(false);
        }
    }
}

/// One commit's events for one sink: numbered `first_seq..` in the outbox.
#[derive(Debug, Clone)]
struct Fresh {
    first_seq: u64,
    /// The commit's events; this sink's are the first `stored` of them.
    events: Arc<[Event]>,
    stored: usize,
    ticket: Arc<Ticket>,
}

/// Events a sink's task can deliver straight from memory: `events[range]`, numbered from
/// `first_seq`.
pub(super) struct FromMemory {
    pub(super) first_seq: u64,
    pub(super) events: Arc<[Event]>,
    pub(super) range: Range<usize>,
    pub(super) ticket: Arc<Ticket>,
}

/// What a sink's task should do next, given where it stands (`cursor`: the first number it
/// has not delivered).
pub(super) enum Next {
    /// Deliver these from memory.
    Memory(FromMemory),
    /// Read the outbox from the cursor, below this number if any (the tail starts there).
    Outbox { until: Option<u64> },
}

/// One sink's tail.
#[derive(Debug, Default)]
pub(super) struct Tail {
    fresh: Mutex<VecDeque<Fresh>>,
}

impl Tail {
    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Fresh>> {
        self.fresh.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A commit's events, numbered from `first_seq` (this sink stores the first `stored`).
    /// Called in numbering order (the outbox numbers under its lock).
    pub(super) fn push(
        &self,
        first_seq: u64,
        events: &Arc<[Event]>,
        stored: usize,
        ticket: &Arc<Ticket>,
    ) {
        if stored == 0 {
            return;
        }
        let mut fresh = self.lock();
        fresh.push_back(Fresh {
            first_seq,
            events: events.clone(),
            stored,
            ticket: ticket.clone(),
        });
        // A sink that is behind reads the outbox; keep memory bounded by dropping what is
        // durable there (never an uncommitted one: it exists nowhere else yet).
        let mut held: usize = fresh.iter().map(|f| f.stored).sum();
        while held > TAIL_EVENTS && fresh.front().is_some_and(|f| f.ticket.is_durable()) {
            held -= fresh.pop_front().map(|f| f.stored).unwrap_or(0);
        }
    }

    /// Takes out what `ticket`'s failed commit put here.
    pub(super) fn discard(&self, ticket: &Arc<Ticket>) {
        self.lock().retain(|f| !Arc::ptr_eq(&f.ticket, ticket));
    }

    /// Where the task whose first undelivered number is `cursor` finds its next events, at
    /// most `max` of them; forgets what is below the cursor.
    pub(super) fn next(&self, cursor: u64, max: usize) -> Next {
        let mut fresh = self.lock();
        while fresh
            .front()
            .is_some_and(|f| f.first_seq + f.stored as u64 <= cursor)
        {
            fresh.pop_front();
        }
        match fresh.front() {
            Some(f) if f.first_seq <= cursor => {
                let start = (cursor - f.first_seq) as usize;
                Next::Memory(FromMemory {
                    first_seq: cursor,
                    events: f.events.clone(),
                    range: start..f.stored.min(start + max.max(1)),
                    ticket: f.ticket.clone(),
                })
            }
            Some(f) => Next::Outbox {
                until: Some(f.first_seq),
            },
            None => Next::Outbox { until: None },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events(n: usize) -> Arc<[Event]> {
        let template = sched_relay_transport::testing::live_migration_events("vm");
        (0..n)
            .map(|i| template[0].clone().with_id(format!("e{i}")))
            .collect()
    }

    fn memory(next: Next) -> (u64, Range<usize>) {
        match next {
            Next::Memory(m) => (m.first_seq, m.range),
            Next::Outbox { until } => panic!("expected memory, got outbox until {until:?}"),
        }
    }

    #[test]
    fn a_caught_up_task_gets_the_new_events_from_memory_in_batches() {
        let tail = Tail::default();
        let ticket = Ticket::new();
        tail.push(10, &events(5), 5, &ticket);
        assert_eq!(memory(tail.next(10, 3)), (10, 0..3));
        assert_eq!(memory(tail.next(13, 3)), (13, 3..5));
        assert!(matches!(tail.next(15, 3), Next::Outbox { until: None }));
    }

    #[test]
    fn a_task_behind_the_tail_reads_the_outbox_up_to_where_the_tail_starts() {
        let tail = Tail::default();
        tail.push(100, &events(2), 2, &Ticket::new());
        assert!(matches!(
            tail.next(40, 10),
            Next::Outbox { until: Some(100) }
        ));
    }

    #[test]
    fn a_sink_at_capacity_gets_only_what_was_stored_for_it() {
        let tail = Tail::default();
        tail.push(0, &events(5), 2, &Ticket::new());
        assert_eq!(memory(tail.next(0, 10)), (0, 0..2));
        tail.push(2, &events(5), 0, &Ticket::new());
        assert!(matches!(tail.next(2, 10), Next::Outbox { until: None }));
    }

    #[test]
    fn a_failed_commit_leaves_the_tail() {
        let tail = Tail::default();
        let failed = Ticket::new();
        tail.push(0, &events(2), 2, &failed);
        tail.push(2, &events(1), 1, &Ticket::new());
        failed.settle(false);
        tail.discard(&failed);
        assert!(matches!(tail.next(0, 10), Next::Outbox { until: Some(2) }));
    }

    #[test]
    fn only_durable_events_are_dropped_to_bound_memory() {
        let tail = Tail::default();
        let pending = Ticket::new();
        tail.push(0, &events(TAIL_EVENTS), TAIL_EVENTS, &pending);
        let durable = Ticket::new();
        durable.settle(true);
        tail.push(TAIL_EVENTS as u64, &events(10), 10, &durable);
        // The pending commit is kept whatever the bound: it exists nowhere else.
        assert_eq!(memory(tail.next(0, 1)), (0, 0..1));
        pending.settle(true);
        tail.push(TAIL_EVENTS as u64 + 10, &events(10), 10, &durable);
        assert!(matches!(
            tail.next(0, 1),
            Next::Outbox {
                until: Some(first)
            } if first == TAIL_EVENTS as u64
        ));
    }

    #[test]
    fn a_commit_that_panics_leaves_its_ticket_failed_not_pending() {
        let ticket = Ticket::new();
        let panicked = std::panic::catch_unwind(|| {
            let _settled = SettledAtDrop(ticket.clone());
            panic!("redb asserted inside the commit");
        });
        assert!(panicked.is_err());
        assert!(ticket.is_settled() && !ticket.is_durable());
        // A commit that settles keeps its verdict.
        let durable = Ticket::new();
        {
            let _settled = SettledAtDrop(durable.clone());
            durable.settle(true);
        }
        assert!(durable.is_durable());
    }

    #[tokio::test]
    async fn a_ticket_tells_its_waiters_whether_the_commit_is_durable() {
        let ticket = Ticket::new();
        let waiter = tokio::spawn({
            let ticket = ticket.clone();
            async move { ticket.durable().await }
        });
        ticket.settle(true);
        assert!(waiter.await.unwrap());
        let failed = Ticket::new();
        failed.settle(false);
        assert!(!failed.durable().await);
    }
}
