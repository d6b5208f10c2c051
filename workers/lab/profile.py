"""The engine's service profile: what the simulator needs to time a worker like this one.

``measure_profile`` runs the real ``Engine`` on a model directory and measures:

- **prefill** on a grid of (cached context, new tokens): a prefix of ``cached`` tokens is
  stored first (a one-token request writes it), then a request for that prefix plus ``new``
  fresh tokens is timed from submission to its first token (``GenerateResult.ttft_s``); the
  store's load time for the cached blocks is taken out (it is measured on its own, below);
- **decode steps** on a grid of (context, batch size): ``batch`` requests of ``context``
  prompt tokens are admitted, then whole engine steps (one token for each) are timed while
  nothing else is admitted;
- **verify passes** of speculative decoding on a grid of (draft width, batch size) at the
  grid's first context: ``batch`` rows of ``context`` prompt tokens in the engine's decode
  batch (``workers.engine.decode``), each pass verifying ``width`` drafted tokens a row;
- **block load** per store tier: ``PrefixStore.lookup`` of a stored prefix, K/V evaluated,
  over its blocks (the memory tier; the store has no other tier yet).

Each figure is the best of ``repeats`` runs (the least a shared machine's other work added),
after one untimed run of the same shape (MLX compiles each new shape on first use).
Every measurement uses its own namespace, so nothing is reused by accident. The answer is an
``router.sim.service.EngineProfile`` that ``orchard simulate --profile`` reads.
"""
from __future__ import annotations

import os
import platform
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from router.kv.key import Namespace
from router.sim.service import EngineProfile
from workers.messages import GenerateRequest, SamplingParams

if TYPE_CHECKING:  # the engine (and MLX) load when a profile is measured, not on import
    from workers.engine.engine import Engine


@dataclass(frozen=True, slots=True)
class ProfileGrid:
    new_tokens: tuple[int, ...] = (16, 128, 512, 1024)
    cached_tokens: tuple[int, ...] = (0, 512, 2048)
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    contexts: tuple[int, ...] = (128, 1024, 2048)
    draft_widths: tuple[int, ...] = (2, 4, 8)  # verify passes: drafts per row
    decode_steps: int = 6  # timed steps per (context, batch) point
    repeats: int = 2

    def __post_init__(self) -> None:
        for name in ("new_tokens", "cached_tokens", "batch_sizes", "contexts", "draft_widths"):
            axis = getattr(self, name)
            if not axis or any(b <= a for a, b in zip(axis, axis[1:])) or axis[0] < 0:
                raise ValueError(f"profile grid {name} must be increasing non-negative values")
        if min(self.new_tokens[0], self.batch_sizes[0], self.contexts[0],
               self.draft_widths[0]) < 1:
            raise ValueError("profile grid: new tokens, batch sizes, contexts and draft widths "
                             "start at >= 1")
        if self.decode_steps < 1 or self.repeats < 1:
            raise ValueError("profile grid: decode_steps and repeats must be >= 1")


