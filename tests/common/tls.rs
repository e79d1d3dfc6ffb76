//! Real TLS servers for the TLS tests, from throw-away certificate authorities made at run
//! time: nats-server with TLS (and with client certificates required), a RabbitMQ node of the
//! test's own with an `amqps` listener, and a rustls terminator in front of a plain server
//! (tansu, whose 0.6.0 command line cannot enable its own TLS: `--cert` and `--key` conflict,
//! and an HTTP receiver for the webhook).

#![allow(dead_code)] // each test binary uses a different part of this module

use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rcgen::{BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// The files of a throw-away public-key infrastructure: `ca` signed the server certificate
/// (for 127.0.0.1 only, so `localhost` is a wrong host name) and the client certificate;
/// `other_ca` signed nothing the servers present, and `stranger` is a client certificate of
/// `other_ca`, which servers that verify clients refuse.
pub struct Pki {
    pub ca: PathBuf,
    pub other_ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
    pub stranger_cert: PathBuf,
    pub stranger_key: PathBuf,
}

/// A CA named `name`: two test CAs with one name would make a wrong CA look like a
/// forged signature instead of an unknown issuer.
fn authority(name: &str) -> (String, Issuer<'static, KeyPair>) {
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, name);
    let pem = params.self_signed(&key).unwrap().pem();
    (pem, Issuer::new(params, key))
}

fn leaf(
    issuer: &Issuer<'static, KeyPair>,
    names: &[&str],
    usage: ExtendedKeyUsagePurpose,
) -> (String, String) {
    let key = KeyPair::generate().unwrap();
    let mut params =
        CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>()).unwrap();
    params.extended_key_usages = vec![usage];
    params.distinguished_name.push(
        rcgen::DnType::CommonName,
        names.first().copied().unwrap_or("client"),
    );
    (
        params.signed_by(&key, issuer).unwrap().pem(),
        key.serialize_pem(),
    )
}

impl Pki {
    /// Writes a new infrastructure into `dir`.
    pub fn generate(dir: &Path) -> Pki {
        let (ca_pem, ca) = authority("sched-relay test CA");
        let (other_pem, other) = authority("another CA");
        let (server_pem, server_key) =
            leaf(&ca, &["127.0.0.1"], ExtendedKeyUsagePurpose::ServerAuth);
        let (client_pem, client_key) =
            leaf(&ca, &["sched-relay"], ExtendedKeyUsagePurpose::ClientAuth);
        let (stranger_pem, stranger_key) =
            leaf(&other, &["stranger"], ExtendedKeyUsagePurpose::ClientAuth);
        let write = |name: &str, text: &str| {
            let path = dir.join(name);
            std::fs::write(&path, text).unwrap();
            path
        };
        Pki {
            ca: write("ca.pem", &ca_pem),
            other_ca: write("other-ca.pem", &other_pem),
            server_cert: write("server.pem", &server_pem),
            server_key: write("server.key", &server_key),
            client_cert: write("client.pem", &client_pem),
            client_key: write("client.key", &client_key),
            stranger_cert: write("stranger.pem", &stranger_pem),
            stranger_key: write("stranger.key", &stranger_key),
        }
    }

    /// A rustls server configuration with the server certificate; with `verify_clients`,
    /// a client certificate signed by `ca` is required.
    pub fn server_config(&self, verify_clients: bool) -> rustls::ServerConfig {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&self.server_cert)
            .unwrap()
            .map(|c| c.unwrap())
            .collect();
        let key = PrivateKeyDer::from_pem_file(&self.server_key).unwrap();
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .unwrap();
        let builder = if verify_clients {
            let mut roots = rustls::RootCertStore::empty();
            for certificate in CertificateDer::pem_file_iter(&self.ca).unwrap() {
                roots.add(certificate.unwrap()).unwrap();
            }
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots),
                provider,
            )
            .build()
            .unwrap();
            builder.with_client_cert_verifier(verifier)
        } else {
            builder.with_no_client_auth()
        };
        builder.with_single_cert(chain, key).unwrap()
    }
}

pub use sched_relay_transport::testing::free_port;

