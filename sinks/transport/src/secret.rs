//! Secrets in sink configurations (passwords, tokens, HMAC keys): given inline, as
//! `${ENV_VAR}`, or in a file (`*_file` keys), and never printed: `Debug` and `Serialize` show
//! `<redacted>`.

use std::path::Path;

use serde::{Deserialize, Serialize};

/// A secret value as written in the configuration (possibly `${ENV_VAR}`).
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }

    /// The value, with a whole-value `${ENV_VAR}` replaced by that variable.
    pub fn expose(&self) -> Result<String, String> {
        match self
            .0
            .strip_prefix("${")
            .and_then(|rest| rest.strip_suffix('}'))
        {
            Some(name) => {
                std::env::var(name).map_err(|_| format!("environment variable {name} is not set"))
            }
            None => Ok(self.0.clone()),
        }
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

impl Serialize for Secret {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str("<redacted>")
    }
}

/// Resolves a secret given inline (`key`) or by file (`key_file`); at most one may be set.
/// A file's trailing newline is dropped. `what` names the key for error messages.
pub fn resolve(
    inline: Option<&Secret>,
    file: Option<&Path>,
    what: &str,
) -> Result<Option<String>, String> {
    match (inline, file) {
        (Some(_), Some(_)) => Err(format!("set {what} or {what}_file, not both")),
        (Some(secret), None) => secret
            .expose()
            .map(Some)
            .map_err(|e| format!("{what}: {e}")),
        (None, Some(path)) => std::fs::read_to_string(path)
            .map(|text| Some(text.trim_end_matches(['\n', '\r']).to_owned()))
            .map_err(|e| format!("{what}_file: cannot read {}: {e}", path.display())),
        (None, None) => Ok(None),
    }
}

/// As [`resolve`], when a connection is about to be made with the secret: a file that cannot
/// be read now (a rotation replacing it, a volume not mounted yet) fails the connection
/// retriably, naming the file, so the events wait in the outbox rather than being
/// dead-lettered; only a configuration that cannot work is permanent.
pub fn resolve_for_connection(
    inline: Option<&Secret>,
    file: Option<&Path>,
    what: &str,
) -> Result<Option<String>, crate::SinkError> {
    resolve(inline, file, what).map_err(|error| match (inline, file) {
        (None, Some(_)) => crate::SinkError::Retriable(error),
        _ => crate::SinkError::Permanent(error),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_never_print_and_resolve_from_env_or_file() {
        let secret = Secret::new("hunter2");
        assert_eq!(format!("{secret:?}"), "<redacted>");
        assert_eq!(serde_json::to_string(&secret).unwrap(), "\"<redacted>\"");

        unsafe { std::env::set_var("SINK_CORE_TEST_SECRET", "from-env") };
        let from_env = Secret::new("${SINK_CORE_TEST_SECRET}");
        assert_eq!(
            resolve(Some(&from_env), None, "password")
                .unwrap()
                .as_deref(),
            Some("from-env")
        );
        let missing = Secret::new("${SINK_CORE_TEST_UNSET}");
        assert!(
            resolve(Some(&missing), None, "password")
                .unwrap_err()
                .contains("SINK_CORE_TEST_UNSET")
        );

        let dir = std::env::temp_dir().join(format!(
            "sched-relay-transport-secret-{}",
            std::process::id()
        ));
        std::fs::write(&dir, "from-file\n").unwrap();
        assert_eq!(
            resolve(None, Some(&dir), "password").unwrap().as_deref(),
            Some("from-file")
        );
        assert!(
            resolve(Some(&secret), Some(&dir), "password")
                .unwrap_err()
                .contains("not both")
        );
        std::fs::remove_file(dir).unwrap();
    }
}
