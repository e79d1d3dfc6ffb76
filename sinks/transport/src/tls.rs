//! The TLS files every broker connection may name: `ca_file` (PEM certificates to trust
//! besides the system's) and, for servers that require client certificates (mutual TLS),
//! `client_cert_file` with `client_key_file`. Checked by `check-config` before any
//! connection is tried, so a wrong path or a key in the certificate's place is an error naming
//! the key and the file, not a handshake failure an hour later.

use std::path::Path;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

/// The PEM certificates of `path` (`what` names the setting in errors).
pub fn read_certificates(path: &Path, what: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{what} {}: {e}", path.display()))?;
    let certificates = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        // The parser's error quotes the offending line: never shown (a key pasted into the
        // wrong file would be printed whole).
        .map_err(|_| format!("{what} {}: malformed PEM (expected -----BEGIN CERTIFICATE----- blocks, one per line group)", path.display()))?;
    if certificates.is_empty() {
        return Err(format!(
            "{what} {}: holds no PEM certificate (expected -----BEGIN CERTIFICATE-----)",
            path.display()
        ));
    }
    Ok(certificates)
}

/// The PEM private key of `path` (PKCS#8, PKCS#1 or SEC1).
pub fn read_private_key(path: &Path, what: &str) -> Result<PrivateKeyDer<'static>, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{what} {}: {e}", path.display()))?;
    // The parser's error quotes the offending line, which for a key collapsed onto one line
    // is the key itself: only fixed texts leave this function.
    if bytes
        .windows(b"ENCRYPTED PRIVATE KEY".len())
        .any(|w| w == b"ENCRYPTED PRIVATE KEY")
    {
        return Err(format!(
            "{what} {}: the key is encrypted; give it unencrypted (mode 0600), there is no key password setting",
            path.display()
        ));
    }
    PrivateKeyDer::from_pem_slice(&bytes).map_err(|_| {
        format!(
            "{what} {}: holds no PEM private key, or a malformed one (expected -----BEGIN PRIVATE KEY-----, RSA PRIVATE KEY or EC PRIVATE KEY, on lines of their own)",
            path.display()
        )
    })
}

