//! Unit tests of the simulator's state machine (appearance, start, cancellation, field
//! filtering by api-version) and of the strict parsing of approval bodies.

use std::time::Duration;

use serde_json::json;

use super::server::start_requests;
use super::state::{Released, State};
use super::{FleetError, Scenario, Simulator};

fn scenario(text: &str) -> Scenario {
    Scenario::from_toml(text).unwrap()
}

const FREEZE: &str = r#"
    [[events]]
    id = "E1"
    type = "Freeze"
    resources = ["WestNO_0"]
    appear_after = "10s"
    notice = "15m"
    started_for = "1m"
    duration_in_seconds = 5
    source = "User"
    description = "Live migration"
"#;

#[test]
fn an_event_appears_starts_at_not_before_and_disappears() {
    let mut state = State::new(scenario(FREEZE));
    let t0 = state.started;
    state.advance(t0);
    assert_eq!(state.incarnation, 1);
    assert_eq!(state.document("2020-07-01")["Events"], json!([]));
    state.advance(t0 + Duration::from_secs(10));
    assert_eq!(state.incarnation, 2);
    assert_eq!(
        state.document("2020-07-01")["Events"][0]["EventStatus"],
        "Scheduled"
    );
    state.advance(t0 + Duration::from_secs(11));
    assert_eq!(state.incarnation, 2, "nothing changed, same incarnation");
    state.advance(t0 + Duration::from_secs(10 + 900));
    let document = state.document("2020-07-01");
    assert_eq!(document["Events"][0]["EventStatus"], "Started");
    assert_eq!(document["Events"][0]["NotBefore"], "");
    state.advance(t0 + Duration::from_secs(10 + 900 + 60));
    assert_eq!(state.document("2020-07-01")["Events"], json!([]));
    assert_eq!(state.incarnation, 4);
}

#[test]
fn fields_are_filtered_by_api_version() {
    let mut state = State::new(scenario(FREEZE));
    state.advance(state.started + Duration::from_secs(10));
    let newest = &state.document("2020-07-01")["Events"][0];
    assert_eq!(newest["DurationInSeconds"], 5);
    assert_eq!(newest["EventSource"], "User");
    assert_eq!(newest["Description"], "Live migration");
    let old = &state.document("2019-04-01")["Events"][0];
    assert!(old.get("DurationInSeconds").is_none() && old.get("EventSource").is_none());
    assert_eq!(old["Description"], "Live migration");
    let oldest = &state.document("2017-08-01")["Events"][0];
    assert!(oldest.get("Description").is_none());
    let preview = &state.document("2017-03-01")["Events"][0];
    assert_eq!(preview["Resources"], json!(["_WestNO_0"]));
    assert!(
        sched_relay_core::document::parse_not_before(preview["NotBefore"].as_str().unwrap())
            .is_some()
    );
}

#[test]
fn preempt_and_terminate_are_hidden_from_versions_that_predate_them() {
    let mut state = State::new(scenario(
        "[[events]]\nid='p'\ntype='Preempt'\nresources=['a']\n[[events]]\nid='t'\ntype='Terminate'\nresources=['a']\n",
    ));
    state.advance(state.started);
    let count = |v: &str| state.document(v)["Events"].as_array().unwrap().len();
    assert_eq!(count("2017-08-01"), 0);
    assert_eq!(count("2017-11-01"), 1);
    assert_eq!(count("2019-01-01"), 2);
}

#[test]
fn a_cancelled_event_disappears_without_starting() {
    let mut state = State::new(scenario(
        "[[events]]\nid='c'\ntype='Reboot'\nresources=['a']\ncancel_after='5m'\n[[events.updates]]\nafter='1m'\nnotice='20m'\n",
    ));
    let t0 = state.started;
    state.advance(t0);
    let first = state.document("2020-07-01")["Events"][0]["NotBefore"].clone();
    state.advance(t0 + Duration::from_secs(60));
    assert_ne!(
        state.document("2020-07-01")["Events"][0]["NotBefore"],
        first
    );
    state.advance(t0 + Duration::from_secs(300));
    assert_eq!(state.document("2020-07-01")["Events"], json!([]));
    assert_eq!(state.incarnation, 4);
}

