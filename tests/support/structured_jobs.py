"""Batch lines and requests that ask for structured outputs and log-probabilities, and a
one-worker frontend for the acme tenant to submit them to.

``PET`` is a schema the grammar library compiles; ``BROKEN`` one it cannot (a look-behind),
refused at ``BROKEN_PATH``. ``batch_line`` writes one OpenAI Batch input line;
``structured_request`` parses one into the ``orchard.v1.Request`` that ``SubmitJob`` takes.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

from cluster.api.batchfile import parse_batch
from tests.support.forged_models import tiny_model
from tests.support.frontend_harness import ACME_CONFIG, running_frontend

PET = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
                                        "legs": {"type": "integer", "minimum": 0, "maximum": 9}},
       "required": ["kind", "legs"], "additionalProperties": False}
BROKEN = {"type": "array", "items": {"type": "string", "pattern": "(?<=a)b"}}  # look-behind
BROKEN_PATH = "response_format.json_schema.schema.items"
USER = [{"role": "user", "content": "A pet, please."}]


def fmt(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema,
                                                   "strict": True}}


def batch_line(custom_id: str, **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "m", "messages": USER, "max_tokens": 40,
                                "temperature": 0, **body}})


def structured_request(custom_id: str, schema: dict, top: int | None = None):
    (pb_request,) = parse_batch([batch_line(custom_id, response_format=fmt(schema),
                                            **({} if top is None else
                                               {"logprobs": True, "top_logprobs": top}))]
                                ).requests
    return pb_request


@contextlib.contextmanager
def acme_frontend(run_dir: Path):
    """A frontend over one worker of the tiny model, with the acme tenant's key."""
    (run_dir / "orchard.toml").write_text(ACME_CONFIG)
    with running_frontend(run_dir, tiny_model(), workers=1) as harness:
        yield harness
