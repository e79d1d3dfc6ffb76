//! Loads the `[[approvals.keys]]` of the configuration into verifying keys: secrets inline,
//! from `${ENV}` or from files. What a key is and how it verifies lives in
//! `sched_relay_core::approval::verify`; this is the I/O around it.

use std::collections::HashMap;

use sched_relay_core::approval::{Key, SigningKey};
use sched_relay_transport::secret;

use super::config::{ApprovalsConfig, KeyAlgorithm, KeyConfig};

/// Reads a configured key (its secret or public key, inline, by env or from a file).
pub fn load(config: &KeyConfig) -> Result<Key, String> {
    Key::check_id(&config.id)?;
    match config.algorithm {
        KeyAlgorithm::HmacSha256 => {
            if config.public_key.is_some() || config.public_key_file.is_some() {
                return Err(
                    "an hmac-sha256 key takes secret or secret_file, not public_key".into(),
                );
            }
            let secret = secret::resolve(
                config.secret.as_ref(),
                config.secret_file.as_deref(),
                "secret",
            )?
            .ok_or("an hmac-sha256 key needs secret or secret_file")?;
            Key::hmac(&secret)
        }
        KeyAlgorithm::Ed25519 => {
            if config.secret.is_some() || config.secret_file.is_some() {
                return Err("an ed25519 key takes public_key or public_key_file: the VM never holds the private key".into());
            }
            let text = match (&config.public_key, &config.public_key_file) {
                (Some(_), Some(_)) => {
                    return Err("set public_key or public_key_file, not both".into());
                }
                (Some(text), None) => text.clone(),
                (None, Some(path)) => std::fs::read_to_string(path)
                    .map_err(|e| format!("cannot read public_key_file {}: {e}", path.display()))?,
                (None, None) => {
                    return Err("an ed25519 key needs public_key or public_key_file".into());
                }
            };
            Key::ed25519(&text)
        }
    }
}

/// Every configured key by id; `ApprovalsConfig::validate` has already vetted them.
pub fn load_all(config: &ApprovalsConfig) -> Result<HashMap<String, Key>, String> {
    config
        .keys
        .iter()
        .map(|key| Ok((key.id.clone(), load(key)?)))
        .collect()
}

/// Writes a new Ed25519 signing key to `out` (which must not exist yet; mode 0600) and
/// returns its public key, for the agents' `[[approvals.keys]]`.
pub fn write_new(out: &std::path::Path) -> Result<String, String> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let text = SigningKey::generate_ed25519()?;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(out)
        .map_err(|e| {
            format!(
                "cannot create {} (it must not exist yet): {e}",
                out.display()
            )
        })?;
    writeln!(file, "{text}").map_err(|e| e.to_string())?;
    let key = SigningKey::parse(&text)?;
    Ok(key.public_key().expect("an Ed25519 key has a public key"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configured_keys_are_checked_with_clear_messages() {
        let key = |text: &str| load(&toml::from_str::<KeyConfig>(text).unwrap());
        assert!(
            key("id = \"k\"\nalgorithm = \"hmac-sha256\"\nsecret = \"short\"")
                .unwrap_err()
                .contains("at least 16 bytes")
        );
        assert!(
            key("id = \"k\"\nalgorithm = \"ed25519\"\nsecret = \"0123456789abcdef\"")
                .unwrap_err()
                .contains("public_key")
        );
        assert!(
            key("id = \"k\"\nalgorithm = \"ed25519\"\npublic_key = \"AAAA\"")
                .unwrap_err()
                .contains("32 bytes")
        );
        assert!(
            key("id = \"k\"\nalgorithm = \"hmac-sha256\"\nsecret = \"0123456789abcdef\"").is_ok()
        );
    }
}
