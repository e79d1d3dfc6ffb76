//! The embedded sinks that need no broker: [`FileSink`] appends one structured-mode CloudEvent
//! per line (JSON Lines) and fsyncs each batch before reporting it delivered; [`StdoutSink`]
//! prints events for people and pipes.
//!
//! A batch is appended all or nothing ([`append_to`]): a write or fsync that fails half-way (a
//! full disk) is cut off again before the error is reported, so the retried batch never
//! follows a torn line; a file that ends mid-line anyway (a crash) gets a line break first.
//! Proved with an in-process fault (`HalfWayFailingFile`) here, and on a real full tmpfs in
//! the agent's `tests/full_disk.rs`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use cloudevents::AttributesReader;
use sched_relay_transport::{DeliveryError, Event, Sink, SinkError};
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
    let context = format!("cannot append to {}", path.display());
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .read(true)
        .append(true)
        .open(path)
        .map_err(|e| SinkError::from_io(&context, &e))?;
    append_to(&mut file, bytes, fsync).map_err(|e| SinkError::from_io(&context, &e))
}

/// What [`append_to`] needs of a file opened for appending; a test puts a fault in between.
pub trait AppendTarget: Write {
    /// The file's length now.
    fn size(&self) -> std::io::Result<u64>;
    /// Cuts the file back to `len` bytes.
    fn truncate(&self, len: u64) -> std::io::Result<()>;
    /// Makes the written data durable.
    fn sync(&self) -> std::io::Result<()>;
    /// The last byte of the file, if it has any.
    fn last_byte(&self, len: u64) -> std::io::Result<Option<u8>>;
}

impl AppendTarget for std::fs::File {
    fn size(&self) -> std::io::Result<u64> {
        Ok(self.metadata()?.len())
    }
    fn truncate(&self, len: u64) -> std::io::Result<()> {
        self.set_len(len)
    }
    fn sync(&self) -> std::io::Result<()> {
        self.sync_data()
    }
    fn last_byte(&self, len: u64) -> std::io::Result<Option<u8>> {
        use std::os::unix::fs::FileExt;
        if len == 0 {
            return Ok(None);
        }
        let mut byte = [0u8];
        self.read_exact_at(&mut byte, len - 1)?;
        Ok(Some(byte[0]))
    }
}

/// Appends `bytes` to an open file, and fsyncs when asked, all or nothing: when the write or
/// the fsync fails (say ENOSPC half-way through a batch), the file is cut back to its length
/// before the write and the error returned, so the retried batch starts on a line of its own
/// instead of after a torn one. A file that already ends mid-line (a crash mid-write, or a
/// cut that failed) first gets a line break, so only that one line is torn.
pub fn append_to(file: &mut impl AppendTarget, bytes: &[u8], fsync: bool) -> std::io::Result<()> {
    if bytes.is_empty() {
        return Ok(());
    }
    let before = file.size()?;
    let torn = file.last_byte(before)?.is_some_and(|last| last != b'\n');
    let written = (|| {
        if torn {
            file.write_all(b"\n")?;
        }
        file.write_all(bytes)?;
        if fsync {
            file.sync()?;
        }
        Ok(())
    })();
    if let Err(error) = written {
        return Err(match file.truncate(before).and_then(|()| file.sync()) {
            Ok(()) => error,
            Err(cut) => std::io::Error::new(
                error.kind(),
                format!(
                    "{error}; cutting the file back to {before} bytes failed too ({cut}), so it \
                     may end in a torn line, which the next write steps past"
                ),
            ),
        });
    }
    Ok(())
}

