//! Loading and validating whole configurations, as users write them.

use std::path::Path;
use std::time::Duration;

use figment::providers::Env;

use super::*;

fn load(toml: &str, env: &[(&str, &str)]) -> Result<Config, ConfigErrors> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.toml");
    std::fs::write(&path, toml).unwrap();
    let _guards: Vec<_> = env.iter().map(|(k, v)| EnvGuard::set(k, v)).collect();
    // Each test sees only its own variables, so tests running in parallel cannot leak
    // overrides into each other; the provider is otherwise the real one.
    let keys: Vec<String> = env
        .iter()
        .map(|(k, _)| k.trim_start_matches(ENV_PREFIX).to_ascii_lowercase())
        .collect();
    let provider = Env::prefixed(ENV_PREFIX)
        .filter(move |key| keys.iter().any(|k| key.as_str().eq_ignore_ascii_case(k)));
    load::load(Some(&path), provider)
}

struct EnvGuard(String);
impl EnvGuard {
    fn set(key: &str, value: &str) -> Self {
        // SAFETY: only this module's tests touch SCHED_RELAY_* variables, each with
        // names no other test reads.
        unsafe { std::env::set_var(key, value) };
        EnvGuard(key.to_owned())
    }
}
impl Drop for EnvGuard {
    fn drop(&mut self) {
        unsafe { std::env::remove_var(&self.0) };
    }
}

#[test]
fn the_product_contract_example_loads() {
    let config = load(
        r#"
        [imds]
        endpoint = "http://169.254.169.254"
        api_version = "2020-07-01"
        poll_interval = "1s"
        [identity]
        vm_name = "WestNO_0"
        [state]
        dir = "/var/lib/sched-relay"
        [policy]
        approve_user_initiated = true
        approve_freeze_max_seconds = 9
        [[sinks]]
        name = "audit"
        kind = "file"
        path = "/var/log/sched-relay/events.jsonl"
        "#,
        &[],
    )
    .unwrap();
    assert_eq!(config.imds.poll_interval, Duration::from_secs(1));
    assert_eq!(config.policy.approve_freeze_max_seconds, Some(9));
    assert_eq!(config.sinks[0].name, "audit");
    assert_eq!(config.sinks[0].kind.label(), "file");
}

#[test]
fn defaults_poll_every_second_and_print_to_stdout() {
    let config = load("", &[]).unwrap();
    // The Default impls and serde's defaults must agree: the demo and tests build
    // configurations in code, users write files.
    assert_eq!(config, Config::default());
    assert!(config.identity.from_metadata && config.events.document_events);
    assert_eq!(config.sinks[0].kind.label(), "stdout");
}

#[test]
fn environment_overrides_the_file() {
    let config = load(
        "[imds]\npoll_interval = \"1s\"\n",
        &[
            ("SCHED_RELAY_IMDS__POLL_INTERVAL", "250ms"),
            ("SCHED_RELAY_POLICY__APPROVE_USER_INITIATED", "true"),
        ],
    )
    .unwrap();
    assert_eq!(config.imds.poll_interval, Duration::from_millis(250));
    assert!(config.policy.approve_user_initiated);
}

#[test]
fn every_problem_is_reported_at_once_with_its_key_path() {
    let errors = load(
        r#"
        [imds]
        endpoint = "ftp://x"
        api_version = "latest"
        poll_interval = "50ms"
        [policy]
        approve_freeze_max_seconds = -1
        [[sinks]]
        name = "a"
        kind = "stdout"
        [[sinks]]
        name = "a"
        kind = "file"
        path = ""
        "#,
        &[],
    )
    .unwrap_err();
    let paths: Vec<&str> = errors.0.iter().map(|p| p.path.as_str()).collect();
    assert_eq!(
        paths,
        [
            "imds.endpoint",
            "imds.api_version",
            "imds.poll_interval",
            "policy.approve_freeze_max_seconds",
            "sinks[1].name",
            "sinks[1].path"
        ],
        "{errors}"
    );
}

