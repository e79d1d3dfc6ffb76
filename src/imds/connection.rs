//! The poller's own kept-alive HTTP/1.1 connection to the metadata service, for the one GET
//! it makes every poll interval.
//!
//! Why not the shared client (`reqwest`, hyper's pooled client): it runs each connection as a
//! task of its own and hands every request and answer across tasks, so an idle poll woke the
//! runtime three or four times. Here the connection is hyper's connection-level client,
//! driven inside the request's own future: a poll is one write and one wake for the answer
//! (BENCHMARKS.md, "Idle polls"). Everything else (StartRequests, the VM's identity, the
//! approval checks' fresh documents) still goes through the shared client.
//!
//! Faults: a kept connection whose close the runtime has already seen is found before the
//! next request is sent on it, and replaced. A request on a kept connection that fails anyway
//! (the service closed it just then, or took the request and closed without answering) is
//! sent once more (a GET is idempotent) on a new connection, but only in a turn of its own,
//! since the service may have counted the first against its 5 requests a second, and only
//! within what is left of the poll's timeout: however it fails, a poll spends at most one
//! timeout sending. A request that times out is not sent again. A request that fails, times
//! out or is abandoned takes its connection with it (its state is unknown), so the next one
//! starts clean. Proved by the tests below against a server that closes every connection
//! after one answer, one that takes a request without answering, one that hangs, and one
//! that is not there.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper::client::conn::http1;
use hyper::header::{HOST, HeaderValue, RETRY_AFTER, USER_AGENT};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use url::Url;

/// More than any Scheduled Events document (a thousand events are about half a megabyte):
/// an endless answer is refused, not buffered until memory runs out.
pub const MAX_BODY: usize = 16 * 1024 * 1024;

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
    /// The connection could not be made, or failed; with why.
    Failed(String),
}

type Sender = http1::SendRequest<Empty<Bytes>>;
type Driver = http1::Connection<TokioIo<TcpStream>, Empty<Bytes>>;

/// One HTTP/1.1 connection to a plain-HTTP endpoint, opened on first use and kept between
/// requests. Owned by one task (the poller): `&mut self`, no lock.
pub struct KeptAlive {
    /// `host:port`, to connect to.
    authority: String,
    host: HeaderValue,
    /// The request target: path and query.
    target: hyper::Uri,
    connect_timeout: Duration,
    open: Option<(Sender, Driver)>,
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
        Some(KeptAlive {
            authority,
            host: HeaderValue::from_str(&host_header).ok()?,
            target: target.parse().ok()?,
            connect_timeout,
            open: None,
        })
    }

    /// `GET` with `Metadata: true`, its sending bounded by `timeout` (a sending that times
    /// out takes its connection with it, and is not sent again). A kept connection whose close
    /// the runtime has already seen is found before anything is sent on it, and replaced. A
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
        let started = tokio::time::Instant::now();
        match self.get_within(timeout).await {
            Err(Unanswered::Failed(error)) if reused => {
                let left = timeout.saturating_sub(started.elapsed());
                if left.is_zero() {
                    return Err(Unanswered::Failed(error));
                }
                tracing::debug!(error = %error, "The kept-alive connection to the metadata service failed; sending again on a new one, in a turn of its own");
                next_turn().await;
                self.get_within(left).await
            }
            answered => answered,
        }
    }

    async fn get_within(&mut self, timeout: Duration) -> Result<Answer, Unanswered> {
        match tokio::time::timeout(timeout, self.get_once()).await {
            Err(_) => Err(Unanswered::TimedOut),
            Ok(answered) => answered.map_err(Unanswered::Failed),
        }
    }

    /// Drops the kept connection if it has ended while idle (the service closed it, or sent
    /// what it should not have): found by driving it once without waiting, so no request is
    /// sent into a connection whose close the runtime has already seen. (A close still on
    /// its way is found by the request itself.)
    fn forget_if_closed(&mut self) {
        let Some((sender, driver)) = &mut self.open else {
            return;
        };
        let mut idle = std::task::Context::from_waker(std::task::Waker::noop());
        if driver.poll_without_shutdown(&mut idle).is_ready() || sender.is_closed() {
            self.open = None;
        }
    }

    async fn get_once(&mut self) -> Result<Answer, String> {
        // Taken out for the exchange, and put back only when it ends well: a request that
        // fails or is abandoned half-way (a timeout drops this future) leaves no connection
        // in an unknown state behind.
        let (mut sender, mut driver) = match self.open.take() {
            Some(open) => open,
            None => self.connect().await?,
        };
        let request = hyper::Request::get(self.target.clone())
            .header(HOST, self.host.clone())
            .header("Metadata", "true")
            .header(
                USER_AGENT,
                concat!("sched-relay/", env!("CARGO_PKG_VERSION")),
            )
            .body(Empty::new())
            .map_err(|e| format!("cannot build the request: {e}"))?;
        let mut closed = false;
        let answer = {
            let exchange = async {
                let response = sender
                    .send_request(request)
                    .await
                    .map_err(|e| sched_relay_transport::error_chain(&e))?;
                let status = response.status().as_u16();
                let retry_after = response
                    .headers()
                    .get(RETRY_AFTER)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned);
                let body = Limited::new(response.into_body(), MAX_BODY)
                    .collect()
                    .await
                    .map_err(|e| format!("reading the answer failed: {e} (answers over {MAX_BODY} bytes are refused)"))?
                    .to_bytes();
                Ok::<_, String>(Answer {
                    status,
                    retry_after,
                    body,
                })
            };
            tokio::pin!(exchange);
            // The connection does its reading and writing only while it is polled: drive it
            // here, beside the exchange, until the answer is read whole.
            tokio::select! {
                biased;
                answer = &mut exchange => answer?,
                ended = std::future::poll_fn(|cx| driver.poll_without_shutdown(cx)) => {
                    ended.map_err(|error| sched_relay_transport::error_chain(&error))?;
                    // The connection finished: the service said `Connection: close` after its
                    // answer, which is then complete, or it had closed the connection (idle,
                    // between two polls) and no answer will ever come.
                    closed = true;
                    let now = std::future::poll_fn(|cx| {
                        std::task::Poll::Ready(exchange.as_mut().poll(cx))
                    })
                    .await;
                    match now {
                        std::task::Poll::Ready(answer) => answer?,
                        std::task::Poll::Pending => {
                            return Err("the service closed the connection without answering".into());
                        }
                    }
                }
            }
        };
        if !closed && !sender.is_closed() {
            self.open = Some((sender, driver));
        }
        Ok(answer)
    }

    async fn connect(&self) -> Result<(Sender, Driver), String> {
        let stream = tokio::time::timeout(
            self.connect_timeout,
            TcpStream::connect(self.authority.as_str()),
        )
        .await
        .map_err(|_| format!("no connection within {:?}", self.connect_timeout))?
        .map_err(|e| format!("cannot connect to {}: {e}", self.authority))?;
        // One small request, one small answer: never wait to fill a segment.
        let _ = stream.set_nodelay(true);
        http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| sched_relay_transport::error_chain(&e))
    }
}

#[cfg(test)]
mod tests;
