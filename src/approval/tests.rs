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

const EVENT: &str = "C7061BAC-AFDC-4513-B24B-AA5F13A16123";

fn approver(dir: &std::path::Path, faults: Arc<DiskFaults>) -> (Approver, Fanout) {
    let outbox = Arc::new(Outbox::open_with_faults(dir, 100, faults).unwrap());
    let fanout = Fanout::start(Vec::new(), &DeliveryConfig::default(), dir, outbox);
    let document = Document::from_value(serde_json::json!({
        "DocumentIncarnation": 2,
        "Events": [{
            "EventId": EVENT, "EventType": "Freeze", "ResourceType": "VirtualMachine",
            "Resources": ["WestNO_0"], "EventStatus": "Scheduled",
            "NotBefore": "Mon, 19 Sep 2016 18:29:47 GMT"
        }]
    }))
    .unwrap()
    .document;
    let (_, latest) = watch::channel(Some(Snapshot {
        document: Arc::new(document),
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

fn request() -> Inbound {
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
    let Verdict::Fail(detail) = verdict else {
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
            Verdict::Fail(_) if Instant::now() < deadline => {
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