#[test]
fn unknown_keys_and_bad_types_are_refused_with_their_path() {
    let errors = load("[imds]\npoll_intervall = \"1s\"\n", &[]).unwrap_err();
    assert_eq!(errors.0[0].path, "imds.poll_intervall");
    assert!(errors.0[0].message.contains("poll_interval"), "{errors}");

    let errors = load("[imds]\npoll_interval = \"soon\"\n", &[]).unwrap_err();
    assert_eq!(errors.0[0].path, "imds.poll_interval", "{errors}");

    let errors = load(
        "[imds]\npoll_intervall = \"1s\"\n[log]\nformat = \"xml\"\n[[sinks]]\nname = \"k\"\nkind = \"carrier-pigeon\"\n[telemetri]\n",
        &[],
    )
    .unwrap_err();
    let paths: Vec<&str> = errors.0.iter().map(|p| p.path.as_str()).collect();
    assert_eq!(
        paths,
        ["telemetri", "imds.poll_intervall", "log.format", "sinks[0]"],
        "{errors}"
    );

    let errors = load("[[sinks]]\nname = \"k\"\nkind = \"carrier-pigeon\"\n", &[]).unwrap_err();
    assert!(errors.0[0].message.contains("carrier-pigeon"), "{errors}");
    assert!(errors.0[0].message.contains("sink \"k\""), "{errors}");

    let errors = load(
        "[[sinks]]\nname = \"f\"\nkind = \"file\"\npth = \"x\"\n",
        &[],
    )
    .unwrap_err();
    assert!(errors.0[0].message.contains("pth"), "{errors}");
}

#[test]
fn a_missing_config_file_is_an_error_not_a_silent_default() {
    let errors = Config::load(Some(Path::new("/nonexistent/sched-relay.toml"))).unwrap_err();
    assert_eq!(errors.0[0].path, "--config");
}

#[test]
fn secrets_never_appear_in_the_printed_configuration() {
    let mut value: toml::Value = toml::from_str(
        r#"
        url = "amqp://guest:hunter2@127.0.0.1:5672/%2f"
        webhook = "https://h/hook?sig=hunter2"
        nats = "nats://hunter2@h:4222"
        headers = { "X-Api-Key" = "hunter2" }
        [auth]
        password = "hunter2"
        bearer_token = "hunter2"
        password_file = "/run/secrets/pw"
        "#,
    )
    .unwrap();
    redact::redact(&mut value);
    let printed = toml::to_string(&value).unwrap();
    assert!(!printed.contains("hunter2"), "{printed}");
    assert!(printed.contains("/run/secrets/pw"), "{printed}");
}

// [approvals] checks that depend on other sections (sinks, telemetry).

fn problems(text: &str) -> Vec<String> {
    let config: Config = toml::from_str(text).unwrap();
    config.validate().iter().map(|p| p.to_string()).collect()
}

#[test]
fn sources_without_a_key_or_a_connection_are_refused_with_the_fix() {
    let found = problems("[approvals.nats]\nsubject = \"a.{vmname}\"\n");
    assert!(
        found
            .iter()
            .any(|p| p.starts_with("approvals.keys:") && p.contains("allow_unsigned")),
        "{found:?}"
    );
    assert!(
        found
            .iter()
            .any(|p| p.starts_with("approvals.nats:") && p.contains("connection")),
        "{found:?}"
    );
}

#[test]
fn a_source_must_name_a_sink_of_its_own_kind() {
    let found = problems(
        "[approvals]\nallow_unsigned = true\n[approvals.amqp]\nsink = \"audit\"\n\
         [[sinks]]\nname = \"audit\"\nkind = \"file\"\npath = \"/tmp/x\"\n",
    );
    assert_eq!(
        found,
        [
            "approvals.amqp: sink = \"audit\" is a file sink; the amqp source needs a sink of kind \"amqp\""
        ]
    );
}

#[test]
fn http_approvals_need_the_listener_and_off_loopback_a_token() {
    let base = "[approvals]\nallow_unsigned = true\n[approvals.http]\n";
    assert!(
        problems(base)
            .iter()
            .any(|p| p.contains("telemetry.listen"))
    );
    let open = format!("{base}[telemetry]\nlisten = \"0.0.0.0:9464\"\n");
    assert!(
        problems(&open)
            .iter()
            .any(|p| p.starts_with("approvals.http.token"))
    );
    let loopback = format!("{base}[telemetry]\nlisten = \"127.0.0.1:9464\"\n");
    assert!(problems(&loopback).is_empty());
}

#[test]
fn placeholders_other_than_vmname_are_refused() {
    let found = problems(
        "[approvals]\nallow_unsigned = true\n[approvals.nats]\nconnection = { url = \"nats://h:4222\" }\nsubject = \"a.{eventid}\"\n",
    );
    assert!(
        found
            .iter()
            .any(|p| p.starts_with("approvals.nats.subject")),
        "{found:?}"
    );
}

