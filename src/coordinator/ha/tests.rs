//! The lease and the fenced state against the machine's real NATS: a stalled instance
//! woken after another took over writes nothing; a release deletes only its own lease; a
//! renewal whose answer was lost does not end the instance; a standby tries for a released
//! lease every 250 ms.

use std::time::Duration;

use sched_relay_transport::testing::{broker_available, unique};

use super::state::FENCED;
use super::{Ha, KvState};
use crate::coordinator::changes::Changes;
use crate::coordinator::config::HaConfig;
use crate::coordinator::fleet::Maintenance;

const NATS: &str = "127.0.0.1:4222";

fn config(bucket: &str, instance: &str) -> HaConfig {
    HaConfig {
        url: "nats://127.0.0.1:4222".into(),
        credentials_file: None,
        bucket: bucket.into(),
        lease: Some(Duration::from_secs(3)),
        instance: Some(instance.into()),
        replicas: 1,
    }
}

/// A change that records event `key` (its content does not matter here).
fn event(key: &str) -> Changes {
    let m: Maintenance = serde_json::from_value(serde_json::json!({
        "event_id": key, "event_type": "Reboot", "event_source": null, "duration_seconds": -1,
        "not_before": null, "resources": ["web-1"], "first_seen": "2026-11-27T10:00:00Z",
        "last_report": "2026-11-27T10:00:00Z", "reports": {}, "drain": null, "approval": null
    }))
    .unwrap();
    Changes {
        events: vec![(key.to_owned(), Some(m))],
        ..Changes::default()
    }
}

