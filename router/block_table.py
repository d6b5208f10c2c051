"""``BlockTable``: block keys to worker bitmasks in flat NumPy arrays, for ``router.held``.

A Python dict of 128-bit block hashes costs about 134 bytes a block (two int objects and an
entry: measured at 1M blocks, 32 workers); this table reserves ``entry_bytes`` = 22 bytes a
block at up to 32 workers. It is a hash table of 64-bit keys in buckets of ``BUCKET = 8``
slots, one row per slot::

    bucket       0                     1                           buckets - 1
    keys     [ k k k 0 0 0 0 0 ][ k k k k k k k k ]  ...  [ k 0 0 0 0 0 0 0 ]   0: empty
    masks    per slot: columns x words uint32 (bit b of word w is worker slot 32w + b),
             and one more row that is always zero: slot -1 (absent) reads as no holder
    stamps   per slot: uint8, the generation of the block's last use (eviction, below)
    passed   per bucket: uint8, keys stored past it because it was full (255 saturates)

- Keys: a block's 64-bit key, and the two buckets it may live in (``router.block_keys``).
- Two choices: a key may live in either of two buckets, ``first = ((key >> 32) x buckets) >>
  32`` and ``second``, the same over its low 32 bits; it is stored in the one with more room.
  With one choice (linear probing over buckets) at 0.8 of the slots used, 30% of the buckets
  had overflowed, runs of them were up to 34 long, and a lookup of a new prompt's 512 blocks
  took 196 us (the longest run decides); with two, overflow is rare and a lookup is two
  bucket reads per block. When both are full the key goes to the first later bucket after
  ``first`` with room (never ``second``), counting itself in ``passed`` of each bucket it
  skipped; a lookup goes on past ``first`` only while the key is absent and ``passed`` is
  non-zero there. Removing a key uncounts the buckets it skipped.
- Growth: by ``GROWTH = 1.5`` when a store would fill more than ``MAX_LOAD = 0.8`` of the
  slots, up to the budget's capacity (``max_entries / MAX_LOAD`` slots). Between growths the
  load is 0.53 to 0.8: 21 to 32 bytes a block at up to 32 workers. A growth rebuilds the
  arrays, a chunk at a time, and holds the old ones until the new ones are filled.
- Memory: arrays of ``MAP_BYTES`` (1 MiB) or more live in anonymous memory maps of their
  own, given back to the system when freed. Left to the C allocator, the arrays that growth
  frees stayed resident in its heap: 68 bytes a block at 1M blocks against the table's 22.
- Least recently used: every stored key and every ``touch`` is one tick of the clock, and a
  slot's stamp is the generation of its last use; ``oldest(n)`` picks the ``n`` highest ages
  (generations and ages: ``router.block_ages``).

A worker's batch of events is looked up and stored at once (``find``, ``add``: vectorised,
``PLACE_BATCH`` keys at a time so that each choice sees the ones before it, and a growth
reinserts every ``stride``-th slot at a time for the same reason); a match looks blocks up one
at a time (``find_one``, about 0.5 us through memoryviews, against 15 us for any NumPy call
sequence). The owner (``router.held``) reads and writes ``masks`` directly.
"""
from __future__ import annotations

import math
import mmap
from typing import Iterator

import numpy as np

from router.block_ages import GENERATIONS, MAX_AGE, clamp, oldest
from router.block_keys import homes_of

BUCKET = 8
MAX_LOAD = 0.8
GROWTH = 1.5
INITIAL_BUCKETS = 16
CHUNK = 1 << 16  # slots a whole-table pass takes at a time (its temporaries stay small)
MAP_BYTES = 1 << 20
CHOICE_ROUNDS = 4  # rounds of placement by two choices before probing on from the first
PLACE_BATCH = 1024  # keys placed at once: their choices see the table as it was before them


def entry_bytes(columns: int, words: int) -> int:
    """Bytes the budget reserves per block: a slot (key, masks, stamp, an eighth of a
    bucket's count) over ``MAX_LOAD``, rounded up."""
    return math.ceil((8 + 4 * columns * words + 1 + 1 / BUCKET) / MAX_LOAD)


def _zeros(shape: tuple[int, ...], dtype) -> np.ndarray:
    size = math.prod(shape) * np.dtype(dtype).itemsize
    if size < MAP_BYTES:
        return np.zeros(shape, dtype)
    if hasattr(mmap, "MAP_PRIVATE"):  # private, as the heap is: a forked child gets a copy
        pages = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    else:
        pages = mmap.mmap(-1, size)
    return np.frombuffer(pages, dtype).reshape(shape)


