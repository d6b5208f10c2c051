"""The decode batch with speculation: greedy outputs token for token the outputs without it,
and a cache that holds exactly the accepted tokens.

The mixed batch and its engines are ``tests/support/spec_runs``'s: a clock that never moves,
so every proposed draft is verified.
"""
from __future__ import annotations

import pytest
import workers  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
from mlx_lm.models.cache import KVCache

from tests.conftest import Clock
from tests.support.forged_models import tiny_model
from tests.support.spec_runs import copying_prompt, drive, engine, flat, prompt_of, requests
from workers.engine.decode import DecodeBatch
from workers.engine.engine import Engine, EngineConfig
from workers.messages import GenerateRequest, SamplingParams
from workers.model.model_dir import open_model_dir


@pytest.fixture(scope="module")
def spec_run():
    eng = engine(True)
    return drive(eng, requests(eng, "s"))


def multi_token_step(spec_run) -> tuple[int, int, int]:
    """(request index, token index, step size) of the first step that yielded 3+ tokens to
    one request, away from its first tokens."""
    steps, _ = spec_run
    for i in range(6):
        seen = 0
        for group in steps[f"s{i}"]:
            if len(group) >= 3 and seen >= 2:
                return i, seen, len(group)
            seen += len(group)
    raise AssertionError("no verify pass accepted two drafts")


class TestGreedyExact:
    def test_a_mixed_batch_gives_the_same_tokens_with_and_without_speculation(
            self, plain_run, spec_run):
        (plain_steps, plain), (spec_steps, spec) = plain_run, spec_run
        for i in range(6):
            p, s = plain[f"p{i}"], spec[f"s{i}"]
            assert s.output_tokens == p.output_tokens
            assert (s.text, s.finish_reason, s.written_tokens) == (p.text, p.finish_reason,
                                                                    p.written_tokens)
            assert flat(spec_steps[f"s{i}"]) == list(s.output_tokens)
            assert p.drafted_tokens == p.accepted_tokens == 0
            assert 0 <= s.accepted_tokens <= s.drafted_tokens
        # speculation did something: drafts were accepted, several tokens in one step
        assert sum(s.accepted_tokens for s in spec.values()) > 10
        assert max(len(g) for steps in spec_steps.values() for g in steps) >= 3
        assert sum(map(len, spec_steps.values())) < sum(map(len, plain_steps.values()))
        # the plain run yields one token a request a step
        assert {len(g) for steps in plain_steps.values() for g in steps} == {1}

    def test_a_stop_string_inside_an_accepted_draft(self, spec_run):
        i, at, _ = multi_token_step(spec_run)
        at += 1  # the second token of a pass that yielded 3 or more: an accepted draft
        stopper = Engine.open(tiny_model("llama"), EngineConfig())
        out = spec_run[1][f"s{i}"].output_tokens
        text_before = stopper.tokenizer.decode(list(out[:at + 1]))
        earlier = stopper.tokenizer.decode(list(out[:at]))
        # the shortest end of the text that first appears with token ``at``
        stop = next(text_before[-n:] for n in range(1, len(text_before) + 1)
                    if text_before[-n:] not in earlier)
        results = []
        for speculate in (False, True):
            eng = engine(speculate)
            steps, done = drive(eng, [GenerateRequest("x", eng.namespace("t"),
                                                      tuple(copying_prompt(i)),
                                                      SamplingParams(max_tokens=30 + 7 * i,
                                                                     stop=(stop,)))])
            results.append((steps["x"], done["x"]))
        (_, plain), (spec_steps, spec) = results
        assert spec.finish_reason == plain.finish_reason == "stop"
        assert (spec.output_tokens, spec.text) == (plain.output_tokens, plain.text)
        assert len(spec.output_tokens) == at + 1 and stop not in spec.text
        assert len(spec_steps[-1]) == 2  # the pass's later tokens were dropped with the stop
        assert spec.written_tokens == plain.written_tokens

    def test_max_tokens_reached_inside_a_draft(self, spec_run):
        i, at, size = multi_token_step(spec_run)
        limit = at + size // 2 + 1  # the pass accepted drafts beyond this token
        results = []
        for speculate in (False, True):
            eng = engine(speculate)
            (r,) = drive(eng, [GenerateRequest("m", eng.namespace("t"),
                                               tuple(copying_prompt(i)),
                                               SamplingParams(max_tokens=limit))])[1].values()
            results.append(r)
        plain, spec = results
        assert spec.output_tokens == plain.output_tokens == spec_run[1][f"s{i}"].output_tokens[:limit]
        assert spec.finish_reason == plain.finish_reason == "length"
        assert spec.written_tokens == plain.written_tokens

    def test_an_abort_between_verify_passes_leaves_the_others_unchanged(self, plain_run):
        eng = engine(True)
        steps, done = drive(eng, requests(eng, "a"), abort=("a2", 5))
        plain = plain_run[1]
        assert flat(steps["a2"]) == list(plain["p2"].output_tokens[:len(flat(steps["a2"]))])
        assert len(flat(steps["a2"])) >= 5 and "a2" not in done
        for i in (0, 1, 3, 4, 5):
            assert done[f"a{i}"].output_tokens == plain[f"p{i}"].output_tokens
        assert not eng.abort("a2")


