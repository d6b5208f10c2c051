"""A draft model's batched drafts: greedy outputs token for token the outputs without it,
the draft's cache in step with the target's, and drafts refused from another tokenizer.

The mixed batch is ``tests/support/spec_runs``'s (six requests, three at a time, joining and
leaving while the others draft; a clock that never moves, so every draft is verified). The
drafts: the target itself (every draft accepted), the target's weights moved by noise
(``near_draft``: some accepted, some not) and a smaller forged model with the same tokenizer
(``tiny_draft``).
"""
from __future__ import annotations

import json
import shutil

import pytest
import workers  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
from mlx_lm.models.cache import KVCache

from tests.conftest import Clock
from tests.support.bounded import run_bounded
from tests.support.engine_waits import answer, closed
from tests.support.forged_models import near_draft, tiny_draft, tiny_model
from tests.support.spec_runs import drive, engine, flat, prompt_of, requests
from workers.engine.draft_model import DraftModel
from workers.engine.engine import Engine, EngineConfig
from workers.engine.runtime import EngineRuntime
from workers.messages import GenerateRequest, SamplingParams
from workers.model.model_dir import open_model_dir

DRAFTS = {"itself": lambda: tiny_model("llama"), "near": near_draft, "smaller": tiny_draft}


@pytest.fixture(scope="module")
def runs():
    """The mixed batch with each of ``DRAFTS``, run once for the module."""
    done = {}

    def run(name: str):
        if name not in done:
            eng = engine(True, draft_model=str(DRAFTS[name]()))
            done[name] = eng, drive(eng, requests(eng, "d"))
        return done[name]
    return run


class TestGreedyExact:
    @pytest.mark.parametrize("name", sorted(DRAFTS))
    def test_the_same_tokens_with_and_without_the_draft(self, plain_run, runs, name):
        eng, (steps, done) = runs(name)
        plain = plain_run[1]
        for i in range(6):
            p, d = plain[f"p{i}"], done[f"d{i}"]
            assert d.output_tokens == p.output_tokens
            assert (d.text, d.finish_reason, d.written_tokens) == (p.text, p.finish_reason,
                                                                    p.written_tokens)
            assert flat(steps[f"d{i}"]) == list(d.output_tokens)
            assert 0 <= d.accepted_tokens <= d.drafted_tokens
        stats = eng.spec_stats()
        assert stats.drafted == sum(r.drafted_tokens for r in done.values()) > 0
        assert stats.accepted == sum(r.accepted_tokens for r in done.values())

    def test_the_target_as_its_own_draft_has_every_draft_accepted(self, runs):
        eng, (steps, done) = runs("itself")
        stats = eng.spec_stats()
        assert stats.drafted > 100 and stats.accepted / stats.drafted == 1.0
        assert all(r.accepted_tokens == r.drafted_tokens > 0 for r in done.values())
        # every draft accepted: the widest passes give 9 tokens (the default 8 drafts and one
        # more)
        assert max(len(g) for s in steps.values() for g in s) == 9

    def test_a_near_draft_is_accepted_in_part(self, runs):
        eng, (steps, done) = runs("near")
        stats = eng.spec_stats()
        assert 0 < stats.accepted < stats.drafted
        assert max(len(g) for s in steps.values() for g in s) >= 3

    def test_an_abort_mid_draft_leaves_the_others_unchanged(self, plain_run):
        eng = engine(True, draft_model=str(near_draft()))
        steps, done = drive(eng, requests(eng, "a"), abort=("a2", 5))
        plain = plain_run[1]
        assert flat(steps["a2"]) == list(plain["p2"].output_tokens[:len(flat(steps["a2"]))])
        assert "a2" not in done
        for i in (0, 1, 3, 4, 5):
            assert done[f"a{i}"].output_tokens == plain[f"p{i}"].output_tokens


    def test_a_constrained_row_never_drafts_and_its_neighbours_stay_exact(self, plain_run):
        from workers.messages import ResponseFormat

        schema = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}},
                  "required": ["kind"], "additionalProperties": False}
        eng = engine(True, max_batch=4, draft_model=str(tiny_model("llama")))
        fmt = ResponseFormat("json_schema", json.dumps(schema), strict=True)
        constrained = GenerateRequest("json", eng.namespace("t"), tuple(prompt_of(30, seed=9)),
                                      SamplingParams(max_tokens=40, response_format=fmt))
        _, done = drive(eng, [constrained, *requests(eng, "f")[:3]])
        assert done["json"].drafted_tokens == 0 and done["json"].finish_reason == "stop"
        assert json.loads(done["json"].text)["kind"] in ("cat", "dog")
        for i in range(3):
            assert done[f"f{i}"].output_tokens == plain_run[1][f"p{i}"].output_tokens
            assert done[f"f{i}"].accepted_tokens == done[f"f{i}"].drafted_tokens > 0


