use super::*;
use crate::CONSUMER_FRAME_MAX;
use lapin::protocol::{AMQPError, AMQPErrorKind, AMQPHardError, AMQPSoftError};

fn reply(code: u16) -> lapin::ErrorKind {
    let error = AMQPError::from_id(code, "from the broker".into()).expect("a known reply code");
    lapin::ErrorKind::ProtocolError(error)
}

#[test]
fn a_refused_login_or_permission_is_an_authentication_fault_not_a_permanent_one() {
    assert_eq!(fault(&reply(403)), AmqpFault::Authentication);
    assert_eq!(fault(&reply(530)), AmqpFault::Authentication);
    let provider = lapin::ErrorKind::AuthProviderError("token expired".into());
    assert_eq!(fault(&provider), AmqpFault::Authentication);
}

#[test]
fn reply_codes_decide_not_found_refused_and_transient() {
    assert_eq!(fault(&reply(404)), AmqpFault::NotFound);
    assert_eq!(fault(&reply(406)), AmqpFault::Refused);
    assert_eq!(fault(&reply(311)), AmqpFault::Refused);
    // A broker shutting down (320 CONNECTION_FORCED) or out of resources comes back.
    assert_eq!(fault(&reply(320)), AmqpFault::Transient);
    assert_eq!(fault(&reply(506)), AmqpFault::Transient);
    let kinds = [
        AMQPErrorKind::Hard(AMQPHardError::INTERNALERROR),
        AMQPErrorKind::Soft(AMQPSoftError::RESOURCELOCKED),
    ];
    for kind in kinds {
        let error = lapin::ErrorKind::ProtocolError(AMQPError::new(kind, "".into()));
        assert_eq!(fault(&error), AmqpFault::Transient);
    }
}

#[test]
fn the_text_of_an_error_never_decides() {
    // An I/O error whose text mentions 403 or NOT_FOUND is still the network's.
    let io = std::io::Error::other("proxy said 403 ACCESS_REFUSED NOT_FOUND 404");
    let kind = lapin::ErrorKind::IOError(std::sync::Arc::new(io));
    assert_eq!(fault(&kind), AmqpFault::Transient);
}

fn sink(url: &str) -> AmqpSink {
    AmqpSink::new(serde_json::from_value(serde_json::json!({"url": url, "exchange": "x"})).unwrap())
}

#[test]
fn the_sink_proposes_a_small_frame_and_a_consumer_the_brokers_default_unless_the_url_asks_for_another()
 {
    let uri = sink("amqp://guest:guest@127.0.0.1:5672/%2f")
        .uri(Frame::UnlessSet(FRAME_MAX))
        .unwrap();
    assert_eq!(uri, "amqp://guest:guest@127.0.0.1:5672/%2f?frame_max=8192");
    let parsed: lapin::uri::AMQPUri = uri.parse().unwrap();
    assert_eq!(parsed.query.frame_max, Some(FRAME_MAX));
    assert_eq!(parsed.vhost, "/");
    let asked = sink("amqps://broker.example/prod?frame_max=131072&heartbeat=30")
        .uri(Frame::UnlessSet(FRAME_MAX))
        .unwrap();
    assert_eq!(
        asked,
        "amqps://broker.example/prod?frame_max=131072&heartbeat=30"
    );
    // A consumer proposes RabbitMQ's default frame, unless its URL asks for another.
    let consumer = sink("amqp://guest:guest@127.0.0.1:5672/%2f")
        .uri(Frame::UnlessSet(CONSUMER_FRAME_MAX))
        .unwrap();
    assert_eq!(
        consumer,
        "amqp://guest:guest@127.0.0.1:5672/%2f?frame_max=131072"
    );
    let asked = sink("amqp://guest:guest@127.0.0.1:5672/%2f?frame_max=1048576")
        .uri(Frame::UnlessSet(CONSUMER_FRAME_MAX))
        .unwrap();
    assert_eq!(
        asked,
        "amqp://guest:guest@127.0.0.1:5672/%2f?frame_max=1048576"
    );
    // A consumer whose frame a message outgrew proposes more, whatever the URL says.
    let raised = sink("amqp://guest:guest@127.0.0.1:5672/%2f?heartbeat=30&frame_max=8192")
        .uri(Frame::Override(65536))
        .unwrap();
    assert_eq!(
        raised,
        "amqp://guest:guest@127.0.0.1:5672/%2f?heartbeat=30&frame_max=65536"
    );
}
