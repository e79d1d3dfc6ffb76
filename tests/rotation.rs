//! Secrets and certificates are rotated on real fleets (Kubernetes secrets, cert-manager, the
//! Key Vault extension, certbot) while the agent runs and events flow. Against a real server
//! each: the agent reads a changed file anew before its next connection, retries (never
//! dead-letters) while the server and the file disagree, and loses nothing. Rotated here:
//! a webhook's bearer token, a NATS user's password (sink and approval source), a client
//! certificate (NATS with mutual TLS), a RabbitMQ password, and the listener's own
//! certificate.

mod common;
#[path = "common/tls.rs"]
mod tls;

use std::collections::HashSet;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::rabbit::{Vhost, rabbitmqctl};
use common::{AgentProcess, SimProcess, is_heartbeat};
use serde_json::Value;

/// Events that keep coming for about `seconds`: one every 0.7 s, each scheduled, started
/// and completed within 3 s, plus a Freeze waiting an hour (for approvals). Also the id of
/// the last event's `completed`, after which nothing more comes.
fn flowing(seconds: u32) -> (String, String) {
    let mut scenario = String::from(
        "[[events]]\nid = \"f0000000-0000-4000-8000-00000000aaaa\"\ntype = \"Freeze\"\n\
         resources = [\"WestNO_0\"]\nnotice = \"1h\"\n",
    );
    let count = seconds * 10 / 7;
    for i in 0..count {
        scenario.push_str(&format!(
            "[[events]]\nid = \"f0000000-0000-4000-8000-{i:012}\"\ntype = \"Reboot\"\n\
             resources = [\"WestNO_0\"]\nappear_after = \"{}ms\"\nnotice = \"1s\"\nstarted_for = \"1s\"\n",
            500 + i * 700
        ));
    }
    let last = format!("f0000000-0000-4000-8000-{:012}:completed", count - 1);
    (scenario, last)
}

/// A signed request (key `k`, as the agents of these tests trust it) approving the Freeze of
/// [`flowing`], which waits an hour.
fn approval_of_the_freeze() -> Vec<u8> {
    let key =
        sched_relay_core::approval::SigningKey::parse("hmac-sha256:rotation-secret-0001").unwrap();
    let draft = sched_relay_core::approval::Draft::new(
        "urn:test:rotation",
        Some("WestNO_0"),
        vec!["f0000000-0000-4000-8000-00000000aaaa".into()],
    );
    serde_json::to_vec(&draft.event(Some(("k", &key)))).unwrap()
}

/// Writes `text` to `path` as rotations do: a new file renamed over the old.
fn rotate(path: &Path, text: &[u8]) {
    let staged = path.with_extension("rotating");
    std::fs::write(&staged, text).unwrap();
    std::fs::rename(&staged, path).unwrap();
}

