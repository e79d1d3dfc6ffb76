//! What the demo prints as it happens: the coordinator's decisions, read from its public
//! `/fleet` (the same JSON `sched-relay watch` reads) and printed as they change, and the
//! demo's own drain hook, a webhook on loopback that says what it drains and takes
//! [`DRAIN_TAKES`] per VM.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use serde_json::Value;

use super::plan::{DRAIN_TAKES, Planned, group_of};

/// One line of the live feed: seconds since the start, who, the event type, what.
pub fn line(started: Instant, who: &str, event_type: &str, what: &str) -> String {
    format!(
        "{:>5.1}s  {who:<12} {event_type:<9} {what}",
        started.elapsed().as_secs_f64()
    )
}

/// What has been printed of each event, to print only what changed.
#[derive(Debug, Default, Clone)]
struct Seen {
    not_before: Option<DateTime<Utc>>,
    verdict: String,
    outcome: String,
    stages: BTreeMap<String, String>,
    drains: BTreeMap<String, String>,
}

/// The coordinator's view, as far as printed.
pub struct Feed {
    started: Instant,
    planned: BTreeMap<String, Planned>,
    seen: BTreeMap<String, Seen>,
    /// The pause before the events left to NotBefore start has been explained.
    said_waiting: bool,
}

impl Feed {
    pub fn new(started: Instant, planned: &[Planned]) -> Feed {
        Feed {
            started,
            planned: planned
                .iter()
                .map(|p| (p.id.to_ascii_uppercase(), p.clone()))
                .collect(),
            seen: BTreeMap::new(),
            said_waiting: false,
        }
    }

    /// The lines a new `/fleet` snapshot calls for, in order.
    pub fn apply(&mut self, snapshot: &Value) -> Vec<String> {
        let now = snapshot["time"]
            .as_str()
            .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
            .map_or_else(Utc::now, |t| t.with_timezone(&Utc));
        let mut lines = Vec::new();
        let empty = Vec::new();
        for event in snapshot["events"].as_array().unwrap_or(&empty) {
            let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
            let id = text(&event["event_id"]);
            let event_type = text(&event["event_type"]);
            let who = match self.planned.get(&id.to_ascii_uppercase()) {
                Some(planned) => planned.who(),
                None => text(&event["resources"][0]),
            };
            let say = |who: &str, what: &str| line(self.started, who, &event_type, what);
            let seen = self.seen.entry(id.clone()).or_default();
            let mut out = Vec::new();
            let reports = event["reports"].as_object().cloned().unwrap_or_default();
            if seen.stages.is_empty() && !reports.is_empty() {
                let not_before = event["not_before"]
                    .as_str()
                    .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
                    .map(|t| t.with_timezone(&Utc));
                seen.not_before = not_before;
                let when = match not_before {
                    Some(at) => format!(
                        "NotBefore {} UTC (in {})",
                        at.format("%H:%M:%S"),
                        humantime::format_duration(Duration::from_secs(
                            (at - now).num_seconds().max(0) as u64
                        ))
                    ),
                    None => "no NotBefore".into(),
                };
                let short = id.split('-').next().unwrap_or(&id);
                out.push(say(&who, &format!("{short} scheduled by Azure, {when}")));
            }
            let verdict = text(&event["verdict"]);
            if !verdict.is_empty() && verdict != seen.verdict {
                out.push(say(&who, &format!("coordinator: {verdict}")));
                seen.verdict = verdict;
            }
            let drains = event["drain"]["vms"]
                .as_object()
                .cloned()
                .unwrap_or_default();
            for (vm, state) in &drains {
                let state = text(state);
                if seen.drains.get(vm) != Some(&state) && state.starts_with("failed") {
                    out.push(say(vm, &format!("drain {state}")));
                }
                seen.drains.insert(vm.clone(), state);
            }
            let outcome = &event["approval"]["outcome"];
            if outcome.is_object() {
                let now_said =
                    format!("{} {}", text(&outcome["outcome"]), text(&outcome["reason"]));
                if now_said != seen.outcome {
                    let approver = text(&event["approval"]["approver"]);
                    let what = if text(&outcome["outcome"]) == "accepted" {
                        format!(
                            "agent of {approver}: approval accepted ({}); StartRequest POSTed to its metadata service",
                            text(&outcome["reason"])
                        )
                    } else {
                        format!("agent of {approver}: approval {now_said}")
                    };
                    out.push(say(&approver, &what));
                    seen.outcome = now_said;
                }
            }
            for (vm, report) in &reports {
                let stage = text(&report["stage"]);
                if seen.stages.get(vm) == Some(&stage) {
                    continue;
                }
                let first = !seen.stages.contains_key(vm);
                seen.stages.insert(vm.clone(), stage.clone());
                let what = match stage.as_str() {
                    "scheduled" if first => continue,
                    "started" => "started: the VM is down".to_owned(),
                    "completed" => format!(
                        "completed: back, its place in group {} is free",
                        group_of(vm).map_or("default", |g| g.name)
                    ),
                    other => other.to_owned(),
                };
                out.push(say(vm, &what));
            }
            lines.extend(out);
        }
        lines.extend(self.waiting_for_not_before(now));
        lines
    }

