//! What `sched-relay demo --fleet` plays: twelve VMs in three groups, each group's budget,
//! every VM's maintenance (one event shared by two VMs on one host), and the files a user
//! would write for it: each VM's scenario, each agent's configuration and the coordinator's.
//! The configurations are TOML, loaded by the same loaders as `sched-relay run` and
//! `sched-relay coordinate`, so the demo runs what a user writes.

use std::time::Duration;

/// A group of VMs (`<name>-1` to `<name>-<size>`) and its budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Group {
    pub name: &'static str,
    pub size: usize,
    /// The coordinator's `max_down` for it; the summary judges the simulators' record by it.
    pub max_down: usize,
}

/// Six web servers that may lose two at a time, and three databases and three caches that
/// may lose one: with an event for every VM, every group has VMs that must wait.
pub const GROUPS: [Group; 3] = [
    Group {
        name: "web",
        size: 6,
        max_down: 2,
    },
    Group {
        name: "db",
        size: 3,
        max_down: 1,
    },
    Group {
        name: "cache",
        size: 3,
        max_down: 1,
    },
];

/// How long the demo's drain takes for each VM.
pub const DRAIN_TAKES: Duration = Duration::from_secs(2);

/// One Azure event of the demo.
#[derive(Debug, Clone, PartialEq)]
pub struct Planned {
    pub id: String,
    pub event_type: &'static str,
    /// Its Resources: two VMs for the host-level event.
    pub vms: Vec<String>,
    pub appear_after: Duration,
    pub notice: Duration,
    pub duration_in_seconds: i64,
    /// How long it keeps its VMs down once started.
    pub started_for: Duration,
    /// The coordinator drains and approves it; else it waits for its NotBefore.
    pub approvable: bool,
}

impl Planned {
    /// `web-6, db-3`.
    pub fn who(&self) -> String {
        self.vms.join(", ")
    }

    /// The EventId's first group, enough to tell the demo's events apart.
    pub fn short_id(&self) -> &str {
        self.id.split('-').next().unwrap_or(&self.id)
    }
}

/// The VM names, group by group.
pub fn vms() -> Vec<String> {
    GROUPS
        .iter()
        .flat_map(|g| (1..=g.size).map(move |n| format!("{}-{n}", g.name)))
        .collect()
}

/// The group a VM name is in.
pub fn group_of(vm: &str) -> Option<&'static Group> {
    GROUPS.iter().find(|g| {
        vm.strip_prefix(g.name)
            .is_some_and(|rest| rest.starts_with('-'))
    })
}

/// The VMs sharing a host, and the event that lists both.
pub const HOST: [&str; 2] = ["web-6", "db-3"];

/// Every event: a Reboot or a Redeploy for each VM (drained, then approved), one of them a
/// host-level Reboot listing web-6 and db-3, and a Freeze on cache-2 that the coordinator
/// leaves to its NotBefore (`never`). The host-level event appears first, so that it is
/// decided alone; the Freeze's NotBefore comes after the others are done, with its
/// 5 s outage known to the coordinator all along.
pub fn events() -> Vec<Planned> {
    let id = |n: u32| format!("C0FFEE{n:02X}-DE30-4F1E-A000-0000000000{n:02X}");
    let own = |n: u32, vm: &str, event_type: &'static str| Planned {
        id: id(n),
        event_type,
        vms: vec![vm.to_owned()],
        appear_after: Duration::from_secs(3),
        notice: Duration::from_secs(300),
        duration_in_seconds: -1,
        started_for: match event_type {
            "Redeploy" => Duration::from_secs(4),
            _ => Duration::from_secs(3),
        },
        approvable: true,
    };
    let mut events: Vec<Planned> = (1..=5)
        .map(|n| own(n, &format!("web-{n}"), "Reboot"))
        .collect();
    events.push(Planned {
        appear_after: Duration::from_secs(1),
        notice: Duration::from_secs(240),
        vms: HOST.iter().map(|vm| vm.to_string()).collect(),
        ..own(6, "", "Reboot")
    });
    events.push(own(7, "db-1", "Reboot"));
    events.push(own(8, "db-2", "Redeploy"));
    events.push(own(9, "cache-1", "Reboot"));
    events.push(Planned {
        notice: Duration::from_secs(22),
        duration_in_seconds: 5,
        started_for: Duration::from_secs(5),
        approvable: false,
        ..own(10, "cache-2", "Freeze")
    });
    events.push(own(11, "cache-3", "Redeploy"));
    events
}

