"""The engine: one loaded model, its prefix cache, and continuous batching of requests.

The engine owns its prefix cache (``workers.engine.prefix_cache``: the store and the caches of
recently finished requests, which a hit extends in place of the store's joined blocks), the
admission queue and step budget (``workers.engine.scheduler``), the requests in prefill
(``workers.engine.prefill``) and the running requests (``workers.engine.running``: orchard's
own decode batch, ``workers.engine.decode``, which also verifies each running request's
draft (``workers.engine.draft``: prompt lookup, or ``draft_model``'s passes). Nobody reaches
the store: the engine's methods say what they read of it. A request goes through::

    submit ─► validate ─► admission (per-tenant round robin)
    step:  admit while the batch has room: lookup in the store ─► a prefill job holding the
           reused K/V
           one decode step for every running request (``DecodeBatch``; with speculation,
           a verify pass of every row's draft, several tokens a row)
           ─► finished requests write their output blocks and return a ``GenerateResult``
           prefill chunks within the step's token budget, oldest job first, jobs at equal
           cache lengths batched into one pass ─► store the blocks the chunks completed
           a chunk that reaches its prompt's end: the last token's hidden state through
           the vocabulary projection ─► the first token ─► join the running batch

Requests join and leave the decode batch between steps (continuous batching); a long prompt
is prefilled a chunk per step, so running requests keep decoding while it is admitted.
Prefill runs through the model body without the vocabulary projection, which only the last
prompt token needs: its row alone is projected, in the same pass. Timings are ``now_ns``
stamps (``time.time_ns`` by default) so the cluster can draw lookup/prefill/decode spans:
this module never imports OpenTelemetry.

Bad input raises ``ValueError`` from ``submit`` with what to fix (``workers.engine.validate``),
and nothing is queued, so the other requests are untouched; ``generate`` turns such errors
into ``RequestFailed``. ``abort`` drops a request wherever it is.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence as Seq

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from router.kv.events import BlockEvent, WorkerRates
from router.kv.key import Hasher, Namespace, hash_blocks
from router.kv.ledger import Holding
from workers.cache.store import KVShape, Lookup, StoreStats
from workers.cache.transfer import BlockTransfer
from workers.engine.chat import render_chat
from workers.engine.config import EngineConfig
from workers.engine.kept import KeptStats
from workers.engine.prefill import PrefillJob, run_chunks
from workers.engine.prefix_cache import PrefixCache
from workers.engine.scheduler import (Admission, StepBudget, interactive_first, split_budget,
                                      this_step)
from workers.engine.constrained import RowHook, first_token
from workers.engine.draft import SpecStats, Speculation
from workers.engine.draft_model import DraftModel
from workers.engine.running import Running
from workers.engine.constraints import Grammars, check_format
from workers.engine.sequence import Sequence, TokenDelta, make_sampler
from workers.engine.validate import check_request
from workers.messages import GenerateRequest, GenerateResult, ModelFacts
from workers.model.model_dir import LoadedModel, open_model_dir

__all__ = ["Engine", "EngineConfig", "RequestFailed", "StepOutput"]


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
                 clock: Callable[[], float], now_ns: Callable[[], int],
                 hasher: Hasher = hash_blocks) -> None:
        self._m = loaded
        self.config = config
        self._now_ns = now_ns
        self._cache = PrefixCache(loaded.kv_shape, config, clock, loaded.model_id,
                                  loaded.revision, hasher)
        self._eos = set(loaded.tokenizer.eos_token_ids)
        self._body = loaded.body      # without the vocabulary projection
        self._head = loaded.head      # None: the last prompt token runs through the whole model
        self._admission: Admission[tuple[GenerateRequest, int]] = Admission()
        self._prefilling: list[PrefillJob] = []  # oldest first
        self._budget = StepBudget(config.prefill_budget, config.decode_stall,
                                  min(4, config.prefill_budget))
        draft = DraftModel.for_engine(loaded, config)  # [engine] draft_model, or None
        spec = Speculation(config.speculate_max_k, draft) if config.speculate else None
        self._running = Running(loaded.model, spec, self._budget, self._eos, now_ns)
        self._grammars: Grammars | None = None  # made for the first constrained request

    @classmethod
    def open(cls, model_dir: Path | str, config: EngineConfig | None = None, *,
             clock: Callable[[], float] = time.monotonic,
             now_ns: Callable[[], int] = time.time_ns, hasher: Hasher = hash_blocks
             ) -> "Engine":
        return cls(open_model_dir(model_dir), config or EngineConfig(), clock, now_ns, hasher)

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

    @property
    def kv_shape(self) -> KVShape:
        """The model's K/V geometry: what one cached token is made of."""
        return self._m.kv_shape

    @property
    def kv_bytes_per_token(self) -> int:
        """K/V bytes one cached token takes in this engine's memory tier, as its store accounts
        it (the model's dtype, or ``kv_bits``): the one figure a capacity in tokens comes from."""
        return self._cache.bytes_per_token()

    @property
    def disk_kv_bytes_per_token(self) -> int:
        """K/V bytes one cached token takes in this engine's disk tier (0: no disk tier)."""
        return self._cache.disk_bytes_per_token()

    @property
    def facts(self) -> ModelFacts:
        """What the cluster learns of the model this engine serves (a worker's hello)."""
        return ModelFacts(self.model_id, self.revision, self.vocab_size, self.max_context,
                          self.config.block_size, self.kv_bytes_per_token,
                          self.disk_kv_bytes_per_token)

    def rates(self) -> WorkerRates | None:
        """What the router costs a disk hit here from: the disk tier's bytes per token and
        read bandwidth, and the prefill rate (None without a disk tier)."""
        return self._cache.rates(self._budget.prefill_tokens_s)

    def namespace(self, tenant: str, adapter: str = "") -> Namespace:
        """The cache namespace of ``tenant`` on this model and weights revision."""
        return Namespace(tenant, self.model_id, self.revision, adapter,
                         secret=self.config.cache_secret)

    def render_chat(self, messages: Seq[dict[str, str]], add_generation_prompt: bool = True
                    ) -> list[int]:
        """Token ids of ``messages`` (``{"role", "content"}`` dicts) through the chat template."""
        return render_chat(self._m.tokenizer, messages, add_generation_prompt)

    # ---- requests ------------------------------------------------------------------------

    def validate(self, req: GenerateRequest) -> None:
        """Raise ``ValueError`` saying what to fix when ``req`` cannot run
        (``workers.engine.validate``), or when its id is already running here."""
        check_request(req, self.vocab_size, self.max_context, self.config.cache_secret)
        if req.sampling.response_format is not None:
            check_format(req.sampling.response_format)
        busy = set(self._admission.keys())
        busy.update(job.request_id for job in self._prefilling)
        busy.update(seq.request.request_id for seq in self._running)
        if req.request_id in busy:
            raise ValueError(f"request id {req.request_id!r} is already running: use a unique id")

    def submit(self, req: GenerateRequest) -> None:
        """Validate and queue ``req``; it starts on a later ``step``."""
        self.validate(req)
        self._cache.prefetch(req)  # read while earlier requests run
        self._admission.push(req.namespace.tenant, req.request_id, (req, self._now_ns()),
                             req.priority)

    def abort(self, request_id: str) -> bool:
        """Drop ``request_id`` wherever it is; return whether it was queued or running.

        It yields nothing from the next ``step`` on and its K/V is freed with it; the blocks
        its prefill already wrote stay in the store (they are complete and shared).
        """
        if self._admission.remove(request_id):
            return True
        for i, job in enumerate(self._prefilling):
            if job.request_id == request_id:
                del self._prefilling[i]
                return True
        return self._running.abort(request_id)

    @property
    def busy(self) -> bool:
        return bool(len(self._admission) or self._prefilling or self._running)

    def step(self) -> StepOutput:
        """Admit what fits, decode one token for every running request, prefill one budget."""
        deltas: list[TokenDelta] = []
        finished: list[GenerateResult] = []
        while (item := self._admission.pop_seated(len(self._running) + len(self._prefilling),
                                                  self.config.max_batch)) is not None:
            self._prefilling.append(self._queued(*item))
        if self._running:
            self._decode(deltas, finished)
        if self._prefilling:
            # only interactive decodes bound the prefill: a batch job's wait for throughput
            interactive = any(not seq.request.batch for seq in self._running)
            self._prefill(interactive, deltas, finished)
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

    def _queued(self, req: GenerateRequest, received_ns: int) -> PrefillJob:
        bs = self.config.block_size
        # a job that reads and writes waits for an older one sharing its first block
        share = (req.namespace, req.prompt[:bs]) if self.config.use_store and req.cache.read \
            and req.cache.write and len(req.prompt) > bs else None
        fmt = req.sampling.response_format
        if fmt is not None and self._grammars is None:
            tok = self._m.tokenizer
            self._grammars = Grammars(tok._tokenizer, self.vocab_size, tok.eos_token_ids)
        return PrefillJob(req, received_ns, list(req.prompt), make_sampler(req.sampling), share,
                          constraint=self._grammars.constraint(fmt) if fmt else None)

    def _look_up(self, job: PrefillJob) -> None:
        """Find the job's prompt in the store; its cache starts from the reused K/V."""
        lookup_start = self._now_ns()
        report, job.cache = self._cache.look_up(job.request, job.prompt)
        job.done = report.reused_tokens
        lookup_end = self._now_ns()
        job.seq = Sequence(job.request, report, job.received_ns, lookup_start, lookup_end,
                           lookup_end, detokenizer=self.tokenizer.detokenizer)

    def _decode(self, deltas: list[TokenDelta], finished: list[GenerateResult]) -> None:
        for done in self._running.step(deltas):
            seq = done.seq
            if self._cache.enabled and done.cache:
                if len(done.tokens) != done.cache[0].offset:
                    raise RuntimeError(
                        f"request {seq.request.request_id}: batch cache holds "
                        f"{done.cache[0].offset} tokens but {len(done.tokens)} token ids "
                        "were tracked")
                seq.written += self._cache.write(seq.request, done.tokens, done.cache)
                self._cache.keep(seq.request, done.tokens, done.cache)
            finished.append(seq.result(self.config.worker_id))

    def _prefill(self, bounded: bool, deltas: list[TokenDelta], finished: list[GenerateResult]
                 ) -> None:
        """Run this step's chunks; jobs whose prompt is all in get their first token.
        ``bounded``: interactive requests are decoding, so the step budget bounds their stall."""
        budget = self._budget.tokens(bounded)
        jobs = self._this_step(budget)
        shares = split_budget([job.need for job in jobs], budget)
        # a chunk takes the prompt's last token along when the model's head can be applied to
        # its hidden state; otherwise the last token waits for its own pass
        cut = 0 if self._head is not None else 1
        body = [min(n, job.need - cut) for job, n in zip(jobs, shares)]
        start = self._now_ns()
        last = run_chunks(self._body, list(zip(jobs, body)))
        mx.eval([[c.keys, c.values] for job, n in zip(jobs, body) if n for c in job.cache])
        self._budget.observe_prefill(sum(body), (self._now_ns() - start) / 1e9, bounded)
        bs = self.config.block_size
        for job, n, share in zip(jobs, body, shares):
            if job.request_id in last:  # the chunk ran to the prompt's end: logits from it
                self._prefilling.remove(job)
                self._start_decoding(job, deltas, finished, self._head(last[job.request_id]))
            elif job.need == 1 and share > n:  # its share covers the last token too
                self._prefilling.remove(job)
                self._start_decoding(job, deltas, finished)
            elif job.done // bs > (job.done - n) // bs:
                # the chunk completed blocks: store them now, so other prompts can reuse them
                job.seq.written += self._cache.write(
                    job.request, job.prompt[:job.done], job.cache)

    def _this_step(self, budget: int) -> list[PrefillJob]:
        """The jobs that get budget this step (``workers.engine.scheduler.this_step``), interactive
        first, each looked up in the store when first reached."""
        return this_step(interactive_first(self._prefilling, lambda job: job.request.priority),
                         budget, self._reach)

    def _reach(self, job: PrefillJob) -> None:
        if job.seq is None:
            self._look_up(job)

    def _start_decoding(self, job: PrefillJob, deltas: list[TokenDelta],
                        finished: list[GenerateResult], logits: mx.array | None = None) -> None:
        """The first token, from ``logits`` of the prompt's last token (or else its pass
        through the whole model); the request joins the decode batch."""
        req, seq = job.request, job.seq
        if logits is None:
            logits = self._m.model(mx.array([job.prompt[-1:]]), cache=job.cache)
        first, raw = first_token(logits[:, -1, :], job.sampler, job.constraint)
        deltas.append(seq.delta(first, self._now_ns(), self._eos, raw))
        # after the first token: storing never delays it
        seq.written += self._cache.write(req, job.prompt, job.cache)
        if seq.finish_reason:
            self._cache.keep(req, job.prompt, job.cache)
            finished.append(seq.result(self.config.worker_id))
            return
        # a grammar has seen the prompt and the first token
        hook = RowHook(job.constraint) if job.constraint is not None else None
        self._running.join(seq, first, job.cache, job.prompt, job.sampler, hook)

    # ---- the prefix cache: what it says, what may be asked of it -------------------------

    def store_stats(self) -> StoreStats:
        return self._cache.store_stats()

    def spec_stats(self) -> SpecStats | None:
        """Speculative decoding's steps, time and drafts so far (None: speculation off)."""
        return self._running.spec_stats()

    @property
    def transfer(self) -> BlockTransfer:
        """The store's blocks sent to and taken from peer workers (the engine thread only)."""
        return self._cache.transfer

    def constraint_seconds(self) -> float:
        """Time spent in grammar masks and matcher steps so far (structured outputs)."""
        return self._grammars.busy_s if self._grammars is not None else 0.0

    def kept_stats(self) -> KeptStats:
        return self._cache.kept_stats()

    def written_tokens(self) -> int:
        """Tokens this engine's store has written so far (blocks stored x block size): the
        one count of written tokens, aborted requests' blocks included."""
        return self._cache.written_tokens()

    def invalidate(self, namespace: Namespace, prefix_tokens: Seq[int] | None = None) -> int:
        """Drop ``namespace``'s blocks (and kept caches), or only the blocks under
        ``prefix_tokens``; how many blocks (0 for a namespace this store never held: the
        cluster asks every worker)."""
        return self._cache.invalidate(namespace, prefix_tokens)

    def expire(self) -> int:
        """Drop blocks past their TTL; how many."""
        return self._cache.expire()

    def drain_events(self) -> list[BlockEvent]:
        """The store's block events since the last call (for the router)."""
        return self._cache.drain_events()

    def holdings(self) -> list[Holding]:
        """Every block the store holds, with its tier (for the router to rebuild its view)."""
        return self._cache.holdings()

    def flush_store(self) -> None:
        """Wait until the disk writer has written every block handed to it."""
        self._cache.flush()

    def close(self) -> None:
        """Persist the store's blocks to its disk tier (if any) and release its directory."""
        self._cache.close()

    # ---- for tools (benchmarks, profiles) that measure the store itself ------------------

    def drop_blocks(self, namespace: Namespace, tokens: Seq[int]) -> int:
        """Drop the store's block at ``tokens``' last full block and those below it (kept
        caches stay): the store as it was before a trial stored them."""
        return self._cache.drop_blocks(namespace, tokens)

    def stored_lookup(self, namespace: Namespace, prompt: Seq[int]) -> Lookup:
        """The store's own lookup of ``prompt`` (a hit's blocks loaded and joined)."""
        return self._cache.stored_lookup(namespace, prompt)

    def store_kv(self, namespace: Namespace, tokens: Seq[int], cache: list[KVCache]) -> int:
        """Write ``cache`` (K/V of ``tokens``) to the store as a request would; blocks written."""
        return self._cache.store_kv(namespace, tokens, cache)
