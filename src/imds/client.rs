//! The HTTP client of the Instance Metadata Service: `GET` and `POST`
//! `/metadata/scheduledevents`, and the VM's identity from `/metadata/instance/compute`.
//!
//! Every request carries `Metadata: true`, never goes through a proxy and never follows a
//! redirect: the service lives on a link-local address, and the header exists precisely so that
//! a redirected or proxied request is refused. Until the first answer the timeout is long,
//! because the first request enables the service and may take up to two minutes.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use reqwest::{StatusCode, header, redirect};
use serde_json::Value;
use url::Url;

use sched_relay_core::document::{Document, DocumentError, Parsed};
use sched_relay_core::event::Identity;

use super::connection::{KeptAlive, Unanswered};
pub use super::error::ImdsError;
use super::error::newest_versions;

/// The Scheduled Events api-versions Azure has published, oldest first.
pub const KNOWN_API_VERSIONS: [&str; 7] = [
    "2017-03-01",
    "2017-08-01",
    "2017-11-01",
    "2019-01-01",
    "2019-04-01",
    "2019-08-01",
    "2020-07-01",
];

/// How many accepted EventIds are remembered: far more than one document ever holds.
const ACCEPTED_REMEMBERED: usize = 256;

/// The api-version used for `/metadata/instance/compute` (independent of Scheduled Events).
const COMPUTE_API_VERSION: &str = "2021-02-01";

/// `base` + `path` + `?api-version=...`.
fn url(base: &Url, path: &str, api_version: &str) -> String {
    let base = base.as_str().trim_end_matches('/');
    format!("{base}{path}?api-version={api_version}")
}

/// A client of one metadata service endpoint.
#[derive(Debug)]
pub struct ImdsClient {
    http: reqwest::Client,
    base: Url,
    /// `/metadata/scheduledevents?api-version=...`, parsed once: not again on every poll.
    scheduled_events: Url,
    api_version: String,
    request_timeout: Duration,
    first_call_timeout: Duration,
    answered: AtomicBool,
    /// Signalled after each accepted StartRequests POST, so the poller looks again at once
    /// instead of a poll interval later (the event is about to start).
    posted: tokio::sync::Notify,
    /// Every request of this client waits its turn: within the service's 5 requests/s.
    pacer: super::pacing::Pacer,
    /// EventIds of accepted StartRequests, oldest first, until they leave the document: an
    /// event this agent approved that vanishes while `Scheduled` probably ran unobserved.
    accepted: std::sync::Mutex<std::collections::VecDeque<String>>,
}

impl ImdsClient {
    pub fn new(
        base: Url,
        api_version: &str,
        request_timeout: Duration,
        first_call_timeout: Duration,
    ) -> Result<Self, ImdsError> {
        crate::install_crypto_provider();
        let http = reqwest::Client::builder()
            .no_proxy()
            .redirect(redirect::Policy::none())
            .connect_timeout(request_timeout.min(Duration::from_secs(5)))
            .user_agent(concat!("sched-relay/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| ImdsError::Unreachable {
                url: base.to_string(),
                reason: format!("cannot build the HTTP client: {e}"),
            })?;
        let scheduled_events = Url::parse(&url(&base, "/metadata/scheduledevents", api_version))
            .map_err(|e| ImdsError::Unreachable {
                url: base.to_string(),
                reason: format!("not a URL with /metadata/scheduledevents appended: {e}"),
            })?;
        Ok(ImdsClient {
            http,
            base,
            scheduled_events,
            api_version: api_version.to_owned(),
            request_timeout,
            first_call_timeout,
            answered: AtomicBool::new(false),
            posted: tokio::sync::Notify::new(),
            pacer: super::pacing::Pacer::new(),
            accepted: Default::default(),
        })
    }

    /// Completes after a StartRequests POST was accepted (at once if one was since the last
    /// wait): by local policy or by a remote approval.
    pub fn posted(&self) -> &tokio::sync::Notify {
        &self.posted
    }

