"""The job store's records (``cluster.jobs.records``) as plain values: a stored result's JSON
with and without log-probabilities, the ids a restart keeps, which states are finished, and a
cancelled job's count of requests that never ran."""
from __future__ import annotations

import json

from cluster.jobs.records import (JobRecord, JobState, PendingRequest, StoredRequest,
                                  StoredResult)
from workers.messages import SamplingParams, TokenLogprob


def _job(state: JobState, total: int = 5, completed: int = 2, failed: int = 1) -> JobRecord:
    return JobRecord("job-1", "acme", state, total, completed, failed, "m", 10, 0)


class TestStoredResultJson:
    def test_stored_results_keep_their_logprobs_and_others_read_as_before(self):
        scored = StoredResult(0, "a", "r", True, output_tokens=(5, 6), logprobs=(
            TokenLogprob(5, -0.25, ((5, -0.25), (2, -1.5))), TokenLogprob(6, -3.0)))
        assert StoredResult.from_json(4, scored.to_json()) == StoredResult(
            **{**{f: getattr(scored, f) for f in scored.__dataclass_fields__}, "seq": 4})
        plain = StoredResult(1, "b", "r2", True)
        assert "logprobs" not in json.loads(plain.to_json())
        assert StoredResult.from_json(0, plain.to_json()).logprobs == ()


    def test_the_json_leaves_out_the_sequence_and_what_is_never_stored(self):
        result = StoredResult(3, "c", "job-1-3", True, text="hi", output_tokens=(7,), seq=9)
        body = json.loads(result.to_json())
        assert body["index"] == 3 and body["text"] == "hi" and body["output_tokens"] == [7]
        assert {"seq", "diagnosis", "verification", "logprobs"} & body.keys() == set()
        assert StoredResult.from_json(9, result.to_json()) == result

    def test_logprobs_are_stored_as_token_value_and_alternatives(self):
        result = StoredResult(0, "a", "r", True, logprobs=(TokenLogprob(5, -0.25, ((5, -0.25),)),))
        assert json.loads(result.to_json())["logprobs"] == [[5, -0.25, [[5, -0.25]]]]


class TestIds:
    def test_a_requests_id_is_its_job_and_place_for_a_rerun_after_a_crash(self):
        stored = StoredRequest("job-7", 12, "c", b"body", (b"", 12))
        pending = PendingRequest("job-7", 12, "c", (1, 2), SamplingParams(max_tokens=4))
        assert stored.request_id == pending.request_id == "job-7-12"


class TestJobStates:
    def test_only_succeeded_and_cancelled_jobs_are_finished(self):
        assert [s.value for s in JobState if s.finished] == ["succeeded", "cancelled"]
        assert JobState("running") is JobState.RUNNING

    def test_a_cancelled_job_counts_the_requests_that_never_ran(self):
        assert _job(JobState.CANCELLED).cancelled == 2
        assert _job(JobState.RUNNING).cancelled == 0
        assert _job(JobState.SUCCEEDED, total=3, completed=2, failed=1).cancelled == 0
