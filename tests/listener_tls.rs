//! The approval listener over HTTPS (`[telemetry] tls_cert_file`/`tls_key_file`): an
//! orchestrator that POSTs approvals across a network talks to it through TLS with a
//! certificate it trusts; a plain-HTTP client and a client that does not trust the
//! certificate get nothing; a bad certificate file is a clear configuration error.

mod common;
#[path = "common/tls.rs"]
mod tls;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::{AgentProcess, BINARY, SimProcess};
use sched_relay_core::approval::{Draft, SigningKey};

const EVENT: &str = "f0000000-0000-4000-8000-0000000000cc";
const SECRET: &str = "listener-tls-secret-0001";
const SCENARIO: &str = r#"
[[events]]
id = "f0000000-0000-4000-8000-0000000000cc"
type = "Freeze"
resources = ["WestNO_0"]
notice = "1h"
"#;

#[test]
fn approvals_over_https_go_through_and_plain_or_untrusting_clients_get_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let pki = tls::Pki::generate(dir.path());
    let ca = std::fs::read_to_string(&pki.ca).unwrap();
    let sim = SimProcess::start(&common::scenario_file(dir.path(), SCENARIO), 1.0);
    let port = sched_relay_transport::testing::free_port();
    let agent = AgentProcess::start(
        &sim.url,
        &format!(
            "[telemetry]\nlisten = \"127.0.0.1:{port}\"\ntls_cert_file = {:?}\ntls_key_file = {:?}\n\
             [identity]\nvm_name = \"WestNO_0\"\n[approvals.http]\n[[approvals.keys]]\n\
             id = \"orchestrator\"\nalgorithm = \"hmac-sha256\"\nsecret = \"{SECRET}\"\n",
            pki.server_cert.display().to_string(),
            pki.server_key.display().to_string(),
        ),
    );
    agent.wait_for_id(&format!("{EVENT}:scheduled"), Duration::from_secs(20));

    let health = tls::https(
        port,
        &ca,
        b"GET /healthz HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n",
    )
    .unwrap();
    assert!(health.starts_with("HTTP/1.1 200"), "{health}");

    let key = SigningKey::parse(&format!("hmac-sha256:{SECRET}")).unwrap();
    let draft = Draft::new(
        "urn:orchestrator:test",
        Some("WestNO_0"),
        vec![EVENT.into()],
    );
    let body = serde_json::to_vec(&draft.event(Some(("orchestrator", &key)))).unwrap();
    let mut request = format!(
        "POST /approvals HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\
         content-type: application/cloudevents+json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    request.extend_from_slice(&body);
    let answer = tls::https(port, &ca, &request).unwrap();
    assert!(
        answer.starts_with("HTTP/1.1 200") && answer.contains("accepted"),
        "{answer}\n{}",
        agent.log()
    );

    // Plain HTTP: no HTTP answer at all.
    let mut plain = TcpStream::connect(("127.0.0.1", port)).unwrap();
    plain
        .set_read_timeout(Some(Duration::from_secs(15)))
        .unwrap();
    plain
        .write_all(b"GET /healthz HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
        .unwrap();
    let mut answer = Vec::new();
    let _ = plain.read_to_end(&mut answer);
    assert!(
        !String::from_utf8_lossy(&answer).contains("200 OK"),
        "plain HTTP was served"
    );

    // A client that trusts another CA refuses the listener's certificate.
    let other_ca = std::fs::read_to_string(&pki.other_ca).unwrap();
    let refused = tls::https(
        port,
        &other_ca,
        b"GET /healthz HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n",
    );
    assert!(refused.is_err(), "{refused:?}");
}

#[test]
fn a_listener_certificate_that_cannot_be_used_is_a_clear_configuration_error() {
    let dir = tempfile::tempdir().unwrap();
    // The server certificate with the client certificate's key: not a pair.
    let pki = tls::Pki::generate(dir.path());
    std::fs::copy(&pki.server_cert, dir.path().join("listener.pem")).unwrap();
    std::fs::copy(&pki.client_key, dir.path().join("other.key")).unwrap();
    for (tls, expected) in [
        (
            format!(
                "tls_cert_file = {:?}\ntls_key_file = {:?}\n",
                dir.path().join("listener.pem").display().to_string(),
                dir.path().join("other.key").display().to_string()
            ),
            "do not make a usable pair",
        ),
        (
            format!(
                "tls_cert_file = {:?}\ntls_key_file = {:?}\n",
                dir.path().join("missing.pem").display().to_string(),
                dir.path().join("other.key").display().to_string()
            ),
            "missing.pem",
        ),
        (
            format!(
                "tls_cert_file = {:?}\n",
                dir.path().join("listener.pem").display().to_string()
            ),
            "set both telemetry.tls_cert_file and telemetry.tls_key_file",
        ),
    ] {
        let config = dir.path().join("config.toml");
        std::fs::write(
            &config,
            format!("[telemetry]\nlisten = \"127.0.0.1:9464\"\n{tls}"),
        )
        .unwrap();
        let output = std::process::Command::new(BINARY)
            .args(["check-config", "--config"])
            .arg(&config)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{stderr}");
        assert!(
            stderr.contains("telemetry.tls_cert_file") && stderr.contains(expected),
            "{stderr}"
        );
    }
}
