//! The webhook sink against a local HTTP server that answers as scripted: 200, 429 with
//! Retry-After, 500, slow, 400 and a redirect, and records what it received.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use cloudevents::{AttributesReader, Event};
use sched_relay_transport::Sink;
use sched_relay_transport::binding::ContentMode;
use sched_relay_transport::testing::live_migration_events;
use sched_relay_webhook::{WebhookSink, WebhookSinkConfig, signature};

#[derive(Clone)]
enum Answer {
    Status(u16),
    RetryAfter(u16, &'static str),
    Slow(Duration),
    Redirect,
}

#[derive(Clone, Default)]
struct Server {
    script: Arc<Mutex<VecDeque<Answer>>>,
    received: Arc<Mutex<Vec<(HeaderMap, Bytes)>>>,
}

impl Server {
    async fn start(script: Vec<Answer>) -> (Server, String) {
        let server = Server {
            script: Arc::new(Mutex::new(script.into())),
            ..Server::default()
        };
        let state = server.clone();
        let app = axum::Router::new().fallback(move |headers: HeaderMap, body: Bytes| {
            let state = state.clone();
            async move {
                state.received.lock().unwrap().push((headers, body));
                let answer = state
                    .script
                    .lock()
                    .unwrap()
                    .pop_front()
                    .unwrap_or(Answer::Status(200));
                let response: Response = match answer {
                    Answer::Status(code) => (
                        StatusCode::from_u16(code).unwrap(),
                        format!("answer {code}"),
                    )
                        .into_response(),
                    Answer::RetryAfter(code, after) => (
                        StatusCode::from_u16(code).unwrap(),
                        [("retry-after", after)],
                        "slow down",
                    )
                        .into_response(),
                    Answer::Slow(delay) => {
                        tokio::time::sleep(delay).await;
                        StatusCode::OK.into_response()
                    }
                    Answer::Redirect => (
                        StatusCode::MOVED_PERMANENTLY,
                        [("location", "http://elsewhere.invalid/")],
                    )
                        .into_response(),
                };
                response
            }
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/events", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        (server, url)
    }

    fn received(&self) -> Vec<(HeaderMap, Bytes)> {
        self.received.lock().unwrap().clone()
    }
}

fn config(url: &str) -> WebhookSinkConfig {
    let mut config: WebhookSinkConfig = toml::from_str(&format!("url = \"{url}\"")).unwrap();
    config.timeout = Duration::from_millis(500);
    config
}

fn decode(headers: &HeaderMap, body: &Bytes) -> Event {
    cloudevents::binding::http::to_event(headers, body.to_vec()).unwrap()
}

#[tokio::test]
async fn each_event_is_posted_in_order_in_binary_mode_and_decodes_with_the_sdk() {
    let (server, url) = Server::start(vec![]).await;
    let sink = WebhookSink::new(config(&url));
    sink.health_check().await.unwrap();
    let events = live_migration_events("WestNO_0");
    sink.deliver(&events).await.unwrap();
    let received = server.received();
    assert_eq!(received.len(), events.len());
    let (headers, _) = &received[1];
    for name in [
        "ce-specversion",
        "ce-id",
        "ce-source",
        "ce-type",
        "ce-subject",
        "ce-time",
        "ce-incarnation",
        "ce-affectsvm",
    ] {
        assert!(headers.contains_key(name), "{name} missing");
    }
    assert_eq!(headers["content-type"], "application/json");
    for ((headers, body), sent) in received.iter().zip(&events) {
        let got = decode(headers, body);
        assert_eq!(
            (got.id(), got.ty(), got.source(), got.time()),
            (sent.id(), sent.ty(), sent.source(), sent.time())
        );
        for (name, value) in sent.iter_extensions() {
            assert_eq!(
                got.extension(name).map(|v| v.to_string()),
                Some(value.to_string())
            );
        }
    }
}

#[tokio::test]
async fn structured_and_batch_modes_carry_whole_events() {
    let (server, url) = Server::start(vec![]).await;
    let events = live_migration_events("WestNO_0");
    let mut structured = config(&url);
    structured.content_mode = Some(ContentMode::Structured);
    WebhookSink::new(structured)
        .deliver(&events[..2])
        .await
        .unwrap();
    let mut batch = config(&url);
    batch.batch = true;
    WebhookSink::new(batch).deliver(&events).await.unwrap();

    let received = server.received();
    assert_eq!(received.len(), 3, "two structured requests, then one batch");
    assert!(
        received[0].0["content-type"]
            .to_str()
            .unwrap()
            .starts_with("application/cloudevents+json")
    );
    assert_eq!(decode(&received[0].0, &received[0].1), events[0]);
    assert!(
        received[2].0["content-type"]
            .to_str()
            .unwrap()
            .starts_with("application/cloudevents-batch+json")
    );
    let decoded: Vec<Event> = serde_json::from_slice(&received[2].1).unwrap();
    assert_eq!(decoded, events);
}

#[tokio::test]
async fn too_many_requests_asks_for_the_wait_the_server_gave() {
    let (_server, url) = Server::start(vec![
        Answer::RetryAfter(429, "7"),
        Answer::RetryAfter(503, "2"),
    ])
    .await;
    let sink = WebhookSink::new(config(&url));
    let events = live_migration_events("vm");
    let error = sink.deliver(&events[..1]).await.unwrap_err();
    assert_eq!(error.retry_after(), Some(Duration::from_secs(7)), "{error}");
    let error = sink.deliver(&events[..1]).await.unwrap_err();
    assert_eq!(error.retry_after(), Some(Duration::from_secs(2)), "{error}");
    sink.deliver(&events[..1]).await.unwrap();
}

#[tokio::test]
async fn server_errors_and_timeouts_are_retried_but_client_errors_are_not() {
    let (_server, url) = Server::start(vec![
        Answer::Status(500),
        Answer::Slow(Duration::from_secs(2)),
        Answer::Status(400),
        Answer::Redirect,
    ])
    .await;
    let sink = WebhookSink::new(config(&url));
    let one = &live_migration_events("vm")[..1];

    let error = sink.deliver(one).await.unwrap_err();
    assert!(
        error.is_retriable() && error.to_string().contains("500"),
        "{error}"
    );
    let error = sink.deliver(one).await.unwrap_err();
    assert!(
        error.is_retriable() && error.to_string().contains("timed out"),
        "{error}"
    );
    let error = sink.deliver(one).await.unwrap_err();
    assert!(!error.is_retriable(), "{error}");
    assert!(
        error.to_string().contains("400") && error.to_string().contains("answer 400"),
        "the reason is kept: {error}"
    );
    let error = sink.deliver(one).await.unwrap_err();
    assert!(
        !error.is_retriable() && error.to_string().contains("redirects are not followed"),
        "{error}"
    );
}

#[tokio::test]
async fn bodies_are_signed_and_custom_headers_and_token_are_sent() {
    let (server, url) = Server::start(vec![]).await;
    let mut config = config(&url);
    config.hmac_key = Some(sched_relay_transport::secret::Secret::new("shared-secret"));
    config.bearer_token = Some(sched_relay_transport::secret::Secret::new("tok"));
    config.headers.insert("X-Fleet".into(), "west".into());
    WebhookSink::new(config)
        .deliver(&live_migration_events("vm")[..2])
        .await
        .unwrap();
    for (headers, body) in server.received() {
        assert_eq!(
            headers["x-signature-256"],
            signature(b"shared-secret", &body)
        );
        assert_eq!(headers["authorization"], "Bearer tok");
        assert_eq!(headers["x-fleet"], "west");
    }
}

#[tokio::test]
async fn an_unreachable_endpoint_is_retriable_and_reported_by_the_health_check() {
    let port = sched_relay_transport::testing::free_port();
    let sink = WebhookSink::new(config(&format!("http://127.0.0.1:{port}/events")));
    let error = sink.health_check().await.unwrap_err();
    assert!(
        error.is_retriable() && error.to_string().contains("unreachable"),
        "{error}"
    );
    assert!(
        sink.deliver(&live_migration_events("vm")[..1])
            .await
            .unwrap_err()
            .is_retriable()
    );
}

/// A throw-away CA and an HTTPS server whose certificate it signed, for 127.0.0.1: every
/// connection gets the TLS handshake and a bare `200 OK`.
struct TlsServer {
    url: String,
    ca_pem: String,
}

impl TlsServer {
    async fn start() -> TlsServer {
        use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
        let ca_key = KeyPair::generate().unwrap();
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca_pem = ca_params.self_signed(&ca_key).unwrap().pem();
        let issuer = Issuer::new(ca_params, ca_key);
        let key = KeyPair::generate().unwrap();
        let certificate = CertificateParams::new(vec!["127.0.0.1".to_owned()])
            .unwrap()
            .signed_by(&key, &issuer)
            .unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(
                vec![certificate.der().clone()],
                rustls::pki_types::PrivateKeyDer::try_from(key.serialize_der()).unwrap(),
            )
            .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("https://{}/events", listener.local_addr().unwrap());
        tokio::spawn(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            while let Ok((stream, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(stream).await else {
                        return;
                    };
                    let mut request = vec![0u8; 65536];
                    let _ = tls.read(&mut request).await;
                    let _ = tls
                        .write_all(
                            b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
                        )
                        .await;
                    let _ = tls.shutdown().await;
                });
            }
        });
        TlsServer { url, ca_pem }
    }
}

#[tokio::test]
async fn the_health_check_fails_when_tls_cannot_verify_the_server_and_passes_with_its_ca() {
    let server = TlsServer::start().await;
    let dir = tempfile::tempdir().unwrap();

    // No ca_file: the platform's trust store does not know this CA. The health check says so
    // at start, not the first delivery.
    let untrusted = WebhookSink::new(config(&server.url));
    let error = untrusted.health_check().await.unwrap_err();
    // Retried, loudly: a server certificate is renewed without touching the agent.
    assert!(error.is_authentication(), "{error}");
    let error = error.to_string();
    assert!(error.contains("TLS failed"), "{error}");
    assert!(error.contains("not trusted"), "{error}");

    // Another CA's certificate is no better.
    let other = TlsServer::start().await;
    let wrong = dir.path().join("wrong-ca.pem");
    std::fs::write(&wrong, &other.ca_pem).unwrap();
    let mut wrong_ca = config(&server.url);
    wrong_ca.ca_file = Some(wrong);
    let error = WebhookSink::new(wrong_ca)
        .health_check()
        .await
        .unwrap_err()
        .to_string();
    assert!(error.contains("TLS failed"), "{error}");

    // The CA that signed it: ready, and deliveries go through with the same trust.
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, &server.ca_pem).unwrap();
    let mut trusted = config(&server.url);
    trusted.ca_file = Some(ca);
    let sink = WebhookSink::new(trusted);
    sink.health_check().await.unwrap();
    sink.deliver(&live_migration_events("vm0")[..1])
        .await
        .unwrap();
}

