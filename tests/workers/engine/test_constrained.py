"""Structured outputs and log-probabilities in the engine's batched step
(``workers.engine.constrained``): each constrained row is masked alone, an unconstrained
neighbour decodes exactly as it would alone, and every returned log-probability equals a
recompute of the same sequence without the cache (before temperature and any mask).
``mask_row``, ``RowHook`` and ``first_token`` on a real grammar: exact masks and draws."""
from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

import workers  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
from mlx_lm.models.cache import KVCache
from router.kv.key import Namespace
from tests.support.forged_models import tiny_model
from workers.engine.config import EngineConfig
from workers.engine.constrained import RowHook, first_token, mask_row
from workers.engine.constraints import Grammars
from workers.engine.engine import Engine
from workers.messages import GenerateRequest, GenerateResult, ResponseFormat, SamplingParams
from workers.model.model_dir import open_model_dir


SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["kind", "n"], "additionalProperties": False}

FORMAT = ResponseFormat("json_schema", json.dumps(SCHEMA, sort_keys=True), strict=True)

PROMPT_A = tuple(range(100, 140))

PROMPT_B = tuple(range(300, 350))

NAMESPACE = Namespace("t", "llama")

@pytest.fixture(scope="module")
def engine_outputs() -> Engine:
    return Engine.open(tiny_model(), EngineConfig(block_size=16, max_batch=4))

def request(rid: str, prompt, max_tokens: int = 40, **sampling) -> GenerateRequest:
    return GenerateRequest(rid, NAMESPACE, tuple(prompt),
                           SamplingParams(max_tokens=max_tokens, **sampling))

def run(engine_outputs: Engine, *requests: GenerateRequest) -> list[GenerateResult]:
    results = engine_outputs.generate(list(requests))
    assert all(isinstance(r, GenerateResult) for r in results), results
    return results

def recompute(engine_outputs: Engine, prompt, output) -> list[mx.array]:
    """Log-softmax rows for each output position, teacher-forced, one pass, no cache reuse."""
    model = engine_outputs._m.model
    tokens = list(prompt) + list(output)
    cache = [KVCache() for _ in range(engine_outputs.kv_shape.layers)]
    logits = model(mx.array([tokens]), cache=cache)[0]
    rows = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return [rows[len(prompt) - 1 + i] for i in range(len(output))]

class TestStructuredOutputs:
    def test_a_constrained_row_beside_a_free_one(self, engine_outputs):
        engine_outputs = Engine.open(tiny_model(), EngineConfig(block_size=16, max_batch=4))
        alone = run(engine_outputs, request("free0", PROMPT_B))[0]
        engine_outputs = Engine.open(tiny_model(), EngineConfig(block_size=16, max_batch=4))
        constrained, free = run(engine_outputs, request("json1", PROMPT_A, response_format=FORMAT),
                                request("free1", PROMPT_B))
        assert free.output_tokens == alone.output_tokens  # its row was never masked
        assert constrained.finish_reason == "stop"
        jsonschema.validate(json.loads(constrained.text), SCHEMA)

    def test_sampled_constrained_outputs_validate(self, engine_outputs):
        results = run(engine_outputs, *(request(f"s{i}", PROMPT_A, response_format=FORMAT,
                                        temperature=1.0, seed=i) for i in range(4)))
        for r in results:
            assert r.finish_reason == "stop"
            jsonschema.validate(json.loads(r.text), SCHEMA)

    def test_max_tokens_before_the_grammar_completes_is_length(self, engine_outputs):
        (r,) = run(engine_outputs, request("short", PROMPT_A, max_tokens=3, response_format=FORMAT))
        assert r.finish_reason == "length" and len(r.output_tokens) == 3
        with pytest.raises(json.JSONDecodeError):
            json.loads(r.text)

    def test_an_uncompilable_format_is_refused_before_it_runs(self, engine_outputs):
        bad = ResponseFormat("json_schema", json.dumps({"type": "frobnicate"}))
        (failed,) = engine_outputs.generate([request("bad", PROMPT_A, response_format=bad)])
        assert "response_format.json_schema.schema: Invalid type: frobnicate" in failed.error

