//! `[log]`: what the agent logs and in which format, and [`init`], the one place that sets
//! up `tracing` for the binary.

use serde::{Deserialize, Serialize};

/// `[log]`.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct LogConfig {
    /// A tracing filter (`info`, `sched_relay=debug,warn`); RUST_LOG wins when set.
    #[serde(default = "default_log_level")]
    pub level: String,
    #[serde(default)]
    pub format: LogFormat,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            level: default_log_level(),
            format: LogFormat::default(),
        }
    }
}

fn default_log_level() -> String {
    "info".into()
}

#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq, Default, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines on stderr.
    #[default]
    Pretty,
    /// One JSON object per line on stderr, for log shippers.
    Json,
}

impl LogConfig {
    /// Problems, as (key under `log`, message).
    pub fn validate(&self) -> Vec<(String, String)> {
        if tracing_subscriber::EnvFilter::try_new(&self.level).is_err() {
            return vec![(
                "level".into(),
                format!(
                    "{:?} is not a log filter; expected e.g. \"info\" or \"sched_relay=debug,warn\"",
                    self.level
                ),
            )];
        }
        Vec::new()
    }
}

/// How many log lines the writer may hold while stderr does not take them; past that,
/// lines are dropped (and counted) rather than blocking the agent.
const BUFFERED_LINES: usize = 4096;

static DROPPED: std::sync::OnceLock<tracing_appender::non_blocking::ErrorCounter> =
    std::sync::OnceLock::new();

/// Log lines dropped because stderr did not take them (a stalled pipe or log driver).
pub fn dropped_lines() -> usize {
    DROPPED.get().map(|c| c.dropped_lines()).unwrap_or(0)
}

/// The log writer's guard: dropping it flushes what the writer thread still holds. Kept
/// here rather than on the stack of `main`, so that an exit that skips the stack's drops (a
/// second signal's) can flush the log first.
static WRITER: std::sync::Mutex<Option<tracing_appender::non_blocking::WorkerGuard>> =
    std::sync::Mutex::new(None);

/// Flushes the log writer when dropped, waiting at most a second for a stalled stderr; hold
/// it until the program ends.
#[must_use = "dropping the guard stops the log writer"]
pub struct LogGuard(());

impl Drop for LogGuard {
    fn drop(&mut self) {
        flush();
    }
}

/// Writes out every log line the writer thread still holds (waiting at most a second for a
/// stalled stderr) and stops it: for an exit that skips the drops, as `std::process::exit`
/// does. Later lines are not written.
pub fn flush() {
    let guard = WRITER.lock().unwrap_or_else(|p| p.into_inner()).take();
    drop(guard);
}

/// Exits the process at once with `code`, writing out the log lines still queued first
/// (`std::process::exit` runs no drops, so the guard would not).
pub fn exit_now(code: i32) -> ! {
    flush();
    std::process::exit(code)
}

/// Sets up `tracing` on stderr: `filter` unless `RUST_LOG` is set, colour only for a person
/// at a terminal (journald and log files get plain text). Every line passes through
/// [`sched_relay_transport::redact`] on its way out, so a credential in a URL never reaches
/// the log, whichever crate (ours or a client library's error) put it in the message. Lines
/// are written by a thread of their own, so a stderr that blocks (a full pipe, a stalled log
/// driver) never blocks the agent: up to 4096 lines wait, later ones are dropped and counted
/// in `sched_relay_log_lines_dropped_total`.
pub fn init(filter: &str, format: LogFormat) -> LogGuard {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(filter));
    let (writer, guard) = tracing_appender::non_blocking::NonBlockingBuilder::default()
        .buffered_lines_limit(BUFFERED_LINES)
        .lossy(true)
        .thread_name("sched-relay-log")
        .finish(std::io::stderr());
    let _ = DROPPED.set(writer.error_counter());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(Redacted(writer));
    match format {
        LogFormat::Json => builder.json().flatten_event(true).init(),
        LogFormat::Pretty => builder.init(),
    }
    *WRITER.lock().unwrap_or_else(|p| p.into_inner()) = Some(guard);
    LogGuard(())
}

/// The log writer, with the credentials of every URL masked: each log event is formatted
/// whole into one buffer, redacted, then handed to the writer thread at once.
struct Redacted(tracing_appender::non_blocking::NonBlocking);

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Redacted {
    type Writer = RedactedLine;

    fn make_writer(&'a self) -> Self::Writer {
        RedactedLine(Vec::new(), self.0.clone())
    }
}

/// One log event on its way to stderr; written, redacted, when dropped.
struct RedactedLine(Vec<u8>, tracing_appender::non_blocking::NonBlocking);

impl std::io::Write for RedactedLine {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for RedactedLine {
    fn drop(&mut self) {
        let line = String::from_utf8_lossy(&self.0);
        let line = sched_relay_transport::redact::text(&line);
        // One message to the writer thread; when its queue is full the line is dropped (and
        // counted), never waited for.
        let _ = std::io::Write::write_all(&mut self.1, line.as_bytes());
    }
}