class TestSampled:
    def test_sampled_requests_repeat_for_a_seed(self):
        runs = []
        for _ in range(2):
            eng = engine(True, draft_model=str(near_draft()))
            runs.append(drive(eng, requests(eng, "s", temperature=0.7, seed=11))[1])
        first, again = runs
        assert all(first[k].output_tokens == again[k].output_tokens for k in first)
        assert sum(r.drafted_tokens for r in first.values()) > 0
        assert all(len(r.output_tokens) == 30 + 7 * int(k[1:]) or r.finish_reason == "stop"
                   for k, r in first.items())

    def test_a_nearly_greedy_temperature_keeps_the_targets_own_drafts(self, plain_run):
        # at temperature 1e-4 the target's distribution is all on its argmax: the rejection
        # rule keeps each certain draft (its probability is 1) and draws the argmax after
        eng = engine(True, draft_model=str(tiny_model("llama")))
        _, done = drive(eng, requests(eng, "n", temperature=1e-4, seed=3))
        for i in range(6):
            assert done[f"n{i}"].output_tokens == plain_run[1][f"p{i}"].output_tokens
            assert done[f"n{i}"].accepted_tokens == done[f"n{i}"].drafted_tokens > 0


def greedy(loaded, tokens: list[int], n: int) -> list[int]:
    """``n`` greedy tokens of ``loaded`` after ``tokens``, one row, one token a pass."""
    cache = [KVCache() for _ in range(loaded.kv_shape.layers)]
    logits = loaded.model(mx.array([tokens]), cache=cache)
    out = [int(mx.argmax(logits[0, -1]).item())]
    while len(out) < n:
        out.append(int(mx.argmax(loaded.model(mx.array([out[-1:]]), cache=cache)[0, -1]).item()))
    return out


class TestTheDraftsCache:
    def test_exact_offsets_and_values_after_rejections_joins_and_leaves(self):
        draft = DraftModel(open_model_dir(tiny_draft()))
        loaded = draft._m
        prompts = {0: prompt_of(12, seed=1), 1: prompt_of(20, seed=2), 2: prompt_of(7, seed=3)}
        for uid, p in prompts.items():
            draft.join(uid, p, first=100 + uid)
        # three passes over the batch; each row's drafts are its own greedy continuation
        drafts = draft.propose({0: 3, 1: 3, 2: 2})
        for uid, p in prompts.items():
            assert drafts[uid] == greedy(loaded, p + [100 + uid], 3)[:3 if uid < 2 else 2]
        assert draft._cache[0].offset.tolist() == [12 + 3, 20 + 3, 7 + 3]
        # row 0 accepted all 3 (its third draft was never fed: it is pending with the next
        # token); row 1 accepted 1 (1 fed draft rejected); row 2 leaves; row 3 joins
        history = {0: prompts[0] + [100, *drafts[0], 7], 1: prompts[1] + [101, drafts[1][0], 8]}
        draft.verified(0, 3, [*drafts[0], 7])
        draft.verified(1, 1, [drafts[1][0], 8])
        draft.leave(2)
        prompts[3] = prompt_of(30, seed=4)
        draft.join(3, prompts[3], first=103)
        history[3] = prompts[3] + [103]
        second = draft.propose({0: 2, 1: 2, 3: 2})
        for uid, h in history.items():
            assert second[uid] == greedy(loaded, h, 2)
        # each row holds its history and its first draft (the second never fed), in some order
        # (rejected positions are covered by copies of a row's oldest: attention ignores order)
        layer = draft._cache[0]
        assert layer.offset.tolist() == [len(history[u]) + 1 for u in (0, 1, 3)] == [
            12 + 6, 20 + 4, 30 + 2]
        for e, uid in enumerate((0, 1, 3)):
            held = history[uid] + second[uid][:1]
            fresh = [KVCache() for _ in range(loaded.kv_shape.layers)]
            loaded.body(mx.array([held]), cache=fresh)
            for batch, ref in zip(draft._cache, fresh):
                mine = batch.extract(e)
                assert mine.keys.shape[2] == len(held)
                order = same_positions(mine.keys, ref.keys[..., :len(held), :])
                values = mine.values[..., mx.array(order), :]
                assert float(mx.abs(values - ref.values[..., :len(held), :]).max()) <= 1e-5

    def test_a_step_without_drafts_is_caught_up_by_the_next_proposal(self):
        draft = DraftModel(open_model_dir(tiny_draft()))
        p = prompt_of(10, seed=5)
        draft.join(0, p, first=50)
        draft.verified(0, 0, [51])  # a plain step: the draft model did not run
        draft.verified(0, 0, [52])
        assert draft.propose({0: 0}) == {}
        assert draft.propose({0: 2}) == {0: greedy(draft._m, p + [50, 51, 52], 2)}
        assert draft._cache[0].offset.tolist() == [10 + 3 + 1]


