//! Every metric the agent and the coordinator record: name, kind and help text (the
//! `# HELP` lines, the table of docs/src/metrics.md and the dashboards are checked against it).

/// Every metric the agent exports: name, kind and help text. docs/src/metrics.md's table, the
/// Grafana dashboard and the alert rules use these names (a test checks they exist).
pub const METRICS: &[(&str, &str, &str)] = &[
    (
        "sched_relay_build_info",
        "gauge",
        "Always 1; the version label says which build runs.",
    ),
    (
        "sched_relay_imds_polls_total",
        "counter",
        "Requests for the Scheduled Events document.",
    ),
    (
        "sched_relay_imds_poll_duration_seconds",
        "histogram",
        "How long each document request took, failures included.",
    ),
    (
        "sched_relay_imds_errors_total",
        "counter",
        "Failed document requests, by kind (timeout, unreachable, status, malformed, ...).",
    ),
    (
        "sched_relay_imds_last_success_timestamp_seconds",
        "gauge",
        "Unix time of the last document fetched successfully.",
    ),
    (
        "sched_relay_incarnation",
        "gauge",
        "DocumentIncarnation of the last processed document.",
    ),
    (
        "sched_relay_incarnation_resets_total",
        "counter",
        "DocumentIncarnation resets: it went backwards, or repeated with other content.",
    ),
    (
        "sched_relay_document_odd_fields_total",
        "counter",
        "Fields of fetched documents ignored for their type or format (every fetch counts).",
    ),
    (
        "sched_relay_documents_refused_total",
        "counter",
        "Fetched documents refused whole (an event without EventId, a duplicate EventId, not JSON), every poll counted.",
    ),
    (
        "sched_relay_document_events",
        "gauge",
        "Events in the current document, by event_type and status.",
    ),
    (
        "sched_relay_transitions_total",
        "counter",
        "Transitions emitted, by transition (scheduled, started, completed, ...).",
    ),
    (
        "sched_relay_heartbeats_total",
        "counter",
        "Heartbeats stored for the sinks (events.heartbeat_interval); a sink still holding an undelivered one gets no new one.",
    ),
    (
        "sched_relay_sink_delivered_total",
        "counter",
        "Events a sink confirmed.",
    ),
    (
        "sched_relay_sink_failed_total",
        "counter",
        "Failed delivery attempts of a sink (retried or dead-lettered).",
    ),
    (
        "sched_relay_sink_authentication_failed_total",
        "counter",
        "Health checks and delivery attempts of a sink whose credentials or permissions the destination refused (retried; logged at ERROR).",
    ),
    (
        "sched_relay_sink_retried_total",
        "counter",
        "Delivery attempts of a sink that will be retried.",
    ),
    (
        "sched_relay_sink_dead_lettered_total",
        "counter",
        "Events written to a sink's dead-letter file.",
    ),
    (
        "sched_relay_sink_delivery_latency_seconds",
        "histogram",
        "From the document's arrival to the sink's confirmation, per event.",
    ),
    (
        "sched_relay_sink_up",
        "gauge",
        "1 when a sink's last health check or delivery succeeded.",
    ),
    (
        "sched_relay_outbox_depth",
        "gauge",
        "Events stored for a sink and not yet confirmed.",
    ),
    (
        "sched_relay_outbox_oldest_age_seconds",
        "gauge",
        "Age of the oldest event a sink has not confirmed (0 when none).",
    ),
    (
        "sched_relay_state_store_writable",
        "gauge",
        "1 while the state store can be written; 0 after an I/O error (full disk) until it can again.",
    ),
    (
        "sched_relay_state_store_commit_seconds",
        "histogram",
        "Storing a change's events before the sinks may send them: the durable commit (fsync) and any wait for the store.",
    ),
    (
        "sched_relay_state_store_errors_total",
        "counter",
        "State store operations that failed with an I/O error.",
    ),
    (
        "sched_relay_outbox_orphaned_events",
        "gauge",
        "Events found at start for a sink that is no longer configured (see `sched-relay outbox`).",
    ),
    (
        "sched_relay_approvals_total",
        "counter",
        "Approval requests handled, by source, outcome and reason.",
    ),
    (
        "sched_relay_approvals_not_handled_total",
        "counter",
        "Approval messages whose outcome could not be stored; each is offered again (or its requester told to retry).",
    ),
    (
        "sched_relay_approvals_redelivered_total",
        "counter",
        "Approval requests handled before (redelivered or replayed), answered with their stored outcome.",
    ),
    (
        "sched_relay_http_connections_refused_total",
        "counter",
        "Connections to the agent's listener beyond telemetry.max_connections, answered 503 (200 for GET /healthz) and closed.",
    ),
    (
        "sched_relay_log_lines_dropped_total",
        "counter",
        "Log lines dropped because stderr did not take them (a stalled pipe or log driver); the agent never waits for its logs.",
    ),
    (
        "sched_relay_approvals_skipped_total",
        "counter",
        "Requests on a shared approval channel that were for another VM.",
    ),
    (
        "sched_relay_approvals_unauthorized_total",
        "counter",
        "POST /approvals refused for a missing or wrong bearer token.",
    ),
    (
        "sched_relay_coordinator_budget_in_use",
        "gauge",
        "VMs of the group down now (held, started, starting at NotBefore, or silent), until the evidence that each is back; group=\"fleet\" with [fleet].",
    ),
    (
        "sched_relay_coordinator_budget_limit",
        "gauge",
        "VMs of the group that may be down at once.",
    ),
    (
        "sched_relay_coordinator_group_size",
        "gauge",
        "What a percentage is of: the larger of the VMs in the inventory and expected_size.",
    ),
    (
        "sched_relay_coordinator_input_total",
        "counter",
        "Messages read, by result: applied, outcome, document, heartbeat, dry_run, duplicate, stale, foreign, approved_elsewhere, conflict, ignored, invalid.",
    ),
    (
        "sched_relay_coordinator_decisions_total",
        "counter",
        "Decisions, by kind: approve, drain, budget, never, too_late, no_agent, not_listed, reports, window, paused, drain_failed, azure (a wait counts when its reason changes).",
    ),
    (
        "sched_relay_coordinator_decision_seconds",
        "histogram",
        "From the message (or the end of a drain or health gate) that allowed a decision to its drain started or approval signed and handed to the broker client.",
    ),
    (
        "sched_relay_coordinator_drain_seconds",
        "histogram",
        "Drain hook durations, by result.",
    ),
    (
        "sched_relay_coordinator_drain_failures_total",
        "counter",
        "Drain hooks that failed or ran out of time.",
    ),
    (
        "sched_relay_coordinator_deadline_misses_total",
        "counter",
        "Drains that had not finished by their deadline (NotBefore minus the margin).",
    ),
    (
        "sched_relay_coordinator_approvals_sent_total",
        "counter",
        "Signed approvals the broker confirmed (repeats of one request included).",
    ),
    (
        "sched_relay_coordinator_publish_failures_total",
        "counter",
        "Approvals the broker did not take (tried again).",
    ),
    (
        "sched_relay_coordinator_approval_outcomes_total",
        "counter",
        "The agents' outcomes of this coordinator's approvals, by outcome and reason.",
    ),
    (
        "sched_relay_coordinator_approvals_abandoned_total",
        "counter",
        "Events given up after max_attempts or a refusal a new request cannot mend (alert on it).",
    ),
    (
        "sched_relay_coordinator_approvals_after_not_before_total",
        "counter",
        "Approvals signed after the event's NotBefore (should stay 0).",
    ),
    (
        "sched_relay_coordinator_silent_vms",
        "gauge",
        "VMs of the group whose agent missed silent_after heartbeats (counted as down).",
    ),
    (
        "sched_relay_coordinator_vms_without_agent",
        "gauge",
        "VMs of the group's Azure source that no agent speaks for (counted in its size).",
    ),
    (
        "sched_relay_coordinator_azure_listing_age_seconds",
        "gauge",
        "Age of the group's last whole Azure listing (-1 before the first; alert when it grows).",
    ),
    (
        "sched_relay_coordinator_arm_acknowledgements_total",
        "counter",
        "Acknowledgements through Azure Resource Manager (approve_via), by result: approved, refused, failed, held (not sent: the subscription is throttled or failing).",
    ),
    (
        "sched_relay_coordinator_holds_overdue",
        "gauge",
        "VMs of the group held past max_hold with no evidence that they are back (alert on it).",
    ),
    (
        "sched_relay_coordinator_holds_overdue_total",
        "counter",
        "Events that went past max_hold with a VM not back (logged at ERROR once each).",
    ),
    (
        "sched_relay_coordinator_vms_left_total",
        "counter",
        "VMs that left the inventory (evicted or terminated and silent, or silent for forget_after).",
    ),
    (
        "sched_relay_coordinator_health_gate_failures_total",
        "counter",
        "Health gate checks that did not pass (the VM stays counted as down).",
    ),
    (
        "sched_relay_coordinator_conflicting_vms",
        "gauge",
        "VM names whose last message was refused for contradicting who the VM is (another resource id, none where one is known, a subject or routing key that names another VM, a name that shares a subject with another); /fleet conflicts says why.",
    ),
    (
        "sched_relay_coordinator_catching_up",
        "gauge",
        "Messages of its input's backlog the coordinator has yet to read since it started (1 while not connected, 0 once caught up): nothing is decided meanwhile.",
    ),
    (
        "sched_relay_coordinator_paused",
        "gauge",
        "1 while an operator has paused draining and approving.",
    ),
    (
        "sched_relay_coordinator_admin_refused_total",
        "counter",
        "POST /pause, /resume or /release refused for a missing or wrong bearer token.",
    ),
];
