//! The CloudEvents protocol bindings, in one place: how an event becomes the headers and body
//! of a Kafka record, a NATS message, an AMQP message or an HTTP request.
//!
//! Binary content mode (the default) puts each context attribute in a header named
//! `<prefix><attribute>` (`ce_` for Kafka, `ce-` for HTTP and NATS, `cloudEvents_` for AMQP 1.0
//! style consumers) and the event's `data` in the body, with `datacontenttype` as the message's
//! content type. Structured mode puts the whole event in the body as
//! `application/cloudevents+json`. cloudevents-sdk's own transport bindings are not used: they
//! pin old versions of rdkafka, reqwest and async-nats.

use cloudevents::AttributesReader;
use cloudevents::event::{AttributeValue, Data, ExtensionValue};
use serde::{Deserialize, Serialize};

use crate::Event;

/// An event that cannot be encoded (its data does not serialize). Retrying cannot help.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct EncodeError(pub String);

/// The content type of a structured-mode message.
pub const STRUCTURED_CONTENT_TYPE: &str = "application/cloudevents+json; charset=utf-8";
/// The content type of a batch of structured events (HTTP only).
pub const BATCH_CONTENT_TYPE: &str = "application/cloudevents-batch+json; charset=utf-8";

/// How an event travels in a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ContentMode {
    /// Attributes in headers, `data` as the body.
    #[default]
    Binary,
    /// The whole event as JSON in the body (`application/cloudevents+json`).
    Structured,
}

/// An event ready for a protocol: header name/value pairs, content type and body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Encoded {
    pub headers: Vec<(String, String)>,
    pub content_type: String,
    pub body: Vec<u8>,
}

/// How one protocol spells headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeaderStyle {
    /// `ce_`, `ce-` or `cloudEvents_`.
    pub prefix: &'static str,
    /// HTTP requires percent-encoding of header values outside printable ASCII (and of space,
    /// `"` and `%`); Kafka, NATS and AMQP headers carry UTF-8 as is.
    pub percent_encode: bool,
}

pub const KAFKA: HeaderStyle = HeaderStyle {
    prefix: "ce_",
    percent_encode: false,
};
pub const NATS: HeaderStyle = HeaderStyle {
    prefix: "ce-",
    percent_encode: false,
};
pub const HTTP: HeaderStyle = HeaderStyle {
    prefix: "ce-",
    percent_encode: true,
};
/// The RabbitMQ binding of Knative's eventing-rabbitmq and the CloudEvents SDKs.
pub const AMQP_RABBITMQ: HeaderStyle = HeaderStyle {
    prefix: "ce-",
    percent_encode: false,
};
/// The AMQP 1.0 binding's application-property names, for consumers that expect those.
pub const AMQP_1_0: HeaderStyle = HeaderStyle {
    prefix: "cloudEvents_",
    percent_encode: false,
};

/// Encodes an event in one content mode for one protocol.
pub fn encode(
    event: &Event,
    mode: ContentMode,
    style: HeaderStyle,
) -> Result<Encoded, EncodeError> {
    match mode {
        ContentMode::Structured => Ok(Encoded {
            headers: Vec::new(),
            content_type: STRUCTURED_CONTENT_TYPE.to_owned(),
            body: structured_json(event)?,
        }),
        ContentMode::Binary => {
            let mut headers = Vec::new();
            let mut content_type = "application/json".to_owned();
            for (name, value) in event.iter_attributes() {
                if name == "datacontenttype" {
                    content_type = value.to_string();
                    continue;
                }
                headers.push((
                    format!("{}{name}", style.prefix),
                    header_value(&value.to_string(), style),
                ));
            }
            for (name, value) in event.iter_extensions() {
                headers.push((
                    format!("{}{name}", style.prefix),
                    header_value(&value.to_string(), style),
                ));
            }
            Ok(Encoded {
                headers,
                content_type,
                body: data_bytes(event)?,
            })
        }
    }
}

/// The event as one structured-mode JSON document.
pub fn structured_json(event: &Event) -> Result<Vec<u8>, EncodeError> {
    serde_json::to_vec(event).map_err(|e| {
        EncodeError(format!(
            "event {} cannot be encoded as JSON: {e}",
            event.id()
        ))
    })
}

/// A batch of events as one `application/cloudevents-batch+json` array.
pub fn batch_json(events: &[Event]) -> Result<Vec<u8>, EncodeError> {
    serde_json::to_vec(events)
        .map_err(|e| EncodeError(format!("batch cannot be encoded as JSON: {e}")))
}

