//! The NATS client side of the sink.

use async_nats::jetstream;
use async_trait::async_trait;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use sched_relay_transport::binding::{self, expand_template};
use sched_relay_transport::files::Stamp;
use sched_relay_transport::{DeliveryError, Event, Sink, SinkError};
use tokio::sync::Mutex;

use crate::NatsSinkConfig;

/// Publishes CloudEvents to NATS. Connects on first use; after that the client reconnects
/// by itself, and publishes made while disconnected time out and are retried by the fan-out.
/// Once a credentials or certificate file has changed, or the server refused the client's
/// login, the next use connects again, reading the files anew.
pub struct NatsSink {
    config: NatsSinkConfig,
    client: Mutex<Option<Connected>>,
}

/// How long a connection that still works is kept after a new one with changed files failed
/// (the server does not take the new credentials yet), before trying them again.
const RETRY_NEW_FILES: std::time::Duration = std::time::Duration::from_secs(10);

impl NatsSink {
    pub fn new(config: NatsSinkConfig) -> Self {
        NatsSink {
            config,
            client: Mutex::new(None),
        }
    }

    async fn client(&self) -> Result<async_nats::Client, SinkError> {
        let mut slot = self.client.lock().await;
        if let Some(connected) = slot.as_mut() {
            match connected.outdated(&self.config) {
                None => return Ok(connected.client.clone()),
                // Files changed, the old login still works: the new connection is made
                // first, and replaces the old one only once it is in.
                Some(Outdated::FilesChanged) if connected.still_works() => {
                    if !connected.may_try_new_files() {
                        return Ok(connected.client.clone());
                    }
                    let url = sched_relay_transport::redact::text(&self.config.url);
                    match connect_watched(&self.config).await {
                        Ok(new) => {
                            tracing::info!(url = %url, "NATS sink: connected with the changed credentials or certificate files; the old connection is closed");
                            *connected = new;
                        }
                        Err(error) => {
                            tracing::warn!(url = %url, error = %error, retry_in = ?RETRY_NEW_FILES, "NATS sink: a connection with the changed credentials or certificate files failed; the old connection goes on meanwhile");
                        }
                    }
                    return Ok(connected.client.clone());
                }
                Some(why) => {
                    let url = sched_relay_transport::redact::text(&self.config.url);
                    tracing::info!(url = %url, "NATS sink: {}; connecting again", why.describe());
                    *slot = None;
                }
            }
        }
        let connected = connect_watched(&self.config).await?;
        let client = connected.client.clone();
        *slot = Some(connected);
        Ok(client)
    }

    fn headers(&self, event: &Event, encoded: &binding::Encoded) -> async_nats::HeaderMap {
        let mut headers = async_nats::HeaderMap::new();
        for (name, value) in &encoded.headers {
            headers.insert(name.as_str(), value.as_str());
        }
        headers.insert("content-type", encoded.content_type.as_str());
        if self.config.jetstream {
            // The stream drops a message whose id it has seen within its duplicate window,
            // so retrying a half-acknowledged batch does not duplicate the acknowledged part.
            // Source and id: the window spans every VM publishing to the stream.
            headers.insert("Nats-Msg-Id", event.message_id());
        }
        headers
    }

    fn sample_subject(&self) -> String {
        self.config
            .subject
            .replace("{vmname}", "healthcheck")
            .replace("{transition}", "scheduled")
            .replace("{eventtype}", "Freeze")
            .replace("{eventid}", "healthcheck")
            .replace("{type}", "com.azure.scheduledevents.scheduled")
    }
}

