"""The OpenAI-compatible HTTP API end to end, with the real ``openai`` SDK as the client: a
real frontend over a LocalBackend (real engines and router), gRPC beside it on the same loop.

Input the HTTP API refuses with a status and the field named: bodies over the cap, JSON
nested past protobuf's limit, numbers its fields cannot hold, lone surrogates, Batch lines for
another model or over the prompt size (refused at intake over gRPC too).

A real frontend over a LocalBackend with small limits; raw requests go through ``http.client``
so that no client library's own checks are in the way.
"""
import io
import json
import time
import openai
import pytest
from cluster.api.client import OrchardError, chat_request
from cluster.api.http_errors import error_response
from cluster.backend.protocol import NoWorkerAvailable
from cluster.cli import main as orchard
from tests.support.forged_models import tiny_model
from tests.support.frontend_harness import TWO_TENANTS_CONFIG, running_frontend
import http.client
from urllib.parse import urlsplit
from google.protobuf import struct_pb2
from cluster.api.json_input import MAX_NESTING
from tests.support.frontend_harness import ACME_CONFIG, running_frontend


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

def _batch_file(n: int, endpoint: str = "/v1/chat/completions") -> io.BytesIO:
    lines = [{"custom_id": f"conv{i}-turn1", "method": "POST", "url": endpoint,
              "body": {"model": "llama", "messages": messages(f"Question {i}?"),
                       "max_tokens": 3, "temperature": 0}} for i in range(n)]
    return io.BytesIO("".join(json.dumps(line) + "\n" for line in lines).encode())


