//! The input against the machine's real NATS: the stream it makes sure of, catching up, and
//! what a stalled instance holds back from its standby.

use sched_relay_transport::testing::{broker_available, unique};

use super::prepare_stream;

const NATS: &str = "127.0.0.1:4222";
const NATS_URL: &str = "nats://127.0.0.1:4222";

fn connection() -> sched_relay_nats::NatsSinkConfig {
    serde_json::from_value(serde_json::json!({ "url": NATS_URL })).unwrap()
}

async fn subjects_of(stream: &str) -> Vec<String> {
    let client = async_nats::connect(NATS_URL).await.unwrap();
    let mut stream = async_nats::jetstream::new(client)
        .get_stream(stream)
        .await
        .unwrap();
    stream.info().await.unwrap().config.subjects.clone()
}

/// A stream of its own (`<prefix>.>`), the input configured on it with the durable
/// `coordinator`, and an approvals sink beside it: what the tests of a running input share.
struct OnStream {
    stream: String,
    prefix: String,
    js: async_nats::jetstream::Context,
    handle: async_nats::jetstream::stream::Stream,
    input: super::Input,
    approvals: crate::sinks::SinkKind,
}

async fn on_a_new_stream(name: &str) -> OnStream {
    let stream = unique(&name.to_ascii_uppercase());
    let prefix = unique(name);
    let client = async_nats::connect(NATS_URL).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let handle = js
        .create_stream(async_nats::jetstream::stream::Config {
            name: stream.clone(),
            subjects: vec![format!("{prefix}.>")],
            ..Default::default()
        })
        .await
        .unwrap();
    let input = serde_json::from_value(serde_json::json!({
        "kind": "nats", "url": NATS_URL, "stream": stream, "subject": format!("{prefix}.>"),
        "durable": "coordinator",
    }))
    .unwrap();
    let approvals = serde_json::from_value(serde_json::json!({
        "kind": "nats", "url": NATS_URL, "subject": format!("{prefix}x.{{vmname}}"),
    }))
    .unwrap();
    OnStream {
        stream,
        prefix,
        js,
        handle,
        input,
        approvals,
    }
}

