//! The CloudEvents contract of product.md, attribute by attribute, and the typed kinds.

use super::*;
use crate::diff::{Observation, diff};
use cloudevents::AttributesReader;

fn factory() -> EventFactory {
    EventFactory::new(
        DEFAULT_TYPE_PREFIX,
        None,
        Identity {
            name: "WestNO_0".into(),
            vm_id: Some("vm-id".into()),
            resource_id: None,
        },
        PartitionKey::EventId,
    )
}

fn document(value: Value) -> Document {
    Document::from_value(value).unwrap().document
}

#[test]
fn transition_event_has_every_attribute_of_the_contract() {
    let raw_event = json!({"EventId": "E1", "EventStatus": "Scheduled", "EventType": "Freeze",
        "Resources": ["WestNO_0"], "EventSource": "Platform", "DurationInSeconds": 5,
        "NotBefore": "Mon, 11 Apr 2022 22:26:58 GMT", "Unknown": {"kept": true}});
    let current = document(json!({"DocumentIncarnation": 2, "Events": [raw_event.clone()]}));
    let transition = &diff(None, &current)[0];
    let observed = "2022-04-11T22:00:00Z".parse().unwrap();
    let event = factory().transition(transition, observed);

    assert_eq!(event.id(), "E1:scheduled");
    assert_eq!(event.ty(), "com.azure.scheduledevents.scheduled");
    assert_eq!(event.source(), "urn:sched-relay:vm:WestNO_0");
    assert_eq!(event.subject(), Some("E1"));
    assert_eq!(event.time(), Some(&observed));
    assert_eq!(event.datacontenttype(), Some("application/json"));
    let ext = |name| event.extension(name).unwrap().to_string();
    assert_eq!(ext("incarnation"), "2");
    assert_eq!(ext("eventtype"), "Freeze");
    assert_eq!(ext("eventstatus"), "Scheduled");
    assert_eq!(ext("eventsource"), "Platform");
    assert_eq!(ext("vmname"), "WestNO_0");
    assert_eq!(ext("affectsvm"), "true");
    assert_eq!(ext("partitionkey"), "E1");

    let structured = serde_json::to_value(&event).unwrap();
    assert_eq!(structured["specversion"], "1.0");
    assert_eq!(structured["incarnation"], 2);
    assert_eq!(structured["affectsvm"], true);
    let data = &structured["data"];
    assert_eq!(data["incarnation"], 2);
    assert_eq!(
        data["vm"],
        json!({"name": "WestNO_0", "id": "vm-id", "resourceId": null})
    );
    assert_eq!(data["affectsVm"], true);
    assert_eq!(data["previousStatus"], Value::Null);
    assert_eq!(
        data["event"], raw_event,
        "the Azure event travels exactly as received"
    );
}

#[test]
fn source_prefers_configuration_then_resource_id() {
    let mut vm = factory().vm;
    vm.resource_id = Some("/subscriptions/s/virtualMachines/WestNO_0".into());
    let from_resource = EventFactory::new("p", None, vm.clone(), PartitionKey::EventId);
    assert_eq!(
        from_resource.source,
        "/subscriptions/s/virtualMachines/WestNO_0"
    );
    let configured = EventFactory::new("p", Some("urn:x"), vm, PartitionKey::EventId);
    assert_eq!(configured.source, "urn:x");
}

#[test]
fn document_event_carries_the_whole_document() {
    let raw = json!({"DocumentIncarnation": "7", "Events": []});
    let event = factory().document(&document(raw.clone()), 0, Utc::now());
    assert_eq!(event.id(), "document:7");
    assert_eq!(event.subject(), Some("7"));
    assert_eq!(event.ty(), "com.azure.scheduledevents.document");
    assert_eq!(serde_json::to_value(&event).unwrap()["data"], raw);
}

#[test]
fn partition_key_can_be_the_vm_name() {
    let mut factory = factory();
    factory.partition_key = PartitionKey::VmName;
    let current = document(json!({"DocumentIncarnation": 1, "Events": [
        {"EventId": "E1", "EventStatus": "Started"}]}));
    let event = factory.transition(&diff(None, &current)[0], Utc::now());
    assert_eq!(
        event.extension("partitionkey").unwrap().to_string(),
        "WestNO_0"
    );
    assert!(
        event.extension("eventsource").is_none(),
        "absent fields add no extension"
    );
}

