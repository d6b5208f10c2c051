"""Structured outputs and log-probabilities over the HTTP API, the shared parts of their
tests (the HTTP app's, the log-probabilities', the Batch API's): a frontend serving a model
whose chat template renders tools (one real engine), the real ``openai`` SDK against it, a
schema that validates and one that cannot compile (llguidance knows no type "frobnicate"),
and Batch lines asking for them.
"""
from __future__ import annotations

import contextlib
import io
import json

import openai
import pytest

from tests.support.forged_models import tiny_model
from tests.support.frontend_harness import ACME_CONFIG, running_frontend

MODEL = "llama-tools"

USER = [{"role": "user", "content": "Describe a pet as JSON."}]


PET = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
                                        "legs": {"type": "integer", "minimum": 0, "maximum": 9}},
       "required": ["kind", "legs"], "additionalProperties": False}

PET_FORMAT = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET,
                                                     "strict": True}}


BROKEN = {"type": "object", "properties": {"a": {"type": "object", "properties": {
    "b": {"type": "frobnicate"}}}}}

BROKEN_PATH = "response_format.json_schema.schema.properties.a.properties.b"


BROKEN_FORMAT = {"type": "json_schema", "json_schema": {"name": "broken", "schema": BROKEN}}


@contextlib.contextmanager
def tools_frontend(tmp_path_factory):
    """One tenant (acme) and one worker serving the tiny model with a tools chat template."""
    run_dir = tmp_path_factory.mktemp("run")
    (run_dir / "orchard.toml").write_text(ACME_CONFIG)
    with running_frontend(run_dir, tiny_model(template="tools"), workers=1) as harness:
        yield harness


@pytest.fixture(scope="module")
def tools_api(tmp_path_factory):
    """``tools_frontend``, for the module (imported by name)."""
    with tools_frontend(tmp_path_factory) as harness:
        yield harness


def sdk_client(api) -> openai.OpenAI:
    address = json.loads((api.config.run_dir / "frontend.json").read_text())["http_address"]
    return openai.OpenAI(base_url=f"{address}/v1", api_key="key-acme", max_retries=0)


def chat(client, **params):
    return client.chat.completions.create(model=MODEL, messages=USER,
                                          **{"max_tokens": 40, "temperature": 0, **params})


def jsonl_file(lines: list[dict]) -> io.BytesIO:
    return io.BytesIO("".join(json.dumps(line) + "\n" for line in lines).encode())


def pet_line(i: int, **body) -> dict:
    return {"custom_id": f"pet-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": f"Pet {i}?"}],
                     "max_tokens": 40, "temperature": 1.0, "seed": i, **body}}
