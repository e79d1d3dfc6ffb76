//! Approving through ARM: the event starts on every VM that lists it, or a 404.

use serde_json::json;

use super::*;

#[tokio::test]
async fn simulator_arm_acknowledge_through_the_scale_set_starts_the_event_on_every_vm_listing_it() {
    let shared = reboot("H", &["web_0", "web_1"], "15m", "10m");
    let fleet = fleet(
        &[web(0, &shared), web(1, &shared), web(2, "")],
        ArmOptions::default(),
    )
    .await;
    let token = fleet.token().await;
    let wrong = fleet
        .post(
            &acknowledge_path("virtualMachineScaleSets/web", "H", "api-version=2024-07-01"),
            &token,
        )
        .await;
    assert_eq!(
        (wrong.status, wrong.code()),
        (400, "InvalidApiVersionParameter")
    );
    assert!(
        wrong.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("2023-10-01-preview")
    );
    let path = acknowledge_path("virtualMachineScaleSets/WEB", "H", ACK_VERSION);
    let answer = fleet.post(&path, &token).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.body, json!({"value": "Successfully Approved"}));
    assert!(
        !answer
            .header("x-ms-ratelimit-remaining-subscription-writes")
            .is_empty()
    );
    for vm in [0, 1] {
        let state = fleet.sim_state(vm).await;
        assert_eq!(
            state.phases,
            [("H".to_owned(), crate::simulator::Phase::Started)]
        );
        assert!(state.down[0].approved, "vm {vm}: {state:?}");
    }
    assert!(fleet.sim_state(2).await.down.is_empty());
    let again = fleet.post(&path, &token).await;
    assert_eq!(
        again.status, 200,
        "an event already started: {}",
        again.body
    );
    fleet.stop().await;
}

#[tokio::test]
async fn simulator_arm_acknowledging_an_event_unknown_to_the_resource_is_404() {
    let d = reboot("D", &["db-1"], "15m", "10m");
    // web_0's document shows D too (as a document shows its neighbours' events), and C,
    // which Azure cancelled at once.
    let cancelled =
        "[[events]]\nid = 'C'\ntype = 'Reboot'\nresources = ['web_0']\ncancel_after = '1ms'\n";
    let fleet = fleet(
        &[
            web(0, &format!("{d}{cancelled}")),
            standalone("db-1", "", &d),
        ],
        ArmOptions::default(),
    )
    .await;
    let token = fleet.token().await;
    let never = fleet
        .post(
            &acknowledge_path("virtualMachineScaleSets/web", "nope", ACK_VERSION),
            &token,
        )
        .await;
    assert_eq!((never.status, never.code()), (404, "NotFound"));
    let gone = fleet
        .post(
            &acknowledge_path("virtualMachineScaleSets/web", "C", ACK_VERSION),
            &token,
        )
        .await;
    assert_eq!((gone.status, gone.code()), (404, "NotFound"));
    // D is in the document of a VM of the scale set, but lists none of them.
    let elsewhere = fleet
        .post(
            &acknowledge_path("virtualMachineScaleSets/web", "D", ACK_VERSION),
            &token,
        )
        .await;
    assert_eq!((elsewhere.status, elsewhere.code()), (404, "NotFound"));
    assert_eq!(
        fleet.sim_state(1).await.phases[0].1,
        crate::simulator::Phase::Scheduled
    );
    let no_set = fleet
        .post(
            &acknowledge_path("virtualMachineScaleSets/api", "D", ACK_VERSION),
            &token,
        )
        .await;
    assert_eq!((no_set.status, no_set.code()), (404, "ResourceNotFound"));
    let direct = fleet
        .post(
            &acknowledge_path("virtualMachines/db-1", "d", ACK_VERSION),
            &token,
        )
        .await;
    assert_eq!(direct.status, 200, "{}", direct.body);
    fleet.stop().await;
}
