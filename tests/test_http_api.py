"""The OpenAI-compatible HTTP API end to end, with the real ``openai`` SDK as the client: a
real frontend over a LocalBackend (real engines and router), gRPC beside it on the same loop."""
import io
import json
import time

import openai
import pytest

from cluster.api.client import OrchardError, chat_request
from cluster.api.http_errors import error_response
from cluster.backend.protocol import NoWorkerAvailable
from cluster.cli import main as orchard
from forged_models import tiny_model
from frontend_harness import TWO_TENANTS_CONFIG, running_frontend

CONFIG = TWO_TENANTS_CONFIG + """
[limits]
max_requests_per_job = 8
max_concurrent = 4
"""
SYSTEM = "You are a careful assistant who answers briefly and never rambles on. " * 4


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    (run_dir / "orchard.toml").write_text(CONFIG)
    with running_frontend(run_dir, tiny_model(), workers=2) as harness:
        yield harness


def sdk(api, key="key-acme") -> openai.OpenAI:
    address = json.loads((api.config.run_dir / "frontend.json").read_text())["http_address"]
    return openai.OpenAI(base_url=f"{address}/v1", api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def acme(api):
    return sdk(api)


@pytest.fixture(scope="module")
def model(acme):
    return acme.models.list().data[0].id


def messages(user: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def test_models_lists_the_served_model(api, acme):
    listed = acme.models.list().data
    assert [m.id for m in listed] == ["llama"]
    assert acme.models.retrieve("llama").owned_by == "orchard"


def test_same_prompt_through_http_and_grpc_gives_the_same_tokens_and_cached_counts(
        api, acme, model):
    prompt = messages("Name three rivers of Europe.")
    with api.client("acme") as grpc_client:
        def through_grpc():
            events = list(grpc_client.generate(chat_request("", prompt, 6)))
            return events[-1].result

        first = through_grpc()  # cold: nothing cached
        http = acme.chat.completions.create(model=model, messages=prompt, max_tokens=6,
                                            temperature=0)
        again = through_grpc()  # warm, as the HTTP request was
    assert first.usage.cached_tokens == 0
    assert http.choices[0].message.content == first.text == again.text
    assert http.usage.completion_tokens == len(first.output_tokens) == 6
    assert http.usage.prompt_tokens == first.usage.prompt_tokens
    cached = http.usage.prompt_tokens_details.cached_tokens
    assert cached == again.usage.cached_tokens
    assert cached == first.usage.prompt_tokens - 1  # all but the last token: kept, then taken
    assert http.choices[0].finish_reason == "length" and http.object == "chat.completion"


def test_streamed_chat_with_usage_matches_the_unstreamed_answer(acme, model):
    prompt = messages("Say something about the sea.")
    whole = acme.chat.completions.create(model=model, messages=prompt, max_tokens=5,
                                         temperature=0)
    chunks = list(acme.chat.completions.create(
        model=model, messages=prompt, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    prompt_tokens = whole.usage.prompt_tokens  # the same prompt, again: all but its last token
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == prompt_tokens - 1
    assert all(c.usage is None for c in chunks[:-1])


def test_streamed_chat_without_usage_has_no_usage_chunk(acme, model):
    chunks = list(acme.chat.completions.create(model=model, messages=messages("Hi"),
                                               max_tokens=3, temperature=0, stream=True))
    assert all(c.choices and c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completion_from_text_and_from_token_ids(acme, model):
    text = acme.completions.create(model=model, prompt="Once upon a time", max_tokens=4,
                                   temperature=0)
    assert text.object == "text_completion" and text.usage.completion_tokens == 4
    streamed = list(acme.completions.create(model=model, prompt="Once upon a time",
                                            max_tokens=4, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == text.choices[0].text
    ids = acme.completions.create(model=model, prompt=[5, 6, 7, 8], max_tokens=2,
                                  temperature=0)
    assert ids.usage.prompt_tokens == 4 and ids.usage.completion_tokens == 2


def _batch_file(n: int, endpoint: str = "/v1/chat/completions") -> io.BytesIO:
    lines = [{"custom_id": f"conv{i}-turn1", "method": "POST", "url": endpoint,
              "body": {"model": "llama", "messages": messages(f"Question {i}?"),
                       "max_tokens": 3, "temperature": 0}} for i in range(n)]
    return io.BytesIO("".join(json.dumps(line) + "\n" for line in lines).encode())


def test_batch_flow_upload_create_poll_download(api, acme):
    uploaded = acme.files.create(file=("in.jsonl", _batch_file(3)), purpose="batch")
    assert acme.files.retrieve(uploaded.id).bytes == uploaded.bytes > 0
    assert (api.config.run_dir / "files" / uploaded.id).stat().st_mode & 0o777 == 0o600
    batch = acme.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                completion_window="24h", metadata={"team": "a"})
    deadline = time.monotonic() + 120
    while batch.status != "completed" and time.monotonic() < deadline:
        time.sleep(0.1)
        batch = acme.batches.retrieve(batch.id)
    assert batch.status == "completed" and batch.metadata == {"team": "a"}
    assert (batch.request_counts.total, batch.request_counts.completed,
            batch.request_counts.failed) == (3, 3, 0)
    assert batch.error_file_id is None
    lines = [json.loads(x) for x in acme.files.content(batch.output_file_id).text.splitlines()]
    assert [line["custom_id"] for line in lines] == ["conv0-turn1", "conv1-turn1", "conv2-turn1"]
    body = lines[0]["response"]["body"]
    assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 3
    assert "cached_tokens" in body["usage"]["prompt_tokens_details"]
    assert acme.batches.list(limit=1).data[0].id == batch.id
    # another tenant sees none of it
    with pytest.raises(openai.NotFoundError):
        sdk(api, "key-beta").batches.retrieve(batch.id)


def test_batch_cancel_and_paging(acme):
    ids = []
    for _ in range(2):
        uploaded = acme.files.create(file=("in.jsonl", _batch_file(8)), purpose="batch")
        ids.append(acme.batches.create(input_file_id=uploaded.id,
                                       endpoint="/v1/chat/completions",
                                       completion_window="24h").id)
    cancelled = acme.batches.cancel(ids[-1])
    assert cancelled.status == "cancelled"
    with pytest.raises(openai.ConflictError) as caught:  # FAILED_PRECONDITION -> 409
        acme.batches.cancel(ids[-1])
    assert "already cancelled" in caught.value.message
    first = acme.batches.list(limit=1)
    assert first.data[0].id == ids[-1] and first.has_more
    second = acme.batches.list(limit=1, after=first.data[0].id)
    assert second.data[0].id == ids[0]


def test_errors_in_openai_shape_with_a_status_each(api, acme, model):
    with pytest.raises(openai.AuthenticationError) as caught:  # UNAUTHENTICATED -> 401
        sdk(api, "no-such-key").models.list()
    assert caught.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.PermissionDeniedError):  # PERMISSION_DENIED -> 403
        sdk(api, "key-admin").chat.completions.create(model=model, messages=messages("x"))
    with pytest.raises(openai.BadRequestError) as caught:  # INVALID_ARGUMENT -> 400
        acme.chat.completions.create(model=model, messages=messages("x"), max_tokens=0)
    assert caught.value.body == {"message": "body.sampling.max_tokens: must be >= 1, got 0",
                                 "type": "invalid_request_error", "param": "max_tokens",
                                 "code": "invalid_value"}
    with pytest.raises(openai.BadRequestError) as caught:
        acme.chat.completions.create(model="gpt-4o", messages=messages("x"))
    assert caught.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):  # NOT_FOUND -> 404
        acme.batches.retrieve("batch_nope")
    lines = _batch_file(2).getvalue().decode().splitlines()
    bad = [lines[0], "", lines[1].replace('"role": "user"', '"role": "robot"')]
    uploaded = acme.files.create(file=("in.jsonl", io.BytesIO("\n".join(bad).encode())),
                                 purpose="batch")
    with pytest.raises(openai.BadRequestError) as caught:  # the file's line, not requests[1]
        acme.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                            completion_window="24h")
    assert caught.value.body["message"].startswith("line 3.messages[1].role: unknown role 'robot'")
    uploaded = acme.files.create(file=("in.jsonl", io.BytesIO(b"{not json\n")),
                                 purpose="batch")
    with pytest.raises(openai.BadRequestError, match="line 1: not valid JSON"):
        acme.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                            completion_window="24h")
    uploaded = acme.files.create(file=("in.jsonl", _batch_file(9)), purpose="batch")
    with pytest.raises(openai.RateLimitError) as caught:  # RESOURCE_EXHAUSTED -> 429
        acme.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                            completion_window="24h")
    assert "9 requests exceed the limit of 8" in caught.value.message


@pytest.mark.parametrize("exc, status, kind", [
    (NoWorkerAvailable("no ready worker"), 503, "server_error"),    # UNAVAILABLE
    (TimeoutError("ran 600 s"), 504, "server_error"),                # DEADLINE_EXCEEDED
    (KeyError("a bug"), 500, "server_error"),                        # INTERNAL
])
def test_server_side_statuses_map_to_http(exc, status, kind):
    response = error_response(exc)
    assert response.status_code == status
    assert json.loads(response.body)["error"]["type"] == kind


def test_managed_keys_apply_without_restart_and_revoked_or_expired_are_refused(
        api, model, capsys):
    run_dir = str(api.config.run_dir)
    assert orchard(["keys", "create", "--tenant", "beta", "--name", "ci", "--run-dir",
                    run_dir]) == 0
    key = capsys.readouterr().out.strip()
    assert key.startswith("sk-beta-")
    assert key not in (api.config.run_dir / "keys.json").read_text()  # stored hashed
    client = sdk(api, key)
    reply = client.chat.completions.create(model=model, messages=messages("hi"), max_tokens=1)
    assert reply.usage.completion_tokens == 1
    with api.client(api_key=key) as grpc_client:  # gRPC accepts it too
        assert grpc_client.jobs() is not None
    assert orchard(["keys", "list", "--json", "--run-dir", run_dir]) == 0
    listed = json.loads(capsys.readouterr().out)
    key_id = listed[0]["id"]
    assert listed[0]["tenant"] == "beta" and listed[0]["state"] == "active"
    assert orchard(["keys", "revoke", key_id, "--run-dir", run_dir]) == 0
    with pytest.raises(openai.AuthenticationError) as revoked:
        client.models.list()
    with api.client(api_key=key) as grpc_client:
        with pytest.raises(OrchardError, match="UNAUTHENTICATED: authorization: unknown API key"):
            grpc_client.jobs()
    # an expired key: created already past its expiry by giving the store a later clock
    from cluster.api.keys import KeyStore
    past = KeyStore(api.config.run_dir, lambda: time.time_ns() // 1_000_000 - 2 * 86_400_000)
    _, expired_key = past.create("beta", "old", expires_days=1)
    with pytest.raises(openai.AuthenticationError) as expired:
        sdk(api, expired_key).models.list()
    with pytest.raises(openai.AuthenticationError) as unknown:
        sdk(api, "sk-beta-never-issued").models.list()
    assert revoked.value.body == expired.value.body == unknown.value.body  # no hint of which
    assert sdk(api, "key-beta").models.list().data  # the orchard.toml key still works


def test_each_http_request_is_one_trace_rooted_at_its_request(tmp_path):
    from cluster.telemetry.attrs import REQUEST_ID
    from cluster.telemetry.otlp_json import read_spans
    from frontend_harness import ACME_CONFIG

    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    (run_dir / "orchard.toml").write_text(ACME_CONFIG)
    with running_frontend(run_dir, tiny_model(), workers=1) as harness:
        client = sdk(harness)
        plain = client.chat.completions.create(model="llama", messages=messages("a"),
                                               max_tokens=2)
        caller = f"00-{'ab' * 16}-{'cd' * 8}-01"
        child = client.chat.completions.create(model="llama", messages=messages("b"),
                                               max_tokens=2, extra_headers={"traceparent": caller})
    spans = read_spans(run_dir / "traces").spans

    def request_span(reply):
        request_id = reply.id.removeprefix("chatcmpl-")
        (span,) = [s for s in spans if s.attributes.get("orchard.span") == "request"
                   and s.attributes.get(REQUEST_ID) == request_id]
        return span

    root = request_span(plain)
    assert not root.parent_span_id  # the HTTP request is the root of its own trace
    inside = [s for s in spans if s.trace_id == root.trace_id]
    assert len(inside) > 1 and all(s.trace_id != request_span(child).trace_id for s in inside)
    assert request_span(child).trace_id == "ab" * 16
    assert request_span(child).parent_span_id == "cd" * 8
