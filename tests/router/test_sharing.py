"""Shared prefixes (``router.sharing.SharedPrefixes``): a branch point continued two ways marks
its prefix shared, one conversation's own history never does, marks are prefix-closed and
memory is bounded."""
from __future__ import annotations

import pytest

from router.kv.key import BlockHash
from router.sharing import SharedPrefixes


def chain(*ids: int) -> list[BlockHash]:
    return [BlockHash(i) for i in ids]


class TestNote:
    def test_a_second_different_continuation_marks_the_prefix_shared(self):
        shared = SharedPrefixes()
        shared.note(chain(1, 2, 10, 11), 2)   # first continuation of S1 (block 2): 10
        assert len(shared) == 0
        shared.note(chain(1, 2, 10, 12), 3)   # the same conversation, a turn later
        assert len(shared) == 0
        shared.note(chain(1, 2, 20), 2)       # a different continuation of block 2
        assert len(shared) == 2
        assert shared.depth(chain(1, 2, 30), 3) == 2

    def test_a_conversation_continuing_its_own_history_is_never_shared(self):
        shared = SharedPrefixes()
        turns = [chain(1, 2), chain(1, 2, 3, 4), chain(1, 2, 3, 4, 5, 6)]
        for previous, turn in zip(turns, turns[1:]):
            shared.note(turn, len(previous))
        assert len(shared) == 0
        assert shared.depth(turns[-1], 6) == 0

    def test_no_match_or_a_whole_match_notes_nothing(self):
        shared = SharedPrefixes()
        shared.note(chain(1, 2), 0)
        shared.note(chain(1, 2), 2)
        shared.note(chain(1, 3), 2)
        assert len(shared) == 0


class TestDepth:
    def test_the_deepest_shared_block_within_the_bound(self):
        shared = SharedPrefixes()
        shared.note(chain(1, 2, 3, 4, 10), 4)
        shared.note(chain(1, 2, 3, 4, 20), 4)   # blocks 1..4 shared
        assert shared.depth(chain(1, 2, 3, 4, 30), 5) == 4
        assert shared.depth(chain(1, 2, 3, 4, 30), 2) == 2
        assert shared.depth(chain(1, 2), 9) == 2
        assert shared.depth(chain(7, 8, 9), 3) == 0   # another prefix


class TestBounds:
    def test_past_max_entries_the_oldest_are_dropped(self):
        shared = SharedPrefixes(max_entries=2)
        shared.note(chain(1, 10), 1)
        shared.note(chain(1, 11), 1)           # 1 shared
        shared.note(chain(2, 10), 1)
        shared.note(chain(2, 11), 1)           # 2 shared
        shared.note(chain(3, 10), 1)
        shared.note(chain(3, 11), 1)           # 3 shared: past the bound, the oldest goes
        assert len(shared) == 1
        assert [shared.depth(chain(b, 99), 1) for b in (1, 2, 3)] == [0, 0, 1]

    def test_max_entries_must_be_positive(self):
        with pytest.raises(ValueError) as refused:
            SharedPrefixes(0)
        assert str(refused.value) == "max_entries must be positive, got 0"
