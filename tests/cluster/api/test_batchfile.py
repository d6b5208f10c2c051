"""``cluster.api.batchfile``: an OpenAI Batch input file parsed into requests, each bad line
named (``file:line:``, then the field) and nothing crashing: malformed lines, values protobuf
cannot hold, bytes that are not UTF-8, fields a batch line cannot ask for; blank lines skipped; a line's
response format and log-probabilities carried into its request; the example batch is what its
generator writes."""
import json
import sys

import pytest

from cluster.api.batchfile import parse_batch
from tests.support.batch_lines import USER, line
from tests.support.paths import REPO
from tests.support.structured_jobs import PET, batch_line, structured_request

EXAMPLES = REPO / "examples"
sys.path.insert(0, str(EXAMPLES))
import make_batch  # noqa: E402


@pytest.mark.parametrize("bad, message", [
    (line("x", seed=1.5), "body.seed must be an integer from 0 to 18446744073709551615, got 1.5"),
    (line("x", seed=2**64), "body.seed must be an integer from 0 to 18446744073709551615, got "
                            "18446744073709551616"),
    (line("x", seed=-1), "body.seed must be an integer from 0 to 18446744073709551615, got -1"),
    (line("x", max_tokens=2**40), "body.max_tokens must be between 1 and 2147483647, got "
                                  "1099511627776"),
    (line("x", temperature=10**400), "body: int too large to convert to float"),
])
def test_values_out_of_range_name_their_line(bad, message):
    with pytest.raises(ValueError) as err:
        parse_batch([line("ok"), bad], name="b.jsonl")
    assert str(err.value).startswith(f"b.jsonl:2: {message}")


def test_json_protobuf_cannot_hold_names_its_line_and_field():
    deep = '{"custom_id": "x", "body": {"messages": ' + "[" * 2000 + "]" * 2000 + "}}"
    with pytest.raises(ValueError) as err:
        parse_batch([line("ok"), deep], name="b.jsonl")
    assert str(err.value) == ("b.jsonl:2: nested deeper than 100 levels of arrays and objects; "
                              "flatten it")
    lone = line("x").replace('"hello"', '"hello \\udfff"')
    with pytest.raises(ValueError) as err:
        parse_batch([line("ok"), lone], name="b.jsonl")
    assert str(err.value) == ("b.jsonl:2: body.messages[0].content: not Unicode text (a lone "
                              "surrogate \\udfff at character 6); escape a character outside "
                              "the BMP as a surrogate pair")


def test_a_line_that_is_not_utf8_is_named():
    lines = [line("ok").encode() + b"\n", b'{"custom_id": "caf\xe9"}\n', line("ok2").encode()]
    with pytest.raises(ValueError) as err:
        parse_batch(lines, name="b.jsonl")
    assert str(err.value) == "b.jsonl:2: not UTF-8 text (byte 0xe9 at column 19)"


@pytest.mark.parametrize("text, lineno, what", [
    ("{not json", 2, "not valid JSON"),
    ('["a list"]', 2, "must be a JSON object"),
    (json.dumps({"method": "POST", "body": {"messages": USER}}), 2, "custom_id"),
    (json.dumps({"custom_id": "x", "url": "/v1/embeddings", "body": {"messages": USER}}), 2,
     "url must be /v1/chat/completions"),
    (json.dumps({"custom_id": "x", "method": "GET", "body": {"messages": USER}}), 2, "method"),
    (json.dumps({"custom_id": "x", "body": {"messages": "hi"}}), 2, "body.messages"),
    (line("x", USER, max_tokens="ten"), 2, "body.max_tokens"),
    (line("x", USER, stop=[1]), 2, "body.stop"),
])
def test_malformed_lines_name_their_line(text, lineno, what):
    with pytest.raises(ValueError) as err:
        parse_batch([line("ok", USER), text, line("ok2", USER)], name="batch.jsonl")
    assert f"batch.jsonl:{lineno}:" in str(err.value) and what in str(err.value)


def test_blank_lines_are_skipped_and_fields_carried():
    batch = parse_batch(["", line("a", USER, max_tokens=7, temperature=0.5, stop="END"), "  "])
    (request,) = batch.requests
    assert batch.lines == [2]
    assert (request.custom_id, request.sampling.max_tokens, request.sampling.stop) == (
        "a", 7, ["END"])
    assert request.sampling.temperature == pytest.approx(0.5)
    with pytest.raises(ValueError, match="empty"):
        parse_batch(["", "\n"], name="e.jsonl")


def test_demo_batch_is_what_the_generator_writes():
    lines = make_batch.batch_lines(8, 3, 2, 16, "default")
    assert (EXAMPLES / "demo_batch.jsonl").read_text().splitlines() == lines
    batch = parse_batch(lines)
    assert len(batch.requests) == 24
    systems = {r.messages.messages[0].content.string_value for r in batch.requests}
    assert len(systems) == 2


class TestWhatABatchLineMayAskFor:
    """A line's response format and log-probabilities reach its request; fields a batch line
    cannot ask for are refused naming the line."""

    def test_a_file_line_carries_the_format_and_logprobs_into_the_request(self):
        pb_request = structured_request("a", PET, top=3)
        assert pb_request.response_format.type == "json_schema"
        assert pb_request.response_format.json_schema.name == "pet"
        assert (pb_request.logprobs, pb_request.top_logprobs) == (True, 3)

    @pytest.mark.parametrize("body, what", [
        ({"presence_penalty": 0.3}, "body.presence_penalty: not implemented; only 0"),
        ({"n": 3}, "body.n: only n = 1"),
        ({"stream": True}, "body.stream: a batch line is answered in the output file"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "body.tools: not supported "
         "in a batch"),
        ({"top_logprobs": 2}, "body.top_logprobs: needs logprobs: true"),
        ({"logprobs": True, "top_logprobs": 30}, "body.top_logprobs: must be from 0 to 20"),
        ({"response_format": {"type": "yaml"}}, "body.response_format.type: must be one of"),
        ({"colour": "red"}, "body.colour: not supported by orchard"),
    ])
    def test_what_a_line_cannot_ask_for_names_the_line_and_field(self, body, what):
        with pytest.raises(ValueError) as err:
            parse_batch([batch_line("ok"), batch_line("bad", **body)], name="b.jsonl")
        assert str(err.value).startswith(f"b.jsonl:2: {what}")
