//! The kept-alive connection against servers that misbehave in each way the module
//! documentation lists.

use super::*;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex, OnceLock};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const OK: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}";
pub(super) const SECOND: Duration = Duration::from_secs(1);

/// Binds a listener and runs `serve` with it on a thread and runtime of its own: the
/// connection under test blocks the thread it reads on, as it does the poll thread.
pub(super) fn serve_elsewhere<F>(
    serve: impl FnOnce(tokio::net::TcpListener) -> F + Send + 'static,
) -> Url
where
    F: Future<Output = ()>,
{
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let url = Url::parse(&format!("http://{}/", listener.local_addr().unwrap())).unwrap();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async move {
            serve(tokio::net::TcpListener::from_std(listener).unwrap()).await;
        });
    });
    url
}

/// Why a GET on `connection` failed; panics if it was answered or timed out instead.
pub(super) async fn failure(connection: &mut KeptAlive, timeout: Duration) -> String {
    match connection.get(timeout, no_turn).await {
        Err(Unanswered::Failed(reason)) => reason,
        other => panic!("a failure, not {other:?}"),
    }
}

/// A turn of the pacer that is always there at once.
pub(super) async fn no_turn() {}

/// Reads one request's head from `socket`; `None` when the connection ended first.
pub(super) async fn read_request(
    socket: &mut tokio::net::TcpStream,
    buffer: &mut [u8],
) -> Option<String> {
    let mut read = 0;
    while !buffer[..read].windows(4).any(|w| w == b"\r\n\r\n") {
        match socket.read(&mut buffer[read..]).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => read += n,
        }
    }
    Some(String::from_utf8_lossy(&buffer[..read]).to_lowercase())
}

/// A server that answers each request on a connection with `answer`, and closes every
/// connection after `per_connection` answers; returns its URL, how many connections it
/// accepted and how many it has closed.
pub(super) fn server(
    answer: &'static [u8],
    per_connection: usize,
) -> (Url, Arc<AtomicUsize>, Arc<AtomicUsize>) {
    server_in_parts(vec![answer], per_connection)
}