fn warnings(text: &str) -> Vec<String> {
    let config: Config = toml::from_str(text).unwrap();
    config.warnings().iter().map(|p| p.to_string()).collect()
}

/// A configuration that ran before an upgrade must keep the agent relaying events after it:
/// what older releases accepted is warned about (and made safe), not refused.
#[test]
fn a_backoff_ceiling_that_could_swallow_a_spot_notice_is_warned_about_and_clamped() {
    let old = "[imds]\nmax_backoff = \"30s\"\n";
    assert!(problems(old).is_empty(), "{:?}", problems(old));
    let found = warnings(old);
    assert!(
        found
            .iter()
            .any(|w| w.contains("imds.max_backoff") && w.contains("5s is used")),
        "{found:?}"
    );
    assert!(warnings("[imds]\nmax_backoff = \"5s\"\n").is_empty());
    let found = problems("[imds]\nmax_backoff = \"100ms\"\n");
    assert!(
        found.iter().any(|p| p.contains("imds.max_backoff")),
        "{found:?}"
    );
    assert!(problems("[imds]\nmax_backoff = \"5s\"\nunready_after = \"30s\"\n").is_empty());
    let found = problems("[imds]\nunready_after = \"0s\"\n");
    assert!(
        found.iter().any(|p| p.contains("imds.unready_after")),
        "{found:?}"
    );
}

#[test]
fn policy_rules_the_api_version_cannot_satisfy_are_warned_about_naming_the_version_needed() {
    let old = "[imds]\napi_version = \"2019-01-01\"\n[policy]\napprove_user_initiated = true\napprove_freeze_max_seconds = 9\n";
    assert!(problems(old).is_empty());
    let found = warnings(old);
    assert_eq!(found.len(), 2, "{found:?}");
    assert!(
        found[0].starts_with("policy.approve_user_initiated: ")
            && found[0].contains("EventSource")
            && found[0].contains("2019-08-01")
            && found[0].contains("imds.api_version"),
        "{found:?}"
    );
    assert!(
        found[1].starts_with("policy.approve_freeze_max_seconds: ")
            && found[1].contains("DurationInSeconds")
            && found[1].contains("2020-07-01"),
        "{found:?}"
    );
    // 2019-08-01 has EventSource but not DurationInSeconds.
    let found = warnings(
        "[imds]\napi_version = \"2019-08-01\"\n[policy]\napprove_user_initiated = true\napprove_freeze_max_seconds = 9\n",
    );
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(
        found[0].starts_with("policy.approve_freeze_max_seconds: "),
        "{found:?}"
    );
    // The default api-version serves both; rules that are off need nothing.
    assert!(
        warnings("[policy]\napprove_user_initiated = true\napprove_freeze_max_seconds = 9\n")
            .is_empty()
    );
    assert!(
        warnings(
            "[imds]\napi_version = \"2017-03-01\"\n[policy]\napprove_event_types = [\"Preempt\"]\n"
        )
        .is_empty()
    );
}

#[test]
fn without_metadata_or_a_configured_name_the_hostname_is_used_and_warned_about() {
    let found = warnings("[identity]\nfrom_metadata = false\n");
    assert!(
        found
            .iter()
            .any(|w| w.starts_with("identity.vm_name") && w.contains("hostname")),
        "{found:?}"
    );
    assert!(problems("[identity]\nfrom_metadata = false\n").is_empty());
    assert!(warnings("[identity]\nfrom_metadata = false\nhostname_fallback = true\n").is_empty());
    assert!(warnings("[identity]\nfrom_metadata = false\nvm_name = \"vm0\"\n").is_empty());
}

#[test]
fn the_heartbeat_interval_comes_from_file_or_environment_is_checked_with_its_key_and_printed() {
    let config = load("[events]\nheartbeat_interval = \"30s\"\n", &[]).unwrap();
    assert_eq!(config.events.heartbeat_interval, Duration::from_secs(30));
    let off = load("", &[("SCHED_RELAY_EVENTS__HEARTBEAT_INTERVAL", "0s")]).unwrap();
    assert!(off.events.heartbeat_interval.is_zero());
    let errors = load("[events]\nheartbeat_interval = \"2h\"\n", &[]).unwrap_err();
    let paths: Vec<&str> = errors.0.iter().map(|p| p.path.as_str()).collect();
    assert_eq!(paths, ["events.heartbeat_interval"], "{errors}");
    let printed = Config::default().to_redacted_toml();
    assert!(printed.contains("heartbeat_interval = \"5m\""), "{printed}");
}
