//! Shared set-up for the end-to-end tests: the real `sched-relay` binary as simulator and as
//! agent, each a child process that is killed if a test fails half-way, and helpers to read
//! what the file sink wrote.

#![allow(dead_code)] // each test binary uses a different part of this module

use std::io::{BufRead, BufReader, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

pub mod rabbit;

pub mod fleet;

pub const BINARY: &str = env!("CARGO_BIN_EXE_sched-relay");

/// A VM of a `sched-relay simulate` process, on a free loopback port. The VMs of one
/// process (`start_fleet`) share it; it is killed when the last of them is dropped.
pub struct SimProcess {
    process: std::sync::Arc<KillOnDrop>,
    pub url: String,
}

/// A child process killed (and reaped) when dropped.
struct KillOnDrop(std::sync::Mutex<Child>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let child = self.0.get_mut().unwrap_or_else(|p| p.into_inner());
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// Writes `toml` (a `sched-relay simulate` scenario) to `scenario.toml` in `dir`; returns
/// the file's path.
pub fn scenario_file(dir: &Path, toml: &str) -> String {
    let path = dir.join("scenario.toml");
    std::fs::write(&path, toml).unwrap();
    path.display().to_string()
}

impl SimProcess {
    pub fn start(scenario: &str, time_scale: f64) -> SimProcess {
        SimProcess::start_fleet(&[scenario], time_scale)
            .pop()
            .unwrap()
    }

    /// One process serving each scenario as a VM on its own port, in order; an EventId in
    /// several scenarios is one event that lists several VMs.
    pub fn start_fleet(scenarios: &[&str], time_scale: f64) -> Vec<SimProcess> {
        SimProcess::start_fleet_with(scenarios, time_scale, false).0
    }

    /// [`SimProcess::start_fleet`] with the simulator's Azure Resource Manager stand-in
    /// over every VM (`--arm-listen`): the VMs, and the stand-in's URL.
    pub fn start_fleet_with_arm(scenarios: &[&str], time_scale: f64) -> (Vec<SimProcess>, String) {
        let (vms, arm) = SimProcess::start_fleet_with(scenarios, time_scale, true);
        (vms, arm.expect("the ARM stand-in listens"))
    }

    fn start_fleet_with(
        scenarios: &[&str],
        time_scale: f64,
        arm: bool,
    ) -> (Vec<SimProcess>, Option<String>) {
        let mut command = Command::new(BINARY);
        command.args(["simulate", "--listen", "127.0.0.1:0"]);
        if arm {
            command.args(["--arm-listen", "127.0.0.1:0"]);
        }
        for scenario in scenarios {
            command.args(["--scenario", scenario]);
        }
        let mut child = command
            .args(["--time-scale", &time_scale.to_string()])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the sched-relay binary starts");
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut urls = Vec::with_capacity(scenarios.len() + 1);
        while urls.len() < scenarios.len() + usize::from(arm) {
            let mut line = String::new();
            stdout.read_line(&mut line).unwrap();
            let Some(url) = line
                .trim()
                .rsplit(' ')
                .next()
                .filter(|url| url.starts_with("http://"))
                .map(str::to_owned)
            else {
                let mut stderr = String::new();
                let _ =
                    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr);
                let _ = child.kill();
                let _ = child.wait();
                panic!("the simulator did not start: {line:?}\n{stderr}");
            };
            urls.push(url);
        }
        // Its logs are not needed once it listens; drop the pipe so it never fills up.
        drop(child.stderr.take());
        let process = std::sync::Arc::new(KillOnDrop(std::sync::Mutex::new(child)));
        // The stand-in says where it listens after every VM.
        let arm = arm.then(|| urls.pop().expect("read above"));
        let vms = urls
            .into_iter()
            .map(|url| SimProcess {
                process: process.clone(),
                url,
            })
            .collect();
        (vms, arm)
    }

    pub fn pid(&self) -> u32 {
        self.process
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .id()
    }

    pub fn get(&self, path: &str) -> Value {
        let url = format!("{}{path}", self.url);
        let response = blocking_get(&url, &[]);
        serde_json::from_str(&response.1).unwrap_or_else(|e| panic!("{url}: {e}: {}", response.1))
    }

    pub fn state(&self) -> Value {
        self.get("/__sim/state")
    }

    pub fn requests(&self) -> Vec<Value> {
        self.get("/__sim/requests").as_array().unwrap().clone()
    }

    /// Waits until every event of the scenario has come and gone and the last document was
    /// served; returns the final incarnation.
    pub fn wait_finished(&self, timeout: Duration) -> u64 {
        let deadline = Instant::now() + timeout;
        loop {
            let state = self.state();
            if state["finished"] == true {
                return state["incarnation"].as_u64().unwrap();
            }
            assert!(
                Instant::now() < deadline,
                "scenario not finished in {timeout:?}: {state}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// A plain HTTP GET without any library of ours: (status, body).
pub fn blocking_get(url: &str, headers: &[(&str, &str)]) -> (u16, String) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    sched_relay::install_crypto_provider();
    runtime.block_on(async {
        let client = reqwest::Client::builder().no_proxy().build().unwrap();
        let mut request = client.get(url);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let response = request.send().await.unwrap();
        let status = response.status().as_u16();
        (status, response.text().await.unwrap())
    })
}

/// A `sched-relay run` process with a file sink in its own temporary directory.
pub struct AgentProcess {
    child: Option<Child>,
    pub dir: tempfile::TempDir,
    pub events_file: PathBuf,
    stderr_file: PathBuf,
    pub config_path: PathBuf,
    env: Vec<(String, String)>,
}

impl AgentProcess {
    /// Starts the agent against `endpoint`; `extra` is appended to the generated TOML.
    pub fn start(endpoint: &str, extra: &str) -> AgentProcess {
        AgentProcess::start_with_env(endpoint, extra, &[])
    }

    /// As `start`, with environment variables (e.g. `SCHED_RELAY_*` overrides).
    pub fn start_with_env(endpoint: &str, extra: &str, env: &[(&str, &str)]) -> AgentProcess {
        let mut agent = AgentProcess::configure_with_env(endpoint, extra, env);
        agent.spawn(&[]);
        agent
    }

    /// An agent on the shipped `[imds]` defaults (1 s polls, 10 s timeouts, 5 s backoff
    /// ceiling): for the guarantees that the defaults must keep, such as a Spot eviction's
    /// 30 s notice after an outage.
    pub fn start_on_defaults(endpoint: &str, extra: &str) -> AgentProcess {
        AgentProcess::start_on_defaults_with_env(endpoint, extra, &[])
    }

    /// As `start_on_defaults`, with environment variables (the fleet benchmark's agents log
    /// at WARN, as a fleet would).
    pub fn start_on_defaults_with_env(
        endpoint: &str,
        extra: &str,
        env: &[(&str, &str)],
    ) -> AgentProcess {
        AgentProcess::launch(&format!("[imds]\nendpoint = \"{endpoint}\""), extra, env)
    }

    /// As `start_on_defaults`, without starting it (say, to `spawn(&["--dry-run"])`).
    pub fn configure_on_defaults(endpoint: &str, extra: &str) -> AgentProcess {
        AgentProcess::prepare(&format!("[imds]\nendpoint = \"{endpoint}\""), extra, &[])
    }

    /// As `start`, without starting it: for a test that starts the binary its own way.
    pub fn configure(endpoint: &str, extra: &str) -> AgentProcess {
        AgentProcess::configure_with_env(endpoint, extra, &[])
    }

    /// As `start_with_env`, without starting it (see `spawn_binary`).
    pub fn configure_with_env(endpoint: &str, extra: &str, env: &[(&str, &str)]) -> AgentProcess {
        let imds = format!(
            "[imds]\nendpoint = \"{endpoint}\"\npoll_interval = \"200ms\"\nrequest_timeout = \"1s\"\nfirst_call_timeout = \"5s\"\nmax_backoff = \"500ms\""
        );
        AgentProcess::prepare(&imds, extra, env)
    }

    fn launch(imds: &str, extra: &str, env: &[(&str, &str)]) -> AgentProcess {
        let mut agent = AgentProcess::prepare(imds, extra, env);
        agent.spawn(&[]);
        agent
    }

    fn prepare(imds: &str, extra: &str, env: &[(&str, &str)]) -> AgentProcess {
        let dir = tempfile::tempdir().unwrap();
        let events_file = dir.path().join("events.jsonl");
        let config = format!(
            r#"
{imds}

[state]
dir = "{state}"

[log]
level = "sched_relay=debug,info"

[[sinks]]
name = "file"
kind = "file"
path = "{events}"
{extra}
"#,
            state = dir.path().join("state").display(),
            events = events_file.display(),
        );
        let config_path = dir.path().join("config.toml");
        std::fs::write(&config_path, config).unwrap();
        let stderr_file = dir.path().join("agent.log");
        AgentProcess {
            child: None,
            dir,
            events_file,
            stderr_file,
            config_path,
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        }
    }

    /// Starts the agent under `prefix` (say `taskset -c 0`) with stdout and stderr on pipes
    /// that nobody reads, and logs at `trace`, so both fill up: returns the pipes' read ends,
    /// to keep them open.
    pub fn spawn_with_stalled_output(
        &mut self,
        prefix: &[&str],
    ) -> (std::process::ChildStdout, std::process::ChildStderr) {
        assert!(self.child.is_none(), "the agent is already running");
        let mut child = Command::new(prefix[0])
            .args(&prefix[1..])
            .arg(BINARY)
            .args(["run", "--config"])
            .arg(&self.config_path)
            .env("RUST_LOG", "trace")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the sched-relay binary starts");
        let pipes = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
        self.child = Some(child);
        pipes
    }

    /// Starts the binary with this agent's configuration and state (again, after a stop).
    pub fn spawn(&mut self, extra_args: &[&str]) {
        self.spawn_binary(Path::new(BINARY), extra_args);
    }

    /// As `spawn`, with another build of the agent (the benchmark's default-feature binary).
    pub fn spawn_binary(&mut self, binary: &Path, extra_args: &[&str]) {
        assert!(self.child.is_none(), "the agent is already running");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.stderr_file)
            .unwrap();
        let child = Command::new(binary)
            .args(["run", "--config"])
            .arg(&self.config_path)
            .args(extra_args)
            .env_remove("RUST_LOG")
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("the sched-relay binary starts");
        self.child = Some(child);
    }

    /// Replaces the environment variables the next `spawn` sets (say, to disarm a fault
    /// injector).
    pub fn set_env(&mut self, env: &[(&str, &str)]) {
        self.env = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
    }

    /// Changes the configuration the next `spawn` reads (say, to switch local policy on).
    pub fn edit_config(&self, edit: impl FnOnce(String) -> String) {
        let config = std::fs::read_to_string(&self.config_path).unwrap();
        std::fs::write(&self.config_path, edit(config)).unwrap();
    }

    /// kill -9: no shutdown, no drain, nothing flushed.
    pub fn kill9(&mut self) {
        let mut child = self.child.take().expect("running");
        child.kill().unwrap();
        child.wait().unwrap();
    }

    /// Waits for the process to end by itself.
    pub fn wait(&mut self, timeout: Duration) -> ExitStatus {
        let mut child = self.child.take().expect("running");
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("the agent did not exit within {timeout:?}:\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Sends a signal (`TERM`, `INT`) without waiting.
    pub fn signal(&self, signal: &str) {
        let child = self.child.as_ref().expect("running");
        let status = Command::new("kill")
            .args([&format!("-{signal}"), &child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// The structured CloudEvents the file sink holds so far, heartbeats left out (see
    /// [`read_events`]).
    pub fn events(&self) -> Vec<Value> {
        read_events(&self.events_file)
    }

    /// Waits until the file sink holds an event with this id.
    pub fn wait_for_id(&self, id: &str, timeout: Duration) -> Vec<Value> {
        self.wait_for(id, timeout, |event_id| event_id == id)
    }

    /// Waits until the file sink holds the `document` event of this incarnation, in any
    /// incarnation epoch (`document:<n>`, or `document:<n>~e<epoch>` after a reset).
    pub fn wait_for_document(&self, incarnation: u64, timeout: Duration) -> Vec<Value> {
        let id = format!("document:{incarnation}");
        let epoch = format!("{id}~");
        self.wait_for(&id, timeout, |event_id| {
            event_id == id || event_id.starts_with(&epoch)
        })
    }

    fn wait_for(&self, id: &str, timeout: Duration, matches: impl Fn(&str) -> bool) -> Vec<Value> {
        let deadline = Instant::now() + timeout;
        loop {
            let events = self.events();
            if events
                .iter()
                .any(|e| e["id"].as_str().is_some_and(&matches))
            {
                return events;
            }
            assert!(
                Instant::now() < deadline,
                "no event {id} within {timeout:?}; got {:?}\nagent log:\n{}",
                ids(&events),
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr_file).unwrap_or_default()
    }

    /// The running agent's process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// Whether the process runs (false once killed with `kill9`).
    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|child| child.try_wait().unwrap().is_none())
    }

    /// Sends SIGTERM and waits for the exit status.
    pub fn stop(&mut self) -> ExitStatus {
        self.signal("TERM");
        self.wait(Duration::from_secs(20))
    }

    /// [`AgentProcess::stop`], which must end in exit status 0; otherwise the test fails with
    /// the status and the agent's log (a panic or an "Agent failed" is in it).
    pub fn stop_cleanly(&mut self) {
        let status = self.stop();
        assert!(
            status.success(),
            "the agent stopped with {status}:\n{}",
            self.log()
        );
    }
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The structured CloudEvents in a file sink's file, heartbeats left out: they come at times
/// of their own (one once the first document is processed, then every
/// `events.heartbeat_interval`), not from the scenario, so the tests that check exact event
/// lists ignore them. `tests/heartbeats.rs` reads them with [`read_all_events`].
pub fn read_events(path: &Path) -> Vec<Value> {
    read_all_events(path)
        .into_iter()
        .filter(|event| !is_heartbeat(event))
        .collect()
}

/// Every structured CloudEvent in a file sink's file, heartbeats included. Only whole lines:
/// the agent may be appending one as the file is read (a test reads while it runs).
pub fn read_all_events(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .split_inclusive('\n')
        .filter_map(|line| line.strip_suffix('\n'))
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line:.300}")))
        .collect()
}

/// Whether a structured CloudEvent is an agent's heartbeat (`<prefix>.heartbeat`).
pub fn is_heartbeat(event: &Value) -> bool {
    event["type"]
        .as_str()
        .is_some_and(|ty| ty.ends_with(".heartbeat"))
}

pub fn ids(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .map(|e| e["id"].as_str().unwrap().to_owned())
        .collect()
}

/// Runs a scenario to its end with the agent, stops the agent with SIGTERM, checks it exited
/// 0, and returns the agent (for its log) and every event the file sink received.
pub fn play(
    scenario: &str,
    time_scale: f64,
    extra_config: &str,
) -> (SimProcess, AgentProcess, Vec<Value>) {
    let sim = SimProcess::start(scenario, time_scale);
    let mut agent = AgentProcess::start(&sim.url, extra_config);
    let last = sim.wait_finished(Duration::from_secs(60));
    agent.wait_for_document(last, Duration::from_secs(10));
    let status = agent.stop();
    assert!(
        status.success(),
        "agent exit status {status}:\n{}",
        agent.log()
    );
    let events = agent.events();
    (sim, agent, events)
}

/// Runs the binary to completion; its stdout, after checking it exited 0 (else both outputs
/// are shown).
pub fn stdout_of(command: &mut Command) -> String {
    let output = command.output().expect("the sched-relay binary starts");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

/// The metadata service allows about 5 requests per second per VM: panics if any second of
/// the simulator's request log (polls, approvals and identity together) holds more.
pub fn assert_within_imds_budget(requests: &[Value]) {
    let at: Vec<u64> = requests
        .iter()
        .map(|r| r["at_ms"].as_u64().unwrap())
        .collect();
    for (i, first) in at.iter().enumerate() {
        let within = at[i..].iter().take_while(|t| **t < first + 1000).count();
        assert!(
            within <= 5,
            "{within} requests in the second from {first} ms: {:?}",
            &requests[i..i + within]
        );
    }
}

/// When the simulator answered the first good GET at or after `from_ms`: when the agent could
/// first see what changed at that moment.
pub fn first_good_get_after(requests: &[Value], from_ms: u64) -> Option<u64> {
    requests
        .iter()
        .filter(|r| r["method"] == "GET" && r["status"] == 200)
        .filter(|r| r["path"] == "/metadata/scheduledevents")
        .map(|r| r["at_ms"].as_u64().unwrap())
        .find(|at| *at >= from_ms)
}

/// An in-process IMDS stand-in that serves one fixed document to every request, named as
/// such: the simulator only serves well-typed fields, and this case needs an odd one. It
/// counts the requests it answered.
pub fn fixed_imds(body: &'static str) -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let served = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = served.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            let mut request = [0u8; 4096];
            let _ = stream.read(&mut request);
            let response = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = stream.write_all(response.as_bytes());
            count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    });
    (url, served)
}

/// A tmpfs of `size` mounted on a fresh directory, unmounted on drop.
pub struct Tmpfs {
    dir: tempfile::TempDir,
}

impl Tmpfs {
    /// An error when this machine does not let the test mount (not root, or in a container
    /// without the capability).
    pub fn mount(size: &str) -> Result<Tmpfs, String> {
        let dir = tempfile::tempdir().unwrap();
        let output = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir.path())
            .output()
            .map_err(|e| format!("cannot run mount: {e}"))?;
        if !output.status.success() {
            return Err(format!(
                "mount -t tmpfs failed ({}): {}",
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            ));
        }
        Ok(Tmpfs { dir })
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount")
            .arg("-l")
            .arg(self.dir.path())
            .status();
    }
}

/// Writes 4 KiB blocks to `filler` until the disk refuses one; returns how much it took.
pub fn fill(filler: &Path) -> u64 {
    let mut file = std::fs::File::create(filler).unwrap();
    let block = [0xA5u8; 4096];
    let mut written = 0;
    loop {
        match file.write(&block) {
            Ok(0) => break,
            Ok(n) => written += n as u64,
            Err(error) if error.raw_os_error() == Some(28) => break,
            Err(error) => panic!("filling the disk: {error}"),
        }
    }
    let _ = file.sync_all();
    written
}

/// (resident, proportional, anonymous) memory in KiB, from `smaps_rollup`.
pub fn memory(pid: u32) -> (u64, u64, u64) {
    let rollup = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap_or_default();
    let kib = |key: &str| {
        rollup
            .lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (kib("Rss:"), kib("Pss:"), kib("Anonymous:"))
}

/// Whether `bytes` hold a whole HTTP/1.1 message: its headers and a body as long as its
/// `Content-Length` (none means no body). `Err` is a `Content-Length` that is not a number,
/// left to the caller: a test's stand-in server may shrug it off, a benchmark should stop.
pub fn http_message_is_whole(bytes: &[u8]) -> Result<bool, std::num::ParseIntError> {
    let Some(end) = bytes.windows(4).position(|w| w == b"\r\n\r\n") else {
        return Ok(false);
    };
    let headers = String::from_utf8_lossy(&bytes[..end]);
    let length = headers
        .lines()
        .find_map(|line| {
            line.to_ascii_lowercase()
                .strip_prefix("content-length:")
                .map(|value| value.trim().parse::<usize>())
        })
        .transpose()?
        .unwrap_or(0);
    Ok(bytes.len() >= end + 4 + length)
}
