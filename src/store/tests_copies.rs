//! Each event stored once for every sink ([`super::payloads`]): what each sink reads, and how
//! long a copy lives, under any mix of commits, deliveries, moves and restarts; and a store of
//! the earlier format, converted.

use std::collections::{BTreeMap, BTreeSet};

use cloudevents::AttributesReader;
use proptest::prelude::*;

use super::tests::{event, eventually};
use super::*;

fn read(outbox: &Outbox, sink: &str) -> Vec<(u64, String)> {
    outbox
        .pending(sink, usize::MAX)
        .unwrap()
        .into_iter()
        .map(|s| (s.seq, s.event.unwrap().id().to_owned()))
        .collect()
}

const SINKS: [&str; 3] = ["amqp", "kafka", "nats"];
const CAPACITY: usize = 6;

#[derive(Debug, Clone)]
enum Step {
    /// A document with this many events, for these sinks (by index).
    Commit(usize, Vec<usize>),
    /// A sink's task delivered its oldest `n`.
    DeliverOldest(usize, usize),
    /// A sink's events at these positions in its queue dead-lettered.
    DeadLetter(usize, Vec<usize>),
    /// One sink's backlog moved to another.
    Move(usize, usize),
    Restart,
}

fn step() -> impl Strategy<Value = Step> {
    let sink = 0..SINKS.len();
    prop_oneof![
        4 => (1usize..5, prop::collection::vec(sink.clone(), 1..4))
            .prop_map(|(n, sinks)| Step::Commit(n, sinks)),
        3 => (sink.clone(), 1usize..5).prop_map(|(s, n)| Step::DeliverOldest(s, n)),
        1 => (sink.clone(), prop::collection::vec(0usize..6, 1..3))
            .prop_map(|(s, at)| Step::DeadLetter(s, at)),
        1 => (sink.clone(), sink).prop_map(|(a, b)| Step::Move(a, b)),
        1 => Just(Step::Restart),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Whatever happens, each sink reads exactly the events it was given and has not
    /// delivered, in order; and the file holds one copy of each event some sink still
    /// holds, and no other (nothing lost, nothing kept for ever).
    #[test]
    fn each_sink_reads_its_own_events_and_a_copy_lives_while_a_queue_names_it(
        steps in prop::collection::vec(step(), 1..40),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let mut outbox = Outbox::open(dir.path(), CAPACITY, false).unwrap();
        let mut model: BTreeMap<&str, Vec<String>> = BTreeMap::new();
        let mut next_id = 0;
        for step in steps {
            match step {
                Step::Commit(n, chosen) => {
                    let names: Vec<String> = chosen
                        .iter()
                        .collect::<BTreeSet<_>>()
                        .into_iter()
                        .map(|&i| SINKS[i].to_owned())
                        .collect();
                    let events: Vec<Event> = (0..n)
                        .map(|k| event(&format!("e{}", next_id + k)))
                        .collect();
                    next_id += n;
                    let overflow = outbox.commit(&names, &events, None).unwrap();
                    for name in &names {
                        let queue = model.entry(SINKS.iter().find(|s| *s == name).unwrap()).or_default();
                        let room = CAPACITY.saturating_sub(queue.len()).min(n);
                        queue.extend(events[..room].iter().map(|e| e.id().to_owned()));
                        let spilled: Vec<_> = overflow.iter().filter(|(s, _)| s == name).map(|(_, e)| e.id().to_owned()).collect();
                        let expected: Vec<_> = events[room..].iter().map(|e| e.id().to_owned()).collect();
                        prop_assert_eq!(spilled, expected);
                    }
                }
                Step::DeliverOldest(sink, n) => {
                    let name = SINKS[sink];
                    let pending = read(&outbox, name);
                    if let Some((seq, _)) = pending.get(n.min(pending.len()).saturating_sub(1)) {
                        outbox.remove_below(name, seq + 1).unwrap();
                        model.entry(name).or_default().drain(..n.min(pending.len()));
                    }
                }
                Step::DeadLetter(sink, at) => {
                    let name = SINKS[sink];
                    let pending = read(&outbox, name);
                    let chosen: BTreeSet<usize> = at.into_iter().filter(|&i| i < pending.len()).collect();
                    let seqs: Vec<u64> = chosen.iter().map(|&i| pending[i].0).collect();
                    outbox.remove(name, &seqs).unwrap();
                    let queue = model.entry(name).or_default();
                    for &i in chosen.iter().rev() {
                        queue.remove(i);
                    }
                }
                Step::Move(from, to) => {
                    outbox.move_sink(SINKS[from], SINKS[to]).unwrap();
                    if from != to {
                        let moved = model.remove(SINKS[from]).unwrap_or_default();
                        model.entry(SINKS[to]).or_default().extend(moved);
                    }
                }
                Step::Restart => {
                    outbox.flush().unwrap();
                    drop(outbox);
                    outbox = Outbox::open(dir.path(), CAPACITY, false).unwrap();
                }
            }
            for name in SINKS {
                let ids: Vec<String> = read(&outbox, name).into_iter().map(|(_, id)| id).collect();
                let expected = model.get(name).cloned().unwrap_or_default();
                prop_assert_eq!(ids, expected, "sink {}", name);
            }
            // A copy for each event some queue holds, and a count only where more than one
            // row names it: the count (or its absence) says how many rows do.
            let mut held: BTreeMap<&String, u64> = BTreeMap::new();
            for id in model.values().flatten() {
                *held.entry(id).or_default() += 1;
            }
            let shared = held.values().filter(|&&rows| rows > 1).count() as u64;
            prop_assert_eq!(outbox.copies_held(), (held.len() as u64, shared));
            let (counted, named) = outbox.holders_counted_and_named();
            prop_assert_eq!(counted, named);
        }
    }
}

#[test]
fn a_store_of_the_earlier_format_is_converted_keeping_every_event_and_its_number() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = |id: &str| serde_json::to_vec(&event(id)).unwrap();
    {
        // A store as 0.x wrote it: one copy of each event per sink, and a document.
        let db = redb::Database::create(dir.path().join(FILE_NAME)).unwrap();
        Outbox::write_legacy_rows(
            &db,
            &[
                ("nats", 7, bytes("a")),
                ("nats", 8, bytes("b")),
                ("amqp", 3, bytes("a")),
                ("amqp", 4, b"not json".to_vec()),
            ],
        );
        let txn = db.begin_write().unwrap();
        txn.open_table(META)
            .unwrap()
            .insert(
                LAST_DOCUMENT,
                br#"{"DocumentIncarnation": 5, "Events": []}"#.as_slice(),
            )
            .unwrap();
        txn.commit().unwrap();
    }
    let outbox = Outbox::open(dir.path(), 100, false).unwrap();
    assert_eq!(read(&outbox, "nats"), [(7, "a".into()), (8, "b".into())]);
    let amqp = outbox.pending("amqp", 10).unwrap();
    assert_eq!(amqp[0].seq, 3);
    assert_eq!(amqp[1].seq, 4);
    assert!(
        amqp[1].event.is_err(),
        "an unreadable event stays unreadable, kept"
    );
    assert_eq!(outbox.depth("nats").unwrap(), 2);
    assert_eq!(
        outbox.last_document().unwrap().unwrap()["DocumentIncarnation"],
        5
    );
    // New events number on from the converted ones, their copies apart from them.
    outbox
        .commit(&["nats".to_owned(), "amqp".to_owned()], &[event("c")], None)
        .unwrap();
    assert_eq!(read(&outbox, "nats")[2], (9, "c".to_owned()));
    assert_eq!(
        outbox.copies_held(),
        (5, 1),
        "a count only for the copy two rows name"
    );
    outbox.remove_below("nats", 10).unwrap();
    outbox.remove_below("amqp", 10).unwrap();
    assert_eq!(outbox.copies_held(), (0, 0), "nothing left behind");
    drop(outbox);
    // Converted once: opened again, nothing comes back.
    let outbox = Outbox::open(dir.path(), 100, false).unwrap();
    assert!(read(&outbox, "nats").is_empty());
    assert_eq!(outbox.stored_sinks().unwrap(), []);
}

