//! `sched-relay coordinate`: the fleet's control plane. It reads every agent's events from
//! the broker they publish to, keeps the fleet's state durably, decides per group and
//! disruption budget who may go down now, drains, and sends signed approvals to each VM's
//! own approval channel, tracking the agents' outcomes.
//!
//! ```text
//! agents --events--> broker --> coordinator --drain hook--> your drain
//!    ^                              |
//!    |                              +--signed approval--> broker --> agent --> IMDS
//!    +----------------------------------------------------------------------------+
//! ```
//!
//! Layout: [`fleet`] is the state built from the events (pure), [`policy`] the groups,
//! budgets and decisions (pure), [`engine`] the loop that applies, stores, decides and acts,
//! [`store`] the redb file, [`drain`] the hooks, [`config`] the file, [`input`] the agents'
//! events (and the input stream it creates when missing).

mod admin;
pub mod azure;
pub mod changes;
pub mod config;
pub mod drain;
pub mod engine;
pub mod fleet;
#[cfg(feature = "nats")]
pub mod ha;
mod input;
mod offload;
pub mod policy;
mod role;
pub mod store;
#[cfg(test)]
mod tests;

use std::future::Future;
use std::sync::{Arc, RwLock};

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use tokio::sync::{mpsc, watch};

use config::CoordinatorConfig;
use engine::Engine;
use policy::Policy;