#[tokio::test]
async fn a_ca_file_without_certificates_is_reported_as_such() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("empty.pem");
    std::fs::write(&path, "not a certificate").unwrap();
    let mut broken = config("https://127.0.0.1:1/events");
    broken.ca_file = Some(path);
    let error = WebhookSink::new(broken)
        .health_check()
        .await
        .unwrap_err()
        .to_string();
    assert!(error.contains("holds no PEM certificate"), "{error}");
}

#[tokio::test]
async fn a_refused_token_holds_the_events_instead_of_dead_lettering_them() {
    // The receiver's token rotated before ours: 401, 403 (and 407 from a proxy) are about the
    // credential, the same for every event.
    let (_server, url) = Server::start(vec![
        Answer::Status(401),
        Answer::Status(403),
        Answer::Status(407),
    ])
    .await;
    let sink = WebhookSink::new(config(&url));
    let one = &live_migration_events("vm")[..1];
    for status in ["401", "403", "407"] {
        let error = sink.deliver(one).await.unwrap_err();
        assert!(
            error.is_retriable() && error.error.is_authentication(),
            "{status}: {error}"
        );
        assert!(error.to_string().contains(status), "{error}");
    }
}

#[tokio::test]
async fn a_token_file_missing_at_start_holds_the_events_instead_of_dead_lettering_them() {
    let (_server, url) = Server::start(vec![]).await;
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(&url);
    config.bearer_token_file = Some(dir.path().join("token"));
    let sink = WebhookSink::new(config);
    assert!(sink.health_check().await.is_err());
    let error = sink
        .deliver(&live_migration_events("vm")[..1])
        .await
        .unwrap_err();
    assert!(error.is_retriable(), "{error}");
    assert!(error.to_string().contains("bearer_token"), "{error}");
}

