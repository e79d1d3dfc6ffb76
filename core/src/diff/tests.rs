//! The diff rules one by one, and properties over random documents that follow Azure's life
//! cycle (and over renumbered ones, as after incarnation resets).

use super::*;
use proptest::prelude::*;
use serde_json::json;
use std::collections::HashMap;

fn document(incarnation: u64, events: &[(&str, &str, &str)]) -> Document {
    let events: Vec<_> = events
        .iter()
        .map(|(id, status, not_before)| {
            json!({"EventId": id, "EventStatus": status, "EventType": "Reboot",
                   "Resources": ["vm0"], "NotBefore": not_before})
        })
        .collect();
    Document::from_value(json!({"DocumentIncarnation": incarnation, "Events": events}))
        .unwrap()
        .document
}

fn kinds(transitions: &[Transition]) -> Vec<(String, TransitionKind)> {
    transitions
        .iter()
        .map(|t| (t.event.id.clone(), t.kind))
        .collect()
}

#[test]
fn event_seen_first_as_started_yields_started_only() {
    let transitions = diff(None, &document(10, &[("hw", "Started", "")]));
    assert_eq!(
        kinds(&transitions),
        [("hw".into(), TransitionKind::Started)]
    );
    assert_eq!(transitions[0].previous_status, None);
}

#[test]
fn start_with_a_cleared_not_before_is_started_not_updated() {
    let before = document(2, &[("e", "Scheduled", "Mon, 11 Apr 2022 22:26:58 GMT")]);
    let after = document(3, &[("e", "Started", "")]);
    let transitions = diff(Some(&before), &after);
    assert_eq!(kinds(&transitions), [("e".into(), TransitionKind::Started)]);
    assert_eq!(transitions[0].previous_status, Some(EventStatus::Scheduled));
}

#[test]
fn disappearance_is_completed_after_started_and_cancelled_before() {
    let before = document(5, &[("a", "Started", ""), ("b", "Scheduled", "x")]);
    let transitions = diff(Some(&before), &document(6, &[]));
    assert_eq!(
        kinds(&transitions),
        [
            ("a".into(), TransitionKind::Completed),
            ("b".into(), TransitionKind::Cancelled)
        ]
    );
    assert_eq!(transitions[0].id(), "a:completed");
}

#[test]
fn updated_ids_carry_the_incarnation() {
    let before = document(8, &[("e", "Scheduled", "Mon, 19 Sep 2016 18:29:47 GMT")]);
    let after = document(9, &[("e", "Scheduled", "Mon, 19 Sep 2016 18:45:00 GMT")]);
    let transitions = diff(Some(&before), &after);
    assert_eq!(transitions[0].id(), "e:updated:9");
}

#[test]
fn a_reset_incarnation_with_new_content_is_diffed_not_skipped() {
    // Azure restarted its numbering on the very number the agent stored.
    let before = document(1, &[]);
    let after = document(1, &[("e", "Scheduled", "x")]);
    let transitions = diff(Some(&before), &after);
    assert_eq!(
        kinds(&transitions),
        [("e".into(), TransitionKind::Scheduled)]
    );
    let started = document(1, &[("e", "Started", "")]);
    let transitions = diff(Some(&after), &started);
    assert_eq!(kinds(&transitions), [("e".into(), TransitionKind::Started)]);
}

#[test]
fn the_same_incarnation_with_the_same_content_yields_nothing() {
    let before = document(4, &[("e", "Scheduled", "x")]);
    assert!(diff(Some(&before), &before.clone()).is_empty());
}

#[test]
fn updated_ids_after_a_reset_carry_the_epoch() {
    let before = document(8, &[("e", "Scheduled", "Mon, 19 Sep 2016 18:29:47 GMT")]);
    let after = document(8, &[("e", "Scheduled", "Mon, 19 Sep 2016 18:45:00 GMT")]);
    let observation = Observation {
        epoch: 2,
        ..Observation::at(chrono::Utc::now())
    };
    let transitions = diff_observed(Some(&before), &after, &observation);
    assert_eq!(transitions[0].id(), "e:updated:8~e2");
    assert_eq!(diff(Some(&before), &after)[0].id(), "e:updated:8");
}

