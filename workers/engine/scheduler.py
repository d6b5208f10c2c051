"""What the engine runs next: admission order and each step's prefill budget.

**Admission.** Each tenant has a deque of its queued requests, oldest first; tenants take
turns (round robin), so one tenant's 1,000-request job adds one request per turn and another
tenant's single Generate waits behind at most one request of each busy tenant, never behind
the whole job::

    tenant a: a1 a2 a3 ... a1000        admitted: a1 b1 c1 a2 c2 a3 a4 ...
    tenant b: b1
    tenant c: c1 c2

**Priority.** Interactive requests (``workers.messages.Priority``) have a lane of their own,
served before the batch lane (round robin by tenant within each), and a prompt in prefill is
handed budget interactive first (``interactive_first``): a batch job's queued requests never
go in ahead of an interactive one, and its prompts in prefill delay an interactive prompt by
at most the step already under way, one step's prefill budget. Nothing is preempted; so that
a batch full of batch decodes never makes a person wait for one of them to end, batch requests
take at most ``max_batch - 1`` seats (``pop_seated``): the last seat is an interactive
request's, at the cost of one decode in ``max_batch`` for a job that runs alone (one in 32 by
default). The cluster's slots, granted interactive first too (``cluster.jobs.slots``), decide
how many requests reach the engine::

    queued: batch b1 b2 b3, then interactive i1      admitted: i1 b1 b2 b3
    in prefill: b1 (400 tokens left), i1 (30)        step budget 64: i1 30, b1 34

**Budget.** A step decodes one token for every running request and then prefills at most
``budget`` prompt tokens, handed to the prefilling requests oldest first (the oldest takes
what it still needs, the next one the rest, ...): a request never waits for a younger one,
and a long prompt is cut into chunks so that running decodes wait for one chunk per step,
never for the whole prompt.

With nothing decoding, the budget is ``max_tokens`` (512 by default: on the 30-layer
SmolLM2-135M on a shared 2-core CPU, passes of 16 to 512 tokens all ran at 20-26 tokens/s,
so cutting a prompt into chunks costs little). While requests decode, the budget is what fits
in ``stall - 1`` decode steps at the measured prefill rate, so a step with prefill takes about
``stall`` times a step without. ``stall`` is 1.8 by default, below the 2.0 that the p99 of a
decode's token interval may reach while a long prompt is admitted: the aim is the typical
step, and the margin is for the spread of step times around it. What a step with prefill can
cost at least: on SmolLM2-135M (one BLAS thread, CPU time) a pass of the model body costs
0.10 s for 1 token, 0.12 s for 4, 0.29 s for 16 and 0.88 s for 64 (about 0.08 s fixed, every
weight read once, plus 0.0125 s a token), against 0.18 s for a decode step of 4 requests;
so 1.8 leaves a chunk of about 5 tokens, 2.0 about 8. A fixed 512-token budget would
not do on a CPU: there a 512-token chunk takes as long as about 30 decode steps of 4
requests (26 s against 0.8 s, same machine), a 30-fold stall. Both rates are moving averages
of what the engine measured (``workers.rates``), in seconds passed in by the caller, never read
here. The budget's prefill rate is taken only from passes that ran beside decodes: a pass
costs a fixed part plus a part per token, so the rate of a 512-token pass alone overstates
what a few tokens beside decodes achieve. Fed by such passes, the first steps of a long
prompt overshot (SmolLM2-135M, 4 decodes: 2.6 decode steps' CPU time for the first admitting
step against 2.0 for the others, the first setting the p99). The engine times the two parts
of a step apart (its decode batch, ``workers.engine.decode``, hands out a step's tokens only
once the step has run, so the prefill pass after it is timed alone), else each would be
charged for the other. With speculation on, a decode step may be a verify pass (several
tokens a row, ``workers.engine.draft``): its time is the decode step the budget is bounded
against, since it is the step a running request waits beside a chunk. The budget never
falls below ``min_tokens`` (4), so a long prompt still advances when decodes are slow.

**Batch jobs.** The stall bound is for people waiting on a stream. A batch job's requests
(``GenerateRequest.batch``) are judged by the job's wall time, and at about 5 tokens a step
beside decodes a job that keeps 8 requests decoding admits its prompts a few tokens a step:
48 chats sharing two system prompts took 576 s against mlx_lm.server's 454 s (which prefills
8 whole prompts while its decodes wait). So the bound applies only while an interactive
request decodes (the engine passes ``decoding`` as "an interactive request is decoding"); a
step whose running decodes are all batch requests prefills the whole ``max_tokens``, and only
bounded passes feed the rate the bound is computed from. The
rate over every pass (``prefill_tokens_s``) is the unit the router counts a disk hit's load
time in (``router.policy``).
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable, Generic, Hashable, Iterable, Iterator, Protocol, TypeVar

from workers.messages import Priority
from workers.rates import moving_average

T = TypeVar("T")
LANES = (Priority.INTERACTIVE, Priority.BATCH)  # admission and prefill order


class Admission(Generic[T]):
    """Queued items in two lanes, interactive before batch; within a lane, tenants round
    robin, oldest first within one. A batch item is popped only when no interactive item
    waits."""

    def __init__(self) -> None:
        self._lanes: dict[Priority, OrderedDict[str, deque[tuple[str, T]]]] = {
            p: OrderedDict() for p in LANES}

    def push(self, tenant: str, key: str, item: T,
             priority: Priority = Priority.INTERACTIVE) -> None:
        self._lanes[priority].setdefault(tenant, deque()).append((key, item))

    def pop(self) -> T | None:
        """The next tenant's oldest item of the first lane that has one; that tenant moves to
        the back of its lane's turn order."""
        tenants = next((lane for lane in self._lanes.values() if lane), None)
        return None if tenants is None else self._pop_from(tenants)

    def pop_seated(self, used: int, seats: int) -> T | None:
        """``pop``, for a batch of ``seats`` of which ``used`` are taken: an interactive item
        while a seat is free, a batch item only while another seat stays free after it (the
        one kept for an interactive request; all of them when there is one seat)."""
        for priority, tenants in self._lanes.items():
            limit = seats if priority is Priority.INTERACTIVE or seats == 1 else seats - 1
            if tenants and used < limit:
                return self._pop_from(tenants)
        return None

    def _pop_from(self, tenants: OrderedDict[str, deque[tuple[str, T]]]) -> T:
        tenant, queue = next(iter(tenants.items()))
        _, item = queue.popleft()
        if queue:
            tenants.move_to_end(tenant)
        else:
            del tenants[tenant]
        return item

    def remove(self, key: str) -> bool:
        for tenants in self._lanes.values():
            for tenant, queue in tenants.items():
                for i, (k, _) in enumerate(queue):
                    if k == key:
                        del queue[i]
                        if not queue:
                            del tenants[tenant]
                        return True
        return False

    def keys(self) -> Iterator[str]:
        for tenants in self._lanes.values():
            for queue in tenants.values():
                yield from (k for k, _ in queue)

    def __len__(self) -> int:
        return sum(len(q) for tenants in self._lanes.values() for q in tenants.values())


