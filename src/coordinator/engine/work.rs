//! The work a decision starts outside the loop: a drain of one VM, and the publication of an
//! approval's newest request; each comes back to the loop as a [`Done`].

use std::time::Instant;

use chrono::{DateTime, Utc};
use sched_relay_core::approval::Draft;

use super::{Done, Engine, NOT_RUN};
use crate::coordinator::drain::{self, Job};
use crate::coordinator::fleet::Via;

impl Engine {
    pub(super) fn start_drain(&mut self, key: &str, vm: &str, _now: DateTime<Utc>) {
        if !self.may_act() {
            return;
        }
        let Some(m) = self.fleet.events.get(key) else {
            return;
        };
        let (Some(config), Some(d)) = (self.config.drain.clone(), m.drain.as_ref()) else {
            return;
        };
        if self
            .draining
            .insert((key.to_owned(), vm.to_owned()), ())
            .is_some()
        {
            return;
        }
        let job = Job {
            vm: vm.to_owned(),
            event_id: m.event_id.clone(),
            event_type: m.event_type.clone(),
            not_before: m.not_before,
            deadline: d.deadline,
        };
        let (http, done, key) = (self.http.clone(), self.done.clone(), key.to_owned());
        let gate = self.gate.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            // The lease may have gone stale since this was decided: run nothing then.
            let result = if gate.as_ref().is_some_and(|may_act| !may_act()) {
                Err(NOT_RUN.to_owned())
            } else {
                drain::run(&config, &http, &job).await
            };
            let _ = done.send(Done::Drained {
                key,
                vm: job.vm,
                result,
                took: started.elapsed(),
            });
        });
    }

    /// Publishes the event's newest request (to its agent, or through ARM).
    pub(super) fn publish(&mut self, key: &str) {
        if !self.may_act() {
            return;
        }
        let Some(m) = self.fleet.events.get(key) else {
            return;
        };
        let Some(approval) = m.approval.as_ref() else {
            return;
        };
        if approval.via == Via::Arm {
            return self.acknowledge(key);
        }
        let Some(sent) = approval.sent.last() else {
            return;
        };
        let draft = Draft {
            id: sent.request_id.clone(),
            source: self.config.coordinator.source.clone(),
            time: sent.signed_at,
            vm_name: Some(approval.approver.clone()),
            event_ids: vec![m.event_id.clone()],
            request_type: format!(
                "{}.approval.requested",
                sched_relay_core::event::DEFAULT_TYPE_PREFIX
            ),
        };
        let event = draft.event(Some((&self.config.signing.key_id, &self.signer)));
        self.publishing
            .insert(key.to_owned(), (true, Instant::now()));
        let (publisher, done, key, request_id) = (
            self.publisher.clone(),
            self.done.clone(),
            key.to_owned(),
            sent.request_id.clone(),
        );
        let gate = self.gate.clone();
        tokio::spawn(async move {
            let result = if gate.as_ref().is_some_and(|may_act| !may_act()) {
                Err(NOT_RUN.to_owned())
            } else {
                publisher
                    .deliver(std::slice::from_ref(&event))
                    .await
                    .map_err(|e| e.to_string())
            };
            let _ = done.send(Done::Published {
                key,
                request_id,
                result,
            });
        });
    }
}
