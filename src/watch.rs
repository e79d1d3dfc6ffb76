//! `sched-relay watch`: a live table of the fleet's maintenance, built from the event stream
//! the agents publish (a file sink, NATS, RabbitMQ or Kafka): one row per VM and event, with
//! its type, status, a NotBefore countdown and the approval state.
//!
//! Every string in the table comes from the fleet (VM names, EventIds, types, rejection
//! reasons), and any agent or broker publisher can write them: before they reach the terminal,
//! control characters (ANSI escapes, `\r`, C1 controls) and bidirectional overrides are shown
//! escaped (`\u{1b}`), never interpreted ([`printable`]).

use std::collections::BTreeMap;
use std::io::Write;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use sched_relay_transport::inbound::{Answer, Delivery, Inbound, Reply};
use serde_json::Value;
use tokio::sync::{mpsc, watch};

use sched_relay_core::EventKind;
use sched_relay_core::approval::PREFIXES;
use sched_relay_core::event::DEFAULT_TYPE_PREFIX;

/// One row: what is known about one event of one VM.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Row {
    pub event_type: String,
    pub status: String,
    pub not_before: Option<DateTime<Utc>>,
    pub approval: String,
    pub last: String,
    pub seen: Option<DateTime<Utc>>,
}

/// The table: (VM, EventId) -> row, of the events whose `type` is `<prefix>.<kind>`.
#[derive(Debug)]
pub struct Fleet {
    pub rows: BTreeMap<(String, String), Row>,
    prefix: String,
}

impl Default for Fleet {
    fn default() -> Self {
        Fleet::new(DEFAULT_TYPE_PREFIX)
    }
}

impl Fleet {
    /// A table of the agents' events whose `type` begins with `prefix` (the agents'
    /// `[events] type_prefix`).
    pub fn new(prefix: &str) -> Fleet {
        Fleet {
            rows: BTreeMap::new(),
            prefix: prefix.to_owned(),
        }
    }

    /// Applies one CloudEvent (structured JSON form) to the table; another producer's event
    /// on the same stream (a `type` without the agents' prefix) is passed over.
    pub fn apply(&mut self, event: &Value) {
        let text = |name: &str| event.get(name).and_then(Value::as_str).unwrap_or_default();
        let ty = text("type");
        let Some(kind) = EventKind::from_type(ty).suffix() else {
            return;
        };
        if ty.strip_suffix(kind).and_then(|p| p.strip_suffix('.')) != Some(self.prefix.as_str()) {
            return;
        }
        let vm = text("vmname").to_owned();
        let event_id = text("subject").to_owned();
        // A document or a heartbeat is the VM's, not one event's: no row.
        if vm.is_empty() || event_id.is_empty() || kind == "document" || kind == "heartbeat" {
            return;
        }
        let row = self.rows.entry((vm, event_id)).or_default();
        row.seen = event
            .get("time")
            .and_then(Value::as_str)
            .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
            .map(|t| t.with_timezone(&Utc))
            .or(row.seen);
        if let Some(outcome) = kind.strip_prefix("approval.") {
            let reason = event["data"]["reason"].as_str().unwrap_or_default();
            row.approval = match outcome {
                "accepted" if event["dryrun"] == true => "dry run".to_owned(),
                "accepted" => "accepted".to_owned(),
                other => format!("{other}: {reason}"),
            };
            return;
        }
        row.last = kind.to_owned();
        if !text("eventtype").is_empty() {
            row.event_type = text("eventtype").to_owned();
        }
        row.status = match kind {
            "completed" => "Completed".to_owned(),
            "cancelled" => "Cancelled".to_owned(),
            _ => text("eventstatus").to_owned(),
        };
        row.not_before = event["data"]["event"]["NotBefore"]
            .as_str()
            .and_then(|t| DateTime::parse_from_rfc2822(t).ok())
            .map(|t| t.with_timezone(&Utc));
    }

