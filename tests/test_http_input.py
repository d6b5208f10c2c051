"""Input the HTTP API refuses with a status and the field named: bodies over the cap, JSON
nested past protobuf's limit, numbers its fields cannot hold, lone surrogates, Batch lines for
another model or over the prompt size (refused at intake over gRPC too).

A real frontend over a LocalBackend with small limits; raw requests go through ``http.client``
so that no client library's own checks are in the way.
"""
import http.client
import io
import json
from urllib.parse import urlsplit

import openai
import pytest
from google.protobuf import struct_pb2

from cluster.api.client import OrchardError, chat_request
from cluster.api.json_input import MAX_NESTING
from forged_models import tiny_model
from frontend_harness import ACME_CONFIG, running_frontend

PROMPT_CAP = 4096
BODY_CAP = 65536
CONFIG = ACME_CONFIG + f"""
[limits]
max_prompt_bytes = {PROMPT_CAP}

[http]
max_body_bytes = {BODY_CAP}
"""
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    (run_dir / "orchard.toml").write_text(CONFIG)
    with running_frontend(run_dir, tiny_model(), workers=1) as harness:
        yield harness


def _connection(api) -> http.client.HTTPConnection:
    address = json.loads((api.config.run_dir / "frontend.json").read_text())["http_address"]
    url = urlsplit(address)
    return http.client.HTTPConnection(url.hostname, url.port, timeout=60)


