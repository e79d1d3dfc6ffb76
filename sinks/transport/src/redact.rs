//! The one URL-redaction helper: every text the agent shows (error messages, health records
//! on `/readyz` and `/events`, log lines, dead-letter reasons, `check-config`) goes through
//! [`text`] so that credentials carried in URLs never leave the process.
//!
//! A URL can carry a secret in three places, and every one is masked wherever a URL appears
//! in the text, also inside a client library's error message:
//! - userinfo: `nats://relay:S3CRET@host` becomes `nats://relay:redacted@host`; a user alone
//!   (`nats://TOKEN@host`, NATS token authentication) becomes `nats://redacted@host`;
//! - the query, which is the credential of Logic Apps, Slack and Teams webhook URLs:
//!   `?sig=T0KEN&sv=1.0` becomes `?redacted` (whole: a bare token may stand where a name
//!   would);
//! - the fragment: `#anything` becomes `#redacted`.
//!
//! Scheme, host, port and path stay, so a message still says where the agent tried to go.
//! A URL is recognised by `scheme://` and ends at white space, a quote, `<`, `>`, a backslash
//! (a JSON escape) or a control character; trailing sentence punctuation is left outside.

use std::borrow::Cow;

/// What replaces each secret part.
pub const MASK: &str = "redacted";

/// `text` with every URL in it redacted (see the module documentation). Text without `://`
/// comes back borrowed, untouched.
pub fn text(text: &str) -> Cow<'_, str> {
    if !text.contains("://") {
        return Cow::Borrowed(text);
    }
    let bytes = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut copied = 0; // bytes of `text` already in `out`
    let mut search = 0;
    while let Some(found) = text[search..].find("://") {
        let separator = search + found;
        // The scheme: letters, digits, `+`, `-`, `.` before `://`, starting with a letter.
        let mut start = separator;
        while start > copied
            && (bytes[start - 1].is_ascii_alphanumeric() || b"+-.".contains(&bytes[start - 1]))
        {
            start -= 1;
        }
        while start < separator && !bytes[start].is_ascii_alphabetic() {
            start += 1;
        }
        let mut end = separator + 3;
        while end < bytes.len()
            && !ends_url(text[end..].chars().next().unwrap_or(' '))
            && !(bytes[end] == b',' && starts_url(&text[end + 1..]))
        {
            end += text[end..].chars().next().map_or(1, char::len_utf8);
        }
        while end > separator + 3 && sentence_end(&text[separator + 3..end]) {
            end -= 1;
        }
        out.push_str(&text[copied..start]);
        out.push_str(&text[start..separator + 3]);
        out.push_str(&redact_rest(&text[separator + 3..end]));
        copied = end;
        search = end.max(separator + 3);
    }
    out.push_str(&text[copied..]);
    Cow::Owned(out)
}

