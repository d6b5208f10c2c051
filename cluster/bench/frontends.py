"""``orchard bench frontends``: how far two frontends' routers drift apart over the same workers.

Two frontends, each its own ``Backend`` (its own ``WorkerPool`` and ``FrontendRouter``, its
own stream to every worker and its own block event feed from it), send requests to the same
``workers`` at once, ``concurrency`` in flight each. Each router learns from its own results
(the batches they carry) and its own feed (the batches nobody carried to it: the other
frontend's stores, evictions): ``EngineWorker``'s per-router cursor. The prefix store is
small (``store_blocks`` per worker), so evictions run all along::

    frontend A: Backend ─ links (router a) ─┐            ┌─ worker w0 (EngineWorker, store)
                        ─ feeds (router a) ─┼─ stream ───┼─ worker w1
    frontend B: Backend ─ links (router b) ─┤            └─ ...
                        ─ feeds (router b) ─┘

Once every request is done the streams drain (each router has applied every worker's last
batch, or the bound passes), each pool runs its check (a router that saw a gap rebuilds that
worker's view from its holdings), and the figures are taken:

- ``belief_drift_blocks``: (block, worker) pairs that one router believes and the other does
  not, over every block any event named (target 0);
- ``truth_drift_blocks``: pairs where either router's belief differs from the workers' own
  holdings (0: both routers are right, not only equal);
- ``gaps``: sequence gaps the routers saw (each rebuilt from holdings); ``lose_every`` drops
  every Nth feed delivery of frontend B on purpose, to show a gap is caught and healed.

The workers are ``EngineWorker``s on one engine thread (``EngineRuntime`` hosting every
engine, as MLX wants one per process), served over real loopback streams; no Ray. The default
size is small (two workers, 48 requests a frontend): a check that the routers agree, not a
throughput figure.
"""
from __future__ import annotations

import asyncio
import dataclasses
import random
import secrets
import time
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

from cluster.backend.backend import Backend
from cluster.backend.handle import WorkerHello
from cluster.backend.link import Items, WorkerLink
from cluster.backend.routing import FeedHeartbeat, FeedItem, FrontendRouter
from cluster.backend.worker_actor import EngineWorker
from router.kv.events import BlockStored, EventBatch
from router.kv.key import BlockHash, Namespace, hash_blocks
from workers.engine.channel import Holdings
from workers.engine.config import EngineConfig
from workers.engine.runtime import EngineRuntime
from workers.messages import GenerateRequest, SamplingParams, WorkerStats

