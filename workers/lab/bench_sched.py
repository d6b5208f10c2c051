"""The scheduler's figures: how long decodes stall while a long prompt is admitted, and what
batching prefills buys.

**Decode stall.** Four requests decode; the time between consecutive tokens of each (TPOT) is
taken over ``window`` steps with nothing admitted, then over ``window`` steps while a
``long_prompt``-token prompt (4,000 by default) is being prefilled, and the two alternate for
``rounds`` rounds so that a burst of load on a shared machine hits both alike (the ratio of
medians is given too: on a shared machine one burst decides a p99). Each round's
long prompt is new (no reuse) and is aborted at the end of its window, before it completes:
the figure is about the chunks, not the prompt's last step. ``decode_stall_ratio`` is the
p99 TPOT while admitting over the p99 TPOT idle. The same intervals are also taken in this
process's CPU time (``decode_stall_ratio_cpu``): with one BLAS thread that is the work each
interval took, which other processes on a shared machine do not stretch, while a wall-clock
p99 there is set by whichever burst of their load lands in the window.

**Batched prefill.** ``prompts`` cold prompts of ``prompt_tokens`` each, first submitted
together (their chunks run as one pass: equal cache lengths), then one at a time, alternating
for ``rounds`` rounds; each figure is prompt tokens over the time to their first tokens, best
round of each.
"""
from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass

from router.kv.stats import percentile
from workers.engine.engine import Engine
from workers.messages import GenerateRequest, SamplingParams


@dataclass(frozen=True, slots=True)
class StallFigures:
    tpot_idle_p50_s: float
    tpot_idle_p99_s: float
    tpot_admitting_p50_s: float
    tpot_admitting_p99_s: float
    decode_stall_ratio: float      # p99 admitting / p99 idle
    decode_stall_ratio_p50: float  # the same with medians: less at the mercy of one burst
    decode_stall_ratio_cpu: float  # p99 / p99 of the intervals in this process's CPU time
    decode_stall_ratio_cpu_p50: float
    long_prompt_tokens: int
    long_prompt_tokens_prefilled: int  # per window, mean over rounds


@dataclass(frozen=True, slots=True)
class BatchedPrefill:
    prompts: int
    prompt_tokens: int
    batched_tokens_per_s: float
    one_at_a_time_tokens_per_s: float


def _prompt(rng: random.Random, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(rng.randrange(vocab // 4, vocab // 2) for _ in range(n))


def _window(engine: Engine, steps: int, stop_on: str = "") -> list[tuple[float, float]]:
    """Intervals (wall, CPU seconds) between consecutive tokens of each request over ``steps``
    steps, or until ``stop_on`` yields its first token (its prefill is done: the admitting
    window is over)."""
    last: dict[str, tuple[float, float]] = {}
    gaps: list[tuple[float, float]] = []
    for _ in range(steps):
        out = engine.step()
        now = time.perf_counter(), time.process_time()
        done = False
        for d in out.deltas:
            if d.request_id == stop_on:
                done = True  # this step ran the prompt's last chunk beside the decodes
            elif d.request_id in last:
                before = last[d.request_id]
                gaps.append((now[0] - before[0], now[1] - before[1]))
            if d.request_id != stop_on:
                last[d.request_id] = now
        if done:
            break
    return gaps


def decode_stall(engine: Engine, long_prompt: int = 4000, window: int = 8, rounds: int = 3,
                 seed: int = 0) -> StallFigures:
    if long_prompt + 2 > engine.max_context:
        raise ValueError(f"a {long_prompt}-token prompt does not fit the model's context of "
                         f"{engine.max_context}: lower the long prompt")
    rng = random.Random(seed)
    vocab, ns = engine.vocab_size, engine.namespace("bench-stall")
    steps_needed = rounds * 2 * (window + 1) + 4
    decodes = [GenerateRequest(f"decode-{i}", ns, _prompt(rng, 32, vocab),
                               SamplingParams(max_tokens=steps_needed)) for i in range(4)]
    for r in decodes:
        engine.submit(r)
    for _ in range(3):  # prefill and first tokens, joining the batch, the first decode
        engine.step()
    idle: list[tuple[float, float]] = []
    admitting: list[tuple[float, float]] = []
    prefilled = 0
    for k in range(rounds):
        idle += _window(engine, window)
        long = GenerateRequest(f"long-{k}", ns, _prompt(rng, long_prompt, vocab),
                               SamplingParams(max_tokens=1))
        engine.submit(long)
        before = engine.store_stats().ledger.tokens
        admitted = _window(engine, window, stop_on=long.request_id)
        if not admitted:
            raise RuntimeError(f"the {long_prompt}-token prompt was prefilled within one step: "
                               "lengthen it to measure decodes beside its prefill")
        admitting += admitted
        prefilled += engine.store_stats().ledger.tokens - before
        engine.abort(long.request_id)
        _window(engine, 1)  # the step after the abort: drop it from the figures
    for r in decodes:
        engine.abort(r.request_id)
    wall = [[g[0] for g in gaps] for gaps in (idle, admitting)]
    cpu = [[g[1] for g in gaps] for gaps in (idle, admitting)]
    idle_p50, admitting_p50 = (percentile(g, 0.5) for g in wall)
    idle_p99, admitting_p99 = (percentile(g, 0.99) for g in wall)
    cpu_idle_p50, cpu_admitting_p50 = (percentile(g, 0.5) for g in cpu)
    cpu_idle_p99, cpu_admitting_p99 = (percentile(g, 0.99) for g in cpu)
    return StallFigures(idle_p50, idle_p99, admitting_p50, admitting_p99,
                        admitting_p99 / idle_p99, admitting_p50 / idle_p50,
                        cpu_admitting_p99 / cpu_idle_p99, cpu_admitting_p50 / cpu_idle_p50,
                        long_prompt, prefilled // rounds)


def batched_prefill(engine: Engine, prompts: int = 4, prompt_tokens: int = 128,
                    rounds: int = 2, seed: int = 1) -> BatchedPrefill:
    if prompts * prompt_tokens > engine.config.prefill_budget:
        raise ValueError(f"{prompts} x {prompt_tokens} tokens exceed the engine's prefill "
                         f"budget of {engine.config.prefill_budget}: they would not share a step")
    rng = random.Random(seed)
    vocab, ns = engine.vocab_size, engine.namespace("bench-prefill")
    ids = iter(range(10**9))

    def batch() -> list[GenerateRequest]:
        return [GenerateRequest(f"p{next(ids)}", ns, _prompt(rng, prompt_tokens, vocab),
                                SamplingParams(max_tokens=1)) for _ in range(prompts)]

    def timed(groups: list[list[GenerateRequest]]) -> float:
        start = time.perf_counter()
        for group in groups:
            engine.generate(group)
        return time.perf_counter() - start

    timed([batch()[:1]])  # warm the kernels
    together, alone = [], []
    for _ in range(rounds):
        together.append(timed([batch()]))
        alone.append(timed([[r] for r in batch()]))
    tokens = prompts * prompt_tokens
    return BatchedPrefill(prompts, prompt_tokens, tokens / min(together), tokens / min(alone))


def as_json(stall: StallFigures, prefill: BatchedPrefill) -> dict:
    return {**asdict(stall), "prefill_tokens_per_s": asdict(prefill)}
