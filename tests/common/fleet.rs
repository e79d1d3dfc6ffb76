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

    /// `/fleet` once this coordinator has its state: it answers 503 while it loads it.
    pub fn fleet(&self) -> Value {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let (status, body) = self.fleet_answer();
            if status == 503 && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
            assert_eq!(status, 200, "{body}\n{}", self.log());
            return serde_json::from_str(&body).unwrap();
        }
    }

    /// `/fleet`'s status and body, as they are now.
    pub fn fleet_answer(&self) -> (u16, String) {
        blocking_get(&format!("http://127.0.0.1:{}/fleet", self.port), &[])
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

    /// What its /healthz says it is: `starting`, `standby` or `active`.
    pub fn role(&self) -> String {
        blocking_get(&format!("http://127.0.0.1:{}/healthz", self.port), &[])
            .1
            .trim()
            .to_owned()
    }

    /// A standby beside it: the same file with another listener, started with its log in
    /// `dir` (`second.toml`, `second.log`).
    pub fn standby(&self, dir: &std::path::Path) -> Coordinator {
        let port = sched_relay_transport::testing::free_port();
        let second = dir.join("second.toml");
        std::fs::write(
            &second,
            std::fs::read_to_string(&self.config).unwrap().replace(
                &format!("127.0.0.1:{}", self.port),
                &format!("127.0.0.1:{port}"),
            ),
        )
        .unwrap();
        Coordinator::start(second, dir.join("second.log"), port)
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

/// A StartRequest for `event_id` on `vm`, signed by `sched-relay sign-approval` with the
/// key in `key_file`, named `key_id`: what a coordinator publishes.
pub fn signed_approval(
    key_file: &std::path::Path,
    key_id: &str,
    vm: &str,
    event_id: &str,
) -> Vec<u8> {
    let request = Command::new(BINARY)
        .args(["sign-approval", "--key"])
        .arg(key_file)
        .args(["--key-id", key_id, "--event-id", event_id, "--vm", vm])
        .output()
        .unwrap();
    assert!(
        request.status.success(),
        "{}",
        String::from_utf8_lossy(&request.stderr)
    );
    request.stdout
}

/// Waits up to 20 s for `sim` to accept a StartRequest naming `event_id`; `log` says why
/// not.
pub fn wait_for_accepted_post(sim: &SimProcess, event_id: &str, log: impl Fn() -> String) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !posts(sim)
        .iter()
        .any(|(body, _, status)| body.contains(event_id) && *status == 200)
    {
        assert!(
            Instant::now() < deadline,
            "no accepted StartRequest for {event_id}:\n{}",
            log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
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

/// One stretch of time an event kept a VM down, as its simulator recorded it.
#[derive(Debug, Clone)]
pub struct Downtime {
    pub vm: String,
    pub event_id: String,
    pub from_us: i64,
    /// `None` while it lasts.
    pub until_us: Option<i64>,
    /// A StartRequest started it (an approval), not its NotBefore.
    pub approved: bool,
    /// When Azure would have started it by itself.
    pub not_before_us: Option<i64>,
}

/// Every VM's downtimes from the simulators' own records (an event that lists several VMs
/// is in each one's record).
pub fn downtimes<'a>(
    sims: impl IntoIterator<Item = (&'a String, &'a SimProcess)>,
) -> Vec<Downtime> {
    let mut all = Vec::new();
    for (vm, sim) in sims {
        let state = sim.state();
        for record in state["down"].as_array().cloned().unwrap_or_default() {
            all.push(Downtime {
                vm: vm.clone(),
                event_id: record["event_id"].as_str().unwrap_or_default().to_owned(),
                from_us: record["from_us"].as_i64().unwrap(),
                until_us: record["until_us"].as_i64(),
                approved: record["approved"] == true,
                not_before_us: record["not_before_us"].as_i64(),
            });
        }
    }
    all
}

/// The ceiling, judged from the simulators' records: every moment a VM was down because an
/// approval started its event, while its group (`group_of`) had more VMs down than its
/// limit (every group must have one). An approval's VM is down because of it from its start
/// until its expected outage ends (`expected`, in microseconds; `None`: all of it), and never
/// past the event's NotBefore, when Azure would have started it anyway: past that, a VM that
/// did not come back is a failure the coordinator could not foresee, still counted as down
/// against every later approval. Each entry says when, which group, and who was down.
pub fn over_budget(
    downtimes: &[Downtime],
    group_of: impl Fn(&str) -> String,
    limits: &std::collections::BTreeMap<String, usize>,
    expected: impl Fn(&Downtime) -> Option<i64>,
) -> Vec<String> {
    let ends = |d: &Downtime| d.until_us.unwrap_or(i64::MAX);
    let mut found = Vec::new();
    for ours in downtimes.iter().filter(|d| d.approved) {
        let group = group_of(&ours.vm);
        let limit = limits
            .get(&group)
            .unwrap_or_else(|| panic!("no limit for group {group:?} (of {})", ours.vm));
        let ours_until = expected(ours)
            .map_or(ends(ours), |outage| {
                ends(ours).min(ours.from_us.saturating_add(outage))
            })
            .min(ours.not_before_us.unwrap_or(i64::MAX));
        // The count only grows at a start: check at ours' start and at every start inside it.
        let instants = std::iter::once(ours.from_us).chain(
            downtimes
                .iter()
                .map(|d| d.from_us)
                .filter(|t| ours.from_us <= *t && *t < ours_until),
        );
        for t in instants {
            let down: std::collections::BTreeSet<&str> = downtimes
                .iter()
                .filter(|d| group_of(&d.vm) == group && d.from_us <= t && t < ends(d))
                .map(|d| d.vm.as_str())
                .collect();
            if down.len() > *limit {
                found.push(format!(
                    "at {t}: group {group} had {} down (limit {limit}): {down:?}, {} by the approval of {}",
                    down.len(),
                    ours.vm,
                    ours.event_id
                ));
            }
        }
    }
    found
}

/// The `q` quantile of a Prometheus histogram, as the upper bound of its bucket.
pub fn quantile(metrics: &str, name: &str, q: f64) -> Option<f64> {
    let buckets: Vec<(f64, f64)> = metrics
        .lines()
        .filter(|l| l.starts_with(&format!("{name}_bucket{{")))
        .filter_map(|l| {
            let le = l.split("le=\"").nth(1)?.split('"').next()?;
            let count: f64 = l.rsplit(' ').next()?.parse().ok()?;
            Some((
                if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().ok()?
                },
                count,
            ))
        })
        .collect();
    let total = buckets.last()?.1;
    (total > 0.0).then(|| {
        buckets
            .iter()
            .find(|(_, c)| *c >= q * total)
            .map(|(le, _)| *le)
    })?
}
