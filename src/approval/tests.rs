//! The approval path against a state store whose disk fills and frees.

use std::sync::Arc;
use std::time::{Duration, Instant};

use sched_relay_core::approval::Draft;
use sched_relay_core::document::Document;
use sched_relay_core::event::{EventFactory, Identity, PartitionKey};
use sched_relay_transport::inbound::Inbound;

use super::*;
use crate::fanout::{DeliveryConfig, Fanout};
use crate::store::DiskFaults;

pub(super) const EVENT: &str = "C7061BAC-AFDC-4513-B24B-AA5F13A16123";

pub(super) fn approver(dir: &std::path::Path, faults: Arc<DiskFaults>) -> (Approver, Fanout) {
    approver_seeing(dir, faults, Some(true))
}

/// An approver whose poller has a document (`Some(with_event)`: with or without the Freeze)
/// or none yet (`None`), and whose metadata service is unreachable.
pub(super) fn approver_seeing(
    dir: &std::path::Path,
    faults: Arc<DiskFaults>,
    document: Option<bool>,
) -> (Approver, Fanout) {
    approver_configured(dir, faults, document, false)
}

fn approver_configured(
    dir: &std::path::Path,
    faults: Arc<DiskFaults>,
    document: Option<bool>,
    dry_run: bool,
) -> (Approver, Fanout) {
    let outbox = Arc::new(Outbox::open_with_faults(dir, 100, faults).unwrap());
    let fanout = Fanout::start(Vec::new(), &DeliveryConfig::default(), dir, outbox);
    let with = Document::from_value(serde_json::json!({
        "DocumentIncarnation": 2,
        "Events": [{
            "EventId": EVENT, "EventType": "Freeze", "ResourceType": "VirtualMachine",
            "Resources": ["WestNO_0"], "EventStatus": "Scheduled",
            "NotBefore": "Mon, 19 Sep 2016 18:29:47 GMT"
        }]
    }))
    .unwrap()
    .document;
    let over = Document::from_value(serde_json::json!({"DocumentIncarnation": 3, "Events": []}))
        .unwrap()
        .document;
    let (_, latest) = watch::channel(document.map(|with_event| Snapshot {
        document: Arc::new(if with_event {
            with.clone()
        } else {
            over.clone()
        }),
        fetched: Instant::now(),
    }));
    let factory = EventFactory::new(
        "com.azure.scheduledevents",
        None,
        Identity {
            name: "WestNO_0".into(),
            vm_id: None,
            resource_id: None,
        },
        PartitionKey::default(),
    );
    let config = ApprovalsConfig {
        allow_unsigned: true,
        dry_run,
        ..Default::default()
    };
    let client = ImdsClient::new(
        "http://127.0.0.1:9".parse().unwrap(),
        "2020-07-01",
        Duration::from_secs(1),
        Duration::from_secs(1),
    )
    .unwrap();
    let approver = Approver::new(
        &config,
        factory,
        Arc::new(client),
        latest,
        Duration::from_secs(3600),
        fanout.publisher(),
    )
    .unwrap();
    (approver, fanout)
}

pub(super) fn request() -> Inbound {
    let draft = Draft::new(
        "urn:orchestrator:test",
        Some("WestNO_0"),
        vec![EVENT.into()],
    );
    Inbound {
        transport: "http",
        channel: "POST /approvals".into(),
        headers: Vec::new(),
        content_type: Some("application/cloudevents+json".into()),
        body: serde_json::to_vec(&draft.event(None)).unwrap(),
        shared: false,
        route: None,
    }
}

#[tokio::test]
async fn a_request_that_cannot_be_recorded_fails_retriably_and_is_not_called_a_replay() {
    let dir = tempfile::tempdir().unwrap();
    let faults = DiskFaults::new();
    let (approver, _fanout) = approver(dir.path(), faults.clone());
    let message = request();

    faults.fill();
    let (_, _, verdict, _) = approver.check(&message, &mut None).await;
    let Verdict::Fail(_, detail) = verdict else {
        panic!("a store error must fail the request, not judge it: {verdict:?}");
    };
    assert!(detail.contains("send the request again"), "{detail}");

    // Once the disk has room, the very same request is checked afresh and passes.
    faults.free();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, _, verdict, _) = approver.check(&message, &mut None).await;
        match verdict {
            Verdict::Valid => break,
            Verdict::Fail(..) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            other => panic!("after the disk was freed: {other:?}"),
        }
    }
    // Checked, but no outcome recorded (as after a crash before it): checked again.
    let (request_id, _, again, recorded) = approver.check(&message, &mut None).await;
    assert!(matches!(again, Verdict::Valid) && recorded, "{again:?}");
    // Once its outcome is recorded, a second time is answered with that outcome.
    let stored = crate::store::StoredOutcome {
        outcome: "accepted".into(),
        event_id: format!("{request_id}:accepted"),
        body: serde_json::json!({"outcome": "accepted"}),
    };
    approver
        .outbox
        .finish_requests(&[(request_id, stored.clone())])
        .unwrap();
    let (_, _, replay, _) = approver.check(&message, &mut None).await;
    assert!(
        matches!(&replay, Verdict::Answered(answer) if *answer == stored),
        "a replay of a handled request is answered with its outcome: {replay:?}"
    );
}

