//! The webhook's TLS client settings, shared by deliveries (through reqwest) and the health
//! check's own handshake, so both trust, and present, the same.

use crate::WebhookSinkConfig;

/// The TLS client settings of deliveries and health checks: the platform's trust store (as
/// reqwest uses it), plus the PEM certificates of `ca_file`, the client certificate for
/// servers that require one, HTTP/1.1 only.
pub(crate) fn client_config(
    config: &WebhookSinkConfig,
) -> Result<std::sync::Arc<rustls::ClientConfig>, String> {
    use sched_relay_transport::tls;
    let provider = rustls::crypto::CryptoProvider::get_default()
        .cloned()
        .unwrap_or_else(|| std::sync::Arc::new(rustls::crypto::ring::default_provider()));
    let verifier = match &config.ca_file {
        None => rustls_platform_verifier::Verifier::new(provider.clone()),
        Some(path) => rustls_platform_verifier::Verifier::new_with_extra_roots(
            tls::read_certificates(path, "ca_file")?,
            provider.clone(),
        ),
    }
    .map_err(|e| format!("cannot load the TLS trust store: {e}"))?;
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS settings: {e}"))?
        .dangerous()
        .with_custom_certificate_verifier(std::sync::Arc::new(verifier));
    let identity = tls::read_client_identity(
        config.client_cert_file.as_deref(),
        config.client_key_file.as_deref(),
    )?;
    let mut config = match identity {
        Some((chain, key)) => builder
            .with_client_auth_cert(chain, key)
            .map_err(|e| format!("client_cert_file and client_key_file: {e}"))?,
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(std::sync::Arc::new(config))
}