#[async_trait]
impl Sink for NatsSink {
    async fn deliver(&self, batch: &[Event]) -> Result<(), DeliveryError> {
        let client = self.client().await?;
        let timeout = self.config.timeout;
        // Events are published in order until one fails (`stopped`); what was published before
        // it is then confirmed, so the failure names its event and costs no other.
        let mut stopped: Option<(usize, SinkError)> = None;
        if self.config.jetstream {
            let context = jetstream::new(client);
            let mut acks = Vec::with_capacity(batch.len());
            for (index, event) in batch.iter().enumerate() {
                let encoded = match binding::encode(event, self.config.content_mode, binding::NATS)
                {
                    Ok(encoded) => encoded,
                    Err(error) => {
                        stopped = Some((index, error.into()));
                        break;
                    }
                };
                let subject = expand_template(&self.config.subject, event);
                let published = context
                    .publish_with_headers(
                        subject.clone(),
                        self.headers(event, &encoded),
                        encoded.body.into(),
                    )
                    .await;
                match published {
                    Ok(ack) => acks.push((subject, ack)),
                    Err(e) => {
                        let message = format!("JetStream publish to {subject} failed: {e}");
                        // Too large for the server is this event's fault, for good; the
                        // rest (a connection lost, a timeout) may pass.
                        let error = match e.kind() {
                            jetstream::context::PublishErrorKind::MaxPayloadExceeded => {
                                SinkError::Permanent(format!(
                                    "{message} (raise the server's max_payload)"
                                ))
                            }
                            _ => SinkError::Retriable(message),
                        };
                        stopped = Some((index, error));
                        break;
                    }
                }
            }
            // Acknowledgements come in publishing order: the first missing one ends the
            // confirmed prefix.
            for (index, (subject, ack)) in acks.into_iter().enumerate() {
                let error = match tokio::time::timeout(timeout, ack).await {
                    Ok(Ok(_)) => continue,
                    Ok(Err(error)) => {
                        let hint = match error.kind() {
                            jetstream::context::PublishErrorKind::StreamNotFound => format!(
                                " (no stream captures this subject: {})",
                                create_hint(&subject)
                            ),
                            _ => String::new(),
                        };
                        format!("JetStream did not store {subject}: {error}{hint}")
                    }
                    Err(_) => {
                        format!("no JetStream acknowledgement for {subject} within {timeout:?}")
                    }
                };
                return Err(DeliveryError::at(index, SinkError::Retriable(error)));
            }
            return match stopped {
                Some((index, error)) => Err(DeliveryError::at(index, error)),
                None => Ok(()),
            };
        }
        for (index, event) in batch.iter().enumerate() {
            let encoded = match binding::encode(event, self.config.content_mode, binding::NATS) {
                Ok(encoded) => encoded,
                Err(error) => {
                    stopped = Some((index, error.into()));
                    break;
                }
            };
            let subject = expand_template(&self.config.subject, event);
            if let Err(e) = client
                .publish_with_headers(
                    subject.clone(),
                    self.headers(event, &encoded),
                    encoded.body.into(),
                )
                .await
            {
                let message = format!("publish to {subject} failed: {e}");
                // Too large for the server, or a subject this event's fields made invalid: this
                // event's fault, for good; a send failure may pass.
                let error = match e.kind() {
                    async_nats::client::PublishErrorKind::MaxPayloadExceeded
                    | async_nats::client::PublishErrorKind::InvalidSubject => {
                        SinkError::Permanent(message)
                    }
                    async_nats::client::PublishErrorKind::Send => SinkError::Retriable(message),
                };
                stopped = Some((index, error));
                break;
            }
        }
        // Core NATS has no acknowledgement: the most it can confirm is that the server has
        // the bytes, all of them or none.
        match tokio::time::timeout(timeout, client.flush()).await {
            Ok(Ok(())) => match stopped {
                Some((index, error)) => Err(DeliveryError::at(index, error)),
                None => Ok(()),
            },
            Ok(Err(error)) => {
                Err(SinkError::Retriable(format!("NATS flush failed: {error}")).into())
            }
            Err(_) => Err(SinkError::Retriable(format!(
                "NATS flush not done within {timeout:?} (server down?)"
            ))
            .into()),
        }
    }

    async fn health_check(&self) -> Result<(), SinkError> {
        let client = self.client().await?;
        if self.config.jetstream {
            let subject = self.sample_subject();
            jetstream::new(client)
                .stream_by_subject(subject.clone())
                .await
                .map_err(|e| {
                    SinkError::Permanent(format!(
                        "no JetStream stream captures {subject}: {e} ({})",
                        create_hint(&subject)
                    ))
                })?;
        }
        Ok(())
    }
}

/// What to do when no stream captures `subject`: a stream on its first token, as the layout of
/// docs/src/nats-layout.md has (`scheduledevents.>`, `scheduledapprovals.>`).
fn create_hint(subject: &str) -> String {
    let root = subject.split('.').next().unwrap_or(subject);
    format!("create one, e.g. nats stream add --subjects '{root}.>'")
}