    /// The table as text, with NotBefore as a countdown from `now`.
    pub fn render(&self, now: DateTime<Utc>) -> String {
        let header = [
            "VM",
            "EVENT",
            "TYPE",
            "STATUS",
            "NOT BEFORE",
            "APPROVAL",
            "LAST",
        ];
        let mut lines: Vec<[String; 7]> = vec![header.map(str::to_owned)];
        let text = |cell: &str| printable(cell).into_owned();
        for ((vm, event_id), row) in &self.rows {
            let countdown = match row.not_before {
                None => "-".to_owned(),
                Some(at) if at > now => format!(
                    "in {}",
                    humantime::format_duration(Duration::from_secs(
                        (at - now).num_seconds().max(0) as u64
                    ),)
                ),
                Some(at) => format!(
                    "{} ago",
                    humantime::format_duration(Duration::from_secs(
                        (now - at).num_seconds().max(0) as u64
                    ),)
                ),
            };
            lines.push([
                text(vm),
                text(event_id),
                text(&row.event_type),
                text(&row.status),
                countdown,
                if row.approval.is_empty() {
                    "-".into()
                } else {
                    text(&row.approval)
                },
                text(&row.last),
            ]);
        }
        let widths: Vec<usize> = (0..7)
            .map(|i| {
                lines
                    .iter()
                    .map(|l| l[i].chars().count())
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let mut out = String::new();
        for line in &lines {
            let cells: Vec<String> = line
                .iter()
                .zip(&widths)
                .map(|(cell, width)| format!("{cell:<width$}"))
                .collect();
            out.push_str(cells.join("  ").trim_end());
            out.push('\n');
        }
        out.push_str(&format!(
            "{} event(s) on {} VM(s)\n",
            self.rows.len(),
            self.vm_count()
        ));
        out
    }

    fn vm_count(&self) -> usize {
        let mut vms: Vec<&String> = self.rows.keys().map(|(vm, _)| vm).collect();
        vms.dedup();
        vms.len()
    }
}

/// `text` safe for a terminal: every control character (C0 such as ESC and `\r`, DEL, C1
/// such as CSI U+009B) and every character that reorders or hides text (bidi embeddings,
/// overrides and isolates, directional marks, zero-width characters) is shown as `\u{..}`.
pub fn printable(text: &str) -> std::borrow::Cow<'_, str> {
    let hostile = |c: char| {
        c.is_control()
            || matches!(c,
                '\u{061C}' | '\u{200B}'..='\u{200F}' | '\u{202A}'..='\u{202E}'
                | '\u{2060}'..='\u{2069}' | '\u{FEFF}')
    };
    if !text.contains(hostile) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        if hostile(c) {
            out.extend(c.escape_unicode());
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

/// A message in binary or structured mode as one structured-mode JSON object.
pub fn decode(message: &Inbound) -> Option<Value> {
    let mut attributes = serde_json::Map::new();
    for (name, value) in &message.headers {
        let lower = name.to_ascii_lowercase();
        if let Some(attribute) = PREFIXES.iter().find_map(|p| lower.strip_prefix(p)) {
            attributes.insert(attribute.to_owned(), Value::String(value.clone()));
        }
    }
    let body: Value = serde_json::from_slice(&message.body).ok()?;
    if attributes.contains_key("specversion") {
        attributes.insert("data".into(), body);
        Some(Value::Object(attributes))
    } else {
        body.get("specversion").is_some().then_some(body)
    }
}

/// Where to read the event stream from.
#[derive(Debug, Clone)]
pub enum Feed {
    File(std::path::PathBuf),
    Broker(url::Url),
    /// A coordinator's `/fleet` (its decisions and budgets as well).
    Coordinator(url::Url),
}

impl std::str::FromStr for Feed {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, String> {
        match url::Url::parse(text) {
            Ok(url) if url.scheme() == "file" => Ok(Feed::File(url.path().into())),
            Ok(url) if matches!(url.scheme(), "nats" | "tls" | "amqp" | "amqps" | "kafka") => {
                Ok(Feed::Broker(url))
            }
            Ok(url) if matches!(url.scheme(), "http" | "https") => Ok(Feed::Coordinator(url)),
            Ok(url) if url.scheme().len() > 1 => Err(format!(
                "--from {text}: expected a file path, nats://, amqp://, kafka:// or a coordinator's http://host:9465"
            )),
            _ => Ok(Feed::File(text.into())),
        }
    }
}

/// Runs the view until Ctrl-C (or, with `once`, until the stream is read: a file to its end,
/// a broker for `settle`), printing to `out`.
pub async fn run(
    from: Feed,
    prefix: &str,
    once: bool,
    settle: Duration,
    out: &mut (impl Write + Send),
) -> Result<(), String> {
    if let Feed::Coordinator(url) = from {
        return coordinator::run(url, once, out).await;
    }
    let (tx, mut rx) = mpsc::channel::<Delivery>(256);
    let (stop, stop_rx) = watch::channel(false);
    let reader = start(from, tx, stop_rx)?;
    let mut fleet = Fleet::new(prefix);
    let tty = std::io::IsTerminal::is_terminal(&std::io::stdout()) && !once;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let deadline = Instant::now() + settle;
    loop {
        tokio::select! {
            delivery = rx.recv() => {
                let Some(delivery) = delivery else { break };
                if let Some(event) = decode(&delivery.message) {
                    fleet.apply(&event);
                }
                let _ = delivery.handled.send(Answer::Handled(Reply { outcome: "skipped", body: Value::Null }));
                continue;
            }
            _ = tick.tick() => {}
            _ = tokio::signal::ctrl_c() => break,
        }
        if once {
            if Instant::now() >= deadline {
                break;
            }
            continue;
        }
        let table = fleet.render(Utc::now());
        let clear = if tty { "\x1b[2J\x1b[H" } else { "" };
        write!(out, "{clear}{table}").map_err(|e| e.to_string())?;
        out.flush().map_err(|e| e.to_string())?;
    }
    let _ = stop.send(true);
    reader.abort();
    write!(out, "{}", fleet.render(Utc::now())).map_err(|e| e.to_string())
}

/// Starts the reader task that feeds `tx`.
fn start(
    from: Feed,
    tx: mpsc::Sender<Delivery>,
    stop: watch::Receiver<bool>,
) -> Result<tokio::task::JoinHandle<()>, String> {
    match from {
        Feed::File(path) => Ok(tokio::spawn(follow_file(path, tx, stop))),
        Feed::Broker(url) => broker(url, tx, stop),
        Feed::Coordinator(_) => unreachable!("run() reads a coordinator itself"),
    }
}

/// Reads a JSON Lines file and follows what is appended (the file sink's output).
async fn follow_file(
    path: std::path::PathBuf,
    tx: mpsc::Sender<Delivery>,
    mut stop: watch::Receiver<bool>,
) {
    let mut offset = 0usize;
    loop {
        let text = tokio::fs::read(&path).await.unwrap_or_default();
        if text.len() > offset {
            let end = text[offset..]
                .iter()
                .rposition(|b| *b == b'\n')
                .map(|i| offset + i + 1)
                .unwrap_or(offset);
            for line in text[offset..end]
                .split(|b| *b == b'\n')
                .filter(|l| !l.is_empty())
            {
                let message = Inbound {
                    transport: "file",
                    channel: path.display().to_string(),
                    headers: Vec::new(),
                    content_type: None,
                    body: line.to_vec(),
                    shared: true,
                    route: None,
                };
                if sched_relay_transport::inbound::hand_over(&tx, message).await
                    == sched_relay_transport::inbound::Handover::Stopping
                {
                    return;
                }
            }
            offset = end;
        }
        tokio::select! {
            _ = stop.wait_for(|stop| *stop) => return,
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
    }
}

#[cfg_attr(
    not(any(feature = "nats", feature = "amqp", feature = "kafka")),
    allow(unused_variables)
)]
fn broker(
    url: url::Url,
    tx: mpsc::Sender<Delivery>,
    stop: watch::Receiver<bool>,
) -> Result<tokio::task::JoinHandle<()>, String> {
    let query = |name: &str| {
        url.query_pairs()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.into_owned())
    };
    let mut base = url.clone();
    base.set_query(None);
    match url.scheme() {
        #[cfg(feature = "nats")]
        "nats" | "tls" => {
            let connection = serde_json::from_value(
                serde_json::json!({"url": base.as_str().trim_end_matches('/')}),
            )
            .map_err(|e| e.to_string())?;
            let spec = sched_relay_nats::source::NatsSourceSpec {
                connection,
                subject: query("subject").unwrap_or_else(|| "scheduledevents.>".into()),
                fleet_subject: None,
                jetstream: None,
                from_start: false,
                ack_wait: Duration::from_secs(60),
                pull: None,
                role: sched_relay_transport::inbound::SourceRole::Watch,
            };
            Ok(tokio::spawn(sched_relay_nats::source::run(
                spec, tx, None, stop,
            )))
        }
        #[cfg(feature = "amqp")]
        "amqp" | "amqps" => {
            let connection = serde_json::from_value(serde_json::json!({"url": base.as_str()}))
                .map_err(|e| e.to_string())?;
            let spec = sched_relay_amqp::source::AmqpSourceSpec {
                connection,
                queue: format!("sched-relay-watch-{}", std::process::id()),
                declare: true,
                exchange: query("exchange").unwrap_or_else(|| "scheduledevents".into()),
                routing_key: query("binding_key").unwrap_or_else(|| "#".into()),
                fleet_routing_key: None,
                prefetch: 256,
                exclusive: true,
                role: sched_relay_transport::inbound::SourceRole::Watch,
            };
            Ok(tokio::spawn(sched_relay_amqp::source::run(
                spec, tx, None, stop,
            )))
        }
        #[cfg(feature = "kafka")]
        "kafka" => {
            let host = format!(
                "{}:{}",
                url.host_str().unwrap_or("127.0.0.1"),
                url.port().unwrap_or(9092)
            );
            let topic = match url.path().trim_start_matches('/') {
                "" => "scheduledevents".to_owned(),
                topic => topic.to_owned(),
            };
            let connection = serde_json::from_value(serde_json::json!({"brokers": host}))
                .map_err(|e| e.to_string())?;
            let spec = sched_relay_kafka::source::KafkaSourceSpec {
                connection,
                topic,
                vm_name: String::new(),
                by_key: false,
                group_id: format!("sched-relay-watch-{}", std::process::id()),
                max_age: humantime::parse_duration(&query("since").unwrap_or_else(|| "24h".into()))
                    .map_err(|e| format!("since: {e}"))?,
                role: sched_relay_transport::inbound::SourceRole::Watch,
            };
            Ok(tokio::spawn(sched_relay_kafka::source::run(
                spec, tx, None, stop,
            )))
        }
        scheme => Err(format!(
            "--from {scheme}://: this build has no support for it"
        )),
    }
}

pub(crate) mod coordinator;
#[cfg(test)]
mod tests;

pub use coordinator::render as render_coordinator;
