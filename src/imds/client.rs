//! The HTTP client of the Instance Metadata Service: `GET` and `POST`
//! `/metadata/scheduledevents`, and the VM's identity from `/metadata/instance/compute`.
//!
//! Every request carries `Metadata: true`, never goes through a proxy and never follows a
//! redirect: the service lives on a link-local address, and the header exists precisely so that
//! a redirected or proxied request is refused. Until the first answer the timeout is long,
//! because the first request enables the service and may take up to two minutes.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use reqwest::{StatusCode, header, redirect};
use serde_json::Value;
use url::Url;

use sched_relay_core::document::{Document, DocumentError, Parsed};
use sched_relay_core::event::Identity;

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

/// Why a request to the metadata service failed. Each variant says what to check.
#[derive(Debug, thiserror::Error)]
pub enum ImdsError {
    #[error("no answer from {url} within {timeout:?}")]
    Timeout { url: String, timeout: Duration },
    #[error("cannot reach {url}: {reason} (is this an Azure VM, and is imds.endpoint right?)")]
    Unreachable { url: String, reason: String },
    #[error(
        "{url} does not accept api-version {version}; the service's newest versions are {newest:?}: \
         set imds.api_version to one of them"
    )]
    BadApiVersion {
        url: String,
        version: String,
        newest: Vec<String>,
    },
    #[error("{url} answered 400 Bad Request: {body}")]
    BadRequest { url: String, body: String },
    #[error(
        "{url} answered 429 Too Many Requests (retry after {retry_after:?}); is another process on this VM polling the metadata service too?"
    )]
    Throttled {
        url: String,
        retry_after: Option<Duration>,
    },
    #[error("{url} answered {status}: {body}")]
    Status {
        url: String,
        status: u16,
        body: String,
    },
    #[error("{url} returned a malformed document: {error}")]
    Malformed { url: String, error: DocumentError },
}

impl ImdsError {
    /// A short stable label for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            ImdsError::Timeout { .. } => "timeout",
            ImdsError::Unreachable { .. } => "unreachable",
            ImdsError::BadApiVersion { .. } => "bad_api_version",
            ImdsError::BadRequest { .. } => "bad_request",
            ImdsError::Throttled { .. } => "throttled",
            ImdsError::Status { status: 410, .. } => "gone",
            ImdsError::Status { status, .. } if *status >= 500 => "server_error",
            ImdsError::Status { .. } => "http_status",
            ImdsError::Malformed { .. } => "malformed",
        }
    }

    /// Whether repeating the request can succeed (a refused approval body never will).
    pub fn is_retriable(&self) -> bool {
        !matches!(
            self,
            ImdsError::BadApiVersion { .. } | ImdsError::BadRequest { .. }
        )
    }
}

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
        let url = self.scheduled_events.as_str();
        let body = self
            .send_scheduled_events(self.http.get(self.scheduled_events.clone()), url)
            .await?;
        Document::parse(&body).map_err(|error| ImdsError::Malformed {
            url: url.to_owned(),
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
    ) -> Result<Vec<u8>, ImdsError> {
        let result = self
            .send(request, url, self.scheduled_events_timeout())
            .await;
        // Any HTTP answer, even an error, proves the service is enabled and responsive.
        if !matches!(
            result,
            Err(ImdsError::Timeout { .. } | ImdsError::Unreachable { .. })
        ) {
            self.answered.store(true, Ordering::Relaxed);
        }
        result
    }

    async fn send(
        &self,
        request: reqwest::RequestBuilder,
        url: &str,
        timeout: Duration,
    ) -> Result<Vec<u8>, ImdsError> {
        self.pacer.turn().await;
        let response = request
            .header("Metadata", "true")
            .timeout(timeout)
            .send()
            .await
            .map_err(|e| self.transport_error(url, timeout, e))?;
        let status = response.status();
        if status == StatusCode::TOO_MANY_REQUESTS {
            let retry_after = response
                .headers()
                .get(header::RETRY_AFTER)
                .and_then(|value| value.to_str().ok())
                .and_then(sched_relay_transport::parse_retry_after);
            if let Some(wait) = retry_after {
                self.pacer.throttled(wait);
            }
            return Err(ImdsError::Throttled {
                url: url.to_owned(),
                retry_after,
            });
        }
        let body = response
            .bytes()
            .await
            .map_err(|e| self.transport_error(url, timeout, e))?;
        if status.is_success() {
            return Ok(body.to_vec());
        }
        let text = String::from_utf8_lossy(&body).trim().to_owned();
        if status == StatusCode::BAD_REQUEST {
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
            status: status.as_u16(),
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

/// The service answers a bad or missing api-version with 400 and a `newest-versions` list.
fn newest_versions(body: &[u8]) -> Option<Vec<String>> {
    let value: Value = serde_json::from_slice(body).ok()?;
    let versions = value.get("newest-versions")?.as_array()?;
    Some(
        versions
            .iter()
            .filter_map(|v| v.as_str().map(str::to_owned))
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_api_version_answer_lists_the_newest_versions() {
        let body = br#"{"error": "Bad request. api-version is invalid", "newest-versions": ["2020-07-01", "2019-08-01"]}"#;
        assert_eq!(
            newest_versions(body),
            Some(vec!["2020-07-01".to_owned(), "2019-08-01".to_owned()])
        );
        assert_eq!(newest_versions(b"Bad Request"), None);
    }

    #[test]
    fn accepted_event_ids_are_remembered_bounded_until_they_leave_the_document() {
        let client = ImdsClient::new(
            Url::parse("http://127.0.0.1:9").unwrap(),
            "2020-07-01",
            Duration::from_secs(1),
            Duration::from_secs(1),
        )
        .unwrap();
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

    #[test]
    fn refused_requests_are_not_retried_but_outages_are() {
        let bad = ImdsError::BadRequest {
            url: "u".into(),
            body: "b".into(),
        };
        assert!(!bad.is_retriable());
        let down = ImdsError::Status {
            url: "u".into(),
            status: 503,
            body: String::new(),
        };
        assert!(down.is_retriable());
        assert_eq!(down.kind(), "server_error");
    }
}