fn legacy_rows(
    sink: &'static str,
    seqs: std::ops::Range<u64>,
) -> Vec<(&'static str, u64, Vec<u8>)> {
    seqs.map(|seq| {
        (
            sink,
            seq,
            serde_json::to_vec(&event(&format!("{sink}{seq}"))).unwrap(),
        )
    })
    .collect()
}

#[test]
fn a_conversion_cut_short_by_a_crash_goes_on_at_the_next_open_losing_nothing() {
    let dir = tempfile::tempdir().unwrap();
    {
        let db = redb::Database::create(dir.path().join(FILE_NAME)).unwrap();
        Outbox::write_legacy_rows(&db, &legacy_rows("nats", 0..8));
        // The process converting it dies after its first transaction.
        assert_eq!(payloads::convert_legacy_batch(&db, 0).unwrap(), Some(3));
    }
    let outbox = Outbox::open(dir.path(), 100, false).unwrap();
    let expected: Vec<(u64, String)> = (0..8).map(|seq| (seq, format!("nats{seq}"))).collect();
    assert_eq!(read(&outbox, "nats"), expected);
    assert_eq!(outbox.copies_held(), (8, 0), "one copy each, none twice");
}

#[test]
fn events_an_earlier_version_stored_after_a_conversion_go_after_those_converted_before() {
    let dir = tempfile::tempdir().unwrap();
    {
        // Converted, with `nats` holding 9..12; then an earlier version ran on it, numbered
        // `nats` from 0 in its own table, and this version opens it again.
        let outbox = Outbox::open(dir.path(), 100, false).unwrap();
        let first: Vec<Event> = (0..12).map(|i| event(&format!("new{i}"))).collect();
        let nats = ["nats".to_owned()];
        outbox.commit(&nats, &first, None).unwrap();
        outbox.remove_below("nats", 9).unwrap();
        outbox.flush().unwrap();
    }
    {
        let db = redb::Database::create(dir.path().join(FILE_NAME)).unwrap();
        Outbox::write_legacy_rows(&db, &legacy_rows("nats", 0..5));
    }
    let outbox = Outbox::open(dir.path(), 100, false).unwrap();
    let mut expected: Vec<(u64, String)> = (9..12).map(|i| (i, format!("new{i}"))).collect();
    expected.extend((0..5).map(|i| (12 + i, format!("nats{i}"))));
    assert_eq!(
        read(&outbox, "nats"),
        expected,
        "nothing overwritten, the older first"
    );
    assert_eq!(outbox.copies_held(), (8, 0));
}

