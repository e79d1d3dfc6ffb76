//! The exec sink: runs a local command for each CloudEvent, the drain-script hook operators
//! know from other maintenance handlers, so a VM can prepare itself (stop taking traffic,
//! flush caches, fail over) as well as tell the fleet.
//!
//! The command is run directly (no shell) with the structured event as JSON on stdin and
//! `EVENT_ID`, `EVENT_TYPE`, `EVENT_STATUS`, `NOT_BEFORE`, `TRANSITION`, `CE_ID`, `CE_TYPE`,
//! `VM_NAME`, `AFFECTS_VM` and `INCARNATION` in its environment. Exit 0 is delivered; an exit
//! status listed in `retry_exit_codes` (default 75, EX_TEMPFAIL) or a timeout is retried; any
//! other status sends the event to the dead-letter file with the command's stderr. It runs
//! for the events `transitions` names; an empty list means every event but heartbeats, so a
//! drain script does not run every few minutes because the agent is alive.
//!
//! The command gets only what it needs: the agent's environment holds broker passwords,
//! tokens and `SCHED_RELAY_*` overrides, so the command starts from an empty environment with
//! `PATH`, the event's variables, the names listed in `pass_env` and the `env` table. It runs
//! in its own process group, and the timeout covers writing the event to its stdin as well as
//! its run: a command that never reads stdin, or that leaves children behind, cannot hold the
//! sink. At the timeout the whole group is killed (`tests`: a grandchild `sleep` does not
//! survive, a command that never reads a large event is killed on time).

use std::collections::BTreeMap;
use std::process::Stdio;
use std::time::Duration;

use async_trait::async_trait;
use cloudevents::{AttributesReader, Data};
use sched_relay_transport::secret::Secret;
use sched_relay_transport::{DeliveryError, Event, EventKind, Sink, SinkError};
use serde::{Deserialize, Serialize};
use tokio::io::AsyncWriteExt;

/// `kind = "exec"`.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ExecSinkConfig {
    /// The program and its arguments, e.g. `["/usr/local/bin/drain", "--graceful"]`.
    pub command: Vec<String>,
    /// Run only for these transitions (`scheduled`, `started`, ...); empty: every event,
    /// `document` snapshots included, but not heartbeats (`heartbeat` must be listed: a drain
    /// script must not run every few minutes because the agent is alive).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub transitions: Vec<String>,
    /// Killed and retried after this long.
    #[serde(default = "default_timeout", with = "humantime_serde")]
    pub timeout: Duration,
    /// Exit statuses that mean "try again later".
    #[serde(default = "default_retry_exit_codes")]
    pub retry_exit_codes: Vec<i32>,
    /// Variables set for the command, besides `PATH` and the event's. Values are secrets
    /// (never printed; `${ENV_VAR}` takes the agent's variable).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, Secret>,
    /// Names of the agent's environment variables the command may see too (when set). Nothing
    /// else of the agent's environment reaches it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pass_env: Vec<String>,
}

/// `PATH` for the command when the agent has none (a bare systemd unit has one).
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

fn default_timeout() -> Duration {
    Duration::from_secs(60)
}

fn default_retry_exit_codes() -> Vec<i32> {
    vec![75]
}

impl ExecSinkConfig {
    pub fn validate(&self) -> Vec<(&'static str, String)> {
        let mut problems = Vec::new();
        if self
            .command
            .first()
            .is_none_or(|program| program.is_empty())
        {
            problems.push((
                "command",
                "must name a program, e.g. [\"/usr/local/bin/drain\"]".to_owned(),
            ));
        }
        if self.timeout.is_zero() {
            problems.push(("timeout", "must be more than 0s".to_owned()));
        }
        let names = self.env.keys().map(|name| ("env", name));
        for (key, name) in names.chain(self.pass_env.iter().map(|name| ("pass_env", name))) {
            if name.is_empty() || name.contains(['=', '\0']) {
                problems.push((
                    key,
                    format!(
                        "{name:?} is not an environment variable name (empty, or with = or NUL)"
                    ),
                ));
            }
        }
        // An unknown name would never match, and its events would be confirmed unrun.
        let known: Vec<&str> = EventKind::ALL.iter().filter_map(|k| k.suffix()).collect();
        for transition in &self.transitions {
            if !known.contains(&transition.as_str()) {
                problems.push((
                    "transitions",
                    format!(
                        "{transition:?} is not a transition; expected some of {}",
                        known.join(", ")
                    ),
                ));
            }
        }
        problems
    }
}

/// Runs the configured command once per event, in order.
pub struct ExecSink {
    config: ExecSinkConfig,
}

impl ExecSink {
    pub fn new(config: ExecSinkConfig) -> Self {
        ExecSink { config }
    }

