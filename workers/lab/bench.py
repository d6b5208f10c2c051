"""The engine benchmark: a long-system-prompt chat, with the prefix store and without.

A deterministic chat (a system prompt of about 1,000 tokens, then 8 turns of a ~50-token user
message and a 32-token reply) runs through two engines on the same model: *warm* with the
prefix store, *cold* without it (every turn prefills its whole prompt). For every turn it also
measures the *floor*: the same uncached suffix prefilled onto a K/V cache already in memory,
with plain mlx-lm and no store, which is the least any cache could cost. Each TTFT covers the
prefill and the first sampled token. Warm and floor are each the best of ``repeats`` runs (5
by default), interleaved and from the same starting state (trial runs generate one token and
their blocks are invalidated again), so a burst of load on a shared machine hits both alike;
cold is the best of ``repeats // 2``.

Figures: per-turn TTFTs and token counts; the medians over turns 2..8 of warm/floor and
cold/warm; the store's bytes per cached token against the theoretical
``2 x layers x kv_heads x head_dim x bytes per element``.
"""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from workers.engine.engine import Engine, EngineConfig
from workers.messages import GenerateRequest, GenerateResult, SamplingParams
from workers.model.model_dir import LoadedModel, open_model_dir

_WORDS = ("orchard apple cache block prefix router token worker cluster batch tenant model "
          "latency memory store evict expire replay trace forecast measured input output "
          "system prompt reply question answer policy").split()


@dataclass(frozen=True, slots=True)
class TurnFigures:
    turn: int
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    ttft_warm_s: float
    ttft_cold_s: float
    ttft_floor_s: float


@dataclass(frozen=True, slots=True)
class EngineBench:
    model: str
    system_prompt_tokens: int
    turns: tuple[TurnFigures, ...]
    ttft_warm_over_floor: float
    ttft_cold_over_warm: float
    bytes_per_cached_token: float
    theoretical_bytes_per_token: int

    def as_json(self) -> dict:
        out = asdict(self)
        out["turns"] = [asdict(t) for t in self.turns]
        return out


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def _floor_cache(loaded: LoadedModel, prefix: list[int]) -> list[tuple[mx.array, mx.array]]:
    """K/V of ``prefix`` computed in memory (untimed), exactly ``len(prefix)`` long per layer."""
    cache = [KVCache() for _ in range(loaded.kv_shape.layers)]
    if prefix:
        getattr(loaded.model, "model", loaded.model)(mx.array([prefix]), cache=cache)
    kv = [(c.keys[..., : len(prefix), :], c.values[..., : len(prefix), :]) for c in cache
          ] if prefix else []
    mx.eval(kv)
    return kv


def _floor_once(loaded: LoadedModel, prompt: list[int], kv: list[tuple[mx.array, mx.array]]
                ) -> float:
    """Time to prefill what follows ``kv`` in ``prompt`` and pick the first token."""
    model = loaded.model
    cache = [KVCache() for _ in range(loaded.kv_shape.layers)]
    for c, (k, v) in zip(cache, kv):
        c.state = (k, v, k.shape[2])
    cached = cache[0].offset
    start = time.perf_counter()
    if len(prompt) - cached > 1:
        getattr(model, "model", model)(mx.array([prompt[cached:-1]]), cache=cache)
    logits = model(mx.array([prompt[-1:]]), cache=cache)
    mx.eval(mx.argmax(logits[:, -1, :], axis=-1))
    return time.perf_counter() - start


def _run(engine: Engine, prompt: list[int], turn: int, reply_tokens: int) -> GenerateResult:
    request = GenerateRequest(f"turn-{turn}", engine.namespace("bench"), tuple(prompt),
                              SamplingParams(max_tokens=reply_tokens))
    (result,) = engine.generate([request])
    if not isinstance(result, GenerateResult):
        raise ValueError(f"the benchmark cannot run on this model: {result.error}")
    return result


def _trial(engine: Engine, prompt: list[int], turn: int) -> GenerateResult:
    """A one-token run, after which the store is put back as it was before it."""
    trial = _run(engine, prompt, turn, 1)
    bs = engine.config.block_size
    first_new = (trial.cached_tokens // bs + 1) * bs  # the first block the store lacked
    if engine.config.use_store and first_new <= len(prompt):
        engine.drop_blocks(engine.namespace("bench"), prompt[:first_new])
    return trial


def _warm_and_floor(engine: Engine, loaded: LoadedModel, prompt: list[int], turn: int,
                    reply_tokens: int, repeats: int) -> tuple[GenerateResult, float, float]:
    """Best warm and floor TTFTs of ``repeats`` interleaved runs; the real turn comes last."""
    first = _trial(engine, prompt, turn)
    kv = _floor_cache(loaded, prompt[: first.cached_tokens])
    warm, floor = [first.ttft_s], [_floor_once(loaded, prompt, kv)]
    for _ in range(repeats - 2):
        warm.append(_trial(engine, prompt, turn).ttft_s)
        floor.append(_floor_once(loaded, prompt, kv))
    result = _run(engine, prompt, turn, reply_tokens)
    warm.append(result.ttft_s)
    floor.append(_floor_once(loaded, prompt, kv))
    return result, min(warm), min(floor)


def _cold(engine: Engine, prompt: list[int], turn: int, repeats: int) -> float:
    return min(_run(engine, prompt, turn, 1).ttft_s for _ in range(repeats))


def bench_engine(model_dir: Path | str, turns: int = 8, system_words: int = 900,
                 user_words: int = 40, reply_tokens: int = 32, block_size: int = 16,
                 seed: int = 0, repeats: int = 5) -> EngineBench:
    loaded = open_model_dir(model_dir)
    warm = Engine(loaded, EngineConfig(block_size=block_size), time.monotonic, time.time_ns)
    cold = Engine(loaded, EngineConfig(block_size=block_size, use_store=False),
                  time.monotonic, time.time_ns)
    rng = random.Random(seed)
    system = _text(rng, system_words)
    while len(warm.render_chat([{"role": "system", "content": system}], False)) > 1000:
        system = system.rsplit(" ", 1)[0]
    messages = [{"role": "system", "content": system}]
    _floor_once(loaded, [1, 2, 3], [])  # warm up kernels before timing anything
    figures = []
    for turn in range(1, turns + 1):
        messages.append({"role": "user", "content": _text(rng, user_words)})
        prompt = warm.render_chat(messages)
        w, warm_s, floor_s = _warm_and_floor(warm, loaded, prompt, turn, reply_tokens, repeats)
        cold_s = _cold(cold, prompt, turn, max(1, repeats // 2))
        figures.append(TurnFigures(turn, len(prompt), w.cached_tokens, w.computed_tokens,
                                   warm_s, cold_s, floor_s))
        messages.append({"role": "assistant", "content": w.text})
    later = figures[1:] or figures
    stats = warm.store_stats()
    return EngineBench(
        model=str(model_dir),
        system_prompt_tokens=len(warm.render_chat(messages[:1], False)),
        turns=tuple(figures),
        ttft_warm_over_floor=statistics.median(t.ttft_warm_s / t.ttft_floor_s for t in later),
        ttft_cold_over_warm=statistics.median(t.ttft_cold_s / t.ttft_warm_s for t in later),
        bytes_per_cached_token=stats.tensor_bytes / stats.ledger.tokens if stats.ledger.tokens else 0.0,
        theoretical_bytes_per_token=stats.bytes_per_token)