#[tokio::test]
async fn requests_with_an_empty_id_over_each_transport_get_distinct_unidentified_ids() {
    let dir = tempfile::tempdir().unwrap();
    let (approver, _fanout) = approver(dir.path(), DiskFaults::new());
    let mut ids = std::collections::HashSet::new();
    for transport in ["http", "nats", "amqp", "http"] {
        let mut message = request();
        message.transport = transport;
        let mut body: serde_json::Value = serde_json::from_slice(&message.body).unwrap();
        body["id"] = "".into();
        message.body = serde_json::to_vec(&body).unwrap();
        let (request_id, _, verdict, _) = approver.check(&message, &mut None).await;
        assert!(
            matches!(&verdict, Verdict::Reject(r) if r.reason == Reason::Malformed),
            "{verdict:?}"
        );
        assert!(
            request_id.starts_with(&format!("unidentified:{transport}:")),
            "{request_id}"
        );
        assert!(ids.insert(request_id), "outcome ids must differ");
    }
}

/// Runs one request through the approver as a source would; returns the answer.
pub(super) async fn handle(approver: &Approver, message: &Inbound) -> Answer {
    let (handled, answer) = tokio::sync::oneshot::channel();
    approver
        .handle(vec![Delivery {
            message: message.clone(),
            handled,
        }])
        .await;
    answer.await.unwrap()
}

pub(super) fn outcome(answer: &Answer) -> &'static str {
    match answer {
        Answer::Handled(reply) => reply.outcome,
        Answer::NotHandled(_) => "not handled",
    }
}

#[tokio::test]
async fn a_request_before_the_first_document_fails_retriably_and_is_forwarded_once_one_comes() {
    let dir = tempfile::tempdir().unwrap();
    // A fresh start while the metadata service is down: no document yet.
    let (approver, fanout) = approver_seeing(dir.path(), DiskFaults::new(), None);
    let message = request();
    let answer = handle(&approver, &message).await;
    assert_eq!(outcome(&answer), "failed", "{answer:?}");
    drop(approver);
    fanout.shutdown(Duration::from_secs(1)).await;
    // The service is back: the same request is checked again, not answered with a stored
    // rejection.
    let (approver, _fanout) = self::approver(dir.path(), DiskFaults::new());
    let (_, _, verdict, recorded) = approver.check(&message, &mut None).await;
    assert!(
        matches!(verdict, Verdict::Valid) && recorded,
        "a transient failure became the request's final outcome: {verdict:?}"
    );
}

#[tokio::test]
async fn a_request_accepted_before_a_crash_is_answered_accepted_after_its_event_has_run() {
    let dir = tempfile::tempdir().unwrap();
    let (before, fanout) = approver(dir.path(), DiskFaults::new());
    let message = request();
    let (request_id, _, verdict, recorded) = before.check(&message, &mut None).await;
    assert!(matches!(verdict, Verdict::Valid) && recorded);
    // The metadata service accepted the POST, then the agent was killed before the outcome.
    before
        .outbox
        .mark_posted(&[(request_id.clone(), vec![EVENT.to_owned()])])
        .unwrap();
    drop(before);
    fanout.shutdown(Duration::from_secs(1)).await;
    // After the restart the Freeze has run and left the document.
    let (after, _fanout) = approver_seeing(dir.path(), DiskFaults::new(), Some(false));
    let (again, _, verdict, recorded) = after.check(&message, &mut None).await;
    assert_eq!(again, request_id);
    assert!(
        matches!(verdict, Verdict::Posted) && recorded,
        "an approval the metadata service accepted is not reported accepted: {verdict:?}"
    );
    let answer = handle(&after, &message).await;
    assert_eq!(outcome(&answer), "accepted", "{answer:?}");
}

#[tokio::test]
async fn a_request_not_yet_posted_before_a_crash_is_refused_once_its_event_is_over() {
    let dir = tempfile::tempdir().unwrap();
    let (before, fanout) = approver(dir.path(), DiskFaults::new());
    let message = request();
    let (_, _, verdict, _) = before.check(&message, &mut None).await;
    assert!(matches!(verdict, Verdict::Valid));
    drop(before);
    fanout.shutdown(Duration::from_secs(1)).await;
    let (after, _fanout) = approver_seeing(dir.path(), DiskFaults::new(), Some(false));
    let (_, _, verdict, _) = after.check(&message, &mut None).await;
    assert!(
        matches!(&verdict, Verdict::Reject(r) if r.reason == Reason::UnknownEvent),
        "{verdict:?}"
    );
}