    /// Once everything the coordinator approves is over while events left to NotBefore
    /// are not, a line saying what the run waits for.
    fn waiting_for_not_before(&mut self, now: DateTime<Utc>) -> Vec<String> {
        let over = |planned: &Planned| {
            self.seen.get(&planned.id).is_some_and(|seen| {
                planned
                    .vms
                    .iter()
                    .all(|vm| seen.stages.get(vm).is_some_and(|s| s == "completed"))
            })
        };
        let (approvable, left): (Vec<&Planned>, Vec<&Planned>) =
            self.planned.values().partition(|p| p.approvable);
        if self.said_waiting || !approvable.iter().all(|p| over(p)) {
            return Vec::new();
        }
        self.said_waiting = true;
        left.iter()
            .filter(|p| !over(p))
            .map(|p| {
                let when = self.seen.get(&p.id).and_then(|s| s.not_before).map_or_else(
                    || "its NotBefore".to_owned(),
                    |at| {
                        format!(
                            "its NotBefore, {} UTC (in {} s)",
                            at.format("%H:%M:%S"),
                            (at - now).num_seconds().max(0)
                        )
                    },
                );
                line(
                    self.started,
                    &p.who(),
                    p.event_type,
                    &format!(
                        "every approval is done; this one waits for Azure to start it at {when}"
                    ),
                )
            })
            .collect()
    }

    /// The coordinator's last word on an event, for a run that did not finish.
    pub fn verdict(&self, id: &str) -> Option<&str> {
        self.seen
            .get(id)
            .map(|s| s.verdict.as_str())
            .filter(|v| !v.is_empty())
    }

    /// Every planned event is completed for every VM it lists, as the coordinator heard.
    pub fn all_over(&self) -> bool {
        self.planned.values().all(|planned| {
            self.seen
                .iter()
                .find(|(id, _)| id.eq_ignore_ascii_case(&planned.id))
                .is_some_and(|(_, seen)| {
                    planned
                        .vms
                        .iter()
                        .all(|vm| seen.stages.get(vm).is_some_and(|s| s == "completed"))
                })
        })
    }
}

/// What the coordinator POSTs to a drain webhook.
#[derive(Debug, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct DrainRequest {
    vm_name: String,
    event_type: String,
    event_id: String,
    #[serde(default)]
    not_before: Option<String>,
}

/// The drain hook's own record: each VM it was asked to drain, and when (µs since the epoch).
pub type Drains = std::sync::Arc<std::sync::Mutex<Vec<(String, i64)>>>;

/// The demo's drain hook on a free loopback port: `POST /drain` notes the VM in `drains`,
/// prints what it drains, takes [`DRAIN_TAKES`], says so and answers 200. Returns its URL
/// and the server's task.
pub async fn drain_hook(
    started: Instant,
    drains: Drains,
) -> std::io::Result<(String, tokio::task::JoinHandle<()>)> {
    use axum::Json;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/drain", listener.local_addr()?);
    let app = axum::Router::new().route(
        "/drain",
        axum::routing::post(move |Json(request): Json<DrainRequest>| async move {
            // From here the VM is out of service: the budget counts it.
            drains
                .lock()
                .expect("the drain record is never poisoned")
                .push((request.vm_name.clone(), chrono::Utc::now().timestamp_micros()));
            let short = request.event_id.split('-').next().unwrap_or_default();
            let not_before = request
                .not_before
                .as_deref()
                .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
                .map_or_else(|| "none".into(), |t| t.format("%H:%M:%S UTC").to_string());
            let say = |what: &str| {
                println!(
                    "{}",
                    line(started, &request.vm_name, &request.event_type, what)
                );
            };
            say(&format!(
                "drain hook: taking {} out of service before {short} (NotBefore {not_before}), {} s",
                request.vm_name,
                DRAIN_TAKES.as_secs()
            ));
            tokio::time::sleep(DRAIN_TAKES).await;
            say("drain hook: drained");
            axum::http::StatusCode::OK
        }),
    );
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok((url, task))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn snapshot(verdict: &str, stage: &str, outcome: Option<&str>) -> Value {
        json!({
            "time": "2026-01-01T12:00:00Z",
            "events": [{
                "event_id": "C0FFEE06-DE30-4F1E-A000-000000000006",
                "event_type": "Reboot",
                "not_before": "2026-01-01T12:04:00Z",
                "resources": ["web-6", "db-3"],
                "verdict": verdict,
                "reports": {"web-6": {"stage": stage}, "db-3": {"stage": "scheduled"}},
                "approval": outcome.map(|o| json!({"approver": "web-6", "outcome": {"outcome": o, "reason": "imds_accepted"}})),
            }]
        })
    }

    #[test]
    fn each_change_is_said_once() {
        let planned = super::super::plan::events();
        let mut feed = Feed::new(Instant::now(), &planned);
        let first = feed.apply(&snapshot("draining 2 VM(s) until x", "scheduled", None));
        assert_eq!(first.len(), 2, "{first:?}");
        assert!(
            first[0].contains("web-6, db-3") && first[0].contains("in 4m"),
            "{first:?}"
        );
        assert!(
            first[1].contains("coordinator: draining 2 VM(s)"),
            "{first:?}"
        );
        assert!(
            feed.apply(&snapshot("draining 2 VM(s) until x", "scheduled", None))
                .is_empty()
        );
        let approved = feed.apply(&snapshot(
            "approved through web-6",
            "started",
            Some("accepted"),
        ));
        assert_eq!(approved.len(), 3, "{approved:?}");
        assert!(
            approved[1].contains("agent of web-6: approval accepted"),
            "{approved:?}"
        );
        assert!(
            approved[2].contains("web-6") && approved[2].contains("started"),
            "{approved:?}"
        );
        let done = feed.apply(&snapshot(
            "approved through web-6",
            "completed",
            Some("accepted"),
        ));
        assert!(done[0].contains("place in group web is free"), "{done:?}");
        assert!(!feed.all_over());
        assert_eq!(
            feed.verdict("C0FFEE06-DE30-4F1E-A000-000000000006"),
            Some("approved through web-6")
        );
    }
}
