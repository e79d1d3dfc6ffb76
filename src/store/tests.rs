//! The outbox on its own, and on a disk that fills and frees (the in-process fault injector).

use super::*;
use cloudevents::AttributesReader;
use cloudevents::{EventBuilder, EventBuilderV10};

#[test]
fn a_request_id_is_seen_once_across_reopening_until_it_expires() {
    let dir = tempfile::tempdir().unwrap();
    {
        let outbox = Outbox::open(dir.path(), 10, false).unwrap();
        assert!(outbox.remember_request("r1", 100, 50).unwrap());
        assert!(!outbox.remember_request("r1", 100, 60).unwrap());
    }
    let outbox = Outbox::open(dir.path(), 10, false).unwrap();
    assert!(
        !outbox.remember_request("r1", 100, 70).unwrap(),
        "survives a restart"
    );
    // After its keep-until time the id is forgotten (the freshness check covers it).
    assert!(outbox.remember_request("r2", 300, 200).unwrap());
    assert!(outbox.remember_request("r1", 400, 201).unwrap());
}

pub(super) fn event(id: &str) -> Event {
    EventBuilderV10::new()
        .id(id)
        .source("urn:t")
        .ty("t")
        .build()
        .unwrap()
        .into()
}

pub(super) fn ids(stored: &[Stored]) -> Vec<String> {
    stored
        .iter()
        .map(|s| s.event.as_ref().unwrap().id().to_owned())
        .collect()
}

fn processed(document: &Value) -> Processed<'_> {
    Processed { document, epoch: 0 }
}

pub(super) fn sinks(names: &[&str]) -> Vec<String> {
    names.iter().map(|n| n.to_string()).collect()
}

#[test]
fn events_wait_per_sink_in_order_until_removed_and_survive_a_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let document = serde_json::json!({"DocumentIncarnation": 3, "Events": []});
    {
        let outbox = Outbox::open(dir.path(), 100, false).unwrap();
        assert_eq!(outbox.last_document().unwrap(), None);
        outbox
            .commit(&sinks(&["a", "b"]), &[event("1"), event("2")], None)
            .unwrap();
        outbox
            .commit(
                &sinks(&["a", "b"]),
                &[event("3")],
                Some(processed(&document)),
            )
            .unwrap();
        let a = outbox.pending("a", 2).unwrap();
        assert_eq!(ids(&a), ["1", "2"]);
        outbox.remove("a", &[a[0].seq, a[1].seq]).unwrap();
    }
    let outbox = Outbox::open(dir.path(), 100, false).unwrap();
    assert_eq!(ids(&outbox.pending("a", 10).unwrap()), ["3"]);
    assert_eq!(ids(&outbox.pending("b", 10).unwrap()), ["1", "2", "3"]);
    assert_eq!(outbox.last_document().unwrap(), Some(document));
    assert_eq!(outbox.depth("b").unwrap(), 3);
}

#[test]
fn a_full_sink_overflows_alone() {
    let dir = tempfile::tempdir().unwrap();
    let outbox = Outbox::open(dir.path(), 2, false).unwrap();
    outbox
        .commit(&sinks(&["slow"]), &[event("1"), event("2")], None)
        .unwrap();
    let overflow = outbox
        .commit(&sinks(&["slow", "fast"]), &[event("3")], None)
        .unwrap();
    assert_eq!(overflow.len(), 1);
    assert_eq!(overflow[0].0, "slow");
    assert_eq!(ids(&outbox.pending("fast", 10).unwrap()), ["3"]);
}

#[test]
fn a_sink_that_emptied_takes_new_events_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let outbox = Outbox::open(dir.path(), 10, false).unwrap();
    outbox.commit(&sinks(&["s"]), &[event("1")], None).unwrap();
    let first = outbox.pending("s", 1).unwrap()[0].seq;
    outbox.remove("s", &[first]).unwrap();
    outbox.commit(&sinks(&["s"]), &[event("2")], None).unwrap();
    // Numbering starts again from 0 in an empty sink: no key can collide.
    assert_eq!(ids(&outbox.pending("s", 10).unwrap()), ["2"]);
}

