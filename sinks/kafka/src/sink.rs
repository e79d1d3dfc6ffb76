//! The librdkafka side of the Kafka sink.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use cloudevents::AttributesReader;
use rdkafka::client::ClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::DeliveryResult;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer, ProducerContext};
use sched_relay_transport::binding;
use sched_relay_transport::{DeliveryError, Event, Sink, SinkError};
use tokio::sync::oneshot;

use crate::KafkaSinkConfig;

/// Keeps the last error librdkafka reported for its connections (a refused login, an
/// unreachable broker) since the current attempt began: the calls themselves only say
/// "transport failure".
#[derive(Clone, Default)]
struct LastError(std::sync::Arc<Mutex<Option<ReportedError>>>);

/// An error code (when librdkafka has one) and its reason text.
type ReportedError = (Option<RDKafkaErrorCode>, String);

impl ClientContext for LastError {
    fn error(&self, error: KafkaError, reason: &str) {
        let code = error.rdkafka_error_code();
        let mut last = self.0.lock().unwrap_or_else(|p| p.into_inner());
        // "1/1 brokers are down" follows the reason they are down (a failed TLS handshake, a
        // refused login): the reason is what the operator needs, and what decides the class.
        if code == Some(RDKafkaErrorCode::AllBrokersDown) && last.is_some() {
            return;
        }
        *last = Some((code, reason.to_owned()));
    }
}

impl LastError {
    fn get(&self) -> Option<ReportedError> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Forgets what was reported, after a success: until then a failed attempt is explained
    /// by the last reason librdkafka gave. That reason may be older than the attempt:
    /// librdkafka repeats an identical broker error only every 30 s, so clearing it at each
    /// attempt left most attempts of a TLS or login failure as a bare "timed out". A reported
    /// reason only ever makes a failure retried (authentication, TLS), never permanent.
    fn clear(&self) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }
}

/// Each message carries the sender its delivery report completes.
type Report = oneshot::Sender<Result<(), KafkaError>>;

impl ProducerContext for LastError {
    type DeliveryOpaque = Box<Report>;

    fn delivery(&self, result: &DeliveryResult<'_>, report: Box<Report>) {
        let _ = report.send(
            result
                .as_ref()
                .map(|_| ())
                .map_err(|(error, _)| error.clone()),
        );
    }
}

/// A producer with its own report thread. rust-rdkafka's FutureProducer polls every 100 ms
/// even when idle (about 30 CPU seconds an hour, measured); a delivery report wakes
/// librdkafka's poll at once anyway, so this thread waits up to a second between reports.
struct Polled {
    producer: BaseProducer<LastError>,
}

type RelayProducer = Arc<Polled>;

/// How long the report thread waits when nothing happens (it bounds how soon the thread
/// notices that its producer was dropped).
const IDLE_POLL: Duration = Duration::from_secs(10);

impl Polled {
    fn start(producer: BaseProducer<LastError>) -> Result<RelayProducer, String> {
        let polled = Arc::new(Polled { producer });
        let reports = Arc::downgrade(&polled);
        std::thread::Builder::new()
            .name("kafka-reports".into())
            .spawn(move || {
                // Ends once the sink has dropped the producer (replaced or shut down).
                while let Some(polled) = reports.upgrade() {
                    polled.producer.poll(IDLE_POLL);
                }
            })
            .map_err(|e| format!("cannot start the Kafka report thread: {e}"))?;
        Ok(polled)
    }
}

/// Produces CloudEvents to one topic. librdkafka keeps its own connections and reconnects by
/// itself; a message it cannot deliver within `timeout` is reported and retried by the fan-out.
/// An idempotent producer can enter a fatal state (fenced, or a sequence gap after a
/// timeout); it is then replaced by a new one, so delivery resumes instead of failing forever.
pub struct KafkaSink {
    config: KafkaSinkConfig,
    producer: Mutex<Result<RelayProducer, String>>,
    /// Shared with every producer this sink creates.
    last_error: LastError,
}

impl KafkaSink {
    pub fn new(config: KafkaSinkConfig) -> Self {
        let last_error = LastError::default();
        let producer = Mutex::new(Self::producer(&config, &last_error));
        KafkaSink {
            config,
            producer,
            last_error,
        }
    }

