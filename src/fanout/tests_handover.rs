//! Events handed to the sinks' tails in memory while their commit is written (see `tail`):
//! what a slow disk, a commit that fails before it is durable, and a sink far behind do to it.

use super::*;
use crate::store::DiskFaults;
use cloudevents::{EventBuilder, EventBuilderV10};
use sched_relay_transport::{RecordingSink, SinkError};

fn event(id: &str) -> Event {
    EventBuilderV10::new()
        .id(id)
        .source("urn:test")
        .ty("t")
        .build()
        .unwrap()
        .into()
}

fn events(ids: impl IntoIterator<Item = usize>) -> Vec<Event> {
    ids.into_iter().map(|i| event(&i.to_string())).collect()
}

fn ids(events: &[Event]) -> Vec<String> {
    events.iter().map(|e| e.id().to_owned()).collect()
}

fn delivery() -> DeliveryConfig {
    DeliveryConfig {
        retry_initial: Duration::from_millis(1),
        retry_max: Duration::from_millis(5),
        ..DeliveryConfig::default()
    }
}

/// Lets held syncs go when a test ends, even by a panic: the runtime waits for its blocking
/// threads, so a sync held forever would hang the test instead of failing it.
struct ReleasedAtEnd(Arc<DiskFaults>);

impl Drop for ReleasedAtEnd {
    fn drop(&mut self) {
        self.0.free();
        self.0.release_syncs();
    }
}

fn start_on_faults(
    dir: &Path,
    sink: &RecordingSink,
) -> (Fanout, Arc<Outbox>, Arc<DiskFaults>, ReleasedAtEnd) {
    let faults = DiskFaults::new();
    let outbox = Arc::new(Outbox::open_with_faults(dir, 100_000, faults.clone()).unwrap());
    let fanout = Fanout::start(
        vec![NamedSink {
            name: "s".into(),
            sink: Box::new(sink.clone()),
        }],
        &delivery(),
        dir,
        outbox.clone(),
    );
    let released = ReleasedAtEnd(faults.clone());
    (fanout, outbox, faults, released)
}

