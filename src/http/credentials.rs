//! The listener's credentials, read again when their files change: its TLS certificate and
//! key (a renewed certificate is served to new connections) and the bearer token
//! `POST /approvals` requires.

use std::sync::Arc;

use sched_relay_transport::files::Stamp;

/// The listener's TLS, built anew for the next connection once `tls_cert_file` or
/// `tls_key_file` changed: a renewed certificate (certbot, cert-manager, the Key Vault
/// extension) is served to new connections without a restart. A pair that cannot be loaded
/// then (half written, say) is logged, and the last good one is served until the files
/// change again.
pub struct ListenerTls {
    config: crate::telemetry::TelemetryConfig,
    current: std::sync::Mutex<(Stamp, tokio_rustls::TlsAcceptor)>,
}

impl ListenerTls {
    /// The listener's TLS as the configuration has it now: None without TLS; with files
    /// that cannot be loaded, one that refuses every handshake until they change.
    pub fn load(config: &crate::telemetry::TelemetryConfig) -> Option<Arc<ListenerTls>> {
        // Stamped before the files are read: a change while reading shows as a change.
        let files = ListenerTls::files(config);
        let acceptor = match tls_acceptor(config) {
            Ok(tls) => tls,
            Err(error) => {
                tracing::error!(error = %error, "Cannot load the listener's TLS certificate; it refuses every connection until the files change");
                Some(tokio_rustls::TlsAcceptor::from(Arc::new(refuse_everyone())))
            }
        };
        acceptor.map(|acceptor| {
            Arc::new(ListenerTls {
                config: config.clone(),
                current: std::sync::Mutex::new((files, acceptor)),
            })
        })
    }

    fn files(config: &crate::telemetry::TelemetryConfig) -> Stamp {
        Stamp::of(sched_relay_transport::files::given([
            &config.tls_cert_file,
            &config.tls_key_file,
        ]))
    }

    /// The acceptor for the next connection (a `stat` of the two files).
    pub fn acceptor(&self) -> tokio_rustls::TlsAcceptor {
        let now = ListenerTls::files(&self.config);
        let mut current = self.current.lock().unwrap_or_else(|p| p.into_inner());
        if now != current.0 {
            current.0 = now;
            match tls_acceptor(&self.config) {
                Ok(Some(acceptor)) => {
                    tracing::info!(
                        "The listener's TLS certificate or key changed; new connections get the new one"
                    );
                    current.1 = acceptor;
                }
                Ok(None) => {}
                Err(error) => {
                    tracing::warn!(error = %error, "The listener's TLS certificate or key changed but cannot be loaded; serving the last good one until the files change again");
                }
            }
        }
        current.1.clone()
    }
}

/// `approvals.http.token`, or `token_file` read again when it changes (a rotated token is
/// required from the next request on). A file unreadable for a while keeps the last token.
pub struct BearerToken {
    file: Option<std::path::PathBuf>,
    current: std::sync::Mutex<(Stamp, String)>,
}

impl BearerToken {
    /// The token given inline (`file` None) or read from `file` at start. With a file, the
    /// first request reads it again (what the stamp would say about the read at start is not
    /// known: a rotation just after it must not go unseen).
    pub fn new(token: String, file: Option<std::path::PathBuf>) -> BearerToken {
        let stamp = Stamp::default();
        BearerToken {
            file,
            current: std::sync::Mutex::new((stamp, token)),
        }
    }

    /// The token a request must carry now.
    pub fn current(&self) -> String {
        let mut current = self.current.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(file) = &self.file {
            let now = Stamp::of([file.as_path()]);
            if now != current.0 {
                current.0 = now;
                match std::fs::read_to_string(file) {
                    Ok(text) if !text.trim().is_empty() => {
                        current.1 = text.trim_end_matches(['\n', '\r']).to_owned();
                        tracing::info!(file = %file.display(), "approvals.http.token_file changed; the new token is required from now on");
                    }
                    Ok(_) => {
                        tracing::warn!(file = %file.display(), "approvals.http.token_file is empty; the last token stays required");
                    }
                    Err(error) => {
                        tracing::warn!(file = %file.display(), error = %error, "approvals.http.token_file cannot be read; the last token stays required");
                    }
                }
            }
        }
        current.1.clone()
    }
}