#[test]
fn a_damaged_store_is_reported_and_fresh_state_moves_it_aside() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join(FILE_NAME),
        b"this is not a redb file at all, not even close",
    )
    .unwrap();
    let error = Outbox::open(dir.path(), 10, false)
        .err()
        .unwrap()
        .to_string();
    assert!(error.contains("--fresh-state"), "{error}");
    let outbox = Outbox::open(dir.path(), 10, true).unwrap();
    assert_eq!(outbox.last_document().unwrap(), None);
    let moved: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains("set-aside"))
        .collect();
    assert_eq!(moved.len(), 1, "the damaged file is kept, not deleted");
}

/// Retries `operation` every 50 ms for up to 10 s (the store reopens with backoff).
pub(super) fn eventually<T>(mut operation: impl FnMut() -> Result<T, StoreError>) -> T {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        match operation() {
            Ok(value) => return value,
            Err(error) if std::time::Instant::now() > deadline => {
                panic!("the store did not recover once the disk was freed: {error}")
            }
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(50)),
        }
    }
}

#[test]
fn a_full_disk_fails_commits_and_once_freed_the_same_process_commits_again_losing_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let faults = DiskFaults::new();
    let outbox = Outbox::open_with_faults(dir.path(), 100, faults.clone()).unwrap();
    let first = serde_json::json!({"DocumentIncarnation": 1, "Events": []});
    outbox
        .commit(&sinks(&["a", "b"]), &[event("1")], Some(processed(&first)))
        .unwrap();
    assert!(outbox.remember_request("r1", 100, 50).unwrap());

    faults.fill();
    let during = serde_json::json!({"DocumentIncarnation": 2, "Events": []});
    for _ in 0..3 {
        let error = outbox
            .commit(&sinks(&["a", "b"]), &[event("2")], Some(processed(&during)))
            .expect_err("a commit on a full disk fails");
        assert!(matches!(error, StoreError::Io { .. }), "{error}");
        assert!(outbox.remember_request("r2", 100, 50).is_err());
    }
    assert!(faults.refused() > 0, "the fault was hit");
    assert!(
        outbox.unwritable().is_some(),
        "the store says it cannot be written"
    );

    faults.free();
    let after = serde_json::json!({"DocumentIncarnation": 3, "Events": []});
    eventually(|| {
        outbox.commit(
            &sinks(&["a", "b"]),
            &[event("2"), event("3")],
            Some(processed(&after)),
        )
    });
    assert_eq!(outbox.unwritable(), None, "writable again");
    assert_eq!(ids(&outbox.pending("a", 10).unwrap()), ["1", "2", "3"]);
    assert_eq!(outbox.depth("b").unwrap(), 3);
    assert_eq!(outbox.last_document().unwrap(), Some(after));
    assert!(
        outbox.remember_request("r2", 100, 50).unwrap(),
        "an id whose record failed is new"
    );
    assert!(
        !outbox.remember_request("r1", 100, 50).unwrap(),
        "ids recorded before the fault are kept"
    );
    let a = outbox.pending("a", 1).unwrap();
    outbox.remove("a", &[a[0].seq]).unwrap();
    assert_eq!(ids(&outbox.pending("a", 10).unwrap()), ["2", "3"]);
}

