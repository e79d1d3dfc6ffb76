//! The agent's own HTTP listener (`[telemetry] listen`, loopback by default): `/metrics`
//! (Prometheus text format), `/healthz` (the process answers), `/readyz` (first poll done,
//! sinks healthy, no outbox full), `GET /events` (the current document and each event's
//! delivery state per sink), and `POST /approvals` when `[approvals.http]` is enabled.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use sched_relay_transport::inbound::{Deliveries, Handover, Inbound, hand_over};
use subtle::ConstantTimeEq;

use crate::telemetry::Telemetry;

mod credentials;
pub use credentials::{BearerToken, ListenerTls, tls_acceptor};

/// What `POST /approvals` needs.
#[derive(Clone)]
pub struct ApprovalEndpoint {
    pub deliveries: Deliveries,
    /// `Authorization: Bearer <token>` is required when set.
    pub token: Option<Arc<BearerToken>>,
}

/// How much of the agent a client may hold (`[telemetry] max_connections`, `request_timeout`):
/// once the listener is reachable from the network, anyone can open connections.
#[derive(Clone)]
pub struct Limits {
    /// Connections served at once.
    pub max_connections: usize,
    /// How long a client may take to send a request's headers, and its body (and to
    /// complete a TLS handshake).
    pub request_timeout: Duration,
    /// HTTPS, when `telemetry.tls_cert_file` is set.
    pub tls: Option<Arc<ListenerTls>>,
}

impl Default for Limits {
    fn default() -> Self {
        Limits::from(&crate::telemetry::TelemetryConfig::default())
    }
}

impl From<&crate::telemetry::TelemetryConfig> for Limits {
    /// The configuration's limits; TLS as [`ListenerTls::load`] makes it (a configuration
    /// that passed validation has loadable files; should they have changed since, the error
    /// is logged and the listener serves nothing rather than plain HTTP).
    fn from(config: &crate::telemetry::TelemetryConfig) -> Self {
        let tls = ListenerTls::load(config);
        Limits {
            max_connections: config.max_connections,
            request_timeout: config.request_timeout,
            tls,
        }
    }
}

/// Connections beyond the limit that are read (for `GET /healthz`) and answered at once; past
/// these, an extra connection is closed unanswered.
const OVERFLOW_ANSWERED: usize = 32;
/// How long a connection beyond the limit may take to say what it wants.
const OVERFLOW_READ: Duration = Duration::from_secs(2);

/// Binds the listener (so a taken port fails the start, loudly) and returns the server task.
/// Each connection gets `limits.request_timeout` to send its headers (and a POST its body);
/// beyond `limits.max_connections` a connection is answered `503` (`200` for `GET /healthz`,
/// so a liveness probe still passes) and closed.
pub async fn serve(
    listen: SocketAddr,
    telemetry: Arc<Telemetry>,
    approvals: Option<ApprovalEndpoint>,
    max_body: usize,
    limits: Limits,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(SocketAddr, tokio::task::JoinHandle<()>), std::io::Error> {
    let mut router = Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/events", get(events))
        .with_state(telemetry);
    if let Some(endpoint) = approvals {
        let approvals = Approvals {
            endpoint,
            max_body,
            body_timeout: limits.request_timeout,
        };
        router = router.route("/approvals", post(approve).with_state(approvals));
    }
    let listener = tokio::net::TcpListener::bind(listen).await?;
    let bound = listener.local_addr()?;
    let task = tokio::spawn(accept(listener, router, limits, shutdown));
    Ok((bound, task))
}

/// Accepts connections until `shutdown`, then lets the ones under way finish their request.
async fn accept(
    listener: tokio::net::TcpListener,
    router: Router,
    limits: Limits,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) {
    let served = Arc::new(tokio::sync::Semaphore::new(limits.max_connections.max(1)));
    let overflow = Arc::new(tokio::sync::Semaphore::new(OVERFLOW_ANSWERED));
    let (stop, stopping) = tokio::sync::watch::channel(false);
    let mut connections = tokio::task::JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(error) => {
                    // Out of file descriptors, say: wait rather than spin.
                    tracing::warn!(error = %error, "The HTTP listener cannot accept a connection");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
        };
        match served.clone().try_acquire_owned() {
            Ok(permit) => {
                let service = hyper_util::service::TowerToHyperService::new(router.clone());
                let stopping = stopping.clone();
                let timeout = limits.request_timeout;
                let tls = limits.tls.as_ref().map(|tls| tls.acceptor());
                connections.spawn(async move {
                    let _permit = permit;
                    match tls {
                        None => serve_connection(stream, service, timeout, stopping).await,
                        Some(tls) => {
                            // A client that never completes its handshake is held no longer
                            // than one that never sends its headers.
                            match tokio::time::timeout(timeout, tls.accept(stream)).await {
                                Ok(Ok(stream)) => {
                                    serve_connection(stream, service, timeout, stopping).await;
                                }
                                Ok(Err(error)) => {
                                    tracing::debug!(error = %error, "TLS handshake with a client failed");
                                }
                                Err(_) => {}
                            }
                        }
                    }
                });
            }
            Err(_) => {
                metrics::counter!("sched_relay_http_connections_refused_total").increment(1);
                // Over TLS a plain answer would be noise: closed unanswered.
                if limits.tls.is_none()
                    && let Ok(permit) = overflow.clone().try_acquire_owned()
                {
                    tokio::spawn(async move {
                        let _permit = permit;
                        answer_beyond_the_limit(stream).await;
                    });
                }
                // Else dropped: closed unanswered.
            }
        }
    }
    let _ = stop.send(true);
    while connections.join_next().await.is_some() {}
}

