#!/usr/bin/env python3
"""What users would run instead of sched-relay: an agent written the way Azure's Scheduled
Events sample does it (requests, a 1-second poll), posting each new event of each new
DocumentIncarnation to a webhook as a structured CloudEvent. Used by scripts/bench as the
side-by-side baseline; not part of the product.

    bench-python-agent.py IMDS_BASE_URL WEBHOOK_URL [POLL_SECONDS]
"""
import datetime
import json
import sys
import time

import requests

ENDPOINT = sys.argv[1].rstrip("/") + "/metadata/scheduledevents?api-version=2020-07-01"
WEBHOOK = sys.argv[2]
POLL = float(sys.argv[3]) if len(sys.argv) > 3 else 1.0
HEADERS = {"Metadata": "true"}


def get_scheduled_events():
    response = requests.get(ENDPOINT, headers=HEADERS, timeout=10)
    response.raise_for_status()
    return response.json()


def publish(document, event, transition):
    cloud_event = {
        "specversion": "1.0",
        "id": f"{event['EventId']}:{transition}",
        "source": "urn:python-agent",
        "type": f"com.azure.scheduledevents.{transition}",
        "subject": event["EventId"],
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "datacontenttype": "application/json",
        "data": {"incarnation": document["DocumentIncarnation"], "event": event},
    }
    requests.post(
        WEBHOOK,
        data=json.dumps(cloud_event),
        headers={"content-type": "application/cloudevents+json"},
        timeout=10,
    )


def main():
    last_incarnation = None
    known = {}
    while True:
        try:
            document = get_scheduled_events()
            if document["DocumentIncarnation"] != last_incarnation:
                last_incarnation = document["DocumentIncarnation"]
                for event in document["Events"]:
                    previous = known.get(event["EventId"])
                    if previous is None:
                        publish(document, event, "scheduled")
                    elif previous != event["EventStatus"]:
                        publish(document, event, event["EventStatus"].lower())
                    known[event["EventId"]] = event["EventStatus"]
        except Exception as error:  # the sample logs and carries on
            print(f"error: {error}", file=sys.stderr)
        time.sleep(POLL)


if __name__ == "__main__":
    main()