def same_positions(mine: mx.array, ref: mx.array) -> list[int]:
    """Where each of ``ref``'s positions is among ``mine``'s (asserted: a permutation, every
    position within 1e-5)."""
    a, b = mine[0].transpose(1, 0, 2), ref[0].transpose(1, 0, 2)   # positions, heads, dims
    gap = mx.abs(a[:, None] - b[None]).max(axis=(2, 3))             # mine x ref
    order = mx.argmin(gap, axis=0).tolist()
    assert sorted(order) == list(range(a.shape[0]))
    assert float(gap.min(axis=0).max()) <= 1e-5
    return order


class TestRefused:
    def test_another_tokenizer_is_refused_naming_both_models(self, tmp_path):
        other = tmp_path / "other-tokenizer"
        shutil.copytree(tiny_draft(), other)
        spec = json.loads((other / "tokenizer.json").read_text())
        vocab = spec["model"]["vocab"]
        vocab["▁of"], vocab["el"] = vocab["el"], vocab["▁of"]
        (other / "tokenizer.json").write_text(json.dumps(spec))
        target = tiny_model("llama")
        with pytest.raises(ValueError) as refused:
            Engine.open(target, EngineConfig(speculate=True, draft_model=str(other)))
        message = str(refused.value)
        assert str(other.resolve()) in message and repr(target.name) in message
        assert "different tokenizers" in message and "'el'" in message

    def test_another_vocabulary_size_is_refused(self):
        draft = tiny_draft(vocab_size=32064)
        with pytest.raises(ValueError, match=r"different vocabulary sizes \(32064 and 32000\)"):
            Engine.open(tiny_model("llama"), EngineConfig(speculate=True, draft_model=str(draft)))

    def test_a_draft_model_needs_speculation_on(self):
        with pytest.raises(ValueError, match="needs speculate = true"):
            Engine.open(tiny_model("llama"), EngineConfig(draft_model=str(tiny_draft())))

    def test_a_worker_with_a_refused_draft_fails_to_start_and_the_runtime_goes_on(self):
        async def scenario():
            runtime = EngineRuntime(lambda batch: None)
            target = str(tiny_model("llama"))
            bad = EngineConfig(speculate=True, draft_model=str(tiny_draft(vocab_size=32064)))
            with pytest.raises(ValueError, match="different vocabulary sizes"):
                await answer(runtime, runtime.open("w0", target, bad), "open w0")
            good = EngineConfig(speculate=True, draft_model=str(tiny_draft()))
            engine = await answer(runtime, runtime.open("w1", target, good), "open w1")
            assert engine.spec_stats() is not None
            await closed(runtime)
        run_bounded(scenario(), 60, "a refused draft at start-up")


@pytest.mark.slow
def test_the_default_model_as_its_own_draft_has_every_draft_accepted():
    from workers.model.default_model import ensure_default_model

    model_dir = ensure_default_model()
    asks = ["Name three fruits that grow in an orchard.",
            "Repeat this exactly: the router sends each prompt to the worker that holds it."]
    results = {}
    for draft in ("", str(model_dir)):
        eng = Engine.open(model_dir, EngineConfig(speculate=bool(draft), draft_model=draft),
                          clock=Clock(), now_ns=lambda: 0)
        reqs = [GenerateRequest(f"d{i}", eng.namespace("t"),
                                tuple(eng.render_chat([{"role": "user", "content": ask}])),
                                SamplingParams(max_tokens=32))
                for i, ask in enumerate(asks)]
        results[draft] = eng.generate(reqs)
    for plain, spec in zip(results[""], results[str(model_dir)]):
        assert spec.output_tokens == plain.output_tokens and spec.text == plain.text
        assert spec.accepted_tokens == spec.drafted_tokens > 0
