//! The ARM routes behind the gate: the path's segments compared without case, then the
//! listings (paged by `nextLink`), the single resources, and the acknowledge of a scheduled
//! event through a VM, a scale set or an availability set.

use std::time::Instant;

use axum::http::{Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::Arm;
use super::inventory::{self, ArmVm, Status};
use super::render;

/// The versions `Microsoft.Maintenance/scheduledevents/{id}/acknowledge` exists in.
const ACKNOWLEDGE_API_VERSIONS: &[&str] = &["2023-10-01-preview", "2025-10-01-preview"];

/// An ARM error answer: `{"error": {"code", "message"}}`.
pub(super) struct Failure {
    status: StatusCode,
    code: &'static str,
    message: String,
}

pub(super) fn failure(
    status: StatusCode,
    code: &'static str,
    message: impl Into<String>,
) -> Failure {
    Failure {
        status,
        code,
        message: message.into(),
    }
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        let body = json!({"error": {"code": self.code, "message": self.message}});
        (self.status, axum::Json(body)).into_response()
    }
}

pub(super) type Answer = Result<Value, Failure>;

/// The query's pairs; names compared without case, as ARM does.
pub(super) struct Query(pub(super) Vec<(String, String)>);

impl Query {
    pub(super) fn parse(uri: &Uri) -> Query {
        let pairs = uri.query().map(|query| {
            url::form_urlencoded::parse(query.as_bytes())
                .into_owned()
                .collect()
        });
        Query(pairs.unwrap_or_default())
    }

    pub(super) fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(key, _)| key.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.as_str())
    }

    pub(super) fn is_true(&self, name: &str) -> bool {
        self.get(name)
            .is_some_and(|v| v.eq_ignore_ascii_case("true"))
    }
}

/// What every route needs of the request.
pub(super) struct Call<'a> {
    pub(super) arm: &'a Arm,
    pub(super) query: &'a Query,
    /// `http://host` as the client reached us, for `nextLink`.
    pub(super) base: String,
    pub(super) path: &'a str,
    pub(super) now: Instant,
}

pub(super) fn route(call: &Call, method: &Method, segments: &[&str]) -> Answer {
    let lower: Vec<String> = segments.iter().map(|s| s.to_ascii_lowercase()).collect();
    let lower: Vec<&str> = lower.iter().map(String::as_str).collect();
    let Some(api_version) = call.query.get("api-version").filter(|v| !v.is_empty()) else {
        return Err(failure(
            StatusCode::BAD_REQUEST,
            "MissingApiVersionParameter",
            "The api-version query parameter (?api-version=) is required for all requests.",
        ));
    };
    let subscription = segments[1];
    if !call.arm.inventory.knows_subscription(subscription) {
        return Err(failure(
            StatusCode::NOT_FOUND,
            "SubscriptionNotFound",
            format!("The subscription '{subscription}' could not be found."),
        ));
    }
    let unrouted = || {
        failure(
            StatusCode::NOT_FOUND,
            "InvalidResourceType",
            format!("The stand-in serves no {method} {}.", call.path),
        )
    };
    match (method.clone(), lower.as_slice()) {
        (Method::GET, [_, _, "providers", "microsoft.compute", "virtualmachines"]) => {
            let vms = call.arm.inventory.subscription(subscription);
            let standalone: Vec<&ArmVm> = vms
                .into_iter()
                .filter(|vm| vm.scale_set().is_none())
                .collect();
            let status_only = call.query.is_true("statusOnly");
            let items = alive(&standalone, call.now)
                .map(|(vm, status)| {
                    if status_only {
                        render::vm_status_only(vm, status)
                    } else {
                        render::vm(vm, status, false)
                    }
                })
                .collect();
            page(call, items)
        }
        (
            Method::GET,
            [
                _,
                _,
                "resourcegroups",
                _,
                "providers",
                "microsoft.compute",
                rest @ ..,
            ],
        ) => {
            let group = call.arm.inventory.group(subscription, segments[3]);
            if group.is_empty() {
                return Err(failure(
                    StatusCode::NOT_FOUND,
                    "ResourceGroupNotFound",
                    format!("Resource group '{}' could not be found.", segments[3]),
                ));
            }
            let names = &segments[segments.len() - rest.len()..];
            read_in_group(call, &group, rest, names).unwrap_or_else(|| Err(unrouted()))
        }
        (
            Method::POST,
            [
                _,
                _,
                "resourcegroups",
                _,
                "providers",
                "microsoft.compute",
                kind,
                _,
                "providers",
                "microsoft.maintenance",
                "scheduledevents",
                _,
                "acknowledge",
            ],
        ) => {
            let group = call.arm.inventory.group(subscription, segments[3]);
            acknowledge(call, api_version, &group, kind, segments[7], segments[11])
        }
        _ => Err(unrouted()),
    }
}

