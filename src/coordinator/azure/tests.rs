//! The refresher against the simulator's Azure Resource Manager stand-in over real TCP,
//! with Microsoft's `azure_identity` getting its managed-identity token from the stand-in
//! (through `managed_identity_endpoint`): every source listed whole, pages followed, reads
//! batched, Azure's own approvals read, a throttled call waited out, a failing source said.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Notify, mpsc, watch};

use super::acknowledge::Acknowledger;
use super::{Acked, Acknowledge, AzureConfig, Credential, Snapshot, Source, refresh};
use crate::simulator::{ArmOptions, ArmRequest, ArmStandIn, Scenario, Simulator};

const SUB: &str = "0b1f6471-1bf0-4dda-aec3-111122223333";

fn vm(name: &str, id: &str, keys: &str) -> String {
    format!(
        "[vm]\nname = '{name}'\nresource_id = '/subscriptions/{SUB}/resourceGroups/{id}'\n{keys}\n"
    )
}

/// Five VMs of scale set `web` (Azure approves their user-initiated Reboots by itself); in
/// resource group `rg-db`, db1 and db2 in availability set `db-as`, db3 deallocated.
async fn fleet() -> (Vec<Simulator>, ArmStandIn) {
    let mut scenarios: Vec<String> = (0..5)
        .map(|n| {
            vm(
                &format!("web_{n}"),
                &format!("rg-web/providers/Microsoft.Compute/virtualMachineScaleSets/web/virtualMachines/{n}"),
                "[vm.scheduled_events_policy]\nuser_initiated_reboot_auto_approve = true",
            )
        })
        .collect();
    for (name, keys) in [
        ("db1", "availability_set = 'db-as'"),
        ("db2", "availability_set = 'db-as'"),
        ("db3", "power_state = 'deallocated'"),
    ] {
        scenarios.push(vm(
            name,
            &format!("rg-db/providers/Microsoft.Compute/virtualMachines/{name}"),
            keys,
        ));
    }
    let scenarios = scenarios
        .iter()
        .map(|t| Scenario::from_toml(t).unwrap())
        .collect();
    let listen = "127.0.0.1:0".parse().unwrap();
    let vms = Simulator::start_fleet(scenarios, listen).await.unwrap();
    let handles: Vec<&Simulator> = vms.iter().collect();
    let options = ArmOptions {
        page_size: 2,
        ..ArmOptions::default()
    };
    let arm = ArmStandIn::start(&handles, listen, options).await.unwrap();
    (vms, arm)
}

fn config(arm: &ArmStandIn) -> AzureConfig {
    let text = format!(
        "resource_manager = '{url}'\nmanaged_identity_endpoint = '{url}'\naudience = 'https://management.azure.com'\nrefresh = '1h'\ntimeout = '10s'\n",
        url = arm.url()
    );
    let config: AzureConfig = toml::from_str(&text).unwrap();
    assert_eq!(
        config.credential,
        Credential::ManagedIdentity,
        "the shipped default"
    );
    config
}

/// The ARM resource id of the stand-in's VM `db1`, which no test's event lists.
fn db1() -> String {
    format!(
        "/subscriptions/{SUB}/resourceGroups/rg-db/providers/Microsoft.Compute/virtualMachines/db1"
    )
}

fn sources(names: &[&str]) -> Vec<(usize, Source)> {
    names
        .iter()
        .enumerate()
        .map(|(index, path)| {
            (
                index,
                Source::parse(&format!("/subscriptions/{SUB}/resourceGroups/{path}")).unwrap(),
            )
        })
        .collect()
}

/// One refresh of `sources`: the refresher's first round.
async fn first_round(config: &AzureConfig, sources: Vec<(usize, Source)>) -> Snapshot {
    crate::install_crypto_provider();
    let (tx, mut rx) = mpsc::channel(1);
    let (stop, stopped) = watch::channel(false);
    refresh::start(config, sources, tx, Arc::new(Notify::new()), stopped).unwrap();
    let snapshot = tokio::time::timeout(Duration::from_secs(60), rx.recv())
        .await
        .expect("a round within a minute")
        .unwrap();
    let _ = stop.send(true);
    snapshot
}

