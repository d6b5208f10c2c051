"""The job runner's stored results, built from typed values (no engine): every field of a
finished request, whose worker it names, and an error's fields."""
from __future__ import annotations

from cluster.backend.protocol import GenerateOutcome
from cluster.jobs.dispatch import error_of, result_of
from cluster.jobs.store import PendingRequest, StoredResult
from tests.telemetry_factories import T0, result
from workers.messages import LookupOutcome, SamplingParams


def test_a_finished_request_is_stored_with_every_field_of_its_result():
    r = result("job-1-4", 40, 16, 16, "", LookupOutcome.PARTIAL, outputs=3)
    outcome = GenerateOutcome(r, None, attempts=2, worker_id="w3", worker_s=0.25)
    assert result_of(4, "conv-4", outcome) == StoredResult(
        index=4, custom_id="conv-4", request_id="job-1-4", ok=True, text="abcd",
        output_tokens=(0, 1, 2), finish_reason="length", prompt_tokens=40, cached_tokens=16,
        computed_tokens=24, written_tokens=16, worker_id="w3", ttft_s=0.02, tpot_s=0.005,
        attempts=2, worker_s=0.25)


def test_the_worker_is_the_backend_s_or_else_the_engine_s_and_its_time_the_engine_s_span():
    r = result("r", 20, 0, 16, "engine-w", LookupOutcome.MISS)
    assert result_of(0, "", GenerateOutcome(r, None, 1, "")).worker_id == "engine-w"
    assert result_of(0, "", GenerateOutcome(r, None, 1, "backend-w")).worker_id == "backend-w"
    # no worker time from the backend: the engine's received -> finished, 40 ms here
    assert result_of(0, "", GenerateOutcome(r, None, 1, "")).worker_s == 0.04
    assert r.timings.received_ns == T0


def test_an_error_is_stored_with_its_request_s_names_and_nothing_else():
    pending = PendingRequest("job-2", 7, "conv-7", (1, 2, 3), SamplingParams(4))
    assert error_of(pending, "UNAVAILABLE", "no worker") == StoredResult(
        index=7, custom_id="conv-7", request_id="job-2-7", ok=False, error_code="UNAVAILABLE",
        error_message="no worker")
