"""The disk tier benchmark: TTFT of a long prefix from disk vs memory vs recomputed; bandwidth;
decode speed while blocks are being written behind.

One model, three engines (all with ``max_tokens = 1`` for TTFT):

- *recomputed*: no store; the request prefills its whole prompt;
- *memory*: the prefix is in the memory tier;
- *disk*: the prefix is only on disk. Two prefixes P and Q take turns: the memory tier holds
  one prefix (plus a block), so reading P back pushes Q out to disk and the next trial reads
  Q. Before each disk trial the files are synced and dropped from the OS page cache
  (``posix_fadvise(DONTNEED)``), so the reads come from the device, not from RAM.

The trials are interleaved, one round per trial (recomputed, then disk, then memory on the
prefix just read back), so a machine whose load changes during the run moves all three
alike. Every trial's prompt is the prefix plus 16 fresh tokens (a new suffix each time); the
figure is the median of ``trials`` runs; ``progress`` hears each trial as it ends. Bandwidth: *write* is bytes written over the writer thread's
busy time (serialisation, checksum and the write); *read* is the bytes of every block file over
the wall time of reading them all at once on the tier's reader threads, page cache dropped.
Beside them, the rates the tiered engine reports to the router after the trials (the tier's
moving average of its lookups' read bandwidth, the engine's prefill rate) and the cost of a
disk token they make (``router.policy.disk_token_cost``, in prefill tokens).

Decode under write-behind: ``decode_pairs`` pairs of decodes of ``decode_tokens`` tokens, one
alone (TPOT), one right after ``spill_tokens`` tokens of other blocks were evicted to the
writer's queue (``_decode_under_spill``); the writer's busy time is reported beside it, so
one can see how much of the decode the spill overlapped.
"""
from __future__ import annotations

import os
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from router.kv.ledger import Eviction
from router.policy import disk_token_cost
from workers.cache.disk_files import SUFFIX
from workers.engine.engine import Engine, EngineConfig
from workers.messages import GenerateRequest, GenerateResult, SamplingParams
from workers.model.model_dir import open_model_dir


BENCH_TTL_S = 7 * 24 * 3600.0


@dataclass(frozen=True, slots=True)
class DiskBench:
    model: str
    prefix_tokens: int
    bytes_per_token: int
    ttft_recomputed_s: float
    ttft_memory_s: float
    ttft_disk_s: float
    disk_tokens_per_trial: tuple[int, ...]
    disk_over_recomputed: float
    write_mb_s: float
    read_mb_s: float
    read_mb: float
    tpot_alone_s: float
    tpot_with_spill_s: float
    tpot_ratio: float      # median over the pairs of TPOT with a spill / TPOT alone
    spill_mb: float
    spill_write_s: float
    # as the tiered engine reports them to the router (None: nothing read from disk)
    tier_read_mb_s: float | None
    prefill_tokens_s: float | None
    disk_token_cost: float | None  # the router's cost of a disk token from those two

    def as_json(self) -> dict:
        return asdict(self)


