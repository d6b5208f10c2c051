"""The comparison ``orchard verify`` runs: a reference engine without the store against a
cached one, request by request, and the cases both ``workers.lab.verify`` and
``workers.lab.verify_tiers`` build on (a chat, random tokens)."""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx

from workers.engine.engine import Engine, EngineConfig
from workers.messages import GenerateRequest, SamplingParams
from workers.model.model_dir import LoadedModel

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
    settings: tuple = ()  # workers.lab.verify_tiers.SettingResult, one per store setting
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
class RunResult:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[mx.array] = field(default_factory=list)
    cached: int = 0
    drafted: int = 0   # speculative decoding's drafts for the request, and those accepted
    accepted: int = 0


def run_requests(engine: Engine, requests: list[GenerateRequest]) -> dict[str, RunResult]:
    runs = {r.request_id: RunResult() for r in requests}
    for r in requests:
        engine.submit(r)
    while engine.busy:
        out = engine.step()
        for d in out.deltas:
            runs[d.request_id].tokens.append(d.token)
            runs[d.request_id].logprobs.append(d.logprobs)
        for res in out.finished:
            run = runs[res.request_id]
            run.cached, run.drafted, run.accepted = (res.cached_tokens, res.drafted_tokens,
                                                     res.accepted_tokens)
    return runs


class Checker:
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
            run_requests(cached, [self.request(cached, w, 2)])
        if before is not None:
            before()
        ref_runs = [run_requests(ref, [self.request(ref, p)]) for p in prompts]
        ref_list = [next(iter(r.values())) for r in ref_runs]
        reqs = [self.request(cached, p) for p in prompts]
        if batched:
            got = run_requests(cached, reqs)
            got_list = [got[r.request_id] for r in reqs]
        else:
            got_list = [next(iter(run_requests(cached, [r]).values())) for r in reqs]
        compared = equal = 0
        worst = 0.0
        for a, b in zip(ref_list, got_list):
            compared += max(len(a.tokens), len(b.tokens))
            for ta, tb, la, lb in zip(a.tokens, b.tokens, a.logprobs, b.logprobs):
                if ta != tb:
                    break
                equal += 1
                worst = max(worst, mx.max(mx.abs(la - lb)).item())
        drafted, accepted = sum(g.drafted for g in got_list), sum(g.accepted for g in got_list)
        notes = (f"drafted {drafted}, accepted {accepted}",) if drafted else ()
        return CaseResult(name, len(prompts), compared, equal, worst,
                          sum(g.cached for g in got_list), expect_reuse, notes)


def chat_case(c: Checker, rng: random.Random) -> CaseResult:
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


def random_case(c: Checker, rng: random.Random) -> CaseResult:
    ref, cached = c.engines()
    vocab = c.loaded.vocab_size
    base = [rng.randrange(vocab) for _ in range(5 * c.block_size + 3)]
    prompts = [base + [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))] for _ in range(3)]
    return c.compare("random token sequences", ref, cached, prompts, batched=False, warm=[base])