/// The VMs among `vms` that exist at `now`, with their status.
fn alive<'a>(vms: &'a [&'a ArmVm], now: Instant) -> impl Iterator<Item = (&'a ArmVm, Status)> + 'a {
    vms.iter()
        .filter_map(move |vm| vm.status(now).map(|status| (*vm, status)))
}

fn not_found(kind: &str, name: &str, group: &str) -> Failure {
    failure(
        StatusCode::NOT_FOUND,
        "ResourceNotFound",
        format!(
            "The Resource 'Microsoft.Compute/{kind}/{name}' under resource group '{group}' was not found."
        ),
    )
}

/// GETs under `.../resourceGroups/{rg}/providers/Microsoft.Compute/`: `rest` is the path
/// after it in lower case, `names` the same segments as sent. `None`: no such route.
fn read_in_group(call: &Call, group: &[&ArmVm], rest: &[&str], names: &[&str]) -> Option<Answer> {
    let expand = call
        .query
        .get("$expand")
        .is_some_and(|v| v.eq_ignore_ascii_case("instanceView"));
    let group_name = &group[0].resource_group;
    let answer = match rest {
        ["virtualmachines"] => {
            let standalone: Vec<&ArmVm> = group
                .iter()
                .copied()
                .filter(|vm| vm.scale_set().is_none())
                .collect();
            let items = alive(&standalone, call.now)
                .map(|(vm, status)| render::vm(vm, status, expand))
                .collect();
            page(call, items)
        }
        ["virtualmachines", _] => inventory::standalone(group, names[1])
            .and_then(|vm| Some(render::vm(vm, vm.status(call.now)?, expand)))
            .ok_or_else(|| not_found("virtualMachines", names[1], group_name)),
        ["virtualmachinescalesets", _, tail @ ..] => {
            let members = inventory::in_scale_set(group, names[1]);
            let Some(first) = members.first() else {
                return Some(Err(not_found(
                    "virtualMachineScaleSets",
                    names[1],
                    group_name,
                )));
            };
            let name = first.scale_set().unwrap_or(names[1]);
            match tail {
                [] => {
                    let capacity = alive(&members, call.now).count();
                    Ok(render::scale_set(first, name, capacity))
                }
                ["virtualmachines"] => {
                    let items = alive(&members, call.now)
                        .map(|(vm, status)| render::vm(vm, status, expand))
                        .collect();
                    page(call, items)
                }
                ["virtualmachines", _] => members
                    .iter()
                    .find(|vm| {
                        vm.resource_id
                            .rsplit('/')
                            .next()
                            .is_some_and(|id| id.eq_ignore_ascii_case(names[3]))
                    })
                    .and_then(|vm| Some(render::vm(vm, vm.status(call.now)?, expand)))
                    .ok_or_else(|| {
                        not_found(
                            "virtualMachineScaleSets/virtualMachines",
                            &format!("{name}/{}", names[3]),
                            group_name,
                        )
                    }),
                _ => return None,
            }
        }
        ["availabilitysets", _] => {
            let members = inventory::in_availability_set(group, names[1]);
            let Some(first) = members.first() else {
                return Some(Err(not_found("availabilitySets", names[1], group_name)));
            };
            let name = first.availability_set().unwrap_or(names[1]);
            let existing: Vec<&ArmVm> = alive(&members, call.now).map(|(vm, _)| vm).collect();
            Ok(render::availability_set(first, name, &existing))
        }
        _ => return None,
    };
    Some(answer)
}

