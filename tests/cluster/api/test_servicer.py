"""``cluster.api.servicer``: the tenant-facing ``orchard.v1.Jobs`` and ``orchard.v1.Generate``.

A streamed RPC's items pumped by a task the RPC's end cancels (``until_rpc_done``), driven
directly; then the two services end to end, a real frontend over a LocalBackend (real
engines and router) and the real client: jobs submitted, listed, followed, resumed and
cancelled, one request generated and streamed, a stream cancelled or closed from another task;
SubmitJob with a response format and log-probabilities.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time

import grpc
import jsonschema
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase)

from cluster.api.batchfile import output_lines
from cluster.api.chat import ChatTokenizer
from cluster.api.client import OrchardError, chat_request, token_request
from cluster.api.edge import Authenticator
from cluster.api.intake import JobIntakeService
from cluster.api.servicer import GenerateServicer, until_rpc_done
from cluster.api.work import Work
from cluster.cli import main as orchard
from proto.orchard.v1 import orchard_pb2 as pb
from proto.orchard.v1 import orchard_pb2_grpc as pb_grpc
from tests.support.forged_models import tiny_model
from tests.support.frontend_harness import ACME_CONFIG, running_frontend
from tests.support.grpc_api import (BLOCK, CONFIG, SYSTEM, chat, finished_exactly,
                                    grpc_frontend, run_job, tokens)
from tests.support.grpc_api import acme, api_hostile, channel, tokenizer  # noqa: F401  (fixtures)
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
def api(tmp_path_factory):
    with grpc_frontend(tmp_path_factory, CONFIG, workers=2) as harness:
        yield harness








def _slots(api_hostile) -> dict[str, int]:
    async def held() -> dict[str, int]:
        return api_hostile.frontend.runner.slots_in_use()
    return api_hostile.run(held())


class CallContext:
    """What a servicer reads from grpc's per-call context, for driving a method directly."""

    def __init__(self, key: str):
        self._metadata = (("authorization", f"Bearer {key}"),)

    def invocation_metadata(self):
        return self._metadata

    def time_remaining(self):
        return None

    def add_done_callback(self, callback) -> None:
        pass  # the call never ends by itself here: the test closes the stream

    def done(self) -> bool:
        return False

    async def abort(self, code, details):
        raise AssertionError(f"aborted: {code} {details}")


