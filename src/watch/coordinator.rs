//! `sched-relay watch --from http://coordinator:9465`: the same table from a fleet
//! coordinator's `/fleet`, with what the coordinator did or why it waits, and each group's
//! budget in use.

use std::io::Write;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::Value;

use super::{Fleet, Row, printable};

/// The table from a coordinator's `/fleet`, once a second (or once), with each group's
/// budget under it.
pub(super) async fn run(
    mut url: url::Url,
    once: bool,
    out: &mut (impl Write + Send),
) -> Result<(), String> {
    if url.path() == "/" || url.path().is_empty() {
        url.set_path("/fleet");
    }
    crate::install_crypto_provider();
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .map_err(|e| e.to_string())?;
    let tty = std::io::IsTerminal::is_terminal(&std::io::stdout()) && !once;
    loop {
        let fetched = fetch(&http, url.as_str()).await;
        let text = match fetched {
            Ok(snapshot) => render(&snapshot, Utc::now()),
            Err(error) if once => return Err(error),
            Err(error) => format!("{error}\n"),
        };
        let clear = if tty { "\x1b[2J\x1b[H" } else { "" };
        write!(out, "{clear}{text}").map_err(|e| e.to_string())?;
        out.flush().map_err(|e| e.to_string())?;
        if once {
            return Ok(());
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            _ = tokio::signal::ctrl_c() => return Ok(()),
        }
    }
}

/// Reads a coordinator's `/fleet` once; a 503 (starting, or a standby) says why.
pub(crate) async fn fetch(http: &reqwest::Client, url: &str) -> Result<Value, String> {
    let response = http.get(url).send().await.map_err(|e| e.to_string())?;
    let status = response.status();
    if !status.is_success() {
        let body = response.text().await.unwrap_or_default();
        let why = serde_json::from_str::<Value>(&body)
            .ok()
            .and_then(|v| v["error"].as_str().map(|e| format!(": {}", printable(e))))
            .unwrap_or_default();
        return Err(format!("{url} answered {status}{why}"));
    }
    let body = response.bytes().await.map_err(|e| e.to_string())?;
    serde_json::from_slice(&body).map_err(|e| format!("{url}: not a coordinator's /fleet: {e}"))
}

/// A coordinator's snapshot as the table: one row per VM and event, the approval column
/// saying what the coordinator did or why it waits.
pub fn render(snapshot: &Value, now: DateTime<Utc>) -> String {
    let mut fleet = Fleet::default();
    let empty = Vec::new();
    for event in snapshot["events"].as_array().unwrap_or(&empty) {
        let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
        let approval = &event["approval"];
        let decision = if approval.is_object() {
            match approval["outcome"]["outcome"].as_str() {
                Some(outcome) => format!("{outcome} {}", text(&approval["outcome"]["reason"])),
                None if approval["dry_run"] == true => "dry run".into(),
                None => format!("sent via {}", text(&approval["approver"])),
            }
        } else {
            text(&event["verdict"])
        };
        let empty_map = serde_json::Map::new();
        for (vm, report) in event["reports"].as_object().unwrap_or(&empty_map) {
            let stage = text(&report["stage"]);
            let mut status = stage.clone();
            if let Some(first) = status.get_mut(0..1) {
                first.make_ascii_uppercase();
            }
            fleet.rows.insert(
                (vm.clone(), text(&event["event_id"])),
                Row {
                    event_type: text(&event["event_type"]),
                    status,
                    not_before: event["not_before"]
                        .as_str()
                        .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
                        .map(|t| t.with_timezone(&Utc)),
                    approval: decision.trim().to_owned(),
                    last: stage,
                    seen: None,
                },
            );
        }
    }
    let mut text = fleet.render(now);
    for group in snapshot["groups"].as_array().unwrap_or(&empty) {
        text.push_str(&format!(
            "group {}: {} of {} down ({} VMs)\n",
            printable(group["group"].as_str().unwrap_or_default()),
            group["down"].as_array().map_or(0, Vec::len),
            group["limit"],
            group["size"]
        ));
    }
    text
}