#[test]
fn a_store_that_recovered_reopens_with_everything_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let faults = DiskFaults::new();
    {
        let outbox = Outbox::open_with_faults(dir.path(), 100, faults.clone()).unwrap();
        outbox.commit(&sinks(&["a"]), &[event("1")], None).unwrap();
        faults.fill();
        assert!(outbox.commit(&sinks(&["a"]), &[event("2")], None).is_err());
        faults.free();
        eventually(|| outbox.commit(&sinks(&["a"]), &[event("2")], None));
    }
    let outbox = Outbox::open(dir.path(), 100, false).unwrap();
    assert_eq!(ids(&outbox.pending("a", 10).unwrap()), ["1", "2"]);
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(32))]

    /// Whatever the names (prefixes of each other, empty, non-ASCII), every sink with events
    /// is listed once with its depth, and a move keeps every event, in order.
    #[test]
    fn stored_sinks_lists_every_backlog_and_a_move_keeps_every_event_in_order(
        backlogs in proptest::collection::btree_map("[ab\u{e9}]{0,3}", 1usize..4, 1..6),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let outbox = Outbox::open(dir.path(), 100, false).unwrap();
        for (sink, count) in &backlogs {
            let events: Vec<Event> = (0..*count).map(|n| event(&format!("{sink}/{n}"))).collect();
            outbox.commit(std::slice::from_ref(sink), &events, None).unwrap();
        }
        let expected: Vec<(String, usize)> = backlogs.clone().into_iter().collect();
        proptest::prop_assert_eq!(outbox.stored_sinks().unwrap(), expected);

        let mut names = backlogs.keys();
        let from = names.next().unwrap().clone();
        let to = "target".to_owned();
        let mut want = ids(&outbox.pending(&to, 100).unwrap());
        want.extend(ids(&outbox.pending(&from, 100).unwrap()));
        proptest::prop_assert_eq!(outbox.move_sink(&from, &to).unwrap(), backlogs[&from]);
        proptest::prop_assert_eq!(ids(&outbox.pending(&to, 100).unwrap()), want);
        proptest::prop_assert!(outbox.pending(&from, 100).unwrap().is_empty());
        proptest::prop_assert_eq!(outbox.depth(&to).unwrap(), backlogs[&from]);
    }
}

#[test]
fn once_the_disk_frees_small_commits_do_not_say_writable_and_a_probe_does_changing_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let faults = DiskFaults::new();
    let outbox = Outbox::open_with_faults(dir.path(), 100, faults.clone()).unwrap();
    let first = serde_json::json!({"DocumentIncarnation": 1, "Events": []});
    outbox
        .commit(
            &sinks(&["a"]),
            &[event("1"), event("2")],
            Some(processed(&first)),
        )
        .unwrap();
    faults.fill();
    // A commit of events (an approval's outcome, say, that nobody commits again) fails.
    assert!(outbox.commit(&sinks(&["a"]), &[event("3")], None).is_err());
    faults.free();
    // A sink's removals and a meta value commit after the reopen: small commits, which a
    // full disk takes too, so no proof that the next document can be stored.
    eventually(|| outbox.remove_below("a", 1));
    outbox.flush().unwrap();
    outbox.set_meta("k", &serde_json::json!(1)).unwrap();
    assert!(outbox.unwritable().is_some(), "small commits say nothing");
    // The poller, with nothing of its own to store, commits the last document again.
    outbox.probe(processed(&first));
    assert_eq!(outbox.unwritable(), None, "a commit of its size says it");
    assert_eq!(outbox.last_document().unwrap(), Some(first));
    assert_eq!(ids(&outbox.pending("a", 10).unwrap()), ["2"]);
}

#[test]
fn a_removal_that_is_not_made_durable_says_nothing_about_the_disk() {
    let dir = tempfile::tempdir().unwrap();
    let faults = DiskFaults::new();
    let outbox = Outbox::open_with_faults(dir.path(), 100, faults.clone()).unwrap();
    outbox
        .commit(&sinks(&["a"]), &[event("1"), event("2")], None)
        .unwrap();
    faults.fill();
    // Making removals durable fails (a failing fsync) ...
    assert!(outbox.flush().is_err());
    faults.free();
    // ... and a removal that is not fsync'd commits: no proof.
    eventually(|| outbox.remove_below("a", 1));
    assert!(
        outbox.unwritable().is_some(),
        "a volatile commit says nothing"
    );
    outbox.flush().unwrap();
    assert_eq!(outbox.unwritable(), None, "a durable one does");
}

#[test]
fn a_probe_with_a_document_older_than_the_stored_one_changes_nothing_and_proves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let faults = DiskFaults::new();
    let outbox = Outbox::open_with_faults(dir.path(), 100, faults.clone()).unwrap();
    let older = serde_json::json!({"DocumentIncarnation": 1, "Events": []});
    let newer = serde_json::json!({"DocumentIncarnation": 2, "Events": []});
    outbox
        .commit(&sinks(&["a"]), &[event("1")], Some(processed(&older)))
        .unwrap();
    outbox
        .commit(&sinks(&["a"]), &[event("2")], Some(processed(&newer)))
        .unwrap();
    faults.fill();
    assert!(outbox.commit(&sinks(&["a"]), &[event("3")], None).is_err());
    faults.free();
    // A probe that took its document before the newer one was stored comes late.
    outbox.probe(processed(&older));
    assert_eq!(outbox.last_document().unwrap(), Some(newer.clone()));
    assert!(outbox.unwritable().is_some(), "nothing was committed");
    outbox.probe(processed(&newer));
    assert_eq!(outbox.unwritable(), None);
    assert_eq!(outbox.last_document().unwrap(), Some(newer));
}