    fn producer(config: &KafkaSinkConfig, last_error: &LastError) -> Result<RelayProducer, String> {
        let mut client = client_config(config)?;
        client
            .set("acks", "all")
            .set("enable.idempotence", "true")
            .set("message.timeout.ms", config.timeout.as_millis().to_string());
        if !config.options.contains_key("linger.ms") {
            // librdkafka waits 5 ms to fill batches by default: most of a goal of 10 ms. A
            // batch the fan-out hands over is queued at once and still goes out together.
            client.set("linger.ms", "1");
        }
        let producer = client
            .create_with_context(last_error.clone())
            .map_err(|e| format!("cannot create the Kafka producer: {e}"))?;
        Polled::start(producer)
    }

    /// The producer; one that could not be created (a secret file not written yet, a
    /// producer replaced after a fatal error that failed to start) is created again on each
    /// attempt, so the sink recovers without a restart. Until then the events wait in the
    /// outbox: a failure to create the producer is the sink's state, not any event's.
    fn current_producer(&self) -> Result<RelayProducer, SinkError> {
        let mut slot = self.producer.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_err() {
            *slot = Self::producer(&self.config, &self.last_error);
        }
        slot.clone().map_err(SinkError::Retriable)
    }

    /// After a fatal producer error, starts over with a new producer (a new producer id).
    fn replace_if_fatal(&self, producer: &RelayProducer, error: &KafkaError) -> bool {
        use RDKafkaErrorCode::*;
        let fenced = matches!(
            error.rdkafka_error_code(),
            Some(ProducerFenced | InvalidProducerEpoch | OutOfOrderSequenceNumber)
        );
        if !fenced && producer.producer.client().fatal_error().is_none() {
            return false;
        }
        *self.producer.lock().unwrap_or_else(|p| p.into_inner()) =
            Self::producer(&self.config, &self.last_error);
        true
    }

    /// Classifies the error of this attempt by its error codes (see [`fault`]), with what
    /// librdkafka reported for its connections during the attempt.
    fn classify(&self, error: &KafkaError, what: &str) -> SinkError {
        let reported = self.last_error.get();
        let mut message = format!(
            "{what} (topic {}, brokers {}): {error}",
            self.config.topic, self.config.brokers
        );
        if let Some((_, reason)) = &reported {
            message = format!("{message}; the connection reported: {reason}");
        }
        match fault(
            error.rdkafka_error_code(),
            reported.and_then(|(code, _)| code),
        ) {
            KafkaFault::Authentication => SinkError::Authentication(format!(
                "{message} (check security_protocol, sasl_mechanism, sasl_username, sasl_password and the topic's ACLs)"
            )),
            KafkaFault::Tls => SinkError::Authentication(format!(
                "{message} (TLS failed: check ca_file, client_cert_file/client_key_file and the broker's certificate and host name)"
            )),
            KafkaFault::Refused => SinkError::Permanent(message),
            KafkaFault::Transient => SinkError::Retriable(message),
        }
    }
}

/// What a failed Kafka operation means for delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KafkaFault {
    /// A refused login or ACL. Retried: credentials are rotated and ACLs granted on the
    /// cluster without touching the agent.
    Authentication,
    /// A failed TLS handshake (a broker certificate the sink does not trust, a client
    /// certificate the broker refused). Retried, loudly, like a refused login: certificates
    /// are renewed on the broker without touching the agent.
    Tls,
    /// A message or topic the cluster can never take (too large, invalid, an invalid name).
    Refused,
    /// Timeouts, unreachable brokers, leader changes, a missing topic being created.
    Transient,
}

/// Reads the error code of the failed call and the code librdkafka reported for its
/// connections during the same attempt (a transport failure says only "transport").
pub fn fault(code: Option<RDKafkaErrorCode>, reported: Option<RDKafkaErrorCode>) -> KafkaFault {
    use RDKafkaErrorCode::*;
    let authentication = |code: Option<RDKafkaErrorCode>| {
        matches!(
            code,
            Some(
                Authentication
                    | SaslAuthenticationFailed
                    | UnsupportedSASLMechanism
                    | TopicAuthorizationFailed
                    | ClusterAuthorizationFailed
                    | TransactionalIdAuthorizationFailed
            )
        )
    };
    // The call's own verdict on its message comes first: a connection's reported trouble
    // must not keep an event the cluster can never take in the queue forever.
    if matches!(
        code,
        Some(MessageSizeTooLarge | InvalidMessage | InvalidMessageSize | InvalidTopic)
    ) {
        return KafkaFault::Refused;
    }
    if authentication(code) || authentication(reported) {
        return KafkaFault::Authentication;
    }
    if code == Some(SSL) || reported == Some(SSL) {
        return KafkaFault::Tls;
    }
    match code {
        Some(MessageSizeTooLarge | InvalidMessage | InvalidMessageSize | InvalidTopic) => {
            KafkaFault::Refused
        }
        _ => KafkaFault::Transient,
    }
}

