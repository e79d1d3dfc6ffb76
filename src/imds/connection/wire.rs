//! One exchange on the poller's connection, on a blocking socket: the request written, the
//! answer read and framed (RFC 9112, section 6.3), each wait at most [`SLICE`] before the
//! runtime gets its turn (see the parent module).

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::{Answer, MAX_BODY, SLICE, Unanswered};

/// The most an answer's head (status line and headers), or a chunked body's trailer, may take.
const MAX_HEAD: usize = 64 * 1024;
/// The most headers an answer may have.
const MAX_HEADERS: usize = 64;
/// The most informational (1xx) answers passed over before the answer.
const MAX_INFORMATIONAL: usize = 8;
/// The most an exchange reads, all told: twice the largest body (a chunked body's framing may
/// take as much as its data) and ten heads (informational ones, the answer's, a trailer).
const MAX_READ: usize = 2 * MAX_BODY + (MAX_INFORMATIONAL + 2) * MAX_HEAD;
/// The most one read asks for (and zeroes first).
const READ_CHUNK: usize = 64 * 1024;

/// An open connection, owned by the exchange on it.
pub(super) struct Open {
    stream: TcpStream,
    /// What the exchange under way has read so far, all told (see [`MAX_READ`]).
    read: usize,
    /// The socket's read and write timeouts as last set: set again only when they change.
    read_timeout: Option<Duration>,
    write_timeout: Option<Duration>,
    /// When the exchange next yields to the runtime, whether or not it is waiting: a service
    /// that trickles its answer does not keep the poll loop from its stop either.
    yield_at: Instant,
}

/// How the answer's body ends (RFC 9112, section 6.3).
enum Framing {
    /// No body: a 204, a 304.
    Empty,
    Length(usize),
    Chunked,
    /// Whatever comes until the service closes the connection.
    UntilClose,
}

/// An answer's head, parsed.
struct Head {
    status: u16,
    /// Its length in bytes, up to and with the empty line.
    length: usize,
    framing: Framing,
    /// The connection ends after this answer.
    close: bool,
    retry_after: Option<String>,
}

impl Open {
    /// The exchanges on `stream`, a connected socket in blocking mode.
    pub(super) fn new(stream: TcpStream) -> Open {
        Open {
            stream,
            read: 0,
            read_timeout: None,
            // As `connect` set it.
            write_timeout: Some(SLICE),
            yield_at: Instant::now() + SLICE,
        }
    }

    /// Whether the connection is open and quiet: a look at the socket that does not wait.
    /// False once the service has closed it, or sent what no request asked for.
    #[cfg(target_os = "linux")]
    pub(super) fn is_idle(&self) -> bool {
        use rustix::net::{RecvFlags, recv};
        let mut byte = [0u8; 1];
        matches!(
            recv(
                &self.stream,
                &mut byte,
                RecvFlags::PEEK | RecvFlags::DONTWAIT
            ),
            Err(rustix::io::Errno::WOULDBLOCK | rustix::io::Errno::INTR)
        )
    }

    /// As on Linux, in three system calls instead of one.
    #[cfg(not(target_os = "linux"))]
    pub(super) fn is_idle(&self) -> bool {
        if self.stream.set_nonblocking(true).is_err() {
            return false;
        }
        let idle = matches!(
            self.stream.peek(&mut [0u8; 1]),
            Err(e) if e.kind() == ErrorKind::WouldBlock
        );
        self.stream.set_nonblocking(false).is_ok() && idle
    }

