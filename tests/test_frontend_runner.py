"""Admission (backpressure) in the job runner: per tenant and over all tenants."""
import pytest

from cluster.jobs.store import JobStore
from cluster.jobs.runner import JobRunner, Overloaded, RunnerLimits
from router.key import Namespace


def test_admit_limits_per_tenant_and_in_total(tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite3", lambda: 0)
    runner = JobRunner(store, None, None,
                       RunnerLimits(max_concurrent=2, max_pending_per_tenant=5,
                                    max_pending_total=8, request_timeout_s=10.0),
                       namespace=lambda t: Namespace(t, "m"), block_size=16)
    runner.admit("a", 5)
    with pytest.raises(Overloaded, match="tenant 'a' has 5 requests pending"):
        runner.admit("a", 1)
    runner.admit("b", 3)
    with pytest.raises(Overloaded, match="cluster has 8 requests pending"):
        runner.admit("c", 1)
    runner.release("a", 2)
    runner.admit("c", 2)
    with pytest.raises(RuntimeError, match="negative"):
        runner.release("b", 4)
    store.close()
