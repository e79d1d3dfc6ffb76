//! The five checks a request passes before anything is sent, in order: format,
//! authenticity, freshness, targeting, state (see the module documentation of `approval`).

use std::sync::Arc;

use chrono::Utc;
use sched_relay_core::approval::{
    FLEET_TARGET, Reason, Rejection, Request, canonical, decode_base64, parse,
};
use sched_relay_core::document::{Document, EventStatus};
use sched_relay_transport::inbound::Inbound;

use super::{Approver, Verdict};
use crate::store::{Seen, StoredOutcome};

/// What the freshness check learned from the store about a fresh request.
struct Fresh {
    /// Recorded in flight by this check or an earlier one: finish it with its outcome.
    recorded: bool,
    /// Handled before without an outcome (the agent stopped after the POST, or the POST
    /// failed): an event that has Started since counts as approved.
    resumed: bool,
    /// Handled before, and the metadata service accepted its POST of these EventIds: the
    /// outcome is `accepted`, whatever the event's state now.
    posted: Option<Vec<String>>,
}

/// How long a handled request's record outlives its freshness window: a redelivery after a
/// long restart (a VM that rebooted for the very event it approved) is still answered with its
/// outcome, not refused as expired.
const RECORD_RETENTION: chrono::Duration = chrono::Duration::days(1);

/// Why the checks stopped before the end.
enum Stop {
    /// The request is refused for what it is.
    Reject(Rejection),
    /// The agent could not check it (its state store cannot be written, or the metadata
    /// service has not answered yet): a retriable failure (reason code, detail), never a
    /// rejection.
    Fail(&'static str, String),
    /// The request was handled before, with this outcome (a redelivery, or a replay).
    Answered(StoredOutcome),
    /// The request was forwarded and accepted before, its outcome never published: the
    /// EventIds its POST named.
    Posted(Vec<String>),
}

impl From<Rejection> for Stop {
    fn from(rejection: Rejection) -> Self {
        Stop::Reject(rejection)
    }
}

impl Approver {
    /// Runs the checks on one message. Returns the request id (or a made-up one for
    /// messages without a readable id), its EventIds and the verdict. EventIds match the
    /// document case-insensitively (a GUID that went through .NET `Guid` comes back
    /// lower-cased); a valid request's EventIds are returned in the document's spelling, which
    /// is what the StartRequests POST and the outcome event carry.
    #[cfg(test)]
    pub(super) async fn check(
        &self,
        message: &Inbound,
        document: &mut Option<Arc<Document>>,
    ) -> (String, Vec<String>, Verdict, bool) {
        let (request_id, event_ids, verdict, recorded, _) =
            self.check_with_content(message, document).await;
        (request_id, event_ids, verdict, recorded)
    }

    /// As [`Approver::check`], with what the request says ([`content_of`]; None for a bare
    /// body or a message that could not be read).
    pub(super) async fn check_with_content(
        &self,
        message: &Inbound,
        document: &mut Option<Arc<Document>>,
    ) -> (String, Vec<String>, Verdict, bool, Option<String>) {
        let made_up = || {
            format!(
                "unidentified:{}:{:016x}",
                message.transport,
                fastrand::u64(..)
            )
        };
        let request = match parse(message, &self.limits) {
            Ok(request) => request,
            Err((rejection, id)) => {
                return (
                    id.unwrap_or_else(made_up),
                    Vec::new(),
                    Verdict::Reject(rejection),
                    false,
                    None,
                );
            }
        };
        let request_id = request.id().map(str::to_owned).unwrap_or_else(made_up);
        let mut event_ids = request.event_ids.clone();
        let content = content_of(&request);
        if message.shared
            && let Some(target) = request.vm_name()
            && target != FLEET_TARGET
            && !target.eq_ignore_ascii_case(&self.factory.vm.name)
        {
            return (
                request_id,
                event_ids,
                Verdict::Skip(format!("addressed to {target}")),
                false,
                content,
            );
        }
        let mut recorded = false;
        let checked = self.checks(&request, content.as_deref(), document, &mut recorded);
        let verdict = match checked.await {
            Ok(spelled) => {
                event_ids = spelled;
                Verdict::Valid
            }
            Err(Stop::Reject(rejection)) => Verdict::Reject(rejection),
            Err(Stop::Fail(reason, detail)) => Verdict::Fail(reason, detail),
            Err(Stop::Answered(stored)) => Verdict::Answered(stored),
            Err(Stop::Posted(posted)) => {
                // The outcome names what was approved, not what this copy says (an earlier
                // version's record kept no EventIds).
                if !posted.is_empty() {
                    event_ids = posted;
                }
                Verdict::Posted
            }
        };
        (request_id, event_ids, verdict, recorded, content)
    }

