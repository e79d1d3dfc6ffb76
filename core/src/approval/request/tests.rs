//! Reading approval messages from every binding, and the property that a signed request
//! verifies after every binding and content mode.

use super::*;
use crate::approval::sign::Draft;
use crate::approval::verify::{Key, SigningKey, canonical, decode_base64};
use crate::binding::{self, ContentMode, HeaderStyle};
use proptest::prelude::*;

fn limits() -> Limits {
    Limits {
        request_type: "com.azure.scheduledevents.approval.requested".into(),
        max_message_bytes: 64 * 1024,
        max_event_ids: 100,
    }
}

fn message(transport: &'static str, encoded: binding::Encoded) -> Inbound {
    Inbound {
        transport,
        channel: "test".into(),
        headers: encoded.headers,
        content_type: Some(encoded.content_type),
        body: encoded.body,
        shared: false,
        route: None,
    }
}

const STYLES: [(&str, HeaderStyle); 4] = [
    ("kafka", binding::KAFKA),
    ("nats", binding::NATS),
    ("http", binding::HTTP),
    ("amqp", binding::AMQP_1_0),
];

#[test]
fn the_bare_azure_body_is_read_without_attributes() {
    let body = br#"{"StartRequests":[{"EventId":"A"},{"EventId":"B"}]}"#.to_vec();
    let inbound = Inbound {
        transport: "http",
        channel: "t".into(),
        headers: vec![("Content-Type".into(), "application/json".into())],
        content_type: None,
        body,
        shared: false,
        route: None,
    };
    let request = parse(&inbound, &limits()).unwrap();
    assert_eq!(request.cloud_event, None);
    assert_eq!(request.event_ids, ["A", "B"]);
}

#[test]
fn wrong_content_types_and_batches_are_refused_by_name() {
    for (content_type, reason) in [
        ("text/plain", Reason::UnsupportedContentType),
        (
            "application/cloudevents-batch+json",
            Reason::UnsupportedContentType,
        ),
        ("application/json", Reason::Malformed),
    ] {
        let inbound = Inbound {
            transport: "nats",
            channel: "t".into(),
            headers: Vec::new(),
            content_type: Some(content_type.into()),
            body: b"[1,2]".to_vec(),
            shared: false,
            route: None,
        };
        assert_eq!(
            parse(&inbound, &limits()).unwrap_err().0.reason,
            reason,
            "{content_type}"
        );
    }
}

fn field() -> impl Strategy<Value = String> {
    "[A-Za-z0-9:/._ -]{1,40}"
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Whatever arrives, the parser answers (Ok or a rejection) and never panics.
    #[test]
    fn parser_never_panics(
        body in proptest::collection::vec(any::<u8>(), 0..512),
        headers in proptest::collection::vec(("(ce[-_]|cloudEvents_)?[a-z]{1,12}", ".{0,40}"), 0..8),
        content_type in proptest::option::of("[a-z/+.-]{0,40}"),
    ) {
        let inbound = Inbound { transport: "kafka", channel: "t".into(), headers, content_type, body, shared: false,
 route: None, };
        let _ = parse(&inbound, &limits());
    }

    /// A signed request survives every binding and content mode: the agent reads back
    /// exactly what was signed, and the signature verifies.
    #[test]
    fn signed_requests_verify_after_every_binding(
        source in field(),
        vm in proptest::option::of("[A-Za-z0-9_-]{1,20}"),
        event_ids in proptest::collection::vec("[A-Fa-f0-9-]{1,36}", 1..5),
        style in 0..STYLES.len(),
        structured in any::<bool>(),
    ) {
        let signer = SigningKey::parse("hmac-sha256:0123456789abcdef0123456789abcdef").unwrap();
        let key = Key::Hmac(b"0123456789abcdef0123456789abcdef".to_vec());
        let mut draft = Draft::new(&source, vm.as_deref(), event_ids);
        draft.request_type = limits().request_type;
        let event = draft.event(Some(("k", &signer)));
        let (transport, header_style) = STYLES[style];
        let mode = if structured { ContentMode::Structured } else { ContentMode::Binary };
        let encoded = binding::encode(&event, mode, header_style).unwrap();
        let request = parse(&message(transport, encoded), &limits()).unwrap();
        let attributes = request.cloud_event.clone().unwrap();
        let text = canonical(&attributes.id, &attributes.source, attributes.time.timestamp(), attributes.vm_name.as_deref(), &request.event_ids);
        prop_assert_eq!(&text, &draft.canonical());
        let signature = decode_base64(attributes.signature.as_deref().unwrap()).unwrap();
        prop_assert!(key.verify(text.as_bytes(), &signature));
    }

    /// Changing any signed field after signing breaks the signature.
    #[test]
    fn any_change_to_a_signed_field_breaks_the_signature(which in 0..5usize, other in "[a-z0-9]{1,12}") {
        let signer = SigningKey::parse("hmac-sha256:0123456789abcdef0123456789abcdef").unwrap();
        let key = Key::Hmac(b"0123456789abcdef0123456789abcdef".to_vec());
        let draft = Draft::new("urn:o", Some("vm1"), vec!["E1".into()]);
        let signature = decode_base64(&signer.sign(draft.canonical().as_bytes())).unwrap();
        let mut changed = draft.clone();
        match which {
            0 => changed.id = format!("{}{other}", changed.id),
            1 => changed.source = format!("urn:changed:{other}"),
            2 => changed.time += chrono::Duration::seconds(1),
            3 => changed.vm_name = Some(format!("vm-{other}")),
            _ => changed.event_ids = vec![format!("E-{other}")],
        }
        prop_assert!(!key.verify(changed.canonical().as_bytes(), &signature));
    }
}

