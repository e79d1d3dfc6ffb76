//! A full state disk that frees again, with the shipped defaults (1 s polls): an Azure event
//! that appears and is cancelled while the state store cannot be written must still reach
//! the sinks, `scheduled` then `cancelled`, once the disk has room, without a restart.
//!
//! Two ways: the agent in this process with its store opened through the in-process fault
//! injector (`store::DiskFaults`), and the real binary with `state.dir` on a small tmpfs that
//! the test fills and frees (needs root for `mount`; without it the test says so and is
//! skipped, except under `CI`, where it fails). On the same kind of tmpfs, the file sink's
//! batch that the full disk cuts short must leave only whole lines, and the state store used
//! from many threads at once never hangs while the disk fills and frees again and again.

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{BINARY, SimProcess, Tmpfs, blocking_get, fill, ids, read_events};
use sched_relay::simulator::{Scenario, Simulator};
use sched_relay::store::DiskFaults;

const EVENT: &str = "C7061BAC-AFDC-4513-B24B-AA5F13A16123";

/// Nothing for 5 s; then a Freeze appears and Azure cancels it 4 s later.
const SCENARIO: &str = r#"
description = "A Freeze that comes and goes while the state disk is full"
time_scale = 1.0

[[events]]
id = "C7061BAC-AFDC-4513-B24B-AA5F13A16123"
type = "Freeze"
resources = ["WestNO_0"]
appear_after = "5s"
notice = "15m"
cancel_after = "4s"
"#;

/// The agent's configuration: the shipped defaults, but for where things go.
fn config(endpoint: &str, state: &Path, events: &Path, listen: Option<u16>) -> String {
    let telemetry = listen
        .map(|port| format!("[telemetry]\nlisten = \"127.0.0.1:{port}\"\n"))
        .unwrap_or_default();
    format!(
        r#"
[imds]
endpoint = "{endpoint}"

[state]
dir = "{state}"

[log]
level = "sched_relay=debug,info"

{telemetry}
[[sinks]]
name = "file"
kind = "file"
path = "{events}"
"#,
        state = state.display(),
        events = events.display(),
    )
}

fn wait_for(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The ids the file sink holds; every line must be one whole event.
/// The ids of the whole lines of the file sink: the agent may be writing the last one while
/// it is read (a 300 kB event is not one write). The end of each test reads it strictly.
fn delivered(events: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(events).unwrap_or_default();
    let whole = &text[..text.rfind('\n').map_or(0, |end| end + 1)];
    let parsed: Vec<serde_json::Value> = whole
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line:.200}")))
        .collect();
    ids(&parsed)
}

/// After the disk was freed: the Freeze's transitions, in order, each once.
fn assert_the_event_seen_meanwhile_arrived(events: &Path) {
    let transitions: Vec<String> = delivered(events)
        .into_iter()
        .filter(|id| id.starts_with(EVENT))
        .collect();
    assert_eq!(
        transitions,
        [format!("{EVENT}:scheduled"), format!("{EVENT}:cancelled")],
        "the transitions seen while the disk was full, with their usual ids"
    );
}