/// 2016-09-19T18:29:47Z, the NotBefore of the documents below, and moments around it.
fn at(time: &str) -> chrono::DateTime<chrono::Utc> {
    format!("2016-09-19T{time}Z").parse().unwrap()
}

const NOT_BEFORE: &str = "Mon, 19 Sep 2016 18:29:47 GMT";

#[test]
fn an_event_that_vanishes_after_its_not_before_probably_started_unobserved() {
    let before = document(2, &[("e", "Scheduled", NOT_BEFORE)]);
    let transitions = diff_observed(
        Some(&before),
        &document(3, &[]),
        &Observation::at(at("18:40:00")),
    );
    assert_eq!(
        kinds(&transitions),
        [("e".into(), TransitionKind::Cancelled)]
    );
    assert_eq!(transitions[0].unobserved, Some(Unobserved::NotBeforePassed));
}

#[test]
fn an_event_this_agent_approved_that_vanishes_probably_started_unobserved() {
    let before = document(2, &[("E1", "Scheduled", NOT_BEFORE)]);
    let approved = ["e1".to_owned()]; // as a .NET Guid spells it
    let observation = Observation {
        approved: &approved,
        ..Observation::at(at("18:20:00"))
    };
    let transitions = diff_observed(Some(&before), &document(3, &[]), &observation);
    assert_eq!(
        kinds(&transitions),
        [("E1".into(), TransitionKind::Cancelled)]
    );
    assert_eq!(
        transitions[0].unobserved,
        Some(Unobserved::ApprovedByThisAgent)
    );
}

#[test]
fn a_cancellation_before_not_before_of_an_unapproved_event_is_just_cancelled() {
    let before = document(2, &[("e", "Scheduled", NOT_BEFORE), ("s", "Started", "")]);
    let other = ["other".to_owned()];
    let observation = Observation {
        approved: &other,
        ..Observation::at(at("18:20:00"))
    };
    let transitions = diff_observed(Some(&before), &document(3, &[]), &observation);
    assert_eq!(transitions[0].kind, TransitionKind::Cancelled);
    assert_eq!(transitions[0].unobserved, None);
    assert_eq!(transitions[1].kind, TransitionKind::Completed);
    assert_eq!(
        transitions[1].unobserved, None,
        "a seen start needs no mark"
    );
    // Nor does a plain diff judge, and an event without NotBefore never counts as past it.
    let late = Observation::at(at("23:00:00"));
    assert_eq!(diff(Some(&before), &document(3, &[]))[0].unobserved, None);
    let no_time = document(2, &[("e", "Scheduled", "")]);
    assert_eq!(
        diff_observed(Some(&no_time), &document(3, &[]), &late)[0].unobserved,
        None
    );
}

// --- properties -------------------------------------------------------------------

/// Where one Azure event is in its documented life cycle at one incarnation.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Phase {
    Absent,
    Scheduled(u8),
    Started(u8),
    Gone,
}

/// Random sequences of documents in which every event follows Azure's life cycle:
/// absent -> (Scheduled, possibly with NotBefore updates) -> Started -> gone, with the
/// scheduled phase skippable (host failure) and the started phase skippable (cancelled).
fn lifecycle_documents() -> impl Strategy<Value = Vec<Document>> {
    (1usize..5, 1usize..12)
        .prop_flat_map(|(event_count, steps)| {
            proptest::collection::vec(proptest::collection::vec(0u8..5, event_count), steps)
        })
        .prop_map(|moves| {
            let events = moves[0].len();
            let mut phases = vec![Phase::Absent; events];
            let mut documents = Vec::new();
            for (step, choices) in moves.iter().enumerate() {
                for (phase, choice) in phases.iter_mut().zip(choices) {
                    *phase = match (*phase, choice) {
                        (Phase::Absent, 1) => Phase::Scheduled(0),
                        (Phase::Absent, 2) => Phase::Started(0),
                        (Phase::Scheduled(n), 1) => Phase::Scheduled(n + 1),
                        (Phase::Scheduled(_), 2) => Phase::Started(0),
                        (Phase::Scheduled(_), 3) | (Phase::Started(_), 3) => Phase::Gone,
                        (Phase::Started(n), 4) => Phase::Started(n + 1),
                        (phase, _) => phase,
                    }
                }
                let items: Vec<_> = phases
                    .iter()
                    .enumerate()
                    .filter_map(|(i, phase)| {
                        let (status, detail) = match phase {
                            Phase::Scheduled(n) => ("Scheduled", *n),
                            Phase::Started(n) => ("Started", *n),
                            _ => return None,
                        };
                        Some(json!({"EventId": format!("E{i}"), "EventStatus": status,
                                    "DurationInSeconds": detail}))
                    })
                    .collect();
                let raw = json!({"DocumentIncarnation": step + 1, "Events": items});
                documents.push(Document::from_value(raw).unwrap().document);
            }
            documents
        })
}