/// Runs until `stop` completes. Errors are the ones that prevent a start (the key, the state
/// store, the listener); broker and hook failures are logged and retried.
pub async fn run(
    config: CoordinatorConfig,
    policy: Policy,
    stop: impl Future<Output = ()>,
) -> Result<(), String> {
    crate::install_crypto_provider();
    // The recorder must exist before the first metric is recorded.
    crate::telemetry::prometheus();
    let key_text = std::fs::read_to_string(&config.signing.key_file).map_err(|e| {
        format!(
            "signing.key_file {}: {e}",
            config.signing.key_file.display()
        )
    })?;
    let signer = sched_relay_core::approval::SigningKey::parse(&key_text).map_err(|e| {
        format!(
            "signing.key_file {}: {e}",
            config.signing.key_file.display()
        )
    })?;
    if signer.public_key().is_none() {
        return Err(format!(
            "signing.key_file {}: an HMAC key; the coordinator signs with Ed25519 only, so that no VM holds a key that can approve for the fleet (sched-relay gen-approval-key)",
            config.signing.key_file.display()
        ));
    }
    let admin_token = admin::token(&config)?;
    let listener = tokio::net::TcpListener::bind(config.coordinator.listen)
        .await
        .map_err(|e| format!("coordinator.listen {}: {e}", config.coordinator.listen))?;
    // Empty until the engine has this instance's state: /fleet answers 503 till then.
    let snapshot: Snapshot = Arc::new(RwLock::new(bytes::Bytes::new()));
    let role = role::Role::new();
    let (admin_tx, mut admin_rx) = mpsc::channel::<admin::Request>(16);
    let server = tokio::spawn(serve(
        listener,
        snapshot.clone(),
        role.clone(),
        admin::Endpoint {
            token: admin_token,
            requests: admin_tx,
        },
    ));
    tokio::pin!(stop);
    let (store, lease) = match &config.ha {
        None => (store::Store::open(&config.coordinator.state_dir)?, None),
        #[cfg(feature = "nats")]
        Some(ha_config) => {
            let ha = tokio::select! {
                ha = ha::Ha::connect(ha_config, config.coordinator.forget_after) => ha?,
                _ = &mut stop => {
                    server.abort();
                    return Ok(());
                }
            };
            role.set("standby");
            let revision = tokio::select! {
                revision = ha.acquire() => revision,
                _ = &mut stop => {
                    server.abort();
                    return Ok(());
                }
            };
            // The lease is this instance's: it loads the state it took over, and is
            // `paused` once active whenever the lease is too old to act on.
            role.set("starting");
            role.gated_by({
                let ha = ha.clone();
                Arc::new(move || ha.may_act())
            });
            // Renewals run on a task of their own from now on, the state's load included.
            let keeper = tokio::spawn(ha.clone().keep(revision));
            (store::Store::Kv(Box::new(ha.state())), Some((ha, keeper)))
        }
        #[cfg(not(feature = "nats"))]
        Some(_) => return Err("ha: this sched-relay was built without NATS support".into()),
    };
    let fleet = store.load()?;
    role.set("active");
    tracing::info!(
        events = fleet.events.len(),
        vms = fleet.vms().len(),
        dry_run = config.coordinator.dry_run,
        "Coordinator state loaded"
    );
    let publisher: Arc<dyn sched_relay_transport::Sink> =
        Arc::from(crate::sinks::registry::build(&config.approvals));
    let (done_tx, mut done_rx) = mpsc::unbounded_channel();
    let (deliveries, mut delivered) = mpsc::channel(64);
    let (stop_tx, stop_rx) = watch::channel(false);
    let (progress, caught_up) = watch::channel(sched_relay_transport::inbound::CatchUp::Unknown);
    let input = input::start(
        &config.input,
        &config.approvals,
        deliveries,
        Some(progress),
        stop_rx.clone(),
    )
    .await?;
    let tick_every = config.coordinator.tick;
    let channel_template = config.input.channel_template();
    let (azure_config, azure_sources) = (config.azure.clone(), config.azure_sources());
    let arm_approvals = config.groups.iter().any(|g| {
        g.azure
            .as_ref()
            .is_some_and(|azure| azure.approve_via.through_arm())
    });
    let mut engine = Engine::new(fleet, policy, config, store, signer, publisher, done_tx);
    engine.snapshot = snapshot.clone();
    // The first decisions come as soon as the input has caught up, not at the next tick.
    let mut catching_up = caught_up.clone();
    engine.progress = Some(caught_up);
    engine.channel_template = channel_template;
    // The groups listed by Azure Resource Manager: a refresher of their inventory.
    let (azure_tx, mut azure_rx) = mpsc::channel(2);
    #[cfg(feature = "azure")]
    let refresher = match azure_config.filter(|_| !azure_sources.is_empty()) {
        Some(azure_config) => {
            let nudge = Arc::new(tokio::sync::Notify::new());
            engine.azure = Some(engine::AzureView::new(nudge.clone(), azure_config.max_age));
            if arm_approvals {
                engine.acknowledger = Some(Arc::new(azure::acknowledge::Acknowledger::new(
                    &azure_config,
                )?));
            }
            Some(azure::refresh::start(
                &azure_config,
                azure_sources,
                azure_tx,
                nudge,
                stop_rx,
            )?)
        }
        None => None,
    };
    #[cfg(not(feature = "azure"))]
    let refresher: Option<tokio::task::JoinHandle<()>> = {
        let _ = (
            azure_config,
            azure_sources,
            azure_tx,
            stop_rx,
            arm_approvals,
        );
        None
    };
    // A refresher that ends (it never should) stops the coordinator: its supervisor starts
    // it again, rather than it deciding on a listing that ages.
    let refresher_ended = async move {
        match refresher {
            Some(task) => task
                .await
                .map_or_else(|e| e.to_string(), |()| "ended".to_owned()),
            None => std::future::pending().await,
        }
    };
    tokio::pin!(refresher_ended);
    #[cfg(feature = "nats")]
    let (kept, holder) = {
        let holder = lease.as_ref().map(|(ha, _)| ha.clone());
        let kept = async move {
            match lease {
                Some((_, keeper)) => keeper
                    .await
                    .unwrap_or_else(|e| format!("the lease's task ended: {e}")),
                None => std::future::pending().await,
            }
        };
        (kept, holder)
    };
    #[cfg(not(feature = "nats"))]
    let kept = {
        let _: Option<((), ())> = lease;
        std::future::pending::<String>()
    };
    tokio::pin!(kept);
    // With a standby, the engine acts only while the lease is fresh, by the role's own test.
    engine.gate = role.fresh();
    engine.resume();
    tracing::info!("Coordinator running");
    let mut tick = tokio::time::interval(tick_every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut result = Ok(());
    loop {
        let owed_at = engine.owed_at();
        tokio::select! {
            _ = &mut stop => break,
            why = &mut refresher_ended => {
                tracing::error!(error = %why, "The Azure inventory's refresher stopped; stopping");
                result = Err(format!("the Azure inventory's refresher stopped: {why}"));
                break;
            }
            why = &mut kept => {
                role.set("standby");
                // What it showed is no longer this instance's to show.
                *snapshot.write().unwrap_or_else(|e| e.into_inner()) = bytes::Bytes::new();
                tracing::error!(error = %why, "Lease lost; stopping so that only one coordinator acts");
                result = Err(why);
                break;
            }
            Some(delivery) = delivered.recv() => {
                // What else waits is applied with it and committed once.
                let mut group = vec![delivery];
                while group.len() < engine::GROUP_MAX {
                    match delivered.try_recv() {
                        Ok(more) => group.push(more),
                        Err(_) => break,
                    }
                }
                engine.deliver_group_paced(group);
            }
            _ = tokio::time::sleep_until(owed_at.unwrap_or_else(std::time::Instant::now).into()), if owed_at.is_some() => {
                engine.decide_owed(chrono::Utc::now());
            }
            Some(done) = done_rx.recv() => engine.finished_paced(done),
            Some(listed) = azure_rx.recv() => engine.azure_listed(listed, chrono::Utc::now()),
            Some((command, answer)) = admin_rx.recv() => {
                let _ = answer.send(engine.admin(command, chrono::Utc::now()));
            }
            _ = tick.tick() => engine.tick(chrono::Utc::now()),
            Ok(()) = catching_up.changed(), if !engine.deciding() => {
                if *catching_up.borrow_and_update() == sched_relay_transport::inbound::CatchUp::CaughtUp {
                    engine.tick(chrono::Utc::now());
                }
            }
        }
    }
    let _ = stop_tx.send(true);
    // What the input handed over and this engine will not apply is offered again (to a
    // standby, after a lost lease), and the input, answered, stops at once.
    delivered.close();
    while let Some(delivery) = delivered.recv().await {
        let _ = delivery
            .handled
            .send(sched_relay_transport::inbound::Answer::NotHandled(
                "the coordinator is stopping".into(),
            ));
    }
    let _ = tokio::time::timeout(std::time::Duration::from_secs(5), input).await;
    #[cfg(feature = "nats")]
    if let Some(ha) = holder {
        ha.release().await;
    }
    server.abort();
    tracing::info!("Coordinator stopped");
    result
}

/// `/fleet`'s body, written by the engine ([`engine::Engine::publish_snapshot`]).
type Snapshot = Arc<RwLock<bytes::Bytes>>;
/// What this instance is ([`role::Role`]).
type Role = Arc<role::Role>;

async fn serve(
    listener: tokio::net::TcpListener,
    snapshot: Snapshot,
    role: Role,
    admin: admin::Endpoint,
) {
    let healthz = {
        let role = role.clone();
        move || {
            let role = role.clone();
            async move { format!("{}\n", role.now()) }
        }
    };
    let app = axum::Router::new()
        .route("/fleet", axum::routing::get(fleet_json))
        .route("/metrics", axum::routing::get(metrics_text))
        .route("/healthz", axum::routing::get(healthz))
        .with_state((snapshot, role.clone()))
        .merge(admin::routes(admin, role));
    if let Err(error) = axum::serve(listener, app).await {
        tracing::error!(error = %error, "The coordinator's listener stopped");
    }
}

/// The engine's last snapshot while this instance acts; otherwise (loading the state, a
/// standby waiting for the lease, a lease too old to act on) a 503 that says which, so that
/// no client reads an empty fleet, or one a standby may have taken over since.
async fn fleet_json(State((snapshot, role)): State<(Snapshot, Role)>) -> impl IntoResponse {
    let role = role.now();
    let body = snapshot.read().unwrap_or_else(|e| e.into_inner()).clone();
    if role == "active" && !body.is_empty() {
        return (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/json")],
            body,
        );
    }
    // (Active, too, from the state's load to the first snapshot: still starting.)
    let (role, why) = match role {
        "standby" => (
            "standby",
            "not the active coordinator: it holds no lease (a standby, or one that lost its lease); ask the active one",
        ),
        "paused" => (
            "paused",
            "paused: this coordinator's lease has not been renewed lately (NATS out of reach, or a stall), so a standby may be taking over; it acts again once a renewal succeeds",
        ),
        _ => (
            "starting",
            "starting: the coordinator has not shown its fleet state yet",
        ),
    };
    let body = serde_json::json!({ "role": role, "error": why });
    (
        StatusCode::SERVICE_UNAVAILABLE,
        [(header::CONTENT_TYPE, "application/json")],
        bytes::Bytes::from(body.to_string()),
    )
}

async fn metrics_text() -> impl IntoResponse {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        crate::telemetry::prometheus().render(),
    )
}