async fn readyz(port: u16) -> (u16, String) {
    let client = reqwest::Client::builder().no_proxy().build().unwrap();
    let response = client
        .get(format!("http://127.0.0.1:{port}/readyz"))
        .send()
        .await
        .unwrap();
    (response.status().as_u16(), response.text().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_seen_while_the_state_disk_is_full_is_delivered_once_it_frees_without_a_restart() {
    let sim = Simulator::start(
        Scenario::from_toml(SCENARIO).unwrap(),
        "127.0.0.1:0".parse().unwrap(),
    )
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let events = dir.path().join("events.jsonl");
    let port = sched_relay_transport::testing::free_port();
    let path = dir.path().join("agent.toml");
    std::fs::write(
        &path,
        config(&sim.url(), &dir.path().join("state"), &events, Some(port)),
    )
    .unwrap();
    let config = sched_relay::Config::load(Some(&path)).unwrap();
    let faults = DiskFaults::new();
    let options = sched_relay::RunOptions {
        disk_faults: Some(faults.clone()),
        ..Default::default()
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let agent = tokio::spawn(sched_relay::run(config, options, async {
        let _ = stopped.await;
    }));

    let events_path = events.clone();
    tokio::task::spawn_blocking(move || {
        wait_for("the first document", Duration::from_secs(20), || {
            delivered(&events_path).contains(&"document:1".to_owned())
        })
    })
    .await
    .unwrap();
    faults.fill();
    // The Freeze appears (incarnation 2) and is cancelled (3) while the disk is full; give
    // the agent two polls to see each.
    let deadline = Instant::now() + Duration::from_secs(30);
    while sim.snapshot().incarnation < 3 {
        assert!(Instant::now() < deadline, "the scenario did not play");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(faults.refused() > 0, "the agent hit the full disk");
    // Nothing reaches a sink before its commit is durable, so nothing of the Freeze arrives
    // while the disk is full (and nothing is sent again every poll).
    let meanwhile = delivered(&events);
    assert!(
        !meanwhile.iter().any(|id| id.starts_with(EVENT)),
        "delivered while the store could not take it: {meanwhile:?}"
    );
    let (status, body) = readyz(port).await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("state store cannot be written"), "{body}");

    faults.free();
    let events_path = events.clone();
    tokio::task::spawn_blocking(move || {
        wait_for("the Freeze's transitions", Duration::from_secs(15), || {
            delivered(&events_path).contains(&format!("{EVENT}:cancelled"))
        })
    })
    .await
    .unwrap();
    assert_the_event_seen_meanwhile_arrived(&events);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (status, body) = readyz(port).await;
        if status == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "still not ready: {body}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    let _ = stop.send(());
    agent.await.unwrap().unwrap();
    sim.stop().await;
}

/// The agent binary, killed if the test fails half-way.
struct Agent(Child);

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn on_a_real_full_tmpfs_the_agent_keeps_what_it_saw_and_delivers_it_once_space_returns() {
    let disk = match Tmpfs::mount("16m") {
        Ok(disk) => disk,
        Err(why) if std::env::var_os("CI").is_some() => {
            panic!("this test needs to mount a tmpfs (run as root): {why}")
        }
        Err(why) => {
            eprintln!("skipped: this test needs to mount a tmpfs (run as root): {why}");
            return;
        }
    };
    let work = tempfile::tempdir().unwrap();
    // A large event: redb reuses free pages inside its file and the sink's file ends in a
    // partly used page, so small commits can still succeed on a "full" tmpfs. Each commit
    // of this one needs far more than that slack.
    let big = "x".repeat(300_000);
    let scenario = format!("{SCENARIO}description = \"{big}\"\n");
    let sim = SimProcess::start(&common::scenario_file(work.path(), &scenario), 1.0);
    // The state and the file sink both on the small disk: the store must recover, and the
    // file must hold only whole lines.
    let events = disk.path().join("events.jsonl");
    let port = sched_relay_transport::testing::free_port();
    let path = work.path().join("agent.toml");
    std::fs::write(
        &path,
        config(&sim.url, &disk.path().join("state"), &events, Some(port)),
    )
    .unwrap();
    let log = work.path().join("agent.log");
    let child = Command::new(BINARY)
        .args(["run", "--config"])
        .arg(&path)
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("the sched-relay binary starts");
    let mut agent = Agent(child);
    let log_text = || std::fs::read_to_string(&log).unwrap_or_default();

    wait_for("the first document", Duration::from_secs(20), || {
        delivered(&events).contains(&"document:1".to_owned())
    });
    let filler = disk.path().join("filler");
    let taken = fill(&filler);
    assert!(taken > 0, "the disk was filled");
    wait_for("the Freeze to come and go", Duration::from_secs(30), || {
        sim.state()["incarnation"].as_u64().unwrap_or_default() >= 3
    });
    std::thread::sleep(Duration::from_millis(2500));
    assert!(
        log_text().contains("The state store cannot be written"),
        "the store hit the full disk:\n{}",
        log_text()
    );
    let (status, body) = blocking_get(&format!("http://127.0.0.1:{port}/readyz"), &[]);
    assert_eq!(status, 503, "{body}\n{}", log_text());
    assert!(body.contains("state store cannot be written"), "{body}");

    std::fs::remove_file(&filler).unwrap();
    wait_for("the Freeze's transitions", Duration::from_secs(20), || {
        delivered(&events).contains(&format!("{EVENT}:cancelled"))
    });
    assert_the_event_seen_meanwhile_arrived(&events);
    wait_for("/readyz to be 200 again", Duration::from_secs(10), || {
        blocking_get(&format!("http://127.0.0.1:{port}/readyz"), &[]).0 == 200
    });

    let _ = Command::new("kill")
        .args(["-TERM", &agent.0.id().to_string()])
        .status();
    let status = agent.0.wait().unwrap();
    assert!(status.success(), "exit {status}:\n{}", log_text());
    // Every line of the file sink is one whole event (read_events panics otherwise).
    assert!(read_events(&events).len() >= 4);
}

#[test]
fn a_file_sink_batch_cut_short_by_a_full_tmpfs_leaves_only_whole_lines() {
    use sched_relay_file::{FileSink, FileSinkConfig};
    use sched_relay_transport::Sink;
    let disk = match Tmpfs::mount("256k") {
        Ok(disk) => disk,
        Err(why) if std::env::var_os("CI").is_some() => {
            panic!("this test needs to mount a tmpfs (run as root): {why}")
        }
        Err(why) => {
            eprintln!("skipped: this test needs to mount a tmpfs (run as root): {why}");
            return;
        }
    };
    let path = disk.path().join("events.jsonl");
    let sink = FileSink::new(FileSinkConfig {
        path: path.clone(),
        fsync: true,
    });
    let event = |id: String| -> sched_relay_core::Event {
        use cloudevents::{EventBuilder, EventBuilderV10};
        EventBuilderV10::new()
            .id(id)
            .source("urn:sched-relay:vm:test")
            .ty("com.azure.scheduledevents.scheduled")
            .data(
                "application/json",
                serde_json::json!({"pad": "x".repeat(900)}),
            )
            .build()
            .unwrap()
            .into()
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    runtime.block_on(async {
        sink.deliver(&[event("first".into())]).await.unwrap();
        let before = std::fs::read(&path).unwrap();
        // About 1 MB: four times the disk, so the write fails part-way.
        let big: Vec<_> = (0..1000).map(|n| event(format!("big-{n}"))).collect();
        let error = sink.deliver(&big).await.unwrap_err();
        assert!(error.is_retriable(), "a full disk may clear: {error}");
        let after = std::fs::read(&path).unwrap();
        assert!(
            after == before,
            "the file is {} bytes after the failed batch, {} before: not cut back",
            after.len(),
            before.len()
        );
        sink.deliver(&[event("after".into())]).await.unwrap();
    });
    let ids = ids(&read_events(&path));
    assert_eq!(ids, ["first", "after"]);
}

/// A user-initiated Reboot that appears while the state disk is full is approved all the same
/// (an approval needs the metadata service, not the store), and its outcome is delivered once
/// the disk frees. In-process, through the fault injector, on the shipped `[imds]` defaults.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_policy_approves_while_the_state_disk_is_full_and_reports_it_once_it_frees() {
    const REBOOT: &str = "5a4e3e9a-6c7f-4a32-9d8e-0000000000f1";
    let scenario = format!(
        "[[events]]\nid = \"{REBOOT}\"\ntype = \"Reboot\"\nsource = \"User\"\nresources = [\"WestNO_0\"]\nappear_after = \"5s\"\nnotice = \"15m\"\nstarted_for = \"1h\"\n"
    );
    let sim = Simulator::start(
        Scenario::from_toml(&scenario).unwrap(),
        "127.0.0.1:0".parse().unwrap(),
    )
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let events = dir.path().join("events.jsonl");
    let path = dir.path().join("agent.toml");
    let text = config(&sim.url(), &dir.path().join("state"), &events, None)
        + "\n[policy]\napprove_user_initiated = true\n";
    std::fs::write(&path, text).unwrap();
    let config = sched_relay::Config::load(Some(&path)).unwrap();
    let faults = DiskFaults::new();
    let options = sched_relay::RunOptions {
        disk_faults: Some(faults.clone()),
        ..Default::default()
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let agent = tokio::spawn(sched_relay::run(config, options, async {
        let _ = stopped.await;
    }));
    let events_path = events.clone();
    tokio::task::spawn_blocking(move || {
        wait_for("the first document", Duration::from_secs(20), || {
            delivered(&events_path).contains(&"document:1".to_owned())
        })
    })
    .await
    .unwrap();
    faults.fill();
    // The Reboot appears at 5 s; the approval goes out while nothing can be stored.
    let deadline = Instant::now() + Duration::from_secs(20);
    while !sim
        .requests()
        .iter()
        .any(|r| r.method == "POST" && r.status == Some(200))
    {
        assert!(
            Instant::now() < deadline,
            "no approval while the disk was full"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(faults.refused() > 0, "the agent hit the full disk");
    // Neither the Reboot's `scheduled` nor the approval's outcome reaches a sink before it
    // is stored.
    let meanwhile = delivered(&events);
    assert!(
        !meanwhile
            .iter()
            .any(|id| id.starts_with("policy:") || id.starts_with(REBOOT)),
        "delivered while the store could not take it: {meanwhile:?}"
    );
    faults.free();
    let events_path = events.clone();
    tokio::task::spawn_blocking(move || {
        wait_for(
            "the approval's outcome and the transitions",
            Duration::from_secs(15),
            || {
                let ids = delivered(&events_path);
                ids.contains(&format!("policy:{REBOOT}:accepted"))
                    && ids.contains(&format!("{REBOOT}:scheduled"))
            },
        )
    })
    .await
    .unwrap();
    let _ = stop.send(());
    agent.await.unwrap().unwrap();
    sim.stop().await;
}

/// The state store as the agent uses it, from many threads at once (the poller's commits, each
/// sink's reads, removals and flushes, approvals' and metrics' small reads and writes), while
/// a real tmpfs fills and frees again and again: no operation may hang, and the store is
/// writable again after each fill. The chaos driver found a sink's recount looping for ever
/// on a database whose handle had failed (redb then yields `PreviousIo` from a range for
/// ever), holding the store's lock: the poller's next commit waited behind it, and what it
/// saw meanwhile was lost at the next restart.
#[test]
fn the_state_store_never_hangs_while_a_real_disk_fills_and_frees_under_concurrent_use() {
    use sched_relay::store::{Outbox, Processed};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

    /// Stops the workers however the test ends, so that a failed one does not leave them
    /// spinning beside the other tests.
    struct Stop(Arc<AtomicBool>);
    impl Drop for Stop {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    let disk = match Tmpfs::mount("8m") {
        Ok(disk) => disk,
        Err(why) if std::env::var_os("CI").is_some() => panic!("needs a tmpfs: {why}"),
        Err(why) => {
            eprintln!("skipped: {why}");
            return;
        }
    };
    let outbox = Arc::new(Outbox::open(disk.path(), 10_000, false).unwrap());
    let sinks: Vec<String> = ["file", "bus", "rabbit", "kafka"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let stop = Stop(Arc::new(AtomicBool::new(false)));
    let template = sched_relay_transport::testing::live_migration_events("WestNO_0");
    let mut workers = Vec::new();
    let mut beats = Vec::new();
    let mut spawn = |name: &'static str, mut work: Box<dyn FnMut(u64) + Send>| {
        let beat = Arc::new(AtomicU64::new(0));
        beats.push((name, beat.clone()));
        let stop = stop.0.clone();
        workers.push(std::thread::spawn(move || {
            let mut round = 0;
            while !stop.load(Ordering::SeqCst) {
                work(round);
                round += 1;
                beat.store(round, Ordering::SeqCst);
            }
        }));
    };
    {
        let (outbox, sinks) = (outbox.clone(), sinks.clone());
        spawn(
            "poller",
            Box::new(move |round| {
                let events: Vec<_> = (0..8)
                    .map(|i| template[0].clone().with_id(format!("e{round}-{i}")))
                    .collect();
                let document = serde_json::json!({"DocumentIncarnation": round, "Events": [], "pad": "x".repeat(2000)});
                let processed = || Processed {
                    document: &document,
                    epoch: 0,
                };
                let _ = outbox.commit(&sinks, &events, Some(processed()));
                outbox.probe(processed());
                std::thread::sleep(Duration::from_millis(2));
            }),
        );
    }
    for sink in sinks.clone() {
        let outbox = outbox.clone();
        spawn(
            "sink",
            Box::new(move |round| {
                if let Ok(pending) = outbox.pending(&sink, 50)
                    && let Some(last) = pending.last()
                {
                    let _ = outbox.remove_below(&sink, last.seq + 1);
                }
                if round % 4 == 0 {
                    let _ = outbox.flush();
                }
                let _ = outbox.depth(&sink);
                std::thread::sleep(Duration::from_millis(1));
            }),
        );
    }
    {
        let outbox = outbox.clone();
        spawn(
            "approvals",
            Box::new(move |round| {
                let _ = outbox.begin_request(&format!("r{round}"), "content", i64::MAX, 0);
                let _ = outbox.set_meta("imds_answered", &serde_json::json!(round));
                let _ = outbox.meta("identity");
                std::thread::sleep(Duration::from_millis(5));
            }),
        );
    }
    let filler = disk.path().join("filler");
    let mut rng = fastrand::Rng::with_seed(7);
    let mut fills = 0;
    let until = Instant::now() + Duration::from_secs(20);
    while Instant::now() < until {
        fill(&filler);
        fills += 1;
        let seen: Vec<u64> = beats
            .iter()
            .map(|(_, b)| b.load(Ordering::SeqCst))
            .collect();
        std::thread::sleep(Duration::from_millis(rng.u64(50..400)));
        std::fs::remove_file(&filler).unwrap();
        // Every thread goes on, and the store is writable again, within seconds of the space
        // coming back (the reopen backoff is at most 1 s).
        let deadline = Instant::now() + Duration::from_secs(5);
        for ((name, beat), before) in beats.iter().zip(&seen) {
            wait_for(
                &format!(
                    "the {name} thread to go on (hung in the state store after {fills} fills?)"
                ),
                deadline.saturating_duration_since(Instant::now()),
                || beat.load(Ordering::SeqCst) != *before,
            );
        }
        // Not `wait_for`: the failure says why the store is still unwritable.
        while let Some(why) = outbox.unwritable() {
            assert!(
                Instant::now() < deadline,
                "still unwritable after {fills} fills: {why}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    drop(stop);
    wait_for("every thread to stop", Duration::from_secs(10), || {
        workers.iter().all(|worker| worker.is_finished())
    });
    for worker in workers {
        worker.join().unwrap();
    }
    assert!(fills > 10, "{fills} fills");
}