/// The event's `data` as bytes (empty when the event has none).
pub fn data_bytes(event: &Event) -> Result<Vec<u8>, EncodeError> {
    match event.data() {
        None => Ok(Vec::new()),
        Some(Data::Binary(bytes)) => Ok(bytes.clone()),
        Some(Data::String(text)) => Ok(text.clone().into_bytes()),
        Some(Data::Json(value)) => serde_json::to_vec(value)
            .map_err(|e| EncodeError(format!("data of {} cannot be encoded: {e}", event.id()))),
    }
}

/// A value of one context attribute, by name (`id`, `type`, an extension, ...).
pub fn attribute(event: &Event, name: &str) -> Option<String> {
    event
        .iter_attributes()
        .find(|(n, _)| *n == name)
        .map(|(_, v): (&str, AttributeValue)| v.to_string())
        .or_else(|| event.extension(name).map(ExtensionValue::to_string))
}

fn header_value(text: &str, style: HeaderStyle) -> String {
    if !style.percent_encode {
        return text.to_owned();
    }
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        match byte {
            0x21..=0x7e if byte != b'"' && byte != b'%' => out.push(byte as char),
            _ => out.push_str(&format!("%{byte:02X}")),
        }
    }
    out
}

/// Expands `{vmname}`, `{transition}`, `{eventtype}`, `{eventid}` and `{type}` in a subject,
/// routing-key or topic template. Characters a broker gives meaning to (`.`, `*`, `>`, `#`,
/// spaces) are replaced by `_` inside a value, so a value can never add levels or wildcards.
pub fn expand_template(template: &str, event: &Event) -> String {
    let value = |name: &str| -> String {
        let raw = match name {
            "vmname" => attribute(event, "vmname"),
            "transition" => Some(event.transition().to_owned()),
            "eventtype" => attribute(event, "eventtype"),
            "eventid" => event.subject().map(str::to_owned),
            "type" => Some(event.ty().to_owned()),
            _ => None,
        };
        // `transition` of approvals is `approval.accepted`: keep it one level.
        template_value(&raw.unwrap_or_else(|| "none".to_owned()))
    };
    let mut out = String::with_capacity(template.len() + 32);
    let mut rest = template;
    while let Some(start) = rest.find('{') {
        out.push_str(&rest[..start]);
        match rest[start..].find('}') {
            Some(end) => {
                out.push_str(&value(&rest[start + 1..start + end]));
                rest = &rest[start + end + 1..];
            }
            None => {
                out.push_str(&rest[start..]);
                rest = "";
            }
        }
    }
    out.push_str(rest);
    out
}

/// A value as a template writes it: characters a broker gives meaning to (`.`, `*`, `>`,
/// `#`, spaces) become `_`, so a value can never add levels or wildcards. Whoever builds a
/// subject, routing key or consumer name from a VM name (the agent's approval sources, the
/// coordinator) uses this, so that both sides name a VM alike.
pub fn template_value(raw: &str) -> String {
    raw.chars()
        .map(|c| {
            if matches!(c, '.' | '*' | '>' | '#' | ' ' | '\t') {
                '_'
            } else {
                c
            }
        })
        .collect()
}

/// The placeholders [`expand_template`] knows, for configuration validation.
pub const TEMPLATE_FIELDS: &[&str] = &["vmname", "transition", "eventtype", "eventid", "type"];

/// Checks a template's placeholders; returns the unknown ones.
pub fn unknown_template_fields(template: &str) -> Vec<String> {
    let mut unknown = Vec::new();
    let mut rest = template;
    while let Some(start) = rest.find('{') {
        match rest[start..].find('}') {
            Some(end) => {
                let name = &rest[start + 1..start + end];
                if !TEMPLATE_FIELDS.contains(&name) {
                    unknown.push(name.to_owned());
                }
                rest = &rest[start + end + 1..];
            }
            None => {
                unknown.push(rest[start..].to_owned());
                break;
            }
        }
    }
    unknown
}

#[cfg(test)]
mod tests {
    use super::*;
    use cloudevents::{EventBuilder, EventBuilderV10};

    pub(crate) fn sample() -> Event {
        EventBuilderV10::new()
            .id("E1:scheduled")
            .source("/subscriptions/s/virtualMachines/WestNO_0")
            .ty("com.azure.scheduledevents.scheduled")
            .subject("E1")
            .time("2022-04-11T22:00:00Z")
            .extension("incarnation", 2i64)
            .extension("affectsvm", true)
            .extension("vmname", "WestNO_0")
            .extension("eventtype", "Freeze")
            .data(
                "application/json",
                serde_json::json!({"event": {"EventId": "E1", "Description": "naïve \"quoted\""}}),
            )
            .build()
            .unwrap()
            .into()
    }

