//! Printing a configuration without its secrets: every key that names a secret, and the
//! password of every URL, is replaced.

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
                } else {
                    redact(value);
                }
            }
        }
        toml::Value::Array(items) => items.iter_mut().for_each(redact),
        toml::Value::String(text) => {
            if let Ok(mut url) = url::Url::parse(text)
                && url.password().is_some()
                && url.set_password(Some("redacted")).is_ok()
            {
                *text = url.to_string();
            }
        }
        _ => {}
    }
}
