"""The OpenAI-compatible HTTP API's test frontends and requests, shared by the HTTP app's,
the Batch API's, the errors', the keys', the guards', JSON input's, the shapes' and the
validation's tests.

``http_frontend(tmp_path_factory, config)`` runs a real frontend over a LocalBackend (real
engines and router) from a fresh run directory; ``sdk(api)`` is the real ``openai`` SDK
against it. For input the API must refuse, ``post`` sends a body as it is through
``http.client``, so that no client library's own checks are in the way, and ``refused`` is
the error body expected back; the ``INPUT_CONFIG`` frontend has small caps to reach.
"""
from __future__ import annotations

import contextlib
import http.client
import io
import json
from urllib.parse import urlsplit

import openai
import pytest

from tests.support.forged_models import tiny_model
from tests.support.frontend_harness import ACME_CONFIG, TWO_TENANTS_CONFIG, running_frontend

CONFIG = TWO_TENANTS_CONFIG + """
[limits]
max_requests_per_job = 8
max_concurrent = 4
"""


SYSTEM = "You are a careful assistant who answers briefly and never rambles on. " * 4


@contextlib.contextmanager
def http_frontend(tmp_path_factory, config: str, workers: int = 1):
    """A real frontend under ``config`` serving the tiny model, in a run dir of its own."""
    run_dir = tmp_path_factory.mktemp("run")
    (run_dir / "orchard.toml").write_text(config)
    with running_frontend(run_dir, tiny_model(), workers=workers) as harness:
        yield harness


def sdk(api, key="key-acme") -> openai.OpenAI:
    address = json.loads((api.config.run_dir / "frontend.json").read_text())["http_address"]
    return openai.OpenAI(base_url=f"{address}/v1", api_key=key, max_retries=0)


def messages(user: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def batch_file(n: int, endpoint: str = "/v1/chat/completions") -> io.BytesIO:
    lines = [{"custom_id": f"conv{i}-turn1", "method": "POST", "url": endpoint,
              "body": {"model": "llama", "messages": messages(f"Question {i}?"),
                       "max_tokens": 3, "temperature": 0}} for i in range(n)]
    return io.BytesIO("".join(json.dumps(line) + "\n" for line in lines).encode())


PROMPT_CAP = 4096

BODY_CAP = 65536


INPUT_CONFIG = ACME_CONFIG + f"""
[limits]
max_prompt_bytes = {PROMPT_CAP}

[http]
max_body_bytes = {BODY_CAP}
"""


CHAT = "/v1/chat/completions"

USER = [{"role": "user", "content": "Hi"}]


def connection(api_httpinput) -> http.client.HTTPConnection:
    address = json.loads((api_httpinput.config.run_dir / "frontend.json").read_text())["http_address"]
    url = urlsplit(address)
    return http.client.HTTPConnection(url.hostname, url.port, timeout=60)


def post(api_httpinput, path: str, body: bytes | str) -> tuple[int, dict]:
    """POST ``body`` as it is; the status and the decoded JSON answer."""
    conn = connection(api_httpinput)
    try:
        conn.request("POST", path, body=body.encode() if isinstance(body, str) else body,
                     headers={"authorization": "Bearer key-acme",
                              "content-type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def chat(api_httpinput, **fields) -> tuple[int, dict]:
    return post(api_httpinput, CHAT, json.dumps({"model": "llama", "messages": USER, "max_tokens": 1,
                                       **fields}))


def refused(status: int, param: str | None, message: str, code: str = "invalid_value") -> dict:
    kind = {400: "invalid_request_error", 413: "invalid_request_error"}[status]
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


LONE = "a lone surrogate \\ud800 at character {}"

ADVICE = "escape a character outside the BMP as a surrogate pair"


def upload(api_httpinput, lines: list[dict]) -> str:
    client = openai.OpenAI(base_url=json.loads(
        (api_httpinput.config.run_dir / "frontend.json").read_text())["http_address"] + "/v1",
        api_key="key-acme", max_retries=0)
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    return client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch").id


def batch_line(i: int, **body) -> dict:
    return {"custom_id": f"r{i}", "method": "POST", "url": CHAT,
            "body": {"model": "llama", "messages": USER, "max_tokens": 1, **body}}


def create_batch(api_httpinput, file_id: str) -> tuple[int, dict]:
    return post(api_httpinput, "/v1/batches", json.dumps({"input_file_id": file_id, "endpoint": CHAT,
                                                "completion_window": "24h"}))


# The fixtures the HTTP tests share over the module's own ``api`` (imported by name).

@pytest.fixture(scope="module")
def acme(api):
    """The OpenAI SDK's client of ``api`` as tenant acme."""
    return sdk(api)


@pytest.fixture(scope="module")
def model(acme):
    """The model ``api`` serves."""
    return acme.models.list().data[0].id
