//! The gate: bearer tokens and their refusals, the token endpoint, throttling and limits.

use std::time::Duration;

use super::*;

#[tokio::test]
async fn simulator_arm_without_a_valid_bearer_answers_401_with_a_challenge() {
    let fleet = fleet(&[web(0, "")], ArmOptions::default()).await;
    let path = format!("{}?{VERSION}", scale_set_path("/virtualMachines"));
    let missing = fleet.get(&path, None).await;
    assert_eq!(
        (missing.status, missing.code()),
        (401, "AuthenticationFailed")
    );
    assert!(missing.header("www-authenticate").starts_with("Bearer "));
    let forged = fleet.get(&path, Some("not-one-of-ours")).await;
    assert_eq!(
        (forged.status, forged.code()),
        (401, "InvalidAuthenticationToken")
    );
    assert!(forged.header("www-authenticate").starts_with("Bearer "));
    let token = fleet.token().await;
    let no_version = fleet
        .get(&scale_set_path("/virtualMachines"), Some(&token))
        .await;
    assert_eq!(
        (no_version.status, no_version.code()),
        (400, "MissingApiVersionParameter")
    );
    assert_eq!(fleet.get(&path, Some(&token)).await.status, 200);
    let log = fleet.arm.requests();
    let valid: Vec<(Option<bool>, Option<u16>)> =
        log.iter().map(|r| (r.bearer_valid, r.status)).collect();
    assert_eq!(
        valid,
        [
            (Some(false), Some(401)),
            (Some(false), Some(401)),
            (None, Some(200)),
            (Some(true), Some(400)),
            (Some(true), Some(200))
        ]
    );
    fleet.stop().await;
}

