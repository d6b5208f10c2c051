"""A direct request's cache diagnosis (``cache_diagnostics: true``) and its verification pass
(``cache.verify``), exactly: ``cluster.jobs.direct.diagnosis_of`` and what ``runner.direct``'s
stream sends and returns for them.

No engine: the diagnosis is read off typed results, and the stream runs on a backend of a few
lines that streams a recompute's answer and then answers the cached pass with another.
"""
from __future__ import annotations

import asyncio
import dataclasses

import pytest

from cluster.backend.protocol import GenerateOutcome
from cluster.jobs.direct import diagnosis_of
from cluster.jobs.dispatch import LoopClock
from cluster.jobs.records import EXCERPT_TOKENS, CacheDiagnosis, CacheVerification
from cluster.jobs.runner import JobRunner, RunnerLimits
from cluster.jobs.store import JobStore, NewRequest, StoredResult
from cluster.telemetry.observe import Observed
from router.attribution import Attribution, MissCause
from router.kv.key import Namespace, hash_blocks
from tests.support.bounded import record_timeouts, run_bounded
from tests.support.runner_bodies import prepare_body
from tests.support.telemetry_factories import result
from workers.messages import CacheControls, LookupOutcome, SamplingParams

BLOCK = 16
PROMPT = tuple(range(100, 140))      # 40 tokens
ENDS = (10, 25, 40)                  # three messages: [0, 10), [10, 25), [25, 40)


def _outcome(common: int, cached: int = 16, outcome=LookupOutcome.NEAR_MISS,
             tokens: tuple[int, ...] = (0, 1, 2, 3)) -> GenerateOutcome:
    r = result("r", len(PROMPT), cached, 0, "w0", outcome, common=common)
    return GenerateOutcome(dataclasses.replace(r, output_tokens=tokens), None, 1, "w0")


def _asked(**fields) -> NewRequest:
    return NewRequest("conv", PROMPT, SamplingParams(max_tokens=4), **fields)


EVICTED = Observed(None, Attribution(MissCause.EVICTED, 24))


class TestDiagnosis:
    def test_a_divergence_inside_a_message_names_it_and_quotes_each_side(self):
        assert diagnosis_of(_asked(message_ends=ENDS), _outcome(18), EVICTED) == CacheDiagnosis(
            cached_tokens=16, prompt_tokens=40, outcome="near_miss", reason="evicted",
            diverged_at=18, message_index=1, before=PROMPT[10:18], after=PROMPT[18:26])
        assert EXCERPT_TOKENS == 8

    def test_a_divergence_at_a_message_s_end_is_in_the_next_message(self):
        d = diagnosis_of(_asked(message_ends=ENDS), _outcome(10), EVICTED)
        assert (d.diverged_at, d.message_index, d.before, d.after) == (
            10, 1, PROMPT[2:10], PROMPT[10:18])

    def test_a_divergence_near_the_start_quotes_what_there_is_before_it(self):
        d = diagnosis_of(_asked(message_ends=ENDS), _outcome(3), None)
        assert (d.diverged_at, d.message_index, d.before, d.after) == (3, 0, PROMPT[:3],
                                                                     PROMPT[3:11])

    def test_a_prefix_past_the_prompt_stops_at_its_end_in_no_message(self):
        d = diagnosis_of(_asked(message_ends=ENDS), _outcome(55), EVICTED)
        assert (d.diverged_at, d.message_index, d.before, d.after) == (40, None, PROMPT[32:],
                                                                       ())

    def test_a_token_prompt_is_in_no_message(self):
        d = diagnosis_of(_asked(), _outcome(18), EVICTED)
        assert (d.diverged_at, d.message_index) == (18, None)

    def test_the_reason_is_the_observer_s_miss_cause_and_empty_without_one(self):
        hit = _outcome(40, cached=32, outcome=LookupOutcome.HIT)
        assert diagnosis_of(_asked(), hit, Observed(None, None)).reason == ""
        assert diagnosis_of(_asked(), hit, None).reason == ""
        assert diagnosis_of(_asked(), hit, None).outcome == "hit"


