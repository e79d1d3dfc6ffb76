//! A JetStream source with a [`Pull`](super::Pull) of its own (the coordinator's input)
//! reads its consumer one pull request at a time: a request for `batch` messages open for
//! `expires`, and the next once it is filled or expired.
//!
//! Not async-nats's continuous `Consumer::stream`: that one counts the messages its open
//! requests may still bring and asks again below half a batch, and it adds a request's
//! `batch` to that count when the request's own send completes. A reader that takes
//! messages as fast as they come (one that hands several over before the first is answered)
//! can take a request's messages before that: the count, floored at zero meanwhile, is then
//! a batch too high, no request is sent, and the stream waits for its fallback, the expiry
//! plus 5 s. The coordinator's decisions waited 6 s so in a benchmark at 10,000 VMs
//! (BENCHMARKS.md, profiling section 37).

use std::time::{Duration, Instant};

use async_nats::jetstream;
use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::consumer::pull::{MessagesError, MessagesErrorKind};
use futures_util::StreamExt;
use futures_util::stream::BoxStream;

/// What a source reads: its consumer's messages, or why it cannot.
pub(super) type Pulled = BoxStream<'static, Result<jetstream::Message, MessagesError>>;

/// A request that brought nothing and that the server neither ended nor answered within
/// its expiry and this much more was lost (a server restarted, a connection that died
/// without a word). One that brought messages is only asked again, not counted: the source
/// may have left it unpolled while its reader was busy.
const ANSWER_GRACE: Duration = Duration::from_secs(1);

/// Requests in a row that failed, or were lost, before the source is told (and connects
/// again): one lost to a leader's change or a server's restart is only asked again.
const FAILURES_TOLERATED: u32 = 2;

/// `consumer`'s messages through one request at a time for `batch` messages, each open for
/// `expires`. A request that fails, ends at once with nothing, or is lost
/// ([`ANSWER_GRACE`]) is asked again after a quarter of `expires`; after
/// [`FAILURES_TOLERATED`] in a row the stream yields the error (the source then connects
/// again).
pub(super) fn one_request_at_a_time(
    consumer: PullConsumer,
    batch: usize,
    expires: Duration,
) -> Pulled {
    // (consumer, the open request, when it was sent and whether it brought a message,
    // failures in a row)
    let state = (
        consumer,
        None::<(jetstream::consumer::pull::Batch, Instant, bool)>,
        0_u32,
    );
    futures_util::stream::unfold(state, move |(consumer, mut open, mut failures)| async move {
        loop {
            if failures >= FAILURES_TOLERATED {
                let error = MessagesError::with_source(
                    MessagesErrorKind::Pull,
                    format!("{failures} pull requests in a row failed or were lost"),
                );
                return Some((Err(error), (consumer, None, 0)));
            }
            let Some((request, sent, brought)) = open.as_mut() else {
                if failures > 0 {
                    // Not at once: a leader's change takes a moment.
                    tokio::time::sleep(expires / 4).await;
                }
                match consumer
                    .batch()
                    .max_messages(batch)
                    .expires(expires)
                    .messages()
                    .await
                {
                    Ok(request) => open = Some((request, Instant::now(), false)),
                    Err(error) => {
                        tracing::debug!(error = %error, "A pull request failed; asking again");
                        failures += 1;
                    }
                }
                continue;
            };
            match tokio::time::timeout(expires + ANSWER_GRACE, request.next()).await {
                Ok(Some(Ok(message))) => {
                    *brought = true;
                    return Some((Ok(message), (consumer, open, 0)));
                }
                // Filled, or expired (the server said so): the next request. One that
                // ended at once with nothing is no answer (asking again at once would
                // flood the server).
                Ok(None) => {
                    if !*brought && sent.elapsed() < expires / 2 {
                        failures += 1;
                    } else {
                        failures = 0;
                    }
                    open = None;
                }
                // A status other than the expiry (a leader's change, a server shutting down).
                Ok(Some(Err(error))) => {
                    tracing::debug!(error = %error, "A pull request ended with an error; asking again");
                    open = None;
                    failures += 1;
                }
                Err(_) => {
                    if !*brought {
                        tracing::debug!(wait = ?(expires + ANSWER_GRACE), "A pull request went unanswered; asking again");
                        failures += 1;
                    }
                    open = None;
                }
            }
        }
    })
    .boxed()
}