/// The secret parts of one URL, raw, as a destination may quote them back without the
/// scheme (`refused POST /hook?sig=...`): userinfo password or token, the whole query and each
/// of its values of 6 characters or more, the fragment. For [`known`].
pub fn url_secrets(url: &str) -> Vec<String> {
    let mut secrets = Vec::new();
    let Some((_, rest)) = url.split_once("://") else {
        return secrets;
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    for host in rest[..authority_end].split(',') {
        if let Some((userinfo, _)) = host.rsplit_once('@') {
            secrets.push(match userinfo.split_once(':') {
                Some((_, password)) => password.to_owned(),
                None => userinfo.to_owned(),
            });
        }
    }
    let tail = &rest[authority_end..];
    let (before_fragment, fragment) = tail.split_once('#').unwrap_or((tail, ""));
    if let Some((_, query)) = before_fragment.split_once('?') {
        secrets.push(query.to_owned());
        secrets.extend(
            query
                .split('&')
                .map(|pair| pair.split_once('=').map_or(pair, |(_, value)| value))
                .filter(|value| value.len() >= 6)
                .map(str::to_owned),
        );
    }
    secrets.push(fragment.to_owned());
    secrets.retain(|secret| !secret.is_empty());
    // Longest first, so a whole query goes before the values inside it.
    secrets.sort_by_key(|secret| std::cmp::Reverse(secret.len()));
    secrets
}

/// `text` with every one of `secrets` (from [`url_secrets`]) masked, and every URL redacted
/// as by [`text`]: for messages that quote a destination's answer.
pub fn known(text_in: &str, secrets: &[String]) -> String {
    let mut out = text(text_in).into_owned();
    for secret in secrets {
        if out.contains(secret.as_str()) {
            out = out.replace(secret.as_str(), MASK);
        }
    }
    out
}

/// Whether the last character belongs to the sentence around the URL: a full stop, comma,
/// colon..., or a `)` closing a parenthesis opened before the URL.
fn sentence_end(url: &str) -> bool {
    match url.as_bytes().last() {
        Some(b'.' | b',' | b';' | b':' | b'!') => true,
        Some(b')') => url.matches(')').count() > url.matches('(').count(),
        _ => false,
    }
}

/// Whether `text` starts with `scheme://` (the next URL of a comma-separated list).
fn starts_url(text: &str) -> bool {
    let scheme = text
        .bytes()
        .take_while(|b| b.is_ascii_alphanumeric() || b"+-.".contains(b))
        .count();
    scheme > 0 && text.as_bytes()[0].is_ascii_alphabetic() && text[scheme..].starts_with("://")
}

fn ends_url(c: char) -> bool {
    c.is_whitespace() || c.is_control() || matches!(c, '"' | '\'' | '<' | '>' | '`' | '\\')
}

/// Everything after `scheme://`: authority (one or several comma-separated hosts, each with
/// its own userinfo), path, query, fragment.
fn redact_rest(rest: &str) -> String {
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let mut out = authority
        .split(',')
        .map(redact_userinfo)
        .collect::<Vec<_>>()
        .join(",");
    let (before_fragment, fragment) = match tail.find('#') {
        Some(at) => (&tail[..at], Some(&tail[at + 1..])),
        None => (tail, None),
    };
    let (path, query) = match before_fragment.find('?') {
        Some(at) => (&before_fragment[..at], Some(&before_fragment[at + 1..])),
        None => (before_fragment, None),
    };
    out.push_str(path);
    if query.is_some() {
        out.push('?');
        out.push_str(MASK);
    }
    if fragment.is_some() {
        out.push('#');
        out.push_str(MASK);
    }
    out
}

fn redact_userinfo(host: &str) -> String {
    match host.rfind('@') {
        None => host.to_owned(),
        Some(at) => {
            let (userinfo, host) = (&host[..at], &host[at..]);
            match userinfo.split_once(':') {
                Some((user, _)) => format!("{user}:{MASK}{host}"),
                None => format!("{MASK}{host}"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn passwords_tokens_queries_and_fragments_are_masked_where_the_url_stands() {
        let cases = [
            (
                "cannot connect to NATS at nats://relay:S3CRET@127.0.0.1:4222: refused",
                "cannot connect to NATS at nats://relay:redacted@127.0.0.1:4222: refused",
            ),
            ("nats://T0KEN@host:4222", "nats://redacted@host:4222"),
            (
                "POST https://x.logic.azure.com/workflows/1/invoke?api-version=2016&sig=T0KEN (event) answered 500",
                "POST https://x.logic.azure.com/workflows/1/invoke?redacted (event) answered 500",
            ),
            (
                "error sending request for url (http://127.0.0.1:1/hook?sig=T0KEN)",
                "error sending request for url (http://127.0.0.1:1/hook?redacted)",
            ),
            (
                "amqp://guest:pw@h:5672/%2f#frag",
                "amqp://guest:redacted@h:5672/%2f#redacted",
            ),
            (
                "nats://a:P1@h1:4222,nats://b:P2@h2:4222",
                "nats://a:redacted@h1:4222,nats://b:redacted@h2:4222",
            ),
            (
                "nats://a:P1@h1,b:P2@h2",
                "nats://a:redacted@h1,b:redacted@h2",
            ),
            (
                r#"{"error":"POST http://h/x?k=V\" failed"}"#,
                r#"{"error":"POST http://h/x?redacted\" failed"}"#,
            ),
            ("see http://h/p?k=SECRET.", "see http://h/p?redacted."),
            ("no url here: a://", "no url here: a://"),
            ("http://h/plain/path", "http://h/plain/path"),
        ];
        for (input, expected) in cases {
            assert_eq!(text(input), expected, "input: {input}");
        }
    }

    #[test]
    fn a_destination_quoting_the_url_without_its_scheme_is_masked_too() {
        let url = "https://h/hook?api-version=2016&sig=T0KEN-VALUE#FRAG";
        let secrets = url_secrets(url);
        let answer =
            "refused POST /hook?api-version=2016&sig=T0KEN-VALUE: bad sig T0KEN-VALUE at #FRAG";
        let masked = known(answer, &secrets);
        assert!(
            !masked.contains("T0KEN") && !masked.contains("FRAG"),
            "{masked}"
        );
        assert_eq!(
            url_secrets("nats://u:PW@a,TOK@b"),
            ["TOK", "PW"].map(String::from)
        );
        assert!(url_secrets("http://h/path").is_empty());
    }

    #[test]
    fn text_without_a_url_is_returned_as_it_is() {
        assert!(matches!(text("a plain message: 5 > 4"), Cow::Borrowed(_)));
    }

    fn secret() -> impl Strategy<Value = String> {
        // Upper case only: the surrounding text below has none, so a hit is a real leak.
        "[A-Z0-9%~_.-]{0,6}[A-Z][A-Z0-9%~_.!$*+=-]{5,24}"
    }

    proptest! {
        #[test]
        fn no_secret_of_any_url_part_survives(
            before in "[a-z :(\\[\"=,]{0,12}",
            after in "[a-z :)\\].\",]{0,12}",
            scheme in "(nats|tls|amqp|amqps|http|https|kafka)",
            user in "[a-z]{1,8}",
            password in secret(),
            token in secret(),
            query_value in secret(),
            fragment in secret(),
            host in "[a-z0-9.-]{1,16}(:[0-9]{1,5})?",
            path in "(/[a-z0-9%._-]{0,8}){0,3}",
        ) {
            for url in [
                format!("{scheme}://{user}:{password}@{host}{path}?a={query_value}#{fragment}"),
                format!("{scheme}://{token}@{host}{path}?{query_value}"),
                format!("{scheme}://{user}:{password}@{host},{token}@{host}{path}"),
            ] {
                let line = format!("{before}{url}{after}");
                let redacted = text(&line);
                for secret in [&password, &token, &query_value, &fragment] {
                    prop_assert!(!redacted.contains(secret.as_str()), "{secret} in {redacted}");
                }
                prop_assert!(redacted.contains(&host), "{host} lost from {redacted}");
                // Redacting twice changes nothing more.
                prop_assert_eq!(text(&redacted), redacted.clone());
            }
        }
    }
}
