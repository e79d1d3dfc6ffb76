//! The input's catch-up: behind until what its stream held at the start is handled, however
//! slowly, and caught up as soon as the last of it is acknowledged.

use sched_relay_transport::testing::broker_available;

use super::{NATS, NATS_URL, OnStream, heartbeats, on_a_new_stream};

/// An input started on a new stream that holds `n` heartbeats, with its catch-up watched,
/// handing messages over a channel of `capacity`.
struct CatchingUp {
    stream: String,
    delivered: tokio::sync::mpsc::Receiver<sched_relay_transport::inbound::Delivery>,
    caught_up: tokio::sync::watch::Receiver<sched_relay_transport::inbound::CatchUp>,
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl CatchingUp {
    /// Started, once the input has said how far behind it is (its first look at its
    /// position).
    async fn start(name: &str, n: usize, capacity: usize) -> CatchingUp {
        use sched_relay_transport::inbound::CatchUp;
        let OnStream {
            stream,
            prefix,
            js,
            input,
            approvals,
            ..
        } = on_a_new_stream(name).await;
        heartbeats(&js, &prefix, n).await;
        let (deliveries, delivered) = tokio::sync::mpsc::channel(capacity);
        let (progress, mut caught_up) = tokio::sync::watch::channel(CatchUp::Unknown);
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let task = super::super::start(&input, &approvals, deliveries, Some(progress), stopped)
            .await
            .unwrap();
        caught_up
            .wait_for(|state| *state != CatchUp::Unknown)
            .await
            .unwrap();
        CatchingUp {
            stream,
            delivered,
            caught_up,
            stop,
            task,
        }
    }

    /// Answers the next message handed over: handled.
    async fn handle_next(&mut self) {
        use sched_relay_transport::inbound::{Answer, Reply};
        let delivery = self.delivered.recv().await.unwrap();
        let _ = delivery.handled.send(Answer::Handled(Reply {
            outcome: "accepted",
            body: serde_json::Value::Null,
        }));
    }

    async fn stop(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
        sched_relay_nats::testing::delete_stream(NATS_URL, &self.stream).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_input_is_caught_up_once_it_has_handled_what_its_stream_held_however_slowly() {
    use sched_relay_transport::inbound::CatchUp;
    if !broker_available("NATS", NATS, "nats-server -a 127.0.0.1 -p 4222 -js") {
        return;
    }
    let mut input = CatchingUp::start("catchup", 5, 1).await;
    // A slow engine: every message waits; the input is behind until the fifth is handled,
    // however long that takes (no quiet second decides it).
    assert_eq!(*input.caught_up.borrow(), CatchUp::Behind(5));
    for n in 0..5 {
        tokio::time::sleep(std::time::Duration::from_millis(1200)).await;
        assert_ne!(
            *input.caught_up.borrow(),
            CatchUp::CaughtUp,
            "after {n} of 5"
        );
        input.handle_next().await;
    }
    tokio::time::timeout(
        std::time::Duration::from_secs(5),
        input
            .caught_up
            .wait_for(|state| *state == CatchUp::CaughtUp),
    )
    .await
    .unwrap()
    .unwrap();
    input.stop().await;
}

/// A takeover decides once its input has caught up: that is seen when the backlog's last
/// message is acknowledged, not at the next of the position's looks a second apart (the
/// first is when the input starts and says how far behind it is).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_input_is_caught_up_as_soon_as_the_last_message_it_held_is_acknowledged() {
    use sched_relay_transport::inbound::CatchUp;
    if !broker_available("NATS", NATS, "nats-server -a 127.0.0.1 -p 4222 -js") {
        return;
    }
    let mut input = CatchingUp::start("caughtup", 3, 64).await;
    let first_look = std::time::Instant::now();
    for _ in 0..3 {
        input.handle_next().await;
    }
    input
        .caught_up
        .wait_for(|state| *state == CatchUp::CaughtUp)
        .await
        .unwrap();
    let took = first_look.elapsed();
    input.stop().await;
    // The next look would come a second after the first.
    assert!(
        took < std::time::Duration::from_millis(700),
        "caught up {took:?} after the input's first look at its position"
    );
}
