//! Reading an approval message, whatever carried it: a CloudEvent in binary mode (attributes
//! in `ce-`/`ce_`/`cloudEvents_` headers, the StartRequests as the body), in structured mode
//! (`application/cloudevents+json`), or the bare Azure body `{"StartRequests":[...]}`.
//!
//! Nothing here is believed yet: the parser only says what the message claims, or why it
//! cannot be read. Attribute values are kept exactly as sent, since the signature covers them.

use crate::inbound::Inbound;
use chrono::{DateTime, Utc};
use serde_json::Value;

/// Which check refused a request, and why, in the order the checks run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    TooLarge,
    UnsupportedContentType,
    Malformed,
    Unsigned,
    UnknownKey,
    BadSignature,
    Expired,
    FromTheFuture,
    Replayed,
    WrongTarget,
    UnknownEvent,
    NotAffected,
    EventStarted,
    EventNotScheduled,
}

impl Reason {
    /// The machine-readable `reason` of the `approval.rejected` event.
    pub fn code(self) -> &'static str {
        match self {
            Reason::TooLarge => "too_large",
            Reason::UnsupportedContentType => "unsupported_content_type",
            Reason::Malformed => "malformed",
            Reason::Unsigned => "unsigned",
            Reason::UnknownKey => "unknown_key",
            Reason::BadSignature => "bad_signature",
            Reason::Expired => "expired",
            Reason::FromTheFuture => "from_the_future",
            Reason::Replayed => "replayed",
            Reason::WrongTarget => "wrong_target",
            Reason::UnknownEvent => "unknown_event",
            Reason::NotAffected => "not_affected",
            Reason::EventStarted => "event_started",
            Reason::EventNotScheduled => "event_not_scheduled",
        }
    }

    /// The check that decided: `format`, `authenticity`, `freshness`, `targeting`, `state`.
    pub fn check(self) -> &'static str {
        use Reason::*;
        match self {
            TooLarge | UnsupportedContentType | Malformed => "format",
            Unsigned | UnknownKey | BadSignature => "authenticity",
            Expired | FromTheFuture | Replayed => "freshness",
            WrongTarget | NotAffected => "targeting",
            UnknownEvent | EventStarted | EventNotScheduled => "state",
        }
    }
}

/// A refused request: which check, and a sentence saying what was wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    pub reason: Reason,
    pub detail: String,
}

impl Rejection {
    pub fn new(reason: Reason, detail: impl Into<String>) -> Self {
        Rejection {
            reason,
            detail: detail.into(),
        }
    }
}

/// What a message claims, as sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// `None` for a bare Azure body, which has no id, time or signature.
    pub cloud_event: Option<Attributes>,
    /// The EventIds of the StartRequests, in message order.
    pub event_ids: Vec<String>,
}

/// The CloudEvents attributes the checks use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attributes {
    pub id: String,
    pub source: String,
    pub time: DateTime<Utc>,
    /// The target VM (`vmname` extension), `*` for the fleet, or none.
    pub vm_name: Option<String>,
    pub key_id: Option<String>,
    /// The base64 `signature` extension.
    pub signature: Option<String>,
}

impl Request {
    pub fn id(&self) -> Option<&str> {
        self.cloud_event.as_ref().map(|a| a.id.as_str())
    }

    pub fn vm_name(&self) -> Option<&str> {
        self.cloud_event.as_ref().and_then(|a| a.vm_name.as_deref())
    }
}

/// The longest request id kept, in bytes. Ids are stored, logged and put into outcome event ids;
/// a real one (a UUID, a ULID, an orchestrator's job key) is far shorter.
pub const MAX_ID_BYTES: usize = 256;

/// Whether `id` can name a request: not empty, not only whitespace, at most [`MAX_ID_BYTES`]
/// bytes, and free of control characters (line breaks, NUL, C1 controls), which would make
/// logs and outcome ids ambiguous. A request whose id is not usable is `malformed`, and its
/// outcome gets a made-up `unidentified:<transport>:<random>` id, as one without an id does.
pub fn usable_id(id: &str) -> bool {
    !id.trim().is_empty() && id.len() <= MAX_ID_BYTES && !id.contains(char::is_control)
}

/// What the parser needs to know from the configuration.
#[derive(Debug, Clone)]
pub struct Limits {
    /// `<type_prefix>.approval.requested`.
    pub request_type: String,
    pub max_message_bytes: usize,
    pub max_event_ids: usize,
}

/// Header prefixes of the CloudEvents bindings, lower-cased: HTTP, NATS and RabbitMQ (`ce-`),
/// Kafka (`ce_`), AMQP 1.0 (`cloudEvents_` and `cloudEvents:`).
pub const PREFIXES: [&str; 4] = ["ce-", "ce_", "cloudevents_", "cloudevents:"];

