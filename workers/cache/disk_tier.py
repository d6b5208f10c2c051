"""The disk tier of a worker's prefix store: blocks evicted from memory, kept in files.

``DiskTier`` owns one directory (one per worker, held with an exclusive ``flock`` on
``.lock`` by ``workers.cache.disk_lock``: a second worker pointed at it is refused) and a ``BlockLedger`` of its own, with its
own byte budget, the same eviction policy and the same TTL as the memory tier. Files are
written behind the engine's back by ``workers.cache.disk_writer``; the format is
``workers.cache.disk_files``.

    memory tier ──evict──► spill ──► ledger (disk budget) ──► writer thread ──► ab/ab12...kv
    lookup ◄── verify (checksum, hash, token ids) ◄── read (prefetched on a thread pool)

Rules:

- **Nothing unverified is served.** Every block read back is checked: its digest, then its
  hash and its identity (namespace, parent, position, token ids) against what the lookup
  expects. A file that fails the digest is deleted, counted (``corrupt``) and its subtree
  forgotten; a sound file that is another block (a hash collision) stays and is an identity
  mismatch for this lookup. Either way the lookup stops before it and the engine recomputes.
- **Restart keeps the cache.** Opening a directory that holds blocks indexes their headers
  (``workers.cache.disk_scan``):
  leftover ``.tmp`` files (a kill during a write), files whose size disagrees with their
  header and blocks whose parent chain loops (hashing never makes one) are deleted and
  counted (``torn``), files of an older format version are deleted and counted
  (``outdated``), blocks of another model or weights revision
  (another namespace, never servable here) are deleted and counted (``foreign``), blocks
  unused for ``ttl_s`` (by file mtime, which a hit refreshes) are deleted (``expired``), and
  the newest that fit the budget are restored. Restored blocks are announced like new ones:
  ``BlockStored(tier=DISK)`` events.
- **Disk full** stops writes (one warning); the memory tier carries on. While full, a spill
  looks at the file system's free space at most every ``FULL_RECHECK_S`` (5 s: a statvfs
  call costs microseconds, and a disk freed by an operator is written again within
  seconds); once it holds ``RESUME_BLOCKS`` (8) of the blocks being spilled, writes resume,
  without a restart. Eight blocks of margin keep a disk that frees a single block from
  flapping between full and not at every spill.
- **The time**: the ledger runs on the injected ``clock``; file ages use ``wall_clock``.
- **Read bandwidth** (``read_bytes_s``, for the router's cost of a disk hit): per lookup that
  read files, the bytes read over the wall time from the first file's read start to the last
  one's end (the reader threads read a chain in parallel, so summed thread time would
  understate it), as a moving average (``workers.rates``); blocks still waiting to be
  written are served from memory and not counted.
"""
from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from router.kv.events import BlockEvent, Tier
from router.kv.key import BlockHash, BlockIdentity
from router.kv.ledger import DEFAULT_EVICTION, BlockLedger, Eviction, LedgerStats, RemovalReason
from workers.cache.disk_files import (BlockData, BlockRecord, CorruptBlock, block_path,
                                      decode_block)
from workers.cache.disk_lock import DiskDirError, lock_directory  # noqa: F401  (raised from here)
from workers.cache.disk_scan import scan
from workers.cache.disk_writer import DiskWriter, PendingBlock
from workers.cache.kv_quant import KVCodec
from workers.rates import moving_average

log = logging.getLogger(__name__)

READ_THREADS = 4  # parallel file reads: one SSD queue is not enough to reach its bandwidth
FULL_RECHECK_S = 5.0  # a full tier looks at the free space at most this often
RESUME_BLOCKS = 8     # ... and writes again once this many blocks fit


@dataclass(frozen=True, slots=True)
class StartCounts:
    """What opening the directory found and did."""

    restored: int   # blocks indexed and announced
    torn: int       # .tmp leftovers and truncated files, deleted
    foreign: int    # another model's or weights revision's blocks, deleted
    expired: int    # unused for ttl_s, deleted
    over_budget: int  # the oldest beyond the byte budget, deleted
    outdated: int = 0  # files of an older format version, deleted