/// Whether `chain` and `key` make a usable client identity (the key is the certificate's).
fn usable_pair(
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> Result<(), String> {
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_client_auth_cert(chain, key)
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// A client certificate chain and its key, when both are set.
pub type ClientIdentity = (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>);

/// Reads `client_cert_file` and `client_key_file`: `None` when neither is set.
pub fn read_client_identity(
    cert: Option<&Path>,
    key: Option<&Path>,
) -> Result<Option<ClientIdentity>, String> {
    match (cert, key) {
        (None, None) => Ok(None),
        (Some(cert), Some(key)) => Ok(Some((
            read_certificates(cert, "client_cert_file")?,
            read_private_key(key, "client_key_file")?,
        ))),
        (Some(_), None) => Err("client_cert_file needs client_key_file (its private key)".into()),
        (None, Some(_)) => Err("client_key_file needs client_cert_file".into()),
    }
}

/// Problems with the TLS settings of one connection, as (key, message), for `validate`:
/// each file (see [`check_files`]), and, when `tls_off` says how to turn TLS on for a
/// connection that would not use it, a CA or client certificate set anyway.
pub fn check(
    tls_off: Option<&str>,
    ca_file: Option<&Path>,
    cert: Option<&Path>,
    key: Option<&Path>,
) -> Vec<(&'static str, String)> {
    let mut problems: Vec<_> = tls_off
        .and_then(|how| check_tls_is_on(false, how, ca_file, cert))
        .into_iter()
        .collect();
    problems.extend(check_files(ca_file, cert, key));
    problems
}

/// Problems with the TLS files of one connection, as (key, message).
fn check_files(
    ca_file: Option<&Path>,
    cert: Option<&Path>,
    key: Option<&Path>,
) -> Vec<(&'static str, String)> {
    let mut problems = Vec::new();
    if let Some(ca) = ca_file
        && let Err(error) = read_certificates(ca, "ca_file")
    {
        problems.push(("ca_file", error));
    }
    match (cert, key) {
        (Some(cert_path), Some(key_path)) => {
            let chain = read_certificates(cert_path, "client_cert_file");
            let key = read_private_key(key_path, "client_key_file");
            match (chain, key) {
                (Ok(chain), Ok(key)) => {
                    if let Err(error) = usable_pair(chain, key) {
                        problems.push((
                            "client_key_file",
                            format!(
                                "{} and {} do not make a usable pair (is the key the certificate's?): {error}",
                                key_path.display(),
                                cert_path.display()
                            ),
                        ));
                    }
                }
                (chain, key) => {
                    if let Err(error) = chain {
                        problems.push(("client_cert_file", error));
                    }
                    if let Err(error) = key {
                        problems.push(("client_key_file", error));
                    }
                }
            }
        }
        (Some(_), None) => problems.push((
            "client_key_file",
            "client_cert_file needs client_key_file (its private key)".into(),
        )),
        (None, Some(_)) => problems.push((
            "client_cert_file",
            "client_key_file needs client_cert_file".into(),
        )),
        (None, None) => {}
    }
    problems
}

/// What TLS refused, when `error` or an error it wraps (an I/O error included) is a rustls
/// error: the server's certificate (an unknown CA, another host name, expired), or ours (the
/// server's alert). `None` for anything else. Every client but librdkafka (OpenSSL) uses
/// rustls, so the sinks classify a TLS failure by this type, never by the message text.
pub fn failure(error: &(dyn std::error::Error + 'static)) -> Option<String> {
    if let Some(tls) = error.downcast_ref::<rustls::Error>() {
        return Some(describe(tls));
    }
    // An I/O error's `source()` skips the error it wraps (and an I/O error can wrap another
    // one: hyper's connectors do), so the wrapped one is searched as well.
    if let Some(inner) = error
        .downcast_ref::<std::io::Error>()
        .and_then(|io| io.get_ref())
        && let Some(found) = failure(inner)
    {
        return Some(found);
    }
    error.source().and_then(failure)
}

fn describe(error: &rustls::Error) -> String {
    match error {
        rustls::Error::InvalidCertificate(_) => format!(
            "TLS failed: {error} (the server's certificate is not trusted: check ca_file, and that the certificate names the host of the URL)"
        ),
        rustls::Error::AlertReceived(_) => format!(
            "TLS failed: {error} (the server refused the handshake: if it requires client certificates, set client_cert_file and client_key_file to one its CA signed)"
        ),
        other => format!("TLS failed: {other}"),
    }
}

/// A TLS file set on a connection that would not use TLS (`how` says how to turn it on):
/// refused, so nobody believes a plain connection is verified.
fn check_tls_is_on(
    on: bool,
    how: &str,
    ca_file: Option<&Path>,
    cert: Option<&Path>,
) -> Option<(&'static str, String)> {
    let key = match (ca_file, cert) {
        _ if on => return None,
        (Some(_), _) => "ca_file",
        (None, Some(_)) => "client_cert_file",
        (None, None) => return None,
    };
    Some((
        key,
        format!("is set, but the connection would not use TLS: {how}"),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A self-signed certificate and its key (PEM), made now.
    fn pair() -> (String, String) {
        let key = rcgen::KeyPair::generate().unwrap();
        let certificate = rcgen::CertificateParams::new(vec!["client".to_owned()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        (certificate.pem(), key.serialize_pem())
    }

    #[test]
    fn good_files_pass_and_each_bad_one_is_named_with_its_key() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key, junk) = (
            dir.path().join("c.pem"),
            dir.path().join("k.pem"),
            dir.path().join("junk"),
        );
        let (certificate, private_key) = pair();
        std::fs::write(&cert, &certificate).unwrap();
        std::fs::write(&key, &private_key).unwrap();
        std::fs::write(&junk, "not pem").unwrap();
        assert!(check_files(Some(&cert), Some(&cert), Some(&key)).is_empty());
        assert!(
            read_client_identity(Some(&cert), Some(&key))
                .unwrap()
                .is_some()
        );

        let missing = dir.path().join("missing.pem");
        let problems = check_files(Some(&missing), Some(&key), Some(&cert));
        let keys: Vec<_> = problems.iter().map(|(k, _)| *k).collect();
        assert_eq!(keys, ["ca_file", "client_cert_file", "client_key_file"]);
        assert!(problems[0].1.contains("missing.pem"), "{problems:?}");
        assert!(problems[1].1.contains("no PEM certificate"), "{problems:?}");
        assert!(problems[2].1.contains("no PEM private key"), "{problems:?}");
        assert_eq!(check_files(Some(&junk), None, None)[0].0, "ca_file");
    }

    #[test]
    fn a_key_that_is_not_the_certificates_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (certificate, _) = pair();
        let (_, other_key) = pair();
        let (cert, key) = (dir.path().join("c.pem"), dir.path().join("k.pem"));
        std::fs::write(&cert, certificate).unwrap();
        std::fs::write(&key, other_key).unwrap();
        let problems = check_files(None, Some(&cert), Some(&key));
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert_eq!(problems[0].0, "client_key_file");
        assert!(problems[0].1.contains("usable pair"), "{problems:?}");
    }

    #[test]
    fn a_malformed_key_file_never_shows_the_key() {
        // A key collapsed onto one line (`echo $KEY > file`), and one with literal \n: the
        // PEM parser's own error would quote the base64 of the key.
        let (_, private_key) = pair();
        let body: String = private_key
            .lines()
            .filter(|l| !l.starts_with("-----"))
            .collect();
        let dir = tempfile::tempdir().unwrap();
        for (name, text) in [
            ("spaces", private_key.replace('\n', " ")),
            ("escapes", private_key.replace('\n', "\\n")),
        ] {
            let path = dir.path().join(name);
            std::fs::write(&path, &text).unwrap();
            let error = read_private_key(&path, "client_key_file").unwrap_err();
            assert!(!error.contains(&body[10..40]), "{name}: {error}");
            for problem in check_files(None, Some(&path), Some(&path)) {
                assert!(!problem.1.contains(&body[10..40]), "{name}: {problem:?}");
                let numbers = problem.1.matches(", ").count();
                assert!(numbers < 10, "{name}: a byte list? {problem:?}");
            }
        }
        let encrypted = dir.path().join("encrypted");
        std::fs::write(
            &encrypted,
            "-----BEGIN ENCRYPTED PRIVATE KEY-----\nMAA=\n-----END ENCRYPTED PRIVATE KEY-----\n",
        )
        .unwrap();
        let error = read_private_key(&encrypted, "client_key_file").unwrap_err();
        assert!(error.contains("encrypted"), "{error}");
    }

    #[test]
    fn a_rustls_error_is_found_however_deep_it_is_wrapped() {
        let refused = || rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer);
        let io = std::io::Error::new(std::io::ErrorKind::InvalidData, refused());
        assert!(failure(&io).unwrap().contains("not trusted"));
        // An I/O error around an I/O error: its source() would skip both.
        let twice = std::io::Error::other(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            refused(),
        ));
        assert!(failure(&twice).unwrap().starts_with("TLS failed"));
        let alert = rustls::Error::AlertReceived(rustls::AlertDescription::CertificateRequired);
        assert!(failure(&alert).unwrap().contains("client_cert_file"));
        assert!(failure(&std::io::Error::other("reset")).is_none());
    }

    #[test]
    fn tls_files_on_a_plain_connection_are_refused() {
        let path = Some(Path::new("/ca.pem"));
        let (key, message) = check_tls_is_on(false, "use amqps://", path, None).unwrap();
        assert_eq!(key, "ca_file");
        assert!(message.contains("use amqps://"), "{message}");
        assert_eq!(
            check_tls_is_on(false, "x", None, path).unwrap().0,
            "client_cert_file"
        );
        assert!(check_tls_is_on(true, "x", path, path).is_none());
        assert!(check_tls_is_on(false, "x", None, None).is_none());
    }

    #[test]
    fn a_client_certificate_without_its_key_or_the_reverse_is_refused() {
        let path = Path::new("/x.pem");
        assert_eq!(check_files(None, Some(path), None)[0].0, "client_key_file");
        assert_eq!(check_files(None, None, Some(path))[0].0, "client_cert_file");
        assert!(read_client_identity(Some(path), None).is_err());
        assert!(read_client_identity(None, None).unwrap().is_none());
    }
}