fn run(documents: &[Document]) -> Vec<Transition> {
    let mut previous: Option<&Document> = None;
    let mut all = Vec::new();
    for document in documents {
        all.extend(diff(previous, document));
        previous = Some(document);
    }
    all
}

/// A legal path: scheduled (updated)* [started (updated)* [completed]] | scheduled
/// (updated)* cancelled | started (updated)* [completed].
fn is_legal_path(kinds: &[TransitionKind]) -> bool {
    use TransitionKind::*;
    let mut state = "new";
    for kind in kinds {
        state = match (state, kind) {
            ("new", Scheduled) => "scheduled",
            ("new", Started) | ("scheduled", Started) => "started",
            ("scheduled", Updated) => "scheduled",
            ("started", Updated) => "started",
            ("scheduled", Cancelled) | ("started", Completed) => "ended",
            _ => return false,
        }
    }
    true
}

/// The documents renumbered with `incarnations` (cycled), as after any number of resets:
/// incarnations that go backwards, repeat, or repeat with other content.
fn renumbered(mut documents: Vec<Document>, incarnations: &[u64]) -> Vec<Document> {
    for (document, incarnation) in documents.iter_mut().zip(incarnations.iter().cycle()) {
        document.incarnation = *incarnation;
    }
    documents
}

/// What the agent derives: unchanged documents skipped, resets counted into the epoch; every
/// transition id and `document` id, and after each processed document its transitions.
fn run_as_agent(documents: &[Document]) -> (Vec<String>, Vec<(usize, Vec<Transition>)>) {
    let (mut previous, mut epoch) = (None::<&Document>, 0);
    let (mut ids, mut steps) = (Vec::new(), Vec::new());
    for (index, document) in documents.iter().enumerate() {
        let continuity = crate::continuity::Continuity::of(previous, document);
        if continuity == crate::continuity::Continuity::Unchanged {
            continue;
        }
        epoch = continuity.epoch_after(epoch);
        let observation = Observation {
            epoch,
            ..Observation::at(chrono::Utc::now())
        };
        let transitions = diff_observed(previous, document, &observation);
        ids.extend(transitions.iter().map(Transition::id));
        let tag = crate::continuity::incarnation_tag(document.incarnation, epoch);
        ids.push(format!("document:{tag}"));
        steps.push((index, transitions));
        previous = Some(document);
    }
    (ids, steps)
}