    fn decode_http(encoded: &Encoded) -> cloudevents::Event {
        let mut headers = http::HeaderMap::new();
        for (name, value) in &encoded.headers {
            headers.insert(
                http::HeaderName::try_from(name.as_str()).unwrap(),
                value.parse().unwrap(),
            );
        }
        headers.insert(
            http::header::CONTENT_TYPE,
            encoded.content_type.parse().unwrap(),
        );
        cloudevents::binding::http::to_event(&headers, encoded.body.clone()).unwrap()
    }

    #[test]
    fn binary_http_encoding_decodes_to_the_same_event_with_the_sdk() {
        let event = sample();
        let encoded = encode(&event, ContentMode::Binary, HTTP).unwrap();
        let names: Vec<&str> = encoded.headers.iter().map(|(n, _)| n.as_str()).collect();
        for expected in [
            "ce-specversion",
            "ce-id",
            "ce-source",
            "ce-type",
            "ce-subject",
            "ce-time",
            "ce-incarnation",
            "ce-affectsvm",
        ] {
            assert!(
                names.contains(&expected),
                "{expected} missing from {names:?}"
            );
        }
        assert_eq!(encoded.content_type, "application/json");
        let decoded = decode_http(&encoded);
        assert_eq!(decoded.id(), event.id());
        assert_eq!(decoded.ty(), event.ty());
        assert_eq!(decoded.source(), event.source());
        assert_eq!(decoded.time(), event.time());
        assert_eq!(decoded.subject(), event.subject());
        assert_eq!(decoded.extension("vmname").unwrap().to_string(), "WestNO_0");
        assert_eq!(decoded.extension("incarnation").unwrap().to_string(), "2");
        let data: serde_json::Value = match decoded.data().unwrap() {
            Data::Binary(bytes) => serde_json::from_slice(bytes).unwrap(),
            Data::Json(value) => value.clone(),
            Data::String(text) => serde_json::from_str(text).unwrap(),
        };
        assert_eq!(Some(&Data::Json(data)), event.data());
    }

    #[test]
    fn structured_encoding_decodes_to_the_same_event_with_the_sdk() {
        let event = sample();
        let encoded = encode(&event, ContentMode::Structured, HTTP).unwrap();
        assert!(encoded.headers.is_empty());
        assert!(
            encoded
                .content_type
                .starts_with("application/cloudevents+json")
        );
        assert_eq!(decode_http(&encoded), *event);
    }

    #[test]
    fn http_header_values_are_percent_encoded_and_other_protocols_are_not() {
        assert_eq!(header_value("a b\"c%dé", HTTP), "a%20b%22c%25d%C3%A9");
        assert_eq!(header_value("a b\"c%dé", KAFKA), "a b\"c%dé");
    }

    #[test]
    fn kafka_and_amqp_1_0_styles_use_their_prefixes() {
        let kafka = encode(&sample(), ContentMode::Binary, KAFKA).unwrap();
        assert!(
            kafka
                .headers
                .iter()
                .any(|(n, v)| n == "ce_id" && v == "E1:scheduled")
        );
        let amqp = encode(&sample(), ContentMode::Binary, AMQP_1_0).unwrap();
        assert!(amqp.headers.iter().any(|(n, v)| n == "cloudEvents_type" && v == "com.azure.scheduledevents.scheduled"));
    }

    #[test]
    fn templates_expand_and_values_cannot_add_subject_levels_or_wildcards() {
        let event = sample();
        assert_eq!(
            expand_template("scheduledevents.{vmname}.{transition}", &event),
            "scheduledevents.WestNO_0.scheduled"
        );
        assert_eq!(
            expand_template("{eventtype}/{eventid}/{nope}", &event),
            "Freeze/E1/none"
        );
        let tricky = EventBuilderV10::new()
            .id("x")
            .source("s")
            .ty("com.azure.scheduledevents.approval.accepted")
            .extension("vmname", "evil.*.>")
            .build()
            .unwrap()
            .into();
        assert_eq!(
            expand_template("a.{vmname}.{transition}", &tricky),
            "a.evil____.approval_accepted"
        );
        assert_eq!(
            unknown_template_fields("a.{vmname}.{oops}.{x"),
            ["oops", "{x"]
        );
    }
}