class Twice:
    """Streams ``first`` (the recompute's output), then answers the cached pass with
    ``again`` having read ``cached`` tokens; keeps each call's request and hashes."""

    def __init__(self, first: tuple[int, ...], again: tuple[int, ...], cached: int = 32):
        self.first, self.again, self.cached = first, again, cached
        self.streamed: list[tuple] = []
        self.generated: list[tuple] = []

    async def stream(self, request, block_hashes):
        self.streamed.append((request, tuple(block_hashes)))
        yield _outcome(0, cached=0, outcome=LookupOutcome.MISS, tokens=self.first)

    async def generate(self, request, block_hashes):
        self.generated.append((request, tuple(block_hashes)))
        return _outcome(32, cached=self.cached, outcome=LookupOutcome.PARTIAL, tokens=self.again)


@pytest.fixture
def bounds(monkeypatch) -> list:
    """The delay of each ``asyncio.timeout`` entered, in order (then the real timeout); the
    loop's clock as ``dispatch`` reads it stands still, so its bound is the timeout exactly."""
    monkeypatch.setattr(LoopClock, "now", lambda self: 0.0)
    return record_timeouts(monkeypatch)


def _direct(tmp_path, backend, request: NewRequest, remaining_s: float | None = None
            ) -> list:
    async def scenario() -> list:
        store = JobStore(tmp_path / "jobs.sqlite3", lambda: 1_000)
        runner = JobRunner(store, backend, prepare_body, RunnerLimits(2, 1000, 1000, 60.0),
                           namespace=lambda t: Namespace(t, "tiny"), block_size=BLOCK)
        try:
            return [item async for item in runner.direct.stream("acme", request, (),
                                                                 remaining_s)]
        finally:
            await runner.close()
            store.close()

    return run_bounded(scenario(), 10, "a direct request on a fake backend")


class TestVerification:
    def test_the_cached_pass_reads_writes_nothing_and_agrees(self, tmp_path, bounds):
        backend = Twice((5, 6, 7), (5, 6, 7), cached=32)
        asked = _asked(cache=CacheControls(read=False), verify=True)
        [stored] = _direct(tmp_path, backend, asked, remaining_s=5.0)
        assert type(stored) is StoredResult and stored.output_tokens == (5, 6, 7)
        assert stored.verification == CacheVerification(True, 32, None)
        assert stored.diagnosis is None
        [(sent, hashes)] = backend.streamed
        [(again, again_hashes)] = backend.generated
        assert sent.cache == CacheControls(read=False)
        assert again == dataclasses.replace(sent, request_id=f"{sent.request_id}-verify",
                                            cache=CacheControls(read=True, write=False))
        assert hashes == again_hashes == tuple(hash_blocks(PROMPT, BLOCK, sent.namespace))
        assert bounds == [5.0, 5.0]   # the stream and the cached pass: the caller's deadline

    @pytest.mark.parametrize("ours, theirs, first_difference", [
        ((5, 6, 7, 8), (5, 6, 9, 8), 2), ((5, 6, 7, 8), (5, 6), 2), ((5,), (5, 6, 7), 1),
        ((5, 6), (6, 6), 0)])
    def test_the_first_output_index_where_the_passes_differ(self, tmp_path, ours, theirs,
                                                            first_difference):
        [stored] = _direct(tmp_path, Twice(ours, theirs, cached=16), _asked(verify=True))
        assert stored.verification == CacheVerification(False, 16, first_difference)

    def test_a_diagnosed_and_verified_request_carries_both(self, tmp_path, bounds):
        asked = _asked(diagnose=True, message_ends=ENDS, verify=True)
        [stored] = _direct(tmp_path, Twice((1, 2), (1, 2)), asked)
        assert stored.verification == CacheVerification(True, 32, None)
        assert stored.diagnosis == CacheDiagnosis(0, 40, "miss", "", 0, 0, (), PROMPT[:8])
        assert bounds == [60.0, 60.0]   # no deadline of its own: the request timeout
