//! Backlogs of sinks that are no longer configured. The outbox is keyed by sink name, so a
//! renamed or removed sink leaves its undelivered events behind, and no task delivers them.
//! At start [`report`] names each one (a WARN log with its depth, the gauge
//! `sched_relay_outbox_orphaned_events`, and `/events`); `sched-relay outbox` ([`run`]) lists
//! the stored sinks and dead-letters or moves a backlog while the agent is stopped.

use std::path::Path;

use crate::store::{Outbox, StoreError};

/// Stored sinks that `configured` does not name, with how many events each holds.
pub fn find(outbox: &Outbox, configured: &[String]) -> Result<Vec<(String, usize)>, StoreError> {
    Ok(outbox
        .stored_sinks()?
        .into_iter()
        .filter(|(sink, depth)| *depth > 0 && !configured.contains(sink))
        .collect())
}

/// Says, once at start, which backlogs nothing will deliver.
pub fn report(orphaned: &[(String, usize)]) {
    for (sink, depth) in orphaned {
        tracing::warn!(sink = %sink, undelivered = depth, "Events wait in the outbox for a sink that is no longer configured; nothing will deliver them. Stop the agent and run `sched-relay outbox move <sink> <new name>` (a renamed sink) or `sched-relay outbox dead-letter <sink>`");
        metrics::gauge!("sched_relay_outbox_orphaned_events", "sink" => sink.clone())
            .set(*depth as f64);
    }
}

/// What `sched-relay outbox` is asked to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutboxCommand {
    /// Every sink with events stored, its depth, and whether it is configured.
    List,
    /// Move a sink's whole backlog to `<state.dir>/dead-letter/<sink>.jsonl`.
    DeadLetter { sink: String },
    /// Append `from`'s backlog, in order, to the queue of the configured sink `to`.
    Move { from: String, to: String },
}

/// Why an `outbox` command did nothing.
#[derive(Debug)]
pub struct OutboxError {
    pub message: String,
    /// Another process (the agent) holds the state directory: `sched-relay outbox` exits 2.
    pub in_use: bool,
}

impl From<String> for OutboxError {
    fn from(message: String) -> Self {
        OutboxError {
            message,
            in_use: false,
        }
    }
}

/// Dead-lettered this many events at a time: each batch is written and fsync'd before it
/// leaves the store, so an interruption repeats at most one batch in the file.
const DEAD_LETTER_BATCH: usize = 500;

/// Runs an `outbox` command on the state store in `dir`, whose configuration names the sinks
/// `configured`; the text to print, or why not. The store must not be open elsewhere: the
/// agent has to be stopped.
pub fn run(
    dir: &Path,
    capacity: usize,
    configured: &[String],
    command: &OutboxCommand,
) -> Result<String, OutboxError> {
    let path = dir.join(crate::store::FILE_NAME);
    if !path.exists() {
        return Err(format!(
            "no state store at {} (state.dir = {:?}): nothing is stored",
            path.display(),
            dir.display().to_string()
        )
        .into());
    }
    let outbox = Outbox::open(dir, capacity, false).map_err(|e| match e {
        // Its message says to stop the agent already.
        StoreError::Locked { .. } => OutboxError {
            message: e.to_string(),
            in_use: true,
        },
        StoreError::InUse { .. } => OutboxError {
            message: format!("{e}: stop the agent first"),
            in_use: true,
        },
        other => other.to_string().into(),
    })?;
    match command {
        OutboxCommand::List => {
            let stored = outbox.stored_sinks().map_err(|e| e.to_string())?;
            if stored.is_empty() {
                return Ok("the outbox is empty\n".into());
            }
            let mut out = format!("{:<24} {:>10}  state\n", "sink", "undelivered");
            for (sink, depth) in stored {
                let state = if configured.contains(&sink) {
                    "configured"
                } else {
                    "not configured: nothing delivers it (outbox move or dead-letter)"
                };
                out.push_str(&format!("{sink:<24} {depth:>10}  {state}\n"));
            }
            Ok(out)
        }
        OutboxCommand::DeadLetter { sink } => Ok(dead_letter(&outbox, dir, sink)?),
        OutboxCommand::Move { from, to } => {
            if from == to {
                return Err(format!("cannot move sink {from:?} to itself").into());
            }
            if !configured.contains(to) {
                return Err(format!(
                    "sink {to:?} is not configured (configured: {}); its events would be orphaned again",
                    configured.join(", ")
                ).into());
            }
            let moved = outbox.move_sink(from, to).map_err(|e| e.to_string())?;
            if moved == 0 {
                return Err(format!("sink {from:?} has no events stored").into());
            }
            Ok(format!(
                "moved {moved} event(s) from {from} to the end of {to}'s queue; they are delivered at the next start\n"
            ))
        }
    }
}

fn dead_letter(outbox: &Outbox, dir: &Path, sink: &str) -> Result<String, String> {
    let reason = "dead-lettered with `sched-relay outbox dead-letter` (sink no longer delivered)";
    let mut total = 0;
    let mut file = None;
    loop {
        let batch = outbox
            .pending(sink, DEAD_LETTER_BATCH)
            .map_err(|e| e.to_string())?;
        if batch.is_empty() {
            break;
        }
        let seqs: Vec<u64> = batch.iter().map(|stored| stored.seq).collect();
        let entries: Vec<_> = batch.into_iter().map(|stored| stored.event).collect();
        let written = crate::fanout::dead_letter(dir, sink, &entries, reason).map_err(|e| {
            format!("cannot write the dead-letter file; {total} event(s) moved so far: {e}")
        })?;
        outbox.remove(sink, &seqs).map_err(|e| e.to_string())?;
        total += seqs.len();
        file = Some(written);
    }
    match file {
        None => Err(format!("sink {sink:?} has no events stored")),
        Some(file) => Ok(format!(
            "wrote {total} event(s) of {sink} to {} and removed them from the outbox\n",
            file.display()
        )),
    }
}
