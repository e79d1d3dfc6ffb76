//! sched-relay: watches Azure Scheduled Events, turns every change into CloudEvents and
//! delivers them to brokers, files and webhooks; approves events by local policy.
//!
//! This crate is the wiring and the I/O; the pure logic is `sched_relay_core`. The data
//! path: [`imds`] fetches a document -> `sched_relay_core::diff` finds the transitions ->
//! `sched_relay_core::event` makes CloudEvents -> [`store`] keeps them durable ->
//! [`fanout`] delivers them, one task per sink -> the sinks (`sinks/*` crates).

pub mod agent;
pub mod approval;
pub mod arenas;
pub mod config;
pub mod coordinator;
pub mod demo;
pub mod fanout;
pub mod http;
pub mod imds;
pub mod logging;
pub mod orphans;
pub mod retry;
pub mod signals;
pub mod simulator;
pub mod sinks;
pub mod store;
pub mod telemetry;
pub mod watch;

pub use agent::{AgentError, RunOptions, run};
pub use config::Config;

/// The optimisation level of the profile this binary was built with (build.rs): "s" for
/// `dist`, what ships; "0" for `release` (a quick build) and for `dev`.
pub const OPT_LEVEL: &str = if cfg!(sched_relay_opt_level = "s") {
    "s"
} else if cfg!(sched_relay_opt_level = "z") {
    "z"
} else if cfg!(sched_relay_opt_level = "1") {
    "1"
} else if cfg!(sched_relay_opt_level = "2") {
    "2"
} else if cfg!(sched_relay_opt_level = "3") {
    "3"
} else {
    "0"
};

/// Says so when this binary is not the `dist` build that ships (in practice, the `release`
/// profile's quick build: unoptimised, without the debug assertions of `dev`): it works, but
/// costs two to three times the CPU and three times the memory (docs: Development, "Build
/// profiles"). For `run` and `coordinate`, not for the demo, which is what that build is for.
pub fn warn_if_unoptimised() {
    if OPT_LEVEL != "s" && !cfg!(debug_assertions) {
        tracing::warn!(
            opt_level = OPT_LEVEL,
            "This sched-relay is not the build that ships (the quick `release` build, unoptimised, costs two to three times the CPU and three times the memory); on a VM, install the package or build with `cargo build --profile dist`"
        );
    }
}

/// Chooses the process-wide TLS crypto provider (rustls with ring, the one lapin and
/// async-nats use too) before any HTTP client is built. Cargo unifies reqwest's features
/// across the workspace, so once the webhook sink brings TLS in, every reqwest client needs
/// a provider; installing twice is harmless. Without the webhook feature there is no TLS in
/// reqwest and nothing to do.
pub fn install_crypto_provider() {
    #[cfg(feature = "webhook")]
    let _ = rustls::crypto::ring::default_provider().install_default();
}
