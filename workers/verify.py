"""Equivalence check: generation with the prefix store must equal generation without it.

``verify_model`` loads a model directory once and runs two engines on it: a *reference* that
never uses the store, and a *cached* one whose store is first warmed with the prefixes the
case needs. Every case compares, request by request and step by step, the greedy tokens and
the log-probabilities over the whole vocabulary (log-softmax of the logits, so the comparison
is of the logits up to their constant shift). A case fails on any token difference, on a
largest absolute difference above the tolerance, or when the cached engine reused nothing
although the case was built to reuse a prefix.

Cases: multi-turn chats through the chat template; random token sequences; prompts ending just
below, at and just above block boundaries; several requests batched together against each
alone; a prefix read back after its neighbours were evicted (these run with no kept caches,
so every hit joins the store's blocks); the turns of one conversation, each extending the
cache the previous turn left (``workers.kept``: no join). Then, per store setting
(``workers.verify_tiers``): a prefix read back from the disk tier (exact), and 8-bit and
4-bit K/V (greedy agreement and largest logit difference, measured).
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import mlx.core as mx

from workers.engine import Engine, EngineConfig
from workers.messages import GenerateRequest, SamplingParams
from workers.model_dir import LoadedModel, open_model_dir

TOLERANCE = 1e-4


@dataclass(frozen=True, slots=True)
class CaseResult:
    name: str
    requests: int
    tokens_compared: int
    tokens_equal: int
    max_abs_logit_diff: float
    cached_tokens: int
    expect_reuse: bool
    notes: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return (self.tokens_equal == self.tokens_compared
                and self.max_abs_logit_diff <= TOLERANCE
                and (self.cached_tokens > 0 or not self.expect_reuse))


@dataclass(frozen=True, slots=True)
class VerifyReport:
    model: str
    cases: tuple[CaseResult, ...]
    tolerance: float = TOLERANCE
    settings: tuple = ()  # workers.verify_tiers.SettingResult, one per store setting
    passed: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "passed", all(c.passed for c in self.cases)
                           and all(s.passed for s in self.settings))

    @property
    def agreement(self) -> float:
        total = sum(c.tokens_compared for c in self.cases)
        return sum(c.tokens_equal for c in self.cases) / total if total else 0.0

    @property
    def max_abs_logit_diff(self) -> float:
        return max((c.max_abs_logit_diff for c in self.cases), default=0.0)


@dataclass
class _Run:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[mx.array] = field(default_factory=list)
    cached: int = 0


def _run(engine: Engine, requests: list[GenerateRequest]) -> dict[str, _Run]:
    runs = {r.request_id: _Run() for r in requests}
    for r in requests:
        engine.submit(r)
    while engine.busy:
        out = engine.step()
        for d in out.deltas:
            runs[d.request_id].tokens.append(d.token)
            runs[d.request_id].logprobs.append(d.logprobs)
        for res in out.finished:
            runs[res.request_id].cached = res.cached_tokens
    return runs


class _Checker:
    def __init__(self, loaded: LoadedModel, block_size: int, max_tokens: int,
                 store_bytes: int, cached_config: dict | None = None) -> None:
        self.loaded = loaded
        self.cached_config = cached_config or {}  # EngineConfig fields of the cached engine
        self.block_size = block_size
        self.max_tokens = max_tokens
        self.store_bytes = store_bytes
        self.counter = 0

    def engines(self, store_bytes: int | None = None, kept_bytes: int = 0
                ) -> tuple[Engine, Engine]:
        cfg = EngineConfig(block_size=self.block_size, store_bytes=store_bytes or self.store_bytes,
                           kept_bytes=kept_bytes, **self.cached_config)
        ref = Engine(self.loaded, EngineConfig(block_size=self.block_size, use_store=False),
                     time.monotonic, time.time_ns)
        return ref, Engine(self.loaded, cfg, time.monotonic, time.time_ns)

    def request(self, engine: Engine, prompt: list[int], max_tokens: int | None = None
                ) -> GenerateRequest:
        self.counter += 1
        return GenerateRequest(f"v{self.counter}", engine.namespace("verify"), tuple(prompt),
                               SamplingParams(max_tokens=max_tokens or self.max_tokens))

    def compare(self, name: str, ref: Engine, cached: Engine, prompts: list[list[int]],
                batched: bool, warm: list[list[int]] = (), expect_reuse: bool = True,
                before: Callable[[], None] | None = None) -> CaseResult:
        for w in warm:
            _run(cached, [self.request(cached, w, 2)])
        if before is not None:
            before()
        ref_runs = [_run(ref, [self.request(ref, p)]) for p in prompts]
        ref_list = [next(iter(r.values())) for r in ref_runs]
        reqs = [self.request(cached, p) for p in prompts]
        if batched:
            got = _run(cached, reqs)
            got_list = [got[r.request_id] for r in reqs]
        else:
            got_list = [next(iter(_run(cached, [r]).values())) for r in reqs]
        compared = equal = 0
        worst = 0.0
        for a, b in zip(ref_list, got_list):
            compared += max(len(a.tokens), len(b.tokens))
            for ta, tb, la, lb in zip(a.tokens, b.tokens, a.logprobs, b.logprobs):
                if ta != tb:
                    break
                equal += 1
                worst = max(worst, mx.max(mx.abs(la - lb)).item())
        return CaseResult(name, len(prompts), compared, equal, worst,
                          sum(g.cached for g in got_list), expect_reuse)


def _chat_case(c: _Checker, rng: random.Random) -> CaseResult:
    ref, cached = c.engines()
    words = ["orchard", "apple", "cache", "block", "prefix", "router", "token", "worker"]
    messages = [{"role": "system", "content": " ".join(rng.choice(words) for _ in range(60))}]
    prompts = []
    for turn in range(3):
        messages.append({"role": "user", "content": " ".join(rng.choice(words) for _ in range(12))})
        prompts.append(cached.render_chat(messages))
        messages.append({"role": "assistant", "content": " ".join(rng.choice(words) for _ in range(8))})
    return c.compare("multi-turn chat (chat template)", ref, cached, prompts, batched=False,
                     warm=[prompts[0]])


def _random_case(c: _Checker, rng: random.Random) -> CaseResult:
    ref, cached = c.engines()
    vocab = c.loaded.vocab_size
    base = [rng.randrange(vocab) for _ in range(5 * c.block_size + 3)]
    prompts = [base + [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))] for _ in range(3)]
    return c.compare("random token sequences", ref, cached, prompts, batched=False, warm=[base])


def _boundary_case(c: _Checker, rng: random.Random) -> CaseResult:
    ref, cached = c.engines()
    bs, vocab = c.block_size, c.loaded.vocab_size
    base = [rng.randrange(vocab) for _ in range(4 * bs + 1)]
    prompts = [base[:3 * bs - 1], base[:3 * bs], base[:3 * bs + 1], base[:4 * bs]]
    return c.compare("block boundaries (below / at / above)", ref, cached, prompts,
                     batched=False, warm=[base])


def _batched_case(c: _Checker, rng: random.Random) -> CaseResult:
    ref, cached = c.engines()
    vocab = c.loaded.vocab_size
    shared = [rng.randrange(vocab) for _ in range(3 * c.block_size)]
    prompts = [shared + [rng.randrange(vocab) for _ in range(n)] for n in (1, 7, 20, 33)]
    prompts.append([rng.randrange(vocab) for _ in range(11)])  # a stranger with no prefix
    return c.compare("batched together vs each alone", ref, cached, prompts, batched=True,
                     warm=[shared + [1]])


def _eviction_case(c: _Checker, rng: random.Random) -> CaseResult:
    bs, vocab = c.block_size, c.loaded.vocab_size
    per_block = bs * c.loaded.kv_shape.bytes_per_token
    ref, cached = c.engines(store_bytes=8 * per_block)
    keep = [rng.randrange(vocab) for _ in range(3 * bs + 1)]
    neighbours = [[rng.randrange(vocab) for _ in range(2 * bs + 1)] for _ in range(3)]
    evicted_before = cached.store.stats().ledger.evictions

    def touch_keep() -> None:
        # keep is used between its neighbours, so they, not keep, are evicted to make room
        _run(cached, [c.request(cached, keep, 1)])
        for n in neighbours:
            _run(cached, [c.request(cached, n, 1)])
            _run(cached, [c.request(cached, keep, 1)])
        if cached.store.stats().ledger.evictions == evicted_before:
            raise RuntimeError("the eviction case evicted nothing: the store is too large")

    return c.compare("restored after neighbours were evicted", ref, cached,
                     [keep + [rng.randrange(vocab) for _ in range(5)]], batched=False,
                     before=touch_keep)


def _kept_case(c: _Checker, rng: random.Random) -> CaseResult:
    """Five turns of one conversation, one at a time: each prompt is the previous prompt, a
    reply and a new message, so each turn takes the cache the previous one left."""
    ref, cached = c.engines(kept_bytes=1 << 30)
    vocab = c.loaded.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(2 * c.block_size + 5)]]
    for _ in range(4):
        prompts.append(prompts[-1] + [rng.randrange(vocab) for _ in range(rng.randrange(9, 30))])
    result = c.compare("next turns extend the kept cache", ref, cached, prompts, batched=False)
    if cached.kept_stats().taken != len(prompts) - 1:
        raise RuntimeError(f"the kept case took {cached.kept_stats().taken} kept caches in "
                           f"{len(prompts) - 1} later turns: the kept path did not run")
    return result


CASES = (_chat_case, _random_case, _boundary_case, _batched_case, _eviction_case, _kept_case)


def verify_model(model_dir: Path | str, block_size: int = 16, max_tokens: int = 8,
                 seed: int = 0, tiers: bool = True) -> VerifyReport:
    """Run every case on ``model_dir``; refuses unsupported architectures with ValueError.

    ``tiers`` adds the per-setting checks of ``workers.verify_tiers`` (disk, 8/4-bit K/V).
    """
    from workers.verify_tiers import verify_tiers

    loaded = open_model_dir(model_dir)
    checker = _Checker(loaded, block_size, max_tokens, store_bytes=1 << 30)
    rng = random.Random(seed)
    cases = tuple(case(checker, rng) for case in CASES)
    settings = verify_tiers(loaded, block_size, max_tokens, seed) if tiers else ()
    return VerifyReport(str(model_dir), cases, settings=settings)
