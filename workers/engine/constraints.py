"""Structured outputs: a grammar per request, its token mask applied to that request's row.

A request may carry a ``ResponseFormat`` (``workers.messages``): any JSON object, JSON that
validates against a schema, a regular expression, or one of a few fixed strings. Its
``Constraint`` owns an ``llguidance`` matcher; before each sampled token the engine asks it
for the allowed tokens and masks the request's row of the batched logits, after the token
it advances the matcher::

    step    logits [batch, vocab] ──► row i masked by request i's matcher (the others as they
                                       are) ──► sample ──► matcher i consumes the token
    EOS     allowed only where the grammar accepts; forced once it can take nothing more

Why llguidance (over xgrammar and outlines-core, all three used by the big servers): it has
wheels for Linux x86_64 and macOS arm64 with no dependencies (xgrammar's Linux wheel pulls
in torch and triton), it compiles a JSON schema in well under a millisecond (so nothing is
precompiled per vocabulary, and outlines-core's index build is avoided), it computes a mask
in tens of microseconds, and it can roll a matcher back, which speculation needs.

Compiling is cached per format (a job's thousand requests share one schema: compiled once);
a format the library cannot compile raises ``ConstraintError`` naming the schema path, which
the cluster checks at submission (``check_format``), so nothing fails at decode time.
Constraints change sampling only: the prompt's K/V and the prefix cache are untouched.
"""
from __future__ import annotations

import functools
import json
import time
from typing import Any, Iterable

import llguidance
import llguidance.hf
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from workers.messages import ResponseFormat

# Compact JSON: a small model given free whitespace can loop on newlines until max_tokens.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_CHILD_KEYS = ("properties", "patternProperties", "$defs", "definitions")
_LIST_KEYS = ("anyOf", "oneOf", "allOf", "prefixItems")
_ONE_KEYS = ("items", "additionalProperties", "not", "contains")


class ConstraintError(ValueError):
    """A response format the grammar library cannot compile; ``path`` names where."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path


def check_format(fmt: ResponseFormat) -> None:
    """Raise ``ConstraintError`` when ``fmt`` cannot be compiled; nothing else."""
    grammar_of(fmt)


@functools.lru_cache(maxsize=256)
def grammar_of(fmt: ResponseFormat) -> str:
    """The llguidance grammar of ``fmt`` (cached: one compile per distinct format)."""
    if fmt.kind == "json_object":
        return _compiled(llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, defaults=_JSON_STYLE), "response_format")
    if fmt.kind == "json_schema":
        schema = _schema(fmt.schema)
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_STYLE)
        error = _error(grammar)
        if error:
            path, message = _locate(schema, "response_format.json_schema.schema", error)
            raise ConstraintError(path, message)
        return grammar
    if fmt.kind == "regex":
        return _compiled(llguidance.LLMatcher.grammar_from_regex(fmt.pattern), "regex")
    if fmt.kind == "lark":
        return _compiled(llguidance.grammar_from("lark", fmt.pattern), "grammar")
    if fmt.kind == "choice":
        if not fmt.choices:
            raise ConstraintError("choice", "needs at least one string")
        lark = "start: " + " | ".join(json.dumps(c) for c in fmt.choices)
        return _compiled(llguidance.grammar_from("lark", lark), "choice")
    raise ConstraintError("response_format.type", f"unknown kind {fmt.kind!r}")


class Grammars:
    """One engine's grammar machinery: its tokenizer as the library sees it, and matchers."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_ids: Iterable[int]) -> None:
        self._tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer)
        self.vocab_size = vocab_size
        self.eos_ids = tuple(sorted(set(eos_ids)))
        self.busy_s = 0.0  # time in masks and matcher steps, all requests (benchmarks read it)

    def constraint(self, fmt: ResponseFormat) -> Constraint:
        matcher = llguidance.LLMatcher(self._tokenizer, grammar_of(fmt))
        if matcher.is_error():
            raise ConstraintError("response_format", matcher.get_error())
        return Constraint(matcher, self)


class Constraint:
    """One request's matcher: which tokens may come next, and what came."""

    def __init__(self, matcher: llguidance.LLMatcher, grammars: Grammars) -> None:
        self._matcher = matcher
        self._g = grammars
        self._tok_vocab = grammars._tokenizer.vocab_size
        self._bits = allocate_token_bitmask(1, self._tok_vocab)
        self._eos = grammars._tokenizer.eos_token

    def allowed(self) -> np.ndarray:
        """A boolean row over the model's vocabulary: the tokens the grammar takes next (the
        model's end tokens where the grammar may end here; only they once it must)."""
        start = time.perf_counter()
        fill_next_token_bitmask(self._matcher, self._bits, 0)
        bits = np.unpackbits(self._bits[0].view(np.uint8), bitorder="little")[:self._tok_vocab]
        row = np.zeros(self._g.vocab_size, dtype=bool)
        n = min(self._tok_vocab, self._g.vocab_size)
        row[:n] = bits[:n].astype(bool)
        ends = bool(row[self._eos]) if self._eos < n else self._matcher.is_accepting()
        row[list(self._g.eos_ids)] = ends
        self._g.busy_s += time.perf_counter() - start
        return row

    def accept(self, token: int) -> None:
        """Advance past ``token`` (sampled from the masked row); an end token ends it."""
        start = time.perf_counter()
        try:
            self._accept(token)
        finally:
            self._g.busy_s += time.perf_counter() - start

    def _accept(self, token: int) -> None:
        if token in self._g.eos_ids:
            if not self._matcher.is_accepting():
                raise RuntimeError("an end token was sampled where the grammar cannot end")
            self._matcher.consume_token(self._eos)
            return
        if not self._matcher.consume_token(token):
            raise RuntimeError(f"token {token} was sampled outside the grammar's mask: "
                               f"{self._matcher.get_error()}")

    def rollback(self, tokens: int) -> None:
        """Forget the last ``tokens`` accepted tokens (rejected draft tokens)."""
        self._matcher.rollback(tokens)

    @property
    def complete(self) -> bool:
        """The output so far is a whole sentence of the grammar."""
        return self._matcher.is_accepting()


def _schema(text: str) -> dict:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConstraintError("response_format.json_schema.schema", f"not JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise ConstraintError("response_format.json_schema.schema", "must be a JSON object")
    return schema


def _error(grammar: str) -> str:
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    return "; ".join(messages) if failed else ""


def _compiled(grammar: str, path: str) -> str:
    error = _error(grammar)
    if error:
        raise ConstraintError(path, error)
    return grammar


def _locate(schema: Any, path: str, error: str) -> tuple[str, str]:
    """The deepest subschema that fails to compile on its own, with its error (a subschema
    holding a ``$ref`` is not tried alone: its pointer reaches outside it)."""
    for child_path, child in _children(schema, path):
        if not isinstance(child, dict) or "$ref" in json.dumps(child):
            continue
        grammar = llguidance.LLMatcher.grammar_from_json_schema(child, defaults=_JSON_STYLE)
        child_error = _error(grammar)
        if child_error:
            return _locate(child, child_path, child_error)
    return path, error


def _children(schema: Any, path: str) -> Iterable[tuple[str, Any]]:
    if not isinstance(schema, dict):
        return
    for key in _CHILD_KEYS:
        for name, child in (schema.get(key) or {}).items():
            yield f"{path}.{key}.{name}", child
    for key in _LIST_KEYS:
        for i, child in enumerate(schema.get(key) or []):
            yield f"{path}.{key}[{i}]", child
    for key in _ONE_KEYS:
        if isinstance(schema.get(key), dict):
            yield f"{path}.{key}", schema[key]
