"""The backend over in-process workers reached by their streams (``cluster.backend.linked``):
a request whose prefix's holder is busy decoding goes to an idle worker with a pull from the
holder, its outputs equal the holder's, and the pull's bytes and time, reported by the
receiver with its block events, become the pair's measured link."""
from __future__ import annotations

import asyncio
import contextlib
import random

from cluster.backend.backend import Backend
from cluster.backend.linked import LinkedLauncher
from router.kv.key import hash_blocks
from router.policy import Reason
from router.pull_cost import DEFAULT_LINK, observed
from tests.support.forged_models import tiny_model
from workers.engine.engine import EngineConfig
from workers.messages import GenerateRequest, SamplingParams

BLOCK = 16
PROMPT = tuple(random.Random(5).randrange(1, 250) for _ in range(200))   # 12 full blocks


def test_a_busy_holders_prefix_is_pulled_by_an_idle_worker():
    async def scenario():
        backend = Backend(LinkedLauncher(tiny_model(), EngineConfig(block_size=BLOCK)),
                          workers=2)
        await backend.start()
        try:
            ns = backend.model_info().namespace("t")

            def request(rid: str, prompt, max_tokens: int) -> GenerateRequest:
                return GenerateRequest(rid, ns, prompt, SamplingParams(max_tokens=max_tokens))

            def hashes(prompt):
                return hash_blocks(prompt, BLOCK, ns)
            async with contextlib.aclosing(backend.stream(request("long", PROMPT, 300),
                                                          hashes(PROMPT))) as decoding:
                chunk = await anext(decoding)   # its prompt is stored: now it decodes
                again = await backend.generate(request("again", PROMPT, 8), hashes(PROMPT))
                items = [chunk] + [item async for item in decoding]
            long = items[-1]
            holder = long.worker_id
            assert again.worker_id != holder
            assert again.decision.reason is Reason.LOAD_SPILL
            assert (again.decision.pull.source, again.decision.pull.blocks) == (holder, 12)
            assert (again.pulled.peer, again.pulled.blocks, again.pulled.refused) == (
                holder, 12, "")
            assert again.result.cached_tokens == 192
            assert again.result.output_tokens == long.result.output_tokens[:8]
            # the receiver's measured link, reported with the result's block events
            links = backend.pool.routes.router.links.links()
            pulled = again.pulled
            assert links == {(holder, again.worker_id): observed(DEFAULT_LINK, pulled.nbytes,
                                                                 pulled.seconds)}
        finally:
            await backend.close()
    asyncio.run(scenario())