    fn environment(event: &Event) -> Vec<(&'static str, String)> {
        let extension = |name: &str| {
            event
                .extension(name)
                .map(|v| v.to_string())
                .unwrap_or_default()
        };
        let not_before = match event.data() {
            Some(Data::Json(data)) => data["event"]["NotBefore"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
            _ => String::new(),
        };
        vec![
            ("EVENT_ID", event.subject().unwrap_or_default().to_owned()),
            ("EVENT_TYPE", extension("eventtype")),
            ("EVENT_STATUS", extension("eventstatus")),
            ("NOT_BEFORE", not_before),
            ("TRANSITION", event.transition().to_owned()),
            ("CE_ID", event.id().to_owned()),
            ("CE_TYPE", event.ty().to_owned()),
            ("VM_NAME", extension("vmname")),
            ("AFFECTS_VM", extension("affectsvm")),
            ("INCARNATION", extension("incarnation")),
        ]
    }

    /// Whether the command runs for this event (the others are confirmed unrun).
    fn wants(&self, event: &Event) -> bool {
        if self.config.transitions.is_empty() {
            return event.kind() != EventKind::Heartbeat;
        }
        let transition = event.transition();
        self.config.transitions.iter().any(|t| t == transition)
    }

    async fn run(&self, event: &Event) -> Result<(), SinkError> {
        if !self.wants(event) {
            return Ok(());
        }
        let program = &self.config.command[0];
        let mut env: Vec<(String, String)> = vec![(
            "PATH".to_owned(),
            std::env::var("PATH").unwrap_or_else(|_| DEFAULT_PATH.to_owned()),
        )];
        env.extend(
            self.config
                .pass_env
                .iter()
                .filter_map(|name| Some((name.clone(), std::env::var(name).ok()?))),
        );
        env.extend(
            Self::environment(event)
                .into_iter()
                .map(|(name, value)| (name.to_owned(), value)),
        );
        for (name, value) in &self.config.env {
            let value = value
                .expose()
                .map_err(|e| SinkError::Permanent(format!("env.{name}: {e}")))?;
            env.push((name.clone(), value));
        }
        let mut child = tokio::process::Command::new(program)
            .args(&self.config.command[1..])
            .env_clear()
            .envs(env)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            // Its own group, so that a timeout reaches what the command started too.
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| SinkError::from_io(&format!("cannot run {program}"), &e))?;
        let group = child.id();
        let body = sched_relay_transport::binding::structured_json(event)?;
        let stdin = child.stdin.take();
        let run = async move {
            if let Some(mut stdin) = stdin {
                // A command that does not read stdin closes it early; that is its right.
                let _ = stdin.write_all(&body).await;
            }
            child.wait_with_output().await
        };
        let timeout = self.config.timeout;
        let output = match tokio::time::timeout(timeout, run).await {
            Err(_) => {
                if let Some(group) = group {
                    kill_group(group);
                }
                return Err(SinkError::Retriable(format!(
                    "{program} did not finish within {timeout:?} for {} (killed with its process group)",
                    event.id()
                )));
            }
            Ok(Err(error)) => {
                return Err(SinkError::Retriable(format!("{program} failed: {error}")));
            }
            Ok(Ok(output)) => output,
        };
        if output.status.success() {
            return Ok(());
        }
        let stderr: String = String::from_utf8_lossy(&output.stderr)
            .chars()
            .take(300)
            .collect();
        let message = format!(
            "{program} exited with {} for {}: {}",
            output.status,
            event.id(),
            stderr.trim()
        );
        match output.status.code() {
            Some(code) if self.config.retry_exit_codes.contains(&code) => {
                Err(SinkError::Retriable(message))
            }
            // Killed by a signal: treat like a timeout, it may well succeed next time.
            None => Err(SinkError::Retriable(message)),
            Some(_) => Err(SinkError::Permanent(message)),
        }
    }
}

/// SIGKILL to every process of the group the command leads (its pid is the group id); also
/// the coordinator's drain hooks.
pub fn kill_group(group: u32) {
    let Ok(group) = libc::pid_t::try_from(group) else {
        return;
    };
    // SAFETY: killpg has no memory effects; a group that is gone answers ESRCH, ignored.
    unsafe {
        libc::killpg(group, libc::SIGKILL);
    }
}

#[async_trait]
impl Sink for ExecSink {
    async fn deliver(&self, batch: &[Event]) -> Result<(), DeliveryError> {
        // One run per event: a failure names its event, and the ones before it are done.
        for (index, event) in batch.iter().enumerate() {
            self.run(event)
                .await
                .map_err(|e| DeliveryError::at(index, e))?;
        }
        Ok(())
    }

    async fn health_check(&self) -> Result<(), SinkError> {
        let program = std::path::Path::new(&self.config.command[0]);
        if program.components().count() > 1 && !program.is_file() {
            return Err(SinkError::Permanent(format!(
                "{} does not exist",
                program.display()
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