pub use admin::Command as AdminCommand;

/// What `sched-relay coordinate` was asked besides its configuration.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// `--dry-run`.
    pub dry_run: bool,
    /// `--check`: print the groups and exit.
    pub check: bool,
    /// `pause`, `resume` or `release`: ask the running coordinator instead of running one.
    pub action: Option<AdminCommand>,
}

/// `sched-relay coordinate`: loads (exit 2 with one line per problem), then runs until
/// `stop`; `check` prints the groups and exits.
pub async fn command(
    path: &std::path::Path,
    options: Options,
    format: crate::logging::LogFormat,
    stop: impl Future<Output = ()>,
) -> std::process::ExitCode {
    let Options {
        dry_run,
        check,
        action,
    } = options;
    use std::process::ExitCode;
    let (mut config, policy) = match CoordinatorConfig::load(path) {
        Ok(loaded) => loaded,
        Err(errors) => {
            for problem in &errors.0 {
                let problem = problem.to_string();
                eprintln!(
                    "config error: {}",
                    sched_relay_transport::redact::text(&problem)
                );
            }
            return ExitCode::from(2);
        }
    };
    if let Some(action) = action {
        return admin::send(&config, action).await;
    }
    config.coordinator.dry_run |= dry_run;
    if check {
        for group in &policy.groups {
            let budget = match group.budget {
                policy::Budget::Count(count) => format!("at most {count} VM(s) down"),
                policy::Budget::Percent(percent) => format!("at most {percent} % of its VMs down"),
            };
            let rules: Vec<String> = group
                .rules
                .iter()
                .map(|(ty, rule)| {
                    let action = match rule.action {
                        policy::Action::Approve => "approve",
                        policy::Action::DrainThenApprove => "drain_then_approve",
                        policy::Action::Never => "never",
                    };
                    match rule.max_duration {
                        Some(max) => format!("{ty} {action} up to {} s", max.as_secs()),
                        None => format!("{ty} {action}"),
                    }
                })
                .collect();
            let mut extra = String::new();
            if let Some(size) = group.expected_size {
                extra.push_str(&format!("; expected size {size}"));
            }
            if !group.windows.is_empty() {
                extra.push_str(&format!("; {} maintenance window(s)", group.windows.len()));
            }
            if group.gated {
                extra.push_str("; health gate");
            }
            println!(
                "group {}: {budget}; {}; any other type never{extra}",
                group.name,
                rules.join(", ")
            );
        }
        return ExitCode::SUCCESS;
    }
    let _log = crate::logging::init("sched_relay=info,warn", format);
    crate::warn_if_unoptimised();
    match run(config, policy, stop).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            tracing::error!(error = %error, "Coordinator failed");
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}
