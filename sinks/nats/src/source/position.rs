//! Where a JetStream source is in its consumer: whether everything the consumer held has
//! been delivered and acknowledged (the end of a catch-up).

use std::time::Duration;

use async_nats::jetstream;

/// How long a confirmed acknowledgement (of what may be the backlog's last message), or a
/// consumer's state, is waited for (well under a millisecond on the same network); without
/// an answer, the consumer is taken as not at its end, and the next look a second later
/// decides.
pub(super) const CONFIRM_ACK: Duration = Duration::from_millis(500);

/// The consumers' position says the backlog is handled: nothing pending, nothing delivered
/// and unacknowledged (by this instance or one before it). A consumer that does not answer
/// within [`CONFIRM_ACK`] is not at its end yet: the source's loop, which says the messages
/// in hand are in progress, waits no longer (the next look is a second later).
pub(super) async fn at_end(consumers: &mut [jetstream::consumer::PullConsumer]) -> bool {
    for consumer in consumers.iter_mut() {
        match tokio::time::timeout(CONFIRM_ACK, consumer.info()).await {
            Ok(Ok(info)) if info.num_pending == 0 && info.num_ack_pending == 0 => {}
            _ => return false,
        }
    }
    true
}
