//! The fan-out's guarantees against a recording sink: order, retries, dead letters, restarts.

use super::*;
use cloudevents::{EventBuilder, EventBuilderV10};
use sched_relay_transport::{DeliveryError, RecordingSink, SinkError};

fn event(id: &str) -> Event {
    EventBuilderV10::new()
        .id(id)
        .source("urn:test")
        .ty("t")
        .build()
        .unwrap()
        .into()
}

fn fast_delivery() -> DeliveryConfig {
    DeliveryConfig {
        retry_initial: Duration::from_millis(1),
        retry_max: Duration::from_millis(5),
        ..DeliveryConfig::default()
    }
}

fn ids(events: &[Event]) -> Vec<String> {
    events.iter().map(|e| e.id().to_owned()).collect()
}

fn start(dir: &Path, sinks: Vec<(&str, RecordingSink)>, delivery: &DeliveryConfig) -> Fanout {
    let outbox = Arc::new(Outbox::open(dir, delivery.queue_capacity, false).unwrap());
    with_outbox(outbox, sinks, delivery, dir)
}

/// The next start of a stopped agent. A stop does not wait past its deadline for the last
/// flush; a process that exits then lets go of the state directory at once, but here the
/// flush's thread lives on in the test's process for a moment, holding the directory's
/// lock. So the restart waits for the lock to go, as a new process would find it gone.
async fn restart(
    dir: &Path,
    sinks: Vec<(&str, RecordingSink)>,
    delivery: &DeliveryConfig,
) -> Fanout {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        match Outbox::open(dir, delivery.queue_capacity, false) {
            Ok(outbox) => return with_outbox(Arc::new(outbox), sinks, delivery, dir),
            Err(StoreError::Locked { .. }) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Err(error) => panic!("the restart cannot open the outbox: {error}"),
        }
    }
}

fn with_outbox(
    outbox: Arc<Outbox>,
    sinks: Vec<(&str, RecordingSink)>,
    delivery: &DeliveryConfig,
    dir: &Path,
) -> Fanout {
    let sinks = sinks
        .into_iter()
        .map(|(name, sink)| NamedSink {
            name: name.into(),
            sink: Box::new(sink),
        })
        .collect();
    Fanout::start(sinks, delivery, dir, outbox)
}

#[tokio::test]
async fn retriable_failures_are_retried_in_order_until_delivered() {
    let dir = tempfile::tempdir().unwrap();
    let flaky = RecordingSink::new();
    flaky.fail_next((0..3).map(|_| SinkError::Retriable("broker down".into())));
    let healthy = RecordingSink::new();
    let fanout = start(
        dir.path(),
        vec![("flaky", flaky.clone()), ("healthy", healthy.clone())],
        &fast_delivery(),
    );
    fanout
        .publish(&[event("1"), event("2")], None)
        .await
        .unwrap();
    fanout.publish(&[event("3")], None).await.unwrap();
    fanout.shutdown(Duration::from_secs(5)).await;
    assert_eq!(ids(&flaky.delivered()), ["1", "2", "3"]);
    assert_eq!(ids(&healthy.delivered()), ["1", "2", "3"]);
    assert!(flaky.attempts() >= 4);
}

#[tokio::test(start_paused = true)]
async fn a_retry_after_from_the_destination_is_honoured_over_the_backoff() {
    let dir = tempfile::tempdir().unwrap();
    let sink = RecordingSink::new();
    sink.fail_next([SinkError::RetryAfter {
        message: "429".into(),
        after: Duration::from_secs(120),
    }]);
    let fanout = start(dir.path(), vec![("hook", sink.clone())], &fast_delivery());
    fanout.publish(&[event("1")], None).await.unwrap();
    tokio::time::sleep(Duration::from_secs(119)).await;
    assert!(sink.delivered().is_empty(), "retried before Retry-After");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(ids(&sink.delivered()), ["1"]);
    fanout.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test]
async fn a_refused_batch_goes_to_the_dead_letter_file_and_delivery_continues() {
    let dir = tempfile::tempdir().unwrap();
    let sink = RecordingSink::new();
    sink.fail_next([SinkError::Permanent("schema rejected".into())]);
    let fanout = start(dir.path(), vec![("picky", sink.clone())], &fast_delivery());
    fanout.publish(&[event("1")], None).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    fanout.publish(&[event("2")], None).await.unwrap();
    fanout.shutdown(Duration::from_secs(5)).await;
    assert_eq!(ids(&sink.delivered()), ["2"]);
    let dead = std::fs::read_to_string(dir.path().join("dead-letter/picky.jsonl")).unwrap();
    let record: serde_json::Value = serde_json::from_str(dead.lines().next().unwrap()).unwrap();
    assert_eq!(record["event"]["id"], "1");
    assert!(
        record["reason"]
            .as_str()
            .unwrap()
            .contains("schema rejected")
    );
}

