//! The demo's NATS: the server at `NATS_URL`, or a `nats-server -js` of its own on a free
//! loopback port with a store in the run's directory (stopped on every way out: the end, an
//! error, a panic, Ctrl-C, a second Ctrl-C), or a clear message saying how to get one. On a
//! server it did not start, the demo makes its streams under names of its own and deletes
//! them at the end.

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sched_relay_transport::redact;

/// How long `nats-server` may take to listen.
const SERVER_START: Duration = Duration::from_secs(10);

/// The `nats-server` this demo started: killed (and reaped) when dropped, or by
/// [`Server::kill`] from a signal handler.
#[derive(Clone)]
pub struct Server {
    child: Arc<Mutex<Option<Child>>>,
    pub pid: u32,
}

impl Server {
    /// Kills the server if it still runs; safe to call more than once.
    pub fn kill(&self) {
        let taken = self
            .child
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take();
        if let Some(mut child) = taken {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Kills the server once the last handle is gone.
pub struct ServerGuard(pub Server);

impl Drop for ServerGuard {
    fn drop(&mut self) {
        self.0.kill();
    }
}

/// Where the demo's NATS is, and whether the demo owns it.
pub struct Nats {
    pub url: String,
    pub server: Option<ServerGuard>,
}

/// Why there is no NATS to run the demo on.
#[derive(Debug, thiserror::Error)]
pub enum NatsError {
    #[error(
        "the fleet demo needs a NATS server with JetStream, and NATS_URL is not set and nats-server is not on the PATH.\n  Either install nats-server (Debian and Ubuntu: sudo apt install nats-server; elsewhere the release binary from https://github.com/nats-io/nats-server/releases) and run the demo again: it starts one of its own on a free loopback port and stops it at the end;\n  or point it at a server you run: NATS_URL=nats://127.0.0.1:4222 sched-relay demo --fleet (start one with: nats-server -js)"
    )]
    NotInstalled,
    #[error("cannot start {binary}: {error}")]
    Spawn {
        binary: String,
        error: std::io::Error,
    },
    #[error("nats-server did not start ({why}); the end of its log:\n{tail}")]
    ServerFailed { why: String, tail: String },
    #[error(
        "NATS_URL={url} is not a NATS URL: expected nats://host:4222 or tls://host:4222 (several separated by commas)"
    )]
    NotAUrl { url: String },
    #[error(
        "cannot reach NATS at NATS_URL={url}: {error} (is a server running there? unset NATS_URL to let the demo start its own nats-server)"
    )]
    Unreachable { url: String, error: String },
    #[error(
        "NATS at {url} refused the demo's JetStream stream {stream}: {error} (the demo needs JetStream: start the server with -js)"
    )]
    Stream {
        url: String,
        stream: String,
        error: String,
    },
}

