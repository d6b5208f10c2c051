"""A draft model's proposals: ``k`` tokens for every running request, in batched passes.

``[engine] draft_model`` names a second, smaller model directory with the target's tokenizer.
``DraftModel`` keeps its own batched K/V cache (mlx-lm's ``BatchKVCache``, left-padded, as
the decode batch's) with one row per drafting request, and proposes a step's drafts in
``K`` forwards over the whole batch, one per draft position, whatever the batch size::

    pass 1   each row's pending tokens (padded on the right, pads dropped after), argmax
    pass j   every row's draft j - 1 in, its draft j out (j = 2 .. K)

The target's verify pass checks them like any other drafts (``workers.engine.decode``;
greedy drafts are certain, so ``workers.engine.acceptance``'s rule keeps sampled requests
exact). After it, each row keeps what its request kept: its accepted drafts stay in the
draft's cache and the rest are dropped (``drop_tail``, the decode batch's own trim), so
both caches hold the same history. A row's *pending* tokens are those its request holds and
the draft's cache does not yet (the newest token, a fully accepted draft's last token, or
the tokens of steps that did not draft): the next proposal's first pass feeds them::

    history   p p p p L | x1 x2 x3        target accepted x1 (a = 1), then yielded t
    draft     p p p p L x1 x2             (passes 1..3 fed L, x1, x2; x3 never fed)
    after     p p p p L x1                drop 1; pending = [t]
    a = 3:    p p p p L x1 x2             drop 0; pending = [x3, t]

**The prefix.** A joining request's prompt is prefilled into the draft on admission (its
body alone, in chunks): the draft's blocks are not stored beside the target's. Why, with
the measured cost, is in ``docs/design-notes.md`` ("A draft model, batched").

**Refused.** A draft whose tokenizer differs from the target's, or whose vocabulary size
does (``check_pair``): both models are named, at start-up.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from workers.engine.config import EngineConfig
from workers.engine.decode import drop_tail
from workers.model.model_dir import LoadedModel, open_model_dir

PREFILL_CHUNK = 512  # prompt tokens per draft prefill pass (bounds its activations)


def _vocab(loaded: LoadedModel) -> dict[str, int]:
    return loaded.tokenizer._tokenizer.get_vocab()


def check_pair(target: LoadedModel, draft: LoadedModel, draft_dir: str) -> None:
    """``ValueError`` naming both models unless ``draft`` can draft for ``target``: the same
    tokenizer (token strings to ids, end tokens) and the same vocabulary size."""
    names = f"the draft model {draft_dir} and the target model {target.model_id!r}"
    mine, theirs = _vocab(draft), _vocab(target)
    if mine != theirs:
        odd = sorted(set(mine.items()) ^ set(theirs.items()))[:1]
        example = f" (e.g. token {odd[0][0]!r})" if odd else ""
        raise ValueError(f"[engine] draft_model: {names} have different tokenizers "
                         f"({len(mine)} and {len(theirs)} tokens, ids differ{example}): "
                         "a draft must use the target's tokenizer")
    if set(draft.tokenizer.eos_token_ids) != set(target.tokenizer.eos_token_ids):
        raise ValueError(f"[engine] draft_model: {names} have different end tokens "
                         f"({sorted(draft.tokenizer.eos_token_ids)} and "
                         f"{sorted(target.tokenizer.eos_token_ids)})")
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"[engine] draft_model: {names} have different vocabulary sizes "
                         f"({draft.vocab_size} and {target.vocab_size}): a draft must "
                         "have the target's vocabulary")


@dataclass(slots=True)
class _Row:
    uid: int
    held: int               # history tokens the draft's cache holds for this row
    pending: list[int]      # history tokens not yet in it, the newest last
    fed: int = 0            # drafts of the last proposal in the cache beyond the history
    drop: int = 0           # of the cache's positions, how many to forget before the next pass


class DraftModel:
    """A loaded draft model and its cache rows, one per drafting request."""

    def __init__(self, loaded: LoadedModel) -> None:
        self._m = loaded
        self._rows: list[_Row] = []
        self._cache: list[BatchKVCache] = []

    @classmethod
    def for_engine(cls, target: LoadedModel, config: EngineConfig) -> "DraftModel | None":
        """The engine's draft model (``config.draft_model``, checked against ``target`` by
        ``check_pair``); None without one."""
        if not config.draft_model:
            return None
        if not config.speculate:
            raise ValueError(f"[engine] draft_model = {config.draft_model!r} needs "
                             "speculate = true: a draft model's drafts are verified by "
                             "speculative decoding")
        path = Path(config.draft_model).expanduser().resolve()
        draft = open_model_dir(path)
        check_pair(target, draft, str(path))
        return cls(draft)

    def __len__(self) -> int:
        return len(self._rows)

    def join(self, uid: int, prompt: list[int], first: int) -> None:
        """Row ``uid`` joins: its prompt prefilled into the draft, ``first`` pending."""
        cache = [KVCache() for _ in range(self._m.kv_shape.layers)]
        for at in range(0, len(prompt), PREFILL_CHUNK):
            self._m.body(mx.array([prompt[at:at + PREFILL_CHUNK]]), cache=cache)
            mx.eval([[c.keys, c.values] for c in cache])
        merged = [BatchKVCache.merge([c]) for c in cache]
        if self._cache:
            for mine, theirs in zip(self._cache, merged):
                mine.extend(theirs)
        else:
            self._cache = merged
        self._rows.append(_Row(uid, len(prompt), [first]))

    def leave(self, uid: int) -> None:
        i = next((i for i, row in enumerate(self._rows) if row.uid == uid), None)
        if i is None:
            return
        del self._rows[i]
        keep = [j for j in range(len(self._rows) + 1) if j != i]
        if not self._rows:
            self._cache = []
            return
        for c in self._cache:
            c.filter(keep)

    def propose(self, plan: dict[int, int]) -> dict[int, list[int]]:
        """``plan[uid]`` greedy drafts for each planned row, from ``max(plan)`` passes over
        every row (an unplanned row is fed too: its cache stays in step, its drafts unused)."""
        width = max(plan.values(), default=0)
        if width <= 0 or not self._rows:
            return {}
        self._settle()
        rows = self._rows
        lengths = [len(row.pending) for row in rows]
        longest = max(lengths)
        inputs = mx.array([row.pending + [row.pending[-1]] * (longest - len(row.pending))
                           for row in rows])
        token = mx.argmax(self._logits(inputs, lengths), axis=-1)
        if longest > min(lengths):
            drop_tail(self._cache, [longest - n for n in lengths])
        drafts = [token]
        for _ in range(width - 1):
            token = mx.argmax(self._m.model(token[:, None], cache=self._cache)[:, -1], axis=-1)
            drafts.append(token)
        out = mx.stack(drafts, axis=1).tolist()
        for row, n in zip(rows, lengths):
            row.held += n
            row.pending, row.fed = [], width - 1
        return {row.uid: out[e][:plan[row.uid]] for e, row in enumerate(rows)
                if plan.get(row.uid, 0) > 0}

    def verified(self, uid: int, accepted: int, tokens: list[int]) -> None:
        """Row ``uid``'s verify pass accepted ``accepted`` drafts and yielded ``tokens`` (the
        accepted drafts, then its own token): the draft's cache keeps what was accepted."""
        row = next((row for row in self._rows if row.uid == uid), None)
        if row is None:
            return
        keep = min(accepted, row.fed)
        row.drop += row.fed - keep
        row.held += keep
        row.pending += tokens[keep:]
        row.fed = 0

    def _settle(self) -> None:
        """Forget every row's rejected drafts (one ``drop_tail`` for the batch), then check
        the cache holds each row's history."""
        drops = [row.drop for row in self._rows]
        if any(drops):
            drop_tail(self._cache, drops)
        for row in self._rows:
            row.drop = 0
        held = self._cache[0].offset.tolist() if self._cache else []
        if held != [row.held for row in self._rows]:
            raise RuntimeError(f"the draft's cache holds {held} tokens per row but "
                               f"{[row.held for row in self._rows]} were tracked")

    def _logits(self, inputs: mx.array, lengths: list[int]) -> mx.array:
        """Logits (``[B, V]``) at each row's last real position of ``inputs``."""
        at = mx.array([n - 1 for n in lengths])
        rows = mx.arange(len(lengths))
        head = self._m.head
        if head is None:
            return self._m.model(inputs, cache=self._cache)[rows, at]
        return head(self._m.body(inputs, cache=self._cache)[rows, at])
