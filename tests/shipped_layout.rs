//! The NATS layout of the shipped files works as shipped. `config/examples/coordinator.toml`
//! and `config/examples/approvals.toml` are loaded by the real loaders and run as the real
//! binaries, with only the server URL, the metadata service's address and local things
//! changed (state and log paths, listener ports, the token and key files; the agent trusts
//! the coordinator's key, as the coordinator example says to do), against a nats-server of
//! the test's own: the examples' stream names are fixed, so a shared server would mix runs.
//! Both ways the docs allow (docs/src/nats-layout.md): the streams created by the components,
//! and created first by the docs' `nats stream add` commands (the `nats` CLI may be missing:
//! the test makes the same streams through the client).
//!
//! Checked from the streams themselves, for a VM named `approvals` (whose events go to
//! `scheduledevents.approvals.<transition>`): both streams exist together with the subjects
//! the docs give; its events land in the events stream only; the coordinator's approval
//! for it lands in the approvals stream only, and the agent's outcome, an event, in the
//! events stream; each reader made its durable consumer; the coordinator's input does not
//! log itself as an approval source.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::fleet::Coordinator;
use common::{BINARY, SimProcess};
use sched_relay::approval::config::NatsSourceConfig;
use sched_relay::coordinator::config::{CoordinatorConfig, Input};
use sched_relay::sinks::SinkKind;
use sched_relay_core::approval::SigningKey;
use sched_relay_nats::testing::PrivateNats;
use sched_relay_transport::testing::free_port;

const REQUESTED: &str = "com.azure.scheduledevents.approval.requested";