/// A structured request whose `id` is `id`, otherwise well formed.
fn structured_with_id(id: &str) -> Inbound {
    let body = serde_json::json!({
        "specversion": "1.0",
        "type": "com.azure.scheduledevents.approval.requested",
        "id": id,
        "source": "orchestrator",
        "time": "2026-01-01T00:00:00Z",
        "data": {"StartRequests": [{"EventId": "A"}]},
    });
    Inbound {
        transport: "http",
        channel: "t".into(),
        headers: Vec::new(),
        content_type: Some("application/cloudevents+json".into()),
        body: serde_json::to_vec(&body).unwrap(),
        shared: false,
        route: None,
    }
}

#[test]
fn a_request_without_a_usable_id_is_malformed_and_names_no_id() {
    let long = "x".repeat(MAX_ID_BYTES + 1);
    for id in [
        "",
        " ",
        "\t \u{3000}",
        "a\u{0}b",
        "a\u{7f}",
        "a\u{85}b",
        long.as_str(),
    ] {
        let (rejection, named) = parse(&structured_with_id(id), &limits()).unwrap_err();
        assert_eq!(rejection.reason, Reason::Malformed, "id {id:?}");
        assert!(rejection.detail.contains("\"id\""), "{}", rejection.detail);
        assert_eq!(named, None, "id {id:?} must not name the rejection");
    }
    let longest = "x".repeat(MAX_ID_BYTES);
    for id in ["r-1", " padded ", longest.as_str(), "ünïcode"] {
        let request = parse(&structured_with_id(id), &limits()).unwrap();
        assert_eq!(request.id(), Some(id));
    }
}

#[test]
fn an_event_id_longer_than_an_id_is_malformed_so_no_outcome_carries_it() {
    let request = |event_id: &str| Inbound {
        transport: "http",
        channel: "t".into(),
        headers: vec![("Content-Type".into(), "application/json".into())],
        content_type: None,
        body: serde_json::to_vec(&serde_json::json!({"StartRequests": [{"EventId": event_id}]}))
            .unwrap(),
        shared: false,
        route: None,
    };
    let (rejection, _) = parse(&request(&"A".repeat(MAX_ID_BYTES + 1)), &limits()).unwrap_err();
    assert_eq!(rejection.reason, Reason::Malformed);
    assert!(rejection.detail.contains("EventId"), "{}", rejection.detail);
    let longest = "A".repeat(MAX_ID_BYTES);
    assert_eq!(
        parse(&request(&longest), &limits()).unwrap().event_ids,
        [longest]
    );
}

proptest! {
    #[test]
    fn a_rejection_never_names_an_unusable_id(id in ".{0,300}") {
        match parse(&structured_with_id(&id), &limits()) {
            Ok(request) => prop_assert!(usable_id(request.id().unwrap())),
            Err((_, named)) => prop_assert!(named.as_deref().is_none_or(usable_id)),
        }
    }
}