    /// Writes `request` whole, by `deadline`.
    pub(super) async fn send(
        &mut self,
        request: &[u8],
        deadline: Instant,
    ) -> Result<(), Unanswered> {
        self.yield_at = Instant::now() + SLICE;
        self.read = 0;
        let mut sent = 0;
        while sent < request.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Unanswered::TimedOut);
            }
            let wait = left.min(SLICE);
            if self.write_timeout != Some(wait) {
                if let Err(e) = self.stream.set_write_timeout(Some(wait)) {
                    return Err(Unanswered::Failed(format!("cannot send the request: {e}")));
                }
                self.write_timeout = Some(wait);
            }
            match self.stream.write(&request[sent..]) {
                Ok(0) => return Err(Unanswered::Failed("the connection took no more".into())),
                Ok(n) => sent += n,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                // A socket timeout that ran out (ETIMEDOUT is the connection's own, a failure).
                Err(e) if e.kind() == ErrorKind::WouldBlock => tokio::task::yield_now().await,
                Err(e) => {
                    return Err(Unanswered::Failed(format!(
                        "sending the request failed: {e}"
                    )));
                }
            }
        }
        Ok(())
    }

    /// Reads into `buffer` what the service sends next, by `deadline`: how many bytes, 0 once
    /// it has closed the connection. Yields to the runtime at least every [`SLICE`] (plus the
    /// kernel's rounding of a socket timeout), whether or not bytes come: no read waits past
    /// the next yield.
    async fn fill(&mut self, buffer: &mut Vec<u8>, deadline: Instant) -> Result<usize, Unanswered> {
        let filled = buffer.len();
        let room = MAX_READ.saturating_sub(self.read);
        if room == 0 {
            return Err(failed(format!(
                "the service sent over {MAX_READ} bytes for one answer, heads and framing included"
            )));
        }
        // Zeroed before the read: no more than a read takes. Into what was reserved (the
        // exact length of a Content-Length body), else a little more.
        let spare = buffer.capacity() - filled;
        let want = if spare > 0 {
            spare.min(READ_CHUNK)
        } else {
            4096
        }
        .min(room);
        buffer.resize(filled + want, 0);
        // The wait before the next yield, in whole steps: the same from poll to poll, so the
        // socket's timeout is not set again every poll.
        let step = SLICE / 10;
        let read = loop {
            let now = Instant::now();
            let until_yield = self.yield_at.saturating_duration_since(now);
            let until_yield = step * (until_yield.as_nanos() / step.as_nanos()) as u32;
            if until_yield.is_zero() {
                tokio::task::yield_now().await;
                self.yield_at = Instant::now() + SLICE;
                continue;
            }
            let left = deadline.saturating_duration_since(now);
            if left.is_zero() {
                break Err(Unanswered::TimedOut);
            }
            let wait = left.min(until_yield);
            if self.read_timeout != Some(wait) {
                if let Err(e) = self.stream.set_read_timeout(Some(wait)) {
                    break Err(Unanswered::Failed(format!(
                        "cannot wait for the answer: {e}"
                    )));
                }
                self.read_timeout = Some(wait);
            }
            match self.stream.read(&mut buffer[filled..]) {
                Ok(n) => break Ok(n),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                // The wait ran out: the loop yields, or times out (ETIMEDOUT is the
                // connection's own, a failure).
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(e) => {
                    break Err(Unanswered::Failed(format!(
                        "reading the answer failed: {e}"
                    )));
                }
            }
        };
        let got = read.as_ref().copied().unwrap_or(0);
        buffer.truncate(filled + got);
        self.read += got;
        read
    }

    /// Reads an answer whole; with whether the connection may carry the next request.
    pub(super) async fn answer(
        &mut self,
        buffer: &mut Vec<u8>,
        deadline: Instant,
    ) -> Result<(Answer, bool), Unanswered> {
        let mut start = 0;
        let mut informational = 0;
        let head = loop {
            match parse_head(&buffer[start..])? {
                // Informational answers (100 Continue, 103 Early Hints) precede the answer.
                Some(head) if (100..200).contains(&head.status) && head.status != 101 => {
                    informational += 1;
                    if informational > MAX_INFORMATIONAL {
                        return Err(failed(format!(
                            "more than {MAX_INFORMATIONAL} informational answers before the answer"
                        )));
                    }
                    start += head.length;
                }
                Some(head) => break head,
                None if buffer.len() - start > MAX_HEAD => {
                    return Err(failed(format!("an answer's head over {MAX_HEAD} bytes")));
                }
                None => {
                    if self.fill(buffer, deadline).await? == 0 {
                        return Err(failed(if buffer.len() == start {
                            "the service closed the connection without answering".into()
                        } else {
                            "the service closed the connection in the middle of its answer".into()
                        }));
                    }
                }
            }
        };
        if head.status == 101 {
            return Err(failed(
                "the service switched protocols (101) on a GET".into(),
            ));
        }
        let mut at = start + head.length;
        let body = match head.framing {
            Framing::Empty => Bytes::new(),
            Framing::Length(length) => {
                if length > MAX_BODY {
                    return Err(too_large());
                }
                buffer.reserve((at + length).saturating_sub(buffer.len()));
                while buffer.len() < at + length {
                    self.more(buffer, deadline).await?;
                }
                at += length;
                Bytes::copy_from_slice(&buffer[at - length..at])
            }
            Framing::UntilClose => {
                while self.fill(buffer, deadline).await? > 0 {
                    if buffer.len() - at > MAX_BODY {
                        return Err(too_large());
                    }
                }
                let body = Bytes::copy_from_slice(&buffer[at..]);
                at = buffer.len();
                body
            }
            Framing::Chunked => {
                let mut body = Vec::new();
                loop {
                    let (used, size) = match httparse::parse_chunk_size(&buffer[at..]) {
                        Ok(httparse::Status::Complete(sized)) => sized,
                        Ok(httparse::Status::Partial) if buffer.len() - at > MAX_HEAD => {
                            return Err(failed("a chunk's size line that does not end".into()));
                        }
                        Ok(httparse::Status::Partial) => {
                            self.more(buffer, deadline).await?;
                            continue;
                        }
                        Err(_) => {
                            return Err(failed(
                                "a chunked answer with a malformed chunk size".into(),
                            ));
                        }
                    };
                    let size = usize::try_from(size).unwrap_or(usize::MAX);
                    if size > MAX_BODY - body.len() {
                        return Err(too_large());
                    }
                    at += used;
                    if size == 0 {
                        break;
                    }
                    while buffer.len() < at + size + 2 {
                        self.more(buffer, deadline).await?;
                    }
                    if &buffer[at + size..at + size + 2] != b"\r\n" {
                        return Err(failed(
                            "a chunk of the answer that does not end where its size says".into(),
                        ));
                    }
                    body.extend_from_slice(&buffer[at..at + size]);
                    at += size + 2;
                    // What is decoded leaves the buffer: many small chunks do not pile up
                    // beside the body.
                    if at >= READ_CHUNK {
                        buffer.drain(..at);
                        at = 0;
                    }
                }
                // The trailer: header lines, ignored, up to an empty line.
                let trailer = at;
                loop {
                    match buffer[at..].windows(2).position(|pair| pair == b"\r\n") {
                        Some(0) => {
                            at += 2;
                            break;
                        }
                        Some(line) => at += line + 2,
                        None if buffer.len() - trailer > MAX_HEAD => {
                            return Err(failed(format!(
                                "a chunked answer's trailer over {MAX_HEAD} bytes"
                            )));
                        }
                        None => self.more(buffer, deadline).await?,
                    }
                }
                Bytes::from(body)
            }
        };
        // Bytes after the answer were not asked for: the connection is not trusted again.
        let keep = !head.close && buffer.len() == at;
        Ok((
            Answer {
                status: head.status,
                retry_after: head.retry_after,
                body,
            },
            keep,
        ))
    }

    /// As [`Open::fill`], for the rest of an answer begun: a close now cuts it short.
    async fn more(&mut self, buffer: &mut Vec<u8>, deadline: Instant) -> Result<(), Unanswered> {
        match self.fill(buffer, deadline).await? {
            0 => Err(failed(
                "the service closed the connection in the middle of its answer".into(),
            )),
            _ => Ok(()),
        }
    }
}

