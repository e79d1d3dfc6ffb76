//! Calls to Azure Resource Manager with a token of the coordinator's credential: each
//! listing followed page by page through `nextLink` (only on ARM's own origin: the token is
//! never sent to another host), a throttled call (429) tried again after its
//! `Retry-After`, and every refusal said with ARM's own error code. A redirect is an
//! answer, never followed.

use std::sync::Arc;
use std::time::Duration;

use azure_core::credentials::TokenCredential;
use serde_json::Value;
use url::Url;

use super::AzureConfig;

/// At most this many pages per listing (100,000 VMs at ARM's page size of 1,000).
const MAX_PAGES: usize = 100;
/// A throttled call is tried again at most this many times in a row.
const MAX_THROTTLED: u32 = 5;
/// The wait after a 429 without `Retry-After`, and the longest one honoured.
const THROTTLE_WAIT: Duration = Duration::from_secs(10);
const THROTTLE_WAIT_MAX: Duration = Duration::from_secs(300);

pub struct Arm {
    http: reqwest::Client,
    /// One call's limit (`[azure] timeout`), the token's fetch bounded by it too.
    timeout: Duration,
    credential: Arc<dyn TokenCredential>,
    base: Url,
    scope: String,
}

impl Arm {
    pub fn new(config: &AzureConfig) -> Result<Arm, String> {
        // No redirect is followed: ARM answers its calls itself, and a POST followed as a
        // GET to a page that answers 200 would be taken for an approval ARM never made.
        let http = reqwest::Client::builder()
            .timeout(config.timeout)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| format!("azure: an HTTP client: {e}"))?;
        let credential = super::credential::build(config, http.clone())?;
        let base = Url::parse(&config.resource_manager)
            .map_err(|e| format!("azure.resource_manager: {e}"))?;
        let audience = config
            .audience
            .as_deref()
            .unwrap_or(&config.resource_manager);
        let scope = format!("{}/.default", audience.trim_end_matches('/'));
        Ok(Arm {
            http,
            timeout: config.timeout,
            credential,
            base,
            scope,
        })
    }

    /// Every item of the listing at `path` (with `query`), over all its pages.
    pub async fn list(&self, path: &str, query: &[(&str, &str)]) -> Result<Vec<Value>, String> {
        let mut url = self.url(path, query)?;
        let mut items = Vec::new();
        for _ in 0..MAX_PAGES {
            let mut page = self.get(&url).await?;
            // Anything but an object with a "value" list is refused (never indexed into: a
            // JSON array or string would panic the refresher).
            match page.get_mut("value").map(Value::take) {
                Some(Value::Array(values)) => items.extend(values),
                _ => return Err(format!("GET {path}: an answer without a \"value\" list")),
            }
            let next = page.get("nextLink").and_then(Value::as_str);
            let Some(next) = next.filter(|s| !s.is_empty()) else {
                return Ok(items);
            };
            let next =
                Url::parse(next).map_err(|e| format!("GET {path}: nextLink {next:?}: {e}"))?;
            if next.origin() != self.base.origin() {
                return Err(format!(
                    "GET {path}: nextLink {next} is not on {}; not followed (the token is for Resource Manager only)",
                    self.base
                ));
            }
            url = next;
        }
        Err(format!("GET {path}: more than {MAX_PAGES} pages"))
    }

    /// One resource at `path` (with `query`).
    pub async fn resource(&self, path: &str, query: &[(&str, &str)]) -> Result<Value, String> {
        self.get(&self.url(path, query)?).await
    }

    /// `path` with `query` on Resource Manager.
    fn url(&self, path: &str, query: &[(&str, &str)]) -> Result<Url, String> {
        let mut url = self.base.join(path).map_err(|e| format!("{path}: {e}"))?;
        url.query_pairs_mut().extend_pairs(query);
        Ok(url)
    }

    /// One POST of `path` (with `query`, no body), with `request_id` as ARM's client
    /// request id; never tried again here: ARM's answer is the caller's to judge.
    pub async fn post(
        &self,
        path: &str,
        query: &[(&str, &str)],
        request_id: &str,
    ) -> Result<Answer, String> {
        let url = self.url(path, query)?;
        let request = self
            .http
            .post(url)
            .header("x-ms-client-request-id", request_id)
            .header(reqwest::header::CONTENT_LENGTH, 0);
        self.send(request, &format!("POST {path}"), true).await
    }

    /// One call; `status_is_enough`: a success whose body is lost is still an answer.
    async fn send(
        &self,
        request: reqwest::RequestBuilder,
        what: &str,
        status_is_enough: bool,
    ) -> Result<Answer, String> {
        // azure_core retries a token's fetch for up to a minute and more: bounded here, so
        // that no call takes longer than twice `timeout` (the acknowledger's probe waits
        // that long and a minute before another goes).
        let token = tokio::time::timeout(
            self.timeout,
            self.credential.get_token(&[&self.scope], None),
        )
        .await
        .map_err(|_| {
            format!(
                "azure: no token for {} within {:?}",
                self.scope, self.timeout
            )
        })?
        .map_err(|e| format!("azure: no token for {}: {e}", self.scope))?;
        let response = request
            .bearer_auth(token.token.secret())
            .send()
            .await
            .map_err(|e| format!("{what}: {e}"))?;
        let status = response.status();
        let retry_after = response
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(Duration::from_secs);
        let body = match response.text().await {
            Ok(body) => body,
            // An acknowledgement's status is ARM's answer (a 2xx has been acted on, a 429
            // carries its Retry-After in a header): a body lost after it takes only the
            // error's words from it. A listing needs its body.
            Err(_) if status_is_enough => String::new(),
            Err(error) => return Err(format!("{what}: {error}")),
        };
        Ok(Answer {
            status,
            retry_after,
            body,
        })
    }

    async fn get(&self, url: &Url) -> Result<Value, String> {
        let what = format!("GET {}", url.path());
        let mut throttled = 0;
        loop {
            let Answer {
                status,
                retry_after,
                body,
            } = self.send(self.http.get(url.clone()), &what, false).await?;
            if status.is_success() {
                return serde_json::from_str(&body).map_err(|e| format!("{what}: not JSON ({e})"));
            }
            if status == reqwest::StatusCode::TOO_MANY_REQUESTS && throttled < MAX_THROTTLED {
                throttled += 1;
                let wait = throttle_wait(retry_after);
                tracing::warn!(call = %what, wait_s = wait.as_secs(), "Azure Resource Manager throttles the coordinator (429); waiting as it asks");
                tokio::time::sleep(wait).await;
                continue;
            }
            return Err(format!("{what}: {status} {}", arm_error(&body)));
        }
    }
}

