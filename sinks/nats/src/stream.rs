//! The JetStream streams sched-relay's consumers read: the coordinator's input (the agents'
//! events) and each agent's approvals. A consumer creates its stream when it is missing,
//! with the subjects it was configured for, and refuses one that exists without capturing
//! them. It never changes an existing stream's subjects: other consumers may depend on them,
//! and NATS refuses a second stream whose subjects overlap another's, so a silent edit could
//! only move messages out of someone's stream.
//!
//! [`captures`] is pure (unit tests below); [`ensure`] needs a server (the coordinator's
//! `input` tests and `tests/shipped_layout.rs`).

/// Whether every subject `subject` can match is matched by `pattern` (NATS wildcards: `*`
/// one token, `>` one or more trailing tokens). A stream whose subjects include `pattern`
/// stores every message a consumer filtered on `subject` could want.
pub fn captures(pattern: &str, subject: &str) -> bool {
    let mut pattern = pattern.split('.');
    let mut subject = subject.split('.');
    loop {
        match (pattern.next(), subject.next()) {
            (None, None) => return true,
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(token)) if token != ">" => {}
            (Some(expected), Some(token)) if expected == token => {}
            _ => return false,
        }
    }
}

#[cfg(feature = "client")]
pub use client::{StreamProblem, ensure};

#[cfg(feature = "client")]
mod client {
    use std::fmt;

    use async_nats::jetstream::ErrorCode;
    use async_nats::jetstream::context::{CreateStreamErrorKind, GetStreamErrorKind};
    use async_nats::jetstream::{self, stream::Stream};

    use super::captures;

    /// Why a stream cannot be used.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub enum StreamProblem {
        /// The server did not answer (down, JetStream off, a timeout): it may pass.
        Unavailable(String),
        /// An operator must act: the stream exists without capturing a subject, or cannot be
        /// created (its subjects overlap another stream's, no permission).
        Refused(String),
    }

    impl fmt::Display for StreamProblem {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            match self {
                StreamProblem::Unavailable(why) | StreamProblem::Refused(why) => f.write_str(why),
            }
        }
    }

    /// The stream `name`, which must capture every one of `subjects`. When it is missing it is
    /// created with `create_with` (as `nats stream add <name> --subjects ... --defaults`
    /// would), keeping messages for `max_age` (zero: no limit), unless `create_with` is
    /// empty. Returns the stream and whether this call created it.
    pub async fn ensure(
        context: &jetstream::Context,
        name: &str,
        subjects: &[String],
        create_with: &[String],
        max_age: std::time::Duration,
    ) -> Result<(Stream, bool), StreamProblem> {
        let command = format!(
            "nats stream add {name} --subjects '{}' --defaults",
            if create_with.is_empty() {
                subjects
            } else {
                create_with
            }
            .join(",")
        );
        match context.get_stream(name).await {
            Ok(stream) => return check(context, stream, subjects).await.map(|s| (s, false)),
            Err(error) => match error.kind() {
                GetStreamErrorKind::JetStream(error)
                    if error.error_code() == ErrorCode::STREAM_NOT_FOUND => {}
                GetStreamErrorKind::JetStream(error) => {
                    return Err(StreamProblem::Refused(format!(
                        "cannot look up stream {name}: {error}"
                    )));
                }
                _ => {
                    return Err(StreamProblem::Unavailable(format!(
                        "cannot look up stream {name}: {error} (is JetStream enabled on the server?)"
                    )));
                }
            },
        }
        if create_with.is_empty() {
            return Err(StreamProblem::Refused(format!(
                "stream {name} does not exist: create it ({command})"
            )));
        }
        let config = jetstream::stream::Config {
            name: name.to_owned(),
            subjects: create_with.to_vec(),
            max_age,
            ..Default::default()
        };
        match context.create_stream(config).await {
            Ok(stream) => Ok((stream, true)),
            Err(error) => match error.kind() {
                CreateStreamErrorKind::JetStream(error)
                    if error.error_code() == ErrorCode::STREAM_SUBJECT_OVERLAP =>
                {
                    let mut holders = Vec::new();
                    for subject in create_with {
                        if let Ok(holder) = context.stream_by_subject(subject.clone()).await {
                            holders.push(format!("stream {holder} already captures {subject}"));
                        }
                    }
                    Err(StreamProblem::Refused(format!(
                        "cannot create stream {name} with subjects {create_with:?}: {}; NATS refuses streams whose subjects overlap. Name the stream that captures them instead, or use subjects that do not overlap (docs: \"The NATS layout\", docs/src/nats-layout.md)",
                        if holders.is_empty() {
                            error.to_string()
                        } else {
                            holders.join(", ")
                        }
                    )))
                }
                // Another consumer created it meanwhile (with other settings): use it if it
                // captures what is needed.
                CreateStreamErrorKind::JetStream(error)
                    if error.error_code() == ErrorCode::STREAM_NAME_EXIST =>
                {
                    match context.get_stream(name).await {
                        Ok(stream) => check(context, stream, subjects).await.map(|s| (s, false)),
                        Err(error) => Err(StreamProblem::Unavailable(format!(
                            "cannot look up stream {name}: {error}"
                        ))),
                    }
                }
                CreateStreamErrorKind::JetStream(error) => Err(StreamProblem::Refused(format!(
                    "cannot create stream {name}: {error}; create it yourself ({command})"
                ))),
                _ => Err(StreamProblem::Unavailable(format!(
                    "cannot create stream {name}: {error} (no permission for the JetStream API looks like this too; then create it yourself: {command})"
                ))),
            },
        }
    }

    /// `stream` as it is, if it captures every one of `subjects`.
    async fn check(
        context: &jetstream::Context,
        stream: Stream,
        subjects: &[String],
    ) -> Result<Stream, StreamProblem> {
        let info = stream.cached_info();
        let name = &info.config.name;
        let has = &info.config.subjects;
        for subject in subjects {
            if has.iter().any(|pattern| captures(pattern, subject)) {
                continue;
            }
            let elsewhere = match context.stream_by_subject(subject.clone()).await {
                Ok(other) if other != *name => format!(" (stream {other} captures it)"),
                _ => String::new(),
            };
            return Err(StreamProblem::Refused(format!(
                "stream {name} exists with subjects {has:?}, which do not capture {subject}{elsewhere}; sched-relay never changes an existing stream's subjects: add {subject} to them (nats stream edit {name} --subjects ...), or configure the stream that captures it"
            )));
        }
        Ok(stream)
    }
}

