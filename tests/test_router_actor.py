"""The router actor the cluster runs (``TracedRouterActor``): the async Ray shell answers like the
plain Router, errors included."""
import asyncio

import pytest

from router.kv.key import Namespace, hash_blocks
from router.policy import NoWorkerAvailable, Reason

pytestmark = pytest.mark.slow

NS = Namespace("acme", "tiny")


@pytest.fixture(scope="module")
def ray_local():
    import ray

    from cluster.backend.bootstrap import start_local

    start_local(num_cpus=1)  # loopback only
    yield ray
    ray.shutdown()


def test_actor_routes_accounts_and_reports_unavailable(ray_local):
    from cluster.backend.router_actor import TracedRouterActor

    async def scenario():
        actor = TracedRouterActor.remote(16)
        tokens = list(range(100))
        hashes = hash_blocks(tokens, 16, NS)
        with pytest.raises(NoWorkerAvailable):
            try:
                await actor.route.remote(NS, hashes, len(tokens))
            except ray_local.exceptions.RayTaskError as exc:
                raise exc.cause
        await actor.add_worker.remote("w0")
        await actor.add_worker.remote("w1")
        first = await actor.route_and_start.remote("r1", NS, hashes, len(tokens))
        again = await actor.route.remote(NS, hashes, len(tokens))
        status = {s.worker_id: s for s in await actor.workers.remote()}
        return first, again, status

    first, again, status = asyncio.run(scenario())
    assert first.reason is Reason.COLD_HASH
    assert again.worker_id == first.worker_id  # the pending entry steers the repeat
    assert status[first.worker_id].in_flight == 1
    assert status[first.worker_id].queued_prefill_tokens == 100


def test_actor_rebuilds_a_worker_with_its_tiers(ray_local):
    from cluster.backend.router_actor import TracedRouterActor
    from router.policy import DISK_TOKEN_COST, PolicyConfig

    tokens = list(range(200, 265))  # 4 full blocks and a token
    hashes = hash_blocks(tokens, 16, NS)

    async def scenario():
        actor = TracedRouterActor.remote(16, config=PolicyConfig(cache_weight=1))
        await actor.add_worker.remote("w0")
        await actor.rebuild.remote("w0", hashes[:1], hashes[1:4])  # 1 in memory, 3 on disk
        return await actor.route.remote(NS, hashes, len(tokens))

    decision = asyncio.run(scenario())
    (candidate,) = decision.candidates
    assert (candidate.matched_tokens, candidate.score) == (64, 1 + DISK_TOKEN_COST * 48)


def test_actor_costs_a_disk_hit_at_the_rates_a_worker_sent(ray_local):
    """The encoded batch a worker actor sends carries its measured rates: 4,096 bytes per
    token at 1 GiB/s and 2**14 prefill tokens/s make a disk token cost exactly 0.0625."""
    from cluster.backend.router_actor import TracedRouterActor
    from router.kv.events import BlockStored, EventBatch, Tier, WorkerRates, encode_batch
    from router.policy import PolicyConfig

    tokens = list(range(200, 265))  # 4 full blocks and a token
    hashes = hash_blocks(tokens, 16, NS)
    parents = [NS.root()] + hashes[:3]
    events = tuple(BlockStored(h, p, 16, NS.label(), Tier.DISK if i else Tier.MEMORY)
                   for i, (h, p) in enumerate(zip(hashes, parents)))  # 1 in memory, 3 on disk

    async def scenario():
        actor = TracedRouterActor.remote(16, config=PolicyConfig(cache_weight=1))
        await actor.add_worker.remote("w0")
        rates = WorkerRates(4096, float(2**30), float(2**14))
        await actor.apply_events.remote(encode_batch(EventBatch("w0", 1, events, rates)))
        return await actor.route.remote(NS, hashes, len(tokens)), await actor.workers.remote()

    decision, (status,) = asyncio.run(scenario())
    (candidate,) = decision.candidates
    assert (candidate.matched_tokens, candidate.score) == (64, 1 + 0.0625 * 48)
    assert status.disk_token_cost == 0.0625