#[async_trait]
impl Sink for FileSink {
    async fn deliver(&self, batch: &[Event]) -> Result<(), DeliveryError> {
        // One append for the batch: it is written whole or not at all, so a failure is the
        // batch's (the fan-out tries its events one by one before it dead-letters any).
        let bytes = encode_json_lines(batch)?;
        let path = self.config.path.clone();
        let fsync = self.config.fsync;
        Ok(
            tokio::task::spawn_blocking(move || append(&path, &bytes, fsync))
                .await
                .map_err(|e| SinkError::Retriable(format!("file writer task failed: {e}")))??,
        )
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
    /// Held by the write under way, until it returns: a stdout that blocks (a full pipe, a
    /// stalled container log driver) holds one blocking thread, never a runtime thread, and
    /// a retry waits for that write instead of piling up threads behind it.
    writing: Arc<tokio::sync::Mutex<()>>,
}

impl StdoutSink {
    pub fn new(config: StdoutSinkConfig) -> Self {
        StdoutSink {
            config,
            writing: Arc::default(),
        }
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
    async fn deliver(&self, batch: &[Event]) -> Result<(), DeliveryError> {
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
        let writing = self.writing.clone().lock_owned().await;
        tokio::task::spawn_blocking(move || {
            let _writing = writing;
            // A closed pipe is reported, not retried forever.
            let mut stdout = std::io::stdout().lock();
            stdout
                .write_all(&bytes)
                .and_then(|_| stdout.flush())
                .map_err(|e| SinkError::Permanent(format!("cannot write to stdout: {e}")))
        })
        .await
        .map_err(|e| SinkError::Retriable(format!("stdout writer task failed: {e}")))??;
        Ok(())
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
    async fn file_sink_holds_events_while_its_path_cannot_be_written() {
        // A path that is a directory (or read-only, or owned by someone else after a
        // logrotate): the destination's state, not the event's; retried, never dead-lettered.
        let dir = tempfile::tempdir().unwrap();
        let sink = FileSink::new(FileSinkConfig {
            path: dir.path().to_path_buf(),
            fsync: true,
        });
        let error = sink.deliver(&[event("a")]).await.unwrap_err();
        assert!(error.is_retriable(), "{error}");
    }

    /// An in-process fault injector: a file that writes only the first half of the next
    /// write, then fails it with ENOSPC, like a disk that fills mid-batch.
    struct HalfWayFailingFile {
        file: std::fs::File,
        fail_next_write: bool,
    }

    impl Write for HalfWayFailingFile {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            if self.fail_next_write {
                self.fail_next_write = false;
                self.file.write_all(&bytes[..bytes.len() / 2])?;
                return Err(std::io::Error::from_raw_os_error(28)); // ENOSPC
            }
            self.file.write(bytes)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            self.file.flush()
        }
    }

    impl AppendTarget for HalfWayFailingFile {
        fn size(&self) -> std::io::Result<u64> {
            self.file.size()
        }
        fn truncate(&self, len: u64) -> std::io::Result<()> {
            AppendTarget::truncate(&self.file, len)
        }
        fn sync(&self) -> std::io::Result<()> {
            self.file.sync()
        }
        fn last_byte(&self, len: u64) -> std::io::Result<Option<u8>> {
            self.file.last_byte(len)
        }
    }

    #[test]
    fn a_batch_that_fails_half_written_leaves_no_torn_line_and_its_retry_appends_whole_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("events.jsonl");
        append(&path, &encode_json_lines(&[event("a")]).unwrap(), true).unwrap();
        let before = std::fs::read(&path).unwrap();
        let batch = encode_json_lines(&[event("b"), event("c")]).unwrap();
        let open = || {
            std::fs::OpenOptions::new()
                .read(true)
                .append(true)
                .open(&path)
                .unwrap()
        };
        let mut failing = HalfWayFailingFile {
            file: open(),
            fail_next_write: true,
        };
        let error = append_to(&mut failing, &batch, true).unwrap_err();
        assert_eq!(
            error.raw_os_error(),
            Some(28),
            "the write error is reported"
        );
        assert_eq!(
            String::from_utf8_lossy(&std::fs::read(&path).unwrap()),
            String::from_utf8_lossy(&before),
            "the file is cut back to its length before the failed write"
        );
        // The fan-out retries the same batch: every line of the file must parse.
        append_to(&mut open(), &batch, true).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let ids: Vec<String> = text
            .lines()
            .map(|line| {
                serde_json::from_str::<Event>(line)
                    .unwrap_or_else(|e| panic!("torn line {line:?}: {e}"))
                    .id()
                    .to_owned()
            })
            .collect();
        assert_eq!(ids, ["a", "b", "c"]);
    }

    #[test]
    fn a_file_left_torn_by_a_crash_gets_a_line_break_before_the_next_batch() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("events.jsonl");
        let whole = encode_json_lines(&[event("a")]).unwrap();
        std::fs::write(&path, &whole[..whole.len() / 2]).unwrap();
        append(&path, &encode_json_lines(&[event("b")]).unwrap(), true).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2, "{text}");
        let b: Event = serde_json::from_str(lines[1]).expect("the new line stands alone");
        assert_eq!(b.id(), "b");
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
