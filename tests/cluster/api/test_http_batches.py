"""``cluster.api.http_batches``: OpenAI's Batch API over HTTP, files in, a durable orchard job,
files out, with the real ``openai`` SDK against a real frontend over a LocalBackend: a batch
uploaded, created, polled and downloaded, cancelled and paged, hidden from another tenant;
Batch lines of JSON schemas whose outputs validate, and lines refused at creation (a schema
that cannot compile, what a batch cannot do) with nothing stored. And an upload copied to
the store a piece at a time (``file_pieces`` into ``BatchStore.write``), refused past its cap.
"""
import io
import json
import time

import jsonschema
import openai
import pytest

from cluster.api.batch_store import BatchStore
from cluster.api.http_batches import COPY_BYTES, file_pieces
from cluster.api.http_errors import BodyTooLarge
from tests.support.http_api import CONFIG, batch_file, http_frontend, sdk
from tests.support.http_api import acme  # noqa: F401  (fixtures)
from tests.support.structured_outputs import tools_api  # noqa: F401  (a fixture)
from tests.support.structured_outputs import (BROKEN_FORMAT, BROKEN_PATH, PET, PET_FORMAT,
                                              jsonl_file, pet_line, sdk_client)


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    with http_frontend(tmp_path_factory, CONFIG, workers=2) as harness:
        yield harness



class _File(io.BytesIO):
    """An uploaded file that records how much each read asked for."""

    def __init__(self, data: bytes):
        super().__init__(data)
        self.asked: list[int] = []

    def read(self, size: int = -1) -> bytes:
        self.asked.append(size)
        return super().read(size)



class TestBatchFlow:
    def test_batch_flow_upload_create_poll_download(self, api, acme):
        uploaded = acme.files.create(file=("in.jsonl", batch_file(3)), purpose="batch")
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
            uploaded = acme.files.create(file=("in.jsonl", batch_file(8)), purpose="batch")
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



class TestStructuredBatches:
    """Against a model whose chat template renders tools (one real engine)."""

    @pytest.fixture
    def api(self, tools_api):
        return tools_api

    @pytest.fixture
    def client(self, tools_api) -> openai.OpenAI:
        return sdk_client(tools_api)

    def test_a_batch_of_json_schema_lines_whose_outputs_validate(self, client):
        lines = [pet_line(i, response_format=PET_FORMAT, logprobs=True, top_logprobs=1)
                 for i in range(4)]
        uploaded = client.files.create(file=("pets.jsonl", jsonl_file(lines)), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, completion_window="24h",
                                      endpoint="/v1/chat/completions")
        deadline = time.monotonic() + 120
        while batch.status != "completed" and time.monotonic() < deadline:
            time.sleep(0.1)
            batch = client.batches.retrieve(batch.id)
        assert (batch.status, batch.request_counts.completed) == ("completed", 4)
        out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
        assert [line["custom_id"] for line in out] == [f"pet-{i}" for i in range(4)]
        for line in out:
            body = line["response"]["body"]
            choice = body["choices"][0]
            jsonschema.validate(json.loads(choice["message"]["content"]), PET)
            entries = choice["logprobs"]["content"]
            assert len(entries) == body["usage"]["completion_tokens"]
            assert all(len(e["top_logprobs"]) == 1 for e in entries)

    def test_a_line_whose_schema_cannot_compile_is_refused_and_nothing_stored(self, api, client):
        lines = [pet_line(0, response_format=PET_FORMAT), pet_line(1, response_format=BROKEN_FORMAT)]
        uploaded = client.files.create(file=("bad.jsonl", jsonl_file(lines)), purpose="batch")
        with api.client("acme") as grpc_client:
            before = len(grpc_client.jobs())
            with pytest.raises(openai.BadRequestError) as caught:
                client.batches.create(input_file_id=uploaded.id, completion_window="24h",
                                      endpoint="/v1/chat/completions")
            assert len(grpc_client.jobs()) == before
        assert caught.value.body["message"].startswith(f"line 2.{BROKEN_PATH}: ")

    @pytest.mark.parametrize("body, param", [
        ({"stream": True}, "line 1.body.stream"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "line 1.body.tools"),
        ({"presence_penalty": 0.5}, "line 1.body.presence_penalty"),
    ])
    def test_a_line_asking_what_a_batch_cannot_do_is_refused(self, client, body, param):
        uploaded = client.files.create(file=("x.jsonl", jsonl_file([pet_line(0, **body)])),
                                       purpose="batch")
        with pytest.raises(openai.BadRequestError) as caught:
            client.batches.create(input_file_id=uploaded.id, completion_window="24h",
                                  endpoint="/v1/chat/completions")
        assert caught.value.body["param"] == param



class TestUploads:
    def test_an_upload_goes_to_disk_a_piece_at_a_time_and_is_refused_past_its_cap(self, tmp_path):
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