/// Reads a message. On failure, also returns the request id when one could be read, so the
/// rejection can name it.
pub fn parse(message: &Inbound, limits: &Limits) -> Result<Request, (Rejection, Option<String>)> {
    // An unusable id never names a rejection: three requests with `"id": ""` would share the
    // outcome id `:rejected`, and consumers that de-duplicate would keep one.
    read(message, limits).map_err(|(rejection, id)| (rejection, id.filter(|id| usable_id(id))))
}

fn read(message: &Inbound, limits: &Limits) -> Result<Request, (Rejection, Option<String>)> {
    let fail = |reason, detail: String| Err((Rejection::new(reason, detail), None));
    if message.body.len() > limits.max_message_bytes {
        return fail(
            Reason::TooLarge,
            format!(
                "the message is {} bytes; at most {} are read (approvals.max_message_bytes)",
                message.body.len(),
                limits.max_message_bytes
            ),
        );
    }
    let mut attributes: Vec<(String, String)> = Vec::new();
    let mut header_content_type = None;
    for (name, value) in &message.headers {
        let lower = name.to_ascii_lowercase();
        if lower == "content-type" {
            header_content_type = Some(value.clone());
            continue;
        }
        if let Some(attribute) = PREFIXES.iter().find_map(|p| lower.strip_prefix(p)) {
            let value = if message.transport == "http" {
                percent_decode(value)
            } else {
                value.clone()
            };
            attributes.push((attribute.to_owned(), value));
        }
    }
    let content_type = message.content_type.clone().or(header_content_type);
    let media = content_type.as_deref().map(|ct| {
        ct.split(';')
            .next()
            .unwrap_or_default()
            .trim()
            .to_ascii_lowercase()
    });
    let binary = attributes.iter().any(|(name, _)| name == "specversion");
    let json_media = |media: Option<&str>| matches!(media, None | Some("application/json"));

    if binary {
        if !json_media(media.as_deref()) {
            return fail(
                Reason::UnsupportedContentType,
                format!(
                    "content type {:?}: the StartRequests must be application/json",
                    content_type.unwrap_or_default()
                ),
            );
        }
        let data = parse_json(&message.body)?;
        let id = find(&attributes, "id").map(str::to_owned);
        let attrs = attributes_from(|name| find(&attributes, name).map(str::to_owned), limits)
            .map_err(|rejection| (rejection, id.clone()))?;
        let event_ids = start_requests(&data, limits).map_err(|r| (r, id))?;
        return Ok(Request {
            cloud_event: Some(attrs),
            event_ids,
        });
    }
    let structured = match media.as_deref() {
        Some("application/cloudevents+json") => true,
        media if json_media(media) => false,
        Some("application/cloudevents-batch+json") => {
            return fail(
                Reason::UnsupportedContentType,
                "batches are not accepted: send one request per message".into(),
            );
        }
        _ => {
            return fail(
                Reason::UnsupportedContentType,
                format!(
                    "content type {:?}; expected application/cloudevents+json, or \
                     application/json with ce- headers",
                    content_type.unwrap_or_default()
                ),
            );
        }
    };
    let body = parse_json(&message.body)?;
    let Value::Object(object) = &body else {
        return fail(Reason::Malformed, "the body is not a JSON object".into());
    };
    if !structured && !object.contains_key("specversion") {
        // The bare Azure body.
        let event_ids = start_requests(&body, limits).map_err(|r| (r, None))?;
        return Ok(Request {
            cloud_event: None,
            event_ids,
        });
    }
    let id = object.get("id").and_then(Value::as_str).map(str::to_owned);
    let text = |name: &str| -> Result<Option<String>, Rejection> {
        match object.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(text)) => Ok(Some(text.clone())),
            Some(_) => Err(Rejection::new(
                Reason::Malformed,
                format!("the attribute {name:?} must be a string"),
            )),
        }
    };
    let mut values = Vec::new();
    for name in [
        "specversion",
        "type",
        "id",
        "source",
        "time",
        "vmname",
        "keyid",
        "signature",
        "datacontenttype",
    ] {
        if let Some(value) = text(name).map_err(|r| (r, id.clone()))? {
            values.push((name.to_owned(), value));
        }
    }
    if let Some(ct) = find(&values, "datacontenttype")
        && !json_media(Some(ct.split(';').next().unwrap_or_default().trim()))
    {
        return Err((
            Rejection::new(
                Reason::UnsupportedContentType,
                format!("datacontenttype {ct:?}: the StartRequests must be application/json"),
            ),
            id,
        ));
    }
    let attrs = attributes_from(|name| find(&values, name).map(str::to_owned), limits)
        .map_err(|rejection| (rejection, id.clone()))?;
    let data = match (object.get("data"), object.get("data_base64")) {
        (Some(data), None) => data.clone(),
        (None, Some(Value::String(encoded))) => {
            let bytes = super::verify::decode_base64(encoded).ok_or_else(|| {
                (
                    Rejection::new(Reason::Malformed, "data_base64 is not base64"),
                    id.clone(),
                )
            })?;
            parse_json(&bytes).map_err(|(r, _)| (r, id.clone()))?
        }
        _ => {
            return Err((
                Rejection::new(
                    Reason::Malformed,
                    "expected exactly one of data or data_base64",
                ),
                id,
            ));
        }
    };
    let event_ids = start_requests(&data, limits).map_err(|r| (r, id))?;
    Ok(Request {
        cloud_event: Some(attrs),
        event_ids,
    })
}