/// One page of `items`, from the `$skiptoken` of the request; `nextLink` is the same URL
/// with the next page's `$skiptoken`, absent on the last page.
fn page(call: &Call, items: Vec<Value>) -> Answer {
    let skip = match call.query.get("$skiptoken") {
        None => 0,
        Some(token) => token.parse::<usize>().map_err(|_| {
            failure(
                StatusCode::BAD_REQUEST,
                "InvalidSkipToken",
                format!("The skip token '{token}' is invalid."),
            )
        })?,
    };
    let size = call.arm.options.page_size.max(1);
    let end = skip.saturating_add(size).min(items.len());
    let value: Vec<Value> = items
        .get(skip..end)
        .map(<[Value]>::to_vec)
        .unwrap_or_default();
    let mut body = json!({"value": value});
    if end < items.len() {
        // The request's own query, in its own encoding, but for the skip token.
        let mut pairs: Vec<String> = call
            .query
            .0
            .iter()
            .filter(|(key, _)| !key.eq_ignore_ascii_case("$skiptoken"))
            .map(|(key, value)| {
                url::form_urlencoded::Serializer::new(String::new())
                    .append_pair(key, value)
                    .finish()
                    .replacen("%24", "$", 1)
            })
            .collect();
        pairs.push(format!("$skiptoken={end}"));
        body["nextLink"] = json!(format!("{}{}?{}", call.base, call.path, pairs.join("&")));
    }
    Ok(body)
}

/// `POST .../{kind}/{name}/providers/Microsoft.Maintenance/scheduledevents/{event}/acknowledge`.
fn acknowledge(
    call: &Call,
    api_version: &str,
    group: &[&ArmVm],
    kind: &str,
    name: &str,
    event_id: &str,
) -> Answer {
    if !ACKNOWLEDGE_API_VERSIONS.contains(&api_version) {
        return Err(failure(
            StatusCode::BAD_REQUEST,
            "InvalidApiVersionParameter",
            format!(
                "The api-version '{api_version}' is invalid. The supported versions are '{}'.",
                ACKNOWLEDGE_API_VERSIONS.join(",")
            ),
        ));
    }
    // Deleted VMs count: their event may be started already (a Terminate), and acknowledging
    // it again is still a success.
    let (members, kind_name): (Vec<&ArmVm>, _) = match kind {
        "virtualmachines" => (
            inventory::standalone(group, name).into_iter().collect(),
            "virtualMachines",
        ),
        "virtualmachinescalesets" => (
            inventory::in_scale_set(group, name),
            "virtualMachineScaleSets",
        ),
        "availabilitysets" => (
            inventory::in_availability_set(group, name),
            "availabilitySets",
        ),
        _ => {
            return Err(failure(
                StatusCode::NOT_FOUND,
                "InvalidResourceType",
                format!("Scheduled events cannot be acknowledged through resource type '{kind}'."),
            ));
        }
    };
    if members.is_empty() {
        let group_name = group.first().map_or("", |vm| vm.resource_group.as_str());
        return Err(not_found(kind_name, name, group_name));
    }
    let names: Vec<&str> = members.iter().map(|vm| vm.name.as_str()).collect();
    for vm in &members {
        if let Some(outcome) = vm.acknowledge(event_id, &names, call.now) {
            tracing::info!(event_id, resource = name, vm = %vm.name, ?outcome, "ARM stand-in acknowledged a scheduled event");
            return Ok(json!({"value": "Successfully Approved"}));
        }
    }
    Err(failure(
        StatusCode::NOT_FOUND,
        "NotFound",
        format!("The scheduled event '{event_id}' was not found for resource '{name}'."),
    ))
}
