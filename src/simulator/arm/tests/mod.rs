//! The ARM stand-in over real TCP, as a coordinator's client meets it: tokens and their
//! refusals, paging by `nextLink`, power states that follow the VMs' simulated lives, an
//! acknowledge that starts an event on every VM that lists it, 404s, 429s, policies and
//! availability sets, and the starts it refuses. This file holds the fleet they run on;
//! `access` tests the gate, `views` what ARM shows, `acknowledge` the approvals.

mod access;
mod acknowledge;
mod views;

use reqwest::header::HeaderMap;
use serde_json::Value;

use super::{ArmError, ArmOptions, ArmStandIn};
use crate::simulator::{Scenario, Simulator, Snapshot};

pub(super) const SUB: &str = "11111111-2222-3333-4444-555555555555";
pub(super) const VERSION: &str = "api-version=2024-07-01";
pub(super) const ACK_VERSION: &str = "api-version=2023-10-01-preview";

/// A scale-set VM `web_{n}` of scale set `web` in resource group `rg`, then `more` TOML.
pub(super) fn web(n: usize, more: &str) -> String {
    format!(
        "[vm]\nname = 'web_{n}'\nresource_id = '/subscriptions/{SUB}/resourceGroups/rg/providers/Microsoft.Compute/virtualMachineScaleSets/web/virtualMachines/{n}'\n{more}"
    )
}

/// A standalone VM `name` in resource group `rg`; `vm_keys` go in its `[vm]` table.
pub(super) fn standalone(name: &str, vm_keys: &str, more: &str) -> String {
    format!(
        "[vm]\nname = '{name}'\nresource_id = '/subscriptions/{SUB}/resourceGroups/rg/providers/Microsoft.Compute/virtualMachines/{name}'\n{vm_keys}\n{more}"
    )
}

/// A Reboot `id` listing `vms`, appearing at once, starting after `notice`.
pub(super) fn reboot(id: &str, vms: &[&str], notice: &str, started_for: &str) -> String {
    format!(
        "[[events]]\nid = '{id}'\ntype = 'Reboot'\nresources = {vms:?}\nnotice = '{notice}'\nstarted_for = '{started_for}'\n"
    )
}

pub(super) struct Fleet {
    pub(super) vms: Vec<Simulator>,
    pub(super) arm: ArmStandIn,
    pub(super) http: reqwest::Client,
}

pub(super) struct Reply {
    pub(super) status: u16,
    pub(super) headers: HeaderMap,
    pub(super) body: Value,
}

impl Reply {
    pub(super) fn code(&self) -> &str {
        self.body["error"]["code"].as_str().unwrap_or_default()
    }
    pub(super) fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
    }
}

pub(super) async fn fleet(scenarios: &[String], options: ArmOptions) -> Fleet {
    let scenarios = scenarios
        .iter()
        .map(|text| Scenario::from_toml(text).unwrap())
        .collect();
    let listen = "127.0.0.1:0".parse().unwrap();
    let vms = Simulator::start_fleet(scenarios, listen).await.unwrap();
    let handles: Vec<&Simulator> = vms.iter().collect();
    let arm = ArmStandIn::start(&handles, listen, options).await.unwrap();
    crate::install_crypto_provider();
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    Fleet { vms, arm, http }
}

pub(super) async fn reply(response: reqwest::Response) -> Reply {
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let bytes = response.bytes().await.unwrap();
    let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    Reply {
        status,
        headers,
        body,
    }
}

impl Fleet {
    pub(super) async fn token(&self) -> String {
        let url = format!(
            "{}?api-version=2019-08-01&resource=https://management.azure.com/",
            self.arm.token_url()
        );
        let answer = reply(
            self.http
                .get(url)
                .header("Metadata", "true")
                .send()
                .await
                .unwrap(),
        )
        .await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        answer.body["access_token"].as_str().unwrap().to_owned()
    }

    /// GETs `target` (a path and query, or an absolute `nextLink`) with `token` as bearer.
    pub(super) async fn get(&self, target: &str, token: Option<&str>) -> Reply {
        let url = if target.starts_with("http") {
            target.to_owned()
        } else {
            format!("{}{target}", self.arm.url())
        };
        let mut request = self.http.get(url);
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        reply(request.send().await.unwrap()).await
    }

    pub(super) async fn post(&self, target: &str, token: &str) -> Reply {
        let url = format!("{}{target}", self.arm.url());
        reply(self.http.post(url).bearer_auth(token).send().await.unwrap()).await
    }

    pub(super) async fn sim_state(&self, vm: usize) -> Snapshot {
        let url = format!("{}/__sim/state", self.vms[vm].url());
        let bytes = self
            .http
            .get(url)
            .send()
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap();
        serde_json::from_slice(&bytes).unwrap()
    }

    pub(super) async fn stop(self) {
        self.arm.stop().await;
        for vm in self.vms {
            vm.stop().await;
        }
    }
}

pub(super) fn scale_set_path(tail: &str) -> String {
    format!(
        "/subscriptions/{SUB}/resourceGroups/rg/providers/Microsoft.Compute/virtualMachineScaleSets/web{tail}"
    )
}

pub(super) fn acknowledge_path(resource: &str, event: &str, version: &str) -> String {
    format!(
        "/subscriptions/{SUB}/resourcegroups/rg/providers/Microsoft.Compute/{resource}/providers/Microsoft.Maintenance/scheduledevents/{event}/acknowledge?{version}"
    )
}

/// The provisioning and power codes of an instance view.
pub(super) fn codes(instance_view: &Value) -> Vec<String> {
    instance_view["statuses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["code"].as_str().unwrap().to_owned())
        .collect()
}