/// Whether Python's `standardwebhooks` package is importable; under CI it must be
/// (`scripts/test` installs it).
fn standardwebhooks_available() -> bool {
    let found = std::process::Command::new("python3")
        .args(["-c", "import standardwebhooks"])
        .output()
        .is_ok_and(|output| output.status.success());
    if !found {
        assert!(
            std::env::var_os("CI").is_none(),
            "the standardwebhooks Python package is missing (python3 -m pip install standardwebhooks==1.1.0)"
        );
        eprintln!("SKIPPED: python3 -m pip install standardwebhooks==1.1.0 to run this test");
    }
    found
}

#[tokio::test]
async fn signed_requests_verify_with_the_standard_webhooks_library_and_tampering_does_not() {
    if !standardwebhooks_available() {
        return;
    }
    let (server, url) = Server::start(vec![]).await;
    let secret = "whsec_c2NoZWQtcmVsYXktdGVzdC1rZXktMDEyMzQ1Njc4OWFi";
    let mut config = config(&url);
    config.hmac_key = Some(sched_relay_transport::secret::Secret::new(secret));
    // No content_mode: signed requests are structured, so the signature covers every
    // attribute (type, source, time), not only data.
    let sink = WebhookSink::new(config);
    // Two VMs report the same Azure event (it lists both) under the same CloudEvents ids.
    let events: Vec<_> = live_migration_events("vm")
        .into_iter()
        .take(2)
        .chain(live_migration_events("WestNO_1").into_iter().take(2))
        .collect();
    sink.deliver(&events).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let received = server.received();
    assert_eq!(received.len(), 4);
    let ids: std::collections::BTreeSet<_> = received
        .iter()
        .map(|(headers, _)| headers["webhook-id"].clone())
        .collect();
    assert_eq!(
        ids.len(),
        4,
        "a receiver de-duplicating on webhook-id keeps every VM's events: {ids:?}"
    );
    for ((headers, body), event) in received.iter().zip(&events) {
        assert_eq!(
            headers["webhook-id"],
            event.message_id(),
            "webhook-id is the CloudEvents source and id"
        );
        assert!(
            headers["content-type"]
                .to_str()
                .unwrap()
                .starts_with("application/cloudevents+json")
        );
        let file = dir.path().join("body");
        std::fs::write(&file, body).unwrap();
        let output = std::process::Command::new("python3")
            .arg(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/tests/verify_standard_webhook.py"
            ))
            .arg(secret)
            .arg(&file)
            .arg(headers["webhook-id"].to_str().unwrap())
            .arg(headers["webhook-timestamp"].to_str().unwrap())
            .arg(headers["webhook-signature"].to_str().unwrap())
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
}
