use super::*;
use serde_json::json;

fn event(ty: &str, vm: &str, id: &str, extra: Value) -> Value {
    let mut event = json!({
        "specversion": "1.0", "type": format!("com.azure.scheduledevents.{ty}"),
        "vmname": vm, "subject": id, "time": "2026-11-21T10:00:00Z",
    });
    for (k, v) in extra.as_object().unwrap() {
        event[k] = v.clone();
    }
    event
}

#[test]
fn the_table_follows_each_events_transitions_and_approval() {
    let mut fleet = Fleet::default();
    fleet.apply(&event(
        "scheduled",
        "vm1",
        "E1",
        json!({
            "eventtype": "Reboot", "eventstatus": "Scheduled",
            "data": {"event": {"NotBefore": "Sat, 21 Nov 2026 10:15:00 GMT"}},
        }),
    ));
    fleet.apply(&event(
        "approval.rejected",
        "vm1",
        "E1",
        json!({"data": {"reason": "expired"}}),
    ));
    fleet.apply(&event(
        "scheduled",
        "vm2",
        "E2",
        json!({"eventtype": "Freeze", "eventstatus": "Scheduled"}),
    ));
    fleet.apply(&event(
        "approval.accepted",
        "vm2",
        "E2",
        json!({"data": {"reason": "policy"}}),
    ));
    fleet.apply(&event(
        "started",
        "vm2",
        "E2",
        json!({"eventtype": "Freeze", "eventstatus": "Started"}),
    ));
    fleet.apply(&event("document", "vm2", "3", json!({})));
    let now = DateTime::parse_from_rfc3339("2026-11-21T10:10:00Z")
        .unwrap()
        .with_timezone(&Utc);
    let table = fleet.render(now);
    let lines: Vec<&str> = table.lines().collect();
    assert!(lines[0].starts_with("VM"));
    assert!(
        lines[1].contains("vm1")
            && lines[1].contains("Reboot")
            && lines[1].contains("in 5m")
            && lines[1].contains("rejected: expired"),
        "{table}"
    );
    assert!(
        lines[2].contains("vm2") && lines[2].contains("Started") && lines[2].contains("accepted"),
        "{table}"
    );
    assert_eq!(lines[3], "2 event(s) on 2 VM(s)");
}

#[test]
fn hostile_fleet_strings_reach_the_terminal_escaped() {
    let mut fleet = Fleet::default();
    let hostile_vm = "vm\u{1b}]0;pwned\u{7}\u{1b}[2J\r\u{9b}31m\u{202e}gpj.exe";
    fleet.apply(&event(
        "scheduled",
        hostile_vm,
        "E1\u{1b}[1A\u{2067}",
        json!({"eventtype": "Reboot\u{85}\u{200f}", "eventstatus": "Scheduled\n\u{7f}"}),
    ));
    fleet.apply(&event(
        "approval.rejected",
        hostile_vm,
        "E1\u{1b}[1A\u{2067}",
        json!({"data": {"reason": "bad\u{1b}[31m\u{2066}"}}),
    ));
    let table = fleet.render(Utc::now());
    let hostile = |c: char| {
        (c.is_control() && c != '\n')
            || matches!(c, '\u{202A}'..='\u{202E}' | '\u{2066}'..='\u{2069}' | '\u{200E}' | '\u{200F}')
    };
    assert!(!table.contains(hostile), "{table:?}");
    // Escaped, not dropped: an operator sees that a name carries control characters.
    assert!(table.contains("vm\\u{1b}]0;pwned\\u{7}"), "{table}");
    assert!(table.contains("\\u{202e}gpj.exe"), "{table}");
    assert_eq!(table.lines().count(), 3, "one line per row: {table}");
    assert_eq!(printable("WestNO_0 ünïcode"), "WestNO_0 ünïcode");
}

#[test]
fn binary_mode_headers_and_structured_bodies_decode_alike() {
    let structured = json!({"specversion": "1.0", "type": "t", "subject": "E"});
    let from_body = Inbound {
        transport: "nats",
        channel: "c".into(),
        headers: Vec::new(),
        content_type: None,
        body: structured.to_string().into_bytes(),
        shared: true,
        route: None,
    };
    assert_eq!(decode(&from_body).unwrap()["subject"], "E");
    let binary = Inbound {
        headers: vec![
            ("ce_specversion".into(), "1.0".into()),
            ("ce_subject".into(), "E".into()),
        ],
        body: b"{\"x\":1}".to_vec(),
        ..from_body
    };
    let decoded = decode(&binary).unwrap();
    assert_eq!(decoded["subject"], "E");
    assert_eq!(decoded["data"]["x"], 1);
}

#[test]
fn heartbeats_and_documents_make_no_rows() {
    let mut fleet = Fleet::default();
    fleet.apply(&event(
        "heartbeat",
        "vm1",
        "heartbeat",
        json!({"incarnation": 3, "data": {"events": [
            {"EventId": "E1", "EventStatus": "Scheduled"}]}}),
    ));
    fleet.apply(&event("document", "vm1", "3", json!({"incarnation": 3})));
    assert!(fleet.rows.is_empty(), "{:?}", fleet.rows);
}

#[test]
fn another_producers_events_on_the_same_stream_stay_out_of_the_table() {
    let mut fleet = Fleet::default();
    let mut foreign = event(
        "scheduled",
        "vm1",
        "E1",
        json!({"eventtype": "Reboot", "eventstatus": "Scheduled"}),
    );
    for ty in [
        "com.example.backup.scheduled",
        "com.azure.scheduledevents.extra.scheduled",
        "xcom.azure.scheduledevents.scheduled",
        "scheduled",
    ] {
        foreign["type"] = json!(ty);
        fleet.apply(&foreign);
    }
    assert!(fleet.rows.is_empty(), "{:?}", fleet.rows);
    fleet.apply(&event(
        "scheduled",
        "vm1",
        "E1",
        json!({"eventtype": "Reboot", "eventstatus": "Scheduled"}),
    ));
    assert_eq!(fleet.rows.len(), 1);
}

#[test]
fn the_table_reads_the_agents_own_type_prefix() {
    let mut fleet = Fleet::new("org.example.maintenance");
    let mut ours = event(
        "scheduled",
        "vm1",
        "E1",
        json!({"eventtype": "Reboot", "eventstatus": "Scheduled"}),
    );
    fleet.apply(&ours);
    assert!(
        fleet.rows.is_empty(),
        "the default prefix is not this fleet's"
    );
    ours["type"] = json!("org.example.maintenance.scheduled");
    fleet.apply(&ours);
    assert_eq!(fleet.rows.len(), 1);
}
