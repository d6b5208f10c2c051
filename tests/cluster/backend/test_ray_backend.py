"""RayBackend on a real embedded Ray cluster: routing on worker block events, a worker killed
mid-request, scaling and draining while requests run, invalidation, placement errors.

One cluster for the module (Ray takes seconds to start); the tests run in file order and
each leaves the pool with at least two ready workers.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import time

import pytest

ray = pytest.importorskip("ray")

from cluster.backend.bootstrap import WORKER_NICENESS  # noqa: E402
from cluster.backend.backend import Backend  # noqa: E402
from cluster.backend.protocol import (GenerateOutcome, NotOwned, NoWorkerAvailable,  # noqa: E402
                                      TokenChunk, UnknownWorker)
from cluster.backend.ray_attach import RayAttacher  # noqa: E402
from cluster.backend.ray_backend import RayBackend  # noqa: E402
from cluster.backend.ray_pool import NoRoom  # noqa: E402
from router.kv.key import Namespace, hash_blocks  # noqa: E402
from tests.support.forged_models import tiny_model  # noqa: E402
from tests.support.requests import routed_request  # noqa: E402
from tests.support.thread_loop import Loop, shared_prompt  # noqa: E402
from workers.engine.engine import EngineConfig  # noqa: E402
from workers.messages import GenerateRequest, SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow

BLOCK = 16


@pytest.fixture(scope="module")
def cluster():
    loop = Loop()
    backend = RayBackend(tiny_model(), workers=2,
                         engine=EngineConfig(block_size=BLOCK, max_batch=4))
    loop.run(backend.start(), timeout_s=300)
    yield backend, loop
    loop.run(backend.close())
    loop.close()


def _finished_exactly(result, max_tokens: int) -> bool:
    """``max_tokens`` tokens ("length"), or fewer ending at EOS ("stop")."""
    n = len(result.output_tokens)
    return (result.finish_reason, n) == ("length", max_tokens) or (
        result.finish_reason == "stop" and 1 <= n <= max_tokens)


def _generate(backend, loop, rid, prompt, max_tokens=4, tenant="t"):
    return loop.run(backend.generate(*routed_request(backend, rid, prompt, max_tokens, tenant)))



def _replaced_as_dead(backend, loop, victim, replaced: int, within_s: float) -> None:
    """The pool replaced ``victim`` (bounded wait), which is listed dead beside two ready."""
    deadline = time.monotonic() + within_s
    while backend.pool.replaced == replaced and time.monotonic() < deadline:
        time.sleep(0.2)
    assert backend.pool.replaced == replaced + 1
    states = {w.worker_id: w.state for w in loop.run(backend.workers())}
    assert states[victim.worker_id] == "dead"
    assert sum(1 for s in states.values() if s == "ready") == 2

def test_workers_start_on_node_slots_with_openblas(cluster):
    backend, loop = cluster
    workers = loop.run(backend.workers())
    assert [w.state for w in workers] == ["ready", "ready"]
    for w in backend.pool.live():
        assert w.hello.openblas, "the worker actor's process must load OpenBLAS before MLX"
        assert w.hello.pid != os.getpid()
    info = backend.model_info()
    declared = json.loads((tiny_model() / "config.json").read_text())["vocab_size"]
    assert info.block_size == BLOCK and info.vocab_size == declared


def test_block_events_reach_the_router_so_the_prefix_is_routed_home(cluster):
    backend, loop = cluster
    first = _generate(backend, loop, "events-0", shared_prompt(1))
    assert first.result.cached_tokens == 0
    # no wait: the result itself carried the worker's block events to the frontend's router
    second = _generate(backend, loop, "events-1", shared_prompt(2))
    assert second.worker_id == first.worker_id
    assert second.decision.reason.value == "prefix_match"
    assert second.decision.expected_cached_tokens == 96   # the 6 shared blocks
    assert second.result.cached_tokens == 96
    stats = loop.run(backend.cache_stats())  # the module's first requests
    assert stats.cached_tokens == 96
    assert (first.result.written_tokens, second.result.written_tokens) == (112, 16)
    assert stats.cache_blocks == (112 + 16) // BLOCK


def test_stream_yields_every_token_then_the_outcome(cluster):
    backend, loop = cluster

    async def collect():
        return [item async for item in backend.stream(*routed_request(backend, "stream-0", shared_prompt(4), max_tokens=6))]
    items = loop.run(collect())
    chunks, outcome = items[:-1], items[-1]
    assert isinstance(outcome, GenerateOutcome) and outcome.attempts == 1
    assert all(isinstance(c, TokenChunk) for c in chunks)
    assert tuple(t for c in chunks for t in c.token_ids) == outcome.result.output_tokens


def test_a_cancelled_stream_is_aborted_on_its_worker(cluster):
    backend, loop = cluster

    async def start_then_cancel():
        stream = backend.stream(*routed_request(backend, "cancel-0", shared_prompt(70), max_tokens=1500))
        first = await anext(stream)
        await stream.aclose()  # what a client that cancels (or a deadline) does to the stream
        return first

    first = loop.run(start_then_cancel())
    assert isinstance(first, TokenChunk)

    async def engine_side():  # the workers' own counts, not the frontend's
        live = backend.pool.live()
        stats = await asyncio.gather(*(w.handle.stats() for w in live))
        return {w.worker_id: s for w, s in zip(live, stats)}
    served = {w: s.requests_served for w, s in loop.run(engine_side()).items()}
    deadline = time.monotonic() + 2.0  # 1,500 tokens take far longer than this to decode
    while time.monotonic() < deadline and any(s.running for s in loop.run(engine_side()).values()):
        time.sleep(0.05)
    after = loop.run(engine_side())
    assert all(s.running == 0 for s in after.values()), "a worker still runs the cancelled request"
    assert {w: s.requests_served for w, s in after.items()} == served


def test_other_tenant_never_hits(cluster):
    backend, loop = cluster
    out = _generate(backend, loop, "tenant-b", shared_prompt(3), tenant="other")
    assert out.result.cached_tokens == 0


def test_a_worker_killed_mid_request_is_retried_elsewhere_and_replaced(cluster):
    backend, loop = cluster
    replaced = backend.pool.replaced
    futures = [loop.submit(backend.generate(*routed_request(backend, f"kill-{i}", shared_prompt(40 + i), max_tokens=48)))
               for i in range(6)]
    deadline = time.monotonic() + 60  # the victim: a worker these requests were sent to
    while not any(w.running for w in backend.pool.ready()) and time.monotonic() < deadline:
        time.sleep(0.02)
    victim = next(w for w in backend.pool.ready() if w.running)
    os.kill(victim.hello.pid, signal.SIGKILL)
    outcomes = [f.result(180) for f in futures]
    assert all(_finished_exactly(o.result, 48) for o in outcomes)
    retried = [o for o in outcomes if o.attempts > 1]
    assert retried and all(o.worker_id != victim.worker_id for o in retried)
    later = _generate(backend, loop, "after-kill", shared_prompt(50))
    assert victim.worker_id not in {c.worker_id for c in later.decision.candidates}, \
        "the router must forget a dead worker"
    _replaced_as_dead(backend, loop, victim, replaced, within_s=120)


def test_an_idle_worker_that_dies_is_noticed_and_replaced_without_a_request(cluster):
    backend, loop = cluster
    victim = backend.pool.ready()[-1]
    replaced = backend.pool.replaced
    os.kill(victim.hello.pid, signal.SIGKILL)
    _replaced_as_dead(backend, loop, victim, replaced, within_s=60)


def test_scale_and_drain_while_requests_run_lose_nothing(cluster):
    backend, loop = cluster
    futures = [loop.submit(backend.generate(*routed_request(backend, f"scale-{i}", shared_prompt(60 + i), max_tokens=24)))
               for i in range(8)]
    grown = loop.run(backend.scale(3))
    assert sum(1 for w in grown if w.state == "ready") == 3
    busy = max(backend.pool.ready(), key=lambda w: w.running)
    drained = loop.run(backend.drain(busy.worker_id))
    assert drained.state == "draining"
    outcomes = [f.result(180) for f in futures]
    assert len(outcomes) == 8 and all(o.result.output_tokens for o in outcomes)
    deadline = time.monotonic() + 30
    while backend.pool.get(busy.worker_id) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert backend.pool.get(busy.worker_id) is None, "a drained worker leaves once idle"
    after = _generate(backend, loop, "after-drain", shared_prompt(70))
    assert busy.worker_id not in {c.worker_id for c in after.decision.candidates}
    with pytest.raises(UnknownWorker):
        loop.run(backend.drain("no-such-worker"))


def test_invalidate_drops_a_tenants_blocks(cluster):
    backend, loop = cluster
    first = _generate(backend, loop, "inv-0", shared_prompt(80), tenant="inv")  # its own tenant
    kept = _generate(backend, loop, "inv-keep", shared_prompt(80), tenant="t")
    info = backend.model_info()
    removed = loop.run(backend.invalidate(Namespace("inv", info.model_id, info.revision), None))
    assert removed == first.result.written_tokens // BLOCK == 7  # 116 prompt tokens
    again = _generate(backend, loop, "inv-1", shared_prompt(81), tenant="inv")
    assert again.result.cached_tokens == 0
    other = _generate(backend, loop, "inv-keep-1", shared_prompt(80), tenant="t")
    # 7 full blocks from the store, the rest of the prompt but its last token from the kept
    # cache of "inv-keep" (on the same worker: routed to its blocks)
    assert (other.result.lookup.matched_tokens, other.result.cached_tokens) == (112, 115), \
        "only one tenant's blocks go"


def _attached(backend, loop):
    """A second backend over the module's worker actors, as a second frontend has it."""
    attached = Backend(RayAttacher(backend.directory("127.0.0.1:1"), str(tiny_model()),
                                   EngineConfig(block_size=BLOCK, max_batch=4)))
    loop.run(attached.start())
    return attached