#[async_trait]
impl Sink for KafkaSink {
    async fn deliver(&self, batch: &[Event]) -> Result<(), DeliveryError> {
        let producer = self.current_producer()?;
        // Queued in order until one cannot be (`stopped`); the delivery reports of what was
        // queued before it decide the confirmed prefix, and each failure names its event.
        let mut stopped: Option<(usize, SinkError)> = None;
        let mut deliveries = Vec::with_capacity(batch.len());
        for (index, event) in batch.iter().enumerate() {
            let encoded = match binding::encode(event, self.config.content_mode, binding::KAFKA) {
                Ok(encoded) => encoded,
                Err(error) => {
                    stopped = Some((index, error.into()));
                    break;
                }
            };
            let mut headers = OwnedHeaders::new_with_capacity(encoded.headers.len() + 1);
            for (name, value) in &encoded.headers {
                headers = headers.insert(Header {
                    key: name,
                    value: Some(value.as_bytes()),
                });
            }
            headers = headers.insert(Header {
                key: "content-type",
                value: Some(encoded.content_type.as_bytes()),
            });
            let key = event
                .extension("partitionkey")
                .map(|v| v.to_string())
                .or_else(|| event.subject().map(str::to_owned))
                .unwrap_or_else(|| event.id().to_owned());
            let (report, delivery) = oneshot::channel();
            let record = BaseRecord::with_opaque_to(&self.config.topic, Box::new(report))
                .key(&key)
                .payload(&encoded.body)
                .headers(headers);
            // Enqueue everything first, then wait for the reports in order: one round trip
            // for the batch, and idempotence keeps the order within a partition.
            match producer.producer.send(record) {
                Ok(()) => deliveries.push((event.id().to_owned(), delivery)),
                Err((error, _)) => {
                    stopped = Some((index, self.classify(&error, "cannot queue a message")));
                    break;
                }
            }
        }
        for (index, (id, delivery)) in deliveries.into_iter().enumerate() {
            let error = match delivery.await {
                Ok(Ok(())) => continue,
                Ok(Err(error)) if self.replace_if_fatal(&producer, &error) => {
                    SinkError::Retriable(format!(
                        "{id} not delivered: {error}; the producer was in a fatal state and has been replaced"
                    ))
                }
                Ok(Err(error)) => self.classify(&error, &format!("{id} not delivered")),
                Err(_) => {
                    SinkError::Retriable(format!("{id}: the producer dropped the delivery report"))
                }
            };
            return Err(DeliveryError::at(index, error));
        }
        match stopped {
            Some((index, error)) => Err(DeliveryError::at(index, error)),
            None => {
                self.last_error.clear();
                Ok(())
            }
        }
    }

    async fn health_check(&self) -> Result<(), SinkError> {
        let producer = self.current_producer()?;
        let fetching = producer.clone();
        let topic = self.config.topic.clone();
        let timeout = self.config.timeout;
        let metadata = tokio::task::spawn_blocking(move || {
            fetching
                .producer
                .client()
                .fetch_metadata(Some(&topic), timeout)
        })
        .await
        .map_err(|e| SinkError::Retriable(format!("metadata task failed: {e}")))?
        .map_err(|e| self.classify(&e, "cannot fetch metadata"))?;
        let topic = metadata
            .topics()
            .iter()
            .find(|t| t.name() == self.config.topic);
        match topic {
            Some(topic) if topic.error().is_none() && !topic.partitions().is_empty() => {
                self.last_error.clear();
                Ok(())
            }
            _ => Err(SinkError::Permanent(format!(
                "topic {} does not exist on {} (create it, e.g. kafka-topics.sh --create --topic {})",
                self.config.topic, self.config.brokers, self.config.topic
            ))),
        }
    }
}

