"""The engine's running requests (``workers.engine.running.Running``) on a tiny real model:
each row decodes the model's greedy tokens into its ``Sequence`` and leaves, when its request
finishes, with a cache holding exactly the tokens fed to it; an abort takes one row out; a
step charges the step budget with its whole time. The clock is the one ``Running`` is handed:
it moves one second at each reading."""
from __future__ import annotations

import pytest

import workers  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
from mlx_lm.models.cache import KVCache

from router.kv.key import Namespace
from tests.support.engine_requests import prompt_of
from tests.support.forged_models import tiny_model
from workers.engine.running import Running, _through_end
from workers.engine.scheduler import StepBudget
from workers.engine.sequence import Sequence
from workers.messages import GenerateRequest, LookupOutcome, LookupReport, SamplingParams
from workers.model.model_dir import LoadedModel, open_model_dir

NS = Namespace("t", "llama")


class Ticks:
    """A nanosecond clock that moves one second each time it is read."""

    def __init__(self) -> None:
        self.reads = 0

    def __call__(self) -> int:
        self.reads += 1
        return self.reads * 1_000_000_000


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return open_model_dir(tiny_model("llama"))


def greedy(loaded: LoadedModel, prompt: list[int], n: int) -> list[int]:
    """The model's first ``n`` greedy tokens after ``prompt``, one pass a token, alone."""
    cache = [KVCache() for _ in range(loaded.kv_shape.layers)]
    tokens, feed = [], prompt
    for _ in range(n):
        logits = loaded.model(mx.array([feed]), cache=cache)
        feed = [int(mx.argmax(logits[0, -1]).item())]
        tokens += feed
    return tokens


def joined(running: Running, loaded: LoadedModel, rid: str, prompt: list[int],
           max_tokens: int, eos: set[int] = frozenset()) -> Sequence:
    """A prefilled request in the batch, its first token taken, as the engine joins one."""
    request = GenerateRequest(rid, NS, tuple(prompt), SamplingParams(max_tokens=max_tokens))
    report = LookupReport(LookupOutcome.MISS, len(prompt), 0, 0, None, None, None, 300.0)
    seq = Sequence(request, report, 0, 0, 0, 0, detokenizer=loaded.tokenizer.detokenizer)
    cache = [KVCache() for _ in range(loaded.kv_shape.layers)]
    logits = loaded.model(mx.array([prompt]), cache=cache)
    raw = logits[0, -1:] - mx.logsumexp(logits[0, -1:], axis=-1, keepdims=True)
    first = int(mx.argmax(raw).item())
    seq.delta(first, 0, set(eos), raw[0])
    running.join(seq, first, cache, prompt, None, None)
    return seq


def running_on(loaded: LoadedModel, eos: set[int] = frozenset(),
               budget: StepBudget | None = None, clock: Ticks | None = None) -> Running:
    return Running(loaded.model, None, budget or StepBudget(), set(eos), clock or Ticks())


class TestRowsDecodeAndLeave:
    def test_each_row_takes_the_greedy_tokens_and_leaves_at_max_tokens_with_its_cache(
            self, loaded):
        running = running_on(loaded)
        prompts = {"a": prompt_of(12, seed=1), "b": prompt_of(20, seed=2)}
        seqs = {"a": joined(running, loaded, "a", prompts["a"], 4),
                "b": joined(running, loaded, "b", prompts["b"], 6)}
        per_step, left = [], []
        while len(running):
            deltas = []
            left.append([f.seq.request.request_id for f in running.step(deltas)])
            per_step.append([d.request_id for d in deltas])
        assert per_step == [["a", "b"]] * 3 + [["b"]] * 2
        assert left == [[], [], ["a"], [], ["b"]]
        for rid, n in (("a", 4), ("b", 6)):
            assert seqs[rid].tokens == greedy(loaded, prompts[rid], n)
            assert seqs[rid].finish_reason == "length"

    def test_a_finished_rows_cache_holds_its_prompt_and_every_token_but_the_last(self, loaded):
        running = running_on(loaded)
        prompt = prompt_of(12, seed=3)
        seq = joined(running, loaded, "a", prompt, 3)
        joined(running, loaded, "b", prompt_of(20, seed=4), 8)
        finished = running.step([]) + running.step([])
        assert [f.seq for f in finished] == [seq]
        (done,) = finished
        assert done.tokens == prompt + seq.tokens[:2]
        assert [c.offset for c in done.cache] == [len(prompt) + 2] * loaded.kv_shape.layers
        assert len(running) == 1

    def test_an_end_token_finishes_a_row_as_stop_with_only_what_was_fed_cached(self, loaded):
        prompt = prompt_of(12, seed=5)
        first, second = greedy(loaded, prompt, 2)
        assert first != second
        running = running_on(loaded, eos={second})
        seq = joined(running, loaded, "a", prompt, 10, eos={second})
        deltas = []
        (done,) = running.step(deltas)
        assert [d.token for d in deltas] == [second]
        assert (seq.finish_reason, seq.tokens, seq.emitted) == ("stop", [first], 2)
        assert done.tokens == prompt + [first] and done.cache[0].offset == len(prompt) + 1
        assert len(running) == 0


class TestAbort:
    def test_an_abort_takes_out_its_row_alone(self, loaded):
        running = running_on(loaded)
        joined(running, loaded, "a", prompt_of(12, seed=6), 8)
        b = joined(running, loaded, "b", prompt_of(20, seed=7), 3)
        assert running.abort("a") is True
        assert [s.request.request_id for s in running] == ["b"] and len(running) == 1
        assert running.abort("a") is False and running.abort("nobody") is False
        deltas = []
        running.step(deltas)
        assert [d.request_id for d in deltas] == ["b"]
        assert b.tokens == greedy(loaded, list(b.request.prompt), 2)


class TestTheStepsTime:
    def test_the_budget_is_charged_from_before_drafting_to_after_the_batch_step(self, loaded):
        budget = StepBudget(max_tokens=512, stall=2.0, min_tokens=1)
        budget.observe_prefill(10, 1.0, decoding=True)  # 10 tokens/s beside decodes
        clock = Ticks()
        running = running_on(loaded, budget=budget, clock=clock)
        seq = joined(running, loaded, "a", prompt_of(12, seed=8), 8)
        running.step([])
        # readings: 1 before drafting, 2 after it, 3 after the batch step, 4 charged: a decode
        # step of 4 - 1 = 3 s, so a step beside it fits (2.0 - 1) x 3 s x 10 tokens/s
        assert budget.tokens(decoding=True) == 30
        assert seq.last_token_ns == 5_000_000_000  # the token's reading, after the charge
        assert running.spec_stats() is None  # no speculation: nothing drafted


class TestDraftsThroughTheEnd:
    def test_a_draft_is_cut_after_its_first_end_token(self):
        assert _through_end([5, 2, 7, 2], {2, 9}) == [5, 2]
        assert _through_end([9], {2, 9}) == [9]

    def test_a_draft_without_an_end_token_is_whole(self):
        assert _through_end([5, 6, 7], {2}) == [5, 6, 7]
        assert _through_end([], {2}) == []
