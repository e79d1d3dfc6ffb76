//! The orchestrator's side of the wire, for `sched-relay sign-approval --to` and for tests:
//! publish a request (built and signed by `sched_relay_core::approval::Draft`) to a broker,
//! or POST it to an agent, with the same clients the sinks use.

use sched_relay_core::Event;
#[cfg(any(feature = "nats", feature = "amqp", feature = "kafka"))]
use serde_json::json;

/// Publishes a request to `to`, the way an orchestrator would, and says what happened:
/// `nats://host:4222[?subject=S]`, `amqp://user:pass@host:5672/%2f[?exchange=E&routing_key=K]`,
/// `kafka://host:9092[/topic]` (key = the VM name, murmur2 partitioner) or an agent's
/// `http://127.0.0.1:9464/approvals` (`token` as bearer; the agent's answer is returned).
// Without any broker feature, only the http:// branch uses the helpers.
#[cfg_attr(
    not(any(feature = "nats", feature = "amqp", feature = "kafka")),
    allow(unused_variables)
)]
pub async fn publish_to(to: &str, event: &Event, token: Option<&str>) -> Result<String, String> {
    let url = url::Url::parse(to).map_err(|e| format!("--to {to:?} is not a URL: {e}"))?;
    // As the agents' approval sources write it (`.` becomes `_`); "*" (the fleet) stays.
    let vm = event
        .extension("vmname")
        .map(|v| v.to_string())
        .filter(|v| v != "*")
        .map_or_else(
            || "*".into(),
            |v| sched_relay_core::binding::template_value(&v),
        );
    let query = |name: &str| {
        url.query_pairs()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.into_owned())
    };
    let host = || {
        format!(
            "{}:{}",
            url.host_str().unwrap_or("127.0.0.1"),
            url.port_or_known_default().unwrap_or_default()
        )
    };
    let deliver = |sink: Box<dyn sched_relay_transport::Sink>, what: String| async move {
        sink.deliver(std::slice::from_ref(event))
            .await
            .map(|()| what)
            .map_err(|e| e.to_string())
    };
    match url.scheme() {
        #[cfg(feature = "nats")]
        "nats" | "tls" => {
            let subject = query("subject").unwrap_or(format!("scheduledapprovals.{vm}"));
            let config: sched_relay_nats::NatsSinkConfig = serde_json::from_value(
                json!({"url": format!("{}://{}", url.scheme(), host()), "subject": subject}),
            )
            .map_err(|e| e.to_string())?;
            deliver(
                Box::new(sched_relay_nats::NatsSink::new(config)),
                format!("published to NATS subject {subject}"),
            )
            .await
        }
        #[cfg(feature = "amqp")]
        "amqp" | "amqps" => {
            let exchange = query("exchange").unwrap_or("scheduledevents.approvals".into());
            let routing_key = query("routing_key").unwrap_or(format!("approvals.{vm}"));
            let mut base = url.clone();
            base.set_query(None);
            let config: sched_relay_amqp::AmqpSinkConfig = serde_json::from_value(json!({
                "url": base.to_string(), "exchange": exchange, "routing_key": routing_key,
            }))
            .map_err(|e| e.to_string())?;
            deliver(Box::new(sched_relay_amqp::AmqpSink::new(config)), format!("published to AMQP exchange {exchange} with routing key {routing_key} (confirmed and routed)")).await
        }
        #[cfg(feature = "kafka")]
        "kafka" => {
            let topic = match url.path().trim_start_matches('/') {
                "" => "scheduledevents.approvals".to_owned(),
                topic => topic.to_owned(),
            };
            let config: sched_relay_kafka::KafkaSinkConfig = serde_json::from_value(json!({
                "brokers": host(), "topic": topic,
                "options": {"partitioner": "murmur2_random"},
            }))
            .map_err(|e| e.to_string())?;
            deliver(
                Box::new(sched_relay_kafka::KafkaSink::new(config)),
                format!("produced to Kafka topic {topic} with key {vm}"),
            )
            .await
        }
        "http" | "https" => {
            crate::install_crypto_provider();
            let body = serde_json::to_vec(event).map_err(|e| e.to_string())?;
            let mut request = reqwest::Client::new()
                .post(url.clone())
                .header("content-type", "application/cloudevents+json")
                .body(body);
            if let Some(token) = token {
                request = request.bearer_auth(token);
            }
            let response = request
                .send()
                .await
                .map_err(|e| format!("POST {url}: {e}"))?;
            let status = response.status();
            let text = response.text().await.unwrap_or_default();
            if status.is_success() {
                Ok(format!("{status}: {text}"))
            } else {
                Err(format!("{status}: {text}"))
            }
        }
        scheme => Err(format!(
            "--to {scheme}://... is not supported by this build; expected nats://, amqp://, kafka:// (with those features) or http://"
        )),
    }
}