/// A TOML string (quoted and escaped).
fn quoted(text: &str) -> String {
    toml::Value::String(text.to_owned()).to_string()
}

/// The simulator's scenario of `vm`: its own events and the host-level one.
pub fn scenario(vm: &str, events: &[Planned]) -> String {
    let mut text = format!(
        "[vm]\nname = {}\nresource_id = {}\n",
        quoted(vm),
        quoted(&format!(
            "/subscriptions/00000000-0000-0000-0000-000000000000/resourceGroups/demo-{}/providers/Microsoft.Compute/virtualMachines/{vm}",
            group_of(vm).map_or("other", |g| g.name)
        ))
    );
    for event in events.iter().filter(|e| e.vms.iter().any(|v| v == vm)) {
        let resources: Vec<String> = event.vms.iter().map(|v| quoted(v)).collect();
        text.push_str(&format!(
            "\n[[events]]\nid = {}\ntype = {}\nresources = [{}]\nappear_after = \"{}ms\"\nnotice = \"{}ms\"\nduration_in_seconds = {}\nstarted_for = \"{}ms\"\n",
            quoted(&event.id),
            quoted(event.event_type),
            resources.join(", "),
            event.appear_after.as_millis(),
            event.notice.as_millis(),
            event.duration_in_seconds,
            event.started_for.as_millis(),
        ));
    }
    text
}

/// Where the run's messages go on NATS: names no other run uses.
#[derive(Debug, Clone)]
pub struct Names {
    pub url: String,
    /// The subjects' first token.
    pub prefix: String,
    pub events_stream: String,
    pub approvals_stream: String,
}

impl Names {
    pub fn new(url: &str, run: &str) -> Names {
        let prefix = format!("sched-relay-demo-{run}");
        let stream = format!(
            "SCHED_RELAY_DEMO_{}",
            run.to_ascii_uppercase().replace('-', "_")
        );
        Names {
            url: url.to_owned(),
            events_stream: format!("{stream}_EVENTS"),
            approvals_stream: format!("{stream}_APPROVALS"),
            prefix,
        }
    }

    pub fn events_subjects(&self) -> String {
        format!("{}.events.>", self.prefix)
    }

    pub fn approvals_subjects(&self) -> String {
        format!("{}.approvals.>", self.prefix)
    }
}

/// An agent's configuration, as `sched-relay run --config` reads it: the VM's simulated
/// metadata service, the events to JetStream, approvals from its own subject, signed by the
/// coordinator's key.
pub fn agent(names: &Names, imds: &str, state_dir: &str, public_key: &str) -> String {
    format!(
        r#"[imds]
endpoint = {imds}

[state]
dir = {state_dir}

[delivery]
shutdown_timeout = "5s"

[[sinks]]
name = "bus"
kind = "nats"
url = {url}
jetstream = true
subject = "{prefix}.events.{{vmname}}.{{transition}}"

[approvals.nats]
sink = "bus"
subject = "{prefix}.approvals.{{vmname}}"
stream = {approvals_stream}

[[approvals.keys]]
id = "demo"
algorithm = "ed25519"
public_key = {public_key}
"#,
        imds = quoted(imds),
        state_dir = quoted(state_dir),
        url = quoted(&names.url),
        prefix = names.prefix,
        approvals_stream = quoted(&names.approvals_stream),
        public_key = quoted(public_key),
    )
}

