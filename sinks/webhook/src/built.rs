//! What the webhook sink sends with, as built from its configuration and files: the HTTP
//! client (with its TLS), the headers every request carries, the signing keys, and a problem
//! found while building. Built again when a file changes or the receiver refuses.

use reqwest::header::{AUTHORIZATION, HeaderMap, HeaderName, HeaderValue};
use reqwest::redirect;
use sched_relay_transport::files::Stamp;

use crate::WebhookSinkConfig;
use crate::sink::standard_key;

/// What the sink sends with, as built from the configuration and its files.
pub(crate) struct Built {
    /// The stamp of the files it was built from, taken before they were read.
    pub(crate) files: Stamp,
    pub(crate) client: reqwest::Client,
    /// The TLS settings deliveries use, for the health check's handshake: "ready" means the
    /// same trust (the platform's roots plus `ca_file`) that a delivery will need.
    pub(crate) tls: Option<std::sync::Arc<rustls::ClientConfig>>,
    /// Headers every request carries (custom headers, bearer token), built once.
    pub(crate) common: HeaderMap,
    pub(crate) hmac_key: Option<Vec<u8>>,
    /// The Standard Webhooks signing key (from `hmac_key`).
    pub(crate) standard_key: Option<Vec<u8>>,
    /// A configuration problem found while building; reported on every attempt.
    pub(crate) broken: Option<String>,
}

impl Built {
    pub(crate) fn new(config: &WebhookSinkConfig) -> Built {
        let files = Stamp::of(config.watched_files());
        let mut broken = None;
        let mut builder = reqwest::Client::builder()
            .redirect(redirect::Policy::none())
            .timeout(config.timeout)
            .user_agent(concat!("sched-relay/", env!("CARGO_PKG_VERSION")));
        let tls = match crate::tls::client_config(config) {
            Ok(tls) => {
                builder = builder.use_preconfigured_tls((*tls).clone());
                Some(tls)
            }
            Err(error) => {
                broken = Some(error);
                None
            }
        };
        let client = builder.build().unwrap_or_else(|error| {
            broken = Some(format!("cannot build the HTTP client: {error}"));
            reqwest::Client::new()
        });
        let mut common = HeaderMap::new();
        for (name, value) in &config.headers {
            match (
                HeaderName::try_from(name.as_str()),
                HeaderValue::try_from(value.as_str()),
            ) {
                (Ok(name), Ok(value)) => {
                    common.insert(name, value);
                }
                _ => {
                    broken = Some(format!(
                        "headers: {name:?} cannot be sent as an HTTP header"
                    ))
                }
            }
        }
        match sched_relay_transport::secret::resolve(
            config.bearer_token.as_ref(),
            config.bearer_token_file.as_deref(),
            "bearer_token",
        ) {
            Ok(Some(token)) => match HeaderValue::try_from(format!("Bearer {token}")) {
                Ok(mut value) => {
                    value.set_sensitive(true);
                    common.insert(AUTHORIZATION, value);
                }
                Err(_) => broken = Some("bearer_token: not a valid header value".into()),
            },
            Ok(None) => {}
            Err(error) => broken = Some(error),
        }
        let (hmac_key, standard_key) = match sched_relay_transport::secret::resolve(
            config.hmac_key.as_ref(),
            config.hmac_key_file.as_deref(),
            "hmac_key",
        ) {
            Ok(Some(key)) => match standard_key(&key) {
                Ok(standard) => (Some(key.into_bytes()), Some(standard)),
                Err(error) => {
                    broken = Some(error);
                    (None, None)
                }
            },
            Ok(None) => (None, None),
            Err(error) => {
                broken = Some(error);
                (None, None)
            }
        };
        Built {
            files,
            client,
            tls,
            common,
            hmac_key,
            standard_key,
            broken,
        }
    }
}
