//! Per-VM publish rights on NATS, as `deploy/nats/per-vm-permissions.conf` ships them
//! (docs/src/permissions.md), against a nats-server of the test's own: a VM's real agent,
//! restricted to its own subjects, publishes its events and takes its approvals; with the
//! same credentials it can neither publish another VM's events nor read another
//! VM's approvals. With the coordinator refusing a message whose subject does not name the
//! VM it speaks for, no agent can then report for another VM.

mod common;

use std::time::{Duration, Instant};

use common::{AgentProcess, SimProcess};
use sched_relay_core::approval::SigningKey;
use sched_relay_nats::testing::PrivateNats;

const CONF: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/deploy/nats/per-vm-permissions.conf"
);

/// A client with `user`'s credentials; a VM's with its own inbox, as the file asks.
async fn connect(url: &str, user: &str) -> async_nats::Client {
    let options = async_nats::ConnectOptions::with_user_and_password(
        user.into(),
        format!("change-me-{user}"),
    );
    let options = if user == "coordinator" {
        options
    } else {
        options.custom_inbox_prefix(format!("_INBOX_{user}"))
    };
    options.connect(url).await.unwrap()
}

/// The subjects of every message `stream` holds.
async fn subjects(js: &async_nats::jetstream::Context, stream: &str) -> Vec<String> {
    let mut stream = js.get_stream(stream).await.unwrap();
    let last = stream.info().await.unwrap().state.last_sequence;
    let mut subjects = Vec::new();
    for sequence in 1..=last {
        if let Ok(message) = stream.get_raw_message(sequence).await {
            subjects.push(message.subject.to_string());
        }
    }
    subjects
}

