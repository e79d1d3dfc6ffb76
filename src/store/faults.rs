//! An in-process fault injector for the state store: a redb `StorageBackend` over the real
//! file that fails every write, sync and resize with ENOSPC while [`DiskFaults::fill`] is on,
//! as a full disk does, and passes everything through once [`DiskFaults::free`] is called;
//! and that holds every sync while [`DiskFaults::hold_syncs`] is on, as a slow disk does.
//! Tests (and rehearsals) use it to prove the store survives a full disk without restarting
//! the process; production opens the file without it.

use std::ops::Bound;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use redb::backends::FileBackend;
use redb::{BackendError, StorageBackend};

/// The switch of a simulated full disk, shared by the test and every backend opened on it
/// (the store reopens its file after a failure, and the new backend must see the same disk).
#[derive(Debug, Default)]
pub struct DiskFaults {
    full: AtomicBool,
    refused: AtomicU64,
    syncs_held: AtomicBool,
    panic_at_sync: AtomicBool,
    sparse: AtomicBool,
}

impl DiskFaults {
    pub fn new() -> Arc<DiskFaults> {
        Arc::default()
    }

    /// From now on every write, sync and resize fails with ENOSPC.
    pub fn fill(&self) {
        self.full.store(true, Ordering::SeqCst);
    }

    /// From now on growing a file succeeds while the disk is full, as `ftruncate` does on
    /// ext4 and tmpfs (the space is taken when written); writes and syncs still fail.
    pub fn grow_sparsely(&self) {
        self.sparse.store(true, Ordering::SeqCst);
    }

    /// Space is back: writes pass through again.
    pub fn free(&self) {
        self.full.store(false, Ordering::SeqCst);
    }

    /// From now on every sync waits until [`DiskFaults::release_syncs`] (a commit is then
    /// written but not durable, as on a slow disk).
    pub fn hold_syncs(&self) {
        self.syncs_held.store(true, Ordering::SeqCst);
    }

    /// The next sync panics, as code inside a commit that asserts would (once).
    pub fn panic_at_next_sync(&self) {
        self.panic_at_sync.store(true, Ordering::SeqCst);
    }

    /// Syncs go through again, held ones first.
    pub fn release_syncs(&self) {
        self.syncs_held.store(false, Ordering::SeqCst);
    }

    fn wait_while_syncs_held(&self) {
        while self.syncs_held.load(Ordering::SeqCst) {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    /// How many operations were refused so far (to show a test really hit the fault).
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::SeqCst)
    }

    fn check(&self) -> Result<(), std::io::Error> {
        if self.full.load(Ordering::SeqCst) {
            self.refused.fetch_add(1, Ordering::SeqCst);
            return Err(std::io::Error::from_raw_os_error(28)); // ENOSPC
        }
        Ok(())
    }
}

/// redb's own file backend, with [`DiskFaults`] in front of every write.
#[derive(Debug)]
pub(super) struct FaultInjectingBackend {
    file: FileBackend,
    faults: Arc<DiskFaults>,
}

impl FaultInjectingBackend {
    pub(super) fn open(
        path: &std::path::Path,
        faults: Arc<DiskFaults>,
        create: bool,
    ) -> Result<Self, redb::DatabaseError> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(create)
            .truncate(false)
            .open(path)?;
        if !create && file.metadata()?.len() == 0 {
            // As redb's `Builder::open`: an empty file is initialised only when creating.
            return Err(std::io::Error::other(
                "the database file is empty and creating one was not asked for",
            )
            .into());
        }
        Ok(FaultInjectingBackend {
            file: FileBackend::new(file)?,
            faults,
        })
    }
}

impl StorageBackend for FaultInjectingBackend {
    fn len(&self) -> Result<u64, std::io::Error> {
        self.file.len()
    }
    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), std::io::Error> {
        self.file.read(offset, out)
    }
    fn set_len(&self, len: u64) -> Result<(), std::io::Error> {
        if !self.faults.sparse.load(Ordering::SeqCst) {
            self.faults.check()?;
        }
        self.file.set_len(len)
    }
    fn sync_data(&self) -> Result<(), std::io::Error> {
        self.faults.wait_while_syncs_held();
        if self.faults.panic_at_sync.swap(false, Ordering::SeqCst) {
            panic!("a panic injected at a sync of the state store");
        }
        self.faults.check()?;
        self.file.sync_data()
    }
    fn write(&self, offset: u64, data: &[u8]) -> Result<(), std::io::Error> {
        self.faults.check()?;
        self.file.write(offset, data)
    }
    fn close(&self) -> Result<(), std::io::Error> {
        self.file.close()
    }
    fn try_lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<bool, BackendError> {
        self.file.try_lock_range(start, end)
    }
    fn try_lock_shared_range(
        &self,
        start: Bound<u64>,
        end: Bound<u64>,
    ) -> Result<bool, BackendError> {
        self.file.try_lock_shared_range(start, end)
    }
    fn lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.file.lock_range(start, end)
    }
    fn lock_shared_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.file.lock_shared_range(start, end)
    }
    fn unlock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.file.unlock_range(start, end)
    }
    fn query_lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<bool, BackendError> {
        self.file.query_lock_range(start, end)
    }
}
