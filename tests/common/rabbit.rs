//! A vhost of a test's own on the machine's RabbitMQ, administered with `rabbitmqctl`, and
//! removed (with the users made for it) when the test ends.

use std::process::Command;

/// `rabbitmqctl`, or what `RABBITMQCTL` names (a broker in a container, say): its output.
pub fn rabbitmqctl(args: &[&str]) -> Result<String, String> {
    let command = std::env::var("RABBITMQCTL").unwrap_or_else(|_| "rabbitmqctl".into());
    let mut words = command.split_whitespace();
    let output = Command::new(words.next().unwrap())
        .args(words)
        .args(args)
        .output()
        .map_err(|e| format!("{command}: {e}"))?;
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    } else {
        Err(format!(
            "{command} {args:?}: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ))
    }
}

/// A vhost (`<prefix>-<pid>`) in which guest may do anything, and the users added to it.
pub struct Vhost {
    pub name: String,
    users: Vec<String>,
}

impl Vhost {
    /// None (the test skips) without RabbitMQ or rabbitmqctl, unless `CI` is set.
    pub fn start(prefix: &str) -> Option<Vhost> {
        if !sched_relay_transport::testing::broker_available(
            "RabbitMQ",
            "127.0.0.1:5672",
            "scripts/brokers start",
        ) {
            return None;
        }
        let name = format!("{prefix}-{}", std::process::id());
        if let Err(problem) = rabbitmqctl(&["add_vhost", &name]) {
            if std::env::var_os("CI").is_some() {
                panic!("cannot administer RabbitMQ and CI is set: {problem}");
            }
            eprintln!("skipped: cannot administer RabbitMQ ({problem}); set RABBITMQCTL");
            return None;
        }
        let vhost = Vhost {
            name,
            users: Vec::new(),
        };
        rabbitmqctl(&[
            "set_permissions",
            "-p",
            &vhost.name,
            "guest",
            ".*",
            ".*",
            ".*",
        ])
        .unwrap();
        Some(vhost)
    }

    /// A user with `password`, removed with the vhost; it has no permissions yet.
    pub fn add_user(&mut self, user: &str, password: &str) {
        rabbitmqctl(&["add_user", user, password]).unwrap();
        self.users.push(user.to_owned());
    }
}

impl Drop for Vhost {
    fn drop(&mut self) {
        for user in &self.users {
            let _ = rabbitmqctl(&["delete_user", user]);
        }
        let _ = rabbitmqctl(&["delete_vhost", &self.name]);
    }
}
