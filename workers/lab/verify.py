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
cache the previous turn left (``workers.engine.kept``: no join); the log-probabilities a
request gets back, from a cached prompt, against a recompute without the cache; speculative
decoding (prompt-lookup drafts verified in the batch) against plain decoding, prompts that
copy from themselves batched together (the verify pass's log-probabilities within the
tolerance of one-token steps', the greedy tokens identical); a prefix pulled from another
engine's store (the frames a peer sends) and reused. Then, per store setting
(``workers.lab.verify_tiers``): a prefix read back from the disk tier (exact), and 8-bit and
4-bit K/V (greedy agreement and largest logit difference, measured).
"""
from __future__ import annotations

import dataclasses
import random
import time
from pathlib import Path

from workers.engine.engine import Engine, EngineConfig, RequestFailed
from workers.model.model_dir import open_model_dir

from workers.lab.verify_cases import (CaseResult, Checker, VerifyReport,
                                     chat_case, random_case, run_requests)


def _boundary_case(c: Checker, rng: random.Random) -> CaseResult:
    ref, cached = c.engines()
    bs, vocab = c.block_size, c.loaded.vocab_size
    base = [rng.randrange(vocab) for _ in range(4 * bs + 1)]
    prompts = [base[:3 * bs - 1], base[:3 * bs], base[:3 * bs + 1], base[:4 * bs]]
    return c.compare("block boundaries (below / at / above)", ref, cached, prompts,
                     batched=False, warm=[base])


def _batched_case(c: Checker, rng: random.Random) -> CaseResult:
    ref, cached = c.engines()
    vocab = c.loaded.vocab_size
    shared = [rng.randrange(vocab) for _ in range(3 * c.block_size)]
    prompts = [shared + [rng.randrange(vocab) for _ in range(n)] for n in (1, 7, 20, 33)]
    prompts.append([rng.randrange(vocab) for _ in range(11)])  # a stranger with no prefix
    return c.compare("batched together vs each alone", ref, cached, prompts, batched=True,
                     warm=[shared + [1]])


def _eviction_case(c: Checker, rng: random.Random) -> CaseResult:
    bs, vocab = c.block_size, c.loaded.vocab_size
    per_block = bs * c.loaded.kv_shape.bytes_per_token
    ref, cached = c.engines(store_bytes=8 * per_block)
    keep = [rng.randrange(vocab) for _ in range(3 * bs + 1)]
    neighbours = [[rng.randrange(vocab) for _ in range(2 * bs + 1)] for _ in range(3)]
    evicted_before = cached.store_stats().ledger.evictions

    def touch_keep() -> None:
        # keep is used between its neighbours, so they, not keep, are evicted to make room
        run_requests(cached, [c.request(cached, keep, 1)])
        for n in neighbours:
            run_requests(cached, [c.request(cached, n, 1)])
            run_requests(cached, [c.request(cached, keep, 1)])
        if cached.store_stats().ledger.evictions == evicted_before:
            raise RuntimeError("the eviction case evicted nothing: the store is too large")

    return c.compare("restored after neighbours were evicted", ref, cached,
                     [keep + [rng.randrange(vocab) for _ in range(5)]], batched=False,
                     before=touch_keep)


def _kept_case(c: Checker, rng: random.Random) -> CaseResult:
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


def _logprobs_case(c: Checker, rng: random.Random) -> CaseResult:
    """The log-probabilities a request gets back (its chosen tokens' and the top 5), from a
    prompt read from the cache, against the same sequence computed without it."""
    ref, cached = c.engines()
    vocab = c.loaded.vocab_size
    prompt = [rng.randrange(vocab) for _ in range(3 * c.block_size + 3)]
    run_requests(cached, [c.request(cached, prompt, 2)])  # the prefix is stored

    def scored(engine):
        plain = c.request(engine, prompt)
        request = dataclasses.replace(
            plain, sampling=dataclasses.replace(plain.sampling, logprobs=5))
        (result,) = engine.generate([request])
        if isinstance(result, RequestFailed):
            raise RuntimeError(f"the logprobs case failed: {result.error}")
        return result

    a, b = scored(ref), scored(cached)
    compared = max(len(a.output_tokens), len(b.output_tokens))
    equal, worst = 0, 0.0
    for x, y in zip(a.logprobs, b.logprobs):
        if x.token != y.token or [t for t, _ in x.top] != [t for t, _ in y.top]:
            break
        equal += 1
        worst = max([worst, abs(x.logprob - y.logprob)]
                    + [abs(p - q) for (_, p), (_, q) in zip(x.top, y.top)])
    return CaseResult("returned log-probabilities (top 5) vs a recompute", 1, compared, equal,
                      worst, b.cached_tokens, True)


def _speculation_case(c: Checker, rng: random.Random) -> CaseResult:
    """Prompts that repeat a passage (something to copy) and one that does not, batched, on an
    engine that verifies every draft (its clock stands still, so no step's cost forbids one)."""
    ref, _ = c.engines()
    config = EngineConfig(block_size=c.block_size, store_bytes=c.store_bytes, speculate=True)
    spec = Engine(c.loaded, config, time.monotonic, lambda: 0)
    vocab = c.loaded.vocab_size
    words = ["orchard", "apple", "cache", "block", "prefix", "router", "token", "worker"]
    passage = " ".join(rng.choice(words) for _ in range(40))
    prompts = [spec.render_chat([{"role": "user", "content": f"Repeat exactly: {passage}"}])]
    for _ in range(2):
        base = [rng.randrange(vocab) for _ in range(2 * c.block_size)]
        prompts.append(base + base[:c.block_size])
    prompts.append([rng.randrange(vocab) for _ in range(c.block_size + 3)])
    long = Checker(c.loaded, c.block_size, max(c.max_tokens, 24), c.store_bytes)
    result = long.compare("speculation (drafts verified) vs plain decoding", ref, spec,
                          prompts, batched=True, expect_reuse=False)
    if not result.notes:
        raise RuntimeError("the speculation case drafted nothing: the verify pass did not run")
    return result


def _pulled_case(c: Checker, rng: random.Random) -> CaseResult:
    """A prefix pulled from another engine's store (``workers.cache.transfer``: the frames a
    peer sends, checked and stored as they arrive) and then reused, against a recompute."""
    ref, cached = c.engines()
    _, holder = c.engines()
    vocab = c.loaded.vocab_size
    base = [rng.randrange(vocab) for _ in range(4 * c.block_size + 2)]
    blocks = len(base) // c.block_size

    def pull() -> None:
        run_requests(holder, [c.request(holder, base, 2)])   # the holder computes it
        ns = cached.namespace("verify")
        frames = holder.transfer.serve(holder.namespace("verify"), base, 0, blocks)
        adopted = cached.transfer.adopt(ns, base, 0, frames)
        if adopted.stored != blocks:
            raise RuntimeError(f"the pulled case stored {adopted.stored} of {blocks} blocks: "
                               f"{adopted.refused}")
    prompts = [base + [rng.randrange(vocab) for _ in range(n)] for n in (1, 9)]
    return c.compare("a prefix pulled from a peer's store", ref, cached, prompts,
                     batched=False, before=pull)


CASES = (chat_case, random_case, _boundary_case, _batched_case, _eviction_case, _kept_case,
         _logprobs_case, _speculation_case, _pulled_case)


def verify_model(model_dir: Path | str, block_size: int = 16, max_tokens: int = 8,
                 seed: int = 0, tiers: bool = True) -> VerifyReport:
    """Run every case on ``model_dir``; refuses unsupported architectures with ValueError.

    ``tiers`` adds the per-setting checks of ``workers.lab.verify_tiers`` (disk, 8/4-bit K/V).
    """
    from workers.lab.verify_tiers import verify_tiers

    loaded = open_model_dir(model_dir)
    checker = Checker(loaded, block_size, max_tokens, store_bytes=1 << 30)
    rng = random.Random(seed)
    cases = tuple(case(checker, rng) for case in CASES)
    settings = verify_tiers(loaded, block_size, max_tokens, seed) if tiers else ()
    return VerifyReport(str(model_dir), cases, settings=settings)