/// A TLS configuration with no certificate: every handshake fails.
pub(super) fn refuse_everyone() -> rustls::ServerConfig {
    #[derive(Debug)]
    struct NoCertificate;
    impl rustls::server::ResolvesServerCert for NoCertificate {
        fn resolve(
            &self,
            _: rustls::server::ClientHello<'_>,
        ) -> Option<Arc<rustls::sign::CertifiedKey>> {
            None
        }
    }
    rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .expect("ring supports the default TLS versions")
        .with_no_client_auth()
        .with_cert_resolver(Arc::new(NoCertificate))
}

/// The listener's TLS from `telemetry.tls_cert_file` and `tls_key_file` (PEM; rustls with
/// ring, the one TLS stack): None when neither is set; an error that says which file and
/// what is wrong with it.
pub fn tls_acceptor(
    config: &crate::telemetry::TelemetryConfig,
) -> Result<Option<tokio_rustls::TlsAcceptor>, String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let (cert_file, key_file) = match (&config.tls_cert_file, &config.tls_key_file) {
        (None, None) => return Ok(None),
        (Some(cert), Some(key)) => (cert, key),
        _ => {
            return Err(
                "set both telemetry.tls_cert_file and telemetry.tls_key_file, or neither".into(),
            );
        }
    };
    let pem = std::fs::read(cert_file)
        .map_err(|e| format!("tls_cert_file {}: {e}", cert_file.display()))?;
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<_, _>>()
        .map_err(|e| {
            format!(
                "tls_cert_file {}: not PEM certificates: {e}",
                cert_file.display()
            )
        })?;
    if chain.is_empty() {
        return Err(format!(
            "tls_cert_file {}: holds no PEM certificate (expected -----BEGIN CERTIFICATE-----)",
            cert_file.display()
        ));
    }
    let pem =
        std::fs::read(key_file).map_err(|e| format!("tls_key_file {}: {e}", key_file.display()))?;
    let key = PrivateKeyDer::from_pem_slice(&pem).map_err(|e| {
        format!(
            "tls_key_file {}: no PEM private key (PKCS#8, PKCS#1 or SEC1): {e}",
            key_file.display()
        )
    })?;
    let server = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| format!("TLS: {e}"))?
    .with_no_client_auth()
    .with_single_cert(chain, key)
    .map_err(|e| {
        format!(
            "tls_cert_file {} and tls_key_file {} do not make a usable pair: {e}",
            cert_file.display(),
            key_file.display()
        )
    })?;
    Ok(Some(tokio_rustls::TlsAcceptor::from(Arc::new(server))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rotated_token_file_is_required_from_the_next_request_and_a_missing_one_keeps_the_last() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("approval-token");
        std::fs::write(&file, "first-token\n").unwrap();
        let token = BearerToken::new("first-token".into(), Some(file.clone()));
        assert_eq!(token.current(), "first-token");
        let staged = dir.path().join("staged");
        std::fs::write(&staged, "second-token\n").unwrap();
        std::fs::rename(&staged, &file).unwrap();
        assert_eq!(token.current(), "second-token");
        // Gone for a while, or empty: the last token stays required (never none).
        std::fs::remove_file(&file).unwrap();
        assert_eq!(token.current(), "second-token");
        std::fs::write(&file, "").unwrap();
        assert_eq!(token.current(), "second-token");
        std::fs::write(&file, "third-token").unwrap();
        assert_eq!(token.current(), "third-token");
        // Given inline: never changes.
        assert_eq!(BearerToken::new("inline".into(), None).current(), "inline");
    }
}
