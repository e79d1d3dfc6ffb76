//! malloc's arenas: how many the process allocates from, and handing back what they hold
//! free. glibc's malloc gives each thread that allocates its own arena, up to eight per core,
//! and each keeps what its threads freed. The coordinator at 10,000 VMs builds and drops
//! large maps on whichever of its threads a message lands: with glibc's default its peak
//! resident set was 283-342 MiB, with two arenas 215-226 MiB, at the same CPU and with
//! decision latency within run-to-run noise (`benches/profiling.md`, section 28). The agent
//! keeps the default: its drains of a backlog cost 15 % more CPU with two arenas. Instead,
//! while it reads a backlog back and once it has drained one, it hands the pages its arenas
//! hold free back to the kernel (section 33), which glibc does by itself only for free memory
//! at the top of a heap.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The arenas the coordinator allocates from.
pub const COORDINATOR_ARENAS: i32 = 2;

/// Caps glibc's malloc arenas at `arenas`, unless the environment already sets a cap
/// (`MALLOC_ARENA_MAX`, or `glibc.malloc.arena_max` in `GLIBC_TUNABLES`), which wins. To be
/// called before the process starts a thread (arenas already made stay). True when it set
/// the cap; false when the environment has one, or off glibc.
pub fn limit(arenas: i32) -> bool {
    if set_by_environment(|name| std::env::var_os(name)) {
        return false;
    }
    set_cap(arenas)
}

/// Whether the environment caps the arenas itself.
fn set_by_environment(var: impl Fn(&str) -> Option<std::ffi::OsString>) -> bool {
    var("MALLOC_ARENA_MAX").is_some()
        || var("GLIBC_TUNABLES").is_some_and(|tunables| {
            tunables
                .to_string_lossy()
                .contains("glibc.malloc.arena_max")
        })
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn set_cap(arenas: i32) -> bool {
    // SAFETY: mallopt only sets a parameter of malloc's, under malloc's own lock.
    unsafe { libc::mallopt(libc::M_ARENA_MAX, arenas) == 1 }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn set_cap(_arenas: i32) -> bool {
    false
}

/// How often at most the agent hands free memory back while it reads a backlog back.
pub const GIVE_BACK_EVERY: Duration = Duration::from_millis(250);

static GIVE_BACK: Pacer = Pacer::new(GIVE_BACK_EVERY);
static GIVEN_BACK_PACED: AtomicU64 = AtomicU64::new(0);
static GIVEN_BACK_NOW: AtomicU64 = AtomicU64::new(0);

/// Hands back to the kernel the pages that malloc's arenas hold free (`malloc_trim`, on
/// glibc; elsewhere nothing), unless a call did less than [`GIVE_BACK_EVERY`] ago; with
/// `now`, whatever the last call. It walks every arena, holding each one's lock while it
/// does (threads allocating from that arena wait), so it belongs on a blocking thread after
/// work that freed much (a batch read back from the outbox), never on an idle path. True
/// when it ran.
pub fn give_back(now: bool) -> bool {
    if !GIVE_BACK.due(since_start(), now) {
        return false;
    }
    trim();
    let count = if now {
        &GIVEN_BACK_NOW
    } else {
        &GIVEN_BACK_PACED
    };
    count.fetch_add(1, Ordering::Relaxed);
    true
}

/// How many times [`give_back`] ran in this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GivenBack {
    /// Paced (`now` false).
    pub paced: u64,
    /// Asked for `now`.
    pub now: u64,
}

/// The counts of [`give_back`] so far.
pub fn given_back() -> GivenBack {
    GivenBack {
        paced: GIVEN_BACK_PACED.load(Ordering::Relaxed),
        now: GIVEN_BACK_NOW.load(Ordering::Relaxed),
    }
}

/// Milliseconds since the first call (the pacer's clock: monotonic).
fn since_start() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_millis() as u64
}

/// Lets one call through per period, across threads.
struct Pacer {
    every: u64,
    /// One more than the millisecond of the last call let through; 0: none yet.
    last: AtomicU64,
}

impl Pacer {
    const fn new(every: Duration) -> Pacer {
        Pacer {
            every: every.as_millis() as u64,
            last: AtomicU64::new(0),
        }
    }

