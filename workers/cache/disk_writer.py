"""Write-behind for the disk tier: one background thread that writes, deletes and touches files.

The engine's thread never waits on the disk. ``DiskWriter.write`` queues a block and returns;
the thread takes everything queued at once (a batch), writes each block to ``<name>.tmp`` and
renames it into place, then goes back to sleep. Until its file is complete a queued block is
*pending*: ``pending(block)`` hands its arrays to a reader, so a block is never unreadable in
between. A delete cancels a pending write and removes the file.

Disk full (``ENOSPC``, ``EDQUOT``) stops all further writes: the thread logs one warning,
reports the blocks it could not write (``take_failed``) so the tier forgets them, and the
memory tier carries on. The tier, which watches the free space, calls ``resume`` once there
is room again. Any other ``OSError`` fails that one block the same way.

A directory removed under the running tier (``rm -rf``) is made again by the next write,
with one warning, and reported (``take_lost``): the tier forgets the blocks it held there
(their files are gone) and writes go on. No restart, and no warning per block.

The thread touches no ledger: it only reports. ``flush`` waits until the queue is empty.

Nothing waits on the thread without a bound. An exception the thread does not expect (a bug:
a block it cannot encode) stops it; it logs the error once, and from then on every ``flush``
and ``close`` raises ``WriterStopped`` naming that error at once, and every write is refused
like one on a full disk (the tier forgets the block). A thread that is alive but does not
finish a flush within ``FLUSH_LIMIT_S`` (a disk that no longer answers) makes ``flush``
raise ``WriterStopped`` too, saying how many writes are still queued.
"""
from __future__ import annotations

import errno
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import mlx.core as mx

from router.kv.key import BlockHash
from workers.cache.disk_files import BlockRecord, TMP_SUFFIX, block_path, write_block

log = logging.getLogger(__name__)

_FULL = (errno.ENOSPC, errno.EDQUOT)
# A flush writes at most the blocks queued before it; even a memory tier of 100 GB written
# at close on a 500 MB/s disk takes under 4 minutes, so 10 minutes means the disk hangs.
FLUSH_LIMIT_S = 600.0
_POLL_S = 0.05  # how often a waiting flush looks whether the thread is still alive


class WriterStopped(RuntimeError):
    """The disk tier's writer thread stopped on an error, or a flush ran past its limit."""


@dataclass(frozen=True, slots=True)
class PendingBlock:
    record: BlockRecord
    keys: tuple[mx.array, ...]
    values: tuple[mx.array, ...]


@dataclass(frozen=True, slots=True)
class _Delete:
    block: BlockHash


@dataclass(frozen=True, slots=True)
class _Touch:
    block: BlockHash


@dataclass(frozen=True, slots=True)
class _Flush:
    done: threading.Event = field(default_factory=threading.Event)


@dataclass(slots=True)
class WriterCounts:
    written_blocks: int = 0
    written_bytes: int = 0
    write_s: float = 0.0
    batches: int = 0
    failed: int = 0