#[test]
fn every_kind_reads_back_from_its_type_with_any_prefix() {
    for prefix in [DEFAULT_TYPE_PREFIX, "com.contoso.maintenance", "x"] {
        for kind in EventKind::ALL {
            let ty = format!("{prefix}.{}", kind.suffix().unwrap());
            assert_eq!(EventKind::from_type(&ty), kind, "{ty}");
        }
    }
    // A bare suffix, or a type sched-relay does not make, is `Other`.
    assert_eq!(EventKind::from_type("scheduled"), EventKind::Other);
    assert_eq!(EventKind::from_type("com.x.rescheduled"), EventKind::Other);
    let other: Event = cloudevents::Event::default().into();
    assert_eq!(other.kind(), EventKind::Other);
}

#[test]
fn events_made_here_carry_the_kind_their_type_reads_back_as() {
    let factory = EventFactory::new(
        "com.contoso.maint",
        None,
        factory().vm,
        PartitionKey::EventId,
    );
    let current = document(json!({"DocumentIncarnation": 3, "Events": [
        {"EventId": "E1", "EventStatus": "Scheduled"}]}));
    let outcome = Outcome {
        outcome: ApprovalOutcome::Rejected,
        request_id: "r".into(),
        event_ids: vec!["E1".into()],
        reason: "bad_signature".into(),
        detail: String::new(),
        channel: "http".into(),
        dry_run: false,
        nonce: None,
    };
    let made = [
        factory.transition(&diff(None, &current)[0], Utc::now()),
        factory.document(&current, 0, Utc::now()),
        factory.approval_outcome(&outcome, Utc::now()),
    ];
    let names: Vec<&str> = made.iter().map(Event::transition).collect();
    assert_eq!(names, ["scheduled", "document", "approval.rejected"]);
    for event in made {
        let stored = serde_json::to_string(&event).unwrap();
        let read: Event = serde_json::from_str(&stored).unwrap();
        assert_eq!(read.kind(), event.kind(), "{stored}");
        assert_eq!(read, event);
    }
}

#[test]
fn a_cancelled_event_that_probably_ran_says_so_and_a_real_cancellation_does_not() {
    let scheduled = json!({"EventId": "E1", "EventStatus": "Scheduled", "EventType": "Reboot",
        "Resources": ["WestNO_0"], "NotBefore": "Mon, 11 Apr 2022 22:26:58 GMT"});
    let before = document(json!({"DocumentIncarnation": 2, "Events": [scheduled]}));
    let after = document(json!({"DocumentIncarnation": 3, "Events": []}));
    let cancelled_at = |time: &str| {
        let observation = Observation::at(time.parse().unwrap());
        events_observed(&factory(), Some(&before), &after, false, &observation).remove(0)
    };
    let ran = cancelled_at("2022-04-11T22:40:00Z");
    assert_eq!(ran.ty(), "com.azure.scheduledevents.cancelled");
    assert_eq!(ran.id(), "E1:cancelled", "the contract's id and type stay");
    let ext = |event: &Event, name| event.extension(name).map(|v| v.to_string());
    assert_eq!(ext(&ran, "unobserved").as_deref(), Some("started"));
    assert_eq!(ext(&ran, "unobservedreason").as_deref(), Some("notbefore"));
    let cancelled = cancelled_at("2022-04-11T22:00:00Z");
    assert_eq!(ext(&cancelled, "unobserved"), None);
    assert_eq!(ext(&cancelled, "unobservedreason"), None);
}

#[test]
fn document_ids_carry_the_epoch_only_after_a_reset() {
    let current = document(json!({"DocumentIncarnation": 4, "Events": []}));
    let observation = Observation {
        epoch: 3,
        ..Observation::at(Utc::now())
    };
    let events = events_observed(&factory(), None, &current, true, &observation);
    assert_eq!(events[0].id(), "document:4~e3");
    assert_eq!(
        events[0].subject(),
        Some("4"),
        "the subject stays the incarnation"
    );
    let events = events_for_document(&factory(), None, &current, true, Utc::now());
    assert_eq!(events[0].id(), "document:4");
}

