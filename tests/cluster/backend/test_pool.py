"""The worker pool (``cluster.backend.pool``) following another frontend's workers: real
``EngineWorker``s on their loopback streams, started and listening as their owner left them,
reached by a launcher that finds them (``discover``) and attaches to them
(``EngineWorker.attach``); the pool attaches to those that listen, forgets those that
leave, refuses to scale or drain, and never stops a worker."""
from __future__ import annotations

import asyncio
import secrets

import pytest

from cluster.backend.handle import WorkerHello
from cluster.backend.link import WorkerLink
from cluster.backend.pool import WorkerPool
from cluster.backend.protocol import NotOwned
from cluster.backend.routing import FrontendRouter
from cluster.backend.worker_actor import EngineWorker
from cluster.bench.frontends import AttachedWorker
from router.kv.key import Namespace, hash_blocks
from tests.support.bounded import run_bounded
from tests.support.forged_models import tiny_model
from tests.support.requests import generate_request
from workers.engine.engine import EngineConfig

BLOCK = 16
OWNER = "the owner's frontend"
ROUTER_ID = "follower"


class Following:
    """A launcher over workers another frontend started: those in ``served`` now."""

    prefix = "w"
    owner = OWNER
    replace_dead = False
    watch = False
    pulls = False

    def __init__(self, served: dict[str, EngineWorker], secret: bytes) -> None:
        self.model_dir = str(tiny_model())
        self.engine = EngineConfig(block_size=BLOCK)
        self.served = served
        self._secret = secret

    async def start(self, routes: FrontendRouter) -> None:
        return None

    async def check_room(self, missing: int, in_use: int) -> None:
        raise AssertionError("a pool that follows never asks for room")

    async def discover(self) -> set[str]:
        return set(self.served)

    async def launch(self, worker_id: str) -> tuple[AttachedWorker, WorkerHello]:
        worker = self.served[worker_id]
        answer = await worker.attach(self._secret)
        if answer is None:
            raise RuntimeError(f"worker {worker_id}: still starting")
        hello, (host, port) = answer
        link = await WorkerLink.connect(worker_id, host, port, self._secret, ROUTER_ID)
        return AttachedWorker(worker, link, ROUTER_ID), hello

    async def close(self, handles) -> None:
        await asyncio.gather(*(h.close() for h in handles))


async def _owners_workers(secret: bytes) -> dict[str, EngineWorker]:
    """w0 and w1 listening, w2 started but not listening yet (its owner is still at it)."""
    workers = {}
    for worker_id in ("w0", "w1", "w2"):
        worker = EngineWorker(worker_id, str(tiny_model()), EngineConfig(block_size=BLOCK),
                              heartbeat_s=None)
        await worker.start()
        if worker_id != "w2":
            await worker.listen(secret)
        workers[worker_id] = worker
    return workers


def _ready(pool: WorkerPool) -> list[str]:
    return sorted(w.worker_id for w in pool.ready())


class TestFollowing:
    def test_attaches_to_listening_workers_forgets_those_gone_and_stops_none(self):
        async def scenario():
            secret = secrets.token_bytes(32)
            workers = await _owners_workers(secret)
            served = dict(workers)
            pool = WorkerPool(Following(served, secret), FrontendRouter(BLOCK))
            try:
                await pool.start()
                await pool.follow()
                assert _ready(pool) == ["w0", "w1"]   # w2 does not listen yet
                assert sorted(s.worker_id for s in pool.routes.router.workers()) == ["w0", "w1"]

                await workers["w2"].listen(secret)
                await pool.follow()
                assert _ready(pool) == ["w0", "w1", "w2"]

                # served over its own stream: the request's blocks reach this pool's router
                handle = pool.get("w1").handle
                prompt = tuple(range(20, 84))
                items = [i async for i in handle.stream(
                    generate_request("r", prompt, 2, ns=_ns(pool)), 0, False)]
                pool.routes.apply("w1", items[-1].events)
                hashes = hash_blocks(prompt, BLOCK, _ns(pool))
                assert [pool.routes.router.holders(h) for h in hashes] == [["w1"]] * 4

                del served["w1"]   # the owner drained it
                await pool.follow()
                assert _ready(pool) == ["w0", "w2"]
                assert [w.state for w in pool.known() if w.worker_id == "w1"] == ["dead"]
                assert [pool.routes.router.holders(h) for h in hashes] == [[]] * 4
                assert pool.replaced == 0
                await pool.check()   # the checks follow too: nothing changed
                assert _ready(pool) == ["w0", "w2"]
            finally:
                await pool.close()
            # neither forgetting w1 nor closing the pool stopped a worker: each still serves
            for worker_id, worker in workers.items():
                assert (await worker.stats()).requests_served == (1 if worker_id == "w1" else 0)
                assert await worker.attach(secret) is not None
            for worker in workers.values():
                await worker.close()

        run_bounded(scenario(), 120, "a pool following three workers")

    def test_scaling_and_draining_are_refused_with_where_to_do_them(self):
        async def scenario():
            secret = secrets.token_bytes(32)
            workers = await _owners_workers(secret)
            pool = WorkerPool(Following(dict(workers), secret), FrontendRouter(BLOCK))
            try:
                await pool.start()
                await pool.follow()
                with pytest.raises(NotOwned) as scale:
                    await pool.scale(3)
                assert str(scale.value) == (f"workers: this frontend attaches to the workers "
                                            f"of {OWNER}; scale them through that frontend")
                with pytest.raises(NotOwned) as drain:
                    await pool.drain("w0")
                assert str(drain.value) == (f"workers: this frontend attaches to the workers "
                                            f"of {OWNER}; drain them through that frontend")
                assert _ready(pool) == ["w0", "w1"]
            finally:
                await pool.close()
                for worker in workers.values():
                    await worker.close()

        run_bounded(scenario(), 120, "a following pool asked to scale and drain")

    def test_attach_answers_only_to_the_secret_it_listens_with(self):
        async def scenario():
            secret = secrets.token_bytes(32)
            workers = await _owners_workers(secret)
            try:
                hello, (host, port) = await workers["w0"].attach(secret)
                assert hello.worker_id == "w0" and host == "127.0.0.1" and port > 0
                with pytest.raises(PermissionError, match="not the secret it listens with"):
                    await workers["w0"].attach(secrets.token_bytes(32))
                assert await workers["w2"].attach(secret) is None   # not listening yet
            finally:
                for worker in workers.values():
                    await worker.close()

        run_bounded(scenario(), 120, "attach with the right and a wrong secret")


def _ns(pool: WorkerPool) -> Namespace:
    model = pool.first_hello.model
    return Namespace("t", model.model_id, model.revision)