/// As [`server`], writing its answer in `parts`, 20 ms apart.
pub(super) fn server_in_parts(
    parts: Vec<&'static [u8]>,
    per_connection: usize,
) -> (Url, Arc<AtomicUsize>, Arc<AtomicUsize>) {
    let (accepted, closed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (counter, closes) = (accepted.clone(), closed.clone());
    let url = serve_elsewhere(move |listener| async move {
        loop {
            let (mut socket, _) = listener.accept().await.unwrap();
            counter.fetch_add(1, SeqCst);
            let (closes, parts) = (closes.clone(), parts.clone());
            tokio::spawn(async move {
                let mut buffer = vec![0u8; 4096];
                for _ in 0..per_connection {
                    let Some(request) = read_request(&mut socket, &mut buffer).await else {
                        return;
                    };
                    assert!(
                        request.starts_with(
                            "get /metadata/scheduledevents?api-version=2020-07-01 http/1.1"
                        ),
                        "{request}"
                    );
                    assert!(request.contains("metadata: true"), "{request}");
                    assert!(request.contains("host: 127.0.0.1:"), "{request}");
                    for (at, part) in parts.iter().enumerate() {
                        if at > 0 {
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                        if socket.write_all(part).await.is_err() {
                            return;
                        }
                    }
                }
                // Closed a little after the last answer, as an idle keep-alive connection
                // is: the client has put it back by then.
                tokio::time::sleep(Duration::from_millis(10)).await;
                drop(socket);
                closes.fetch_add(1, SeqCst);
            });
        }
    });
    let url = url
        .join("metadata/scheduledevents?api-version=2020-07-01")
        .unwrap();
    (url, accepted, closed)
}

/// A server whose first connection answers one request, then reads the next and calls
/// `on_second`; then it closes without answering (the service may have counted it), or
/// with `hang` keeps the connection open and silent. Later connections answer every
/// request with an empty document. Returns its URL and when each request arrived.
fn server_that_takes_a_second_request_without_answering(
    on_second: impl Fn() + Send + Sync + 'static,
    hang: bool,
) -> (Url, Arc<Mutex<Vec<std::time::Instant>>>) {
    const DOCUMENT: &[u8] =
        b"HTTP/1.1 200 OK\r\ncontent-length: 37\r\n\r\n{\"DocumentIncarnation\":1,\"Events\":[]}";
    let arrivals = Arc::new(Mutex::new(Vec::new()));
    let arrived = arrivals.clone();
    let on_second = Arc::new(on_second);
    let url = serve_elsewhere(move |listener| async move {
        for connection in 0.. {
            let (mut socket, _) = listener.accept().await.unwrap();
            let (arrived, on_second) = (arrived.clone(), on_second.clone());
            tokio::spawn(async move {
                let mut buffer = vec![0u8; 4096];
                for answered in 0.. {
                    if read_request(&mut socket, &mut buffer).await.is_none() {
                        return;
                    }
                    arrived.lock().unwrap().push(std::time::Instant::now());
                    if connection == 0 && answered == 1 {
                        on_second();
                        if hang {
                            std::future::pending::<()>().await;
                        }
                        return;
                    }
                    if socket.write_all(DOCUMENT).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (url, arrivals)
}

#[tokio::test]
async fn one_connection_serves_every_poll() {
    let (url, accepted, _) = server(OK, usize::MAX);
    let mut connection = KeptAlive::new(&url, SECOND).unwrap();
    for _ in 0..5 {
        let answer = connection.get(SECOND, no_turn).await.unwrap();
        assert_eq!((answer.status, &answer.body[..]), (200, &b"{}"[..]));
    }
    assert_eq!(accepted.load(SeqCst), 1);
}

#[tokio::test]
async fn a_connection_the_service_closed_while_idle_is_replaced_without_a_failed_poll() {
    let (url, accepted, closed) = server(OK, 1);
    let mut connection = KeptAlive::new(&url, SECOND).unwrap();
    let turns = std::cell::Cell::new(0);
    for poll in 1..=3 {
        let answer = connection
            .get(SECOND, || async { turns.set(turns.get() + 1) })
            .await
            .unwrap();
        assert_eq!(answer.status, 200);
        assert!(connection.open.is_some(), "kept after a keep-alive answer");
        // The server closes the connection 10 ms after its answer, while it is idle
        // here; once the runtime has seen the close (a wait parks it), the next poll
        // finds the connection gone before sending anything on it.
        while closed.load(SeqCst) < poll {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(accepted.load(SeqCst), 3);
    assert_eq!(
        turns.get(),
        0,
        "no request was sent twice, so none waited for a turn"
    );
}

#[tokio::test]
async fn a_request_a_kept_connection_took_without_answering_is_sent_again_only_after_a_new_turn() {
    let (url, arrivals) = server_that_takes_a_second_request_without_answering(|| {}, false);
    let url = url.join("metadata/scheduledevents").unwrap();
    let mut connection = KeptAlive::new(&url, SECOND).unwrap();
    let turn_ended = std::cell::Cell::new(None);
    let next_turn = || async {
        assert_eq!(
            arrivals.lock().unwrap().len(),
            2,
            "the turn is taken after the failed sending, before the next"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        turn_ended.set(Some(std::time::Instant::now()));
    };
    assert_eq!(connection.get(SECOND, no_turn).await.unwrap().status, 200);
    assert_eq!(connection.get(SECOND, next_turn).await.unwrap().status, 200);
    let arrivals = arrivals.lock().unwrap().clone();
    assert_eq!(arrivals.len(), 3);
    let turn_ended = turn_ended.get().expect("a turn was taken");
    assert!(arrivals[2] >= turn_ended, "sent again only after its turn");
}

#[tokio::test]
async fn a_poll_sent_again_waits_out_a_429_that_came_meanwhile_beyond_its_timeout() {
    // A request timeout shorter than the wait for the re-send's turn: the turn is not
    // part of it. The 429 (to another request of the agent) is noted after the failed
    // sending reached the server and before the client can see it fail.
    let client = Arc::new(OnceLock::new());
    let throttle = client.clone();
    let (url, arrivals) = server_that_takes_a_second_request_without_answering(
        move || {
            let client: &crate::imds::ImdsClient = throttle.get().unwrap();
            client.pacer().throttled(Duration::from_millis(300));
        },
        false,
    );
    let client = client.get_or_init(|| {
        crate::imds::ImdsClient::new(url, "2020-07-01", Duration::from_millis(100), SECOND).unwrap()
    });
    let mut connection = client.poll_connection().unwrap();
    let body = client.fetch_body_on(&mut connection).await.unwrap();
    client.parse(&body).unwrap();
    let body = client.fetch_body_on(&mut connection).await.unwrap();
    client.parse(&body).unwrap();
    let arrivals = arrivals.lock().unwrap().clone();
    assert_eq!(arrivals.len(), 3);
    assert!(
        arrivals[2] - arrivals[1] >= Duration::from_millis(300),
        "sent again {:?} after the failed one, inside the Retry-After",
        arrivals[2] - arrivals[1]
    );
}

#[tokio::test]
async fn a_request_a_kept_connection_timed_out_on_is_not_sent_again() {
    let (url, arrivals) = server_that_takes_a_second_request_without_answering(|| {}, true);
    let url = url.join("metadata/scheduledevents").unwrap();
    let mut connection = KeptAlive::new(&url, SECOND).unwrap();
    let turns = std::cell::Cell::new(0);
    assert_eq!(connection.get(SECOND, no_turn).await.unwrap().status, 200);
    let unanswered = connection
        .get(Duration::from_millis(100), || async {
            turns.set(turns.get() + 1)
        })
        .await
        .unwrap_err();
    assert!(matches!(unanswered, Unanswered::TimedOut), "{unanswered:?}");
    assert_eq!((turns.get(), arrivals.lock().unwrap().len()), (0, 2));
}

#[tokio::test]
async fn connection_close_answers_are_read_whole_and_the_connection_is_not_reused() {
    const CLOSE: &[u8] =
        b"HTTP/1.1 503 Service Unavailable\r\nconnection: close\r\nretry-after: 7\r\ncontent-length: 4\r\n\r\nbusy";
    let (url, accepted, _) = server(CLOSE, 1);
    let mut connection = KeptAlive::new(&url, SECOND).unwrap();
    for _ in 0..2 {
        let answer = connection.get(SECOND, no_turn).await.unwrap();
        assert_eq!(answer.status, 503);
        assert_eq!(answer.retry_after.as_deref(), Some("7"));
        assert_eq!(&answer.body[..], b"busy");
    }
    assert_eq!(accepted.load(SeqCst), 2);
}

#[tokio::test]
async fn an_abandoned_request_does_not_leave_its_connection_for_the_next_one() {
    // A server that reads the request and never answers: the timeout drops the
    // exchange half-way.
    let (url, accepted, _) = server(b"", usize::MAX);
    let mut connection = KeptAlive::new(&url, SECOND).unwrap();
    for _ in 0..2 {
        let timed_out = connection
            .get(Duration::from_millis(100), no_turn)
            .await
            .unwrap_err();
        assert!(matches!(timed_out, Unanswered::TimedOut), "{timed_out:?}");
    }
    assert_eq!(accepted.load(SeqCst), 2);
}

#[tokio::test]
async fn an_endpoint_nobody_listens_on_is_a_clear_failure() {
    let port = sched_relay_transport::testing::free_port();
    let url = Url::parse(&format!("http://127.0.0.1:{port}/metadata/scheduledevents")).unwrap();
    let error = failure(&mut KeptAlive::new(&url, SECOND).unwrap(), SECOND).await;
    assert!(
        error.contains(&format!("cannot connect to 127.0.0.1:{port}")),
        "{error}"
    );
}

#[test]
fn only_plain_http_endpoints_get_a_kept_alive_connection() {
    let https = Url::parse("https://169.254.169.254/metadata/scheduledevents").unwrap();
    assert!(KeptAlive::new(&https, Duration::from_secs(1)).is_none());
    let ipv6 = Url::parse("http://[fd00::1]:8080/metadata/scheduledevents?a=b").unwrap();
    let connection = KeptAlive::new(&ipv6, Duration::from_secs(1)).unwrap();
    assert_eq!(connection.authority, "[fd00::1]:8080");
    let request = String::from_utf8(connection.request).unwrap();
    assert!(
        request.starts_with(
            "GET /metadata/scheduledevents?a=b HTTP/1.1\r\nHost: [fd00::1]:8080\r\nMetadata: true\r\n"
        ),
        "{request}"
    );
    let default_port = Url::parse("http://169.254.169.254/metadata/scheduledevents").unwrap();
    let connection = KeptAlive::new(&default_port, Duration::from_secs(1)).unwrap();
    assert_eq!(connection.authority, "169.254.169.254:80");
    let request = String::from_utf8(connection.request).unwrap();
    assert!(
        request.contains("\r\nHost: 169.254.169.254\r\n"),
        "{request}"
    );
}

/// A server that takes each request and answers it one byte every `every`, forever.
fn trickling_server(every: Duration) -> Url {
    serve_elsewhere(move |listener| async move {
        loop {
            let (mut socket, _) = listener.accept().await.unwrap();
            tokio::spawn(async move {
                let mut buffer = vec![0u8; 4096];
                read_request(&mut socket, &mut buffer).await;
                for byte in b"HTTP/1.1 200 OK\r\nx-slow: "
                    .iter()
                    .chain(std::iter::repeat(&b'a'))
                {
                    if socket.write_all(&[*byte]).await.is_err() {
                        return;
                    }
                    tokio::time::sleep(every).await;
                }
            });
        }
    })
}

#[tokio::test]
async fn an_answer_that_trickles_in_times_out_at_the_timeout_not_per_read() {
    let url = trickling_server(Duration::from_millis(20));
    let mut connection = KeptAlive::new(&url, SECOND).unwrap();
    let started = std::time::Instant::now();
    // Bounded here too, so that a timeout taken per read fails the test, not hang it.
    let unanswered = tokio::time::timeout(
        Duration::from_secs(2),
        connection.get(Duration::from_millis(300), no_turn),
    )
    .await
    .expect("timed out by its own timeout, not this one")
    .unwrap_err();
    assert!(matches!(unanswered, Unanswered::TimedOut), "{unanswered:?}");
    assert!(
        started.elapsed() < Duration::from_millis(500),
        "timed out after {:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn what_the_poll_loop_waits_on_beside_a_request_is_seen_within_a_slice() {
    // A server that takes the request and never answers, and one that answers a byte a
    // little less often than a slice (no read waits a slice out); the poll loop selects on
    // its stop beside the request, first, as here on a timer. Stops at six phases each.
    let (hangs, _, _) = server(b"", usize::MAX);
    for url in [hangs, trickling_server(Duration::from_millis(45))] {
        let mut connection = KeptAlive::new(&url, SECOND).unwrap();
        for phase in 0..6 {
            let stop = tokio::time::sleep(Duration::from_millis(60 + 10 * phase));
            tokio::pin!(stop);
            tokio::select! {
                biased;
                _ = &mut stop => {}
                answered = connection.get(Duration::from_secs(10), no_turn) => {
                    panic!("no answer was sent whole: {answered:?}");
                }
            }
            let late = tokio::time::Instant::now() - stop.deadline();
            assert!(late < 2 * SLICE, "the stop was seen {late:?} after it came");
        }
    }
}
