//! Secrets never leave the agent: credentials in every sink kind and every approval source
//! (URL passwords and tokens, webhook `?sig=` query tokens, Kafka SASL passwords, exec
//! variables, the listener's bearer token, an approval key) appear nowhere an operator or a
//! log shipper can read: not in the log, `/readyz`, `/events`, `/metrics`, the dead-letter
//! files, nor `check-config` (its output and its error lines); nor does a password in the
//! metadata endpoint's URL. The sinks fail in the ways
//! that produce messages (unreachable ports, refused credentials on the real RabbitMQ, a
//! webhook answering 500 and 400) and succeed (a private NATS server with a password, a
//! webhook answering 204), against real servers.

mod common;

use std::io::{Read as _, Write as _};
use std::time::{Duration, Instant};

use common::{AgentProcess, BINARY, SimProcess};
use sched_relay_nats::testing::PrivateNats;
use sched_relay_transport::testing::{broker_available, free_port, unique};

const SCENARIO: &str = r#"
[vm]
name = "WestNO_0"

[[events]]
id = "5ec0e700-0000-4000-8000-000000000001"
type = "Freeze"
resources = ["WestNO_0"]
duration_in_seconds = 5
appear_after = "0s"
notice = "1h"
started_for = "1h"
"#;

/// Every secret the configuration below holds; none may be seen outside.
const SECRETS: &[&str] = &[
    "NATS-DOWN-S3CRET",
    "NATS-OK-S3CRET",
    "NATS-T0KEN-IN-URL",
    "AMQP-WRONG-S3CRET",
    "AMQP-DOWN-S3CRET",
    "KAFKA-SASL-S3CRET",
    "HOOK-500-T0KEN",
    "HOOK-400-T0KEN",
    "HOOK-DOWN-T0KEN",
    "HOOK-OK-T0KEN",
    "HOOK-FRAGMENT-T0KEN",
    "HOOK-HMAC-S3CRET",
    "EXEC-ENV-S3CRET",
    "SRC-NATS-S3CRET",
    "SRC-AMQP-S3CRET",
    "SRC-KAFKA-S3CRET",
    "HTTP-BEARER-T0KEN",
    "APPROVAL-HMAC-S3CRET",
    "CONFIG-ERROR-S3CRET",
    "IMDS-S3CRET",
];

/// A webhook receiver on a free port: `/ok` answers 204, `/500` 500 and `/400` 400, each
/// quoting the request line back (as some error pages do).
fn webhook_receiver() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            std::thread::spawn(move || {
                let mut request = Vec::new();
                let mut buffer = [0u8; 65536];
                // Headers, then the body by Content-Length.
                loop {
                    let Ok(n) = stream.read(&mut buffer) else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    request.extend_from_slice(&buffer[..n]);
                    // A length that is not a number counts as no body.
                    if common::http_message_is_whole(&request).unwrap_or(true) {
                        break;
                    }
                }
                let text = String::from_utf8_lossy(&request).to_string();
                let line = text.lines().next().unwrap_or_default().to_owned();
                let path = line.split(' ').nth(1).unwrap_or_default().to_owned();
                let status = match path.split('?').next().unwrap_or_default() {
                    "/ok" => "204 No Content",
                    "/500" => "500 Internal Server Error",
                    _ => "400 Bad Request",
                };
                let body = format!("refused {line}");
                let _ = write!(
                    stream,
                    "HTTP/1.1 {status}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
            });
        }
    });
    port
}

/// A GET by hand: the whole answer, or `None` while nothing listens.
fn get(port: u16, path: &str) -> Option<String> {
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n"
    )
    .ok()?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).ok()?;
    Some(answer)
}

/// A POST with a bearer token, by hand: the whole answer.
fn post(port: u16, path: &str, token: &str, body: &str) -> String {
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        stream,
        "POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer {token}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    answer
}

fn brokers_available() -> bool {
    broker_available("RabbitMQ", "127.0.0.1:5672", "rabbitmq-server -detached")
}

