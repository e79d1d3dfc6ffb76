//! What exactly is signed, and how a signature is checked.
//!
//! The signed text is the canonical form of a request: these lines joined by `\n` (no
//! trailing newline), each taken from the request as sent:
//!
//! ```text
//! sched-relay-approval-v1
//! <id>
//! <source>
//! <time as whole Unix seconds, e.g. 1795260000>
//! <vmname, or an empty line when the request names no VM>
//! <EventId>            one line per StartRequest, in the order of the message
//! ```
//!
//! `signature` is the HMAC-SHA256 (shared secret) or Ed25519 signature of those bytes,
//! base64-encoded; `keyid` names the key. The key, not the message, decides the algorithm,
//! so a message cannot downgrade an Ed25519 key to HMAC.

use base64::Engine;
use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD};
use ed25519_dalek::{Signer, Verifier};
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The first line of the canonical form; a new form gets a new first line.
pub const CANONICAL_VERSION: &str = "sched-relay-approval-v1";

/// The canonical form of a request (see the module documentation).
pub fn canonical(
    id: &str,
    source: &str,
    unix_seconds: i64,
    vm_name: Option<&str>,
    event_ids: &[String],
) -> String {
    let mut text = format!(
        "{CANONICAL_VERSION}\n{id}\n{source}\n{unix_seconds}\n{}",
        vm_name.unwrap_or_default()
    );
    for event_id in event_ids {
        text.push('\n');
        text.push_str(event_id);
    }
    text
}

/// A key the agent trusts, ready to verify.
#[derive(Clone)]
pub enum Key {
    Hmac(Vec<u8>),
    Ed25519(ed25519_dalek::VerifyingKey),
}

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Key::Hmac(_) => f.write_str("Hmac(<redacted>)"),
            Key::Ed25519(key) => write!(f, "Ed25519({})", STANDARD.encode(key.as_bytes())),
        }
    }
}

impl Key {
    /// A shared HMAC-SHA256 secret, as given (UTF-8 text). At least 16 bytes.
    pub fn hmac(secret: &str) -> Result<Key, String> {
        if secret.len() < 16 {
            return Err(
                "the HMAC secret must be at least 16 bytes (32 random bytes recommended)".into(),
            );
        }
        Ok(Key::Hmac(secret.as_bytes().to_vec()))
    }

    /// An Ed25519 public key: base64 of the raw 32 bytes (surrounding white space ignored).
    pub fn ed25519(public_key: &str) -> Result<Key, String> {
        Ok(Key::Ed25519(parse_public_key(public_key)?))
    }

    /// Checks a key id as configured: non-empty, no white space (it is one line of a header).
    pub fn check_id(id: &str) -> Result<(), String> {
        if id.is_empty() || id.contains(char::is_whitespace) {
            return Err(format!("id {id:?} must be non-empty without spaces"));
        }
        Ok(())
    }

    /// Whether `signature` (raw bytes) signs `message` with this key. Constant-time for HMAC.
    pub fn verify(&self, message: &[u8], signature: &[u8]) -> bool {
        match self {
            Key::Hmac(secret) => {
                let mut mac =
                    Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes keys of any length");
                mac.update(message);
                mac.verify_slice(signature).is_ok()
            }
            Key::Ed25519(key) => ed25519_dalek::Signature::from_slice(signature)
                .is_ok_and(|signature| key.verify(message, &signature).is_ok()),
        }
    }
}

/// A key that can sign: what an orchestrator (and `sched-relay sign-approval`) holds.
pub enum SigningKey {
    Hmac(Vec<u8>),
    Ed25519(Box<ed25519_dalek::SigningKey>),
}

impl SigningKey {
    /// Reads a signing key file: `hmac-sha256:<secret>` or `ed25519:<base64 32-byte seed>`
    /// (what `sched-relay gen-approval-key` writes).
    pub fn parse(text: &str) -> Result<SigningKey, String> {
        let text = text.trim();
        if let Some(secret) = text.strip_prefix("hmac-sha256:") {
            if secret.len() < 16 {
                return Err("the HMAC secret must be at least 16 bytes".into());
            }
            return Ok(SigningKey::Hmac(secret.as_bytes().to_vec()));
        }
        if let Some(seed) = text.strip_prefix("ed25519:") {
            let bytes = decode_base64(seed).ok_or("the ed25519 seed is not base64")?;
            let seed: [u8; 32] = bytes
                .try_into()
                .map_err(|_| "the ed25519 seed must be 32 bytes")?;
            return Ok(SigningKey::Ed25519(Box::new(
                ed25519_dalek::SigningKey::from_bytes(&seed),
            )));
        }
        Err("expected \"hmac-sha256:<secret>\" or \"ed25519:<base64 seed>\"".into())
    }

