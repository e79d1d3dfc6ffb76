//! The HTTP client side of the webhook sink.

use async_trait::async_trait;
use hmac::{Hmac, Mac};
use reqwest::StatusCode;
use reqwest::header::{CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue, RETRY_AFTER};
use sched_relay_transport::binding::{self, BATCH_CONTENT_TYPE};
use sched_relay_transport::files::Stamp;
use sched_relay_transport::{DeliveryError, Event, Sink, SinkError, parse_retry_after};
use sha2::Sha256;

use crate::WebhookSinkConfig;
use crate::built::Built;

/// The longest part of an error answer quoted in logs and dead letters.
const BODY_EXCERPT: usize = 300;

/// POSTs CloudEvents to one URL. Its client, headers and keys are built from the
/// configuration's files, and built anew before the next request once one of the files has
/// changed, or the receiver refused the credentials (401, 403, 407) or the TLS handshake:
/// a rotated token or certificate is taken up without a restart.
pub struct WebhookSink {
    config: WebhookSinkConfig,
    built: std::sync::RwLock<std::sync::Arc<Built>>,
    /// The receiver refused what the last request carried: build anew before the next one.
    refused: std::sync::atomic::AtomicBool,
}

/// The signature header value for `body`: `sha256=<hex HMAC-SHA256(key, body)>`.
/// The Standard Webhooks signature header value: `v1,<base64 HMAC-SHA256(key,
/// "<id>.<timestamp>.<body>")>`.
pub fn standard_signature(key: &[u8], id: &str, timestamp: i64, body: &[u8]) -> String {
    use base64::Engine;
    let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes keys of any length");
    mac.update(format!("{id}.{timestamp}.").as_bytes());
    mac.update(body);
    let digest = mac.finalize().into_bytes();
    format!(
        "v1,{}",
        base64::engine::general_purpose::STANDARD.encode(digest)
    )
}

/// The Standard Webhooks key: a `whsec_<base64>` secret is its base64-decoded bytes (as the
/// specification's libraries read it); any other secret is used as it is.
pub fn standard_key(secret: &str) -> Result<Vec<u8>, String> {
    use base64::Engine;
    match secret.strip_prefix("whsec_") {
        Some(encoded) => base64::engine::general_purpose::STANDARD
            .decode(encoded)
            .map_err(|e| format!("hmac_key: whsec_ key whose rest is not base64: {e}")),
        None => Ok(secret.as_bytes().to_vec()),
    }
}

pub fn signature(key: &[u8], body: &[u8]) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes keys of any length");
    mac.update(body);
    let digest = mac.finalize().into_bytes();
    let hex: String = digest.iter().map(|byte| format!("{byte:02x}")).collect();
    format!("sha256={hex}")
}