/// Where the coordinator keeps its state, listens, finds its key and drains.
pub struct CoordinatorPlaces<'a> {
    pub state_dir: &'a str,
    pub listen: std::net::SocketAddr,
    pub key_file: &'a str,
    pub drain_url: &'a str,
}

/// The coordinator's configuration, as `sched-relay coordinate --config` reads it: one
/// group per [`GROUPS`] entry with its budget, Reboots and Redeploys drained then approved,
/// Freezes left to NotBefore, and each type's outage as long as the simulator keeps a VM down
/// (3 s, 4 s) with a margin for the approval's way to the VM, so that the coordinator knows
/// how long an approval takes a VM away.
pub fn coordinator(names: &Names, places: &CoordinatorPlaces) -> String {
    let mut text = format!(
        r#"[coordinator]
source = "urn:sched-relay:coordinator:demo"
state_dir = {state_dir}
listen = "{listen}"
# /fleet, which the demo prints from, is refreshed at each tick (default 500ms).
tick = "100ms"

[input]
kind = "nats"
url = {url}
stream = {events_stream}
subject = "{prefix}.events.>"
durable = "coordinator"

[approvals]
kind = "nats"
url = {url}
subject = "{prefix}.approvals.{{vmname}}"
jetstream = true

[signing]
key_file = {key_file}
key_id = "demo"

[drain]
url = {drain_url}
margin = "30s"

[defaults]
max_down = 1
[defaults.actions]
Reboot = "drain_then_approve"
Redeploy = "drain_then_approve"
Freeze = "never"
[defaults.outage]
Reboot = "6s"
Redeploy = "8s"
"#,
        state_dir = quoted(places.state_dir),
        listen = places.listen,
        url = quoted(&names.url),
        events_stream = quoted(&names.events_stream),
        prefix = names.prefix,
        key_file = quoted(places.key_file),
        drain_url = quoted(places.drain_url),
    );
    for group in GROUPS {
        text.push_str(&format!(
            "\n[[groups]]\nname = \"{name}\"\nvm_name = \"{name}-*\"\nmax_down = {max_down}\n",
            name = group.name,
            max_down = group.max_down,
        ));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_vm_has_one_event_and_the_host_level_one_spans_two_groups() {
        let events = events();
        for vm in vms() {
            let theirs: Vec<&Planned> = events.iter().filter(|e| e.vms.contains(&vm)).collect();
            assert_eq!(theirs.len(), 1, "{vm}: {theirs:?}");
            assert!(group_of(&vm).is_some(), "{vm}");
        }
        let host: Vec<&Planned> = events.iter().filter(|e| e.vms.len() > 1).collect();
        assert_eq!(host.len(), 1);
        assert_ne!(group_of(&host[0].vms[0]), group_of(&host[0].vms[1]));
        // More events than budget in every group: some VMs must wait.
        for group in GROUPS {
            let approvable = events
                .iter()
                .filter(|e| e.approvable && e.vms.iter().any(|v| group_of(v) == Some(&group)))
                .count();
            assert!(approvable > group.max_down, "{group:?}");
        }
        assert_eq!(vms().len(), 12);
        assert_eq!(group_of("webby-1"), None);
    }

    #[test]
    fn the_scenarios_parse_and_share_the_host_level_event() {
        let events = events();
        let scenarios: Vec<crate::simulator::Scenario> = vms()
            .iter()
            .map(|vm| crate::simulator::Scenario::from_toml(&scenario(vm, &events)).unwrap())
            .collect();
        let host = &events.iter().find(|e| e.vms.len() > 1).unwrap().id;
        let listing: Vec<&str> = scenarios
            .iter()
            .filter(|s| s.events.iter().any(|e| &e.id == host))
            .map(|s| s.vm.name.as_str())
            .collect();
        assert_eq!(listing, ["web-6", "db-3"]);
    }
}