    /// A new random Ed25519 key, as written to a key file.
    pub fn generate_ed25519() -> Result<String, String> {
        let mut seed = [0u8; 32];
        getrandom::fill(&mut seed).map_err(|e| format!("no randomness: {e}"))?;
        Ok(format!("ed25519:{}", STANDARD.encode(seed)))
    }

    /// The public key to put in `[[approvals.keys]]`, for Ed25519 keys.
    pub fn public_key(&self) -> Option<String> {
        match self {
            SigningKey::Hmac(_) => None,
            SigningKey::Ed25519(key) => Some(STANDARD.encode(key.verifying_key().as_bytes())),
        }
    }

    /// The base64 signature of `message`.
    pub fn sign(&self, message: &[u8]) -> String {
        let raw = match self {
            SigningKey::Hmac(secret) => {
                let mut mac =
                    Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes keys of any length");
                mac.update(message);
                mac.finalize().into_bytes().to_vec()
            }
            SigningKey::Ed25519(key) => key.sign(message).to_bytes().to_vec(),
        };
        STANDARD.encode(raw)
    }
}

fn parse_public_key(text: &str) -> Result<ed25519_dalek::VerifyingKey, String> {
    let bytes = decode_base64(text.trim()).ok_or("the public key is not base64")?;
    let bytes: [u8; 32] = bytes
        .try_into()
        .map_err(|_| "the public key must be 32 bytes (base64 of the raw Ed25519 key)")?;
    ed25519_dalek::VerifyingKey::from_bytes(&bytes)
        .map_err(|e| format!("not an Ed25519 public key: {e}"))
}

/// Standard base64, with or without padding.
pub fn decode_base64(text: &str) -> Option<Vec<u8>> {
    STANDARD
        .decode(text)
        .or_else(|_| STANDARD_NO_PAD.decode(text))
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const HMAC_FILE: &str = "hmac-sha256:0123456789abcdef0123456789abcdef";

    fn ids(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    /// The request of the documented examples.
    fn sample() -> String {
        canonical(
            "r1",
            "urn:orch",
            1_795_260_000,
            Some("vm1"),
            &ids(&["A", "B"]),
        )
    }

    #[test]
    fn canonical_form_is_the_documented_lines() {
        let text = sample();
        assert_eq!(
            text,
            "sched-relay-approval-v1\nr1\nurn:orch\n1795260000\nvm1\nA\nB"
        );
        let untargeted = canonical("r1", "urn:orch", 0, None, &ids(&["A"]));
        assert_eq!(untargeted, "sched-relay-approval-v1\nr1\nurn:orch\n0\n\nA");
    }

    /// A fixed vector an orchestrator in another language can check its signer against:
    /// HMAC-SHA256 with the secret "0123456789abcdef0123456789abcdef" over the canonical
    /// form above (printf '%s' ... | openssl dgst -sha256 -hmac ... -binary | base64).
    #[test]
    fn hmac_signature_matches_the_documented_vector() {
        let key = SigningKey::parse(HMAC_FILE).unwrap();
        assert_eq!(
            key.sign(sample().as_bytes()),
            "C5elmhpVtiA9l7p6CcHU6RUwjbrTVem9lJW0u7JaBmc="
        );
    }

    #[test]
    fn hmac_and_ed25519_signatures_verify_only_with_their_key_and_message() {
        let ed = SigningKey::parse(&SigningKey::generate_ed25519().unwrap()).unwrap();
        let ed_public = Key::Ed25519(parse_public_key(&ed.public_key().unwrap()).unwrap());
        let hmac = SigningKey::parse(HMAC_FILE).unwrap();
        let hmac_key = Key::Hmac(b"0123456789abcdef0123456789abcdef".to_vec());
        for (signer, key) in [(&ed, &ed_public), (&hmac, &hmac_key)] {
            let signature = decode_base64(&signer.sign(b"message")).unwrap();
            assert!(key.verify(b"message", &signature));
            assert!(!key.verify(b"messagE", &signature));
            let mut flipped = signature.clone();
            flipped[0] ^= 1;
            assert!(!key.verify(b"message", &flipped));
        }
        // Another key of the same kind does not verify.
        let other = SigningKey::parse(&SigningKey::generate_ed25519().unwrap()).unwrap();
        let signature = decode_base64(&other.sign(b"message")).unwrap();
        assert!(!ed_public.verify(b"message", &signature));
        // An HMAC key never accepts an Ed25519 signature and the other way round.
        assert!(!hmac_key.verify(b"message", &signature));
    }
}
