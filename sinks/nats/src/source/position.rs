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

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use async_nats::jetstream::{self, consumer::pull};

    use super::{CONFIRM_ACK, at_end};
    use crate::testing::PrivateNats;

    /// The source's loop looks at its position between handing messages over and saying
    /// they are in progress: a server that stops answering (stalled, or cut off with the
    /// connection left open) must not hold that loop for the client's own request timeout
    /// (10 s), past the ack wait of what it holds (4 s for the coordinator's input).
    #[tokio::test]
    async fn a_look_at_the_position_of_a_server_that_stopped_answering_gives_up_within_its_bound() {
        let Some(server) = PrivateNats::start(&[]) else {
            return;
        };
        let client = async_nats::connect(server.url()).await.unwrap();
        let js = jetstream::new(client);
        let stream = js
            .create_stream(jetstream::stream::Config {
                name: "position".into(),
                subjects: vec!["position.>".into()],
                ..Default::default()
            })
            .await
            .unwrap();
        let consumer = stream
            .create_consumer(pull::Config {
                durable_name: Some("position".into()),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                ..Default::default()
            })
            .await
            .unwrap();
        let mut consumers = vec![consumer];
        assert!(
            at_end(&mut consumers).await,
            "an empty consumer of an answering server is at its end"
        );

        server.stall();
        let looked = Instant::now();
        let end = at_end(&mut consumers).await;
        let took = looked.elapsed();
        server.wake();
        assert!(
            !end,
            "a consumer whose server did not answer is not at its end"
        );
        assert!(
            took < CONFIRM_ACK + Duration::from_millis(500),
            "the look waited {took:?} for a server that stopped answering (bound {CONFIRM_ACK:?})"
        );
    }
}
