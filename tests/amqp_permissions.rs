//! Per-VM rights on RabbitMQ, as `deploy/rabbitmq/per-vm-permissions.sh` sets them
//! (docs/src/permissions.md), on a vhost of the test's own: a VM's real agent, restricted
//! to its own routing keys and approvals queue, publishes its events and takes its approvals;
//! with the same credentials it can neither publish another VM's events, nor read, bind or
//! consume another VM's approvals, nor delete the exchanges every VM relies on.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::rabbit::Vhost;
use common::{AgentProcess, SimProcess};
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions,
    ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties, ExchangeKind};
use sched_relay_core::approval::SigningKey;

const SCRIPT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/deploy/rabbitmq/per-vm-permissions.sh"
);

/// A user restricted to `vm` by the shipped script; its password is its name.
fn user_for(broker: &mut Vhost, vm: &str) -> String {
    let user = format!("{}-{vm}", broker.name);
    broker.add_user(&user, &user);
    let script = Command::new("bash")
        .args([SCRIPT, vm, &user, &broker.name])
        .output()
        .unwrap();
    assert!(
        script.status.success(),
        "{}",
        String::from_utf8_lossy(&script.stderr)
    );
    user
}

fn url(broker: &Vhost, user: &str) -> String {
    let vhost = broker.name.replace('/', "%2f");
    format!("amqp://{user}:{user}@127.0.0.1:5672/{vhost}")
}

async fn channel(url: &str) -> lapin::Channel {
    let connection = Connection::connect(url, ConnectionProperties::default())
        .await
        .unwrap();
    // The connection lives as long as the channel is used: leaked, for a test.
    let channel = connection.create_channel().await.unwrap();
    std::mem::forget(connection);
    channel
}

/// Publishes with a broker confirmation: Ok only if the broker took it.
async fn publish(url: &str, exchange: &str, key: &str, body: &[u8]) -> Result<(), String> {
    let channel = channel(url).await;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(|e| e.to_string())?;
    let confirm = channel
        .basic_publish(
            exchange.into(),
            key.into(),
            BasicPublishOptions::default(),
            body,
            BasicProperties::default(),
        )
        .await
        .map_err(|e| e.to_string())?
        .await
        .map_err(|e| e.to_string())?;
    if confirm.is_ack() {
        Ok(())
    } else {
        Err(format!("{confirm:?}"))
    }
}

