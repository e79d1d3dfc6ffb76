//! How answers are framed and read: each framing RFC 9112 allows, and answers that are not
//! HTTP or too large, against the servers of the parent module's tests.

use std::sync::atomic::Ordering::SeqCst;
use std::time::Duration;

use super::super::KeptAlive;
use super::super::tests::{SECOND, failure, no_turn, serve_elsewhere, server, server_in_parts};

#[tokio::test]
async fn chunked_answers_are_read_whole_and_the_connection_is_kept() {
    let (url, accepted, _) = server_in_parts(
        vec![
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\nretry-after: 3\r\n\r\n9\r\n{\"Doc",
            b"umen\r\n1c;note=x\r\ntIncarnation\":1,\"Events\":[]}\r\n",
            b"0\r\nx-trailer: ignored\r\n\r\n",
        ],
        usize::MAX,
    );
    let mut connection = KeptAlive::new(&url, SECOND).unwrap();
    for _ in 0..2 {
        let answer = connection.get(SECOND, no_turn).await.unwrap();
        assert_eq!(answer.status, 200);
        assert_eq!(answer.retry_after.as_deref(), Some("3"));
        assert_eq!(
            &answer.body[..],
            br#"{"DocumentIncarnation":1,"Events":[]}"#
        );
    }
    assert_eq!(accepted.load(SeqCst), 1, "kept after a chunked answer");
}

#[tokio::test]
async fn an_answer_without_a_length_is_read_until_the_close_and_not_reused() {
    let (url, accepted, _) = server_in_parts(
        vec![b"HTTP/1.1 200 OK\r\n\r\n{\"Document", b"Incarnation\":2}"],
        1,
    );
    let mut connection = KeptAlive::new(&url, SECOND).unwrap();
    for _ in 0..2 {
        let answer = connection.get(SECOND, no_turn).await.unwrap();
        assert_eq!(&answer.body[..], br#"{"DocumentIncarnation":2}"#);
        assert!(connection.open.is_none());
    }
    assert_eq!(accepted.load(SeqCst), 2);
}

#[tokio::test]
async fn informational_answers_before_the_answer_are_passed_over() {
    let (url, _, _) = server_in_parts(
        vec![
            b"HTTP/1.1 100 Continue\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}",
        ],
        usize::MAX,
    );
    let mut connection = KeptAlive::new(&url, SECOND).unwrap();
    let answer = connection.get(SECOND, no_turn).await.unwrap();
    assert_eq!((answer.status, &answer.body[..]), (200, &b"{}"[..]));
}

#[tokio::test]
async fn an_answer_over_the_size_limit_is_refused_without_reading_it() {
    for answer in [
        &b"HTTP/1.1 200 OK\r\ncontent-length: 16777217\r\n\r\n{"[..],
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1000001\r\n{",
    ] {
        let (url, _, _) = server(answer, usize::MAX);
        // Refused at once, not timed out waiting for the rest.
        let error = failure(&mut KeptAlive::new(&url, SECOND).unwrap(), SECOND).await;
        assert!(
            error.contains("answers over 16777216 bytes are refused"),
            "{error}"
        );
    }
}

#[tokio::test]
async fn answers_that_are_not_http_are_a_clear_failure() {
    for (answer, expected) in [
        (&b"SSH-2.0-OpenSSH_9.2\r\n\r\n"[..], "not HTTP/1.1"),
        (
            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\n{}",
            "two different Content-Lengths",
        ),
        (
            b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n{}",
            "not a number",
        ),
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
            "malformed chunk size",
        ),
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\n{}}\r\n0\r\n\r\n",
            "does not end where its size says",
        ),
    ] {
        let (url, _, _) = server(answer, usize::MAX);
        let mut connection = KeptAlive::new(&url, SECOND).unwrap();
        let error = failure(&mut connection, SECOND).await;
        assert!(error.contains(expected), "{error}");
        assert!(connection.open.is_none(), "not kept after {expected}");
    }
}

#[tokio::test]
async fn bytes_after_an_answer_that_nobody_asked_for_end_the_connection() {
    let (url, accepted, _) = server(
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}HTTP/1.1 200 OK\r\n",
        usize::MAX,
    );
    let mut connection = KeptAlive::new(&url, SECOND).unwrap();
    for _ in 0..2 {
        let answer = connection.get(SECOND, no_turn).await.unwrap();
        assert_eq!(&answer.body[..], b"{}");
        assert!(connection.open.is_none(), "let go at once");
    }
    assert_eq!(accepted.load(SeqCst), 2);
}

/// A server that answers each request with `head`, then `line` over and over, forever.
fn endless_server(head: &'static [u8], line: &'static [u8]) -> url::Url {
    use tokio::io::AsyncWriteExt;
    serve_elsewhere(move |listener| async move {
        loop {
            let (mut socket, _) = listener.accept().await.unwrap();
            tokio::spawn(async move {
                let mut buffer = vec![0u8; 4096];
                super::super::tests::read_request(&mut socket, &mut buffer).await;
                let lines = line.repeat(1024);
                if socket.write_all(head).await.is_err() {
                    return;
                }
                while socket.write_all(&lines).await.is_ok() {}
            });
        }
    })
}

#[tokio::test]
async fn an_answer_that_never_ends_its_head_or_trailer_is_refused_not_buffered() {
    for (head, line, expected) in [
        (
            &b""[..],
            &b"HTTP/1.1 100 Continue\r\n\r\n"[..],
            "informational answers",
        ),
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n0\r\n",
            b"x-more: trailer\r\n",
            "trailer over 65536 bytes",
        ),
        (
            b"HTTP/1.1 200 OK\r\nx-long: ",
            b"a",
            "head over 65536 bytes",
        ),
        (
            b"HTTP/1.1 200 OK\r\n\r\n",
            b"{}",
            "answers over 16777216 bytes are refused",
        ),
    ] {
        let url = endless_server(head, line);
        let mut connection = KeptAlive::new(&url, SECOND).unwrap();
        // Refused, not read until the timeout.
        let error = failure(&mut connection, Duration::from_secs(30)).await;
        assert!(error.contains(expected), "{error}");
    }
}

#[tokio::test]
async fn a_body_within_the_limit_is_read_whatever_its_framing_takes() {
    // The largest body by its length, and a 12 MiB one in 16-byte chunks: 16.5 MiB on the
    // wire, more than the body limit, all of it framing.
    let largest = vec![b'7'; 16 * 1024 * 1024];
    let mut whole = b"HTTP/1.1 200 OK\r\ncontent-length: 16777216\r\n\r\n".to_vec();
    whole.extend_from_slice(&largest);
    let chunked_body = vec![b'c'; 12 * 1024 * 1024];
    let mut chunked = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
    for chunk in chunked_body.chunks(16) {
        chunked.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
        chunked.extend_from_slice(chunk);
        chunked.extend_from_slice(b"\r\n");
    }
    chunked.extend_from_slice(b"0\r\n\r\n");
    for (answer, body) in [(whole, largest), (chunked, chunked_body)] {
        let (url, _, _) = server(answer.leak(), usize::MAX);
        let mut connection = KeptAlive::new(&url, SECOND).unwrap();
        let answer = connection
            .get(Duration::from_secs(30), no_turn)
            .await
            .unwrap();
        assert_eq!(answer.body.len(), body.len());
        assert!(answer.body[..] == body[..]);
    }
}