proptest! {
    #[test]
    fn every_event_id_follows_a_legal_path(documents in lifecycle_documents()) {
        let mut paths: HashMap<String, Vec<TransitionKind>> = HashMap::new();
        for transition in run(&documents) {
            paths.entry(transition.event.id.clone()).or_default().push(transition.kind);
        }
        for (id, path) in paths {
            prop_assert!(is_legal_path(&path), "{id}: {path:?}");
        }
    }

    #[test]
    fn the_same_document_twice_yields_nothing(documents in lifecycle_documents()) {
        for document in &documents {
            prop_assert!(diff(Some(document), document).is_empty());
        }
    }

    #[test]
    fn ids_are_deterministic_and_unique(documents in lifecycle_documents()) {
        let first: Vec<String> = run(&documents).iter().map(Transition::id).collect();
        let second: Vec<String> = run(&documents).iter().map(Transition::id).collect();
        prop_assert_eq!(&first, &second);
        let unique: std::collections::HashSet<_> = first.iter().collect();
        prop_assert_eq!(unique.len(), first.len(), "an id was reused: {:?}", first);
    }

    #[test]
    fn every_event_change_is_reported_and_nothing_else(documents in lifecycle_documents()) {
        // Replaying the transitions over an empty view must rebuild each document exactly:
        // nothing missed, nothing invented.
        let mut view: HashMap<String, ScheduledEvent> = HashMap::new();
        let mut previous: Option<&Document> = None;
        for document in &documents {
            for transition in diff(previous, document) {
                match transition.kind {
                    TransitionKind::Completed | TransitionKind::Cancelled => {
                        prop_assert!(view.remove(&transition.event.id).is_some());
                    }
                    _ => { view.insert(transition.event.id.clone(), transition.event); }
                }
            }
            prop_assert_eq!(view.len(), document.events.len());
            for event in &document.events {
                prop_assert_eq!(view.get(&event.id), Some(event));
            }
            previous = Some(document);
        }
    }

    #[test]
    fn arbitrary_documents_never_panic_and_respect_order(
        statuses in proptest::collection::vec(
            proptest::collection::vec((0u8..6, 0u8..4), 0..6), 1..8)
    ) {
        let names = ["Scheduled", "Started", "Paused"];
        let documents: Vec<Document> = statuses.iter().enumerate().map(|(step, events)| {
            let mut seen = std::collections::HashSet::new();
            let items: Vec<_> = events.iter()
                .filter(|(id, _)| seen.insert(*id))
                .map(|(id, status)| json!({"EventId": format!("E{id}"),
                    "EventStatus": names[*status as usize % 3], "Extra": status}))
                .collect();
            Document::from_value(json!({"DocumentIncarnation": step, "Events": items}))
                .unwrap().document
        }).collect();
        let transitions = run(&documents);
        for pair in transitions.windows(2) {
            prop_assert!(pair[0].incarnation <= pair[1].incarnation);
        }
    }

    #[test]
    fn ids_stay_unique_and_deterministic_across_incarnation_resets(
        documents in lifecycle_documents(),
        incarnations in proptest::collection::vec(0u64..4, 1..6),
    ) {
        let documents = renumbered(documents, &incarnations);
        let (first, _) = run_as_agent(&documents);
        prop_assert_eq!(&first, &run_as_agent(&documents).0);
        let unique: std::collections::HashSet<_> = first.iter().collect();
        prop_assert_eq!(unique.len(), first.len(), "an id was reused: {:?}", first);
    }

    #[test]
    fn ids_do_not_change_when_the_numbering_never_resets(documents in lifecycle_documents()) {
        let plain: Vec<String> = run(&documents).iter().map(Transition::id).collect();
        let (agent, _) = run_as_agent(&documents);
        let transitions: Vec<String> =
            agent.into_iter().filter(|id| !id.starts_with("document:")).collect();
        prop_assert_eq!(plain, transitions);
    }

    #[test]
    fn every_change_is_reported_across_incarnation_resets(
        documents in lifecycle_documents(),
        incarnations in proptest::collection::vec(0u64..4, 1..6),
    ) {
        let documents = renumbered(documents, &incarnations);
        let mut view: HashMap<String, ScheduledEvent> = HashMap::new();
        let (_, steps) = run_as_agent(&documents);
        let mut steps = steps.into_iter().peekable();
        for (index, document) in documents.iter().enumerate() {
            while let Some((_, transitions)) = steps.next_if(|(step, _)| *step == index) {
                for transition in transitions {
                    if matches!(transition.kind, TransitionKind::Completed | TransitionKind::Cancelled) {
                        prop_assert!(view.remove(&transition.event.id).is_some());
                    } else {
                        view.insert(transition.event.id.clone(), transition.event);
                    }
                }
            }
            // A skipped document was unchanged, so the view matches it too.
            prop_assert_eq!(view.len(), document.events.len());
            for event in &document.events {
                prop_assert_eq!(view.get(&event.id), Some(event));
            }
        }
    }
}
