//! The hooks: the drain, a command or a webhook run once per VM before its event is
//! approved, given until the deadline (NotBefore minus the margin); and the health gate, run
//! after the event is over for a VM until it passes. Hooks must be idempotent: after a
//! coordinator restart (or a failover) a drain that was running is run again, and a gate
//! runs until it passes.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::json;

use super::config::{Drain, HealthConfig};

/// What the hook is told.
#[derive(Debug, Clone)]
pub struct Job {
    pub vm: String,
    pub event_id: String,
    pub event_type: String,
    pub not_before: Option<DateTime<Utc>>,
    pub deadline: DateTime<Utc>,
}

/// Runs the hook for one VM; `Ok` once it says drained, `Err(why)` otherwise (a failure, or
/// the deadline passed: the command's whole process group is killed, the request dropped).
pub async fn run(config: &Drain, http: &reqwest::Client, job: &Job) -> Result<(), String> {
    let left = (job.deadline - Utc::now())
        .to_std()
        .unwrap_or(Duration::ZERO);
    if left.is_zero() {
        return Err("deadline passed before the drain started".into());
    }
    let work = async {
        match (&config.command, &config.url) {
            (Some(command), _) => command_hook(command, job, left).await,
            (None, Some(url)) => webhook_hook(http, url, job).await,
            (None, None) => Err("no drain hook configured".into()),
        }
    };
    match tokio::time::timeout(left, work).await {
        Ok(result) => result,
        Err(_) => Err(format!(
            "did not finish by the deadline {} ({} s)",
            job.deadline.to_rfc3339(),
            left.as_secs()
        )),
    }
}

/// Runs a health gate for one VM; `Ok` once it says healthy, within its `timeout`.
pub async fn check(gate: &HealthConfig, http: &reqwest::Client, job: &Job) -> Result<(), String> {
    let work = async {
        match (&gate.command, &gate.url) {
            (Some(command), _) => command_hook(command, job, gate.timeout).await,
            (None, Some(url)) => webhook_hook(http, url, job).await,
            (None, None) => Err("no health gate configured".into()),
        }
    };
    match tokio::time::timeout(gate.timeout, work).await {
        Ok(result) => result,
        Err(_) => Err(format!(
            "did not answer within {}",
            humantime::format_duration(gate.timeout)
        )),
    }
}

fn expand(text: &str, job: &Job) -> String {
    text.replace("{vmname}", &job.vm)
        .replace("{eventid}", &job.event_id)
        .replace("{eventtype}", &job.event_type)
}

/// The command in its own process group, killed as a group at the deadline; its exit
/// decides (a child it leaves running in the background does not hold the result).
async fn command_hook(command: &[String], job: &Job, left: Duration) -> Result<(), String> {
    let mut process = tokio::process::Command::new(&command[0]);
    process
        .args(command[1..].iter().map(|a| expand(a, job)))
        .env("SCHED_RELAY_VM_NAME", &job.vm)
        .env("SCHED_RELAY_EVENT_ID", &job.event_id)
        .env("SCHED_RELAY_EVENT_TYPE", &job.event_type)
        .env("SCHED_RELAY_DEADLINE", job.deadline.to_rfc3339())
        .env(
            "SCHED_RELAY_NOT_BEFORE",
            job.not_before.map(|t| t.to_rfc3339()).unwrap_or_default(),
        )
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        // Its messages join the coordinator's own log stream (the journal, say).
        .stderr(std::process::Stdio::inherit())
        .kill_on_drop(true)
        .process_group(0);
    let mut child = process
        .spawn()
        .map_err(|e| format!("{}: {e}", command[0]))?;
    let group = child.id();
    match tokio::time::timeout(left, child.wait()).await {
        Ok(Ok(status)) if status.success() => Ok(()),
        Ok(Ok(status)) => Err(format!("{} exited with {status}", command[0])),
        Ok(Err(error)) => Err(format!("{}: {error}", command[0])),
        Err(_) => {
            if let Some(group) = group {
                sched_relay_exec::kill_group(group);
            }
            Err(format!(
                "did not finish by the deadline {} (killed with its process group)",
                job.deadline.to_rfc3339()
            ))
        }
    }
}

async fn webhook_hook(http: &reqwest::Client, url: &str, job: &Job) -> Result<(), String> {
    let body = json!({
        "vmName": job.vm,
        "eventId": job.event_id,
        "eventType": job.event_type,
        "notBefore": job.not_before.map(|t| t.to_rfc3339()),
        "deadline": job.deadline.to_rfc3339(),
    });
    let response = http
        .post(url)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .map_err(|e| sched_relay_transport::redact::text(&e.to_string()).into_owned())?;
    if response.status().is_success() {
        Ok(())
    } else {
        Err(format!("the drain webhook answered {}", response.status()))
    }
}
