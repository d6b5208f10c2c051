"""Concurrency slots: never lost on cancel, shared fairly between tenants and with Generate.

The runner and the slot pool are the real ones; the backend is a gate that holds every request
until the test opens it, so the test can count how many run at once.
"""
import asyncio

import pytest

from tests.support.bounded import run_bounded

from cluster.jobs.runner import JobRunner, RunnerLimits
from cluster.jobs.slots import SlotPool
from cluster.telemetry.metrics import SlotGauges
from workers.messages import Priority
from cluster.jobs.store import JobStore, NewRequest, StagedRequest
from router.kv.key import Namespace
from workers.messages import SamplingParams


class GateBackend:
    """Holds every ``generate`` call open, counting the calls in flight, and every direct
    request's stream."""

    def __init__(self):
        self.running: dict[str, int] = {}  # tenant -> calls in flight
        self.opened = asyncio.Event()
        self.held: list[asyncio.Event] = []  # one per direct request streaming now

    def total(self) -> int:
        return sum(self.running.values())

    async def generate(self, request, block_hashes):
        tenant = request.namespace.tenant
        self.running[tenant] = self.running.get(tenant, 0) + 1
        try:
            await self.opened.wait()
        finally:
            self.running[tenant] -= 1
        raise ValueError("the gate backend produces no results")

    async def stream(self, request, block_hashes):
        """A direct request (``runner.direct``): held until the test sets its event."""
        done = asyncio.Event()
        self.held.append(done)
        await done.wait()
        raise ValueError("the gate backend produces no results")
        yield  # an async generator


def _requests(n: int) -> list[StagedRequest]:
    return [StagedRequest(i, f"r{i}", b"", b"") for i in range(n)]


def _prepare(body: bytes) -> NewRequest:  # every stored request runs as the same prompt
    return NewRequest(custom_id="", prompt=(1, 2, 3), sampling=SamplingParams(max_tokens=1))


def _runner(tmp_path, backend, max_concurrent: int) -> tuple[JobStore, JobRunner]:
    store = JobStore(tmp_path / "jobs.sqlite3", lambda: 0)
    runner = JobRunner(store, backend, _prepare,
                       RunnerLimits(max_concurrent, max_pending_per_tenant=10_000,
                                    max_pending_total=10_000, request_timeout_s=60.0),
                       namespace=lambda t: Namespace(t, "m"), block_size=16)
    return store, runner


def _submit(store: JobStore, runner: JobRunner, tenant: str, n: int):
    runner.admit(tenant, n)
    job = store.create_job(tenant, "m", _requests(n))
    runner.launch(job)
    return job


async def _until(predicate, timeout_s: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)


def test_300_submit_and_cancel_cycles_leave_all_8_slots(tmp_path):
    async def main() -> None:
        backend = GateBackend()
        store, runner = _runner(tmp_path, backend, max_concurrent=8)
        for cycle in range(300):
            job = _submit(store, runner, "acme", 3)
            for _ in range(cycle % 3):  # cancel before the job starts, or between its steps
                await asyncio.sleep(0)
            runner.cancel(job.job_id, "acme")
        await _until(lambda: runner.slots_in_use() == {})
        _submit(store, runner, "acme", 8)
        await _until(lambda: backend.total() == 8)
        assert runner.slots_in_use() == {"acme": 8}
        await runner.close()
        store.close()

    run_bounded(main(), 60, "300 submit and cancel cycles leave all 8 slots")


def test_a_generate_flood_gets_its_share_of_the_slots_and_no_more(tmp_path):
    async def main() -> None:
        backend = GateBackend()
        store, runner = _runner(tmp_path, backend, max_concurrent=4)

        async def generate_call() -> None:  # what a Generate call runs: a direct request
            with pytest.raises(ValueError):
                async for _ in runner.direct.stream("flood", _prepare(b"")):
                    pass

        flood = [asyncio.create_task(generate_call()) for _ in range(20)]
        await _until(lambda: runner.slots_in_use() == {"flood": 4} and len(backend.held) == 4)
        _submit(store, runner, "acme", 4)  # waits: the flood holds every slot
        await _until(lambda: runner.slot_gauges()["batch"].waiting == 1)
        assert backend.total() == 0
        # the first slot the flood frees goes to acme's batch job, owed a quarter of the
        # slots (1 of 4) while it waits; the next ones to the flood's interactive requests
        backend.held.pop(0).set()
        await _until(lambda: backend.running == {"acme": 1})
        for _ in range(2):
            backend.held.pop(0).set()
        await _until(lambda: runner.slots_in_use() == {"acme": 1, "flood": 3}
                     and len(backend.held) == 3)
        assert backend.running == {"acme": 1}
        # 20 Generate calls: 3 ended, 3 running, 14 waiting; the job asks for one at a time
        assert runner.slot_gauges() == {"interactive": SlotGauges(3, 14),
                                        "batch": SlotGauges(1, 1)}
        for task in flood:
            task.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
        await _until(lambda: backend.total() == 4)
        assert runner.slots_in_use() == {"acme": 4}
        await runner.close()
        store.close()

    run_bounded(main(), 60, "a generate flood gets its share of the slots and no more")