class BlockTable:
    """Keys to ``columns`` masks of ``words`` uint32 each, at most ``max_bytes`` of blocks."""

    def __init__(self, columns: int, max_bytes: int, words: int = 1) -> None:
        self.columns, self.words, self.max_bytes = columns, words, max_bytes
        self._budget()
        if self.max_entries < 1:
            raise ValueError(f"max_bytes must hold at least one block "
                             f"({entry_bytes(columns, words)} bytes), got {max_bytes}")
        if self._max_buckets >= 1 << 32:  # a bucket number times a 32-bit half fits 64 bits
            raise ValueError(f"max_bytes {max_bytes} is more than a table can address "
                             f"({(1 << 32) * BUCKET} slots): give it less")
        self._step = max(1, self.max_entries // GENERATIONS)  # ticks per generation
        self.count = 0
        self._ticks = 0
        self._allocate(min(INITIAL_BUCKETS, self._max_buckets))

    # ---- capacity ------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.masks.nbytes + self.stamps.nbytes + self.passed.nbytes

    def room(self) -> int:
        """Blocks that can still be added before something must be evicted."""
        return self.max_entries - self.count

    def widen(self) -> None:
        """One more word per column (32 more worker slots). The budget then holds fewer
        blocks: the owner evicts down to ``max_entries``, then calls ``fit``."""
        rows = len(self.masks)
        wider = _zeros((rows, self.columns, self.words + 1), np.uint32)
        wider[:, :, :self.words] = self.masks.reshape(rows, self.columns, self.words)
        self.words += 1
        self.masks = wider.reshape(rows, -1)
        self._views()
        self._budget()

    def fit(self) -> None:
        """Rebuild at the budget's capacity if the table has outgrown it (after ``widen``)."""
        if self.buckets > self._max_buckets:
            self._rebuild(self._max_buckets)

    def _budget(self) -> None:
        self.max_entries = self.max_bytes // entry_bytes(self.columns, self.words)
        self._max_buckets = max(1, math.ceil(self.max_entries / MAX_LOAD / BUCKET))

    def _allocate(self, buckets: int) -> None:
        self.buckets = buckets
        self.keys = _zeros((buckets, BUCKET), np.uint64)
        self.masks = _zeros((buckets * BUCKET + 1, self.columns * self.words), np.uint32)
        self.stamps = _zeros((buckets * BUCKET,), np.uint8)
        self.passed = _zeros((buckets,), np.uint8)
        self._flat = self.keys.reshape(-1)
        self._views()

    def _views(self) -> None:
        # Python-level views of the arrays for single lookups: indexing a memoryview costs a
        # tenth of indexing an array
        self._key_view = memoryview(self._flat)
        self._passed_view = memoryview(self.passed)
        self._stamp_view = memoryview(self.stamps)
        self._mask_view = memoryview(self.masks.reshape(-1))

    def _rebuild(self, buckets: int) -> None:
        old_keys, old_masks, old_stamps = self._flat, self.masks, self.stamps
        self._allocate(buckets)
        # Every stride-th slot at a time: keys in slot order share buckets, and placed
        # together their two choices cannot see each other (a rebuild in slot order left the
        # buckets as unevenly filled as one choice would)
        stride = -(-len(old_keys) // CHUNK)
        for lo in range(stride):
            live = lo + stride * np.flatnonzero(old_keys[lo::stride])
            slots = self._place(old_keys[live])
            self.masks[slots], self.stamps[slots] = old_masks[live], old_stamps[live]

    # ---- lookups -------------------------------------------------------------------------

    def find(self, keys: np.ndarray) -> np.ndarray:
        """The slot of each key (intp), -1 where absent."""
        homes = homes_of(keys, self.buckets)
        both = homes.reshape(-1)  # per key: its second bucket, then its first
        rows = self.keys.take(both, axis=0).reshape(len(keys), 2 * BUCKET)
        key, at = np.nonzero(rows == keys[:, None])
        slots = np.full(len(keys), -1, np.intp)
        slots[key] = both[2 * key + (at >> 3)] * BUCKET + (at & (BUCKET - 1))
        further = self.passed.take(homes[:, 1]) > 0
        further &= slots < 0
        if further.any():
            self._find_further(keys, slots, np.flatnonzero(further), homes[:, 1])
        return slots

    def _find_further(self, keys: np.ndarray, slots: np.ndarray, todo: np.ndarray,
                      first: np.ndarray) -> None:
        """Go on past ``first`` for the keys at ``todo`` (in neither of their buckets)."""
        bucket = first[todo]
        for _ in range(self.buckets):  # a bound: each round moves the rest one bucket on
            bucket = (bucket + 1) % self.buckets
            equal = self.keys.take(bucket, axis=0) == keys[todo, None]
            hit = equal.view(np.uint64).ravel() != 0
            slots[todo[hit]] = bucket[hit] * BUCKET + equal[hit].argmax(1)
            on = ~hit & (self.passed.take(bucket) > 0)
            if not on.any():
                return
            todo, bucket = todo[on], bucket[on]
        raise RuntimeError("a lookup walked every bucket of the table")

    def find_one(self, key: int) -> int | None:
        """``find`` for one key, without NumPy's per-call cost (about 0.5 us)."""
        keys, buckets = self._key_view, self.buckets
        first = ((key >> 32) * buckets) >> 32
        at = first * BUCKET
        row = keys[at:at + BUCKET].tolist()
        if key in row:
            return at + row.index(key)
        at = (((key & 0xFFFFFFFF) * buckets) >> 32) * BUCKET
        row = keys[at:at + BUCKET].tolist()
        if key in row:
            return at + row.index(key)
        bucket = first
        for _ in range(buckets):  # on past full buckets, while someone went past
            if not self._passed_view[bucket]:
                return None
            bucket = (bucket + 1) % buckets
            row = keys[bucket * BUCKET:(bucket + 1) * BUCKET].tolist()
            if key in row:
                return bucket * BUCKET + row.index(key)
        raise RuntimeError("a lookup walked every bucket of the table")

    def row_words(self, slot: int) -> tuple[int, int]:
        """The two columns' masks of ``slot`` in a table of two columns of one word."""
        return self._mask_view[2 * slot], self._mask_view[2 * slot + 1]

    def row(self, slot: int | None) -> list[int]:
        """The mask words of ``slot`` (all zero for None), columns one after the other."""
        width = self.columns * self.words
        at = len(self.masks) - 1 if slot is None else slot  # the last row is always zero
        return self._mask_view[at * width:(at + 1) * width].tolist()

    def chunks(self) -> Iterator[np.ndarray]:
        """The occupied slots, ``CHUNK`` slots of the table at a time."""
        for lo in range(0, len(self._flat), CHUNK):
            yield lo + np.flatnonzero(self._flat[lo:lo + CHUNK])

    # ---- updates -------------------------------------------------------------------------

    def add(self, keys: np.ndarray) -> np.ndarray:
        """Store absent, distinct ``keys`` (at most ``room()``); their slots, stamped newest,
        in order (the first is the oldest)."""
        if len(keys) > self.room():
            raise RuntimeError(f"adding {len(keys)} blocks to a table with room for "
                               f"{self.room()}: evict first")
        need = self.count + len(keys)
        if need > MAX_LOAD * self.buckets * BUCKET and self.buckets < self._max_buckets:
            grown = max(math.ceil(self.buckets * GROWTH), math.ceil(need / MAX_LOAD / BUCKET))
            self._rebuild(min(grown, self._max_buckets))
        slots = self._place(keys)
        self.count += len(keys)
        ticks = self._ticks + np.arange(1, len(keys) + 1)
        self._advance(len(keys))
        oldest_kept = self._ticks - MAX_AGE * self._step  # no new stamp is clamped later
        self.stamps[slots] = (np.maximum(ticks, oldest_kept) // self._step) & 0xFF
        return slots

    def remove(self, slots: np.ndarray) -> None:
        """Empty ``slots`` (distinct, occupied)."""
        if not len(slots):
            return
        homes = homes_of(self._flat[slots], self.buckets)
        first, second = homes[:, 1], homes[:, 0]
        bucket = slots // BUCKET
        skipped = np.where(bucket == second, 0, (bucket - first) % self.buckets)
        for step in range(int(skipped.max(initial=0))):
            self._count_passed((first[skipped > step] + step) % self.buckets, -1)
        self._flat[slots] = 0
        self.masks[slots] = 0
        self.count -= len(slots)

    def touch(self, slots: np.ndarray | list[int]) -> None:
        """Stamp ``slots`` as used now: one tick of the clock, like one stored block. A few
        (a match's, as a list) are stamped one by one: NumPy's call costs more."""
        if not len(slots):
            return
        self._advance(1)
        generation = self._generation() & 0xFF
        if isinstance(slots, list):
            stamps = self._stamp_view
            for slot in slots:
                stamps[slot] = generation
        else:
            self.stamps[slots] = generation

    def oldest(self, n: int) -> np.ndarray:
        """The ``n`` least recently used slots (fewer if the table holds fewer)."""
        return oldest(self.stamps, self.chunks, self._generation(), min(n, self.count))

    def _generation(self) -> int:
        return self._ticks // self._step

    def _advance(self, ticks: int) -> None:
        """Move the clock on. Each time it enters a new run of ``GENERATIONS`` generations,
        ages above ``MAX_AGE`` are clamped to it, so that no age ever reaches 256 (between
        two clamps they grow by less than ``GENERATIONS``)."""
        before = self._generation()
        self._ticks += ticks
        now = self._generation()
        if before // GENERATIONS != now // GENERATIONS:
            clamp(self.stamps, before, now, CHUNK)

    def _place(self, keys: np.ndarray) -> np.ndarray:
        """Put absent, distinct ``keys`` in their buckets; their slots."""
        if len(keys) > PLACE_BATCH:  # a choice must see the ones before it
            return np.concatenate([self._place(keys[lo:lo + PLACE_BATCH])
                                   for lo in range(0, len(keys), PLACE_BATCH)])
        slots = np.empty(len(keys), np.intp)
        homes = homes_of(keys, self.buckets)
        first, second = homes[:, 1], homes[:, 0]
        todo = np.arange(len(keys))
        for _ in range(CHOICE_ROUNDS):
            if not len(todo):
                return slots
            a, b = first[todo], second[todo]
            target = np.where(self._room_in(b) > self._room_in(a), b, a)
            todo = todo[~self._fill(keys, todo, target, slots)]
        bucket = first[todo]  # both full: on from the first choice, never into the second
        for _ in range(self.buckets + 1):  # a bound: each round moves the rest one bucket on
            if not len(todo):
                return slots
            placed = self._fill(keys, todo, bucket, slots, avoid=second[todo])
            self._count_passed(bucket[~placed], 1)
            todo, bucket = todo[~placed], (bucket[~placed] + 1) % self.buckets
        raise RuntimeError("no bucket had room: the table is over its capacity")

    def _room_in(self, buckets: np.ndarray) -> np.ndarray:
        return (self.keys.take(buckets, axis=0) == 0).sum(1)

    def _fill(self, keys: np.ndarray, todo: np.ndarray, bucket: np.ndarray,
              slots: np.ndarray, avoid: np.ndarray | None = None) -> np.ndarray:
        """Put ``keys[todo]`` into ``bucket`` (one each) where there is room, first come first
        served; record their slots; which were placed."""
        empty = self.keys.take(bucket, axis=0) == 0
        rank = _ranks(bucket)
        fits = rank < empty.sum(1)
        if avoid is not None:
            fits &= bucket != avoid
        # the rank-th empty slot of the row: the slots before it hold rank empties or fewer
        column = (np.cumsum(empty, axis=1, dtype=np.uint8) <= rank[:, None]).sum(1)
        placed = bucket[fits] * BUCKET + column[fits]
        self._flat[placed] = keys[todo[fits]]
        slots[todo[fits]] = placed
        return fits

    def _count_passed(self, buckets: np.ndarray, sign: int) -> None:
        if not len(buckets):
            return
        where, times = np.unique(buckets, return_counts=True)
        counts = self.passed[where].astype(np.int64)
        keep = counts < 255  # a saturated count stays: it may undercount otherwise
        counts[keep] = np.clip(counts[keep] + sign * times[keep], 0, 255)
        self.passed[where] = counts


def _ranks(values: np.ndarray) -> np.ndarray:
    """How many earlier entries of ``values`` equal each one (0 for the first of each)."""
    order = np.argsort(values, kind="stable")
    ranked = values[order]
    at = np.arange(len(values))
    first = np.ones(len(values), bool)
    first[1:] = ranked[1:] != ranked[:-1]
    rank = np.empty(len(values), np.intp)
    rank[order] = at - np.maximum.accumulate(np.where(first, at, 0))
    return rank

