"""Which blocks of a ``router.block_table.BlockTable`` were used least recently.

Every stored key and every ``touch`` is one tick of the table's clock; ``step = max_entries //
GENERATIONS`` ticks make a generation (64 generations to a budget's worth of stores), and a
slot's stamp (uint8) is the generation of its last use. ``oldest`` picks the ``n`` highest
ages, ties in slot order. Ages stay below 256: once every 64 generations every age above
``MAX_AGE = 128`` is clamped to 128 (``clamp``), so entries unused for more than 128
generations tie.
"""
from __future__ import annotations

from typing import Callable, Iterable

import numpy as np

GENERATIONS = 64
MAX_AGE = 128


def oldest(stamps: np.ndarray, chunks: Callable[[], Iterable[np.ndarray]], generation: int,
           n: int) -> np.ndarray:
    """The ``n`` slots of highest age at ``generation``, ties in slot order; ``chunks()``
    gives the occupied slots (``n`` or more), a chunk at a time."""
    now = np.uint8(generation & 0xFF)
    ages = np.zeros(256, np.int64)
    for live in chunks():
        ages += np.bincount(now - stamps[live], minlength=256)  # uint8: wraps to ages
    cut = 255 - int(np.searchsorted(np.cumsum(ages[::-1]), n))  # the age the n-th has
    wanted_at_cut = n - int(ages[cut + 1:].sum())
    older, at_cut = [np.zeros(0, np.intp)], []
    for live in chunks():
        age = now - stamps[live]
        older.append(live[age > cut])
        if wanted_at_cut > 0:
            at_cut.append(live[age == cut][:wanted_at_cut])
            wanted_at_cut -= len(at_cut[-1])
    return np.concatenate(older + at_cut)


def clamp(stamps: np.ndarray, before: int, now: int, chunk: int) -> None:
    """The clock went from generation ``before`` into a new run of ``GENERATIONS`` at ``now``:
    clamp every age above ``MAX_AGE`` to it, ``chunk`` slots at a time, in place."""
    jump, clamped = now - before, np.uint8((now - MAX_AGE) & 0xFF)
    for lo in range(0, len(stamps), chunk):
        part = stamps[lo:lo + chunk]  # a view: written in place
        if jump >= MAX_AGE:
            part[:] = clamped
        else:  # ages before the jump are below 192, so uint8 arithmetic holds them
            part[np.uint8(before & 0xFF) - part > MAX_AGE - jump] = clamped