    /// The checks in order; when all pass, the EventIds as the document spells them.
    /// `content` is what the request says ([`content_of`]). `recorded` turns true once the
    /// request id is recorded in flight.
    async fn checks(
        &self,
        request: &Request,
        content: Option<&str>,
        document: &mut Option<Arc<Document>>,
        recorded: &mut bool,
    ) -> Result<Vec<String>, Stop> {
        self.authenticity(request)?;
        let fresh = self.freshness(request, content.unwrap_or_default()).await?;
        *recorded = fresh.recorded;
        if let Some(posted) = fresh.posted {
            return Err(Stop::Posted(posted));
        }
        self.targeting(request)?;
        let document = match document {
            Some(document) => document.clone(),
            None => document.insert(self.latest_document().await?).clone(),
        };
        Ok(self.state(request, &document, fresh.resumed)?)
    }

    fn authenticity(&self, request: &Request) -> Result<(), Rejection> {
        let unsigned = |what: &str| {
            Rejection::new(
                Reason::Unsigned,
                format!(
                    "{what}; unsigned requests are accepted only with approvals.allow_unsigned = true"
                ),
            )
        };
        let Some(attributes) = &request.cloud_event else {
            return if self.config.allow_unsigned {
                Ok(())
            } else {
                Err(unsigned("a bare StartRequests body carries no signature"))
            };
        };
        let Some(signature) = &attributes.signature else {
            return if self.config.allow_unsigned {
                Ok(())
            } else {
                Err(unsigned("the request has no signature extension"))
            };
        };
        let key_id = attributes.key_id.as_deref().ok_or_else(|| {
            Rejection::new(
                Reason::UnknownKey,
                "the request is signed but names no keyid",
            )
        })?;
        let key = self.keys.get(key_id).ok_or_else(|| {
            Rejection::new(
                Reason::UnknownKey,
                format!("keyid {key_id:?} is not one of approvals.keys"),
            )
        })?;
        let signature = decode_base64(signature)
            .ok_or_else(|| Rejection::new(Reason::BadSignature, "the signature is not base64"))?;
        let canonical = canonical(
            &attributes.id,
            &attributes.source,
            attributes.time.timestamp(),
            attributes.vm_name.as_deref(),
            &request.event_ids,
        );
        if key.verify(canonical.as_bytes(), &signature) {
            Ok(())
        } else {
            Err(Rejection::new(
                Reason::BadSignature,
                format!(
                    "the signature does not match the request with key {key_id:?} (was anything changed on the way, or signed with another key?)"
                ),
            ))
        }
    }

