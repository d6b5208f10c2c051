"""The engine: one loaded model, its prefix store, and continuous batching of requests.

The engine owns the store and an mlx-lm ``BatchGenerator``. A request goes through::

    submit ─► validate ─► queue
    step:  admit one queued request:  lookup in the store ─► prefill the uncached suffix
           onto the reused K/V ─► sample the first token ─► write the prompt's new full
           blocks ─► join the running batch (mlx-lm's ``BatchGenerator``)
           one decode step for every running request
           ─► finished requests write their output blocks and return a ``GenerateResult``

Requests join and leave the decode batch between steps (continuous batching); several run at
once. Prefill runs through the model body without the vocabulary projection, which only the
last prompt token needs; the first token is sampled right there, so TTFT is prefill plus one
projection, and the store's writes come after it. Timings are ``now_ns`` stamps
(``time.time_ns`` by default) so the cluster can draw lookup/prefill/decode spans: this
module never imports OpenTelemetry.

Bad input raises ``ValueError`` from ``submit`` with what to fix, and nothing is queued, so
the other requests are untouched; ``generate`` turns such errors into ``RequestFailed``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence as Seq

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.models.cache import KVCache

from router.events import BlockEvent
from router.key import BlockHash, Namespace
from workers.messages import GenerateRequest, GenerateResult, LookupOutcome, LookupReport
from workers.model_dir import LoadedModel, open_model_dir
from workers.sequence import Sequence, TokenDelta, make_sampler
from workers.store import PrefixStore, StoreStats


@dataclass(frozen=True, slots=True)
class EngineConfig:
    block_size: int = 16
    store_bytes: int = 1 << 30
    ttl_s: float = 300.0
    eviction: str = "reuse"   # the store's eviction policy: "reuse" or plain "lru"
    use_store: bool = True     # False: every request computes its whole prompt
    max_batch: int = 8         # requests decoding at once
    prefill_chunk: int = 2048  # tokens per prefill forward pass
    worker_id: str = ""


@dataclass(frozen=True, slots=True)
class RequestFailed:
    """A request refused by validation; the others in the same call still ran."""

    request_id: str
    error: str


@dataclass(frozen=True, slots=True)
class StepOutput:
    deltas: tuple[TokenDelta, ...]
    finished: tuple[GenerateResult, ...]


class Engine:
    """Generation with prefix reuse for one local mlx-lm model directory."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig,
                 clock: Callable[[], float], now_ns: Callable[[], int]) -> None:
        self._m = loaded
        self.config = config
        self._now_ns = now_ns
        self.store = PrefixStore(loaded.kv_shape, config.block_size, config.store_bytes,
                                 config.ttl_s, clock, config.eviction)
        self._eos = set(loaded.tokenizer.eos_token_ids)
        self._stops = StopSequences([[e] for e in sorted(self._eos)])
        self._batch = BatchGenerator(loaded.model, completion_batch_size=config.max_batch,
                                     prefill_batch_size=1)
        self._queue: list[tuple[GenerateRequest, int]] = []
        self._running: dict[int, Sequence] = {}  # BatchGenerator uid -> sequence

    @classmethod
    def open(cls, model_dir: Path | str, config: EngineConfig | None = None, *,
             clock: Callable[[], float] = time.monotonic,
             now_ns: Callable[[], int] = time.time_ns) -> "Engine":
        return cls(open_model_dir(model_dir), config or EngineConfig(), clock, now_ns)

    # ---- what the model is ---------------------------------------------------------------

    @property
    def tokenizer(self):
        return self._m.tokenizer

    @property
    def vocab_size(self) -> int:
        return self._m.vocab_size

    @property
    def max_context(self) -> int:
        return self._m.max_context

    @property
    def model_id(self) -> str:
        return self._m.model_id

    @property
    def revision(self) -> str:
        return self._m.revision

    def namespace(self, tenant: str, adapter: str = "") -> Namespace:
        """The cache namespace of ``tenant`` on this model and weights revision."""
        return Namespace(tenant, self.model_id, self.revision, adapter)

    def render_chat(self, messages: Seq[dict[str, str]], add_generation_prompt: bool = True
                    ) -> list[int]:
        """Token ids of ``messages`` (``{"role", "content"}`` dicts) through the chat template."""
        if not messages:
            raise ValueError("messages is empty: pass at least one {'role', 'content'} message")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"each message needs 'role' and 'content' keys, got {m!r}")
        ids = self._m.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=add_generation_prompt, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    # ---- requests ------------------------------------------------------------------------

    def validate(self, req: GenerateRequest) -> None:
        """Raise ``ValueError`` saying what to fix when ``req`` cannot run."""
        s = req.sampling
        if not isinstance(req.namespace, Namespace):
            raise ValueError(f"request {req.request_id}: namespace must be a router.key.Namespace")
        if not req.prompt:
            raise ValueError(f"request {req.request_id}: the prompt is empty; send at least one token")
        bad = next((t for t in req.prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(
                f"request {req.request_id}: token id {bad} is outside the vocabulary "
                f"[0, {self.vocab_size}); tokenize with this model's tokenizer")
        if s.max_tokens <= 0:
            raise ValueError(f"request {req.request_id}: max_tokens must be >= 1, got {s.max_tokens}")
        if len(req.prompt) + s.max_tokens > self.max_context:
            raise ValueError(
                f"request {req.request_id}: prompt ({len(req.prompt)} tokens) plus max_tokens "
                f"({s.max_tokens}) exceeds the model's context of {self.max_context}; "
                f"shorten the prompt or lower max_tokens")
        if s.temperature < 0 or not 0 < s.top_p <= 1:
            raise ValueError(
                f"request {req.request_id}: need temperature >= 0 and 0 < top_p <= 1, "
                f"got {s.temperature} and {s.top_p}")
        busy = {q.request_id for q, _ in self._queue}
        busy.update(seq.request.request_id for seq in self._running.values())
        if req.request_id in busy:
            raise ValueError(f"request id {req.request_id!r} is already running: use a unique id")

    def submit(self, req: GenerateRequest) -> None:
        """Validate and queue ``req``; it starts on a later ``step``."""
        self.validate(req)
        self._queue.append((req, self._now_ns()))

    def abort(self, request_id: str) -> bool:
        """Drop ``request_id`` wherever it is; return whether it was queued or running.

        It yields nothing from the next ``step`` on and its K/V is freed with it; the blocks
        its prefill already wrote stay in the store (they are complete and shared).
        """
        for i, (queued, _) in enumerate(self._queue):
            if queued.request_id == request_id:
                del self._queue[i]
                return True
        uid = next((u for u, seq in self._running.items()
                    if seq.request.request_id == request_id), None)
        if uid is None:
            return False
        self._batch.remove([uid])
        del self._running[uid]
        return True

    @property
    def busy(self) -> bool:
        return bool(self._queue or self._running)

    def step(self) -> StepOutput:
        """Admit one queued request (lookup, prefill, first token), then decode one token for all."""
        deltas: list[TokenDelta] = []
        finished: list[GenerateResult] = []
        if self._queue and len(self._running) < self.config.max_batch:
            req, received = self._queue.pop(0)
            self._admit(req, received, deltas, finished)
        if not self._running:
            return StepOutput(tuple(deltas), tuple(finished))
        _, responses = self._batch.next()
        for r in responses:
            seq = self._running[r.uid]
            added = seq.add(int(r.token), self._now_ns(), self._eos)
            deltas.append(TokenDelta(seq.request.request_id, int(r.token), added, r.logprobs))
            if r.finish_reason or seq.finish_reason:
                finished.append(self._finish(r.uid, r.prompt_cache, r.all_tokens))
        return StepOutput(tuple(deltas), tuple(finished))

    def generate(self, requests: Iterable[GenerateRequest]) -> list[GenerateResult | RequestFailed]:
        """Run ``requests`` together to completion; results in the order given."""
        order: list[str] = []
        failed: dict[str, RequestFailed] = {}
        for req in requests:
            order.append(req.request_id)
            try:
                self.submit(req)
            except ValueError as exc:
                failed[req.request_id] = RequestFailed(req.request_id, str(exc))
        done: dict[str, GenerateResult] = {}
        while self.busy:
            for result in self.step().finished:
                done[result.request_id] = result
        return [failed.get(rid) or done[rid] for rid in order]

    # ---- internals -----------------------------------------------------------------------

    def _admit(self, req: GenerateRequest, received_ns: int, deltas: list[TokenDelta],
               finished: list[GenerateResult]) -> None:
        """Lookup, prefill the uncached suffix, sample the first token, join the batch."""
        lookup_start = self._now_ns()
        prompt = list(req.prompt)
        if self.config.use_store:
            found = self.store.lookup(req.namespace, prompt)
            report, cache = found.report, found.cache
        else:
            report, cache = _no_store_report(len(prompt), self.config.ttl_s), None
        cache = cache or [KVCache() for _ in range(self._m.kv_shape.layers)]
        lookup_end = prefill_start = self._now_ns()
        seq = Sequence(req, report, received_ns, lookup_start, lookup_end, prefill_start,
                       detokenizer=self.tokenizer.detokenizer)
        sampler = make_sampler(req.sampling)
        token, logprobs = self._first_token(prompt[report.matched_tokens:], cache, sampler)
        added = seq.add(token, self._now_ns(), self._eos)
        deltas.append(TokenDelta(req.request_id, token, added, logprobs))
        if self.config.use_store:  # after the first token: storing never delays it
            seq.written = self.store.write(req.namespace, prompt, cache)
        if seq.finish_reason:
            finished.append(seq.result(self.config.worker_id))
            return
        (uid,) = self._batch.insert(
            [[token]], max_tokens=[req.sampling.max_tokens - 1], caches=[cache],
            all_tokens=[prompt], samplers=[sampler] if sampler else None,
            stop_sequences=[self._stops])
        self._running[uid] = seq

    def _first_token(self, suffix: list[int], cache: list[KVCache], sampler
                     ) -> tuple[int, mx.array]:
        """Prefill ``suffix`` onto ``cache`` and sample the first output token."""
        self._prefill(suffix[:-1], cache)
        logits = self._m.model(mx.array([suffix[-1:]]), cache=cache)[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        token = sampler(logprobs) if sampler else mx.argmax(logprobs, axis=-1)
        mx.eval(token, logprobs)
        return int(token.item()), logprobs[0]

    def _prefill(self, tokens: list[int], cache: list[KVCache]) -> None:
        # The model body alone: the vocabulary projection is only needed for the last token.
        # Chunks are evaluated as they go (bounding memory) except the last, which is
        # evaluated together with the first token: one synchronisation for a short suffix.
        body = getattr(self._m.model, "model", self._m.model)
        step = self.config.prefill_chunk
        for start in range(0, len(tokens), step):
            body(mx.array([tokens[start:start + step]]), cache=cache)
            if start + step < len(tokens):
                mx.eval([c.keys for c in cache], [c.values for c in cache])

    def _finish(self, uid: int, cache: list[KVCache] | None, all_tokens: list[int] | None
                ) -> GenerateResult:
        seq = self._running.pop(uid)
        if cache is None:  # stopped by a stop string: take it out of the batch ourselves
            cache, all_tokens = self._batch.remove([uid], return_prompt_caches=True)[uid]
        if self.config.use_store and cache:
            if all_tokens is None or len(all_tokens) != cache[0].offset:
                raise RuntimeError(
                    f"request {seq.request.request_id}: batch cache holds {cache[0].offset} "
                    f"tokens but {len(all_tokens or ())} token ids were tracked")
            seq.written += self.store.write(seq.request.namespace, all_tokens, cache)
        if not seq.finish_reason:
            seq.finish_reason = "length"
        return seq.result(self.config.worker_id)


    # ---- the store, for the runtime (nobody outside reaches into ``store``) --------------

    def stats(self) -> StoreStats:
        return self.store.stats()

    def written_tokens(self) -> int:
        """Tokens this engine's store has written so far (blocks stored x block size): the
        one count of written tokens, aborted requests' blocks included."""
        return self.store.stats().ledger.stored_blocks * self.config.block_size

    def invalidate(self, namespace: Namespace, prefix_tokens: Seq[int] | None = None) -> int:
        """Drop ``namespace``'s blocks, or only those under ``prefix_tokens``; how many (0
        for a namespace this store never held: the cluster asks every worker)."""
        if prefix_tokens is not None:
            return self.store.invalidate_prefix(namespace, list(prefix_tokens))
        if namespace.label() not in self.store.ledger.namespaces():
            return 0
        return self.store.invalidate_namespace(namespace)

    def expire(self) -> int:
        """Drop blocks past their TTL; how many."""
        return self.store.expire()

    def drain_events(self) -> list[BlockEvent]:
        """The store's block events since the last call (for the router)."""
        return self.store.drain_events()

    def holdings(self) -> list[BlockHash]:
        """Every block hash the store holds (for the router to rebuild its view)."""
        return [h.block for h in self.store.holdings()]


def _no_store_report(prompt_tokens: int, ttl_s: float) -> LookupReport:
    return LookupReport(LookupOutcome.MISS, prompt_tokens, 0, 0, None, None, None, ttl_s)