fn wait_for_port(port: u16, what: &str, child: &mut Child, log: &Path) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if let Ok(Some(status)) = child.try_wait() {
            panic!(
                "{what} exited ({status}) before listening on {port}:\n{}",
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        assert!(
            Instant::now() < deadline,
            "{what} is not listening on {port} after 60 s:\n{}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A nats-server of this test's own, TLS only, with JetStream; with `verify_clients`, every
/// client must present a certificate signed by the test CA.
pub struct NatsTls {
    child: Child,
    pub port: u16,
}

impl NatsTls {
    pub fn start(pki: &Pki, dir: &Path, verify_clients: bool) -> NatsTls {
        let port = free_port();
        let name = if verify_clients {
            "nats-mtls"
        } else {
            "nats-tls"
        };
        let config = dir.join(format!("{name}.conf"));
        std::fs::write(
            &config,
            format!(
                "listen: \"127.0.0.1:{port}\"\njetstream {{ store_dir: {store:?} }}\n\
                 tls {{\n  cert_file: {cert:?}\n  key_file: {key:?}\n  ca_file: {ca:?}\n  verify: {verify_clients}\n  timeout: 5\n}}\n",
                store = dir.join(format!("{name}-store")).display().to_string(),
                cert = pki.server_cert.display().to_string(),
                key = pki.server_key.display().to_string(),
                ca = pki.ca.display().to_string(),
            ),
        )
        .unwrap();
        let log = dir.join(format!("{name}.log"));
        let child = Command::new("nats-server")
            .arg("-c")
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("nats-server is installed (scripts/test installs it)");
        // In its guard first: a server that never listens is still killed.
        let mut server = NatsTls { child, port };
        wait_for_port(port, "nats-server", &mut server.child, &log);
        server
    }
}

impl Drop for NatsTls {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A RabbitMQ node of this test's own (its own name, ports, database and no plugins beside
/// the machine's broker), listening for `amqps` only. Clients that present a certificate
/// must present one of the test CA; clients without one are let in (guest, on loopback).
pub struct RabbitTls {
    child: Child,
    pub port: u16,
}

impl RabbitTls {
    pub fn start(pki: &Pki, dir: &Path) -> RabbitTls {
        let port = free_port();
        let home = dir.join("rabbitmq");
        std::fs::create_dir_all(&home).unwrap();
        let config = home.join("rabbitmq.conf");
        std::fs::write(
            &config,
            format!(
                "listeners.tcp = none\nlisteners.ssl.default = {port}\n\
                 ssl_options.cacertfile = {ca}\nssl_options.certfile = {cert}\nssl_options.keyfile = {key}\n\
                 ssl_options.verify = verify_peer\nssl_options.fail_if_no_peer_cert = false\n",
                ca = pki.ca.display(),
                cert = pki.server_cert.display(),
                key = pki.server_key.display(),
            ),
        )
        .unwrap();
        let plugins = home.join("enabled_plugins");
        std::fs::write(&plugins, "[].\n").unwrap();
        let env_file = home.join("rabbitmq-env.conf");
        std::fs::write(&env_file, "").unwrap();
        let log = home.join("server.log");
        // The node name must be unique on this machine's epmd; the distribution port too.
        let node = format!("sched-relay-tls-{}-{port}@localhost", std::process::id());
        let child = Command::new("/usr/lib/rabbitmq/bin/rabbitmq-server")
            .current_dir(&home)
            .env("HOME", &home)
            .env("RABBITMQ_NODENAME", &node)
            .env("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1")
            .env("RABBITMQ_DIST_PORT", free_port().to_string())
            .env("RABBITMQ_CONFIG_FILE", &config)
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", &plugins)
            .env("RABBITMQ_CONF_ENV_FILE", &env_file)
            .env("RABBITMQ_MNESIA_BASE", home.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", home.join("log"))
            .env("ERL_EPMD_ADDRESS", "127.0.0.1")
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .expect("rabbitmq-server is installed (scripts/test installs it)");
        // In its guard first: a node that never listens is still stopped.
        let mut node = RabbitTls { child, port };
        wait_for_port(port, "the test's RabbitMQ node", &mut node.child, &log);
        node
    }
}

impl Drop for RabbitTls {
    fn drop(&mut self) {
        // The node's Erlang VM and its helpers (epmd is the machine's and stays) are one
        // process group.
        unsafe {
            libc::killpg(self.child.id() as i32, libc::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        unsafe {
            libc::killpg(self.child.id() as i32, libc::SIGKILL);
        }
        let _ = self.child.wait();
    }
}

/// A TLS server (rustls) on a port of its own that forwards each connection, decrypted, to
/// `upstream`: real TLS in front of a plain server that cannot do it itself.
pub struct TlsTerminator {
    pub port: u16,
    runtime: Option<tokio::runtime::Runtime>,
}

impl TlsTerminator {
    pub fn start(config: rustls::ServerConfig, upstream: u16) -> TlsTerminator {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let port = listener.local_addr().unwrap().port();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        runtime.spawn(async move {
            loop {
                let Ok((socket, _)) = listener.accept().await else {
                    continue;
                };
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    // A refused handshake (wrong client certificate) just closes the socket.
                    let Ok(mut tls) = acceptor.accept(socket).await else {
                        return;
                    };
                    let Ok(mut plain) =
                        tokio::net::TcpStream::connect(("127.0.0.1", upstream)).await
                    else {
                        return;
                    };
                    let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
                });
            }
        });
        TlsTerminator {
            port,
            runtime: Some(runtime),
        }
    }
}

impl Drop for TlsTerminator {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// A plain HTTP receiver that answers 200 to every POST and counts them.
pub struct Receiver {
    pub port: u16,
    pub posts: Arc<std::sync::atomic::AtomicUsize>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl Receiver {
    pub fn start() -> Receiver {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let port = listener.local_addr().unwrap().port();
        let posts = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = posts.clone();
        let app = axum::Router::new().fallback(move |method: axum::http::Method| {
            let counted = counted.clone();
            async move {
                if method == axum::http::Method::POST {
                    counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                }
                "ok"
            }
        });
        runtime.spawn(async move { axum::serve(listener, app).await });
        Receiver {
            port,
            posts,
            runtime: Some(runtime),
        }
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// One HTTPS request to 127.0.0.1:`port`, trusting only `ca_pem`: the raw response.
pub fn https(port: u16, ca_pem: &str, request: &[u8]) -> Result<String, String> {
    use std::io::{Read, Write};
    let mut roots = rustls::RootCertStore::empty();
    for certificate in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(certificate.unwrap()).unwrap();
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let connection =
        rustls::ClientConnection::new(Arc::new(config), "127.0.0.1".try_into().unwrap()).unwrap();
    let socket = std::net::TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
    socket
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut tls = rustls::StreamOwned::new(connection, socket);
    tls.write_all(request).map_err(|e| e.to_string())?;
    let mut response = Vec::new();
    match tls.read_to_end(&mut response) {
        Ok(_) => {}
        // Servers close without close_notify at times: what was read is the answer.
        Err(error) if !response.is_empty() => eprintln!("after the response: {error}"),
        Err(error) => return Err(error.to_string()),
    }
    Ok(String::from_utf8_lossy(&response).into_owned())
}