    async fn freshness(&self, request: &Request, content: &str) -> Result<Fresh, Stop> {
        // A bare body has neither time nor id: only allow_unsigned lets it this far.
        let Some(attributes) = &request.cloud_event else {
            return Ok(Fresh {
                recorded: false,
                resumed: false,
                posted: None,
            });
        };
        // What the request says, signed or not (`content`): its record keeps it, and a
        // request that reuses the id with other content is not answered from that record.
        // A POST this process saw accepted is answered accepted whatever the store holds
        // now: its durable mark (or the whole record) may have been lost to a disk fault,
        // and the event may be over; checked before the age, as a stored record is.
        if let Some((said, event_ids)) = self.posted.get(&attributes.id) {
            if said != content {
                return Err(altered(&attributes.id).into());
            }
            tracing::info!(request_id = %attributes.id, "A request the metadata service accepted in this run, its outcome not recorded: answering accepted, nothing sent again");
            return Ok(Fresh {
                recorded: true,
                resumed: true,
                posted: Some(event_ids),
            });
        }
        let store_error = |error: String| {
            // Without a durable record a replay could not be recognised later, so nothing is
            // sent; but the request was not replayed: it fails, and may be sent again.
            Stop::Fail(
                "state_store_error",
                format!(
                    "cannot record the request id in the state store, so nothing was sent; send \
                     the request again once the store is writable: {error}"
                ),
            )
        };
        // A request handled before is answered from its record whatever its age: the age
        // limit keeps out replays of requests never seen, and a redelivery after a long
        // restart is no replay.
        let outbox = self.outbox.clone();
        let id = attributes.id.clone();
        let at = Utc::now().timestamp();
        let said = content.to_owned();
        let known = tokio::task::spawn_blocking(move || outbox.peek_request(&id, &said, at))
            .await
            .map_err(|e| e.to_string())
            .and_then(|result| result.map_err(|e| e.to_string()))
            .map_err(store_error)?;
        let now = Utc::now();
        let max_age =
            chrono::Duration::from_std(self.config.max_age).unwrap_or(chrono::Duration::MAX);
        if known.is_none() {
            let age = now.signed_duration_since(attributes.time);
            let skew =
                chrono::Duration::from_std(self.config.clock_skew).unwrap_or(chrono::Duration::MAX);
            if age > max_age {
                return Err(Rejection::new(
                    Reason::Expired,
                    format!(
                        "time {} is {}s old; at most {}s (approvals.max_age)",
                        attributes.time,
                        age.num_seconds(),
                        max_age.num_seconds()
                    ),
                )
                .into());
            }
            if -age > skew {
                return Err(Rejection::new(
                    Reason::FromTheFuture,
                    format!(
                        "time {} is {}s ahead of this VM's clock; at most {}s (approvals.clock_skew)",
                        attributes.time,
                        (-age).num_seconds(),
                        skew.num_seconds()
                    ),
                )
                .into());
            }
        }
        let keep_until = attributes
            .time
            .checked_add_signed(max_age)
            .and_then(|t| t.checked_add_signed(RECORD_RETENTION))
            .map_or(i64::MAX, |t| t.timestamp() + 1);
        let outbox = self.outbox.clone();
        let id = attributes.id.clone();
        let now = now.timestamp();
        let content = content.to_owned();
        let seen = tokio::task::spawn_blocking(move || {
            outbox.begin_request(&id, &content, keep_until, now)
        })
        .await
        .map_err(|e| e.to_string())
        .and_then(|result| result.map_err(|e| e.to_string()))
        .map_err(store_error)?;
        match seen {
            Seen::New => Ok(Fresh {
                recorded: true,
                resumed: false,
                posted: None,
            }),
            Seen::Posted { event_ids } => {
                tracing::info!(request_id = %attributes.id, "A request the metadata service accepted before, its outcome never published: answering accepted, nothing sent again");
                Ok(Fresh {
                    recorded: true,
                    resumed: true,
                    posted: Some(event_ids),
                })
            }
            Seen::InFlight => {
                tracing::info!(request_id = %attributes.id, "A request handled before without a recorded outcome (a restart, or a failed POST); checking and forwarding it again");
                Ok(Fresh {
                    recorded: true,
                    resumed: true,
                    posted: None,
                })
            }
            Seen::Finished(stored) => Err(Stop::Answered(stored)),
            Seen::Replayed => Err(Rejection::new(
                Reason::Replayed,
                format!("request id {:?} was already handled", attributes.id),
            )
            .into()),
            Seen::Altered => Err(altered(&attributes.id).into()),
        }
    }

