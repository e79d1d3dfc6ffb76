//! The signals that stop a command: SIGTERM (a supervisor) and SIGINT (Ctrl-C).

/// Completes on the first SIGINT or SIGTERM; a second one exits at once.
pub async fn shutdown() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut terminate = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut interrupt = signal(SignalKind::interrupt()).expect("SIGINT handler");
    tokio::select! {
        _ = terminate.recv() => {}
        _ = interrupt.recv() => {}
    }
    tracing::info!("Signal received, stopping (a second signal exits at once)");
    tokio::spawn(async move {
        tokio::select! {
            _ = terminate.recv() => {}
            _ = interrupt.recv() => {}
        }
        tracing::warn!("Second signal: exiting now, without draining the sinks (exit 130)");
        crate::logging::exit_now(130);
    });
}
