//! What a poll fetched: the body read (or known again), its odd fields counted and logged,
//! and the document shared with the approval checks.

use std::sync::Arc;
use std::time::Instant;

use sched_relay_core::continuity::Continuity;
use sched_relay_core::document::{Document, Parsed};

use super::Poller;
use crate::imds::{ImdsError, Snapshot};

/// A body the poller parsed, kept to know it again: a copy, as large as the body, made once
/// per change (holding the connection's buffer instead would make it allocate a new one for
/// every answer).
pub(crate) struct LastBody {
    body: Vec<u8>,
    /// How many odd fields it had, counted again on every fetch of it.
    odd_fields: usize,
}

impl LastBody {
    /// `body` as a document, unless it is the same bytes as `last`, the last body that
    /// parsed (which it then replaces). A body refused is not kept: refused again next time.
    pub(super) fn read(
        last: &mut Option<LastBody>,
        body: &[u8],
        parse: impl FnOnce(&[u8]) -> Result<Parsed, ImdsError>,
    ) -> Result<Read, ImdsError> {
        if last.as_ref().is_some_and(|last| last.body[..] == *body) {
            return Ok(Read::Same);
        }
        let parsed = parse(body)?;
        *last = Some(LastBody {
            body: body.to_vec(),
            odd_fields: parsed.warnings.len(),
        });
        Ok(Read::New(parsed))
    }
}

/// What a poll's body turned out to be.
pub(super) enum Read {
    /// The same bytes as the last body that parsed.
    Same,
    New(Parsed),
}

impl Poller {
    /// A fetched body as a document, unless it is the same bytes as the last one that parsed.
    pub(super) fn read(&mut self, body: bytes::Bytes) -> Result<Read, ImdsError> {
        let client = &self.client;
        LastBody::read(&mut self.last_body, &body, |body| client.parse(body))
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

    /// Tells the approval checks about the latest document (shared, not copied, when it
    /// changed). An unchanged document only renews the fetch time, which readers see without
    /// being woken: an idle poll wakes nobody else.
    pub(super) fn share(&self, document: &Arc<Document>) {
        self.latest.send_if_modified(|latest| match latest {
            Some(snapshot)
                if Continuity::of(Some(&snapshot.document), document) == Continuity::Unchanged =>
            {
                snapshot.fetched = Instant::now();
                false
            }
            _ => {
                *latest = Some(Snapshot {
                    document: document.clone(),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(body: &[u8]) -> Result<Parsed, ImdsError> {
        Document::parse(body).map_err(|error| ImdsError::Malformed {
            url: "u".into(),
            error,
        })
    }

    fn read(last: &mut Option<LastBody>, body: &str) -> &'static str {
        match LastBody::read(last, body.as_bytes(), parse) {
            Ok(Read::Same) => "same",
            Ok(Read::New(_)) => "new",
            Err(_) => "refused",
        }
    }

    const A: &str = r#"{"DocumentIncarnation":1,"Events":[]}"#;
    const B: &str = r#"{"DocumentIncarnation":2,"Events":[]}"#;
    /// A's document, in other bytes.
    const A_SPACED: &str = r#"{"DocumentIncarnation": 1, "Events": []}"#;
    const MALFORMED: &str = r#"{"DocumentIncarnation":"x","Events":[]}"#;

    #[test]
    fn only_the_bytes_of_the_last_document_that_parsed_are_known_again() {
        let mut last = None;
        let seen: Vec<_> = [
            A, A, B, A, A_SPACED, A_SPACED, MALFORMED, MALFORMED, A_SPACED, MALFORMED, A,
        ]
        .iter()
        .map(|body| read(&mut last, body))
        .collect();
        assert_eq!(
            seen,
            [
                "new", "same", "new", "new", "new", "same", "refused", "refused", "same",
                "refused", "new"
            ]
        );
    }

    #[test]
    fn a_body_known_again_counts_the_odd_fields_it_had() {
        let odd = r#"{"DocumentIncarnation":1,"Events":[{"EventId":"E1","EventType":"Reboot","ResourceType":"VirtualMachine","Resources":"vm","EventStatus":"Scheduled","NotBefore":""}]}"#;
        let mut last = None;
        let Ok(Read::New(parsed)) = LastBody::read(&mut last, odd.as_bytes(), parse) else {
            panic!("refused");
        };
        assert!(!parsed.warnings.is_empty());
        assert_eq!(last.as_ref().unwrap().odd_fields, parsed.warnings.len());
        assert!(matches!(
            LastBody::read(&mut last, odd.as_bytes(), parse),
            Ok(Read::Same)
        ));
    }
}
