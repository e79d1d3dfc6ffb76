//! `sched-relay demo --fleet` as a newcomer runs it: the built binary, on the machine's real
//! NATS (through `NATS_URL`) or on a `nats-server` it starts itself. What is checked is what
//! it prints: exit 0 within about a minute, the decisions as they happen (VMs made to wait
//! for each group's budget, the Freeze left to its NotBefore, every drain), and the summary's
//! figures, which the demo judges from the simulated VMs' own record: ten approvals, one
//! event left to NotBefore, the host-level Reboot approved once for both its VMs, and never
//! more VMs of a group down at once than its budget. Then that it leaves nothing behind:
//! its streams on the shared server, its own server after Ctrl-C.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::BINARY;
use sched_relay_transport::testing::{broker_available, free_port};

/// The machine's NATS with JetStream: `NATS_URL`, or the one `scripts/test` starts.
fn nats_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}
/// The groups as a user reads them in the demo's header: (name, VMs, budget).
const GROUPS: [(&str, usize, usize); 3] = [("web", 6, 2), ("db", 3, 1), ("cache", 3, 1)];

/// The number after `prefix` on the line that starts with it.
fn figure(stdout: &str, prefix: &str) -> usize {
    let line = stdout
        .lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no line starting {prefix:?}:\n{stdout}"));
    line[prefix.len()..]
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no figure after {prefix:?}: {line}"))
}

#[test]
fn the_fleet_demo_keeps_every_groups_budget_approves_the_host_level_reboot_once_and_cleans_up() {
    let url = nats_url();
    // host:port of the first server in the URL, past any credentials.
    let address = url
        .trim_start_matches("nats://")
        .split([',', '/'])
        .next()
        .and_then(|server| server.rsplit('@').next())
        .unwrap_or_default()
        .to_owned();
    if !broker_available("NATS", &address, "nats-server -a 127.0.0.1 -p 4222 -js") {
        return;
    }
    let started = Instant::now();
    let output = Command::new(BINARY)
        .args(["demo", "--fleet"])
        .env("NATS_URL", &url)
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let took = started.elapsed();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "exit {:?}\n{stdout}\n{stderr}",
        output.status
    );
    // The demo's own deadline (120 s) decides whether it finished: no time is asserted here.
    eprintln!("demo --fleet took {took:?}");
    // The agents' and the coordinator's own logs stay at WARN, and no error on a good run.
    assert!(
        !stderr.contains("INFO") && !stderr.contains("ERROR"),
        "{stderr}"
    );

    // As it happens: VMs of each group made to wait for its budget, the Freeze left to
    // NotBefore, each VM drained (the host-level Reboot's two VMs each) by the demo's hook.
    for (group, _, budget) in GROUPS {
        let waiting =
            format!("waiting for budget: group {group} has {budget} of {budget} VM(s) down");
        assert!(stdout.contains(&waiting), "no {waiting:?}:\n{stdout}");
    }
    assert!(
        stdout.contains(
            r#"coordinator: not approved: the action for "Freeze" is never; NotBefore decides"#
        ),
        "{stdout}"
    );
    assert!(
        stdout.contains("cache-2      Freeze    every approval is done; this one waits for Azure to start it at its NotBefore"),
        "{stdout}"
    );
    assert_eq!(
        stdout.matches("drain hook: drained").count(),
        11,
        "{stdout}"
    );
    assert_eq!(
        stdout.matches("approval accepted (imds_accepted)").count(),
        10,
        "{stdout}"
    );

    // The summary, judged by the demo from the simulators' record.
    let summary = stdout
        .split("\nSummary, from the simulated VMs' own record of who was down when and the drain hook's of whom it drained (a VM counts as down from its drain's start):\n")
        .nth(1)
        .unwrap_or_else(|| panic!("no summary:\n{stdout}"));
    let stdout = summary;
    assert_eq!(figure(stdout, "  approvals: "), 10, "{stdout}");
    assert!(stdout.contains("(10 StartRequests accepted)"), "{stdout}");
    assert_eq!(figure(stdout, "  left to NotBefore: "), 1, "{stdout}");
    assert!(
        stdout.contains("left to NotBefore: 1 (cache-2 Freeze"),
        "{stdout}"
    );
    let host = stdout
        .lines()
        .find(|l| l.starts_with("  host-level Reboot "))
        .unwrap_or_else(|| panic!("no host-level line:\n{stdout}"));
    assert!(
        host.contains("on web-6, db-3: approved once (1 StartRequest, through ")
            && host.ends_with("started on both"),
        "{host}"
    );
    for (group, size, budget) in GROUPS {
        let prefix = format!("  group {group}: at most ");
        let most = figure(stdout, &prefix);
        let line = stdout.lines().find(|l| l.starts_with(&prefix)).unwrap();
        assert!(
            line.contains(&format!(" of {size} VMs down at once")),
            "{line}"
        );
        assert!(
            (1..=budget).contains(&most),
            "group {group}: {most} VMs down at once, budget {budget}: {line}"
        );
        // The budget it was judged against is the one a user was shown.
        assert!(line.ends_with(&format!(", budget {budget}")), "{line}");
    }
    assert!(stdout.contains("\nDone in "), "{stdout}");

    // Its streams were deleted from the shared server.
    let stdout = String::from_utf8_lossy(&output.stdout);
    let streams: Vec<String> = stdout
        .split_whitespace()
        .filter(|w| w.starts_with("SCHED_RELAY_DEMO_"))
        .map(str::to_owned)
        .collect();
    assert_eq!(streams.len(), 2, "{stdout}");
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(async {
            let jetstream =
                async_nats::jetstream::new(async_nats::connect(url.as_str()).await.unwrap());
            let mut left = Vec::new();
            for stream in &streams {
                if jetstream.get_stream(stream).await.is_ok() {
                    // Not left on the shared server for the next run to find.
                    let _ = jetstream.delete_stream(stream).await;
                    left.push(stream);
                }
            }
            assert!(left.is_empty(), "still on the server: {left:?}");
        });
}

