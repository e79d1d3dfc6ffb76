//! A store file replaced while the agent runs by another store's, holding events: they are
//! delivered after everything the sinks' tasks have passed, in their order, never removed
//! unsent. A copy of this very store keeps its numbers.

use super::tests::{event, eventually, ids, sinks};
use super::*;

/// A sink's task has delivered this store's events 0-2 (its position is 3); then `put_back`
/// replaces the file, and an I/O error makes the store reopen it.
fn replaced_under_a_task_at_3(put_back: impl FnOnce(&Path)) -> (tempfile::TempDir, Outbox) {
    let dir = tempfile::tempdir().unwrap();
    let faults = DiskFaults::new();
    let outbox = Outbox::open_with_faults(dir.path(), 100, faults.clone()).unwrap();
    outbox
        .commit(&sinks(&["a"]), &[event("1"), event("2"), event("3")], None)
        .unwrap();
    let backlog = outbox.pending_between("a", 0, None, 10).unwrap();
    assert_eq!(backlog.iter().map(|s| s.seq).collect::<Vec<_>>(), [0, 1, 2]);
    put_back(&dir.path().join(FILE_NAME));
    faults.fill();
    assert!(outbox.set_meta("probe", &serde_json::json!(1)).is_err());
    faults.free();
    eventually(|| outbox.flush());
    (dir, outbox)
}

#[test]
fn another_stores_events_put_back_while_the_agent_runs_are_delivered_after_what_it_passed() {
    // Another store (another VM's backup, or a state moved aside) with four events for `a`,
    // numbered 0-3, and one for `b`.
    let other = tempfile::tempdir().unwrap();
    {
        let backup = Outbox::open(other.path(), 100, false).unwrap();
        let events = [event("x1"), event("x2"), event("x3"), event("x4")];
        backup.commit(&sinks(&["a"]), &events, None).unwrap();
        backup.commit(&sinks(&["b"]), &[event("y1")], None).unwrap();
    }
    let (_dir, outbox) = replaced_under_a_task_at_3(|path| {
        std::fs::remove_file(path).unwrap();
        std::fs::copy(other.path().join(FILE_NAME), path).unwrap();
    });
    // The task reads on from its position, and removes below it: nothing of the file is lost.
    let next = outbox.pending_between("a", 3, None, 10).unwrap();
    assert_eq!(ids(&next), ["x1", "x2", "x3", "x4"], "in their order");
    assert!(
        next.iter().all(|s| s.seq >= 3),
        "{:?}",
        next.iter().map(|s| s.seq).collect::<Vec<_>>()
    );
    outbox.remove_below("a", 3).unwrap();
    assert_eq!(
        ids(&outbox.pending("a", 10).unwrap()),
        ["x1", "x2", "x3", "x4"]
    );
    assert_eq!(ids(&outbox.pending("b", 10).unwrap()), ["y1"]);
    // New events come after them.
    outbox.commit(&sinks(&["a"]), &[event("5")], None).unwrap();
    assert_eq!(
        ids(&outbox.pending("a", 10).unwrap()),
        ["x1", "x2", "x3", "x4", "5"]
    );
    // The file is this store's now: a later reopen moves nothing again.
    drop(outbox);
    let reopened = Outbox::open(_dir.path(), 100, false).unwrap();
    assert_eq!(
        ids(&reopened.pending("a", 10).unwrap()),
        ["x1", "x2", "x3", "x4", "5"]
    );
}

#[test]
fn a_backup_of_this_store_put_back_keeps_its_numbers() {
    // Copied while the task stood at 0: its events 0-2 were delivered since.
    let backup = tempfile::NamedTempFile::new().unwrap();
    let (_dir, outbox) = replaced_under_a_task_at_3(|path| {
        std::fs::copy(path, backup.path()).unwrap();
        std::fs::remove_file(path).unwrap();
        std::fs::copy(backup.path(), path).unwrap();
    });
    // Below the task's position: delivered already, so removed, not sent again.
    assert!(outbox.pending_between("a", 3, None, 10).unwrap().is_empty());
    outbox.remove_below("a", 3).unwrap();
    assert!(outbox.pending("a", 10).unwrap().is_empty());
}

/// The file was lost while the agent ran (made anew, a new store), then last night's backup
/// of it is put back: its events are numbered again above the task's position, so those it
/// had not delivered are delivered (those it had, again: at least once), never removed.
#[test]
fn a_backup_from_before_the_file_was_made_anew_is_numbered_again() {
    let backup = tempfile::NamedTempFile::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let faults = DiskFaults::new();
    let outbox = Outbox::open_with_faults(dir.path(), 100, faults.clone()).unwrap();
    let path = dir.path().join(FILE_NAME);
    outbox
        .commit(&sinks(&["a"]), &[event("1"), event("2"), event("3")], None)
        .unwrap();
    outbox.flush().unwrap();
    std::fs::copy(&path, backup.path()).unwrap();
    // The task delivers all three (position 3), then the file is lost and made anew.
    assert_eq!(outbox.pending_between("a", 0, None, 10).unwrap().len(), 3);
    std::fs::remove_file(&path).unwrap();
    faults.fill();
    assert!(outbox.set_meta("probe", &serde_json::json!(1)).is_err());
    faults.free();
    eventually(|| outbox.flush());
    // The backup is put back under the running agent.
    std::fs::remove_file(&path).unwrap();
    std::fs::copy(backup.path(), &path).unwrap();
    faults.fill();
    assert!(outbox.set_meta("probe", &serde_json::json!(2)).is_err());
    faults.free();
    eventually(|| outbox.flush());
    let next = outbox.pending_between("a", 3, None, 10).unwrap();
    assert_eq!(ids(&next), ["1", "2", "3"], "delivered again, not removed");
    outbox.remove_below("a", 3).unwrap();
    assert_eq!(ids(&outbox.pending("a", 10).unwrap()), ["1", "2", "3"]);
}

/// `rm -rf` of the state directory while the agent runs takes its lock file with it: the
/// reopen that makes the directory anew locks it again, so a second agent is still refused.
#[test]
fn the_state_directory_is_locked_again_once_it_is_made_anew() {
    let parent = tempfile::tempdir().unwrap();
    let dir = parent.path().join("state");
    let faults = DiskFaults::new();
    let outbox = Outbox::open_with_faults(&dir, 100, faults.clone()).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    faults.fill();
    assert!(outbox.set_meta("probe", &serde_json::json!(1)).is_err());
    faults.free();
    eventually(|| outbox.flush());
    assert!(
        matches!(StateLock::take(&dir), Err(StoreError::Locked { .. })),
        "a second process could lock the directory made anew"
    );
    drop(outbox);
    assert!(StateLock::take(&dir).is_ok(), "released with the store");
}