def split_budget(needs: list[int], budget: int) -> list[int]:
    """Tokens per request for one step: oldest first, each takes what it needs of the rest."""
    if budget < 0 or any(n < 0 for n in needs):
        raise ValueError(f"budget and needs must be >= 0, got {budget} and {needs}")
    shares = []
    for need in needs:
        take = min(need, budget)
        shares.append(take)
        budget -= take
    return shares


class StepJob(Protocol):
    """A prompt being prefilled, as ``this_step`` sees it."""

    @property
    def first_block(self) -> Hashable | None: ...  # what a job sharing its first block shares

    @property
    def need(self) -> int: ...  # prompt tokens it still has to compute


J = TypeVar("J", bound=StepJob)


def this_step(jobs: Iterable[J], budget: int, reach: Callable[[J], None] | None = None
              ) -> list[J]:
    """The jobs that get budget this step, oldest first, until the budget is spent.

    A job that starts with the same block as an older job still in prefill waits for it: taken
    up after the older one has stored its prompt, it reuses that prompt's blocks instead of
    computing them again alongside. ``reach`` sees each job as it is taken, before its need is
    read (the engine looks its prompt up in the store then). The engine and the simulator's
    step model (``router.sim.steps``) both choose with this function.
    """
    chosen: list[J] = []
    ahead: set[Hashable] = set()
    for job in jobs:
        if budget <= 0:
            break
        if job.first_block is not None:
            if job.first_block in ahead:
                continue
            ahead.add(job.first_block)
        if reach is not None:
            reach(job)
        chosen.append(job)
        budget -= job.need
    return chosen


def interactive_first(jobs: Iterable[J], priority: Callable[[J], Priority]) -> list[J]:
    """``jobs`` (oldest first) with the interactive ones ahead, each lane keeping its order:
    the order ``this_step`` hands the prefill budget out in, so a batch prompt in prefill
    takes only what an interactive prompt leaves of a step's budget."""
    return sorted(jobs, key=lambda job: LANES.index(priority(job)))


@dataclass(slots=True)
class StepBudget:
    """Prefill tokens per step: ``max_tokens`` alone, bounded by the decode stall otherwise."""

    max_tokens: int = 512
    stall: float = 1.8
    min_tokens: int = 4
    _decode_s: float = 0.0        # moving average of one decode step
    _prefill_tok_s: float = 0.0   # moving average of prefill tokens per second, every pass
    _beside_tok_s: float = 0.0    # the same over passes beside decodes (the budget's)

    def __post_init__(self) -> None:
        if self.max_tokens < 1 or not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"need 1 <= min_tokens <= max_tokens, got {self.min_tokens} "
                             f"and {self.max_tokens}")
        if self.stall <= 1.0:
            raise ValueError(f"stall must be > 1.0 (a step with prefill takes at most that "
                             f"many decode steps), got {self.stall}")

    def tokens(self, decoding: bool) -> int:
        if not decoding:
            return self.max_tokens
        if not (self._decode_s and self._beside_tok_s):
            return self.min_tokens  # nothing measured beside decodes yet: the smallest step
        fits = int((self.stall - 1.0) * self._decode_s * self._beside_tok_s)
        return max(self.min_tokens, min(self.max_tokens, fits))

    @property
    def prefill_tokens_s(self) -> float | None:
        """The measured prefill rate (moving average), None before the first prefill."""
        return self._prefill_tok_s or None

    def observe_decode(self, seconds: float) -> None:
        self._decode_s = moving_average(self._decode_s, seconds)

    def observe_prefill(self, tokens: int, seconds: float, decoding: bool) -> None:
        """A prefill pass of ``tokens`` took ``seconds``; the budget counts only passes
        beside decodes, ``prefill_tokens_s`` every pass."""
        if tokens > 0 and seconds > 0:
            self._prefill_tok_s = moving_average(self._prefill_tok_s, tokens / seconds)
            if decoding:
                self._beside_tok_s = moving_average(self._beside_tok_s, tokens / seconds)

