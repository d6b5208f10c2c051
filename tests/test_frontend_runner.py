"""Admission (backpressure) in the job runner: per tenant and over all tenants."""
import pytest

from cluster.jobs.store import JobStore
from cluster.jobs.admission import Overloaded
from cluster.jobs.runner import JobRunner, RunnerLimits
from router.kv.key import Namespace


def test_admit_limits_per_tenant_and_in_total(tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite3", lambda: 0)
    runner = JobRunner(store, None, None,
                       RunnerLimits(max_concurrent=2, max_pending_per_tenant=5,
                                    max_pending_total=8, request_timeout_s=10.0),
                       namespace=lambda t: Namespace(t, "m"), block_size=16)
    runner.admit("a", 5)          # exactly the tenant's limit
    with pytest.raises(Overloaded, match=r"^requests: tenant 'a' has 5 requests pending and the "
                                         r"limit is 5; wait for jobs to finish and retry$"):
        runner.admit("a", 1)
    runner.admit("b", 3)          # exactly the cluster's limit
    assert runner.pending() == {"a": 5, "b": 3}
    with pytest.raises(Overloaded, match=r"^requests: the cluster has 8 requests pending and "
                                         r"the limit is 8; retry later$"):
        runner.admit("c", 1)
    assert runner.pending() == {"a": 5, "b": 3}   # a refused admission counts nothing
    runner.release("a", 2)
    runner.admit("c", 2)
    assert runner.pending() == {"a": 3, "b": 3, "c": 2}
    runner.release("c", 2)        # down to zero: the tenant is gone from the counts
    assert runner.pending() == {"a": 3, "b": 3}
    with pytest.raises(RuntimeError, match=r"^pending count for 'b' went negative \(-1\)$"):
        runner.release("b", 4)
    runner.release("z", 0)        # nothing pending, nothing released: no count appears
    assert runner.pending() == {"a": 3, "b": 3}
    with pytest.raises(RuntimeError, match=r"^pending count for 'z' went negative \(-1\)$"):
        runner.release("z", 1)
    store.close()