class DiskWriter:
    """The disk tier's background writer for ``directory``."""

    def __init__(self, directory: Path, clock: Callable[[], float] = time.monotonic) -> None:
        self.directory = directory
        self.full = False
        self.full_since = 0.0  # the tier's clock when a write last found the disk full
        self._clock = clock
        self.counts = WriterCounts()
        self._lock = threading.Lock()
        self._pending: dict[BlockHash, PendingBlock] = {}
        self._failed: list[BlockHash] = []
        self._lost = 0  # times the directory was found removed and made again
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None  # what stopped the thread, if anything did
        self._thread = threading.Thread(target=self._run, name=f"orchard-disk-{directory.name}",
                                        daemon=True)
        self._thread.start()

    # ---- the engine's side ---------------------------------------------------------------

    def write(self, block: PendingBlock) -> None:
        if self.error is not None:  # nobody would write it: refused, like on a full disk
            self._fail(block.record.block)
            return
        with self._lock:
            self._pending[block.record.block] = block
        self._queue.put(block)

    def delete(self, block: BlockHash) -> None:
        with self._lock:
            self._pending.pop(block, None)
        self._queue.put(_Delete(block))

    def touch(self, block: BlockHash) -> None:
        """Set the file's mtime to now: a restart reads last use from it."""
        self._queue.put(_Touch(block))

    def pending(self, block: BlockHash) -> PendingBlock | None:
        with self._lock:
            return self._pending.get(block)

    def pending_count(self) -> int:
        with self._lock:
            return len(self._pending)

    def take_failed(self) -> list[BlockHash]:
        with self._lock:
            failed, self._failed = self._failed, []
        return failed

    def take_lost(self) -> int:
        """How many times the directory was found removed (and made again) since last asked."""
        with self._lock:
            lost, self._lost = self._lost, 0
        return lost

    def resume(self) -> None:
        """Write again after a full disk (the tier saw free space return)."""
        self.full = False

    def flush(self, limit_s: float = FLUSH_LIMIT_S) -> None:
        """Wait until what was queued before is done; ``WriterStopped`` if the thread stopped
        (at once) or has not got there within ``limit_s``."""
        op = _Flush()
        self._queue.put(op)
        deadline = time.monotonic() + limit_s
        while not op.done.wait(_POLL_S):
            self._check()
            if time.monotonic() >= deadline:
                raise WriterStopped(
                    f"disk tier {self.directory}: a flush is not done after {limit_s:g} s, "
                    f"{self.pending_count()} writes still queued (does the disk answer?)")
        self._check()

    def close(self) -> None:
        """Stop the thread once the queue is done; ``WriterStopped`` if it had stopped on an
        error (its writes since were not made)."""
        self._queue.put(None)
        self._thread.join(FLUSH_LIMIT_S)
        self._check()
        if self._thread.is_alive():
            raise WriterStopped(f"disk tier {self.directory}: the writer has not finished "
                                f"after {FLUSH_LIMIT_S:g} s (does the disk answer?)")

    def _check(self) -> None:
        if self.error is not None:
            raise WriterStopped(f"disk tier {self.directory}: the writer thread stopped on "
                                f"{self.error!r}; blocks spilled since were not written")

    # ---- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # a bug: say so once; flush and close raise it
            with self._lock:  # nothing queued will be written: the tier forgets those blocks
                self.error = exc
                self._failed.extend(self._pending)
                self.counts.failed += len(self._pending)
                self._pending.clear()
            log.exception("disk tier %s: the writer thread stopped", self.directory)

    def _serve(self) -> None:
        while True:
            batch = [self._queue.get()]
            while True:  # take what else is queued: one batch per wake-up
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = False
            start = time.perf_counter()
            wrote = 0
            for op in batch:
                if op is None:
                    stop = True
                elif isinstance(op, PendingBlock):
                    wrote += self._write(op)
                elif isinstance(op, _Delete):
                    _unlink(block_path(self.directory, op.block))
                elif isinstance(op, _Touch):
                    _touch(block_path(self.directory, op.block))
                else:
                    op.done.set()
            if wrote:
                with self._lock:
                    self.counts.write_s += time.perf_counter() - start
                    self.counts.batches += 1
            if stop:
                return

    def _write(self, op: PendingBlock) -> int:
        h = op.record.block
        with self._lock:
            if self._pending.get(h) is not op:
                return 0  # deleted (or queued again) since
        if self.full:
            self._fail(h)
            return 0
        path = block_path(self.directory, h)
        tmp = path.with_name(path.name + TMP_SUFFIX)
        try:
            if not self.directory.is_dir():
                self._remake_directory()
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                size = write_block(f, op.record, op.keys, op.values)
            os.replace(tmp, path)
        except OSError as exc:
            _unlink(tmp)
            if exc.errno in _FULL and not self.full:
                self.full_since = self._clock()
                self.full = True
                log.warning("disk tier %s is full (%s): writes to it stop until space is "
                            "free again, the memory tier carries on", self.directory,
                            exc.strerror)
            elif exc.errno not in _FULL:
                log.warning("disk tier %s: cannot write block %032x: %s", self.directory, h, exc)
            self._fail(h)
            return 0
        with self._lock:
            if self._pending.get(h) is op:
                del self._pending[h]
            self.counts.written_blocks += 1
            self.counts.written_bytes += size
        return 1

    def _remake_directory(self) -> None:
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        with self._lock:
            self._lost += 1
        log.warning("disk tier %s was removed while in use: made it again; the blocks it "
                    "held are forgotten and recomputed on use, new blocks are written",
                    self.directory)

    def _fail(self, h: BlockHash) -> None:
        with self._lock:
            self._pending.pop(h, None)
            self._failed.append(h)
            self.counts.failed += 1


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except FileNotFoundError:
        pass
