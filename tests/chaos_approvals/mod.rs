//! Approvals under faults, for the chaos driver: an orchestrator sends signed requests over
//! core NATS request-reply for events of the scenario that wait for approval (an hour of
//! notice: only an approval starts them), while IMDS answers some StartRequests POSTs with
//! 503, brokers are cut and the agent is killed with -9. Like a real orchestrator it sends the
//! same request again until it gets an outcome (no reply, `not_handled`, `failed`), and a new
//! one after a rejection. Each event must end with exactly one accepted outcome id.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use sched_relay_core::approval::{Draft, SigningKey};
use serde_json::Value;

pub const SECRET: &str = "chaos-orchestrator-secret-0001";

/// One event that only an approval starts.
#[derive(Debug)]
pub struct Planned {
    pub event_id: String,
    /// When the orchestrator approves it, after the simulator started.
    pub at: Duration,
}

/// What the orchestrator did and saw.
#[derive(Debug, Default, Clone)]
pub struct Sent {
    /// Per event: the request ids sent for it, the last one accepted if any.
    pub requests: BTreeMap<String, Vec<String>>,
    /// Per event: the accepted request id.
    pub accepted: BTreeMap<String, String>,
    pub sends: usize,
    pub rejected: usize,
    pub failed: usize,
    pub not_handled: usize,
    pub unanswered: usize,
}

/// Adds `count` approval events and 503s for some of their POSTs to `toml`.
pub fn plan(
    rng: &mut fastrand::Rng,
    round: u64,
    offset: f64,
    toml: &mut String,
) -> (Vec<Planned>, usize) {
    let mut planned = Vec::new();
    let mut post_faults = 0;
    for index in 0..rng.usize(1..4) {
        let event_id = format!("chaos-{round}-approve-{index}");
        let appear = offset + 1.0 + rng.f64() * 6.0;
        let appear_ms = (appear * 1000.0) as u64;
        let _ = write!(
            toml,
            "\n[[events]]\nid = \"{event_id}\"\ntype = \"Freeze\"\nresources = [\"WestNO_0\"]\nappear_after = \"{appear_ms}ms\"\nduration_in_seconds = 5\nnotice = \"1h\"\nstarted_for = \"2500ms\"\n"
        );
        let at = appear_ms + rng.u64(1_000..3_000);
        if rng.bool() {
            // One to three 503s for the next POSTs: three use up `imds_attempts`.
            let count = rng.u8(1..4);
            let _ = write!(
                toml,
                "\n[[faults]]\nkind = \"status\"\nstatus = 503\nmethod = \"POST\"\nafter = \"{}ms\"\ncount = {count}\n",
                at.saturating_sub(200)
            );
            post_faults += usize::from(count);
        }
        planned.push(Planned {
            event_id,
            at: Duration::from_millis(at),
        });
    }
    (planned, post_faults)
}

/// The agent's configuration for approvals over core NATS on `subject`, through sink `bus`.
pub fn config(subject_prefix: &str) -> String {
    format!(
        "\n[[approvals.keys]]\nid = \"chaos\"\nalgorithm = \"hmac-sha256\"\nsecret = \"{SECRET}\"\n\n\
         [approvals.nats]\nsink = \"bus\"\nsubject = \"{subject_prefix}.{{vmname}}\"\n"
    )
}

/// The orchestrator: approves each planned event at its time, until each has an accepted
/// outcome or `deadline`.
pub async fn orchestrate(
    planned: Vec<Planned>,
    subject_prefix: String,
    started: Instant,
    deadline: Instant,
) -> Sent {
    let key = SigningKey::parse(&format!("hmac-sha256:{SECRET}")).unwrap();
    let client = async_nats::connect("nats://127.0.0.1:4222").await.unwrap();
    let subject = format!("{subject_prefix}.WestNO_0");
    let mut sent = Sent::default();
    // Per event: the request being sent.
    let mut current: BTreeMap<String, (String, Vec<u8>)> = BTreeMap::new();
    loop {
        let open: Vec<&Planned> = planned
            .iter()
            .filter(|p| !sent.accepted.contains_key(&p.event_id))
            .collect();
        if open.is_empty() || Instant::now() > deadline {
            return sent;
        }
        for p in open {
            if started.elapsed() < p.at {
                continue;
            }
            let (request_id, body) = current
                .entry(p.event_id.clone())
                .or_insert_with(|| {
                    let draft = Draft::new(
                        "urn:orchestrator:chaos",
                        Some("WestNO_0"),
                        vec![p.event_id.clone()],
                    );
                    let event = draft.event(Some(("chaos", &key)));
                    sent.requests
                        .entry(p.event_id.clone())
                        .or_default()
                        .push(draft.id.clone());
                    (draft.id, serde_json::to_vec(&event).unwrap())
                })
                .clone();
            let mut headers = async_nats::HeaderMap::new();
            headers.insert("content-type", "application/cloudevents+json");
            sent.sends += 1;
            let answer = tokio::time::timeout(
                Duration::from_secs(3),
                client.request_with_headers(subject.clone(), headers, body.into()),
            )
            .await;
            let reply: Option<Value> = match answer {
                Ok(Ok(message)) => serde_json::from_slice(&message.payload).ok(),
                _ => None,
            };
            match reply.as_ref().and_then(|r| r["outcome"].as_str()) {
                Some("accepted") => {
                    assert_eq!(reply.as_ref().unwrap()["requestId"], request_id.as_str());
                    sent.accepted.insert(p.event_id.clone(), request_id);
                }
                Some("rejected") => {
                    // Final for this id: a new request next time.
                    sent.rejected += 1;
                    current.remove(&p.event_id);
                }
                Some("failed") => sent.failed += 1,
                Some("not_handled") => sent.not_handled += 1,
                _ => sent.unanswered += 1,
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Whether a CloudEvent id is an outcome of one of `sent`'s requests.
pub fn is_outcome(sent: &Sent, id: &str) -> bool {
    sent.requests
        .values()
        .flatten()
        .any(|request| id.starts_with(&format!("{request}:")))
}

/// Checks one sink's outcome ids: each planned event has exactly one accepted outcome id
/// (its accepted request's), and no other request was accepted. Returns (lost, invented).
pub fn check(events: &[String], sent: &Sent, received: &[String]) -> (usize, usize) {
    let accepted: BTreeSet<&str> = received
        .iter()
        .filter(|id| is_outcome(sent, id))
        .filter_map(|id| id.strip_suffix(":accepted"))
        .collect();
    let lost = events
        .iter()
        .filter(|event_id| {
            sent.accepted
                .get(*event_id)
                .is_none_or(|request| !accepted.contains(request.as_str()))
        })
        .count();
    let invented = accepted
        .iter()
        .filter(|request| !sent.accepted.values().any(|a| a == *request))
        .count();
    (lost, invented)
}
