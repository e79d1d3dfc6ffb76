//! The listener survives hostile clients: once `POST /approvals` is reachable from the
//! network, anyone can open connections. Ten thousand that send half a request header and
//! stop cost the agent little memory, are all closed within `telemetry.request_timeout`
//! (10 s by default), `/healthz` keeps answering meanwhile, and a valid approval goes through
//! after. Shipped defaults: 256 connections at once, 10 s to send headers and body.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::{AgentProcess, BINARY, SimProcess, blocking_get};

const EVENT: &str = "f0000000-0000-4000-8000-0000000000bb";
const SECRET: &str = "listener-limits-secret-0001";
const SCENARIO: &str = r#"
[[events]]
id = "f0000000-0000-4000-8000-0000000000bb"
type = "Freeze"
resources = ["WestNO_0"]
notice = "1h"
"#;
const FLOOD: usize = 10_000;

fn raise_open_files_limit(at_least: u64) {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid pointer to a plain struct.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit), 0);
        if limit.rlim_cur < at_least {
            limit.rlim_cur = at_least.min(limit.rlim_max);
            assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &limit), 0);
        }
    }
    assert!(
        limit.rlim_cur >= at_least,
        "the test needs {at_least} open files; the hard limit is {}",
        limit.rlim_max
    );
}

fn resident_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

/// Whether the agent has closed `stream` (what it sent before, a 503, is read and skipped).
fn closed(stream: &mut TcpStream) -> bool {
    let mut buffer = [0u8; 512];
    loop {
        match stream.read(&mut buffer) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => return false,
            Err(_) => return true,
        }
    }
}

#[test]
fn ten_thousand_half_open_connections_cost_little_are_all_closed_and_approvals_still_work() {
    raise_open_files_limit(FLOOD as u64 + 1024);
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("orchestrator.key");
    std::fs::write(&key, format!("hmac-sha256:{SECRET}")).unwrap();
    let sim = SimProcess::start(&common::scenario_file(dir.path(), SCENARIO), 1.0);
    let port = sched_relay_transport::testing::free_port();
    let agent = AgentProcess::start(
        &sim.url,
        &format!(
            "[telemetry]\nlisten = \"127.0.0.1:{port}\"\n[identity]\nvm_name = \"WestNO_0\"\n\
             [approvals.http]\n[[approvals.keys]]\nid = \"orchestrator\"\n\
             algorithm = \"hmac-sha256\"\nsecret = \"{SECRET}\"\n"
        ),
    );
    agent.wait_for_id(&format!("{EVENT}:scheduled"), Duration::from_secs(20));
    let before = resident_kib(agent.pid());

    let mut flood = Vec::with_capacity(FLOOD);
    for _ in 0..FLOOD {
        let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
        // Half a request header, then nothing.
        let _ = stream.write_all(b"POST /approvals HTTP/1.1\r\nHost: agent\r\n");
        flood.push(stream);
    }
    let opened = Instant::now();
    let (status, _) = blocking_get(&format!("http://127.0.0.1:{port}/healthz"), &[]);
    assert_eq!(status, 200, "/healthz must answer during the flood");
    let during = resident_kib(agent.pid());
    eprintln!(
        "agent resident memory: {before} KiB before, {during} KiB with {FLOOD} connections open"
    );
    // The goal is under 30 MiB for the release agent, which idles at about 12 MiB
    // (BENCHMARKS.md); this debug build idles far higher, so its growth is what is held: at
    // most 18 MiB (before the limits: 143 MiB, and never given back).
    assert!(
        during.saturating_sub(before) < 18 * 1024,
        "{during} KiB resident with {FLOOD} half-open connections, {before} KiB before"
    );

    for stream in &flood {
        stream.set_nonblocking(true).unwrap();
    }
    let deadline = opened + Duration::from_secs(10 + 5);
    let mut open: Vec<TcpStream> = flood;
    while !open.is_empty() {
        open.retain_mut(|stream| !closed(stream));
        assert!(
            Instant::now() < deadline || open.is_empty(),
            "{} of {FLOOD} connections still open {:?} after the flood (telemetry.request_timeout is 10 s)",
            open.len(),
            opened.elapsed()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!("all {FLOOD} closed within {:?}", opened.elapsed());

    let signed = std::process::Command::new(BINARY)
        .args(["sign-approval", "--key"])
        .arg(&key)
        .args([
            "--key-id",
            "orchestrator",
            "--vm",
            "WestNO_0",
            "--event-id",
            EVENT,
        ])
        .args(["--to", &format!("http://127.0.0.1:{port}/approvals")])
        .output()
        .unwrap();
    assert!(
        signed.status.success(),
        "{}{}",
        String::from_utf8_lossy(&signed.stdout),
        String::from_utf8_lossy(&signed.stderr)
    );
    let events = agent.events();
    assert!(
        events
            .iter()
            .any(|e| e["type"] == "com.azure.scheduledevents.approval.accepted"),
        "no accepted outcome:\n{}",
        agent.log()
    );
}