/// Heartbeats of VMs `vm-0` to `vm-<n-1>` on the stream, each stored before the next.
async fn heartbeats(js: &async_nats::jetstream::Context, prefix: &str, n: usize) {
    for n in 0..n {
        js.publish(format!("{prefix}.vm-{n}.heartbeat"), "{}".into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
}

mod catch_up;

#[tokio::test]
async fn a_missing_input_stream_is_created_with_the_configured_subject_and_kept_a_week() {
    if !broker_available("NATS", NATS, "nats-server -a 127.0.0.1 -p 4222 -js") {
        return;
    }
    let stream = unique("INPUT");
    let subject = format!("{}.>", unique("input"));
    prepare_stream(&connection(), &stream, &subject)
        .await
        .unwrap();
    assert_eq!(subjects_of(&stream).await, std::slice::from_ref(&subject));
    // Kept a week: heartbeats cannot fill the server.
    let client = async_nats::connect(NATS_URL).await.unwrap();
    let mut created = async_nats::jetstream::new(client)
        .get_stream(&stream)
        .await
        .unwrap();
    assert_eq!(
        created.info().await.unwrap().config.max_age,
        super::INPUT_STREAM_MAX_AGE
    );
    // Found as it is the next time.
    prepare_stream(&connection(), &stream, &subject)
        .await
        .unwrap();
    sched_relay_nats::testing::delete_stream(NATS_URL, &stream).await;
}

#[tokio::test]
async fn an_input_stream_that_does_not_capture_the_subject_is_refused_and_left_as_it_is() {
    if !broker_available("NATS", NATS, "nats-server -a 127.0.0.1 -p 4222 -js") {
        return;
    }
    let stream = unique("INPUT");
    let prefix = unique("input");
    let narrow = format!("{prefix}.*.scheduled");
    sched_relay_nats::testing::create_stream(NATS_URL, &stream, &narrow).await;
    let error = prepare_stream(&connection(), &stream, &format!("{prefix}.>"))
        .await
        .unwrap_err();
    assert!(
        error.starts_with(&format!(
            "input.stream: stream {stream} exists with subjects"
        )) && error.contains(&format!("do not capture {prefix}.>"))
            && error.contains("never changes"),
        "{error}"
    );
    assert_eq!(subjects_of(&stream).await, [narrow]);
    sched_relay_nats::testing::delete_stream(NATS_URL, &stream).await;
}

#[tokio::test]
async fn an_input_stream_that_would_overlap_another_says_which_stream_holds_the_subject() {
    if !broker_available("NATS", NATS, "nats-server -a 127.0.0.1 -p 4222 -js") {
        return;
    }
    // The events stream of an earlier documented layout, and the coordinator configured with another
    // name for it.
    let (old, new) = (unique("SCHEDULED_EVENTS"), unique("SCHEDULEDEVENTS"));
    let subject = format!("{}.>", unique("events"));
    sched_relay_nats::testing::create_stream(NATS_URL, &old, &subject).await;
    let error = prepare_stream(&connection(), &new, &subject)
        .await
        .unwrap_err();
    assert!(
        error.contains(&format!("stream {old} already captures {subject}")),
        "{error}"
    );
    sched_relay_nats::testing::delete_stream(NATS_URL, &old).await;
}

#[test]
fn a_stalled_instance_holds_nothing_back_past_the_soonest_takeover_of_the_shipped_lease() {
    let lease = crate::coordinator::config::default_lease();
    // The stall may come just before a renewal: the key then expires a period after the
    // one before.
    let soonest_takeover = lease - crate::coordinator::ha::renew_every(lease);
    assert!(super::INPUT_PULL.expires + super::INPUT_ACK_WAIT <= super::STALL_HOLDS_BACK);
    assert!(super::STALL_HOLDS_BACK < soonest_takeover);
}

/// A durable made by an earlier version with another ack wait gets this one's.
#[tokio::test]
async fn an_input_durable_made_with_an_older_ack_wait_gets_the_current_one() {
    if !broker_available("NATS", NATS, "nats-server -a 127.0.0.1 -p 4222 -js") {
        return;
    }
    let OnStream {
        stream,
        prefix,
        handle,
        input,
        approvals,
        ..
    } = on_a_new_stream("ackwait").await;
    handle
        .create_consumer(async_nats::jetstream::consumer::pull::Config {
            durable_name: Some("coordinator".into()),
            filter_subject: format!("{prefix}.>"),
            ack_wait: std::time::Duration::from_secs(10),
            ..Default::default()
        })
        .await
        .unwrap();
    let (deliveries, _delivered) = tokio::sync::mpsc::channel(1);
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let task = super::start(&input, &approvals, deliveries, None, stop)
        .await
        .unwrap();
    let mut ack_wait = std::time::Duration::ZERO;
    for _ in 0..50 {
        let mut consumer: async_nats::jetstream::consumer::PullConsumer =
            handle.get_consumer("coordinator").await.unwrap();
        ack_wait = consumer.info().await.unwrap().config.ack_wait;
        if ack_wait == super::INPUT_ACK_WAIT {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(ack_wait, super::INPUT_ACK_WAIT);
    let _ = stop_tx.send(true);
    let _ = task.await;
    sched_relay_nats::testing::delete_stream(NATS_URL, &stream).await;
}

/// Two instances of the input on one durable consumer, as an active coordinator and its
/// standby. The active one is stopped while it handles a message, after handling it
/// for longer than the ack wait (it said the message was in progress).
/// The bound is a number, not the constants it follows from: it must stay below the
/// soonest a standby can take over after a stall with the shipped lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_stalled_instance_took_or_would_take_reaches_the_standby_before_the_lease_expires() {
    if !broker_available("NATS", NATS, "nats-server -a 127.0.0.1 -p 4222 -js") {
        return;
    }
    let OnStream {
        stream,
        prefix,
        js,
        input,
        approvals,
        ..
    } = on_a_new_stream("stall").await;
    let publish = |n: u32| {
        let js = js.clone();
        let subject = format!("{prefix}.vm-{n}.heartbeat");
        async move {
            js.publish(subject, "{}".into())
                .await
                .unwrap()
                .await
                .unwrap()
        }
    };
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    // The active instance runs on a runtime of its own, on a thread the test freezes
    // as SIGSTOP would: its connection stays open, and it sends nothing any more (no
    // pull request, no acknowledgement, no word that the message is in progress).
    // As the engine's: the input hands it several messages before the first is answered.
    let (to_active, mut active) = tokio::sync::mpsc::channel(64);
    let (freeze, frozen) = std::sync::mpsc::channel::<()>();
    let (first_input, first_approvals) = (input.clone(), approvals.clone());
    let first_stop = stop.clone();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async move {
            let _task = super::start(&first_input, &first_approvals, to_active, None, first_stop)
                .await
                .unwrap();
            while frozen.try_recv().is_err() {
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
            std::thread::sleep(std::time::Duration::from_secs(60));
        });
    });
    publish(1).await;
    let held = tokio::time::timeout(std::time::Duration::from_secs(10), active.recv())
        .await
        .unwrap()
        .unwrap();
    assert!(held.message.channel.ends_with("vm-1.heartbeat"));
    // Handled for a while first: only a stopped process's messages come again, not one a
    // running instance is still handling (it says so every half ack wait).
    tokio::time::sleep(super::INPUT_ACK_WAIT * 2).await;
    let mut durable: async_nats::jetstream::consumer::PullConsumer = js
        .get_stream(&stream)
        .await
        .unwrap()
        .get_consumer("coordinator")
        .await
        .unwrap();
    assert_eq!(durable.info().await.unwrap().num_redelivered, 0);
    freeze.send(()).unwrap();
    // The stall began when the message was handed over. A message published now goes
    // to the stalled instance's last open request; the standby, active later, must
    // have both within the bound.
    let stalled = std::time::Instant::now();
    publish(2).await;
    tokio::time::sleep(super::INPUT_PULL.expires).await;
    let (to_standby, mut standby) = tokio::sync::mpsc::channel(8);
    let second = super::start(&input, &approvals, to_standby, None, stop)
        .await
        .unwrap();
    let bound = super::STALL_HOLDS_BACK;
    let mut seen = Vec::new();
    while seen.len() < 2 {
        let delivery = tokio::time::timeout(
            (stalled + bound).saturating_duration_since(std::time::Instant::now()),
            standby.recv(),
        )
        .await
        .unwrap_or_else(|_| panic!("the standby had only {seen:?} within {bound:?} of the stall"))
        .unwrap();
        seen.push(delivery.message.channel.clone());
        let _ = delivery
            .handled
            .send(sched_relay_transport::inbound::Answer::Handled(
                sched_relay_transport::inbound::Reply {
                    outcome: "accepted",
                    body: serde_json::Value::Null,
                },
            ));
    }
    seen.sort();
    assert!(
        seen[0].ends_with("vm-1.heartbeat") && seen[1].ends_with("vm-2.heartbeat"),
        "{seen:?}"
    );
    drop(held);
    let _ = stop_tx.send(true);
    let _ = second.await;
    sched_relay_nats::testing::delete_stream(NATS_URL, &stream).await;
}

/// The engine commits what waits in its channel at once; the input hands it messages while
/// the first is unanswered so that there is something to wait, and acknowledges each only
/// once it is answered, in the order they came.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_are_handed_over_before_the_first_is_answered_and_each_acknowledged_only_once_answered()
 {
    use sched_relay_transport::inbound::{Answer, Reply};
    if !broker_available("NATS", NATS, "nats-server -a 127.0.0.1 -p 4222 -js") {
        return;
    }
    let OnStream {
        stream,
        prefix,
        js,
        input,
        approvals,
        ..
    } = on_a_new_stream("inflight").await;
    heartbeats(&js, &prefix, 10).await;
    let (deliveries, mut delivered) = tokio::sync::mpsc::channel(64);
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let task = super::start(&input, &approvals, deliveries, None, stop)
        .await
        .unwrap();
    let mut handed = Vec::new();
    for _ in 0..10 {
        let delivery = tokio::time::timeout(std::time::Duration::from_secs(5), delivered.recv())
            .await
            .unwrap_or_else(|_| panic!("only {} handed while none was answered", handed.len()))
            .unwrap();
        handed.push(delivery);
    }
    let channels: Vec<&str> = handed.iter().map(|d| d.message.channel.as_str()).collect();
    for (n, channel) in channels.iter().enumerate() {
        assert!(
            channel.ends_with(&format!("vm-{n}.heartbeat")),
            "{channels:?}"
        );
    }
    let mut durable: async_nats::jetstream::consumer::PullConsumer = js
        .get_stream(&stream)
        .await
        .unwrap()
        .get_consumer("coordinator")
        .await
        .unwrap();
    async fn unacknowledged(durable: &mut async_nats::jetstream::consumer::PullConsumer) -> usize {
        durable.info().await.unwrap().num_ack_pending
    }
    let answer = |delivery: sched_relay_transport::inbound::Delivery| {
        let _ = delivery.handled.send(Answer::Handled(Reply {
            outcome: "accepted",
            body: serde_json::Value::Null,
        }));
    };
    // Every one but the first answered: none is acknowledged before the first is.
    let mut handed = handed.into_iter();
    let first = handed.next().unwrap();
    handed.for_each(answer);
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    assert_eq!(unacknowledged(&mut durable).await, 10);
    answer(first);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while unacknowledged(&mut durable).await > 0 {
        assert!(std::time::Instant::now() < deadline, "not acknowledged");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let _ = stop_tx.send(true);
    let _ = task.await;
    sched_relay_nats::testing::delete_stream(NATS_URL, &stream).await;
}