/// Waits until the last event has completed and every event the agent produced (its file sink's,
/// heartbeats aside: each sink has its own) is among `received`'s ids; then checks that
/// nothing was dead-lettered.
fn assert_all_delivered(
    agent: &AgentProcess,
    last: &str,
    received: impl Fn() -> HashSet<String>,
    timeout: Duration,
) {
    agent.wait_for_id(last, timeout);
    let deadline = Instant::now() + timeout;
    loop {
        let produced: HashSet<String> = agent
            .events()
            .iter()
            .filter(|e| !is_heartbeat(e))
            .map(|e| e["id"].as_str().unwrap().to_owned())
            .collect();
        let got = received();
        let missing: Vec<&String> = produced.difference(&got).collect();
        if missing.is_empty() && !produced.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{} of {} events never arrived (first: {:?}):\n{}",
            missing.len(),
            produced.len(),
            missing.first(),
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let dead = agent.dir.path().join("state/dead-letter");
    let letters: Vec<String> = std::fs::read_dir(&dead)
        .map(|entries| {
            entries
                .flatten()
                .filter(|e| e.metadata().map(|m| m.len() > 0).unwrap_or(false))
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    assert!(letters.is_empty(), "dead-lettered: {letters:?}");
}

/// Waits until `condition` holds.
fn wait_until(what: &str, timeout: Duration, condition: impl Fn() -> bool) {
    let deadline = Instant::now() + timeout;
    while !condition() {
        assert!(Instant::now() < deadline, "{what}: not within {timeout:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A webhook receiver that takes only `Bearer <accepted>` (401 otherwise) and keeps the
/// ids of what it took.
struct Receiver {
    port: u16,
    accepted: Arc<Mutex<String>>,
    ids: Arc<Mutex<HashSet<String>>>,
    refused: Arc<std::sync::atomic::AtomicUsize>,
    _runtime: tokio::runtime::Runtime,
}

impl Receiver {
    fn start(token: &str) -> Receiver {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let port = listener.local_addr().unwrap().port();
        let accepted = Arc::new(Mutex::new(token.to_owned()));
        let ids = Arc::new(Mutex::new(HashSet::new()));
        let refused = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (want, got, no) = (accepted.clone(), ids.clone(), refused.clone());
        let app = axum::Router::new().fallback(
            move |headers: axum::http::HeaderMap, body: axum::body::Bytes| {
                let (want, got, no) = (want.clone(), got.clone(), no.clone());
                async move {
                    let expected = format!("Bearer {}", want.lock().unwrap());
                    let given = headers
                        .get("authorization")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or_default();
                    if given != expected {
                        no.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        return axum::http::StatusCode::UNAUTHORIZED;
                    }
                    let id = headers
                        .get("ce-id")
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_owned)
                        .or_else(|| {
                            serde_json::from_slice::<Value>(&body)
                                .ok()
                                .and_then(|event| event["id"].as_str().map(str::to_owned))
                        });
                    if let Some(id) = id {
                        got.lock().unwrap().insert(id);
                    }
                    axum::http::StatusCode::OK
                }
            },
        );
        runtime.spawn(async move { axum::serve(listener, app).await });
        Receiver {
            port,
            accepted,
            ids,
            refused,
            _runtime: runtime,
        }
    }
}

#[cfg(feature = "webhook")]
#[test]
fn a_rotated_webhook_token_is_read_anew_and_no_event_is_lost_or_dead_lettered() {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("webhook-token");
    std::fs::write(&token, "token-one\n").unwrap();
    let receiver = Receiver::start("token-one");
    let telemetry = tls::free_port();
    let (scenario, last) = flowing(15);
    let sim = SimProcess::start(&common::scenario_file(dir.path(), &scenario), 1.0);
    let agent = AgentProcess::start_on_defaults(
        &sim.url,
        &format!(
            "[telemetry]\nlisten = \"127.0.0.1:{telemetry}\"\n\
             [[sinks]]\nname = \"hook\"\nkind = \"webhook\"\nurl = \"http://127.0.0.1:{}/events\"\nbearer_token_file = {:?}\n",
            receiver.port,
            token.display().to_string()
        ),
    );
    wait_until("the first events", Duration::from_secs(20), || {
        receiver.ids.lock().unwrap().len() >= 5
    });
    // The receiver takes the new token first (the sink is refused meanwhile), then the
    // agent's file is rotated.
    *receiver.accepted.lock().unwrap() = "token-two".into();
    wait_until("a refusal", Duration::from_secs(20), || {
        receiver.refused.load(std::sync::atomic::Ordering::SeqCst) > 0
    });
    // The file is gone for a while (a rotation that removes before it writes): the events
    // wait in the outbox, and /readyz names the file.
    std::fs::remove_file(&token).unwrap();
    let readyz = format!("http://127.0.0.1:{telemetry}/readyz");
    wait_until(
        "/readyz naming the token file",
        Duration::from_secs(30),
        || {
            let (status, body) = common::blocking_get(&readyz, &[]);
            status == 503 && body.contains("webhook-token")
        },
    );
    rotate(&token, b"token-two\n");
    assert_all_delivered(
        &agent,
        &last,
        || receiver.ids.lock().unwrap().clone(),
        Duration::from_secs(60),
    );
}

/// A nats-server of this test's own whose configuration the test rewrites and reloads
/// (SIGHUP), as an operator rotating credentials does.
struct Nats {
    child: Child,
    port: u16,
    config: std::path::PathBuf,
}

impl Nats {
    fn start(dir: &Path, body: &str) -> Nats {
        let port = tls::free_port();
        let config = dir.join("nats.conf");
        let mut server = Nats {
            child: Nats::spawn(dir, &config, port, body),
            port,
            config,
        };
        server.wait_listening(dir);
        server
    }

    fn spawn(dir: &Path, config: &Path, port: u16, body: &str) -> Child {
        Nats::write(dir, config, port, body);
        Command::new("nats-server")
            .arg("-c")
            .arg(config)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("nats.log")).unwrap())
            .spawn()
            .unwrap_or_else(|e| panic!("nats-server is installed (scripts/test): {e}"))
    }

    fn wait_listening(&mut self, dir: &Path) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "nats-server exited ({status}):\n{}",
                    std::fs::read_to_string(dir.join("nats.log")).unwrap_or_default()
                );
            }
            assert!(Instant::now() < deadline, "nats-server is not listening");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn write(dir: &Path, config: &Path, port: u16, body: &str) {
        std::fs::write(
            config,
            format!(
                "listen: \"127.0.0.1:{port}\"\njetstream {{ store_dir: {:?} }}\n{body}\n",
                dir.join("nats-store").display().to_string()
            ),
        )
        .unwrap();
    }

    /// Rewrites the configuration and has the server reload it.
    fn reload(&self, dir: &Path, body: &str) {
        Nats::write(dir, &self.config, self.port, body);
        unsafe {
            libc::kill(self.child.id() as i32, libc::SIGHUP);
        }
    }

    /// Stops the server and starts it again with `body` (same port, same store): every
    /// connection is made anew.
    fn restart(&mut self, dir: &Path, body: &str) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.child = Nats::spawn(dir, &self.config, self.port, body);
        self.wait_listening(dir);
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn nats_users(agent_password: &str) -> String {
    format!(
        "authorization {{ users = [ {{ user: agent, password: \"{agent_password}\" }}, {{ user: admin, password: admin }} ] }}"
    )
}

/// The ids of every message in `stream` (structured CloudEvents).
async fn ids_of(client: async_nats::Client, stream: &str) -> HashSet<String> {
    use futures_util::StreamExt;
    let js = async_nats::jetstream::new(client);
    let stream = js.get_stream(stream).await.unwrap();
    let consumer = stream
        .create_consumer(async_nats::jetstream::consumer::pull::Config {
            deliver_policy: async_nats::jetstream::consumer::DeliverPolicy::All,
            ack_policy: async_nats::jetstream::consumer::AckPolicy::None,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut ids = HashSet::new();
    let mut batch = consumer
        .fetch()
        .max_messages(100_000)
        .expires(Duration::from_secs(1))
        .messages()
        .await
        .unwrap();
    while let Some(Ok(message)) = batch.next().await {
        if let Some(id) = serde_json::from_slice::<Value>(&message.payload)
            .ok()
            .and_then(|event| event["id"].as_str().map(str::to_owned))
        {
            ids.insert(id);
        }
    }
    ids
}

#[cfg(feature = "nats")]
#[test]
fn a_rotated_nats_password_is_read_anew_by_the_sink_and_the_approval_source() {
    let dir = tempfile::tempdir().unwrap();
    let server = Nats::start(dir.path(), &nats_users("first-password"));
    let admin = format!("nats://127.0.0.1:{}", server.port);
    let connect = |url: String| async move {
        async_nats::ConnectOptions::with_user_and_password("admin".into(), "admin".into())
            .connect(url)
            .await
            .unwrap()
    };
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let js = async_nats::jetstream::new(connect(admin.clone()).await);
        js.create_stream(async_nats::jetstream::stream::Config {
            name: "ROTATION".into(),
            subjects: vec!["rotation.>".into()],
            ..Default::default()
        })
        .await
        .unwrap();
    });
    let password = dir.path().join("nats-password");
    std::fs::write(&password, "first-password\n").unwrap();
    let (scenario, last) = flowing(15);
    let sim = SimProcess::start(&common::scenario_file(dir.path(), &scenario), 1.0);
    let agent = AgentProcess::start_on_defaults(
        &sim.url,
        &format!(
            "[[sinks]]\nname = \"bus\"\nkind = \"nats\"\nurl = \"nats://127.0.0.1:{}\"\njetstream = true\n\
             subject = \"rotation.{{vmname}}.{{transition}}\"\ncontent_mode = \"structured\"\n\
             user = \"agent\"\npassword_file = {:?}\n\
             [approvals.nats]\nsink = \"bus\"\n\
             [[approvals.keys]]\nid = \"k\"\nalgorithm = \"hmac-sha256\"\nsecret = \"rotation-secret-0001\"\n",
            server.port,
            password.display().to_string()
        ),
    );
    let in_stream =
        || runtime.block_on(async { ids_of(connect(admin.clone()).await, "ROTATION").await });
    wait_until("the first events", Duration::from_secs(20), || {
        in_stream().len() >= 5
    });
    // The server takes the new password (and drops the connections made with the old one),
    // then the agent's file is rotated.
    server.reload(dir.path(), &nats_users("second-password"));
    // The file is gone for a while meanwhile (a rotation that removes before it writes):
    // retried, not dead-lettered.
    std::fs::remove_file(&password).unwrap();
    std::thread::sleep(Duration::from_secs(3));
    rotate(&password, b"second-password\n");
    assert_all_delivered(&agent, &last, in_stream, Duration::from_secs(60));
    // The clients made with the old password are gone, not trying it again for ever.
    let refusals = || {
        std::fs::read_to_string(dir.path().join("nats.log"))
            .unwrap_or_default()
            .lines()
            .filter(|line| line.contains("authentication error"))
            .count()
    };
    let settled = refusals();
    std::thread::sleep(Duration::from_secs(10));
    assert_eq!(
        refusals(),
        settled,
        "something still logs in with the old password:\n{}",
        std::fs::read_to_string(dir.path().join("nats.log")).unwrap_or_default()
    );

    // The approval source reads its subject again with the new password: a request is
    // answered (core NATS request-reply) with its outcome.
    let deadline = Instant::now() + Duration::from_secs(30);
    let answer = runtime.block_on(async {
        let client = connect(admin.clone()).await;
        loop {
            let body = approval_of_the_freeze();
            let asked = tokio::time::timeout(
                Duration::from_secs(3),
                client.request("scheduledapprovals.WestNO_0", body.into()),
            )
            .await;
            if let Ok(Ok(reply)) = asked {
                break serde_json::from_slice::<Value>(&reply.payload).unwrap();
            }
            assert!(
                Instant::now() < deadline,
                "the approval source never answered after the rotation:\n{}",
                agent.log()
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    });
    assert_eq!(answer["outcome"], "accepted", "{answer}");
}

/// A client certificate renewed by another CA before the server trusts it: refused and
/// retried (never dead-lettered), then in once the server trusts the new CA alone. (async-nats
/// reads the certificate files itself at each connection; this proves the path end to end.)
#[cfg(feature = "nats")]
#[test]
fn a_rotated_client_certificate_is_presented_on_the_next_connection() {
    let dir = tempfile::tempdir().unwrap();
    let pki = tls::Pki::generate(dir.path());
    let tls_block = |clients_ca: &Path| {
        format!(
            "tls {{\n  cert_file: {:?}\n  key_file: {:?}\n  ca_file: {:?}\n  verify: true\n  timeout: 5\n}}",
            pki.server_cert.display().to_string(),
            pki.server_key.display().to_string(),
            clients_ca.display().to_string()
        )
    };
    let mut server = Nats::start(dir.path(), &tls_block(&pki.ca));
    // The agent's certificate, where its configuration points.
    let cert = dir.path().join("agent.pem");
    let key = dir.path().join("agent.key");
    std::fs::copy(&pki.client_cert, &cert).unwrap();
    std::fs::copy(&pki.client_key, &key).unwrap();
    let url = format!("tls://127.0.0.1:{}", server.port);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    // The test's own client, with a certificate the server trusts at the time.
    let client = |cert: &Path, key: &Path| {
        runtime.block_on(
            async_nats::ConnectOptions::new()
                .require_tls(true)
                .add_root_certificates(pki.ca.clone())
                .add_client_certificate(cert.to_owned(), key.to_owned())
                .connect(&url),
        )
    };
    let first = client(&pki.client_cert, &pki.client_key).unwrap();
    runtime
        .block_on(async {
            async_nats::jetstream::new(first)
                .create_stream(async_nats::jetstream::stream::Config {
                    name: "ROTATION".into(),
                    subjects: vec!["rotation.>".into()],
                    ..Default::default()
                })
                .await
        })
        .unwrap();
    let (scenario, last) = flowing(15);
    let sim = SimProcess::start(&common::scenario_file(dir.path(), &scenario), 1.0);
    let agent = AgentProcess::start_on_defaults(
        &sim.url,
        &format!(
            "[[sinks]]\nname = \"bus\"\nkind = \"nats\"\nurl = \"{url}\"\njetstream = true\n\
             subject = \"rotation.{{vmname}}.{{transition}}\"\ncontent_mode = \"structured\"\n\
             ca_file = {:?}\nclient_cert_file = {:?}\nclient_key_file = {:?}\n",
            pki.ca.display().to_string(),
            cert.display().to_string(),
            key.display().to_string()
        ),
    );
    let in_stream = |cert: &Path, key: &Path| {
        let Ok(client) = client(cert, key) else {
            return HashSet::new();
        };
        runtime.block_on(ids_of(client, "ROTATION"))
    };
    wait_until("the first events", Duration::from_secs(20), || {
        in_stream(&pki.client_cert, &pki.client_key).len() >= 5
    });
    // The agent's certificate is renewed, by another CA, before the server trusts it:
    // refused meanwhile, retried. Then the server trusts only the new CA, from a restart
    // (every connection made anew): only the renewed certificate gets in.
    rotate(&cert, &std::fs::read(&pki.stranger_cert).unwrap());
    rotate(&key, &std::fs::read(&pki.stranger_key).unwrap());
    std::thread::sleep(Duration::from_secs(3));
    server.restart(dir.path(), &tls_block(&pki.other_ca));
    assert_all_delivered(
        &agent,
        &last,
        || in_stream(&pki.stranger_cert, &pki.stranger_key),
        Duration::from_secs(60),
    );
}

#[cfg(feature = "amqp")]
#[test]
fn a_rotated_rabbitmq_password_is_read_anew_and_no_event_is_lost_or_dead_lettered() {
    let Some(mut vhost) = Vhost::start("sched-relay-rotation") else {
        return;
    };
    let user = format!("{}-agent", vhost.name);
    vhost.add_user(&user, "first-password");
    rabbitmqctl(&[
        "set_permissions",
        "-p",
        &vhost.name,
        &user,
        ".*",
        ".*",
        ".*",
    ])
    .unwrap();
    // A queue of the test's own takes every event the agent publishes.
    let guest = format!("amqp://guest:guest@127.0.0.1:5672/{}", vhost.name);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let channel = runtime.block_on(async {
        let connection = lapin::Connection::connect(&guest, lapin::ConnectionProperties::default())
            .await
            .unwrap();
        let channel = connection.create_channel().await.unwrap();
        std::mem::forget(connection);
        channel
            .queue_declare(
                "rotation".into(),
                lapin::options::QueueDeclareOptions::default(),
                lapin::types::FieldTable::default(),
            )
            .await
            .unwrap();
        channel
            .queue_bind(
                "rotation".into(),
                "amq.topic".into(),
                "#".into(),
                lapin::options::QueueBindOptions::default(),
                lapin::types::FieldTable::default(),
            )
            .await
            .unwrap();
        channel
    });
    let ids = Arc::new(Mutex::new(HashSet::new()));
    {
        let (channel, ids) = (channel.clone(), ids.clone());
        runtime.spawn(async move {
            use futures_util::StreamExt;
            let mut consumer = channel
                .basic_consume(
                    "rotation".into(),
                    "test".into(),
                    lapin::options::BasicConsumeOptions {
                        no_ack: true,
                        ..Default::default()
                    },
                    lapin::types::FieldTable::default(),
                )
                .await
                .unwrap();
            while let Some(Ok(delivery)) = consumer.next().await {
                if let Some(id) = serde_json::from_slice::<Value>(&delivery.data)
                    .ok()
                    .and_then(|event| event["id"].as_str().map(str::to_owned))
                {
                    ids.lock().unwrap().insert(id);
                }
            }
        });
    }
    let dir = tempfile::tempdir().unwrap();
    let password = dir.path().join("rabbitmq-password");
    std::fs::write(&password, "first-password\n").unwrap();
    let (scenario, last) = flowing(15);
    let sim = SimProcess::start(&common::scenario_file(dir.path(), &scenario), 1.0);
    let agent = AgentProcess::start_on_defaults(
        &sim.url,
        &format!(
            "[[sinks]]\nname = \"rabbit\"\nkind = \"amqp\"\nurl = \"amqp://{}@127.0.0.1:5672/{}\"\n\
             exchange = \"amq.topic\"\ndeclare = false\ncontent_mode = \"structured\"\npassword_file = {:?}\n\
             [approvals.amqp]\nsink = \"rabbit\"\n\
             [[approvals.keys]]\nid = \"k\"\nalgorithm = \"hmac-sha256\"\nsecret = \"rotation-secret-0001\"\n",
            user,
            vhost.name,
            password.display().to_string()
        ),
    );
    wait_until("the first events", Duration::from_secs(20), || {
        ids.lock().unwrap().len() >= 5
    });
    // The agent's connections (its sink's and its approval source's), by pid.
    let connections = || -> HashSet<String> {
        rabbitmqctl(&["-q", "list_connections", "user", "pid"])
            .unwrap()
            .lines()
            .filter_map(|line| {
                let mut fields = line.split_whitespace();
                match (fields.next(), fields.next()) {
                    (Some(listed), Some(pid)) if listed == user => Some(pid.to_owned()),
                    _ => None,
                }
            })
            .collect()
    };
    wait_until(
        "the sink's and the source's connections",
        Duration::from_secs(20),
        || connections().len() == 2,
    );
    let before = connections();
    // The broker takes the new password; it keeps the connections made with the old one.
    // The agent's file is rotated after, and is gone for a while meanwhile (a rotation
    // that removes before it writes): retried, the old connections going on, never a dead
    // letter. Then both are made again with the new password.
    rabbitmqctl(&["change_password", &user, "second-password"]).unwrap();
    std::fs::remove_file(&password).unwrap();
    std::thread::sleep(Duration::from_secs(3));
    rotate(&password, b"second-password\n");
    wait_until(
        "both connections made again with the new password",
        Duration::from_secs(40),
        || {
            let now = connections();
            now.len() == 2 && now.is_disjoint(&before)
        },
    );
    assert_all_delivered(
        &agent,
        &last,
        || ids.lock().unwrap().clone(),
        Duration::from_secs(60),
    );
    // The approval source reads with the new password: a request is answered.
    let body = approval_of_the_freeze();
    runtime.block_on(async {
        channel
            .basic_publish(
                "scheduledevents.approvals".into(),
                "approvals.WestNO_0".into(),
                lapin::options::BasicPublishOptions::default(),
                &body,
                lapin::BasicProperties::default()
                    .with_content_type("application/cloudevents+json".into()),
            )
            .await
            .unwrap()
            .await
            .unwrap();
    });
    wait_until("the approval's outcome", Duration::from_secs(30), || {
        agent.events().iter().any(|event| {
            event["type"]
                .as_str()
                .is_some_and(|t| t.ends_with("approval.accepted"))
        })
    });
}

#[test]
fn a_renewed_listener_certificate_is_served_to_new_connections_without_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let (first, second) = (dir.path().join("first"), dir.path().join("second"));
    std::fs::create_dir(&first).unwrap();
    std::fs::create_dir(&second).unwrap();
    let (old, new) = (tls::Pki::generate(&first), tls::Pki::generate(&second));
    let cert = dir.path().join("listener.pem");
    let key = dir.path().join("listener.key");
    std::fs::copy(&old.server_cert, &cert).unwrap();
    std::fs::copy(&old.server_key, &key).unwrap();
    let (scenario, _) = flowing(1);
    let sim = SimProcess::start(&common::scenario_file(dir.path(), &scenario), 1.0);
    let port = tls::free_port();
    let _agent = AgentProcess::start_on_defaults(
        &sim.url,
        &format!(
            "[telemetry]\nlisten = \"127.0.0.1:{port}\"\ntls_cert_file = {:?}\ntls_key_file = {:?}\n",
            cert.display().to_string(),
            key.display().to_string()
        ),
    );
    // Whether a client trusting only `ca` gets an answer from /healthz.
    let answered = |ca: &Path| {
        let ca = std::fs::read_to_string(ca).unwrap();
        let request = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
        tls::https(port, &ca, request).is_ok_and(|response| response.starts_with("HTTP/1.1 200"))
    };
    wait_until(
        "the listener with the first certificate",
        Duration::from_secs(20),
        || answered(&old.ca),
    );
    assert!(
        !answered(&new.ca),
        "the renewed certificate is not there yet"
    );
    // Renewed as certbot and cert-manager do: the key, then the certificate.
    rotate(&key, &std::fs::read(&new.server_key).unwrap());
    rotate(&cert, &std::fs::read(&new.server_cert).unwrap());
    wait_until(
        "the renewed certificate served",
        Duration::from_secs(10),
        || answered(&new.ca),
    );
    assert!(!answered(&old.ca), "the old certificate is still served");
}
