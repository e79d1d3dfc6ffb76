//! The poller's own kept-alive HTTP/1.1 connection to the metadata service, for the one GET
//! it makes every poll interval.
//!
//! Why not the shared client (`reqwest`, hyper's pooled client), nor hyper's connection-level
//! client driven in the poll task (used before): an idle poll is one small request and one
//! small answer, and the work of an async HTTP client around them (its tasks, wakers, the
//! runtime's reactor turns) was half of what a poll cost: an idle poll through hyper on the
//! poll thread's runtime cost as much as the agent's, about twice a blocking loop that sends
//! the same GET (benches/profiling.md, section 14). Here the exchange is a write and blocking
//! reads on the socket; the answer's head is parsed by `httparse`, its body framed as RFC 9112
//! (section 6.3) says: chunked, `Content-Length`, or until the service closes. Everything else
//! (StartRequests, the VM's identity, the approval checks' fresh documents) still goes through
//! the shared client.
//!
//! Blocking is for the poll thread only, which runs nothing but the poll loop: the exchange
//! yields to the runtime at least every [`SLICE`] (no read blocks past that), so whatever the
//! poll loop waits on beside it (a stop) is seen within a slice while the service hangs or
//! trickles its answer. An exchange reads a bounded amount however the service frames what
//! it sends: a body of at most 16 MiB, its framing at most as much again, ten 64 KiB heads.
//!
//! Faults: a kept connection the service has closed (or written to unasked) while idle is
//! found before the next request is sent on it, and replaced. A request on a kept connection
//! that fails anyway (the service closed it just then, or took the request and closed without
//! answering) is sent once more (a GET is idempotent) on a new connection, but only in a turn
//! of its own, since the service may have counted the first against its 5 requests a second,
//! and only within what is left of the poll's timeout: however it fails, a poll spends at most
//! one timeout sending. A request that times out is not sent again. A request that fails,
//! times out or is abandoned takes its connection with it (its state is unknown), so the next
//! one starts clean; so does an answer followed by bytes nobody asked for. Proved by the tests
//! (`connection/tests.rs`) against a server that closes every connection after one answer, one
//! that takes a request without answering, one that hangs, one that trickles, one that is not
//! there, and answers of each framing.

use std::time::{Duration, Instant};

use bytes::Bytes;
use url::Url;

use wire::Open;

/// More than any Scheduled Events document (a thousand events are about half a megabyte):
/// an endless answer is refused, not buffered until memory runs out.
pub const MAX_BODY: usize = 16 * 1024 * 1024;
/// How often, at least, the exchange yields to the runtime (no read blocks past the next
/// yield): a stop is seen within a slice and the kernel's rounding of a socket timeout, while
/// the service hangs or trickles.
pub(crate) const SLICE: Duration = Duration::from_millis(50);
/// A timeout beyond this is taken as this (an `Instant` cannot go on for ever).
const FOREVER: Duration = Duration::from_secs(365 * 24 * 3600);
/// The read buffer kept between polls; one that grew past this (a large document) is let go.
const KEPT_BUFFER: usize = 64 * 1024;

/// What the service answered.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    /// The `Retry-After` header, as sent.
    pub retry_after: Option<String>,
    pub body: Bytes,
}

/// Why a `GET` got no answer.
#[derive(Debug)]
pub enum Unanswered {
    /// None within the timeout.
    TimedOut,
    /// The connection could not be made, or failed, or the answer was not HTTP; with why.
    Failed(String),
}

/// One HTTP/1.1 connection to a plain-HTTP endpoint, opened on first use and kept between
/// requests. Owned by one task (the poller): `&mut self`, no lock.
pub struct KeptAlive {
    /// `host:port`, to connect to.
    authority: String,
    /// The whole request, built once.
    request: Vec<u8>,
    connect_timeout: Duration,
    open: Option<Open>,
    /// Read into, and kept between polls (see [`KEPT_BUFFER`]).
    buffer: Vec<u8>,
}

impl KeptAlive {
    /// A connection for `GET url`; `None` unless `url` is plain `http` (an `https` endpoint
    /// is left to the shared client, which does TLS).
    pub fn new(url: &Url, connect_timeout: Duration) -> Option<KeptAlive> {
        if url.scheme() != "http" {
            return None;
        }
        let host = url.host_str()?;
        let port = url.port_or_known_default()?;
        // An IPv6 literal keeps its brackets in both the Host header and the address.
        let host = match url.host()? {
            url::Host::Ipv6(_) => format!("[{}]", host.trim_matches(|c| c == '[' || c == ']')),
            _ => host.to_owned(),
        };
        let authority = format!("{host}:{port}");
        let host_header = match url.port() {
            Some(port) => format!("{host}:{port}"),
            None => host,
        };
        let target = match url.query() {
            Some(query) => format!("{}?{query}", url.path()),
            None => url.path().to_owned(),
        };
        // A parsed URL has them percent-encoded; checked all the same, since they go into the
        // request as they are.
        let visible = |text: &str| !text.is_empty() && text.bytes().all(|b| b.is_ascii_graphic());
        if !visible(&host_header) || !visible(&target) {
            return None;
        }
        let request = format!(
            "GET {target} HTTP/1.1\r\nHost: {host_header}\r\nMetadata: true\r\nUser-Agent: sched-relay/{}\r\n\r\n",
            env!("CARGO_PKG_VERSION")
        );
        Some(KeptAlive {
            authority,
            request: request.into_bytes(),
            connect_timeout,
            open: None,
            buffer: Vec::new(),
        })
    }