#[tokio::test]
async fn what_a_dead_sink_could_not_take_is_kept_and_delivered_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let down = RecordingSink::new();
    down.fail_next((0..10_000).map(|_| SinkError::Retriable("down".into())));
    let healthy = RecordingSink::new();
    let fanout = start(
        dir.path(),
        vec![("down", down.clone()), ("healthy", healthy.clone())],
        &fast_delivery(),
    );
    fanout
        .publish(&[event("1"), event("2")], None)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        ids(&healthy.delivered()),
        ["1", "2"],
        "the healthy sink is not held back"
    );
    fanout.shutdown(Duration::from_millis(100)).await;
    assert!(down.delivered().is_empty());
    assert!(
        !dir.path().join("dead-letter/down.jsonl").exists(),
        "kept, not dead-lettered"
    );

    // The next start: the sink is back, and gets what it missed, in order; the healthy
    // sink gets nothing twice.
    let back = RecordingSink::new();
    let healthy_again = RecordingSink::new();
    let fanout = restart(
        dir.path(),
        vec![("down", back.clone()), ("healthy", healthy_again.clone())],
        &fast_delivery(),
    )
    .await;
    fanout.shutdown(Duration::from_secs(5)).await;
    assert_eq!(ids(&back.delivered()), ["1", "2"]);
    assert!(healthy_again.delivered().is_empty());
}

#[tokio::test]
async fn a_full_outbox_dead_letters_instead_of_blocking() {
    let dir = tempfile::tempdir().unwrap();
    let down = RecordingSink::new();
    down.fail_next((0..10_000).map(|_| SinkError::Retriable("down".into())));
    let delivery = DeliveryConfig {
        queue_capacity: 2,
        batch_size: 1,
        ..fast_delivery()
    };
    let fanout = start(dir.path(), vec![("down", down.clone())], &delivery);
    fanout
        .publish(&[event("1"), event("2"), event("3")], None)
        .await
        .unwrap();
    let dead = std::fs::read_to_string(dir.path().join("dead-letter/down.jsonl")).unwrap();
    assert!(
        dead.contains("\"id\":\"3\"") && dead.contains("outbox full"),
        "{dead}"
    );
    assert!(!dead.contains("\"id\":\"1\""));
    fanout.shutdown(Duration::from_millis(50)).await;
}

/// A sink that fills the state disk while delivering its first batch (whose commit is durable
/// by then): the batch arrives, and then its removal from the outbox fails.
struct FillsTheDiskOnDelivery {
    sink: RecordingSink,
    faults: Arc<crate::store::DiskFaults>,
    filled: std::sync::atomic::AtomicBool,
}

