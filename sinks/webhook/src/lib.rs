//! The webhook sink: HTTP POST of each CloudEvent with the CloudEvents HTTP binding (binary
//! mode `ce-` headers by default, structured mode by choice), or of whole batches as
//! `application/cloudevents-batch+json`. 2xx is delivered; 429, 5xx, timeouts and connection
//! failures are retried (honouring `Retry-After`); any other status is refused for good and
//! the batch goes to the dead-letter file with the status and the start of the answer.
//! Redirects are not followed, so a signature or token never travels to another host.
//!
//! The configuration always compiles; the client needs the `client` feature.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use sched_relay_transport::binding::ContentMode;
use sched_relay_transport::secret::Secret;
use serde::{Deserialize, Serialize};

#[cfg(feature = "client")]
mod built;
#[cfg(feature = "client")]
mod sink;
#[cfg(feature = "client")]
mod tls;
#[cfg(feature = "client")]
pub use sink::{WebhookSink, signature};

/// `kind = "webhook"`.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct WebhookSinkConfig {
    /// Where to POST: `https://orchestrator.example/events`.
    pub url: String,
    /// `binary` (ce- headers, data as body) or `structured` (the whole event as JSON).
    /// Default: `structured` when the requests are signed (`hmac_key`), so the signature
    /// covers every attribute; else `binary`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content_mode: Option<ContentMode>,
    /// POST each batch as one `application/cloudevents-batch+json` array instead of one
    /// request per event.
    #[serde(default)]
    pub batch: bool,
    /// Per-request timeout; a timeout is retried.
    #[serde(default = "default_timeout", with = "humantime_serde")]
    pub timeout: Duration,
    /// Extra headers on every request.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, String>,
    /// Sent as `Authorization: Bearer <token>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bearer_token: Option<Secret>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bearer_token_file: Option<PathBuf>,
    /// Signs every request the Standard Webhooks way (`webhook-id`, `webhook-timestamp`,
    /// `webhook-signature: v1,<base64 HMAC-SHA256 of "id.timestamp.body">`); a `whsec_<base64>`
    /// key is used as its libraries expect. Also sent, for receivers of earlier versions:
    /// `<hmac_header>: sha256=<hex HMAC-SHA256(key, body)>` (the body only: deprecated).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hmac_key: Option<Secret>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hmac_key_file: Option<PathBuf>,
    #[serde(default = "default_hmac_header")]
    pub hmac_header: String,
    /// A PEM file of CA certificates to trust besides the system's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<PathBuf>,
    /// A PEM certificate (with its chain) to present to servers that require client
    /// certificates (mutual TLS); with `client_key_file`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_cert_file: Option<PathBuf>,
    /// The PEM private key of `client_cert_file`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_key_file: Option<PathBuf>,
}

fn default_timeout() -> Duration {
    Duration::from_secs(10)
}

fn default_hmac_header() -> String {
    "X-Signature-256".into()
}

impl WebhookSinkConfig {
    /// The files the sink reads its token, signing key and certificates from: the sink
    /// builds its client anew once one of them changed ([`sched_relay_transport::files`]).
    pub fn watched_files(&self) -> Vec<&std::path::Path> {
        sched_relay_transport::files::given([
            &self.bearer_token_file,
            &self.hmac_key_file,
            &self.ca_file,
            &self.client_cert_file,
            &self.client_key_file,
        ])
    }

    /// The content mode in effect: as configured, else `structured` when requests are
    /// signed, else `binary`.
    pub fn content_mode(&self) -> ContentMode {
        self.content_mode
            .unwrap_or(if self.hmac_key.is_some() || self.hmac_key_file.is_some() {
                ContentMode::Structured
            } else {
                ContentMode::Binary
            })
    }

    /// Problems, as (key, message), without touching the network.
    pub fn validate(&self) -> Vec<(&'static str, String)> {
        let mut problems = Vec::new();
        match url::Url::parse(&self.url) {
            Ok(url) if matches!(url.scheme(), "http" | "https") && url.has_host() => {}
            _ => problems.push(("url", format!("{:?} is not an http(s) URL", self.url))),
        }
        if self.bearer_token.is_some() && self.bearer_token_file.is_some() {
            problems.push((
                "bearer_token",
                "set bearer_token or bearer_token_file, not both".into(),
            ));
        }
        if self.hmac_key.is_some() && self.hmac_key_file.is_some() {
            problems.push(("hmac_key", "set hmac_key or hmac_key_file, not both".into()));
        }
        for name in self.headers.keys() {
            let valid = !name.is_empty()
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_".contains(&b));
            if !valid {
                problems.push(("headers", format!("{name:?} is not a valid header name")));
            }
        }
        if self.timeout.is_zero() {
            problems.push(("timeout", "must be more than 0s".into()));
        }
        // A CA or client certificate on a connection that would not use TLS is refused.
        let tls = url::Url::parse(&self.url).is_ok_and(|url| url.scheme() == "https");
        problems.extend(sched_relay_transport::tls::check(
            (!tls).then_some("use an https:// URL"),
            self.ca_file.as_deref(),
            self.client_cert_file.as_deref(),
            self.client_key_file.as_deref(),
        ));
        problems
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_validation() {
        let config: WebhookSinkConfig =
            toml::from_str("url = \"https://example.org/events\"").unwrap();
        assert_eq!(config.timeout, Duration::from_secs(10));
        assert!(!config.batch);
        assert!(config.validate().is_empty());
        let bad: WebhookSinkConfig = toml::from_str(
            "url = \"ftp://x\"\nhmac_key = \"k\"\nhmac_key_file = \"/k\"\n[headers]\n\"bad header\" = \"x\"",
        )
        .unwrap();
        let keys: Vec<&str> = bad.validate().iter().map(|(k, _)| *k).collect();
        assert_eq!(keys, ["url", "hmac_key", "headers"]);
    }
}
