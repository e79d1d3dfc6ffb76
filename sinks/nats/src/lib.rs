//! The NATS sink: publishes each CloudEvent on a subject built from a template, through core
//! NATS (no acknowledgement: a message nobody is subscribed to is gone) or JetStream (the
//! stream acknowledges each message; `Nats-Msg-Id` is the CloudEvents source and id, so a
//! retried batch is de-duplicated by the stream and another VM's event is not). Headers follow the CloudEvents NATS binding (`ce-id`, ...).
//!
//! The configuration always compiles; the client needs the `client` feature.

use std::path::PathBuf;
use std::time::Duration;

use sched_relay_transport::binding::{ContentMode, unknown_template_fields};
use sched_relay_transport::secret::Secret;
use serde::{Deserialize, Serialize};

#[cfg(feature = "client")]
mod sink;
#[cfg(feature = "client")]
pub mod source;
pub mod stream;
#[cfg(feature = "client")]
pub use sink::{Connected, NatsSink, Outdated, connect, connect_error, connect_watched};
#[cfg(feature = "testing")]
pub mod testing;

/// `kind = "nats"`.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct NatsSinkConfig {
    /// Server URL, or several separated by commas: `nats://127.0.0.1:4222`, `tls://host:4222`.
    pub url: String,
    /// Publish through JetStream and wait for the stream's acknowledgement (recommended).
    /// A stream must capture the subjects (`nats stream add --subjects 'scheduledevents.>'`).
    #[serde(default)]
    pub jetstream: bool,
    /// Subject template: `{vmname}`, `{transition}`, `{eventtype}`, `{eventid}`, `{type}`.
    #[serde(default = "default_subject")]
    pub subject: String,
    /// `binary` (ce- headers, data as payload) or `structured` (the whole event as JSON).
    #[serde(default)]
    pub content_mode: ContentMode,
    /// A `.creds` file (JWT + NKey), as issued by `nsc`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials_file: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<Secret>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_file: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password: Option<Secret>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password_file: Option<PathBuf>,
    /// Require TLS even for `nats://` URLs (implied by `ca_file` and `client_cert_file`).
    #[serde(default)]
    pub tls: bool,
    /// A PEM file of CA certificates to trust instead of the system's (async-nats loads the
    /// system's roots only when no CA is given).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<PathBuf>,
    /// A PEM certificate (with its chain) to present to servers that require client
    /// certificates (mutual TLS); with `client_key_file`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_cert_file: Option<PathBuf>,
    /// The PEM private key of `client_cert_file`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_key_file: Option<PathBuf>,
    /// Connect, flush and acknowledgement timeout.
    #[serde(default = "default_timeout", with = "humantime_serde")]
    pub timeout: Duration,
    /// Where replies to this client go (JetStream acknowledgements, consumer deliveries,
    /// API answers): `<inbox_prefix>.<unique>`. The default `_INBOX` is shared by every
    /// client; with per-VM permissions give each VM its own (`_INBOX_web-1`) and allow it to
    /// subscribe only there, or any VM could read other clients' replies
    /// (`deploy/nats/per-vm-permissions.conf`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inbox_prefix: Option<String>,
}

fn default_subject() -> String {
    "scheduledevents.{vmname}.{transition}".into()
}

fn default_timeout() -> Duration {
    Duration::from_secs(5)
}

impl NatsSinkConfig {
    /// The files a connection reads its credentials and certificates from: a connection
    /// made before one of them changed is made again ([`sched_relay_transport::files`]).
    pub fn watched_files(&self) -> Vec<&std::path::Path> {
        sched_relay_transport::files::given([
            &self.credentials_file,
            &self.token_file,
            &self.password_file,
            &self.ca_file,
            &self.client_cert_file,
            &self.client_key_file,
        ])
    }

