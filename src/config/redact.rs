//! Printing a configuration without its secrets: every key that names a secret is replaced,
//! and every URL goes through the one URL-redaction helper
//! ([`sched_relay_transport::redact`]: userinfo, query and fragment masked).

/// Keys whose values are secrets wherever they appear.
const SECRET_KEYS: &[&str] = &[
    "password",
    "token",
    "secret",
    "hmac_key",
    "private_key",
    "sasl_password",
];

pub(super) fn redact(value: &mut toml::Value) {
    match value {
        toml::Value::Table(table) => {
            for (key, value) in table.iter_mut() {
                let secret = SECRET_KEYS
                    .iter()
                    .any(|s| key == s || key.ends_with(&format!("_{s}")));
                if secret && !key.ends_with("_file") {
                    *value = toml::Value::String("<redacted>".into());
                } else if key == "headers"
                    && let toml::Value::Table(headers) = value
                {
                    // A webhook's custom headers are often its credentials (X-Api-Key).
                    for (_, header) in headers.iter_mut() {
                        *header = toml::Value::String("<redacted>".into());
                    }
                } else {
                    redact(value);
                }
            }
        }
        toml::Value::Array(items) => items.iter_mut().for_each(redact),
        toml::Value::String(text) => {
            if let std::borrow::Cow::Owned(redacted) = sched_relay_transport::redact::text(text) {
                *text = redacted;
            }
        }
        _ => {}
    }
}
