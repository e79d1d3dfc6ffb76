"""Verifies one request the webhook sink sent with the `standardwebhooks` package (the
Standard Webhooks project's own library), then checks that tampering fails verification.

    verify_standard_webhook.py SECRET BODY_FILE WEBHOOK_ID WEBHOOK_TIMESTAMP WEBHOOK_SIGNATURE

Exit 0 and prints "verified" when the request verifies and every tampered copy is refused.
"""
import json
import sys
import time

from standardwebhooks.webhooks import Webhook

secret, body_file, webhook_id, timestamp, signature = sys.argv[1:]
with open(body_file, "rb") as f:
    body = f.read()
headers = {
    "webhook-id": webhook_id,
    "webhook-timestamp": timestamp,
    "webhook-signature": signature,
}
hook = Webhook(secret)
hook.verify(body, headers)

event = json.loads(body)
tampered = {
    "a rewritten type": (json.dumps({**event, "type": event["type"] + ".forged"}).encode(), headers),
    "a rewritten id": (body, {**headers, "webhook-id": webhook_id + "-replayed"}),
    "a refreshed timestamp": (body, {**headers, "webhook-timestamp": str(int(time.time()) + 1)}),
    "an expired timestamp": (body, {**headers, "webhook-timestamp": str(int(time.time()) - 3600)}),
}
for what, (data, forged) in tampered.items():
    try:
        hook.verify(data, forged)
    except Exception:
        continue
    print(f"accepted with {what}")
    sys.exit(1)
print("verified")