@dataclass(frozen=True, slots=True)
class DiskStats:
    ledger: LedgerStats
    start: StartCounts
    written_blocks: int
    written_bytes: int
    write_s: float
    write_batches: int
    read_blocks: int
    read_bytes: int
    read_s: float          # summed over reader threads
    prefetched: int        # block reads started by prefetch, ahead of their lookup
    corrupt: int           # files that failed verification on read: deleted, never served
    failed_writes: int
    full: bool
    skipped_full: int      # spills refused because the disk is full
    pending_writes: int
    lost_blocks: int = 0   # forgotten because the directory was removed under the tier
    free_bytes: int | None = None  # the file system's free space (None: unreadable)


@dataclass(frozen=True, slots=True)
class _Read:
    """One block file read on a reader thread, with its ``perf_counter`` start and end."""

    data: bytes
    start: float
    end: float


class DiskTier:
    """One worker's disk directory of K/V blocks, with its own ledger and budget."""

    def __init__(self, directory: Path | str, capacity_bytes: int, ttl_s: float,
                 clock: Callable[[], float], codec: KVCodec, bytes_per_token: int,
                 model: str, revision: str, eviction: Eviction = DEFAULT_EVICTION,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.directory = Path(directory)
        self.codec = codec
        self.model, self.revision = model, revision
        self._wall = wall_clock
        self._clock = clock
        self._lock_fd = lock_directory(self.directory)
        self.ledger = BlockLedger(capacity_bytes, ttl_s, clock, bytes_per_token, policy=eviction,
                                  on_remove=self._removed, tier=Tier.DISK)
        self._tokens: dict[BlockHash, bytes] = {}  # token ids per block, for near misses
        self._reads: dict[BlockHash, Future] = {}
        self._read_counts = [0, 0, 0.0]  # blocks, bytes, seconds
        self._read_rate: float | None = None  # bytes/s, moving average over lookups
        self._prefetched = 0
        self._corrupt = 0
        self._skipped_full = 0
        self._lost_blocks = 0  # forgotten because the directory was removed under the tier
        self._checked_at = 0.0  # while full: when the free space was last looked at
        self.start = self._index()
        self._writer = DiskWriter(self.directory, clock)
        self._pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="orchard-disk-read")

    # ---- queries -------------------------------------------------------------------------

    def __contains__(self, block: BlockHash) -> bool:
        return block in self.ledger

    def tokens(self, block: BlockHash) -> tuple[int, ...]:
        raw = self._tokens[block]
        return tuple(int.from_bytes(raw[i:i + 4], "little") for i in range(0, len(raw), 4))

    @property
    def read_bytes_s(self) -> float | None:
        """The measured read bandwidth (bytes/s), None before the first file is read back."""
        return self._read_rate

    def stats(self) -> DiskStats:
        self._reap()
        w = self._writer.counts
        return DiskStats(self.ledger.stats(), self.start, w.written_blocks, w.written_bytes,
                         w.write_s, w.batches, self._read_counts[0], self._read_counts[1],
                         self._read_counts[2], self._prefetched, self._corrupt, w.failed, self._writer.full,
                         self._skipped_full, self._writer.pending_count(), self._lost_blocks,
                         _free_bytes(self.directory))

    def drain_events(self) -> list[BlockEvent]:
        self._reap()
        return self.ledger.drain_events()

    # ---- writes --------------------------------------------------------------------------

    def spill(self, record: BlockRecord, keys: tuple, values: tuple) -> bool:
        """Keep a block evicted from memory (``keys``/``values`` in this tier's codec).

        Returns whether it was taken: not when the disk is full or the budget cannot fit it.
        A block already here is only touched.
        """
        self._reap()
        h = record.block
        if h in self.ledger:
            if self.ledger.parent(h) != record.parent or self.ledger.namespace(h) != record.namespace:
                return False  # another block under the same hash: never touched or replaced
            self.ledger.touch(self.ledger.chain_to(h))
            return True
        if self._writer.full and not self._space_returned(len(record.tokens)):
            self._skipped_full += 1
            return False
        self.ledger.expire()  # before reading the chain: insert would expire its head
        ancestors = self.ledger.chain_to(record.parent)
        if record.parent == h or (ancestors and self.ledger.parent(ancestors[0]) == h):
            raise RuntimeError(f"disk tier {self.directory}: block {h:032x} would be its own "
                               "ancestor (a broken hash chain); it was not spilled")
        chain = ancestors + [h]
        root = self.ledger.parent(ancestors[0]) if ancestors else record.parent
        stored = self.ledger.insert(chain, len(record.tokens), record.namespace, root)
        if h not in stored:
            return False
        self._tokens[h] = b"".join(t.to_bytes(4, "little") for t in record.tokens)
        self._writer.write(PendingBlock(record, keys, values))
        return True

    def flush(self) -> None:
        """Wait until every queued write is on disk (benchmarks, tests, shutdown);
        ``WriterStopped`` if the writer stopped on an error (its blocks are forgotten)."""
        try:
            self._writer.flush()
        finally:
            self._reap()

    def close(self) -> None:
        """Finish reads and writes; the directory is released even if ``WriterStopped``."""
        self._pool.shutdown(wait=True)
        try:
            self._writer.close()
        finally:
            self._reap()
            os.close(self._lock_fd)  # releases the flock

    # ---- reads ---------------------------------------------------------------------------

    def prefetch(self, blocks: Sequence[BlockHash]) -> None:
        """Start reading ``blocks`` (held here, not pending) on the reader threads."""
        self._prefetched += self._start_reads(blocks)

    def _start_reads(self, blocks: Sequence[BlockHash]) -> int:
        started = 0
        for h in blocks:
            if h in self.ledger and h not in self._reads and self._writer.pending(h) is None:
                self._reads[h] = self._pool.submit(self._read_file, block_path(self.directory, h))
                started += 1
        return started

    def load(self, chain: Sequence[BlockHash], want: Sequence[BlockIdentity],
             mismatch: Callable[[BlockHash, BlockIdentity, BlockIdentity], None]
             ) -> list[BlockData]:
        """The verified blocks of ``chain`` (each expected to be ``want[i]``), in order,
        stopping at the first that is missing, fails verification (dropped and counted) or is
        another block under the same hash (reported to ``mismatch``, kept).
        """
        self._start_reads(chain)
        out: list[BlockData] = []
        reads: list[_Read] = []
        for h, identity in zip(chain, want):
            block = self._load_one(h, reads)
            if block is None:
                break
            if block.record.identity != identity:
                mismatch(h, identity, block.record.identity)
                break
            out.append(block)
        self._observe(reads)
        for h in chain[len(out):]:  # reads started for blocks after a failure are not needed
            self._reads.pop(h, None)
        if out:
            self.ledger.match([b.record.block for b in out])
            self.ledger.touch(self.ledger.chain_to(out[-1].record.block))  # disk ancestors too
            for b in out:
                self._writer.touch(b.record.block)
        return out

    def _load_one(self, h: BlockHash, reads: list[_Read]) -> BlockData | None:
        pending = self._writer.pending(h)
        future = self._reads.pop(h, None)
        if pending is not None:
            return BlockData(pending.record, pending.keys, pending.values)
        path = block_path(self.directory, h)
        if future is None:  # pending when the reads were started, written since: read it now
            future = self._pool.submit(self._read_file, path)
        try:
            read = future.result()
            data = read.data
            block = decode_block(data, path)
            if block.record.block != h:
                raise CorruptBlock(f"{path}: holds block {block.record.block:032x}")
        except (CorruptBlock, FileNotFoundError):
            self._corrupt += 1
            self.ledger.invalidate_prefix([h])  # its file and its subtree go
            return None
        self._read_counts[0] += 1
        self._read_counts[1] += len(data)
        self._read_counts[2] += read.end - read.start
        reads.append(read)
        return block

    def _observe(self, reads: list[_Read]) -> None:
        """One lookup's files: their bytes over the wall time it took to read them all."""
        if not reads:
            return
        span = max(r.end for r in reads) - min(r.start for r in reads)
        if span > 0:
            read_bytes = sum(len(r.data) for r in reads)
            self._read_rate = moving_average(self._read_rate, read_bytes / span)

    @staticmethod
    def _read_file(path: Path) -> _Read:
        start = time.perf_counter()
        data = path.read_bytes()
        return _Read(data, start, time.perf_counter())

    # ---- invalidation, expiry ------------------------------------------------------------

    def invalidate_namespace(self, label: str) -> int:
        if label not in self.ledger.namespaces():
            return 0
        return self.ledger.invalidate_namespace(label)

    def invalidate_prefix(self, chain: Sequence[BlockHash]) -> int:
        return self.ledger.invalidate_prefix(chain)

    def expire(self) -> int:
        return len(self.ledger.expire())

    # ---- internals -----------------------------------------------------------------------

    def _space_returned(self, tokens: int) -> bool:
        """While full: whether the file system has room for ``RESUME_BLOCKS`` blocks of
        ``tokens`` tokens again (looked at every ``FULL_RECHECK_S``); if so, writes resume."""
        now = self._clock()
        if now - max(self._writer.full_since, self._checked_at) < FULL_RECHECK_S:
            return False
        self._checked_at = now
        try:
            fs = os.statvfs(self.directory)
        except OSError:  # the directory went away: stay full, the memory tier carries on
            return False
        free = fs.f_bavail * fs.f_frsize
        if free < RESUME_BLOCKS * tokens * self.ledger.bytes_per_token:
            return False
        self._writer.resume()
        log.warning("disk tier %s has %.1f MB free again: writes resume", self.directory,
                    free / 1e6)
        return True

    def _removed(self, block: BlockHash, reason: RemovalReason) -> None:
        self._tokens.pop(block, None)
        self._reads.pop(block, None)
        self._writer.delete(block)

    def _reap(self) -> None:
        """Forget blocks the writer could not write (disk full or an I/O error), and every
        block once the directory was found removed (their files went with it)."""
        if self._writer.take_lost():
            self._directory_lost()
        for h in self._writer.take_failed():
            if h in self.ledger:
                self.ledger.invalidate_prefix([h])

    def _directory_lost(self) -> None:
        """Forget the blocks whose files went with the directory (not those written since,
        nor those still queued), and hold the new directory's lock."""
        gone = [h for h in self._held() if self._writer.pending(h) is None
                and not block_path(self.directory, h).exists()]
        for h in gone:
            if h in self.ledger:  # a subtree removed earlier in this loop took it already
                self._lost_blocks += self.ledger.invalidate_prefix([h])
        os.close(self._lock_fd)  # the lock's file went with the directory: take it again
        self._lock_fd = lock_directory(self.directory)

    def _held(self) -> list[BlockHash]:
        return [holding.block for holding in self.ledger.holdings()]

    def _index(self) -> StartCounts:
        found = scan(self.directory, self.model, self.revision, self.ledger.ttl_s, self._wall())
        keep = found.newest_within(self.ledger.capacity_bytes, self.ledger.bytes_per_token)
        clock_now = self._clock()
        for record, age_s in reversed(keep):  # oldest first, children before parents
            self.ledger.restore(record.block, record.parent, len(record.tokens),
                                record.namespace, clock_now - age_s)
            self._tokens[record.block] = b"".join(t.to_bytes(4, "little") for t in record.tokens)
        counts = found.counts
        if counts.outdated:
            log.warning("disk tier %s: %d block files of an older format deleted (the cache "
                        "key changed; they are recomputed on use)", self.directory,
                        counts.outdated)
        return StartCounts(len(keep), counts.torn, counts.foreign, counts.expired,
                           counts.over_budget, counts.outdated)


def _free_bytes(directory: Path) -> int | None:
    try:
        fs = os.statvfs(directory)
    except OSError:
        return None
    return fs.f_bavail * fs.f_frsize
