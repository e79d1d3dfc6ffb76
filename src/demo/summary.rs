//! The demo's verdict, judged from the simulated VMs' own records (which VM was down when,
//! and which StartRequests each metadata service accepted), never from the coordinator's
//! view: approvals, events left to NotBefore, the host-level event, and the most VMs of each
//! group down at once against the group's budget.

use std::collections::BTreeSet;

use super::plan::{GROUPS, Planned, group_of};
use crate::simulator::{RecordedRequest, Snapshot};

/// What one simulated VM recorded.
pub struct VmRecord {
    pub vm: String,
    pub snapshot: Snapshot,
    pub requests: Vec<RecordedRequest>,
}

/// The most VMs of a group down at one moment.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupMost {
    pub group: &'static str,
    pub size: usize,
    pub budget: usize,
    pub most: usize,
    /// Who was down at that moment.
    pub who: Vec<String>,
}

/// The figures and what is wrong with them.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    /// Events every listed VM of which an approval started.
    pub approved: usize,
    /// StartRequests the simulated metadata services answered 200.
    pub accepted_posts: usize,
    /// Events started at their NotBefore, described.
    pub left_to_not_before: Vec<String>,
    pub host: String,
    pub groups: Vec<GroupMost>,
    /// Each a reason to exit non-zero.
    pub problems: Vec<String>,
}

/// The EventIds a StartRequest body names.
fn named(body: &str) -> Vec<String> {
    serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v["StartRequests"].as_array().cloned())
        .unwrap_or_default()
        .iter()
        .filter_map(|r| r["EventId"].as_str().map(str::to_owned))
        .collect()
}

/// Judges the run from the simulators' records and the drain hook's (`drains`: each VM it
/// was asked to drain, and when). A VM counts as down from the start of its drain to the end
/// of the downtime that follows it (a drained VM is out of service, as the budget says), and
/// for every downtime of its own. `now_us` ends what is still down.
pub fn judge(
    records: &[VmRecord],
    planned: &[Planned],
    drains: &[(String, i64)],
    now_us: i64,
) -> Summary {
    let mut problems = Vec::new();
    // Every accepted StartRequest: (the VM it went to, the EventIds it named).
    let accepted: Vec<(&str, Vec<String>)> = records
        .iter()
        .flat_map(|r| {
            r.requests
                .iter()
                .filter(|q| q.method == "POST" && q.status == Some(200))
                .map(move |q| (r.vm.as_str(), named(&q.body)))
        })
        .collect();
    let posts_for = |id: &str| -> Vec<&str> {
        accepted
            .iter()
            .filter(|(_, ids)| ids.iter().any(|i| i.eq_ignore_ascii_case(id)))
            .map(|(vm, _)| *vm)
            .collect()
    };
    // (VM, from, until, approved) of every down record of `id`.
    let downs = |id: &str| -> Vec<(&str, bool)> {
        records
            .iter()
            .flat_map(|r| {
                r.snapshot
                    .down
                    .iter()
                    .filter(move |d| d.event_id.eq_ignore_ascii_case(id))
                    .map(move |d| (r.vm.as_str(), d.approved))
            })
            .collect()
    };
    let mut approved = 0;
    let mut left_to_not_before = Vec::new();
    for event in planned {
        let down = downs(&event.id);
        let by_approval = event
            .vms
            .iter()
            .all(|vm| down.iter().any(|(v, approved)| v == vm && *approved));
        let by_not_before: Vec<&str> = down
            .iter()
            .filter(|(_, approved)| !approved)
            .map(|(vm, _)| *vm)
            .collect();
        let what = format!("{} {} {}", event.who(), event.event_type, event.short_id());
        if by_approval {
            approved += 1;
        }
        if !by_not_before.is_empty() {
            left_to_not_before.push(what.clone());
        }
        match (event.approvable, by_approval) {
            (true, false) if down.is_empty() => {
                problems.push(format!("{what} never started"));
            }
            (true, false) => problems.push(format!(
                "{what} was not started by an approval on every VM it lists (started at NotBefore on {})",
                by_not_before.join(", ")
            )),
            (false, _) if !posts_for(&event.id).is_empty() => problems.push(format!(
                "{what} was approved, but the coordinator's action for it is never"
            )),
            (false, _) if down.is_empty() => problems.push(format!("{what} never started")),
            _ => {}
        }
    }
    let host = match planned.iter().find(|e| e.vms.len() > 1) {
        None => "no host-level event".to_owned(),
        Some(event) => {
            let posts = posts_for(&event.id);
            let down = downs(&event.id);
            let started_on: Vec<&str> = event
                .vms
                .iter()
                .filter(|vm| down.iter().any(|(v, approved)| v == vm && *approved))
                .map(String::as_str)
                .collect();
            let once = posts.len() == 1 && started_on.len() == event.vms.len();
            if !once {
                problems.push(format!(
                    "the host-level {} {} on {}: {} accepted StartRequest(s) (through {}), started by it on {} of {} VMs; expected one, starting it on both",
                    event.event_type,
                    event.short_id(),
                    event.who(),
                    posts.len(),
                    posts.join(", "),
                    started_on.len(),
                    event.vms.len()
                ));
            }
            format!(
                "host-level {} {} on {}: {} ({} StartRequest{}{}), started on {}",
                event.event_type,
                event.short_id(),
                event.who(),
                if once {
                    "approved once"
                } else {
                    "NOT approved once"
                },
                posts.len(),
                if posts.len() == 1 { "" } else { "s" },
                if posts.is_empty() {
                    String::new()
                } else {
                    format!(", through {}", posts.join(", "))
                },
                if started_on.len() == event.vms.len() {
                    "both".to_owned()
                } else {
                    format!("{} of {}", started_on.len(), event.vms.len())
                }
            )
        }
    };
    let groups: Vec<GroupMost> = GROUPS
        .iter()
        .map(|group| {
            // (VM, from, until) of every down record in the group.
            let mut spans: Vec<(&str, i64, i64)> = records
                .iter()
                .filter(|r| group_of(&r.vm) == Some(group))
                .flat_map(|r| {
                    r.snapshot
                        .down
                        .iter()
                        .map(move |d| (r.vm.as_str(), d.from_us, d.until_us.unwrap_or(now_us)))
                })
                .collect();
            // Each drain, until the end of the VM's first downtime after it began (or now,
            // when none followed).
            for (vm, at) in drains.iter().filter(|(vm, _)| group_of(vm) == Some(group)) {
                let until = spans
                    .iter()
                    .filter(|(down, _, until)| *down == vm.as_str() && until >= at)
                    .map(|(_, _, until)| *until)
                    .min()
                    .unwrap_or(now_us);
                spans.push((vm.as_str(), *at, until));
            }
            let mut most = GroupMost {
                group: group.name,
                size: group.size,
                budget: group.max_down,
                most: 0,
                who: Vec::new(),
            };
            // The count only grows when a VM goes down.
            for (_, at, _) in &spans {
                let down: BTreeSet<&str> = spans
                    .iter()
                    .filter(|(_, from, until)| from <= at && at < until)
                    .map(|(vm, _, _)| *vm)
                    .collect();
                if down.len() > most.most {
                    most.most = down.len();
                    most.who = down.into_iter().map(str::to_owned).collect();
                }
            }
            if most.most > most.budget {
                problems.push(format!(
                    "group {} had {} VMs down at once ({}), over its budget of {}",
                    most.group,
                    most.most,
                    most.who.join(", "),
                    most.budget
                ));
            }
            most
        })
        .collect();
    Summary {
        approved,
        accepted_posts: accepted.len(),
        left_to_not_before,
        host,
        groups,
        problems,
    }
}

