//! What a poll fetched: the body read (or known again), its odd fields counted and logged,
//! and the document shared with the approval checks.

use std::sync::Arc;
use std::time::Instant;

use sched_relay_core::continuity::Continuity;
use sched_relay_core::document::Document;

use super::Poller;
use crate::imds::{ImdsError, Snapshot};

/// A body the poller parsed, kept to know it again (a copy: holding the connection's buffer
/// would make it allocate a new one for every answer).
pub(crate) struct LastBody {
    body: Vec<u8>,
    /// How many odd fields it had, counted again on every fetch of it.
    odd_fields: usize,
}

/// What a poll's body turned out to be.
pub(super) enum Read {
    /// The same bytes as the last body that parsed.
    Same,
    New(sched_relay_core::document::Parsed),
}

impl Poller {
    /// A fetched body as a document, unless it is the same bytes as the last one that parsed.
    pub(super) fn read(&mut self, body: bytes::Bytes) -> Result<Read, ImdsError> {
        if self
            .last_body
            .as_ref()
            .is_some_and(|last| last.body[..] == body[..])
        {
            return Ok(Read::Same);
        }
        let parsed = self.client.parse(&body)?;
        self.last_body = Some(LastBody {
            body: body.to_vec(),
            odd_fields: parsed.warnings.len(),
        });
        Ok(Read::New(parsed))
    }

    /// Counts every odd field of every fetch, and logs them once per incarnation (again if
    /// the same incarnation comes back with other oddities).
    pub(super) fn note_odd_fields(&mut self, incarnation: u64, warnings: &[String]) {
        if warnings.is_empty() {
            return;
        }
        metrics::counter!("sched_relay_document_odd_fields_total").increment(warnings.len() as u64);
        if self
            .warned
            .as_ref()
            .is_some_and(|(seen, said)| *seen == incarnation && said == warnings)
        {
            return;
        }
        for warning in warnings {
            tracing::warn!(incarnation, warning = %warning, "Tolerated an odd field in the document (logged once per incarnation; sched_relay_document_odd_fields_total counts every fetch)");
        }
        self.warned = Some((incarnation, warnings.to_vec()));
    }

    /// The same body's odd fields, counted again (they were logged when it was first read).
    pub(super) fn note_odd_fields_again(&self) {
        if let Some(last) = &self.last_body
            && last.odd_fields > 0
        {
            metrics::counter!("sched_relay_document_odd_fields_total")
                .increment(last.odd_fields as u64);
        }
    }

    /// Tells the approval checks about the latest document (a copy only when it changed).
    /// An unchanged document only renews the fetch time, which readers see without being
    /// woken: an idle poll wakes nobody else.
    pub(super) fn share(&self, document: &Document) {
        self.latest.send_if_modified(|latest| match latest {
            Some(snapshot)
                if Continuity::of(Some(&snapshot.document), document) == Continuity::Unchanged =>
            {
                snapshot.fetched = Instant::now();
                false
            }
            _ => {
                *latest = Some(Snapshot {
                    document: Arc::new(document.clone()),
                    fetched: Instant::now(),
                });
                true
            }
        });
    }

    /// The shared document was fetched again, unchanged: its fetch time is renewed, and
    /// nobody is woken.
    pub(super) fn renew_shared(&self) {
        self.latest.send_if_modified(|latest| {
            if let Some(snapshot) = latest {
                snapshot.fetched = Instant::now();
            }
            false
        });
    }
}
