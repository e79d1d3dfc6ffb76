//! The configuration files we ship are loadable, and the reference documents every key.

use std::collections::BTreeSet;
use std::path::Path;

use sched_relay::config::Config;

fn keys(value: &toml::Value, prefix: &str, out: &mut BTreeSet<String>) {
    if let toml::Value::Table(table) = value {
        for (key, value) in table {
            let path = if prefix.is_empty() {
                key.clone()
            } else {
                format!("{prefix}.{key}")
            };
            if key != "sinks" {
                out.insert(path.clone());
                keys(value, &path, out);
            }
        }
    }
}

#[test]
fn reference_config_loads_and_documents_every_key() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/reference.toml");
    let config = Config::load(Some(&path)).unwrap_or_else(|e| panic!("{e}"));
    let text = std::fs::read_to_string(&path).unwrap();

    // Every key the code knows appears in the reference, set or commented out.
    let mut known = BTreeSet::new();
    keys(
        &toml::Value::try_from(Config::default()).unwrap(),
        "",
        &mut known,
    );
    for optional in [
        "identity.vm_name",
        "identity.vm_id",
        "identity.resource_id",
        "identity.source",
        "policy.approve_freeze_max_seconds",
    ] {
        known.insert(optional.to_owned());
    }
    for key in &known {
        let name = key.rsplit('.').next().unwrap();
        let documented = text.lines().any(|line| {
            let line = line.trim_start_matches(['#', ' ']);
            line.starts_with(&format!("{name} =")) || line.starts_with(&format!("[{key}]"))
        });
        assert!(documented, "config/reference.toml does not document {key}");
    }

    // Where the reference sets a key, it sets it to the default.
    let defaults = Config {
        sinks: config.sinks.clone(),
        ..Config::default()
    };
    assert_eq!(
        config, defaults,
        "config/reference.toml must show the defaults"
    );
}

#[test]
fn every_example_config_loads() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/examples");
    let mut count = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        Config::load(Some(&path)).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        count += 1;
    }
    assert!(count >= 4);
}