#[async_trait::async_trait]
impl Sink for FillsTheDiskOnDelivery {
    async fn deliver(&self, batch: &[Event]) -> Result<(), DeliveryError> {
        if !self.filled.swap(true, std::sync::atomic::Ordering::SeqCst) {
            self.faults.fill();
        }
        self.sink.deliver(batch).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivered_batch_that_cannot_be_removed_is_not_delivered_again_while_the_disk_is_full() {
    let dir = tempfile::tempdir().unwrap();
    let faults = crate::store::DiskFaults::new();
    let outbox = Arc::new(Outbox::open_with_faults(dir.path(), 100, faults.clone()).unwrap());
    let recorded = RecordingSink::new();
    let sink = FillsTheDiskOnDelivery {
        sink: recorded.clone(),
        faults: faults.clone(),
        filled: false.into(),
    };
    let fanout = Fanout::start(
        vec![NamedSink {
            name: "s".into(),
            sink: Box::new(sink),
        }],
        &fast_delivery(),
        dir.path(),
        outbox.clone(),
    );
    fanout.publish(&[event("1")], None).await.unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(faults.refused() > 0, "the removal hit the full disk");
    assert_eq!(
        ids(&recorded.delivered()),
        ["1"],
        "delivered once, not again and again"
    );

    faults.free();
    // Removed within a couple of store retries (1 s each) once the disk has room; the
    // deadline is wide because a loaded CI host once took longer than 10 s.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while outbox.depth("s").unwrap_or(1) > 0 {
        assert!(std::time::Instant::now() < deadline, "never removed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    fanout.shutdown(Duration::from_secs(5)).await;
    assert_eq!(ids(&recorded.delivered()), ["1"]);
}

#[cfg(feature = "webhook")]
/// A webhook that is down, then answers 400 to `document` events and 200 to the rest (the
/// issue's reproduction), with what it accepted.
async fn webhook_refusing_documents(
    down: Arc<std::sync::atomic::AtomicBool>,
) -> (String, Arc<std::sync::Mutex<Vec<String>>>) {
    let accepted = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = accepted.clone();
    let app = axum::Router::new().fallback(
        move |headers: axum::http::HeaderMap, body: axum::body::Bytes| {
            let (seen, down) = (seen.clone(), down.clone());
            async move {
                if down.load(std::sync::atomic::Ordering::SeqCst) {
                    return axum::http::StatusCode::SERVICE_UNAVAILABLE;
                }
                let header = |name: &str| {
                    let value = headers.get(name).and_then(|v| v.to_str().ok());
                    value.unwrap_or_default().to_owned()
                };
                // (type, id) of each event: one in binary mode, several in a batch.
                let events: Vec<(String, String)> = if header("content-type").contains("batch") {
                    let batch: Vec<serde_json::Value> = serde_json::from_slice(&body).unwrap();
                    let field = |e: &serde_json::Value, f: &str| e[f].as_str().unwrap().to_owned();
                    batch
                        .iter()
                        .map(|e| (field(e, "type"), field(e, "id")))
                        .collect()
                } else {
                    vec![(header("ce-type"), header("ce-id"))]
                };
                if events.iter().any(|(ty, _)| ty.ends_with(".document")) {
                    return axum::http::StatusCode::BAD_REQUEST;
                }
                seen.lock()
                    .unwrap()
                    .extend(events.into_iter().map(|(_, id)| id));
                axum::http::StatusCode::OK
            }
        },
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/events", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, accepted)
}

fn dead_letter_ids(dir: &Path, sink: &str) -> Vec<String> {
    std::fs::read_to_string(dir.join(format!("dead-letter/{sink}.jsonl")))
        .unwrap_or_default()
        .lines()
        .map(|line| {
            serde_json::from_str::<serde_json::Value>(line).unwrap()["event"]["id"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect()
}

#[cfg(feature = "webhook")]
async fn events_reach_a_webhook_that_refuses_documents_after_an_outage(batch: bool) {
    let dir = tempfile::tempdir().unwrap();
    let down = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let (url, accepted) = webhook_refusing_documents(down.clone()).await;
    let config: sched_relay_webhook::WebhookSinkConfig =
        toml::from_str(&format!("url = \"{url}\"\nbatch = {batch}")).unwrap();
    let outbox = Arc::new(Outbox::open(dir.path(), 100, false).unwrap());
    let fanout = Fanout::start(
        vec![NamedSink {
            name: "hook".into(),
            sink: Box::new(sched_relay_webhook::WebhookSink::new(config)),
        }],
        &fast_delivery(),
        dir.path(),
        outbox.clone(),
    );
    let events = sched_relay_transport::testing::live_migration_events("vm");
    fanout.publish(&events, None).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    down.store(false, std::sync::atomic::Ordering::SeqCst);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while outbox.depth("hook").unwrap_or(1) > 0 {
        assert!(std::time::Instant::now() < deadline, "never settled");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    fanout.shutdown(Duration::from_secs(5)).await;
    let transitions: Vec<String> = events
        .iter()
        .filter(|e| !e.ty().ends_with(".document"))
        .map(|e| e.id().to_owned())
        .collect();
    let documents: Vec<String> = events
        .iter()
        .filter(|e| e.ty().ends_with(".document"))
        .map(|e| e.id().to_owned())
        .collect();
    assert_eq!(
        *accepted.lock().unwrap(),
        transitions,
        "scheduled, started and completed all arrive, in order"
    );
    assert_eq!(
        dead_letter_ids(dir.path(), "hook"),
        documents,
        "only the refused documents are dead-lettered"
    );
}

#[cfg(feature = "webhook")]
#[tokio::test]
async fn one_refused_event_is_dead_lettered_alone_and_the_rest_of_its_batch_is_delivered() {
    events_reach_a_webhook_that_refuses_documents_after_an_outage(false).await;
}

#[cfg(feature = "webhook")]
#[tokio::test]
async fn a_batch_webhook_that_refuses_a_batch_gets_its_events_one_by_one_and_only_the_refused_are_dead_lettered()
 {
    events_reach_a_webhook_that_refuses_documents_after_an_outage(true).await;
}

#[tokio::test]
async fn an_exec_drain_script_failing_on_one_event_does_not_skip_the_later_events_of_its_batch() {
    let dir = tempfile::tempdir().unwrap();
    let ran = dir.path().join("ran");
    let script = format!(
        "[ \"$TRANSITION\" = document ] && exit 3; echo \"$TRANSITION\" >> {}",
        ran.display()
    );
    let config: sched_relay_exec::ExecSinkConfig =
        toml::from_str(&format!("command = [\"/bin/sh\", \"-c\", {script:?}]")).unwrap();
    let outbox = Arc::new(Outbox::open(dir.path(), 100, false).unwrap());
    let fanout = Fanout::start(
        vec![NamedSink {
            name: "drain".into(),
            sink: Box::new(sched_relay_exec::ExecSink::new(config)),
        }],
        &fast_delivery(),
        dir.path(),
        outbox,
    );
    let events = sched_relay_transport::testing::live_migration_events("vm");
    fanout.publish(&events, None).await.unwrap();
    fanout.shutdown(Duration::from_secs(10)).await;
    assert_eq!(
        std::fs::read_to_string(&ran)
            .unwrap()
            .lines()
            .collect::<Vec<_>>(),
        ["scheduled", "started", "completed"]
    );
    assert_eq!(
        dead_letter_ids(dir.path(), "drain").len(),
        4,
        "the four documents"
    );
}

#[tokio::test]
async fn a_retried_rest_never_resends_the_confirmed_prefix() {
    let dir = tempfile::tempdir().unwrap();
    let sink = RecordingSink::new();
    let fanout = start(dir.path(), vec![("s", sink.clone())], &fast_delivery());
    sink.refuse(|e| e.id() == "2");
    fanout
        .publish(&[event("1"), event("2"), event("3")], None)
        .await
        .unwrap();
    fanout.shutdown(Duration::from_secs(5)).await;
    assert_eq!(ids(&sink.delivered()), ["1", "3"], "each once, in order");
    assert_eq!(dead_letter_ids(dir.path(), "s"), ["2"]);
}

#[tokio::test]
async fn refused_credentials_are_retried_until_rotated_never_dead_lettered() {
    let dir = tempfile::tempdir().unwrap();
    let sink = RecordingSink::new();
    sink.fail_next((0..3).map(|_| SinkError::Authentication("login refused".into())));
    let fanout = start(
        dir.path(),
        vec![("rotating", sink.clone())],
        &fast_delivery(),
    );
    fanout
        .publish(&[event("1"), event("2")], None)
        .await
        .unwrap();
    fanout.shutdown(Duration::from_secs(5)).await;
    assert_eq!(ids(&sink.delivered()), ["1", "2"]);
    assert!(dead_letter_ids(dir.path(), "rotating").is_empty());
}

/// Review finding: on a full disk the dead-letter write failed, was logged, and the refused
/// event left the outbox all the same. Now it stays there until its dead letter is on disk,
/// and the events after it wait behind it (per-sink order).
#[tokio::test]
async fn a_refused_event_leaves_the_outbox_only_once_its_dead_letter_is_written() {
    let dir = tempfile::tempdir().unwrap();
    // The dead-letter directory cannot be created: a file stands in its place.
    std::fs::write(dir.path().join("dead-letter"), b"in the way").unwrap();
    let sink = RecordingSink::new();
    sink.refuse(|e| e.id() == "2");
    let fanout = start(dir.path(), vec![("s", sink.clone())], &fast_delivery());
    fanout
        .publish(&[event("1"), event("2"), event("3")], None)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        ids(&sink.delivered()),
        ["1"],
        "3 waits behind the refused 2"
    );
    assert_eq!(fanout.publisher().outbox().depth("s").unwrap(), 2);
    std::fs::remove_file(dir.path().join("dead-letter")).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while sink.delivered().len() < 2 {
        assert!(std::time::Instant::now() < deadline, "never delivered 3");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    fanout.shutdown(Duration::from_secs(5)).await;
    assert_eq!(ids(&sink.delivered()), ["1", "3"]);
    assert_eq!(dead_letter_ids(dir.path(), "s"), ["2"]);
}
