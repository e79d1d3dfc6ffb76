//! The core of sched-relay: everything about Azure Scheduled Events and the agent's wire
//! contract that needs no runtime, no store and no broker client. Its functions do no I/O;
//! only [`approval::Draft::new`] and key generation read the clock and randomness (beside
//! the standard library's hash maps, which seed themselves from the OS). An orchestrator that
//! signs approvals, or a consumer that wants the event types, depends on this crate alone.
//!
//! - [`document`]: the Scheduled Events document and its tolerant parser;
//! - [`diff`]: previous document + current document -> transitions (a pure function);
//! - [`continuity`]: whether a document is unchanged, next, or a numbering reset, and the
//!   epoch that keeps incarnation-derived ids unique across resets;
//! - [`event`]: transitions, documents, approval outcomes and the agent's heartbeats as
//!   CloudEvents (ids, types, extensions, data), and the typed [`EventKind`] every relayed
//!   [`Event`] carries;
//! - [`binding`]: how a CloudEvent travels as headers and body on Kafka, NATS, AMQP and HTTP;
//! - [`policy`]: local approval decisions, as in Azure's own sample;
//! - [`approval`]: the approval request format, its canonical signed text, sign and verify;
//! - [`inbound`]: a message as it arrived, before anything is believed about it.
//!
//! Diffing two documents:
//!
//! ```
//! use sched_relay_core::diff::{TransitionKind, diff};
//! use sched_relay_core::document::Document;
//!
//! let before = Document::parse(br#"{"DocumentIncarnation": 1, "Events": []}"#)?.document;
//! let after = Document::parse(
//!     br#"{"DocumentIncarnation": 2, "Events": [{"EventId": "E1", "EventType": "Reboot",
//!          "EventStatus": "Scheduled", "Resources": ["vm1"],
//!          "NotBefore": "Mon, 19 Sep 2016 18:29:47 GMT"}]}"#,
//! )?
//! .document;
//! let transitions = diff(Some(&before), &after);
//! assert_eq!(transitions.len(), 1);
//! assert_eq!(transitions[0].kind, TransitionKind::Scheduled);
//! assert_eq!(transitions[0].id(), "E1:scheduled");
//! # Ok::<(), sched_relay_core::document::DocumentError>(())
//! ```
//!
//! Signing an approval, as an orchestrator does, and verifying it, as the agent does:
//!
//! ```
//! use sched_relay_core::approval::{Draft, Key, SigningKey, decode_base64};
//!
//! let signer = SigningKey::parse("hmac-sha256:0123456789abcdef0123456789abcdef")?;
//! let draft = Draft::new("urn:orchestrator", Some("vm1"), vec!["E1".into()]);
//! let request = draft.event(Some(("k1", &signer)));
//! // The CloudEvent carries `keyid` and `signature`; publish it to the VM's approval channel.
//! let signature = request.extension("signature").unwrap().to_string();
//!
//! let trusted = Key::hmac("0123456789abcdef0123456789abcdef")?;
//! let raw = decode_base64(&signature).unwrap();
//! assert!(trusted.verify(draft.canonical().as_bytes(), &raw));
//! # Ok::<(), String>(())
//! ```

pub mod approval;
pub mod binding;
pub mod continuity;
pub mod diff;
pub mod document;
pub mod event;
pub mod inbound;
pub mod policy;

pub use event::{Event, EventKind};