/// Publishes `batch`, again every 50 ms while the store refuses the commit, for at most 10 s.
async fn publish_once_it_commits(fanout: &Fanout, batch: &[Event], never: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while fanout.publish(batch, None).await.is_err() {
        assert!(std::time::Instant::now() < deadline, "{never}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(std::time::Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_event_reaches_a_sink_before_its_commit_is_durable() {
    let dir = tempfile::tempdir().unwrap();
    let sink = RecordingSink::new();
    let (fanout, outbox, faults, _released) = start_on_faults(dir.path(), &sink);
    faults.hold_syncs();
    let publisher = fanout.publisher();
    let committing = tokio::spawn(async move { publisher.publish(&events(1..=2), None).await });
    // A slow disk: the commit waits on its fsync. Had the sink got the events now, a crash
    // before the fsync would leave it with transitions of a document never processed.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!committing.is_finished(), "the commit waits on the disk");
    assert!(
        sink.delivered().is_empty(),
        "delivered before the commit was durable: {:?}",
        ids(&sink.delivered())
    );
    faults.release_syncs();
    committing.await.unwrap().unwrap();
    until("delivered once durable", || sink.delivered().len() == 2).await;
    until("removed once delivered", || outbox.depth("s").unwrap() == 0).await;
    fanout.shutdown(Duration::from_secs(5)).await;
    assert_eq!(ids(&sink.delivered()), ["1", "2"]);
    assert_eq!(outbox.pending("s", 10).unwrap().len(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_that_fails_at_its_fsync_delivers_nothing_first_and_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let sink = RecordingSink::new();
    let (fanout, outbox, faults, _released) = start_on_faults(dir.path(), &sink);
    faults.hold_syncs();
    let publisher = fanout.publisher();
    let committing = tokio::spawn(async move { publisher.publish(&events(1..=2), None).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    // The disk fills before the commit is durable: its fsync fails.
    faults.fill();
    faults.release_syncs();
    assert!(committing.await.unwrap().is_err());
    assert!(
        sink.delivered().is_empty(),
        "delivered from a commit that failed: {:?}",
        ids(&sink.delivered())
    );
    faults.free();
    // An approval's outcome comes next (new numbers, past the failed commit's), then the
    // poller stores what it kept, with the same ids.
    // The store reopens with backoff; until then a commit is refused before anything is
    // numbered or handed over.
    publish_once_it_commits(&fanout, &events(3..=3), "the store never reopened").await;
    fanout.publish(&events(1..=2), None).await.unwrap();
    until("all delivered and removed", || {
        sink.delivered().len() >= 3 && outbox.depth("s").unwrap() == 0
    })
    .await;
    fanout.publish(&events(4..=4), None).await.unwrap();
    until("the next one delivered", || sink.delivered().len() >= 4).await;
    fanout.shutdown(Duration::from_secs(5)).await;
    // None lost, none skipped. A failed fsync does not say the data is not on disk: here
    // (as on Linux) what was written is, the reopened store holds the failed commit, and
    // the events stored again after it are a repeat with the same ids (at least once).
    let delivered = ids(&sink.delivered());
    let mut first = Vec::new();
    for id in &delivered {
        if !first.contains(id) {
            first.push(id.clone());
        }
    }
    assert!(
        first == ["1", "2", "3", "4"] || first == ["3", "1", "2", "4"],
        "{delivered:?}"
    );
    assert_eq!(
        delivered.last().map(String::as_str),
        Some("4"),
        "{delivered:?}"
    );
    for (id, most) in [("1", 2), ("2", 2), ("3", 1), ("4", 1)] {
        let times = delivered.iter().filter(|d| d.as_str() == id).count();
        assert!(times <= most, "{id} sent {times} times: {delivered:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_that_panics_does_not_leave_its_sinks_waiting_for_it() {
    let dir = tempfile::tempdir().unwrap();
    let sink = RecordingSink::new();
    let (fanout, _outbox, faults, _released) = start_on_faults(dir.path(), &sink);
    faults.hold_syncs();
    faults.panic_at_next_sync();
    let publisher = fanout.publisher();
    let committing = tokio::spawn(async move { publisher.publish(&events(1..=2), None).await });
    // Handed over, and the sink's task waits for the commit ...
    tokio::time::sleep(Duration::from_millis(100)).await;
    // ... which panics inside the store.
    faults.release_syncs();
    assert!(committing.await.unwrap().is_err());
    publish_once_it_commits(
        &fanout,
        &events(3..=3),
        "the store never took a commit again",
    )
    .await;
    until("the next event delivered", || {
        ids(&sink.delivered()).contains(&"3".to_owned())
    })
    .await;
    fanout.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sink_far_behind_gets_its_backlog_from_the_outbox_then_the_new_events_once_each_in_order()
{
    let dir = tempfile::tempdir().unwrap();
    let sink = RecordingSink::new();
    sink.fail_next((0..40).map(|_| SinkError::Retriable("down".into())));
    let (fanout, outbox, _faults, _released) = start_on_faults(dir.path(), &sink);
    // More than a tail holds, while the sink is down; then more once it is back.
    let total = tail::TAIL_EVENTS * 2 + 500;
    for chunk in (0..total).collect::<Vec<_>>().chunks(700) {
        fanout
            .publish(&events(chunk.iter().copied()), None)
            .await
            .unwrap();
    }
    until("the sink is back", || sink.delivered().len() > 100).await;
    fanout
        .publish(&events(total..total + 10), None)
        .await
        .unwrap();
    until("all delivered", || sink.delivered().len() >= total + 10).await;
    until("all removed", || outbox.depth("s").unwrap() == 0).await;
    fanout.shutdown(Duration::from_secs(5)).await;
    let expected: Vec<String> = (0..total + 10).map(|i| i.to_string()).collect();
    assert_eq!(ids(&sink.delivered()), expected);
}

#[test]
fn removals_not_yet_durable_come_back_after_a_reopen_and_the_generation_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let faults = DiskFaults::new();
    let outbox = Outbox::open_with_faults(dir.path(), 100, faults.clone()).unwrap();
    let sinks = ["s".to_owned()];
    outbox.commit(&sinks, &events(1..=2), None).unwrap();
    outbox.remove_below("s", 2).unwrap();
    assert_eq!(outbox.depth("s").unwrap(), 0);
    let generation = outbox.generation();
    // An I/O error latches the database; the store reopens the file from its last durable
    // commit, which still holds the two events.
    faults.fill();
    assert!(outbox.commit(&sinks, &events(3..=3), None).is_err());
    faults.free();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let back = loop {
        if let Ok(back) = outbox.pending("s", 10) {
            break back;
        }
        assert!(std::time::Instant::now() < deadline, "never reopened");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(back.len(), 2);
    assert_eq!(outbox.generation(), generation + 1);
    assert_eq!(outbox.depth("s").unwrap(), 2);
    // Numbers are not handed out twice: the failed commit's stays used.
    outbox.commit(&sinks, &events(4..=4), None).unwrap();
    let seqs: Vec<u64> = outbox
        .pending("s", 10)
        .unwrap()
        .iter()
        .map(|s| s.seq)
        .collect();
    assert_eq!(seqs, [0, 1, 3]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_restart_new_events_are_delivered_even_once_the_old_backlog_has_left_the_outbox() {
    let dir = tempfile::tempdir().unwrap();
    {
        let outbox = Outbox::open(dir.path(), 100, false).unwrap();
        outbox
            .commit(&["s".to_owned()], &events(1..=3), None)
            .unwrap();
    }
    // The next start: the backlog is delivered and removed before anything new is stored,
    // so the new events must not be numbered as if the queue had always been empty.
    let sink = RecordingSink::new();
    let (fanout, outbox, _faults, _released) = start_on_faults(dir.path(), &sink);
    until("the backlog delivered and removed", || {
        sink.delivered().len() == 3 && outbox.depth("s").unwrap() == 0
    })
    .await;
    fanout.publish(&events(4..=5), None).await.unwrap();
    until("the new events delivered", || sink.delivered().len() >= 5).await;
    fanout.shutdown(Duration::from_secs(5)).await;
    assert_eq!(ids(&sink.delivered()), ["1", "2", "3", "4", "5"]);
}

/// What reading a backlog back left free in malloc's arenas goes back to the kernel once the
/// backlog is drained (not only now and then while it drains), and events delivered from
/// memory, as an agent that keeps up delivers them, never pay for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_backlog_gives_its_memory_back_and_events_delivered_from_memory_do_not() {
    if !crate::arenas::in_a_process_of_its_own(
        "fanout::tests_handover::a_drained_backlog_gives_its_memory_back_and_events_delivered_from_memory_do_not",
    ) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    {
        let outbox = Outbox::open(dir.path(), 1000, false).unwrap();
        outbox
            .commit(&["s".to_owned()], &events(1..=300), None)
            .unwrap();
    }
    let before = crate::arenas::given_back();
    let sink = RecordingSink::new();
    let (fanout, outbox, _faults, _released) = start_on_faults(dir.path(), &sink);
    until("the backlog delivered and removed", || {
        sink.delivered().len() == 300 && outbox.depth("s").unwrap() == 0
    })
    .await;
    // Whether or not its reads gave back now and then (the pace allows one per 250 ms).
    until("the drained backlog's memory given back", || {
        crate::arenas::given_back().now > before.now
    })
    .await;
    let drained = crate::arenas::given_back();
    for i in 301..=303 {
        // Longer than the pace between two: one on this path would not be held back by it.
        tokio::time::sleep(crate::arenas::GIVE_BACK_EVERY + Duration::from_millis(50)).await;
        fanout.publish(&events(i..=i), None).await.unwrap();
        until("the new event delivered", || sink.delivered().len() == i).await;
    }
    fanout.shutdown(Duration::from_secs(5)).await;
    assert_eq!(
        crate::arenas::given_back(),
        drained,
        "events delivered from memory gave memory back"
    );
}
