//! The AMQP client side of the sink.

use async_trait::async_trait;
use cloudevents::AttributesReader;
use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use sched_relay_transport::binding::{self, expand_template};
use sched_relay_transport::files::Stamp;
use sched_relay_transport::{DeliveryError, Event, Sink, SinkError};
use tokio::sync::Mutex;

use crate::{AmqpSinkConfig, FRAME_MAX, Frame, HeaderStyle};

/// Publishes CloudEvents to an AMQP 0-9-1 exchange with publisher confirms. Connects on first
/// use and again after any connection or channel failure, and once a password or
/// certificate file has changed (read anew then).
pub struct AmqpSink {
    config: AmqpSinkConfig,
    connection: Mutex<Option<(Connection, Channel, Stamp)>>,
    /// When a connection with changed files was last tried and failed (the old one going on).
    tried_new_files: std::sync::Mutex<Option<std::time::Instant>>,
}

/// How long a connection that still works is kept after a new one with changed files failed
/// (the broker does not take the new password or certificate yet), before trying again.
pub const RETRY_NEW_FILES: std::time::Duration = std::time::Duration::from_secs(10);

/// Closes a connection that is no longer used, without waiting on it (a half-open one would
/// hold the caller until the broker's timeout).
pub fn close_in_background(connection: Connection, why: &'static str) {
    tokio::spawn(async move {
        let _ = tokio::time::timeout(
            std::time::Duration::from_secs(5),
            connection.close(200, why.into()),
        )
        .await;
    });
}

impl AmqpSink {
    pub fn new(config: AmqpSinkConfig) -> Self {
        AmqpSink {
            config,
            connection: Mutex::new(None),
            tried_new_files: std::sync::Mutex::new(None),
        }
    }

    /// The URL to connect with: the password from its file, and the frame to propose.
    fn uri(&self, frame: Frame) -> Result<String, SinkError> {
        let password = sched_relay_transport::secret::resolve_for_connection(
            self.config.password.as_ref(),
            self.config.password_file.as_deref(),
            "password",
        )?;
        let mut url = url::Url::parse(&self.config.url)
            .map_err(|e| SinkError::Permanent(format!("url: {e}")))?;
        if let Some(password) = password {
            url.set_password(Some(&password))
                .map_err(|_| SinkError::Permanent("url: cannot carry a password".into()))?;
        }
        frame.propose(&mut url);
        Ok(url.to_string())
    }

    /// The stamp of the password and certificate files (see [`Stamp`]).
    pub fn files(&self) -> Stamp {
        Stamp::of(self.config.watched_files())
    }

    /// A host:port/vhost description of the broker without credentials, for messages.
    fn broker(&self) -> String {
        url::Url::parse(&self.config.url)
            .map(|url| {
                format!(
                    "{}:{}{}",
                    url.host_str().unwrap_or("?"),
                    url.port().unwrap_or(5672),
                    url.path()
                )
            })
            .unwrap_or_else(|_| "the broker".into())
    }

    async fn channel(&self) -> Result<Channel, SinkError> {
        let mut slot = self.connection.lock().await;
        if let Some((connection, channel, files)) = slot.as_ref()
            && connection.status().connected()
            && channel.status().connected()
        {
            if self.files() == *files || !self.may_try_new_files() {
                return Ok(channel.clone());
            }
            // A password or certificate file changed: the new connection is made first, and
            // replaces the old one only once it is in.
            match self.connect_declared().await {
                Ok((new_connection, new_channel, new_files)) => {
                    tracing::info!(broker = %self.broker(), "AMQP sink: connected with the changed password or certificate files; the old connection is closed");
                    if let Some((old, _, _)) =
                        slot.replace((new_connection, new_channel.clone(), new_files))
                    {
                        close_in_background(old, "credentials rotated");
                    }
                    return Ok(new_channel);
                }
                Err(error) => {
                    tracing::warn!(broker = %self.broker(), error = %error, retry_in = ?RETRY_NEW_FILES, "AMQP sink: a connection with the changed password or certificate files failed; the old connection goes on meanwhile");
                    return Ok(channel.clone());
                }
            }
        }
        if let Some((old, _, _)) = slot.take() {
            close_in_background(old, "reconnecting");
        }
        let (connection, channel, files) = self.connect_declared().await?;
        *slot = Some((connection, channel.clone(), files));
        Ok(channel)
    }