/// A client, and what it was made with: the stamp of its credentials and certificate files,
/// and whether the server has refused its login since (on a reconnect: credentials revoked
/// or rotated on the server). Dropped, it retires its client: async-nats never ends a
/// reconnection loop on its own (`max_reconnects(None)`), so a client replaced while it
/// reconnects would try its old credentials for ever; retired, it waits a year between
/// attempts instead, and its connection closes as soon as its last handle goes.
pub struct Connected {
    pub client: async_nats::Client,
    files: Stamp,
    refused: Arc<AtomicBool>,
    retired: Arc<AtomicBool>,
    /// When a connection with changed files was last tried and failed.
    tried_new_files: Option<std::time::Instant>,
}

/// Why a [`Connected`] client should give way to a new connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outdated {
    /// The server refused the client's login or TLS (on a reconnect).
    Refused,
    /// A credentials or certificate file changed since the client was made.
    FilesChanged,
}

impl Outdated {
    pub fn describe(self) -> &'static str {
        match self {
            Outdated::Refused => "the server refused the login; reading the credentials anew",
            Outdated::FilesChanged => "a credentials or certificate file changed",
        }
    }
}

impl Connected {
    /// Why this client should be replaced by a new connection (files read anew), if it
    /// should: the server refused the client's login, or a credentials or certificate file
    /// of `config` changed.
    pub fn outdated(&self, config: &NatsSinkConfig) -> Option<Outdated> {
        if self.refused.load(Ordering::SeqCst) {
            Some(Outdated::Refused)
        } else if Stamp::of(config.watched_files()) != self.files {
            Some(Outdated::FilesChanged)
        } else {
            None
        }
    }

    /// Whether the client is connected now (a refused one is not).
    pub fn still_works(&self) -> bool {
        !self.refused.load(Ordering::SeqCst)
            && self.client.connection_state() == async_nats::connection::State::Connected
    }

    /// Whether a connection with changed files may be tried now (at most every
    /// [`RETRY_NEW_FILES`] while the old one works); notes the try.
    pub fn may_try_new_files(&mut self) -> bool {
        let due = self
            .tried_new_files
            .is_none_or(|at| at.elapsed() >= RETRY_NEW_FILES);
        if due {
            self.tried_new_files = Some(std::time::Instant::now());
        }
        due
    }
}

impl Drop for Connected {
    fn drop(&mut self) {
        self.retired.store(true, Ordering::SeqCst);
    }
}

/// Connects with the sink's URL, credentials and TLS settings. See [`connect_error`] for what
/// retrying can fix.
pub async fn connect(config: &NatsSinkConfig) -> Result<async_nats::Client, SinkError> {
    let mut connected = connect_watched(config).await?;
    // Never retired: whoever holds this client keeps it reconnecting.
    connected.retired = Arc::new(AtomicBool::new(false));
    Ok(connected.client.clone())
}

/// As [`connect`], with what tells when the client is [`Connected::outdated`] (the sink and
/// the approval source).
pub async fn connect_watched(config: &NatsSinkConfig) -> Result<Connected, SinkError> {
    // Stamped before reading: a file changed while being read shows as changed later.
    let files = Stamp::of(config.watched_files());
    let refused = Arc::new(AtomicBool::new(false));
    let noted = refused.clone();
    let retired = Arc::new(AtomicBool::new(false));
    let parked = retired.clone();
    let mut options = async_nats::ConnectOptions::new()
        .name("sched-relay")
        .connection_timeout(config.timeout)
        .request_timeout(Some(config.timeout))
        .max_reconnects(None)
        // async-nats's own schedule (at once, then doubling from 2 ms to 4 s), but a retired
        // client (replaced, see `Connected`) waits a year: it never logs in again.
        .reconnect_delay_callback(move |attempts| {
            if parked.load(Ordering::SeqCst) {
                std::time::Duration::from_secs(365 * 24 * 3600)
            } else if attempts <= 1 {
                std::time::Duration::ZERO
            } else {
                let exponent = u32::try_from(attempts - 1).unwrap_or(u32::MAX);
                std::time::Duration::from_millis(2_u64.saturating_pow(exponent))
                    .min(std::time::Duration::from_secs(4))
            }
        })
        .event_callback(move |event| {
            let noted = noted.clone();
            async move {
                if refuses_login(&event) {
                    noted.store(true, Ordering::SeqCst);
                }
            }
        });
    if let Some(path) = &config.credentials_file {
        // Unreadable now (a rotation replacing it): retried, never dead-lettered.
        options = options.credentials_file(path).await.map_err(|e| {
            SinkError::Retriable(format!(
                "cannot read credentials_file {}: {e}",
                path.display()
            ))
        })?;
    }
    if let Some(token) = sched_relay_transport::secret::resolve_for_connection(
        config.token.as_ref(),
        config.token_file.as_deref(),
        "token",
    )? {
        options = options.token(token);
    }
    let password = sched_relay_transport::secret::resolve_for_connection(
        config.password.as_ref(),
        config.password_file.as_deref(),
        "password",
    )?;
    if let Some(user) = &config.user {
        options = options.user_and_password(user.clone(), password.unwrap_or_default());
    }
    if let Some(prefix) = &config.inbox_prefix {
        options = options.custom_inbox_prefix(prefix.clone());
    }
    // A CA or client certificate means TLS: never a plain connection to a server that
    // happens not to ask for TLS.
    if config.tls || config.ca_file.is_some() || config.client_cert_file.is_some() {
        options = options.require_tls(true);
    }
    if let Some(ca) = &config.ca_file {
        options = options.add_root_certificates(ca.clone());
    }
    if let (Some(cert), Some(key)) = (&config.client_cert_file, &config.client_key_file) {
        options = options.add_client_certificate(cert.clone(), key.clone());
    }
    let servers: Vec<String> = config.url.split(',').map(|s| s.trim().to_owned()).collect();
    let client = options.connect(servers).await.map_err(|error| {
        // async-nats reports most handshake failures as I/O errors: found by their type.
        let tls = sched_relay_transport::tls::failure(&error);
        let message = sched_relay_transport::redact::text(&format!(
            "cannot connect to NATS at {}: {}",
            config.url,
            tls.as_deref().unwrap_or(&error.to_string())
        ))
        .into_owned();
        match tls {
            Some(_) => SinkError::Authentication(message),
            None => connect_error(error.kind(), message),
        }
    })?;
    Ok(Connected {
        client,
        files,
        refused,
        retired,
        tried_new_files: None,
    })
}

