"""The hot-document trace (``router.sim.hot_trace``): documents shared by every request on
them, one question block each, the hottest document drawn most, the same trace for a seed."""
from __future__ import annotations

from dataclasses import replace

import pytest

from cluster.cli import main
from router.sim.hot_trace import HOLDER_LOAD, HotShape, holder_rate, hot_documents, hottest_share
from router.sim.simulator import SimConfig
from router.sim.trace import load_trace

SHAPE = HotShape(requests=400, documents=3, document_blocks=4, block_size=16)


def test_each_request_is_a_document_and_a_question_of_its_own():
    trace = hot_documents(SHAPE, seed=1)
    docs = {r.hash_ids[:4] for r in trace}
    assert docs <= {(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)} and len(docs) == 3
    assert [r.hash_ids[4] for r in trace] == list(range(12, 412))   # never shared
    assert all(4 * 16 < r.input_length <= 5 * 16 for r in trace)
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(trace, trace[1:]))
    counts = [sum(r.hash_ids[0] == d * 4 for r in trace) for d in range(3)]
    assert counts == sorted(counts, reverse=True)   # weights 1, 1/2, 1/3
    assert hot_documents(SHAPE, seed=1) == trace != hot_documents(SHAPE, seed=2)


def test_a_shape_without_requests_or_rate_is_refused():
    with pytest.raises(ValueError, match="at least one request"):
        HotShape(requests=0)
    with pytest.raises(ValueError, match="rate_per_s must be positive"):
        HotShape(rate_per_s=0)


def test_the_cli_writes_it(tmp_path, capsys):
    path = tmp_path / "hot.jsonl"
    assert main(["simulate", "--synthesize", str(path), "--shape", "hot-documents"]) == 0
    trace = load_trace(path)
    assert len(trace) == HotShape().requests
    assert {r.hash_ids[0] for r in trace} == {0, 16, 32, 48}


def test_a_holder_without_decodes_serves_its_prefill_rate_over_the_new_tokens():
    config = SimConfig(workers=1, block_size=16, decode_share=0.0)
    questions = 50
    burst = replace(SHAPE, requests=questions + 1, documents=1, rate_per_s=1e9)
    new = sum(r.input_length - 4 * 16 for r in hot_documents(burst, seed=0)[1:])
    assert holder_rate(SHAPE, config, questions) == pytest.approx(questions * 6000.0 / new)


def test_the_default_rate_is_twice_what_one_holder_of_the_hottest_document_serves():
    shape = HotShape()
    assert hottest_share(shape) == pytest.approx(0.48)   # 1 / (1 + 1/2 + 1/3 + 1/4)
    rate = holder_rate(shape)
    assert rate == pytest.approx(18.52, abs=0.01)
    assert HOLDER_LOAD == 2.0
    assert shape.rate_per_s == round(HOLDER_LOAD * rate / hottest_share(shape)) == 77


def test_the_cli_writes_a_smaller_one_and_refuses_a_count_it_cannot_use(tmp_path, capsys):
    path = tmp_path / "hot.jsonl"
    assert main(["simulate", "--synthesize", str(path), "--shape", "hot-documents",
                 "--requests", "50"]) == 0
    assert load_trace(path) == hot_documents(HotShape(requests=50), seed=0)
    capsys.readouterr()
    assert main(["simulate", "--synthesize", str(path), "--requests", "0"]) == 2
    assert "orchard: error: --requests must be at least 1, got 0" in capsys.readouterr().err
    assert main(["simulate", "--trace", str(path), "--requests", "50"]) == 2
    assert "--requests is for --synthesize" in capsys.readouterr().err