impl Summary {
    /// The summary as printed.
    pub fn lines(&self) -> Vec<String> {
        let mut lines = vec![
            "Summary, from the simulated VMs' own record of who was down when and the drain hook's of whom it drained (a VM counts as down from its drain's start):".to_owned(),
            format!(
                "  approvals: {} events started by the coordinator's approval, before their NotBefore ({} StartRequests accepted)",
                self.approved, self.accepted_posts
            ),
            format!(
                "  left to NotBefore: {}{}",
                self.left_to_not_before.len(),
                if self.left_to_not_before.is_empty() {
                    String::new()
                } else {
                    format!(
                        " ({}: not approved, Azure started it at its NotBefore)",
                        self.left_to_not_before.join("; ")
                    )
                }
            ),
            format!("  {}", self.host),
        ];
        for group in &self.groups {
            lines.push(format!(
                "  group {}: at most {} of {} VMs down at once{}, budget {}",
                group.group,
                group.most,
                group.size,
                if group.who.is_empty() {
                    String::new()
                } else {
                    format!(" ({})", group.who.join(", "))
                },
                group.budget
            ));
        }
        lines
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simulator::DownRecord;

    fn record(vm: &str, downs: &[(&str, i64, i64, bool)], posts: &[&str]) -> VmRecord {
        VmRecord {
            vm: vm.to_owned(),
            snapshot: Snapshot {
                incarnation: 1,
                last_served_incarnation: Some(1),
                phases: Vec::new(),
                finished: true,
                started_unix_us: 0,
                started: Vec::new(),
                down: downs
                    .iter()
                    .map(|(id, from, until, approved)| DownRecord {
                        event_id: (*id).to_owned(),
                        event_type: "Reboot".into(),
                        from_us: *from,
                        until_us: Some(*until),
                        approved: *approved,
                        not_before_us: None,
                    })
                    .collect(),
            },
            requests: posts
                .iter()
                .map(|id| RecordedRequest {
                    at_ms: 0,
                    unix_us: 0,
                    method: "POST".into(),
                    path: "/metadata/scheduledevents".into(),
                    api_version: None,
                    metadata: Some("true".into()),
                    body: format!("{{\"StartRequests\":[{{\"EventId\":\"{id}\"}}]}}"),
                    status: Some(200),
                })
                .collect(),
        }
    }

    /// Every event started one after the other, each by its own approval, the Freeze at
    /// its NotBefore; `overlap` puts web-1..web-3 down together.
    fn run(overlap: bool, host_posts: usize) -> Summary {
        run_with_drains(overlap, host_posts, &[])
    }

    /// The same, with the drain hook's record.
    fn run_with_drains(overlap: bool, host_posts: usize, drains: &[(&str, i64)]) -> Summary {
        let planned = super::super::plan::events();
        let mut records = Vec::new();
        for vm in super::super::plan::vms() {
            let event = planned.iter().find(|e| e.vms.contains(&vm)).unwrap();
            let n = i64::from_str_radix(&event.id[6..8], 16).unwrap();
            let from = if overlap && ["web-1", "web-2", "web-3"].contains(&vm.as_str()) {
                100
            } else {
                n * 1_000
            };
            let posts: Vec<&str> = if !event.approvable || (event.vms.len() > 1 && vm != "web-6") {
                Vec::new()
            } else if event.vms.len() > 1 {
                vec![event.id.as_str(); host_posts]
            } else {
                vec![event.id.as_str()]
            };
            records.push(record(
                &vm,
                &[(event.id.as_str(), from, from + 500, event.approvable)],
                &posts,
            ));
        }
        let drains: Vec<(String, i64)> = drains
            .iter()
            .map(|(vm, at)| ((*vm).to_owned(), *at))
            .collect();
        judge(&records, &planned, &drains, 1_000_000)
    }

    #[test]
    fn a_vm_being_drained_counts_against_its_groups_budget() {
        // Each web VM is down for 500 µs at its own time; web-2 and web-3 are drained while
        // web-1 is down, long before their own downtimes: three out of service at once.
        let planned = super::super::plan::events();
        let down_at = |vm: &str| {
            let event = planned
                .iter()
                .find(|e| e.vms.contains(&vm.to_owned()))
                .unwrap();
            i64::from_str_radix(&event.id[6..8], 16).unwrap() * 1_000
        };
        let web_1 = down_at("web-1");
        assert!(down_at("web-2") > web_1 + 500 && down_at("web-3") > web_1 + 500);
        let summary = run_with_drains(false, 1, &[("web-2", web_1 + 100), ("web-3", web_1 + 200)]);
        assert_eq!(summary.groups[0].most, 3, "{:?}", summary.groups);
        assert_eq!(summary.groups[0].who, ["web-1", "web-2", "web-3"]);
        assert!(
            summary
                .problems
                .iter()
                .any(|p| p.contains("over its budget of 2")),
            "{:?}",
            summary.problems
        );
        // A drain that starts as the VM's group has room is no problem.
        let summary = run_with_drains(false, 1, &[("web-2", down_at("web-2") - 100)]);
        assert_eq!(summary.problems, Vec::<String>::new());
    }

    #[test]
    fn a_run_within_budget_is_summed_up_without_problems() {
        let summary = run(false, 1);
        assert_eq!(summary.problems, Vec::<String>::new());
        assert_eq!((summary.approved, summary.accepted_posts), (10, 10));
        assert_eq!(summary.left_to_not_before, ["cache-2 Freeze C0FFEE0A"]);
        assert!(
            summary
                .host
                .contains("approved once (1 StartRequest, through web-6), started on both"),
            "{}",
            summary.host
        );
        assert!(
            summary.groups.iter().all(|g| g.most == 1),
            "{:?}",
            summary.groups
        );
        let lines = summary.lines().join("\n");
        assert!(
            lines.contains("  group web: at most 1 of 6 VMs down at once"),
            "{lines}"
        );
    }

    #[test]
    fn three_web_vms_down_at_once_and_a_host_event_approved_twice_are_problems() {
        let summary = run(true, 2);
        assert_eq!(summary.groups[0].most, 3);
        assert_eq!(summary.groups[0].who, ["web-1", "web-2", "web-3"]);
        assert_eq!(summary.problems.len(), 2, "{:?}", summary.problems);
        assert!(
            summary.problems[0].contains("2 accepted StartRequest(s)"),
            "{:?}",
            summary.problems
        );
        assert!(
            summary.problems[1].contains("over its budget of 2"),
            "{:?}",
            summary.problems
        );
    }
}
