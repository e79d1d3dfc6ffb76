//! `/fleet` as served: written straight from what the engine holds into one buffer, not
//! through a tree of JSON values (benches/profiling.md, section 29), it must say what the
//! tree said, part for part: here against the tree built from the same state (its parts
//! kept between refreshes: `fleet_parts.rs`).

use serde_json::json;

use super::azure::{BATCH, azure_world, listed};
use super::{document, published, t0};
use crate::coordinator::fleet::Pause;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fleet_json_says_what_the_engines_state_says_part_for_part() {
    let config = format!("{BATCH}\n[fleet]\nmax_down = 2\n");
    let mut world = azure_world(&config);
    let reboot = document(2, &[("E1", "Reboot", "Scheduled", &["batch-0"], 3600, -1)]);
    for event in published("batch-0", Some(&document(1, &[])), &reboot) {
        world.deliver(&event, t0());
    }
    world.beat("batch-0", t0(), t0(), &["E1"]);
    world.engine.azure_listed(
        listed(&[("batch-0", "running"), ("batch-1", "deallocated")]),
        t0(),
    );
    world.engine.tick(t0());
    world.settle().await;
    world.engine.fleet.paused = Some(Pause {
        at: t0(),
        reason: "a test".into(),
    });
    world
        .engine
        .fleet
        .note_conflict("batch-9", "two agents, one name");
    // Late enough that batch-0's agent is silent (the flag is the moment's, not stored);
    // batch-2's beats then.
    let later = t0() + chrono::Duration::hours(2);
    world.beat("batch-2", later, later, &[]);
    world.engine.publish_snapshot(later);
    let shown = world.engine.fleet_json();

    // The tree as the engine built it before, from the same state.
    let fleet = &world.engine.fleet;
    let policy = world.engine.policy();
    let budgets = crate::coordinator::policy::usage(fleet, policy, later);
    let view = world.engine.azure.as_ref().unwrap();
    let expected = json!({
        "time": later.to_rfc3339(),
        "dryRun": false,
        "paused": fleet.paused,
        "caughtUp": true,
        "conflicts": fleet.conflicts,
        "groups": budgets.groups,
        "fleet": budgets.fleet,
        "vms": fleet.vms().iter().map(|(name, vm)| {
            let mut value = json!(vm);
            value["silent"] = json!(vm.silent(later, policy.silent_after));
            (name.clone(), value)
        }).collect::<serde_json::Map<_, _>>(),
        "events": fleet.events.values().collect::<Vec<_>>(),
        "azure": {
            "complete": view.complete,
            "clash": fleet.azure_clash(),
            "sources": view.sources,
            "warnings": view.warnings,
            "vms": fleet.azure(),
        },
    });
    assert_eq!(shown, expected);
    // Each part is there to compare, not null on both sides.
    assert_eq!(shown["vms"]["batch-0"]["silent"], true, "{shown}");
    assert_eq!(shown["vms"]["batch-2"]["silent"], false, "{shown}");
    assert_eq!(shown["paused"]["reason"], "a test", "{shown}");
    assert_eq!(shown["conflicts"]["batch-9"], "two agents, one name");
    assert_eq!(shown["fleet"]["limit"], 2, "{shown}");
    assert_eq!(shown["events"][0]["event_id"], "E1", "{shown}");
    assert_eq!(shown["azure"]["vms"]["batch-1"]["power"], "deallocated");
    assert_eq!(
        shown["azure"]["sources"][0]["source"],
        "/subscriptions/s/resourceGroups/rg-batch"
    );
    // As written: the top level's keys in the order they always had, and each VM's
    // `silent` once (a field of the VM's own named so would be written twice; a group's
    // `silent` is a list).
    let body = world.engine.snapshot.read().unwrap().clone();
    let Keys(keys) = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        keys,
        [
            "azure",
            "caughtUp",
            "conflicts",
            "dryRun",
            "events",
            "fleet",
            "groups",
            "paused",
            "time",
            "vms"
        ]
    );
    let text = std::str::from_utf8(&body).unwrap();
    let flags = text
        .match_indices(r#""silent":"#)
        .filter(|(at, key)| !text[at + key.len()..].starts_with('['))
        .count();
    assert_eq!(flags, fleet.vms().len(), "{text}");
}

/// An object's keys, in the order they were written.
struct Keys(Vec<String>);

impl<'de> serde::Deserialize<'de> for Keys {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct InOrder;
        impl<'de> serde::de::Visitor<'de> for InOrder {
            type Value = Keys;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Keys, A::Error> {
                let mut keys = Vec::new();
                while let Some(key) = map.next_key::<String>()? {
                    map.next_value::<serde::de::IgnoredAny>()?;
                    keys.push(key);
                }
                Ok(Keys(keys))
            }
        }
        deserializer.deserialize_map(InOrder)
    }
}
