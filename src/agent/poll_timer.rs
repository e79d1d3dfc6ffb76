//! The poller's wait until its next poll: on Linux, one `timerfd` watched by the runtime's
//! reactor.
//!
//! Why not `tokio::time::sleep`: tokio's timer wheel keeps a deadline a second away in a
//! coarse level (64 ms slots) and wakes the thread once to move it to the fine level, then
//! again at the deadline: two wake-ups per poll where one is enough, and on a VM a wake-up is
//! most of what an idle poll costs (BENCHMARKS.md, "Idle polls"). A timerfd armed for the
//! deadline wakes the thread once, when it is due.
//!
//! Anywhere a timerfd cannot be had (another OS, a sandbox that refuses it) the wait falls
//! back to tokio's timer, which is only slower when idle.

use std::time::Instant;

pub(super) struct PollTimer {
    #[cfg(target_os = "linux")]
    timerfd: Option<tokio::io::unix::AsyncFd<std::os::fd::OwnedFd>>,
}

impl PollTimer {
    /// A timer for the runtime this is called on (the fd is registered with its reactor).
    pub(super) fn new() -> PollTimer {
        #[cfg(target_os = "linux")]
        {
            use rustix::time::{TimerfdClockId, TimerfdFlags, timerfd_create};
            let timerfd = timerfd_create(
                TimerfdClockId::Monotonic,
                TimerfdFlags::NONBLOCK | TimerfdFlags::CLOEXEC,
            )
            .map_err(std::io::Error::from)
            .and_then(|fd| {
                // SAFETY: the AsyncFd owns the OwnedFd the kernel just gave us; nothing else
                // has it, so it stays open and the same descriptor until the AsyncFd drops.
                unsafe {
                    tokio::io::unix::AsyncFd::register_with_interest(
                        fd,
                        tokio::io::Interest::READABLE,
                    )
                }
                .map_err(std::io::Error::from)
            });
            match timerfd {
                Ok(timerfd) => PollTimer {
                    timerfd: Some(timerfd),
                },
                Err(error) => {
                    tracing::debug!(error = %error, "No timerfd for the poll interval; using the runtime's timer");
                    PollTimer { timerfd: None }
                }
            }
        }
        #[cfg(not(target_os = "linux"))]
        PollTimer {}
    }

    /// Completes at `deadline` (at once if it has passed). Cancel-safe: a wait that is
    /// dropped leaves nothing behind that could end the next one early.
    pub(super) async fn sleep_until(&mut self, deadline: Instant) {
        #[cfg(target_os = "linux")]
        if let Some(timerfd) = &self.timerfd {
            match wait_on(timerfd, deadline).await {
                Ok(()) => return,
                Err(error) => {
                    tracing::debug!(error = %error, "The poll timerfd failed; using the runtime's timer from now on");
                    self.timerfd = None;
                }
            }
        }
        tokio::time::sleep_until(deadline.into()).await;
    }
}

#[cfg(target_os = "linux")]
async fn wait_on(
    timerfd: &tokio::io::unix::AsyncFd<std::os::fd::OwnedFd>,
    deadline: Instant,
) -> std::io::Result<()> {
    use rustix::time::{Itimerspec, TimerfdTimerFlags, Timespec, timerfd_settime};
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Ok(());
    }
    let zero = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    let due = Itimerspec {
        it_interval: zero,
        it_value: Timespec {
            tv_sec: left.as_secs().try_into().unwrap_or(i64::MAX),
            tv_nsec: left.subsec_nanos().into(),
        },
    };
    // Arming it again also resets the count of an expiry nobody read (a wait that was
    // dropped after its deadline): only this deadline can end this wait.
    timerfd_settime(timerfd, TimerfdTimerFlags::empty(), &due)?;
    loop {
        let mut ready = timerfd.readable().await?;
        let mut expirations = [0u8; 8];
        match rustix::io::read(timerfd.get_ref(), &mut expirations) {
            Ok(_) => {
                // Consumed: the next wait starts from a clear readiness, without a read that
                // finds nothing.
                ready.clear_ready();
                return Ok(());
            }
            // Readiness left over from an expiry the re-arming discarded.
            Err(rustix::io::Errno::AGAIN) => ready.clear_ready(),
            Err(error) => return Err(error.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn waits_until_the_deadline_and_no_longer() {
        let mut timer = PollTimer::new();
        for wait in [Duration::from_millis(50), Duration::from_millis(120)] {
            let started = Instant::now();
            timer.sleep_until(started + wait).await;
            let waited = started.elapsed();
            assert!(waited >= wait, "{waited:?} < {wait:?}");
            assert!(waited < wait + Duration::from_millis(500), "{waited:?}");
        }
        let started = Instant::now();
        timer.sleep_until(started - Duration::from_secs(1)).await;
        assert!(started.elapsed() < Duration::from_millis(50));
    }

    #[tokio::test]
    async fn a_dropped_wait_whose_deadline_passed_does_not_end_the_next_one_early() {
        let mut timer = PollTimer::new();
        // Armed for 10 ms and abandoned at 1 ms; the expiry comes while nobody waits.
        let _ = tokio::time::timeout(
            Duration::from_millis(1),
            timer.sleep_until(Instant::now() + Duration::from_millis(10)),
        )
        .await;
        std::thread::sleep(Duration::from_millis(30));
        let abandoned = tokio::time::timeout(
            Duration::from_millis(50),
            timer.sleep_until(Instant::now() + Duration::from_secs(3600)),
        )
        .await;
        assert!(abandoned.is_err(), "a stale expiry ended an hour's wait");
        let started = Instant::now();
        timer
            .sleep_until(started + Duration::from_millis(100))
            .await;
        assert!(started.elapsed() >= Duration::from_millis(100));
    }

    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn on_linux_the_wait_is_a_timerfd() {
        assert!(PollTimer::new().timerfd.is_some());
    }
}