#[test]
fn a_file_of_an_earlier_version_put_in_place_while_running_numbers_above_the_sinks_tasks() {
    let dir = tempfile::tempdir().unwrap();
    let faults = DiskFaults::new();
    let outbox = Outbox::open_with_faults(dir.path(), 100, faults.clone()).unwrap();
    let nats = ["nats".to_owned()];
    let first: Vec<Event> = (0..6).map(|i| event(&format!("new{i}"))).collect();
    outbox.commit(&nats, &first, None).unwrap();
    // The sink's task read them all (it stands at 6) ...
    assert_eq!(outbox.pending("nats", 10).unwrap().len(), 6);
    // ... when a copy of an earlier version's store replaced the file, and a full disk made
    // the agent reopen it.
    let staged = dir.path().join("staged.redb");
    {
        let db = redb::Database::create(&staged).unwrap();
        Outbox::write_legacy_rows(&db, &legacy_rows("nats", 0..2));
    }
    std::fs::rename(&staged, dir.path().join(FILE_NAME)).unwrap();
    faults.fill();
    assert!(outbox.commit(&nats, &[event("x")], None).is_err());
    faults.free();
    let after: Vec<(u64, String)> = eventually(|| outbox.pending("nats", usize::MAX))
        .into_iter()
        .map(|s| (s.seq, s.event.unwrap().id().to_owned()))
        .collect();
    assert_eq!(
        after,
        [(7, "nats0".to_owned()), (8, "nats1".to_owned())],
        "above the task's position (and the failed commit's 6), so it reads them"
    );
}

