"""Acceptance into the store: the dispatch order follows shared prefixes, not the file."""
import json
import random

import pytest

from cluster.api.intake import BatchIntake
from cluster.api.validate import LimitExceeded
from cluster.backend.protocol import ModelInfo
from cluster.jobs.store import JobStore

MODEL = ModelInfo("m", "r", vocab_size=100, max_context=64, model_dir="", block_size=4,
                  kv_bytes_per_token=64)
SYSTEMS = ["You are A.", "You are B.", "You are C."]


def line(i: int) -> bytes:
    body = {"max_tokens": 2, "messages": [{"role": "system", "content": SYSTEMS[i % 3]},
                                          {"role": "user", "content": f"q{i}"}]}
    return json.dumps({"custom_id": f"c{i}", "body": body}).encode() + b"\n"


def accept(store: JobStore, lines: list[bytes], chunk: int = 7):
    batch = BatchIntake(store.intake("acme", "m"), MODEL, max_requests=100, name="f.jsonl")
    data = b"".join(lines)
    for start in range(0, len(data), chunk):  # chunks that split lines anywhere
        batch.feed(data[start:start + chunk])
    batch.end()
    job, _ = batch.commit()
    batch.intake.close()
    return job


def dispatch_order(store: JobStore, job_id: str) -> list[str]:
    return [r.custom_id for r in store.next_requests(job_id, limit=1000)]


@pytest.fixture
def store(tmp_path):
    s = JobStore(tmp_path / "jobs.sqlite3", lambda: 0)
    yield s
    s.close()


def test_requests_sharing_a_system_prompt_dispatch_together_whatever_the_file_order(store):
    lines = [line(i) for i in range(12)]
    shuffled = lines[:]
    random.Random(7).shuffle(shuffled)
    first = dispatch_order(store, accept(store, lines).job_id)
    second = dispatch_order(store, accept(store, shuffled).job_id)
    assert first == second
    groups = [int(c[1:]) % 3 for c in first]
    assert groups == sorted(groups, key=groups.index)  # each system prompt's requests adjacent
    assert [r.index for r in store.next_requests(accept(store, lines).job_id, limit=1)] == [
        int(first[0][1:])]  # each request keeps its own index (its place in the file)


def test_the_limit_and_a_bad_line_are_named(store):
    with pytest.raises(LimitExceeded, match="limit of 100 requests per job"):
        accept(store, [line(i) for i in range(101)])
    with pytest.raises(ValueError, match=r"^f.jsonl:3: not valid JSON"):
        accept(store, [line(0), line(1), b"{oops\n"])
    with pytest.raises(ValueError, match=r"f.jsonl:2: body.messages\[1\].role: unknown role"):
        accept(store, [line(0), line(1).replace(b'"user"', b'"robot"')])
    assert store.list_jobs("acme") == []