fn find<'a>(pairs: &'a [(String, String)], name: &str) -> Option<&'a str> {
    pairs
        .iter()
        .find(|(key, _)| key == name)
        .map(|(_, value)| value.as_str())
}

fn parse_json(bytes: &[u8]) -> Result<Value, (Rejection, Option<String>)> {
    serde_json::from_slice(bytes).map_err(|e| {
        (
            Rejection::new(Reason::Malformed, format!("the body is not JSON: {e}")),
            None,
        )
    })
}

/// The attributes every request must carry, checked for shape (not yet for truth).
fn attributes_from(
    get: impl Fn(&str) -> Option<String>,
    limits: &Limits,
) -> Result<Attributes, Rejection> {
    let malformed = |detail: String| Rejection::new(Reason::Malformed, detail);
    let required = |name: &str| {
        get(name)
            .filter(|value| !value.is_empty())
            .ok_or_else(|| malformed(format!("the attribute {name:?} is missing or empty")))
    };
    let spec = required("specversion")?;
    if spec != "1.0" {
        return Err(malformed(format!("specversion {spec:?}; expected \"1.0\"")));
    }
    let ty = required("type")?;
    if ty != limits.request_type {
        return Err(malformed(format!(
            "type {ty:?}; an approval has type {:?}",
            limits.request_type
        )));
    }
    let id = required("id")?;
    if !usable_id(&id) {
        return Err(malformed(format!(
            "the attribute \"id\" must be 1 to {MAX_ID_BYTES} bytes, not only whitespace, \
             without control characters; got {} bytes",
            id.len()
        )));
    }
    let source = required("source")?;
    let time_text = required("time")?;
    let time = DateTime::parse_from_rfc3339(&time_text)
        .map_err(|e| malformed(format!("time {time_text:?} is not RFC 3339: {e}")))?
        .with_timezone(&Utc);
    let vm_name = get("vmname");
    for (name, value) in [
        ("id", Some(&id)),
        ("source", Some(&source)),
        ("vmname", vm_name.as_ref()),
    ] {
        if value.is_some_and(|v| v.contains(['\n', '\r'])) {
            return Err(malformed(format!(
                "the attribute {name:?} contains a line break"
            )));
        }
    }
    Ok(Attributes {
        id,
        source,
        time,
        vm_name,
        key_id: get("keyid"),
        signature: get("signature"),
    })
}

/// The EventIds of `{"StartRequests":[{"EventId":"..."}, ...]}`.
fn start_requests(data: &Value, limits: &Limits) -> Result<Vec<String>, Rejection> {
    let malformed = |detail: &str| {
        Rejection::new(
            Reason::Malformed,
            format!("{detail}; expected {{\"StartRequests\":[{{\"EventId\":\"...\"}}]}}"),
        )
    };
    let list = data
        .get("StartRequests")
        .and_then(Value::as_array)
        .ok_or_else(|| malformed("no StartRequests array"))?;
    if list.is_empty() {
        return Err(malformed("StartRequests is empty"));
    }
    if list.len() > limits.max_event_ids {
        return Err(Rejection::new(
            Reason::TooLarge,
            format!(
                "{} StartRequests; at most {} per request (approvals.max_event_ids)",
                list.len(),
                limits.max_event_ids
            ),
        ));
    }
    list.iter()
        .map(|entry| {
            entry
                .get("EventId")
                .and_then(Value::as_str)
                // Azure's EventIds are GUIDs; the cap keeps every outcome's headers small (the
                // AMQP sink's frames are 8 KiB, and a header frame cannot be split).
                .filter(|id| {
                    !id.is_empty() && id.len() <= MAX_ID_BYTES && !id.contains(['\n', '\r'])
                })
                .map(str::to_owned)
                .ok_or_else(|| {
                    malformed(&format!(
                        "a StartRequest has no EventId string of 1 to {MAX_ID_BYTES} bytes"
                    ))
                })
        })
        .collect()
}

/// Undoes the percent-encoding HTTP header values use in the CloudEvents HTTP binding.
fn percent_decode(value: &str) -> String {
    percent_encoding::percent_decode_str(value)
        .decode_utf8_lossy()
        .into_owned()
}

#[cfg(test)]
mod tests;
