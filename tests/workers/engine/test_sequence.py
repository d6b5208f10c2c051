"""Sampling at the edges of the temperature range: a tiny temperature is greedy, not random.

Log-probabilities of output tokens (``workers.engine.sequence.token_logprob``): the chosen
token's value and the likeliest alternatives, exactly, most likely first, ties by token id.
"""
from __future__ import annotations

import pytest
import workers  # noqa: F401  (OpenBLAS before mlx)
from tests.support.forged_models import tiny_model
from workers.engine.engine import Engine, EngineConfig
from workers.messages import GenerateRequest, GenerateResult, SamplingParams
from workers.engine.sequence import GREEDY_BELOW, make_sampler
import math
import mlx.core as mx
from workers.engine.sequence import token_logprob
from workers.messages import TokenLogprob


PROMPT = tuple(range(100, 140))

@pytest.fixture
def engine() -> Engine:
    """An engine of the test's own: its prefix store fills as the test generates."""
    return Engine.open(tiny_model("llama"), EngineConfig(block_size=16))

def _tokens(engine: Engine, request_id: str, temperature: float, seed: int) -> tuple[int, ...]:
    request = GenerateRequest(request_id, engine.namespace("t"), PROMPT,
                              SamplingParams(max_tokens=16, temperature=temperature, seed=seed))
    (result,) = engine.generate([request])
    assert isinstance(result, GenerateResult), result
    return result.output_tokens


class TestSampling:
    @pytest.mark.parametrize("temperature", [1e-38, 1e-39, 1e-45, 5e-6])
    def test_a_temperature_below_1e_5_is_greedy(self, engine, temperature):
        assert make_sampler(SamplingParams(max_tokens=1, temperature=temperature)) is None
        greedy = _tokens(engine, f"g{temperature}", 0.0, 0)
        for seed in range(3):
            assert _tokens(engine, f"t{temperature}-{seed}", temperature, seed) == greedy

    def test_temperatures_from_1e_5_sample(self):
        assert GREEDY_BELOW == 1e-5
        assert make_sampler(SamplingParams(max_tokens=1, temperature=1e-5)) is not None


def _row(values) -> mx.array:
    logits = mx.array(values, dtype=mx.float32)
    return logits - mx.logsumexp(logits)


class TestLogprobs:
    def test_the_chosen_token_and_the_top_alternatives_in_order(self):
        row = _row([0.0, 2.0, 1.0, 2.0, -1.0])
        z = math.log(1 + 2 * math.e ** 2 + math.e + math.e ** -1)
        got = token_logprob(row, 2, 3)
        assert got.token == 2 and abs(got.logprob - (1 - z)) < 1e-6
        assert [t for t, _ in got.top] == [1, 3, 2]  # 1 and 3 tie: the lower id first
        assert all(abs(v - want) < 1e-6 for (_, v), want in zip(got.top, [2 - z, 2 - z, 1 - z]))

    def test_zero_alternatives_and_all_of_a_tiny_vocabulary(self):
        row = _row([1.0, 0.0])
        assert token_logprob(row, 0, 0).top == ()
        every = token_logprob(row, 1, 5)
        assert [t for t, _ in every.top] == [0, 1]
        assert isinstance(every, TokenLogprob)

    def test_a_half_precision_row_is_read_in_float32(self):
        row = _row([0.5, 0.25, 0.125]).astype(mx.float16)
        got = token_logprob(row, 0, 1)
        assert isinstance(got.logprob, float) and got.top[0][0] == 0