#[test]
fn a_probe_on_a_store_written_before_epochs_takes_the_missing_epoch_as_zero() {
    let dir = tempfile::tempdir().unwrap();
    let faults = DiskFaults::new();
    let outbox = Outbox::open_with_faults(dir.path(), 100, faults.clone()).unwrap();
    // The last document as a store of that age holds it: no epoch beside it.
    let document = serde_json::json!({"DocumentIncarnation": 4, "Events": []});
    outbox.set_meta(super::LAST_DOCUMENT, &document).unwrap();
    faults.fill();
    assert!(outbox.commit(&sinks(&["a"]), &[event("1")], None).is_err());
    faults.free();
    eventually(|| outbox.pending("a", 1));
    outbox.probe(processed(&document));
    assert_eq!(outbox.unwritable(), None);
}

/// Someone removes the file while the agent runs (a clean-up script, `rm -rf` of the state
/// dir): the open handle writes the unlinked file until an I/O error makes the store reopen
/// it, here while the disk is still full, as real disks are (growing a file takes no space,
/// writing its header does).
#[test]
fn a_state_file_removed_while_the_disk_is_full_is_made_anew_once_it_frees() {
    let dir = tempfile::tempdir().unwrap();
    let faults = DiskFaults::new();
    faults.grow_sparsely();
    let outbox = Outbox::open_with_faults(dir.path(), 100, faults.clone()).unwrap();
    let current = serde_json::json!({"DocumentIncarnation": 1, "Events": []});
    outbox
        .commit(&sinks(&["a"]), &[event("1")], Some(processed(&current)))
        .unwrap();
    std::fs::remove_file(dir.path().join(super::FILE_NAME)).unwrap();
    faults.fill();
    assert!(outbox.commit(&sinks(&["a"]), &[event("2")], None).is_err());
    let refused = faults.refused();
    // Reopens tried while the disk stays full leave nothing redb could not open later.
    let full_until = std::time::Instant::now() + std::time::Duration::from_millis(1500);
    while std::time::Instant::now() < full_until {
        assert!(outbox.last_document().is_err());
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(
        faults.refused() > refused,
        "a reopen was tried on the full disk"
    );
    faults.free();

    // The document does not change: the poller's probe with it must make the store
    // writable again, and the new file must hold that document.
    eventually(|| {
        outbox.probe(processed(&current));
        match outbox.unwritable() {
            None => Ok(()),
            Some(why) => Err(StoreError::Io {
                path: "outbox".into(),
                reason: why,
            }),
        }
    });
    assert_eq!(outbox.last_document().unwrap(), Some(current.clone()));
    outbox.commit(&sinks(&["a"]), &[event("2")], None).unwrap();
    assert_eq!(ids(&outbox.pending("a", 10).unwrap()), ["2"]);
    assert!(outbox.remember_request("r1", 100, 50).unwrap());
    drop(outbox);
    let reopened = Outbox::open(dir.path(), 100, false).unwrap();
    assert_eq!(ids(&reopened.pending("a", 10).unwrap()), ["2"]);
    assert_eq!(reopened.last_document().unwrap(), Some(current));
}

/// After a restart a sink's task delivers its backlog from the outbox (numbers 0-2) before
/// anything new is stored; then `change` is done to the file, and an I/O error makes the
/// store reopen it. New events must not take numbers the task has passed: its next removal
/// (below 3) would delete them unsent.
fn new_numbers_stay_above_a_delivered_backlog_after(change: impl FnOnce(&std::path::Path)) {
    let dir = tempfile::tempdir().unwrap();
    Outbox::open(dir.path(), 100, false)
        .unwrap()
        .commit(&sinks(&["a"]), &[event("1"), event("2"), event("3")], None)
        .unwrap();
    let faults = DiskFaults::new();
    let outbox = Outbox::open_with_faults(dir.path(), 100, faults.clone()).unwrap();
    let backlog = outbox.pending_between("a", 0, None, 10).unwrap();
    assert_eq!(backlog.iter().map(|s| s.seq).collect::<Vec<_>>(), [0, 1, 2]);
    change(&dir.path().join(super::FILE_NAME));
    faults.fill();
    assert!(outbox.set_meta("probe", &serde_json::json!(1)).is_err());
    faults.free();
    eventually(|| outbox.commit(&sinks(&["a"]), &[event("4")], None));
    let stored = outbox.pending("a", 10).unwrap();
    assert_eq!(ids(&stored), ["4"]);
    assert!(stored[0].seq >= 3, "numbered {}", stored[0].seq);
    outbox.remove_below("a", 3).unwrap();
    assert_eq!(ids(&outbox.pending("a", 10).unwrap()), ["4"]);
}

#[test]
fn a_file_made_anew_numbers_above_every_event_a_sink_has_passed() {
    new_numbers_stay_above_a_delivered_backlog_after(|path| std::fs::remove_file(path).unwrap());
}

/// Replaced by another valid store (a backup put back), which has its tables.
#[test]
fn a_replaced_state_file_numbers_above_every_event_a_sink_has_passed() {
    let other = tempfile::tempdir().unwrap();
    drop(Outbox::open(other.path(), 100, false).unwrap());
    new_numbers_stay_above_a_delivered_backlog_after(|path| {
        std::fs::remove_file(path).unwrap();
        std::fs::copy(other.path().join(super::FILE_NAME), path).unwrap();
    });
}

/// `rm -rf` of the state directory while the agent runs, and the outage ends with a small
/// commit (a sink's flush), not a probe: the directory and the file come back holding the
/// last processed document and its epoch, so a restart diffs against them.
#[test]
fn a_state_dir_removed_while_the_agent_runs_comes_back_with_the_last_document() {
    let parent = tempfile::tempdir().unwrap();
    let dir = parent.path().join("state");
    std::fs::create_dir(&dir).unwrap();
    let faults = DiskFaults::new();
    let outbox = Outbox::open_with_faults(&dir, 100, faults.clone()).unwrap();
    let current = serde_json::json!({"DocumentIncarnation": 7, "Events": []});
    let processed = Processed {
        document: &current,
        epoch: 3,
    };
    outbox
        .commit(&sinks(&["a"]), &[event("1")], Some(processed))
        .unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    faults.fill();
    assert!(outbox.set_meta("probe", &serde_json::json!(1)).is_err());
    faults.free();
    eventually(|| outbox.flush());
    assert_eq!(outbox.unwritable(), None, "writable again");
    assert_eq!(outbox.last_document().unwrap(), Some(current.clone()));
    assert_eq!(outbox.last_epoch().unwrap(), 3);
    assert!(
        !dir.join("outbox.redb.new").exists(),
        "nothing left beside it"
    );
    drop(outbox);
    let reopened = Outbox::open(&dir, 100, false).unwrap();
    assert_eq!(reopened.last_document().unwrap(), Some(current));
    assert_eq!(reopened.last_epoch().unwrap(), 3);
}

/// The file emptied in place while the agent runs (`: > outbox.redb`): the reopen makes it
/// anew rather than failing for ever on an empty file.
#[test]
fn an_emptied_state_file_is_made_anew_at_the_next_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let faults = DiskFaults::new();
    let outbox = Outbox::open_with_faults(dir.path(), 100, faults.clone()).unwrap();
    let current = serde_json::json!({"DocumentIncarnation": 1, "Events": []});
    outbox
        .commit(&sinks(&["a"]), &[event("1")], Some(processed(&current)))
        .unwrap();
    let path = dir.path().join(super::FILE_NAME);
    std::fs::remove_file(&path).unwrap();
    std::fs::write(&path, b"").unwrap();
    faults.fill();
    assert!(outbox.commit(&sinks(&["a"]), &[event("2")], None).is_err());
    faults.free();
    eventually(|| outbox.commit(&sinks(&["a"]), &[event("2")], None));
    assert_eq!(outbox.last_document().unwrap(), Some(current));
    assert_eq!(ids(&outbox.pending("a", 10).unwrap()), ["2"]);
}
