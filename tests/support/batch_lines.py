"""Lines of an OpenAI Batch input file (JSONL), for the batch file's and the ``orchard
submit`` command's tests."""
from __future__ import annotations

import json

USER = [{"role": "user", "content": "hello"}]


def line(custom_id, messages=USER, **body):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "m", "messages": messages, **body}})
