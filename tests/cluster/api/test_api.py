"""The gRPC API end to end: a real frontend, LocalBackend (real engines + router), real clients.

The gRPC API against hostile and clumsy callers: bad bytes, huge values, wrong schemes.

A real frontend over a LocalBackend; raw bytes go through a plain grpc channel so that the
client library's own checks are not in the way.
"""
import json
import os
import time
import grpc
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase)
from cluster.api.batchfile import output_lines
from cluster.api.chat import ChatTokenizer
from cluster.api.client import Client, OrchardError, chat_request, token_request
from tests.support.forged_models import tiny_model
from tests.support.frontend_harness import TWO_TENANTS_CONFIG, running_frontend
from proto.orchard.v1 import orchard_pb2 as pb
from proto.orchard.v1 import orchard_pb2_grpc as pb_grpc
import asyncio
import logging
import re
import threading
from cluster.api.edge import Authenticator
from cluster.api.intake import JobIntakeService
from cluster.api.work import Work
from cluster.api.servicer import GenerateServicer


CONFIG = TWO_TENANTS_CONFIG + """
[limits]
max_requests_per_job = 16
max_pending_per_tenant = 12
max_concurrent = 4
"""

SYSTEM = "You are a careful assistant who answers briefly. " * 6

BLOCK = 16  # the harness's block size

@pytest.fixture(scope="module")
def tokenizer():
    """The model's chat template, to know each prompt's tokens (read only)."""
    tok = ChatTokenizer(tiny_model())
    yield tok
    tok.close()

def finished_exactly(output_tokens: int, max_tokens: int, finish_reason: str) -> bool:
    """A result stops at ``max_tokens`` ("length") or earlier at EOS ("stop"), never else."""
    return (finish_reason == "length" and output_tokens == max_tokens) or (
        finish_reason == "stop" and 1 <= output_tokens <= max_tokens)

