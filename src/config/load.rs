//! Loading: the file (or the default path), then `SCHED_RELAY_*` overrides, extracted section
//! by section so that one bad key does not hide the problems of the others.

use std::path::Path;

use figment::Figment;
use figment::providers::{Env, Format, Toml};

use super::{
    Config, ConfigErrors, ConfigProblem, DEFAULT_CONFIG_PATH, ENV_PREFIX, default_sinks, problem,
};
use crate::sinks::SinkEntry;

/// Loads and validates, reading overrides from `env` (tests narrow it to their variables).
pub(super) fn load(path: Option<&Path>, env: Env) -> Result<Config, ConfigErrors> {
    let mut figment = Figment::new();
    match path {
        Some(path) if !path.is_file() => {
            return Err(ConfigErrors(vec![problem(
                "--config",
                format!("{} does not exist or is not a file", path.display()),
            )]));
        }
        Some(path) => figment = figment.merge(Toml::file_exact(path)),
        None if Path::new(DEFAULT_CONFIG_PATH).is_file() => {
            figment = figment.merge(Toml::file_exact(DEFAULT_CONFIG_PATH))
        }
        None => {}
    }
    // SCHED_RELAY_CONFIG names the file itself (clap reads it); it is not a key.
    let figment = figment.merge(env.split("__").ignore(&["config"]));
    let config = extract_all(&figment)?;
    let problems = config.validate();
    if problems.is_empty() {
        Ok(config)
    } else {
        Err(ConfigErrors(problems))
    }
}

/// Extracts section by section and sink by sink, so that one bad key does not hide the
/// problems of the others (serde stops at the first error of a struct).
fn extract_all(figment: &Figment) -> Result<Config, ConfigErrors> {
    use figment::value::{Dict, Value};
    let mut problems = Vec::new();
    let root: Dict = figment
        .extract()
        .map_err(|errors| ConfigErrors(errors.into_iter().map(figment_problem).collect()))?;
    const SECTIONS: [&str; 10] = [
        "imds",
        "identity",
        "events",
        "state",
        "policy",
        "delivery",
        "log",
        "telemetry",
        "approvals",
        "sinks",
    ];
    for key in root.keys().filter(|key| !SECTIONS.contains(&key.as_str())) {
        let variable = std::env::vars().map(|(name, _)| name).find(|name| {
            name.strip_prefix(ENV_PREFIX).is_some_and(|rest| {
                rest.to_ascii_lowercase().split("__").next() == Some(key.as_str())
            })
        });
        let origin = match variable {
            Some(name) => format!(" (from the environment variable {name})"),
            None => String::new(),
        };
        problems.push(problem(
            key.clone(),
            format!(
                "unknown section{origin}; expected one of {}",
                SECTIONS.join(", ")
            ),
        ));
    }
    fn section<T: serde::de::DeserializeOwned + Default>(
        figment: &Figment,
        root: &Dict,
        key: &str,
        problems: &mut Vec<ConfigProblem>,
    ) -> T {
        if !root.contains_key(key) {
            return T::default();
        }
        figment
            .extract_inner(key)
            .unwrap_or_else(|errors: figment::Error| {
                problems.extend(errors.into_iter().map(|error| section_problem(key, error)));
                T::default()
            })
    }
    let mut config = Config {
        imds: section(figment, &root, "imds", &mut problems),
        identity: section(figment, &root, "identity", &mut problems),
        events: section(figment, &root, "events", &mut problems),
        state: section(figment, &root, "state", &mut problems),
        policy: section(figment, &root, "policy", &mut problems),
        delivery: section(figment, &root, "delivery", &mut problems),
        log: section(figment, &root, "log", &mut problems),
        telemetry: section(figment, &root, "telemetry", &mut problems),
        approvals: section(figment, &root, "approvals", &mut problems),
        sinks: default_sinks(),
    };
    if root.contains_key("sinks") {
        match figment.extract_inner::<Vec<Value>>("sinks") {
            Ok(entries) => {
                config.sinks = Vec::with_capacity(entries.len());
                for (index, entry) in entries.into_iter().enumerate() {
                    match entry.deserialize::<SinkEntry>() {
                        Ok(sink) => config.sinks.push(sink),
                        Err(error) => problems
                            .push(problem(format!("sinks[{index}]"), error.kind.to_string())),
                    }
                }
            }
            Err(errors) => problems.extend(
                errors
                    .into_iter()
                    .map(|error| section_problem("sinks", error)),
            ),
        }
    }
    if problems.is_empty() {
        Ok(config)
    } else {
        Err(ConfigErrors(problems))
    }
}

/// A problem inside `section`: figment reports paths relative to the extracted value.
fn section_problem(section: &str, mut error: figment::Error) -> ConfigProblem {
    error.path.retain(|part| part != section);
    error.path.insert(0, section.to_owned());
    figment_problem(error)
}

fn figment_problem(error: figment::Error) -> ConfigProblem {
    let path = if error.path.is_empty() {
        "config".to_owned()
    } else {
        error.path.join(".")
    };
    let source = error
        .metadata
        .as_ref()
        .map(|metadata| match &metadata.source {
            Some(source) => format!(" (in {source})"),
            None => format!(" (from {})", metadata.name),
        })
        .unwrap_or_default();
    problem(path, format!("{}{source}", error.kind))
}
