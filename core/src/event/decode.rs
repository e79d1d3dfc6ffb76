//! Decoding a structured-mode JSON CloudEvent in one pass: what a sink's backlog costs to read
//! back from the outbox.
//!
//! cloudevents-sdk's `Deserialize` parses the whole event into a `serde_json::Value`, turns it
//! into a map, and takes each attribute out of it through `Value` deserializers; in the
//! benchmark's 100k-event backlog drain that was a quarter of the agent's CPU. Here the
//! common shape (1.0, JSON `data`, string attributes, string/boolean/integer extensions, each
//! key once) is read straight from the bytes into the SDK's builder. Anything else (another
//! spec version, `data_base64`, a `dataschema`, a null or an attribute of another type, a key
//! twice, an empty `source`, a `time` the SDK would refuse, a `$` or a `\u` escape anywhere)
//! takes the SDK's own path, which decides it, so the result is exactly the SDK's in every
//! case (property tests compare both on generated events).

use std::collections::HashMap;
use std::fmt;

use chrono::{DateTime, Utc};
use cloudevents::event::{AttributesWriter, Data, EventBuilder, EventBuilderV10, ExtensionValue};
use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde_json::Value;

use super::Event;

impl Event {
    /// Decodes a structured-mode JSON CloudEvent, exactly as deserializing it with
    /// `serde_json::from_slice` does (same event, and an error where that fails), for a
    /// fraction of the work.
    pub fn from_json_slice(bytes: &[u8]) -> serde_json::Result<Event> {
        match fast_path(bytes) {
            Some(event) => Ok(event),
            None => serde_json::from_slice(bytes),
        }
    }
}

/// The event, when it has the common shape; `None` leaves it to the SDK.
pub(super) fn fast_path(bytes: &[u8]) -> Option<Event> {
    // With serde_json's `raw_value` feature (which axum turns on in this build), parsing a
    // `Value` treats an object whose first key is `$serde_json::private::RawValue` as a raw
    // value, and the SDK parses the data twice (the second time in key order): such keys, at
    // any depth and however escaped, are the SDK's to decide. They need a `$`, or a `\u`
    // escape to spell one.
    if bytes.contains(&b'$') || (bytes.contains(&b'\\') && bytes.windows(2).any(|w| w == b"\\u")) {
        return None;
    }
    let mut deserializer = serde_json::Deserializer::from_slice(bytes);
    let fields = deserializer.deserialize_map(FastVisitor).ok()??;
    deserializer.end().ok()?;
    fields.build()
}

/// What the one pass read; `None` from the visitor when the event is not of the common shape.
#[derive(Default)]
struct Fields {
    specversion_seen: bool,
    id: Option<String>,
    source: Option<String>,
    ty: Option<String>,
    subject: Option<String>,
    time: Option<String>,
    datacontenttype: Option<String>,
    data: Option<Value>,
    extensions: HashMap<String, ExtensionValue>,
}

impl Fields {
    fn build(self) -> Option<Event> {
        let Fields {
            specversion_seen,
            id,
            source,
            ty,
            subject,
            time,
            datacontenttype,
            data,
            extensions,
        } = self;
        if !specversion_seen {
            return None;
        }
        // The builder refuses an empty source, which the SDK's decoding accepts: `build` fails,
        // and the SDK decides.
        let mut builder = EventBuilderV10::new().id(id?).source(source?).ty(ty?);
        if let Some(subject) = subject {
            builder = builder.subject(subject);
        }
        if let Some(time) = time {
            let time = DateTime::parse_from_rfc3339(&time).ok()?;
            builder = builder.time(DateTime::<Utc>::from(time));
        }
        for (name, value) in extensions {
            builder = builder.extension(&name, value);
        }
        let mut cloud = builder.build().ok()?;
        // The SDK's rule: data is JSON unless a content type says otherwise.
        let json = datacontenttype.as_deref().is_none_or(is_json_content_type);
        let data = match data {
            None => None,
            Some(value) if json => Some(Data::Json(value)),
            Some(Value::String(text)) => Some(Data::String(text)),
            Some(_) => return None,
        };
        cloud.set_datacontenttype(datacontenttype);
        if let Some(data) = data {
            cloud.set_data_unchecked(data);
        }
        Some(Event::from(cloud))
    }
}