#[test]
fn a_conversion_the_disk_has_no_room_for_loses_nothing_and_finishes_at_the_next_open() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(FILE_NAME);
    {
        let db = redb::Database::create(&path).unwrap();
        Outbox::write_legacy_rows(&db, &legacy_rows("nats", 0..8));
    }
    let faults = DiskFaults::new();
    {
        let db = recovery::open_database_with(redb::Builder::new(), &path, Some(&faults), false)
            .unwrap();
        faults.fill();
        assert!(payloads::convert_legacy_events(&db, 0).is_err());
        assert!(faults.refused() > 0, "the fault was hit");
    }
    faults.free();
    let outbox = Outbox::open_with_faults(dir.path(), 100, faults).unwrap();
    let expected: Vec<(u64, String)> = (0..8).map(|seq| (seq, format!("nats{seq}"))).collect();
    assert_eq!(read(&outbox, "nats"), expected);
    assert_eq!(outbox.copies_held(), (8, 0));
}

#[test]
fn copies_that_a_store_of_the_last_release_counted_once_leave_with_their_last_holder() {
    // The last release wrote a count for every copy, 1 where one queue held it; this one
    // writes counts only for shared copies. A store it wrote must read the same.
    let dir = tempfile::tempdir().unwrap();
    let both = ["nats".to_owned(), "amqp".to_owned()];
    {
        let outbox = Outbox::open(dir.path(), 100, false).unwrap();
        outbox
            .commit(&both[..1], &[event("alone"), event("also-alone")], None)
            .unwrap();
        outbox.commit(&both, &[event("shared")], None).unwrap();
        assert_eq!(outbox.copies_held(), (3, 1));
        outbox.flush().unwrap();
    }
    let db = redb::Database::create(dir.path().join(FILE_NAME)).unwrap();
    Outbox::count_every_copy(&db);
    drop(db);
    let outbox = Outbox::open(dir.path(), 100, false).unwrap();
    assert_eq!(
        outbox.copies_held(),
        (3, 3),
        "every copy counted, as before"
    );
    let (counted, named) = outbox.holders_counted_and_named();
    assert_eq!(counted, named);
    outbox.remove_below("nats", 1).unwrap();
    assert_eq!(
        outbox.copies_held(),
        (2, 2),
        "the first copy went with its only holder"
    );
    outbox.remove_below("amqp", u64::MAX).unwrap();
    let (counted, named) = outbox.holders_counted_and_named();
    assert_eq!(
        counted, named,
        "the shared copy's count now says one holder"
    );
    assert_eq!(
        read(&outbox, "nats")
            .into_iter()
            .map(|(_, id)| id)
            .collect::<Vec<_>>(),
        ["also-alone", "shared"]
    );
    outbox.remove_below("nats", u64::MAX).unwrap();
    assert_eq!(outbox.copies_held(), (0, 0), "nothing left behind");
}

#[test]
fn a_count_left_at_a_reused_copy_id_does_not_keep_a_lone_copy_for_ever() {
    // No release leaves one, but a file edited by hand might: a lone copy stored at that
    // id must still leave with its one holder.
    let dir = tempfile::tempdir().unwrap();
    let nats = ["nats".to_owned()];
    drop(Outbox::open(dir.path(), 100, false).unwrap());
    let db = redb::Database::create(dir.path().join(FILE_NAME)).unwrap();
    Outbox::write_count(&db, 0, 3);
    drop(db);
    let outbox = Outbox::open(dir.path(), 100, false).unwrap();
    outbox.commit(&nats, &[event("lone")], None).unwrap();
    assert_eq!(outbox.copies_held(), (1, 0), "the stored copy has no count");
    outbox.remove_below("nats", u64::MAX).unwrap();
    assert_eq!(outbox.copies_held(), (0, 0), "nothing left behind");
}
