//! The `sched-relay` command line: parses arguments, sets up logging and signals, and hands
//! over to the library.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use sched_relay::config::Config;
use sched_relay::imds::ImdsClient;
use sched_relay::logging::{self, LogFormat};
use sched_relay::orphans::OutboxCommand;
use sched_relay::store::StoreError;

#[derive(Parser)]
#[command(
    name = "sched-relay",
    version,
    about = "Relays Azure Scheduled Events as CloudEvents to brokers, and approvals back"
)]
struct Cli {
    /// Log format on stderr (overrides log.format).
    #[arg(long, global = true, value_enum)]
    log_format: Option<LogFormat>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the agent until SIGTERM or SIGINT.
    Run {
        /// Configuration file (default /etc/sched-relay/config.toml when it exists).
        #[arg(long, env = "SCHED_RELAY_CONFIG")]
        config: Option<PathBuf>,
        /// Move a damaged state store aside (never deleted) and start afresh; its undelivered
        /// events are then not delivered.
        #[arg(long)]
        fresh_state: bool,
        /// Check approvals (remote and by policy) and publish their outcomes marked as dry
        /// run, but POST nothing to the metadata service.
        #[arg(long)]
        dry_run: bool,
    },
    /// Validate the configuration and print it with secrets redacted; exit 2 on problems.
    CheckConfig {
        #[arg(long, env = "SCHED_RELAY_CONFIG")]
        config: Option<PathBuf>,
    },
    /// List the outbox's backlogs, or dead-letter or move one (a renamed or removed sink);
    /// run while the agent is stopped.
    Outbox {
        #[arg(long, env = "SCHED_RELAY_CONFIG")]
        config: Option<PathBuf>,
        #[command(subcommand)]
        action: OutboxAction,
    },
    /// Serve a simulated IMDS Scheduled Events endpoint.
    Simulate {
        #[arg(long, default_value = "127.0.0.1:8169")]
        listen: SocketAddr,
        /// A scenario file, or a built-in one: live-migration (default), user-reboot,
        /// redeploy, spot-preempt, scaleset-terminate, host-failure, cancelled-maintenance,
        /// multi-vm, imds-faults, demo. Given several times, one process serves each VM on
        /// its own port (--listen's and the next ones, or free ones with port 0), and an
        /// EventId in several scenarios is one event that lists several VMs: approving it
        /// on one starts it on all.
        #[arg(long, default_value = "live-migration")]
        scenario: Vec<String>,
        /// Multiplies every offset of the scenario (0.01 plays 15 minutes in 9 seconds).
        #[arg(long)]
        time_scale: Option<f64>,
        /// Also serve an Azure Resource Manager stand-in for every VM with a `[vm]
        /// resource_id` (scale sets, VMs, availability sets, acknowledging their events) and
        /// the IMDS managed-identity token endpoint, on this address.
        #[arg(long)]
        arm_listen: Option<SocketAddr>,
        /// Items per page of the stand-in's lists (more through `nextLink`).
        #[arg(long, default_value_t = 100, requires = "arm_listen")]
        arm_page_size: usize,
        /// How long a token the stand-in issues is accepted.
        #[arg(long, default_value = "1h", value_parser = humantime::parse_duration, requires = "arm_listen")]
        arm_token_lifetime: std::time::Duration,
    },
    /// A live table of the fleet's events, from the stream the agents publish.
    Watch {
        /// A file sink's path, nats://host:4222[?subject=scheduledevents.>],
        /// amqp://user:pass@host:5672/%2f[?exchange=scheduledevents&binding_key=#] or
        /// kafka://host:9092[/topic][?since=24h], or a coordinator's http://host:9465.
        #[arg(long)]
        from: sched_relay::watch::Feed,
        /// Read for --settle, print the table once and exit (for scripts).
        #[arg(long)]
        once: bool,
        #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
        settle: std::time::Duration,
        /// The agents' `[events] type_prefix`: events of other types on the stream are
        /// passed over.
        #[arg(long, default_value = sched_relay_core::event::DEFAULT_TYPE_PREFIX)]
        type_prefix: String,
    },
    /// Run simulator + agent + stdout/file sinks on this machine, no broker needed; with
    /// --fleet, the fleet coordinator at work on twelve simulated VMs (needs NATS).
    Demo {
        /// The agent's own log on stderr (with --fleet, the coordinator's too; RUST_LOG wins):
        /// WARN by default, so that the summary reads cleanly; "info" narrates every step.
        #[arg(long, default_value = "warn")]
        log_level: String,
        /// The fleet coordinator on twelve simulated VMs in three groups (one host-level
        /// event), their agents, on the NATS at NATS_URL or a nats-server it starts; prints
        /// each decision, then a summary judged from the simulated VMs' own record. Exit 0
        /// after about 30 s; 1 if a budget was exceeded or the run did not finish.
        #[arg(long)]
        fleet: bool,
    },
    /// GET the current Scheduled Events document and print it.
    Events {
        #[arg(long, default_value = "http://169.254.169.254")]
        endpoint: url::Url,
        #[arg(long, default_value = "2020-07-01")]
        api_version: String,
    },
    /// The fleet coordinator: read every agent's events, drain and approve under
    /// disruption budgets (docs: "The fleet coordinator").
    Coordinate {
        #[arg(long, env = "SCHED_RELAY_COORDINATOR_CONFIG")]
        config: PathBuf,
        /// Decide and log, but sign, publish and drain nothing.
        #[arg(long)]
        dry_run: bool,
        /// Validate the configuration, print the groups and exit (2 on problems).
        #[arg(long)]
        check: bool,
        /// Ask the running coordinator to pause, resume or release a VM (else run one).
        #[command(subcommand)]
        action: Option<sched_relay::coordinator::AdminCommand>,
    },
    /// Print a signed approval request (CloudEvent, structured JSON), or publish it with --to.
    SignApproval {
        /// A key file: `hmac-sha256:<secret>` or `ed25519:<base64 seed>` (gen-approval-key).
        #[arg(long)]
        key: PathBuf,
        /// The key id the agents know this key by (`[[approvals.keys]] id`).
        #[arg(long)]
        key_id: String,
        /// An EventId to start; repeat for several.
        #[arg(long = "event-id", required = true)]
        event_ids: Vec<String>,
        /// The VM that should approve (its identity.vm_name), or "*" for the fleet.
        #[arg(long)]
        vm: Option<String>,
        /// The request's CloudEvents source.
        #[arg(long, default_value = "urn:sched-relay:sign-approval")]
        source: String,
        /// Publish instead of printing: nats://host:4222[?subject=..],
        /// amqp://user:pass@host:5672/%2f[?exchange=..&routing_key=..], kafka://host:9092[/topic]
        /// or http://127.0.0.1:9464/approvals.
        #[arg(long)]
        to: Option<String>,
        /// Bearer token for --to http://.../approvals.
        #[arg(long, env = "SCHED_RELAY_APPROVAL_TOKEN")]
        token: Option<String>,
    },
    /// Write a new Ed25519 signing key file (mode 0600) and print its public key.
    GenApprovalKey {
        #[arg(long)]
        out: PathBuf,
    },
    /// POST StartRequests for these EventIds (approve them now).
    Approve {
        #[arg(required = true)]
        event_ids: Vec<String>,
        #[arg(long, default_value = "http://169.254.169.254")]
        endpoint: url::Url,
        #[arg(long, default_value = "2020-07-01")]
        api_version: String,
    },
}

