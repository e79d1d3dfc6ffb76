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

/// Sets up `tracing` on stderr: `filter` unless `RUST_LOG` is set, colour only for a person
/// at a terminal (journald and log files get plain text). Every line passes through
/// [`sched_relay_transport::redact`] on its way out, so a credential in a URL never reaches
/// the log, whichever crate (ours or a client library's error) put it in the message.
pub fn init(filter: &str, format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(filter));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(RedactedStderr);
    match format {
        LogFormat::Json => builder.json().flatten_event(true).init(),
        LogFormat::Pretty => builder.init(),
    }
}

/// Stderr, with the credentials of every URL masked: each log event is formatted whole into
/// one buffer, redacted, then written at once.
struct RedactedStderr;

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for RedactedStderr {
    type Writer = RedactedLine;

    fn make_writer(&'a self) -> Self::Writer {
        RedactedLine(Vec::new())
    }
}

/// One log event on its way to stderr; written, redacted, when dropped.
struct RedactedLine(Vec<u8>);

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
        // Like tracing's own stderr writer: a log line that cannot be written is dropped.
        let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
    }
}