#[test]
fn an_agent_restricted_to_its_own_subjects_works_and_cannot_speak_or_listen_for_another_vm() {
    let Some(nats) = PrivateNats::start(&["-c", CONF]) else {
        return;
    };
    let url = nats.url();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // The operator creates both streams, as the file says.
    let admin = runtime.block_on(async {
        let js = async_nats::jetstream::new(connect(&url, "coordinator").await);
        for (name, subject) in [
            ("SCHEDULEDEVENTS", "scheduledevents.>"),
            ("SCHEDULEDAPPROVALS", "scheduledapprovals.>"),
        ] {
            js.create_stream(async_nats::jetstream::stream::Config {
                name: name.into(),
                subjects: vec![subject.into()],
                ..Default::default()
            })
            .await
            .unwrap();
        }
        js
    });
    // Before its agent ever ran, web-1's credentials cannot make its consumer with another
    // VM's filter (the agent would find it and take web-2's approvals for its own).
    runtime.block_on(async {
        let web1 = async_nats::jetstream::new(connect(&url, "web-1").await);
        let stream = web1.get_stream("SCHEDULEDAPPROVALS").await.unwrap();
        let misfiltered = stream
            .create_consumer(async_nats::jetstream::consumer::pull::Config {
                durable_name: Some("sched-relay-web-1".into()),
                filter_subject: "scheduledapprovals.web-2".into(),
                ..Default::default()
            })
            .await;
        assert!(
            misfiltered.is_err(),
            "web-1 made its consumer on web-2's approvals"
        );
    });
    let dir = tempfile::tempdir().unwrap();
    let scenario = dir.path().join("web-1.toml");
    std::fs::write(
        &scenario,
        "[vm]\nname = \"web-1\"\nresource_id = \"/subscriptions/s/resourceGroups/rg-web/providers/Microsoft.Compute/virtualMachines/web-1\"\n\n\
         [[events]]\nid = \"E1\"\ntype = \"Reboot\"\nresources = [\"web-1\"]\nappear_after = \"1s\"\nnotice = \"600s\"\n",
    )
    .unwrap();
    let sim = SimProcess::start(scenario.to_str().unwrap(), 1.0);
    let key_file = dir.path().join("coordinator.key");
    let key = SigningKey::generate_ed25519().unwrap();
    std::fs::write(&key_file, &key).unwrap();
    let public_key = SigningKey::parse(&key).unwrap().public_key().unwrap();
    let agent = AgentProcess::start_on_defaults(
        &sim.url,
        &format!(
            "[[sinks]]\nname = \"bus\"\nkind = \"nats\"\nurl = \"{url}\"\nuser = \"web-1\"\npassword = \"change-me-web-1\"\njetstream = true\ninbox_prefix = \"_INBOX_web-1\"\n\n\
             [approvals.nats]\nsink = \"bus\"\nstream = \"SCHEDULEDAPPROVALS\"\n\
             [[approvals.keys]]\nid = \"coordinator\"\nalgorithm = \"ed25519\"\npublic_key = \"{public_key}\"\n"
        ),
    );
    // Its own events arrive, under its own subjects only.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let seen = runtime.block_on(subjects(&admin, "SCHEDULEDEVENTS"));
        if seen.iter().any(|s| s == "scheduledevents.web-1.scheduled") {
            assert!(
                seen.iter().all(|s| s.starts_with("scheduledevents.web-1.")),
                "{seen:?}"
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no event from web-1: {seen:?}\n{}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(
        !agent.log().contains("Permissions Violation"),
        "{}",
        agent.log()
    );

    // With web-1's credentials, another VM's events cannot be published...
    runtime.block_on(async {
        let web1 = async_nats::jetstream::new(connect(&url, "web-1").await);
        let forged = async {
            web1.publish("scheduledevents.web-2.completed", "{}".into())
                .await?
                .await
        };
        let refused = tokio::time::timeout(Duration::from_secs(5), forged).await;
        assert!(
            !matches!(refused, Ok(Ok(_))),
            "web-1 published web-2's event"
        );
        assert!(
            !subjects(&admin, "SCHEDULEDEVENTS")
                .await
                .iter()
                .any(|s| s.contains("web-2")),
            "web-2's subject holds a message"
        );
        // ... nor another VM's approvals read.
        let stream = web1.get_stream("SCHEDULEDAPPROVALS").await.unwrap();
        let theirs = stream
            .get_or_create_consumer(
                "sched-relay-web-2",
                async_nats::jetstream::consumer::pull::Config {
                    durable_name: Some("sched-relay-web-2".into()),
                    filter_subject: "scheduledapprovals.web-2".into(),
                    ..Default::default()
                },
            )
            .await;
        assert!(
            theirs.is_err(),
            "web-1 made a consumer of web-2's approvals"
        );
        // ... not even under its own consumer's name, with another VM's filter.
        let renamed = stream
            .create_consumer(async_nats::jetstream::consumer::pull::Config {
                durable_name: Some("sched-relay-web-1-x".into()),
                filter_subject: "scheduledapprovals.web-2".into(),
                ..Default::default()
            })
            .await;
        assert!(renamed.is_err(), "web-1 made a second consumer");
    });

    // Nor can web-1 listen to other clients' replies (acknowledgements, deliveries): it may
    // subscribe only to its own inbox.
    let sniffed = runtime.block_on(async {
        let web1 = connect(&url, "web-1").await;
        let mut sniffers = Vec::new();
        for subject in ["_INBOX.>", "_INBOX_web-2.>", ">"] {
            sniffers.push(web1.subscribe(subject).await.unwrap());
        }
        web1.flush().await.unwrap();
        let web2 = async_nats::jetstream::new(connect(&url, "web-2").await);
        web2.publish("scheduledevents.web-2.document", "{}".into())
            .await
            .unwrap()
            .await
            .unwrap();
        let coordinator = async_nats::jetstream::new(connect(&url, "coordinator").await);
        coordinator
            .publish("scheduledapprovals.web-2", "{}".into())
            .await
            .unwrap()
            .await
            .unwrap();
        let mut all = futures_util::stream::select_all(sniffers);
        tokio::time::timeout(
            Duration::from_secs(2),
            futures_util::StreamExt::next(&mut all),
        )
        .await
        .ok()
        .flatten()
        .map(|message| message.subject.to_string())
    });
    assert_eq!(sniffed, None, "web-1 read another client's reply");

    // The coordinator's approval for web-1 reaches web-1's agent, which POSTs it.
    let request = common::fleet::signed_approval(&key_file, "coordinator", "web-1", "E1");
    runtime.block_on(async {
        let coordinator = async_nats::jetstream::new(connect(&url, "coordinator").await);
        coordinator
            .publish("scheduledapprovals.web-1", request.into())
            .await
            .unwrap()
            .await
            .unwrap();
    });
    common::fleet::wait_for_accepted_post(&sim, "E1", || agent.log());
}
