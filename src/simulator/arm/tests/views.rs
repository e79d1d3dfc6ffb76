//! What ARM shows of the fleet: pages, power states through an event's life, deletions,
//! policies, availability sets, and the fleets it refuses to show.

use std::time::{Duration, Instant};

use serde_json::json;

use super::*;
use crate::simulator::{Scenario, Simulator};

#[tokio::test]
async fn simulator_arm_five_scale_set_vms_are_listed_over_three_pages_by_following_next_link() {
    let scenarios: Vec<String> = (0..5).map(|n| web(n, "")).collect();
    let options = ArmOptions {
        page_size: 2,
        ..ArmOptions::default()
    };
    let fleet = fleet(&scenarios, options).await;
    let token = fleet.token().await;
    // ARM's keywords and names in any case.
    let mut next = Some(format!(
        "/subscriptions/{SUB}/resourcegroups/RG/providers/microsoft.compute/virtualmachinescalesets/WEB/virtualMachines?{VERSION}&$expand=instanceView"
    ));
    let (mut pages, mut names) = (0, Vec::new());
    while let Some(target) = next {
        let page = fleet.get(&target, Some(&token)).await;
        assert_eq!(page.status, 200, "{}", page.body);
        assert!(
            !page
                .header("x-ms-ratelimit-remaining-subscription-reads")
                .is_empty()
        );
        for vm in page.body["value"].as_array().unwrap() {
            assert_eq!(
                vm["type"],
                "Microsoft.Compute/virtualMachineScaleSets/virtualMachines"
            );
            assert_eq!(vm["properties"]["osProfile"]["computerName"], vm["name"]);
            assert_eq!(
                codes(&vm["properties"]["instanceView"]),
                ["ProvisioningState/succeeded", "PowerState/running"]
            );
            names.push(vm["name"].as_str().unwrap().to_owned());
            assert!(
                vm["id"]
                    .as_str()
                    .unwrap()
                    .ends_with(vm["instanceId"].as_str().unwrap())
            );
        }
        next = page.body["nextLink"].as_str().map(str::to_owned);
        if let Some(link) = &next {
            assert!(
                link.starts_with("http://") && link.contains("$skiptoken="),
                "{link}"
            );
        }
        pages += 1;
    }
    assert_eq!(pages, 3);
    assert_eq!(names, ["web_0", "web_1", "web_2", "web_3", "web_4"]);
    let unknown = fleet
        .get(&format!("/subscriptions/{SUB}/resourceGroups/rg/providers/Microsoft.Compute/virtualMachineScaleSets/api/virtualMachines?{VERSION}"), Some(&token))
        .await;
    assert_eq!((unknown.status, unknown.code()), (404, "ResourceNotFound"));
    fleet.stop().await;
}