def bench_disk(model_dir: Path | str, prefix_tokens: int = 2000, trials: int = 3,
               block_size: int = 16, decode_tokens: int = 48, spill_tokens: int = 2048,
               seed: int = 0, decode_pairs: int = 3,
               progress: Callable[[str], None] = lambda line: None) -> DiskBench:
    loaded = open_model_dir(model_dir)
    rng = random.Random(seed)
    vocab = loaded.vocab_size
    per_token = loaded.kv_shape.bytes_per_token
    prefixes = [[rng.randrange(vocab) for _ in range(prefix_tokens)] for _ in range(2)]
    clock = (time.monotonic, time.time_ns)
    with tempfile.TemporaryDirectory(prefix="orchard-disk-bench-") as tmp:
        cold = Engine(loaded, EngineConfig(block_size=block_size, use_store=False), *clock)
        # one prefix and its trial's suffix block: reading one back pushes the other out
        memory = (prefix_tokens // block_size + 1) * block_size * per_token
        # a TTL far beyond the run: on a loaded machine one recomputed trial can outlast the
        # default 300 s, and the prefix would expire from disk instead of being read back
        cfg = EngineConfig(block_size=block_size, store_bytes=memory, eviction=Eviction.LRU,
                           ttl_s=BENCH_TTL_S, disk_bytes=1 << 40, disk_dir=tmp,
                           worker_id="bench")
        tiered = Engine(loaded, cfg, *clock)
        try:
            ask = _Asker(rng, vocab)
            for prefix in prefixes:  # P, then Q in memory: P is pushed out to disk
                ask(tiered, prefix)
            progress("both prefixes computed; P is on disk")
            recomputed, disk, in_memory, disk_tokens = [], [], [], []
            for i in range(trials):
                prefix = prefixes[i % 2]  # on disk only: the other one holds the memory tier
                recomputed.append(ask(cold, prefix).ttft_s)
                tiered.flush_store()
                _drop_page_cache(Path(tmp))
                r = ask(tiered, prefix)
                disk.append(r.ttft_s)
                disk_tokens.append(r.lookup.disk_tokens)
                in_memory.append(ask(tiered, prefix).ttft_s)
                progress(f"trial {i + 1}/{trials}: TTFT recomputed {recomputed[-1]:.2f} s, "
                         f"disk {disk[-1]:.2f} s ({disk_tokens[-1]} tokens from disk), "
                         f"memory {in_memory[-1]:.2f} s")
            rates = tiered.rates()
            read_mb_s, read_mb = _read_bandwidth(Path(tmp))
            progress(f"read {read_mb:.0f} MB at {read_mb_s:.0f} MB/s (page cache dropped)")
            tpot_alone, tpot_spill, tpot_ratio, spill_mb, spill_s = _decode_under_spill(
                tiered, ask, rng, vocab, decode_tokens, spill_tokens, prefixes, decode_pairs,
                progress)
            stats = tiered.store_stats().disk
        finally:
            tiered.close()
    ttft_disk = statistics.median(disk)
    ttft_cold = statistics.median(recomputed)
    return DiskBench(
        str(model_dir), prefix_tokens, per_token, ttft_cold, statistics.median(in_memory),
        ttft_disk, tuple(disk_tokens), ttft_disk / ttft_cold,
        stats.written_bytes / stats.write_s / 1e6 if stats.write_s else 0.0, read_mb_s,
        read_mb, tpot_alone, tpot_spill, tpot_ratio, spill_mb, spill_s,
        rates.disk_read_bytes_s and rates.disk_read_bytes_s / 1e6, rates.prefill_tokens_s,
        disk_token_cost(rates))


class _Asker:
    def __init__(self, rng: random.Random, vocab: int) -> None:
        self.rng, self.vocab, self.n = rng, vocab, 0

    def __call__(self, engine: Engine, prefix: list[int], max_tokens: int = 1) -> GenerateResult:
        self.n += 1
        suffix = [self.rng.randrange(self.vocab) for _ in range(16)]
        req = GenerateRequest(f"b{self.n}", engine.namespace("bench"), tuple(prefix + suffix),
                              SamplingParams(max_tokens=max_tokens))
        (result,) = engine.generate([req])
        return result


def _decode_under_spill(engine: Engine, ask: _Asker, rng: random.Random, vocab: int,
                        decode_tokens: int, spill_tokens: int, prefixes: list[list[int]],
                        pairs: int, progress: Callable[[str], None]
                        ) -> tuple[float, float, float, float, float]:
    """Median TPOT alone and with a spill queued just before, the median of the pairs'
    ratios, and the median MB and writer seconds of a spill.

    A decode follows a fill of new blocks, which evicts the previous ones to the writer's
    queue: *alone*, that spill is flushed before the decode starts; *with a spill*, the
    decode starts at once while the writer works. Each pair measures both, and pairs
    alternate which comes first, so a load that drifts during a pair favours neither.
    """
    short = prefixes[0][:64]
    ns = engine.namespace("bench")
    alone, spilled, mb, busy = [], [], [], []
    for i in range(pairs):
        for spill in ((False, True) if i % 2 == 0 else (True, False)):
            before = engine.store_stats().disk
            _fill(engine, ns, rng, vocab, spill_tokens)
            if not spill:
                engine.flush_store()
            tpot = ask(engine, short, decode_tokens).tpot_s
            engine.flush_store()
            if spill:
                after = engine.store_stats().disk
                spilled.append(tpot)
                mb.append((after.written_bytes - before.written_bytes) / 1e6)
                busy.append(after.write_s - before.write_s)
            else:
                alone.append(tpot)
        progress(f"pair {i + 1}/{pairs}: decode TPOT alone {alone[-1] * 1e3:.1f} ms, with "
                 f"{mb[-1]:.0f} MB written behind ({busy[-1]:.2f} s of writing) "
                 f"{spilled[-1] * 1e3:.1f} ms")
    ratio = statistics.median(s / a for a, s in zip(alone, spilled))
    return (statistics.median(alone), statistics.median(spilled), ratio,
            statistics.median(mb), statistics.median(busy))


def _fill(engine: Engine, ns, rng: random.Random, vocab: int, tokens: int) -> None:
    """Store ``tokens`` new tokens' worth of K/V (random values: the write cost is the same)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    shape = engine.kv_shape
    ids = [rng.randrange(vocab) for _ in range(tokens)]
    cache = []
    for _ in range(shape.layers):
        c = KVCache()
        c.keys = mx.random.normal((1, shape.kv_heads, tokens, shape.head_dim)).astype(shape.dtype)
        c.values = mx.random.normal((1, shape.kv_heads, tokens, shape.head_dim)).astype(shape.dtype)
        c.offset = tokens
        cache.append(c)
    mx.eval([c.keys for c in cache], [c.values for c in cache])
    engine.store_kv(ns, ids, cache)


def _files(directory: Path) -> list[Path]:
    return [p for p in directory.glob(f"*/*/*{SUFFIX}")]


def _drop_page_cache(directory: Path) -> None:
    for path in _files(directory):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _read_bandwidth(directory: Path) -> tuple[float, float]:
    _drop_page_cache(directory)
    files = _files(directory)
    start = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        total = sum(pool.map(lambda p: len(p.read_bytes()), files))
    seconds = time.perf_counter() - start
    return total / seconds / 1e6, total / 1e6