    /// A new connection and confirming channel, the exchange declared when asked, and the
    /// stamp of the files it was made with.
    async fn connect_declared(&self) -> Result<(Connection, Channel, Stamp), SinkError> {
        let files = self.files();
        let (connection, channel) = self.open(true, Frame::UnlessSet(FRAME_MAX)).await?;
        if self.config.declare
            && let Err(error) = self.declare(&channel).await
        {
            close_in_background(connection, "declaration failed");
            return Err(error);
        }
        Ok((connection, channel, files))
    }

    /// Whether a connection with changed files may be tried now (at most every
    /// [`RETRY_NEW_FILES`] while the old one works); notes the try.
    pub fn may_try_new_files(&self) -> bool {
        let mut tried = self
            .tried_new_files
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let due = tried.is_none_or(|at| at.elapsed() >= RETRY_NEW_FILES);
        if due {
            *tried = Some(std::time::Instant::now());
        }
        due
    }

    /// Connects and opens a channel (with publisher confirms when asked); also used by the
    /// approval source, so both directions share the URL, credentials and TLS settings.
    ///
    /// `frame`: the frame size to propose ([`FRAME_MAX`] to publish, [`CONSUMER_FRAME_MAX`]
    /// to consume, unless the URL sets one).
    pub async fn open(
        &self,
        confirms: bool,
        frame: Frame,
    ) -> Result<(Connection, Channel), SinkError> {
        let timeout = self.config.timeout;
        let connect = async {
            let properties =
                ConnectionProperties::default().with_connection_name("sched-relay".into());
            // A TLS file that cannot be read now (being replaced by a rotation, say) is the
            // sink's state, not any event's: retried. (Loading the configuration at start
            // refuses files it cannot read.)
            let read = |path: &std::path::PathBuf, what: &str| {
                std::fs::read(path).map_err(|e| {
                    SinkError::Retriable(format!("cannot read {what} {}: {e}", path.display()))
                })
            };
            let identity = match (&self.config.client_cert_file, &self.config.client_key_file) {
                (Some(cert), Some(key)) => Some(lapin::tcp::OwnedIdentity::PKCS8 {
                    pem: read(cert, "client_cert_file")?,
                    key: read(key, "client_key_file")?,
                }),
                _ => None,
            };
            let tls = lapin::tcp::OwnedTLSConfig {
                identity,
                cert_chain: match &self.config.ca_file {
                    Some(path) => {
                        Some(String::from_utf8_lossy(&read(path, "ca_file")?).into_owned())
                    }
                    None => None,
                },
            };
            let runtime = lapin::runtime::default_runtime()
                .map_err(|e| SinkError::Permanent(format!("no async runtime for AMQP: {e}")))?;
            let connection =
                Connection::connect_with_config(&self.uri(frame)?, properties, tls, runtime)
                    .await
                    .map_err(|e| self.classify(e, "cannot connect"))?;
            let channel = connection
                .create_channel()
                .await
                .map_err(|e| self.classify(e, "cannot open a channel"))?;
            if confirms {
                channel
                    .confirm_select(ConfirmSelectOptions::default())
                    .await
                    .map_err(|e| self.classify(e, "cannot enable publisher confirms"))?;
            }
            Ok::<_, SinkError>((connection, channel))
        };
        tokio::time::timeout(timeout, connect).await.map_err(|_| {
            SinkError::Retriable(format!(
                "no AMQP connection to {} within {timeout:?}",
                self.broker()
            ))
        })?
    }

