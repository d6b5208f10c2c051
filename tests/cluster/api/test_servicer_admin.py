"""``cluster.api.servicer_admin``: the operator-facing ``orchard.v1.Admin`` end to end, a real
frontend over a LocalBackend (two real engines and the router) and the real client: workers
listed, drained and scaled while jobs run, the cache's statistics, invalidation by tenant,
by token prefix and by chat prefix, and the errors of bad admin calls.
"""
from __future__ import annotations

import time

import pytest

from cluster.api.client import OrchardError, token_request
from tests.support.grpc_api import BLOCK, CONFIG, chat, grpc_frontend, run_job, tokens
from tests.support.grpc_api import acme, tokenizer  # noqa: F401  (fixtures)




@pytest.fixture(scope="module")
def api(tmp_path_factory):
    with grpc_frontend(tmp_path_factory, CONFIG, workers=2) as harness:
        yield harness




class TestAdmin:
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

    def test_drain_and_scale_while_serving(self, api, acme):
        with api.client(admin=True) as admin:
            drained = admin.drain("local-0")
            assert drained.state == "draining"
            _, results = run_job(acme, [chat(f"d{i}", f"after drain {i}") for i in range(3)])
            assert {r.worker_id for r in results} == {"local-1"}
            assert [w.worker_id for w in admin.workers()] == ["local-1"]
            assert sorted(w.worker_id for w in admin.scale(2)) == ["local-1", "local-2"]

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

