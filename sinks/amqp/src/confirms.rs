//! Which event of a batch the broker did not store, from the batch's publisher confirms.

use cloudevents::AttributesReader;
use lapin::Confirmation;
use sched_relay_transport::{Event, SinkError};

/// The first event of `batch` the broker did not store, and why: returned as unroutable
/// (permanent) or nacked (retriable). `confirmations` are the batch's first ones, in order,
/// each with its routing key.
///
/// lapin hands a returned (unroutable) message to the first confirmation an ack completes,
/// and one ack may cover several messages (completed in a hash map's order): the returned
/// message's id (the event's) says which event it was, wherever it surfaced. One without an
/// id (never ours) counts where it surfaced.
pub(crate) fn first_unstored(
    batch: &[Event],
    confirmations: &[(String, Confirmation)],
    exchange: &str,
    broker: &str,
) -> Option<(usize, SinkError)> {
    let returned: Vec<&str> = confirmations
        .iter()
        .filter_map(|(_, confirmation)| match confirmation {
            Confirmation::Ack(Some(message)) | Confirmation::Nack(Some(message)) => message
                .properties
                .message_id()
                .as_ref()
                .map(|id| id.as_str()),
            _ => None,
        })
        .collect();
    for (index, (routing_key, confirmation)) in confirmations.iter().enumerate() {
        let id = batch[index].id();
        let surfaced_without_id = matches!(
            confirmation,
            Confirmation::Ack(Some(message)) | Confirmation::Nack(Some(message))
                if message.properties.message_id().is_none()
        );
        let unroutable = surfaced_without_id || returned.contains(&id);
        let error = match confirmation {
            Confirmation::Ack(_) if !unroutable => continue,
            Confirmation::Ack(_) => SinkError::Permanent(format!(
                "unroutable: no queue is bound to exchange {exchange} for routing key {routing_key} (bind one, or set declare = true with a queue)"
            )),
            Confirmation::Nack(_) => SinkError::Retriable(format!(
                "{broker} refused to store a message for {routing_key} (nack)"
            )),
            Confirmation::NotRequested => {
                SinkError::Retriable("publisher confirms are not enabled on the channel".into())
            }
        };
        return Some((index, error));
    }
    None
}