    /// The pacer every request of this client waits for, for tests that throttle it.
    #[cfg(test)]
    pub(crate) fn pacer(&self) -> &super::pacing::Pacer {
        &self.pacer
    }

    /// The base URL requests go to.
    pub fn base(&self) -> &Url {
        &self.base
    }

    /// The service is known to be enabled (it answered this agent within the last day, as the
    /// state store remembers): no request needs the long first-call timeout. Without this, an
    /// agent restarted during an outage would wait `first_call_timeout` on every poll.
    pub fn assume_enabled(&self) {
        self.answered.store(true, Ordering::Relaxed);
    }

    /// Whether the service has answered a Scheduled Events request of this client.
    pub fn has_answered(&self) -> bool {
        self.answered.load(Ordering::Relaxed)
    }

    /// Scheduled Events requests wait long until the service has answered once (the first
    /// call enables it); anything else, and everything after, uses the normal timeout.
    fn scheduled_events_timeout(&self) -> Duration {
        if self.answered.load(Ordering::Relaxed) {
            self.request_timeout
        } else {
            self.first_call_timeout
        }
    }

    /// `GET /metadata/scheduledevents`: the current document.
    pub async fn fetch(&self) -> Result<Parsed, ImdsError> {
        self.parse(&self.fetch_body().await?)
    }

    /// As [`ImdsClient::fetch`], the body unparsed (for [`ImdsClient::parse`]): a poller that
    /// got the same bytes last time need not parse them again.
    pub async fn fetch_body(&self) -> Result<Bytes, ImdsError> {
        let url = self.scheduled_events.as_str();
        self.send_scheduled_events(self.http.get(self.scheduled_events.clone()), url)
            .await
    }

    /// A kept-alive connection for [`ImdsClient::fetch_body_on`], for the one task that polls;
    /// `None` for an `https` endpoint (then [`ImdsClient::fetch_body`] is the way).
    pub fn poll_connection(&self) -> Option<KeptAlive> {
        KeptAlive::new(
            &self.scheduled_events,
            self.request_timeout.min(Duration::from_secs(5)),
        )
    }

    /// As [`ImdsClient::fetch_body`], through the poller's own kept-alive connection: the
    /// same pacing, timeouts and answers, without handing the exchange to the shared client's
    /// connection task (see [`KeptAlive`]).
    pub async fn fetch_body_on(&self, connection: &mut KeptAlive) -> Result<Bytes, ImdsError> {
        let url = self.scheduled_events.as_str();
        let timeout = self.scheduled_events_timeout();
        self.pacer.turn().await;
        // A request sent again on a new connection waits for a turn of its own, as the first
        // did: outside the timeout, so a throttled service holds it back rather than time it out.
        let answered = match connection.get(timeout, || self.pacer.turn()).await {
            Err(Unanswered::TimedOut) => Err(ImdsError::Timeout {
                url: url.to_owned(),
                timeout,
            }),
            Err(Unanswered::Failed(reason)) => Err(ImdsError::Unreachable {
                url: url.to_owned(),
                reason,
            }),
            Ok(answer) => self.judge(
                url,
                answer.status,
                answer.retry_after.as_deref(),
                answer.body,
            ),
        };
        self.note_answered(&answered);
        answered
    }

    /// A Scheduled Events body as a document, or why it is refused.
    pub fn parse(&self, body: &[u8]) -> Result<Parsed, ImdsError> {
        Document::parse(body).map_err(|error| ImdsError::Malformed {
            url: self.scheduled_events.as_str().to_owned(),
            error,
        })
    }

