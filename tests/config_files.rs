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
        "telemetry.listen",
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
        // The fleet coordinator's file is not an agent's: its own loader checks it.
        if path.file_name().is_some_and(|n| n == "coordinator.toml") {
            if let Err(errors) = sched_relay::coordinator::config::CoordinatorConfig::load(&path) {
                panic!("{}: {errors}", path.display());
            }
            count += 1;
            continue;
        }
        if let Err(errors) = Config::load(Some(&path)) {
            // In a build without some sink (say, no `kafka` feature) the only acceptable
            // problem is the one that says so.
            for problem in &errors.0 {
                assert!(
                    problem.message.contains("was built without"),
                    "{}: {problem}",
                    path.display()
                );
            }
        }
        count += 1;
    }
    assert!(count >= 10);
}

#[test]
fn every_sink_block_documented_in_the_reference_uses_real_keys() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/reference.toml");
    let text = std::fs::read_to_string(path).unwrap();
    let mut blocks = Vec::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        if line == "# [[sinks]]" {
            current = Some(String::from("[[sinks]]\n"));
        } else if let Some(block) = current.as_mut() {
            match line.strip_prefix("# ") {
                Some(code) if !code.starts_with('#') => {
                    block.push_str(code);
                    block.push('\n');
                }
                Some(_) => {}
                None => blocks.extend(current.take()),
            }
        }
    }
    blocks.extend(current);
    assert_eq!(blocks.len(), 5, "nats, amqp, kafka, webhook, exec");
    #[derive(serde::Deserialize)]
    struct Sinks {
        sinks: Vec<sched_relay::sinks::SinkEntry>,
    }
    // Each block lists every key of its kind, alternatives included (token and password),
    // so it is checked for names and types, which is what drifts, not for a coherent set-up.
    for block in blocks {
        let sinks: Sinks = toml::from_str(&block).unwrap_or_else(|e| panic!("{e}\n{block}"));
        assert_eq!(sinks.sinks.len(), 1);
    }
}

#[test]
fn every_approval_block_documented_in_the_reference_uses_real_keys() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/reference.toml");
    let text = std::fs::read_to_string(path).unwrap();
    // The commented-out [[approvals.keys]] and [approvals.<source>] blocks, uncommented.
    // A block runs from its commented header to the first line that is not a comment.
    let mut blocks: Vec<String> = Vec::new();
    let mut open = false;
    for line in text.lines() {
        let Some(code) = line.strip_prefix("# ") else {
            open = false;
            continue;
        };
        if code.starts_with("[approvals.") || code.starts_with("[[approvals.") {
            blocks.push(format!("{code}\n"));
            open = true;
        } else if open
            && code
                .split_once(" = ")
                .is_some_and(|(key, _)| key.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
        {
            blocks.last_mut().unwrap().push_str(&format!("{code}\n"));
        }
    }
    assert_eq!(
        blocks.len(),
        6,
        "two keys, http, nats, amqp, kafka: {blocks:?}"
    );
    #[derive(serde::Deserialize)]
    struct Document {
        approvals: sched_relay::approval::config::ApprovalsConfig,
    }
    let parsed: Document =
        toml::from_str(&blocks.concat()).unwrap_or_else(|e| panic!("{e}\n{}", blocks.concat()));
    assert_eq!(parsed.approvals.keys.len(), 2);
    assert!(parsed.approvals.http.is_some() && parsed.approvals.nats.is_some());
    assert!(parsed.approvals.amqp.is_some() && parsed.approvals.kafka.is_some());
}