impl WebhookSink {
    pub fn new(config: WebhookSinkConfig) -> Self {
        // One process-wide provider (ring) for every rustls user; a second install is a no-op.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let built = Built::new(&config);
        WebhookSink {
            config,
            built: std::sync::RwLock::new(std::sync::Arc::new(built)),
            refused: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// What to send with now: built anew when a file changed or the receiver refused the
    /// last request's credentials.
    fn current(&self) -> std::sync::Arc<Built> {
        let built = self.built.read().unwrap_or_else(|p| p.into_inner()).clone();
        let refused = self
            .refused
            .swap(false, std::sync::atomic::Ordering::SeqCst);
        let changed = Stamp::of(self.config.watched_files()) != built.files;
        if !refused && !changed {
            return built;
        }
        // (Not logged here: this crate has no logger. The refusal was logged as the
        // delivery's error; a new file shows in the next delivery's outcome.)
        let rebuilt = std::sync::Arc::new(Built::new(&self.config));
        *self.built.write().unwrap_or_else(|p| p.into_inner()) = rebuilt.clone();
        rebuilt
    }
}

impl WebhookSink {
    async fn post(
        &self,
        built: &Built,
        headers: HeaderMap,
        body: Vec<u8>,
        what: &str,
    ) -> Result<(), SinkError> {
        let sent = self.send(built, headers, body, what).await;
        if matches!(sent, Err(SinkError::Authentication(_))) {
            self.refused
                .store(true, std::sync::atomic::Ordering::SeqCst);
        }
        sent
    }

    async fn send(
        &self,
        built: &Built,
        headers: HeaderMap,
        body: Vec<u8>,
        what: &str,
    ) -> Result<(), SinkError> {
        let mut request = built
            .client
            .post(&self.config.url)
            .headers(built.common.clone())
            .headers(headers);
        if let Some(key) = &built.hmac_key {
            request = request.header(self.config.hmac_header.as_str(), signature(key, &body));
        }
        if let Some(key) = &built.standard_key {
            // Signed at each attempt: a retry carries a fresh timestamp.
            let timestamp = chrono::Utc::now().timestamp();
            request = request
                .header("webhook-id", what)
                .header("webhook-timestamp", timestamp.to_string())
                .header(
                    "webhook-signature",
                    standard_signature(key, what, timestamp, &body),
                );
        }
        // The URL itself can be the credential (`?sig=` of Logic Apps, Slack, Teams): every
        // message names it redacted, and reqwest's errors, which quote it, are redacted too.
        let url = sched_relay_transport::redact::text(&self.config.url);
        let response = request.body(body).send().await.map_err(|error| {
            if error.is_timeout() {
                SinkError::Retriable(format!(
                    "POST {url} ({what}) timed out after {:?}",
                    self.config.timeout
                ))
            } else if let Some(tls) = sched_relay_transport::tls::failure(&error) {
                // Retried (loudly): a certificate is renewed on the server without the agent.
                SinkError::Authentication(format!("POST {url} ({what}): {tls}"))
            } else {
                SinkError::Retriable(format!(
                    "POST {url} ({what}) failed: {}",
                    sched_relay_transport::redact::text(&sched_relay_transport::error_chain(
                        &error.without_url()
                    ))
                ))
            }
        })?;
        let status = response.status();
        if status.is_success() {
            return Ok(());
        }
        let retry_after = response
            .headers()
            .get(RETRY_AFTER)
            .and_then(|value| value.to_str().ok())
            .and_then(parse_retry_after);
        let text = response.text().await.unwrap_or_default();
        let excerpt: String = text.chars().take(BODY_EXCERPT).collect();
        // A receiver's error page may quote the URL it was called with, or only its query.
        let message = sched_relay_transport::redact::known(
            &format!("POST {url} ({what}) answered {status}: {excerpt}"),
            &sched_relay_transport::redact::url_secrets(&self.config.url),
        );
        // A refused credential is the receiver's state, not the event's: a token rotated on
        // one side before the other must hold the events, not dead-letter every one of them.
        if matches!(
            status,
            StatusCode::UNAUTHORIZED
                | StatusCode::FORBIDDEN
                | StatusCode::PROXY_AUTHENTICATION_REQUIRED
        ) {
            return Err(SinkError::Authentication(format!(
                "{message} (check bearer_token or the URL's credential, and the receiver's)"
            )));
        }
        if status == StatusCode::TOO_MANY_REQUESTS || status.is_server_error() {
            return Err(match retry_after {
                Some(after) => SinkError::RetryAfter { message, after },
                None => SinkError::Retriable(message),
            });
        }
        if status.is_redirection() {
            return Err(SinkError::Permanent(format!(
                "{message} (redirects are not followed: set url to the final address)"
            )));
        }
        Err(SinkError::Permanent(message))
    }
}

/// The proxy the environment names for `url`, as reqwest's default client reads it
/// (`HTTPS_PROXY`/`HTTP_PROXY`, then `ALL_PROXY`, either case), unless `NO_PROXY` lists the
/// host (`*`, the host itself, or a domain it is in).
fn proxy_for(url: &url::Url, env: impl Fn(&str) -> Option<String>) -> Option<url::Url> {
    let var = |names: &[&str]| {
        names
            .iter()
            .find_map(|name| env(name).filter(|v| !v.trim().is_empty()))
    };
    let names: &[&str] = if url.scheme() == "https" {
        &["HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"]
    } else {
        &["HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"]
    };
    let proxy = var(names)?;
    let host = url.host_str().unwrap_or_default().to_ascii_lowercase();
    let bypassed = var(&["NO_PROXY", "no_proxy"]).is_some_and(|list| {
        list.split(',')
            .map(|entry| entry.trim().to_ascii_lowercase())
            .any(|entry| {
                let domain = entry.trim_start_matches('.');
                entry == "*"
                    || (!domain.is_empty()
                        && (host == domain || host.ends_with(&format!(".{domain}"))))
            })
    });
    if bypassed {
        return None;
    }
    url::Url::parse(&proxy)
        .ok()
        .filter(|parsed| parsed.has_host())
        .or_else(|| url::Url::parse(&format!("http://{proxy}")).ok())
}

fn header_map(pairs: &[(String, String)], content_type: &str) -> Result<HeaderMap, SinkError> {
    let mut headers = HeaderMap::new();
    for (name, value) in pairs {
        let name = HeaderName::try_from(name.as_str())
            .map_err(|e| SinkError::Permanent(format!("header {name}: {e}")))?;
        let value = HeaderValue::try_from(value.as_str())
            .map_err(|e| SinkError::Permanent(format!("header {name}: {e}")))?;
        headers.insert(name, value);
    }
    headers.insert(
        CONTENT_TYPE,
        HeaderValue::try_from(content_type)
            .map_err(|e| SinkError::Permanent(format!("content type: {e}")))?,
    );
    Ok(headers)
}

#[async_trait]
impl Sink for WebhookSink {
    async fn deliver(&self, batch: &[Event]) -> Result<(), DeliveryError> {
        // A sink that could not be set up (a token file missing or being replaced, a header
        // it cannot send) is the sink's state, not any event's: the events wait in the
        // outbox, and /readyz and the health check say why, until a file it reads changes.
        let built = self.current();
        if let Some(problem) = &built.broken {
            return Err(SinkError::Retriable(format!(
                "{problem} (events wait in the outbox; the files are read again when they change)"
            ))
            .into());
        }
        if self.config.batch {
            // One answer for the whole batch: a refusal cannot say which event it is about.
            let body = binding::batch_json(batch)?;
            // Also its `webhook-id`: the same for a retry of the same batch, another for
            // another VM's batch that starts with an event of the same id.
            let what = match batch.first() {
                Some(first) => format!("batch:{}:{}", first.message_id(), batch.len()),
                None => "batch:empty".to_owned(),
            };
            return Ok(self
                .post(&built, header_map(&[], BATCH_CONTENT_TYPE)?, body, &what)
                .await?);
        }
        for (index, event) in batch.iter().enumerate() {
            let post = async {
                let encoded = binding::encode(event, self.config.content_mode(), binding::HTTP)?;
                let headers = header_map(&encoded.headers, &encoded.content_type)?;
                self.post(&built, headers, encoded.body, &event.message_id())
                    .await
            };
            post.await.map_err(|e| DeliveryError::at(index, e))?;
        }
        Ok(())
    }

    async fn health_check(&self) -> Result<(), SinkError> {
        let built = self.current();
        if let Some(problem) = &built.broken {
            return Err(SinkError::Retriable(problem.clone()));
        }
        // A webhook has no side-effect-free probe; check that the host accepts a connection
        // and, over HTTPS, completes a TLS handshake that a delivery would accept.
        let url = url::Url::parse(&self.config.url)
            .map_err(|e| SinkError::Permanent(format!("url: {e}")))?;
        // Deliveries go through the proxy the environment names (reqwest reads HTTPS_PROXY and
        // friends): then the probe can only check that the proxy accepts a connection.
        let proxy = proxy_for(&url, |name| std::env::var(name).ok());
        let target = proxy.as_ref().unwrap_or(&url);
        let host = target.host_str().unwrap_or_default().to_owned();
        let port = target.port_or_known_default().unwrap_or(443);
        let connect = tokio::net::lookup_host((host.as_str(), port));
        let addresses: Vec<std::net::SocketAddr> =
            tokio::time::timeout(self.config.timeout, connect)
                .await
                .map_err(|_| {
                    SinkError::Retriable(format!(
                        "cannot resolve {host} within {:?}",
                        self.config.timeout
                    ))
                })?
                .map_err(|e| SinkError::Retriable(format!("cannot resolve {host}: {e}")))?
                .collect();
        if addresses.is_empty() {
            return Err(SinkError::Retriable(format!("{host} has no address")));
        }
        // Every address, as a connection attempt would (IPv6 first, then IPv4, ...).
        let connect_any = async {
            let mut last = None;
            for address in &addresses {
                match tokio::net::TcpStream::connect(address).await {
                    Ok(stream) => return Ok(stream),
                    Err(error) => last = Some(error),
                }
            }
            Err(last.expect("at least one address"))
        };
        let stream = tokio::time::timeout(self.config.timeout, connect_any)
            .await
            .map_err(|_| {
                SinkError::Retriable(format!(
                    "{host}:{port} did not accept a connection within {:?}",
                    self.config.timeout
                ))
            })?
            .map_err(|e| SinkError::Retriable(format!("{host}:{port} is unreachable: {e}")))?;
        if url.scheme() != "https" || proxy.is_some() {
            return Ok(());
        }
        let (Some(tls), Some(url_host)) = (&built.tls, url.host()) else {
            return Ok(());
        };
        let name = match url_host {
            url::Host::Domain(domain) => rustls::pki_types::ServerName::try_from(domain.to_owned())
                .map_err(|e| SinkError::Permanent(format!("url: host {domain}: {e}")))?,
            url::Host::Ipv4(ip) => rustls::pki_types::ServerName::from(std::net::IpAddr::V4(ip)),
            url::Host::Ipv6(ip) => rustls::pki_types::ServerName::from(std::net::IpAddr::V6(ip)),
        };
        let handshake = tokio_rustls::TlsConnector::from(tls.clone()).connect(name, stream);
        tokio::time::timeout(self.config.timeout, handshake)
            .await
            .map_err(|_| {
                SinkError::Retriable(format!(
                    "{host}:{port}: no TLS handshake within {:?}",
                    self.config.timeout
                ))
            })?
            .map_err(|e| match sched_relay_transport::tls::failure(&e) {
                Some(tls) => SinkError::Authentication(format!("{host}:{port}: {tls}")),
                None => SinkError::Retriable(format!(
                    "{host}:{port}: TLS handshake failed: {}",
                    sched_relay_transport::error_chain(&e)
                )),
            })?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_probe_takes_the_proxy_a_delivery_takes() {
        let url = |text: &str| url::Url::parse(text).unwrap();
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(key, _)| *key == name)
                    .map(|(_, value)| value.to_string())
            }
        };
        let hook = url("https://hooks.example.com/events");
        assert_eq!(proxy_for(&hook, env(&[])), None);
        let proxied = proxy_for(&hook, env(&[("HTTPS_PROXY", "http://proxy.corp:3128")]));
        assert_eq!(proxied.unwrap().port_or_known_default(), Some(3128));
        // Without a scheme, as curl accepts it.
        let bare = proxy_for(&hook, env(&[("https_proxy", "proxy.corp:8080")]));
        assert_eq!(bare.unwrap().host_str(), Some("proxy.corp"));
        // An http:// webhook does not take the HTTPS proxy.
        let plain = url("http://hooks.example.com/events");
        assert_eq!(
            proxy_for(&plain, env(&[("HTTPS_PROXY", "http://p:1")])),
            None
        );
        for no_proxy in ["*", "example.com", ".example.com", "hooks.example.com"] {
            let pairs: &'static [(&'static str, &'static str)] = match no_proxy {
                "*" => &[("HTTPS_PROXY", "http://p:1"), ("NO_PROXY", "*")],
                "example.com" => &[
                    ("HTTPS_PROXY", "http://p:1"),
                    ("NO_PROXY", "a.org, example.com"),
                ],
                ".example.com" => &[("HTTPS_PROXY", "http://p:1"), ("no_proxy", ".example.com")],
                _ => &[
                    ("ALL_PROXY", "http://p:1"),
                    ("NO_PROXY", "hooks.example.com"),
                ],
            };
            assert_eq!(proxy_for(&hook, env(pairs)), None, "{no_proxy}");
        }
        let other = url("https://notexample.com/events");
        assert!(
            proxy_for(
                &other,
                env(&[("HTTPS_PROXY", "http://p:1"), ("NO_PROXY", "example.com")])
            )
            .is_some()
        );
    }

    #[test]
    fn signature_is_hex_hmac_sha256_of_the_body() {
        // RFC 4231 test case 2.
        assert_eq!(
            signature(b"Jefe", b"what do ya want for nothing?"),
            "sha256=5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }
}
