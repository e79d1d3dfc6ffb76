//! The `sched-relay` command line: parses arguments, sets up logging and signals, and hands
//! over to the library.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use sched_relay::config::{Config, LogFormat};
use sched_relay::imds::ImdsClient;
use sched_relay::simulator::{Scenario, Simulator};

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
    },
    /// Validate the configuration and print it with secrets redacted; exit 2 on problems.
    CheckConfig {
        #[arg(long, env = "SCHED_RELAY_CONFIG")]
        config: Option<PathBuf>,
    },
    /// Serve a simulated IMDS Scheduled Events endpoint.
    Simulate {
        #[arg(long, default_value = "127.0.0.1:8169")]
        listen: SocketAddr,
        /// A scenario file, or a built-in one: live-migration (default), user-reboot,
        /// redeploy, spot-preempt, scaleset-terminate, host-failure, cancelled-maintenance,
        /// multi-vm, imds-faults, demo.
        #[arg(long, default_value = "live-migration")]
        scenario: String,
        /// Multiplies every offset of the scenario (0.01 plays 15 minutes in 9 seconds).
        #[arg(long)]
        time_scale: Option<f64>,
    },
    /// Run simulator + agent + stdout/file sinks on this machine, no broker needed.
    Demo,
    /// GET the current Scheduled Events document and print it.
    Events {
        #[arg(long, default_value = "http://169.254.169.254")]
        endpoint: url::Url,
        #[arg(long, default_value = "2020-07-01")]
        api_version: String,
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

fn init_logging(filter: &str, format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(filter));
    // Colour only for a person at a terminal; journald and log files get plain text.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Json => builder.json().flatten_event(true).init(),
        LogFormat::Pretty => builder.init(),
    }
}

/// Completes on the first SIGINT or SIGTERM; a second one exits at once.
async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut terminate = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut interrupt = signal(SignalKind::interrupt()).expect("SIGINT handler");
    tokio::select! {
        _ = terminate.recv() => {}
        _ = interrupt.recv() => {}
    }
    tracing::info!("Signal received, stopping (a second signal exits at once)");
    tokio::spawn(async move {
        tokio::select! {
            _ = terminate.recv() => {}
            _ = interrupt.recv() => {}
        }
        eprintln!("Second signal: exiting now");
        std::process::exit(130);
    });
}

fn load_config(path: Option<&std::path::Path>) -> Result<Config, ExitCode> {
    Config::load(path).map_err(|errors| {
        for problem in &errors.0 {
            eprintln!("config error: {problem}");
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

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let format = cli.log_format.unwrap_or_default();
    match cli.command {
        Command::Run {
            config,
            fresh_state,
        } => {
            let config = match load_config(config.as_deref()) {
                Ok(config) => config,
                Err(code) => return code,
            };
            init_logging(
                &config.log.level,
                cli.log_format.unwrap_or(config.log.format),
            );
            let options = sched_relay::RunOptions { fresh_state };
            match sched_relay::run(config, options, shutdown_signal()).await {
                Ok(()) => ExitCode::SUCCESS,
                Err(error) => {
                    tracing::error!(error = %error, "Agent failed");
                    ExitCode::FAILURE
                }
            }
        }
        Command::CheckConfig { config } => match load_config(config.as_deref()) {
            Ok(config) => {
                print!("{}", config.to_redacted_toml());
                ExitCode::SUCCESS
            }
            Err(code) => code,
        },
        Command::Simulate {
            listen,
            scenario,
            time_scale,
        } => {
            init_logging("info", format);
            let mut scenario = match Scenario::load(&scenario) {
                Ok(scenario) => scenario,
                Err(error) => {
                    eprintln!("error: {error}");
                    return ExitCode::from(2);
                }
            };
            if let Some(scale) = time_scale {
                if !(scale > 0.0 && scale.is_finite()) {
                    eprintln!("error: --time-scale {scale} must be a positive number");
                    return ExitCode::from(2);
                }
                scenario.time_scale = scale;
            }
            let simulator = match Simulator::start(scenario, listen).await {
                Ok(simulator) => simulator,
                Err(error) => {
                    eprintln!("error: cannot listen on {listen}: {error}");
                    return ExitCode::FAILURE;
                }
            };
            // Tests and scripts read this line to find the port.
            println!("sched-relay simulator listening on {}", simulator.url());
            shutdown_signal().await;
            simulator.stop().await;
            ExitCode::SUCCESS
        }
        Command::Demo => {
            init_logging("sched_relay=info", format);
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
