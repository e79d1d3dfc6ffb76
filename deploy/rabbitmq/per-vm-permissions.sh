#!/usr/bin/env bash
# Per-VM rights for sched-relay on RabbitMQ (docs/src/permissions.md).
#
#   deploy/rabbitmq/per-vm-permissions.sh <vm-name> <user> [vhost]
#
# Gives <user> (create it first: rabbitmqctl add_user) exactly what the agent of VM <vm-name>
# needs with the shipped names, and nothing of any other VM's:
#   - publish to the events exchange "scheduledevents" only under routing keys "<vm>.",
#   - declare, bind and consume its own approvals queue "sched-relay.approvals.<vm>", bound to
#     "scheduledevents.approvals" only by its own key "approvals.<vm>".
# It cannot delete or redeclare either exchange (create both once with an administrator's
# credentials; the agent leaves an existing exchange alone), publish approvals, or read,
# bind or purge another VM's queue. Run it once per VM from your inventory. The coordinator
# needs its usual rights (read the events, publish approvals).
#
# rabbitmqctl runs locally; set RABBITMQCTL to reach another, e.g.
#   RABBITMQCTL="docker compose exec -T rabbitmq rabbitmqctl"
# Tested as shipped by tests/amqp_permissions.rs.
set -euo pipefail

if [[ $# -lt 2 || $# -gt 3 ]]; then
    echo "usage: $0 <vm-name> <user> [vhost]" >&2
    exit 64
fi
vm=$1 user=$2 vhost=${3:-/}
read -r -a ctl <<<"${RABBITMQCTL:-rabbitmqctl}"

# The name as the agent writes it into queue names and routing keys: characters brokers give
# meaning to become "_" (so "db.prod" is "db_prod").
name=$(printf '%s' "$vm" | tr '.*>#\t ' '______')
# ... and as a regular expression.
re=$(printf '%s' "$name" | sed 's/[][\\.^$*+?(){}|/-]/\\&/g')

queue="sched-relay\\.approvals\\.$re"
"${ctl[@]}" set_permissions -p "$vhost" "$user" \
    "^$queue\$" \
    "^(scheduledevents|$queue)\$" \
    "^(scheduledevents\\.approvals|$queue)\$"
"${ctl[@]}" set_topic_permissions -p "$vhost" "$user" scheduledevents "^$re\\." '^$'
"${ctl[@]}" set_topic_permissions -p "$vhost" "$user" scheduledevents.approvals '^$' "^approvals\\.$re\$"
