"""One request's life inside the engine: its sampler, stop conditions, counts and timestamps.

``Sequence`` is private to the engine's loop (``workers.engine.engine``): it turns the tokens the
batch produces into text, notices stop strings, and finally builds the ``GenerateResult``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_top_p

from workers.messages import (GenerateRequest, GenerateResult, LookupReport, SamplingParams,
                              Timings, TokenLogprob)

# Below this temperature sampling is greedy: 1/T times the log-probabilities overflows float32
# near T = 1e-38 (every logit becomes -inf, and the draw is uniform), and long before that the
# most likely token's probability rounds to 1.
GREEDY_BELOW = 1e-5


class Sampler:
    """A sampled request's draws, from its own seeded PRNG key, split once per draw.

    Its tokens depend only on its seed, never on which other requests share the batch. A
    plain step calls it on the step's log-probabilities (``[1, V]``); a verify pass asks for
    the distribution it draws from and for the draws of the rejection rule
    (``workers.engine.acceptance``).
    """

    def __init__(self, params: SamplingParams) -> None:
        self._key = mx.random.key(params.seed)
        self._scale = 1.0 / params.temperature
        self._top_p = params.top_p

    def __call__(self, logprobs: mx.array) -> mx.array:
        if self._top_p < 1.0:
            logprobs = apply_top_p(logprobs, self._top_p)
        return mx.random.categorical(logprobs * self._scale, key=self._split())

    def distribution(self, logprobs: mx.array) -> mx.array:
        """The probabilities (``[V]``) a draw from ``logprobs`` (``[V]``) follows."""
        row = logprobs[None]
        if self._top_p < 1.0:
            row = apply_top_p(row, self._top_p)
        return mx.softmax(row * self._scale, axis=-1)[0]

    def uniform(self) -> float:
        return float(mx.random.uniform(key=self._split()).item())

    def draw(self, probs: mx.array) -> int:
        """One token from ``probs`` (``[V]``, summing to 1)."""
        return int(mx.random.categorical(mx.log(probs), key=self._split()).item())

    def _split(self) -> mx.array:
        self._key, sub = mx.random.split(self._key)
        return sub


def make_sampler(params: SamplingParams) -> Sampler | None:
    """``None`` for greedy (the batch's shared argmax); otherwise a seeded sampler of its own."""
    if params.temperature < GREEDY_BELOW:
        return None
    return Sampler(params)


def token_logprob(row: mx.array, token: int, top: int) -> TokenLogprob:
    """``token``'s log-probability in ``row``, with the ``top`` likeliest tokens (most likely
    first, equal values by token id) in float32."""
    values = np.asarray(row.astype(mx.float32) if row.dtype != mx.float32 else row)
    alternatives: tuple[tuple[int, float], ...] = ()
    if top:
        part = np.argpartition(-values, top - 1)[:top] if top < len(values) else np.arange(len(values))
        ranked = sorted(part.tolist(), key=lambda t: (-values[t], t))[:top]
        alternatives = tuple((t, float(values[t])) for t in ranked)
    return TokenLogprob(token, float(values[token]), alternatives)


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """One new output token of one request, as streaming callers see it.

    ``logprobs`` is the full log-softmax over the vocabulary at this step (an ``mx.array``);
    drop it before sending a delta to another process. ``token_logprobs`` is the token's entry
    as the result records it (``Sequence.add``, on the engine thread, which owns MLX's
    arrays): one when the request asked for log-probabilities, none otherwise and for an end
    token (which is not an output token).
    """

    request_id: str
    token: int
    text: str  # text added by this token (may be empty while a character is incomplete)
    logprobs: mx.array
    token_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(slots=True)
class Sequence:
    request: GenerateRequest
    report: LookupReport
    received_ns: int
    lookup_start_ns: int
    lookup_end_ns: int
    prefill_start_ns: int
    written: int = 0
    emitted: int = 0  # tokens the model produced, a final EOS included
    first_token_ns: int = 0
    last_token_ns: int = 0
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    detokenizer: Any = None  # mlx-lm's streaming detokenizer, one per sequence
    logprobs: list[TokenLogprob] = field(default_factory=list)  # when the request asks
    drafted: int = 0   # tokens drafted for it (speculative decoding)
    accepted: int = 0  # of those, accepted and taken
    _stopped_by_string: bool = False
    _stop_string: str = ""  # the stop string that ended the text (the result's extra "stop")

    def delta(self, token: int, now_ns: int, eos: set[int], row: mx.array) -> TokenDelta:
        """``add`` the token; the delta that streams it (with its recorded log-probability)."""
        recorded = len(self.logprobs)
        added = self.add(token, now_ns, eos, row)
        return TokenDelta(self.request.request_id, token, added, row,
                          tuple(self.logprobs[recorded:]))

    def add(self, token: int, now_ns: int, eos: set[int], row: mx.array | None = None) -> str:
        """Take one token (``row``: the step's log-probabilities, before temperature and any
        mask); return the text it adds. Sets ``finish_reason`` when it stops."""
        if not self.first_token_ns:
            self.first_token_ns = now_ns
        self.last_token_ns = now_ns
        self.emitted += 1
        if token in eos:
            self.finish_reason = "stop"
            return self._flush()
        top = self.request.sampling.logprobs
        if top is not None:
            if row is None:
                raise RuntimeError(f"request {self.request.request_id} asked for logprobs, "
                                   "but its step gave none")
            self.logprobs.append(token_logprob(row, token, top))
        self.tokens.append(token)
        self.detokenizer.add_token(token)
        added = self._append(self.detokenizer.last_segment)
        if not self.finish_reason and len(self.tokens) >= self.request.sampling.max_tokens:
            self.finish_reason = "length"
            added += self._flush()
        return added

    def _flush(self) -> str:
        self.detokenizer.finalize()
        return self._append(self.detokenizer.last_segment)

    def _append(self, segment: str) -> str:
        """Append decoded text, cutting it at the first stop string; return what is visible."""
        if self.finish_reason == "stop" and self._stopped_by_string:
            return ""
        before = len(self.text)
        self.text += segment
        longest = max((len(s) for s in self.request.sampling.stop), default=0)
        window = max(0, before - longest + 1)  # a stop string may straddle two segments
        hits = [(at, s) for s in self.request.sampling.stop
                if (at := self.text.find(s, window)) >= 0]
        if hits:
            at, self._stop_string = min(hits)  # the first in the text (ties: by the string)
            self.text = self.text[:at]
            self.finish_reason = "stop"
            self._stopped_by_string = True
        return self.text[before:]

    def result(self, worker_id: str) -> GenerateResult:
        produced = max(1, self.emitted)
        ttft = (self.first_token_ns - self.received_ns) / 1e9
        tpot = (self.last_token_ns - self.first_token_ns) / 1e9 / (produced - 1) if produced > 1 else 0.0
        r = self.report
        return GenerateResult(
            request_id=self.request.request_id, output_tokens=tuple(self.tokens), text=self.text,
            finish_reason=self.finish_reason, ttft_s=ttft, tpot_s=tpot,
            input_tokens=r.prompt_tokens, cached_tokens=r.reused_tokens,
            computed_tokens=r.prompt_tokens - r.reused_tokens, written_tokens=self.written,
            lookup=r, worker_id=worker_id, logprobs=tuple(self.logprobs),
            drafted_tokens=self.drafted, accepted_tokens=self.accepted,
            extra={"stop": self._stop_string} if self._stop_string else {},
            timings=Timings(self.received_ns, self.lookup_start_ns, self.lookup_end_ns,
                            self.prefill_start_ns, self.first_token_ns, self.last_token_ns))