    /// `GET` with `Metadata: true`, its sending bounded by `timeout` (a sending that times
    /// out takes its connection with it, and is not sent again). A kept connection the
    /// service has closed while idle is found before anything is sent on it, and replaced. A
    /// request on a kept connection that fails anyway may have reached the service (which
    /// counts it against its budget of 5 a second), so it is sent once more on a new
    /// connection only after `next_turn` (the pacer's next turn, not counted in the timeout),
    /// and only within what is left of `timeout`. A new connection that fails is the answer.
    pub async fn get<Turn: Future<Output = ()>>(
        &mut self,
        timeout: Duration,
        next_turn: impl FnOnce() -> Turn,
    ) -> Result<Answer, Unanswered> {
        self.forget_if_closed();
        let reused = self.open.is_some();
        let timeout = timeout.min(FOREVER);
        let started = Instant::now();
        match self.get_once(started + timeout).await {
            Err(Unanswered::Failed(error)) if reused => {
                let left = timeout.saturating_sub(started.elapsed());
                if left.is_zero() {
                    return Err(Unanswered::Failed(error));
                }
                tracing::debug!(error = %error, "The kept-alive connection to the metadata service failed; sending again on a new one, in a turn of its own");
                next_turn().await;
                self.get_once(Instant::now() + left).await
            }
            answered => answered,
        }
    }

    /// Drops the kept connection if the service closed it while idle, or sent what no
    /// request asked for: a look at the socket that does not wait, so no request is sent into
    /// a connection already closed. (A close still on its way is found by the request itself.)
    fn forget_if_closed(&mut self) {
        if self.open.as_ref().is_some_and(|open| !open.is_idle()) {
            self.open = None;
        }
    }

    /// One request and its answer, by `deadline`.
    async fn get_once(&mut self, deadline: Instant) -> Result<Answer, Unanswered> {
        // Taken out for the exchange, and put back only when it ends well: a request that
        // fails or is abandoned half-way (the future dropped) leaves no connection in an
        // unknown state behind.
        let mut open = match self.open.take() {
            Some(open) => open,
            None => self.connect(deadline).await?,
        };
        open.send(&self.request, deadline).await?;
        let mut buffer = std::mem::take(&mut self.buffer);
        buffer.clear();
        let (answer, keep) = open.answer(&mut buffer, deadline).await?;
        if buffer.capacity() <= KEPT_BUFFER {
            self.buffer = buffer;
        }
        if keep {
            self.open = Some(open);
        }
        Ok(answer)
    }

    async fn connect(&self, deadline: Instant) -> Result<Open, Unanswered> {
        // Through the runtime, so that a name is resolved off this thread and a connect is
        // bounded; then the socket is the thread's, blocking.
        let limit = self
            .connect_timeout
            .min(deadline.saturating_duration_since(Instant::now()));
        let stream = match tokio::time::timeout(
            limit,
            tokio::net::TcpStream::connect(self.authority.as_str()),
        )
        .await
        {
            Err(_) if limit < self.connect_timeout => return Err(Unanswered::TimedOut),
            Err(_) => {
                return Err(Unanswered::Failed(format!(
                    "no connection within {:?}",
                    self.connect_timeout
                )));
            }
            Ok(Err(e)) => {
                return Err(Unanswered::Failed(format!(
                    "cannot connect to {}: {e}",
                    self.authority
                )));
            }
            Ok(Ok(stream)) => stream,
        };
        // One small request, one small answer: never wait to fill a segment.
        let _ = stream.set_nodelay(true);
        let socket = |e: std::io::Error| {
            Unanswered::Failed(format!(
                "cannot set up the connection to {}: {e}",
                self.authority
            ))
        };
        let stream = stream.into_std().map_err(socket)?;
        stream.set_nonblocking(false).map_err(socket)?;
        stream.set_write_timeout(Some(SLICE)).map_err(socket)?;
        Ok(Open::new(stream))
    }
}

mod wire;

#[cfg(test)]
mod tests;
