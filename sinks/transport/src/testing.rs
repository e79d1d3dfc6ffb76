//! Helpers for the sink crates' tests: the documentation's live migration as CloudEvents, and
//! the rule for tests that need a real broker (fail under CI, skip with a message elsewhere).

use cloudevents::{EventBuilder, EventBuilderV10};

use crate::Event;

/// The live-migration sequence as the agent publishes it for VM `vm`: document:1, then
/// scheduled, started, completed of one Freeze, each followed by its document snapshot.
pub fn live_migration_events(vm: &str) -> Vec<Event> {
    let id = "C7061BAC-AFDC-4513-B24B-AA5F13A16123";
    let source = format!("urn:sched-relay:vm:{vm}");
    let document = |incarnation: i64, events: serde_json::Value| {
        EventBuilderV10::new()
            .id(format!("document:{incarnation}"))
            .source(source.clone())
            .ty("com.azure.scheduledevents.document")
            .subject(incarnation.to_string())
            .time(chrono::Utc::now())
            .extension("incarnation", incarnation)
            .extension("vmname", vm)
            .extension("partitionkey", vm)
            .data(
                "application/json",
                serde_json::json!({"DocumentIncarnation": incarnation, "Events": events}),
            )
            .build()
            .expect("a valid event")
            .into()
    };
    let azure_event = |status: &str, not_before: &str| {
        serde_json::json!({"EventId": id, "EventStatus": status, "EventType": "Freeze",
            "ResourceType": "VirtualMachine", "Resources": [vm, "WestNO_1"], "NotBefore": not_before,
            "Description": "Virtual machine is being paused because of a memory-preserving Live Migration operation.",
            "EventSource": "Platform", "DurationInSeconds": 5})
    };
    let transition = |kind: &str,
                      incarnation: i64,
                      status: &str,
                      previous: Option<&str>,
                      event: serde_json::Value| {
        EventBuilderV10::new()
            .id(format!("{id}:{kind}"))
            .source(source.clone())
            .ty(format!("com.azure.scheduledevents.{kind}"))
            .subject(id)
            .time(chrono::Utc::now())
            .extension("incarnation", incarnation)
            .extension("eventtype", "Freeze")
            .extension("eventstatus", status)
            .extension("eventsource", "Platform")
            .extension("vmname", vm)
            .extension("affectsvm", true)
            .extension("partitionkey", id)
            .data(
                "application/json",
                serde_json::json!({"incarnation": incarnation,
                "vm": {"name": vm, "id": null, "resourceId": null}, "affectsVm": true,
                "previousStatus": previous, "event": event}),
            )
            .build()
            .expect("a valid event")
            .into()
    };
    let scheduled = azure_event("Scheduled", "Mon, 11 Apr 2022 22:26:58 GMT");
    let started = azure_event("Started", "");
    vec![
        document(1, serde_json::json!([])),
        transition("scheduled", 2, "Scheduled", None, scheduled.clone()),
        document(2, serde_json::json!([scheduled])),
        transition("started", 3, "Started", Some("Scheduled"), started.clone()),
        document(3, serde_json::json!([started.clone()])),
        transition("completed", 4, "Started", Some("Started"), started),
        document(4, serde_json::json!([])),
    ]
}

/// Asserts that events decoded from a protocol carry what was sent: the same ids in the same
/// order, the same required attributes, every extension (as text, since binary mode carries
/// extensions as header strings), and the same data.
pub fn assert_same_events(received: &[cloudevents::Event], sent: &[Event]) {
    use cloudevents::AttributesReader;
    let received_ids: Vec<&str> = received.iter().map(|e| e.id()).collect();
    let sent_ids: Vec<&str> = sent.iter().map(|e| e.id()).collect();
    assert_eq!(received_ids, sent_ids);
    let data = |event: &cloudevents::Event| -> Option<serde_json::Value> {
        match event.data()? {
            cloudevents::Data::Json(value) => Some(value.clone()),
            cloudevents::Data::Binary(bytes) => serde_json::from_slice(bytes).ok(),
            cloudevents::Data::String(text) => serde_json::from_str(text).ok(),
        }
    };
    for (got, want) in received.iter().zip(sent) {
        let context = want.id();
        assert_eq!(
            (got.ty(), got.source(), got.subject(), got.time()),
            (want.ty(), want.source(), want.subject(), want.time()),
            "{context}"
        );
        for (name, value) in want.iter_extensions() {
            assert_eq!(
                got.extension(name).map(|v| v.to_string()),
                Some(value.to_string()),
                "{name} of {context}"
            );
        }
        assert_eq!(data(got), data(want), "data of {context}");
    }
}