mod decoding {
    //! `Event::from_json_slice` is a faster path to exactly what the SDK's decoding gives.
    use super::*;
    use proptest::prelude::*;

    /// What the SDK's own `Deserialize` makes of the bytes (an error as `None`).
    fn by_the_sdk(bytes: &[u8]) -> Option<Event> {
        serde_json::from_slice::<Event>(bytes).ok()
    }

    fn by_the_fast_path(bytes: &[u8]) -> Option<Event> {
        Event::from_json_slice(bytes).ok()
    }

    /// An extension's value: mostly what the SDK keeps (string, boolean, integer), so that
    /// generated events often take the one-pass path, sometimes anything.
    fn extension_value() -> impl Strategy<Value = Value> {
        prop_oneof![
            3 => "[a-zA-Z0-9 :./+=-]{0,12}".prop_map(Value::from),
            1 => any::<bool>().prop_map(Value::from),
            2 => any::<i64>().prop_map(Value::from),
            1 => any::<u64>().prop_map(Value::from),
            1 => json_value(),
        ]
    }

    fn json_value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            (-1e9f64..1e9).prop_map(Value::from),
            "[a-zA-Z0-9 :./+=-]{0,12}".prop_map(Value::from),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
                prop::collection::btree_map("[a-z]{1,6}", inner, 0..4)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    /// An attribute that is absent (2 in 10), one of a few values, or of a wrong type (a
    /// number or null, `odd` each).
    fn attribute_or_odd(
        values: &'static [&'static str],
        odd: u32,
    ) -> impl Strategy<Value = Option<Value>> {
        prop_oneof![
            2 => Just(None),
            6 => prop::sample::select(values).prop_map(|v| Some(Value::from(v))),
            odd => any::<i64>().prop_map(|n| Some(Value::from(n))),
            odd => Just(Some(Value::Null)),
        ]
    }

    /// With `usual`, absent nine times in ten.
    fn rarely(
        usual: bool,
        attribute: impl Strategy<Value = Option<Value>> + 'static,
    ) -> BoxedStrategy<Option<Value>> {
        if usual {
            prop_oneof![9 => Just(None), 1 => attribute].boxed()
        } else {
            attribute.boxed()
        }
    }

    #[test]
    fn most_usual_generated_events_take_the_one_pass_path() {
        use proptest::strategy::ValueTree;
        let mut runner = proptest::test_runner::TestRunner::deterministic();
        let strategy = structured_event(true);
        let fast = (0..1000)
            .filter(|_| {
                let bytes = strategy.new_tree(&mut runner).unwrap().current();
                super::super::decode::fast_path(&bytes).is_some()
            })
            .count();
        assert!(fast >= 400, "only {fast} of 1000 took the one-pass path");
    }

    /// A structured event; `usual` makes it mostly of the shape the one-pass path reads (1.0,
    /// the required attributes there and strings, rarely anything odd).
    fn structured_event(usual: bool) -> impl Strategy<Value = Vec<u8>> {
        let odd = if usual { 0 } else { 1 };
        let versions: &'static [&'static str] = if usual {
            &["1.0"]
        } else {
            &["1.0", "0.3", "2.0"]
        };
        let sources: &'static [&'static str] = if usual {
            &["urn:sched-relay:vm:WestNO_0", "/subscriptions/x"]
        } else {
            &["urn:sched-relay:vm:WestNO_0", "/subscriptions/x", ""]
        };
        let times: &'static [&'static str] = if usual {
            &["2026-11-25T10:00:00Z", "2026-11-25T10:00:00.123456+01:00"]
        } else {
            &[
                "2026-11-25T10:00:00Z",
                "2026-11-25T10:00:00.123456+01:00",
                "yesterday",
            ]
        };
        let required = move |values| {
            if usual {
                prop::sample::select(values)
                    .prop_map(|v: &str| Some(Value::from(v)))
                    .boxed()
            } else {
                attribute_or_odd(values, 1).boxed()
            }
        };
        (
            (
                required(versions),
                required(&["E1:scheduled", "document:7~e2", ""]),
                required(sources),
                required(&["com.azure.scheduledevents.scheduled", "x"]),
                attribute_or_odd(&["E1", "7"], odd),
                attribute_or_odd(times, odd),
            ),
            (
                attribute_or_odd(
                    &[
                        "application/json",
                        "text/plain",
                        "application/cloudevents+json",
                        "text/json; charset=utf-8",
                    ],
                    odd,
                ),
                rarely(
                    usual,
                    attribute_or_odd(&["https://example.com/schema", "not a url"], 1),
                ),
                prop::option::of(json_value()),
                rarely(
                    usual,
                    attribute_or_odd(&["eyJhIjoxfQ==", "aGVsbG8=", "%%%"], 1),
                ),
                prop::collection::btree_map("[a-z]{1,10}", extension_value(), 0..4),
                any::<bool>(),
            ),
        )
            .prop_map(
                |(
                    (specversion, id, source, ty, subject, time),
                    (content_type, dataschema, data, data_base64, extensions, text_data),
                )| {
                    let mut map = serde_json::Map::new();
                    // Text data as a string, so a text content type is not always refused.
                    let data = data.map(|d| {
                        if text_data {
                            Value::from(d.to_string())
                        } else {
                            d
                        }
                    });
                    for (name, value) in [
                        ("specversion", specversion),
                        ("id", id),
                        ("source", source),
                        ("type", ty),
                        ("subject", subject),
                        ("time", time),
                        ("datacontenttype", content_type),
                        ("dataschema", dataschema),
                        ("data", data),
                        ("data_base64", data_base64),
                    ] {
                        if let Some(value) = value {
                            map.insert(name.into(), value);
                        }
                    }
                    for (name, value) in extensions {
                        map.entry(name).or_insert(value);
                    }
                    serde_json::to_vec(&map).unwrap()
                },
            )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2048))]
        #[test]
        fn decoding_fast_gives_what_the_sdk_gives_or_fails_where_it_fails(bytes in prop_oneof![structured_event(false), structured_event(true)]) {
            prop_assert_eq!(by_the_fast_path(&bytes), by_the_sdk(&bytes), "{}", String::from_utf8_lossy(&bytes));
        }

        /// The one-pass path alone: whatever it accepts is the SDK's event.
        #[test]
        fn decoding_in_one_pass_gives_the_sdks_event_whenever_it_gives_one(bytes in structured_event(true)) {
            if let Some(fast) = super::super::decode::fast_path(&bytes) {
                prop_assert_eq!(Some(fast), by_the_sdk(&bytes), "{}", String::from_utf8_lossy(&bytes));
            }
        }

        #[test]
        fn decoding_fast_fails_on_what_is_not_json_as_the_sdk_does(bytes in prop::collection::vec(any::<u8>(), 0..64)) {
            prop_assert_eq!(by_the_fast_path(&bytes), by_the_sdk(&bytes));
        }
    }

    #[test]
    fn common_shapes_are_read_in_one_pass_as_the_sdk_reads_them() {
        let shapes: [&[u8]; 5] = [
            br#"{"specversion":"1.0","id":"1","source":"s","type":"t","datacontenttype":"application/json","data":{"a":[1,2.5,null]},"vm":"WestNO_0","n":-3,"ok":true}"#,
            br#"{"specversion":"1.0","id":"1","source":"s","type":"t","datacontenttype":"text/plain","data":"hello"}"#,
            br#"{"specversion":"1.0","id":"1","source":"s","type":"t","data":{"a":1}}"#,
            br#"{"id":"1","source":"s","type":"t","time":"2026-11-25T10:00:00.123+01:00","subject":"E1","specversion":"1.0"}"#,
            br#"{"specversion":"1.0","id":"1","source":"s","type":"t","data":null}"#,
        ];
        for bytes in shapes {
            let fast = super::super::decode::fast_path(bytes);
            assert!(fast.is_some(), "{}", String::from_utf8_lossy(bytes));
            assert_eq!(
                fast,
                by_the_sdk(bytes),
                "{}",
                String::from_utf8_lossy(bytes)
            );
        }
    }

    #[test]
    fn unusual_shapes_are_left_to_the_sdk() {
        let shapes: [&[u8]; 14] = [
            // serde_json's raw-value marker (the `raw_value` feature is on in the agent):
            // first at the top (the SDK fails), and inside data, where only the SDK's second
            // parse, in key order, sees it first.
            br#"{"$serde_json::private::RawValue":"0","specversion":"1.0","id":"1","source":"s","type":"t"}"#,
            br#"{"specversion":"1.0","id":"1","source":"s","type":"t","data":{"a":1,"$serde_json::private::RawValue":"2"}}"#,
            br#"{"specversion":"1.0","id":"1","source":"s","type":"t","data":{"a":1,"\u0024serde_json::private::RawValue":"2"}}"#,
            // A key twice (the SDK keeps the last), an attribute spelled with an escape.
            br#"{"specversion":"1.0","id":"1","source":"s","type":"t","x":"a","x":"b"}"#,
            br#"{"specversion":"1.0","\u0069d":"1","source":"s","type":"t"}"#,
            br#"{"specversion":"1.0","id":"1","source":"s","type":"t","x":-0}"#,
            br#"{"specversion":"0.3","id":"1","source":"s","type":"t"}"#,
            br#"{"specversion":"1.0","id":"1","source":"","type":"t"}"#,
            br#"{"specversion":"1.0","id":"1","id":"2","source":"s","type":"t"}"#,
            br#"{"specversion":"1.0","id":"1","source":"s","type":"t","subject":null}"#,
            br#"{"specversion":"1.0","id":"1","source":"s","type":"t","x":1.5}"#,
            br#"{"specversion":"1.0","id":"1","source":"s","type":"t","data_base64":"aGVsbG8="}"#,
            br#"{"specversion":"1.0","id":"1","source":"s","type":"t","time":"yesterday"}"#,
            br#"{"specversion":"1.0","id":"1","source":"s","type":"t","datacontenttype":"text/plain","data":{"a":1}}"#,
        ];
        for bytes in shapes {
            assert!(
                super::super::decode::fast_path(bytes).is_none(),
                "{}",
                String::from_utf8_lossy(bytes)
            );
            assert_eq!(by_the_fast_path(bytes), by_the_sdk(bytes));
        }
    }

    #[test]
    fn an_event_with_both_data_and_data_base64_is_refused_either_way() {
        let bytes = br#"{"specversion":"1.0","id":"1","source":"s","type":"t","datacontenttype":"application/json","data":{"a":1},"data_base64":"eyJhIjoxfQ=="}"#;
        assert!(by_the_sdk(bytes).is_none());
        assert!(Event::from_json_slice(bytes).is_err());
    }

    #[test]
    fn every_event_this_agent_makes_decodes_the_same_either_way() {
        let before = document(json!({"DocumentIncarnation": 1, "Events": []}));
        let after = document(json!({"DocumentIncarnation": 2, "Events": [{
            "EventId": "E1", "EventType": "Freeze", "ResourceType": "VirtualMachine",
            "Resources": ["WestNO_0", "WestNO_1"], "EventStatus": "Scheduled",
            "NotBefore": "Mon, 11 Apr 2022 22:26:58 GMT", "Description": "Live migration",
            "EventSource": "Platform", "DurationInSeconds": 5}]}));
        let observation = Observation::at(Utc::now());
        let mut events = events_observed(&factory(), Some(&before), &after, false, &observation);
        events.extend(events_for_document(
            &factory(),
            Some(&before),
            &after,
            true,
            Utc::now(),
        ));
        assert!(events.len() >= 2, "a scheduled event and the document");
        for event in events {
            let bytes = serde_json::to_vec(&event).unwrap();
            let decoded = Event::from_json_slice(&bytes).unwrap();
            assert_eq!(decoded, event);
            // And without the SDK's slow path: this is what every backlog reads back.
            assert_eq!(
                super::super::decode::fast_path(&bytes).as_ref(),
                Some(&event),
                "{}",
                String::from_utf8_lossy(&bytes)
            );
            assert_eq!(Some(decoded), by_the_sdk(&bytes));
        }
    }
}