def test_a_freed_slot_goes_to_the_tenant_holding_fewest():
    async def main() -> None:
        pool = SlotPool(2)
        await pool.acquire("a")
        await pool.acquire("a")
        order: list[str] = []

        async def take(tenant: str) -> None:
            await pool.acquire(tenant)
            order.append(tenant)

        waiters = [asyncio.create_task(take(t)) for t in ("a", "a", "b")]
        await asyncio.sleep(0)
        pool.release("a")  # b holds none, a holds one: b first, though a asked first
        await asyncio.sleep(0)
        assert order == ["b"] and pool.held() == {"a": 1, "b": 1}
        pool.release("b")
        await asyncio.sleep(0)
        assert order == ["b", "a"] and pool.held() == {"a": 2}
        waiters[1].cancel()  # a waiter cancelled while waiting takes nothing
        await asyncio.gather(*waiters, return_exceptions=True)
        pool.release("a")
        pool.release("a")
        assert pool.held() == {} and pool.in_use() == 0

    run_bounded(main(), 60, "a freed slot goes to the tenant holding fewest")


def test_a_freed_slot_goes_to_an_interactive_waiter_before_older_batch_waiters():
    async def main() -> None:
        pool = SlotPool(4)  # a batch floor of 1, which the job's second slot keeps met
        for tenant, priority in (("jobs", Priority.BATCH), ("jobs", Priority.BATCH),
                                 ("people", Priority.INTERACTIVE),
                                 ("people", Priority.INTERACTIVE)):
            await pool.acquire(tenant, priority)
        order: list[str] = []

        async def take(name: str, tenant: str, priority: Priority) -> None:
            await pool.acquire(tenant, priority)
            order.append(name)

        waiters = [asyncio.create_task(take(*w)) for w in (
            ("b1", "jobs", Priority.BATCH), ("b2", "other", Priority.BATCH),
            ("i1", "people", Priority.INTERACTIVE))]
        await asyncio.sleep(0)
        assert (pool.waiting(Priority.BATCH), pool.waiting(Priority.INTERACTIVE)) == (2, 1)
        for held, priority in (("jobs", Priority.BATCH), ("people", Priority.INTERACTIVE),
                               ("people", Priority.INTERACTIVE)):
            pool.release(held, priority)
            await asyncio.sleep(0)
        # b2's tenant holds fewer slots than b1's: fairness within the lane
        assert order == ["i1", "b2", "b1"]
        assert pool.held() == {"jobs": 2, "people": 1, "other": 1}
        await asyncio.gather(*waiters)

    run_bounded(main(), 60, "interactive waiters first")


def test_waiting_batch_requests_below_their_floor_take_a_freed_slot_first():
    async def main() -> None:
        pool = SlotPool(4)  # floor: 1 batch slot
        for _ in range(4):
            await pool.acquire("people")
        order: list[str] = []

        async def take(name: str, priority: Priority) -> None:
            await pool.acquire(name[0], priority)
            order.append(name)

        waiters = [asyncio.create_task(take(n, p)) for n, p in (
            ("i5", Priority.INTERACTIVE), ("b1", Priority.BATCH), ("b2", Priority.BATCH),
            ("i6", Priority.INTERACTIVE))]
        await asyncio.sleep(0)
        for _ in range(3):
            pool.release("people")
            await asyncio.sleep(0)
        assert order == ["b1", "i5", "i6"]
        pool.release("b", Priority.BATCH)
        await asyncio.sleep(0)
        assert order == ["b1", "i5", "i6", "b2"]
        await asyncio.gather(*waiters)

    run_bounded(main(), 60, "the batch floor")