class _Prompts:
    """Fresh token ids and namespaces, so no two measurements share a cached block."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        self._rng = random.Random(seed)
        self._vocab = vocab
        self._n = 0

    def tokens(self, n: int) -> list[int]:
        return [self._rng.randrange(10, self._vocab) for _ in range(n)]

    def namespace(self, engine: Engine) -> Namespace:
        self._n += 1
        return engine.namespace(f"profile-{self._n}")


def measure_profile(model_dir: str | Path, block_size: int = 16, max_batch: int = 8,
                    grid: ProfileGrid = ProfileGrid(),
                    progress: Callable[[str], None] | None = None) -> EngineProfile:
    """Measure ``model_dir`` on the real engine; ``progress`` hears one line per grid row."""
    import time as clock

    from workers.engine.engine import Engine, EngineConfig
    from workers.model.model_dir import open_model_dir

    say = progress or (lambda line: None)
    longest = max(grid.cached_tokens[-1] + grid.new_tokens[-1], grid.contexts[-1] + 2)
    loaded = open_model_dir(model_dir)
    engine = Engine(loaded, EngineConfig(block_size=block_size, max_batch=max_batch,
                                         store_bytes=1 << 32), clock.monotonic, clock.time_ns)
    if longest + grid.decode_steps + 2 > engine.max_context:
        raise ValueError(f"the profile grid reaches {longest} tokens but the model's context is "
                         f"{engine.max_context}: pass smaller --new-tokens/--cached-tokens/"
                         f"--contexts")
    prompts = _Prompts(engine.vocab_size)
    _run(engine, prompts.namespace(engine), prompts.tokens(64), 1)  # compile and warm up
    load = _load_s_per_block(engine, prompts, grid)
    say(f"store load: {load * 1e6:.1f} us per block of {block_size} tokens")
    prefill = []
    for cached in grid.cached_tokens:
        row = [max(0.0, _prefill_s(engine, prompts, cached, new, grid.repeats)
                   - cached / block_size * load) for new in grid.new_tokens]
        prefill.append(tuple(row))
        say(f"prefill onto {cached} cached tokens: "
            + ", ".join(f"{n}: {s * 1e3:.1f} ms" for n, s in zip(grid.new_tokens, row)))
    steps = []
    for context in grid.contexts:
        row = [_step_s(engine, prompts, context, b, grid) for b in grid.batch_sizes]
        steps.append(tuple(row))
        say(f"decode step at context {context}: "
            + ", ".join(f"batch {b}: {s * 1e3:.1f} ms" for b, s in zip(grid.batch_sizes, row)))
    verify = []
    for width in grid.draft_widths:
        row = [_verify_s(loaded, prompts, grid.contexts[0], b, width, grid)
               for b in grid.batch_sizes]
        verify.append(tuple(row))
        say(f"verify pass of {width} drafts at context {grid.contexts[0]}: "
            + ", ".join(f"batch {b}: {s * 1e3:.1f} ms" for b, s in zip(grid.batch_sizes, row)))
    return EngineProfile(
        model=engine.model_id, revision=engine.revision, block_size=block_size,
        max_batch=max_batch, kv_bytes_per_token=engine.store_stats().bytes_per_token,
        new_tokens=grid.new_tokens, cached_tokens=grid.cached_tokens, prefill_s=tuple(prefill),
        batch_sizes=grid.batch_sizes, contexts=grid.contexts, step_s=tuple(steps),
        load_s_per_block=(("memory", load),),
        machine=f"{platform.machine()} {platform.system()}, {_cpus()} CPUs",
        draft_widths=grid.draft_widths, verify_s=tuple(verify),
        verify_context=grid.contexts[0])


def _run(engine: Engine, namespace: Namespace, prompt: list[int], max_tokens: int):
    request = GenerateRequest(f"p{time.monotonic_ns()}", namespace, tuple(prompt),
                              SamplingParams(max_tokens=max_tokens))
    (result,) = engine.generate([request])
    if not hasattr(result, "ttft_s"):
        raise RuntimeError(f"the engine refused a profiling request: {result.error}")
    return result


def _prefill_s(engine: Engine, prompts: _Prompts, cached: int, new: int, repeats: int) -> float:
    best = float("inf")
    for attempt in range(repeats + 1):  # the first run of a new shape compiles: not timed
        namespace = prompts.namespace(engine)
        prefix = prompts.tokens(cached)
        if cached:
            _run(engine, namespace, prefix + prompts.tokens(1), 1)  # stores the prefix
        result = _run(engine, namespace, prefix + prompts.tokens(new), 1)
        if result.cached_tokens != cached:
            raise RuntimeError(f"profiling expected {cached} cached tokens, the store gave "
                               f"{result.cached_tokens}: is the store too small?")
        if attempt:
            best = min(best, result.ttft_s)
    return best


def _load_s_per_block(engine: Engine, prompts: _Prompts, grid: ProfileGrid) -> float:
    import mlx.core as mx

    cached = max(grid.cached_tokens[-1], engine.config.block_size)
    blocks = cached // engine.config.block_size
    best = float("inf")
    for _ in range(max(3, grid.repeats)):
        namespace = prompts.namespace(engine)
        prompt = prompts.tokens(cached + 1)
        _run(engine, namespace, prompt, 1)
        started = time.perf_counter()
        found = engine.stored_lookup(namespace, prompt)
        if found.cache is None or found.report.matched_tokens != blocks * engine.config.block_size:
            raise RuntimeError("profiling could not read back the prefix it stored")
        mx.eval([c.keys for c in found.cache], [c.values for c in found.cache])
        best = min(best, time.perf_counter() - started)
    return best / blocks


def _step_s(engine: Engine, prompts: _Prompts, context: int, batch: int,
            grid: ProfileGrid) -> float:
    best, timed, attempts = float("inf"), 0, 0
    # the first run of a new shape compiles (never timed); a run where a request stops early
    # at its EOS (greedy decoding of a random-weights model can) has no full-batch step, and
    # is run again on other prompts, a few times at most
    while timed < grid.repeats and attempts < grid.repeats + 4:
        ids = [f"d{time.monotonic_ns()}-{i}" for i in range(batch)]
        for rid in ids:  # enough tokens to outlast the chunked prefill of the others
            engine.submit(GenerateRequest(
                rid, prompts.namespace(engine), tuple(prompts.tokens(context)),
                SamplingParams(max_tokens=engine.max_context - context)))
        times: list[float] = []
        all_decoding = False
        while engine.busy and len(times) < grid.decode_steps:
            started = time.perf_counter()
            out = engine.step()
            elapsed = time.perf_counter() - started
            # after a step where every request got a token, all of them decode and nothing
            # is left to prefill: the next step with a token for each is a pure decode step
            full = len(out.deltas) == batch and not out.finished
            if full and all_decoding:
                times.append(elapsed)
            all_decoding = full
        for rid in ids:
            engine.abort(rid)
        if len(times) == grid.decode_steps and attempts:
            best = min(best, sorted(times)[len(times) // 2])
            timed += 1
        attempts += 1
    if best == float("inf"):
        raise RuntimeError(f"no decode step of batch {batch} ran: is max_batch below {batch}?")
    return best


def _verify_s(loaded, prompts: _Prompts, context: int, batch: int, width: int,
              grid: ProfileGrid) -> float:
    """The median verify pass of ``batch`` rows x ``width`` drafts (random drafts: rejected,
    so every pass also rolls the rejected positions out, as most passes do), best of the
    repeats, after one untimed pass of the shape."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from workers.engine.decode import DecodeBatch

    best = float("inf")
    for _ in range(grid.repeats):
        rows = DecodeBatch(loaded.model)
        for _ in range(batch):
            prompt = prompts.tokens(context)
            cache = [KVCache() for _ in range(loaded.kv_shape.layers)]
            logits = loaded.model(mx.array([prompt]), cache=cache)
            rows.insert(int(mx.argmax(logits[0, -1]).item()), cache, prompt, None, None)
        uids = list(range(batch))
        times = []
        for step in range(grid.decode_steps + 1):
            drafts = {uid: prompts.tokens(width) for uid in uids}
            started = time.perf_counter()
            rows.step(drafts)
            if step:  # the first pass of a shape compiles
                times.append(time.perf_counter() - started)
        best = min(best, sorted(times)[len(times) // 2])
    return best


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