#[tokio::test]
async fn simulator_arm_token_endpoint_answers_as_imds_does() {
    let fleet = fleet(&[web(0, "")], ArmOptions::default()).await;
    let url = |query: &str| format!("{}?{query}", fleet.arm.token_url());
    let no_metadata = fleet
        .http
        .get(url(
            "api-version=2018-02-01&resource=https://management.azure.com/",
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(no_metadata.status(), 400);
    let no_resource = fleet
        .http
        .get(url("api-version=2018-02-01"))
        .header("Metadata", "true")
        .send()
        .await
        .unwrap();
    assert_eq!(no_resource.status(), 400);
    let answer = reply(
        fleet
            .http
            .get(url(
                "api-version=2018-02-01&resource=https://management.azure.com/&client_id=abc",
            ))
            .header("Metadata", "true")
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(answer.status, 200);
    let body = &answer.body;
    // azure_identity reads expires_on as a string of Unix seconds.
    let expires_on: i64 = body["expires_on"].as_str().unwrap().parse().unwrap();
    let now = chrono::Utc::now().timestamp();
    assert!((now + 3590..=now + 3610).contains(&expires_on), "{body}");
    assert_eq!(body["expires_in"], "3600");
    assert_eq!(body["token_type"], "Bearer");
    assert_eq!(body["client_id"], "abc");
    assert_eq!(body["resource"], "https://management.azure.com/");
    // A token for another audience is not one ARM takes.
    let vault = reply(
        fleet
            .http
            .get(url(
                "api-version=2019-08-01&resource=https://vault.azure.net",
            ))
            .header("Metadata", "true")
            .send()
            .await
            .unwrap(),
    )
    .await;
    let token = vault.body["access_token"].as_str().unwrap();
    let path = format!("{}?{VERSION}", scale_set_path(""));
    let refused = fleet.get(&path, Some(token)).await;
    assert_eq!(
        (refused.status, refused.code()),
        (401, "InvalidAuthenticationTokenAudience")
    );
    fleet.stop().await;
}

#[tokio::test]
async fn simulator_arm_an_expired_token_is_refused_as_expired() {
    let options = ArmOptions {
        token_lifetime: Duration::from_secs(1),
        ..ArmOptions::default()
    };
    let fleet = fleet(&[web(0, "")], options).await;
    let token = fleet.token().await;
    let path = format!("{}?{VERSION}", scale_set_path(""));
    assert_eq!(fleet.get(&path, Some(&token)).await.status, 200);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let expired = fleet.get(&path, Some(&token)).await;
    assert_eq!(
        (expired.status, expired.code()),
        (401, "ExpiredAuthenticationToken")
    );
    assert!(expired.header("www-authenticate").contains("invalid_token"));
    fleet.stop().await;
}

#[tokio::test]
async fn simulator_arm_throttle_hook_answers_429_with_retry_after() {
    let fleet = fleet(&[web(0, "")], ArmOptions::default()).await;
    let token = fleet.token().await;
    let hook = fleet
        .http
        .post(format!("{}/__arm/throttle", fleet.arm.url()))
        .body(r#"{"count": 2, "retry_after": 7}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(hook.status(), 200);
    let path = format!("{}?{VERSION}", scale_set_path(""));
    for _ in 0..2 {
        let throttled = fleet.get(&path, Some(&token)).await;
        assert_eq!(
            (throttled.status, throttled.code()),
            (429, "TooManyRequests")
        );
        assert_eq!(throttled.header("retry-after"), "7");
        // Tokens are not ARM calls.
        fleet.token().await;
    }
    assert_eq!(fleet.get(&path, Some(&token)).await.status, 200);
    fleet.stop().await;
}

#[tokio::test]
async fn simulator_arm_fail_hook_answers_the_error_asked_for_then_serves_again() {
    let fleet = fleet(&[web(0, "")], ArmOptions::default()).await;
    let token = fleet.token().await;
    let hook = async |body: &'static str| {
        let answer = fleet
            .http
            .post(format!("{}/__arm/fail", fleet.arm.url()))
            .body(body)
            .send()
            .await
            .unwrap();
        answer.status()
    };
    // Only server errors and a conflict: anything else is a test's mistake, said.
    assert_eq!(hook(r#"{"count": 1, "status": 404}"#).await, 400);
    assert_eq!(hook(r#"{"count": 2, "status": 503}"#).await, 200);
    let path = format!("{}?{VERSION}", scale_set_path(""));
    for _ in 0..2 {
        let failed = fleet.get(&path, Some(&token)).await;
        assert_eq!((failed.status, failed.code()), (503, "ServiceUnavailable"));
        // Tokens are not ARM calls.
        fleet.token().await;
    }
    assert_eq!(fleet.get(&path, Some(&token)).await.status, 200);
    assert_eq!(hook(r#"{"count": 1, "status": 409}"#).await, 200);
    let conflict = fleet.get(&path, Some(&token)).await;
    assert_eq!((conflict.status, conflict.code()), (409, "Conflict"));
    assert_eq!(fleet.get(&path, Some(&token)).await.status, 200);
    fleet.stop().await;
}

#[tokio::test]
async fn simulator_arm_past_the_read_limit_answers_429_and_writes_count_apart() {
    let options = ArmOptions {
        read_limit_per_hour: 3,
        ..ArmOptions::default()
    };
    let fleet = fleet(&[web(0, "")], options).await;
    let token = fleet.token().await;
    let path = format!("{}?{VERSION}", scale_set_path(""));
    for left in ["2", "1", "0"] {
        let answer = fleet.get(&path, Some(&token)).await;
        assert_eq!(answer.status, 200);
        assert_eq!(
            answer.header("x-ms-ratelimit-remaining-subscription-reads"),
            left
        );
    }
    let limited = fleet.get(&path, Some(&token)).await;
    assert_eq!((limited.status, limited.code()), (429, "TooManyRequests"));
    let retry_after: u64 = limited.header("retry-after").parse().unwrap();
    assert!((3590..=3600).contains(&retry_after), "{retry_after}");
    let write = fleet
        .post(
            &acknowledge_path("virtualMachineScaleSets/web", "x", ACK_VERSION),
            &token,
        )
        .await;
    assert_eq!(write.status, 404, "writes have their own limit");
    fleet.stop().await;
}
