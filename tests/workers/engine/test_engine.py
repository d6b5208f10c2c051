"""The engine: reuse with exact counts, continuous batching, sampling, stops, bad input,
abort, the step budget and priority. Structured outputs and log-probabilities:
``test_constrained.py``; chunked prefill: ``test_prefill.py``; chat turns: ``test_chat.py``;
model directories: ``tests/workers/model/test_model_dir.py``."""
from __future__ import annotations

import dataclasses

import pytest

from router.kv.key import Namespace
from tests.conftest import Clock
from tests.support.engine_requests import prompt_of, req, run_one
from tests.support.forged_models import tiny_model
from workers.engine.engine import Engine, EngineConfig, RequestFailed
from workers.messages import GenerateRequest, GenerateResult, LookupOutcome, SamplingParams


BS = 16

@pytest.fixture
def engine() -> Engine:
    """A fresh engine per test: every test writes to its store."""
    return Engine.open(tiny_model("llama"), EngineConfig(block_size=BS))

def _drive(eng: Engine, requests, abort: tuple[str, int] | None = None
           ) -> tuple[dict[str, list[int]], dict[str, GenerateResult]]:
    """Step ``requests`` to completion; ``abort=(id, n)`` aborts ``id`` once it has n tokens."""
    for r in requests:
        eng.submit(r)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    finished: dict[str, GenerateResult] = {}
    while eng.busy:
        if abort and len(tokens[abort[0]]) == abort[1]:
            assert eng.abort(abort[0]) is True
            abort = None
        out = eng.step()
        for d in out.deltas:
            tokens[d.request_id].append(d.token)
        finished.update({f.request_id: f for f in out.finished})
    return tokens, finished


