"""The decode batch: every running request's K/V in one batched cache, one forward a step.

``DecodeBatch`` is orchard's own decode loop (in place of mlx-lm's ``BatchGenerator``, which
knows nothing of drafts): a prefilled request joins with its cache (merged into mlx-lm's
``BatchKVCache``, left-padded), each ``step`` runs one forward over every row and hands out
each row's tokens, and a finished row leaves with its cache extracted. A step with drafts is
the verify pass of speculative decoding: row ``i`` feeds its last token and its ``d_i``
drafts, padded to the step's widest draft ``K`` (pad positions count as rejected), and the
pass gives ``K + 1`` positions of logits per row in one forward::

    row 0   [last, x1, x2, x3]    accepts 3: keeps all four positions, yields 4 tokens
    row 1   [last, y1, pad, pad]  accepts 0: keeps ``last``, yields 1 token

The cache then holds exactly the accepted tokens of every row (``drop_tail``): a row that
accepted ``a_i`` keeps ``a_i + 1`` of the ``K + 1`` positions. Every row first loses the
fewest rejected positions of any row by a plain trim; a row with ``e`` more rejected
positions than that gets its ``e`` oldest positions copied over them and its left padding
moved past their old place, where the mask never looks::

    before   pad pad | a b c d L x1 X X        (X: rejected, e = 2)
    after    pad pad  a b | c d L x1 a b       left_padding += 2, offset -= 2

so the row's offset (its RoPE position) is its true length. Attention does not depend on the
order of the cached positions (each key carries its own rotary position, and every cached
key precedes every query), so the row attends exactly as before; copying ``e`` positions
costs about 1 ms for a batch of 8 where rolling each row's whole cache into place cost 135
ms (SmolLM2, 550 positions, 30 layers). The row remembers the order its positions are in
(``_Row.order``) and puts them back in order when it leaves with its cache (the prefix store
keeps blocks in token order). A row holding fewer positions than it must cover is rolled
instead (rare: a very short prompt).

A step without drafts runs exactly what mlx-lm's batch runs (the same forward over the same
cache layout, the same samplers on the same log-probabilities): speculation off, the tokens
are mlx-lm's. Structured-output rows (``hook``) never draft: their grammar steps one token a
pass. Only full-attention caches batch here (the engine refuses sliding-window models).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, KVCache, dynamic_roll

from workers.engine.acceptance import greedy_accepted, sample_accepted
from workers.engine.constrained import RowHook
from workers.engine.sequence import Sampler


@dataclass(slots=True)
class _Row:
    uid: int
    last: int                 # the row's newest token, not yet in the cache
    tokens: list[int]         # the token ids whose K/V the cache holds
    sampler: Sampler | None   # None: greedy
    hook: RowHook | None
    # the token index (into ``tokens``) of each cached position, oldest first, once
    # ``drop_tail`` has moved some out of order (None: in order)
    order: list[int] | None = None


@dataclass(frozen=True, slots=True)
class RowStep:
    """One row's share of a step: its new tokens in order (accepted drafts, then the pass's
    own token) with the raw log-probabilities each was drawn from."""

    uid: int
    tokens: tuple[int, ...]
    logprobs: tuple[mx.array, ...]
    drafted: int
    accepted: int


class DecodeBatch:
    """The running requests of one engine, decoded together."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._rows: list[_Row] = []
        self._cache: list[BatchKVCache] = []
        self._next_uid = 0

    def __len__(self) -> int:
        return len(self._rows)

    def insert(self, first: int, cache: list[KVCache], tokens: list[int],
               sampler: Sampler | None, hook: RowHook | None) -> int:
        """A prefilled request joins: ``cache`` holds ``tokens`` (its prompt), ``first`` is
        its first output token. Returns the row's uid."""
        if cache and cache[0].offset != len(tokens):
            raise RuntimeError(f"a joining cache holds {cache[0].offset} tokens but "
                               f"{len(tokens)} token ids came with it")
        merged = [BatchKVCache.merge([c]) for c in cache]
        if self._cache:
            for mine, theirs in zip(self._cache, merged):
                mine.extend(theirs)
        else:
            self._cache = merged
        self._settle()
        uid = self._next_uid
        self._next_uid += 1
        self._rows.append(_Row(uid, first, list(tokens), sampler, hook))
        return uid

    def remove(self, uid: int, unused: int = 0) -> tuple[list[KVCache], list[int]]:
        """Take row ``uid`` out; its cache and the token ids it holds, without the last
        ``unused`` (accepted tokens its request did not take: it stopped inside a draft)."""
        i = next(i for i, row in enumerate(self._rows) if row.uid == uid)
        row = self._rows.pop(i)
        held = len(row.tokens) - unused
        caches = []
        back = None if row.order is None else mx.array(sorted(range(len(row.order)),
                                                               key=row.order.__getitem__))
        for c in self._cache:
            one = c.extract(i)
            if back is not None:  # in token order again
                one.keys, one.values = one.keys[..., back, :], one.values[..., back, :]
            if unused:
                one.keys, one.values = one.keys[..., :held, :], one.values[..., :held, :]
                one.offset = held
            caches.append(one)
        keep = [j for j in range(len(self._rows) + 1) if j != i]
        if keep:
            for c in self._cache:
                c.filter(keep)
            self._settle()
        else:
            self._cache = []
        return caches, row.tokens[:held]

    def _settle(self) -> None:
        """Evaluate the batch's cache now that a row joined or left (its copy into, or out
        of, every row's padded K/V): otherwise that copy runs inside the next step, and the
        step's measured time, which the speculation rule and the step budget read, carries
        it (a step of 8 rows after a join took 0.7 to 1.0 s instead of 0.2 s)."""
        mx.eval([(c.keys, c.values, c.offset, c.left_padding) for c in self._cache
                 if c.keys is not None])

    def step(self, drafts: Mapping[int, list[int]]) -> list[RowStep]:
        """One forward over every row (each row's draft, if any, verified in it)."""
        rows = self._rows
        if not rows:
            return []
        proposed = [[] if row.hook else list(drafts.get(row.uid, ())) for row in rows]
        width = max(len(d) for d in proposed)
        inputs = mx.array([[row.last, *d, *[row.last] * (width - len(d))]
                           for row, d in zip(rows, proposed)])
        logits = self._model(inputs, cache=self._cache)
        raw = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        drawn = raw
        if any(row.hook for row in rows):
            drawn = mx.concatenate([self._masked(row, logits[e:e + 1], raw[e:e + 1])
                                    if row.hook else raw[e:e + 1] for e, row in enumerate(rows)])
        greedy = mx.argmax(drawn, axis=-1)
        mx.eval(greedy, raw, drawn)
        targets = greedy.tolist()
        out: list[RowStep] = []
        for e, (row, d) in enumerate(zip(rows, proposed)):
            if row.sampler is None:
                a = greedy_accepted(d, targets[e])
                new = targets[e][:a + 1]
            elif d:
                new, a = sample_accepted(row.sampler, drawn[e], d)
            else:
                a, new = 0, [int(row.sampler(drawn[e, :1]).item())]
            if row.order is not None:
                row.order += range(len(row.tokens), len(row.tokens) + a + 1)
            row.tokens += [row.last, *d[:a]]
            row.last = new[-1]
            out.append(RowStep(row.uid, tuple(new), tuple(raw[e, j] for j in range(a + 1)),
                               len(d), a))
        if width:
            moved = drop_tail(self._cache, [width - s.accepted for s in out])
            for row, e in zip(rows, moved):
                if e:
                    order = row.order if row.order is not None else list(range(len(row.tokens)))
                    row.order = order[e:] + order[:e]
        return out

    def _masked(self, row: _Row, logits: mx.array, raw: mx.array) -> mx.array:
        """A constrained row's first position masked by its grammar and normalised; its other
        positions (pads beside other rows' drafts, never read) as they were."""
        masked = row.hook(row.last, logits[:, 0, :])
        first = (masked - mx.logsumexp(masked, axis=-1, keepdims=True))[:, None, :]
        return mx.concatenate([first, raw[:, 1:]], axis=1)


