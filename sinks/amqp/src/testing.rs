//! Helpers for tests that consume what the AMQP sink published: an exchange with a queue
//! bound to it, drained and removed by the test.

use std::time::Duration;

use lapin::options::{
    BasicGetOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};
use sched_relay_transport::testing::unique;

/// An exchange and a queue bound to it with `#`, both removed when the test ends.
pub struct Topology {
    pub channel: Channel,
    pub exchange: String,
    pub queue: String,
}

impl Topology {
    pub async fn new(url: &str) -> Topology {
        let connection = Connection::connect(url, ConnectionProperties::default())
            .await
            .unwrap();
        let channel = connection.create_channel().await.unwrap();
        let exchange = unique("sr-test-x-");
        let queue = unique("sr-test-q-");
        channel
            .exchange_declare(
                exchange.as_str().into(),
                ExchangeKind::Topic,
                ExchangeDeclareOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        channel
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        channel
            .queue_bind(
                queue.as_str().into(),
                exchange.as_str().into(),
                "#".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        Topology {
            channel,
            exchange,
            queue,
        }
    }

    /// Takes every message now in the queue.
    pub async fn drain(&self, expected: usize) -> Vec<lapin::message::BasicGetMessage> {
        let mut messages = Vec::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while messages.len() < expected && tokio::time::Instant::now() < deadline {
            match self
                .channel
                .basic_get(self.queue.as_str().into(), BasicGetOptions { no_ack: true })
                .await
                .unwrap()
            {
                Some(message) => messages.push(message),
                None => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
        messages
    }

    pub async fn remove(self) {
        let _ = self
            .channel
            .queue_delete(self.queue.as_str().into(), QueueDeleteOptions::default())
            .await;
        let _ = self
            .channel
            .exchange_delete(
                self.exchange.as_str().into(),
                ExchangeDeleteOptions::default(),
            )
            .await;
    }
}

/// The `message_id` (the CloudEvents id) of each message, in order.
pub fn message_ids(messages: &[lapin::message::BasicGetMessage]) -> Vec<String> {
    messages
        .iter()
        .map(|m| {
            m.delivery
                .properties
                .message_id()
                .as_ref()
                .map(|id| id.to_string())
                .unwrap_or_default()
        })
        .collect()
}

/// A RabbitMQ node of its own (Debian's `rabbitmq-server`, run as this user, with its own
/// Erlang node name, ports, data directory and cookie), for a benchmark or test that
/// restarts the broker: the machine's RabbitMQ is shared and is never restarted.
/// Stopped, and its data removed, when dropped.
pub struct PrivateRabbit {
    node: String,
    port: u16,
    distribution: u16,
    dir: std::path::PathBuf,
}

impl PrivateRabbit {
    /// Starts a node on a free port and waits until it serves; `None` (or a panic under CI)
    /// when RabbitMQ is not installed.
    pub fn start() -> Option<PrivateRabbit> {
        let port = sched_relay_transport::testing::free_port();
        // The node's distribution port; its CLI tools take the one 10000 above it.
        let distribution = std::iter::repeat_with(sched_relay_transport::testing::free_port)
            .find(|p| *p < 55000)
            .expect("a free port");
        let name = unique("srrabbit");
        let dir = std::env::temp_dir().join(&name);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("rabbitmq.conf"),
            format!("listeners.tcp.default = 127.0.0.1:{port}\nloopback_users = none\n"),
        )
        .unwrap();
        std::fs::write(dir.join("enabled_plugins"), "[].\n").unwrap();
        let rabbit = PrivateRabbit {
            node: format!("{name}@localhost"),
            port,
            distribution,
            dir,
        };
        rabbit.restart().then_some(rabbit)
    }

    /// `rabbitmq-server` or `rabbitmqctl` with this node's environment. Debian's wrappers in
    /// /usr/sbin switch to the `rabbitmq` user and drop the environment; the scripts behind
    /// them do not.
    fn command(&self, program: &str) -> std::process::Command {
        let behind = std::path::Path::new("/usr/lib/rabbitmq/bin").join(program);
        let mut command = std::process::Command::new(if behind.exists() {
            behind.into_os_string()
        } else {
            program.into()
        });
        command
            .env("HOME", &self.dir)
            .env("RABBITMQ_NODENAME", &self.node)
            .env("RABBITMQ_NODE_PORT", self.port.to_string())
            .env("RABBITMQ_DIST_PORT", self.distribution.to_string())
            .env("RABBITMQ_MNESIA_BASE", self.dir.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", self.dir.join("log"))
            .env("RABBITMQ_CONFIG_FILE", self.dir.join("rabbitmq"))
            .env(
                "RABBITMQ_ENABLED_PLUGINS_FILE",
                self.dir.join("enabled_plugins"),
            )
            .env("RABBITMQ_PID_FILE", self.dir.join("pid"))
            // Nothing of the machine's own node: its environment file and advanced config.
            .env("RABBITMQ_CONF_ENV_FILE", self.dir.join("rabbitmq-env.conf"))
            .env(
                "RABBITMQ_ADVANCED_CONFIG_FILE",
                self.dir.join("advanced.config"),
            );
        command
    }

    /// Starts the node (again, on the same data: durable queues and their messages survive).
    pub fn restart(&self) -> bool {
        let mut server = self.command("rabbitmq-server");
        server.arg("-detached");
        let Some(mut started) =
            sched_relay_transport::testing::spawn_or_skip(&mut server, "rabbitmq-server")
        else {
            return false;
        };
        let _ = started.wait();
        // `await_startup` waits for a node that is booting, but fails at once for one not
        // registered yet, which `-detached` returns before: ask again until it answers.
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        let ready = loop {
            let ready = self
                .command("rabbitmqctl")
                .args(["-n", &self.node, "--timeout", "120", "await_startup"])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .status()
                .is_ok_and(|status| status.success());
            if ready || std::time::Instant::now() > deadline {
                break ready;
            }
            std::thread::sleep(Duration::from_millis(500));
        };
        assert!(
            ready,
            "the private RabbitMQ node {} did not start",
            self.node
        );
        sched_relay_transport::testing::wait_for_port(self.port, "the private RabbitMQ node");
        true
    }

    /// Stops the node and waits until it has; kills it if its CLI cannot reach it.
    pub fn stop(&self) {
        // With the pid file, `stop` returns once the Erlang VM has exited.
        let pid_file = self.dir.join("pid");
        let stopped = self
            .command("rabbitmqctl")
            .args(["-n", &self.node, "stop"])
            .arg(&pid_file)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|status| status.success());
        if !stopped {
            // Its Erlang VM is the only process whose command line names this node.
            let name = self.node.split('@').next().unwrap_or(&self.node);
            let _ = std::process::Command::new("pkill")
                .args(["-KILL", "-f", name])
                .status();
        }
    }

    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }
}

impl Drop for PrivateRabbit {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