fn failed(reason: String) -> Unanswered {
    Unanswered::Failed(reason)
}

fn too_large() -> Unanswered {
    failed(format!(
        "reading the answer failed: answers over {MAX_BODY} bytes are refused"
    ))
}

/// The head of the answer at the start of `bytes`, `None` while it is not whole.
fn parse_head(bytes: &[u8]) -> Result<Option<Head>, Unanswered> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut response = httparse::Response::new(&mut headers);
    let length = match response.parse(bytes) {
        Ok(httparse::Status::Complete(length)) => length,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => return Err(failed(format!("the service's answer is not HTTP/1.1: {e}"))),
    };
    let status = response.code.unwrap_or_default();
    // HTTP/1.0 closes after each answer unless it says otherwise.
    let mut close = response.version == Some(0);
    let mut content_length: Option<usize> = None;
    let mut transfer_encoding: Option<bool> = None; // Some(whether the last coding is chunked)
    let mut retry_after = None;
    for header in response.headers.iter() {
        let value = std::str::from_utf8(header.value).map(str::trim);
        let name = header.name;
        if name.eq_ignore_ascii_case("content-length") {
            let length = value
                .ok()
                .filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|v| v.parse::<usize>().ok())
                .ok_or_else(|| failed("an answer whose Content-Length is not a number".into()))?;
            if content_length.is_some_and(|other| other != length) {
                return Err(failed(
                    "an answer with two different Content-Lengths".into(),
                ));
            }
            content_length = Some(length);
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            let last = value
                .unwrap_or_default()
                .rsplit(',')
                .next()
                .unwrap_or_default();
            transfer_encoding = Some(last.trim().eq_ignore_ascii_case("chunked"));
        } else if name.eq_ignore_ascii_case("connection") {
            for option in value.unwrap_or_default().split(',').map(str::trim) {
                if option.eq_ignore_ascii_case("close") {
                    close = true;
                } else if option.eq_ignore_ascii_case("keep-alive") && response.version == Some(0) {
                    close = false;
                }
            }
        } else if name.eq_ignore_ascii_case("retry-after") && retry_after.is_none() {
            retry_after = value.ok().map(str::to_owned);
        }
    }
    let framing = if (100..200).contains(&status) || status == 204 || status == 304 {
        Framing::Empty
    } else {
        match (transfer_encoding, content_length) {
            (Some(true), _) => Framing::Chunked,
            (Some(false), _) => Framing::UntilClose,
            (None, Some(length)) => Framing::Length(length),
            (None, None) => Framing::UntilClose,
        }
    };
    // Both framings at once: the length is ignored, and the connection not trusted after.
    if transfer_encoding.is_some() && content_length.is_some()
        || matches!(framing, Framing::UntilClose)
    {
        close = true;
    }
    Ok(Some(Head {
        status,
        length,
        framing,
        close,
        retry_after,
    }))
}

#[cfg(test)]
mod tests;
