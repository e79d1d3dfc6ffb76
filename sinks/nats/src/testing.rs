//! Helpers for tests that consume what the NATS sink published (this crate's tests and the
//! agent's end-to-end tests): JetStream streams, and nats-server instances a test owns.

use std::process::{Child, Command};

pub async fn create_stream(
    url: &str,
    name: &str,
    subjects: &str,
) -> async_nats::jetstream::stream::Stream {
    let client = async_nats::connect(url).await.unwrap();
    async_nats::jetstream::new(client)
        .create_stream(async_nats::jetstream::stream::Config {
            name: name.to_owned(),
            subjects: vec![subjects.to_owned()],
            ..Default::default()
        })
        .await
        .unwrap()
}

/// Deletes a stream [`create_stream`] made, with what it holds.
pub async fn delete_stream(url: &str, name: &str) {
    let client = async_nats::connect(url).await.unwrap();
    async_nats::jetstream::new(client)
        .delete_stream(name)
        .await
        .unwrap();
}

pub async fn stored_ids(stream: &async_nats::jetstream::stream::Stream, count: u64) -> Vec<String> {
    let mut ids = Vec::new();
    for sequence in 1..=count {
        let message = stream.get_raw_message(sequence).await.unwrap();
        ids.push(message.headers.get("ce-id").unwrap().as_str().to_owned());
    }
    ids
}

/// A nats-server this test owns, on its own port and store directory.
pub struct PrivateNats {
    child: Option<Child>,
    port: u16,
    store: tempfile::TempDir,
    extra: Vec<String>,
}

impl PrivateNats {
    /// Starts a server on a free port.
    pub fn start(extra: &[&str]) -> Option<PrivateNats> {
        let port = sched_relay_transport::testing::free_port();
        PrivateNats::start_on(port, extra)
    }

    /// Starts a server on `port` (e.g. one a client was configured for while it was down).
    pub fn start_on(port: u16, extra: &[&str]) -> Option<PrivateNats> {
        let mut server = PrivateNats {
            child: None,
            port,
            store: tempfile::tempdir().unwrap(),
            extra: extra.iter().map(|s| s.to_string()).collect(),
        };
        server.restart().then_some(server)
    }

    pub fn restart(&mut self) -> bool {
        let binary = std::env::var("NATS_SERVER_BIN").unwrap_or_else(|_| "nats-server".into());
        let mut command = Command::new(&binary);
        command
            .args([
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-js",
                "-sd",
            ])
            .arg(self.store.path())
            .args(&self.extra);
        let Some(child) = sched_relay_transport::testing::spawn_or_skip(&mut command, &binary)
        else {
            return false;
        };
        self.child = Some(child);
        sched_relay_transport::testing::wait_for_port(self.port, "the private nats-server");
        true
    }

    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Stops the server's process (SIGSTOP) without closing its connections: the stall of a
    /// server whose clients see an open connection that no longer answers.
    pub fn stall(&self) {
        self.signal("-STOP");
    }

    /// Lets a server [`PrivateNats::stall`] stopped go on (SIGCONT).
    pub fn wake(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, signal: &str) {
        let child = self.child.as_ref().expect("the private nats-server runs");
        let status = Command::new("kill")
            .args([signal, &child.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(
            status.success(),
            "kill {signal} of the private nats-server failed"
        );
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }
}

impl Drop for PrivateNats {
    fn drop(&mut self) {
        self.stop();
    }
}