/// Serves HTTP/1.1 on one connection until it ends, its client idles past `timeout` in a
/// request's headers, or the listener stops (then after the request under way).
async fn serve_connection<I>(
    io: I,
    service: hyper_util::service::TowerToHyperService<Router>,
    timeout: Duration,
    mut stopping: tokio::sync::watch::Receiver<bool>,
) where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(timeout);
    let connection = http.serve_connection(hyper_util::rt::TokioIo::new(io), service);
    tokio::pin!(connection);
    tokio::select! {
        _ = connection.as_mut() => {}
        () = async { let _ = stopping.wait_for(|stop| *stop).await; } => {
            connection.as_mut().graceful_shutdown();
            let _ = connection.await;
        }
    }
}

/// A connection beyond the limit: `200 ok` for `GET /healthz`, `503` for anything else, then
/// closed.
async fn answer_beyond_the_limit(mut stream: tokio::net::TcpStream) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut start = [0u8; 16];
    let read = tokio::time::timeout(OVERFLOW_READ, stream.read(&mut start)).await;
    let health = matches!(read, Ok(Ok(n)) if start[..n].starts_with(b"GET /healthz "));
    let answer: &[u8] = if health {
        b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 3\r\nconnection: close\r\n\r\nok\n"
    } else {
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\nretry-after: 1\r\ncontent-length: 21\r\nconnection: close\r\n\r\ntoo many connections\n"
    };
    let _ = tokio::time::timeout(OVERFLOW_READ, stream.write_all(answer)).await;
}

async fn readyz(State(telemetry): State<Arc<Telemetry>>) -> Response {
    // Readiness reads the store (each sink's depth), which can wait on a commit's fsync or a
    // reopen after an I/O error: off the async threads, so a probe never stalls polling.
    match tokio::task::spawn_blocking(move || telemetry.readiness()).await {
        Ok(Ok(body)) => (StatusCode::OK, axum::Json(body)).into_response(),
        Ok(Err(body)) => (StatusCode::SERVICE_UNAVAILABLE, axum::Json(body)).into_response(),
        Err(error) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("readiness failed: {error}"),
        )
            .into_response(),
    }
}

async fn metrics(State(telemetry): State<Arc<Telemetry>>) -> Response {
    // Reading the store's gauges touches the disk: off the async threads.
    match tokio::task::spawn_blocking(move || telemetry.render_metrics()).await {
        Ok(text) => (
            [(
                header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            text,
        )
            .into_response(),
        Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response(),
    }
}

async fn events(State(telemetry): State<Arc<Telemetry>>) -> Response {
    match tokio::task::spawn_blocking(move || telemetry.events_view()).await {
        Ok(view) => axum::Json(view).into_response(),
        Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response(),
    }
}

/// `POST /approvals`, with its body's limits.
#[derive(Clone)]
struct Approvals {
    endpoint: ApprovalEndpoint,
    max_body: usize,
    body_timeout: Duration,
}

async fn approve(
    State(Approvals {
        endpoint,
        max_body,
        body_timeout,
    }): State<Approvals>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    if let Some(token) = &endpoint.token {
        let token = token.current();
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or_default();
        if !bool::from(given.as_bytes().ct_eq(token.as_bytes())) {
            tracing::warn!("POST /approvals without the right bearer token; refused");
            metrics::counter!("sched_relay_approvals_unauthorized_total").increment(1);
            return (
                StatusCode::UNAUTHORIZED,
                [(header::WWW_AUTHENTICATE, "Bearer")],
                "a bearer token is required\n",
            )
                .into_response();
        }
    }
    // A body that never comes, or comes a byte at a time, holds a connection: bounded.
    let body = match tokio::time::timeout(body_timeout, axum::body::to_bytes(body, max_body)).await
    {
        Ok(Ok(body)) => body,
        Ok(Err(error)) => {
            return (
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("the request body is unreadable or over {max_body} bytes: {error}\n"),
            )
                .into_response();
        }
        Err(_) => {
            return (
                StatusCode::REQUEST_TIMEOUT,
                format!(
                    "the request body did not arrive within {body_timeout:?} (telemetry.request_timeout)\n"
                ),
            )
                .into_response();
        }
    };
    let message = Inbound {
        transport: "http",
        channel: "POST /approvals".into(),
        headers: headers
            .iter()
            .filter(|(name, _)| *name != header::AUTHORIZATION)
            .map(|(name, value)| {
                (
                    name.as_str().to_owned(),
                    String::from_utf8_lossy(value.as_bytes()).into_owned(),
                )
            })
            .collect(),
        content_type: None,
        body: body.to_vec(),
        shared: false,
        route: None,
    };
    let reply = match hand_over(&endpoint.deliveries, message).await {
        Handover::Handled(reply) => reply,
        Handover::NotHandled(why) => {
            return (
                StatusCode::SERVICE_UNAVAILABLE,
                format!("no outcome: it could not be stored; send the request again: {why}\n"),
            )
                .into_response();
        }
        Handover::Stopping => {
            return (
                StatusCode::SERVICE_UNAVAILABLE,
                "no outcome: the agent is stopping; send the request again\n",
            )
                .into_response();
        }
    };
    let status = match (reply.outcome, reply.body["reason"].as_str()) {
        ("accepted", _) => StatusCode::OK,
        ("failed", Some("state_store_error")) => StatusCode::SERVICE_UNAVAILABLE,
        ("failed", _) => StatusCode::BAD_GATEWAY,
        (_, Some("too_large")) => StatusCode::PAYLOAD_TOO_LARGE,
        (_, Some("unsupported_content_type")) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
        (_, Some("malformed")) => StatusCode::BAD_REQUEST,
        (_, Some("unsigned" | "unknown_key" | "bad_signature")) => StatusCode::FORBIDDEN,
        _ => StatusCode::CONFLICT,
    };
    (status, axum::Json(reply.body)).into_response()
}
