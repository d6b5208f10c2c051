"""The trace's optional fields beyond Mooncake's (a session key and a breakpoint), and the
conversation trace that ships with orchard."""
from __future__ import annotations

import json

import pytest

from router.sim.trace import DEFAULT_TRACE, TraceRequest, load_trace, write_trace


def test_session_and_breakpoint_round_trip_and_stay_out_of_plain_lines(tmp_path):
    path = tmp_path / "t.jsonl"
    trace = [TraceRequest(0.0, 600, 5, (1, 2)),
             TraceRequest(1.5, 1100, 5, (1, 3, 4), session="s1", write_blocks=1)]
    write_trace(trace, path)
    first, second = (json.loads(line) for line in path.read_text().splitlines())
    assert set(first) == {"timestamp", "input_length", "output_length", "hash_ids"}
    assert (second["session"], second["write_blocks"]) == ("s1", 1)
    assert load_trace(path) == trace


@pytest.mark.parametrize("extra, message", [
    ({"session": 3}, "session must be a string"),
    ({"write_blocks": -1}, "write_blocks must be a non-negative integer"),
    ({"write_blocks": True}, "write_blocks must be a non-negative integer"),
    ({"sesion": "a"}, "unknown field\\(s\\) sesion"),
])
def test_a_bad_optional_field_is_named(tmp_path, extra, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "input_length": 10, "output_length": 1,
                                "hash_ids": [0], **extra}) + "\n")
    with pytest.raises(ValueError, match=f"bad.jsonl:1: {message}"):
        load_trace(path)


def test_the_conversation_trace_ships_with_orchard():
    trace = load_trace(DEFAULT_TRACE, limit=3)
    assert len(trace) == 3 and trace[0].arrival_s == 0.0
    assert (DEFAULT_TRACE.parent / "README.md").read_text().count("Apache License 2.0") == 1