#[test]
fn an_agent_restricted_to_its_own_keys_and_queue_works_and_cannot_speak_or_listen_for_another_vm() {
    let Some(mut broker) = Vhost::start("sched-relay-permissions") else {
        return;
    };
    let web1 = user_for(&mut broker, "web-1");
    user_for(&mut broker, "web-2");
    let admin_url = url(&broker, "guest");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // The operator creates both exchanges, as the script says, and an audit queue of every
    // event; web-2's approvals queue exists too.
    let admin = runtime.block_on(async {
        let admin = channel(&admin_url).await;
        for exchange in ["scheduledevents", "scheduledevents.approvals"] {
            admin
                .exchange_declare(
                    exchange.into(),
                    ExchangeKind::Topic,
                    ExchangeDeclareOptions {
                        durable: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await
                .unwrap();
        }
        for (queue, exchange, key) in [
            ("audit", "scheduledevents", "#"),
            (
                "sched-relay.approvals.web-2",
                "scheduledevents.approvals",
                "approvals.web-2",
            ),
        ] {
            admin
                .queue_declare(
                    queue.into(),
                    QueueDeclareOptions::default(),
                    FieldTable::default(),
                )
                .await
                .unwrap();
            admin
                .queue_bind(
                    queue.into(),
                    exchange.into(),
                    key.into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await
                .unwrap();
        }
        admin
    });
    // The routing keys of the events that reached the audit queue, waiting up to `wait` for
    // `expected`.
    let audit = |expected: &str, wait: Duration| {
        let admin = admin.clone();
        let expected = expected.to_owned();
        let deadline = Instant::now() + wait;
        let mut keys = Vec::new();
        runtime.block_on(async move {
            while !keys.contains(&expected) && Instant::now() < deadline {
                match admin
                    .basic_get("audit".into(), lapin::options::BasicGetOptions::default())
                    .await
                    .unwrap()
                {
                    Some(message) => keys.push(message.delivery.routing_key.to_string()),
                    None => tokio::time::sleep(Duration::from_millis(100)).await,
                }
            }
            keys
        })
    };

    let dir = tempfile::tempdir().unwrap();
    let scenario = dir.path().join("web-1.toml");
    std::fs::write(
        &scenario,
        "[vm]\nname = \"web-1\"\n\n\
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
            "[[sinks]]\nname = \"bus\"\nkind = \"amqp\"\nurl = \"{}\"\nexchange = \"scheduledevents\"\n\n\
             [approvals.amqp]\nsink = \"bus\"\n\
             [[approvals.keys]]\nid = \"coordinator\"\nalgorithm = \"ed25519\"\npublic_key = \"{public_key}\"\n",
            url(&broker, &web1)
        ),
    );
    // Its own events arrive, under its own keys only.
    let keys = audit("web-1.scheduled", Duration::from_secs(20));
    assert!(
        keys.contains(&"web-1.scheduled".to_owned()),
        "no event from web-1: {keys:?}\n{}",
        agent.log()
    );
    assert!(keys.iter().all(|k| k.starts_with("web-1.")), "{keys:?}");

    // With web-1's credentials, another VM's event cannot be published...
    let url = url(&broker, &web1);
    runtime.block_on(async {
        let forged = publish(&url, "scheduledevents", "web-2.completed", b"{}").await;
        assert!(forged.is_err(), "web-1 published web-2's event");
        // ... nor an approval, for anyone.
        let approval = publish(&url, "scheduledevents.approvals", "approvals.web-2", b"{}").await;
        assert!(approval.is_err(), "web-1 published an approval");
        // ... nor another VM's approvals read, directly or through a binding of its own.
        let theirs = channel(&url)
            .await
            .basic_consume(
                "sched-relay.approvals.web-2".into(),
                "spy".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await;
        assert!(theirs.is_err(), "web-1 consumed web-2's approvals");
        let bound = channel(&url)
            .await
            .queue_bind(
                "sched-relay.approvals.web-1".into(),
                "scheduledevents.approvals".into(),
                "approvals.web-2".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await;
        assert!(bound.is_err(), "web-1 bound its queue to web-2's approvals");
        let everything = channel(&url)
            .await
            .queue_bind(
                "sched-relay.approvals.web-1".into(),
                "scheduledevents".into(),
                "#".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await;
        assert!(everything.is_err(), "web-1 bound its queue to every event");
        // ... nor an exchange every VM relies on deleted.
        for exchange in ["scheduledevents", "scheduledevents.approvals"] {
            let deleted = channel(&url)
                .await
                .exchange_delete(exchange.into(), ExchangeDeleteOptions::default())
                .await;
            assert!(deleted.is_err(), "web-1 deleted {exchange}");
        }
    });
    let keys = audit("web-2.completed", Duration::from_secs(3));
    assert!(
        !keys.iter().any(|k| k.starts_with("web-2.")),
        "web-2's key carried a message: {keys:?}"
    );

    // The coordinator's approval for web-1 reaches web-1's agent, which POSTs it.
    let request = common::fleet::signed_approval(&key_file, "coordinator", "web-1", "E1");
    runtime
        .block_on(publish(
            &admin_url,
            "scheduledevents.approvals",
            "approvals.web-1",
            &request,
        ))
        .unwrap();
    common::fleet::wait_for_accepted_post(&sim, "E1", || agent.log());
    assert!(!agent.log().contains("ACCESS_REFUSED"), "{}", agent.log());
}