fn repository() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &str) -> String {
    std::fs::read_to_string(repository().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// Replaces `from` (which must be there) with `to` everywhere in `text`.
fn substitute(text: &str, from: &str, to: &str) -> String {
    assert!(text.contains(from), "the example no longer has {from:?}");
    text.replace(from, to)
}

/// Every `nats stream add <name> --subjects '<subjects>'` in the README, the book (docs/src),
/// the examples and the compose file, by stream name. One name, one set of subjects, wherever
/// it is written.
fn documented_streams() -> BTreeMap<String, String> {
    let mut streams = BTreeMap::new();
    let mut files = vec!["README.md".to_owned(), "docker-compose.yml".to_owned()];
    for dir in ["config/examples", "docs/src", "docs/src/sinks"] {
        for entry in std::fs::read_dir(repository().join(dir)).unwrap() {
            let name = entry.unwrap().file_name().into_string().unwrap();
            if std::path::Path::new(&name)
                .extension()
                .is_some_and(|e| e == "toml" || e == "md")
            {
                files.push(format!("{dir}/{name}"));
            }
        }
    }
    for file in files {
        let text = read(&file);
        for (at, _) in text.match_indices("stream add ") {
            let mut words = text[at + "stream add ".len()..].split_whitespace();
            let name = words.next().unwrap().to_owned();
            assert_eq!(
                words.next(),
                Some("--subjects"),
                "{file}: stream add {name}"
            );
            let subjects = words.next().unwrap().trim_matches('\'').to_owned();
            if let Some(before) = streams.insert(name.clone(), subjects.clone()) {
                assert_eq!(before, subjects, "{file} gives {name} other subjects");
            }
        }
    }
    streams
}

/// A `sched-relay run` with the given configuration, killed when dropped.
struct Agent {
    child: Child,
    log: std::path::PathBuf,
}

impl Agent {
    fn start(config: &Path, log: std::path::PathBuf) -> Agent {
        let stderr = std::fs::File::create(&log).unwrap();
        let child = Command::new(BINARY)
            .args(["run", "--config"])
            .arg(config)
            .env_remove("RUST_LOG")
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .unwrap();
        Agent { child, log }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// (subject, CloudEvents type) of every message `stream` holds.
async fn stored(js: &async_nats::jetstream::Context, stream: &str) -> Vec<(String, String)> {
    let mut stream = js.get_stream(stream).await.unwrap();
    let last = stream.info().await.unwrap().state.last_sequence;
    let mut messages = Vec::new();
    for sequence in 1..=last {
        let Ok(message) = stream.get_raw_message(sequence).await else {
            continue;
        };
        let ty = match message.headers.get("ce-type") {
            Some(ty) => ty.as_str().to_owned(),
            // Structured mode.
            None => serde_json::from_slice::<serde_json::Value>(&message.payload)
                .ok()
                .and_then(|event| event["type"].as_str().map(str::to_owned))
                .unwrap_or_default(),
        };
        messages.push((message.subject.to_string(), ty));
    }
    messages
}

async fn subjects_of(js: &async_nats::jetstream::Context, stream: &str) -> Vec<String> {
    let mut stream = js
        .get_stream(stream)
        .await
        .unwrap_or_else(|e| panic!("stream {stream}: {e}"));
    stream.info().await.unwrap().config.subjects.clone()
}

/// Every NATS `stream`, `subject` and `fleet_subject` set (or shown commented out) in the
/// shipped files belongs to the stream of its direction: under `[approvals...]` the stream
/// the agent example names, elsewhere (`[[sinks]]`, `[input]`) the coordinator example's
/// input stream; each subject is captured by that stream's documented subjects and by no
/// other's.
#[test]
fn every_shipped_stream_and_subject_belongs_to_the_stream_of_its_direction() {
    let documented = documented_streams();
    let example = |path: &str| -> toml::Value { toml::from_str(&read(path)).unwrap() };
    let events = example("config/examples/coordinator.toml")["input"]["stream"]
        .as_str()
        .unwrap()
        .to_owned();
    let approvals = example("config/examples/approvals.toml")["approvals"]["nats"]["stream"]
        .as_str()
        .unwrap()
        .to_owned();
    let mut files = vec![
        "config/reference.toml".to_owned(),
        "deploy/azure/cloud-init.yaml".to_owned(),
        "deploy/helm/sched-relay/values.yaml".to_owned(),
        "deploy/kubernetes/daemonset.yaml".to_owned(),
    ];
    for dir in ["config/examples", "deploy/helm/sched-relay/ci"] {
        for entry in std::fs::read_dir(repository().join(dir)).unwrap() {
            let name = entry.unwrap().file_name().into_string().unwrap();
            files.push(format!("{dir}/{name}"));
        }
    }
    let mut seen = 0;
    for file in &files {
        let mut section = String::new();
        for line in read(file).lines() {
            let line = line.trim_start_matches([' ', '#']);
            if line.starts_with('[') {
                section = line
                    .split(']')
                    .next()
                    .unwrap()
                    .trim_start_matches('[')
                    .to_owned();
                continue;
            }
            let Some((key, value)) = line.split_once(" = \"") else {
                continue;
            };
            let value = value.split('"').next().unwrap();
            let expected = if section.starts_with("approvals") {
                &approvals
            } else {
                &events
            };
            match key {
                "stream" => assert_eq!(value, expected, "{file} [{section}]"),
                "subject" | "fleet_subject" => {
                    // A template stands for any VM's subject.
                    let subject = value
                        .split('.')
                        .map(|token| if token.contains('{') { "*" } else { token })
                        .collect::<Vec<_>>()
                        .join(".");
                    let streams: Vec<&String> = documented
                        .iter()
                        .filter(|(_, subjects)| {
                            subjects.split(',').any(|pattern| {
                                sched_relay_nats::stream::captures(pattern, &subject)
                            })
                        })
                        .map(|(name, _)| name)
                        .collect();
                    assert_eq!(streams, [expected], "{file} [{section}] {key} = {value}");
                }
                _ => continue,
            }
            seen += 1;
        }
    }
    assert!(seen >= 10, "{seen}");
}

#[test]
fn the_shipped_nats_layout_works_with_the_streams_the_components_create() {
    shipped_layout(false);
}

#[test]
fn the_shipped_nats_layout_works_with_the_streams_the_docs_say_to_create() {
    shipped_layout(true);
}

fn shipped_layout(created_by_hand: bool) {
    let Some(nats) = PrivateNats::start(&[]) else {
        return;
    };
    let url = nats.url();
    let dir = tempfile::tempdir().unwrap();
    let path = |name: &str| dir.path().join(name);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let _entered = runtime.enter();
    let js = async_nats::jetstream::new(runtime.block_on(async_nats::connect(&url)).unwrap());

    // The coordinator's example, as an operator would install it.
    let key = SigningKey::generate_ed25519().unwrap();
    std::fs::write(path("coordinator.key"), &key).unwrap();
    let public_key = SigningKey::parse(&key).unwrap().public_key().unwrap();
    let coordinator_port = free_port();
    let mut text = read("config/examples/coordinator.toml");
    for (from, to) in [
        ("nats://nats-1.fleet.internal:4222", url.clone()),
        (
            "/var/lib/sched-relay-coordinator",
            path("coordinator").display().to_string(),
        ),
        ("127.0.0.1:9465", format!("127.0.0.1:{coordinator_port}")),
        (
            "/etc/sched-relay/coordinator.key",
            path("coordinator.key").display().to_string(),
        ),
    ] {
        text = substitute(&text, from, &to);
    }
    std::fs::write(path("coordinator.toml"), text).unwrap();
    let (coordinator_config, _) = CoordinatorConfig::load(&path("coordinator.toml"))
        .unwrap_or_else(|e| panic!("coordinator.toml: {e}"));
    let Input::Nats {
        stream: events_stream,
        subject: events_subject,
        durable: coordinator_durable,
        ..
    } = &coordinator_config.input
    else {
        panic!("the coordinator example reads NATS");
    };
    let SinkKind::Nats(approvals_sink) = &coordinator_config.approvals else {
        panic!("the coordinator example approves over NATS");
    };
    assert!(approvals_sink.jetstream);

    // The agent's example.
    let sim_dir = tempfile::tempdir().unwrap();
    let scenario = common::scenario_file(
        sim_dir.path(),
        "[vm]\nname = \"approvals\"\n\
         resource_id = \"/subscriptions/s/resourceGroups/rg-test/providers/Microsoft.Compute/virtualMachines/approvals\"\n\n\
         [[events]]\nid = \"c0000000-0000-4000-8000-000000000001\"\ntype = \"Freeze\"\n\
         resources = [\"approvals\"]\nappear_after = \"1s\"\nnotice = \"60s\"\n\
         duration_in_seconds = 5\nstarted_for = \"2s\"\n",
    );
    let sim = SimProcess::start(&scenario, 1.0);
    std::fs::write(path("approval-token"), "shipped-layout-token").unwrap();
    let mut text = read("config/examples/approvals.toml");
    for (from, to) in [
        ("nats://nats.internal:4222", url.clone()),
        // No credentials on the test's own server.
        (
            "credentials_file = \"/etc/sched-relay/nats.creds\"\n",
            String::new(),
        ),
        (
            "/var/log/sched-relay/events.jsonl",
            path("events.jsonl").display().to_string(),
        ),
        ("127.0.0.1:9464", format!("127.0.0.1:{}", free_port())),
        (
            "/etc/sched-relay/approval-token",
            path("approval-token").display().to_string(),
        ),
    ] {
        text = substitute(&text, from, &to);
    }
    text.push_str(&format!(
        "\n[imds]\nendpoint = \"{}\"\n\n[state]\ndir = \"{}\"\n\n\
         [[approvals.keys]]\nid = \"{}\"\nalgorithm = \"ed25519\"\npublic_key = \"{public_key}\"\n",
        sim.url,
        path("agent").display(),
        coordinator_config.signing.key_id,
    ));
    std::fs::write(path("agent.toml"), text).unwrap();
    let agent_config = sched_relay::config::Config::load(Some(&path("agent.toml")))
        .unwrap_or_else(|e| panic!("approvals.toml: {e}"));
    let approvals_source: &NatsSourceConfig = agent_config.approvals.nats.as_ref().unwrap();
    let approvals_stream = approvals_source.stream.clone().unwrap();
    let SinkKind::Nats(events_sink) = &agent_config.sinks[1].kind else {
        panic!("the agent example's second sink is NATS");
    };
    assert!(events_sink.jetstream);

    // The docs and the examples name the same streams with the same subjects.
    let documented = documented_streams();
    assert_eq!(documented.len(), 2, "{documented:?}");
    let subjects_documented = |stream: &str| {
        documented.get(stream).unwrap_or_else(|| {
            panic!("docs/src/nats-layout.md does not say how to create {stream}: {documented:?}")
        })
    };
    assert_eq!(subjects_documented(events_stream), events_subject);
    let approvals_root = subjects_documented(&approvals_stream);
    assert_eq!(
        *approvals_root,
        approvals_source.stream_subjects().join(",")
    );

    if created_by_hand {
        for (name, subjects) in &documented {
            runtime.block_on(sched_relay_nats::testing::create_stream(
                &url, name, subjects,
            ));
        }
    }
    let coordinator = Coordinator::start(
        path("coordinator.toml"),
        path("coordinator.log"),
        coordinator_port,
    );
    // The agent after the coordinator's input, so that the approvals stream is not there
    // yet when the coordinator looks. (An agent that starts first keeps its events in its
    // outbox until the events stream exists.)
    let deadline = Instant::now() + Duration::from_secs(30);
    while !coordinator.log().contains("Coordinator input ready") {
        assert!(Instant::now() < deadline, "{}", coordinator.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    let agent = Agent::start(&path("agent.toml"), path("agent.log"));

    // The approval, and the agent's outcome of it, went through.
    let deadline = Instant::now() + Duration::from_secs(60);
    let (events, approvals) = loop {
        let ready = runtime.block_on(async {
            let events = js.get_stream(events_stream).await.is_ok();
            let approvals = js.get_stream(&approvals_stream).await.is_ok();
            if events && approvals {
                Some((
                    stored(&js, events_stream).await,
                    stored(&js, &approvals_stream).await,
                ))
            } else {
                None
            }
        });
        if let Some((events, approvals)) = ready {
            let outcome = events
                .iter()
                .any(|(_, ty)| ty.ends_with(".approval.accepted"));
            if outcome && !approvals.is_empty() {
                break (events, approvals);
            }
        }
        assert!(
            Instant::now() < deadline,
            "no approval and outcome within a minute\ncoordinator:\n{}\nagent:\n{}",
            coordinator.log(),
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    };

    runtime.block_on(async {
        // Both streams, side by side, as documented.
        assert_eq!(
            subjects_of(&js, events_stream).await,
            std::slice::from_ref(events_subject)
        );
        assert_eq!(
            subjects_of(&js, &approvals_stream).await,
            std::slice::from_ref(approvals_root)
        );
        // Each reader made its durable consumer.
        let events = js.get_stream(events_stream).await.unwrap();
        events
            .get_consumer::<async_nats::jetstream::consumer::pull::Config>(coordinator_durable)
            .await
            .unwrap_or_else(|e| panic!("consumer {coordinator_durable}: {e}"));
        let approvals = js.get_stream(&approvals_stream).await.unwrap();
        let agent_durable = approvals_source.durable.replace("{vmname}", "approvals");
        approvals
            .get_consumer::<async_nats::jetstream::consumer::pull::Config>(&agent_durable)
            .await
            .unwrap_or_else(|e| panic!("consumer {agent_durable}: {e}"));
    });
    // The VM named `approvals`: its events in the events stream, under the events' root,
    // and no approval among them.
    assert!(
        events
            .iter()
            .any(|(subject, _)| subject == "scheduledevents.approvals.scheduled"),
        "{events:?}"
    );
    for (subject, ty) in &events {
        assert!(subject.starts_with("scheduledevents."), "{subject} {ty}");
        assert_ne!(ty, REQUESTED, "an approval in the events stream: {subject}");
    }
    // Its approvals in the approvals stream, on its own subject, and nothing else there.
    for (subject, ty) in &approvals {
        assert_eq!(subject, "scheduledapprovals.approvals", "{approvals:?}");
        assert_eq!(ty, REQUESTED, "{approvals:?}");
    }

    let (coordinator_log, agent_log) = (coordinator.log(), agent.log());
    assert!(
        coordinator_log.contains("Coordinator input ready (JetStream)")
            && !coordinator_log.contains("Approval source"),
        "{coordinator_log}"
    );
    assert!(
        agent_log.contains("Approval source ready (JetStream)"),
        "{agent_log}"
    );
    // Who created what: the coordinator its input stream, the agent its approvals stream,
    // unless they were there already; before the agent ran, the coordinator said the
    // approvals had no stream yet.
    assert_eq!(
        coordinator_log.contains("Created the coordinator's input stream"),
        !created_by_hand,
        "{coordinator_log}"
    );
    assert_eq!(
        coordinator_log.contains("No JetStream stream captures the approvals subject yet"),
        !created_by_hand,
        "{coordinator_log}"
    );
    assert_eq!(
        agent_log.contains("Created the JetStream stream, which was missing"),
        !created_by_hand,
        "{agent_log}"
    );
}