/// Whether async-nats reports that the server refused the client's login or its TLS (on a
/// reconnect, which async-nats then keeps trying with what it was given at the start).
fn refuses_login(event: &async_nats::Event) -> bool {
    match event {
        async_nats::Event::ServerError(async_nats::ServerError::AuthorizationViolation) => true,
        async_nats::Event::ClientError(async_nats::ClientError::Other(error)) => {
            let error = error.to_ascii_lowercase();
            ["authorization", "authentication", "tls", "certificate"]
                .iter()
                .any(|word| error.contains(word))
        }
        _ => false,
    }
}

/// Classifies a failed connection by async-nats's error kind. A refused login or a failed
/// TLS handshake is retried (loudly): credentials are rotated, and an expired or re-issued
/// server certificate is replaced, on the server without touching the agent; dead-lettering
/// every event meanwhile would lose them to a certificate renewal. A server list that cannot
/// work is not retried.
pub fn connect_error(kind: async_nats::ConnectErrorKind, message: String) -> SinkError {
    use async_nats::ConnectErrorKind::*;
    match kind {
        AuthorizationViolation | Authentication => SinkError::Authentication(format!(
            "{message} (check user/password, token or credentials_file)"
        )),
        Tls => SinkError::Authentication(format!(
            "{message} (TLS failed: check tls, ca_file, client_cert_file/client_key_file and the server's certificate)"
        )),
        ServerParse => SinkError::Permanent(message),
        Dns | TimedOut | Io | MaxReconnects => SinkError::Retriable(message),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use async_nats::ConnectErrorKind;

    #[test]
    fn a_refused_login_or_tls_handshake_is_retried_as_an_authentication_failure() {
        // A broker whose certificate expired or was re-issued by a CA not yet in ca_file:
        // the events wait for the fix instead of all going to the dead-letter file.
        for kind in [
            ConnectErrorKind::AuthorizationViolation,
            ConnectErrorKind::Authentication,
            ConnectErrorKind::Tls,
        ] {
            let error = connect_error(kind, "refused".into());
            assert!(
                error.is_retriable() && error.is_authentication(),
                "{kind:?}: {error}"
            );
        }
    }

    #[test]
    fn only_a_configuration_that_cannot_work_is_permanent() {
        assert!(!connect_error(ConnectErrorKind::ServerParse, "url".into()).is_retriable());
        for kind in [
            ConnectErrorKind::Io,
            ConnectErrorKind::TimedOut,
            ConnectErrorKind::Dns,
        ] {
            let error = connect_error(kind, "down".into());
            assert!(
                error.is_retriable() && !error.is_authentication(),
                "{kind:?}"
            );
        }
    }
}