class TestBehaviour:
    def test_second_request_reuses_the_prefix_and_gives_the_same_tokens(self, engine):
        prompt = prompt_of(110, seed=1)
        cold = run_one(engine, req(engine, prompt))
        assert (cold.input_tokens, cold.cached_tokens, cold.computed_tokens) == (110, 0, 110)
        assert cold.lookup.outcome == LookupOutcome.MISS
        # prefill wrote 6 blocks (110 tokens in the cache); the finish, with 110 + 5 output tokens
        # in the cache, added the 7th block that the output completed
        assert cold.written_tokens == 112
        warm = run_one(engine, req(engine, prompt))
        assert warm.lookup.outcome == LookupOutcome.HIT
        # the store matches 6 blocks; the kept cache of the first request gives the partial 7th
        # block up to the prompt's last token, which is always computed
        assert (warm.lookup.matched_tokens, warm.lookup.kept_tokens) == (96, 13)
        assert (warm.cached_tokens, warm.computed_tokens, warm.written_tokens) == (109, 1, 0)
        assert warm.output_tokens == cold.output_tokens
        assert warm.finish_reason == "length" and len(warm.output_tokens) == 6
        assert warm.ttft_s > 0 and warm.tpot_s > 0
        t = warm.timings
        assert t.received_ns <= t.lookup_start_ns <= t.lookup_end_ns <= t.prefill_start_ns
        assert t.prefill_start_ns <= t.first_token_ns <= t.finished_ns

    def test_uncached_engine_agrees(self, engine):
        plain = Engine.open(tiny_model("llama"), EngineConfig(block_size=BS, use_store=False))
        prompt = prompt_of(70, seed=2)
        run_one(engine, req(engine, prompt))
        a = run_one(engine, req(engine, prompt + [5, 6, 7]))
        b = run_one(plain, req(plain, prompt + [5, 6, 7]))
        # the store's 4 blocks and, from the first request's kept cache, the rest of its prompt
        assert (a.lookup.matched_tokens, a.cached_tokens, b.cached_tokens) == (64, 70, 0)
        assert a.output_tokens == b.output_tokens

    def test_requests_decode_concurrently(self, engine):
        requests = [req(engine, prompt_of(30 + 7 * i, seed=10 + i), max_tokens=8) for i in range(3)]
        for r in requests:
            engine.submit(r)
        together = 0
        finished = {}
        while engine.busy:
            out = engine.step()
            together = max(together, len({d.request_id for d in out.deltas}))
            finished.update({f.request_id: f for f in out.finished})
        assert together == 3
        assert all(len(finished[r.request_id].output_tokens) == 8 for r in requests)

    def test_seeded_sampling_is_reproducible(self, engine):
        prompt = prompt_of(20, seed=3)
        a = run_one(engine, req(engine, prompt, 12, temperature=1.0, seed=7))
        b = run_one(engine, req(engine, prompt, 12, temperature=1.0, seed=7))
        c = run_one(engine, req(engine, prompt, 12, temperature=1.0, seed=8))
        assert a.output_tokens == b.output_tokens != c.output_tokens

    def test_stop_string_ends_generation(self, engine):
        prompt = prompt_of(25, seed=4)
        full = run_one(engine, req(engine, prompt, 12, temperature=1.0, seed=1))
        stop = full.text[len(full.text) // 2:][:3]
        assert stop.strip(), full.text
        cut = run_one(engine, req(engine, prompt, 12, temperature=1.0, seed=1,
                                  stop=("never in it", stop)))
        assert cut.finish_reason == "stop"
        assert stop not in cut.text and full.text.startswith(cut.text)
        assert len(cut.output_tokens) < 12
        assert cut.extra == {"stop": stop}  # the stop string that cut it
        assert full.extra == {}

    def test_tenants_do_not_share(self, engine):
        prompt = prompt_of(50, seed=5)
        run_one(engine, req(engine, prompt, tenant="a"))
        other = run_one(engine, req(engine, prompt, tenant="b"))
        assert other.cached_tokens == 0 and other.lookup.outcome == LookupOutcome.MISS

    def test_bad_requests_fail_alone(self, engine):
        good = req(engine, prompt_of(10, seed=6))
        bad = [
            (req(engine, []), "prompt is empty"),
            (req(engine, [1, 32000]), "outside the vocabulary"),
            (req(engine, [-1]), "outside the vocabulary"),
            (req(engine, [1, 2], max_tokens=0), "max_tokens must be >= 1"),
            (req(engine, prompt_of(2000, seed=7), max_tokens=100), "exceeds the model's context"),
            (GenerateRequest("ns", "tenant", (1, 2), SamplingParams(4)), "Namespace"),
            (req(engine, [1, 2], temperature=-1.0), "temperature"),
        ]
        results = engine.generate([b for b, _ in bad[:3]] + [good] + [b for b, _ in bad[3:]])
        failures = [r for r in results if isinstance(r, RequestFailed)]
        assert len(failures) == len(bad)
        for failure, (_, message) in zip(failures, [m for m in bad]):
            assert message in failure.error
        assert isinstance(results[3], GenerateResult) and len(results[3].output_tokens) == 6
        assert engine.invalidate(Namespace("nobody", "m")) == 0   # held nothing: nothing dropped

    def test_ttl_events_and_invalidation_through_the_engine(self):
        clock = Clock()
        eng = Engine.open(tiny_model("llama"), EngineConfig(block_size=BS, ttl_s=30), clock=clock)
        prompt = prompt_of(40, seed=9)
        first = run_one(eng, req(eng, prompt))
        events = eng.drain_events()
        assert len(events) == first.written_tokens // BS
        assert {h.block for h in eng.holdings()} == {e.block for e in events}
        clock.now = 20
        again = run_one(eng, req(eng, prompt))  # 2 blocks, and the kept tail up to the last token
        assert (again.lookup.matched_tokens, again.cached_tokens) == (32, 39)
        clock.now = 55  # 35 s after the last use
        expired = run_one(eng, req(eng, prompt))
        assert expired.cached_tokens == 0 and expired.lookup.outcome == LookupOutcome.MISS
        assert eng.store_stats().ledger.expirations == len(events)
        near = run_one(eng, req(eng, prompt[:20] + [7] + prompt[21:]))
        assert near.lookup.outcome == LookupOutcome.NEAR_MISS
        # the store's first block, and the kept cache up to where the prompts part
        assert near.lookup.line() == "common=20 of 40" and near.lookup.matched_tokens == 16
        assert near.cached_tokens == 20
        # the prefix's block and both children below it: the prompt's own and the near miss's
        assert eng.invalidate(eng.namespace("t"), prompt[:16]) == 3
        assert run_one(eng, req(eng, prompt)).cached_tokens == 0

    def test_more_requests_than_the_batch_holds_all_finish_with_the_same_tokens(self):
        small = Engine.open(tiny_model("llama"), EngineConfig(block_size=BS, max_batch=2))
        shared = prompt_of(48, seed=12)
        prompts = [shared + prompt_of(3 + 5 * i, seed=20 + i) for i in range(5)]
        alone = [run_one(small, req(small, p, max_tokens=4 + i)).output_tokens
                 for i, p in enumerate(prompts)]
        small.invalidate(small.namespace("t"))
        results = small.generate([req(small, p, max_tokens=4 + i) for i, p in enumerate(prompts)])
        assert [r.output_tokens for r in results] == alone
        assert [len(r.output_tokens) for r in results] == [4, 5, 6, 7, 8]
        # the first computes the shared 48 tokens (3 blocks); each sibling reuses all three
        assert [r.cached_tokens for r in results] == [0, 48, 48, 48, 48]

    def test_abort_stops_a_running_request_and_leaves_the_others_unchanged(self):
        eng = Engine.open(tiny_model("llama"), EngineConfig(block_size=BS, use_store=False))
        prompts = [prompt_of(30 + 9 * i, seed=40 + i) for i in range(3)]

        def batch(tag: str):
            return [GenerateRequest(f"{tag}{i}", eng.namespace("t"), tuple(p), SamplingParams(12))
                    for i, p in enumerate(prompts)]

        alone, _ = _drive(eng, batch("a"))
        tokens, finished = _drive(eng, batch("b"), abort=("b1", 4))
        assert tokens["b1"] == alone["a1"][:4]  # nothing after the step before the abort
        assert tokens["b0"] == alone["a0"] and tokens["b2"] == alone["a2"]
        assert [len(t) for t in alone.values()] == [12, 12, 12]
        assert set(finished) == {"b0", "b2"}
        assert not eng.abort("b1") and not eng.abort("nobody")

    def test_abort_of_a_queued_request_runs_nothing_and_frees_its_id(self):
        eng = Engine.open(tiny_model("llama"), EngineConfig(block_size=BS))
        first, second = (req(eng, prompt_of(20, seed=50 + i), max_tokens=3) for i in range(2))
        eng.submit(first)
        eng.submit(second)
        assert eng.abort(second.request_id)
        tokens = {}
        while eng.busy:
            for d in eng.step().deltas:
                tokens.setdefault(d.request_id, []).append(d.token)
        assert list(tokens) == [first.request_id] and len(tokens[first.request_id]) == 3
        eng.submit(second)  # its id is free again
        assert eng.abort(second.request_id) and not eng.busy

    def test_running_decodes_get_a_token_every_step_while_a_long_prompt_prefills(self):
        # a stall bound this loose leaves the budget at its ceiling, 16 tokens a step, once a pass
        # beside decodes was measured; the first one has nothing measured: the floor, 4 tokens
        eng = Engine.open(tiny_model("llama"), EngineConfig(block_size=BS, prefill_budget=16,
                                                            decode_stall=1e6))
        short = [req(eng, prompt_of(8, seed=61 + i), max_tokens=60) for i in range(2)]
        for r in short:
            eng.submit(r)
        assert {d.request_id for d in eng.step().deltas} == {r.request_id for r in short}
        # joined the batch: their second tokens come from the very next step
        assert {d.request_id for d in eng.step().deltas} == {r.request_id for r in short}
        long = req(eng, prompt_of(300, seed=63), max_tokens=2)
        eng.submit(long)
        per_step = []
        while True:
            out = eng.step()
            per_step.append({d.request_id for d in out.deltas})
            if long.request_id in per_step[-1]:
                break
        # 300 tokens, 4 then 16 a step: 20 steps, and the running pair decodes in every one
        assert len(per_step) == 20
        assert all({r.request_id for r in short} <= got for got in per_step)
        while eng.busy:
            eng.step()

    @pytest.mark.parametrize("batch, steps", [
        ((True, True), 19),    # only batch decodes: the whole budget, 16 a step
        ((True, False), 75),   # one interactive decode: bounded, the floor of 4 a step
        ((False, False), 75),
    ])
    def test_only_interactive_decodes_bound_the_prefill_of_a_long_prompt(self, batch, steps):
        # a stall bound this tight leaves the bounded budget at its floor, 4 tokens a step
        eng = Engine.open(tiny_model("llama"), EngineConfig(block_size=BS, prefill_budget=16,
                                                            decode_stall=1.0001))
        running = [dataclasses.replace(req(eng, prompt_of(8, seed=66 + i), max_tokens=200),
                                       batch=b) for i, b in enumerate(batch)]
        for r in running:
            eng.submit(r)
        eng.step()
        eng.step()  # both decoding now
        long = dataclasses.replace(req(eng, prompt_of(300, seed=68), max_tokens=2), batch=True)
        eng.submit(long)
        taken = 0
        while True:
            taken += 1
            if long.request_id in {d.request_id for d in eng.step().deltas}:
                break
        # 300 tokens: 18 x 16 + 12 in 19 steps, or 75 x 4 in 75
        assert taken == steps
        for r in running:
            eng.abort(r.request_id)
        while eng.busy:
            eng.step()

    def test_a_job_sharing_a_first_block_waits_and_reuses_the_older_ones_prompt(self):
        eng = Engine.open(tiny_model("llama"), EngineConfig(block_size=BS))
        shared = prompt_of(40, seed=64)
        a, b = (req(eng, shared + prompt_of(5, seed=65 + i)) for i in range(2))
        ra, rb = eng.generate([a, b])
        assert (ra.cached_tokens, rb.cached_tokens) == (0, 32)
        # a stores 2 blocks of its prompt, then a third at the finish (45 + 5 tokens cached);
        # b stores only its own third block
        assert (ra.written_tokens, rb.written_tokens) == (48, 16)

    def test_abort_during_prefill_keeps_the_completed_blocks(self):
        eng = Engine.open(tiny_model("llama"), EngineConfig(block_size=BS, prefill_budget=16))
        long = req(eng, prompt_of(200, seed=66))
        eng.submit(long)
        for _ in range(3):
            assert not eng.step().deltas
        assert eng.abort(long.request_id) and not eng.busy
        assert eng.step().deltas == ()
        assert eng.store_stats().ledger.tokens == 48  # three chunks of 16, one block each


class TestPriority:
    def test_an_interactive_request_is_prefilled_ahead_of_batch_prompts_in_one_step(self):
        """Two batch prompts of 200 tokens are in prefill (64-token budget a step); an
        interactive prompt of 30 submitted after them takes its 30 tokens of the next step's
        budget and gets its first token in that step, before either batch prompt."""
        eng = Engine.open(tiny_model("llama"), EngineConfig(block_size=BS, prefill_budget=64))
        batch = [dataclasses.replace(req(eng, prompt_of(200, s), tenant="jobs"), batch=True)
                 for s in (1, 2)]
        for r in batch:
            eng.submit(r)
        first = eng.step()
        assert first.deltas == () and first.finished == ()
        person = req(eng, prompt_of(30, 3), tenant="people")
        eng.submit(person)
        second = eng.step()
        # in FIFO order b1, with 136 tokens left, would have taken the whole 64
        assert [d.request_id for d in second.deltas] == [person.request_id]

    def test_batch_decodes_leave_a_seat_for_an_interactive_request(self):
        """max_batch 2: of two batch requests one is admitted, the other waits; an interactive
        request submitted while the first decodes takes the kept seat and its first token
        comes in the step it is admitted (a 20-token prompt, within one budget)."""
        eng = Engine.open(tiny_model("llama"), EngineConfig(block_size=BS, max_batch=2))
        batch = [dataclasses.replace(req(eng, prompt_of(20, s), max_tokens=50, tenant="jobs"),
                                     batch=True) for s in (4, 5)]
        for r in batch:
            eng.submit(r)
        first = eng.step()
        assert [d.request_id for d in first.deltas] == [batch[0].request_id]
        person = req(eng, prompt_of(20, 6), tenant="people")
        eng.submit(person)
        second = eng.step()
        assert person.request_id in [d.request_id for d in second.deltas]
        assert batch[1].request_id not in [d.request_id for d in second.deltas]