/// cloudevents-sdk's own rule (crate-private there) for data that is JSON rather than text.
fn is_json_content_type(content_type: &str) -> bool {
    content_type.starts_with("application/json")
        || content_type.starts_with("text/json")
        || content_type.ends_with("+json")
}

/// A top-level key: an attribute this pass reads, or an extension's name.
enum Key {
    SpecVersion,
    Id,
    Source,
    Type,
    Subject,
    Time,
    DataContentType,
    Data,
    /// `data_base64`, `dataschema`: left to the SDK.
    Unusual,
    Extension(String),
}

impl Key {
    fn of(name: &str) -> Key {
        match name {
            "specversion" => Key::SpecVersion,
            "id" => Key::Id,
            "source" => Key::Source,
            "type" => Key::Type,
            "subject" => Key::Subject,
            "time" => Key::Time,
            "datacontenttype" => Key::DataContentType,
            "data" => Key::Data,
            "data_base64" | "dataschema" => Key::Unusual,
            other => Key::Extension(other.to_owned()),
        }
    }
}

struct KeySeed;

impl<'de> DeserializeSeed<'de> for KeySeed {
    type Value = Key;
    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Key, D::Error> {
        deserializer.deserialize_str(KeySeed)
    }
}

impl Visitor<'_> for KeySeed {
    type Value = Key;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an attribute name")
    }
    fn visit_str<E: serde::de::Error>(self, name: &str) -> Result<Key, E> {
        Ok(Key::of(name))
    }
}

struct FastVisitor;

impl<'de> Visitor<'de> for FastVisitor {
    /// `None`: not the common shape (the rest of the map is skipped, the SDK decides).
    type Value = Option<Fields>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a structured-mode CloudEvent")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Option<Fields>, A::Error> {
        let mut fields = Fields::default();
        let mut usual = true;
        while let Some(key) = map.next_key_seed(KeySeed)? {
            if !usual {
                map.next_value::<IgnoredAny>()?;
                continue;
            }
            usual = match key {
                Key::SpecVersion => {
                    let version = map.next_value::<Value>()?;
                    let first = !fields.specversion_seen;
                    fields.specversion_seen = true;
                    first && version == "1.0"
                }
                Key::Id => string(&mut map, &mut fields.id)?,
                Key::Source => string(&mut map, &mut fields.source)?,
                Key::Type => string(&mut map, &mut fields.ty)?,
                Key::Subject => string(&mut map, &mut fields.subject)?,
                Key::Time => string(&mut map, &mut fields.time)?,
                Key::DataContentType => string(&mut map, &mut fields.datacontenttype)?,
                Key::Data => {
                    let value = map.next_value::<Value>()?;
                    fields.data.replace(value).is_none()
                }
                Key::Unusual => false,
                Key::Extension(name) => {
                    let value = match map.next_value::<Value>()? {
                        Value::String(text) => Some(ExtensionValue::String(text)),
                        Value::Bool(flag) => Some(ExtensionValue::Boolean(flag)),
                        Value::Number(number) => number.as_i64().map(ExtensionValue::Integer),
                        _ => None,
                    };
                    match value {
                        Some(value) => fields.extensions.insert(name, value).is_none(),
                        None => false,
                    }
                }
            };
        }
        Ok(usual.then_some(fields))
    }
}

/// Reads a string attribute into an empty slot; false for another type or a second one.
fn string<'de, A: MapAccess<'de>>(
    map: &mut A,
    slot: &mut Option<String>,
) -> Result<bool, A::Error> {
    Ok(match map.next_value::<Value>()? {
        Value::String(text) if slot.is_none() => {
            *slot = Some(text);
            true
        }
        _ => false,
    })
}
