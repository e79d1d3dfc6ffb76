//! sched-relay: watches Azure Scheduled Events, turns every change into CloudEvents and
//! delivers them to brokers, files and webhooks; approves events by local policy.
//!
//! The data path: [`imds`] fetches a document -> [`diff`] (pure) finds the transitions ->
//! [`event`] (pure) makes CloudEvents -> [`fanout`] delivers them, one task per sink.

pub mod agent;
pub mod config;
pub mod demo;
pub mod diff;
pub mod event;
pub mod fanout;
pub mod imds;
pub mod policy;
pub mod simulator;
pub mod sinks;

pub use agent::{AgentError, run};
pub use config::Config;