class TestTheCacheHoldsTheAcceptedTokens:
    def test_exact_offsets_and_values_after_a_verify_pass(self):
        loaded = open_model_dir(tiny_model("llama"))
        model = loaded.model
        prompts = [prompt_of(12, seed=1), prompt_of(20, seed=2)]

        def prefilled(prompt):
            cache = [KVCache() for _ in range(loaded.kv_shape.layers)]
            logits = model(mx.array([prompt]), cache=cache)
            return cache, int(mx.argmax(logits[0, -1]).item())

        def greedy(prompt, n):
            cache, token = prefilled(prompt)
            out = [token]
            for _ in range(n):
                out.append(int(mx.argmax(model(mx.array([[out[-1]]]), cache=cache)[0, -1]).item()))
            return out

        batch = DecodeBatch(model)
        uids = []
        for p in prompts:
            cache, first = prefilled(p)
            uids.append(batch.insert(first, cache, p, None, None))
        truth = [greedy(p, 5) for p in prompts]
        # row 0 drafts its true next 3 tokens (all accepted); row 1 one right, then a wrong one
        wrong = (truth[1][2] + 1) % 32000
        steps = batch.step({uids[0]: truth[0][1:4], uids[1]: [truth[1][1], wrong]})
        assert [s.tokens for s in steps] == [tuple(truth[0][1:5]), tuple(truth[1][1:3])]
        assert [(s.drafted, s.accepted) for s in steps] == [(3, 3), (2, 1)]
        # row 0 holds its prompt, first token and 3 drafts; row 1 its prompt, first and 1
        layer = batch._cache[0]
        assert layer.offset.tolist() == [12 + 4, 20 + 2]
        assert layer.left_padding.tolist() == [6, 0]   # 8 of prompt length, less the 2 dropped
        assert layer._idx == 22
        for uid, p, t, held in ((uids[1], prompts[1], truth[1], 2), (uids[0], prompts[0], truth[0], 4)):
            cache, tokens = batch.remove(uid, unused=1)
            assert tokens == p + t[:held - 1] and cache[0].offset == len(p) + held - 1
            fresh = [KVCache() for _ in range(loaded.kv_shape.layers)]
            model(mx.array([tokens]), cache=fresh)
            for mine, ref in zip(cache, fresh):
                assert mine.keys.shape[2] == len(tokens)
                assert float(mx.abs(mine.keys - ref.keys[..., :len(tokens), :]).max()) <= 1e-5
                assert float(mx.abs(mine.values - ref.values[..., :len(tokens), :]).max()) <= 1e-5
        assert len(batch) == 0 and batch.step({}) == []

    def test_positions_moved_out_of_order_decode_exactly_and_leave_in_order(self):
        loaded = open_model_dir(tiny_model("llama"))
        model = loaded.model
        # row 2's prompt is one token: its first pass must cover more positions than it holds,
        # so that pass rolls; later passes copy rows' oldest positions over the rejected ones
        prompts = [prompt_of(12, seed=5), prompt_of(30, seed=6), prompt_of(1, seed=7)]

        def greedy(prompt, n):
            cache = [KVCache() for _ in range(loaded.kv_shape.layers)]
            out = [int(mx.argmax(model(mx.array([prompt]), cache=cache)[0, -1]).item())]
            for _ in range(n):
                out.append(int(mx.argmax(model(mx.array([[out[-1]]]), cache=cache)[0, -1]).item()))
            return out

        truth = [greedy(p, 24) for p in prompts]
        batch = DecodeBatch(model)
        uids = []
        for p, t in zip(prompts, truth):
            cache = [KVCache() for _ in range(loaded.kv_shape.layers)]
            model(mx.array([p]), cache=cache)
            uids.append(batch.insert(t[0], cache, p, None, None))
        made = [1, 1, 1]   # tokens each row has so far (its first)
        # each pass: how many of 4 true drafts each row gets before a wrong one
        for i, right in enumerate(((4, 3, 0), (1, 0, 2), (0, 4, 4), (2, 1, 3), (3, 2, 1))):
            drafts = {}
            for uid, t, n, k in zip(uids, truth, made, right):
                drafts[uid] = t[n:n + k] + [(t[n + k] + 1) % 32000] * (4 - k)
            steps = batch.step(drafts)
            for e, (step, t, k) in enumerate(zip(steps, truth, right)):
                assert step.tokens == tuple(t[made[e]:made[e] + k + 1]) and step.accepted == k
                made[e] += k + 1
            if i == 0:  # row 2 held 2 positions and dropped 4: the pass rolled, all in order
                assert [r.order is None for r in batch._rows] == [True, True, True]
        assert made == [16, 16, 16]
        assert [r.order is not None for r in batch._rows] == [True, True, True]
        for uid, p, t, n in zip(uids, prompts, truth, made):
            cache, tokens = batch.remove(uid)
            assert tokens == p + t[:n - 1]
            fresh = [KVCache() for _ in range(loaded.kv_shape.layers)]
            model(mx.array([tokens]), cache=fresh)
            for mine, ref in zip(cache, fresh):
                assert float(mx.abs(mine.keys - ref.keys[..., :len(tokens), :]).max()) <= 1e-5
                assert float(mx.abs(mine.values - ref.values[..., :len(tokens), :]).max()) <= 1e-5

    def test_rows_that_reject_alike_are_trimmed_without_a_roll(self):
        loaded = open_model_dir(tiny_model("llama"))
        batch = DecodeBatch(loaded.model)
        for n, seed in ((10, 3), (14, 4)):
            prompt = prompt_of(n, seed=seed)
            cache = [KVCache() for _ in range(loaded.kv_shape.layers)]
            loaded.model(mx.array([prompt[:-1]]), cache=cache)
            batch.insert(prompt[-1], cache, prompt[:-1], None, None)
        layer = batch._cache[0]
        before = (layer.offset.tolist(), layer.left_padding.tolist(), layer._idx)
        assert before == ([9, 13], [4, 0], 13)
        # both rows draft 3 tokens that no argmax of a random model gives (token 0)
        steps = batch.step({0: [0, 0, 0], 1: [0, 0, 0]})
        assert [(s.drafted, s.accepted, len(s.tokens)) for s in steps] == [(3, 0, 1), (3, 0, 1)]
        # each row holds one more token; the three rejected positions trimmed from both
        assert (layer.offset.tolist(), layer.left_padding.tolist(), layer._idx) == (
            [10, 14], [4, 0], 14)


