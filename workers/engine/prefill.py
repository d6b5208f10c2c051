"""Prompts in prefill: each one's K/V cache and progress, and the batched chunk pass.

A ``PrefillJob`` is a request between admission and its first token. It is looked up in the
store when it first gets budget (so that it finds what older jobs wrote meanwhile); its cache
starts with the reused prefix and grows by one chunk per step (``workers.engine.scheduler`` sizes
the chunks). A chunk that reaches the end of its prompt hands back the hidden state of the
prompt's last token, and only that row goes through the vocabulary projection: the first
token's logits come out of the same pass, with no pass of their own for the last token (its
fixed cost, every weight read once, is about 0.08 s on SmolLM2-135M on one CPU thread). For an
architecture whose logits are not plainly the projection of the body's output
(``LoadedModel.head`` is None), the engine keeps the last token out of the chunks and runs it
through the whole model.

Chunks of several jobs run as one forward pass when their caches hold the same number of
tokens (the same RoPE positions and the same causal mask): the caches are stacked along the
batch axis, shorter chunks are right-padded to the longest, and each job's cache is cut back
to its own length afterwards. Padding sits after every real token of its row, so the causal
mask keeps it out of every real position's attention; the real rows compute exactly what
they would alone::

    job a  [ cached 0..511 | chunk 512..639 ]
    job b  [ cached 0..511 | chunk 512..575 | pad .. 639 ]   b keeps 0..575

Chunks shorter than 3/4 of their pass's widest chunk run in a pass of their own (padding is
computed and thrown away); jobs whose caches differ in length run one pass each. A job alone in its pass extends its own
cache in place; only a stacked pass copies caches (into the stack and back out).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from workers.messages import GenerateRequest
from workers.engine.constraints import Constraint
from workers.engine.sequence import Sampler, Sequence

# A chunk joins a stacked pass only if it fills at least this much of the pass's widest chunk:
# padding is computed and thrown away, so at most a quarter of a row is waste.
_MIN_FILL = 0.75


@dataclass(slots=True)
class PrefillJob:
    request: GenerateRequest
    received_ns: int
    prompt: list[int]
    sampler: Sampler | None
    first_block: tuple | None  # (namespace, its first block's tokens): jobs that may share
    seq: Sequence | None = None  # set by the store lookup, when the job first gets budget
    constraint: Constraint | None = None  # the request's grammar (structured outputs)
    cache: list[KVCache] = field(default_factory=list)
    done: int = 0  # prompt tokens held by the cache

    @property
    def need(self) -> int:
        """Prompt tokens still to run, the last one (through the whole model) included."""
        return len(self.prompt) - self.done

    @property
    def request_id(self) -> str:
        return self.request.request_id


def run_chunks(body: nn.Module, chunks: list[tuple[PrefillJob, int]]) -> dict[str, mx.array]:
    """Run each ``(job, tokens)`` chunk through ``body``; jobs at equal offsets share a pass.

    Returns, by request id, the hidden state (``[1, 1, hidden]``) of the prompt's last token
    for each job whose chunk reached the end of its prompt. Leaves everything lazy: the caller
    evaluates the caches once for the whole step.
    """
    groups: dict[int, list[tuple[PrefillJob, int]]] = {}
    for job, n in chunks:
        if n > 0:
            groups.setdefault(job.done, []).append((job, n))
    last: dict[str, mx.array] = {}
    for group in groups.values():
        for pack in _packs(group):
            if len(pack) == 1:
                job, n = pack[0]
                hidden = body(mx.array([job.prompt[job.done:job.done + n]]), cache=job.cache)
                rows = [hidden]
            else:
                hidden = _stacked_pass(body, pack)
                rows = [hidden[row:row + 1] for row in range(len(pack))]
            for (job, n), h in zip(pack, rows):
                if job.done + n == len(job.prompt):
                    last[job.request_id] = h[:, n - 1:n, :]
        for job, n in group:
            job.done += n
    return last


def _packs(group: list[tuple[PrefillJob, int]]) -> list[list[tuple[PrefillJob, int]]]:
    """Chunks that share a pass: each at least ``_MIN_FILL`` of its pass's widest chunk."""
    packs: list[list[tuple[PrefillJob, int]]] = []
    for job, n in sorted(group, key=lambda c: -c[1]):
        if packs and n >= _MIN_FILL * packs[-1][0][1]:
            packs[-1].append((job, n))
        else:
            packs.append([(job, n)])
    return packs


def _stacked_pass(body: nn.Module, group: list[tuple[PrefillJob, int]]) -> mx.array:
    """One pass for chunks at the same offset; the hidden states, a row per job."""
    width = max(n for _, n in group)
    rows = [job.prompt[job.done:job.done + n] + [0] * (width - n) for job, n in group]
    offset = group[0][0].done
    layers = len(group[0][0].cache)
    stacked = [KVCache() for _ in range(layers)]
    if offset:
        for layer, cache in enumerate(stacked):
            keys = mx.concatenate([job.cache[layer].keys[..., :offset, :] for job, _ in group])
            values = mx.concatenate([job.cache[layer].values[..., :offset, :] for job, _ in group])
            cache.state = (keys, values, offset)
    hidden = body(mx.array(rows), cache=stacked)
    for row, (job, n) in enumerate(group):
        for layer, cache in enumerate(stacked):
            mine = KVCache()
            mine.state = (cache.keys[row:row + 1, :, :offset + n, :],
                          cache.values[row:row + 1, :, :offset + n, :], offset + n)
            job.cache[layer] = mine
    return hidden
