"""Equivalence per store setting: the disk tier (exact) and quantized K/V (measured, not exact).

``verify_tiers`` runs ``workers.lab.verify``'s comparison (greedy tokens and log-probabilities of
a cached engine against an engine that recomputes everything) with the cached engine's store
set up otherwise:

- **disk tier**: a prefix is pushed out of a small memory tier by its neighbours, lands on
  disk, and is read back for the compared requests. Unquantized, it must agree exactly (same
  bar as ``orchard verify``'s own cases); the case fails if nothing was read from disk.
- **8-bit / 4-bit K/V** (memory tier): the chat and random-sequence cases. Quantized K/V is
  not exact: the report gives the greedy agreement and the largest logit difference, and
  the bytes per cached token against the model's precision, so the capacity gained can be
  weighed against the accuracy lost. A model whose head_dim is not a multiple of 64 cannot
  be quantized in groups of 64: the setting is reported as skipped, with why.
"""
from __future__ import annotations

import random
import tempfile
from dataclasses import dataclass

from workers.cache.kv_quant import KVCodec
from workers.model.model_dir import LoadedModel
from workers.lab.verify_cases import (TOLERANCE, CaseResult, Checker, chat_case, random_case,
                                     run_requests)


@dataclass(frozen=True, slots=True)
class SettingResult:
    setting: str
    exact: bool                 # must agree exactly (no quantization)
    bytes_per_token: int
    bytes_ratio: float          # against the model's own precision
    tokens_compared: int = 0
    tokens_equal: int = 0
    max_abs_logit_diff: float = 0.0
    reused_tokens: int = 0
    skipped: str = ""           # why the setting could not run on this model

    @property
    def agreement(self) -> float:
        return self.tokens_equal / self.tokens_compared if self.tokens_compared else 0.0

    @property
    def passed(self) -> bool:
        if self.skipped or not self.exact:
            return True  # quantized settings are measured, not judged
        return (self.tokens_equal == self.tokens_compared and self.reused_tokens > 0
                and self.max_abs_logit_diff <= TOLERANCE)


def verify_tiers(loaded: LoadedModel, block_size: int, max_tokens: int, seed: int
                 ) -> tuple[SettingResult, ...]:
    shape = loaded.kv_shape
    full = shape.bytes_per_token
    results = [_disk_setting(loaded, block_size, max_tokens, seed)]
    for bits in (8, 4):
        codec = KVCodec(bits, shape.dtype)
        per_token = shape.tier_bytes_per_token(codec)
        name = f"memory tier {bits}-bit K/V"
        try:
            codec.check(shape.head_dim)
        except ValueError as exc:
            results.append(SettingResult(name, False, per_token, per_token / full, skipped=str(exc)))
            continue
        checker = Checker(loaded, block_size, max_tokens, 1 << 30, {"kv_bits": bits})
        rng = random.Random(seed)
        cases = [chat_case(checker, rng), random_case(checker, rng)]
        results.append(_combine(name, False, per_token, per_token / full, cases))
    return tuple(results)


def _disk_setting(loaded: LoadedModel, block_size: int, max_tokens: int, seed: int
                  ) -> SettingResult:
    per_block = block_size * loaded.kv_shape.bytes_per_token
    with tempfile.TemporaryDirectory(prefix="orchard-verify-disk-") as tmp:
        checker = Checker(loaded, block_size, max_tokens, 8 * per_block,
                           {"disk_bytes": 1 << 30, "disk_dir": tmp, "worker_id": "verify"})
        ref, cached = checker.engines()
        try:
            case = _read_back_case(checker, ref, cached, random.Random(seed))
        finally:
            cached.close()
    full = loaded.kv_shape.bytes_per_token
    return _combine("disk tier (read back from files)", True, full, 1.0, [case])


def _read_back_case(c: Checker, ref, cached, rng: random.Random) -> CaseResult:
    bs, vocab = c.block_size, c.loaded.vocab_size
    keep = [rng.randrange(vocab) for _ in range(3 * bs + 1)]
    neighbours = [[rng.randrange(vocab) for _ in range(2 * bs + 1)] for _ in range(6)]

    def push_keep_to_disk() -> None:
        run_requests(cached, [c.request(cached, keep, 1)])
        for n in neighbours:  # each evicts some of keep's blocks from the 8-block memory
            run_requests(cached, [c.request(cached, n, 1)])
        cached.flush_store()
        if cached.store_stats().disk.written_blocks == 0:
            raise RuntimeError("the disk case spilled nothing: the memory tier is too large")

    case = c.compare("read back from the disk tier", ref, cached,
                     [keep + [rng.randrange(vocab) for _ in range(5)]], batched=False,
                     before=push_keep_to_disk)
    if cached.store_stats().disk.read_blocks == 0:
        raise RuntimeError("the disk case read nothing from disk")
    return case


def _combine(name: str, exact: bool, per_token: int, ratio: float,
             cases: list[CaseResult]) -> SettingResult:
    return SettingResult(
        name, exact, per_token, ratio, sum(c.tokens_compared for c in cases),
        sum(c.tokens_equal for c in cases), max(c.max_abs_logit_diff for c in cases),
        sum(c.cached_tokens for c in cases))
