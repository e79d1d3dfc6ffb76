//! The fleet coordinator's test and benchmark helpers: `sched-relay coordinate` as a child
//! process, and what the simulators recorded (approval POSTs, VMs down at once).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::{BINARY, SimProcess, blocking_get};

/// `sched-relay coordinate` as a child process, killed when dropped.
pub struct Coordinator {
    child: Option<Child>,
    config: PathBuf,
    log: PathBuf,
    pub port: u16,
}

impl Coordinator {
    pub fn start(config: PathBuf, log: PathBuf, port: u16) -> Coordinator {
        let mut coordinator = Coordinator {
            child: None,
            config,
            log,
            port,
        };
        coordinator.spawn();
        coordinator
    }

    pub fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let child = Command::new(BINARY)
            .args(["coordinate", "--config"])
            .arg(&self.config)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            let exited = self.child.as_mut().unwrap().try_wait().unwrap();
            assert!(
                exited.is_none() && Instant::now() < deadline,
                "the coordinator did not start ({exited:?}):\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn fleet(&self) -> Value {
        let (status, body) = blocking_get(&format!("http://127.0.0.1:{}/fleet", self.port), &[]);
        assert_eq!(status, 200, "{body}");
        serde_json::from_str(&body).unwrap()
    }

    pub fn metrics(&self) -> String {
        blocking_get(&format!("http://127.0.0.1:{}/metrics", self.port), &[]).1
    }

    /// Sends `signal` (`STOP`, `CONT`, ...) to the process.
    pub fn signal(&self, signal: &str) {
        if let Some(pid) = self.pid() {
            let status = Command::new("kill")
                .args([format!("-{signal}"), pid.to_string()])
                .status()
                .unwrap();
            assert!(status.success(), "kill -{signal} {pid}");
        }
    }

    /// Waits up to `timeout` for the process to exit by itself.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(status) = self.child.as_mut()?.try_wait().unwrap() {
                self.child = None;
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Coordinator {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Each simulator's POSTs: (EventIds in the body, Unix microseconds, status).
pub fn posts(sim: &SimProcess) -> Vec<(String, i64, u64)> {
    sim.requests()
        .into_iter()
        .filter(|r| r["method"] == "POST")
        .map(|r| {
            (
                r["body"].as_str().unwrap().to_owned(),
                r["unix_us"].as_i64().unwrap(),
                r["status"].as_u64().unwrap_or(0),
            )
        })
        .collect()
}

/// The most VMs down at one moment, each approval taking its VM down for
/// `[POST, POST + down_for)` (two events of one VM at once are one VM down).
pub fn most_at_once(starts: &[(String, i64)], down_for: Duration) -> usize {
    let down = down_for.as_micros() as i64;
    starts
        .iter()
        .map(|(_, t)| {
            let vms: std::collections::BTreeSet<&String> = starts
                .iter()
                .filter(|(_, s)| s <= t && *t < s + down)
                .map(|(vm, _)| vm)
                .collect();
            vms.len()
        })
        .max()
        .unwrap_or(0)
}
