"""Structured outputs' grammar half (``workers.engine.constraints``): every construct a client's
schema may use gives only outputs that validate, whatever tokens the model would pick inside the
mask; formats the library cannot compile are refused naming the schema path."""
from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest

import workers  # noqa: F401  (OpenBLAS before mlx)
from tests.support.forged_models import tiny_model
from workers.engine.constraints import ConstraintError, Grammars, check_format, grammar_of
from workers.messages import ResponseFormat
from workers.model.model_dir import open_model_dir


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    loaded = open_model_dir(tiny_model())
    tok = loaded.tokenizer
    return Grammars(tok._tokenizer, 32000, tok.eos_token_ids), tok


def schema_format(schema: dict) -> ResponseFormat:
    return ResponseFormat("json_schema", json.dumps(schema, sort_keys=True), strict=True)


def walk(grammars, fmt: ResponseFormat, seed: int, limit: int = 400) -> tuple[str, bool]:
    """Tokens drawn at random among those the mask allows (a model that obeys nothing but the
    mask): the text, and whether it ended on an end token."""
    g, tok = grammars
    rng = random.Random(seed)
    c = g.constraint(fmt)
    out: list[int] = []
    for _ in range(limit):
        allowed = np.nonzero(c.allowed())[0].tolist()
        assert allowed, "the mask allows nothing"
        # prefer ending once allowed half the time, so walks finish within the limit
        ends = [t for t in allowed if t in g.eos_ids]
        token = ends[0] if ends and rng.random() < 0.5 else rng.choice(allowed)
        c.accept(token)
        if token in g.eos_ids:
            return tok.decode(out), True
        out.append(token)
    return tok.decode(out), False


EXTRACTION = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["person", "company", "place"]},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,5}$"},
                 "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                     "zip": {"type": "string",
                                                             "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["name", "age", "kind", "tags", "address"],
    "additionalProperties": False,
}


class TestSchemas:
    @pytest.mark.parametrize("seed", range(12))
    def test_every_walk_inside_the_mask_validates(self, grammars, seed):
        text, ended = walk(grammars, schema_format(EXTRACTION), seed, limit=600)
        if ended:
            jsonschema.validate(json.loads(text), EXTRACTION)

    def test_most_walks_end_and_every_ended_walk_is_json(self, grammars):
        ended = [walk(grammars, schema_format(EXTRACTION), seed, limit=600) for seed in range(12)]
        assert sum(e for _, e in ended) >= 10
        for text, e in ended:
            if e:
                assert set(json.loads(text)) >= {"name", "age", "kind", "tags", "address"}

    def test_json_object_mode_gives_an_object(self, grammars):
        for seed in range(6):
            text, ended = walk(grammars, ResponseFormat("json_object"), seed)
            if ended:
                assert isinstance(json.loads(text), dict)

    def test_an_enum_alone_gives_exactly_its_values(self, grammars):
        schema = {"enum": ["yes", "no", "maybe"]}
        seen = {walk(grammars, schema_format(schema), seed)[0] for seed in range(20)}
        assert seen <= {'"yes"', '"no"', '"maybe"'} and len(seen) >= 2

    def test_choice_and_regex(self, grammars):
        seen = {walk(grammars, ResponseFormat("choice", choices=("red", "green")), s)[0]
                for s in range(10)}
        assert seen == {"red", "green"}
        for seed in range(5):
            text, ended = walk(grammars, ResponseFormat("regex", pattern="[0-9]{3}-[a-c]{2}"), seed)
            assert ended and len(text) == 6 and text[3] == "-"

    def test_the_end_token_is_only_allowed_where_the_grammar_accepts(self, grammars):
        g, tok = grammars
        c = g.constraint(schema_format({"type": "integer"}))
        first = c.allowed()
        assert not first[list(g.eos_ids)].any()  # nothing written yet: no end
        c.accept(tok.encode("7", add_special_tokens=False)[-1])
        assert c.complete and c.allowed()[list(g.eos_ids)].all()
        with pytest.raises(RuntimeError, match="outside the grammar's mask"):
            c.accept(tok.encode("x", add_special_tokens=False)[-1])


class TestRefusals:
    def test_an_unknown_type_names_its_path(self):
        schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {
            "b": {"type": "frobnicate"}}}}}
        with pytest.raises(ConstraintError) as info:
            check_format(schema_format(schema))
        assert info.value.path == "response_format.json_schema.schema.properties.a.properties.b"
        assert "Invalid type: frobnicate" in str(info.value)

    def test_an_unsupported_pattern_names_its_path_inside_items(self):
        schema = {"type": "array", "items": {"type": "string", "pattern": "(?<=a)b"}}
        with pytest.raises(ConstraintError, match="look-around") as info:
            check_format(schema_format(schema))
        assert info.value.path == "response_format.json_schema.schema.items"

    def test_a_missing_reference_and_bad_json(self):
        with pytest.raises(ConstraintError, match="does not exist"):
            check_format(schema_format({"$ref": "#/definitions/missing"}))
        with pytest.raises(ConstraintError, match="not JSON"):
            check_format(ResponseFormat("json_schema", "{oops"))
        with pytest.raises(ConstraintError, match="needs at least one string"):
            check_format(ResponseFormat("choice"))

    def test_one_schema_compiles_once(self):
        grammar_of.cache_clear()
        fmt = schema_format(EXTRACTION)
        for _ in range(5):
            grammar_of(fmt)
        assert grammar_of.cache_info().misses == 1 and grammar_of.cache_info().hits == 4