#[tokio::test]
async fn a_handled_request_redelivered_after_max_age_gets_its_stored_outcome_not_a_second_one() {
    let dir = tempfile::tempdir().unwrap();
    // Handled with a final outcome (here: refused, its event being over).
    let (mut approver, _fanout) = approver_seeing(dir.path(), DiskFaults::new(), Some(false));
    let message = request();
    let first = handle(&approver, &message).await;
    let Answer::Handled(first) = first else {
        panic!("{first:?}")
    };
    assert_eq!(first.outcome, "rejected");
    // Killed before the ack; the VM (rebooting for the approved event) is back after
    // approvals.max_age: the broker delivers the same message, now too old. (max_age is made
    // 1 s here, not waited for on its default 5 minutes.)
    approver.config.max_age = Duration::from_secs(1);
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let (_, _, verdict, _) = approver.check(&message, &mut None).await;
    let Verdict::Answered(stored) = verdict else {
        panic!("a redelivery after max_age got a new verdict: {verdict:?}")
    };
    assert_eq!(stored.body, first.body);
    // A request never seen that old is still refused.
    let mut other: serde_json::Value = serde_json::from_slice(&message.body).unwrap();
    other["id"] = "never-seen-before".into();
    let old = Inbound {
        body: serde_json::to_vec(&other).unwrap(),
        ..message
    };
    let (_, _, verdict, _) = approver.check(&old, &mut None).await;
    assert!(
        matches!(&verdict, Verdict::Reject(r) if r.reason == Reason::Expired),
        "{verdict:?}"
    );
}

#[tokio::test]
async fn refusals_before_the_request_is_recorded_and_failures_get_outcome_ids_of_their_own() {
    let dir = tempfile::tempdir().unwrap();
    let (approver, _fanout) = approver_seeing(dir.path(), DiskFaults::new(), None);
    let message = request();
    let mut ids = std::collections::HashSet::new();
    for _ in 0..2 {
        let Answer::Handled(reply) = handle(&approver, &message).await else {
            panic!("not handled")
        };
        assert_eq!(reply.outcome, "failed");
        assert!(ids.insert(reply.body["outcomeId"].to_string()), "{ids:?}");
    }
    let mut body: serde_json::Value = serde_json::from_slice(&message.body).unwrap();
    body["id"] = "too-old".into();
    body["time"] = (chrono::Utc::now() - chrono::Duration::hours(1))
        .to_rfc3339()
        .into();
    let old = Inbound {
        body: serde_json::to_vec(&body).unwrap(),
        ..message
    };
    for _ in 0..2 {
        let Answer::Handled(reply) = handle(&approver, &old).await else {
            panic!("not handled")
        };
        assert_eq!(reply.outcome, "rejected");
        let id = reply.body["outcomeId"].as_str().unwrap().to_owned();
        assert_ne!(id, "too-old:rejected");
        assert!(ids.insert(id), "{ids:?}");
    }
}

#[tokio::test]
async fn a_request_accepted_in_dry_run_is_forwarded_once_dry_run_is_off() {
    let dir = tempfile::tempdir().unwrap();
    let (dry, fanout) = approver_configured(dir.path(), DiskFaults::new(), Some(true), true);
    let message = request();
    let Answer::Handled(reply) = handle(&dry, &message).await else {
        panic!("not handled")
    };
    assert_eq!(
        (reply.outcome, &reply.body["reason"]),
        ("accepted", &"dry_run".into())
    );
    // Its outcome id is its own: the real outcome later must not look like a duplicate.
    let dry_id = reply.body["outcomeId"].as_str().unwrap().to_owned();
    assert!(
        !dry_id.ends_with(":accepted"),
        "a dry run's outcome id {dry_id} is the real outcome's"
    );
    drop(dry);
    fanout.shutdown(Duration::from_secs(1)).await;
    // The operator turns dry run off; the orchestrator sends the same request again.
    let (live, _fanout) = approver(dir.path(), DiskFaults::new());
    let (_, _, verdict, _) = live.check(&message, &mut None).await;
    assert!(
        matches!(verdict, Verdict::Valid),
        "a dry run's answer became the request's final outcome: {verdict:?}"
    );
}

#[test]
fn a_record_past_its_time_counts_as_forgotten_even_before_it_is_pruned() {
    let dir = tempfile::tempdir().unwrap();
    let outbox = Outbox::open(dir.path(), 100, false).unwrap();
    assert_eq!(
        outbox.begin_request("r", "c", 1_000, 500).unwrap(),
        crate::store::Seen::New
    );
    assert_eq!(
        outbox.peek_request("r", "c", 900).unwrap(),
        Some(crate::store::Seen::InFlight)
    );
    // A quiet VM: nothing has pruned it, but its time is over.
    assert_eq!(outbox.peek_request("r", "c", 1_001).unwrap(), None);
    assert_eq!(
        outbox.begin_request("r", "c", 5_000, 1_001).unwrap(),
        crate::store::Seen::New
    );
}