/// What ARM answered a call.
pub struct Answer {
    pub status: reqwest::StatusCode,
    pub retry_after: Option<Duration>,
    pub body: String,
}

/// The wait a 429 asks for (`Retry-After`, else [`THROTTLE_WAIT`]), at most
/// [`THROTTLE_WAIT_MAX`].
pub fn throttle_wait(retry_after: Option<Duration>) -> Duration {
    retry_after.unwrap_or(THROTTLE_WAIT).min(THROTTLE_WAIT_MAX)
}

/// ARM's error (`{"error": {"code", "message"}}`), or the body's start.
pub fn arm_error(body: &str) -> String {
    let parsed: Option<Value> = serde_json::from_str(body).ok();
    match parsed.as_ref().map(|v| &v["error"]) {
        Some(error) if error["code"].is_string() => format!(
            "{}: {}",
            error["code"].as_str().unwrap_or_default(),
            error["message"].as_str().unwrap_or_default()
        ),
        _ => crate::watch::printable(&body.chars().take(200).collect::<String>()).into_owned(),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn arms_error_code_is_what_a_refusal_says() {
        let body = r#"{"error":{"code":"ExpiredAuthenticationToken","message":"The access token expiry UTC time is earlier than current UTC time."}}"#;
        assert_eq!(
            super::arm_error(body),
            "ExpiredAuthenticationToken: The access token expiry UTC time is earlier than current UTC time."
        );
        assert_eq!(super::arm_error("<html>bad gateway"), "<html>bad gateway");
    }
}
