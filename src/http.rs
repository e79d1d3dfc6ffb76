//! The agent's own HTTP listener (`[telemetry] listen`, loopback by default): `/metrics`
//! (Prometheus text format), `/healthz` (the process answers), `/readyz` (first poll done,
//! sinks healthy, no outbox full), `GET /events` (the current document and each event's
//! delivery state per sink), and `POST /approvals` when `[approvals.http]` is enabled.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use sched_relay_transport::inbound::{Deliveries, Handover, Inbound, hand_over};
use subtle::ConstantTimeEq;

use crate::telemetry::Telemetry;

/// What `POST /approvals` needs.
#[derive(Clone)]
pub struct ApprovalEndpoint {
    pub deliveries: Deliveries,
    /// `Authorization: Bearer <token>` is required when set.
    pub token: Option<String>,
}

/// Binds the listener (so a taken port fails the start, loudly) and returns the server task.
pub async fn serve(
    listen: SocketAddr,
    telemetry: Arc<Telemetry>,
    approvals: Option<ApprovalEndpoint>,
    max_body: usize,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(SocketAddr, tokio::task::JoinHandle<()>), std::io::Error> {
    let mut router = Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/events", get(events))
        .with_state(telemetry);
    if let Some(endpoint) = approvals {
        router = router.route(
            "/approvals",
            post(approve)
                .with_state(endpoint)
                .layer(DefaultBodyLimit::max(max_body)),
        );
    }
    let listener = tokio::net::TcpListener::bind(listen).await?;
    let bound = listener.local_addr()?;
    let task = tokio::spawn(async move {
        if let Err(error) = axum::serve(listener, router)
            .with_graceful_shutdown(shutdown)
            .await
        {
            tracing::error!(error = %error, "The HTTP listener failed");
        }
    });
    Ok((bound, task))
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

async fn approve(
    State(endpoint): State<ApprovalEndpoint>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Some(token) = &endpoint.token {
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
