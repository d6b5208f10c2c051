"""Log-probabilities in OpenAI's two shapes, from the tokens' bytes and values.

Each output token arrives as a ``TokenScore``: its bytes (UTF-8, possibly part of a
character), its log-probability and its likeliest alternatives, most likely first. The values
are the model's log-softmax before temperature and any constraint, in float32 (the engine's
``workers.messages.TokenLogprob``, read through the tokenizer's ``token_bytes``).

    chat          choices[].logprobs = {"content": [{token, logprob, bytes,
                                                     top_logprobs: [{token, logprob, bytes}]}],
                                        "refusal": None}
    completions   choices[].logprobs = {tokens, token_logprobs,
                                        top_logprobs: [{token: logprob, ...}], text_offset}

``token`` is the bytes decoded (a partial character shows as U+FFFD; ``bytes`` is exact).
``text_offset`` counts the characters before each token in the answer's ``text``, from
``offset`` (a streamed completion's text so far). A tokenizer may drop what starts its text
(SentencePiece's leading space: the first token's bytes are ``b" Hello"``, the text
``Hello``): offsets then count from where the text starts. A completion's alternatives are a dict keyed by text, as OpenAI's
are: two tokens of the same text keep the likelier. The server (``cluster.api.openai_shapes``)
and ``orchard results`` (``cluster.api.batchfile``, from protobuf) write the same shapes.
"""
from __future__ import annotations

import codecs
from dataclasses import dataclass
from typing import Callable, Sequence

from workers.messages import TokenLogprob

TokenBytes = Callable[[Sequence[int]], list[bytes]]


@dataclass(frozen=True, slots=True)
class TokenScore:
    bytes: bytes
    logprob: float
    top: tuple[tuple[bytes, float], ...] = ()


def scores_of(entries: Sequence[TokenLogprob], token_bytes: TokenBytes) -> list[TokenScore]:
    """The engine's log-probabilities with each token's bytes (one tokenizer call)."""
    ids = [t for entry in entries for t in (entry.token, *(a for a, _ in entry.top))]
    pieces = iter(token_bytes(ids))
    return [TokenScore(next(pieces), entry.logprob,
                       tuple((next(pieces), value) for _, value in entry.top))
            for entry in entries]


def _text(piece: bytes) -> str:
    return piece.decode("utf-8", "replace")


def _entry(piece: bytes, logprob: float) -> dict:
    return {"token": _text(piece), "logprob": logprob, "bytes": list(piece)}


def chat_logprobs(scores: Sequence[TokenScore]) -> dict:
    return {"content": [{**_entry(s.bytes, s.logprob),
                         "top_logprobs": [_entry(b, v) for b, v in s.top]} for s in scores],
            "refusal": None}


def completion_logprobs(scores: Sequence[TokenScore], offset: int = 0,
                        text: str | None = None) -> dict:
    """``text``: the answer's whole text, when known (not for a streamed chunk, whose
    ``offset`` already counts the text sent)."""
    joined = b"".join(s.bytes for s in scores).decode("utf-8", "replace")
    dropped = len(joined) - len(text) if text is not None and joined.endswith(text) else 0
    offsets, decoder, chars = [], codecs.getincrementaldecoder("utf-8")("replace"), 0
    for s in scores:
        offsets.append(offset + max(chars - dropped, 0))
        chars += len(decoder.decode(s.bytes))
    tops = []
    for s in scores:
        top: dict[str, float] = {}
        for piece, value in s.top:
            top.setdefault(_text(piece), value)
        tops.append(top)
    return {"tokens": [_text(s.bytes) for s in scores],
            "token_logprobs": [s.logprob for s in scores], "top_logprobs": tops,
            "text_offset": offsets}