    /// Whether a call at `now` (ms) goes through: always with `force`, else when none went
    /// through in the last period (of calls at once, one). A call whose clock was read
    /// before another's went through never moves the period back.
    fn due(&self, now: u64, force: bool) -> bool {
        if force {
            self.last.fetch_max(now + 1, Ordering::Relaxed);
            return true;
        }
        let last = self.last.load(Ordering::Relaxed);
        if last != 0 && now < last - 1 + self.every {
            return false;
        }
        self.last
            .compare_exchange(last, now + 1, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    }
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn trim() {
    // SAFETY: malloc_trim takes each arena's lock in turn; it frees nothing in use.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn trim() {}

/// Set in the child process that [`in_a_process_of_its_own`] starts.
#[cfg(test)]
const CHILD: &str = "SCHED_RELAY_ARENAS_TEST_CHILD";

/// Runs test `name` again in a process of its own, without the environment's malloc
/// settings, and says whether this is that process (the test's body runs there). Arenas,
/// their caps and the count of give-backs are process-wide, and `cargo test` runs every
/// test in one process.
#[cfg(test)]
pub(crate) fn in_a_process_of_its_own(name: &str) -> bool {
    if std::env::var_os(CHILD).is_some() {
        return true;
    }
    let mut command = std::process::Command::new(std::env::current_exe().unwrap());
    command
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        // glibc's own settings (`MALLOC_ARENA_MAX`, `MALLOC_TRIM_THRESHOLD_`, ...), and any
        // allocator put in its place.
        .env_remove("GLIBC_TUNABLES")
        .env_remove("LD_PRELOAD");
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("MALLOC_") {
            command.env_remove(name);
        }
    }
    let child = command.output().unwrap();
    let said = String::from_utf8_lossy(&child.stdout).into_owned()
        + &String::from_utf8_lossy(&child.stderr);
    assert!(child.status.success(), "the child failed:\n{said}");
    assert!(said.contains("1 passed"), "the child ran no test:\n{said}");
    false
}

#[cfg(test)]
mod pacer_tests {
    use super::*;

    #[test]
    fn one_give_back_per_period_unless_forced() {
        let pacer = Pacer::new(Duration::from_millis(250));
        assert!(pacer.due(0, false), "the first goes through");
        assert!(!pacer.due(0, false));
        assert!(!pacer.due(249, false));
        assert!(pacer.due(250, false), "a period later");
        assert!(!pacer.due(300, false));
        assert!(pacer.due(300, true), "forced: a drain ended");
        assert!(
            !pacer.due(549, false),
            "a forced one starts the period again"
        );
        assert!(pacer.due(550, false));
        assert!(
            pacer.due(500, true),
            "a forced call with an older clock goes through"
        );
        assert!(!pacer.due(799, false), "and does not move the period back");
        assert!(pacer.due(800, false));
    }
}

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    use std::ffi::OsString;

    use super::*;

    /// How many arenas malloc has made so far (its `malloc_info` report has a `<heap>` each).
    fn arenas_made() -> usize {
        let mut buffer: *mut libc::c_char = std::ptr::null_mut();
        let mut size: libc::size_t = 0;
        // SAFETY: open_memstream hands back a stream writing to a buffer it allocates; it is
        // closed before the buffer is read, copied, and freed, once.
        let report = unsafe {
            let stream = libc::open_memstream(&mut buffer, &mut size);
            assert!(!stream.is_null(), "open_memstream failed");
            assert_eq!(libc::malloc_info(0, stream), 0, "malloc_info failed");
            libc::fclose(stream);
            let text = std::slice::from_raw_parts(buffer as *const u8, size).to_vec();
            libc::free(buffer.cast());
            String::from_utf8(text).unwrap()
        };
        report.matches("<heap nr=").count()
    }

    /// Eight threads allocating at once, each holding its memory until all have some.
    fn allocate_on_eight_threads() {
        let barrier = std::sync::Arc::new(std::sync::Barrier::new(8));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let barrier = barrier.clone();
                std::thread::spawn(move || {
                    let held: Vec<Vec<u8>> = (0..64).map(|i| vec![i as u8; 1024]).collect();
                    barrier.wait();
                    std::hint::black_box(held);
                })
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
    }

    #[test]
    fn a_capped_process_allocates_from_no_more_arenas_than_the_cap() {
        // glibc fixes its arena limit once a process has made more than eight arenas.
        if !in_a_process_of_its_own(
            "arenas::tests::a_capped_process_allocates_from_no_more_arenas_than_the_cap",
        ) {
            return;
        }
        assert!(limit(COORDINATOR_ARENAS), "mallopt refused the cap");
        let before = arenas_made();
        allocate_on_eight_threads();
        let made = arenas_made();
        assert!(
            made <= before.max(COORDINATOR_ARENAS as usize),
            "{made} arenas after eight threads allocated ({before} before), with a cap of {COORDINATOR_ARENAS}"
        );
    }

    /// The process's resident set, in KiB.
    fn resident_kib() -> u64 {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    }

    #[test]
    fn memory_freed_in_the_middle_of_the_arenas_goes_back_to_the_kernel_when_given_back() {
        if !in_a_process_of_its_own(
            "arenas::tests::memory_freed_in_the_middle_of_the_arenas_goes_back_to_the_kernel_when_given_back",
        ) {
            return;
        }
        // Four threads (four arenas) each allocate 16 MiB in 1 KiB pieces and free 15 of
        // every 16: the free memory lies between pieces still in use, where free() leaves
        // it resident, as a drain's decoded batches and the store's pages leave it.
        let kept: Vec<Vec<Vec<u8>>> = (0..4)
            .map(|_| {
                std::thread::spawn(|| {
                    let pieces: Vec<Vec<u8>> =
                        (0..16 * 1024).map(|i| vec![i as u8; 1024]).collect();
                    pieces.into_iter().step_by(16).collect::<Vec<_>>()
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|thread| thread.join().unwrap())
            .collect();
        let before = resident_kib();
        assert!(give_back(true));
        let after = resident_kib();
        assert!(
            after + 32 * 1024 < before,
            "resident {before} KiB before giving back, {after} KiB after: less than 32 of the 60 MiB freed went back"
        );
        assert_eq!(given_back(), GivenBack { paced: 0, now: 1 });
        drop(std::hint::black_box(kept));
    }

    #[test]
    fn an_operators_own_arena_setting_wins() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(key, _)| *key == name)
                    .map(|(_, value)| OsString::from(value))
            }
        };
        assert!(!set_by_environment(env(&[])));
        assert!(!set_by_environment(env(&[(
            "GLIBC_TUNABLES",
            "glibc.malloc.tcache_count=0"
        )])));
        assert!(set_by_environment(env(&[("MALLOC_ARENA_MAX", "8")])));
        assert!(set_by_environment(env(&[(
            "GLIBC_TUNABLES",
            "glibc.malloc.check=0:glibc.malloc.arena_max=4"
        )])));
    }
}