#[test]
fn no_secret_of_any_sink_or_source_reaches_logs_endpoints_dead_letters_or_check_config() {
    if !brokers_available() {
        return;
    }
    let Some(nats) = PrivateNats::start(&["--user", "relay", "--pass", "NATS-OK-S3CRET"]) else {
        return;
    };
    let closed = free_port(); // nothing listens here
    let hook = webhook_receiver();
    let listen = free_port();
    let dir = tempfile::tempdir().unwrap();
    let sim = SimProcess::start(&common::scenario_file(dir.path(), SCENARIO), 1.0);
    let prefix = unique("secrets");
    let sinks = format!(
        r#"
[identity]
vm_name = "WestNO_0"

[telemetry]
listen = "127.0.0.1:{listen}"

[delivery]
retry_initial = "100ms"
retry_max = "500ms"

[[sinks]]
name = "nats-down"
kind = "nats"
url = "nats://relay:NATS-DOWN-S3CRET@127.0.0.1:{closed}"
subject = "{prefix}.{{vmname}}"

[[sinks]]
name = "nats-token-down"
kind = "nats"
url = "nats://NATS-T0KEN-IN-URL@127.0.0.1:{closed}"
subject = "{prefix}.{{vmname}}"

[[sinks]]
name = "nats-ok"
kind = "nats"
url = "{nats_url}"
user = "relay"
password = "NATS-OK-S3CRET"
subject = "{prefix}.{{vmname}}"

[[sinks]]
name = "amqp-refused"
kind = "amqp"
url = "amqp://guest:AMQP-WRONG-S3CRET@127.0.0.1:5672/%2f"
exchange = "amq.topic"
declare = false

[[sinks]]
name = "amqp-down"
kind = "amqp"
url = "amqp://relay:AMQP-DOWN-S3CRET@127.0.0.1:{closed}/%2f"
exchange = "amq.topic"

[[sinks]]
name = "kafka-down"
kind = "kafka"
brokers = "127.0.0.1:{closed}"
topic = "{prefix}"
security_protocol = "sasl_plaintext"
sasl_mechanism = "PLAIN"
sasl_username = "relay"
sasl_password = "KAFKA-SASL-S3CRET"
timeout = "1s"

[[sinks]]
name = "hook-500"
kind = "webhook"
url = "http://127.0.0.1:{hook}/500?sig=HOOK-500-T0KEN&sv=1.0"
hmac_key = "HOOK-HMAC-S3CRET"

[[sinks]]
name = "hook-400"
kind = "webhook"
url = "http://127.0.0.1:{hook}/400?api-version=2016-10-01&sig=HOOK-400-T0KEN#HOOK-FRAGMENT-T0KEN"

[[sinks]]
name = "hook-down"
kind = "webhook"
url = "http://127.0.0.1:{closed}/x?sig=HOOK-DOWN-T0KEN"

[[sinks]]
name = "hook-ok"
kind = "webhook"
url = "http://127.0.0.1:{hook}/ok?sig=HOOK-OK-T0KEN"

[[sinks]]
name = "drain"
kind = "exec"
command = ["/bin/sh", "-c", "echo refusing >&2; exit 3"]
env = {{ DRAIN_TOKEN = "EXEC-ENV-S3CRET" }}

[[approvals.keys]]
id = "orchestrator-hmac"
algorithm = "hmac-sha256"
secret = "APPROVAL-HMAC-S3CRET"

[approvals.http]
token = "HTTP-BEARER-T0KEN"

[approvals.nats]
connection = {{ url = "nats://relay:SRC-NATS-S3CRET@127.0.0.1:{closed}" }}
subject = "{prefix}.approvals.{{vmname}}"

[approvals.amqp]
connection = {{ url = "amqp://relay:SRC-AMQP-S3CRET@127.0.0.1:{closed}/%2f" }}
queue = "{prefix}.approvals"

[approvals.kafka]
connection = {{ brokers = "127.0.0.1:{closed}", security_protocol = "sasl_plaintext", sasl_mechanism = "PLAIN", sasl_username = "relay", sasl_password = "SRC-KAFKA-S3CRET" }}
topic = "{prefix}.approvals"
"#,
        nats_url = nats.url(),
    );
    // Even the metadata endpoint: the agent logs it at start, and no sink redacts that line.
    let endpoint = sim.url.replace("http://", "http://imds:IMDS-S3CRET@");
    let mut agent = AgentProcess::start(&endpoint, &sinks);
    let dead_letters = agent.dir.path().join("state/dead-letter");

    // Let every sink fail (and the good ones succeed) and the dead letters be written.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let hook_400 = std::fs::read_to_string(dead_letters.join("hook-400.jsonl"));
        let drain = std::fs::read_to_string(dead_letters.join("drain.jsonl"));
        let readyz = get(listen, "/readyz").unwrap_or_default();
        let failing = [
            "nats-down",
            "nats-token-down",
            "amqp-refused",
            "amqp-down",
            "hook-500",
            "hook-down",
        ]
        .iter()
        .all(|sink| readyz.contains(&format!("sink {sink} is failing")));
        if hook_400.is_ok() && drain.is_ok() && failing {
            break;
        }
        assert!(agent.is_running(), "the agent exited:\n{}", agent.log());
        assert!(
            Instant::now() < deadline,
            "the sinks did not all fail as set up: {readyz}\n{}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // The approval listener, with its token and a forged request in it.
    let answer = post(
        listen,
        "/approvals",
        "HTTP-BEARER-T0KEN",
        r#"{"StartRequests":[{"EventId":"5ec0e700-0000-4000-8000-000000000001"}]}"#,
    );
    assert!(answer.starts_with("HTTP/1.1 4"), "{answer}");
    // A few retries more, so every retry path has logged.
    std::thread::sleep(Duration::from_secs(2));

    let readyz = get(listen, "/readyz").unwrap();
    let events = get(listen, "/events").unwrap();
    let metrics = get(listen, "/metrics").unwrap();
    let mut dead_letter_text = String::new();
    for entry in std::fs::read_dir(&dead_letters).unwrap() {
        dead_letter_text += &std::fs::read_to_string(entry.unwrap().path()).unwrap();
    }
    let config = agent.dir.path().join("config.toml");
    let check = std::process::Command::new(BINARY)
        .args(["check-config", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    assert!(check.status.success(), "{check:?}");
    let check_config = String::from_utf8_lossy(&check.stdout).into_owned();
    // A refused configuration quotes the value it refuses.
    let broken = dir.path().join("broken.toml");
    std::fs::write(
        &broken,
        std::fs::read_to_string(&config).unwrap()
            + "\n[[sinks]]\nname = \"broken\"\nkind = \"webhook\"\nurl = \"ftp://relay:CONFIG-ERROR-S3CRET@host/x\"\n",
    )
    .unwrap();
    let refused = std::process::Command::new(BINARY)
        .args(["check-config", "--config"])
        .arg(&broken)
        .output()
        .unwrap();
    assert_eq!(refused.status.code(), Some(2), "{refused:?}");
    let config_error = String::from_utf8_lossy(&refused.stderr).into_owned();
    let log = agent.log();
    // What the sinks were given (approval outcomes included), as the file sink wrote it.
    let published = std::fs::read_to_string(&agent.events_file).unwrap_or_default();
    if std::env::var_os("SECRETS_TEST_DUMP").is_some() {
        eprintln!("{log}\n{readyz}\n{events}\n{dead_letter_text}\n{check_config}\n{config_error}");
    }
    drop(agent);

    // The messages are there, with their URLs redacted, so the check below means something.
    assert!(
        readyz.contains("127.0.0.1:") && readyz.contains("redacted"),
        "{readyz}"
    );
    assert!(events.contains("lastError"), "{events}");
    for working in ["nats-ok", "hook-ok"] {
        assert!(!readyz.contains(&format!("sink {working} ")), "{readyz}");
    }
    assert!(
        dead_letter_text.contains("answered 400"),
        "{dead_letter_text}"
    );
    assert!(check_config.contains("hook-ok"), "{check_config}");
    assert!(
        config_error.contains("is not an http(s) URL"),
        "{config_error}"
    );
    for (what, text) in [
        ("the agent's log", &log),
        ("/readyz", &readyz),
        ("/events", &events),
        ("/metrics", &metrics),
        ("the dead-letter files", &dead_letter_text),
        ("the published events", &published),
        ("check-config", &check_config),
        ("check-config's errors", &config_error),
    ] {
        for secret in SECRETS {
            assert!(
                !text.contains(secret),
                "{secret} appears in {what}:\n{}",
                text.lines()
                    .filter(|l| l.contains(secret))
                    .collect::<Vec<_>>()
                    .join("\n")
            );
        }
    }
}
