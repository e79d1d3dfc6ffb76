//! The operator's controls of a running coordinator: `POST /pause`, `/resume` and
//! `/release` on its listener, authenticated by the bearer token in
//! `coordinator.admin_token_file` (without one they answer 403), and the
//! `sched-relay coordinate pause|resume|release` commands that call them. What they change
//! is stored like the fleet's state, so it survives a restart and a failover.

use std::sync::Arc;

use axum::http::{HeaderMap, StatusCode, header};
use axum::response::IntoResponse;
use serde::Deserialize;
use subtle::ConstantTimeEq;
use tokio::sync::{mpsc, oneshot};

use super::Role;
use super::config::CoordinatorConfig;
use super::engine::Admin;

/// A command for the engine, with where its answer goes.
pub(super) type Request = (Admin, oneshot::Sender<Result<String, String>>);

/// The routes' state: the token and the way to the engine.
#[derive(Clone)]
pub(super) struct Endpoint {
    pub token: Option<Arc<str>>,
    pub requests: mpsc::Sender<Request>,
}

/// The token from `admin_token_file`: a readable, non-empty file, or an error that stops
/// the start.
pub(super) fn token(config: &CoordinatorConfig) -> Result<Option<Arc<str>>, String> {
    let Some(path) = &config.coordinator.admin_token_file else {
        return Ok(None);
    };
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("coordinator.admin_token_file {}: {e}", path.display()))?;
    let token = text.trim();
    if token.len() < 16 {
        return Err(format!(
            "coordinator.admin_token_file {}: the token must be at least 16 characters",
            path.display()
        ));
    }
    Ok(Some(Arc::from(token)))
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct PauseBody {
    #[serde(default)]
    reason: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ReleaseBody {
    vm: String,
    #[serde(default)]
    event_id: Option<String>,
}

pub(super) fn routes(endpoint: Endpoint, role: Role) -> axum::Router {
    let post = |kind: &'static str| {
        let (endpoint, role) = (endpoint.clone(), role.clone());
        axum::routing::post(move |headers: HeaderMap, body: axum::body::Bytes| {
            let (endpoint, role) = (endpoint.clone(), role.clone());
            async move { handle(kind, &endpoint, &role, &headers, &body).await }
        })
    };
    axum::Router::new()
        .route("/pause", post("pause"))
        .route("/resume", post("resume"))
        .route("/release", post("release"))
}

async fn handle(
    kind: &str,
    endpoint: &Endpoint,
    role: &Role,
    headers: &HeaderMap,
    body: &[u8],
) -> axum::response::Response {
    let answer = |status: StatusCode, text: String| {
        (
            status,
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            format!("{text}\n"),
        )
            .into_response()
    };
    let Some(token) = &endpoint.token else {
        return answer(
            StatusCode::FORBIDDEN,
            "set coordinator.admin_token_file to use this".into(),
        );
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or_default();
    if !bool::from(given.as_bytes().ct_eq(token.as_bytes())) {
        metrics::counter!("sched_relay_coordinator_admin_refused_total").increment(1);
        tracing::warn!(
            action = kind,
            "An operator request without the admin token; refused"
        );
        return answer(
            StatusCode::UNAUTHORIZED,
            "a valid bearer token is needed".into(),
        );
    }
    let refused = match role.now() {
        "active" => None,
        "paused" => Some(
            "this coordinator's lease has not been renewed lately, so it does not act now; try again, or ask the active one",
        ),
        _ => Some("this coordinator is not the active one; ask the active one"),
    };
    if let Some(why) = refused {
        return answer(StatusCode::SERVICE_UNAVAILABLE, why.into());
    }
    let body = if body.iter().all(u8::is_ascii_whitespace) {
        b"{}".as_slice()
    } else {
        body
    };
    let command = match kind {
        "pause" => {
            serde_json::from_slice::<PauseBody>(body).map(|b| Admin::Pause { reason: b.reason })
        }
        "resume" => Ok(Admin::Resume),
        _ => serde_json::from_slice::<ReleaseBody>(body).map(|b| Admin::Release {
            vm: b.vm,
            event: b.event_id,
        }),
    };
    let command = match command {
        Ok(command) => command,
        Err(error) => {
            return answer(
                StatusCode::BAD_REQUEST,
                format!("the body is not what /{kind} takes: {error}"),
            );
        }
    };
    let (tx, rx) = oneshot::channel();
    if endpoint.requests.send((command, tx)).await.is_err() {
        return answer(
            StatusCode::SERVICE_UNAVAILABLE,
            "the coordinator is stopping".into(),
        );
    }
    match rx.await {
        Ok(Ok(said)) => answer(StatusCode::OK, said),
        Ok(Err(error)) => answer(StatusCode::CONFLICT, error),
        Err(_) => answer(
            StatusCode::SERVICE_UNAVAILABLE,
            "the coordinator is stopping".into(),
        ),
    }
}

/// What `sched-relay coordinate pause|resume|release` asks.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum Command {
    /// Stop draining and approving (stored: survives restarts and failovers).
    Pause {
        /// Why, for /fleet and the logs.
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// Drain and approve again.
    Resume,
    /// Free the places a VM holds (it is back, or gone): for every event, or one.
    Release {
        vm: String,
        #[arg(long)]
        event_id: Option<String>,
    },
}

/// Sends the command to the coordinator that `config` describes (its `listen` address and
/// admin token) and prints the answer; exit 0 on success.
pub async fn send(config: &CoordinatorConfig, command: Command) -> std::process::ExitCode {
    use std::process::ExitCode;
    crate::install_crypto_provider();
    let token = match token(config) {
        Ok(Some(token)) => token,
        Ok(None) => {
            eprintln!("error: coordinator.admin_token_file is not set in the configuration");
            return ExitCode::from(2);
        }
        Err(error) => {
            eprintln!("error: {error}");
            return ExitCode::from(2);
        }
    };
    let mut address = config.coordinator.listen;
    if address.ip().is_unspecified() {
        address.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
    }
    let (path, body) = match command {
        Command::Pause { reason } => ("pause", serde_json::json!({ "reason": reason })),
        Command::Resume => ("resume", serde_json::json!({})),
        Command::Release { vm, event_id } => (
            "release",
            serde_json::json!({ "vm": vm, "eventId": event_id }),
        ),
    };
    let http = match reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(30))
        .build()
    {
        Ok(http) => http,
        Err(error) => {
            eprintln!("error: {error}");
            return ExitCode::FAILURE;
        }
    };
    let response = http
        .post(format!("http://{address}/{path}"))
        .bearer_auth(&*token)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await;
    match response {
        Ok(response) => {
            let status = response.status();
            let text = response.text().await.unwrap_or_default();
            if status.is_success() {
                print!("{text}");
                ExitCode::SUCCESS
            } else {
                eprint!("error: the coordinator at {address} answered {status}: {text}");
                ExitCode::FAILURE
            }
        }
        Err(error) => {
            eprintln!("error: cannot reach the coordinator at {address}: {error}");
            ExitCode::FAILURE
        }
    }
}
