//! What stands before every ARM answer: the tokens the managed-identity endpoint issued and
//! their expiry, the bearer check with ARM's error codes, the per-subscription read and
//! write counts over a sliding hour, and the throttle a test asked for.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};

const HOUR: Duration = Duration::from_secs(3600);

/// The audiences ARM accepts a token for (a client asks for `https://management.azure.com/`
/// or the classic `https://management.core.windows.net/`).
const ARM_AUDIENCES: &[&str] = &[
    "https://management.azure.com",
    "https://management.core.windows.net",
];

struct Issued {
    expires: Instant,
    expires_wall: DateTime<Utc>,
    resource: String,
}

/// A request counted against a subscription's limit: reads are GETs, writes POSTs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Access {
    Read,
    Write,
}

impl Access {
    /// The header that tells the client how many it has left.
    pub(super) fn remaining_header(self) -> &'static str {
        match self {
            Access::Read => "x-ms-ratelimit-remaining-subscription-reads",
            Access::Write => "x-ms-ratelimit-remaining-subscription-writes",
        }
    }
}

/// Why a bearer token was refused, with ARM's error code for each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Refusal {
    Missing,
    Malformed,
    NotIssued,
    Expired { at: DateTime<Utc> },
    Audience { resource: String },
}

impl Refusal {
    pub(super) fn code(&self) -> &'static str {
        match self {
            Refusal::Missing | Refusal::Malformed => "AuthenticationFailed",
            Refusal::NotIssued => "InvalidAuthenticationToken",
            Refusal::Expired { .. } => "ExpiredAuthenticationToken",
            Refusal::Audience { .. } => "InvalidAuthenticationTokenAudience",
        }
    }

    pub(super) fn message(&self) -> String {
        let format = "%-m/%-d/%Y %-I:%M:%S %p";
        match self {
            Refusal::Missing => "Authentication failed. The 'Authorization' header is missing.".into(),
            Refusal::Malformed => {
                "Authentication failed. The 'Authorization' header is provided in an invalid format.".into()
            }
            Refusal::NotIssued => "The access token is invalid.".into(),
            Refusal::Expired { at } => format!(
                "The access token expiry UTC time '{}' is earlier than current UTC time '{}'.",
                at.format(format),
                Utc::now().format(format)
            ),
            Refusal::Audience { resource } => format!(
                "The access token has been obtained for wrong audience or resource '{resource}'. It should exactly match with one of the allowed audiences 'https://management.core.windows.net/','https://management.azure.com/'."
            ),
        }
    }
}

/// A token as the endpoint hands it out.
pub(super) struct Token {
    pub(super) access_token: String,
    pub(super) expires_on: i64,
    pub(super) not_before: i64,
}

#[derive(Default)]
pub(super) struct Gate {
    tokens: HashMap<String, Issued>,
    reads: HashMap<String, VecDeque<Instant>>,
    writes: HashMap<String, VecDeque<Instant>>,
    /// The next ARM requests answer 429 with this `Retry-After`.
    throttle: Countdown<u64>,
    /// The next ARM requests answer this server error (an outage), each after this delay
    /// (a gateway that times out).
    failing: Countdown<(u16, Duration)>,
}

/// An answer a test asked the next `count` requests to get.
struct Countdown<T>(Option<(u32, T)>);

impl<T> Default for Countdown<T> {
    fn default() -> Self {
        Countdown(None)
    }
}

impl<T: Copy> Countdown<T> {
    /// The next `count` requests get `answer` (0: none does).
    fn ask(&mut self, count: u32, answer: T) {
        self.0 = (count > 0).then_some((count, answer));
    }

    /// Takes one of the answers asked for.
    fn take(&mut self) -> Option<T> {
        let (count, answer) = self.0.as_mut()?;
        let answer = *answer;
        *count -= 1;
        if *count == 0 {
            self.0 = None;
        }
        Some(answer)
    }
}

impl Gate {
    /// A new opaque token for `resource`, valid for `lifetime` from `now`.
    pub(super) fn issue(&mut self, resource: &str, lifetime: Duration, now: Instant) -> Token {
        let access_token: String = std::iter::repeat_with(fastrand::alphanumeric)
            .take(64)
            .collect();
        let wall = Utc::now();
        let expires_wall = wall + chrono::Duration::from_std(lifetime).unwrap_or_default();
        self.tokens.insert(
            access_token.clone(),
            Issued {
                expires: now + lifetime,
                expires_wall,
                resource: resource.to_owned(),
            },
        );
        Token {
            access_token,
            expires_on: expires_wall.timestamp(),
            not_before: wall.timestamp(),
        }
    }

