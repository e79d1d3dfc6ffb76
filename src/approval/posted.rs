//! The approvals this process saw accepted, kept in memory beside their durable marks.

use std::collections::HashMap;

/// Requests whose StartRequests POST the metadata service accepted in this process, with the
/// EventIds it named, until their outcome is recorded: a redelivery is answered `accepted`
/// from here even when the durable mark could not be written (a disk fault), rather than
/// checked again and refused once its event is over. At most [`PostedHere::MAX`] (the oldest
/// go first): past that the outcome records are failing to be written for long.
#[derive(Default)]
pub(super) struct PostedHere(std::sync::Mutex<Posted>);

/// How many were inserted, and per request id: its insertion's number, what the request
/// said, and the EventIds its POST named.
type Posted = (u64, HashMap<String, (u64, String, Vec<String>)>);

impl PostedHere {
    const MAX: usize = 10_000;

    pub(super) fn insert(&self, request_id: &str, content: &str, event_ids: &[String]) {
        let mut guard = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let (counter, posted) = &mut *guard;
        *counter += 1;
        posted.insert(
            request_id.to_owned(),
            (*counter, content.to_owned(), event_ids.to_vec()),
        );
        if posted.len() > Self::MAX
            && let Some(oldest) = posted
                .iter()
                .min_by_key(|(_, (order, _, _))| *order)
                .map(|(id, _)| id.clone())
        {
            posted.remove(&oldest);
        }
    }

    /// What the request said and the EventIds its POST named.
    pub(super) fn get(&self, request_id: &str) -> Option<(String, Vec<String>)> {
        let guard = self.0.lock().unwrap_or_else(|p| p.into_inner());
        guard
            .1
            .get(request_id)
            .map(|(_, content, ids)| (content.clone(), ids.clone()))
    }

    /// Their outcomes are recorded: the records answer from now on.
    pub(super) fn forget(&self, request_ids: impl Iterator<Item = String>) {
        let mut guard = self.0.lock().unwrap_or_else(|p| p.into_inner());
        for id in request_ids {
            guard.1.remove(&id);
        }
    }
}