    async fn declare(&self, channel: &Channel) -> Result<(), SinkError> {
        let config = &self.config;
        let kind = match config.exchange_type.as_str() {
            "direct" => ExchangeKind::Direct,
            "fanout" => ExchangeKind::Fanout,
            "headers" => ExchangeKind::Headers,
            _ => ExchangeKind::Topic,
        };
        let durable = ExchangeDeclareOptions {
            durable: true,
            ..ExchangeDeclareOptions::default()
        };
        channel
            .exchange_declare(
                config.exchange.as_str().into(),
                kind,
                durable,
                FieldTable::default(),
            )
            .await
            .map_err(|e| {
                self.classify(e, &format!("cannot declare exchange {}", config.exchange))
            })?;
        if let Some(queue) = &config.queue {
            let durable = QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            };
            channel
                .queue_declare(queue.as_str().into(), durable, FieldTable::default())
                .await
                .map_err(|e| self.classify(e, &format!("cannot declare queue {queue}")))?;
            channel
                .queue_bind(
                    queue.as_str().into(),
                    config.exchange.as_str().into(),
                    config.binding_key.as_str().into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await
                .map_err(|e| self.classify(e, &format!("cannot bind queue {queue}")))?;
        }
        Ok(())
    }

    /// Classifies the error of this operation from lapin's typed error (the broker's reply
    /// code), never from its text: see [`fault`].
    pub fn classify(&self, error: lapin::Error, what: &str) -> SinkError {
        if let Some(tls) = sched_relay_transport::tls::failure(&error) {
            // Retried (loudly): a certificate is renewed on the broker without the agent.
            return SinkError::Authentication(format!("{what} on {}: {tls}", self.broker()));
        }
        let message = format!("{what} on {}: {error}", self.broker());
        match fault(error.kind()) {
            AmqpFault::Authentication => SinkError::Authentication(format!(
                "{message} (check the user and password in url, and the user's permissions on the vhost and exchange)"
            )),
            // A missing exchange is the broker's state (being recreated, say), the same for
            // every event: they wait in the outbox rather than all go to the dead-letter file.
            AmqpFault::NotFound => SinkError::Retriable(format!(
                "{message} (create the exchange, or set declare = true)"
            )),
            AmqpFault::Refused => SinkError::Permanent(message),
            AmqpFault::Transient => SinkError::Retriable(message),
        }
    }

    fn properties(&self, event: &Event, encoded: &binding::Encoded) -> BasicProperties {
        let mut headers = FieldTable::default();
        for (name, value) in &encoded.headers {
            headers.insert(
                ShortString::from(name.as_str()),
                AMQPValue::LongString(LongString::from(value.as_str())),
            );
        }
        let timestamp = event
            .time()
            .map(|t| t.timestamp().max(0) as u64)
            .unwrap_or_default();
        BasicProperties::default()
            .with_content_type(encoded.content_type.as_str().into())
            .with_message_id(event.id().into())
            .with_delivery_mode(2)
            .with_timestamp(timestamp)
            .with_app_id("sched-relay".into())
            .with_headers(headers)
    }

    async fn forget_connection(&self) {
        *self.connection.lock().await = None;
    }
}