/// Whether a process with this pid exists (a zombie counts).
fn alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

#[test]
fn without_nats_url_it_starts_its_own_nats_server_and_ctrl_c_stops_everything() {
    if Command::new("nats-server")
        .arg("--version")
        .output()
        .is_err()
    {
        assert!(
            std::env::var_os("CI").is_none(),
            "nats-server is not on the PATH and CI is set (apt install nats-server)"
        );
        eprintln!("skipped: nats-server is not on the PATH (apt install nats-server)");
        return;
    }
    let mut demo = Command::new(BINARY)
        .args(["demo", "--fleet"])
        .env_remove("NATS_URL")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = demo.id();
    let mut lines = BufReader::new(demo.stdout.take().unwrap()).lines();
    let mut seen = String::new();
    let mut server = None;
    // Its own server, then into the run: an approved VM goes down.
    for line in lines.by_ref() {
        let line = line.unwrap();
        seen.push_str(&line);
        seen.push('\n');
        if let Some(rest) = line.strip_prefix("  NATS:      nats-server (pid ") {
            server = rest.split(')').next().and_then(|p| p.parse::<u32>().ok());
        }
        if line.contains("started: the VM is down") {
            break;
        }
    }
    let server = server.unwrap_or_else(|| panic!("no nats-server pid:\n{seen}"));
    assert!(alive(server), "{seen}");
    let dir = std::fs::read_dir(std::env::temp_dir())
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| {
            p.file_name().is_some_and(|n| {
                n.to_string_lossy()
                    .starts_with(&format!("sched-relay-demo-fleet-{pid}-"))
            })
        })
        .unwrap_or_else(|| panic!("no directory of the run:\n{seen}"));
    let interrupted = Instant::now();
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGINT) }, 0);
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = demo.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = demo.kill();
            panic!("the demo did not stop within 20 s of SIGINT:\n{seen}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    eprintln!("stopped {:?} after SIGINT", interrupted.elapsed());
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut demo.stderr.take().unwrap(), &mut stderr).unwrap();
    assert_eq!(status.code(), Some(130), "{seen}\n{stderr}");
    assert!(stderr.contains("interrupted"), "{stderr}");
    assert!(!alive(server), "nats-server {server} is still running");
    assert!(!dir.exists(), "{} is left behind", dir.display());
}

#[test]
fn without_any_nats_it_says_how_to_get_one_and_a_broken_one_is_named() {
    let run = |path: &str, nats_url: Option<&str>| {
        let mut command = Command::new(BINARY);
        command.args(["demo", "--fleet"]).env("PATH", path);
        match nats_url {
            Some(url) => command.env("NATS_URL", url),
            None => command.env_remove("NATS_URL"),
        };
        let output = command.output().unwrap();
        (
            output.status.code(),
            String::from_utf8_lossy(&output.stderr).into_owned(),
        )
    };
    let empty = tempfile::tempdir().unwrap();
    let nowhere = empty.path().to_str().unwrap();

    // Neither NATS_URL nor nats-server: how to get either.
    let (code, stderr) = run(nowhere, None);
    assert_eq!(code, Some(1), "{stderr}");
    for says in [
        "apt install nats-server",
        "github.com/nats-io/nats-server/releases",
        "NATS_URL=nats://",
    ] {
        assert!(stderr.contains(says), "no {says:?} in:\n{stderr}");
    }

    // NATS_URL where nothing listens: named.
    let url = format!("nats://127.0.0.1:{}", free_port());
    let (code, stderr) = run(nowhere, Some(&url));
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("cannot reach NATS at NATS_URL={url}")),
        "{stderr}"
    );

    // A NATS_URL the agents' configuration would refuse: said before anything starts.
    let (code, stderr) = run(nowhere, Some("127.0.0.1:4222"));
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains("NATS_URL=127.0.0.1:4222 is not a NATS URL: expected nats://host:4222"),
        "{stderr}"
    );

    // A nats-server that cannot start: the end of its log.
    let fake = empty.path().join("nats-server");
    std::fs::write(
        &fake,
        "#!/bin/sh\necho '[FTL] Error listening on port: 127.0.0.1:4222, \"address already in use\"' >&2\nexit 1\n",
    )
    .unwrap();
    let mut permissions = std::fs::metadata(&fake).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut permissions, 0o755);
    std::fs::set_permissions(&fake, permissions).unwrap();
    let (code, stderr) = run(nowhere, None);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains("nats-server did not start (it exited with exit status: 1)")
            && stderr.contains("[FTL] Error listening on port"),
        "{stderr}"
    );
}