#[derive(Subcommand)]
enum OutboxAction {
    /// Every sink with undelivered events, and whether it is still configured.
    List,
    /// Write a sink's whole backlog to <state.dir>/dead-letter/<sink>.jsonl and drop it.
    DeadLetter { sink: String },
    /// Append a sink's backlog, in order, to a configured sink's queue (a renamed sink).
    Move { from: String, to: String },
}

fn load_config(path: Option<&std::path::Path>) -> Result<Config, ExitCode> {
    Config::load(path).map_err(|errors| {
        for problem in &errors.0 {
            // A problem quotes the value it refuses, which may be a URL with credentials.
            let problem = problem.to_string();
            eprintln!(
                "config error: {}",
                sched_relay_transport::redact::text(&problem)
            );
        }
        ExitCode::from(2)
    })
}

fn client(endpoint: url::Url, api_version: &str) -> ImdsClient {
    let timeout = std::time::Duration::from_secs(10);
    ImdsClient::new(
        endpoint,
        api_version,
        timeout,
        std::time::Duration::from_secs(150),
    )
    .expect("an HTTP client without TLS builds")
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Before the runtime starts its threads, each of which would make an arena of its own.
    if matches!(cli.command, Command::Coordinate { .. }) {
        sched_relay::arenas::limit(sched_relay::arenas::COORDINATOR_ARENAS);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("the async runtime starts");
    // The command runs as a task of the runtime, not on this thread: a future driven by
    // `block_on` is woken from the worker threads (timers, sockets) and hands every wake-up
    // across threads, which cost 14 of the 17.5 context switches of an idle poll (measured,
    // BENCHMARKS.md). Here this thread only waits for the end.
    let code = runtime.block_on(async {
        tokio::spawn(run_command(cli))
            .await
            .unwrap_or(ExitCode::FAILURE)
    });
    // The agent has already spent its shutdown deadline: a write still stuck on a full pipe
    // (the stdout sink's, say) must not hold the exit, as dropping the runtime would.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    code
}

async fn run_command(cli: Cli) -> ExitCode {
    let format = cli.log_format.unwrap_or_default();
    match cli.command {
        Command::Run {
            config,
            fresh_state,
            dry_run,
        } => {
            let config = match load_config(config.as_deref()) {
                Ok(config) => config,
                Err(code) => return code,
            };
            let _log = logging::init(
                &config.log.level,
                cli.log_format.unwrap_or(config.log.format),
            );
            sched_relay::warn_if_unoptimised();
            let options = sched_relay::RunOptions {
                fresh_state,
                dry_run,
                disk_faults: None,
            };
            match sched_relay::run(config, options, sched_relay::signals::shutdown()).await {
                Ok(()) => ExitCode::SUCCESS,
                // Another process holds the state directory: nothing was started or moved.
                Err(
                    error @ sched_relay::AgentError::Store(
                        StoreError::Locked { .. } | StoreError::InUse { .. },
                    ),
                ) => {
                    tracing::error!(error = %error, "Agent not started");
                    ExitCode::from(2)
                }
                Err(error) => {
                    tracing::error!(error = %error, "Agent failed");
                    ExitCode::FAILURE
                }
            }
        }
        Command::CheckConfig { config } => match load_config(config.as_deref()) {
            Ok(config) => {
                for warning in config.warnings() {
                    eprintln!("config warning: {warning}");
                }
                print!("{}", config.to_redacted_toml());
                ExitCode::SUCCESS
            }
            Err(code) => code,
        },
        Command::Outbox { config, action } => {
            let config = match load_config(config.as_deref()) {
                Ok(config) => config,
                Err(code) => return code,
            };
            let command = match action {
                OutboxAction::List => OutboxCommand::List,
                OutboxAction::DeadLetter { sink } => OutboxCommand::DeadLetter { sink },
                OutboxAction::Move { from, to } => OutboxCommand::Move { from, to },
            };
            let configured: Vec<String> = config.sinks.iter().map(|s| s.name.clone()).collect();
            let capacity = config.delivery.queue_capacity;
            match sched_relay::orphans::run(&config.state.dir, capacity, &configured, &command) {
                Ok(output) => {
                    print!("{output}");
                    ExitCode::SUCCESS
                }
                Err(error) => {
                    eprintln!("error: {}", error.message);
                    ExitCode::from(if error.in_use { 2 } else { 1 })
                }
            }
        }
        Command::Simulate {
            listen,
            scenario,
            time_scale,
            arm_listen,
            arm_page_size,
            arm_token_lifetime,
        } => {
            let _log = logging::init("info", format);
            let plan = sched_relay::simulator::ServePlan {
                listen,
                scenarios: scenario,
                time_scale,
                arm: arm_listen.map(|arm_listen| {
                    let options = sched_relay::simulator::ArmOptions {
                        page_size: arm_page_size,
                        token_lifetime: arm_token_lifetime,
                        ..Default::default()
                    };
                    (arm_listen, options)
                }),
            };
            // Tests and scripts read its lines (one per VM, in --scenario order, then the ARM
            // stand-in's) to find the ports.
            match sched_relay::simulator::serve(plan, sched_relay::signals::shutdown()).await {
                Ok(()) => ExitCode::SUCCESS,
                Err(error) => {
                    eprintln!("error: {}", error.message);
                    ExitCode::from(if error.usage { 2 } else { 1 })
                }
            }
        }
        Command::Watch {
            from,
            once,
            settle,
            type_prefix,
        } => {
            let _log = logging::init("warn", format);
            let mut out = std::io::stdout();
            match sched_relay::watch::run(from, &type_prefix, once, settle, &mut out).await {
                Ok(()) => ExitCode::SUCCESS,
                Err(error) => {
                    eprintln!("error: {error}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Demo { log_level, fleet } => {
            let _log = logging::init(&log_level, format);
            if fleet {
                return sched_relay::demo::fleet_command().await;
            }
            match sched_relay::demo::run().await {
                Ok(_) => ExitCode::SUCCESS,
                Err(error) => {
                    eprintln!("demo failed: {error}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Events {
            endpoint,
            api_version,
        } => match client(endpoint, &api_version).fetch().await {
            Ok(parsed) => {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&parsed.document.raw).expect("JSON prints")
                );
                for warning in parsed.warnings {
                    eprintln!("warning: {warning}");
                }
                ExitCode::SUCCESS
            }
            Err(error) => {
                eprintln!("error: {error}");
                ExitCode::FAILURE
            }
        },
        Command::Coordinate {
            config,
            dry_run,
            check,
            action,
        } => {
            let options = sched_relay::coordinator::Options {
                dry_run,
                check,
                action,
            };
            sched_relay::coordinator::command(
                &config,
                options,
                format,
                sched_relay::signals::shutdown(),
            )
            .await
        }
        Command::SignApproval {
            key,
            key_id,
            event_ids,
            vm,
            source,
            to,
            token,
        } => sign_approval(&key, &key_id, event_ids, vm, &source, to, token).await,
        Command::GenApprovalKey { out } => gen_approval_key(&out),
        Command::Approve {
            event_ids,
            endpoint,
            api_version,
        } => match client(endpoint, &api_version).start(&event_ids).await {
            Ok(()) => {
                println!("approved: {}", event_ids.join(", "));
                ExitCode::SUCCESS
            }
            Err(error) => {
                eprintln!("error: approval refused: {error}");
                ExitCode::FAILURE
            }
        },
    }
}

async fn sign_approval(
    key: &std::path::Path,
    key_id: &str,
    event_ids: Vec<String>,
    vm: Option<String>,
    source: &str,
    to: Option<String>,
    token: Option<String>,
) -> ExitCode {
    use sched_relay_core::approval::{Draft, SigningKey};
    let signing_key = match std::fs::read_to_string(key)
        .map_err(|e| e.to_string())
        .and_then(|text| SigningKey::parse(&text))
    {
        Ok(signing_key) => signing_key,
        Err(error) => {
            eprintln!("error: --key {}: {error}", key.display());
            return ExitCode::from(2);
        }
    };
    let event = Draft::new(source, vm.as_deref(), event_ids).event(Some((key_id, &signing_key)));
    let Some(to) = to else {
        println!(
            "{}",
            serde_json::to_string(&event).expect("an event prints")
        );
        return ExitCode::SUCCESS;
    };
    match sched_relay::approval::publish_to(&to, &event, token.as_deref()).await {
        Ok(what) => {
            println!("{what}");
            ExitCode::SUCCESS
        }
        Err(error) => {
            // --to may carry credentials (amqp://user:password@...).
            eprintln!("error: {}", sched_relay_transport::redact::text(&error));
            ExitCode::FAILURE
        }
    }
}

fn gen_approval_key(out: &std::path::Path) -> ExitCode {
    match sched_relay::approval::keys::write_new(out) {
        Ok(public) => {
            println!(
                "Private key written to {} (keep it on the orchestrator only).",
                out.display()
            );
            println!("Add this to each agent's configuration:\n");
            println!(
                "[[approvals.keys]]\nid = \"<a name for this key>\"\nalgorithm = \"ed25519\"\npublic_key = \"{public}\""
            );
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}