#[async_trait]
impl Sink for AmqpSink {
    async fn deliver(&self, batch: &[Event]) -> Result<(), DeliveryError> {
        let channel = self.channel().await?;
        let style = match self.config.header_style {
            HeaderStyle::Rabbitmq => binding::AMQP_RABBITMQ,
            HeaderStyle::Amqp1 => binding::AMQP_1_0,
        };
        let mandatory = BasicPublishOptions {
            mandatory: true,
            ..BasicPublishOptions::default()
        };
        // Published in order until one fails (`stopped`); the confirms of what was published
        // before it decide the confirmed prefix, and each failure names its event.
        let mut stopped: Option<(usize, SinkError)> = None;
        let mut confirms = Vec::with_capacity(batch.len());
        for (index, event) in batch.iter().enumerate() {
            let encoded = match binding::encode(event, self.config.content_mode, style) {
                Ok(encoded) => encoded,
                Err(error) => {
                    stopped = Some((index, error.into()));
                    break;
                }
            };
            let routing_key = expand_template(&self.config.routing_key, event);
            let published = channel
                .basic_publish(
                    self.config.exchange.as_str().into(),
                    routing_key.as_str().into(),
                    mandatory,
                    &encoded.body,
                    self.properties(event, &encoded),
                )
                .await;
            match published {
                Ok(confirm) => confirms.push((routing_key, confirm)),
                Err(error) => {
                    stopped = Some((index, self.classify(error, "publish failed")));
                    break;
                }
            }
        }
        let timeout = self.config.timeout;
        let mut confirmations = Vec::with_capacity(confirms.len());
        let mut failed = None;
        for (index, (routing_key, confirm)) in confirms.into_iter().enumerate() {
            match tokio::time::timeout(timeout, confirm).await {
                Err(_) => {
                    failed = Some((
                        index,
                        SinkError::Retriable(format!(
                            "no publisher confirm from {} within {timeout:?}",
                            self.broker()
                        )),
                    ));
                    break;
                }
                Ok(Err(error)) => {
                    failed = Some((index, self.classify(error, "publish not confirmed")));
                    break;
                }
                Ok(Ok(confirmation)) => confirmations.push((routing_key, confirmation)),
            }
        }
        if let Some((index, error)) = failed {
            self.forget_connection().await;
            // An event before it may have been returned or nacked: that one is the first
            // not stored.
            let (index, error) = crate::confirms::first_unstored(
                batch,
                &confirmations,
                &self.config.exchange,
                &self.broker(),
            )
            .unwrap_or((index, error));
            return Err(DeliveryError::at(index, error));
        }
        if let Some((index, error)) = crate::confirms::first_unstored(
            batch,
            &confirmations,
            &self.config.exchange,
            &self.broker(),
        ) {
            return Err(DeliveryError::at(index, error));
        }
        match stopped {
            Some((index, error)) => {
                if error.is_retriable() {
                    // A failed publish leaves the channel unusable: start afresh next time.
                    self.forget_connection().await;
                }
                Err(DeliveryError::at(index, error))
            }
            None => Ok(()),
        }
    }

    async fn health_check(&self) -> Result<(), SinkError> {
        let channel = self.channel().await?;
        if self.config.declare {
            return Ok(());
        }
        let passive = ExchangeDeclareOptions {
            passive: true,
            ..ExchangeDeclareOptions::default()
        };
        let checked = channel
            .exchange_declare(
                self.config.exchange.as_str().into(),
                ExchangeKind::Topic,
                passive,
                FieldTable::default(),
            )
            .await;
        if let Err(error) = checked {
            // A failed passive declare closes the channel: start afresh next time.
            self.forget_connection().await;
            return Err(self.classify(
                error,
                &format!("exchange {} is not usable", self.config.exchange),
            ));
        }
        Ok(())
    }
}

/// What a failed AMQP operation means for delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AmqpFault {
    /// The broker refused the login, or the user's access to the vhost or exchange (403
    /// ACCESS_REFUSED, 530 NOT_ALLOWED, a failing auth provider). Retried: passwords are
    /// rotated and permissions granted on the broker without touching the agent.
    Authentication,
    /// 404 NOT_FOUND: the exchange or queue does not exist.
    NotFound,
    /// The broker refused the message or the configuration (content too large, an exchange
    /// declared with another type, an invalid vhost path, an unsupported method).
    Refused,
    /// Everything else: the network, a broker restart, a closed channel, a missed heartbeat.
    Transient,
}

/// Reads a lapin error kind: AMQP reply codes for what the broker said, lapin's own kinds for
/// what happened on this side.
pub fn fault(kind: &lapin::ErrorKind) -> AmqpFault {
    use lapin::ErrorKind;
    match kind {
        ErrorKind::ProtocolError(error) => match error.get_id() {
            403 | 530 => AmqpFault::Authentication,
            404 => AmqpFault::NotFound,
            311 | 402 | 406 | 502 | 503 | 540 => AmqpFault::Refused,
            _ => AmqpFault::Transient,
        },
        ErrorKind::AuthProviderError(_) => AmqpFault::Authentication,
        ErrorKind::InvalidProtocolVersion(_) | ErrorKind::SerialisationError(_) => {
            AmqpFault::Refused
        }
        _ => AmqpFault::Transient,
    }
}

#[cfg(test)]
mod tests;
