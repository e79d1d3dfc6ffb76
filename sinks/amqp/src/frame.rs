//! The frame size a connection proposes to the broker: small for the sink, RabbitMQ's
//! default for consumers, more for a consumer whose frame a message outgrew.

/// The largest frame the sink proposes (the broker may ask for less), unless the URL's
/// `frame_max` says otherwise. lapin keeps a zeroed send and receive buffer of 32 frames per
/// connection: at RabbitMQ's default of 128 KiB that is 8 MiB resident per connection, more
/// than the rest of an idle agent. A larger body goes as several frames; the headers of the
/// agent's events (attributes and short extensions: EventIds and request ids are at most
/// 256 bytes) fit one. Consumers propose [`CONSUMER_FRAME_MAX`] instead.
pub const FRAME_MAX: u32 = 8192;

/// The frame a consumer (an approval source, the coordinator's input) proposes unless the URL's
/// `frame_max` says otherwise: RabbitMQ's default, so on a broker left at its default the
/// consumer's frame is the broker's. A header frame cannot be split, and a publisher's may be
/// as large as the broker's frame: a consumer with a smaller frame would be disconnected by
/// every delivery of such a message, and the message, unacknowledged, delivered again. Proposed
/// rather than left to the broker because lapin sizes a connection's two buffers (32 frames
/// each) at connecting by the frame proposed, as zeroed memory that stays untouched until
/// bytes pass through it, but grows them to the negotiated size by writing zeroes: without a
/// proposal, 8 MiB resident at once on every idle agent with a RabbitMQ approval source (and,
/// on a broker whose `frame_max` is 0, unlimited, an allocation of 32 times 4 GiB). On a
/// broker with a larger frame, a message whose headers outgrow it makes the consumer
/// propose more (see [`Frame::Override`]).
pub const CONSUMER_FRAME_MAX: u32 = 131_072;

/// The largest frame a consumer proposes after messages outgrew its frame: lapin's buffers
/// are 32 frames each way (2 x 256 MiB of address space here, resident only as far as bytes
/// pass through them).
pub const CONSUMER_FRAME_CEILING: u32 = 8 << 20;

/// The frame size a connection proposes to the broker, which may ask for less.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Frame {
    /// This size, unless the URL's `frame_max` says otherwise.
    UnlessSet(u32),
    /// This size, whatever the URL says: a consumer whose frame a message outgrew.
    Override(u32),
}

impl Frame {
    /// Puts the proposal in the connection's URL.
    pub(crate) fn propose(self, url: &mut url::Url) {
        let set = url.query_pairs().any(|(key, _)| key == "frame_max");
        match self {
            Frame::UnlessSet(_) if set => {}
            Frame::UnlessSet(size) => {
                url.query_pairs_mut()
                    .append_pair("frame_max", &size.to_string());
            }
            Frame::Override(size) => {
                let others: Vec<(String, String)> = url
                    .query_pairs()
                    .filter(|(key, _)| key != "frame_max")
                    .map(|(key, value)| (key.into_owned(), value.into_owned()))
                    .collect();
                url.query_pairs_mut()
                    .clear()
                    .extend_pairs(others)
                    .append_pair("frame_max", &size.to_string());
            }
        }
    }
}