    /// `POST /metadata/scheduledevents` with one StartRequest per EventId.
    pub async fn start(&self, event_ids: &[String]) -> Result<(), ImdsError> {
        let url = self.scheduled_events.as_str();
        let requests: Vec<Value> = event_ids
            .iter()
            .map(|id| serde_json::json!({ "EventId": id }))
            .collect();
        let body = serde_json::json!({ "StartRequests": requests }).to_string();
        let request = self
            .http
            .post(self.scheduled_events.clone())
            .header(header::CONTENT_TYPE, "application/json")
            .body(body);
        self.send_scheduled_events(request, url).await?;
        self.remember_accepted(event_ids);
        self.posted.notify_one();
        Ok(())
    }

    fn remember_accepted(&self, event_ids: &[String]) {
        let mut accepted = self.accepted.lock().unwrap_or_else(|p| p.into_inner());
        for id in event_ids {
            if !accepted.iter().any(|known| known.eq_ignore_ascii_case(id)) {
                accepted.push_back(id.clone());
            }
        }
        while accepted.len() > ACCEPTED_REMEMBERED {
            accepted.pop_front();
        }
    }

    /// Takes back the accepted EventIds an earlier run of the agent kept (see `run`): an event
    /// it approved that vanished while the agent was down (this VM rebooted) is then still
    /// reported as probably started.
    pub fn restore_accepted(&self, event_ids: &[String]) {
        self.remember_accepted(event_ids);
    }

    /// The EventIds whose StartRequests this client sent and the service accepted (by local
    /// policy or a remote approval), until [`ImdsClient::forget_accepted`] drops them.
    pub fn accepted(&self) -> Vec<String> {
        let accepted = self.accepted.lock().unwrap_or_else(|p| p.into_inner());
        accepted.iter().cloned().collect()
    }

    /// Forgets accepted EventIds for which `still_present` is false: they left the document.
    pub fn forget_accepted(&self, still_present: impl Fn(&str) -> bool) {
        let mut accepted = self.accepted.lock().unwrap_or_else(|p| p.into_inner());
        accepted.retain(|id| still_present(id));
    }

    /// `GET /metadata/instance/compute`: the VM's name, vmId and resource id.
    pub async fn identity(&self) -> Result<Identity, ImdsError> {
        let url = url(
            &self.base,
            "/metadata/instance/compute",
            COMPUTE_API_VERSION,
        );
        let body = self
            .send(self.http.get(&url), &url, self.request_timeout)
            .await?;
        let malformed = |reason: &str| ImdsError::Malformed {
            url: url.clone(),
            error: DocumentError::Invalid {
                path: "compute".into(),
                expected: "an object with a non-empty \"name\"",
                found: reason.to_owned(),
            },
        };
        let value: Value =
            serde_json::from_slice(&body).map_err(|e| malformed(&format!("not JSON: {e}")))?;
        let text = |field: &str| {
            value
                .get(field)
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
        };
        Ok(Identity {
            name: text("name").ok_or_else(|| malformed("no name"))?,
            vm_id: text("vmId"),
            resource_id: text("resourceId"),
        })
    }

    async fn send_scheduled_events(
        &self,
        request: reqwest::RequestBuilder,
        url: &str,
    ) -> Result<Bytes, ImdsError> {
        let result = self
            .send(request, url, self.scheduled_events_timeout())
            .await;
        self.note_answered(&result);
        result
    }

    /// Any HTTP answer, even an error, proves the service is enabled and responsive.
    fn note_answered<T>(&self, result: &Result<T, ImdsError>) {
        if !matches!(
            result,
            Err(ImdsError::Timeout { .. } | ImdsError::Unreachable { .. })
        ) {
            self.answered.store(true, Ordering::Relaxed);
        }
    }