    /// Problems, as (key, message), without touching the network.
    pub fn validate(&self) -> Vec<(&'static str, String)> {
        let mut problems = Vec::new();
        for server in self.url.split(',') {
            match url::Url::parse(server.trim()) {
                Ok(url) if matches!(url.scheme(), "nats" | "tls") && url.has_host() => {}
                // This build has no WebSocket transport: async-nats would dial a ws:// or
                // wss:// server as plain TCP, without TLS whatever ca_file or tls say.
                Ok(url) if matches!(url.scheme(), "ws" | "wss") => problems.push((
                    "url",
                    format!(
                        "{server:?}: WebSocket URLs are not supported (they would connect without TLS); use nats:// or tls://"
                    ),
                )),
                _ => problems.push((
                    "url",
                    format!(
                        "{server:?} is not a NATS URL; expected e.g. \"nats://127.0.0.1:4222\""
                    ),
                )),
            }
        }
        let unknown = unknown_template_fields(&self.subject);
        if !unknown.is_empty() || self.subject.is_empty() {
            problems.push((
                "subject",
                format!("{:?}: unknown placeholders {unknown:?}", self.subject),
            ));
        }
        if self.token.is_some() && self.token_file.is_some() {
            problems.push(("token", "set token or token_file, not both".into()));
        }
        if self.password.is_some() && self.password_file.is_some() {
            problems.push(("password", "set password or password_file, not both".into()));
        }
        if (self.password.is_some() || self.password_file.is_some()) && self.user.is_none() {
            problems.push(("user", "a password needs a user".into()));
        }
        if self.timeout.is_zero() {
            problems.push(("timeout", "must be more than 0s".into()));
        }
        if let Some(prefix) = &self.inbox_prefix
            && (prefix.split('.').any(|token| {
                token.is_empty()
                    || token
                        .chars()
                        .any(|c| c.is_whitespace() || c == '*' || c == '>')
            }))
        {
            problems.push((
                "inbox_prefix",
                format!(
                    "{prefix:?} is not a subject prefix; expected tokens without spaces or wildcards, e.g. \"_INBOX_web-1\""
                ),
            ));
        }
        // TLS is implied by the files themselves (see `connect`).
        problems.extend(sched_relay_transport::tls::check(
            None,
            self.ca_file.as_deref(),
            self.client_cert_file.as_deref(),
            self.client_key_file.as_deref(),
        ));
        problems
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(text: &str) -> NatsSinkConfig {
        toml::from_str(text).unwrap()
    }

    #[test]
    fn an_inbox_prefix_with_a_wildcard_space_or_empty_token_is_refused() {
        for bad in ["", "_INBOX.>", "_INBOX_*", "_INBOX web", "_INBOX.", ".x"] {
            let problems = config(&format!(
                "url = \"nats://127.0.0.1:4222\"\ninbox_prefix = {bad:?}\n"
            ))
            .validate();
            assert!(
                problems.iter().any(|(key, _)| *key == "inbox_prefix"),
                "{bad:?}: {problems:?}"
            );
        }
        let good = config("url = \"nats://127.0.0.1:4222\"\ninbox_prefix = \"_INBOX_web-1\"\n");
        assert!(good.validate().is_empty(), "{:?}", good.validate());
    }

    #[test]
    fn defaults_use_the_documented_subject_and_binary_mode() {
        let config = config("url = \"nats://127.0.0.1:4222\"");
        assert_eq!(config.subject, "scheduledevents.{vmname}.{transition}");
        assert_eq!(config.content_mode, ContentMode::Binary);
        assert!(!config.jetstream);
        assert!(config.validate().is_empty());
    }

    #[test]
    fn bad_settings_are_reported_by_key() {
        let config = config(
            "url = \"http://x\"\nsubject = \"a.{vm}\"\ntoken = \"t\"\ntoken_file = \"/t\"\npassword = \"p\"",
        );
        let keys: Vec<&str> = config.validate().iter().map(|(k, _)| *k).collect();
        assert_eq!(keys, ["url", "subject", "token", "user"]);
    }

    #[test]
    fn websocket_urls_are_refused_since_they_would_connect_without_tls() {
        for url in ["wss://nats.example:443", "ws://127.0.0.1:8080"] {
            let problems = config(&format!("url = \"{url}\"\ntls = true")).validate();
            assert_eq!(problems.len(), 1, "{problems:?}");
            assert!(problems[0].1.contains("without TLS"), "{problems:?}");
        }
    }
}
