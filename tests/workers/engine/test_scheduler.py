"""Admission order, the budget split and the stall-bounded budget, with exact values."""
from __future__ import annotations

import pytest

from workers.engine.scheduler import (Admission, StepBudget, interactive_first, split_budget,
                                      this_step)
from workers.messages import Priority


def test_tenants_take_turns_and_each_keeps_its_order():
    queue: Admission[str] = Admission()
    for key in ["a1", "a2", "a3", "a4"]:
        queue.push("a", key, key)
    queue.push("b", "b1", "b1")
    queue.push("c", "c1", "c1")
    queue.push("c", "c2", "c2")
    order = [queue.pop() for _ in range(len(queue))]
    assert order == ["a1", "b1", "c1", "a2", "c2", "a3", "a4"]
    assert queue.pop() is None and len(queue) == 0


def test_a_tenant_that_comes_back_goes_to_the_end_of_the_turn():
    queue: Admission[str] = Admission()
    queue.push("a", "a1", "a1")
    queue.push("b", "b1", "b1")
    assert queue.pop() == "a1"  # a's deque is empty and gone
    queue.push("a", "a2", "a2")
    assert [queue.pop(), queue.pop()] == ["b1", "a2"]


def test_remove_by_key():
    queue: Admission[str] = Admission()
    queue.push("a", "a1", "x")
    queue.push("a", "a2", "y")
    queue.push("b", "b1", "z")
    assert queue.remove("a1") and not queue.remove("a1")
    assert queue.remove("b1")
    assert list(queue.keys()) == ["a2"] and queue.pop() == "y"


def test_interactive_items_are_popped_before_queued_batch_items():
    queue: Admission[str] = Admission()
    for key in ["b1", "b2", "b3"]:
        queue.push("jobs", key, key, Priority.BATCH)
    queue.push("x", "x1", "x1", Priority.BATCH)
    queue.push("people", "i1", "i1")
    queue.push("people", "i2", "i2", Priority.INTERACTIVE)
    queue.push("other", "o1", "o1")
    assert list(queue.keys()) == ["i1", "i2", "o1", "b1", "b2", "b3", "x1"]
    order = [queue.pop() for _ in range(len(queue))]
    assert order == ["i1", "o1", "i2", "b1", "x1", "b2", "b3"]


def test_remove_finds_a_key_in_either_lane():
    queue: Admission[str] = Admission()
    queue.push("a", "b1", "b1", Priority.BATCH)
    queue.push("a", "i1", "i1")
    assert queue.remove("b1") and len(queue) == 1
    assert queue.pop() == "i1" and queue.pop() is None


def test_batch_items_leave_the_last_seat_to_an_interactive_one():
    queue: Admission[str] = Admission()
    for key in ["b1", "b2", "b3"]:
        queue.push("jobs", key, key, Priority.BATCH)
    assert queue.pop_seated(used=2, seats=4) == "b1"
    assert queue.pop_seated(used=3, seats=4) is None  # the last seat is kept
    queue.push("people", "i1", "i1")
    assert queue.pop_seated(used=3, seats=4) == "i1"
    assert queue.pop_seated(used=4, seats=4) is None
    assert queue.pop_seated(used=0, seats=1) == "b2"  # one seat: nothing to keep
    assert list(queue.keys()) == ["b3"]


class _Job:
    def __init__(self, name: str, need: int, priority: Priority):
        self.name, self.need, self.priority, self.first_block = name, need, priority, None


def test_an_interactive_prompt_takes_the_step_budget_ahead_of_older_batch_prompts():
    jobs = [_Job("b1", 400, Priority.BATCH), _Job("b2", 400, Priority.BATCH),
            _Job("i1", 30, Priority.INTERACTIVE), _Job("i2", 50, Priority.INTERACTIVE)]
    ordered = interactive_first(jobs, lambda job: job.priority)
    assert [j.name for j in ordered] == ["i1", "i2", "b1", "b2"]
    chosen = this_step(ordered, 64)
    assert [j.name for j in chosen] == ["i1", "i2"]
    assert split_budget([j.need for j in chosen], 64) == [30, 34]


def test_budget_goes_to_the_oldest_first():
    assert split_budget([300, 300, 50], 512) == [300, 212, 0]
    assert split_budget([100, 0, 60, 40], 512) == [100, 0, 60, 40]
    assert split_budget([4000], 16) == [16]
    assert split_budget([], 512) == []
    with pytest.raises(ValueError):
        split_budget([1], -1)


def test_step_budget_bounds_the_stall():
    budget = StepBudget(max_tokens=512, stall=2.0, min_tokens=16)
    assert budget.tokens(decoding=False) == 512
    assert budget.tokens(decoding=True) == 16  # nothing measured yet
    budget.observe_decode(0.05)
    budget.observe_prefill(5000, 1.0, decoding=False)  # a pass alone: not the rate beside decodes
    assert budget.tokens(decoding=True) == 16  # still nothing measured beside decodes
    budget.observe_prefill(200, 1.0, decoding=True)  # 200 tokens/s
    assert budget.tokens(decoding=True) == 16  # (2 - 1) x 0.05 s x 200 = 10 -> the floor
    budget.observe_prefill(2000, 1.0, decoding=True)  # moving average: 0.7 x 200 + 0.3 x 2000
    assert budget.tokens(decoding=True) == 37  # 0.05 x 740
    budget.observe_decode(10.0)
    assert budget.tokens(decoding=True) == 512  # the ceiling
    with pytest.raises(ValueError, match="stall must be > 1.0"):
        StepBudget(stall=1.0)
    with pytest.raises(ValueError, match="min_tokens"):
        StepBudget(max_tokens=8, min_tokens=16)