class TestJobs:
    def test_job_runs_every_request_once_and_reuses_the_shared_prefix(self, acme, tokenizer):
        messages = [[{"role": "system", "content": SYSTEM},
                     {"role": "user", "content": f"question number {i}"}] for i in range(5)]
        requests = [chat_request(f"q{i}", m, 4) for i, m in enumerate(messages)]
        job, results = run_job(acme, requests)
        assert (job.state, job.completed, job.failed) == ("succeeded", 5, 0)
        assert sorted(r.index for r in results) == [0, 1, 2, 3, 4]
        assert [r.seq for r in results] == [0, 1, 2, 3, 4]
        assert all(r.ok and finished_exactly(r.usage.completion_tokens, 4, r.finish_reason)
                   for r in results)
        prompts = [tokenizer.render(m) for m in messages]
        assert [r.usage.prompt_tokens for r in sorted(results, key=lambda r: r.index)] == [
            len(p) for p in prompts]
        assert all(r.usage.prompt_tokens == r.usage.cached_tokens + r.usage.computed_tokens
                   for r in results)
        # the shared prefix (system prompt and "question number ") is computed once, then reused:
        # its whole 16-token blocks from the store, and its partial last block as well when the
        # request took a finished one's kept cache (each is handed to one request); a request
        # that spills over to the other worker (four run at once) reads nothing
        common = len(os.path.commonprefix(prompts))
        shared = common // BLOCK * BLOCK
        assert {r.usage.cached_tokens for r in results} <= {0, shared, common}
        assert sum(r.usage.cached_tokens >= shared for r in results) >= 3
        lines = [json.loads(line) for line in output_lines(results, created_s=0)]
        assert [line["custom_id"] for line in lines] == [f"q{i}" for i in range(5)]
        body = lines[1]["response"]["body"]
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == results[
            [r.index for r in results].index(1)].usage.cached_tokens
        assert body["choices"][0]["message"]["role"] == "assistant"

    def test_results_resume_from_an_offset(self, acme):
        job, results = run_job(acme, [chat(f"r{i}", f"resume {i}") for i in range(4)])
        tail = list(acme.results(job.job_id, offset=2))
        assert [r.seq for r in tail] == [2, 3]
        assert [r.custom_id for r in tail] == [r.custom_id for r in results[2:]]
        assert list(acme.results(job.job_id, offset=4, follow=True)) == []

    def test_a_prefix_cached_for_one_tenant_is_never_a_hit_for_another(self, api, acme):
        prompt = list(range(100, 164))  # four full blocks
        _, first = run_job(acme, [token_request("a1", prompt, 2)])
        _, again = run_job(acme, [token_request("a2", prompt, 2)])
        # all 4 blocks are held; the last prompt token is computed again for the first output
        assert again[0].usage.cached_tokens == 63
        with api.client("beta") as beta:
            _, other = run_job(beta, [token_request("b1", prompt, 2)])
            assert other[0].usage.cached_tokens == 0
            _, other_again = run_job(beta, [token_request("b2", prompt, 2)])
            assert other_again[0].usage.cached_tokens == 63  # beta's own copy

    def test_cancel_stops_a_running_job(self, acme):
        job = acme.submit([chat(f"c{i}", f"long answer {i}", max_tokens=200) for i in range(10)])
        cancelled = acme.cancel(job.job_id)
        assert cancelled.state == "cancelled"
        assert cancelled.completed + cancelled.failed + cancelled.cancelled == 10
        time.sleep(0.5)
        after = acme.job(job.job_id)
        assert after.completed + after.failed == cancelled.completed + cancelled.failed
        with pytest.raises(OrchardError) as err:
            acme.cancel(job.job_id)
        assert err.value.code == "FAILED_PRECONDITION" and "job_id" in err.value.message

    def test_unknown_job_ids_are_not_found(self, api, acme):
        for call in (acme.job, acme.cancel, lambda j: list(acme.results(j))):
            with pytest.raises(OrchardError) as err:
                call("job-does-not-exist")
            assert err.value.code == "NOT_FOUND" and "job_id" in err.value.message
        job, _ = run_job(acme, [tokens([5, 6, 7])])
        with api.client("beta") as beta, pytest.raises(OrchardError) as err:
            beta.job(job.job_id)  # another tenant's job does not exist for beta
        assert err.value.code == "NOT_FOUND"

    def test_cancelling_a_finished_job_is_failed_precondition(self, acme):
        job, _ = run_job(acme, [tokens([5, 6, 7])])
        with pytest.raises(OrchardError) as err:
            acme.cancel(job.job_id)
        assert err.value.code == "FAILED_PRECONDITION" and "already succeeded" in err.value.message

    def test_results_stream_resumes_after_a_disconnect_mid_job(self, acme):
        job = acme.submit([chat(f"s{i}", f"streamed {i}", max_tokens=24) for i in range(6)])
        stream = acme.results(job.job_id, follow=True)
        first = [next(stream), next(stream)]
        stream.close()  # the client goes away mid-job
        rest = list(acme.results(job.job_id, offset=first[-1].seq + 1, follow=True))
        seen = first + rest
        assert [r.seq for r in seen] == list(range(6))
        assert sorted(r.custom_id for r in seen) == sorted(f"s{i}" for i in range(6))
        assert acme.job(job.job_id).state == "succeeded"

    def test_a_retried_submission_with_its_idempotency_key_runs_once(self, acme):
        requests = [chat(f"k{i}", f"idempotent {i}") for i in range(2)]
        first = acme.submit(requests, idempotency_key="batch-2026-11-29")
        again = acme.submit(requests, idempotency_key="batch-2026-11-29")
        assert again.job_id == first.job_id
        assert [j.job_id for j in acme.jobs()].count(first.job_id) == 1
        assert acme.wait(first.job_id, poll_s=0.05, timeout_s=60).completed == 2
        assert acme.submit(requests, idempotency_key="another").job_id != first.job_id
        with pytest.raises(OrchardError) as err:
            acme.submit(requests, idempotency_key="x" * 257)
        assert err.value.code == "INVALID_ARGUMENT" and "idempotency_key" in err.value.message