#[cfg(test)]
mod tests {
    use super::captures;

    #[test]
    fn a_pattern_captures_exactly_the_subjects_it_matches_for_every_token() {
        for (pattern, subject) in [
            ("scheduledevents.>", "scheduledevents.>"),
            ("scheduledevents.>", "scheduledevents.approvals.scheduled"),
            ("scheduledevents.>", "scheduledevents.*.*"),
            ("scheduledevents.*.*", "scheduledevents.web-1.scheduled"),
            ("scheduledapprovals.>", "scheduledapprovals.approvals"),
            ("scheduledapprovals.*", "scheduledapprovals.*"),
            (">", "scheduledevents.>"),
            ("a.b", "a.b"),
        ] {
            assert!(
                captures(pattern, subject),
                "{pattern} should capture {subject}"
            );
        }
        for (pattern, subject) in [
            // `>` may stand for more tokens than `*` matches.
            ("scheduledevents.*.*", "scheduledevents.>"),
            ("scheduledevents.*", "scheduledevents.*.*"),
            // The old layout: the agents' approvals inside the events' root, and the other
            // way round.
            ("scheduledevents.approvals.>", "scheduledevents.>"),
            (
                "scheduledapprovals.>",
                "scheduledevents.approvals.scheduled",
            ),
            ("scheduledevents.>", "scheduledapprovals.approvals"),
            // `>` needs at least one token.
            ("scheduledevents.>", "scheduledevents"),
            ("a.b", "a.b.c"),
            ("a.b.c", "a.b"),
            ("a.*", "a.>"),
        ] {
            assert!(
                !captures(pattern, subject),
                "{pattern} must not capture {subject}"
            );
        }
    }
}