/// The server at `NATS_URL` (not contacted yet), or one started in `dir`.
pub async fn find_or_start(nats_url: Option<String>, dir: &Path) -> Result<Nats, NatsError> {
    if let Some(url) = nats_url.filter(|u| !u.trim().is_empty()) {
        // What the agents' and the coordinator's configurations will accept.
        let usable = url.split(',').all(|server| {
            url::Url::parse(server.trim())
                .is_ok_and(|u| matches!(u.scheme(), "nats" | "tls") && u.has_host())
        });
        if !usable {
            return Err(NatsError::NotAUrl {
                url: redact::text(&url).into_owned(),
            });
        }
        return Ok(Nats { url, server: None });
    }
    let binary = "nats-server";
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|error| NatsError::Spawn {
            binary: binary.into(),
            error,
        })?;
    let store = dir.join("nats");
    let log = dir.join("nats-server.log");
    let log_file = std::fs::File::create(&log).map_err(|error| NatsError::Spawn {
        binary: binary.into(),
        error,
    })?;
    let stderr = log_file.try_clone().map_err(|error| NatsError::Spawn {
        binary: binary.into(),
        error,
    })?;
    let mut command = Command::new(binary);
    command
        .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
        .arg(&store)
        .stdin(Stdio::null())
        .stdout(log_file)
        .stderr(stderr)
        // Its own process group: a Ctrl-C at the terminal reaches the demo, which stops
        // its agents and coordinator while the server is still up, then kills it.
        .process_group(0);
    // (A demo killed with SIGKILL, or ended by a `process::exit` of the coordinator it runs,
    // leaves the server running: its pid is printed, and it is in the run's directory. The
    // kernel could kill it with the demo (PR_SET_PDEATHSIG), but rustix's `process` feature
    // changes the hashes of the symbol names deploy/symbol-order.txt lists.)
    let spawned = command.spawn();
    let child = match spawned {
        Ok(child) => child,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            return Err(NatsError::NotInstalled);
        }
        Err(error) => {
            return Err(NatsError::Spawn {
                binary: binary.into(),
                error,
            });
        }
    };
    let server = Server {
        pid: child.id(),
        child: Arc::new(Mutex::new(Some(child))),
    };
    let guard = ServerGuard(server.clone());
    let failed = |why: String| NatsError::ServerFailed {
        why,
        tail: log_tail(&log),
    };
    let deadline = Instant::now() + SERVER_START;
    loop {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            break;
        }
        let exited = server
            .child
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .as_mut()
            .and_then(|child| child.try_wait().ok().flatten());
        if let Some(status) = exited {
            return Err(failed(format!("it exited with {status}")));
        }
        if Instant::now() > deadline {
            drop(guard);
            return Err(failed(format!(
                "it did not listen on 127.0.0.1:{port} within {} s; stopped",
                SERVER_START.as_secs()
            )));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(Nats {
        url: format!("nats://127.0.0.1:{port}"),
        server: Some(guard),
    })
}

/// The last lines of a log file.
fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    let tail = lines[lines.len().saturating_sub(15)..].join("\n");
    if tail.trim().is_empty() {
        "(empty)".into()
    } else {
        tail
    }
}

/// Connects (a few seconds at most) and creates the run's two streams: the agents' events
/// and their approvals.
pub async fn streams(
    url: &str,
    streams: &[(String, String)],
) -> Result<async_nats::jetstream::Context, NatsError> {
    let shown = redact::text(url).into_owned();
    let client = async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(5))
        .connect(url)
        .await
        .map_err(|error| NatsError::Unreachable {
            url: shown.clone(),
            error: redact::text(&error.to_string()).into_owned(),
        })?;
    let jetstream = async_nats::jetstream::new(client);
    for (made, (name, subjects)) in streams.iter().enumerate() {
        let config = async_nats::jetstream::stream::Config {
            name: name.clone(),
            subjects: vec![subjects.clone()],
            // What a killed run leaves on a shared server does not pile up: its messages go
            // by themselves (the empty streams stay until removed).
            max_age: Duration::from_secs(3600),
            ..Default::default()
        };
        let created =
            tokio::time::timeout(Duration::from_secs(10), jetstream.create_stream(config)).await;
        let (error, ours) = match created {
            Ok(Ok(_)) => continue,
            Ok(Err(error)) => (error.to_string(), made),
            // The server may have made it after all.
            Err(_) => ("no answer within 10 s".to_owned(), made + 1),
        };
        // The streams this run made go with the failed run.
        let names: Vec<&str> = streams[..ours].iter().map(|(n, _)| n.as_str()).collect();
        delete(&jetstream, &names).await;
        return Err(NatsError::Stream {
            url: shown.clone(),
            stream: name.clone(),
            error,
        });
    }
    Ok(jetstream)
}

/// Deletes the run's streams (and with them its consumers) from a server the demo shares.
pub async fn delete(jetstream: &async_nats::jetstream::Context, names: &[&str]) -> Vec<String> {
    let mut left = Vec::new();
    for name in names {
        let deleted =
            tokio::time::timeout(Duration::from_secs(5), jetstream.delete_stream(*name)).await;
        if !matches!(deleted, Ok(Ok(_))) {
            left.push((*name).to_owned());
        }
    }
    left
}
