"""The gRPC API end to end: a real frontend, LocalBackend (real engines + router), real clients."""
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
from forged_models import tiny_model
from frontend_harness import TWO_TENANTS_CONFIG, running_frontend
from proto.orchard.v1 import orchard_pb2 as pb
from proto.orchard.v1 import orchard_pb2_grpc as pb_grpc

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


def test_job_runs_every_request_once_and_reuses_the_shared_prefix(acme, tokenizer):
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


def test_results_resume_from_an_offset(acme):
    job, results = run_job(acme, [chat(f"r{i}", f"resume {i}") for i in range(4)])
    tail = list(acme.results(job.job_id, offset=2))
    assert [r.seq for r in tail] == [2, 3]
    assert [r.custom_id for r in tail] == [r.custom_id for r in results[2:]]
    assert list(acme.results(job.job_id, offset=4, follow=True)) == []


def test_a_prefix_cached_for_one_tenant_is_never_a_hit_for_another(api, acme):
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


def test_generate_streams_tokens_then_the_result(acme):
    events = list(acme.generate(chat("", "stream please", max_tokens=6)))
    deltas = [e.delta for e in events if e.WhichOneof("event") == "delta"]
    assert events[-1].WhichOneof("event") == "result"
    result = events[-1].result
    assert result.ok and finished_exactly(len(result.output_tokens), 6, result.finish_reason)
    assert [t for d in deltas for t in d.token_ids] == list(result.output_tokens)
    assert "".join(d.text for d in deltas) == result.text


def test_cancel_stops_a_running_job(acme):
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


def test_admin_workers_stats_and_invalidation(api, acme):
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


def test_health_and_reflection(api):
    channel = grpc.insecure_channel(api.address)
    services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {"orchard.v1.Jobs", "orchard.v1.Generate", "orchard.v1.Admin",
            "grpc.health.v1.Health"} <= services
    channel.close()


# --------------------------------------------------------------------- bad input (section 7)

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


@pytest.mark.parametrize("case", sorted(BAD_JOBS))
def test_bad_job_is_invalid_argument_naming_the_field(api, acme, case):
    requests, field = BAD_JOBS[case]
    if callable(requests):  # sized from the served model's context
        requests = requests(api.backend.model_info().max_context)
    with pytest.raises(OrchardError) as err:
        acme.submit(requests)
    assert err.value.code == "INVALID_ARGUMENT"
    assert field in err.value.message


def test_duplicate_custom_ids(acme):
    with pytest.raises(OrchardError) as err:
        acme.submit([tokens([1, 2]), tokens([3, 4])])
    assert err.value.code == "INVALID_ARGUMENT"
    assert "requests[1].custom_id" in err.value.message and "duplicate" in err.value.message


def test_a_job_above_the_size_limit_is_resource_exhausted(acme):
    with pytest.raises(OrchardError) as err:
        acme.submit([tokens([1, 2], 1)] * 17)  # 17 > max_requests_per_job = 16
    assert err.value.code == "RESOURCE_EXHAUSTED"
    assert err.value.message.startswith("requests:") and "limit of 16" in err.value.message


def test_backpressure_is_resource_exhausted(acme):
    with pytest.raises(OrchardError) as err:
        acme.submit([chat(f"p{i}", "x") for i in range(13)])  # 13 > 12 pending per tenant
    assert err.value.code == "RESOURCE_EXHAUSTED" and "requests" in err.value.message


def test_authentication_and_permissions(api):
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


def test_unknown_job_ids_are_not_found(api, acme):
    for call in (acme.job, acme.cancel, lambda j: list(acme.results(j))):
        with pytest.raises(OrchardError) as err:
            call("job-does-not-exist")
        assert err.value.code == "NOT_FOUND" and "job_id" in err.value.message
    job, _ = run_job(acme, [tokens([5, 6, 7])])
    with api.client("beta") as beta, pytest.raises(OrchardError) as err:
        beta.job(job.job_id)  # another tenant's job does not exist for beta
    assert err.value.code == "NOT_FOUND"


def test_cancelling_a_finished_job_is_failed_precondition(acme):
    job, _ = run_job(acme, [tokens([5, 6, 7])])
    with pytest.raises(OrchardError) as err:
        acme.cancel(job.job_id)
    assert err.value.code == "FAILED_PRECONDITION" and "already succeeded" in err.value.message


def test_bad_generate_and_admin_calls(api, acme):
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


def test_the_server_keeps_serving_after_bad_input(api, acme):
    job, results = run_job(acme, [chat("after", "still there?")])
    assert job.state == "succeeded" and results[0].ok
    assert acme.health() == "SERVING"


def test_drain_and_scale_while_serving(api, acme):
    with api.client(admin=True) as admin:
        drained = admin.drain("local-0")
        assert drained.state == "draining"
        _, results = run_job(acme, [chat(f"d{i}", f"after drain {i}") for i in range(3)])
        assert {r.worker_id for r in results} == {"local-1"}
        assert [w.worker_id for w in admin.workers()] == ["local-1"]
        assert sorted(w.worker_id for w in admin.scale(2)) == ["local-1", "local-2"]


def test_results_stream_resumes_after_a_disconnect_mid_job(acme):
    job = acme.submit([chat(f"s{i}", f"streamed {i}", max_tokens=24) for i in range(6)])
    stream = acme.results(job.job_id, follow=True)
    first = [next(stream), next(stream)]
    stream.close()  # the client goes away mid-job
    rest = list(acme.results(job.job_id, offset=first[-1].seq + 1, follow=True))
    seen = first + rest
    assert [r.seq for r in seen] == list(range(6))
    assert sorted(r.custom_id for r in seen) == sorted(f"s{i}" for i in range(6))
    assert acme.job(job.job_id).state == "succeeded"


def test_generate_past_its_deadline_is_deadline_exceeded(acme):
    with pytest.raises(OrchardError) as err:
        list(acme.generate(chat("", "slow", max_tokens=200), timeout_s=0.05))
    assert err.value.code == "DEADLINE_EXCEEDED"
    assert acme.health() == "SERVING"


def test_with_every_worker_drained_jobs_wait_and_generate_is_unavailable(api, acme):
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


def test_invalidate_by_chat_prefix(api, acme, tokenizer):
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


def test_a_retried_submission_with_its_idempotency_key_runs_once(acme):
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