def post(api, path: str, body: bytes | str) -> tuple[int, dict]:
    """POST ``body`` as it is; the status and the decoded JSON answer."""
    conn = _connection(api)
    try:
        conn.request("POST", path, body=body.encode() if isinstance(body, str) else body,
                     headers={"authorization": "Bearer key-acme",
                              "content-type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def chat(api, **fields) -> tuple[int, dict]:
    return post(api, CHAT, json.dumps({"model": "llama", "messages": USER, "max_tokens": 1,
                                       **fields}))


def refused(status: int, param: str | None, message: str, code: str = "invalid_value") -> dict:
    kind = {400: "invalid_request_error", 413: "invalid_request_error"}[status]
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def test_a_body_over_the_configured_cap_is_refused_413_unread(api):
    conn = _connection(api)
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
    status, answer = chat(api, messages=[{"role": "user", "content": "x" * 60_000}])
    assert status == 400  # within the body cap: read, then refused by the prompt's own cap
    assert answer["error"]["message"] == (
        f"body.messages: 60000 bytes of text exceed the limit of {PROMPT_CAP} "
        "([limits] max_prompt_bytes); shorten the prompt")


def test_an_upload_over_its_own_cap_is_refused_413_unread(api):
    conn = _connection(api)
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


def nested(depth: int) -> str:
    """A chat body whose messages list holds lists ``depth`` levels deep, the body included."""
    return '{"model": "llama", "messages": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}"


@pytest.mark.parametrize("depth", [MAX_NESTING + 1, 30_000])  # 30,000: past Python's own
def test_json_nested_past_protobufs_limit_is_refused_400(api, depth):
    assert post(api, CHAT, nested(depth)) == (400, refused(
        400, "body", "body: nested deeper than 100 levels of arrays and objects; flatten it"))


def test_json_nested_to_the_limit_is_parsed(api):
    assert post(api, CHAT, nested(MAX_NESTING)) == (400, refused(
        400, "messages", "messages: must be a list of {role, content} objects"))


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


def test_protobufs_decoder_has_the_same_limit():
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
def test_numbers_out_of_range_name_the_field(api, fields, param, message):
    assert chat(api, **fields) == (400, refused(400, param, message))


def test_token_ids_out_of_range_name_the_field(api):
    body = json.dumps({"model": "llama", "prompt": [1, 2**70], "max_tokens": 1})
    assert post(api, "/v1/completions", body) == (400, refused(
        400, "prompt[1]", "prompt[1]: token id 1180591620717411303424 is outside the vocabulary"))


LONE = "a lone surrogate \\ud800 at character {}"
ADVICE = "escape a character outside the BMP as a surrogate pair"


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
def test_a_lone_surrogate_names_the_field(api, body, param, at):
    assert post(api, CHAT, body) == (400, refused(
        400, param, f"{param}: not Unicode text ({LONE.format(at)}); {ADVICE}"))


def test_a_surrogate_pair_is_text(api):
    status, answer = chat(api, messages=[{"role": "user", "content": "\U0001F600"}])
    assert status == 200 and answer["usage"]["completion_tokens"] == 1


def _upload(api, lines: list[dict]) -> str:
    client = openai.OpenAI(base_url=json.loads(
        (api.config.run_dir / "frontend.json").read_text())["http_address"] + "/v1",
        api_key="key-acme", max_retries=0)
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    return client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch").id


def _line(i: int, **body) -> dict:
    return {"custom_id": f"r{i}", "method": "POST", "url": CHAT,
            "body": {"model": "llama", "messages": USER, "max_tokens": 1, **body}}


def _batch(api, file_id: str) -> tuple[int, dict]:
    return post(api, "/v1/batches", json.dumps({"input_file_id": file_id, "endpoint": CHAT,
                                                "completion_window": "24h"}))


@pytest.mark.parametrize("model, shown", [("gpt-4o", "'gpt-4o'"), (None, "None")])
def test_a_batch_line_for_another_model_is_refused_as_chat_is(api, model, shown):
    line = _line(1, model=model)
    if model is None:
        del line["body"]["model"]
    file_id = _upload(api, [_line(0), line])
    assert _batch(api, file_id) == (400, refused(
        400, "line 2.body.model", f"line 2.body.model: unknown model {shown}; this cluster "
        "serves 'llama' (GET /v1/models)"))
    status, answer = chat(api, model=model)
    assert (status, answer["error"]["message"]) == (
        400, f"model: unknown model {shown}; this cluster serves 'llama' (GET /v1/models)")


def test_a_batch_line_protobuf_cannot_hold_names_the_line_and_field(api):
    file_id = _upload(api, [_line(0), _line(1, stop=["\ud800"]), _line(2)])
    assert _batch(api, file_id) == (400, refused(
        400, "line 2.body.stop[0]", f"line 2.body.stop[0]: not Unicode text ({LONE.format(0)}); "
        f"{ADVICE}"))
    file_id = _upload(api, [_line(0), _line(1, max_tokens=2**40)])
    assert _batch(api, file_id) == (400, refused(
        400, "line 2.body.max_tokens", "line 2.body.max_tokens: must be at most 2147483647, got "
        "1099511627776"))


def test_a_batch_line_over_the_prompt_size_is_refused_at_intake(api):
    before = len(api.frontend.store.list_jobs("acme", 1000))
    file_id = _upload(api, [_line(0), _line(1, messages=[
        {"role": "system", "content": "s" * 4000}, {"role": "user", "content": "u" * 97}])])
    assert _batch(api, file_id) == (400, refused(
        400, "line 2.messages", f"line 2.messages: 4097 bytes of text exceed the limit of "
        f"{PROMPT_CAP} ([limits] max_prompt_bytes); shorten the prompt"))
    assert len(api.frontend.store.list_jobs("acme", 1000)) == before


def test_a_job_over_the_prompt_size_is_refused_at_intake_over_grpc(api, tmp_path):
    big = [{"role": "user", "content": "é" * 2049}]  # 4098 bytes of UTF-8
    with api.client("acme") as client:
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


class _File(io.BytesIO):
    """An uploaded file that records how much each read asked for."""

    def __init__(self, data: bytes):
        super().__init__(data)
        self.asked: list[int] = []

    def read(self, size: int = -1) -> bytes:
        self.asked.append(size)
        return super().read(size)


def test_an_upload_goes_to_disk_a_piece_at_a_time_and_is_refused_past_its_cap(tmp_path):
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