class TestHttpApi:
    def test_models_lists_the_served_model(self, api, acme):
        listed = acme.models.list().data
        assert [m.id for m in listed] == ["llama"]
        assert acme.models.retrieve("llama").owned_by == "orchard"

    def test_same_prompt_through_http_and_grpc_gives_the_same_tokens_and_cached_counts(self, 
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

    def test_streamed_chat_with_usage_matches_the_unstreamed_answer(self, acme, model):
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

    def test_streamed_chat_without_usage_has_no_usage_chunk(self, acme, model):
        chunks = list(acme.chat.completions.create(model=model, messages=messages("Hi"),
                                                   max_tokens=3, temperature=0, stream=True))
        assert all(c.choices and c.usage is None for c in chunks)
        assert chunks[-1].choices[0].finish_reason == "length"

    def test_completion_from_text_and_from_token_ids(self, acme, model):
        text = acme.completions.create(model=model, prompt="Once upon a time", max_tokens=4,
                                       temperature=0)
        assert text.object == "text_completion" and text.usage.completion_tokens == 4
        streamed = list(acme.completions.create(model=model, prompt="Once upon a time",
                                                max_tokens=4, temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in streamed) == text.choices[0].text
        ids = acme.completions.create(model=model, prompt=[5, 6, 7, 8], max_tokens=2,
                                      temperature=0)
        assert ids.usage.prompt_tokens == 4 and ids.usage.completion_tokens == 2

    def test_batch_flow_upload_create_poll_download(self, api, acme):
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

    def test_batch_cancel_and_paging(self, acme):
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

    def test_errors_in_openai_shape_with_a_status_each(self, api, acme, model):
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
    def test_server_side_statuses_map_to_http(self, exc, status, kind):
        response = error_response(exc)
        assert response.status_code == status
        assert json.loads(response.body)["error"]["type"] == kind

    def test_a_shed_request_is_a_429_with_its_retry_after_and_plain_backpressure_without(self):
        from cluster.jobs.admission import Overloaded
        from cluster.jobs.shedding import Shed

        response = error_response(Shed("overloaded: ...", 3))
        assert (response.status_code, response.headers["retry-after"]) == (429, "3")
        assert json.loads(response.body)["error"]["type"] == "rate_limit_error"
        response = error_response(Overloaded("requests: the cluster has 5 pending"))
        assert response.status_code == 429 and "retry-after" not in response.headers

    def test_managed_keys_apply_without_restart_and_revoked_or_expired_are_refused(self, 
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

    def test_each_http_request_is_one_trace_rooted_at_its_request(self, tmp_path):
        from cluster.telemetry.attrs import REQUEST_ID
        from cluster.telemetry.otlp_json import read_spans
        from tests.support.frontend_harness import ACME_CONFIG

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


PROMPT_CAP = 4096

BODY_CAP = 65536

CONFIG_HTTPINPUT = ACME_CONFIG + f"""
[limits]
max_prompt_bytes = {PROMPT_CAP}

[http]
max_body_bytes = {BODY_CAP}
"""

CHAT = "/v1/chat/completions"

USER = [{"role": "user", "content": "Hi"}]

@pytest.fixture(scope="module")
def api_httpinput(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    (run_dir / "orchard.toml").write_text(CONFIG_HTTPINPUT)
    with running_frontend(run_dir, tiny_model(), workers=1) as harness:
        yield harness

def _connection(api_httpinput) -> http.client.HTTPConnection:
    address = json.loads((api_httpinput.config.run_dir / "frontend.json").read_text())["http_address"]
    url = urlsplit(address)
    return http.client.HTTPConnection(url.hostname, url.port, timeout=60)

def post(api_httpinput, path: str, body: bytes | str) -> tuple[int, dict]:
    """POST ``body`` as it is; the status and the decoded JSON answer."""
    conn = _connection(api_httpinput)
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

def nested(depth: int) -> str:
    """A chat body whose messages list holds lists ``depth`` levels deep, the body included."""
    return '{"model": "llama", "messages": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}"

def _message(field: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field holding ``payload``."""
    size, length = len(payload), bytearray()
    while True:
        byte, size = size & 0x7F, size >> 7
        length.append(byte | (0x80 if size else 0))
        if not size:
            return bytes([field << 3 | 2]) + bytes(length) + payload

def _nested_values(levels: int) -> bytes:
    """``levels`` messages, each in the one before: Value, ListValue, Value, ... (a Value's
    list_value is field 6, a ListValue's values field 1), serialized from the innermost out."""
    data, top_is_value = b"", True
    for _ in range(levels - 1):
        data = _message(1, data) if top_is_value else _message(6, data)
        top_is_value = not top_is_value
    return data

LONE = "a lone surrogate \\ud800 at character {}"

ADVICE = "escape a character outside the BMP as a surrogate pair"

def _upload(api_httpinput, lines: list[dict]) -> str:
    client = openai.OpenAI(base_url=json.loads(
        (api_httpinput.config.run_dir / "frontend.json").read_text())["http_address"] + "/v1",
        api_key="key-acme", max_retries=0)
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    return client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch").id

def _line(i: int, **body) -> dict:
    return {"custom_id": f"r{i}", "method": "POST", "url": CHAT,
            "body": {"model": "llama", "messages": USER, "max_tokens": 1, **body}}

def _batch(api_httpinput, file_id: str) -> tuple[int, dict]:
    return post(api_httpinput, "/v1/batches", json.dumps({"input_file_id": file_id, "endpoint": CHAT,
                                                "completion_window": "24h"}))

class _File(io.BytesIO):
    """An uploaded file that records how much each read asked for."""

    def __init__(self, data: bytes):
        super().__init__(data)
        self.asked: list[int] = []

    def read(self, size: int = -1) -> bytes:
        self.asked.append(size)
        return super().read(size)


class TestHttpInput:
    def test_a_body_over_the_configured_cap_is_refused_413_unread(self, api_httpinput):
        conn = _connection(api_httpinput)
        try:
            conn.putrequest("POST", CHAT)
            conn.putheader("authorization", "Bearer key-acme")
            conn.putheader("content-length", str(256 << 20))  # 256 MiB declared, none sent
            conn.endheaders()
            response = conn.getresponse()
            assert (response.status, response.getheader("connection")) == (413, "close")
            assert json.loads(response.read()) == refused(
                413, "body", f"body: {256 << 20} bytes exceed the limit of {BODY_CAP} bytes ([http] "
                "max_body_bytes); send a smaller request", "request_too_large")
        finally:
            conn.close()
        status, answer = chat(api_httpinput, messages=[{"role": "user", "content": "x" * 60_000}])
        assert status == 400  # within the body cap: read, then refused by the prompt's own cap
        assert answer["error"]["message"] == (
            f"body.messages: 60000 bytes of text exceed the limit of {PROMPT_CAP} "
            "([limits] max_prompt_bytes); shorten the prompt")

    def test_an_upload_over_its_own_cap_is_refused_413_unread(self, api_httpinput):
        conn = _connection(api_httpinput)
        try:
            conn.putrequest("POST", "/v1/files")
            conn.putheader("authorization", "Bearer key-acme")
            conn.putheader("content-type", "multipart/form-data; boundary=b")
            conn.putheader("content-length", str((200 << 20) + (64 << 10) + 1))
            conn.endheaders()
            response = conn.getresponse()
            assert response.status == 413
            assert json.loads(response.read())["error"]["message"] == (
                f"body: {(200 << 20) + (64 << 10) + 1} bytes exceed the limit of "
                f"{(200 << 20) + (64 << 10)} bytes (a 200 MiB file and its form); split the file")
        finally:
            conn.close()

    @pytest.mark.parametrize("depth", [MAX_NESTING + 1, 30_000])  # 30,000: past Python's own
    def test_json_nested_past_protobufs_limit_is_refused_400(self, api_httpinput, depth):
        assert post(api_httpinput, CHAT, nested(depth)) == (400, refused(
            400, "body", "body: nested deeper than 100 levels of arrays and objects; flatten it"))

    def test_json_nested_to_the_limit_is_parsed(self, api_httpinput):
        assert post(api_httpinput, CHAT, nested(MAX_NESTING)) == (400, refused(
            400, "messages", "messages: must be a list of {role, content} objects"))

    def test_protobufs_decoder_has_the_same_limit(self):
        """The gRPC edge's limit is protobuf's own: a message holding MAX_NESTING levels of
        messages decodes, one holding one more does not."""
        struct_pb2.Value.FromString(_nested_values(1 + MAX_NESTING))
        with pytest.raises(Exception, match="MaxDepth"):
            struct_pb2.ListValue.FromString(_nested_values(2 + MAX_NESTING))

    @pytest.mark.parametrize("fields, param, message", [
        ({"max_tokens": 10**12}, "max_tokens",
         "max_tokens: must be at most 2147483647, got 1000000000000"),
        ({"max_tokens": None, "max_completion_tokens": 2**31}, "max_completion_tokens",
         "max_completion_tokens: must be at most 2147483647, got 2147483648"),
        ({"max_tokens": -10**12}, "max_tokens", "max_tokens: must be >= 1, got -1000000000000"),
        ({"seed": 2**70}, "seed", "seed: must be at most 18446744073709551615, got "
                                  "1180591620717411303424"),
        ({"temperature": 10**400}, "temperature",
         f"temperature: must be a finite number, got {str(10**400)[:64]}... (401 characters)"),
        ({"top_p": -10**400}, "top_p",
         f"top_p: must be a finite number, got {str(-10**400)[:64]}... (402 characters)"),
    ])
    def test_numbers_out_of_range_name_the_field(self, api_httpinput, fields, param, message):
        assert chat(api_httpinput, **fields) == (400, refused(400, param, message))

    def test_token_ids_out_of_range_name_the_field(self, api_httpinput):
        body = json.dumps({"model": "llama", "prompt": [1, 2**70], "max_tokens": 1})
        assert post(api_httpinput, "/v1/completions", body) == (400, refused(
            400, "prompt[1]", "prompt[1]: token id 1180591620717411303424 is outside the vocabulary"))

    @pytest.mark.parametrize("body, param, at", [
        ('{"model": "llama", "messages": [{"role": "user", "content": "hi\\ud800"}]}',
         "messages[0].content", 2),
        ('{"model": "llama", "messages": [{"role": "\\ud800", "content": "hi"}]}',
         "messages[0].role", 0),
        ('{"model": "llama", "messages": [{"role": "user", "content": [{"type": "text", '
         '"text": "\\ud800"}]}]}', "messages[0].content[0].text", 0),
        ('{"model": "llama", "messages": [{"role": "user", "content": "hi"}], "stop": '
         '["ok", "\\ud800"]}', "stop[1]", 0),
    ])
    def test_a_lone_surrogate_names_the_field(self, api_httpinput, body, param, at):
        assert post(api_httpinput, CHAT, body) == (400, refused(
            400, param, f"{param}: not Unicode text ({LONE.format(at)}); {ADVICE}"))

    def test_a_surrogate_pair_is_text(self, api_httpinput):
        status, answer = chat(api_httpinput, messages=[{"role": "user", "content": "\U0001F600"}])
        assert status == 200 and answer["usage"]["completion_tokens"] == 1

    @pytest.mark.parametrize("model, shown", [("gpt-4o", "'gpt-4o'"), (None, "None")])
    def test_a_batch_line_for_another_model_is_refused_as_chat_is(self, api_httpinput, model, shown):
        line = _line(1, model=model)
        if model is None:
            del line["body"]["model"]
        file_id = _upload(api_httpinput, [_line(0), line])
        assert _batch(api_httpinput, file_id) == (400, refused(
            400, "line 2.body.model", f"line 2.body.model: unknown model {shown}; this cluster "
            "serves 'llama' (GET /v1/models)"))
        status, answer = chat(api_httpinput, model=model)
        assert (status, answer["error"]["message"]) == (
            400, f"model: unknown model {shown}; this cluster serves 'llama' (GET /v1/models)")

    def test_a_batch_line_protobuf_cannot_hold_names_the_line_and_field(self, api_httpinput):
        file_id = _upload(api_httpinput, [_line(0), _line(1, stop=["\ud800"]), _line(2)])
        assert _batch(api_httpinput, file_id) == (400, refused(
            400, "line 2.body.stop[0]", f"line 2.body.stop[0]: not Unicode text ({LONE.format(0)}); "
            f"{ADVICE}"))
        file_id = _upload(api_httpinput, [_line(0), _line(1, max_tokens=2**40)])
        assert _batch(api_httpinput, file_id) == (400, refused(
            400, "line 2.body.max_tokens", "line 2.body.max_tokens: must be at most 2147483647, got "
            "1099511627776"))

    def test_a_batch_line_over_the_prompt_size_is_refused_at_intake(self, api_httpinput):
        before = len(api_httpinput.frontend.store.list_jobs("acme", 1000))
        file_id = _upload(api_httpinput, [_line(0), _line(1, messages=[
            {"role": "system", "content": "s" * 4000}, {"role": "user", "content": "u" * 97}])])
        assert _batch(api_httpinput, file_id) == (400, refused(
            400, "line 2.messages", f"line 2.messages: 4097 bytes of text exceed the limit of "
            f"{PROMPT_CAP} ([limits] max_prompt_bytes); shorten the prompt"))
        assert len(api_httpinput.frontend.store.list_jobs("acme", 1000)) == before

    def test_a_job_over_the_prompt_size_is_refused_at_intake_over_grpc(self, api_httpinput, tmp_path):
        big = [{"role": "user", "content": "é" * 2049}]  # 4098 bytes of UTF-8
        with api_httpinput.client("acme") as client:
            before = client.jobs()
            with pytest.raises(OrchardError) as err:
                client.submit([chat_request("a", USER, 1), chat_request("b", big, 1)])
            assert (err.value.code, err.value.message) == (
                "INVALID_ARGUMENT", "requests[1].messages: 4098 bytes of text exceed the limit of "
                f"{PROMPT_CAP} ([limits] max_prompt_bytes); shorten the prompt")
            path = tmp_path / "batch.jsonl"
            path.write_text(json.dumps(_line(0)) + "\n" + json.dumps(_line(1, messages=big)) + "\n")
            with pytest.raises(OrchardError) as err:
                client.submit_file(path)
            assert (err.value.code, err.value.message) == (
                "INVALID_ARGUMENT", "batch.jsonl:2: body.messages: 4098 bytes of text exceed the "
                f"limit of {PROMPT_CAP} ([limits] max_prompt_bytes); shorten the prompt")
            assert client.jobs() == before

    def test_an_upload_goes_to_disk_a_piece_at_a_time_and_is_refused_past_its_cap(self, tmp_path):
        from cluster.api.batch_store import BatchStore
        from cluster.api.http_batches import COPY_BYTES, file_pieces
        from cluster.api.http_errors import BodyTooLarge

        store = BatchStore(tmp_path, lambda: 0)
        upload = _File(b"x" * (3 * COPY_BYTES))
        staged = store.write(file_pieces(upload, 3 * COPY_BYTES))
        assert upload.asked == [COPY_BYTES] * 4  # three pieces, then the end
        assert staged.bytes == (tmp_path / "files" / staged.file_id).stat().st_size == 3 * COPY_BYTES
        with pytest.raises(BodyTooLarge) as err:
            store.write(file_pieces(_File(b"x" * (3 * COPY_BYTES + 1)), 3 * COPY_BYTES))
        assert str(err.value) == "file: larger than 3145728 bytes; split it"
        assert [p.name for p in (tmp_path / "files").iterdir()] == [staged.file_id]  # part removed
        store.close()