DRAIN_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class FrontendsWorkload:
    workers: int = 2
    requests: int = 48          # per frontend
    concurrency: int = 4        # requests in flight per frontend
    prefixes: int = 6           # shared prefixes the prompts continue
    prefix_tokens: int = 64
    suffix_tokens: int = 24
    max_tokens: int = 2
    store_blocks: int = 24      # each worker's prefix store, in blocks: evictions all along
    block_size: int = 16
    lose_every: int = 0         # drop every Nth feed delivery to frontend B (0: none)
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("workers", "requests", "concurrency", "prefixes", "prefix_tokens",
                     "suffix_tokens", "max_tokens", "store_blocks", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.lose_every < 0:
            raise ValueError("--lose-every must be >= 0 (0: no feed delivery dropped)")


@dataclass(frozen=True, slots=True)
class DriftReport:
    belief_drift_blocks: int    # (block, worker) pairs one router believes, the other not
    truth_drift_blocks: int     # pairs where a router differs from the workers' holdings
    blocks_held: int            # (block, worker) pairs the workers hold at the end
    blocks_named: int           # distinct blocks any event named
    batches: int                # event batches the workers published
    gaps: int                   # sequence gaps the routers saw (rebuilt from holdings)
    feed_deliveries_lost: int   # dropped on purpose (lose_every)
    drained: bool               # every router applied every worker's last batch in time
    requests: int
    wall_s: float


class AttachedWorker:
    """One frontend's handle on a worker it did not start: its own stream and feed."""

    def __init__(self, worker: EngineWorker, link: WorkerLink, router_id: str,
                 lose_every: int = 0) -> None:
        self._worker = worker
        self._link = link
        self._router_id = router_id
        self._lose_every = lose_every
        self.lost = 0

    def stream(self, request: GenerateRequest, feed_after: int, chunks: bool,
               pull: None = None) -> Items:
        return self._link.stream(request, feed_after, chunks)   # no pulls planned here

    async def events(self, after: int) -> AsyncIterator[FeedItem]:
        delivered = 0
        async for batches in self._worker.events(after, self._router_id):
            if isinstance(batches, FeedHeartbeat):   # only batches are lost
                yield batches
                continue
            delivered += 1
            if self._lose_every and delivered % self._lose_every == 0:
                self.lost += 1
                continue
            yield batches

    async def stats(self) -> WorkerStats | None:
        return await self._worker.stats()

    async def invalidate(self, namespace: Namespace, prefix_tokens: Sequence[int] | None) -> int:
        return await self._worker.invalidate(namespace, prefix_tokens)

    async def holdings(self) -> Holdings:
        return await self._worker.holdings()

    async def ping(self) -> None:
        await self._worker.ping()

    def kill(self) -> None:
        return None   # the bench owns the workers

    async def close(self) -> None:
        await self._link.close()


class AttachLauncher:
    """A frontend's launcher over workers that already serve (``Launcher`` for the pool)."""

    prefix = "w"
    owner = ""
    replace_dead = False
    watch = False   # the bench runs the pool's check itself, once the streams drained
    pulls = False   # the drift is of the routers' beliefs: no pulls between the workers

    def __init__(self, served: dict[str, tuple[EngineWorker, int, WorkerHello]], secret: bytes,
                 engine: EngineConfig, model_dir: str, router_id: str, lose_every: int = 0):
        self.model_dir = model_dir
        self.engine = engine
        self._served = served
        self._secret = secret
        self.router_id = router_id
        self._lose_every = lose_every
        self.handles: list[AttachedWorker] = []

    async def start(self, routes: FrontendRouter) -> None:
        return None

    async def check_room(self, missing: int, in_use: int) -> None:
        if in_use + missing > len(self._served):
            raise ValueError(f"workers: {len(self._served)} serve; no more can be attached")

    async def launch(self, worker_id: str) -> tuple[AttachedWorker, WorkerHello]:
        worker, port, hello = self._served[worker_id]
        link = await WorkerLink.connect(worker_id, "127.0.0.1", port, self._secret,
                                        self.router_id)
        handle = AttachedWorker(worker, link, self.router_id, self._lose_every)
        self.handles.append(handle)
        return handle, hello

    async def close(self, handles: Sequence[AttachedWorker]) -> None:
        await asyncio.gather(*(h.close() for h in handles))


def _prompts(w: FrontendsWorkload, rng: random.Random, vocab: int) -> list[tuple[int, ...]]:
    heads = [tuple(rng.randrange(10, vocab) for _ in range(w.prefix_tokens))
             for _ in range(w.prefixes)]
    return [heads[rng.randrange(w.prefixes)]
            + tuple(rng.randrange(10, vocab) for _ in range(w.suffix_tokens))
            for _ in range(w.requests)]


async def _load(backend: Backend, name: str, prompts: list[tuple[int, ...]],
                w: FrontendsWorkload) -> None:
    info = backend.model_info()
    ns = Namespace("bench", info.model_id, info.revision)
    queue = list(enumerate(prompts))

    async def client() -> None:
        while queue:
            i, prompt = queue.pop()
            request = GenerateRequest(f"{name}-{i}", ns, prompt,
                                      SamplingParams(max_tokens=w.max_tokens))
            await backend.generate(request, hash_blocks(prompt, w.block_size, ns))
    await asyncio.gather(*(client() for _ in range(w.concurrency)))


def _drained(routes: Sequence[FrontendRouter], last: dict[str, int]) -> bool:
    return all(r.feed_after(w) >= seq or w in r.stale_workers()
               for r in routes for w, seq in last.items())


async def measure(model_dir: str, w: FrontendsWorkload) -> DriftReport:
    named: set[BlockHash] = set()
    batches = 0
    served: dict[str, tuple[EngineWorker, int, WorkerHello]] = {}

    def on_events(batch: EventBatch) -> None:      # the engine thread
        nonlocal batches
        batches += 1
        named.update(e.block for e in batch.events if isinstance(e, BlockStored))
        if batch.worker_id in served:   # not the probe's (opened to read the model)
            served[batch.worker_id][0].on_events(batch)

    runtime = EngineRuntime(on_events)
    probe = await runtime.open("probe", model_dir, EngineConfig(block_size=w.block_size))
    facts = probe.facts
    runtime.retire("probe")
    engine = EngineConfig(block_size=w.block_size, kept_bytes=0,
                          store_bytes=w.store_blocks * w.block_size * facts.kv_bytes_per_token)
    secret = secrets.token_bytes(32)
    frontends: list[Backend] = []
    try:
        for i in range(w.workers):
            worker = EngineWorker(f"w{i}", model_dir, engine, runtime=runtime)
            hello = await worker.start()
            _, port = await worker.listen(secret)
            served[f"w{i}"] = (worker, port, hello)
        launchers = [AttachLauncher(served, secret, engine, model_dir, f"router-{name}",
                                    w.lose_every if name == "b" else 0) for name in "ab"]
        for launcher in launchers:
            backend = Backend(launcher, w.workers)
            await backend.start()
            frontends.append(backend)
        rng = random.Random(w.seed)
        loads = [_prompts(w, rng, facts.vocab_size) for _ in frontends]
        started = time.perf_counter()
        await asyncio.gather(*(_load(b, n, p, w) for b, n, p in zip(frontends, "ab", loads)))
        wall = time.perf_counter() - started
        routes = [b.pool.routes for b in frontends]
        holdings = {wid: await served[wid][0].holdings() for wid in served}
        last = {wid: h.seq for wid, h in holdings.items()}
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while not (drained := _drained(routes, last)) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        gaps = sum(len(r.stale_workers()) for r in routes)
        for backend in frontends:
            await backend.pool.check()   # a gap: that worker's view rebuilt from holdings
        return _report(routes, holdings, named, batches, gaps,
                       sum(h.lost for h in launchers[1].handles), drained,
                       2 * w.requests, wall)
    finally:
        for backend in frontends:
            await backend.close()
        for worker, _, _ in served.values():
            await worker.close()
        await runtime.close()


def _report(routes: Sequence[FrontendRouter], holdings: dict[str, Holdings],
            named: set[BlockHash], batches: int, gaps: int, lost: int, drained: bool,
            requests: int, wall: float) -> DriftReport:
    truth = {(block, wid) for wid, h in holdings.items() for block in (*h.blocks,
                                                                        *h.disk_blocks)}
    beliefs = [{(block, wid) for block in named for wid in r.router.holders(block)}
               for r in routes]
    return DriftReport(
        belief_drift_blocks=len(beliefs[0] ^ beliefs[1]),
        truth_drift_blocks=len(beliefs[0] ^ truth) + len(beliefs[1] ^ truth),
        blocks_held=len(truth), blocks_named=len(named), batches=batches, gaps=gaps,
        feed_deliveries_lost=lost, drained=drained, requests=requests,
        wall_s=round(wall, 3))


def run(model_dir: str, workload: FrontendsWorkload) -> DriftReport:
    return asyncio.run(measure(model_dir, workload))


def as_json(report: DriftReport, workload: FrontendsWorkload) -> dict:
    return {**dataclasses.asdict(report), "workload": dataclasses.asdict(workload)}


def register_bench(sub) -> None:
    d = FrontendsWorkload()
    p = sub.add_parser("frontends", help="two frontends' routers over the same workers: how "
                                         "far their beliefs drift (target 0)")
    p.add_argument("--model", help="mlx-lm model directory (default: the embedded model)")
    for field in dataclasses.fields(FrontendsWorkload):
        p.add_argument("--" + field.name.replace("_", "-"), type=int,
                       default=getattr(d, field.name))
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd)


def _cmd(args) -> int:
    import json

    import workers  # noqa: F401  (OpenBLAS before mlx)
    from workers.model.default_model import ensure_default_model

    workload = FrontendsWorkload(**{f.name: getattr(args, f.name)
                                    for f in dataclasses.fields(FrontendsWorkload)})
    report = run(str(args.model or ensure_default_model()), workload)
    if args.json:
        print(json.dumps(as_json(report, workload), indent=2))
        return 0
    print(f"belief_drift_blocks {report.belief_drift_blocks} (target 0): (block, worker) pairs "
          f"one router believes and the other does not, after the streams drained")
    print(f"truth_drift_blocks {report.truth_drift_blocks}: beliefs that differ from the "
          f"workers' {report.blocks_held} held (block, worker) pairs")
    print(f"{report.requests} requests on {workload.workers} workers in {report.wall_s:.2f} s, "
          f"{report.batches} event batches, {report.gaps} gap(s) rebuilt, "
          f"{report.feed_deliveries_lost} feed deliveries dropped on purpose, "
          f"drained {report.drained}")
    return 0