class TestLogprobs:
    def test_free_logprobs_equal_a_recompute(self, engine_outputs):
        (r,) = run(engine_outputs, request("lp", PROMPT_A, max_tokens=8, logprobs=5))
        rows = recompute(engine_outputs, PROMPT_A, r.output_tokens)
        assert [t.token for t in r.logprobs] == list(r.output_tokens)
        for got, row in zip(r.logprobs, rows):
            assert abs(got.logprob - row[got.token].item()) <= 1e-4
            assert len(got.top) == 5 and got.top[0][0] == got.token  # greedy: the likeliest
            values = [v for _, v in got.top]
            assert values == sorted(values, reverse=True)
            for token, value in got.top:
                assert abs(value - row[token].item()) <= 1e-4

    def test_constrained_logprobs_are_the_models_before_the_mask(self, engine_outputs):
        (r,) = run(engine_outputs, request("lpj", PROMPT_A, response_format=FORMAT, logprobs=2))
        rows = recompute(engine_outputs, PROMPT_A, r.output_tokens)
        assert len(r.logprobs) == len(r.output_tokens)
        for got, row in zip(r.logprobs, rows):
            assert abs(got.logprob - row[got.token].item()) <= 1e-4
            likeliest = int(mx.argmax(row).item())
            assert got.top[0][0] == likeliest  # the unmasked favourite, allowed or not

    def test_no_logprobs_unless_asked(self, engine_outputs):
        (r,) = run(engine_outputs, request("none", PROMPT_A, max_tokens=3))
        assert r.logprobs == ()


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    tok = open_model_dir(tiny_model()).tokenizer
    return Grammars(tok._tokenizer, 32000, tok.eos_token_ids)


CHOICE = ResponseFormat("choice", choices=("cat", "dog"))


def logits_row(seed: int = 0, dtype=mx.float32) -> mx.array:
    return mx.random.normal((1, 32000), key=mx.random.key(seed)).astype(dtype)


class TestMaskRow:
    @pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
    def test_allowed_tokens_keep_their_logits_and_every_other_is_minus_infinity(
            self, grammars, dtype):
        constraint = grammars.constraint(CHOICE)
        allowed = constraint.allowed()
        assert 0 < allowed.sum() < 32000
        logits = logits_row(1, dtype)
        masked = mask_row(logits, constraint)
        assert (masked.shape, masked.dtype) == ((1, 32000), dtype)
        got, raw = np.array(masked[0].astype(mx.float32)), np.array(logits[0].astype(mx.float32))
        assert np.array_equal(got[allowed], raw[allowed])
        assert np.all(got[~allowed] == -np.inf)


class TestRowHook:
    def test_the_first_call_masks_only_and_each_later_one_accepts_the_token_fed(self, grammars):
        hook = RowHook(grammars.constraint(CHOICE))
        logits = logits_row(2)
        first = hook(123, logits)  # the token fed was accepted by first_token already
        allowed = np.isfinite(np.array(first[0]))
        token = int(np.flatnonzero(allowed)[0])
        after = grammars.constraint(CHOICE)
        after.accept(token)
        second = hook(token, logits)
        assert np.array_equal(np.isfinite(np.array(second[0])), after.allowed())
        assert not np.array_equal(after.allowed(), allowed)


class TestFirstToken:
    def test_the_likeliest_allowed_token_and_the_raw_log_probabilities(self, grammars):
        constraint = grammars.constraint(CHOICE)
        allowed = constraint.allowed()
        logits = logits_row(3)
        top = int(np.flatnonzero(~allowed)[0])
        logits[0, top] = 100.0  # the favourite is outside the grammar
        token, raw = first_token(logits, None, constraint)
        values = np.array(logits[0])
        assert token == int(np.flatnonzero(allowed)[np.argmax(values[allowed])])
        expected = values - np.log(np.exp(values - values.max()).sum()) - values.max()
        assert raw.shape == (32000,) and np.allclose(np.array(raw), expected, atol=1e-5)
        assert int(np.argmax(np.array(raw))) == top  # before the mask
        after = grammars.constraint(CHOICE)
        after.accept(token)
        assert np.array_equal(constraint.allowed(), after.allowed())  # the grammar took it

    def test_without_a_grammar_it_is_the_argmax(self):
        logits = logits_row(4)
        token, raw = first_token(logits, None, None)
        assert token == int(np.argmax(np.array(logits[0])))
        assert abs(float(mx.logsumexp(raw).item())) <= 1e-5
