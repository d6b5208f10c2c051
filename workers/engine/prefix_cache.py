"""The engine's prefix cache: its prefix store (``workers.cache.store``) and its kept caches
(``workers.engine.kept``), and everything the engine asks of them.

The engine (``workers.engine.engine``) owns one ``PrefixCache`` and reaches its store only
through it; nobody else does (the engine's own methods say what they read)::

    submit ─► prefetch         disk blocks read while earlier requests run
    a job first reached ─► look_up: the store's verified match, then the kept cache holding
                           those tokens (and the partial block after them) in place of the join
    a chunk completes blocks, the first token, a finished request ─► write (then keep)

With ``use_store`` off nothing is read or written: every request computes its whole prompt.
A request's ``CacheControls`` narrow this for that request alone: ``read`` off, its whole
prompt is computed (nothing looked up, nothing prefetched); ``write`` off, nothing stored or
kept; a ``write_limit`` (its last breakpoint), only the full blocks before it are stored and
nothing is kept (a kept cache would hold the tokens past it); its ``ttl_s`` goes to the
ledger with what it writes. A salted namespace's caches are never kept either: kept caches
are found by the namespace's label, which holds no salt.
Kept caches are used only where the store holds K/V in the model's dtype (a quantized tier's
blocks differ from the exact K/V a kept cache holds).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Sequence

from mlx_lm.models.cache import KVCache

from router.kv.events import BlockEvent, WorkerRates
from router.kv.key import Hasher, Namespace
from router.kv.ledger import Holding
from workers.cache.open_store import open_store
from workers.cache.store import KVShape, Lookup, StoreStats
from workers.cache.transfer import BlockTransfer
from workers.engine.config import EngineConfig
from workers.engine.kept import KeptCaches, KeptStats
from workers.messages import CacheControls, GenerateRequest, LookupOutcome, LookupReport


class PrefixCache:
    """One engine's store and kept caches (the engine's thread only)."""

    def __init__(self, shape: KVShape, config: EngineConfig, clock: Callable[[], float],
                 model_id: str, revision: str, hasher: Hasher) -> None:
        self._shape = shape
        self._config = config
        self.enabled = config.use_store
        self._store = open_store(
            shape, config.block_size, config.ttl_s, clock,
            memory_bytes=config.store_bytes, eviction=config.eviction, kv_bits=config.kv_bits,
            disk_bytes=config.disk_bytes, disk_kv_bits=config.disk_kv_bits,
            disk_dir=Path(config.disk_dir) / (config.worker_id or "worker"),
            model=model_id, revision=revision, hasher=hasher)
        exact = config.use_store and not (config.kv_bits or config.disk_kv_bits)
        self._kept = KeptCaches(config.kept_bytes if exact else 0)
        # blocks sent to and taken from peer workers (``workers.cache.transfer``)
        self.transfer = BlockTransfer(self._store, model_id, revision, hasher, config.use_store)

    # ---- the request path ----------------------------------------------------------------

    def prefetch(self, request: GenerateRequest) -> None:
        if self.enabled and request.cache.read:
            self._store.prefetch(request.namespace, request.prompt)

    def look_up(self, request: GenerateRequest, prompt: Sequence[int]
                ) -> tuple[LookupReport, list[KVCache]]:
        """What ``prompt`` reuses and the cache to extend (fresh when nothing is reused)."""
        namespace = request.namespace
        if not (self.enabled and request.cache.read):
            report = LookupReport(LookupOutcome.MISS, len(prompt), 0, 0, None, None, None,
                                  self._config.ttl_s)
            return report, self._fresh()
        found = self._store.lookup(namespace, prompt)
        report, cache = found.report, found.cache
        # a kept cache holding the matched tokens replaces the join (left lazy: never run),
        # and may hold the partial block after them too
        kept = None if namespace.salt else self._kept.take(
            namespace.label(), prompt, report.matched_tokens, self._config.block_size)
        if kept is not None:
            cache, held = kept
            report = dataclasses.replace(report, kept_tokens=held - report.matched_tokens)
        return report, cache or self._fresh()

    def write(self, request: GenerateRequest, tokens: Sequence[int],
              cache: Sequence[KVCache]) -> int:
        """Store the full blocks of ``tokens`` not stored yet that the request's controls
        allow; how many tokens were written."""
        controls: CacheControls = request.cache
        allowed = controls.writable(len(tokens))
        if not self.enabled or allowed < self._config.block_size:
            return 0
        return self._store.write(request.namespace, tokens[:allowed], cache, controls.ttl_s)

    def store_kv(self, namespace: Namespace, tokens: Sequence[int], cache: Sequence[KVCache]
                 ) -> int:
        """Write ``cache`` as a request asking nothing of the store would (the lab's benches)."""
        return self._store.write(namespace, tokens, cache) if self.enabled else 0

    def keep(self, request: GenerateRequest, tokens: Sequence[int], cache: list[KVCache]
             ) -> None:
        """A finished request's whole cache, for the next turn to extend."""
        if request.cache.keeps and not request.namespace.salt:
            self._kept.keep(request.namespace.label(), tokens, cache)

    def _fresh(self) -> list[KVCache]:
        return [KVCache() for _ in range(self._shape.layers)]

    # ---- what the store says, and what may be asked of it --------------------------------

    def store_stats(self) -> StoreStats:
        return self._store.stats()

    def kept_stats(self) -> KeptStats:
        return self._kept.stats()

    def bytes_per_token(self) -> int:
        return self._store.ledger.bytes_per_token

    def disk_bytes_per_token(self) -> int:
        disk = self._store.disk
        return disk.ledger.bytes_per_token if disk is not None else 0

    def rates(self, prefill_tokens_s: float) -> WorkerRates | None:
        disk = self._store.disk
        if disk is None:
            return None
        return WorkerRates(disk.ledger.bytes_per_token, disk.read_bytes_s, prefill_tokens_s)

    def written_tokens(self) -> int:
        return self._store.written_blocks() * self._config.block_size

    def invalidate(self, namespace: Namespace, prefix_tokens: Sequence[int] | None) -> int:
        self._kept.drop(namespace.label())  # never taken without the store's match: memory
        if prefix_tokens is not None:
            return self._store.invalidate_prefix(namespace, list(prefix_tokens))
        if namespace.label() not in self._store.namespaces():
            return 0
        return self._store.invalidate_namespace(namespace)

    def drop_blocks(self, namespace: Namespace, tokens: Sequence[int]) -> int:
        return self._store.invalidate_prefix(namespace, list(tokens))

    def stored_lookup(self, namespace: Namespace, prompt: Sequence[int]) -> Lookup:
        return self._store.lookup(namespace, prompt)

    def expire(self) -> int:
        return self._store.expire()

    def drain_events(self) -> list[BlockEvent]:
        return self._store.drain_events()

    def holdings(self) -> list[Holding]:
        return self._store.holdings()

    def flush(self) -> None:
        self._store.flush()

    def close(self) -> None:
        self._store.close()
