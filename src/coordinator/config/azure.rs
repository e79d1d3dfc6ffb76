//! The checks of `[azure]` and `[groups.azure]` ([`crate::coordinator::azure::AzureConfig`]).

use std::time::Duration;

use super::{CoordinatorConfig, problem};
use crate::config::ConfigProblem;
use crate::coordinator::azure::{Credential, Source};

impl CoordinatorConfig {
    /// Each group's source, by the policy's group index.
    pub fn azure_sources(&self) -> Vec<(usize, Source)> {
        self.groups
            .iter()
            .enumerate()
            .filter_map(|(index, group)| {
                let source = Source::parse(&group.azure.as_ref()?.source).ok()?;
                Some((index, source))
            })
            .collect()
    }

    pub(super) fn check_azure(&self, problems: &mut Vec<ConfigProblem>) {
        let mut any = false;
        for (index, group) in self.groups.iter().enumerate() {
            let Some(azure) = &group.azure else { continue };
            any = true;
            if let Err(why) = Source::parse(&azure.source) {
                problems.push(problem(format!("groups[{index}].azure.source"), why));
            }
        }
        let Some(config) = &self.azure else {
            if any {
                problems.push(problem(
                    "azure",
                    "a group has an Azure source ([groups.azure]) but there is no [azure] section saying how to reach Azure Resource Manager",
                ));
            }
            return;
        };
        if !cfg!(feature = "azure") {
            problems.push(problem(
                "azure",
                "this sched-relay was built without Azure support (the `azure` feature)",
            ));
        }
        for (key, value) in [
            ("resource_manager", Some(&config.resource_manager)),
            (
                "managed_identity_endpoint",
                Some(&config.managed_identity_endpoint),
            ),
            ("audience", config.audience.as_ref()),
        ] {
            let Some(value) = value else { continue };
            match url::Url::parse(value) {
                // The bearer token goes to Resource Manager: in clear only on this machine.
                Ok(url)
                    if key == "resource_manager"
                        && url.scheme() == "http"
                        && !url.host().is_some_and(|host| match host {
                            url::Host::Domain(name) => name == "localhost",
                            url::Host::Ipv4(ip) => ip.is_loopback(),
                            url::Host::Ipv6(ip) => ip.is_loopback(),
                        }) =>
                {
                    problems.push(problem(
                        "azure.resource_manager",
                        format!("{value:?}: plain http would send the bearer token in clear; https (http only on loopback, for the simulator)"),
                    ))
                }
                Ok(url) if matches!(url.scheme(), "http" | "https") && url.host().is_some() => {}
                _ => problems.push(problem(
                    format!("azure.{key}"),
                    format!("{value:?} is not an http(s) URL"),
                )),
            }
        }
        if config.compute_api_version.trim().is_empty() {
            problems.push(problem(
                "azure.compute_api_version",
                "empty; Azure's compute api-version, like 2024-07-01",
            ));
        }
        if config.maintenance_api_version.trim().is_empty() {
            problems.push(problem(
                "azure.maintenance_api_version",
                "empty; the api-version of Microsoft.Maintenance/scheduledevents acknowledge, like 2023-10-01-preview",
            ));
        }
        if config.refresh < Duration::from_secs(1) || config.refresh > Duration::from_secs(3600) {
            problems.push(problem(
                "azure.refresh",
                "must be between 1s and 1h (every refresh reads each source once)",
            ));
        }
        if config.max_age < config.refresh * 2 {
            problems.push(problem(
                "azure.max_age",
                "must be at least twice refresh (a listing is refreshed every refresh)",
            ));
        }
        if config.timeout < Duration::from_secs(1) || config.timeout > Duration::from_secs(300) {
            problems.push(problem("azure.timeout", "must be between 1s and 5m"));
        }
        if config.client_id.is_some() && config.credential != Credential::ManagedIdentity {
            problems.push(problem(
                "azure.client_id",
                "names a user-assigned managed identity: only with credential = \"managed_identity\" (the others read AZURE_CLIENT_ID)",
            ));
        }
    }
}