/// The connection settings (brokers, security, SASL, CA, extra options) shared by the
/// producer and the approval source's consumer.
pub fn client_config(config: &KafkaSinkConfig) -> Result<ClientConfig, String> {
    let mut client = ClientConfig::new();
    for (key, value) in &config.options {
        client.set(key, value);
    }
    client
        .set("bootstrap.servers", &config.brokers)
        .set("client.id", "sched-relay")
        .set("security.protocol", &config.security_protocol);
    if !config.options.contains_key("allow.auto.create.topics") {
        // A typo in `topic` must be an error, not a new topic.
        client.set("allow.auto.create.topics", "false");
    }
    if let Some(mechanism) = &config.sasl_mechanism {
        client.set("sasl.mechanism", mechanism);
    }
    if let Some(user) = &config.sasl_username {
        client.set("sasl.username", user);
    }
    let password = sched_relay_transport::secret::resolve(
        config.sasl_password.as_ref(),
        config.sasl_password_file.as_deref(),
        "sasl_password",
    )?;
    if let Some(password) = password {
        client.set("sasl.password", password);
    }
    if let Some(ca) = &config.ca_file {
        client.set("ssl.ca.location", ca.display().to_string());
    }
    if let (Some(cert), Some(key)) = (&config.client_cert_file, &config.client_key_file) {
        client
            .set("ssl.certificate.location", cert.display().to_string())
            .set("ssl.key.location", key.display().to_string());
    }
    Ok(client)
}

#[cfg(test)]
mod tests {
    use super::*;
    use RDKafkaErrorCode::*;

    #[test]
    fn a_password_file_written_after_the_start_is_read_on_the_next_attempt() {
        // A sidecar (or a rotation that deletes, then writes) provides the file a moment
        // after the agent started: the events wait, and the sink needs no restart.
        let dir = tempfile::tempdir().unwrap();
        let password = dir.path().join("kafka-password");
        let config: KafkaSinkConfig = toml::from_str(&format!(
            "brokers = \"127.0.0.1:1\"\nsecurity_protocol = \"sasl_plaintext\"\n\
             sasl_mechanism = \"PLAIN\"\nsasl_username = \"relay\"\n\
             sasl_password_file = {:?}\n",
            password.display().to_string()
        ))
        .unwrap();
        let sink = KafkaSink::new(config);
        let error = sink.current_producer().err().expect("no password yet");
        assert!(error.is_retriable(), "{error}");
        std::fs::write(&password, "s3cret\n").unwrap();
        assert!(sink.current_producer().is_ok());
    }

    #[test]
    fn a_refused_login_or_acl_is_an_authentication_fault_retried_not_permanent() {
        let failure = KafkaError::MessageProduction(SaslAuthenticationFailed);
        assert_eq!(
            fault(failure.rdkafka_error_code(), None),
            KafkaFault::Authentication
        );
        assert_eq!(
            fault(Some(TopicAuthorizationFailed), None),
            KafkaFault::Authentication
        );
        // A transport failure during which the connection reported a refused login.
        assert_eq!(
            fault(Some(BrokerTransportFailure), Some(Authentication)),
            KafkaFault::Authentication
        );
    }

    #[test]
    fn a_failed_tls_handshake_is_retried_loudly_not_permanent() {
        // librdkafka reports the handshake (OpenSSL) on the connection; the call times out.
        let timeout = KafkaError::MessageProduction(MessageTimedOut);
        assert_eq!(
            fault(timeout.rdkafka_error_code(), Some(SSL)),
            KafkaFault::Tls
        );
        assert_eq!(fault(Some(SSL), None), KafkaFault::Tls);
    }

    #[test]
    fn a_message_the_cluster_refuses_is_refused_whatever_the_connection_reported() {
        // One broker with a bad certificate must not keep an oversized event queued forever.
        for reported in [SSL, Authentication, SaslAuthenticationFailed] {
            assert_eq!(
                fault(Some(MessageSizeTooLarge), Some(reported)),
                KafkaFault::Refused
            );
        }
    }

    #[test]
    fn only_the_calls_and_the_reported_codes_decide() {
        // Nothing reported since the last success: a timeout is a timeout.
        let timeout = KafkaError::MessageProduction(MessageTimedOut);
        assert_eq!(
            fault(timeout.rdkafka_error_code(), None),
            KafkaFault::Transient
        );
        assert_eq!(fault(Some(MessageSizeTooLarge), None), KafkaFault::Refused);
        assert_eq!(fault(Some(InvalidTopic), None), KafkaFault::Refused);
        assert_eq!(
            fault(Some(UnknownTopicOrPartition), None),
            KafkaFault::Transient
        );
        assert_eq!(fault(None, None), KafkaFault::Transient);
    }
}
