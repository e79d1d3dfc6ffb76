//! The embedded sinks that need no broker: [`FileSink`] appends one structured-mode CloudEvent
//! per line (JSON Lines) and fsyncs each batch before reporting it delivered; [`StdoutSink`]
//! prints events for people and pipes.

use std::io::Write;
use std::path::{Path, PathBuf};

use async_trait::async_trait;
use cloudevents::AttributesReader;
use sched_relay_transport::{Event, Sink, SinkError};
use serde::Deserialize;

/// `kind = "file"`: JSON Lines of structured-mode CloudEvents.
#[derive(Debug, Clone, Deserialize, serde::Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FileSinkConfig {
    /// Where to append. The parent directory is created if missing. The file is reopened for
    /// every batch, so logrotate's move-and-create works without a signal.
    pub path: PathBuf,
    /// fsync every batch before it counts as delivered. Turn off only for throwaway files.
    #[serde(default = "default_fsync")]
    pub fsync: bool,
}

fn default_fsync() -> bool {
    true
}

/// Appends structured CloudEvents to a file, one per line.
pub struct FileSink {
    config: FileSinkConfig,
}

impl FileSink {
    pub fn new(config: FileSinkConfig) -> Self {
        FileSink { config }
    }
}

/// Encodes a batch as JSON Lines of structured-mode CloudEvents.
pub fn encode_json_lines(batch: &[Event]) -> Result<Vec<u8>, SinkError> {
    let mut buffer = Vec::with_capacity(batch.len() * 1024);
    for event in batch {
        serde_json::to_writer(&mut buffer, event).map_err(|e| {
            SinkError::Permanent(format!(
                "event {} cannot be encoded as JSON: {e}",
                event.id()
            ))
        })?;
        buffer.push(b'\n');
    }
    Ok(buffer)
}

/// Appends bytes to a file, creating it and its directory if needed, and optionally fsyncs.
/// Reopens the file every call, so a rotated file is followed.
pub fn append(path: &Path, bytes: &[u8], fsync: bool) -> Result<(), SinkError> {
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|e| {
            SinkError::from_io(&format!("cannot create directory {}", parent.display()), &e)
        })?;
    }
    let context = || format!("cannot append to {}", path.display());
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| SinkError::from_io(&context(), &e))?;
    file.write_all(bytes)
        .map_err(|e| SinkError::from_io(&context(), &e))?;
    if fsync {
        file.sync_data()
            .map_err(|e| SinkError::from_io(&context(), &e))?;
    }
    Ok(())
}

#[async_trait]
impl Sink for FileSink {
    async fn deliver(&self, batch: &[Event]) -> Result<(), SinkError> {
        let bytes = encode_json_lines(batch)?;
        let path = self.config.path.clone();
        let fsync = self.config.fsync;
        tokio::task::spawn_blocking(move || append(&path, &bytes, fsync))
            .await
            .map_err(|e| SinkError::Retriable(format!("file writer task failed: {e}")))?
    }

    async fn health_check(&self) -> Result<(), SinkError> {
        let path = self.config.path.clone();
        tokio::task::spawn_blocking(move || append(&path, b"", false))
            .await
            .map_err(|e| SinkError::Retriable(format!("file writer task failed: {e}")))?
    }
}

/// How the stdout sink prints each event.
#[derive(Debug, Clone, Copy, Deserialize, serde::Serialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum StdoutFormat {
    /// One structured-mode CloudEvent per line (JSON Lines), for pipes.
    #[default]
    Json,
    /// Indented structured-mode JSON, for reading one event at a time.
    Pretty,
    /// One short aligned line per event, for watching a terminal.
    Summary,
}

/// `kind = "stdout"`.
#[derive(Debug, Clone, Deserialize, serde::Serialize, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct StdoutSinkConfig {
    /// `json` (default), `pretty` or `summary`.
    #[serde(default)]
    pub format: StdoutFormat,
}

/// Prints events on standard output. Logs go to standard error, so stdout stays clean.
pub struct StdoutSink {
    config: StdoutSinkConfig,
}

impl StdoutSink {
    pub fn new(config: StdoutSinkConfig) -> Self {
        StdoutSink { config }
    }
}

/// The human line of `format = "summary"`: observed time, the full `type`, the `id`, then
/// the extensions that say most at a glance, where the event has them.
pub fn summary_line(event: &Event) -> String {
    let time = event
        .time()
        .map(|t| t.format("%H:%M:%S%.3f").to_string())
        .unwrap_or_default();
    let mut line = format!("{time}  {:<44} {}", event.ty(), event.id());
    for name in [
        "eventtype",
        "eventstatus",
        "incarnation",
        "affectsvm",
        "requestid",
    ] {
        if let Some(value) = event.extension(name) {
            line.push_str(&format!("  {name}={value}"));
        }
    }
    line
}

#[async_trait]
impl Sink for StdoutSink {
    async fn deliver(&self, batch: &[Event]) -> Result<(), SinkError> {
        let bytes = match self.config.format {
            StdoutFormat::Json => encode_json_lines(batch)?,
            StdoutFormat::Pretty => {
                let mut out = Vec::new();
                for event in batch {
                    serde_json::to_writer_pretty(&mut out, event)
                        .map_err(|e| SinkError::Permanent(format!("cannot encode event: {e}")))?;
                    out.push(b'\n');
                }
                out
            }
            StdoutFormat::Summary => batch
                .iter()
                .map(|e| summary_line(e) + "\n")
                .collect::<String>()
                .into_bytes(),
        };
        // Blocking stdout is fine here: one task owns this sink, and a closed pipe must be
        // reported, not retried forever.
        let mut stdout = std::io::stdout().lock();
        stdout
            .write_all(&bytes)
            .and_then(|_| stdout.flush())
            .map_err(|e| SinkError::Permanent(format!("cannot write to stdout: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cloudevents::{EventBuilder, EventBuilderV10};

    fn event(id: &str) -> Event {
        EventBuilderV10::new()
            .id(id)
            .source("urn:sched-relay:vm:test")
            .ty("com.azure.scheduledevents.scheduled")
            .subject("E1")
            .extension("incarnation", 2i64)
            .data("application/json", serde_json::json!({"x": 1}))
            .build()
            .unwrap()
            .into()
    }

    #[tokio::test]
    async fn file_sink_appends_one_structured_event_per_line_across_batches() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nested/events.jsonl");
        let sink = FileSink::new(FileSinkConfig {
            path: path.clone(),
            fsync: true,
        });
        sink.health_check().await.unwrap();
        sink.deliver(&[event("a"), event("b")]).await.unwrap();
        sink.deliver(&[event("c")]).await.unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let ids: Vec<String> = text
            .lines()
            .map(|l| serde_json::from_str::<Event>(l).unwrap().id().to_owned())
            .collect();
        assert_eq!(ids, ["a", "b", "c"]);
    }

    #[tokio::test]
    async fn file_sink_reports_an_unwritable_path_as_not_retriable() {
        let dir = tempfile::tempdir().unwrap();
        let sink = FileSink::new(FileSinkConfig {
            path: dir.path().to_path_buf(),
            fsync: true,
        });
        let error = sink.deliver(&[event("a")]).await.unwrap_err();
        assert!(!error.is_retriable(), "{error}");
    }

    #[test]
    fn summary_line_names_transition_event_and_id() {
        let line = summary_line(&event("E1:scheduled"));
        let words: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(
            words,
            [
                "com.azure.scheduledevents.scheduled",
                "E1:scheduled",
                "incarnation=2"
            ],
            "{line}"
        );
    }
}
