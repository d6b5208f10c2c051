"""Load shedding: the predicted TTFT from the queue and the measured averages, the bound,
and the exact Retry-After."""
from __future__ import annotations

import pytest

from cluster.jobs.admission import Overloaded, RetryLater
from cluster.jobs.shedding import LoadShedder, Prediction, QueueState, Shed


def _measured(max_ttft_s: float = 0.0, slot_s: float = 2.0, ttft_s: float = 0.5) -> LoadShedder:
    shedder = LoadShedder(max_ttft_s)
    shedder.observe_slot(slot_s)
    shedder.observe_ttft(ttft_s)
    return shedder


def test_nothing_is_predicted_or_shed_before_both_averages_have_a_measurement():
    shedder = LoadShedder(max_ttft_s=1.0)
    full = QueueState(capacity=4, in_use=4, ahead=100)
    assert shedder.predict(full) is None
    shedder.observe_slot(2.0)
    assert shedder.predict(full) is None and shedder.slot_s == 2.0
    shedder.check(full, remaining_s=0.1)  # nothing measured of TTFT yet: admitted


def test_a_free_slot_predicts_the_measured_ttft_alone():
    shedder = _measured()
    assert shedder.predict(QueueState(4, 3, 0)) == Prediction(0.0, 0.5)


def test_behind_a_queue_the_wait_is_the_queue_drained_at_capacity_over_slot_time():
    shedder = _measured()  # a slot is held 2 s: 4 slots free 2 a second
    # 7 ahead: the new one takes the 8th freed slot, 8 x 2 / 4 = 4 s, then 0.5 s to a token
    assert shedder.predict(QueueState(4, 4, 7)) == Prediction(4.0, 4.5)
    assert shedder.predict(QueueState(4, 4, 0)) == Prediction(0.5, 1.0)


def test_the_averages_move_as_the_engines_rates_do_and_the_ttfts_spread_counts_twice():
    shedder = _measured(slot_s=2.0, ttft_s=0.5)
    shedder.observe_slot(4.0)   # 0.7 x 2 + 0.3 x 4
    shedder.observe_ttft(1.5)   # 0.7 x 0.5 + 0.3 x 1.5; deviation |1.5 - 0.5|, the first
    assert shedder.slot_s == pytest.approx(2.6)
    # wait 2 x 2.6 / 2, then the TTFT's average and two deviations
    assert shedder.predict(QueueState(2, 2, 1)).ttft_s == pytest.approx(2.6 + 0.8 + 2 * 1.0)
    shedder.observe_ttft(0.8)   # on the average: the deviation falls to 0.7 x 1.0
    assert shedder.predict(QueueState(2, 1, 0)).ttft_s == pytest.approx(0.8 + 2 * 0.7)


def test_a_request_past_its_bound_is_shed_with_the_seconds_the_queue_needs():
    shedder = _measured(max_ttft_s=2.0)
    queue = QueueState(capacity=4, in_use=4, ahead=7)  # predicted 4.5 s
    with pytest.raises(Shed) as caught:
        shedder.check(queue, remaining_s=None)
    assert caught.value.retry_after_s == 3  # ceil(4.5 - 2.0): 5 of the 7 ahead must go
    assert isinstance(caught.value, RetryLater) and isinstance(caught.value, Overloaded)
    assert "4.50 s (7 waiting ahead of it for 4 slots), past its 2.00 s bound" in str(
        caught.value)
    with pytest.raises(Shed) as caught:  # the caller's deadline is the nearer bound
        shedder.check(queue, remaining_s=1.0)
    assert caught.value.retry_after_s == 4  # ceil(4.5 - 1.0), the whole 4 s wait at most
    shedder.check(QueueState(4, 4, 2), remaining_s=None)  # 3 x 0.5 + 0.5 = 2.0: met


def test_retry_after_is_at_most_the_wait_and_at_least_one_second():
    assert Prediction(wait_s=1.2, ttft_s=10.0).retry_after_s(bound_s=1.0) == 2
    assert Prediction(wait_s=0.0, ttft_s=3.0).retry_after_s(bound_s=1.0) == 1
    assert Prediction(wait_s=30.0, ttft_s=31.0).retry_after_s(bound_s=10.0) == 21


def test_without_a_bound_nothing_is_shed():
    shedder = _measured()
    shedder.check(QueueState(1, 1, 10_000), remaining_s=None)
    assert shedder.bound(None) is None and shedder.bound(3.0) == 3.0


def test_a_negative_bound_is_refused():
    with pytest.raises(ValueError, match="max_ttft_s must be >= 0"):
        LoadShedder(-1.0)


def test_by_default_only_the_callers_deadline_bounds():
    shedder = LoadShedder()
    assert shedder.bound(None) is None and shedder.bound(3.0) == 3.0


def test_a_measurement_of_no_time_moves_no_average():
    shedder = _measured(slot_s=0.5, ttft_s=0.5)   # under a second counts
    shedder.observe_slot(0.0)
    shedder.observe_ttft(0.0)
    assert shedder.slot_s == 0.5
    assert shedder.predict(QueueState(4, 4, 3)) == Prediction(0.5, 1.0)  # 4 x 0.5 / 4 + 0.5