/// What the fan-out does after a failure, for sink tests: retries the unconfirmed rest of
/// the batch every 200 ms, up to `attempts` times, until the sink accepts it. Panics if it
/// never does.
pub async fn deliver_until_accepted(sink: &dyn crate::Sink, batch: &[Event], attempts: usize) {
    let mut last = None;
    let mut confirmed = 0;
    for _ in 0..attempts {
        match sink.deliver(&batch[confirmed..]).await {
            Ok(()) => return,
            Err(error) => {
                confirmed = (confirmed + error.confirmed).min(batch.len());
                last = Some(error);
            }
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    panic!("delivery did not resume after {attempts} attempts; last error: {last:?}");
}

/// A loopback port nothing listens on right now (for a server the test starts next).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free loopback port")
        .port()
}

/// A broker outage in the middle of a stream, for sink tests: the first two events are
/// delivered, the network through `proxy` is cut, the next batch must fail with a retriable
/// error, the network comes back, and the batch is retried as the fan-out would (up to
/// `attempts` times).
pub async fn deliver_across_an_outage(
    sink: &dyn crate::Sink,
    proxy: &CuttableProxy,
    events: &[Event],
    attempts: usize,
) {
    sink.deliver(&events[..2]).await.unwrap();
    proxy.cut();
    let error = sink.deliver(&events[2..]).await.unwrap_err();
    assert!(error.is_retriable(), "{error}");
    proxy.restore().await;
    deliver_until_accepted(sink, &events[2..], attempts).await;
}

/// Starts a server a test owns. When it cannot be run: under CI the test fails, elsewhere it
/// is skipped (`None`) with a line saying why.
pub fn spawn_or_skip(
    command: &mut std::process::Command,
    what: &str,
) -> Option<std::process::Child> {
    match command
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
    {
        Ok(child) => Some(child),
        Err(error) if std::env::var_os("CI").is_some() => panic!("cannot run {what}: {error}"),
        Err(error) => {
            eprintln!("skipped: cannot run {what}: {error}");
            None
        }
    }
}

/// Waits until something listens on `127.0.0.1:port` (a server a test just started).
pub fn wait_for_port(port: u16, what: &str) {
    for _ in 0..100 {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    panic!("{what} did not listen on 127.0.0.1:{port}");
}

/// Whether a broker answers on `address` (`host:port`). When it does not: under CI (the `CI`
/// variable is set) the test fails, since CI must exercise the real broker; elsewhere the
/// test is skipped with a line saying how to start the broker.
pub fn broker_available(name: &str, address: &str, how_to_start: &str) -> bool {
    use std::net::ToSocketAddrs;
    let reachable = address
        .to_socket_addrs()
        .ok()
        .and_then(|mut addrs| addrs.next())
        .is_some_and(|addr| {
            std::net::TcpStream::connect_timeout(&addr, std::time::Duration::from_secs(2)).is_ok()
        });
    if reachable {
        return true;
    }
    if std::env::var_os("CI").is_some() {
        panic!("{name} is not reachable at {address} and CI is set: {how_to_start}");
    }
    eprintln!("skipped: {name} is not reachable at {address} ({how_to_start})");
    false
}

/// A name no other test run uses, for subjects, queues, topics and streams.
pub fn unique(prefix: &str) -> String {
    format!(
        "{prefix}{}{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() % 1_000_000_000)
            .unwrap_or_default()
    )
}

/// Fault injection for network loss: a TCP proxy in front of a real broker that a test can
/// cut (every connection dropped, new ones refused) and restore on the same port. It stands
/// for a partition or a broker host going away, which the shared test brokers cannot do
/// without disturbing other tests.
pub struct CuttableProxy {
    port: u16,
    upstream: String,
    tasks: std::sync::Arc<std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>>>,
}

impl CuttableProxy {
    /// Starts forwarding a free loopback port to `upstream` (`host:port`).
    pub async fn start(upstream: &str) -> CuttableProxy {
        let port = free_port();
        let proxy = CuttableProxy {
            port,
            upstream: upstream.to_owned(),
            tasks: Default::default(),
        };
        proxy.restore().await;
        proxy
    }

    /// The address clients should use instead of the upstream.
    pub fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Drops every connection and refuses new ones.
    pub fn cut(&self) {
        for task in self.tasks.lock().expect("not poisoned").drain(..) {
            task.abort();
        }
    }

    /// Listens again on the same port.
    pub async fn restore(&self) {
        let socket = tokio::net::TcpSocket::new_v4().expect("a socket");
        socket.set_reuseaddr(true).expect("SO_REUSEADDR");
        let mut bound = None;
        for _ in 0..50 {
            match socket.bind(([127, 0, 0, 1], self.port).into()) {
                Ok(()) => {
                    bound = Some(());
                    break;
                }
                Err(_) => tokio::time::sleep(std::time::Duration::from_millis(50)).await,
            }
        }
        bound.expect("the proxy port can be bound again");
        let listener = socket.listen(64).expect("listen");
        let upstream = self.upstream.clone();
        let tasks = self.tasks.clone();
        let accept = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let upstream = upstream.clone();
                let connection = tokio::spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(&upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
                tasks.lock().expect("not poisoned").push(connection);
            }
        });
        self.tasks.lock().expect("not poisoned").push(accept);
    }
}

impl Drop for CuttableProxy {
    fn drop(&mut self) {
        self.cut();
    }
}
