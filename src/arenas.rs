//! How many malloc arenas the process allocates from. glibc's malloc gives each thread that
//! allocates its own arena, up to eight per core, and each keeps what its threads freed. The
//! coordinator at 10,000 VMs builds and drops large maps on whichever of its threads a
//! message lands: with glibc's default its peak resident set was 283-342 MiB, with two
//! arenas 215-226 MiB, at the same CPU and with decision latency within run-to-run noise
//! (`benches/profiling.md`, section 28). The agent keeps the default: its drains of a
//! backlog cost 15 % more CPU with two arenas.

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

    /// Set in the child process the test below starts.
    const CHILD: &str = "SCHED_RELAY_ARENAS_TEST_CHILD";

    #[test]
    fn a_capped_process_allocates_from_no_more_arenas_than_the_cap() {
        if std::env::var_os(CHILD).is_none() {
            // glibc fixes its arena limit once a process has made more than eight arenas,
            // and the cap is process-wide: measured in a process of its own, whatever the
            // runner (`cargo test` runs every test in one), without the environment's cap.
            let name = "arenas::tests::a_capped_process_allocates_from_no_more_arenas_than_the_cap";
            let child = std::process::Command::new(std::env::current_exe().unwrap())
                .args([name, "--exact", "--nocapture", "--test-threads=1"])
                .env(CHILD, "1")
                .env_remove("MALLOC_ARENA_MAX")
                .env_remove("GLIBC_TUNABLES")
                .output()
                .unwrap();
            let said = String::from_utf8_lossy(&child.stdout).into_owned()
                + &String::from_utf8_lossy(&child.stderr);
            assert!(child.status.success(), "the child failed:\n{said}");
            assert!(said.contains("1 passed"), "the child ran no test:\n{said}");
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