    fn targeting(&self, request: &Request) -> Result<(), Rejection> {
        let me = &self.factory.vm.name;
        match request.vm_name() {
            None => Ok(()),
            Some(target) if target.eq_ignore_ascii_case(me) => Ok(()),
            Some(FLEET_TARGET) if self.config.allow_fleet => Ok(()),
            Some(FLEET_TARGET) => Err(Rejection::new(
                Reason::WrongTarget,
                "the request is for the whole fleet (vmname \"*\"); that needs approvals.allow_fleet = true",
            )),
            Some(target) => Err(Rejection::new(
                Reason::WrongTarget,
                format!("the request is for VM {target:?}, and this is {me:?}"),
            )),
        }
    }

    /// Every EventId is in `document` (compared ignoring case) and Scheduled (or Started,
    /// when `resumed`: this request, handled before a crash, may have started it); returns
    /// them in the document's spelling.
    fn state(
        &self,
        request: &Request,
        document: &Document,
        resumed: bool,
    ) -> Result<Vec<String>, Rejection> {
        let mut spelled = Vec::with_capacity(request.event_ids.len());
        for event_id in &request.event_ids {
            let found = document.event(event_id).or_else(|| {
                document
                    .events
                    .iter()
                    .find(|event| event.id.eq_ignore_ascii_case(event_id))
            });
            let Some(event) = found else {
                return Err(Rejection::new(
                    Reason::UnknownEvent,
                    format!(
                        "EventId {event_id} is not in the current document (incarnation {}): unknown, or already over",
                        document.incarnation
                    ),
                ));
            };
            match &event.status {
                EventStatus::Scheduled => {}
                EventStatus::Started if resumed => {}
                EventStatus::Started => {
                    return Err(Rejection::new(
                        Reason::EventStarted,
                        format!("EventId {event_id} has already Started"),
                    ));
                }
                other => {
                    return Err(Rejection::new(
                        Reason::EventNotScheduled,
                        format!("EventId {event_id} is {}, not Scheduled", other.as_str()),
                    ));
                }
            }
            if request.vm_name().is_none() && !event.affects(&self.factory.vm.name) {
                return Err(Rejection::new(
                    Reason::NotAffected,
                    format!(
                        "the request names no VM, and EventId {event_id} does not list this VM in Resources"
                    ),
                ));
            }
            spelled.push(event.id.clone());
        }
        Ok(spelled)
    }

    /// The poller's document when it is fresher than one poll interval; else a new fetch.
    /// Without any document (the metadata service has not answered since the start), the
    /// request fails retriably: nothing is known yet that could refuse it.
    async fn latest_document(&self) -> Result<Arc<Document>, Stop> {
        let cached = self.latest.borrow().clone();
        if let Some(snapshot) = &cached
            && snapshot.fetched.elapsed() <= self.poll_interval
        {
            return Ok(snapshot.document.clone());
        }
        match self.client.fetch().await {
            Ok(parsed) => Ok(Arc::new(parsed.document)),
            Err(error) => match cached {
                Some(snapshot) => {
                    tracing::warn!(error = %error, "Cannot fetch a fresh document for an approval; checking against the last one");
                    Ok(snapshot.document)
                }
                None => Err(Stop::Fail(
                    "imds_error",
                    format!(
                        "no document from the metadata service yet, so the request cannot be checked; nothing was sent, send it again: {error}"
                    ),
                )),
            },
        }
    }
}

/// What a request says (its id, source, time, VM and EventIds, as signed), to tell a second
/// copy of it from another request reusing its id; None for a bare body (no id).
pub(super) fn content_of(request: &Request) -> Option<String> {
    request.cloud_event.as_ref().map(|attributes| {
        canonical(
            &attributes.id,
            &attributes.source,
            attributes.time.timestamp(),
            attributes.vm_name.as_deref(),
            &request.event_ids,
        )
    })
}

/// The refusal of a request that reuses a handled request's id with other content.
fn altered(id: &str) -> Rejection {
    Rejection::new(
        Reason::Replayed,
        format!(
            "request id {id:?} was handled before with other content (another VM, EventIds, source or time): an id is used once"
        ),
    )
}