def _followed(attached, loop, ids: list[str], within_s: float) -> list[str]:
    """The attached pool's ready workers once they are ``ids`` (its checks run meanwhile)."""
    deadline = time.monotonic() + within_s
    while True:
        loop.run(attached.pool.check())
        ready = sorted(w.worker_id for w in attached.pool.ready())
        if ready == ids or time.monotonic() > deadline:
            return ready
        time.sleep(0.2)


def test_a_second_frontend_attaches_to_the_workers_and_never_scales_or_stops_them(cluster):
    backend, loop = cluster
    ids = sorted(w.worker_id for w in backend.pool.ready())
    assert len(ids) == 2
    attached = _attached(backend, loop)
    try:
        assert sorted(w.worker_id for w in attached.pool.ready()) == ids
        assert attached.model_info() == backend.model_info()
        # served through the second frontend: the first one's router learns the blocks from
        # its own feed of that worker (no result of its own carried them)
        system = tuple(2000 + (i * 11) % 800 for i in range(96))   # no earlier prompt's
        out = _generate(attached, loop, "attached-0", system + tuple(range(3000, 3020)))
        assert out.result.cached_tokens == 0 and out.worker_id in ids
        _, hashes = routed_request(backend, "probe", system + tuple(range(3000, 3020)))
        deadline = time.monotonic() + 30
        while backend.pool.routes.router.holders(hashes[0]) != [out.worker_id] \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert backend.pool.routes.router.holders(hashes[6]) == [out.worker_id]
        home = _generate(backend, loop, "attached-1", system + tuple(range(3100, 3120)))
        assert (home.worker_id, home.result.cached_tokens) == (out.worker_id, 96)
        with pytest.raises(NotOwned, match="scale them through that frontend"):
            loop.run(attached.scale(3))
        with pytest.raises(NotOwned, match="drain them through that frontend"):
            loop.run(attached.drain(ids[0]))
        # the owner's scale-up is attached at the next check, its drain forgotten
        loop.run(backend.scale(3))
        grown = sorted(w.worker_id for w in backend.pool.ready())
        assert _followed(attached, loop, grown, within_s=60) == grown
        (new,) = set(grown) - set(ids)
        loop.run(backend.drain(new))
        assert _followed(attached, loop, ids, within_s=60) == ids
    finally:
        loop.run(attached.close())
    # closing the second frontend stops none of the workers
    assert sorted(w.worker_id for w in backend.pool.ready()) == ids
    loop.run(backend.pool.check())
    assert sorted(w.worker_id for w in backend.pool.ready()) == ids
    after = _generate(backend, loop, "attached-2", system + tuple(range(3200, 3220)))
    assert (after.worker_id, after.result.cached_tokens) == (out.worker_id, 96)