PASSAGE = ("The orchard keeps a prefix store on every Mac. A router sends each prompt to the "
           "worker most likely to hold its cached prefix, and the worker reads the blocks it "
           "holds instead of computing them again.")


@pytest.mark.slow
def test_the_default_model_gives_the_same_tokens_with_and_without_speculation():
    from workers.model.default_model import ensure_default_model

    model_dir = ensure_default_model()
    asks = [f"Repeat this text exactly:\n\n{PASSAGE}",
            f"Correct the spelling, then repeat it:\n\n{PASSAGE.replace('prefix', 'prefx')}",
            "Name three fruits that grow in an orchard."]
    results = {}
    for speculate in (False, True):
        eng = Engine.open(model_dir, EngineConfig(block_size=16, speculate=speculate),
                          clock=Clock(), now_ns=lambda: 0)
        reqs = [GenerateRequest(f"d{i}", eng.namespace("t"),
                                tuple(eng.render_chat([{"role": "user", "content": ask}])),
                                SamplingParams(max_tokens=48))
                for i, ask in enumerate(asks)]
        results[speculate] = eng.generate(reqs)
    for plain, spec in zip(results[False], results[True]):
        assert spec.output_tokens == plain.output_tokens and spec.text == plain.text
    assert sum(r.accepted_tokens for r in results[True]) > 20  # the copies were drafted


class TestSampledAndConstrained:
    def test_sampled_requests_speculate_and_repeat_for_a_seed(self):
        runs = []
        for _ in range(2):
            eng = engine(True)
            reqs = requests(eng, "t", temperature=0.7, seed=11)
            runs.append(drive(eng, reqs)[1])
        first, again = runs
        assert all(first[k].output_tokens == again[k].output_tokens for k in first)
        assert sum(r.drafted_tokens for r in first.values()) > 0
        assert all(len(r.output_tokens) == 30 + 7 * int(k[1:]) or r.finish_reason == "stop"
                   for k, r in first.items())

    def test_a_constrained_row_never_drafts_and_its_neighbours_stay_exact(self, plain_run):
        import json

        import jsonschema

        from workers.messages import ResponseFormat

        schema = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}},
                  "required": ["kind"], "additionalProperties": False}
        eng = engine(True, max_batch=4)
        fmt = ResponseFormat("json_schema", json.dumps(schema), strict=True)
        free = requests(eng, "f")[:3]
        constrained = GenerateRequest("json", eng.namespace("t"), tuple(copying_prompt(0)),
                                      SamplingParams(max_tokens=40, response_format=fmt))
        _, done = drive(eng, [constrained, *free])
        assert done["json"].drafted_tokens == 0 and done["json"].finish_reason == "stop"
        jsonschema.validate(json.loads(done["json"].text), schema)
        for i in range(3):
            assert done[f"f{i}"].output_tokens == plain_run[1][f"p{i}"].output_tokens
        assert sum(done[f"f{i}"].accepted_tokens for i in range(3)) > 0
