"""``orchard replay``: a slice of a Mooncake trace, scaled down, sent to a real local cluster.

The slice (``requests`` lines from ``start``) is scaled to this machine: token counts are
divided by ``scale`` (so each 512-token trace block becomes ``512 / scale`` tokens) and the
gaps between arrivals multiplied by ``time_scale`` (1: the trace's own pace). Each hash id
becomes the same ``512 / scale`` token ids wherever it appears (ids drawn from a generator
seeded by the id), so requests share exactly the prefixes the trace says they share.

Every request is sent as a Generate request on its timestamp to a fresh local Ray cluster
(``workers`` worker actors, orchard's router) and its result kept: cached and input tokens,
TTFT (the worker's request-received to first token, queueing there included) and worker.

With an engine profile, the same scaled slice then runs through the simulator (orchard's
policy, the profile's service model, the workers' store capacity) and both are printed side
by side: the validation of the simulator against the engine it was calibrated on.
"""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from router.sim.simulator import TRACE_BLOCK
from router.kv.stats import percentile
from router.sim.trace import TraceRequest


@dataclass(frozen=True, slots=True)
class ReplaySlice:
    start: int = 0
    requests: int = 150
    scale: int = 32          # token counts divided by this
    time_scale: float = 1.0  # gaps between arrivals multiplied by this

    def __post_init__(self) -> None:
        if self.start < 0 or self.requests < 1:
            raise ValueError("--start must be >= 0 and --requests >= 1")
        if self.scale < 1 or TRACE_BLOCK % self.scale:
            raise ValueError(f"--scale must divide the trace's {TRACE_BLOCK}-token blocks "
                             f"(1, 2, 4, ... 512), got {self.scale}")
        if self.time_scale <= 0:
            raise ValueError(f"--time-scale must be positive, got {self.time_scale}")

    @property
    def block_tokens(self) -> int:
        """Tokens each trace hash id stands for after scaling."""
        return TRACE_BLOCK // self.scale


@dataclass(frozen=True, slots=True)
class Served:
    input_tokens: int
    cached_tokens: int
    ttft_s: float
    worker: str


@dataclass(frozen=True, slots=True)
class ReplayResult:
    requests: int
    workers: int
    hit_ratio: float
    ttft_p50_s: float
    ttft_p99_s: float
    wall_s: float
    per_worker: dict[str, int]


def scale_slice(trace: Sequence[TraceRequest], part: ReplaySlice) -> list[TraceRequest]:
    """The slice, its token counts divided by ``scale`` and its arrivals rescaled from 0."""
    lines = list(trace[part.start:part.start + part.requests])
    if not lines:
        raise ValueError(f"--start {part.start} is past the trace's {len(trace)} requests")
    first = lines[0].arrival_s
    out = []
    for i, t in enumerate(lines):
        n_in = t.input_length // part.scale
        if n_in < 1:
            raise ValueError(f"--scale {part.scale} leaves request {part.start + i} "
                             f"({t.input_length} input tokens) empty: use a smaller --scale")
        out.append(TraceRequest(round((t.arrival_s - first) * part.time_scale, 6), n_in,
                                max(1, t.output_length // part.scale), t.hash_ids))
    return out


def prompt_tokens(line: TraceRequest, block_tokens: int, vocab: int, salt: int) -> list[int]:
    """The prompt of a scaled line: each hash id's own tokens, then fresh ones to its length."""
    tokens: list[int] = []
    for block_id in line.hash_ids:
        if len(tokens) >= line.input_length:
            break
        rng = random.Random(block_id * 2_654_435_761 + 17)
        tokens += [rng.randrange(10, vocab) for _ in range(block_tokens)]
    rest = random.Random(salt)
    tokens += [rest.randrange(10, vocab) for _ in range(line.input_length - len(tokens))]
    return tokens[:line.input_length]


async def _send_all(backend, lines: Sequence[TraceRequest], block_tokens: int,
                    say: Callable[[str], None], check: Callable[[object], None]) -> list[Served]:
    from router.kv.key import Namespace, hash_blocks
    from workers.messages import GenerateRequest, SamplingParams

    info = backend.model_info()
    check(info)
    namespace = Namespace("replay", info.model_id, info.revision)
    too_long = [i for i, t in enumerate(lines) if t.input_length + t.output_length > info.max_context]
    if too_long:
        i = too_long[0]
        raise ValueError(f"scaled request {i} needs {lines[i].input_length} + "
                         f"{lines[i].output_length} tokens, over the model's context of "
                         f"{info.max_context}: use a larger --scale")
    served: list[Served] = []
    started = time.monotonic()

    async def one(i: int, line: TraceRequest) -> None:
        prompt = prompt_tokens(line, block_tokens, info.vocab_size, salt=i)
        request = GenerateRequest(f"replay-{i}", namespace, tuple(prompt),
                                  SamplingParams(max_tokens=line.output_length))
        await asyncio.sleep(max(0.0, started + line.arrival_s - time.monotonic()))
        outcome = await backend.generate(request, hash_blocks(prompt, info.block_size, namespace))
        r = outcome.result
        served.append(Served(r.input_tokens, r.cached_tokens, r.ttft_s, outcome.worker_id))
        if len(served) % max(1, len(lines) // 10) == 0:
            say(f"{len(served)}/{len(lines)} requests done")

    await asyncio.gather(*(one(i, t) for i, t in enumerate(lines)))
    return served


def replay_on_cluster(model_dir: str, workers: int, lines: Sequence[TraceRequest],
                      part: ReplaySlice, engine=None,
                      say: Callable[[str], None] = lambda line: None,
                      check: Callable[[object], None] = lambda info: None) -> ReplayResult:
    """Send ``lines`` (already scaled) to a fresh embedded Ray cluster; measured figures.

    ``check(model_info)`` runs once the workers are up, before anything is sent (a profile
    from another model is refused there)."""
    from cluster.backend import bootstrap
    from cluster.backend.bootstrap import Placement
    from cluster.backend.ray_backend import RayBackend

    placement = Placement()
    bootstrap.start_local(bootstrap.local_cpus(workers, placement))
    try:
        async def run() -> tuple[list[Served], float]:
            backend = RayBackend(model_dir, workers, engine, placement=placement)
            await backend.start()
            try:
                t0 = time.monotonic()
                served = await _send_all(backend, lines, part.block_tokens, say, check)
                return served, time.monotonic() - t0
            finally:
                await backend.close()

        served, wall = asyncio.run(run())
    finally:
        bootstrap.shutdown()
    total = sum(s.input_tokens for s in served)
    ttfts = [s.ttft_s for s in served]
    per_worker: dict[str, int] = {}
    for s in served:
        per_worker[s.worker] = per_worker.get(s.worker, 0) + 1
    return ReplayResult(len(served), workers,
                        sum(s.cached_tokens for s in served) / total if total else 0.0,
                        percentile(ttfts, 0.5), percentile(ttfts, 0.99), wall,
                        dict(sorted(per_worker.items())))