class TestGenerate:
    def test_generate_streams_tokens_then_the_result(self, acme):
        events = list(acme.generate(chat("", "stream please", max_tokens=6)))
        deltas = [e.delta for e in events if e.WhichOneof("event") == "delta"]
        assert events[-1].WhichOneof("event") == "result"
        result = events[-1].result
        assert result.ok and finished_exactly(len(result.output_tokens), 6, result.finish_reason)
        assert [t for d in deltas for t in d.token_ids] == list(result.output_tokens)
        assert "".join(d.text for d in deltas) == result.text

    def test_generate_past_its_deadline_is_deadline_exceeded(self, acme):
        with pytest.raises(OrchardError) as err:
            list(acme.generate(chat("", "slow", max_tokens=200), timeout_s=0.05))
        assert err.value.code == "DEADLINE_EXCEEDED"
        assert acme.health() == "SERVING"

    def test_a_generate_stream_holds_a_slot_and_a_cancel_ends_it_cleanly(self, api_hostile, channel, caplog):
        caplog.set_level(logging.WARNING)
        stub = pb_grpc.GenerateStub(channel)
        call = stub.Generate(pb.GenerateRequest(request=token_request("", list(range(1, 11)), 1000)),
                             metadata=(("authorization", "Bearer key-acme"),), timeout=60)
        assert next(call).HasField("delta")
        assert _slots(api_hostile) == {"acme": 1}  # Generate shares max_concurrent with the jobs
        call.cancel()
        deadline = time.monotonic() + 10
        while _slots(api_hostile) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _slots(api_hostile) == {}
        time.sleep(0.2)
        problems = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert not [p for p in problems if "context" in p.lower()], problems

    def test_a_generate_stream_closed_from_another_task_detaches_no_span(self, api_hostile, caplog):
        """grpc closes a stream the client cancelled while it was suspended at a yield from
        another task: no span context may be attached across that yield."""
        caplog.set_level(logging.WARNING)
        model = api_hostile.backend.model_info()
        runner = api_hostile.frontend.runner
        work = Work(runner.direct, model, ChatTokenizer(model.model_dir),
                    JobIntakeService(api_hostile.frontend.store, runner, model, 100))
        servicer = GenerateServicer(Authenticator({"key-acme": "acme"}, frozenset()), work)
        request = pb.GenerateRequest(request=token_request("", list(range(1, 11)), 500))

        async def first_delta():
            stream = servicer.Generate(request, CallContext("key-acme"))
            return stream, await stream.__anext__()

        stream, first = api_hostile.run(first_delta())
        assert first.HasField("delta")

        async def close_elsewhere():
            await asyncio.create_task(stream.aclose())

        api_hostile.run(close_elsewhere())
        deadline = time.monotonic() + 10
        while _slots(api_hostile) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _slots(api_hostile) == {}
        problems = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert not [p for p in problems if "context" in p.lower()], problems


class TestTheServerBesideTheServices:
    def test_health_and_reflection(self, api):
        channel = grpc.insecure_channel(api.address)
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
        assert {"orchard.v1.Jobs", "orchard.v1.Generate", "orchard.v1.Admin",
                "grpc.health.v1.Health"} <= services
        channel.close()


def test_list_jobs_over_grpc_and_the_command(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    (run_dir / "orchard.toml").write_text(ACME_CONFIG)
    with running_frontend(run_dir, tiny_model(), workers=1) as api:
        with api.client("acme") as client:
            made = [client.submit([token_request("a", [5, 6, 7], 1)]) for _ in range(3)]
            for job in made:
                client.wait(job.job_id, poll_s=0.05, timeout_s=60)
            page, token = client.jobs_page(page_size=2)
            rest, last = client.jobs_page(page_size=2, page_token=token)
            assert [j.job_id for j in page + rest] == [j.job_id for j in made[::-1]]
            assert token and last == ""
            assert client.jobs(states=["running"]) == []
            assert len(client.jobs(states=["succeeded"], since_ms=made[1].created_unix_ms)) == 2
            with pytest.raises(OrchardError, match="INVALID_ARGUMENT: page_token"):
                client.jobs_page(page_token="bm9wZQ==")
        assert orchard(["jobs", "--run-dir", str(run_dir), "--state", "succeeded",
                        "--since", "1h", "--json"]) == 0
        listed = json.loads(capsys.readouterr().out)
        assert [j["job_id"] for j in listed] == [j.job_id for j in made[::-1]]
        assert all(j["finished_unix_ms"] >= j["created_unix_ms"] > 0 for j in listed)


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
