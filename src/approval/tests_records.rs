//! A request's record answers only that request, and with what was approved: the EventIds
//! its accepted POST named, never those of the copy that arrives; another request reusing
//! its id is a replay.

use std::sync::Arc;
use std::time::{Duration, Instant};

use sched_relay_core::document::Document;
use sched_relay_transport::inbound::Inbound;

use super::tests::{EVENT, approver, approver_seeing, handle, outcome, request};
use super::*;
use crate::store::DiskFaults;

/// The request with its EventIds (or VM) changed, the id kept.
fn with(message: &Inbound, field: &str, value: serde_json::Value) -> Inbound {
    let mut body: serde_json::Value = serde_json::from_slice(&message.body).unwrap();
    if field == "EventIds" {
        body["data"]["StartRequests"] = value;
    } else {
        body[field] = value;
    }
    Inbound {
        body: serde_json::to_vec(&body).unwrap(),
        ..message.clone()
    }
}

fn body(answer: &Answer) -> serde_json::Value {
    match answer {
        Answer::Handled(reply) => reply.body.clone(),
        Answer::NotHandled(why) => panic!("not handled: {why}"),
    }
}

/// The poller's document from now on: the Freeze has run and left it.
fn event_over(approver: &mut Approver) {
    let over = Document::from_value(serde_json::json!({"DocumentIncarnation": 3, "Events": []}))
        .unwrap()
        .document;
    let (_, latest) = watch::channel(Some(Snapshot {
        document: Arc::new(over),
        fetched: Instant::now(),
    }));
    approver.latest = latest;
}

#[tokio::test]
async fn a_request_reusing_a_handled_id_with_other_content_is_a_replay_not_its_outcome() {
    let dir = tempfile::tempdir().unwrap();
    let (approver, _fanout) = approver(dir.path(), DiskFaults::new());
    let message = request();
    let (request_id, _, verdict, recorded) = approver.check(&message, &mut None).await;
    assert!(matches!(verdict, Verdict::Valid) && recorded, "{verdict:?}");
    let stored = crate::store::StoredOutcome {
        outcome: "accepted".into(),
        event_id: format!("{request_id}:accepted"),
        body: serde_json::json!({"outcome": "accepted", "eventIds": [EVENT]}),
    };
    approver
        .outbox
        .finish_requests(&[(request_id, stored.clone())])
        .unwrap();
    // The same message again: its stored outcome.
    let (_, _, again, _) = approver.check(&message, &mut None).await;
    assert!(
        matches!(&again, Verdict::Answered(s) if *s == stored),
        "{again:?}"
    );
    // The same id with another event, another VM, another time: not this request.
    let others = [
        with(
            &message,
            "EventIds",
            serde_json::json!([{"EventId": "other-event"}]),
        ),
        with(&message, "vmname", serde_json::json!("WestNO_1")),
        with(&message, "time", serde_json::json!("2026-01-01T00:00:00Z")),
    ];
    for other in others {
        let (_, _, verdict, _) = approver.check(&other, &mut None).await;
        assert!(
            matches!(&verdict, Verdict::Reject(r) if r.reason == Reason::Replayed),
            "a request reusing a handled id with other content got {verdict:?}"
        );
    }
}

#[tokio::test]
async fn a_posted_request_is_answered_with_the_event_ids_its_post_named() {
    let dir = tempfile::tempdir().unwrap();
    let (before, fanout) = approver(dir.path(), DiskFaults::new());
    // The orchestrator wrote the EventId lower-cased; the document (and the POST) spell it
    // upper-case.
    let message = with(
        &request(),
        "EventIds",
        serde_json::json!([{"EventId": EVENT.to_lowercase()}]),
    );
    let (request_id, event_ids, verdict, _) = before.check(&message, &mut None).await;
    assert!(matches!(verdict, Verdict::Valid), "{verdict:?}");
    assert_eq!(event_ids, [EVENT]);
    before
        .outbox
        .mark_posted(&[(request_id.clone(), event_ids)])
        .unwrap();
    drop(before);
    fanout.shutdown(Duration::from_secs(1)).await;
    let (after, _fanout) = approver_seeing(dir.path(), DiskFaults::new(), Some(false));
    let answer = handle(&after, &message).await;
    assert_eq!(outcome(&answer), "accepted", "{answer:?}");
    assert_eq!(body(&answer)["eventIds"], serde_json::json!([EVENT]));
    // Another request with this id, naming another event, gets no `accepted`.
    let other = with(
        &message,
        "EventIds",
        serde_json::json!([{"EventId": "other-event"}]),
    );
    let answer = handle(&after, &other).await;
    assert_eq!(outcome(&answer), "rejected", "{answer:?}");
    assert_eq!(body(&answer)["reason"], "replayed");
}

/// The metadata service accepted a request's POST, and the disk refused its mark (and,
/// with `file_lost`, the state file was lost with it and made anew); then its event ran and
/// left the document, and the requester, unanswered, sends it again.
async fn posted_then_disk_fault(file_lost: bool) -> Verdict {
    let dir = tempfile::tempdir().unwrap();
    let faults = DiskFaults::new();
    let (mut approver, _fanout) = approver(dir.path(), faults.clone());
    let message = request();
    let (request_id, event_ids, verdict, recorded) = approver.check(&message, &mut None).await;
    assert!(matches!(verdict, Verdict::Valid) && recorded, "{verdict:?}");
    faults.fill();
    let pending = Pending {
        delivery: Delivery {
            message: message.clone(),
            handled: tokio::sync::oneshot::channel().0,
        },
        request_id,
        event_ids,
        verdict,
        recorded,
        content: super::checks::content_of(
            &sched_relay_core::approval::parse(&message, &approver.limits).unwrap(),
        ),
    };
    approver.mark_posted(&[&pending]).await;
    if file_lost {
        std::fs::remove_file(dir.path().join(crate::store::FILE_NAME)).unwrap();
    }
    faults.free();
    event_over(&mut approver);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, _, verdict, _) = approver.check(&message, &mut None).await;
        match verdict {
            Verdict::Fail(..) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            verdict => break verdict,
        }
    }
}

#[tokio::test]
async fn a_post_whose_mark_a_full_disk_refused_is_still_answered_accepted_after_its_event() {
    let verdict = posted_then_disk_fault(false).await;
    assert!(
        matches!(verdict, Verdict::Posted),
        "an approval the metadata service accepted is refused once its mark failed: {verdict:?}"
    );
}

#[tokio::test]
async fn a_post_whose_record_was_lost_with_the_state_file_is_still_answered_accepted() {
    let verdict = posted_then_disk_fault(true).await;
    assert!(
        matches!(verdict, Verdict::Posted),
        "an approval the metadata service accepted is checked again once its record was lost: {verdict:?}"
    );
}
