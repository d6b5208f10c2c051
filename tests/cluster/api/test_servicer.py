"""``cluster.api.servicer``: ``until_rpc_done`` (a streamed RPC's items pumped by a task the
RPC's end cancels, the next item read only once the handler wants it), and ``SubmitJob`` with a
response format and log-probabilities, end to end through a frontend."""
from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from cluster.api.client import OrchardError, chat_request
from cluster.api.servicer import until_rpc_done
from tests.support.structured_jobs import (BROKEN, BROKEN_PATH, PET, USER, acme_frontend,
                                           structured_request)


class _Rpc:
    """The two calls ``until_rpc_done`` makes of a ``grpc.aio`` servicer context."""

    def __init__(self) -> None:
        self.callbacks = []

    def add_done_callback(self, callback) -> None:
        self.callbacks.append(callback)

    def done(self) -> bool:
        return False

    def end(self) -> None:
        for callback in self.callbacks:
            callback(self)


def _items(log: list[str], n: int):
    async def items():
        try:
            for i in range(n):
                log.append(f"yield {i}")
                yield i
                log.append(f"after {i}")
        finally:
            log.append("closed")
    return items()


def test_the_pump_reads_the_next_item_only_once_the_handler_wants_it():
    async def scenario():
        log: list[str] = []
        stream = until_rpc_done(_Rpc(), _items(log, 2))
        assert await anext(stream) == 0
        for _ in range(10):   # every chance to read ahead while the handler sends item 0
            await asyncio.sleep(0)
        before_next = list(log)
        assert [i async for i in stream] == [1]
        return before_next, log

    before_next, log = asyncio.run(scenario())
    # what the items do after their last yield (a request's trace) waits for the handler
    assert before_next == ["yield 0"]
    assert log == ["yield 0", "after 0", "yield 1", "after 1", "closed"]


def test_the_rpc_s_end_closes_the_items_where_they_wait():
    async def scenario():
        log: list[str] = []
        rpc = _Rpc()
        stream = until_rpc_done(rpc, _items(log, 3))
        assert await anext(stream) == 0
        assert await anext(stream) == 1
        rpc.end()               # the client went away while the handler sent item 1
        for _ in range(10):
            await asyncio.sleep(0)
        return log

    assert asyncio.run(scenario()) == ["yield 0", "after 0", "yield 1", "closed"]


@pytest.fixture(scope="module")
def frontend(tmp_path_factory):
    with acme_frontend(tmp_path_factory.mktemp("run")) as harness:
        yield harness


class TestSubmitJobWithAResponseFormat:
    """``SubmitJob`` takes the HTTP API's ``response_format``: a schema that cannot compile is
    refused at submission, naming the request and the schema's path, with nothing stored;
    results carry each token's log-probability."""

    def test_submit_job_with_a_schema_that_cannot_compile_is_refused_and_nothing_stored(
            self, frontend):
        with frontend.client("acme") as client:
            before = client.jobs()
            with pytest.raises(OrchardError) as caught:
                client.submit([structured_request("a", PET), structured_request("b", BROKEN)])
            assert client.jobs() == before
        assert caught.value.code == "INVALID_ARGUMENT"
        assert caught.value.message.startswith(f"requests[1].{BROKEN_PATH}: ")
        assert "look-around" in caught.value.message

    def test_submit_job_outputs_validate_and_carry_logprobs(self, frontend):
        with frontend.client("acme") as client:
            job = client.submit([structured_request(f"r{i}", PET, top=2) for i in range(3)]
                                + [chat_request("plain", USER, 3)])
            client.wait(job.job_id)
            results = {r.custom_id: r for r in client.results(job.job_id)}
        for i in range(3):
            result = results[f"r{i}"]
            jsonschema.validate(json.loads(result.text), PET)
            assert len(result.logprobs) == len(result.output_tokens)
            for entry, token in zip(result.logprobs, result.output_tokens):
                assert entry.token_id == token and len(entry.top_logprobs) == 2
                assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert list(results["plain"].logprobs) == []