#[test]
fn start_requests_are_parsed_strictly() {
    assert_eq!(
        start_requests(br#"{"StartRequests": [{"EventId": "a"}, {"EventId": "b"}]}"#).unwrap(),
        ["a", "b"]
    );
    for bad in [
        &b"nope"[..],
        br#"{}"#,
        br#"{"StartRequests": []}"#,
        br#"{"StartRequests": [{"Id": "a"}]}"#,
    ] {
        assert!(
            start_requests(bad).is_err(),
            "{}",
            String::from_utf8_lossy(bad)
        );
    }
}

/// One Azure event in the documents of two VMs (a host-level Reboot listing both).
fn shared_reboot(vm: &str, notice: &str) -> Scenario {
    scenario(&format!(
        "[vm]\nname = '{vm}'\n[[events]]\nid = 'H'\ntype = 'Reboot'\nresources = ['vm-a', 'vm-b']\nappear_after = '1s'\nnotice = '{notice}'\nstarted_for = '1m'\n"
    ))
}

#[test]
fn an_event_listing_several_vms_started_by_one_of_them_is_started_on_every_vm() {
    let (t0, wall, released) = (
        std::time::Instant::now(),
        chrono::Utc::now(),
        Released::default(),
    );
    let mut a = State::in_fleet(shared_reboot("vm-a", "15m"), t0, wall, released.clone());
    let mut b = State::in_fleet(shared_reboot("vm-b", "15m"), t0, wall, released);
    let status = |state: &State| state.document("2020-07-01")["Events"][0]["EventStatus"].clone();
    let approved_at = t0 + Duration::from_secs(5);
    a.advance(approved_at);
    b.advance(approved_at);
    assert_eq!(
        (status(&a), status(&b)),
        (json!("Scheduled"), json!("Scheduled"))
    );
    a.approve(&["H".to_owned()], approved_at);
    let before = b.incarnation;
    b.advance(approved_at + Duration::from_millis(1));
    assert_eq!(
        b.incarnation,
        before + 1,
        "a new document on the other VM too"
    );
    assert_eq!(
        status(&b),
        "Started",
        "one StartRequest releases every VM the event lists"
    );
    a.advance(approved_at + Duration::from_millis(1));
    assert_eq!(status(&a), "Started");
    // Both end together: started at the approval, not when each VM next looked.
    a.advance(approved_at + Duration::from_secs(61));
    b.advance(approved_at + Duration::from_secs(61));
    assert_eq!(a.document("2020-07-01")["Events"], json!([]));
    assert_eq!(b.document("2020-07-01")["Events"], json!([]));
}

#[test]
fn vms_of_separate_simulators_do_not_share_approvals() {
    let mut a = State::new(shared_reboot("vm-a", "15m"));
    let mut b = State::new(shared_reboot("vm-b", "15m"));
    let later = a.started.max(b.started) + Duration::from_secs(5);
    a.advance(later);
    a.approve(&["H".to_owned()], later);
    b.advance(later + Duration::from_millis(1));
    assert_eq!(
        b.document("2020-07-01")["Events"][0]["EventStatus"],
        "Scheduled"
    );
}

#[tokio::test]
async fn a_fleet_whose_shared_event_differs_between_vms_is_refused_with_both_names() {
    let listen = "127.0.0.1:0".parse().unwrap();
    let error = Simulator::start_fleet(
        vec![shared_reboot("vm-a", "15m"), shared_reboot("vm-b", "10m")],
        listen,
    )
    .await
    .err()
    .expect("refused");
    assert!(
        matches!(&error, FleetError::SharedEventDiffers { id, first, second } if id == "H" && first == "vm-a" && second == "vm-b"),
        "{error}"
    );
    // The same offsets at another time scale are other instants.
    let mut faster = shared_reboot("vm-b", "15m");
    faster.time_scale = 0.5;
    let error = Simulator::start_fleet(vec![shared_reboot("vm-a", "15m"), faster], listen)
        .await
        .err()
        .expect("refused");
    assert!(
        matches!(&error, FleetError::SharedEventDiffers { id, .. } if id == "H"),
        "{error}"
    );
    let fleet = Simulator::start_fleet(
        vec![shared_reboot("vm-a", "15m"), shared_reboot("vm-b", "15m")],
        listen,
    )
    .await
    .unwrap();
    assert_eq!(fleet.len(), 2);
    assert_ne!(fleet[0].addr(), fleet[1].addr(), "each VM on its own port");
    for simulator in fleet {
        simulator.stop().await;
    }
}
