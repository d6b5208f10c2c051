"""Sampling at the edges of the temperature range: a tiny temperature is greedy, not random."""
import pytest

import workers  # noqa: F401  (OpenBLAS before mlx)
from tests.forged_models import tiny_model
from workers.engine.engine import Engine, EngineConfig
from workers.messages import GenerateRequest, GenerateResult, SamplingParams
from workers.engine.sequence import GREEDY_BELOW, make_sampler

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


@pytest.mark.parametrize("temperature", [1e-38, 1e-39, 1e-45, 5e-6])
def test_a_temperature_below_1e_5_is_greedy(engine, temperature):
    assert make_sampler(SamplingParams(max_tokens=1, temperature=temperature)) is None
    greedy = _tokens(engine, f"g{temperature}", 0.0, 0)
    for seed in range(3):
        assert _tokens(engine, f"t{temperature}-{seed}", temperature, seed) == greedy


def test_temperatures_from_1e_5_sample():
    assert GREEDY_BELOW == 1e-5
    assert make_sampler(SamplingParams(max_tokens=1, temperature=1e-5)) is not None