def drop_tail(cache: list[BatchKVCache], drop: list[int]) -> list[int]:
    """Forget the last ``drop[i]`` positions of row ``i`` in every layer (see the module's
    diagram): a trim of the fewest, then each row with more has its oldest positions copied
    over the rest. Returns, per row, how many of its oldest positions moved to its end."""
    low = min(drop)
    extra = [n - low for n in drop]
    if low:
        for c in cache:
            c.trim(low)
    if not any(extra):
        return [0] * len(drop)
    n = cache[0]._idx  # mlx-lm's BatchKVCache keeps its filled length here
    pads = cache[0].left_padding.tolist()
    if any(n - e - pad < e for e, pad in zip(extra, pads) if e):
        _roll_tail(cache, extra)  # a row holding fewer positions than it must cover
        return [0] * len(drop)
    moves = [(i, e, pads[i]) for i, e in enumerate(extra) if e]
    # the copies first, each evaluated: the updates below then write in place (a copy read
    # from the array it updates would copy the whole array, each time)
    sources = [[(mx.contiguous(c.keys[i:i + 1, :, p:p + e]),
                 mx.contiguous(c.values[i:i + 1, :, p:p + e])) for i, e, p in moves]
               for c in cache]
    mx.eval(sources)
    shift = mx.array(extra)
    for c, copies in zip(cache, sources):
        for (i, e, _), (keys, values) in zip(moves, copies):
            c.keys[i:i + 1, :, n - e:n] = keys
            c.values[i:i + 1, :, n - e:n] = values
        c.offset = c.offset - shift
        c.left_padding = c.left_padding + shift
        _cut_common_padding(c)
    return extra


def _roll_tail(cache: list[BatchKVCache], extra: list[int]) -> None:
    """Roll row ``i``'s last ``extra[i]`` positions to its front, under its left padding."""
    shift = mx.array(extra)[:, None]
    for c in cache:
        n = c._idx
        c.keys = dynamic_roll(c.keys[..., :n, :], shift, axis=2)
        c.values = dynamic_roll(c.values[..., :n, :], shift, axis=2)
        c.offset = c.offset - shift[:, 0]
        c.left_padding = c.left_padding + shift[:, 0]
        _cut_common_padding(c)


def _cut_common_padding(c: BatchKVCache) -> None:
    """Cut off the padding every row has."""
    common = min(c.left_padding.tolist())
    if common:
        c.keys, c.values = c.keys[..., common:, :], c.values[..., common:, :]
        c._idx -= common
        c.left_padding = c.left_padding - common
