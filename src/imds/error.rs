//! How a request to the metadata service can fail, each way with what to check.

use std::time::Duration;

use serde_json::Value;

use sched_relay_core::document::DocumentError;

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

/// The service answers a bad or missing api-version with 400 and a `newest-versions` list.
pub(super) fn newest_versions(body: &[u8]) -> Option<Vec<String>> {
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