def test_a_waiter_cancelled_after_its_grant_passes_the_slot_on():
    async def main() -> None:
        pool = SlotPool(1)
        await pool.acquire("a")
        first = asyncio.create_task(pool.acquire("b"))
        second = asyncio.create_task(pool.acquire("c"))
        await asyncio.sleep(0)
        pool.release("a")  # granted to b ...
        first.cancel()     # ... which is cancelled before it resumes: c gets the slot
        await asyncio.gather(first, return_exceptions=True)
        await second
        assert pool.held() == {"c": 1}

    run_bounded(main(), 60, "a waiter cancelled after its grant passes the slot on")


def test_a_pool_needs_a_slot():
    with pytest.raises(ValueError, match="max_concurrent must be >= 1"):
        SlotPool(0)


def test_interactive_requests_take_turns_on_the_slots_less_the_batch_floor_batch_waits_for():
    async def main() -> None:
        pool = SlotPool(8)  # floor: 2 batch slots
        assert pool.for_interactive() == 8
        for _ in range(3):
            await pool.acquire("jobs", Priority.BATCH)
        assert pool.for_interactive() == 8  # no batch request waits: every slot comes back
        for _ in range(5):
            await pool.acquire("people")
        waiter = asyncio.create_task(pool.acquire("jobs", Priority.BATCH))
        await asyncio.sleep(0)
        assert pool.for_interactive() == 6  # 2 of batch's 3 go back to batch when freed
        assert (pool.held_by(Priority.BATCH), pool.held_by(Priority.INTERACTIVE)) == (3, 5)
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)

    run_bounded(main(), 60, "the slots interactive requests take turns on")


class LaneBackend(GateBackend):
    """A gate that also records the lane each job request reached the engine in."""

    def __init__(self):
        super().__init__()
        self.lanes: dict[str, set[bool]] = {}   # tenant -> GenerateRequest.batch seen

    async def generate(self, request, block_hashes):
        self.lanes.setdefault(request.namespace.tenant, set()).add(request.batch)
        return await super().generate(request, block_hashes)


def test_an_interactive_jobs_requests_take_the_interactive_lane_a_batch_jobs_the_batch_one(
        tmp_path):
    """4 slots, all held by Generate calls; a batch job (acme) and an interactive job (bob)
    wait, one request each at a time. The freed slots: the first to acme (batch is owed 1 of
    4 while it waits), the next three to bob's interactive requests, none more to acme. Each
    job's requests reach the engine in its lane (``GenerateRequest.batch``)."""
    async def main() -> None:
        backend = LaneBackend()
        store, runner = _runner(tmp_path, backend, max_concurrent=4)

        async def generate_call() -> None:
            with pytest.raises(ValueError):
                async for _ in runner.direct.stream("flood", _prepare(b"")):
                    pass

        flood = [asyncio.create_task(generate_call()) for _ in range(4)]
        await _until(lambda: len(backend.held) == 4)
        runner.admit("acme", 4)
        runner.launch(store.create_job("acme", "m", _requests(4)))
        runner.admit("bob", 4)
        interactive = store.create_job("bob", "m", _requests(4), Priority.INTERACTIVE)
        runner.launch(interactive)
        await _until(lambda: runner.slot_gauges() == {"interactive": SlotGauges(4, 1),
                                                      "batch": SlotGauges(0, 1)})
        granted = []
        for freed in range(1, 5):   # one at a time, each job waiting again before the next
            backend.held.pop(0).set()
            await _until(lambda: backend.total() == freed and all(
                g.waiting == 1 for g in runner.slot_gauges().values()))
            granted.append(dict(backend.running))
        assert granted == [{"acme": 1}, {"acme": 1, "bob": 1}, {"acme": 1, "bob": 2},
                           {"acme": 1, "bob": 3}]
        assert runner.slot_gauges() == {"interactive": SlotGauges(3, 1),
                                        "batch": SlotGauges(1, 1)}
        assert backend.lanes == {"acme": {True}, "bob": {False}}
        assert interactive.priority is Priority.INTERACTIVE
        await asyncio.gather(*flood)
        await runner.close()
        store.close()

    run_bounded(main(), 60, "each job's requests in its own lane")
