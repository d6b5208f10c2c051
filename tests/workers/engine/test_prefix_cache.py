"""A request's cache controls in the engine's prefix cache (``workers.engine.prefix_cache``):
breakpoints write exactly the blocks before them, ``write: false`` stores nothing, ``read:
false`` computes the whole prompt, a TTL reaches the ledger, salts share nothing.

The engine is the real one over a forged tiny model, its store's clock injected.
"""
from __future__ import annotations

import dataclasses
import random

import pytest

import workers  # noqa: F401  (OpenBLAS before mlx)
from tests.conftest import Clock
from tests.support.forged_models import tiny_model
from workers.engine.engine import Engine, EngineConfig
from workers.messages import CacheControls, GenerateRequest, GenerateResult, SamplingParams

BS = 16
PROMPT = tuple(random.Random(25).randrange(32000) for _ in range(70))  # 4 full blocks + 6


@pytest.fixture
def clock() -> Clock:
    return Clock(1000.0)


@pytest.fixture
def engine(clock: Clock) -> Engine:
    # no kept caches: every reuse counted here is the store's
    return Engine.open(tiny_model("llama"), EngineConfig(block_size=BS, ttl_s=300.0,
                                                         kept_bytes=0), clock=clock)


_ids = iter(range(10**9))


def run(engine: Engine, cache: CacheControls = CacheControls(), prompt=PROMPT,
        salt: str = "") -> GenerateResult:
    namespace = dataclasses.replace(engine.namespace("t"), salt=salt)
    request = GenerateRequest(f"c{next(_ids)}", namespace, tuple(prompt),
                              SamplingParams(max_tokens=4), cache=cache)
    (result,) = engine.generate([request])
    assert isinstance(result, GenerateResult), result
    return result


def stored_blocks(engine: Engine) -> int:
    return engine.store_stats().ledger.blocks


class TestBreakpoints:
    def test_a_breakpoint_writes_exactly_the_full_blocks_before_it(self, engine):
        first = run(engine, CacheControls(write_limit=40))  # blocks 0 and 1 end before 40
        assert (first.written_tokens, stored_blocks(engine)) == (32, 2)
        again = run(engine)
        assert again.cached_tokens == 32
        assert again.output_tokens == first.output_tokens

    def test_a_breakpoint_on_a_block_boundary_writes_that_block(self, engine):
        assert run(engine, CacheControls(write_limit=48)).written_tokens == 48

    def test_without_breakpoints_every_full_block_is_written_outputs_included(self, engine):
        result = run(engine)  # 70 prompt + 3 output tokens held: 4 full blocks
        assert (result.written_tokens, stored_blocks(engine)) == (64, 4)

    def test_a_breakpoint_before_the_first_block_writes_nothing(self, engine):
        assert run(engine, CacheControls(write_limit=15)).written_tokens == 0
        assert stored_blocks(engine) == 0


class TestBypass:
    def test_write_false_computes_everything_and_stores_nothing(self, engine):
        bypass = run(engine, CacheControls(write=False))
        assert (bypass.computed_tokens, bypass.written_tokens) == (70, 0)
        assert stored_blocks(engine) == 0
        assert run(engine).cached_tokens == 0

    def test_read_false_computes_the_whole_prompt_with_the_same_tokens(self, engine):
        warm = run(engine)
        assert run(engine).cached_tokens == 64
        cold = run(engine, CacheControls(read=False))
        assert (cold.cached_tokens, cold.computed_tokens) == (0, 70)
        assert cold.output_tokens == warm.output_tokens


class TestTtl:
    def test_written_blocks_carry_the_request_ttl(self, engine, clock):
        run(engine, CacheControls(ttl_s=3600.0))
        clock.now += 300.0  # the store's own TTL has passed: an hour's blocks stay
        assert engine.expire() == 0
        assert run(engine, prompt=PROMPT[:40]).cached_tokens == 32
        clock.now += 3600.0
        assert engine.expire() == 4
        assert stored_blocks(engine) == 0

    def test_without_a_ttl_blocks_keep_the_store_ttl(self, engine, clock):
        run(engine)
        clock.now += 300.0
        assert engine.expire() == 4


class TestKept:
    def test_a_bypassed_or_cut_or_salted_request_keeps_no_cache_for_the_next_turn(self, clock):
        engine = Engine.open(tiny_model("llama"), EngineConfig(block_size=BS), clock=clock)
        assert run(engine, CacheControls(write=False)).written_tokens == 0
        assert run(engine, CacheControls(write=False)).cached_tokens == 0
        run(engine, CacheControls(write_limit=40))
        assert run(engine, CacheControls(write=False)).cached_tokens == 32  # the store's only
        run(engine, salt="s")
        assert run(engine, salt="s").cached_tokens == 64
        run(engine)
        assert run(engine).cached_tokens == 69  # the store's 64, a kept cache's 5 after them


class TestSalt:
    def test_different_salts_share_no_block(self, engine):
        run(engine, salt="alice")
        assert run(engine, salt="bob").cached_tokens == 0
        assert run(engine).cached_tokens == 0           # no salt is a salt of its own
        assert run(engine, salt="alice").cached_tokens == 64
        assert stored_blocks(engine) == 12              # three chains of four blocks