def test_a_frontend_attaching_with_another_secret_is_refused(cluster):
    backend, loop = cluster
    wrong = dataclasses.replace(backend.directory("127.0.0.1:1"), secret="00" * 32)
    attached = Backend(RayAttacher(wrong, str(tiny_model()), EngineConfig(block_size=BLOCK)))
    with pytest.raises(NoWorkerAvailable, match="no worker of orchard up"):
        loop.run(attached.start())


def test_scaling_past_the_node_slots_says_how_to_fix_it(cluster):
    backend, loop = cluster
    with pytest.raises(NoRoom, match="add nodes"):
        loop.run(backend.scale(1000))
    with pytest.raises(ValueError, match=">= 1"):
        loop.run(backend.scale(0))


def test_bad_policy_is_refused():
    with pytest.raises(ValueError, match="policy"):
        RayBackend(tiny_model(), policy="random")


def test_with_every_worker_drained_requests_are_unavailable(cluster):
    backend, loop = cluster  # last: leaves no worker
    for worker in backend.pool.ready():
        loop.run(backend.drain(worker.worker_id))
    with pytest.raises(NoWorkerAvailable):
        _generate(backend, loop, "none-left", shared_prompt(90))



def test_workers_run_at_the_normal_priority(cluster):
    # Ray would start its worker processes at niceness 15, behind every other process on the
    # Mac; the embedded cluster starts them at 0 (WORKER_NICENESS), as the engine needs
    @ray.remote(num_cpus=0)
    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, 0)

    assert WORKER_NICENESS == 0
    assert ray.get(niceness.remote(), timeout=60) == 0