    async fn send(
        &self,
        request: reqwest::RequestBuilder,
        url: &str,
        timeout: Duration,
    ) -> Result<Bytes, ImdsError> {
        self.pacer.turn().await;
        let response = request
            .header("Metadata", "true")
            .timeout(timeout)
            .send()
            .await
            .map_err(|e| self.transport_error(url, timeout, e))?;
        let status = response.status().as_u16();
        let retry_after = response
            .headers()
            .get(header::RETRY_AFTER)
            .and_then(|value| value.to_str().ok())
            .map(str::to_owned);
        let body = response
            .bytes()
            .await
            .map_err(|e| self.transport_error(url, timeout, e))?;
        self.judge(url, status, retry_after.as_deref(), body)
    }

    /// What an answer of the service means: the body of a success, or the error that says
    /// what to check (a 429 also holds back every request of this client: as long as it asks,
    /// or [`super::pacing::UNASKED_THROTTLE_HOLD`] when it does not say).
    fn judge(
        &self,
        url: &str,
        status: u16,
        retry_after: Option<&str>,
        body: Bytes,
    ) -> Result<Bytes, ImdsError> {
        if status == StatusCode::TOO_MANY_REQUESTS.as_u16() {
            let retry_after = retry_after.and_then(sched_relay_transport::parse_retry_after);
            self.pacer
                .throttled(retry_after.unwrap_or(super::pacing::UNASKED_THROTTLE_HOLD));
            return Err(ImdsError::Throttled {
                url: url.to_owned(),
                retry_after,
            });
        }
        if (200..300).contains(&status) {
            return Ok(body);
        }
        let text = String::from_utf8_lossy(&body).trim().to_owned();
        if status == StatusCode::BAD_REQUEST.as_u16() {
            if let Some(newest) = newest_versions(&body) {
                return Err(ImdsError::BadApiVersion {
                    url: url.to_owned(),
                    version: self.api_version.clone(),
                    newest,
                });
            }
            return Err(ImdsError::BadRequest {
                url: url.to_owned(),
                body: text,
            });
        }
        Err(ImdsError::Status {
            url: url.to_owned(),
            status,
            body: text,
        })
    }

    fn transport_error(&self, url: &str, timeout: Duration, error: reqwest::Error) -> ImdsError {
        if error.is_timeout() {
            return ImdsError::Timeout {
                url: url.to_owned(),
                timeout,
            };
        }
        ImdsError::Unreachable {
            url: url.to_owned(),
            reason: sched_relay_transport::error_chain(&error),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client of a service that is not there: for what needs no answer.
    fn client() -> ImdsClient {
        ImdsClient::new(
            Url::parse("http://127.0.0.1:9").unwrap(),
            "2020-07-01",
            Duration::from_secs(1),
            Duration::from_secs(1),
        )
        .unwrap()
    }

    #[test]
    fn accepted_event_ids_are_remembered_bounded_until_they_leave_the_document() {
        let client = client();
        client.remember_accepted(&["E1".into(), "e1".into(), "E2".into()]);
        assert_eq!(client.accepted(), ["E1", "E2"]);
        client.forget_accepted(|id| id == "E2");
        assert_eq!(client.accepted(), ["E2"]);
        let many: Vec<String> = (0..300).map(|n| format!("E{n}")).collect();
        client.remember_accepted(&many);
        assert_eq!(client.accepted().len(), ACCEPTED_REMEMBERED);
        assert_eq!(
            client.accepted().last().unwrap(),
            "E299",
            "the oldest go first"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_429_without_retry_after_holds_back_every_request_of_the_client_for_a_second() {
        let client = client();
        for retry_after in [None, Some("soon")] {
            client.pacer().turn().await;
            let answered = tokio::time::Instant::now();
            let judged = client.judge("u", 429, retry_after, Bytes::new());
            assert!(matches!(
                judged,
                Err(ImdsError::Throttled {
                    retry_after: None,
                    ..
                })
            ));
            // An approval POST or an identity call right after it waits the hold out.
            client.pacer().turn().await;
            assert_eq!(
                answered.elapsed(),
                super::super::pacing::UNASKED_THROTTLE_HOLD,
                "Retry-After {retry_after:?}"
            );
        }
    }
}