#[tokio::test]
async fn simulator_arm_power_state_is_starting_while_a_reboot_holds_the_vm_and_running_after() {
    let fleet = fleet(
        &[standalone(
            "db-1",
            "",
            &reboot("R", &["db-1"], "1500ms", "1500ms"),
        )],
        ArmOptions::default(),
    )
    .await;
    let token = fleet.token().await;
    let path = format!(
        "/subscriptions/{SUB}/providers/Microsoft.Compute/virtualMachines?{VERSION}&statusOnly=true"
    );
    let statuses = || async {
        let answer = fleet.get(&path, Some(&token)).await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        codes(&answer.body["value"][0]["properties"]["instanceView"])
    };
    let (running, updating) = (
        ["ProvisioningState/succeeded", "PowerState/running"],
        ["ProvisioningState/updating", "PowerState/starting"],
    );
    assert_eq!(statuses().await, running, "scheduled, not started yet");
    let deadline = Instant::now() + Duration::from_secs(10);
    while statuses().await != updating {
        assert!(Instant::now() < deadline, "never seen starting");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(fleet.sim_state(0).await.down[0].until_us, None, "held down");
    let one = format!(
        "/subscriptions/{SUB}/resourceGroups/rg/providers/Microsoft.Compute/virtualMachines/DB-1?{VERSION}"
    );
    let model = fleet.get(&one, Some(&token)).await;
    assert_eq!(model.body["properties"]["provisioningState"], "Updating");
    while statuses().await != running {
        assert!(Instant::now() < deadline, "never back to running");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(fleet.sim_state(0).await.down[0].until_us.is_some());
    fleet.stop().await;
}

#[tokio::test]
async fn simulator_arm_a_started_terminate_removes_the_vm_from_every_listing() {
    let terminate =
        "[[events]]\nid = 'T'\ntype = 'Terminate'\nresources = ['web_1']\nstatus = 'Started'\n";
    let fleet = fleet(&[web(0, ""), web(1, terminate)], ArmOptions::default()).await;
    let token = fleet.token().await;
    let list = fleet
        .get(
            &format!("{}?{VERSION}", scale_set_path("/virtualMachines")),
            Some(&token),
        )
        .await;
    let names: Vec<&str> = list.body["value"]
        .as_array()
        .unwrap()
        .iter()
        .map(|vm| vm["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["web_0"]);
    let gone = fleet
        .get(
            &format!("{}?{VERSION}", scale_set_path("/virtualMachines/1")),
            Some(&token),
        )
        .await;
    assert_eq!((gone.status, gone.code()), (404, "ResourceNotFound"));
    let set = fleet
        .get(&format!("{}?{VERSION}", scale_set_path("")), Some(&token))
        .await;
    assert_eq!(set.body["sku"]["capacity"], 1);
    fleet.stop().await;
}

const POLICY: &str = "[vm.scheduled_events_policy]\nuser_initiated_reboot_auto_approve = true\nall_instances_down_auto_approve = false\n";

#[tokio::test]
async fn simulator_arm_the_scale_sets_policy_appears_on_the_scale_set() {
    let fleet = fleet(
        &[
            web(0, POLICY),
            web(1, POLICY),
            standalone("db-1", "", POLICY),
        ],
        ArmOptions::default(),
    )
    .await;
    let token = fleet.token().await;
    let set = fleet
        .get(&format!("{}?{VERSION}", scale_set_path("")), Some(&token))
        .await;
    assert_eq!(set.status, 200, "{}", set.body);
    let expected = json!({
        "userInitiatedReboot": {"automaticallyApprove": true},
        "allInstancesDown": {"automaticallyApprove": false},
    });
    assert_eq!(set.body["properties"]["scheduledEventsPolicy"], expected);
    assert_eq!(
        set.body["type"],
        "Microsoft.Compute/virtualMachineScaleSets"
    );
    let vm = fleet
        .get(&format!("/subscriptions/{SUB}/resourceGroups/rg/providers/Microsoft.Compute/virtualMachines/db-1?{VERSION}"), Some(&token))
        .await;
    assert_eq!(vm.body["properties"]["scheduledEventsPolicy"], expected);
    fleet.stop().await;
}

#[tokio::test]
async fn simulator_arm_an_availability_set_lists_its_vms() {
    let fleet = fleet(
        &[
            standalone("db-1", "availability_set = 'dbset'", ""),
            standalone("db-2", "availability_set = 'DBSet'", ""),
            standalone("app-1", "power_state = 'deallocated'", ""),
        ],
        ArmOptions::default(),
    )
    .await;
    let token = fleet.token().await;
    let set = fleet
        .get(&format!("/subscriptions/{SUB}/resourceGroups/rg/providers/Microsoft.Compute/availabilitySets/DBSET?{VERSION}"), Some(&token))
        .await;
    assert_eq!(set.status, 200, "{}", set.body);
    let ids: Vec<String> = set.body["properties"]["virtualMachines"]
        .as_array()
        .unwrap()
        .iter()
        .map(|vm| vm["id"].as_str().unwrap().to_ascii_lowercase())
        .collect();
    assert_eq!(ids.len(), 2);
    assert!(ids[0].ends_with("/virtualmachines/db-1") && ids[1].ends_with("/virtualmachines/db-2"));
    let group = fleet
        .get(&format!("/subscriptions/{SUB}/resourceGroups/rg/providers/Microsoft.Compute/virtualMachines?{VERSION}&$expand=instanceView"), Some(&token))
        .await;
    let vms = group.body["value"].as_array().unwrap();
    assert_eq!(vms.len(), 3);
    assert!(
        vms[0]["properties"]["availabilitySet"]["id"]
            .as_str()
            .unwrap()
            .eq_ignore_ascii_case(set.body["id"].as_str().unwrap())
    );
    assert!(vms[2]["properties"].get("availabilitySet").is_none());
    assert_eq!(
        codes(&vms[2]["properties"]["instanceView"])[1],
        "PowerState/deallocated"
    );
    fleet.stop().await;
}

#[tokio::test]
async fn simulator_arm_scale_set_vms_with_different_policies_refuse_the_start() {
    let scenarios = vec![
        Scenario::from_toml(&web(0, POLICY)).unwrap(),
        Scenario::from_toml(&web(1, "")).unwrap(),
    ];
    let listen = "127.0.0.1:0".parse().unwrap();
    let vms = Simulator::start_fleet(scenarios, listen).await.unwrap();
    let handles: Vec<&Simulator> = vms.iter().collect();
    let error = ArmStandIn::start(&handles, listen, ArmOptions::default())
        .await
        .err()
        .expect("refused");
    assert!(
        matches!(&error, ArmError::PoliciesDiffer { scale_set, first, second } if scale_set == "web" && first == "web_0" && second == "web_1"),
        "{error}"
    );
    for vm in vms {
        vm.stop().await;
    }
}