    /// Checks an `Authorization` header: a `Bearer` token this gate issued for ARM, not expired.
    pub(super) fn check(&self, authorization: Option<&str>, now: Instant) -> Result<(), Refusal> {
        let header = authorization.ok_or(Refusal::Missing)?;
        let (scheme, token) = header.trim().split_once(' ').ok_or(Refusal::Malformed)?;
        let token = token.trim();
        if !scheme.eq_ignore_ascii_case("Bearer") || token.is_empty() {
            return Err(Refusal::Malformed);
        }
        let issued = self.tokens.get(token).ok_or(Refusal::NotIssued)?;
        if now >= issued.expires {
            return Err(Refusal::Expired {
                at: issued.expires_wall,
            });
        }
        let audience = issued.resource.trim_end_matches('/');
        if !ARM_AUDIENCES
            .iter()
            .any(|allowed| allowed.eq_ignore_ascii_case(audience))
        {
            return Err(Refusal::Audience {
                resource: issued.resource.clone(),
            });
        }
        Ok(())
    }

    pub(super) fn throttle(&mut self, count: u32, retry_after: u64) {
        self.throttle.ask(count, retry_after);
    }

    /// Takes one of the throttled answers a test asked for: its `Retry-After`.
    pub(super) fn take_throttle(&mut self) -> Option<u64> {
        self.throttle.take()
    }

    pub(super) fn fail(&mut self, count: u32, status: u16, delay: Duration) {
        self.failing.ask(count, (status, delay));
    }

    /// Takes one of the failed answers a test asked for: its status and delay.
    pub(super) fn take_failure(&mut self) -> Option<(u16, Duration)> {
        self.failing.take()
    }

    fn window(
        &mut self,
        subscription: &str,
        access: Access,
        now: Instant,
    ) -> &mut VecDeque<Instant> {
        let windows = match access {
            Access::Read => &mut self.reads,
            Access::Write => &mut self.writes,
        };
        let window = windows
            .entry(subscription.to_ascii_lowercase())
            .or_default();
        while window
            .front()
            .is_some_and(|at| now.duration_since(*at) >= HOUR)
        {
            window.pop_front();
        }
        window
    }

    /// Counts one request: `Ok(left)` after it, or `Err(seconds)` until one more is allowed.
    pub(super) fn count(
        &mut self,
        subscription: &str,
        access: Access,
        limit: u32,
        now: Instant,
    ) -> Result<u32, u64> {
        let window = self.window(subscription, access, now);
        let used = u32::try_from(window.len()).unwrap_or(u32::MAX);
        if used >= limit {
            // The oldest request leaves the hour first; at least 1 s, rounded up.
            let wait = window
                .front()
                .map(|oldest| HOUR.saturating_sub(now.duration_since(*oldest)))
                .unwrap_or(HOUR);
            return Err(wait.as_secs() + u64::from(wait.subsec_nanos() > 0));
        }
        window.push_back(now);
        Ok(limit - used - 1)
    }

    /// How many are left, without counting one.
    pub(super) fn remaining(
        &mut self,
        subscription: &str,
        access: Access,
        limit: u32,
        now: Instant,
    ) -> u32 {
        let used = u32::try_from(self.window(subscription, access, now).len()).unwrap_or(u32::MAX);
        limit.saturating_sub(used)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bearer_is_refused_with_the_code_that_says_why() {
        let mut gate = Gate::default();
        let now = Instant::now();
        let arm = gate.issue("https://management.azure.com/", HOUR, now);
        let other = gate.issue("https://vault.azure.net", HOUR, now);
        let check = |header: Option<String>, at| gate.check(header.as_deref(), at);
        assert_eq!(check(None, now), Err(Refusal::Missing));
        assert_eq!(
            check(Some("Basic abc".into()), now),
            Err(Refusal::Malformed)
        );
        assert_eq!(
            check(Some("Bearer nope".into()), now),
            Err(Refusal::NotIssued)
        );
        let bearer = format!("bearer {}", arm.access_token);
        assert_eq!(check(Some(bearer.clone()), now), Ok(()));
        assert!(matches!(
            check(Some(bearer), now + HOUR),
            Err(Refusal::Expired { .. })
        ));
        assert!(matches!(
            check(Some(format!("Bearer {}", other.access_token)), now),
            Err(Refusal::Audience { .. })
        ));
    }

    #[test]
    fn the_limit_counts_over_a_sliding_hour() {
        let mut gate = Gate::default();
        let t0 = Instant::now();
        assert_eq!(gate.count("S", Access::Read, 2, t0), Ok(1));
        assert_eq!(gate.count("s", Access::Read, 2, t0 + HOUR / 2), Ok(0));
        assert_eq!(gate.count("S", Access::Write, 2, t0), Ok(1), "writes apart");
        assert_eq!(gate.count("S", Access::Read, 2, t0 + HOUR / 2), Err(1800));
        assert_eq!(gate.count("S", Access::Read, 2, t0 + HOUR), Ok(0));
    }
}
