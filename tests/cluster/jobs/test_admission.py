"""Admission: pending requests per tenant and in all, refused whole past either limit, counted
back as they finish; a taken-over job's requests added without a second refusal."""
from __future__ import annotations

import pytest

from cluster.jobs.admission import Admission, Overloaded, RetryLater


def test_past_the_tenants_limit_is_refused_and_counts_nothing():
    a = Admission(max_per_tenant=5, max_total=100)
    a.admit("acme", 3)
    with pytest.raises(Overloaded, match="tenant 'acme' has 3 requests pending and the limit "
                                         "is 5"):
        a.admit("acme", 3)
    a.admit("acme", 2)   # exactly to the limit
    a.admit("beta", 5)   # another tenant's own limit
    assert a.pending() == {"acme": 5, "beta": 5}


def test_past_the_clusters_limit_is_refused():
    a = Admission(max_per_tenant=10, max_total=12)
    a.admit("acme", 8)
    with pytest.raises(Overloaded, match="the cluster has 8 requests pending and the limit is "
                                         "12"):
        a.admit("beta", 5)
    a.admit("beta", 4)
    assert a.pending() == {"acme": 8, "beta": 4}


def test_taken_over_requests_add_up_past_the_limits_and_release_to_nothing():
    a = Admission(max_per_tenant=5, max_total=5)
    a.add("acme", 4)
    a.add("acme", 4)     # accepted elsewhere once: never refused again
    a.add("acme", 0)
    assert a.pending() == {"acme": 8}
    with pytest.raises(Overloaded):
        a.admit("acme", 1)
    a.release("acme", 8)
    assert a.pending() == {}
    with pytest.raises(RuntimeError, match="pending count for 'acme' went negative \\(-1\\)"):
        a.release("acme", 1)


def test_admitted_counts_for_the_block_only():
    a = Admission(max_per_tenant=2, max_total=2)
    with a.admitted("acme", 2):
        assert a.pending() == {"acme": 2}
        with pytest.raises(Overloaded):
            a.admit("acme", 1)
    assert a.pending() == {}


def test_retry_later_carries_its_seconds():
    refusal = RetryLater("busy", 7)
    assert isinstance(refusal, Overloaded) and (str(refusal), refusal.retry_after_s) == ("busy", 7)


def test_a_restart_starts_again_from_the_stores_counts():
    a = Admission(max_per_tenant=5, max_total=100)
    a.admit("acme", 1)
    a.reset({"beta": 4})
    assert a.pending() == {"beta": 4}
    with pytest.raises(Overloaded):
        a.admit("beta", 2)
