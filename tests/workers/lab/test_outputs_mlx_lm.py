"""``mlx_lm.server``'s side of the outputs bench (``workers.lab.outputs_mlx_lm``): the fields
each request kind sends, and the figures from its rounds (the fastest of each kind, the ratios
over free text, the share of JSON that validates). The server itself runs in the bench's end
to end test, ``tests/workers/lab/test_outputs_bench.py``."""
from __future__ import annotations

from workers.lab.outputs_mlx_lm import MlxLmOutputs, MlxLmRun, outputs_figures, request_extra

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


class TestWhatEachKindSends:
    def test_free_text_sends_nothing_more(self):
        assert request_extra("free", SCHEMA) == {}

    def test_logprobs_ask_for_the_top_5(self):
        assert request_extra("logprobs", SCHEMA) == {"logprobs": True, "top_logprobs": 5}

    def test_json_sends_the_schema_strict(self):
        assert request_extra("json", SCHEMA) == {"response_format": {
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}}


class TestTheFigures:
    def test_the_fastest_round_of_each_kind_and_the_valid_share(self):
        runs = {"free": [MlxLmRun(2.0, 100, ("a",)), MlxLmRun(1.6, 90, ("b",))],
                "logprobs": [MlxLmRun(2.4, 100, ("c",)), MlxLmRun(3.0, 100, ("d",))],
                "json": [MlxLmRun(2.0, 80, ('{"name": "Ada"}', "not json", '{"age": 3}',
                                            '{"name": "Bo"}'))]}
        assert outputs_figures(runs, SCHEMA) == MlxLmOutputs(
            free_wall_s=1.6, logprobs_wall_s=2.4, json_wall_s=2.0, free_output_tokens=90,
            json_output_tokens=80, logprobs_wall_ratio=1.5, json_schema_wall_ratio=1.25,
            json_schema_valid_share=0.5)

    def test_a_json_round_without_texts_has_no_valid_share(self):
        runs = {"free": [MlxLmRun(1.0, 10, ())], "logprobs": [MlxLmRun(1.0, 10, ())],
                "json": [MlxLmRun(1.0, 0, ())]}
        assert outputs_figures(runs, SCHEMA).json_schema_valid_share == 0.0
