//! A message as it arrived on any transport (a broker or HTTP), before anything is believed
//! about it: what the approval parser and `sched-relay watch` read. Plain data; the
//! sources that fill it live with their brokers' clients.

/// One message as it arrived, before anything is believed about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inbound {
    /// `nats`, `jetstream`, `amqp`, `kafka` or `http`.
    pub transport: &'static str,
    /// Where it came from: subject, queue, `topic/partition@offset`, `POST /approvals`.
    pub channel: String,
    /// Header name/value pairs as received (names in their original case).
    pub headers: Vec<(String, String)>,
    /// The message's content type, if the protocol carries one outside the headers.
    pub content_type: Option<String>,
    pub body: Vec<u8>,
    /// The channel also carries other VMs' requests (a fleet subject, every partition of a
    /// topic): requests that name another VM are skipped without an outcome.
    pub shared: bool,
    /// The address the publisher gave it, where the channel is not that: an AMQP routing key
    /// (the channel is the queue), a Kafka record's key. `None` for NATS (the channel is the
    /// subject) and HTTP.
    pub route: Option<String>,
}
