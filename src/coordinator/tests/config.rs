//! The coordinator's configuration: the example loads; conflicts and unknown keys are
//! refused with their key paths; actions fall back from groups to defaults to `never`.

use std::path::Path;
use std::time::Duration;

use figment::providers::Env;

use crate::config::ConfigErrors;
use crate::coordinator::config::CoordinatorConfig;
use crate::coordinator::policy::{Action, Budget, Outage, Policy};

pub(super) fn load(text: &str) -> Result<(CoordinatorConfig, Policy), ConfigErrors> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("coordinator.toml");
    std::fs::write(&path, text).unwrap();
    CoordinatorConfig::load_with(&path, Env::prefixed("SCHED_RELAY_COORDINATOR_TEST_NONE_"))
}

pub(super) const BASE: &str = r#"
[coordinator]
[input]
kind = "nats"
url = "nats://127.0.0.1:4222"
stream = "SCHEDULEDEVENTS"
[approvals]
kind = "nats"
url = "nats://127.0.0.1:4222"
subject = "scheduledapprovals.{vmname}"
[signing]
key_file = "/etc/sched-relay/coordinator.key"
key_id = "fleet-1"
"#;

#[test]
fn the_example_configuration_loads() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/examples/coordinator.toml");
    let (config, policy) =
        CoordinatorConfig::load_with(&path, Env::prefixed("SCHED_RELAY_COORDINATOR_TEST_NONE_"))
            .unwrap();
    assert!(!config.coordinator.dry_run);
    assert!(policy.groups.len() >= 2);
}

#[test]
fn conflicting_or_incomplete_groups_are_refused_with_their_paths() {
    let text = format!(
        "{BASE}\n[[groups]]\nname = \"web\"\nvm_name = \"web-*\"\nmax_down = 1\nmax_down_percent = 10\n\
         [groups.actions]\nReboot = \"drain_then_approve\"\n\
         [[groups]]\nname = \"web\"\n\
         [[groups]]\nname = \"db\"\nvm_name = \"db-*\"\nmax_down_percent = 150\n"
    );
    let errors = load(&text).unwrap_err().to_string();
    for expected in [
        "groups[0]: set max_down or max_down_percent, not both",
        "groups[0].actions.Reboot: drain_then_approve needs a [drain] section",
        "groups[1].name: \"web\" is the name of an earlier group too",
        "groups[1]: matches nothing",
        "groups[2].max_down_percent: 150 is not a percentage",
    ] {
        assert!(
            errors.contains(expected),
            "{expected:?} missing from:\n{errors}"
        );
    }
}

#[test]
fn unknown_keys_and_actions_are_refused() {
    let errors = load(&format!("{BASE}\n[defaults]\nmax_dwn = 2\n"))
        .unwrap_err()
        .to_string();
    assert!(errors.contains("max_dwn"), "{errors}");
    let errors = load(&format!(
        "{BASE}\n[defaults.actions]\nReboot = \"aprove\"\n"
    ))
    .unwrap_err()
    .to_string();
    assert!(errors.contains("defaults.actions.Reboot"), "{errors}");
}

#[test]
fn types_without_an_action_are_never_approved_and_group_rules_override_defaults() {
    let text = format!(
        "{BASE}\n[defaults]\nmax_down = 3\n[defaults.actions]\nFreeze = {{ action = \"approve\", max_duration = \"30s\" }}\nReboot = \"approve\"\n\
         [[groups]]\nname = \"db\"\nvm_name = \"db-*\"\nmax_down = 1\n[groups.actions]\nReboot = \"never\"\n"
    );
    let (_, policy) = load(&text).unwrap();
    let db = &policy.groups[0];
    assert_eq!(db.rule("Reboot").action, Action::Never);
    assert_eq!(db.rule("freeze").action, Action::Approve);
    assert_eq!(
        db.rule("freeze").max_duration,
        Some(Duration::from_secs(30))
    );
    assert_eq!(db.rule("Terminate").action, Action::Never);
    assert_eq!(db.budget, Budget::Count(1));
    let default = policy.groups.last().unwrap();
    assert_eq!(default.rule("Reboot").action, Action::Approve);
    assert_eq!(default.budget, Budget::Count(3));
}

#[test]
fn outages_windows_gates_and_the_fleet_budget_load_per_group_or_are_refused_with_their_paths() {
    let text = format!(
        "{BASE}\n[fleet]\nmax_down = 4\n\
         [defaults.outage]\nReboot = \"5m\"\nPreempt = \"duration\"\n\
         [[defaults.windows]]\ndays = [\"sat-sun\"]\nfrom = \"22:00\"\nto = \"04:00\"\n\
         [[groups]]\nname = \"db\"\nvm_name = \"db-*\"\nmax_down = 1\nexpected_size = 12\n\
         [groups.outage]\nReboot = \"until_gone\"\n\
         [groups.health]\ncommand = [\"/bin/true\", \"{{vmname}}\"]\n"
    );
    let (config, policy) = load(&text).unwrap();
    let db = &policy.groups[0];
    assert_eq!(db.outages["reboot"], Outage::UntilGone);
    assert_eq!(db.outages["preempt"], Outage::EventDuration);
    assert_eq!(
        (db.expected_size, db.gated, db.windows.len()),
        (Some(12), true, 1)
    );
    let default = policy.groups.last().unwrap();
    assert_eq!(
        default.outages["reboot"],
        Outage::For(Duration::from_secs(300))
    );
    assert!(!default.gated);
    assert_eq!(policy.fleet_budget, Some(Budget::Count(4)));
    assert!(config.health(0).is_some() && config.health(1).is_none());
    assert_eq!(
        (policy.silent_after, policy.report_wait.num_seconds()),
        (3, 5)
    );

    let bad = format!(
        "{BASE}\n[coordinator]\nsilent_after = 0\n[fleet]\n\
         [defaults.outage]\nReboot = \"soon\"\n\
         [[defaults.windows]]\nfrom = \"25:00\"\nto = \"04:00\"\n\
         [defaults.health]\ncommand = []\ninterval = \"0s\"\n"
    )
    .replacen("[coordinator]\n", "", 1);
    let errors = load(&bad).unwrap_err().to_string();
    for expected in [
        "coordinator.silent_after: 0 heartbeats is outside 1..100",
        "fleet: set max_down or max_down_percent",
        "defaults.outage.Reboot: \"soon\": expected a duration",
        "defaults.windows[0]: \"25:00\" is not a time",
        "defaults.health.command: must name a program",
        "defaults.health.interval: 0s is outside 1s..1h",
    ] {
        assert!(
            errors.contains(expected),
            "{expected:?} missing from:\n{errors}"
        );
    }
}

#[test]
fn approvals_sent_to_an_events_subject_are_refused() {
    let text = BASE.replace(
        "subject = \"scheduledapprovals.{vmname}\"",
        "subject = \"scheduledevents.{vmname}.{transition}\"",
    );
    let errors = load(&text).unwrap_err().to_string();
    assert!(
        errors.contains(
            "approvals.subject: \"scheduledevents.{vmname}.{transition}\" is an events subject"
        ),
        "{errors}"
    );
}
