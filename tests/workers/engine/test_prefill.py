"""Prompts in prefill (``workers.engine.prefill``) through a real engine: a prompt prefilled in
chunks gives the tokens and log-probabilities of one prefilled whole, with its first token at
the step whose chunk reaches its end; and the last token run inside its chunk (through the
vocabulary projection of the body) or on its own (the whole model) gives the same tokens.
``run_chunks`` on the body alone: which chunks share a pass, each job's hidden state and cache
as if it had run alone."""
from __future__ import annotations

import dataclasses

import pytest

import workers  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
from mlx_lm.models.cache import KVCache

from router.kv.key import Namespace
from tests.conftest import Clock
from tests.support.engine_requests import prompt_of, req
from tests.support.forged_models import tiny_model
from workers.engine.engine import Engine, EngineConfig
from workers.engine.prefill import PrefillJob, _packs, run_chunks
from workers.messages import GenerateRequest, SamplingParams
from workers.model.model_dir import open_model_dir

BS = 16
NS = Namespace("t", "llama")


class TestChunkedPrefill:
    def test_chunked_prefill_gives_the_same_tokens_and_logprobs(self):
        whole = Engine.open(tiny_model("llama"), EngineConfig(block_size=BS, use_store=False))
        chunked = Engine.open(tiny_model("llama"), EngineConfig(block_size=BS, use_store=False,
                                                                prefill_budget=16))
        prompt = prompt_of(100, seed=60)
        runs = []
        for eng in (whole, chunked):
            eng.submit(req(eng, prompt, max_tokens=8))
            steps, deltas = [], []
            while eng.busy:
                out = eng.step()
                steps.append(len(out.deltas))
                deltas += out.deltas
            assert len(deltas) == 8
            runs.append(deltas)
        assert [d.token for d in runs[0]] == [d.token for d in runs[1]]
        assert float(abs(runs[0][0].logprobs - runs[1][0].logprobs).max()) <= 1e-5
        # 100 tokens in chunks of 16: the 7th step runs the last 4 and gives the first token
        assert steps[:7] == [0, 0, 0, 0, 0, 0, 1]


    @pytest.mark.parametrize("budget", [512, 16])
    def test_a_last_token_in_the_chunk_and_one_on_its_own_give_the_same_tokens(self, budget):
        loaded = open_model_dir(tiny_model("llama"))
        apart = dataclasses.replace(loaded, config={**loaded.config, "model_type": "gemma3"})
        config = EngineConfig(block_size=BS, prefill_budget=budget)
        runs = []
        for model in (loaded, apart):
            eng = Engine(model, config, Clock(), lambda: 0)
            eng.submit(req(eng, prompt_of(100, seed=71), max_tokens=6))
            deltas = []
            while eng.busy:
                deltas += eng.step().deltas
            runs.append(deltas)
        assert [d.token for d in runs[0]] == [d.token for d in runs[1]]
        assert len(runs[0]) == 6
        assert float(abs(runs[0][0].logprobs - runs[1][0].logprobs).max()) <= 1e-5


@pytest.fixture(scope="module")
def loaded():
    return open_model_dir(tiny_model("llama"))


def job(loaded, rid: str, prompt: list[int]) -> PrefillJob:
    request = GenerateRequest(rid, NS, tuple(prompt), SamplingParams(max_tokens=4))
    return PrefillJob(request, 0, list(prompt), None, None,
                      cache=[KVCache() for _ in range(loaded.kv_shape.layers)])


def alone(loaded, prompt: list[int]) -> mx.array:
    """The body's hidden state of ``prompt``'s last token, in one pass of its own."""
    cache = [KVCache() for _ in range(loaded.kv_shape.layers)]
    return loaded.body(mx.array([prompt]), cache=cache)[:, -1:, :]


class TestPacks:
    def test_a_chunk_joins_a_pass_it_fills_at_least_three_quarters_of(self):
        a, b, c, d = (PrefillJob(None, 0, [], None, None) for _ in range(4))
        # widest first: 12 is exactly 3/4 of 16 and joins it; 11 opens a pass; 9 fills 3/4+ of 11
        assert _packs([(c, 11), (a, 16), (d, 9), (b, 12)]) == [[(a, 16), (b, 12)],
                                                                [(c, 11), (d, 9)]]
        assert _packs([(a, 8), (b, 5)]) == [[(a, 8)], [(b, 5)]]


class TestRunChunks:
    def test_stacked_chunks_give_each_job_its_own_hidden_state_and_cache(self, loaded):
        prompts = {"a": prompt_of(36, seed=80), "b": prompt_of(34, seed=81),
                   "c": prompt_of(13, seed=82), "d": prompt_of(20, seed=83)}
        jobs = {rid: job(loaded, rid, p) for rid, p in prompts.items()}
        a, b, c, d = jobs.values()
        # one pass for a, b and c at offset 0 (c: its whole prompt); d gets nothing
        first = run_chunks(loaded.body, [(a, 16), (b, 16), (c, 13), (d, 0)])
        assert list(first) == ["c"]
        assert float(mx.abs(first["c"] - alone(loaded, prompts["c"])).max()) <= 1e-4
        assert [j.done for j in jobs.values()] == [16, 16, 13, 0]
        assert [j.cache[0].offset if j.cache[0].keys is not None else 0
                for j in jobs.values()] == [16, 16, 13, 0]
        # a and b again at offset 16, both to their prompt's end, stacked (18 >= 3/4 of 20)
        last = run_chunks(loaded.body, [(a, 20), (b, 18)])
        assert sorted(last) == ["a", "b"] and (a.done, b.done) == (36, 34)
        assert [a.cache[0].offset, b.cache[0].offset] == [36, 34]
        for rid in "ab":
            assert last[rid].shape == (1, 1, 64)
            assert float(mx.abs(last[rid] - alone(loaded, prompts[rid])).max()) <= 1e-4, rid

    def test_a_chunk_that_stops_short_of_the_end_gives_no_hidden_state(self, loaded):
        prompt = prompt_of(30, seed=84)
        short = job(loaded, "s", prompt)
        assert run_chunks(loaded.body, [(short, 29)]) == {}
        assert (short.done, short.need) == (29, 1)
        last = run_chunks(loaded.body, [(short, 1)])
        assert float(mx.abs(last["s"] - alone(loaded, prompt)).max()) <= 1e-4