fn calls<'a>(requests: &'a [ArmRequest], path_end: &str) -> Vec<&'a ArmRequest> {
    requests
        .iter()
        .filter(|r| r.path.ends_with(path_end))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_source_is_listed_whole_with_one_token_pages_followed_and_reads_batched() {
    let (_vms, arm) = fleet().await;
    let sources = sources(&[
        "rg-web/providers/Microsoft.Compute/virtualMachineScaleSets/web",
        "rg-db/providers/Microsoft.Compute/availabilitySets/db-as",
        "rg-db",
    ]);
    let snapshot = first_round(&config(&arm), sources).await;
    assert!(snapshot.complete(), "{:?}", snapshot.sources);
    let group_of = |name: &str| snapshot.vms.get(name).map(|vm| vm.group);
    for n in 0..5 {
        assert_eq!(group_of(&format!("web_{n}")), Some(0));
    }
    assert_eq!(
        (group_of("db1"), group_of("db2"), group_of("db3")),
        (Some(1), Some(1), Some(2))
    );
    assert_eq!(
        snapshot.vms["web_3"].down(false),
        None,
        "{:?}",
        snapshot.vms["web_3"]
    );
    assert_eq!(
        snapshot.vms["db1"].down(false),
        None,
        "{:?}",
        snapshot.vms["db1"]
    );
    assert_eq!(
        snapshot.vms["db3"].down(false).as_deref(),
        Some("Azure: power deallocated")
    );
    assert!(snapshot.sources[0].auto_approve.user_initiated_reboot);
    assert!(!snapshot.sources[2].auto_approve.user_initiated_reboot);

    let requests = arm.requests();
    assert!(
        requests.iter().all(|r| r.status == Some(200)),
        "{requests:#?}"
    );
    // One token (azure_identity caches it); five scale-set VMs over three pages of two; the
    // resource group's three VMs listed once (two pages) for two sources; the
    // subscription's states once (the same three VMs: two pages).
    assert_eq!(calls(&requests, "/oauth2/token").len(), 1, "{requests:#?}");
    assert_eq!(
        calls(&requests, "/virtualMachineScaleSets/web/virtualMachines").len(),
        3
    );
    assert_eq!(
        calls(
            &requests,
            "/resourceGroups/rg-db/providers/Microsoft.Compute/virtualMachines"
        )
        .len(),
        2
    );
    let states = calls(
        &requests,
        &format!("/subscriptions/{SUB}/providers/Microsoft.Compute/virtualMachines"),
    );
    assert_eq!(states.len(), 2, "{requests:#?}");
    assert!(
        states[0]
            .query
            .as_deref()
            .unwrap_or_default()
            .contains("statusOnly=true")
    );
    assert!(
        requests
            .iter()
            .filter(|r| r.path.starts_with("/subscriptions"))
            .all(|r| r.bearer_valid == Some(true))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_throttled_listing_is_tried_again_after_its_retry_after() {
    let (_vms, arm) = fleet().await;
    crate::install_crypto_provider();
    let throttled = reqwest::Client::new()
        .post(format!("{}/__arm/throttle", arm.url()))
        .header("content-type", "application/json")
        .body(r#"{"count": 1, "retry_after": 1}"#)
        .send()
        .await
        .unwrap();
    assert!(throttled.status().is_success());
    let started = std::time::Instant::now();
    let snapshot = first_round(&config(&arm), sources(&["rg-db"])).await;
    assert!(snapshot.complete(), "{:?}", snapshot.sources);
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "Retry-After not waited for"
    );
    let statuses: Vec<Option<u16>> = arm
        .requests()
        .iter()
        .filter(|r| r.path.starts_with("/subscriptions"))
        .map(|r| r.status)
        .collect();
    assert_eq!(statuses.first(), Some(&Some(429)), "{statuses:?}");
    assert_eq!(snapshot.vms.len(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_azure_does_not_know_is_said_and_keeps_the_inventory_incomplete() {
    let (_vms, arm) = fleet().await;
    let snapshot = first_round(
        &config(&arm),
        sources(&[
            "rg-web/providers/Microsoft.Compute/virtualMachineScaleSets/api",
            "rg-db",
        ]),
    )
    .await;
    assert!(!snapshot.complete());
    let error = snapshot.sources[0].error.clone().unwrap_or_default();
    assert!(
        error.contains("404") && error.contains("NotFound"),
        "{error}"
    );
    assert_eq!(snapshot.sources[1].error, None);
    assert_eq!(snapshot.vms.len(), 3, "the other source's VMs");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_for_another_audience_is_refused_and_said() {
    let (_vms, arm) = fleet().await;
    let mut config = config(&arm);
    config.audience = None;
    let snapshot = first_round(&config, sources(&["rg-db"])).await;
    let error = snapshot.sources[0].error.clone().unwrap_or_default();
    assert!(
        error.contains("401") && error.contains("InvalidAuthenticationTokenAudience"),
        "{error}"
    );
}

/// `POST /__arm/fail` with `body`.
async fn fail(arm: &ArmStandIn, body: &str) {
    let answer = reqwest::Client::new()
        .post(format!("{}/__arm/fail", arm.url()))
        .body(body.to_owned())
        .send()
        .await
        .unwrap();
    assert!(answer.status().is_success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_of_arm_costs_one_acknowledgement_per_wait_however_many_events_wait() {
    let (_vms, arm) = fleet().await;
    crate::install_crypto_provider();
    let acknowledger = Arc::new(Acknowledger::new(&config(&arm)).unwrap());
    // An outage whose failures take their time, as a gateway's timeouts do: while one is
    // on its way, every other event is tried again.
    fail(&arm, r#"{"count": 1000, "status": 503, "delay_ms": 500}"#).await;
    // Ten events, each tried again every 100 ms (the engine: every 2 s) until ARM answers
    // it: 404 here, as no VM has these events.
    let scope = db1();
    let tasks: Vec<_> = (0..10)
        .map(|n| {
            let (acknowledger, scope) = (acknowledger.clone(), scope.clone());
            tokio::spawn(async move {
                loop {
                    match acknowledger
                        .acknowledge(&scope, &format!("E{n}"), "r")
                        .await
                    {
                        Acked::Refused { .. } => return,
                        Acked::Held(_) | Acked::Failed(_) => {
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                        Acked::Approved => panic!("no VM has E{n}"),
                    }
                }
            })
        })
        .collect();
    // ARM comes back once the first probe has failed (after 2 s), so the second probe
    // (4 s later) is answered.
    let acknowledgements = || {
        let calls: Vec<(u64, u16)> = arm
            .requests()
            .iter()
            .filter(|r| r.path.ends_with("/acknowledge"))
            .map(|r| (r.at_ms, r.status.unwrap_or_default()))
            .collect();
        // Recorded as answered (each after its delay): the first to arrive is the least.
        let start = calls.iter().map(|(ms, _)| *ms).min().unwrap_or_default();
        (calls, start)
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (calls, start) = acknowledgements();
        // The probe: no sooner than the first failure's delay and wait (2.5 s).
        if calls.iter().any(|(ms, s)| *s == 503 && ms - start >= 2000) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "no probe: {calls:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    fail(&arm, r#"{"count": 0, "status": 503}"#).await;
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(30), task)
            .await
            .expect("every event answered once ARM is back")
            .unwrap();
    }
    let (calls, start) = acknowledgements();
    let at = |from: u64, to: u64, status: u16| {
        calls
            .iter()
            .filter(|(ms, s)| *s == status && (from..to).contains(&(ms - start)))
            .count()
    };
    // The outage's start: those sent before the first failure came back.
    assert!(at(0, 1000, 503) >= 1, "{calls:?}");
    // Then one probe after the first wait (2 s), one after the second (4 s more): ARM's
    // answer to it lets every other event go.
    assert_eq!(at(1000, 5500, 503), 1, "one probe after 2 s: {calls:?}");
    assert_eq!(at(0, 5500, 404), 0, "{calls:?}");
    assert_eq!(at(5500, u64::MAX, 404), 10, "{calls:?}");
    assert_eq!(calls.len(), at(0, 1000, 503) + 11, "{calls:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conflict_on_one_event_holds_back_none_of_the_subscriptions_other_events() {
    let (_vms, arm) = fleet().await;
    crate::install_crypto_provider();
    let acknowledger = Acknowledger::new(&config(&arm)).unwrap();
    let scope = db1();
    let unknown =
        |acked: &Acked| matches!(acked, Acked::Refused { reason, .. } if reason == "unknown_event");
    // Another operation on E1 (a 409): E1's own failure, tried again on the engine's tick.
    fail(&arm, r#"{"count": 1, "status": 409}"#).await;
    let first = acknowledger.acknowledge(&scope, "E1", "r1").await;
    assert!(
        matches!(&first, Acked::Failed(why) if why.contains("Conflict")),
        "{first:?}"
    );
    // The subscription's next events are sent at once, together (a shared failure would
    // hold them for 2 s, a probe all but one), and ARM answers them: no VM has them.
    let (second, third) = tokio::join!(
        acknowledger.acknowledge(&scope, "E2", "r2"),
        acknowledger.acknowledge(&scope, "E3", "r3")
    );
    assert!(unknown(&second) && unknown(&third), "{second:?} {third:?}");
    // A 409 that answers a probe (after a server error and its 2 s wait) frees the probe's
    // place at once: the next acknowledgement goes, rather than waiting out the probe's
    // patience (2 x timeout + 60 s).
    fail(&arm, r#"{"count": 1, "status": 503}"#).await;
    let failed = acknowledger.acknowledge(&scope, "E4", "r4").await;
    assert!(
        matches!(&failed, Acked::Failed(why) if why.contains("503")),
        "{failed:?}"
    );
    tokio::time::sleep(Duration::from_millis(2100)).await;
    fail(&arm, r#"{"count": 1, "status": 409}"#).await;
    let probe = acknowledger.acknowledge(&scope, "E5", "r5").await;
    assert!(
        matches!(&probe, Acked::Failed(why) if why.contains("Conflict")),
        "{probe:?}"
    );
    let next = acknowledger.acknowledge(&scope, "E6", "r6").await;
    assert!(unknown(&next), "{next:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_identity_endpoint_that_never_answers_costs_an_acknowledgement_one_timeout() {
    // Accepts every connection and answers none: a hung IMDS identity endpoint.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", silent.local_addr().unwrap());
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = silent.accept().await {
            held.push(socket);
        }
    });
    let config: AzureConfig = toml::from_str(&format!(
        "resource_manager = '{url}'\nmanaged_identity_endpoint = '{url}'\naudience = 'https://management.azure.com'\ntimeout = '1s'\n"
    ))
    .unwrap();
    crate::install_crypto_provider();
    let acknowledger = Acknowledger::new(&config).unwrap();
    let scope = db1();
    // azure_core alone would try the token again with back-off for a minute and more, and
    // the acknowledger's probe would outlive its patience.
    let acked = tokio::time::timeout(
        Duration::from_secs(4),
        acknowledger.acknowledge(&scope, "E1", "r1"),
    )
    .await
    .expect("the token's fetch is bounded by [azure] timeout");
    // The bound's own words, with `timeout`: not azure_core giving up by itself.
    match acked {
        Acked::Failed(why) => assert!(
            why.contains("no token") && why.contains("within 1s"),
            "{why}"
        ),
        other => panic!("{other:?}"),
    }
}

/// A fake ARM, for answers the stand-in cannot be asked for: each request's first line is
/// recorded, and `answer` gives the bytes written back (then the connection closes).
async fn fake_arm(answer: fn(&str) -> &'static [u8]) -> (String, Arc<Mutex<Vec<String>>>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    crate::install_crypto_provider();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let mut request = Vec::new();
            let mut buffer = [0u8; 4096];
            while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                match socket.read(&mut buffer).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => request.extend_from_slice(&buffer[..n]),
                }
            }
            let text = String::from_utf8_lossy(&request);
            let line = text.lines().next().unwrap_or_default().to_owned();
            record.lock().unwrap().push(line.clone());
            let _ = socket.write_all(answer(&line)).await;
        }
    });
    (url, seen)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_whose_answer_loses_its_body_is_still_an_approval() {
    let (_vms, arm) = fleet().await;
    // Every call is answered 200, then the connection closes 40 bytes into the body.
    let (url, _) = fake_arm(|_| b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"properties\": {\"status\": \"Acknowledged\"").await;
    let mut config = config(&arm);
    config.resource_manager = url;
    let acknowledger = Acknowledger::new(&config).unwrap();
    let scope = db1();
    // ARM acted on it: trying it again would be refused (the event started), and counting
    // it a failure would hold back the subscription's other acknowledgements.
    let acked = acknowledger.acknowledge(&scope, "E1", "r1").await;
    assert_eq!(acked, Acked::Approved);
}

/// ARM never redirects an acknowledgement: a redirect (a proxy's, a misconfigured
/// `resource_manager`) is not followed, since a POST followed as a GET to a page that
/// answers 200 would count as an approval ARM never made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acknowledgement_answered_with_a_redirect_is_not_an_approval() {
    let (_vms, arm) = fleet().await;
    let (url, seen) = fake_arm(|line| {
        if line.starts_with("POST") {
            b"HTTP/1.1 303 See Other\r\nlocation: /elsewhere\r\ncontent-length: 0\r\n\r\n"
        } else {
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
        }
    })
    .await;
    let mut config = config(&arm);
    config.resource_manager = url;
    let acknowledger = Acknowledger::new(&config).unwrap();
    let acked = acknowledger.acknowledge(&db1(), "E1", "r1").await;
    match acked {
        Acked::Failed(why) => assert!(why.contains("303"), "{why}"),
        other => panic!("{other:?}"),
    }
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 1, "{seen:?}");
}