async fn delete_buckets(bucket: &str) {
    let js =
        async_nats::jetstream::new(async_nats::connect("nats://127.0.0.1:4222").await.unwrap());
    for name in [
        bucket.to_owned(),
        format!("{bucket}-seen"),
        format!("{bucket}-lease"),
    ] {
        let _ = js.delete_stream(format!("KV_{name}")).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_instance_woken_after_a_takeover_cannot_overwrite_the_active_ones_state() {
    if !broker_available("NATS", NATS, "nats-server -a 127.0.0.1 -p 4222 -js") {
        return;
    }
    let bucket = unique("fence");
    let a = Ha::connect(&config(&bucket, "a"), Duration::from_secs(3600))
        .await
        .unwrap();
    let b = Ha::connect(&config(&bucket, "b"), Duration::from_secs(3600))
        .await
        .unwrap();
    let (old, new): (KvState, KvState) = (a.state_without_lease(), b.state_without_lease());
    old.load().unwrap();
    old.write(&event("E1")).unwrap();
    // `old` stalls; `new` takes over, reads everything and decides.
    new.load().unwrap();
    new.write(&event("E2")).unwrap();
    // Woken, `old` acts on what it decided before: refused.
    let refused = old.write(&event("E3")).unwrap_err();
    assert!(refused.starts_with(FENCED), "{refused}");
    // A write of the stalled one that lands after the new one read the state makes the
    // new one's next write fail instead: it reads again, and knows it.
    let again = b.state_without_lease();
    let loaded = again.load().unwrap();
    assert!(loaded.events.contains_key("E1") && loaded.events.contains_key("E2"));
    assert!(!loaded.events.contains_key("E3"));
    let late = a.state_without_lease();
    late.load().unwrap();
    late.write(&event("E4")).unwrap();
    assert!(again.write(&event("E5")).unwrap_err().starts_with(FENCED));
    let reloaded = again.load().unwrap();
    assert!(reloaded.events.contains_key("E4"));
    again.write(&event("E5")).unwrap();
    assert!(late.write(&event("E6")).unwrap_err().starts_with(FENCED));
    // With the lease check, an instance whose lease is not fresh writes nothing at all.
    let gated = a.state();
    gated.load().unwrap();
    assert!(!a.may_act());
    assert!(gated.write(&event("E7")).unwrap_err().starts_with(FENCED));
    a.acquire().await;
    gated.write(&event("E7")).unwrap();
    delete_buckets(&bucket).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_deletes_only_the_lease_this_instance_wrote() {
    if !broker_available("NATS", NATS, "nats-server -a 127.0.0.1 -p 4222 -js") {
        return;
    }
    let bucket = unique("release");
    let a = Ha::connect(&config(&bucket, "a"), Duration::from_secs(3600))
        .await
        .unwrap();
    // Its own lease, released at a planned stop: gone at once.
    a.acquire().await;
    a.release().await;
    assert_eq!(a.lease.get("leader").await.unwrap(), None);
    a.acquire().await;
    // Someone else holds the key now (a takeover this instance did not see).
    a.lease.put("leader", "b".into()).await.unwrap();
    a.release().await;
    let holder = a.lease.get("leader").await.unwrap();
    assert_eq!(holder.as_deref(), Some(b"b".as_slice()));
    delete_buckets(&bucket).await;
}

/// With the default lease (8 s) a standby tries for the lease every 250 ms: released at
/// five phases of its rhythm, 200 ms apart, the lease is taken at the next try, within
/// 600 ms (a quarter second, and the rest for a loaded machine), where a rhythm of a
/// second would leave it free 950 and 750 ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_tries_for_the_lease_every_quarter_second() {
    if !broker_available("NATS", NATS, "nats-server -a 127.0.0.1 -p 4222 -js") {
        return;
    }
    let bucket = unique("takeover");
    let shipped = |instance: &str| HaConfig {
        lease: None,
        ..config(&bucket, instance)
    };
    let mut holder = Ha::connect(&shipped("a"), Duration::from_secs(3600))
        .await
        .unwrap();
    let mut standby = Ha::connect(&shipped("b"), Duration::from_secs(3600))
        .await
        .unwrap();
    holder.acquire().await;
    let mut free_for = Vec::new();
    for phase in 0..5 {
        let waiting = tokio::spawn({
            let standby = standby.clone();
            async move {
                standby.acquire().await;
                std::time::Instant::now()
            }
        });
        tokio::time::sleep(Duration::from_millis(1050 + 200 * phase)).await;
        let released = std::time::Instant::now();
        holder.release().await;
        free_for.push(waiting.await.unwrap() - released);
        std::mem::swap(&mut holder, &mut standby);
    }
    let longest = free_for.iter().max().unwrap();
    assert!(*longest < Duration::from_millis(600), "{free_for:?}");
    delete_buckets(&bucket).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_whose_answer_was_lost_is_recognised_and_the_instance_stays_active() {
    if !broker_available("NATS", NATS, "nats-server -a 127.0.0.1 -p 4222 -js") {
        return;
    }
    let bucket = unique("renew");
    let a = Ha::connect(&config(&bucket, "a"), Duration::from_secs(3600))
        .await
        .unwrap();
    let revision = a.acquire().await;
    // The server wrote a renewal of ours whose answer never came back: the key is ours,
    // at a revision this instance does not know.
    a.lease
        .put("leader", a.holder.clone().into())
        .await
        .unwrap();
    let keeper = tokio::spawn(a.clone().keep(revision));
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(!keeper.is_finished(), "the instance stopped");
    assert!(a.may_act());
    // Another process's key ends it, even one configured with the same name.
    a.lease
        .put("leader", "a#0000000000000001".into())
        .await
        .unwrap();
    let why = tokio::time::timeout(Duration::from_secs(5), keeper)
        .await
        .unwrap()
        .unwrap();
    assert!(why.contains("held by a#0000000000000001"), "{why}");
    delete_buckets(&bucket).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forgotten_event_leaves_nothing_in_the_state_stream_for_a_takeover_to_read() {
    if !broker_available("NATS", NATS, "nats-server -a 127.0.0.1 -p 4222 -js") {
        return;
    }
    let bucket = unique("forget");
    let a = Ha::connect(&config(&bucket, "a"), Duration::from_secs(3600))
        .await
        .unwrap();
    let state = a.state_without_lease();
    state.load().unwrap();
    state.write(&event("E1")).unwrap();
    state.write(&event("E2")).unwrap();
    state
        .write(&Changes {
            events: vec![("E1".to_owned(), None)],
            ..Changes::default()
        })
        .unwrap();
    let mut stream = a.js.get_stream(format!("KV_{bucket}")).await.unwrap();
    let info = stream.info().await.unwrap();
    // E2 alone: E1's value and its delete marker are gone.
    assert_eq!(info.state.messages, 1, "{:?}", info.state);
    // The fence still holds its place: the next write expects the last sequence.
    state.write(&event("E3")).unwrap();
    let loaded = a.state_without_lease().load().unwrap();
    assert!(!loaded.events.contains_key("E1"));
    assert!(loaded.events.contains_key("E2") && loaded.events.contains_key("E3"));
    delete_buckets(&bucket).await;
}

/// An instance whose configuration sets no lease uses the period of the lease bucket it
/// finds (made by an earlier default, say), one that sets another is refused with both
/// periods, a bucket made without one gets the default's, and a bucket whose keys never
/// expire is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_without_a_lease_of_its_own_uses_the_buckets_and_one_with_another_is_refused() {
    if !broker_available("NATS", NATS, "nats-server -a 127.0.0.1 -p 4222 -js") {
        return;
    }
    let forget_after = Duration::from_secs(3600);
    let bucket = unique("period");
    let made = Ha::connect(&config(&bucket, "a"), forget_after)
        .await
        .unwrap();
    assert_eq!(made.period, Duration::from_secs(3));
    let unset = HaConfig {
        lease: None,
        ..config(&bucket, "b")
    };
    let adopted = Ha::connect(&unset, forget_after).await.unwrap();
    assert_eq!(
        adopted.period,
        Duration::from_secs(3),
        "the bucket's period"
    );
    let other = HaConfig {
        lease: Some(Duration::from_secs(4)),
        ..config(&bucket, "c")
    };
    let refused = Ha::connect(&other, forget_after).await.err().unwrap();
    assert!(
        refused.contains("keeps keys for 3s") && refused.contains("expects 4s"),
        "{refused}"
    );
    delete_buckets(&bucket).await;

    let fresh = unique("period");
    let unset = HaConfig {
        lease: None,
        ..config(&fresh, "a")
    };
    let made = Ha::connect(&unset, forget_after).await.unwrap();
    assert_eq!(made.period, crate::coordinator::config::default_lease());
    let js =
        async_nats::jetstream::new(async_nats::connect("nats://127.0.0.1:4222").await.unwrap());
    let mut stream = js.get_stream(format!("KV_{fresh}-lease")).await.unwrap();
    assert_eq!(
        stream.info().await.unwrap().config.max_age,
        crate::coordinator::config::default_lease()
    );
    delete_buckets(&fresh).await;

    // A lease bucket made by hand without a TTL would keep the lease for ever.
    let by_hand = unique("period");
    // As `nats kv add` lays it out (the client's create_key_value asks this machine's
    // server for account information in a form it does not answer).
    js.create_stream(async_nats::jetstream::stream::Config {
        name: format!("KV_{by_hand}-lease"),
        subjects: vec![format!("$KV.{by_hand}-lease.>")],
        max_messages_per_subject: 1,
        allow_rollup: true,
        deny_delete: true,
        ..Default::default()
    })
    .await
    .unwrap();
    let unset = HaConfig {
        lease: None,
        ..config(&by_hand, "a")
    };
    let refused = Ha::connect(&unset, forget_after).await.err().unwrap();
    assert!(refused.contains("outside the 2s..5m"), "{refused}");
    delete_buckets(&by_hand).await;
}