@pytest.fixture(scope="module")
def api(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    (run_dir / "orchard.toml").write_text(CONFIG)
    with running_frontend(run_dir, tiny_model(), workers=2) as harness:
        yield harness

@pytest.fixture(scope="module")
def acme(api):
    with api.client("acme") as client:
        yield client

def chat(custom_id, user, max_tokens=4, system=SYSTEM):
    return chat_request(custom_id, [{"role": "system", "content": system},
                                    {"role": "user", "content": user}], max_tokens)

def run_job(client, requests):
    job = client.submit(requests)
    job = client.wait(job.job_id, poll_s=0.05, timeout_s=120)
    return job, list(client.results(job.job_id))

def tokens(ids, max_tokens=2):
    return pb.Request(custom_id="t", tokens=pb.TokenIds(ids=ids),
                      sampling=pb.SamplingParams(max_tokens=max_tokens))

def messages(*msgs, max_tokens=2):
    return chat_request("m", list(msgs), max_tokens)

BAD_JOBS = {
    "empty job": ([], "requests"),
    "empty message list": ([messages()], "requests[0].messages"),
    "unknown role": ([messages({"role": "wizard", "content": "hi"})], "messages[0].role"),
    "non-string content": ([messages({"role": "user", "content": 5})], "messages[0].content"),
    "object content": ([messages({"role": "user", "content": {"a": 1}})],
                       "messages[0].content"),
    "token id above the vocabulary": ([tokens([1, 10**9])], "tokens.ids[1]"),
    "negative token id": ([tokens([-1, 3])], "tokens.ids[0]"),
    "max tokens zero": ([tokens([1, 2], 0)], "sampling.max_tokens"),
    "max tokens negative": ([tokens([1, 2], -3)], "sampling.max_tokens"),
    "max tokens above the context": (lambda ctx: [tokens([1, 2], ctx)], "sampling.max_tokens"),
    "prompt over the context": (lambda ctx: [tokens([7] * ctx, 1)], "requests[0].prompt"),
    "missing prompt": ([pb.Request(custom_id="x", sampling=pb.SamplingParams(max_tokens=1))],
                       "requests[0].prompt"),
}


class TestBehaviour:
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

    def test_generate_streams_tokens_then_the_result(self, acme):
        events = list(acme.generate(chat("", "stream please", max_tokens=6)))
        deltas = [e.delta for e in events if e.WhichOneof("event") == "delta"]
        assert events[-1].WhichOneof("event") == "result"
        result = events[-1].result
        assert result.ok and finished_exactly(len(result.output_tokens), 6, result.finish_reason)
        assert [t for d in deltas for t in d.token_ids] == list(result.output_tokens)
        assert "".join(d.text for d in deltas) == result.text

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

    def test_admin_workers_stats_and_invalidation(self, api, acme):
        prompt = list(range(300, 364))
        with api.client(admin=True) as admin:
            before = admin.cache_stats()
            _, (first,) = run_job(acme, [token_request("i1", prompt, 2)])
            workers = admin.workers()
            assert {w.state for w in workers} == {"ready"} and len(workers) == 2
            stats = admin.cache_stats()
            # a new 64-token prompt: nothing read, four blocks computed and stored
            assert (first.usage.cached_tokens, first.usage.written_tokens) == (0, 64)
            assert stats.workers == 2 and stats.cached_tokens == before.cached_tokens
            assert stats.cache_blocks == before.cache_blocks + 4
            assert stats.written_tokens == before.written_tokens + 64
            assert stats.computed_tokens == before.computed_tokens + 64
            # everything stored under the first two blocks goes; the first block stays
            assert admin.invalidate("acme", token_ids=prompt[:32]) == 3
            _, rerun = run_job(acme, [token_request("i2", prompt, 2)])
            assert rerun[0].usage.cached_tokens == 16
            held = admin.cache_stats().cache_blocks
            beta_blocks = admin.invalidate("beta")
            acme_blocks = admin.invalidate("acme")
            assert acme_blocks + beta_blocks == held
            assert admin.cache_stats().cache_blocks == 0
            assert admin.invalidate("acme") == 0
            assert admin.health("orchard.v1.Admin") == "SERVING"

    def test_health_and_reflection(self, api):
        channel = grpc.insecure_channel(api.address)
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
        assert {"orchard.v1.Jobs", "orchard.v1.Generate", "orchard.v1.Admin",
                "grpc.health.v1.Health"} <= services
        channel.close()

    @pytest.mark.parametrize("case", sorted(BAD_JOBS))
    def test_bad_job_is_invalid_argument_naming_the_field(self, api, acme, case):
        requests, field = BAD_JOBS[case]
        if callable(requests):  # sized from the served model's context
            requests = requests(api.backend.model_info().max_context)
        with pytest.raises(OrchardError) as err:
            acme.submit(requests)
        assert err.value.code == "INVALID_ARGUMENT"
        assert field in err.value.message

    def test_duplicate_custom_ids(self, acme):
        with pytest.raises(OrchardError) as err:
            acme.submit([tokens([1, 2]), tokens([3, 4])])
        assert err.value.code == "INVALID_ARGUMENT"
        assert "requests[1].custom_id" in err.value.message and "duplicate" in err.value.message

    def test_a_job_above_the_size_limit_is_resource_exhausted(self, acme):
        with pytest.raises(OrchardError) as err:
            acme.submit([tokens([1, 2], 1)] * 17)  # 17 > max_requests_per_job = 16
        assert err.value.code == "RESOURCE_EXHAUSTED"
        assert err.value.message.startswith("requests:") and "limit of 16" in err.value.message

    def test_backpressure_is_resource_exhausted(self, acme):
        with pytest.raises(OrchardError) as err:
            acme.submit([chat(f"p{i}", "x") for i in range(13)])  # 13 > 12 pending per tenant
        assert err.value.code == "RESOURCE_EXHAUSTED" and "requests" in err.value.message

    def test_authentication_and_permissions(self, api):
        channel = grpc.insecure_channel(api.address)
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.JobsStub(channel).ListJobs(pb.ListJobsRequest())
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "authorization" in err.value.details()
        channel.close()
        cases = [(Client(api.address, "wrong-key").jobs, "UNAUTHENTICATED"),
                 (Client(api.address, "key-acme").workers, "PERMISSION_DENIED"),
                 (Client(api.address, "key-admin").jobs, "PERMISSION_DENIED"),
                 (Client(api.address, "wrong-key").cache_stats, "UNAUTHENTICATED")]
        for call, code in cases:
            with pytest.raises(OrchardError) as err:
                call()
            assert err.value.code == code and "authorization" in err.value.message

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

    def test_bad_generate_and_admin_calls(self, api, acme):
        with pytest.raises(OrchardError) as err:
            list(acme.generate(tokens([1, 2], 0)))
        assert err.value.code == "INVALID_ARGUMENT" and "request.sampling.max_tokens" in err.value.message
        with api.client(admin=True) as admin:
            for call, code, field in ((lambda: admin.scale(0), "INVALID_ARGUMENT", "workers"),
                                      (lambda: admin.drain("nope"), "NOT_FOUND", "worker_id"),
                                      (lambda: admin.invalidate("nobody"), "INVALID_ARGUMENT",
                                       "tenant")):
                with pytest.raises(OrchardError) as err:
                    call()
                assert err.value.code == code and field in err.value.message

    def test_the_server_keeps_serving_after_bad_input(self, api, acme):
        job, results = run_job(acme, [chat("after", "still there?")])
        assert job.state == "succeeded" and results[0].ok
        assert acme.health() == "SERVING"

    def test_drain_and_scale_while_serving(self, api, acme):
        with api.client(admin=True) as admin:
            drained = admin.drain("local-0")
            assert drained.state == "draining"
            _, results = run_job(acme, [chat(f"d{i}", f"after drain {i}") for i in range(3)])
            assert {r.worker_id for r in results} == {"local-1"}
            assert [w.worker_id for w in admin.workers()] == ["local-1"]
            assert sorted(w.worker_id for w in admin.scale(2)) == ["local-1", "local-2"]

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

    def test_generate_past_its_deadline_is_deadline_exceeded(self, acme):
        with pytest.raises(OrchardError) as err:
            list(acme.generate(chat("", "slow", max_tokens=200), timeout_s=0.05))
        assert err.value.code == "DEADLINE_EXCEEDED"
        assert acme.health() == "SERVING"

    def test_with_every_worker_drained_jobs_wait_and_generate_is_unavailable(self, api, acme):
        with api.client(admin=True) as admin:
            for worker in admin.workers():
                admin.drain(worker.worker_id)
            assert admin.workers() == []
            with pytest.raises(OrchardError) as err:
                list(acme.generate(chat("", "anyone?")))
            assert err.value.code == "UNAVAILABLE"
            job = acme.submit([chat(f"w{i}", f"waiting {i}") for i in range(3)])
            time.sleep(0.3)
            assert acme.job(job.job_id).done == 0  # accepted, waiting for a worker
            admin.scale(1)
            done = acme.wait(job.job_id, poll_s=0.05, timeout_s=60)
            assert (done.state, done.completed) == ("succeeded", 3)
            assert len(admin.scale(2)) == 2  # the module's frontend as the other tests know it

    def test_invalidate_by_chat_prefix(self, api, acme, tokenizer):
        system = {"role": "system", "content": "The invalidation test's own assistant. " * 8}
        prompt = tokenizer.render([system, {"role": "user", "content": "cache me"}])
        ask = lambda cid: chat(cid, "cache me", system=system["content"])  # noqa: E731
        _, (first,) = run_job(acme, [ask("v1")])
        _, (warm,) = run_job(acme, [ask("v2")])
        assert (first.usage.cached_tokens, first.usage.prompt_tokens) == (0, len(prompt))
        # the same prompt again: all of it but the last token (the store's blocks and the kept
        # cache's partial block)
        assert warm.usage.cached_tokens == len(prompt) - 1
        stored = (first.usage.written_tokens + warm.usage.written_tokens) // BLOCK
        with api.client(admin=True) as admin:
            removed = admin.invalidate("acme", messages=[system])
        # the system prompt's last full block and everything under it went; earlier blocks stay
        kept = len(tokenizer.render_prefix([system])) // BLOCK - 1
        assert removed == stored - kept
        _, (rerun,) = run_job(acme, [ask("v3")])
        assert rerun.usage.cached_tokens == kept * BLOCK

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


CONFIG_HOSTILE = TWO_TENANTS_CONFIG

class HeldTokenizer(ChatTokenizer):
    """The frontend's tokenizer, holding any conversation of over 100,000 characters in its
    thread (``entered`` set) until ``release`` is set: a big prompt's tokenizing made as long
    as a test needs, whatever the machine's speed."""

    def __init__(self, model_dir) -> None:
        super().__init__(model_dir)
        self.entered, self.release = threading.Event(), threading.Event()

    def _apply(self, messages, add_generation_prompt, tools):
        if sum(len(str(m.get("content", ""))) for m in messages) > 100_000:
            self.entered.set()
            assert self.release.wait(120), "the held tokenizer was never released"
        return super()._apply(messages, add_generation_prompt, tools)


@pytest.fixture(scope="module")
def api_hostile(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    (run_dir / "orchard.toml").write_text(CONFIG_HOSTILE)
    tokenizer = HeldTokenizer(tiny_model())
    tokenizer.release.set()  # held only where a test clears it
    with running_frontend(run_dir, tiny_model(), workers=1, tokenizer=tokenizer) as harness:
        harness.tokenizer = tokenizer
        yield harness

@pytest.fixture(scope="module")
def channel(api_hostile):
    with grpc.insecure_channel(api_hostile.address) as channel:
        yield channel

def _raw(channel, method: str, data: bytes, key: str | None, streaming: bool = False):
    """Send ``data`` as the request bytes of ``method``; returns the status code raised."""
    metadata = (("authorization", f"Bearer {key}"),) if key else ()
    if streaming:
        call = channel.unary_stream(method)
        with pytest.raises(grpc.RpcError) as info:
            list(call(data, metadata=metadata, timeout=30))
    else:
        call = channel.unary_unary(method)
        with pytest.raises(grpc.RpcError) as info:
            call(data, metadata=metadata, timeout=30)
    return info.value.code(), info.value.details()

def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (wire type 2)."""
    return bytes([number << 3 | 2]) + _varint(len(payload)) + payload

def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)

def _deep_value(depth: int) -> bytes:
    """A google.protobuf.Value nested ``depth`` lists deep (Value.list_value = 6,
    ListValue.values = 1)."""
    value = b""
    for _ in range(depth):
        value = _field(6, _field(1, value))
    return value

def _deep_generate(depth: int) -> bytes:
    message = _field(1, b"user") + _field(2, _deep_value(depth))  # ChatMessage role, content
    request = _field(2, _field(1, message))  # Request.messages.messages[0]
    return _field(1, request)                # GenerateRequest.request

GARBAGE = b"\xff\xff\xff\xff\x0f\x01"

BAD_UTF8_JOB_ID = _field(1, b"job-\xff\xfe")  # GetJobRequest.job_id

HUGE = "x" * 100_000

def _error(call) -> tuple[str, str]:
    with pytest.raises(OrchardError) as info:
        call()
    return info.value.code, info.value.message

def _generate(client, request):
    return lambda: list(client.generate(request, timeout_s=30))

MIB = 1 << 20

FILLER = "The quick brown fox jumps over the lazy dog, again and again. "

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


class TestHostile:
    @pytest.mark.parametrize("method,data,streaming", [
        ("/orchard.v1.Jobs/GetJob", GARBAGE, False),
        ("/orchard.v1.Jobs/GetJob", BAD_UTF8_JOB_ID, False),
        ("/orchard.v1.Jobs/StreamResults", BAD_UTF8_JOB_ID, True),
        ("/orchard.v1.Generate/Generate", _deep_generate(150), True),
        ("/orchard.v1.Admin/Drain", GARBAGE, False),
    ])
    def test_bytes_that_are_not_a_message_get_invalid_argument(self, channel, method, data, streaming):
        key = "key-admin" if ".Admin/" in method else "key-acme"
        code, details = _raw(channel, method, data, key, streaming)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert details.startswith("request: not a valid orchard.v1.")

    def test_bad_bytes_still_need_a_key_first(self, channel):
        code, _ = _raw(channel, "/orchard.v1.Jobs/GetJob", GARBAGE, key=None)
        assert code == grpc.StatusCode.UNAUTHENTICATED
        code, _ = _raw(channel, "/orchard.v1.Jobs/GetJob", GARBAGE, key="not-a-key")
        assert code == grpc.StatusCode.UNAUTHENTICATED
        code, _ = _raw(channel, "/orchard.v1.Admin/Drain", GARBAGE, key="key-acme")
        assert code == grpc.StatusCode.PERMISSION_DENIED

    def test_nesting_within_the_limit_is_still_parsed(self, channel):
        code, details = _raw(channel, "/orchard.v1.Generate/Generate", _deep_generate(20), "key-acme",
                             streaming=True)
        assert code == grpc.StatusCode.INVALID_ARGUMENT  # well-formed, but not text content
        assert details == "request.messages[0].content[0]: a content part must be {\"type\": \"text\", \"text\": \"...\"}"

    def test_huge_values_are_quoted_short_and_keep_their_status(self, api_hostile):
        with api_hostile.client("acme") as acme, api_hostile.client(admin=True) as admin:
            assert _error(lambda: acme.job(HUGE)) == (
                "NOT_FOUND", f"job_id: no job {'x' * 64!r}... (100000 characters)")
            assert _error(lambda: acme.cancel(HUGE))[0] == "NOT_FOUND"
            code, message = _error(_generate(acme, chat_request(
                "r", [{"role": HUGE, "content": "hi"}], 4)))
            assert code == "INVALID_ARGUMENT"
            assert message.startswith(f"request.messages[0].role: unknown role {'x' * 64!r}... "
                                      "(100000 characters); use one of")
            assert _error(lambda: admin.invalidate(HUGE)) == (
                "INVALID_ARGUMENT", f"tenant: unknown tenant {'x' * 64!r}... (100000 characters); "
                "known: acme, beta")
            assert _error(lambda: admin.drain(HUGE)) == (
                "NOT_FOUND", f"worker_id: no worker {'x' * 64!r}... (100000 characters)")

    def test_custom_id_and_stop_strings_are_capped(self, api_hostile):
        with api_hostile.client("acme") as acme:
            assert _error(lambda: acme.submit([token_request("c" * 257, [1, 2], 2)])) == (
                "INVALID_ARGUMENT", "requests[0].custom_id: 257 bytes; use at most 256")
            assert _error(lambda: acme.submit([token_request("é" * 129, [1, 2], 2)]))[1] == (
                "requests[0].custom_id: 258 bytes; use at most 256")
            dup = "d" * 256
            assert _error(lambda: acme.submit([token_request(dup, [1], 2),
                                               token_request(dup, [2], 2)]))[1] == (
                f"requests[1].custom_id: duplicate {'d' * 64!r}... (256 characters) (first at "
                "requests[0]); custom ids must be unique")
            assert _error(_generate(acme, token_request("", [1, 2], 2, stop=["s"] * 17))) == (
                "INVALID_ARGUMENT", "request.sampling.stop: 17 stop strings; use at most 16")
            assert _error(_generate(acme, token_request("", [1, 2], 2, stop=["ok", "s" * 257]))) == (
                "INVALID_ARGUMENT", "request.sampling.stop[1]: 257 bytes; a stop string may have at "
                "most 256")
            events = list(acme.generate(token_request("c" * 256, [1, 2], 2, stop=["s" * 256] * 16)))
            assert events[-1].result.ok and events[-1].result.custom_id == "c" * 256

    def test_prompts_over_the_size_caps_are_refused_naming_the_limit(self, api_hostile):
        with api_hostile.client("acme") as acme:
            text = (FILLER * (MIB // len(FILLER) + 1))[:MIB + 1]
            api_hostile.tokenizer.entered.clear()
            assert _error(_generate(acme, chat_request("", [{"role": "user", "content": text}],
                                                       4))) == (
                "INVALID_ARGUMENT", f"request.messages: {MIB + 1} bytes of text exceed the limit of "
                f"{MIB} ([limits] max_prompt_bytes); shorten the prompt")
            assert not api_hostile.tokenizer.entered.is_set()  # refused before tokenizing
            assert _error(lambda: acme.submit([token_request("t", [5] * 2048, 1)])) == (
                "INVALID_ARGUMENT", "requests[0].prompt: 2048 tokens reach the model's context of 2048; "
                "shorten the prompt")

    def test_a_1_mib_prompt_does_not_stall_another_tenants_calls(self, api_hostile):
        text = (FILLER * (MIB // len(FILLER) + 1))[:MIB]
        big: dict = {}

        def send_big() -> None:
            with api_hostile.client("acme") as acme:
                try:
                    list(acme.generate(chat_request("", [{"role": "user", "content": text}], 4)))
                except OrchardError as exc:
                    big["error"] = (exc.code, exc.message)
                big["done"] = time.perf_counter()

        held = api_hostile.tokenizer
        held.entered.clear()
        held.release.clear()   # the big prompt stays in the tokenizer until beta is answered
        try:
            with api_hostile.client("beta") as beta:
                beta.jobs()  # connected before the big prompt goes out
                thread = threading.Thread(target=send_big)
                thread.start()
                assert held.entered.wait(60), "the big prompt never reached the tokenizer"
                for i in range(5):  # answered while the big prompt is being tokenized
                    beta.jobs()
                    events = list(beta.generate(chat_request(f"s{i}", [{"role": "user",
                                                                      "content": "hi"}], 1)))
                    assert events[-1].result.ok
                assert "done" not in big, "the big prompt finished before the small calls"
        finally:
            held.release.set()
        thread.join(60)
        assert big["error"][0] == "INVALID_ARGUMENT"
        assert re.fullmatch(r"request\.prompt: \d+ tokens reach the model's context "
                            r"of 2048; shorten the prompt", big["error"][1]), big["error"][1]

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

    def test_the_key_needs_the_bearer_scheme(self, api_hostile):
        with Client(api_hostile.address, "key-acme") as acme:
            assert acme.jobs() is not None
        for header in ("key-acme", "Basic key-acme", "Bearerkey-acme"):
            with grpc.insecure_channel(api_hostile.address) as channel:
                stub = pb_grpc.JobsStub(channel)
                with pytest.raises(grpc.RpcError) as info:
                    stub.ListJobs(pb.ListJobsRequest(), metadata=(("authorization", header),))
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert info.value.details() == ("authorization: use the Bearer scheme: "
                                                "'authorization: Bearer <api key>'")
        with grpc.insecure_channel(api_hostile.address) as channel:
            stub = pb_grpc.JobsStub(channel)
            stub.ListJobs(pb.ListJobsRequest(), metadata=(("authorization", "bearer  key-acme"),))

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
