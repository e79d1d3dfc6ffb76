//! A fault injector for tests, never set in production: with the environment variable
//! `SCHEDRELAY_FAULT_ABORT` set to `approval_after_post`, `approval_after_post_mark` or
//! `approval_after_outcome`, the agent aborts (as a kill -9 would end it) right after a
//! StartRequests POST succeeded and before it is marked posted, right after that mark and
//! before its outcome is stored, or right after the outcome is stored and recorded and before
//! the message is acknowledged. `tests/approval_faults.rs` uses it to prove that no approval is
//! lost at either step. (Not `SCHED_RELAY_*`: those are configuration keys.)

use std::sync::OnceLock;

/// The environment variable that arms the injector.
pub const ENV: &str = "SCHEDRELAY_FAULT_ABORT";

/// Where the agent may be made to abort.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Point {
    AfterPost,
    AfterPostMark,
    AfterOutcome,
    /// The checker panics on its next batch (not an abort).
    CheckerPanic,
}

fn armed() -> Option<Point> {
    static ARMED: OnceLock<Option<Point>> = OnceLock::new();
    *ARMED.get_or_init(|| match std::env::var(ENV).ok()?.as_str() {
        "approval_after_post" => Some(Point::AfterPost),
        "approval_after_post_mark" => Some(Point::AfterPostMark),
        "approval_checker_panic" => Some(Point::CheckerPanic),
        "approval_after_outcome" => Some(Point::AfterOutcome),
        other => {
            tracing::error!(value = other, "{ENV} is set to an unknown point; ignored");
            None
        }
    })
}

/// Panics at `point` when the injector is armed there.
pub fn panic_if(point: Point) {
    if armed() == Some(point) {
        panic!("fault injector {ENV}: panicking at {point:?}");
    }
}

/// Aborts the process at `point` when the injector is armed there.
pub fn abort_if(point: Point) {
    if armed() == Some(point) {
        eprintln!("fault injector {ENV}: aborting at {point:?}");
        std::process::abort();
    }
}
