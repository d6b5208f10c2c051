"""``router.block_ages``: the ages ``oldest`` reads over a table's chunks, and ``clamp``,
exactly, on slots given a chunk at a time."""
from __future__ import annotations

import numpy as np

from router.block_ages import MAX_AGE, clamp, oldest


def _stamps(generation: int, ages: list[int]) -> np.ndarray:
    return np.array([(generation - a) & 0xFF for a in ages], np.uint8)


class TestOldest:
    # slots 0..7 at generation 50, their ages; the occupied slots come in three chunks
    AGES = [5, 9, 9, 1, 9, 3, 7, 9]
    CHUNKS = ([0, 1, 2], [3, 4, 5], [6, 7])

    def _oldest(self, n: int) -> list[int]:
        stamps = _stamps(50, self.AGES)
        chunks = lambda: (np.array(c, np.intp) for c in self.CHUNKS)
        return oldest(stamps, chunks, 50, n).tolist()

    def test_ties_at_the_cut_are_taken_in_slot_order_across_chunks(self):
        assert self._oldest(3) == [1, 2, 4]   # three of the four aged 9: two, then one
        assert self._oldest(4) == [1, 2, 4, 7]

    def test_every_older_slot_then_the_first_at_the_cut(self):
        # the older in chunk order, then those at the cut's age
        assert self._oldest(5) == [1, 2, 4, 7, 6]      # the four aged 9, then the one aged 7
        assert self._oldest(6) == [1, 2, 4, 6, 7, 0]   # the five older than 5, then slot 0
        assert sorted(self._oldest(8)) == list(range(8))

    def test_ages_wrap_with_the_generation(self):
        # generation 3: stamps 250 and 2 are ages 9 and 1
        stamps = np.array([250, 2, 3], np.uint8)
        assert oldest(stamps, lambda: iter([np.arange(3)]), 3, 1).tolist() == [0]


class TestClamp:
    def test_within_a_run_only_ages_that_would_pass_max_age_are_clamped(self):
        """From generation 100 to 110 (10 generations): a slot aged more than 118 at 100
        would pass 128 and is clamped to 128 at 110; one aged 118 reaches 128 exactly. Ten
        slots, three to a chunk."""
        ages = [119, 0, 118, 125, 50, 119, 126, 1, 150, 118]
        stamps = _stamps(100, ages)
        clamp(stamps, 100, 110, 3)
        after = [(110 - int(s)) & 0xFF for s in stamps]
        assert after == [MAX_AGE, 10, 128, MAX_AGE, 60, MAX_AGE, MAX_AGE, 11, MAX_AGE, 128]
        assert stamps.tolist()[0] == (110 - MAX_AGE) & 0xFF

    def test_a_jump_of_max_age_or_more_clamps_every_slot(self):
        stamps = _stamps(10, [0, 5, 100, 180, 3])
        clamp(stamps, 10, 140, 2)
        assert stamps.tolist() == [(140 - MAX_AGE) & 0xFF] * 5
